"""The tuned reversal recipe of notebook 15 against the tutorial's, seed by seed.

Each (recipe, seed) run trains a fresh model, scores exact match on the 256 test sequences
every `--eval-every` steps and stops at the first perfect score. It reports the step, the
training seconds (wall clock, evaluations excluded) and the CPU seconds of that run:

    python benchmarks/tuned_recipe.py --threads 2 --seeds 0 1 2 3 4 5 --out bench-recipe.json
    python benchmarks/tuned_recipe.py --recipes tuned --jobs 3    # three runs side by side

With --jobs > 1 the runs share the machine's cores; give each run its own cores
(jobs * threads <= cores) or the seconds mean little. It is not part of the installed package.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from pathlib import Path

import torch

from transformer_from_scratch.tuning import TUNED_RECIPE
from transformer_from_scratch.tuning import TUTORIAL_RECIPE
from transformer_from_scratch.tuning import train_until_solved

RECIPES = {"tuned": TUNED_RECIPE, "tutorial": TUTORIAL_RECIPE}


def run(job: tuple[str, int, int, int]) -> dict:
    """Train one (recipe, seed) until 256/256; return the step and the seconds."""
    name, seed, threads, eval_every = job
    torch.set_num_threads(threads)
    recipe = RECIPES[name].replace(seed=seed)
    _, history = train_until_solved(recipe, eval_every=eval_every, stop_when_solved=True)
    return {
        "recipe": name,
        "seed": seed,
        "threads": threads,
        "max_steps": recipe.steps,
        "solved_step": history["solved_step"],
        "seconds": round(history["solved_seconds"] or history["seconds"], 2),
        "cpu_seconds": round(history["cpu_seconds"], 2),
        "last_exact": history["exact"][-1][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    jobs = [
        (name, seed, args.threads, args.eval_every) for name in args.recipes for seed in args.seeds
    ]
    print(f"{'recipe':9s} {'seed':>4s} {'solved at step':>15s} {'seconds':>8s} {'CPU s':>7s}")
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for row in pool.imap(run, jobs, chunksize=1):  # printed as they finish, in order
            rows.append(row)
            step = row["solved_step"] if row["solved_step"] is not None else "not solved"
            print(
                f"{row['recipe']:9s} {row['seed']:4d} {step!s:>15s} {row['seconds']:8.1f} "
                f"{row['cpu_seconds']:7.1f}",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
