"""The course's benchmark contract: `make bench` runs this file and writes bench.json.

Side by side in one process, on the same inputs (warm-up, several interleaved repeats, the
median), it measures:

- train_step_ratio_fast: one training step (forward, loss, backward, gradient clipping, Adam)
  of the course model on its fast path (notebook 14) over nn.Transformer holding the same
  weights and doing the same work (transformer_from_scratch.reference.TorchTransformer with the
  dropout inside each layer's feed-forward, `layer.dropout` between linear1 and linear2, replaced
  by nn.Identity: our feed-forward has none), both eager, in training mode; the worst ratio over
  the batch shapes (64x8 and 16x128) and thread counts (1 and 2). Before timing, the benchmark
  checks that the two compute the same function (eval-mode outputs) and apply dropout at as
  many places (`dropout_sites`);
- train_step_ratio_fast_vs_shipped: the same against nn.Transformer as PyTorch ships it (with
  the inner feed-forward dropout: one more dropout per layer, more work than ours);
- train_step_ratio_scratch, train_step_ratio_scratch_vs_shipped: the same for the from-scratch
  model;
- kv_cache_speedup_512: greedy decoding of 512 new tokens, without / with the KV cache;
- gpt_train_step_ratio_hf: one training step (forward, loss, backward, clip, AdamW) of notebook
  16's GPT on its fast path over transformers' GPT2LMHeadModel with the same configuration
  (4 blocks of width 128, 4 heads, 76 tokens), weights, batch (16 x 128) and optimizer, both
  eager and in training mode with dropout 0.1 at the same places (checked, as the eval-mode
  logits, before timing); the worst over the thread counts;
- tiled_memory_ratio_8192: peak memory of tiled / naive attention at T = 8192 (one head, d_k 64);
- mfu_measured_peak: model FLOPs utilisation of the fast path's training step, with fused Adam
  (batch 64x8, one thread): FLOPs counted by FlopCounterMode / median step time / the float32
  matmul peak timed in turns with it (the same with plain Adam is in mfu_detail); `mfu` is the
  same number under its old name;
- mfu_theoretical_peak: the same FLOP/s over the CPU's theoretical float32 peak for those
  threads (cpu.peak_flops_per_thread: vector lanes x 2 for the FMA x 2 FMA units, an
  assumption, x the clock); None off the CPU or where /proc/cpuinfo is missing;
- attention: notebook 02's attention benchmark (benchmarks/attention.py);
- device, torch, threads, cpu: what it ran on (cpu: the model name, the avx2 / avx512f / amx
  flags, the clock and the theoretical peak, with the assumptions behind it);
- targets: each target, its value and whether it was met.

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
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch import nn

from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.efficient import tiled_attention
from transformer_from_scratch.efficient import use_fast_path
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.measure import count_flops
from transformer_from_scratch.measure import dropout_sites
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


def _reference_layers(reference: TorchTransformer) -> list[nn.Module]:
    """The encoder and decoder layers of the nn.Transformer inside a TorchTransformer."""
    return [*reference.transformer.encoder.layers, *reference.transformer.decoder.layers]


def equal_work_reference(reference: TorchTransformer) -> TorchTransformer:
    """A copy of reference without the dropout inside each layer's feed-forward.

    nn.TransformerEncoderLayer computes linear2(dropout(activation(linear1(x)))) and then
    dropout2 (dropout1 follows the attention); nn.TransformerDecoderLayer the same with dropout3
    after it. `layer.dropout`, the inner one, has no counterpart in our feed-forward
    (Linear, activation, Linear): with nn.Identity in its place the reference does our work."""
    copied = copy.deepcopy(reference)
    for layer in _reference_layers(copied):
        if not isinstance(layer.dropout, nn.Dropout):
            raise TypeError(f"expected the inner FFN dropout, got {type(layer.dropout).__name__}")
        layer.dropout = nn.Identity()
    return copied


def train_step_models(
    device: torch.device, seed: int = 0, model_kwargs: dict | None = None
) -> dict[str, nn.Module]:
    """The from-scratch model, its fast path, the equal-work nn.Transformer ("torch") and the one
    as shipped ("torch_shipped", with the inner FFN dropout), all with the same weights."""
    torch.manual_seed(seed)
    scratch = Transformer(VOCAB, VOCAB, **(model_kwargs or {})).to(device).train()
    shipped = TorchTransformer(scratch).to(device).train()
    fast = use_fast_path(copy.deepcopy(scratch)).train()
    torch_model = equal_work_reference(shipped).train()
    return {"scratch": scratch, "fast": fast, "torch": torch_model, "torch_shipped": shipped}


def check_same_work(
    models: dict[str, nn.Module],
    src: Tensor,
    tgt_in: Tensor,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> dict[str, int]:
    """Raise a RuntimeError unless ours and the equal-work reference compute the same function
    (eval-mode outputs, to float tolerance) and have as many dropout sites; the shipped reference
    must have one more per layer. Returns the sites of each model. Training modes are restored."""
    sites = {name: dropout_sites(m) for name, m in models.items()}
    ref_sites = sites["torch"]
    for name in ("scratch", "fast"):
        if name in models and sites[name] != ref_sites:
            raise RuntimeError(
                f"dropout sites differ: {name} {sites[name]}, equal-work reference {ref_sites}"
            )
    if "torch_shipped" in models:
        layers = _reference_layers(models["torch_shipped"])
        extra = sum(isinstance(x.dropout, nn.Dropout) and x.dropout.p > 0 for x in layers)
        if sites["torch_shipped"] != ref_sites + extra:
            raise RuntimeError(
                f"the shipped reference has {sites['torch_shipped']} dropout sites, expected "
                f"{ref_sites} + {extra} (one inner FFN dropout per layer)"
            )
    tgt_mask = causal_mask(tgt_in.size(1), device=tgt_in.device)
    modes = {name: m.training for name, m in models.items()}
    try:
        with torch.no_grad():
            outs = {name: m.eval()(src, tgt_in, tgt_mask=tgt_mask) for name, m in models.items()}
    finally:
        for name, m in models.items():
            m.train(modes[name])
    for name in ("scratch", "fast", "torch_shipped"):
        if name not in outs:
            continue
        try:
            torch.testing.assert_close(outs[name], outs["torch"], atol=atol, rtol=rtol)
        except AssertionError as error:
            raise RuntimeError(
                f"{name} and the equal-work reference compute different functions: {error}"
            ) from None
    return sites


def compare_train_step(
    batch: int,
    src_len: int,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
) -> dict:
    """Median training-step time of our two models and the two references, and the ratios.

    torch_s is the equal-work nn.Transformer (no inner FFN dropout), torch_shipped_s the one as
    PyTorch ships it; *_over_torch divide by the first, *_over_torch_shipped by the second."""
    device = torch.device(device) if device is not None else get_device()
    models = train_step_models(device, model_kwargs=model_kwargs)
    data = reversal_batch(batch, src_len, device)
    sites = check_same_work(models, data[0], data[1])  # before any timing
    steps = {name: make_train_step(m, *data) for name, m in models.items()}
    t = interleaved_medians(steps, device, repeats)
    return {
        "batch": batch,
        "src_len": src_len,
        "threads": torch.get_num_threads(),
        **{f"{name}_s": seconds for name, seconds in t.items()},
        "fast_over_torch": t["fast"] / t["torch"],
        "scratch_over_torch": t["scratch"] / t["torch"],
        "fast_over_torch_shipped": t["fast"] / t["torch_shipped"],
        "scratch_over_torch_shipped": t["scratch"] / t["torch_shipped"],
        "torch_over_torch_shipped": t["torch"] / t["torch_shipped"],
        "dropout_sites": sites,
    }


def compare_compiled_step(
    batch: int,
    src_len: int,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
) -> dict:
    """torch.compile'd training steps: the fast path against the equal-work nn.Transformer,
    both compiled, and against the eager equal-work nn.Transformer."""
    device = torch.device(device) if device is not None else get_device()
    models = train_step_models(device, model_kwargs=model_kwargs)
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
    eager = equal_work_reference(TorchTransformer(models["scratch"])).train()  # uncompiled
    steps["torch_eager"] = make_train_step(eager, *data)
    t = interleaved_medians(steps, device, repeats)
    row.update({f"{name}_s": seconds for name, seconds in t.items()})
    row["compiled_fast_over_compiled_torch"] = t["fast_compiled"] / t["torch_compiled"]
    row["compiled_fast_over_eager_torch"] = t["fast_compiled"] / t["torch_eager"]
    return row


def hf_dropout_sites(model: nn.Module) -> int:
    """Places where transformers' GPT-2 drops in training: its dropouts are all nn.Dropout
    modules (attention weights included), which measure.dropout_sites counts already."""
    return dropout_sites(model)


def compare_gpt_train_step(
    batch: int = 16,
    context: int = 128,
    repeats: int = 7,
    device: torch.device | str | None = None,
    dropout_p: float = 0.1,
) -> dict:
    """One training step (forward, loss, backward, clip, AdamW) of notebook 16's GPT on the fast
    path against transformers' GPT2LMHeadModel with the same configuration, weights, batch and
    optimizer, both eager and in training mode with dropout at the same places; checked to
    compute the same function (eval-mode logits) before any timing."""
    from transformer_from_scratch.gpt import GPT
    from transformer_from_scratch.gpt import GPTConfig
    from transformer_from_scratch.gpt import to_hf_gpt2

    device = torch.device(device) if device is not None else get_device()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=76, max_len=context, d_model=128, num_heads=4, num_layers=4,
                       dropout_p=dropout_p, fast=True)  # fmt: skip
    ours = GPT(config).to(device)
    theirs = to_hf_gpt2(ours)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 76, (batch, context + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        same = torch.allclose(ours.eval()(inputs), theirs.eval()(inputs).logits, atol=1e-4)
    if not same:
        raise AssertionError("the GPT and its transformers copy compute different logits")
    # ours: the embeddings' dropout, and per block the attention weights and two residual branches
    ours_sites = dropout_sites(ours)
    # theirs: embd, and per block attn_dropout, resid_dropout, the MLP's dropout
    theirs_sites = hf_dropout_sites(theirs)
    if ours_sites != theirs_sites:
        raise AssertionError(f"dropout sites differ: ours {ours_sites}, theirs {theirs_sites}")

    def train_step(model: nn.Module, logits: Callable[[Tensor], Tensor]) -> Callable[[], Tensor]:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99))

        def step() -> Tensor:
            optimizer.zero_grad(set_to_none=True)
            out = logits(inputs)
            loss = F.cross_entropy(out.flatten(0, 1), targets.flatten())
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return loss.detach()

        return step

    steps = {
        "gpt": train_step(ours, ours),
        "hf": train_step(theirs, lambda x: theirs(x).logits),
    }
    t = interleaved_medians(steps, device, repeats)
    return {
        "batch": batch,
        "context": context,
        "threads": torch.get_num_threads(),
        "dropout_p": dropout_p,
        "dropout_sites": ours_sites,
        "gpt_s": t["gpt"],
        "hf_s": t["hf"],
        "gpt_over_hf": t["gpt"] / t["hf"],
    }


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
    cached = greedy_decode(model, src, max_new_tokens=new_tokens, use_cache=True).tokens
    if not torch.equal(cached, greedy_decode(model, src, max_new_tokens=new_tokens).tokens):
        raise RuntimeError(f"the cache changed the tokens at {new_tokens} new tokens")
    t = interleaved_medians(
        {
            "uncached": lambda: greedy_decode(model, src, max_new_tokens=new_tokens),
            "cached": lambda: greedy_decode(model, src, max_new_tokens=new_tokens, use_cache=True),
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


# Server x86 cores issue two vector FMAs a cycle (two FMA units): an assumption, not a reading.
FMA_UNITS_ASSUMED = 2


def _cpuinfo_text() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _lscpu_text() -> str:
    if shutil.which("lscpu") is None:
        return ""
    try:
        return subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, check=False,
            env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"},
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_info(cpuinfo: str | None = None, lscpu: str | None = None) -> dict:
    """The CPU's model name, the flags that set its float32 peak, and that peak per thread.

    peak_flops_per_thread = fp32 lanes (AVX-512: 16, AVX2: 8, else 4) x 2 (an FMA is a multiply
    and an add) x FMA_UNITS_ASSUMED x the clock: lscpu's 'CPU max MHz' where it has one, else the
    highest 'cpu MHz' of /proc/cpuinfo (in a VM that is often the base clock, not the boost one).
    None where the text says nothing. cpuinfo / lscpu: the texts to read (None: this machine's)."""
    cpuinfo = _cpuinfo_text() if cpuinfo is None else cpuinfo
    lscpu = _lscpu_text() if lscpu is None else lscpu
    names = re.findall(r"^model name\s*:\s*(.+?)\s*$", cpuinfo, re.M)
    flag_lines = re.findall(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)
    flags = set(flag_lines[0].split()) if flag_lines else set()
    has = {
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "amx": any(f.startswith("amx") for f in flags),
        "fma": "fma" in flags,
    }
    max_mhz = re.findall(r"^CPU max MHz:\s*([0-9.]+)", lscpu, re.M)
    if max_mhz:
        mhz, source = float(max_mhz[0]), "lscpu 'CPU max MHz'"
    else:
        readings = [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)", cpuinfo, re.M)]
        mhz, source = (max(readings), "/proc/cpuinfo 'cpu MHz' (max)") if readings else (None, None)
    lanes = 16 if has["avx512f"] else 8 if has["avx2"] else 4
    per_cycle = lanes * 2 * FMA_UNITS_ASSUMED
    known = mhz is not None and bool(flags)
    return {
        "model_name": names[0] if names else None,
        "flags": has,
        "amx_flags": sorted(f for f in flags if f.startswith("amx")),
        "mhz": mhz,
        "mhz_source": source,
        "fp32_lanes": lanes,
        "fma_units_assumed": FMA_UNITS_ASSUMED,
        "flops_per_cycle": per_cycle,
        "peak_flops_per_thread": per_cycle * mhz * 1e6 if known else None,
        "assumption": (
            f"{lanes} fp32 lanes x 2 (FMA) x {FMA_UNITS_ASSUMED} FMA units (assumed, as on "
            "server x86) x the clock above, per thread; a core that runs AVX-512 on 256-bit "
            "units (AMD Zen 4) or boosts above that clock has another real peak"
        ),
    }


def model_flops_utilisation(
    batch: int = 64,
    src_len: int = 8,
    repeats: int = 7,
    device: torch.device | str | None = None,
    model_kwargs: dict | None = None,
    peak_size: int = 1024,
    peak_flops_per_thread: float | None = None,
) -> dict:
    """MFU of the fast path's training step: counted FLOPs / median step time / a peak.

    Two peaks: the measured one, a (peak_size x peak_size) float32 matmul timed in turns with
    the steps (so that a slower or faster spell of the machine moves both sides alike), and the
    theoretical one, peak_flops_per_thread (cpu_info) x the threads (None: not computed). The
    fast path's step uses fused Adam; the step with plain Adam is timed as well."""
    check_int("peak_size", peak_size, 1)
    device = torch.device(device) if device is not None else get_device()
    fast = train_step_models(device, model_kwargs=model_kwargs)["fast"]
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
    threads = torch.get_num_threads()
    theoretical = None if peak_flops_per_thread is None else peak_flops_per_thread * threads
    measured_mfu = flops / t["fused"] / peak
    return {
        "batch": batch,
        "src_len": src_len,
        "threads": threads,
        "flops_per_step": flops,
        "step_s": t["fused"],
        "step_s_plain_adam": t["plain"],
        "achieved_flops": flops / t["fused"],
        "peak_flops_measured": peak,
        "peak_flops_theoretical": theoretical,
        "mfu_measured_peak": measured_mfu,
        "mfu_theoretical_peak": None if theoretical is None else flops / t["fused"] / theoretical,
        "mfu_plain_adam": flops / t["plain"] / peak,  # over the measured peak
        "matmul_over_theoretical_peak": None if theoretical is None else peak / theoretical,
        "peak_flops": peak,  # the old names of peak_flops_measured and mfu_measured_peak
        "mfu": measured_mfu,
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
    gpt_shape: tuple[int, int] = (16, 128),
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
    gpt = [
        _with_threads(n, lambda: compare_gpt_train_step(*gpt_shape, repeats, device=device))
        for n in threads
    ]
    b0, s0 = shapes[0]
    cpu = cpu_info()
    per_thread = cpu["peak_flops_per_thread"] if device.type == "cpu" else None
    mfu = _with_threads(
        first,
        lambda: model_flops_utilisation(
            b0, s0, repeats, peak_size=peak_size, peak_flops_per_thread=per_thread, **kw
        ),
    )
    result = {
        "train_step_ratio_fast": max(r["fast_over_torch"] for r in train),
        "train_step_ratio_fast_vs_shipped": max(r["fast_over_torch_shipped"] for r in train),
        "train_step_ratio_scratch": max(r["scratch_over_torch"] for r in train),
        "train_step_ratio_scratch_vs_shipped": max(r["scratch_over_torch_shipped"] for r in train),
        f"kv_cache_speedup_{decode_tokens}": decode["speedup"],
        f"tiled_memory_ratio_{tiled_T}": memory["ratio"],
        "gpt_train_step_ratio_hf": max(r["gpt_over_hf"] for r in gpt),
        "mfu_measured_peak": mfu["mfu_measured_peak"],
        "mfu_theoretical_peak": mfu["mfu_theoretical_peak"],
        "mfu": mfu["mfu_measured_peak"],  # the old name of mfu_measured_peak
        "device": str(device),
        "torch": torch.__version__,
        "threads": threads,
        "cpu": cpu,
        "reference": (
            "train_step_ratio_*: over nn.Transformer with the same weights and without the "
            "dropout inside its feed-forward (the work of ours: eval outputs and dropout sites "
            "checked before timing); *_vs_shipped: over nn.Transformer as shipped, with it"
        ),
        "model": {"src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, **(model_kwargs or {})},
        "repeats": repeats,
        "train_step": train,
        "decode": decode,
        "tiled_memory": memory,
        "gpt_train_step": gpt,
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
    result["targets"] = {
        key: {"op": op, "goal": goal, "value": result[key], "met": target_met(key, result[key])}
        for key, (op, goal) in TARGETS.items()
        if isinstance(result.get(key), float)
    }
    return result


# The course's goals for these keys on its 2-core CPU (issue 11), printed beside the results:
# (comparison, value). Goals, not asserts: on another machine the ratios move.
# train_step_ratio_fast is the worst row, so its goal holds at every shape and thread count; it
# is against the equal-work nn.Transformer (the *_vs_shipped keys have no goal). mfu is the old
# name of mfu_measured_peak, and shares its goal.
TARGETS = {
    "train_step_ratio_fast": ("<=", 0.85),
    "gpt_train_step_ratio_hf": ("<=", 0.80),  # issue 19: notebook 16's GPT against transformers
    "tiled_memory_ratio_8192": ("<=", 0.125),
    "mfu_measured_peak": (">=", 0.55),
    "mfu": (">=", 0.55),
}


def target_met(key: str, value: float) -> bool | None:
    """Whether value meets key's goal; None for a key without one."""
    if key not in TARGETS:
        return None
    op, goal = TARGETS[key]
    return value <= goal if op == "<=" else value >= goal


def target_status(key: str, value: float) -> str:
    """'target <= 0.85: met' (or 'MISSED'), or '' for a key without a target."""
    met = target_met(key, value)
    if met is None:
        return ""
    op, goal = TARGETS[key]
    return f"target {op} {goal}: {'met' if met else 'MISSED'}"


def format_results(result: dict) -> str:
    """The results as plain-text tables: the contract's keys first."""
    lines = [
        f"torch {result['torch']} on {result['device']}, threads {result['threads']}, "
        f"median of {result['repeats']} interleaved runs",
        "",
        "training step (forward, loss, backward, clip, Adam), against nn.Transformer (eager):",
        "torch = nn.Transformer without its inner feed-forward dropout (our work: same eval "
        "outputs, same dropout sites),",
        "shipped = nn.Transformer as PyTorch ships it (one more dropout per layer); the target "
        "<= 0.85 is on fast/torch, in every row",
        f"{'threads':>7} {'batch':>6} {'S':>5} {'scratch ms':>11} {'fast ms':>8} {'torch ms':>9} "
        f"{'shipped ms':>11} {'scratch/torch':>14} {'fast/torch':>11} {'fast/shipped':>13}",
    ]
    for r in result["train_step"]:
        met = target_met("train_step_ratio_fast", r["fast_over_torch"])
        lines.append(
            f"{r['threads']:>7} {r['batch']:>6} {r['src_len']:>5} {1e3 * r['scratch_s']:>11.2f} "
            f"{1e3 * r['fast_s']:>8.2f} {1e3 * r['torch_s']:>9.2f} "
            f"{1e3 * r['torch_shipped_s']:>11.2f} {r['scratch_over_torch']:>14.3f} "
            f"{r['fast_over_torch']:>11.3f} {r['fast_over_torch_shipped']:>13.3f}  "
            f"{'met' if met else 'MISSED'}"
        )
    sites = result["train_step"][0]["dropout_sites"]
    lines.append("dropout sites: " + ", ".join(f"{name} {n}" for name, n in sites.items()))
    for r in result.get("compiled", []):
        lines.append(
            f"compiled (torch = equal work), {r['threads']} threads, "
            f"{r['batch']}x{r['src_len']}: fast "
            f"{1e3 * r['fast_compiled_s']:.2f} ms (compile {r['fast_compile_s']:.0f} s), "
            f"nn.Transformer {1e3 * r['torch_compiled_s']:.2f} ms (compile "
            f"{r['torch_compile_s']:.0f} s), eager nn.Transformer {1e3 * r['torch_eager_s']:.2f} "
            f"ms; compiled fast / compiled torch {r['compiled_fast_over_compiled_torch']:.3f}, "
            f"/ eager torch {r['compiled_fast_over_eager_torch']:.3f}"
        )
    d, m, u, c = result["decode"], result["tiled_memory"], result["mfu_detail"], result["cpu"]
    if u["peak_flops_theoretical"] is None:
        theoretical = "no theoretical peak (not a CPU run, or no /proc/cpuinfo)"
    else:
        theoretical = (
            f"{u['peak_flops_theoretical'] / 1e9:.1f} GFLOP/s theoretical peak "
            f"({c['flops_per_cycle']} FLOP/cycle x {c['mhz']:.0f} MHz x {u['threads']} "
            f"thread(s), {c['fma_units_assumed']} FMA units assumed): "
            f"{u['mfu_theoretical_peak']:.3f}; the matmul reaches "
            f"{u['matmul_over_theoretical_peak']:.2f} of it"
        )
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in c["flags"].items())
    lines += [
        f"CPU: {c['model_name']}; {flags}; clock {c['mhz']} MHz from {c['mhz_source']}",
        "",
        f"greedy decoding of {d['new_tokens']} tokens: {1e3 * d['uncached_s']:.0f} ms without the "
        f"KV cache, {1e3 * d['cached_s']:.0f} ms with: {d['speedup']:.1f}x",
        f"attention forward at T={m['T']}: naive {m['naive_bytes'] / 2**20:.1f} MiB, tiled "
        f"{m['tiled_bytes'] / 2**20:.2f} MiB: ratio {m['ratio']:.4f}",
        f"MFU at {u['batch']}x{u['src_len']}, {u['threads']} thread(s), fast path + fused Adam: "
        f"{u['flops_per_step'] / 1e9:.3f} GFLOP a step in {1e3 * u['step_s']:.1f} ms = "
        f"{u['achieved_flops'] / 1e9:.1f} GFLOP/s; of a {u['peak_flops_measured'] / 1e9:.1f} "
        f"GFLOP/s measured matmul peak: {u['mfu_measured_peak']:.3f} (plain Adam: "
        f"{1e3 * u['step_s_plain_adam']:.1f} ms, {u['mfu_plain_adam']:.3f}); of a {theoretical}",
        "",
        "bench.json:",
    ]
    for key in (
        "train_step_ratio_fast",
        "train_step_ratio_fast_vs_shipped",
        "train_step_ratio_scratch",
        "train_step_ratio_scratch_vs_shipped",
        *(k for k in result if k.startswith(("kv_cache_speedup_", "tiled_memory_ratio_"))),
        "gpt_train_step_ratio_hf",
        "mfu_measured_peak",
        "mfu_theoretical_peak",
    ):
        value = result[key]
        if value is None:
            lines.append(f"  {key:>35}: None")
            continue
        lines.append(f"  {key:>35}: {value:.4f}  {target_status(key, value)}".rstrip())
    lines.append(f"  {'mfu':>35}: the old name of mfu_measured_peak")
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
