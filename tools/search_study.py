"""Notebook 15, exercise 1: TPE against random search over five seeds and 30 trials each.

    python tools/search_study.py   (about 25 minutes on one thread)

The notebook's search (section 5): the memorising small model's validation loss after 150 steps,
the median pruner with 3 start-up trials and 50 warm-up steps. Writes tools/search_study.json:
for every sampler and seed, each trial's final loss (None for a pruned one) and the best.
"""

import json
import time
from pathlib import Path

import optuna

from transformer_from_scratch.tuning import Recipe
from transformer_from_scratch.tuning import make_splits
from transformer_from_scratch.tuning import make_study
from transformer_from_scratch.tuning import search_objective

SEEDS, TRIALS = range(5), 30
OUT = Path(__file__).with_name("search_study.json")


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    small = Recipe(d_model=64, num_heads=4, d_ff=128, num_layers=2, batch_size=32, steps=400,
                   warmup=20, lr=3e-3, schedule="constant")  # fmt: skip
    plenty_set, val_set = make_splits(small, 4096, 512, seed=0)
    memo_set = tuple(t[:64] for t in plenty_set)
    objective = search_objective(small.replace(steps=150), val_set, train_data=memo_set)
    results, start = {}, time.perf_counter()
    for seed in SEEDS:
        for sampler in ("tpe", "random"):
            study = make_study(sampler, seed=seed, n_startup_trials=3, n_warmup_steps=50)
            study.optimize(objective, n_trials=TRIALS)
            values = [t.value if t.state.name == "COMPLETE" else None for t in study.trials]
            results[f"{sampler}-{seed}"] = {"values": values, "best": study.best_value}
            seconds = time.perf_counter() - start
            print(f"seed {seed} {sampler:6s} best {study.best_value:.3f}, "
                  f"{values.count(None)} of {TRIALS} pruned, {seconds:.0f} s")  # fmt: skip
            OUT.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
