"""Attention against T: our scaled_dot_product_attention next to PyTorch's fused one.

Times (median), peak memory and FLOPs of one forward pass at each sequence length, the log-log
slopes over the longer lengths, printed as a table and written as JSON:

    python benchmarks/attention.py --threads 1 --out bench-attention.json
    python benchmarks/attention.py --T 256 512 1024 2048 4096 --heads 8 --repeats 10

Notebook 02 teaches the measurements (transformer_from_scratch.measure) on a few lengths; this
script repeats them side by side in one process. It is not part of the installed package.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.measure import count_flops
from transformer_from_scratch.measure import fit_slope
from transformer_from_scratch.measure import peak_memory
from transformer_from_scratch.measure import time_call
from transformer_from_scratch.utils import get_device

DEFAULT_T = (64, 128, 256, 512, 1024, 2048)


def ours(Q: Tensor, K: Tensor, V: Tensor) -> Tensor:
    """The course's attention, returning the context only (as PyTorch's does)."""
    return scaled_dot_product_attention(Q, K, V)[0]


IMPLEMENTATIONS = {"ours": ours, "torch": F.scaled_dot_product_attention}


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_qkv(
    T: int,
    d_k: int = 64,
    batch: int = 1,
    num_heads: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random (batch, num_heads, T, d_k) queries, keys and values, drawn on the CPU and moved."""
    for name, value in (("T", T), ("d_k", d_k), ("batch", batch), ("num_heads", num_heads)):
        _positive_int(name, value)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, num_heads, T, d_k)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype).to(device) for _ in range(3))


def measure_row(
    T: int,
    d_k: int,
    batch: int,
    num_heads: int,
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict:
    """One length: median times, weights' bytes, peak bytes and FLOPs of ours and PyTorch's."""
    Q, K, V = make_qkv(T, d_k, batch, num_heads, dtype=dtype, device=device)
    row: dict = {"T": T}
    with torch.no_grad():
        for name, fn in IMPLEMENTATIONS.items():
            row[f"{name}_s"] = time_call(lambda fn=fn: fn(Q, K, V), warmup=1, repeats=repeats)
        row["ours_over_torch"] = row["ours_s"] / row["torch_s"]
        _, attn = scaled_dot_product_attention(Q, K, V)  # (batch, num_heads, T, T)
        row["weights_bytes"] = attn.numel() * attn.element_size()
        del attn
        for name, fn in IMPLEMENTATIONS.items():  # peak_memory knows the CPU and CUDA only
            measurable = device.type in ("cpu", "cuda")
            row[f"peak_bytes_{name}"] = (
                peak_memory(lambda fn=fn: fn(Q, K, V), device) if measurable else None
            )
    meta = [torch.empty(batch, num_heads, T, d_k, device="meta") for _ in range(3)]
    row["flops"] = count_flops(lambda: ours(*meta))
    return row


def run_suite(
    Ts=DEFAULT_T,
    d_k: int = 64,
    batch: int = 1,
    num_heads: int = 1,
    repeats: int = 5,
    threads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict:
    """Every length's row, and the log-log slopes over the longer half of the lengths."""
    Ts = sorted(Ts)
    if len(Ts) < 2 or len(set(Ts)) != len(Ts):
        raise ValueError(f"need at least two different sequence lengths, got {Ts}")
    _positive_int("repeats", repeats)
    if threads is not None:
        _positive_int("threads", threads)
    device = torch.device(device) if device is not None else get_device()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        rows = [measure_row(T, d_k, batch, num_heads, repeats, dtype, device) for T in Ts]
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    upper = rows[len(rows) // 2 :] if len(rows) >= 4 else rows  # where the T^2 term dominates
    Ts_upper = [r["T"] for r in upper]
    keys = ["ours_s", "torch_s", "weights_bytes", "peak_bytes_ours", "flops"]
    slopes = {
        key: fit_slope(Ts_upper, [r[key] for r in upper]) if upper[0][key] is not None else None
        for key in keys
    }
    config = {
        "d_k": d_k,
        "batch": batch,
        "num_heads": num_heads,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": used_threads,
        "repeats": repeats,
        "torch": torch.__version__,
    }
    return {"config": config, "rows": rows, "slopes": slopes, "slope_from_T": Ts_upper[0]}


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.3f}"


def format_suite(suite: dict) -> str:
    """The suite's results as a plain-text table."""
    c = suite["config"]
    lines = [
        f"attention, B={c['batch']} h={c['num_heads']} d_k={c['d_k']} {c['dtype']} on "
        f"{c['device']}, threads={c['threads']}, median of {c['repeats']} runs, "
        f"torch {c['torch']}",
        f"{'T':>6} {'ours ms':>9} {'torch ms':>9} {'ours/torch':>10} {'weights MiB':>12} "
        f"{'peak MiB':>9} {'torch peak':>10}",
    ]
    for r in suite["rows"]:
        lines.append(
            f"{r['T']:>6} {1e3 * r['ours_s']:>9.3f} {1e3 * r['torch_s']:>9.3f} "
            f"{r['ours_over_torch']:>10.2f} {_mib(r['weights_bytes']):>12} "
            f"{_mib(r['peak_bytes_ours']):>9} {_mib(r['peak_bytes_torch']):>10}"
        )
    s = suite["slopes"]
    peak = "-" if s["peak_bytes_ours"] is None else f"{s['peak_bytes_ours']:.2f}"
    lines.append(
        f"log-log slope for T >= {suite['slope_from_T']}: time ours {s['ours_s']:.2f}, "
        f"torch {s['torch_s']:.2f} (noisy wall clock); peak memory ours {peak}; "
        f"FLOPs of the matmuls {s['flops']:.2f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: run the suite, print the table, write the results as JSON to --out."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/attention.py",
        description="Time and memory of our attention against F.scaled_dot_product_attention.",
    )
    parser.add_argument(
        "--T", type=int, nargs="+", default=list(DEFAULT_T), help="sequence lengths"
    )
    parser.add_argument("--d-k", type=int, default=64, help="width of a query and a key")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per length (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-attention.json"), help="JSON file to write"
    )
    args = parser.parse_args(argv)
    suite = run_suite(
        args.T,
        d_k=args.d_k,
        batch=args.batch,
        num_heads=args.heads,
        repeats=args.repeats,
        threads=args.threads,
        device=args.device,
    )
    print(format_suite(suite))
    args.out.write_text(json.dumps(suite, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
