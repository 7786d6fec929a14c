"""nanoGPT's CPU recipe on notebook 16's split, side by side with the course's GPT (notebook 16).

nanoGPT's README gives a recipe for a laptop's CPU (`shakespeare_char`, cut down):

    --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
    --lr_decay_iters=2000 --dropout=0.0   (and from its config: lr 1e-3, 100 warm-up
    iterations, cosine to 1e-4, beta2 0.99, weight decay 0.1 on matrices, clip 1.0)

"about 3 minutes ... a loss of only 1.88" on tiny Shakespeare. This script runs that recipe on
the held-out plays of notebook 16 (34 plays to train on, 4 to validate on), with nanoGPT's loop
(its learning-rate function, its optimizer groups, random windows) around a model nobody here
wrote: transformers' GPT2LMHeadModel, which is nanoGPT's architecture (GPT-2's), with exact GELU
as nanoGPT's; unlike nanoGPT's default it has biases (about 1 % more parameters). Then it trains
the course's GPT with notebook 16's recipe in the same process, so that the two clocks compare.

Every run records the training seconds so far (the updates' time, not the evaluations') and the
validation loss on windows spread over the held-out plays: nanoGPT's runs every `--eval-every`
iterations on 256 windows, the course's run as notebook 16 does (every 100 updates, on its
recipe's 64 windows); at the end, each the loss on the whole of them. Writes
tools/gpt_reference.json.

    python tools/gpt_reference.py                  # 1 thread, as tools/gpt_reference.json
    python tools/gpt_reference.py --iters 2000     # one reference run only
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.gpt import GPT
from transformer_from_scratch.gpt import CharTokenizer
from transformer_from_scratch.gpt import GPTConfig
from transformer_from_scratch.gpt import LMRecipe
from transformer_from_scratch.gpt import evaluate_lm
from transformer_from_scratch.gpt import load_plays
from transformer_from_scratch.gpt import split_plays
from transformer_from_scratch.gpt import train_lm

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tools" / "gpt_reference.json"
# notebook 16's CPU recipe and model (its RECIPES["cpu"], SIZES["cpu"]); tests/test_tools.py checks
# that the notebook trains what this file records
COURSE_RECIPE = dict(steps=1200, batch_size=16, context=128, lr=2e-3, eval_every=100)
COURSE_SIZE = dict(d_model=128, num_heads=4, num_layers=4, dropout_p=0.0, fast=True)


class Logits(nn.Module):
    """GPT2LMHeadModel's logits as a plain tensor, so that evaluate_lm can read it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens).logits


def nanogpt_lr(it: int, lr: float, warmup: int, decay_iters: int, min_lr: float) -> float:
    """nanoGPT's get_lr: linear warm-up, cosine decay to min_lr, then flat."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def nanogpt_run(train_ids, valid_ids, vocab_size: int, iters: int, eval_every: int) -> dict:
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    block, batch = 64, 12
    torch.manual_seed(1337)  # nanoGPT's seed
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=block, n_embd=128, n_layer=4, n_head=4,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
    evaluated = Logits(model)
    record = {"step": [], "seconds": [], "val_loss": []}
    seconds = 0.0
    for it in range(iters + 1):
        if it % eval_every == 0 or it == iters:
            record["step"].append(it)
            record["seconds"].append(seconds)
            record["val_loss"].append(evaluate_lm(evaluated, valid_ids, block, max_windows=256))
            model.train()
        if it == iters:
            break
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = nanogpt_lr(it, 1e-3, 100, iters, 1e-4)
        ix = torch.randint(len(train_ids) - block, (batch,))
        x = torch.stack([train_ids[i : i + block] for i in ix])
        y = torch.stack([train_ids[i + 1 : i + 1 + block] for i in ix])
        logits = model(x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
    record["full_val_loss"] = evaluate_lm(evaluated, valid_ids, block)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    record["tokens_per_step"] = block * batch
    return record


def course_run(train_ids, valid_ids, vocab_size: int) -> dict:
    recipe = LMRecipe(**COURSE_RECIPE)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, max_len=recipe.context, **COURSE_SIZE))
    history = train_lm(model, train_ids, valid_ids, recipe, progress=False)
    # evaluated as in the notebook: recipe.eval_windows (64) windows, not nanoGPT's runs' 256
    record = {k: history[k] for k in ("step", "seconds", "val_loss")}
    record["full_val_loss"] = evaluate_lm(model, valid_ids, recipe.context)
    record["parameters"] = sum(p.numel() for p in model.parameters())
    record["tokens_per_step"] = recipe.batch_size * recipe.context
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, nargs="+", default=[2000, 6000])
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-course", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train_text, valid_text = split_plays(load_plays())
    chars = CharTokenizer(train_text)
    train_ids, valid_ids = chars.encode(train_text), chars.encode(valid_text)
    result = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "threads": args.threads,
        "torch": torch.__version__,
        "vocab_size": chars.vocab_size,
        "runs": {},
    }
    for iters in args.iters:
        run = nanogpt_run(train_ids, valid_ids, chars.vocab_size, iters, args.eval_every)
        result["runs"][f"nanogpt_{iters}"] = run
        print(f"nanoGPT recipe, {iters} iterations: {run['seconds'][-1]:.0f} s, "
              f"held-out loss {run['full_val_loss']:.3f}", flush=True)  # fmt: skip
    if not args.skip_course:
        run = course_run(train_ids, valid_ids, chars.vocab_size)
        result["runs"]["course"] = run | {"recipe": COURSE_RECIPE, "size": COURSE_SIZE}
        print(
            f"course recipe: {run['seconds'][-1]:.0f} s, held-out loss {run['full_val_loss']:.3f}"
        )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
