"""The ablation behind notebook 17's section 9: GPT-2's block to Llama's, one change at a time.

Each row of `ABLATION_ROWS` (transformer_from_scratch.llm) adds one change to the row above; every
row has the GPT-2 row's parameter count (its FFN width is matched) and the same budget
(`ABLATION_RECIPE`, notebook 16's: 1,200 updates of 16 windows of 128 characters), and is
trained with each seed
(the seed draws both the weights and the training windows) on notebook 16's plays split, one
thread per run, exactly as `run_ablation` does in the notebook. The score is the validation loss
in bits per character over `ABLATION_EVAL_WINDOWS` windows of the held-out plays.

    python tools/llm_ablation.py --seeds 0-1 --jobs 2 --out tools/llm_ablation.json

prints a table (markdown) and writes the JSON that notebook 17 copies (tests/test_tools.py checks
the copy). Expect six to ten minutes per run on one core of this project's machine (the stored
study: 12 runs, two at a time, in 3,512 s). The GPT-2 row with seed 0 is notebook 16's own run
(its class, seed, recipe and windows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from transformer_from_scratch.gpt import CharTokenizer
from transformer_from_scratch.gpt import load_plays
from transformer_from_scratch.gpt import split_plays
from transformer_from_scratch.llm import ABLATION_RECIPE
from transformer_from_scratch.llm import ABLATION_ROWS
from transformer_from_scratch.llm import run_ablation


def parse_seeds(text: str) -> list[int]:
    """'0-2' -> [0, 1, 2]; '0,3' -> [0, 3]."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += range(int(low), int(high or low) + 1)
    return seeds


def one_run(row: str, seed: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    train_text, valid_text = split_plays(load_plays())
    chars = CharTokenizer(train_text)
    train_ids, valid_ids = chars.encode(train_text), chars.encode(valid_text)
    start = time.perf_counter()
    _, record = run_ablation(row, seed, train_ids, valid_ids, chars.vocab_size)
    record["wall_seconds"] = time.perf_counter() - start
    bits, ms = record["val_bits"], 1000 * record["seconds_per_step"]
    print(f"{row:14s} seed {seed}: {bits:.4f} bits/char, {ms:.0f} ms/step", flush=True)
    return record


def table(records: list[dict]) -> str:
    lines = ["| row | parameters | d_ff | bits/char (mean) | min | max | ms/update (mean) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in ABLATION_ROWS:
        mine = [r for r in records if r["row"] == row]
        if not mine:
            continue
        bits = [r["val_bits"] for r in mine]
        ms = statistics.mean(1000 * r["seconds_per_step"] for r in mine)
        mean, low, high = statistics.mean(bits), min(bits), max(bits)
        lines.append(f"| {row} | {mine[0]['parameters']:,} | {mine[0]['d_ff']} | "
                     f"{mean:.4f} | {low:.4f} | {high:.4f} | {ms:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-1")
    parser.add_argument("--rows", default=",".join(ABLATION_ROWS), help="comma-separated rows")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side, one process each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out", default="tools/llm_ablation.json")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ABLATION_ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; expected some of {list(ABLATION_ROWS)}")
    runs = [(row, seed) for seed in parse_seeds(args.seeds) for row in rows]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(one_run, row, seed, args.threads) for row, seed in runs]
        records = [f.result() for f in futures]
    result = {
        "command": " ".join(["python tools/llm_ablation.py", *(argv or sys.argv[1:])]),
        "recipe": dataclasses.asdict(ABLATION_RECIPE),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads_per_run": args.threads,
        "jobs": args.jobs,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "runs": records,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
