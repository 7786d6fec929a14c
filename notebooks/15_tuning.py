# %% [markdown]
# # 15 · Tuning and generalisation
#
# **What you will build:** draft.
#
# [Open in Colab](x) · Assumes: [11 · Training](11_training.ipynb).

# %%
# Setup. On Colab, install the course's package (Colab's own torch is kept as it is).
import sys

if "google.colab" in sys.modules:
    import subprocess

    PACKAGE = "transformer-from-scratch @ git+https://github.com/transformer-from-scratch/transformer-from-scratch@main"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", PACKAGE], capture_output=True, text=True
    )
    if pip.returncode != 0:
        raise RuntimeError(
            f"Could not install the course's package {PACKAGE!r}. pip said:\n"
            f"{pip.stderr.strip()[-800:]}\n"
            "Opened from a fork? Point the notebooks at it with `make fork REPO=owner/name`, "
            "push, and open the notebook from the fork (README, 'Forks')."
        )

# %%
import torch

# %%
#| default_exp tuning

# %%
#| export regularization
"""Stochastic depth (DropPath), written from scratch and put on the course's residual branches."""

import torch
from torch import nn

from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.checks import check_tensor
from transformer_from_scratch.checks import checking


def drop_path(
    x: torch.Tensor, p: float, training: bool = True, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Zero each sample's x with probability p and scale the kept ones by 1/(1-p); identity in eval."""
    if checking():
        check_tensor("x", x, kind="float")
        check_probability("p", p)
    if not training or p == 0.0:
        return x
    keep = 1.0 - p
    shape = (x.shape[0],) + (1,) * (x.dim() - 1)  # (B, 1, 1): one draw per sample, not per entry
    mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep, generator=generator)
    return x * mask / keep  # E[mask / keep] = 1: the expectation of the branch is kept


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016) on a residual branch: drop_path in a module."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = check_probability("p", p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)


class BranchDrop(nn.Module):
    """What a residual branch passes through before the add: its dropout, then DropPath."""

    def __init__(self, dropout: nn.Module, p: float = 0.0):
        super().__init__()
        self.dropout = dropout  # the block's own nn.Dropout, kept as it was
        self.drop_path = DropPath(p)

    @property
    def p(self) -> float:
        """The dropout's rate, as the nn.Dropout that this module replaces reports it."""
        return self.dropout.p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path(self.dropout(x))


def add_drop_path(model: nn.Module, p: float) -> nn.Module:
    """Put DropPath on every residual branch of the model's encoder and decoder stacks, in place.

    Block l of a stack of L gets the rate p * l / L (Huang et al., 2016: the deeper, the more
    often skipped). Calling it again sets new rates; p = 0 switches it off."""
    check_probability("p", p)
    stacks = [m for m in model.modules() if isinstance(m, Encoder | Decoder)]
    if not stacks:
        raise ValueError(f"{type(model).__name__} holds no Encoder or Decoder stack")
    for stack in stacks:
        L = len(stack.layers)
        for l, block in enumerate(stack.layers, start=1):
            for name in ("dropout1", "dropout2", "dropout3"):  # one per residual branch
                branch = getattr(block, name, None)
                if branch is None:
                    continue  # encoder blocks have two branches, decoder blocks three
                if not isinstance(branch, BranchDrop):
                    branch = BranchDrop(branch)
                    setattr(block, name, branch)
                branch.drop_path.p = p * l / L
    return model


# %%
#| export
"""Tuning the reversal model: one configurable training run, the generalisation gap, a
learning-rate range test, parameter budgets, a search space for Optuna, and the recipes."""

import dataclasses
import math
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.data import make_batch
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.regularization import add_drop_path
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.train import exact_match
from transformer_from_scratch.train import lr_lambda
from transformer_from_scratch.train import reversal_loss

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # src, tgt_in, tgt_out, lengths


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a reversal run: the task, the model's sizes and the training."""

    vocab_size: int = 12
    max_len: int = 8
    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 2
    dropout_p: float = 0.0
    drop_path: float = 0.0  # the largest DropPath rate, reached by the last block of each stack
    optimizer: str = "adamw"  # or "adam"
    lr: float = 2e-3  # the peak rate; with schedule="paper", a factor on the paper's rate
    schedule: str = "cosine"  # linear warm-up, then "cosine" to 0, "constant", or "paper"
    warmup: int = 50
    steps: int = 600
    batch_size: int = 64
    accum_steps: int = 1  # micro-batches per update; batch_size is their total
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    clip_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    seed: int = 0  # the weights and dropout; seed + 1 draws the training batches

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_heads", "d_ff", "num_layers", "steps"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("max_len", self.max_len, minimum=3)
        check_int("batch_size", self.batch_size, minimum=1)
        check_int("accum_steps", self.accum_steps, minimum=1)
        check_int("warmup", self.warmup, minimum=0)
        check_int("seed", self.seed, minimum=0)
        if self.batch_size % self.accum_steps != 0:
            raise ValueError(
                f"batch_size={self.batch_size} is not a multiple of accum_steps={self.accum_steps}"
            )
        check_probability("dropout_p", self.dropout_p)
        check_probability("drop_path", self.drop_path)
        check_probability("label_smoothing", self.label_smoothing)
        check_choice("optimizer", self.optimizer, ("adam", "adamw"))
        check_choice("schedule", self.schedule, ("cosine", "constant", "paper"))
        check_float("lr", self.lr, 0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, 0.0)
        check_float("clip_norm", self.clip_norm, 0.0, low_open=True)
        check_float("eps", self.eps, 0.0, low_open=True)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas!r}")
        for beta in self.betas:
            check_float("betas", beta, 0.0, 1.0, high_open=True)

    def replace(self, **changes) -> "Recipe":
        """A copy with `changes`; unknown names are a TypeError, bad values a ValueError."""
        return dataclasses.replace(self, **changes)


# The tutorial's run: Adam at base rate 1 times the paper's schedule, dropout 0.1, 6,000 steps.
TUTORIAL_RECIPE = Recipe(
    dropout_p=0.1, optimizer="adam", lr=1.0, schedule="paper", warmup=400, steps=6000
)


def build_model(recipe: Recipe) -> Transformer:
    """The recipe's Transformer on the CPU, its weights drawn after torch.manual_seed(seed)."""
    torch.manual_seed(recipe.seed)
    model = Transformer(
        recipe.vocab_size,
        recipe.vocab_size,
        d_model=recipe.d_model,
        num_heads=recipe.num_heads,
        d_ff=recipe.d_ff,
        num_layers=recipe.num_layers,
        dropout_p=recipe.dropout_p,
    )
    if recipe.drop_path > 0:
        add_drop_path(model, recipe.drop_path)
    return model


def lr_factor(step: int, recipe: Recipe) -> float:
    """The multiplier on recipe.lr for update `step` (0-based): warm-up, then the schedule."""
    step = check_int("step", step, minimum=0)
    if recipe.schedule == "paper":  # notebook 11: the rate of update s is lr_lambda(s + 1)
        return lr_lambda(step + 1, recipe.d_model, max(recipe.warmup, 1))
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup  # linear, reaching 1 at the end of the warm-up
    if recipe.schedule == "constant":
        return 1.0
    progress = (step - recipe.warmup) / max(recipe.steps - recipe.warmup, 1)  # 0 -> 1
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))  # 1 -> 0


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """Adam or AdamW at base rate recipe.lr; AdamW decays matrices only, not biases or norms."""
    if recipe.optimizer == "adam":
        return torch.optim.Adam(
            model.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps
        )
    decay = [p for p in model.parameters() if p.dim() >= 2]  # weights and embeddings
    keep = [p for p in model.parameters() if p.dim() < 2]  # biases, LayerNorm gains and shifts
    groups = [
        {"params": decay, "weight_decay": recipe.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps)


def num_tokens(batch: Batch) -> int:
    """How many target positions of a batch the loss grades (everything but PAD)."""
    return int((batch[2] != PAD).sum())


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Cut a batch into `parts` micro-batches of equal size along the batch dimension."""
    B = batch[0].shape[0]
    if B % parts != 0:
        raise ValueError(f"a batch of {B} does not split into {parts} equal micro-batches")
    size = B // parts
    return [tuple(t[i * size : (i + 1) * size] for t in batch) for i in range(parts)]


def accumulate_gradients(
    model: Transformer,
    micro_batches: list[Batch],
    label_smoothing: float = 0.0,
    total_tokens: int | None = None,
    scale: float = 1.0,
) -> float:
    """Backward through every micro-batch, each loss weighted by its share of the graded tokens.

    The gradients add up to those of one pass over the concatenated batch (mean over all its
    tokens); `total_tokens` and `scale` let a distributed run count the tokens of every process.
    Returns the loss of the whole batch."""
    counts = [num_tokens(b) for b in micro_batches]
    total = sum(counts) if total_tokens is None else total_tokens
    loss_sum = 0.0
    for batch, count in zip(micro_batches, counts, strict=True):
        loss = reversal_loss(model, batch, label_smoothing) * (count * scale / total)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum / scale


@torch.no_grad()
def evaluate_loss(model: Transformer, data: Batch, batch_size: int = 512) -> float:
    """Mean cross-entropy (no smoothing) over all graded tokens of `data`, in eval mode."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, data[0].shape[0], batch_size):
        chunk = tuple(t[start : start + batch_size] for t in data)
        n = num_tokens(chunk)
        total += reversal_loss(model, chunk).item() * n
        count += n
    model.train(was_training)
    return total / count


def batches(
    recipe: Recipe, data: Batch | None = None, generator: torch.Generator | None = None
) -> Iterator[Batch]:
    """Training batches: fresh sequences every step, or shuffled passes over a fixed `data` set."""
    if generator is None:
        generator = torch.Generator().manual_seed(recipe.seed + 1)
    if data is None:
        while True:
            yield make_batch(recipe.batch_size, recipe.max_len, recipe.vocab_size, generator)
    n = data[0].shape[0]
    size = min(recipe.batch_size, n)
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - size + 1, size):  # drop a last, smaller batch
            index = order[start : start + size]
            yield tuple(t[index] for t in data)


def fit(
    model: Transformer,
    recipe: Recipe,
    train_data: Batch | None = None,
    val_data: Batch | None = None,
    eval_every: int = 0,
    callback: Callable[[int, Transformer, dict], bool | None] | None = None,
    progress: bool = False,
) -> dict:
    """Train `model` as `recipe` says; return its history.

    Without `train_data` every step draws fresh sequences; with it, the run makes passes over
    that fixed set. Every `eval_every` steps (and at the end) the history records the loss on
    `val_data` and on `train_data`, both in eval mode, then `callback(step, model, history)` runs;
    a true result stops the run. Seconds count the training only, not the evaluations."""
    check_int("eval_every", eval_every, minimum=0)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
    stream = batches(recipe, train_data)
    history: dict = {"loss": [], "lr": [], "eval_step": [], "train_loss": [], "val_loss": []}
    seconds = cpu_seconds = 0.0
    steps = range(1, recipe.steps + 1)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="training", leave=False)
    for step in steps:
        start, cpu_start = time.perf_counter(), time.process_time()
        model.train()
        optimizer.zero_grad(set_to_none=True)
        micro = split_batch(next(stream), recipe.accum_steps)
        loss = accumulate_gradients(model, micro, recipe.label_smoothing)
        nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
        history["lr"].append(optimizer.param_groups[0]["lr"])  # the rate of this update
        optimizer.step()
        scheduler.step()
        history["loss"].append(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        cpu_seconds += time.process_time() - cpu_start
        if eval_every and (step % eval_every == 0 or step == recipe.steps):
            history["eval_step"].append(step)
            if train_data is not None:
                history["train_loss"].append(evaluate_loss(model, train_data))
            if val_data is not None:
                history["val_loss"].append(evaluate_loss(model, val_data))
            history["seconds"], history["cpu_seconds"] = seconds, cpu_seconds
            if callback is not None and callback(step, model, history):
                break
    history["seconds"], history["cpu_seconds"] = seconds, cpu_seconds
    model.eval()
    return history


def make_splits(recipe: Recipe, n_train: int, n_val: int, seed: int = 0) -> tuple[Batch, Batch]:
    """A fixed training set of n_train sequences and a validation set that shares none of them."""
    check_int("n_train", n_train, minimum=1)
    check_int("n_val", n_val, minimum=1)
    generator = torch.Generator().manual_seed(seed)
    train = make_batch(n_train, recipe.max_len, recipe.vocab_size, generator)
    val = make_batch(n_val, recipe.max_len, recipe.vocab_size, generator)
    seen = {tuple(row) for row in train[0].tolist()}
    fresh = torch.tensor([tuple(row) not in seen for row in val[0].tolist()])
    return train, tuple(t[fresh] for t in val)


def lr_range_test(
    recipe: Recipe,
    lr_min: float = 1e-5,
    lr_max: float = 1.0,
    steps: int = 100,
    smoothing: float = 0.9,
    stop_factor: float = 4.0,
) -> dict[str, list[float]]:
    """Smith's range test: one update per rate, the rate growing geometrically from lr_min to
    lr_max, on a fresh model and fresh batches; stops once the smoothed loss passes
    stop_factor times its best. Returns the rates, the losses and the smoothed losses."""
    check_float("lr_min", lr_min, 0.0, low_open=True)
    check_float("lr_max", lr_max, lr_min, low_open=True)
    check_int("steps", steps, minimum=2)
    check_probability("smoothing", smoothing)
    model = build_model(recipe)
    optimizer = make_optimizer(model, recipe)
    stream = batches(recipe)
    result: dict[str, list[float]] = {"lr": [], "loss": [], "smoothed": []}
    average, best = 0.0, math.inf
    model.train()
    for i in range(steps):
        lr = lr_min * (lr_max / lr_min) ** (i / (steps - 1))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, split_batch(next(stream), recipe.accum_steps))
        nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
        optimizer.step()
        average = smoothing * average + (1 - smoothing) * loss
        smoothed = average / (1 - smoothing ** (i + 1))  # bias-corrected running mean
        result["lr"].append(lr)
        result["loss"].append(loss)
        result["smoothed"].append(smoothed)
        best = min(best, smoothed)
        if not math.isfinite(loss) or smoothed > stop_factor * best:
            break
    return result


def suggest_lr(result: dict[str, list[float]]) -> dict[str, float]:
    """Read a range test: the rate at the lowest smoothed loss, the rate where the smoothed loss
    falls fastest (per decade of rate), and the rule of thumb, a tenth of the first."""
    lrs, smoothed = result["lr"], result["smoothed"]
    if len(lrs) < 3:
        raise ValueError("a range test of at least 3 steps is needed")
    best = min(range(len(lrs)), key=smoothed.__getitem__)
    slopes = [
        (smoothed[i + 1] - smoothed[i]) / math.log10(lrs[i + 1] / lrs[i])
        for i in range(best)  # only the part before the minimum
    ]
    steepest = min(range(len(slopes)), key=slopes.__getitem__) if slopes else 0
    return {"min_loss": lrs[best], "steepest": lrs[steepest], "suggested": lrs[best] / 10}


def count_parameters(recipe: Recipe) -> int:
    """The parameters of the recipe's Transformer, counted on a model built without memory."""
    with torch.device("meta"):  # real modules, no storage: any size counts in milliseconds
        model = Transformer(
            recipe.vocab_size,
            recipe.vocab_size,
            d_model=recipe.d_model,
            num_heads=recipe.num_heads,
            d_ff=recipe.d_ff,
            num_layers=recipe.num_layers,
        )
    return sum(p.numel() for p in model.parameters())


def width_for_budget(recipe: Recipe, num_layers: int, budget: int, ff_ratio: int = 4) -> Recipe:
    """The recipe with num_layers layers and the d_model (a multiple of num_heads, d_ff =
    ff_ratio * d_model) whose parameter count is closest to `budget`."""
    check_int("num_layers", num_layers, minimum=1)
    check_int("budget", budget, minimum=1)
    check_int("ff_ratio", ff_ratio, minimum=1)
    h = recipe.num_heads

    def sized(units: int) -> Recipe:
        return recipe.replace(num_layers=num_layers, d_model=h * units, d_ff=ff_ratio * h * units)

    low, high = 1, 2
    while count_parameters(sized(high)) < budget:  # the count grows with the width
        low, high = high, 2 * high
    while high - low > 1:  # bisect: count(low) < budget <= count(high)
        middle = (low + high) // 2
        if count_parameters(sized(middle)) < budget:
            low = middle
        else:
            high = middle
    return min(sized(low), sized(high), key=lambda r: abs(count_parameters(r) - budget))


def train_until_solved(
    recipe: Recipe,
    eval_every: int = 50,
    n: int = 256,
    stop_when_solved: bool = False,
    progress: bool = False,
    model: Transformer | None = None,
) -> tuple[Transformer, dict]:
    """Train a fresh model (or `model`) by the recipe, scoring exact match on n test sequences
    every eval_every steps. The history gains "exact" [(step, correct)], "solved_step" and
    "solved_seconds": the first evaluation with all n right (None if none)."""
    model = build_model(recipe) if model is None else model
    solved = {"solved_step": None, "solved_seconds": None, "exact": []}

    def score(step: int, model: Transformer, history: dict) -> bool:
        correct = exact_match(model, n=n, max_len=recipe.max_len)
        solved["exact"].append((step, correct))
        if correct == n and solved["solved_step"] is None:
            solved["solved_step"], solved["solved_seconds"] = step, history["seconds"]
            return stop_when_solved
        return False

    history = fit(model, recipe, eval_every=eval_every, callback=score, progress=progress)
    history.update(solved)
    return model, history


def search_space(trial) -> dict:
    """The knobs the notebook's search tunes, as Optuna suggestions (`trial` an optuna.Trial)."""
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "warmup": trial.suggest_int("warmup", 0, 100),
        "dropout_p": trial.suggest_float("dropout_p", 0.0, 0.3),
        "weight_decay": trial.suggest_float("weight_decay", 1e-4, 1.0, log=True),
    }


def search_objective(base: Recipe, val_data: Batch, eval_every: int = 25) -> Callable:
    """An Optuna objective: train base with the trial's knobs, report the validation loss every
    eval_every steps so that a pruner can stop a poor trial, return the last one."""

    def objective(trial) -> float:
        import optuna  # imported here: the package does not need it otherwise

        recipe = base.replace(**search_space(trial))
        model = build_model(recipe)

        def report(step: int, model: Transformer, history: dict) -> bool:
            trial.report(history["val_loss"][-1], step)
            if trial.should_prune():
                raise optuna.TrialPruned()
            return False

        history = fit(model, recipe, val_data=val_data, eval_every=eval_every, callback=report)
        return history["val_loss"][-1]

    return objective


def make_study(sampler: str, seed: int = 0, pruner: bool = True, n_startup_trials: int = 5):
    """An Optuna study that minimises, with a seeded TPE or random sampler and a median pruner."""
    import optuna

    sampler = check_choice("sampler", sampler, ("tpe", "random"))
    if sampler == "tpe":
        chosen = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials)
    else:
        chosen = optuna.samplers.RandomSampler(seed=seed)
    median = optuna.pruners.MedianPruner(n_startup_trials=n_startup_trials, n_warmup_steps=0)
    return optuna.create_study(
        direction="minimize", sampler=chosen, pruner=median if pruner else optuna.pruners.NopPruner()
    )
