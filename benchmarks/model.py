"""The course's benchmark contract: `make bench` runs this file and writes bench.json.

Side by side in one process, on the same inputs (warm-up, several interleaved repeats, the
median), it measures:

- train_step_ratio_fast: one training step (forward, loss, backward, gradient clipping, Adam)
  of the course model on its fast path (notebook 14) over nn.Transformer holding the same
  weights (transformer_from_scratch.reference.TorchTransformer), both eager, in training mode;
  the worst ratio over the batch shapes (64x8 and 16x128) and thread counts (1 and 2);
- train_step_ratio_scratch: the same for the from-scratch model;
- kv_cache_speedup_512: greedy decoding of 512 new tokens, without / with the KV cache;
- tiled_memory_ratio_8192: peak memory of tiled / naive attention at T = 8192 (one head, d_k 64);
- mfu: model FLOPs utilisation of the fast path's training step, with fused Adam (batch 64x8,
  one thread): FLOPs counted by FlopCounterMode / median step time / the float32 matmul peak
  timed in turns with it (the same with plain Adam is in mfu_detail);
- attention: notebook 02's attention benchmark (benchmarks/attention.py);
- device, torch, threads: what it ran on.

    python benchmarks/model.py --out bench.json
    python benchmarks/model.py --threads 1 --shapes 64x8 --compile   # compiled step as well

It is not part of the installed package; tests/test_benchmarks_model.py runs it on tiny sizes.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch import nn

from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.decoding import KVCache
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.efficient import tiled_attention
from transformer_from_scratch.efficient import use_fast_path
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.measure import count_flops
from transformer_from_scratch.measure import peak_memory
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.reference import TorchTransformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.utils import get_device

VOCAB = 12  # the reversal task of notebook 11: PAD, BOS, EOS and 9 symbols
DEFAULT_SHAPES = ((64, 8), (16, 128))
DEFAULT_THREADS = (1, 2)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds of each fn, timed in turns (a, b, c, a, b, c, ...) so drift hits all alike."""
    check_int("repeats", repeats, 1)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def reversal_batch(
    batch: int, src_len: int, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Random sources (B, S) and their reversals as tgt_in [BOS, ...] and tgt_out [..., EOS]."""
    check_int("batch", batch, 1)
    check_int("src_len", src_len, 1)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS + 1, VOCAB, (batch, src_len), generator=gen)
    rev = src.flip(1)
    tgt_in = torch.cat([torch.full((batch, 1), BOS), rev], dim=1)
    tgt_out = torch.cat([rev, torch.full((batch, 1), EOS)], dim=1)
    return src.to(device), tgt_in.to(device), tgt_out.to(device)


def make_train_step(
    model: nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, fused: bool = False
) -> Callable[[], Tensor]:
    """A closure: one training step (forward, loss, backward, clip, Adam); returns the loss.

    fused=True uses Adam's fused implementation (one kernel per tensor group; CPU: torch >= 2.4).
    """
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused
    )
    tgt_mask = causal_mask(tgt_in.size(1), device=tgt_in.device)  # (1, 1, T, T)

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        logits = model(src, tgt_in, tgt_mask=tgt_mask)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    return step


def three_models(
    device: torch.device, seed: int = 0, model_kwargs: dict | None = None
) -> dict[str, nn.Module]:
    """The from-scratch model, its fast path and nn.Transformer, all with the same weights."""
    torch.manual_seed(seed)
    scratch = Transformer(VOCAB, VOCAB, **(model_kwargs or {})).to(device).train()
    torch_model = TorchTransformer(scratch).to(device).train()
    fast = use_fast_path(copy.deepcopy(scratch)).train()
    return {"scratch": scratch, "fast": fast, "torch": torch_model}


def compare_train_step(
    batch: int,
    src_len: int,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
) -> dict:
    """Median training-step time of the three models, and the ratios to nn.Transformer."""
    device = torch.device(device) if device is not None else get_device()
    models = three_models(device, model_kwargs=model_kwargs)
    data = reversal_batch(batch, src_len, device)
    steps = {name: make_train_step(m, *data) for name, m in models.items()}
    t = interleaved_medians(steps, device, repeats)
    return {
        "batch": batch,
        "src_len": src_len,
        "threads": torch.get_num_threads(),
        **{f"{name}_s": seconds for name, seconds in t.items()},
        "fast_over_torch": t["fast"] / t["torch"],
        "scratch_over_torch": t["scratch"] / t["torch"],
    }


def compare_compiled_step(
    batch: int,
    src_len: int,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
) -> dict:
    """torch.compile'd training steps: the fast path against nn.Transformer, both compiled."""
    device = torch.device(device) if device is not None else get_device()
    models = three_models(device, model_kwargs=model_kwargs)
    data = reversal_batch(batch, src_len, device)
    row: dict = {"batch": batch, "src_len": src_len, "threads": torch.get_num_threads()}
    steps = {}
    for name in ("fast", "torch"):
        step = make_train_step(torch.compile(models[name]), *data)
        start = time.perf_counter()
        step()  # compiles the forward and the backward
        step()
        row[f"{name}_compile_s"] = time.perf_counter() - start
        steps[f"{name}_compiled"] = step
    eager = TorchTransformer(models["scratch"]).train()  # a fresh, uncompiled reference point
    steps["torch_eager"] = make_train_step(eager, *data)
    t = interleaved_medians(steps, device, repeats)
    row.update({f"{name}_s": seconds for name, seconds in t.items()})
    row["compiled_fast_over_compiled_torch"] = t["fast_compiled"] / t["torch_compiled"]
    row["compiled_fast_over_eager_torch"] = t["fast_compiled"] / t["torch_eager"]
    return row


def never_ending(model: Transformer) -> Transformer:
    """A copy of model that never emits EOS: decoding always runs its full length."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.out_proj.bias[EOS] = -math.inf
    return copied


def kv_cache_speedup(
    new_tokens: int = 512,
    repeats: int = 3,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
) -> dict:
    """Greedy decoding of one source: median time without and with the KV cache (same tokens)."""
    check_int("new_tokens", new_tokens, 1)
    device = torch.device(device) if device is not None else get_device()
    torch.manual_seed(0)
    model = never_ending(Transformer(VOCAB, VOCAB, **(model_kwargs or {}))).to(device).eval()
    src, _, _ = reversal_batch(1, 8, device)
    cached = greedy_decode(model, src, new_tokens, cache=KVCache())
    if not torch.equal(cached, greedy_decode(model, src, new_tokens)):
        raise RuntimeError(f"the cache changed the tokens at {new_tokens} new tokens")
    t = interleaved_medians(
        {
            "uncached": lambda: greedy_decode(model, src, new_tokens),
            "cached": lambda: greedy_decode(model, src, new_tokens, cache=KVCache()),
        },
        device,
        repeats,
        warmup=1,
    )
    return {
        "new_tokens": new_tokens,
        "uncached_s": t["uncached"],
        "cached_s": t["cached"],
        "speedup": t["uncached"] / t["cached"],
    }


def tiled_memory(T: int = 8192, d_k: int = 64, device: torch.device | str | None = None) -> dict:
    """Peak memory of one forward pass, naive (notebook 02) against tiled (notebook 14)."""
    check_int("T", T, 1)
    device = torch.device(device) if device is not None else get_device()
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 1, T, d_k, generator=gen).to(device) for _ in range(3))
    with torch.no_grad():
        naive = peak_memory(lambda: scaled_dot_product_attention(Q, K, V)[0], device)
        tiled = peak_memory(lambda: tiled_attention(Q, K, V), device)
    return {"T": T, "naive_bytes": naive, "tiled_bytes": tiled, "ratio": tiled / naive}


def model_flops_utilisation(
    batch: int = 64,
    src_len: int = 8,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
    peak_size: int = 1024,
) -> dict:
    """MFU of the fast path's training step: counted FLOPs / median step time / matmul peak.

    The fast path's step uses fused Adam; the step with plain Adam is timed as well. The steps
    and the (peak_size x peak_size) float32 matmul that defines the peak are timed in turns,
    so that a slower or faster spell of the machine moves both sides alike."""
    check_int("peak_size", peak_size, 1)
    device = torch.device(device) if device is not None else get_device()
    fast = three_models(device, model_kwargs=model_kwargs)["fast"]
    data = reversal_batch(batch, src_len, device)
    flops = count_flops(make_train_step(copy.deepcopy(fast), *data))
    A = torch.randn(peak_size, peak_size, generator=torch.Generator().manual_seed(0)).to(device)
    t = interleaved_medians(
        {
            "fused": make_train_step(copy.deepcopy(fast), *data, fused=True),
            "plain": make_train_step(fast, *data),
            "matmul": lambda: A @ A,
        },
        device,
        repeats,
    )
    peak = 2 * peak_size**3 / t["matmul"]
    return {
        "batch": batch,
        "src_len": src_len,
        "threads": torch.get_num_threads(),
        "flops_per_step": flops,
        "step_s": t["fused"],
        "step_s_plain_adam": t["plain"],
        "achieved_flops": flops / t["fused"],
        "peak_flops": peak,
        "mfu": flops / t["fused"] / peak,
        "mfu_plain_adam": flops / t["plain"] / peak,
    }


def _with_threads(threads: int | None, fn: Callable[[], object]):
    """fn() with torch's CPU thread count set to `threads` (None: unchanged)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, 1))
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def _attention_benchmark():
    """benchmarks/attention.py, the benchmark of notebook 02, loaded from its file."""
    path = Path(__file__).resolve().parent / "attention.py"
    spec = importlib.util.spec_from_file_location("benchmarks_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(
    shapes=DEFAULT_SHAPES,
    threads=DEFAULT_THREADS,
    repeats: int = 11,
    decode_tokens: int = 512,
    decode_repeats: int = 3,
    tiled_T: int = 8192,
    attention_T=(64, 128, 256, 512, 1024, 2048),
    compile_step: bool = False,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
    peak_size: int = 1024,
) -> dict:
    """Every benchmark, in one process: the contract's keys, then the rows they come from."""
    device = torch.device(device) if device is not None else get_device()
    threads = list(threads)
    if not threads or not shapes:
        raise ValueError("need at least one thread count and one batch shape")
    kw = {"device": device, "model_kwargs": model_kwargs}
    train = [
        _with_threads(n, lambda b=b, s=s: compare_train_step(b, s, repeats, **kw))
        for n in threads
        for b, s in shapes
    ]
    first = threads[0]
    decode = _with_threads(first, lambda: kv_cache_speedup(decode_tokens, decode_repeats, **kw))
    memory = tiled_memory(tiled_T, device=device)
    b0, s0 = shapes[0]
    mfu = _with_threads(
        first, lambda: model_flops_utilisation(b0, s0, repeats, peak_size=peak_size, **kw)
    )
    result = {
        "train_step_ratio_fast": max(r["fast_over_torch"] for r in train),
        "train_step_ratio_scratch": max(r["scratch_over_torch"] for r in train),
        f"kv_cache_speedup_{decode_tokens}": decode["speedup"],
        f"tiled_memory_ratio_{tiled_T}": memory["ratio"],
        "mfu": mfu["mfu"],
        "device": str(device),
        "torch": torch.__version__,
        "threads": threads,
        "model": {"src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, **(model_kwargs or {})},
        "repeats": repeats,
        "train_step": train,
        "decode": decode,
        "tiled_memory": memory,
        "mfu_detail": mfu,
    }
    if attention_T:
        attention = _attention_benchmark()
        result["attention"] = attention.run_suite(
            attention_T, repeats=repeats, threads=first, device=device
        )
    if compile_step:
        result["compiled"] = [
            _with_threads(n, lambda b=b, s=s: compare_compiled_step(b, s, repeats, **kw))
            for n in threads
            for b, s in shapes
        ]
    return result


# The course's goals for these keys on its 2-core CPU (issue 11), printed beside the results:
# (comparison, value). Goals, not asserts: on another machine the ratios move.
TARGETS = {
    "train_step_ratio_fast": ("<=", 0.85),
    "tiled_memory_ratio_8192": ("<=", 0.125),
    "mfu": (">=", 0.55),
}


def target_status(key: str, value: float) -> str:
    """'target <= 0.85: met' (or 'MISSED'), or '' for a key without a target."""
    if key not in TARGETS:
        return ""
    op, goal = TARGETS[key]
    met = value <= goal if op == "<=" else value >= goal
    return f"target {op} {goal}: {'met' if met else 'MISSED'}"


def format_results(result: dict) -> str:
    """The results as plain-text tables: the contract's keys first."""
    lines = [
        f"torch {result['torch']} on {result['device']}, threads {result['threads']}, "
        f"median of {result['repeats']} interleaved runs",
        "",
        "training step (forward, loss, backward, clip, Adam), against nn.Transformer (eager):",
        f"{'threads':>7} {'batch':>6} {'S':>5} {'scratch ms':>11} {'fast ms':>9} {'torch ms':>9} "
        f"{'scratch/torch':>14} {'fast/torch':>11}",
    ]
    for r in result["train_step"]:
        lines.append(
            f"{r['threads']:>7} {r['batch']:>6} {r['src_len']:>5} {1e3 * r['scratch_s']:>11.2f} "
            f"{1e3 * r['fast_s']:>9.2f} {1e3 * r['torch_s']:>9.2f} "
            f"{r['scratch_over_torch']:>14.3f} {r['fast_over_torch']:>11.3f}"
        )
    for r in result.get("compiled", []):
        lines.append(
            f"compiled, {r['threads']} threads, {r['batch']}x{r['src_len']}: fast "
            f"{1e3 * r['fast_compiled_s']:.2f} ms (compile {r['fast_compile_s']:.0f} s), "
            f"nn.Transformer {1e3 * r['torch_compiled_s']:.2f} ms (compile "
            f"{r['torch_compile_s']:.0f} s), eager nn.Transformer {1e3 * r['torch_eager_s']:.2f} "
            f"ms; compiled fast / compiled torch {r['compiled_fast_over_compiled_torch']:.3f}, "
            f"/ eager torch {r['compiled_fast_over_eager_torch']:.3f}"
        )
    d, m, u = result["decode"], result["tiled_memory"], result["mfu_detail"]
    lines += [
        "",
        f"greedy decoding of {d['new_tokens']} tokens: {1e3 * d['uncached_s']:.0f} ms without the "
        f"KV cache, {1e3 * d['cached_s']:.0f} ms with: {d['speedup']:.1f}x",
        f"attention forward at T={m['T']}: naive {m['naive_bytes'] / 2**20:.1f} MiB, tiled "
        f"{m['tiled_bytes'] / 2**20:.2f} MiB: ratio {m['ratio']:.4f}",
        f"MFU at {u['batch']}x{u['src_len']}, {u['threads']} thread(s), fast path + fused Adam: "
        f"{u['flops_per_step'] / 1e9:.3f} GFLOP a step in {1e3 * u['step_s']:.1f} ms = "
        f"{u['achieved_flops'] / 1e9:.1f} GFLOP/s of a {u['peak_flops'] / 1e9:.1f} GFLOP/s "
        f"matmul peak: {u['mfu']:.3f} (plain Adam: {1e3 * u['step_s_plain_adam']:.1f} ms, "
        f"{u['mfu_plain_adam']:.3f})",
        "",
        "bench.json:",
    ]
    for key in (
        "train_step_ratio_fast",
        "train_step_ratio_scratch",
        *(k for k in result if k.startswith(("kv_cache_speedup_", "tiled_memory_ratio_"))),
        "mfu",
    ):
        lines.append(f"  {key:>26}: {result[key]:.4f}  {target_status(key, result[key])}".rstrip())
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    """'64x8' -> (64, 8): a batch size and a source length."""
    try:
        batch, src_len = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected BATCHxLENGTH such as 64x8, got {text!r}"
        ) from None
    return batch, src_len


def main(argv: list[str] | None = None) -> int:
    """Command line: run everything, print the tables, write the JSON to --out."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/model.py",
        description="The course's benchmarks side by side; writes bench.json (see the docstring).",
    )
    parser.add_argument("--shapes", type=_shape, nargs="+", default=list(DEFAULT_SHAPES),
                        help="training batches as BATCHxLENGTH (default: 64x8 16x128)")  # fmt: skip
    parser.add_argument("--threads", type=int, nargs="+", default=list(DEFAULT_THREADS),
                        help="CPU thread counts (default: 1 2)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=11, help="timed runs (the median is kept)")
    parser.add_argument("--decode-tokens", type=int, default=512, help="tokens to decode")
    parser.add_argument("--tiled-T", type=int, default=8192, help="length of the memory test")
    parser.add_argument("--no-attention", action="store_true", help="skip notebook 02's suite")
    parser.add_argument("--compile", action="store_true", help="time torch.compile'd steps too")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the best)")
    parser.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON file to write")
    args = parser.parse_args(argv)
    result = run_all(
        args.shapes,
        args.threads,
        args.repeats,
        decode_tokens=args.decode_tokens,
        tiled_T=args.tiled_T,
        attention_T=() if args.no_attention else (64, 128, 256, 512, 1024, 2048),
        compile_step=args.compile,
        device=args.device,
    )
    print(format_results(result))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
