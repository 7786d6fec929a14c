# %% [markdown]
# # 11 · Training
#
# **What you will build:** everything it takes to train the Transformer of notebook 10 and to
# know that it learned: the reversal task (`make_batch`), teacher forcing with the causal mask,
# the paper's learning-rate schedule (`lr_lambda`), the training loop (`train_model`), an
# exact-match test on fresh sequences (`exact_match`), and checkpoints (`save_checkpoint`,
# `load_checkpoint`, `get_reversal_model`). Then the results of the blog tutorial "Deep Learning: Transformers" (the course's main
# source, README, "Where it comes from"; "the tutorial" from here on) are reproduced side by
# side with its numbers: the parameter count, the exact-match score (perfect or one short), and
# the initialisation ablation, with a script for a study over several seeds, since a trained
# model's numbers are findings of one run. On the way: the same run without its warm-up, how
# often the gradient is clipped, and what a half-trained model's mistakes look like. Last,
# label smoothing, and what it does to the model's confidence.
#
# The notebook trains the tutorial's model for 4,800 steps in all (six runs): about seven
# minutes from top to bottom on a quiet machine with a CPU thread to itself, and several times
# as long on a machine busy with other work (the appendix "Why this notebook stops at 2,500
# steps" gives measured times). The long cells show a progress bar and use the GPU when there
# is one.
#
# **On a first pass** the story is sections 1 to 3, section 4's ten-line `bare_update` (then skip
# the `Trainer` cell, the library's version of it with hooks for later notebooks), section 5
# without the two cells of the package's decoding loop, and sections 6 to 9. The appendices hold
# the rest: what the `Trainer`'s hooks are for, how to reproduce the stored run exactly (PyTorch's
# CPU kernels), checkpoints, and the package's decoding loop checked against the plain one.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/11_training.ipynb) · Assumes: [05 · Masking](05_masking.ipynb), [09 · Embeddings and the output head](09_embeddings_and_output_head.ipynb), [10 · The full model](10_full_model.ipynb).

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
import inspect
import math
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from matplotlib.ticker import NullFormatter
from matplotlib.patches import Patch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.masks import causal_mask, padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS, EOS, PAD
from transformer_from_scratch.utils import COLORS, get_device, save_figure, set_seed

set_seed(0)
device = get_device()
# Notebook 00's colours mean queries/keys/values and ours/PyTorch's; this notebook's curves are
# none of those, so they get their own: training loss dark grey, exact match purple, learning
# rate brown, a variant of the recipe (another schedule, init or loss) pink, gradient norm olive.
# Section 8's bars reuse two of them: dark grey for predictions from the true prefix (as the
# training loss is computed), purple for free-running decoding (as exact match is).
LOSS_COLOR, EM_COLOR, LR_COLOR, VARIANT_COLOR = "#404040", "#9467bd", "#8c564b", "#e377c2"
GRAD_COLOR = "#bcbd22"

# %% [markdown]
# The functions this notebook writes go into two modules of the package: `data` (the task) and
# `train` (the schedule, the loop, the evaluation and the checkpoints).

# %%
#| default_exp train

# %% [markdown]
# ## 1 · The task: reverse a sequence
#
# A model that trains in a few minutes on a CPU needs a task that needs no download and whose
# answer is checkable exactly. The tutorial's choice is **reversal**: the source is a random
# string of symbols $x_1 \dots x_L$, and the target is the same string backwards,
# $y_t = x_{L+1-t}$. The vocabulary holds the three reserved ids of notebook 09 (`PAD` = 0,
# `BOS` = 1, `EOS` = 2) and $V - 3$ symbols; lengths are uniform in $[3, L_\max]$.
#
# Why reversal and not copying? To copy, the decoder at target position $t$ must read source
# position $t$: the *same* diagonal for every sequence, which the positional encodings alone can
# supply. To reverse, it must read source position $L - 1 - t$ (counting both from 0), and $L$ differs
# from sequence to sequence: the cross-attention has to find where *this* source ends, from the
# content and the padding mask, and count back from there. A model that solves reversal has an
# alignment that really depends on its input; notebook 12 draws it.
#
# `make_batch` draws a whole batch at once: lengths first, then symbols for every slot, then
# `PAD` over the slots past each length. The reversal is a `gather` with the index $L - 1 - i$
# (0-based) in every row.

# %%
#| export data
"""The reversal task: random symbol sequences paired with their reversal, PAD-padded."""

import torch

from transformer_from_scratch.checks import check_int
from transformer_from_scratch.tokens import BOS, EOS, PAD

FIRST_SYMBOL = 3  # ids below it are PAD, BOS and EOS
MIN_LEN = 3  # the shortest sequence the task draws


def make_batch(
    batch_size: int, max_len: int, vocab_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A reversal batch (CPU): src (B, max_len), tgt_in, tgt_out (B, max_len + 1), lengths (B,)."""
    check_int("batch_size", batch_size, 1)
    check_int("max_len", max_len, MIN_LEN)
    check_int("vocab_size", vocab_size, FIRST_SYMBOL + 1)  # at least one real symbol
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must live on the CPU, got one on {generator.device}")
    B = batch_size
    lengths = torch.randint(MIN_LEN, max_len + 1, (B,), generator=generator)  # (B,)
    symbols = torch.randint(FIRST_SYMBOL, vocab_size, (B, max_len), generator=generator)
    positions = torch.arange(max_len)  # (L_max,)
    real = positions < lengths[:, None]  # (1, L_max) < (B, 1) -> (B, L_max)
    src = symbols.masked_fill(~real, PAD)  # (B, L_max)
    # Slot i of the reversal holds source slot L - 1 - i; past L the index is clamped, then padded.
    backwards = (lengths[:, None] - 1 - positions).clamp(min=0)  # (B, L_max)
    reversed_src = src.gather(1, backwards).masked_fill(~real, PAD)  # (B, L_max)
    tgt_in = torch.cat([torch.full((B, 1), BOS), reversed_src], dim=1)  # (B, L_max + 1)
    tgt_out = torch.cat([reversed_src, torch.full((B, 1), PAD)], dim=1)  # (B, L_max + 1)
    tgt_out[torch.arange(B), lengths] = EOS  # right after the L real symbols
    return src, tgt_in, tgt_out, lengths


# %% [markdown]
# The tutorial's setting: a vocabulary of $V = 12$ (nine symbols) and $L_\max = 8$.

# %%
VOCAB, MAX_LEN = 12, 8
generator = torch.Generator().manual_seed(0)
src, tgt_in, tgt_out, lengths = make_batch(4, MAX_LEN, VOCAB, generator=generator)
print("lengths:", lengths.tolist())
print("src    :", src[0].tolist())
print("tgt_in :", tgt_in[0].tolist())
print("tgt_out:", tgt_out[0].tolist())

# %% [markdown]
# **Check:** on a large batch, every row is what the task promises: the source is $L$ symbols
# then padding, `tgt_out` is the source reversed (checked against `torch.flip` row by row) and
# then `EOS`, `tgt_in` is `BOS` then the same reversal; every length from 3 to 8 occurs; and the
# same generator seed gives the same batch.

# %%
src, tgt_in, tgt_out, lengths = make_batch(1000, MAX_LEN, VOCAB, torch.Generator().manual_seed(1))
assert src.shape == (1000, MAX_LEN) and tgt_in.shape == tgt_out.shape == (1000, MAX_LEN + 1)
assert src.dtype == tgt_in.dtype == tgt_out.dtype == lengths.dtype == torch.long
assert set(lengths.tolist()) == set(range(3, MAX_LEN + 1))
for b in range(1000):
    L = int(lengths[b])
    seq = src[b, :L]
    assert (seq >= 3).all() and (seq < VOCAB).all() and (src[b, L:] == PAD).all()
    assert torch.equal(tgt_out[b, :L], torch.flip(seq, dims=[0])) and tgt_out[b, L] == EOS
    assert tgt_in[b, 0] == BOS and torch.equal(tgt_in[b, 1 : L + 1], torch.flip(seq, dims=[0]))
    assert (tgt_in[b, L + 1 :] == PAD).all() and (tgt_out[b, L + 1 :] == PAD).all()
again = make_batch(1000, MAX_LEN, VOCAB, torch.Generator().manual_seed(1))
assert all(torch.equal(x, y) for x, y in zip((src, tgt_in, tgt_out, lengths), again, strict=True))
print("1000 rows: reversal, BOS/EOS/PAD and lengths 3..8 as promised; same seed, same batch")

# %% [markdown]
# **Reversal needs an alignment that depends on the input's length; `make_batch` draws a padded
# batch of it in four tensor operations.**
#
# ## 2 · Teacher forcing and the causal mask
#
# The decoder is a next-token predictor. During training it does not read its own guesses: it
# reads the *correct* target shifted right by one, $\texttt{tgt\_in} = [\texttt{BOS}, y_1, \dots,
# y_L]$, and at every position $t$ it is graded on the next token, $\texttt{tgt\_out} = [y_1,
# \dots, y_L, \texttt{EOS}]$. This is **teacher forcing** (Williams & Zipser, 1989). Because all
# the inputs are known in advance, the $L + 1$ predictions of a sequence come out of **one**
# parallel forward pass, where generation (notebook 12) has to produce them one at a time.
#
# The price is a leak: the answer at position $t$ is the *input* at position $t + 1$. The
# causal mask of notebook 05 ($M_{ij} = [j \le i]$) closes it: position $t$ of the decoder may
# read `tgt_in` at positions $0 \dots t$ only, which is exactly what it will have at generation
# time. The source needs no such mask; its padding mask hides the `PAD` slots from the encoder
# and from the cross-attention. The target needs no padding mask either: its `PAD` slots come
# after every real position, so the causal mask already hides them from every position that is
# graded.
#
# The loss is the mean cross-entropy over the graded positions, with `ignore_index=PAD` so
# that padding is never graded:
#
# $$\mathcal{L} = -\frac{1}{N} \sum_{(b,t):\ \texttt{tgt\_out}_{bt} \ne \texttt{PAD}}
#     \log p_\theta\!\left(\texttt{tgt\_out}_{bt} \mid \texttt{src}_b,\ \texttt{tgt\_in}_{b,0..t}\right),$$
#
# with $N$ the number of graded positions (each sequence contributes $L + 1$: its symbols and
# the `EOS`).

# %% jupyter={"source_hidden": true}
# Token colours: not the course's query/key/value colours, since tokens are none of those.
TOKEN_COLORS = {"PAD": "#d9d9d9", "BOS": "#b3e2cd", "EOS": "#c5b0d5", "symbol": "#fff3d6"}
MAY_READ, HIDDEN = "#525252", "#eeeeee"


def draw_tokens(ax, rows: dict[str, torch.Tensor], title: str) -> None:
    """Draw token rows as coloured, labelled cells (PAD, BOS, EOS, symbols; -1: no slot)."""
    kinds = ["white", *(TOKEN_COLORS[k] for k in ("PAD", "BOS", "EOS", "symbol"))]
    ids = torch.stack(list(rows.values()))  # (rows, T)
    ax.imshow(ids.clamp(max=3).numpy(), cmap=ListedColormap(kinds), vmin=-1.5, vmax=3.5,
              aspect="auto")
    names = {PAD: "PAD", BOS: "BOS", EOS: "EOS"}
    for (r, t), v in np.ndenumerate(ids.numpy()):
        if v >= 0:
            ax.text(t, r, names.get(int(v), str(v)), ha="center", va="center", fontsize=8,
                    color="black")
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_xticks(range(ids.shape[1]))
    ax.set_xlabel("position $t$")
    ax.set_title(title, fontsize=10)


src, tgt_in, tgt_out, lengths = make_batch(2, MAX_LEN, VOCAB, torch.Generator().manual_seed(3))
fig = plt.figure(figsize=(13, 5), layout="constrained")
grid = fig.add_gridspec(2, 2, width_ratios=[1.5, 1])
for b in range(2):
    ax = fig.add_subplot(grid[b, 0])
    src_row = torch.cat([src[b], torch.tensor([-1])])  # src is one slot shorter: left blank
    draw_tokens(ax, {"src": src_row, "tgt_in (reads)": tgt_in[b], "tgt_out (predicts)": tgt_out[b]},
                f"example {b}: L = {int(lengths[b])}")
    for t in range(int(lengths[b])):  # the input at t + 1 is the answer at t
        ax.annotate("", xy=(t + 0.2, 1.72), xytext=(t + 0.8, 1.28),
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 1})
ax = fig.add_subplot(grid[:, 1])
mask = causal_mask(MAX_LEN + 1)[0, 0]  # (T, T)
ax.imshow(mask.int().numpy(), cmap=ListedColormap([HIDDEN, MAY_READ]), vmin=0, vmax=1)
labels = [{PAD: "PAD", BOS: "BOS"}.get(int(v), str(int(v))) for v in tgt_in[0]]
ax.set_xticks(range(MAX_LEN + 1), labels, fontsize=8)
answers = [{PAD: "not graded", EOS: "predicts EOS"}.get(int(v), f"predicts {int(v)}")
           for v in tgt_out[0]]
ax.set_yticks(range(MAX_LEN + 1), [f"position {t}: {a}" for t, a in enumerate(answers)], fontsize=8)
ax.set_xlabel("tgt_in token it may read (key)")
ax.set_ylabel("query: decoder position $t$")
ax.set_title("causal mask for example 0\n(dark: may read, light: hidden)", fontsize=10)
fig.legend(handles=[Patch(facecolor=c, edgecolor="grey", label=k) for k, c in TOKEN_COLORS.items()],
           loc="outside lower left", ncols=4, fontsize=9)
fig.suptitle("Teacher forcing: tgt_out is tgt_in shifted left by one (arrows); "
             "the causal mask hides the answer")
save_figure(fig, "training_teacher_forcing")
plt.show()

# %% [markdown]
# **Check:** the shift, and the mask's role, on the real model. `tgt_in[:, 1:]` equals
# `tgt_out[:, :-1]` wherever the latter is a symbol. Then, with an untrained Transformer in
# evaluation mode, change every `tgt_in` token after position $t$: with the causal mask the
# predictions at positions $\le t$ do not move at all; without it they do, because they can see
# the tokens they are meant to predict.

# %%
# tf_: this section's batch (names of its own: later cells draw other batches)
tf_src, tf_tgt_in, tf_tgt_out, tf_lengths = make_batch(64, MAX_LEN, VOCAB,
                                                      torch.Generator().manual_seed(2))
symbol = tf_tgt_out[:, :-1] >= 3
assert torch.equal(tf_tgt_in[:, 1:][symbol], tf_tgt_out[:, :-1][symbol])

set_seed(0)
probe = Transformer(VOCAB, VOCAB).to(device).eval()
tf_mask = padding_mask(tf_lengths, MAX_LEN).to(device)  # (B, 1, 1, L_max)
t = 3
changed = tf_tgt_in.clone()
changed[:, t + 1 :] = torch.randint(3, VOCAB, changed[:, t + 1 :].shape,
                                    generator=torch.Generator().manual_seed(5))
with torch.no_grad():
    for tgt_mask, should_match in ((causal_mask(MAX_LEN + 1, device=device), True), (None, False)):
        before = probe(tf_src.to(device), tf_tgt_in.to(device), src_mask=tf_mask, tgt_mask=tgt_mask)
        after = probe(tf_src.to(device), changed.to(device), src_mask=tf_mask, tgt_mask=tgt_mask)
        same = torch.equal(before[:, : t + 1], after[:, : t + 1])  # positions 0..t
        assert same == should_match, (tgt_mask is None, same)
print(f"positions 0..{t}: unchanged by later tokens with the causal mask, changed without it")

# %% [markdown]
# And the loss: what `F.cross_entropy(..., ignore_index=PAD)` computes is the formula above, the
# mean over the graded positions only. Here it is set against the formula computed by hand from
# the log-probabilities, and against the other reading of "ignore", the graded positions' sum
# divided by *all* $B \times T$ slots (padding counted as a zero loss), which is another number.
# This checks our reading of PyTorch's loss, not our code; section 4 checks the course's own
# `token_loss` against it. An untrained model guesses near uniformly, so the loss is close to
# $\ln V$, a little above it: random logits cost more than equal ones (by about half their
# variance), and how much depends on the draw of the weights.

# %%
with torch.no_grad():
    logits = probe(tf_src.to(device), tf_tgt_in.to(device), src_mask=tf_mask,
                   tgt_mask=causal_mask(MAX_LEN + 1, device=device))  # (B, T, V)
    target = tf_tgt_out.to(device)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
    log_p = logits.log_softmax(dim=-1).gather(-1, target[..., None])[..., 0]  # (B, T)
    graded = target != PAD  # (B, T): the L symbols and the EOS of each sequence
    assert_close(loss, -log_p[graded].mean())  # the mean over the N graded positions
    assert not torch.isclose(loss, -log_p[graded].sum() / graded.numel(), rtol=0.05)  # not / (B T)
    # random initial logits cost a little more than a uniform guess: over the seed offsets
    # 0, 1000, ..., 8000 the untrained loss lay 0.00 to 0.30 above ln V (0.02 here)
    assert -0.05 < loss.item() - math.log(VOCAB) < 0.5
print(f"untrained loss {loss.item():.3f} over N = {int(graded.sum())} graded positions of "
      f"{graded.numel()} slots,  vs  ln V = {math.log(VOCAB):.3f} (a uniform guess)")

# %% [markdown]
# **Teacher forcing makes training one parallel pass per batch; the causal mask is what keeps
# that pass honest, and `ignore_index=PAD` keeps padding out of the grade.**
#
# ## 3 · The learning-rate schedule
#
# Vaswani et al. (2017, §5.3) train with Adam ($\beta_1 = 0.9$, $\beta_2 = 0.98$,
# $\epsilon = 10^{-9}$) and a rate that rises linearly for $w$ *warmup* steps and then decays as
# the inverse square root of the step $s$:
#
# $$\mathrm{lr}(s) = d_\text{model}^{-1/2} \cdot \min\!\left(s^{-1/2},\; s \cdot w^{-3/2}\right).$$
#
# The two branches meet where $s^{-1/2} = s\,w^{-3/2}$, i.e. $s^{3/2} = w^{3/2}$, at $s = w$.
# Before it the linear branch is the smaller one, after it the decay, so the peak is at
# $s = w$ exactly, with value $\mathrm{lr}_\max = (d_\text{model}\, w)^{-1/2}$.
#
# Why warm up at all: at initialisation the attention weights are near uniform and Adam's second-moment
# estimate $v$ rests on a handful of gradients, so its steps are large and poorly aimed; a small
# rate for the first few hundred steps lets both settle (Liu et al., 2020, trace the problem to
# exactly that variance of Adam's early steps). Post-norm models, like the paper's, need it
# most; this notebook's model is pre-norm (notebook 08), and section 6 ("The same run without
# warm-up") tests whether it needs it.

# %%
#| export
"""Training on the reversal task: the paper's schedule, the loop, exact match and checkpoints."""

import collections
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any
from typing import ClassVar
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.data import make_batch
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.masks import causal_mask, padding_mask
from transformer_from_scratch.model import Transformer, TransformerConfig
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.utils import get_device, set_seed


def lr_lambda(step: int, d_model: int, warmup: int) -> float:
    """The paper's rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); step clamped to >= 1."""
    check_float("d_model", d_model, 0.0, low_open=True)
    check_float("warmup", warmup, 0.0, low_open=True)
    step = check_int("step", step, 0)
    step = max(step, 1)  # step 0 would divide by zero in step^-0.5
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


# %% [markdown]
# **Check:** over the integer steps, the largest rate is at `step == warmup` and equals
# $(d_\text{model} w)^{-1/2}$, for the paper's base setting ($d_\text{model} = 512$, $w = 4000$),
# the tutorial's ($128$, $400$) and the two mixed ones; the warmup is linear (twice the step,
# twice the rate) and the decay an inverse square root (four times the step, half the rate).

# %%
settings = [(128, 400), (128, 4000), (512, 400), (512, 4000)]
steps = np.arange(0, 20_001)
curves, report = {}, []
for d_model, warmup in settings:
    schedule_rates = np.array([lr_lambda(int(s), d_model, warmup) for s in steps])
    curves[d_model, warmup] = schedule_rates
    peak = int(steps[schedule_rates.argmax()])
    assert peak == warmup, (d_model, warmup, peak)
    assert math.isclose(schedule_rates.max(), (d_model * warmup) ** -0.5, rel_tol=1e-12)
    assert math.isclose(lr_lambda(warmup // 2, d_model, warmup), schedule_rates.max() / 2, rel_tol=1e-12)
    assert math.isclose(lr_lambda(4 * warmup, d_model, warmup), schedule_rates.max() / 2, rel_tol=1e-12)
    report.append(f"d_model {d_model:3d}, warmup {warmup:4d}: peak at step {peak:4d}, "
                  f"lr {schedule_rates.max():.3e}")
assert lr_lambda(0, 128, 400) == lr_lambda(1, 128, 400)  # clamped
print("\n".join(report))

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
styles = {128: "-", 512: "--"}
colors = {400: LR_COLOR, 4000: "#c49c94"}  # two browns: the warmup; the line style: d_model
for ax in axes:
    for (d_model, warmup), schedule_rates in curves.items():
        ax.plot(steps[1:], schedule_rates[1:], styles[d_model], color=colors[warmup], lw=1.6,
                label=f"$d_{{model}}$ = {d_model}, $w$ = {warmup}")
        ax.plot(warmup, schedule_rates[warmup], "o", color=colors[warmup], ms=5)
    ax.grid(alpha=0.3, which="both")
    ax.set_xlabel("training step $s$")
    ax.set_ylabel("learning rate")
axes[0].set_title("Linear axes: warmup, peak at $s = w$ (dots), decay")
axes[1].set(xscale="log", yscale="log", ylim=(1e-7, 1e-2),
            title="Log-log axes: slope $+1$, then slope $-1/2$")
axes[0].legend(fontsize=9)
save_figure(fig, "training_lr_schedule")
plt.show()

# %% [markdown]
# The paper's base model ($d_\text{model} = 512$, $w = 4000$) never goes above $7 \times 10^{-4}$;
# the tutorial's small model peaks about six times higher, at $4.4 \times 10^{-3}$, and ten times
# earlier. The scale $d_\text{model}^{-1/2}$ gives a narrower model larger steps, and a short
# run needs a short warmup: 400 steps are about a sixth (0.16) of the 2,500 this notebook trains
# for (section 6), where the paper's 4,000 were a twenty-fifth of its 100,000.
#
# **The schedule is the learning rate: it peaks at step $w$ at $(d_\text{model} w)^{-1/2}$ and
# then falls as $s^{-1/2}$.**
#
# ## 4 · The training loop
#
# One step: draw a fresh batch, run the model with both masks, take the cross-entropy, clip the
# gradient's global norm to 1 (Pascanu et al., 2013: a gradient whose norm is above 1 is scaled
# down to norm 1, its direction kept; section 6, "How often the gradient is clipped", counts how
# often that happens here), and let Adam
# and the schedule update the weights. The model is the
# tutorial's, `Transformer(12, 12)` with its defaults ($d_\text{model} = 128$, 4 heads,
# $d_{ff} = 512$, 2 layers each side, dropout 0.1).
#
# The loss of section 2, packaged, in two parts that the rest of the course reuses (notebooks 13
# and 15 evaluate, accumulate and train with the same two functions): `token_loss` is the
# cross-entropy of logits against target ids, PAD ignored, as a mean over the real tokens or as
# their sum (to be divided by the tokens of several batches together, notebook 13); and
# `sequence_loss` is the forward pass with both masks, then `token_loss`. Logits in a 16-bit
# float (notebook 13's mixed precision) are cast to float32 before the loss, so the softmax and
# its log are computed in float32; the logits keep the 16-bit rounding they came with, which no
# cast can undo. (Inside a GPU autocast region `cross_entropy` runs in float32 anyway; the cast
# makes it so wherever the loss is computed.) `num_tokens` counts what the loss grades.

# %%
#| export
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # src, tgt_in, tgt_out, lengths


def token_loss(
    logits: torch.Tensor,  # (B, T, V)
    tgt_out: torch.Tensor,  # (B, T) target ids, PAD where there is no token
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of every real target token: their mean, or their sum (reduction="sum")."""
    check_choice("reduction", reduction, ("mean", "sum"))
    if logits.dtype in (torch.float16, torch.bfloat16):  # autocast: the loss in float32
        logits = logits.float()
    return F.cross_entropy(
        logits.flatten(0, 1),  # (B, T, V) -> (B*T, V)
        tgt_out.flatten(),  # (B, T) -> (B*T,)
        ignore_index=PAD,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


def sequence_loss(
    model: Transformer, batch: Batch, label_smoothing: float = 0.0, reduction: str = "mean"
) -> torch.Tensor:
    """token_loss of a (src, tgt_in, tgt_out, src_lengths) batch: the model with both masks."""
    _check_seq2seq_batch(batch, "sequence_loss")
    device = next(model.parameters()).device
    src, tgt_in, tgt_out, lengths = (t.to(device) for t in batch)
    src_mask = padding_mask(lengths, src.size(1))  # (B, 1, 1, T_src): hide the source's padding
    tgt_mask = causal_mask(tgt_in.size(1), device=device)  # (1, 1, T, T): hide the future
    logits = model(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # (B, T, V)
    return token_loss(logits, tgt_out, label_smoothing, reduction)


def num_tokens(batch: Batch) -> int:
    """How many target positions of a batch the loss grades (everything but PAD)."""
    _check_seq2seq_batch(batch, "num_tokens")
    return int((batch[2] != PAD).sum())


def _check_seq2seq_batch(batch: Batch, name: str) -> None:
    """A TypeError, naming the way out, for a batch that is not (src, tgt_in, tgt_out, lengths):
    the Trainer's defaults are this task's; another task brings loss_fn and count_fn."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 4:
        got = f"{len(batch)} items" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise TypeError(
            f"{name} wants an encoder-decoder batch (src, tgt_in, tgt_out, src_lengths), got "
            f"{got}; for another model give the Trainer its own loss_fn and count_fn"
        )


# %% [markdown]
# **Check:** `token_loss` is section 2's loss. On the same batch and the same untrained model,
# its mean equals the mean computed there by hand; `num_tokens` counts $\sum_b (L_b + 1)$
# positions, the symbols and the `EOS` of each sequence, computed here from the lengths; the sum
# divided by `num_tokens` is the mean again; and `sequence_loss`, which runs the model itself
# with both masks, gives the same number. A `token_loss` that let `PAD` into the mean, or lined
# logits and targets up wrongly when it flattens them, would fail here.

# %%
tf_batch = (tf_src, tf_tgt_in, tf_tgt_out, tf_lengths)
with torch.no_grad():
    tf_logits = probe.eval()(tf_src.to(device), tf_tgt_in.to(device), src_mask=tf_mask,
                             tgt_mask=causal_mask(MAX_LEN + 1, device=device))  # (B, T, V)
    tf_target = tf_tgt_out.to(device)  # (B, T)
    tf_log_p = tf_logits.log_softmax(dim=-1).gather(-1, tf_target[..., None])[..., 0]  # (B, T)
    tf_by_hand = -tf_log_p[tf_target != PAD].mean()  # section 2's formula
    assert num_tokens(tf_batch) == int((tf_lengths + 1).sum())  # L symbols and EOS each
    assert_close(token_loss(tf_logits, tf_target), tf_by_hand)
    assert_close(token_loss(tf_logits, tf_target, reduction="sum") / num_tokens(tf_batch), tf_by_hand)
    assert_close(sequence_loss(probe, tf_batch), tf_by_hand)
print(f"token_loss, its sum / num_tokens and sequence_loss: section 2's mean over "
      f"{num_tokens(tf_batch)} graded positions")


# %% [markdown]
# With the loss packaged, one training step is ten lines: a fresh batch in, the loss, its
# gradient, the clip, the optimizer's step and the schedule's. This is the whole of it; training
# is `bare_update` called once per batch:

# %%
def bare_update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, batch: Batch,
                clip_norm: float = 1.0) -> float:
    """One training step and nothing else; returns the batch's loss."""
    model.train()  # dropout on
    optimizer.zero_grad(set_to_none=True)
    loss = sequence_loss(model, batch)  # forward with both masks, then the cross-entropy
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), clip_norm)  # global norm above clip_norm: scaled down
    optimizer.step()
    scheduler.step()  # the rate of the next update
    return loss.item()


# %% [markdown]
# The course writes this loop once, for the library, as the class `Trainer`. Notebook 13 adds
# mixed precision and gradient accumulation to it, notebook 15 a validation curve, early stopping
# and several processes; none of them writes a second loop (notebook 14 times a bare step of its
# own, to measure the arithmetic and nothing else). They *extend* this one through callbacks, as
# minGPT's `Trainer` is extended (there `register_callback(event, fn)`, with one event,
# `on_batch_end`); ours has three fixed places in the update where a callback may run, and two
# methods a subclass may replace.
#
# **On a first pass, skip the next cell.** `Trainer.update` is `bare_update` plus the callbacks,
# a list of micro-batches in place of the one batch, and a history of the loss, the rate and the
# gradient norm; the second check after it shows that with no callbacks it *is* `bare_update`,
# bit for bit. Its other keywords are hooks for notebooks 13 and 15, unused here; the appendix
# "The `Trainer`'s hooks for later notebooks" says what each one is for.
#
# `accumulate_gradients` runs the backward pass of one or more *micro-batches* (pieces of one
# batch, for when the whole does not fit in memory, notebook 13). Each micro-batch's mean loss
# is weighted by its share of the graded tokens, $n_i / \sum_j n_j$, so that the gradients add
# up to those of one pass over all the tokens together (checked below); with a single
# micro-batch the weight is 1 and it is the plain `loss.backward()`.
#
# `Trainer.update` is the step: run the `before_update` callbacks (a rate set by hand goes
# there, notebook 15's range test), zero the gradients, accumulate, run the `after_backward`
# callbacks (the gradients are complete and unscaled there: the place to measure them), clip the
# global norm, record the rate, step the optimizer and the schedule, record the loss, run the
# `after_update` callbacks.
#
# `trainer.step` counts the updates: a `before_update` callback sees
# those done so far (0 at first), an `after_backward` or `after_update` callback the number of
# the update it is in (1 for the first). The history gets this update's rate and loss only after
# the optimizer's step, so an `after_backward` callback that reads `history["loss"][-1]` reads
# the previous update's. `fit` repeats `update` over an iterator of micro-batch lists, with a
# progress bar; an `after_update` callback that returns `True` stops the run (early stopping).

# %%
#| export
def accumulate_gradients(
    model: nn.Module,
    micro_batches: list[Batch],
    label_smoothing: float = 0.0,
    total_tokens: "int | torch.Tensor | None" = None,
    scale: float = 1.0,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    scaler: "torch.amp.GradScaler | None" = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    loss_fn: "Callable[[nn.Module, Any], torch.Tensor] | None" = None,
    count_fn: "Callable[[Any], int] | None" = None,
) -> float:
    """Backward through every micro-batch, each mean loss weighted by its share of the tokens.

    The gradients add up to those of one pass over the concatenated batch (the mean over all its
    graded tokens). `total_tokens` and `scale` let a distributed run count every process's tokens;
    `autocast()` wraps each forward pass, `scaler` scales each loss before its backward, and
    `no_sync()` wraps all but the last micro-batch. Another task brings its own micro-batches,
    `loss_fn(model, batch)` (their mean loss per graded token; default: sequence_loss with
    label_smoothing) and `count_fn(batch)` (their graded tokens; default: num_tokens). Returns
    the loss of the whole batch (with `total_tokens` of several processes: this process's share
    of it)."""
    if not micro_batches:
        raise ValueError("accumulate_gradients needs at least one micro-batch")
    if loss_fn is None:
        loss_fn = partial(sequence_loss, label_smoothing=label_smoothing)
    elif label_smoothing:
        raise ValueError("label_smoothing is sequence_loss's: give loss_fn its own smoothing")
    counts = [(num_tokens if count_fn is None else count_fn)(b) for b in micro_batches]
    total = sum(counts) if total_tokens is None else total_tokens
    if int(total) == 0:
        raise ValueError("the micro-batches hold no graded token (every target is PAD)")
    loss_sum = 0.0
    for i, (batch, count) in enumerate(zip(micro_batches, counts, strict=True)):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if no_sync is None or last else no_sync():
            with contextlib.nullcontext() if autocast is None else autocast():
                loss = loss_fn(model, batch) * (count * scale / total)
            (loss if scaler is None else scaler.scale(loss)).backward()
        loss_sum += loss.item()
    return loss_sum / scale


class Trainer:
    """The course's one training loop: updates from micro-batches, with callbacks.

    trainer = Trainer(model, optimizer, scheduler, clip_norm=1.0)
    trainer.add_callback("after_update", fn)  # fn(trainer); a True result stops fit()
    history = trainer.fit(batches, steps)     # batches: an iterator of micro-batch lists
    """

    EVENTS = ("before_update", "after_backward", "after_update")

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: "torch.optim.lr_scheduler.LRScheduler | None" = None,
        *,
        label_smoothing: float = 0.0,
        clip_norm: float = 1.0,
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        scaler: "torch.amp.GradScaler | None" = None,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        loss_fn: "Callable[[nn.Module, Any], torch.Tensor] | None" = None,
        count_fn: "Callable[[Any], int] | None" = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.label_smoothing = check_probability("label_smoothing", label_smoothing)
        self.clip_norm = check_float("clip_norm", clip_norm, 0.0, low_open=True)
        self.autocast, self.scaler, self.no_sync = autocast, scaler, no_sync
        if label_smoothing and loss_fn is not None:
            raise ValueError("label_smoothing is sequence_loss's: give loss_fn its own smoothing")
        for name, fn in (("loss_fn", loss_fn), ("count_fn", count_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        self.loss_fn, self.count_fn = loss_fn, count_fn  # None: the translation task's
        self.gradient_scale = 1.0  # a distributed trainer sets the number of processes
        self.callbacks: dict[str, list[Callable]] = {event: [] for event in self.EVENTS}
        # per update: its loss, its rate, and the gradient norm before clipping
        self.history: dict[str, list[float]] = {"loss": [], "lr": [], "grad_norm": []}
        self.step = 0  # updates done; from after_backward on, the number of the current one
        self.should_stop = False  # set when an after_update callback returns True
        self.seconds = self.cpu_seconds = 0.0  # in update(), the after_update callbacks excluded

    def add_callback(self, event: str, fn: Callable[["Trainer"], bool | None]) -> "Trainer":
        """Run fn(trainer) at `event` (one of Trainer.EVENTS) of every update."""
        check_choice("event", event, self.EVENTS)
        if not callable(fn):
            raise TypeError(f"a callback must be callable, got {type(fn).__name__}")
        self.callbacks[event].append(fn)
        return self

    def _run(self, event: str) -> bool:
        stop = False
        for fn in self.callbacks[event]:
            stop = bool(fn(self)) or stop
        return stop

    def count_tokens(self, micro_batches: list[Batch]) -> int:
        """The graded tokens of the whole update (a distributed trainer counts every process's)."""
        return sum((num_tokens if self.count_fn is None else self.count_fn)(b) for b in micro_batches)

    def accumulate(self, micro_batches: list[Batch]) -> float:
        """The backward passes of one update (accumulate_gradients with this trainer's options)."""
        return accumulate_gradients(
            self.model, micro_batches, self.label_smoothing, self.count_tokens(micro_batches),
            self.gradient_scale, autocast=self.autocast, scaler=self.scaler, no_sync=self.no_sync,
            loss_fn=self.loss_fn, count_fn=self.count_fn,
        )  # fmt: skip

    def update(self, micro_batches: list[Batch]) -> float:
        """One optimizer step from a list of micro-batches; returns its loss."""
        start, cpu_start = time.perf_counter(), time.process_time()
        self.model.train()  # dropout on (a callback may have evaluated)
        self._run("before_update")
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(micro_batches)
        self.step += 1
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # true gradients, to measure and to clip
        self._run("after_backward")
        norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm)  # before clipping
        self.history["grad_norm"].append(float(norm))  # > clip_norm: this update was clipped
        self.history["lr"].append(self.optimizer.param_groups[0]["lr"])  # this update's rate
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped if a float16 gradient overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.history["loss"].append(loss)
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time of the work, not of its launch
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu_start
        self.should_stop = self._run("after_update")
        return loss

    def fit(
        self,
        batches: Iterable[list[Batch]],
        steps: int | None = None,
        *,
        progress: "bool | tqdm" = False,  # or a bar to advance
        desc: str = "training",
        leave: bool = True,
    ) -> dict[str, list[float]]:
        """update() on each micro-batch list of `batches` (at most `steps` of them); returns the
        history. `progress`: True for a bar of its own, or a tqdm bar to advance (one bar for
        several fit calls, notebook 13)."""
        if steps is not None:
            check_int("steps", steps, 1)
            batches = itertools.islice(batches, steps)
        own_bar = isinstance(progress, bool)
        # One redraw a second at most: each redraw is a message to the notebook (notebook 13).
        bar = tqdm(total=steps, desc=desc, unit="step", mininterval=1.0, leave=leave,
                   disable=not progress) if own_bar else progress  # fmt: skip
        try:
            for micro_batches in batches:
                loss = self.update(micro_batches)
                bar.update(1)
                if self.step % 50 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                if self.should_stop:
                    break
        finally:
            if own_bar:
                bar.close()
        return self.history


# %% [markdown]
# **Check:** the events fire in their order, once per update; `after_backward` sees the gradient
# before clipping and `after_update` sees it clipped; a `True` from an `after_update` callback
# stops `fit`. With `clip_norm=1e-3` every gradient of a fresh model is far larger than the
# bound, so the two norms must differ: were the clipping done before the `after_backward`
# callbacks, or not at all, an assert below would fail; and the step SGD takes, measured on the
# weights, must be that of the clipped gradient (clipping after the optimizer's step would pass
# the first two asserts and fail this one). (`trainer.step` counts the updates
# done: 0 in the first `before_update`, 1 once the first backward pass is in.)

# %%
def gradient_norm(model: nn.Module) -> float:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def recorder(event: str, log: list, norms: list, moves: list) -> Callable[[Trainer], bool]:
    def callback(t: Trainer) -> bool:
        log.append((t.step, event))
        weights = torch.cat([p.detach().flatten() for p in t.model.parameters()])
        if event == "before_update":
            moves.append(weights)  # to measure the step the optimizer takes
        else:
            norms.append((event, gradient_norm(t.model)))
        if event == "after_update":
            moves[-1] = (weights - moves[-1]).norm().item()
        return event == "after_update" and t.step == 3  # stop after the third update

    return callback


with torch.random.fork_rng():  # the global generator's state is left as it was
    torch.manual_seed(0)
    demo = Transformer(VOCAB, VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=1, dropout_p=0.0)
    demo_trainer = Trainer(demo, torch.optim.SGD(demo.parameters(), lr=0.1), clip_norm=1e-3)
    events, norms, moves = [], [], []
    for event in Trainer.EVENTS:
        demo_trainer.add_callback(event, recorder(event, events, norms, moves))
    demo_batches = ([make_batch(8, MAX_LEN, VOCAB, torch.Generator().manual_seed(i))] for i in range(100))
    demo_history = demo_trainer.fit(demo_batches, steps=10)

assert events == [(s - 1, "before_update") if e == 0 else (s, Trainer.EVENTS[e])
                  for s in (1, 2, 3) for e in range(3)]  # fmt: skip
assert demo_trainer.step == len(demo_history["loss"]) == 3  # stopped after 3 of 10
for (_, before), (_, after) in zip(norms[0::2], norms[1::2], strict=True):
    assert before > 100 * demo_trainer.clip_norm and abs(after - demo_trainer.clip_norm) < 1e-6
# SGD steps by lr times the gradient it is given: 0.1 x 1e-3 only if it got the clipped one
assert all(abs(move - 0.1 * demo_trainer.clip_norm) < 1e-6 for move in moves)
for k in range(3):
    print(f"update {k + 1}: " + " -> ".join(f"{e} (step {s})" for s, e in events[3 * k : 3 * k + 3]))
print("after_backward: gradient norm > 100 x clip_norm; after_update: clip_norm")


# %% [markdown]
# **Check:** the library's loop is the bare one, and accumulation is one big batch. Two copies
# of a small model (the same weights, no dropout), one trained by `bare_update` and one by a
# `Trainer` with no callbacks, on the same five batches with Adam and the paper's schedule, must
# record the same losses and end with the same weights, bit for bit (a `Trainer` that clipped
# after the step, or stepped the schedule twice, would not). Then `accumulate_gradients` over
# three micro-batches of one batch of 24 must give the gradient of the whole batch in one pass,
# up to rounding; the control is the plain mean of the three micro-batches' losses, which weights
# each piece equally whatever its number of tokens, and gives another gradient.

# %%
def small_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(VOCAB, VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=1, dropout_p=0.0)


def adam_with_schedule(m: nn.Module):
    optimizer = torch.optim.Adam(m.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s + 1, 16, 4))


def flat_gradient(m: nn.Module, backward: Callable[[], object]) -> torch.Tensor:
    m.zero_grad(set_to_none=True)
    backward()
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])


with torch.random.fork_rng():  # the global generator's state is left as it was
    bare_model, library_model, untrained_model = small_model(), small_model(), small_model()
    small_batches = [make_batch(8, MAX_LEN, VOCAB, torch.Generator().manual_seed(i)) for i in range(5)]
    bare_optimizer, bare_scheduler = adam_with_schedule(bare_model)
    bare_losses = [bare_update(bare_model, bare_optimizer, bare_scheduler, b) for b in small_batches]
    library_losses = Trainer(library_model, *adam_with_schedule(library_model)).fit(
        [b] for b in small_batches)["loss"]
    whole = make_batch(24, MAX_LEN, VOCAB, torch.Generator().manual_seed(5))
    pieces = [tuple(t[i : i + 8] for t in whole) for i in (0, 8, 16)]  # three micro-batches
    g_whole = flat_gradient(bare_model, lambda: sequence_loss(bare_model, whole).backward())
    g_accumulated = flat_gradient(bare_model, lambda: accumulate_gradients(bare_model, pieces))
    g_plain_mean = flat_gradient(
        bare_model, lambda: (sum(sequence_loss(bare_model, p) for p in pieces) / 3).backward())

assert bare_losses == library_losses
assert all(torch.equal(a, b) for a, b in zip(bare_model.state_dict().values(),
                                             library_model.state_dict().values(), strict=True))
assert not torch.equal(bare_model.out_proj.weight, untrained_model.out_proj.weight)  # it trained
piece_tokens = [num_tokens(p) for p in pieces]
assert len(set(piece_tokens)) > 1  # pieces of different sizes: the control can tell
relative = {name: ((g - g_whole).norm() / g_whole.norm()).item()
            for name, g in (("accumulated", g_accumulated), ("plain mean", g_plain_mean))}
assert relative["accumulated"] < 1e-5 and relative["plain mean"] > 1e-3
print("Trainer without callbacks = bare_update: the same 5 losses, the same weights, bit for bit")
print(f"3 micro-batches of {' + '.join(map(str, piece_tokens))} tokens: accumulate_gradients "
      "gives the whole batch's gradient (relative difference < 1e-5); the plain mean of the "
      "three losses does not (> 1e-3)")


# %% [markdown]
# The loop. Adam gets a base rate of 1.0 because `LambdaLR` *multiplies* the base rate by the
# lambda, so the schedule is the actual rate. `LambdaLR` asks for the rate of the first update
# with step 0, so the lambda is shifted by one: update $s$ (counting from 1) uses
# $\mathrm{lr}(s)$, and the peak falls on update $w$ exactly. Given a generator (`train_reversal` passes one), the batches come from their own
# `torch.Generator`, so the data do not depend on how many random numbers the model's
# initialisation or dropout consumed: two models trained with the same generator seed see the
# same batches, in the same order.
#
# Its `callback(step, model)` is a shorthand for the runs of this notebook, which only evaluate
# or keep a snapshot: `train_model` wraps it into an `after_update` callback of the `Trainer`,
# whose callbacks receive the trainer itself (`fn(trainer)`, as above).

# %%
#| export
def train_model(
    model: Transformer,
    steps: int,
    *,
    batch_size: int = 64,
    max_len: int = 8,
    warmup: int = 400,
    label_smoothing: float = 0.0,
    clip_norm: float = 1.0,
    generator: torch.Generator | None = None,
    log_every: int = 0,
    callback: Callable[[int, Transformer], None] | None = None,
    schedule: Callable[[int], float] | None = None,
    progress: bool = False,
) -> dict[str, list[float]]:
    """Train on fresh reversal batches (Adam, the paper's schedule); return the history per step.

    `callback(step, model)`, if given, runs after every update (to evaluate or snapshot).
    `schedule(s)`, if given, is the rate of update s (from 1) instead of lr_lambda(s, d, warmup).
    `progress=True` shows a progress bar (tqdm.auto: a widget in Jupyter, text elsewhere).
    """
    check_int("steps", steps, 1)
    if schedule is not None and not callable(schedule):
        raise TypeError(f"schedule must be callable (step -> rate), got {type(schedule).__name__}")
    vocab_size = model.tgt_embed.num_embeddings
    rate = schedule if schedule is not None else partial(lr_lambda, d_model=model.d_model, warmup=warmup)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    # Base rate 1.0 times the lambda: the schedule is the rate. +1: update s uses lr(s).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: rate(s + 1))
    trainer = Trainer(model, optimizer, scheduler, label_smoothing=label_smoothing, clip_norm=clip_norm)
    if log_every:
        def log(t: Trainer) -> None:
            if t.step % log_every == 0:
                loss, lr = t.history["loss"][-1], t.history["lr"][-1]
                print(f"step {t.step:5d}  loss {loss:.4f}  lr {lr:.2e}")

        trainer.add_callback("after_update", log)
    if callback is not None:
        trainer.add_callback("after_update", lambda t: callback(t.step, t.model) and None)
    # Fresh batches, one micro-batch per update, drawn on the CPU from their own generator.
    batches = ([make_batch(batch_size, max_len, vocab_size, generator=generator)] for _ in range(steps))
    return trainer.fit(batches, steps, progress=progress)


# %% [markdown]
# A *recipe* pins down everything the result depends on, and `train_reversal` follows it:
# seed the global generator (weights and dropout), build the model, and train it on batches
# from a generator of its own (seed + 1). Trained on the CPU with the same PyTorch, the same CPU
# kernel and one thread, the same recipe gives the same weights, bit for bit, every time, which
# is what lets this notebook store its outputs and notebook 12 rebuild this exact model when no
# checkpoint is around.
#
# The condition that is easy to miss is the *CPU kernel*: PyTorch has one version of its CPU
# kernels per set of vector instructions, they round some operations differently, and the stored
# outputs were made under the AVX2 one. The appendix "Reproducing the stored run: CPU kernels"
# says why that matters and how to run under it. On a first pass it is enough to know that
# under another kernel, on another kind of CPU or on a GPU, your run is another run of the same
# recipe, like another seed: the numbers this notebook quotes from "the stored run" are then not
# yours, while the checks assert bounds with margins. Most of them held for every seed of a
# study over several seeds, and section 7 lists the few that were checked on the stored run
# only; they are meant to pass for your run too.
#
# The recipe is a frozen dataclass, `ReversalRecipe` (nanoGPT's `GPTConfig` is a dataclass too;
# ours is also frozen and checks itself): typed fields with
# the tutorial's values as defaults, checked when it is made, and immutable, so a run cannot
# change the recipe it was given. The model's part of it is handed over as notebook 10's
# `TransformerConfig` (`recipe.model_config`), which is what `train_reversal` builds: the
# architecture is described in one place, the recipe adds the data and the training. `REVERSAL_RECIPE` is the default one; `reversal_recipe(**changes)`
# returns a copy with some fields changed (`dataclasses.replace`), and names the known fields
# when a keyword is misspelt. `train_reversal` takes the same keywords.
#
# Two entries are there for the experiments further down: `embedding_init="default"` redraws the
# two embedding tables from PyTorch's default $\mathcal{N}(0, 1)$ (with their own generator, so
# the rest of the model and the dropout masks are the same), and `label_smoothing`.
# `build_reversal_model(recipe)` draws the model a recipe describes; notebook 15's `Recipe`
# extends this class with the training choices that `train_model` fixes (optimiser, schedule,
# clipping), so there is one description of a reversal run, not two.
#
# `train_reversal` trains on the CPU unless it is given a `device` (section 6's main run passes
# the notebook's `device`); `get_reversal_model` (appendix "Checkpoints"), which notebook 12
# calls, picks the best device by itself.

# %%
#| export
@dataclasses.dataclass(frozen=True)
class ReversalRecipe:
    """All a reversal run depends on: the model's sizes, the batches, the schedule, the seed."""

    vocab_size: int = 12
    max_len: int = 8
    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 2
    dropout_p: float = 0.1
    batch_size: int = 64
    steps: int = 2500
    warmup: int = 400
    label_smoothing: float = 0.0
    embedding_init: str = "paper"  # or "default": nn.Embedding's N(0, 1)
    seed: int = 0

    # The fewest warm-up steps allowed: the paper's schedule needs at least one.
    min_warmup: ClassVar[int] = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "num_heads", "d_ff", "num_layers",
                     "batch_size", "steps"):
            check_int(name, getattr(self, name), 1)
        check_int("warmup", self.warmup, self.min_warmup)
        check_int("seed", self.seed, 0)
        check_probability("dropout_p", self.dropout_p)
        check_probability("label_smoothing", self.label_smoothing)
        check_choice("embedding_init", self.embedding_init, ("paper", "default"))

    @property
    def model_config(self) -> TransformerConfig:
        """The architecture this recipe trains, as notebook 10's configuration: its vocabulary
        on both sides, its sizes and its dropout."""
        return TransformerConfig(
            self.vocab_size, self.vocab_size, d_model=self.d_model, num_heads=self.num_heads,
            d_ff=self.d_ff, num_layers=self.num_layers, dropout_p=self.dropout_p,
        )  # fmt: skip


REVERSAL_RECIPE = ReversalRecipe()  # the tutorial's recipe, as this notebook trains it


def reversal_recipe(**changes) -> ReversalRecipe:
    """REVERSAL_RECIPE with `changes` applied; an unknown key is a ValueError naming the known."""
    known = [field.name for field in dataclasses.fields(ReversalRecipe)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ValueError(f"unknown recipe keys {unknown}; known: {known}")
    return dataclasses.replace(REVERSAL_RECIPE, **changes)


def build_reversal_model(recipe: ReversalRecipe) -> Transformer:
    """The recipe's Transformer on the CPU, its weights drawn after torch.manual_seed(seed); with
    embedding_init="default", both embedding tables redrawn from N(0, 1) (generator seed + 2)."""
    torch.manual_seed(recipe.seed)
    model = Transformer(recipe.model_config)
    if recipe.embedding_init == "default":
        embedding_generator = torch.Generator().manual_seed(recipe.seed + 2)
        with torch.no_grad():
            for embedding in (model.src_embed, model.tgt_embed):
                nn.init.normal_(embedding.weight, 0.0, 1.0, generator=embedding_generator)
                embedding.weight[PAD].zero_()  # what nn.Embedding's own init does too
    return model


def train_reversal(
    log_every: int = 0,
    callback: Callable[[int, Transformer], None] | None = None,
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
    schedule: Callable[[int], float] | None = None,
    **changes,
) -> tuple[Transformer, dict[str, list[float]]]:
    """Build a reversal model as the recipe says, train it on `device`; return it and its history.

    `changes` are recipe fields (`steps=800`, `embedding_init="default"`, ...). The weights are
    drawn on the CPU, so they are the same on every device; on a GPU the dropout masks come from
    the GPU's generator, so a GPU run is another run of the same recipe.
    """
    recipe = reversal_recipe(**changes)
    set_seed(recipe.seed)  # the weights and the dropout masks
    model = build_reversal_model(recipe).to(device)
    history = train_model(
        model,
        recipe.steps,
        batch_size=recipe.batch_size,
        max_len=recipe.max_len,
        warmup=recipe.warmup,
        label_smoothing=recipe.label_smoothing,
        generator=torch.Generator().manual_seed(recipe.seed + 1),  # the batches
        log_every=log_every,
        callback=callback,
        schedule=schedule,
        progress=progress,
    )
    return model.eval(), history


# %% [markdown]
# The tutorial's model, counted: it reports 930,828 parameters.

# %%
RECIPE = reversal_recipe()
set_seed(0)
n_params = sum(p.numel() for p in Transformer(VOCAB, VOCAB).parameters())
assert n_params == 930_828
print(f"parameters: {n_params:,}")


# %% [markdown]
# **A recipe (model, batches, schedule, seed) is all it takes to train; with the same PyTorch,
# CPU kernel and thread count it fixes the result bit for bit.**
#
# ## 5 · Did it learn? Greedy decoding and exact match
#
# A low loss under teacher forcing is not yet a working model: at test time the decoder reads
# its *own* previous outputs, and a single wrong token derails what follows. The real test is
# generation. **Greedy decoding** takes the most likely token at every step,
# $\hat y_t = \arg\max_v p(v \mid \hat y_{<t}, x)$, and feeds it back as the next input (the
# softmax is monotone, so the argmax of the logits will do). Three details make it work on a
# batch:
#
# - **The encoder runs once.** The source does not change while we generate, so `enc_out` is
#   computed before the loop and read by every step.
# - **Each sequence stops on its own.** A row that has emitted `EOS` is finished and receives
#   `PAD` from then on, so the result is a rectangle `(B, ≤ max_new_tokens + 1)`, `BOS` first,
#   like a padded target batch. The loop ends when every row has finished, or after
#   `max_new_tokens` steps.
# - **Dropout is off**, and the model is handed back in the mode it came in.
#
# The simplest form re-runs the decoder over the whole prefix at every step and checks after
# every step whether all rows are done:

# %%
@torch.no_grad()
def plain_greedy_decode(
    model: Transformer, src: torch.Tensor, max_new_tokens: int, src_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Most-likely-token decoding: (B, T_src) -> (B, <= max_new_tokens + 1), starting with BOS."""
    was_training = model.training
    model.eval()  # no dropout while generating
    try:
        enc_out = model.encode(src, src_mask=src_mask)  # (B, T_src, d_model), computed once
        B = src.size(0)
        ys = torch.full((B, 1), BOS, dtype=torch.long, device=src.device)  # (B, 1)
        finished = torch.zeros(B, dtype=torch.bool, device=src.device)  # (B,)
        for _ in range(max_new_tokens):
            T = ys.size(1)
            dec_out = model.decode(
                ys, enc_out, self_mask=causal_mask(T, device=src.device), cross_mask=src_mask
            )  # (B, T, d_model)
            logits = model.out_proj(dec_out[:, -1])  # the last position only: (B, V)
            next_token = logits.argmax(dim=-1).masked_fill(finished, PAD)  # (B,)
            ys = torch.cat([ys, next_token[:, None]], dim=1)  # (B, T) -> (B, T + 1)
            finished |= next_token == EOS
            if finished.all():
                break
    finally:
        model.train(was_training)
    return ys


# %% [markdown]
# The package's `greedy_decode` (in the `decoding` module, which notebook 12 extends with beam
# search and sampling) is this loop with five changes: it checks its arguments, shares one loop
# (`generate`) with every decoding strategy, returns each row's log-probability with its tokens,
# can keep a key/value cache (notebook 12), and waits for the device only every 8 steps. Without
# the cache none of them changes a token. (Leave the cache off in this notebook: `use_cache=True`
# builds a `KVCache`, the class notebook 12 adds to the module, so here it would stop with a
# `NameError`.) The rest of this notebook decodes with it, so its code
# comes here, in the next two code cells; **a first reading can skip them**, up to "A sequence
# counts as correct" below, and read `greedy_decode(model, src, max_new_tokens=...).tokens` as
# `plain_greedy_decode` under another name. The appendix "Checking `greedy_decode` against the
# plain loop" explains the five changes and compares the two loops token for token.
#
# First the context manager for the mode (the library's one way to switch dropout off for a
# while: every module's mode is given back as it was, even if the block raises), the result
# type and the checks:

# %%
#| export decoding
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_from_scratch.checks import (
    check_bool,
    check_int,
    check_mask,
    check_tensor,
    validated,
)
from transformer_from_scratch.layers import DecoderCache
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.tokens import BOS, EOS, PAD


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Evaluation mode (no dropout) inside the block; every module's own mode restored after.

    `with eval_mode(model): ...` gives the model back as it came in, even if the block raises,
    down to a submodule that was in another mode than its parent.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@dataclass(frozen=True)
class Generation:
    """What greedy_decode, beam_search and sample return.

    tokens: (B, T) long ids, BOS first, PAD after a row's EOS; T <= max_new_tokens + 1.
    log_probs: (B,) float32, the total log-probability the model gives each row's tokens
        (softmax at temperature 1, EOS counted, the PAD after it not): what sequence_log_prob
        computes for `tokens`, whatever strategy (or sampling temperature) chose them.
    """

    tokens: Tensor
    log_probs: Tensor


def check_generation_inputs(
    model: nn.Module,
    src: Tensor,
    *,
    max_new_tokens: int,
    src_mask: Tensor | None = None,
    use_cache: bool = False,
    cache: DecoderCache | None = None,
):
    """Check what every decoding strategy takes; return the cache to decode with (or None).

    Raises a TypeError for a wrong type and a ValueError for a wrong value (policy of `checks`).
    The cache is `cache` if one is given (it must be empty; passing one implies use_cache),
    else a new KVCache (notebook 12) if use_cache, else None: the whole prefix every step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_tensor("src", src, dim=2, kind="int")  # (B, T_src) token ids
    check_int("max_new_tokens", max_new_tokens, 1)
    max_len = getattr(model, "max_len", None)  # rows of the positional table, if the model says
    if max_len is not None and max_new_tokens > max_len:  # the last step reads positions 0..n-1
        raise ValueError(
            f"max_new_tokens={max_new_tokens} is more than the model's max_len={max_len}: the "
            "decoder would read positions beyond its positional table"
        )
    B, T_src = src.shape
    check_mask(
        "src_mask", src_mask, (B, 1, 1, T_src), "(B, 1, 1, T_src)", hint="build it with padding_mask"
    )
    check_bool("use_cache", use_cache)
    if cache is None:
        return KVCache() if use_cache else None  # noqa: F821 (notebook 12 adds it to `decoding`)
    length = getattr(cache, "length", None)
    if not isinstance(length, int):
        raise TypeError(
            f"cache must be a decoding cache such as KVCache() (with a `length`), got "
            f"{type(cache).__name__}"
        )
    if length != 0:
        raise ValueError(f"cache must be empty (a new KVCache), it holds {length} positions")
    return cache


# %% [markdown]
# Then one decoder step, the loop, and greedy decoding as one use of it. Everything after `src`
# is keyword-only, so a call names what each number means (`max_new_tokens=9`), and every
# strategy takes the same names:

# %%
#| export decoding
def next_token_logits(
    model: nn.Module, ys: Tensor, enc_out: Tensor, cross_mask: Tensor | None = None,
    cache: DecoderCache | None = None,
) -> Tensor:
    """The logits (B, V) of the token after the prefixes ys (B, T): one decoder step.

    Without a cache the whole prefix goes through the decoder (causally masked); with one, only
    the newest token ys[:, -1:], and the cache holds the keys and values of the others.
    """
    if cache is None:
        self_mask = causal_mask(ys.size(1), device=ys.device)  # (1, 1, T, T)
        dec_out = model.decode(ys, enc_out, self_mask=self_mask, cross_mask=cross_mask)
    else:
        dec_out = model.decode(ys[:, -1:], enc_out, cross_mask=cross_mask, cache=cache)
    return model.out_proj(dec_out[:, -1])  # the last position: (B, d_model) -> (B, V)


_SYNC_EVERY = 8  # steps between two "has every row finished?" checks (each waits for the device)


@torch.no_grad()
def generate(
    model: nn.Module,
    src: Tensor,
    *,
    max_new_tokens: int,
    src_mask: Tensor | None = None,
    use_cache: bool = False,
    cache: DecoderCache | None = None,
    choose: Callable[[Tensor], Tensor],
) -> Generation:
    """The loop of greedy decoding and sampling: encode once, then one token per step.

    `choose` maps the logits (B, V) to the next ids (B,). A row that has emitted EOS gets PAD
    after it; the loop ends when every row has, or after max_new_tokens steps. With the cache
    (`use_cache=True`, or your own empty `cache`) the logits equal the uncached ones up to float
    rounding (the two paths add in another order; notebook 12 measures it), so the tokens are
    the same unless two logits tie within that rounding.
    """
    cache = check_generation_inputs(
        model, src, max_new_tokens=max_new_tokens, src_mask=src_mask, use_cache=use_cache, cache=cache
    )
    B, device = src.size(0), src.device
    with eval_mode(model):
        enc_out = model.encode(src, src_mask=src_mask)  # once: (B, T_src, d_model); checks ids
        ys = torch.full((B, 1), BOS, dtype=torch.long, device=device)  # (B, 1)
        finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
        log_probs = torch.zeros(B, device=device)  # (B,): total log p of each row so far
        with validated():  # the inputs were checked; the loop's own tokens need no checks
            for step in range(1, max_new_tokens + 1):
                logits = next_token_logits(model, ys, enc_out, cross_mask=src_mask, cache=cache)
                next_token = choose(logits).masked_fill(finished, PAD)  # (B,): PAD once finished
                log_p = F.log_softmax(logits.float(), dim=-1)  # (B, V), temperature 1
                picked = log_p.gather(-1, next_token[:, None])[:, 0]  # (B,)
                log_probs += picked.masked_fill(finished, 0.0)  # the PAD after EOS counts 0
                ys = torch.cat([ys, next_token[:, None]], dim=1)  # (B, T) -> (B, T + 1)
                finished |= next_token == EOS  # stays on the device: no wait here
                if step % _SYNC_EVERY == 0 and bool(finished.all()):  # the only wait, every 8
                    break
    # Cut after the column where the last row emitted EOS (all of ys if a row never did):
    # what a check after every step would have returned.
    is_eos = ys == EOS  # (B, T)
    ends = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), ys.size(1) - 1)  # (B,)
    return Generation(tokens=ys[:, : int(ends.max()) + 1], log_probs=log_probs)


def greedy_decode(
    model: nn.Module,
    src: Tensor,
    *,
    max_new_tokens: int,
    src_mask: Tensor | None = None,
    use_cache: bool = False,
    cache: DecoderCache | None = None,
) -> Generation:
    """Take the most likely token at each step: tokens (B, <= max_new_tokens + 1), BOS first.

    A row that has emitted EOS gets PAD after it; `.log_probs` (B,) is each row's total log p.
    `use_cache=True` (or an empty `cache`, notebook 12) feeds only the newest token to the
    decoder at each step; the tokens are the same.
    """
    return generate(
        model,
        src,
        max_new_tokens=max_new_tokens,
        src_mask=src_mask,
        use_cache=use_cache,
        cache=cache,
        choose=lambda logits: logits.argmax(dim=-1),
    )


# %% [markdown]
# A sequence counts as correct only if the decoded tokens are its reversal, then `EOS`, then
# nothing but `PAD`: the whole of `tgt_out`. `exact_match` draws `n` fresh sequences from a
# generator with a seed of its own (2017, never used for training), so they are new batches
# rather than the ones the model was trained on.

# %%
#| export
EVAL_SEED = 2017  # the test sequences' generator; training uses seed + 1 for its batches


@torch.no_grad()
def reversal_correct(
    model: Transformer, src: torch.Tensor, tgt_out: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """(B,) bool: does greedy decoding of each source give exactly its tgt_out (reversal, EOS)?"""
    device = next(model.parameters()).device
    src, tgt_out = src.to(device), tgt_out.to(device)
    src_mask = padding_mask(lengths.to(device), src.size(1))  # (B, 1, 1, T_src)
    decoded = greedy_decode(model, src, max_new_tokens=tgt_out.size(1), src_mask=src_mask)
    decoded = decoded.tokens[:, 1:]  # (B, <= T_tgt): drop BOS
    padded = torch.full_like(tgt_out, PAD)  # (B, T_tgt): decoding may stop early
    padded[:, : decoded.size(1)] = decoded
    return (padded == tgt_out).all(dim=1)


def exact_match(
    model: Transformer, n: int = 256, max_len: int = 8, generator: torch.Generator | None = None
) -> int:
    """How many of `n` fresh reversal sequences greedy decoding gets exactly right."""
    check_int("n", n, 1)
    if generator is None:
        generator = torch.Generator().manual_seed(EVAL_SEED)
    vocab_size = model.tgt_embed.num_embeddings
    src, _, tgt_out, lengths = make_batch(n, max_len, vocab_size, generator=generator)
    return int(reversal_correct(model, src, tgt_out, lengths).sum())


# %% [markdown]
# **Check:** `exact_match` counts what it should. A stand-in for a model that reads the source
# and says the right next token (the reversal, then `EOS`) must get all 256; the same stand-in
# *copying* the source instead must get exactly the palindromes among the 256, counted by hand;
# a stand-in that reverses perfectly but never says `EOS` (it pads instead) must get none. A
# count that ignored the order of the tokens would pass the copier, one that compared only the
# first $L$ tokens would pass the endless reverser, one that always said 0 would fail the
# reverser. (The unit tests check `exact_match` the same way.) The untrained model of section 2
# is printed for scale, not asserted: it gets none right, as any untrained model would.

# %%
class Oracle(nn.Module):
    """Not a Transformer: the decoder steps read the source and say its reversal (or its copy)."""

    def __init__(self, reverse: bool = True, end: int = EOS):
        super().__init__()
        self.reverse, self.end = reverse, end  # end: what it says after the L symbols
        self.tgt_embed = nn.Embedding(VOCAB, 1)  # exact_match reads the vocabulary size from it

    def encode(self, src, src_mask=None):
        return src  # (B, T_src): the "encoding" is the source itself

    def decode(self, ys, enc_out, self_mask=None, cross_mask=None, cache=None):
        t = ys.size(1) - 1  # tokens emitted so far
        L = (enc_out != PAD).sum(dim=1)  # (B,)
        slot = L - 1 - t if self.reverse else torch.full_like(L, t)  # the source slot to say
        token = enc_out.gather(1, slot.clamp(0, enc_out.size(1) - 1)[:, None])[:, 0]  # (B,)
        token = torch.where(t < L, token, self.end)  # after L symbols: EOS (or `end`)
        return F.one_hot(token, VOCAB).float()[:, None]  # (B, 1, V): the last position's "logits"

    def out_proj(self, x):
        return x


em_src, _, _, em_len = make_batch(256, MAX_LEN, VOCAB, torch.Generator().manual_seed(EVAL_SEED))
palindromes = sum(torch.equal(s[:L], s[:L].flip(0)) for s, L in zip(em_src, em_len.tolist(), strict=True))
untrained_em = exact_match(probe)
assert exact_match(Oracle(reverse=True)) == 256
assert exact_match(Oracle(reverse=False)) == palindromes > 0
assert exact_match(Oracle(reverse=True, end=PAD)) == 0  # every symbol right, never ends: wrong
print(f"exact match: reverser 256/256, copier {palindromes}/256 (the {palindromes} palindromes), "
      f"reverser without EOS 0/256, untrained {untrained_em}/256")

# %% [markdown]
# **Exact match asks for the whole reversal and the `EOS`, generated token by token from the
# model's own outputs.**
#
# ## 6 · Training the model
#
# The tutorial trains for 6,000 steps; this notebook trains for 2,500 (section 7 says why). A
# callback measures exact match every 100 steps, on the same 256 test sequences each time, and
# keeps copies of the weights at steps 100 and 600 for sections 8 and 9. Neither touches a random
# generator (the test sequences have their own), so the run is exactly the one without them.

# %%
EARLY_STEPS, SMOOTHING_STEPS, ABLATION_STEPS = 100, 600, 800  # the snapshots and shorter runs


def watch(curve: dict, every: int = 100, snapshots: dict | None = None, at: tuple = ()):
    """A train_model callback: exact match every `every` steps; copies of the weights at `at`."""

    def callback(step: int, m: Transformer) -> None:
        if step % every == 0:
            curve[step] = exact_match(m)
        if snapshots is not None and step in at:
            snapshots[step] = {k: v.detach().clone() for k, v in m.state_dict().items()}

    return callback


# %% [markdown]
# The run takes three to three and a half minutes on a quiet machine with a CPU thread to itself
# (about 80 ms a step, the 25 exact-match evaluations included) and several times that on a
# machine busy with other work. The cell prints the wall-clock time and the CPU time it used; on
# a busy machine the wall clock is the larger, since it also counts the time spent waiting for a
# core. On a GPU it uses the GPU: on an H200 the whole cell took 84 s (measured once, with torch
# 2.11, the version of the course's Colab profile).
#
# > **Your numbers.** A GPU draws its dropout masks from its own generator, so a GPU run is
# > another run of the same recipe, like another seed, and so is a CPU run under another CPU
# > kernel (appendix "Reproducing the stored run: CPU kernels"). The checks below assert bounds
# > with a margin for another run; this run's exact numbers are printed in cells whose output is
# > not compared, and the prose quotes them as "the stored run".

# %% tags=["nbval-ignore-output"]
em_curve, snapshots = {}, {}
start, cpu_start = time.perf_counter(), time.process_time()
model, history = train_reversal(
    device=device, progress=True,
    callback=watch(em_curve, snapshots=snapshots, at=(EARLY_STEPS, SMOOTHING_STEPS)),
)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
print(f"{seconds:.0f} s of wall-clock time (device: {device.type}), "
      f"{cpu_seconds:.0f} s of CPU time: {1000 * cpu_seconds / RECIPE.steps:.0f} ms of CPU time "
      "per step, exact-match evaluations included")

# %% [markdown]
# What the run logged, every 500 steps (this run's numbers: another seed, CPU kernel or device
# prints others):

# %% tags=["nbval-ignore-output"]
losses, rates = np.array(history["loss"]), np.array(history["lr"])
STEPS = RECIPE.steps
for s in range(500, STEPS + 1, 500):
    print(f"step {s:5d}  loss {losses[s - 1]:.4f}  lr {rates[s - 1]:.2e}  "
          f"exact match {em_curve[s]}/256")
print(f"mean loss of the first 10 steps {losses[:10].mean():.4f}, of the last 100 "
      f"{losses[-100:].mean():.4f}")

# %% [markdown]
# And exact match at every evaluation, the right-hand plot of the figure below (this run's):

# %% tags=["nbval-ignore-output"]
for first in (100, 1400):
    chunk = [s for s in em_curve if first <= s < first + 1300]
    print("step   " + "".join(f"{s:>6d}" for s in chunk))
    print("of 256 " + "".join(f"{em_curve[s]:>6d}" for s in chunk))
perfect = [s for s in em_curve if em_curve[s] == 256]
print(f"first 256/256 at step {perfect[0] if perfect else None}; 256/256 at {len(perfect)} of "
      f"{len(em_curve)} evaluations; from step 1,400 on between {min(em_curve[s] for s in em_curve if s >= 1400)} "
      f"and {max(em_curve[s] for s in em_curve if s >= 1400)}")

# %% [markdown]
# **Check:** the history's rates are the schedule's, update for update (this would fail without
# the shift by one of section 4: `LambdaLR` would give updates 1 and 2 the same rate; exercise
# 1). The history's losses are means per graded token, as section 2 defined the loss: the mean
# of the first ten is within 0.15 of $\ln 12 \approx 2.485$, the loss of the near-uniform guess
# an untrained model makes (section 2 measured 2.506); a loss recorded as a sum, or weighted
# wrongly, would be far off (the stored run: 2.455, printed above; the seed study of section 7:
# 2.455 to 2.545). The two findings, with room for another run (they are not this run's
# numbers): the loss fell to a few hundredths (the mean of the last 100 steps below 0.03), and
# exact match climbed to 250 or more of 256 (the stored run: 255).

# %%
assert np.allclose(rates, [lr_lambda(s, 128, 400) for s in range(1, STEPS + 1)], rtol=1e-12, atol=0)
assert abs(losses[:10].mean() - math.log(VOCAB)) < 0.15 and losses[-100:].mean() < 0.03
assert em_curve[STEPS] >= 250


# %% jupyter={"source_hidden": true}
def smooth(x: np.ndarray, window: int = 50) -> np.ndarray:
    """Moving average over `window` steps (the first few average what there is)."""
    cumsum = np.cumsum(np.insert(x, 0, 0.0))
    head = cumsum[1:window] / np.arange(1, window)
    return np.concatenate([head, (cumsum[window:] - cumsum[:-window]) / window])


step_axis = np.arange(1, STEPS + 1)
fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained",
                         gridspec_kw={"width_ratios": [1.5, 1, 1]})
ax = axes[0]
ax.plot(step_axis, losses, color=LOSS_COLOR, alpha=0.25, lw=0.8, label="loss per batch")
ax.plot(step_axis, smooth(losses), color=LOSS_COLOR, lw=2, label="50-step moving average")
ax.axvline(RECIPE.warmup, color="grey", ls=":", lw=1, label="end of warmup")
ax.set(xlabel="training step", ylabel="cross-entropy (nats, log scale)", yscale="log",
       title="Training loss")
ax.legend(loc="upper right", fontsize=9)
ax = axes[1]
ax.plot(step_axis, rates, color=LR_COLOR, lw=1.5)
ax.axvline(RECIPE.warmup, color="grey", ls=":", lw=1)
ax.set(xlabel="training step", ylabel="learning rate", ylim=(0, rates.max() * 1.1),
       title="Learning rate (section 3's schedule)")
ax = axes[2]
ax.plot(list(em_curve), list(em_curve.values()), "o-", ms=3, color=EM_COLOR)
ax.axhline(256, color="grey", ls=":", lw=1)
ax.set(xlabel="training step", ylabel="sequences decoded exactly (of 256)", ylim=(0, 265),
       title="Exact match, greedy decoding, every 100 steps")
late = [s for s in em_curve if s >= 1400]  # the late wobble, magnified
inset = ax.inset_axes([0.42, 0.17, 0.54, 0.4])
inset.plot(late, [em_curve[s] for s in late], "o-", ms=3, color=EM_COLOR)
inset.axhline(256, color="grey", ls=":", lw=1)
inset.set(ylim=(min(em_curve[s] for s in late) - 1.5, 257), title="from step 1,400, zoomed")
inset.set_xlabel("training step", fontsize=7, labelpad=1)
inset.yaxis.get_major_locator().set_params(integer=True)
inset.tick_params(labelsize=7)
inset.title.set_fontsize(8)
fig.suptitle(f"Training the reversal model ({STEPS} steps, batch 64, warmup 400)")
save_figure(fig, "training_loss_curve")
plt.show()

# %% [markdown]
# How far one batch's loss strays from the moving average, early and late in the run (this
# run's numbers):

# %% tags=["nbval-ignore-output"]
scatter = losses / smooth(losses)  # (STEPS,): each batch's loss over its 50-step moving average
scatter_width = {}  # stretch -> 95th over 5th percentile of that ratio
for a, b in ((0, 500), (500, 1500), (1500, STEPS)):
    low, high = np.percentile(scatter[a:b], [5, 95])
    scatter_width[a, b] = high / low
    print(f"steps {a + 1:4d}-{b}: the middle 90 % of batches at {low:.2f} to {high:.2f} times "
          "the moving average")

# %%
assert scatter_width[1500, STEPS] > 3 * scatter_width[0, 500]  # wider late than early (stored: 15 vs 1.9)

# %% [markdown]
# In the stored run, the loss falls fast while the rate warms up, from $\ln 12 \approx 2.5$ (a
# uniform guess) to about 0.4 by step 300; it stalls around the peak of the rate at step 400;
# then it keeps falling as the rate decays, to about 0.02 on average. The per-batch loss
# scatters around its average, and more widely as training goes on: over the first 500 steps
# the middle 90 % of batches lie within 0.66 to 1.24 times the moving average, over the last
# 1,000 within 0.16 to 2.40, a factor of fifteen. Late in training the loss of any single batch
# says little.
#
# Exact match tracks the loss but not smoothly (the curve is printed above): it can drop for a while,
# by ten sequences or more (in the stored run from 185 at step 300 to 175 at step 400, and from 253 at step 800 down to 219
# at step 1,100, back to 250 at step 1,200: the dips in the right-hand plot), and late in
# training it still wobbles by a sequence or three between evaluations (253 to 256 from step
# 1,400 on, 255 at the last), because the rate is still
# $1.8 \times 10^{-3}$ at the end and an unlucky batch can shift a decision. Section 7 shows how that plays out over several
# seeds.
#
# The final model, on 256 fresh sequences, and three examples:

# %% tags=["nbval-ignore-output"]
correct = exact_match(model, n=256)
print(f"exact match on 256 fresh sequences: {correct}/256")
src, _, tgt_out, lengths = make_batch(3, MAX_LEN, VOCAB, torch.Generator().manual_seed(7))
src_mask = padding_mask(lengths, MAX_LEN).to(device)
decoded = greedy_decode(model, src.to(device), max_new_tokens=MAX_LEN + 1, src_mask=src_mask)
decoded = decoded.tokens.cpu()
for b in range(3):
    L = int(lengths[b])
    print(f"source {src[b, :L].tolist()}  ->  decoded {decoded[b, 1 : L + 2].tolist()}")


# %% [markdown]
# **Check:** at least 97 % of the 256 are right, that is 249 or more (the stored run: 255;
# every seed of the study: 256; the tutorial: all 256). And they are not remembered: replaying the
# training generator lists every one of the $64 \times 2500$ training sequences, and most test
# sequences, nearly all the long ones among them, never occurred in training (a property of the
# test set, asserted because the check rests on it); the same 97 % must hold among *those*, so
# that a model that recited its training batches and guessed the rest would fail here.
#
# The replay must draw the batches that training drew, or the count of "never occurred" means
# nothing. So first: `bare_update` (section 4), run by hand on the first two replayed batches
# from the recipe's fresh model, must give the losses and weights of `train_reversal(steps=2)`
# bit for bit. Were training to draw its batches from another stream (another batch size, a
# generator shared with dropout, an extra draw per step), it would not.

# %%
def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x.cpu(), y.cpu())
               for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


assert correct >= math.ceil(0.97 * 256)  # 249
with torch.random.fork_rng():  # the global generator's state is left as it was
    replay = torch.Generator().manual_seed(RECIPE.seed + 1)  # the training batches, again
    replayed = [make_batch(RECIPE.batch_size, MAX_LEN, VOCAB, generator=replay) for _ in range(2)]
    set_seed(RECIPE.seed)  # as train_reversal does: the weights, then the dropout masks
    by_hand = build_reversal_model(RECIPE)
    hand_optimizer = torch.optim.Adam(by_hand.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    hand_scheduler = torch.optim.lr_scheduler.LambdaLR(
        hand_optimizer, lambda s: lr_lambda(s + 1, RECIPE.d_model, RECIPE.warmup))
    hand_losses = [bare_update(by_hand, hand_optimizer, hand_scheduler, b) for b in replayed]
    two_steps, two_history = train_reversal(steps=2)  # on the CPU, as by_hand
assert hand_losses == two_history["loss"] and same_weights(by_hand, two_steps)
test_src, _, test_out, test_len = make_batch(256, MAX_LEN, VOCAB,
                                             torch.Generator().manual_seed(EVAL_SEED))
replay = torch.Generator().manual_seed(RECIPE.seed + 1)  # all the training batches
seen = set()
for _ in range(STEPS):
    seen.update(map(tuple, make_batch(RECIPE.batch_size, MAX_LEN, VOCAB,
                                      generator=replay)[0].tolist()))
in_training = torch.tensor([tuple(row) in seen for row in test_src.tolist()])  # (256,)
print("length  test sequences  also in training")
for L in range(3, MAX_LEN + 1):
    at_L = test_len == L
    print(f"{L:6d}  {int(at_L.sum()):14d}  {int((in_training & at_L).sum()):16d}")
long_new = int((~in_training & (test_len >= 6)).sum())
assert long_new > 100 and int((~in_training).sum()) > 128
right = reversal_correct(model, test_src, test_out, test_len).cpu()  # (256,): the 256 of `correct`
unseen_rate = right[~in_training].float().mean().item()
assert unseen_rate >= 0.97  # the same bound for the new ones alone
print(f"{int((~in_training).sum())} of the 256 never occurred in training")


# %% [markdown]
# How many of the never-seen sequences this run gets right, and the sequences it gets wrong,
# each with the model's output and the reversal it should have produced (this run's; another
# run misses others, or none):

# %% tags=["nbval-ignore-output"]
def say(tokens: list[int]) -> str:
    return " ".join({EOS: "EOS"}.get(t, str(t)) for t in tokens if t != PAD)


misses = (~right).nonzero()[:, 0].tolist()  # the test rows decoded wrong
if misses:
    miss_out = greedy_decode(model, test_src[misses].to(device), max_new_tokens=MAX_LEN + 1,
                             src_mask=padding_mask(test_len[misses], MAX_LEN).to(device))
    for b, out in zip(misses, miss_out.tokens[:, 1:].cpu().tolist(), strict=True):
        print(f"row {b:3d}: source {say(test_src[b].tolist()):18s} output {say(out):20s} "
              f"expected {say(test_out[b].tolist()):20s} "
              f"({'seen' if in_training[b] else 'not seen'} in training)")
print(f"{len(misses)} of 256 wrong; of the {int((~in_training).sum())} never seen in training, "
      f"{int(right[~in_training].sum())} right")

# %% [markdown]
# With nine symbols there are only $9^3 = 729$ sequences of length 3 and $9^4 = 6561$ of length
# 4, and training draws about 27,000 of each length, so it sees nearly all the short ones; of
# length 8 there are $9^8 \approx 4.3 \times 10^7$, and a test sequence of that length is almost
# surely new. Memorising cannot explain the score: the model computes the reversal.
#
# In the stored run all 153 never-seen sequences come back right (printed above). The one
# sequence it gets wrong is a short one that did occur in training, 4 6 6 4: the model reverses
# it as 4 6 6 6 4, with one 6 too many, a slip at a doubled symbol (notebook 12's test set shows
# the same slip twice).
#
# **Nearly every fresh sequence, 255 of 256 in the stored run, comes back exactly reversed and
# terminated: the model generates, not only predicts under teacher forcing.**
#
# ### How often the gradient is clipped
#
# The history records each update's gradient norm *before* clipping (`history["grad_norm"]`),
# and section 4's check showed that every gradient whose norm is above `clip_norm` is scaled
# down, so an update was clipped when its recorded norm is above the bound. (`train_reversal`
# passes no `clip_norm`, so the bound is `train_model`'s default, read from its signature
# below.) Counted over three stretches of the run, the first 100 steps, the rest of the warm-up
# and just after (101 to 500), and the remaining 2,000:

# %% tags=["nbval-ignore-output"]
grad_norms = np.array(history["grad_norm"])  # (STEPS,): each update's norm before clipping
assert "clip_norm" not in {field.name for field in dataclasses.fields(ReversalRecipe)}
CLIP = inspect.signature(train_model).parameters["clip_norm"].default  # what train_reversal uses
stretches = {"1-100": (0, 100), "101-500": (100, 500), "501-2500": (500, STEPS)}
clipped = {}
print(f"clip_norm = {CLIP}")
print(f"{'steps':>10s}{'clipped':>9s}{'norm > 2':>10s}{'median norm':>13s}{'largest':>9s}")
for name, (a, b) in stretches.items():
    norms = grad_norms[a:b]
    clipped[name] = (norms > CLIP).mean()
    print(f"{name:>10s}{clipped[name]:9.0%}{(norms > 2 * CLIP).mean():10.0%}"
          f"{np.median(norms):13.2f}{norms.max():9.1f}")
print(f"first 10 steps: {(grad_norms[:10] > CLIP).mean():.0%} clipped; last 500: "
      f"{(grad_norms[-500:] > CLIP).mean():.0%}, median norm {np.median(grad_norms[-500:]):.2f}")

# %% [markdown]
# **Check:** the gradient's norm exceeds the bound of 1 (so the update is clipped) on more than
# a tenth of the first 100 updates, and less often after step 500 than over steps 101 to 500
# (the stored run: 62 %, 100 % and 71 %). These shares measure the size of the gradients; that
# clipping acts on them is section 4's check. They are not in the seed study (section 7): these
# bounds have been checked on the stored run only.

# %%
assert clipped["1-100"] > 0.1
assert clipped["501-2500"] < clipped["101-500"]

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), layout="constrained",
                         gridspec_kw={"width_ratios": [1.5, 1]})
ax = axes[0]
ax.plot(step_axis, grad_norms, color=GRAD_COLOR, alpha=0.35, lw=0.8, label="norm of each update")
ax.plot(step_axis, smooth(grad_norms), color=GRAD_COLOR, lw=2, label="50-step moving average")
ax.axhline(CLIP, color=COLORS["accent"], ls="--", lw=1, label="clip_norm = 1: above it, scaled to 1")
ax.axvline(RECIPE.warmup, color="grey", ls=":", lw=1, label="end of warmup")
ax.set(xlabel="training step", ylabel="gradient norm before clipping (log scale)", yscale="log",
       title="Global gradient norm of each update")
ax.legend(fontsize=8, loc="lower left", ncols=2)
ax = axes[1]
blocks = grad_norms[: STEPS // 100 * 100].reshape(-1, 100)  # (25, 100): blocks of 100 updates
ax.bar(np.arange(len(blocks)) * 100 + 50, 100 * (blocks > CLIP).mean(axis=1), width=90,
       color=GRAD_COLOR)
ax.set(xlabel="training step (blocks of 100 updates)", ylabel="updates clipped (%)",
       ylim=(0, 105), title="Share of updates clipped, per 100 steps")
fig.suptitle("Gradient clipping in the main run: which updates the bound of 1 scales down")
save_figure(fig, "training_grad_norm")
plt.show()

# %% [markdown]
# In the stored run clipping is no rare event of the first steps. The first ten updates are all
# clipped, and 62 % of the first 100, the steps where the loss falls fastest. From about step
# 100 on, while the rate climbs to its peak, every update is clipped, more than half of them
# (58 %) by a factor above 2 (median norm 2.1 over steps 101 to 500). Then the norm slowly comes
# down and clipping fires less often: on 71 % of the updates after step 500 and on about half
# (48 %) of the last 500, with rare spikes up to 11.6.
#
# With Adam this is milder than it sounds. Adam divides each step by a running root-mean-square
# of the past gradients, so scaling *every* gradient by one factor would change nothing; what
# clipping changes is how much one update counts against the others in those running averages:
# a spike of 11 counts as an ordinary update instead of inflating the averages for the next few
# dozen steps. Whether this run would train as well without clipping is not tested here (it
# would take another run of 2,500 steps).
#
# ### The same run without warm-up
#
# Section 3 gave the reason for the warm-up: Adam's first steps are large and poorly aimed (Liu
# et al., 2020). Xiong et al. (2020) trace the need for it to the large gradients near the output
# of a *post-norm* Transformer at initialisation, and find that pre-norm Transformers, like this
# one, can train without it. Here that can be tested: the same recipe, seed and batches, with the
# ramp cut off, so that the first update already gets the peak rate $(d_\text{model} w)^{-1/2}$
# and the decay is unchanged.
#
# `train_model` takes any schedule as a function of the step. Then the same pair again with the
# rate doubled, to see where a ramp starts to matter. Three runs of 300 steps, about a minute
# on a quiet machine's CPU thread (several times that on a busy machine). The ramp lasts 400
# steps, so the runs with it stop three quarters of the way up: at step 300 their rate is
# $300/400$ of their peak, and what these runs compare is the start of training, not the peak
# itself.

# %%
WARMUP_STEPS = 300  # the length of each run: the ramp lasts 400 steps, so they all still ramp


def rate(scale: float, ramp: bool):
    """The recipe's schedule times `scale`; without the ramp: its peak from update 1, then the decay."""
    peak = scale * lr_lambda(RECIPE.warmup, RECIPE.d_model, RECIPE.warmup)
    if ramp:
        return lambda s: scale * lr_lambda(s, RECIPE.d_model, RECIPE.warmup)
    return lambda s: min(peak, scale * lr_lambda(s, RECIPE.d_model, 1))  # warmup 1: d^-1/2 s^-1/2


warmup_variants = {"no warm-up": (1.0, False), "2× rate, warm-up": (2.0, True),
                   "2× rate, no warm-up": (2.0, False)}

# %% tags=["nbval-ignore-output"]
warmup_runs = {"warm-up (the recipe)": {"lr": rates[:WARMUP_STEPS],
                                        "loss": losses[:WARMUP_STEPS], "em": em_curve}}
for name, (scale, ramp) in warmup_variants.items():
    curve = {}
    _, run_history = train_reversal(steps=WARMUP_STEPS, schedule=rate(scale, ramp),
                                    device=device, progress=True, callback=watch(curve))
    warmup_runs[name] = {"lr": np.array(run_history["lr"]), "loss": np.array(run_history["loss"]),
                         "em": curve}

# %% [markdown]
# This run's numbers (another seed, CPU kernel or device prints others):

# %% tags=["nbval-ignore-output"]
print(f"{'':22s}{'first rate':>11s}{'rate at 300':>12s}{'loss, steps 201-300':>21s}"
      f"{'/ recipe':>9s}{'/ own 101-200':>14s}   exact match at 100 / 200 / 300")
recipe_late = warmup_runs["warm-up (the recipe)"]["loss"][200:300].mean()
for name, run in warmup_runs.items():
    em = " / ".join(f"{run['em'][s]:3d}" for s in (100, 200, 300))
    late, middle = run["loss"][200:300].mean(), run["loss"][100:200].mean()
    print(f"{name:22s}{run['lr'][0]:11.2e}{run['lr'][-1]:12.2e}{late:21.3f}{late / recipe_late:9.3f}"
          f"{late / middle:14.3f}   {em}")
print("\nmean loss over steps " + "".join(f"{f'{a + 1}-{a + 50}':>9s}" for a in range(0, 300, 50)))
for name, run in warmup_runs.items():
    print(f"{name:22s}" + "".join(f"{run['loss'][a : a + 50].mean():9.3f}" for a in range(0, 300, 50)))

# %% [markdown]
# **Check:** first the schedules. `train_model` must hand the `schedule` it is given to the
# optimizer, shifted by one as the recipe's own (the history records the rate the optimizer
# used): the flat run holds the recipe's peak from update 1, the ramped doubled one gets twice
# the recipe's rate update for update and ends at 1.5 times the peak, the flat doubled one holds
# twice the peak. Were the argument ignored, the flat runs would record the recipe's rates; were
# it applied without the shift, the doubled ramped run's rates would not be twice the recipe's.
#
# Then the findings, with margins around the stored run; the last column is the seed study's
# range (section 7), four other runs of the same recipe:
#
# | finding | what the cell below asserts | stored run | study |
# |---|---|---|---|
# | at twice the rate, the run with the ramp learns | exact match at step 300 ≥ 60 | 128 | 124–152 |
# | ... and the run without it does not | exact match at step 300 ≤ 20 | 2 | 0–5 |
# | the recipe itself learns | exact match at step 300 ≥ 100 | 185 | 142–196 |
# | at the recipe's rate, the run without the ramp is where the recipe is by steps 201–300, or ahead | mean loss over steps 201–300 ≤ 1.1 × the recipe's (the column "/ recipe") | 0.876 | 0.87–0.96 |
# | that ratio tells a run that is behind: the doubled ramped run's is higher | its ratio > that of the run without the ramp | 1.246 | 1.12–1.25 |
# | without the ramp, exact match is not far behind the recipe's | no more than 45 fewer | 3 more | 21 fewer to 55 more |
# | the doubled ramped run slows down as its rate reaches the recipe's peak (at step 200) | its loss falls less from steps 101–200 to 201–300 than the recipe's (the column "/ own 101-200" is higher) | 0.880 against 0.727 | 0.78–0.88 against 0.66–0.72 |
#
# The bounds on exact match are wide on purpose: each reads one evaluation in the middle of
# steep learning, where one run moves by ten sequences or more from one evaluation to the next
# (section 6) and the seeds spread by about ±30; 45 is about twice the largest shortfall in the
# study. The bound of 20 alone would pass a broken model too; with the bound of 60 it asserts a
# gap of 40 sequences or more between two runs that differ only in the ramp. The loss averages
# 100 updates and is the steadier measure, which is why the conclusions below rest on it.

# %%
peak = lr_lambda(RECIPE.warmup, RECIPE.d_model, RECIPE.warmup)
flat = warmup_runs["no warm-up"]
assert np.allclose(flat["lr"], peak, rtol=1e-12, atol=0)  # the peak from the first update on
assert np.allclose(warmup_runs["2× rate, warm-up"]["lr"], 2 * rates[:WARMUP_STEPS], rtol=1e-12)
assert math.isclose(warmup_runs["2× rate, warm-up"]["lr"][-1], 1.5 * peak, rel_tol=1e-9)
assert np.allclose(warmup_runs["2× rate, no warm-up"]["lr"], 2 * peak, rtol=1e-12, atol=0)
em_at = {name: run["em"][WARMUP_STEPS] for name, run in warmup_runs.items()}
assert em_at["2× rate, no warm-up"] <= 20 and em_at["2× rate, warm-up"] >= 60
assert em_at["warm-up (the recipe)"] >= 100
late_ratio = {name: run["loss"][200:WARMUP_STEPS].mean() / losses[200:WARMUP_STEPS].mean()
              for name, run in warmup_runs.items()}  # mean loss over steps 201-300 / the recipe's
assert late_ratio["no warm-up"] <= 1.1  # where the recipe is, or ahead
assert late_ratio["2× rate, warm-up"] > late_ratio["no warm-up"]  # a run behind reads higher
assert em_at["no warm-up"] >= em_at["warm-up (the recipe)"] - 45  # no more than 45 fewer
fall = {name: run["loss"][200:WARMUP_STEPS].mean() / run["loss"][100:200].mean()
        for name, run in warmup_runs.items()}  # steps 201-300 over steps 101-200: below 1, it fell
assert fall["2× rate, warm-up"] > fall["warm-up (the recipe)"]

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(15, 4.3), layout="constrained")
styles = {"warm-up (the recipe)": (LOSS_COLOR, "-"), "no warm-up": (VARIANT_COLOR, "-"),
          "2× rate, warm-up": (LOSS_COLOR, "--"), "2× rate, no warm-up": (VARIANT_COLOR, "--")}
step_range = np.arange(1, WARMUP_STEPS + 1)
for name, run in warmup_runs.items():
    color, ls = styles[name]
    axes[0].plot(step_range, run["lr"], color=color, ls=ls, lw=1.8, label=name)
    axes[1].plot(step_range, smooth(run["loss"], 20), color=color, ls=ls, lw=1.8, label=name)
    em_steps = [s for s in sorted(run["em"]) if s <= WARMUP_STEPS]
    axes[2].plot(em_steps, [run["em"][s] for s in em_steps], "o", color=color, ls=ls, ms=5,
                 label=name)
passes_peak = RECIPE.warmup // 2  # where the doubled ramp reaches the recipe's peak: step 200
for ax in axes[:2]:
    ax.axvline(passes_peak, color="grey", ls=":", lw=1,
               label="step 200: the doubled ramp reaches the recipe's peak")
axes[0].set(xlabel="training step", ylabel="learning rate", title="The four schedules")
axes[1].set(xlabel="training step", ylabel="cross-entropy, 20-step average (log scale)",
            yscale="log", title="Training loss")
axes[1].set_yticks([0.3, 0.4, 0.6, 1, 2, 3], ["0.3", "0.4", "0.6", "1", "2", "3"])
axes[1].yaxis.set_minor_formatter(NullFormatter())
axes[2].set(xlabel="training step", ylabel="sequences decoded exactly (of 256)", ylim=(-10, 265),
            xticks=[100, 200, 300], title="Exact match")  # below 0: the runs at 0 stay visible
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=5, fontsize=9)
fig.suptitle("The first 300 steps with and without the warm-up: same model, seed and batches "
             "(grey: with the ramp, pink: without; dashed: twice the rate)")
save_figure(fig, "training_warmup")
plt.show()

# %% [markdown]
# At the recipe's rate this pre-norm model does not need the ramp: without it the first updates
# are 400 times larger, yet by steps 201 to 300 its loss is where the recipe's is, or lower (the
# check above), and its exact match at step 300 close to the recipe's. In the stored run
# (the 50-step means above) the run without the ramp is ahead over the first 100 steps (1.516
# and 0.883 against 1.951 and 0.965), behind over steps 101 to 200 (0.654 and 0.496 against
# 0.601 and 0.488), and ahead again over steps 201 to 300 (0.347 against 0.396); exact match at
# step 300 is about the same (188 against 185). The seed study's raw numbers
# (`tools/seed_study.json`) show the same pattern for all four seeds (the mean loss of the 100 steps up to step 200: 0.565 to 0.620 without the ramp,
# 0.538 to 0.587 with it; up to step 300: ahead without it, for every seed). So the ramp is not
# needed at this rate, as Xiong et al. found for pre-norm Transformers, though without it the
# loss does not fall faster at every stage.
#
# At twice the rate the ramp decides the outcome. Without it the loss falls for about 150 steps,
# from 2.5 to 1.6 (the means of the 50-step stretches printed above: 2.04, 1.69, 1.61), then
# stops falling and drifts back up, to 1.71 over steps 251 to 300, and exact match stays near 0
# (4, 7 and 2 of 256 at steps 100, 200 and 300). With the ramp, the doubled schedule trains, but
# it falls behind the recipe once its rate nears the recipe's peak, which it reaches at step 200
# (left panel). Up to step 150 its 50-step means are at or below the recipe's (1.764, 0.816 and
# 0.600 against 1.951, 0.965 and 0.601); over steps 151 to 300 they hardly move (0.521, 0.491,
# 0.496) while the recipe's keep falling (0.488, 0.428, 0.364). Its mean loss over steps 201 to
# 300 is 0.88 of its mean over steps 101 to 200, the recipe's 0.73 (the column "/ own 101-200";
# by the study's 100-step means every seed slows down the same way, 0.78 to 0.88 against 0.66 to
# 0.72), and from step 200 to 300 its exact match gains 11 sequences (117 to 128, about one
# run's wobble between evaluations) where the recipe's gains 71 (114 to 185). By step 300 its
# rate is 1.5 times the recipe's peak ($6.6 \times 10^{-3}$, printed above), and still climbing.
#
# So what 300 steps show is this: a run that starts at twice the peak stalls near a loss of 1.7
# and decodes almost nothing within 300 steps; one that climbs towards it does not collapse,
# but it stalls as its rate passes the recipe's peak, and ends well behind the recipe (128
# against 185). Whether it would recover later, or collapse at the full doubled peak at step
# 400, and whether a flat start at 1.5 times the peak would fail, these runs do not test (to try
# the last: `train_reversal(steps=300, schedule=rate(1.5, False))`).
#
# The contrast with a *post-norm* model, where Xiong et al. (2020) found the warm-up
# indispensable even at ordinary rates, is not run here (it would double this section's
# training). To try it: build the model from `RECIPE.model_config` with `norm_first=False`
# (`dataclasses.replace`), and train it with `train_model` under `rate(1.0, True)` and
# `rate(1.0, False)`.
#
# **This pre-norm model trains without a warm-up at the recipe's rate; at twice that rate the
# warm-up is the difference between a run that learns and one that never does, within the
# first 300 steps.**
#
# ## 7 · Reproducing the tutorial, and the initialisation ablation
#
# Notebook 09 explained why the embedding's initialisation and the $\sqrt{d_\text{model}}$
# multiply belong together: the paper-style $\mathcal{N}(0, 1/d_\text{model})$ init times
# $\sqrt{d_\text{model}}$ gives token vectors of unit scale per coordinate, comparable with the
# sinusoidal positions (whose coordinates have RMS $1/\sqrt 2$). PyTorch's default
# $\mathcal{N}(0, 1)$ times $\sqrt{d_\text{model}}$ makes them $\sqrt{128} \approx 11$ times
# larger.
#
# In a pre-norm model the overall scale itself does no harm, since each block's layer
# norm divides it out; what the scale changes is the *mix*. First, the sum that enters the
# residual stream is token plus position, and at 11 against 0.71 per coordinate the layer norms
# see almost only the token: the position, which reversal depends on, is a small perturbation
# (measured below: its share of the stream's squared norm).
# Second, each sub-layer adds to the stream an output whose size does not depend on the
# stream's (its input was normalised), so on a stream 11 times larger every block's
# contribution is about ten times smaller in relation: at initialisation the blocks can barely
# move the token vectors.
#
# The tutorial measured what this costs on this very
# task: a final loss of 0.0985 instead of 0.0059, and 244/256 instead of 256/256. ("Paper init"
# is the tutorial's name and ours, `embedding_init="paper"`: the paper prescribes the
# $\sqrt{d_\text{model}}$ multiply but no initialisation; $\mathcal{N}(0, 1/d_\text{model})$ is
# the convention of its reference code, tensor2tensor, and of fairseq.)
#
# **Check:** the scales, on freshly built models; then both effects, measured for a fresh model
# of each kind (the recipe's weights, eval mode) on one batch. The first: the position's share
# of what the layer norms see, $\lVert p \rVert^2 / \lVert e + p \rVert^2$ for the token vector
# $e$ (times $\sqrt{d_\text{model}}$) and the position vector $p$ of each real token, averaged.
# The second: how much the first encoder block changes the stream,
# $\mathrm{RMS}(\mathrm{block}(x) - x) / \mathrm{RMS}(x)$.
#
# The position's RMS of $1/\sqrt 2$ holds for any table of sine–cosine pairs of the same
# angle ($\sin^2 + \cos^2 = 1$), so its assert does not test this notebook's code: it checks
# that notebook 04's table, which the argument rests on, is such a table at the positions used
# here (a table of sines alone would give 0.35 at positions 0 to 7, one multiplied by
# $\sqrt{d_\text{model}}$ 8.0).

# %%
set_seed(0)
paper_model = Transformer(VOCAB, VOCAB)
with torch.no_grad():
    default_emb = nn.Embedding(VOCAB, 128, padding_idx=PAD)  # PyTorch's own N(0, 1) init
    symbols = torch.arange(3, VOCAB)
    paper_rms = (paper_model.src_embed(symbols) * math.sqrt(128)).pow(2).mean().sqrt().item()
    default_rms = (default_emb(symbols) * math.sqrt(128)).pow(2).mean().sqrt().item()
    pe_rms = paper_model.pos.pe[0, :MAX_LEN].pow(2).mean().sqrt().item()
assert 0.8 < paper_rms < 1.2 and 9 < default_rms < 13 and abs(pe_rms - 0.5**0.5) < 0.05
print(f"RMS per coordinate: token (paper init) {paper_rms:.2f}, token (default init) "
      f"{default_rms:.2f}, position {pe_rms:.2f}")


# %% tags=["nbval-ignore-output"]
@torch.no_grad()
def first_block_share(m: Transformer, src: torch.Tensor) -> float:
    """RMS of what encoder block 0 adds to the residual stream, over the stream's own RMS."""
    x = m.pos(m.src_embed(src) * math.sqrt(m.d_model))  # (B, T, D): token * sqrt(d) + position
    return ((m.encoder.layers[0](x) - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()


@torch.no_grad()
def position_share(m: Transformer, src: torch.Tensor) -> float:
    """The position's share of the stream's squared norm, |p|^2 / |e + p|^2, over real tokens."""
    e = m.src_embed(src) * math.sqrt(m.d_model)  # (B, T, D): the token part
    p = m.pos.pe[0, : src.size(1)].expand_as(e)  # (B, T, D): the position part
    real = src != PAD  # (B, T)
    return (p.pow(2).sum(-1)[real] / (e + p).pow(2).sum(-1)[real]).mean().item()


share_src = make_batch(64, MAX_LEN, VOCAB, torch.Generator().manual_seed(3))[0]
INITS, SHARE_SEEDS = ("paper", "default"), range(4)  # the recipe's seed 0, and three more
seed_pos_shares, seed_shares = {}, {}  # (seed, init) -> the two measures
for share_seed in (1, 2, 3, 0):  # seed 0 last: build_reversal_model seeds the global generator,
    for init in INITS:  # which is left as it was when this cell built only the recipe's two
        m = build_reversal_model(reversal_recipe(embedding_init=init, seed=share_seed)).eval()
        seed_pos_shares[share_seed, init] = position_share(m, share_src)
        seed_shares[share_seed, init] = first_block_share(m, share_src)
pos_shares = {init: seed_pos_shares[0, init] for init in INITS}  # the recipe's fresh models
shares = {init: seed_shares[0, init] for init in INITS}
print("the position's share of the stream's squared norm: "
      + ", ".join(f"{init} init {share:.1%}" for init, share in pos_shares.items()))
print("first encoder block: RMS of its change / RMS of its input: "
      + ", ".join(f"{init} init {share:.3f}" for init, share in shares.items()))
print(f"\n{'seed':>4s}{'position share: paper':>24s}{'default':>9s}"
      f"{'block change: paper':>22s}{'default':>9s}")
for share_seed in SHARE_SEEDS:
    print(f"{share_seed:4d}{seed_pos_shares[share_seed, 'paper']:24.1%}"
          f"{seed_pos_shares[share_seed, 'default']:9.1%}"
          f"{seed_shares[share_seed, 'paper']:22.3f}{seed_shares[share_seed, 'default']:9.3f}")

# %% [markdown]
# In the recipe's fresh models (seed 0) the position is 36 % of the stream's squared norm with
# the paper init and 0.4 % with the default; over seeds 0 to 3 (the table) 32 % to 36 % against
# 0.4 %. The block's change, seeds 0 to 3: 0.65 to 0.70 with the paper init, 0.073 to 0.075 with
# the default, nine times less. The checks hold for every one of the four seeds.

# %%
for share_seed in SHARE_SEEDS:
    assert seed_pos_shares[share_seed, "paper"] > 0.2, share_seed
    assert seed_pos_shares[share_seed, "default"] < 0.02, share_seed
    assert seed_shares[share_seed, "paper"] > 0.4 and seed_shares[share_seed, "default"] < 0.15
    assert seed_shares[share_seed, "paper"] > 5 * seed_shares[share_seed, "default"], share_seed

# %% [markdown]
# The ablation trains the same recipe with `embedding_init="default"`: same seed, same batches,
# same dropout masks, same weights everywhere except the two embedding tables. It runs for 800
# steps (about a minute on a quiet machine's CPU thread, several times that on a busy machine;
# the cell prints this run's time) and is compared with the main run *at step 800*,
# which the callback recorded; the gap is already unmistakable there.

# %% tags=["nbval-ignore-output"]
default_curve = {}
start = time.perf_counter()
default_model, default_history = train_reversal(
    embedding_init="default", steps=ABLATION_STEPS, device=device, progress=True,
    callback=watch(default_curve),
)
print(f"{time.perf_counter() - start:.0f} s")

# %% [markdown]
# Side by side with the tutorial's numbers (ours are this run's; another seed, CPU kernel or
# device prints others):

# %% tags=["nbval-ignore-output"]
default_losses = np.array(default_history["loss"])
K = ABLATION_STEPS
rows = [
    ("parameters", "930,828", f"{n_params:,}", ""),
    ("exact match, paper init", "256/256", f"{em_curve[STEPS]}/256", f"{em_curve[K]}/256"),
    ("exact match, default init", "244/256", "", f"{default_curve[K]}/256"),
    ("final loss (last batch), paper init", "0.0059", f"{losses[-1]:.4f}", f"{losses[K - 1]:.4f}"),
    ("final loss (last batch), default init", "0.0985", "", f"{default_losses[-1]:.4f}"),
    ("loss, mean of last 100 steps, paper init", "", f"{losses[-100:].mean():.4f}",
     f"{losses[K - 100 : K].mean():.4f}"),
    ("loss, mean of last 100 steps, default init", "", "", f"{default_losses[-100:].mean():.4f}"),
]
print(f"{'':44s}{'tutorial':>11s}{'ours':>11s}{'ours':>11s}")
print(f"{'':44s}{'6000 steps':>11s}{f'{STEPS} steps':>11s}{f'{K} steps':>11s}")
for row in rows:
    print(f"{row[0]:44s}" + "".join(f"{cell:>11s}" for cell in row[1:]))
print("\nexact match (of 256) at step " + "".join(f"{s:>6d}" for s in default_curve))
print(f"{'paper init':29s}" + "".join(f"{em_curve[s]:>6d}" for s in default_curve))
print(f"{'default init':29s}" + "".join(f"{default_curve[s]:>6d}" for s in default_curve))

# %% [markdown]
# **Check:** the ablation's qualitative result, with margins around the stored run (a loss ratio
# of 9.3 and a gap of 216 sequences at step 800, both a little above the study's 8.5 to 8.7 and
# 191 to 208: the gap is wider in the stored run, not narrower): at the same step, the default
# initialisation has a loss three times the paper init's or more, decodes at least 150 fewer
# sequences, and is behind at every evaluation, not only at the last.

# %%
paper_loss_K, default_loss_K = losses[K - 100 : K].mean(), default_losses[-100:].mean()
assert default_loss_K > 3 * paper_loss_K
assert default_curve[K] <= em_curve[K] - 150
assert all(default_curve[s] < em_curve[s] for s in default_curve)

# %% jupyter={"source_hidden": true}
default_correct = reversal_correct(default_model, test_src, test_out, test_len).cpu()  # (256,)
fig, axes = plt.subplots(1, 3, figsize=(15, 4), layout="constrained",
                         gridspec_kw={"width_ratios": [1.3, 1.1, 1]})
inits = (("paper init $\\mathcal{N}(0, 1/d_{model})$", losses, em_curve, LOSS_COLOR),
         ("default init $\\mathcal{N}(0, 1)$", default_losses, default_curve, VARIANT_COLOR))
for name, curve, em, color in inits:
    axes[0].plot(np.arange(1, len(curve) + 1), smooth(curve), color=color, lw=1.8, label=name)
    axes[1].plot(list(em), list(em.values()), "o-", ms=3, color=color, label=name)
default_end = smooth(default_losses)[-1]  # where the default-init run stops
axes[0].plot(K, default_end, "o", color=VARIANT_COLOR, ms=6)
axes[0].annotate(f"default init: run stopped at step {K}", (K, default_end), xytext=(8, 6),
                 textcoords="offset points", fontsize=8, color=VARIANT_COLOR)
axes[0].axvline(K, color="grey", ls=":", lw=1, label=f"step {K}: the comparison")
axes[0].set(xlabel="training step", ylabel="cross-entropy, 50-step average (log scale)",
            yscale="log", title="Loss: same model, batches and seeds")
axes[1].axvline(K, color="grey", ls=":", lw=1, label=f"step {K}: the comparison")
axes[1].set(xlabel="training step", ylabel="sequences decoded exactly (of 256)", ylim=(0, 265),
            title="Exact match every 100 steps")
for ax in axes[:2]:
    ax.legend(fontsize=8)
by_length = range(3, MAX_LEN + 1)
wrong = [int((~default_correct[test_len == L]).sum()) for L in by_length]
total = [int((test_len == L).sum()) for L in by_length]
axes[2].bar(by_length, total, color="#d9d9d9", label="all test sequences")
axes[2].bar(by_length, wrong, color=VARIANT_COLOR, label="of which wrong, default init")
axes[2].set(xlabel="sequence length $L$", ylabel="test sequences", ylim=(0, 1.35 * max(total)),
            title=f"Default init at step {K}: which fail")
axes[2].legend(fontsize=8, loc="upper center", ncols=2)
fig.suptitle("The initialisation ablation: only the embedding tables' initial scale differs")
save_figure(fig, "training_init_ablation")
plt.show()

# %% [markdown]
# The default initialisation is slower from the first steps on, and it fails mostly on the
# longer sequences, where an alignment error has more chances to happen.
#
# ### What changed from the tutorial, and the evidence for it
#
# **In short** (the evidence follows): the parameter count is reproduced exactly (930,828);
# the exact-match score is 255/256 in the stored run at step 2,500 and 256/256 for each of the
# four seeds of a study; the ablation's model is much worse at every evaluation up to step 800.
# Where our numbers differ from the tutorial's, the reasons are the batches' random stream, the
# length of the run and what the tutorial calls its final loss.
#
# **Steps.** This notebook trains for 2,500 steps, not the tutorial's 6,000 (the appendix "Why
# this notebook stops at 2,500 steps" says why, and what a step costs).
#
# The schedule has no end point (it depends only on the step), and each step draws its batch
# from the same generator whatever the length of the run, so this notebook's 2,500 steps are
# exactly the first 2,500 steps of a 6,000-step run of this recipe (the tutorial's length; not of
# the tutorial's own run, whose batches come from another random stream, see below), and the
# question is how early the results settle. In the stored run, exact match was 240 of 256 at
# step 1,000 (in the middle of
# a dip), 255 at step 1,500, 256 at step 2,000 and 255 at step 2,500 (printed in section 6):
# this run first reached the tutorial's perfect score at step 1,600, was at it at 5 of its 25
# evaluations (steps 1,600, 1,900, 2,000, 2,100 and 2,300), has wobbled between 253 and 256
# since step 1,400, and ends one sequence short of it at step 2,500, with its loss still falling.
#
# One run does not say how often that happens. `tools/seed_study.py` trains the recipe with
# several seeds exactly as this notebook does (on the CPU, one thread per run; seed 0 is this
# notebook's recipe and seed), and tabulates for each seed exact match every 100 steps and every
# finding that this notebook and the next one check. Its tables for seeds 0 to 3 are committed beside it
# (`tools/seed_study.md`, raw numbers in `tools/seed_study.json`), from
#
#     python tools/seed_study.py --seeds 0-3 --steps 2500 --jobs 2 --out tools/seed_study
#
# (each seed costs about as much CPU time as this notebook's own training). The study ran under
# PyTorch's AVX-512 kernel (the default on the CPU it ran on); the stored run was trained under
# its AVX2 kernel (see the appendix on CPU kernels), which rounds some operations differently, and over 2,500 steps
# those last bits add up to another run: the study's seed-0 row is the AVX-512 kernel's run of
# seed 0, not the one stored here, so the stored run is a fifth sample of the recipe. Exact match
# on this notebook's 256 test sequences, lowest and highest over the study's four seeds, and the
# stored run's (printed in section 6 and, for the default initialisation, under the ablation's
# table above; in bold where it falls outside the study's range):
#
# | after step | 300 | 600 | 1,000 | 1,500 | 2,000 | 2,500 |
# |---|---|---|---|---|---|---|
# | paper init, study | 142–196 | 211–234 | 248–254 | 253–256 | 253–256 | 256 |
# | seeds at 256/256, study | 0 of 4 | 0 of 4 | 0 of 4 | 1 of 4 | 1 of 4 | 4 of 4 |
# | paper init, stored run | 185 | 222 | **240** | 255 | 256 | **255** |
# | default init (ablation), study | 7–13 | 18–34 | | | | |
# | default init (ablation), stored run | 13 | **13** | | | | |
#
# Every seed is at 256/256 at step 2,500; one (seed 3) first reached it at step 1,400 and dipped
# below it again before step 2,500, the others
# wobble between 253 and 256 in the last few hundred steps (seed 1 sits at 253 or 254 from step
# 2,100 to 2,400). So 2,500 steps is where all four runs are at or within a few sequences of the
# perfect score, and the one evaluation at 2,500 happens to find all four at 256; a few hundred
# steps more would not change the picture.
#
# The stored run shows how much luck is in one evaluation: it falls below the study's range at
# step 2,500 (255), at step 1,000 (240, in its dip) and, with the default initialisation, at
# step 600 (13), and inside it at the other steps of the table. Every bound on a trained model
# that this notebook asserts and the study measures held for all four seeds, with room to spare
# (the study's ranges are given with each check); the bounds are chosen wider than that, for
# another PyTorch or device. Some asserted bounds are not in the study:
#
# - in section 6, the per-batch loss's wider scatter late in training and the clipping shares,
#   checked on the stored run only;
# - in section 9, the smoothed model's mean KL from $q$ above 0.01, checked on the stored run and
#   in `make robust`'s runs under three other seeds (`tools/robust.md`), and the three bounds on
#   the wrong tokens' probabilities (the smoothed model's median between a fifth and twice
#   $\varepsilon / V$, the plain model's median ten times lower, some wrong token above five
#   times $\varepsilon / V$), checked on the stored run only;
# - the position's share of section 7, which the notebook itself measures over seeds 0 to 3
#   (fresh models need no training).
#
# **Differences in the numbers.** Ours are not the tutorial's, for three reasons. Our batches
# come from a different random stream (drawn in one vectorised call, not sequence by
# sequence), so the runs are different samples of the same process. Our main run stops at
# 2,500 steps, not 6,000, and its loss is still falling. And the ablation is compared at step
# 800, where the default initialisation is much further behind than the tutorial's was at step
# 6,000 (it catches up slowly: 244/256 there).
#
# Mind also what the tutorial's "final loss" is: the
# loss of one batch of 64 sequences, which swings by a factor of ten from one step to the next
# (the pale line in the loss plot). In the stored run the last batch of step 2,500 had a loss of
# 0.0135, more than twice the tutorial's 0.0059, while the mean of the last 100 steps was 0.0204.
# The 100-step means are the numbers to compare, and the loss *ratio* between the two
# initialisations at equal steps (9.3 in the stored run at step 800; 17 in the tutorial at step
# 6,000, from single batches) tells the same story.
#
# **Reproduced: 930,828 parameters; with the paper's initialisation, 255/256 in the stored run at
# step 2,500 (it was at the tutorial's 256/256 at 5 of its 25 evaluations, the first at step
# 1,600, and the study's four seeds are all at 256/256 at step 2,500); and a much worse
# model at every evaluation up to step 800 (how far the ablation runs) when PyTorch's default
# $\mathcal{N}(0, 1)$ init meets the $\sqrt{d_\text{model}}$ multiply.**
#
# ## 8 · What failure looks like
#
# Exact match counts the failures; it does not show them. Two weaker models are at hand: the
# main run's weights at step 100 (the callback kept them) and the default-init model of section
# 7 at step 800. Both decode the 256 test sequences, and for each output we find the first
# position where it differs from the reversal.

# %%
early_model = Transformer(VOCAB, VOCAB)
early_model.load_state_dict(snapshots[EARLY_STEPS])
early_model = early_model.to(device).eval()
test_mask = padding_mask(test_len, MAX_LEN).to(device)  # (256, 1, 1, L_max)
test_graded = test_out != PAD  # (256, L_max + 1): the L symbols and EOS
positions = torch.arange(MAX_LEN + 1)


def first_errors(m: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy outputs (B, L_max + 1), PAD-padded, and each row's first wrong position (or L_max + 1)."""
    out = greedy_decode(m, test_src.to(device), max_new_tokens=MAX_LEN + 1, src_mask=test_mask)
    out = out.tokens[:, 1:].cpu()
    out = F.pad(out, (0, MAX_LEN + 1 - out.size(1)), value=PAD)  # decoding may stop early
    wrong = (out != test_out) & test_graded
    return out, torch.where(wrong.any(1), wrong.int().argmax(1), MAX_LEN + 1)


@torch.no_grad()
def teacher_forced_tokens(m: Transformer) -> torch.Tensor:
    """The argmax at every position when the decoder reads the true prefix: (B, L_max + 1)."""
    test_in = torch.cat([torch.full((256, 1), BOS), test_out[:, :-1]], dim=1)  # BOS, then y
    test_in = test_in.masked_fill(test_in == EOS, PAD)  # tgt_in holds no EOS
    logits = m(test_src.to(device), test_in.to(device), src_mask=test_mask,
               tgt_mask=causal_mask(MAX_LEN + 1, device=device))
    return logits.argmax(-1).cpu()


failures = {}
for name, m in (("step 100", early_model), ("default init, step 800", default_model)):
    out, first = first_errors(m)
    after = (positions > first[:, None]) & test_graded  # (B, T): graded positions after the first error
    failures[name] = {
        "out": out, "first": first, "wrong": int((first <= MAX_LEN).sum()),
        "free": (out == test_out)[after].float().mean().item(),
        "forced": (teacher_forced_tokens(m) == test_out)[after].float().mean().item(),
    }

# %% [markdown]
# The question is what happens *after* the first error. At every later position, compare two
# things: the token the free-running decoder produced (reading its own, now wrong, prefix), and
# the token the same model predicts when it reads the true prefix instead (teacher forcing, as in
# training). Both are graded against the same reversal:

# %% tags=["nbval-ignore-output"]
print(f"{'model':24s}{'wrong outputs':>14s}   right after the first error: "
      f"{'own prefix':>10s}{'true prefix':>12s}")
for name, f in failures.items():
    print(f"{name:24s}{f['wrong']:>10d}/256   {'':29s}{f['free']:>10.1%}{f['forced']:>12.1%}")

# %% [markdown]
# **Check:** for both models, the positions after a first error are right 60 % or more of the
# time with the true prefix, and at most 50 % of the time with the model's own (the stored run:
# 80 % and 33 % at step 100, 69 % and 24 % with the default init; the study: 68 % to 81 % and 22 %
# to 34 %): the error, not the position, is what spoils them.

# %%
for name, f in failures.items():
    assert f["wrong"] > 20, name  # weak models: plenty of failures to look at
    assert f["forced"] >= 0.6 and f["free"] <= 0.5, name

# %% jupyter={"source_hidden": true}
CELL_TARGET, CELL_RIGHT, FIRST_WRONG, LATER_WRONG = "#e6e6e6", "#fff3d6", COLORS["accent"], "#f4b6b6"


def draw_failures(ax, out: torch.Tensor, first: torch.Tensor, rows: list[int], title: str) -> None:
    """Target (grey) and output of each row; output tokens right cream, the first wrong one red,
    later wrong ones pink."""
    names = {PAD: "·", BOS: "BOS", EOS: "EOS"}
    for i, b in enumerate(rows):
        L = int(test_len[b])
        for kind, tokens in (("target", test_out[b]), ("output", out[b])):
            y = 3 * i + (kind == "output")
            for t in range(MAX_LEN + 1):
                token = int(tokens[t])
                color = (CELL_TARGET if kind == "target" else CELL_RIGHT) if t <= L else "white"
                if kind == "output" and token != int(test_out[b, t]):
                    color = FIRST_WRONG if t == int(first[b]) else LATER_WRONG
                ax.add_patch(plt.Rectangle((t - 0.5, y - 0.5), 1, 1, facecolor=color,
                                           edgecolor="white"))
                ax.text(t, y, names.get(token, str(token)), ha="center", va="center", fontsize=8,
                        color="white" if color == FIRST_WRONG else "black")
            ax.text(-0.7, y, kind, ha="right", va="center", fontsize=8)
    ax.set(xlim=(-3.2, MAX_LEN + 0.5), ylim=(3 * len(rows) - 1, -1), title=title,
           xlabel="output position $t$")
    ax.set_xticks(range(MAX_LEN + 1))
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), layout="constrained",
                         gridspec_kw={"width_ratios": [1, 1, 0.8]})
for ax, (name, f) in zip(axes[:2], failures.items(), strict=True):
    rows = [b for b in range(256) if int(f["first"][b]) <= MAX_LEN and int(test_len[b]) >= 6][:5]
    draw_failures(ax, f["out"], f["first"], rows, f"{name}: five wrong outputs")
x = np.arange(len(failures))
axes[2].bar(x - 0.2, [f["forced"] for f in failures.values()], 0.4, color=LOSS_COLOR,
            label="true prefix (teacher forcing)")
axes[2].bar(x + 0.2, [f["free"] for f in failures.values()], 0.4, color=EM_COLOR,
            label="its own prefix (free-running)")
axes[2].set_xticks(x, list(failures), fontsize=9)
axes[2].set(ylim=(0, 1.15), ylabel="share right, of the positions\nafter the first error",
            title="After the first error")
axes[2].legend(fontsize=8, loc="upper center", ncols=1)
fig.legend(handles=[Patch(facecolor=c, edgecolor="grey", label=k) for k, c in
                    (("target (the reversal, then EOS)", CELL_TARGET), ("output: right", CELL_RIGHT),
                     ("output: first wrong token", FIRST_WRONG),
                     ("output: later wrong token", LATER_WRONG))],
           loc="outside lower left", ncols=4, fontsize=9)
early_f, default_f = failures.values()
fig.suptitle("How the weaker models fail: after the first wrong token (red), only "
             f"{early_f['free']:.0%} and {default_f['free']:.0%} of the later positions come out "
             f"right,\nagainst {early_f['forced']:.0%} and {default_f['forced']:.0%} when the "
             "decoder reads the true prefix (right-hand panel)")
save_figure(fig, "training_failures")
plt.show()

# %% [markdown]
# In the stored run the model of step 100 gets 159 of the 256 outputs wrong, the default-init
# model of step 800 gets 219 wrong. In the examples, the step-100 model's first errors are
# symbols skipped or swapped (in the second, 9 and 7 come out in the wrong order), and two of
# them sit at a repeated symbol, where finding one's place is hardest: in the third example the
# second of the doubled 9s comes out as the 7 before them, in the fourth the model skips
# the 5 and jumps to the doubled 8. The default-init model often goes wrong at the very first
# symbol. Then the error is read back, and
# the rest of the output runs off course, sometimes ending early.
#
# After their first error, only
# about a third (step 100) and a quarter (default init) of the later positions are right; reading
# the true prefix instead, the same models get about four in five and two in three of those same
# positions right. The error, not the difficulty of the later positions, is what spoils them.
# This is called *exposure bias* (Ranzato et al., 2016): trained only on true prefixes, the model
# has never seen its own mistakes, and has not learnt to recover from them.
#
# **A wrong token is not an isolated mistake: the decoder reads it back, and what follows is
# built on it. Teacher forcing never shows the model its own errors, which is why exact match,
# not the training loss, is the test.**
#
# ## 9 · Label smoothing
#
# Cross-entropy against a one-hot target is minimised by putting probability 1 on the right
# token, which the model can only approach by making its logits ever larger: it is rewarded for
# becoming over-confident. **Label smoothing** (Szegedy et al., 2016) replaces the one-hot target
# with a mixture of it and the uniform distribution over the $V$ classes,
#
# $$q = (1 - \varepsilon)\,\mathrm{onehot}(y) + \frac{\varepsilon}{V},$$
#
# and the loss $-\sum_k q_k \log p_k$ is now minimised by $p = q$, whose largest entry is
# $1 - \varepsilon + \varepsilon / V$. Vaswani et al. (2017, §5.4) use $\varepsilon_{ls} = 0.1$:
# it "hurts perplexity, as the model learns to be more unsure, but improves accuracy and BLEU".
# PyTorch implements exactly this $q$ in `F.cross_entropy(..., label_smoothing=ε)` (the
# uniform part covers all $V$ classes, `PAD` included, and `ignore_index` still drops the padded
# positions). Here $V = 12$, so the optimum puts $0.9083$ on the right token, $0.0083$ on every
# other one, and the loss can go no lower than the entropy of $q$:

# %%
eps_ls = 0.1
q_true = 1 - eps_ls + eps_ls / VOCAB
q_other = eps_ls / VOCAB
floor = -(q_true * math.log(q_true) + (VOCAB - 1) * q_other * math.log(q_other))
q_logits = torch.full((1, VOCAB), math.log(q_other))
q_logits[0, 5] = math.log(q_true)  # a model that predicts exactly q for target 5
at_optimum = F.cross_entropy(q_logits, torch.tensor([5]), label_smoothing=eps_ls).item()
assert math.isclose(at_optimum, floor, rel_tol=1e-6)
print(f"optimal max probability {q_true:.4f}, loss floor H(q) = {floor:.4f} nats")

# %% [markdown]
# The same recipe with $\varepsilon = 0.1$, for 600 steps (under a minute on a quiet machine's
# CPU thread, several times that on a busy machine; the cell prints this run's time);
# it is compared with the main run's weights at step 600, which the callback kept: same seed,
# same batches, same number of updates.

# %% tags=["nbval-ignore-output"]
start = time.perf_counter()
smooth_model, smooth_history = train_reversal(label_smoothing=eps_ls, steps=SMOOTHING_STEPS,
                                              device=device, progress=True)
print(f"{time.perf_counter() - start:.0f} s")

# %% [markdown]
# Both models predict every position of one fresh batch under teacher forcing; over the graded
# positions we average the probability of the top token and the entropy of the predicted
# distribution.

# %%
plain_model = Transformer(VOCAB, VOCAB)
plain_model.load_state_dict(snapshots[SMOOTHING_STEPS])
plain_model = plain_model.to(device).eval()
smooth_losses = np.array(smooth_history["loss"])
probe_batch = make_batch(256, MAX_LEN, VOCAB, torch.Generator().manual_seed(11))


@torch.no_grad()
def predicted_distributions(m: Transformer, batch) -> torch.Tensor:
    """Softmax of the model's logits at the graded positions of a batch: (N, V)."""
    src, tgt_in, tgt_out, lengths = (t.to(device) for t in batch)
    logits = m(src, tgt_in, src_mask=padding_mask(lengths, src.size(1)),
               tgt_mask=causal_mask(tgt_in.size(1), device=device))  # (B, T, V)
    return logits.softmax(dim=-1)[tgt_out != PAD].cpu()  # (B, T, V) -> (N, V)


graded_targets = probe_batch[2][probe_batch[2] != PAD]  # (N,), the right answers
stats = {}
for name, m in (("no smoothing", plain_model), ("smoothing 0.1", smooth_model)):
    p = predicted_distributions(m, probe_batch)  # (N, V)
    top = p.max(dim=-1).values  # (N,)
    stats[name] = {
        "p": p,
        "top": top,
        "entropy": -(p * p.clamp_min(1e-12).log()).sum(dim=-1),  # (N,), in nats
        "accuracy": (p.argmax(dim=-1) == graded_targets).float().mean().item(),
        "exact": exact_match(m),
    }

# %% [markdown]
# This run's numbers (another seed, PyTorch, CPU kernel or device prints others):

# %% tags=["nbval-ignore-output"]
print(f"{'':14s}{'mean top p':>11s}{'max top p':>10s}{'top p > 0.99':>13s}{'entropy':>9s}"
      f"{'accuracy':>10s}{'exact':>7s}")
for name, st in stats.items():
    print(f"{name:14s}{st['top'].mean():11.4f}{st['top'].max():10.4f}"
          f"{(st['top'] > 0.99).float().mean():13.1%}{st['entropy'].mean():9.4f}"
          f"{st['accuracy']:10.1%}{st['exact']:7d}")
print(f"smoothing 0.1: mean loss of its last 100 steps {smooth_losses[-100:].mean():.4f} "
      f"(floor {floor:.4f})")
smooth_log_p = stats["smoothing 0.1"]["p"].log()  # (N, V)
smooth_q = torch.full_like(smooth_log_p, eps_ls / VOCAB)
smooth_q[torch.arange(len(smooth_q)), graded_targets] += 1 - eps_ls
print(f"smoothing 0.1: mean KL(q || p) on this batch "
      f"{(smooth_q * (smooth_q.log() - smooth_log_p)).sum(-1).mean():.4f} nats")
top_agree = (stats["no smoothing"]["p"].argmax(-1) == stats["smoothing 0.1"]["p"].argmax(-1))
print(f"the two models' top tokens agree at {top_agree.float().mean():.1%} of the "
      f"{len(graded_targets)} graded positions")

# %% [markdown]
# ("accuracy" is the share of graded positions whose top token is the right one, under teacher
# forcing; "exact" is exact match with greedy decoding, out of 256.)
#
# **Check:** first the loss itself. The smoothed cross-entropy of the smoothed model on this
# batch, computed as training computes it (`token_loss`: the whole $(B, T)$ target batch,
# `ignore_index=PAD`, `label_smoothing=0.1`; the padded positions get a uniform guess, which
# `ignore_index` must drop), equals $-\sum_k q_k \log p_k$ over the graded positions, computed by
# hand with the uniform part over all 12 classes, `PAD` included, as claimed above. The same sum
# with the uniform part over the 11 classes other than `PAD` ($\varepsilon / 11$ each) differs
# from it by far more than rounding, so the check would notice if `ignore_index` also took `PAD`
# out of the uniform part.
#
# That loss exceeds the floor $H(q)$ by the mean $\mathrm{KL}(q \,\|\, p)$, an identity that
# holds for any $p$ (it is why no model can go below the floor, exercise 2), so it is not
# asserted here. What can fail is the size of that KL: after 600 steps the smoothed model has
# not matched $q$ exactly, and its mean KL on this batch is above 0.01 nats (the stored run:
# 0.0337, printed above).
#
# Then the findings, with margins around the stored run: without smoothing half of the predictions or
# more put over 0.99 on their top token (the stored run: 79 %; the study: 71 % to 83 %); with it
# none does, and the mean top probability is within 0.02 of the optimum $0.908$ (0.9029; the
# study: within 0.009).
#
# The entropy is more than four times higher (6.6 times in the stored
# run, 5.7 to 8.6 in the study), and the decisions barely move: both accuracies are above 95 %
# and within three percentage points of each other (98.1 % and 98.7 % in the stored run; the
# study's seeds: at most 0.3 points apart, so the bound leaves ten times that room), and the
# two models' top tokens agree at 93 % or more of
# the positions (the stored run: 97.4 %, printed above; the study: 96 % to 98 %).

# %%
plain, smoothed = stats["no smoothing"], stats["smoothing 0.1"]
log_p = smoothed["p"].log()  # (N, V); a softmax output, so no zeros
q = torch.full_like(log_p, eps_ls / VOCAB)  # the uniform part: all V classes, PAD included
q[torch.arange(len(q)), graded_targets] += 1 - eps_ls
by_hand = -(q * log_p).sum(dim=-1).mean()
probe_targets = probe_batch[2]  # (B, T): the whole target batch, PAD at the padded positions
probe_log_p = torch.full((*probe_targets.shape, VOCAB), -math.log(VOCAB))  # (B, T, V): uniform
probe_log_p[probe_targets != PAD] = log_p  # the model's at the graded positions
training_loss = token_loss(probe_log_p, probe_targets, label_smoothing=eps_ls)  # as in training
assert_close(training_loss, by_hand)
q_no_pad = torch.full_like(q, eps_ls / (VOCAB - 1))  # the other reading: PAD left out
q_no_pad[:, PAD] = 0.0
q_no_pad[torch.arange(len(q)), graded_targets] += 1 - eps_ls
assert not torch.isclose(training_loss, -(q_no_pad * log_p).sum(dim=-1).mean(), rtol=1e-3)
kl = (q * (q.log() - log_p)).sum(dim=-1).mean()
assert kl > 0.01  # the model: p is not yet q

assert (plain["top"] > 0.99).float().mean() >= 0.5 and (smoothed["top"] > 0.99).sum() == 0
assert abs(smoothed["top"].mean() - q_true) < 0.02
assert smoothed["entropy"].mean() > 4 * plain["entropy"].mean()
assert min(plain["accuracy"], smoothed["accuracy"]) > 0.95
assert abs(smoothed["accuracy"] - plain["accuracy"]) < 0.03
agree = (plain["p"].argmax(dim=-1) == smoothed["p"].argmax(dim=-1)).float().mean().item()
assert agree >= 0.93

# %% jupyter={"source_hidden": true}
# The first graded position where both models are right and the plain one is sure of itself.
both_right = (plain["p"].argmax(-1) == graded_targets) & (smoothed["p"].argmax(-1) == graded_targets)
position = int((both_right & (plain["top"] > 0.99)).nonzero()[0, 0])
target_token = int(graded_targets[position])
fig, axes = plt.subplots(1, 2, figsize=(13, 4), layout="constrained",
                         gridspec_kw={"width_ratios": [1.4, 1]})
ax = axes[0]
tokens = np.arange(VOCAB)
ax.bar(tokens - 0.2, plain["p"][position].numpy(), width=0.4, color=LOSS_COLOR,
       label="no smoothing")
ax.bar(tokens + 0.2, smoothed["p"][position].numpy(), width=0.4, color=VARIANT_COLOR,
       label="label smoothing ε = 0.1")
ax.axhline(q_true, color=COLORS["accent"], ls="--", lw=1,
           label=f"smoothed target q: {q_true:.3f} and {q_other:.4f}")
ax.axhline(q_other, color=COLORS["accent"], ls="--", lw=1)
for level, what in ((q_true, "the correct token"), (q_other, "every other token")):
    ax.text(-0.5, 1.25 * level, f"q = {level:.3g} for {what}", ha="left", va="bottom", fontsize=8,
            color=COLORS["accent"])
for dx, st in ((-0.2, plain), (0.2, smoothed)):  # a log axis hides 0.9 against 1: say them
    ax.text(target_token + dx, 2e-8, f"{float(st['p'][position, target_token]):.3f}",
            ha="center", va="bottom", fontsize=10, fontweight="bold", rotation=90,
            color="white")  # inside the bar
labels = [{PAD: "PAD", BOS: "BOS", EOS: "EOS"}.get(int(t), str(int(t))) for t in tokens]
labels[target_token] += "\n(correct)"
ax.set_xticks(tokens, labels)
ax.set(yscale="log", ylim=(1e-8, 20), xlabel="token", ylabel="predicted probability (log scale)",
       title="One position's predicted distribution")
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=3)
ax = axes[1]
low = min(plain["top"].min().item(), smoothed["top"].min().item())
bins = np.linspace(np.floor(20 * low) / 20, 1.0, 41)  # from just below the lowest top probability
for name, st, color in (("no smoothing", plain, LOSS_COLOR), ("smoothing 0.1", smoothed, VARIANT_COLOR)):
    ax.hist(st["top"].numpy(), bins=bins, color=color, histtype="step", lw=1.8, label=name)
ax.axvline(q_true, color=COLORS["accent"], ls="--", lw=1, label=f"optimum {q_true:.3f}")
ax.set(yscale="log", xlabel="probability of the top token",
       ylabel="graded positions (log scale)", xlim=(bins[0], 1.0),
       title=f"Confidence over {len(plain['top'])} graded positions")
ax.legend(fontsize=8, loc="upper left")
fig.suptitle(f"Label smoothing after {SMOOTHING_STEPS} steps: the same decisions, capped confidence")
save_figure(fig, "training_label_smoothing")
plt.show()

# %% [markdown]
# The probabilities of the wrong tokens, at the position on the left and over all graded
# positions (this run's numbers):

# %% tags=["nbval-ignore-output"]
wrong_token = torch.arange(VOCAB) != graded_targets[:, None]  # (N, V): True at the wrong tokens
wrong_median = {}
for name, st in (("no smoothing", plain), ("smoothing 0.1", smoothed)):
    here = st["p"][position][torch.arange(VOCAB) != target_token]  # (V - 1,)
    wrong_median[name] = st["p"][wrong_token].median().item()
    print(f"{name:14s} at that position {here.min():.1e} to {here.max():.1e}; "
          f"over all positions: median {wrong_median[name]:.1e}")
print(f"epsilon / V = {eps_ls / VOCAB:.1e}")
largest_wrong = smoothed["p"].masked_fill(~wrong_token, 0).max(dim=-1).values  # (N,)
over = (largest_wrong > eps_ls / VOCAB).float().mean().item()
print(f"smoothing 0.1: some wrong token gets more than epsilon / V at {over:.1%} of the "
      f"positions, up to {largest_wrong.max():.2f}; the lowest top probability is "
      f"{smoothed['top'].min():.2f}")

# %% [markdown]
# **Check:** with smoothing, the median wrong-token probability is of the order of
# $\varepsilon / V$ (between a fifth and twice it), the plain model's at least ten times lower,
# and some wrong token gets more than five times $\varepsilon / V$. These bounds are not in the
# seed study (section 7): they have been checked on the stored run only.

# %%
assert eps_ls / VOCAB / 5 < wrong_median["smoothing 0.1"] < 2 * eps_ls / VOCAB
assert wrong_median["no smoothing"] < wrong_median["smoothing 0.1"] / 10
assert largest_wrong.max() > 5 * eps_ls / VOCAB  # not below it everywhere

# %% [markdown]
# At the position drawn both models put the correct token on top (it was chosen so), and over
# the whole batch their top tokens agree at 97.4 % of the graded positions in the stored run
# (printed above): the models differ in how much they bet on their top token. Without
# smoothing the wrong tokens get tiny probabilities: $8 \times 10^{-7}$ to $6 \times 10^{-5}$ at
# the position drawn, a median of $8 \times 10^{-5}$ over all positions (the stored run, printed
# above), and the plain loss rewards pushing them lower still. With smoothing they are of the
# order of $\varepsilon / V = 0.0083$, the value the model was asked to predict: 0.0031 to
# 0.0058 at the position drawn, a median of 0.0072 over all of them. They are not capped there,
# though: at 88 % of the positions at least one wrong token gets more than $\varepsilon / V$
# (the last line printed above), and where the model is unsure (top probabilities down to 0.43,
# right-hand plot) one wrong token takes far more, up to 0.92 at a position whose top token is
# wrong (1.3 % of the positions are, from the accuracy of 98.7 %).
#
# After 600 steps the smoothed model is not at its optimum yet, so its top probabilities
# scatter around $0.908$, some above it (0.95 at most), but none comes near 1.
#
# On a task this clean, smoothing changes almost nothing about the decisions. Exact match, which
# needs every token of a sequence right, can move more, either way: in the stored run both models
# decode 222 of 256 at step 600, while the study's seeds differ by up to 11 sequences (232
# against 221 for seed 0, 211 against 220 for seed 2), the size by which one run's exact match
# still swings between evaluations at this stage of training (section 6). On real data (later
# notebooks), where the "right" token is often one of several plausible ones, a model that
# keeps some probability for the alternatives is what the paper found to translate better.
#
# **Label smoothing caps the model's confidence near $1 - \varepsilon + \varepsilon/V$: the
# loss has a floor, the predictions keep some entropy, and the decisions barely change.**
#
# ## Recap
#
# | piece | code | shape / value |
# |---|---|---|
# | the task | `make_batch(B, L_max, V, generator)` | src $(B, L_\max)$; tgt_in, tgt_out $(B, L_\max + 1)$; lengths $(B,)$ |
# | teacher forcing | `tgt_in = [BOS, y]`, `tgt_out = [y, EOS]` | one parallel pass over $(B, T, V)$ logits |
# | hiding the future | `causal_mask(T)` as `tgt_mask` | $(1, 1, T, T)$ |
# | hiding source padding | `padding_mask(lengths, T_src)` as `src_mask` | $(B, 1, 1, T_\text{src})$ |
# | the loss | `F.cross_entropy(..., ignore_index=PAD, label_smoothing=ε)` | mean over $\sum_b (L_b + 1)$ positions |
# | the schedule | `lr_lambda(s, d_model, w)` via `LambdaLR`, Adam lr = 1 | peak $(d_\text{model} w)^{-1/2}$ at $s = w$ |
# | the loop | `bare_update` (one step, no hooks); `Trainer`, `train_model(model, steps, ...)`, clip at norm 1 | history: loss, lr and pre-clip gradient norm per step |
# | a fixed recipe | `ReversalRecipe`, `reversal_recipe(**changes)`, `train_reversal(**changes)` | bit-identical with the same PyTorch, CPU kernel and thread count |
# | evaluation | `greedy_decode(model, src, max_new_tokens=...)`, `exact_match(model, n=256)` | a `Generation`: `.tokens` $(B, \le L_\max + 2)$, `.log_probs` $(B,)$; 250 or more of 256 |
# | checkpoints | `save_checkpoint`, `load_checkpoint`, `get_reversal_model` | atomic; `weights_only=True` |
#
# ## Exercises
#
# 1. `train_model` hands `LambdaLR` the lambda `s -> lr_lambda(s + 1, ...)`. What would the
#    tutorial's `s -> lr_lambda(s, ...)` change? Find out which rate each update gets.
# 2. Show that with label smoothing the loss $-\sum_k q_k \log p_k$ is smallest at $p = q$:
#    perturb the optimal logits in random directions and check that the loss never goes down.
# 3. Train a small model *without* the causal mask. What happens to the training loss, and to
#    exact match? Explain both.
#
# **Solutions.**
#
# 1. `LambdaLR` sets the rate of the first update from `lambda(0)`, and `lr_lambda` clamps 0 to
#    1, so without the shift updates 1 and 2 get the same rate $\mathrm{lr}(1)$, and from then
#    on update $s$ gets $\mathrm{lr}(s - 1)$: the schedule runs one step late, and its peak falls
#    on update $w + 1$. (The tutorial's printout is not affected: it prints the rate *after*
#    `sched.step()`, which is the next update's.) Harmless, but the shift makes the code say what
#    the formula says. Recording the rate each update uses:

# %%
param = nn.Parameter(torch.zeros(1))  # no gradient: Adam skips it, the schedule still runs
optimizer = torch.optim.Adam([param], lr=1.0)
unshifted = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, 128, 400))
used = []
for _ in range(800):
    used.append(optimizer.param_groups[0]["lr"])  # the rate of this update
    optimizer.step()
    unshifted.step()
assert used[0] == used[1] == lr_lambda(1, 128, 400)  # updates 1 and 2 share a rate
assert used[1:] == [lr_lambda(s, 128, 400) for s in range(1, 800)]  # update s + 1 gets lr(s)
assert int(np.argmax(used)) + 1 == 401  # the peak falls on update 401
assert rates[399] == max(rates) == lr_lambda(400, 128, 400)  # ours: on update 400
print(f"unshifted: updates 1 and 2 at {used[0]:.2e}, peak on update {int(np.argmax(used)) + 1}")

# %% [markdown]
# 2. The loss is $H(q) + \mathrm{KL}(q \,\|\, p)$, and the KL divergence is zero only at
#    $p = q$ and positive elsewhere. Numerically; and, to show that this search finds a lower
#    loss where there is one, the same search from a point that is not the optimum:

# %%
g = torch.Generator().manual_seed(0)
target = torch.tensor([5])
for _ in range(200):
    nudged = q_logits + 0.1 * torch.randn(1, VOCAB, generator=g)
    assert F.cross_entropy(nudged, target, label_smoothing=eps_ls).item() >= at_optimum - 1e-7
print(f"200 random perturbations: none below H(q) = {floor:.4f}")
# From the logits of a model sure of its answer (p = 0.9995 on the target), which the smoothed
# loss penalises, some of the same perturbations go down.
sure = torch.zeros(1, VOCAB)
sure[0, 5] = 10.0
sure_loss = F.cross_entropy(sure, target, label_smoothing=eps_ls).item()
lower = sum(F.cross_entropy(sure + 0.1 * torch.randn(1, VOCAB, generator=g), target,
                            label_smoothing=eps_ls).item() < sure_loss for _ in range(200))
assert lower > 0
print(f"from a sure model's logits (loss {sure_loss:.4f}): {lower} of 200 perturbations go lower")


# %% [markdown]
# 3. Without the mask, position $t$ of the decoder can read `tgt_in[t + 1]`, which *is* the
#    answer `tgt_out[t]`. The model learns to copy it, so the training loss collapses much
#    faster than with the mask. But at generation time position $t + 1$ does not exist yet, the
#    copy has nothing to read, and exact match is near zero. A small model (one layer,
#    $d_\text{model} = 32$) trained for 150 steps each way shows it:

# %% tags=["nbval-ignore-output"]
def train_small(use_causal_mask: bool, steps: int = 150) -> tuple[Transformer, float]:
    set_seed(0)
    small = Transformer(VOCAB, VOCAB, d_model=32, num_heads=2, d_ff=64, num_layers=1, dropout_p=0.0)
    optimizer = torch.optim.Adam(small.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        src, tgt_in, tgt_out, lengths = make_batch(64, MAX_LEN, VOCAB, generator=data)
        tgt_mask = causal_mask(MAX_LEN + 1) if use_causal_mask else None
        logits = small(src, tgt_in, src_mask=padding_mask(lengths, MAX_LEN), tgt_mask=tgt_mask)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return small.eval(), loss.item()


honest, honest_loss = train_small(use_causal_mask=True)
cheat, cheat_loss = train_small(use_causal_mask=False)
honest_em, cheat_em = exact_match(honest), exact_match(cheat)
print(f"with the causal mask   : training loss {honest_loss:.4f}, exact match {honest_em}/256")
print(f"without the causal mask: training loss {cheat_loss:.4f}, exact match {cheat_em}/256")
assert cheat_loss < honest_loss / 5 and cheat_em <= 5

# %% [markdown]
# ## Appendix · The `Trainer`'s hooks for later notebooks
#
# `accumulate_gradients` and `Trainer` take keywords that this notebook never uses:
#
# - `autocast`: a context for each forward pass (notebook 13's mixed precision).
# - `scaler`: a `GradScaler` for float16 (notebook 13). It scales each loss before its backward
#   pass; `update` unscales the gradients before the `after_backward` callbacks, so that they,
#   and the clipping, see the true gradients, and the scaler skips the optimizer's step when a
#   float16 gradient overflowed.
# - `no_sync`: a context under which a data-parallel model does not synchronise its gradients,
#   for every micro-batch but the last (notebook 15).
# - `total_tokens` and `scale` (the `Trainer`'s `gradient_scale`): for a run whose tokens are
#   spread over several processes (notebook 15).
# - `loss_fn` and `count_fn`: another task's loss and token count. A micro-batch is whatever
#   the two read; `loss_fn(model, batch)` returns the mean loss per graded token and
#   `count_fn(batch)` the number of graded tokens, which weights it. Notebook 16's language model
#   passes its `lm_loss` and counts every target (its `LMTrainer` is this `Trainer` with the
#   two set), and so trains on this loop, and on notebook 15's `DistributedTrainer`, unchanged.
#
# `seconds` and `cpu_seconds` count the wall-clock and the CPU time spent in `update`, except the
# `after_update` callbacks, where evaluations go. Notebook 15's `DistributedTrainer` replaces the
# two methods meant for it, `count_tokens` (it counts the tokens of every process) and
# `accumulate` (it adds up every process's share of the loss, so that each records the loss of
# the global batch), and sets `gradient_scale` and `no_sync`.

# %% [markdown]
# ## Appendix · Reproducing the stored run: CPU kernels
#
# Section 4 says that the same recipe gives the same weights, bit for bit, with the same
# PyTorch, the same CPU kernel and one thread. The kernel is the condition that is easy to miss.
# PyTorch has several versions of its CPU kernels, one per set of vector instructions, and by
# default runs the widest one the CPU has (AVX-512 on newer x86 CPUs, AVX2 on older ones;
# `torch.backends.cpu.get_cpu_capability()` names the one in use). They round some operations
# differently, and over 2,500 steps those last bits add up to another run. It is the kernel that
# decides, not the machine: one CPU with AVX-512 trains the stored run under the AVX2 kernel and
# another run under its own.
#
# `make execute`, which stores the outputs, runs the AVX2 kernel wherever the CPU has AVX2 (on
# Linux it reads the CPU's flags and sets `ATEN_CPU_CAPABILITY=avx2`, CONTRIBUTING.md), so the
# stored run is the same on any such x86-64 machine. To reproduce it in `make lab` or a Jupyter
# of your own, start Jupyter with that variable set, on an x86-64 CPU:
# `ATEN_CPU_CAPABILITY=avx2 make lab` (`make lab` already runs one thread; for your own Jupyter,
# also set `OMP_NUM_THREADS=1`). Under PyTorch's own choice of kernel on an AVX-512 CPU, on
# another kind of CPU, or on a GPU, your run is another run of the same recipe, like another
# seed; section 4 says what that means for the numbers quoted and for the checks.

# %% [markdown]
# ## Appendix · Checkpoints
#
# Notebook 12 generates with this notebook's model, and should not have to train it again. A
# checkpoint holds three things: the weights (`state_dict`), the constructor arguments that
# rebuild the model, and free-form metadata (here the recipe and the history). Two details make
# it robust:
#
# - **Atomic save.** `torch.save` straight to the final path leaves a truncated file if the
#   process dies halfway, and a reader (another notebook running at the same time) may find a
#   half-written one. Writing to a temporary file in the same folder and then `os.replace`-ing it
#   onto the final name is atomic on POSIX file systems: a reader sees the old file or the new
#   one, never a mixture, and a crash leaves at worst a stray temporary file. (`os.replace`
#   works on Windows too, but Python guarantees its atomicity only on POSIX.)
# - **Safe load.** `torch.load` unpickles, and unpickling can run arbitrary code.
#   `weights_only=True` (the default since torch 2.6; the course passes it for older versions)
#   restricts it to tensors and plain containers, numbers and strings, which is all a checkpoint
#   needs. So the metadata is checked at save time to be made of those
#   types only, matched exactly (a namedtuple or a `defaultdict` is a subclass that saves and
#   then fails to load), or a checkpoint could be saved that cannot be loaded.
#
# Any failure to read (a missing file, a truncated one, foreign bytes, or a file that is not
# one of ours) becomes a `CheckpointError`, a `ValueError` that names the path.

# %%
#| export utils
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator:
    """Open a temporary file beside `path` to write; on a clean exit, flush it to disk and rename
    it onto `path`; on an error, delete it and leave `path` as it was.

    with atomic_open("run.json", "w", encoding="utf-8") as f: f.write(text)

    The course's one atomic write (checkpoints, tokenizers, cached corpora). On POSIX the rename
    (os.replace) replaces the name in one step; Windows offers os.replace too, but Python does
    not promise that it is atomic there. fsync puts the bytes on disk before the name moves."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file in the same folder (same file system), then one atomic rename.
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# %%
#| export
CHECKPOINT_FORMAT = 1  # bumped whenever the layout of the saved dictionary changes


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, corrupt or not written by save_checkpoint."""


_SAFE_SCALARS = (str, int, float, bool, type(None))


def _check_safe(value, where: str) -> None:
    """Raise a TypeError unless torch.load(weights_only=True) can read `value` back.

    The types are matched exactly: a subclass (a namedtuple, a defaultdict, an IntEnum) saves,
    and then the weights-only loader refuses it; OrderedDict, as in a state_dict, is allowed."""
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where}: keys must be str or int, got {type(key).__name__}")
            _check_safe(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_safe(item, f"{where}[{i}]")
    elif type(value) not in (*_SAFE_SCALARS, torch.Tensor, nn.Parameter):
        raise TypeError(
            f"{where} is a {type(value).__name__}; a checkpoint's metadata may hold only "
            "tensors, numbers, strings, None and lists/tuples/dicts of them"
        )


def save_checkpoint(path: str | os.PathLike, model: Transformer, **meta) -> Path:
    """Atomically write the model's weights, config and `meta` to `path`; return the path."""
    _check_safe(meta, "meta")
    payload = {
        "format": CHECKPOINT_FORMAT,
        "config": dataclasses.asdict(model.config),  # plain data: Transformer(**config) rebuilds it
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "meta": meta,
    }
    return atomic_save(payload, path)


def atomic_save(obj, path: str | os.PathLike) -> Path:
    """torch.save(obj) to `path` through atomic_open: a crash leaves the old file or the new one,
    never half of one."""
    with atomic_open(path) as f:
        torch.save(obj, f)
    return Path(path)


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device | None = None
) -> tuple[Transformer, dict]:
    """Rebuild the model saved at `path` (weights_only load); return (model in eval mode, meta)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, foreign bytes, a disallowed pickle global, ...
        raise CheckpointError(
            f"cannot read the checkpoint {path} (truncated or corrupt?): {err}"
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path} is not a format-{CHECKPOINT_FORMAT} checkpoint written by save_checkpoint"
        )
    try:
        model = Transformer(**payload["config"])
        model.load_state_dict(payload["state_dict"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"the checkpoint {path} does not rebuild a Transformer: {err}") from err
    if map_location is not None:
        model = model.to(map_location)
    return model.eval(), payload.get("meta", {})


# %% [markdown]
# The notebook's model goes to `checkpoints/reversal.pt` (relative to the notebooks' folder,
# which git ignores), with its recipe and history:

# %%
checkpoint = Path("checkpoints/reversal.pt")
save_checkpoint(checkpoint, model, recipe=dataclasses.asdict(RECIPE), history=history)
print(checkpoint, "saved")

# %% [markdown]
# **Check:** the file loads with plain `torch.load(..., weights_only=True)`; the rebuilt model
# has the same configuration and bit-identical weights and outputs; a save over an old file leaves
# one file and no temporary one; a save that fails halfway (here: a `lambda`, which cannot be
# pickled, after the weights) leaves the old file byte for byte as it was, which is what "atomic"
# promises, while a plain `torch.save` to the final name, the control, leaves a broken file in its
# place; and a truncated copy,
# random bytes and a missing path each give a `CheckpointError` (a `ValueError`) that names the
# file. What no check in a notebook can show is the other half of the promise, a crash of the
# machine mid-write: that rests on `os.replace` and `fsync`, as said above.

# %%
raw = torch.load(checkpoint, weights_only=True)
assert set(raw) == {"format", "config", "state_dict", "meta"} and raw["meta"]["recipe"] == dataclasses.asdict(RECIPE)
restored, meta = load_checkpoint(checkpoint, map_location=device)
assert restored.config == model.config and not restored.training
for (name, a), (_, b) in zip(model.state_dict().items(), restored.state_dict().items(), strict=True):
    assert torch.equal(a, b), name
with torch.no_grad():
    batch = [t.to(device) for t in probe_batch]
    mask_s, mask_t = padding_mask(batch[3], MAX_LEN), causal_mask(MAX_LEN + 1, device=device)
    assert torch.equal(model.eval()(*batch[:2], src_mask=mask_s, tgt_mask=mask_t),
                       restored(*batch[:2], src_mask=mask_s, tgt_mask=mask_t))
assert meta["history"]["loss"] == history["loss"]
with tempfile.TemporaryDirectory() as folder:  # a folder of its own: nothing else writes there
    save_checkpoint(Path(folder) / "reversal.pt", model)
    save_checkpoint(Path(folder) / "reversal.pt", model)  # the second save replaces the first
    assert os.listdir(folder) == ["reversal.pt"]  # and no temporary file is left over
    # A save that fails halfway: the pickler meets a lambda, which it cannot pickle, after the
    # weights. atomic_save must leave the old file as it was; plain torch.save (the control) cannot.
    payload = {"state_dict": model.state_dict(), "hook": lambda: None}
    for name, save in (("atomic_save", atomic_save), ("torch.save", torch.save)):
        target = Path(folder) / f"{name}.pt"
        atomic_save(model.state_dict(), target)
        before = target.read_bytes()
        try:
            save(payload, target)
        except Exception:  # noqa: BLE001 (which pickling error is torch's business)
            kept = target.read_bytes() == before
        else:
            raise AssertionError(f"{name} saved a lambda")
        assert kept == (name == "atomic_save"), name
        print(f"{name:11s} fails halfway -> the old file is {'intact' if kept else 'gone, a broken one in its place'}")
    assert sorted(os.listdir(folder)) == ["atomic_save.pt", "reversal.pt", "torch.save.pt"]  # no temporaries

broken = checkpoint.parent / "broken.pt"
for name, damage in (("truncated", checkpoint.read_bytes()[: checkpoint.stat().st_size // 2]),
                     ("random bytes", bytes(range(256)) * 4)):
    broken.write_bytes(damage)
    try:
        load_checkpoint(broken)
    except ValueError as err:
        assert isinstance(err, CheckpointError) and str(broken) in str(err)
        message = str(err).replace(os.sep, "/")  # the same output on Windows
        print(f"{name:12s} -> {type(err).__name__}: {message[:60]}...")
    else:
        raise AssertionError(f"a {name} checkpoint loaded")
broken.unlink()
try:
    load_checkpoint(checkpoint.parent / "missing.pt")
except CheckpointError as err:
    print(f"{'missing':12s} -> {type(err).__name__}: {str(err).replace(os.sep, '/')}")


# %% [markdown]
# `get_reversal_model` is what notebook 12 calls: it loads the checkpoint when it is there,
# readable, and was made with the requested recipe, and otherwise trains with the recipe and saves
# it. It trains on the device it is given (by default the best one). On an x86-64 CPU under
# PyTorch's AVX2 kernel (as in `make execute`, or with `ATEN_CPU_CAPABILITY=avx2` set before
# Jupyter starts, appendix "Reproducing the stored run: CPU kernels"), with the same PyTorch and one thread, the result is bit-identical to
# this notebook's model; under another CPU kernel (PyTorch's default on a CPU with AVX-512), on
# another kind of CPU or on a GPU it is another run of the same recipe.
# Either notebook can therefore run first, or alone.

# %%
#| export
def get_reversal_model(
    checkpoint: str | os.PathLike = "checkpoints/reversal.pt",
    device: str | torch.device | None = None,
    verbose: bool = True,
    progress: bool = False,
    **changes,
) -> Transformer:
    """Notebook 11's reversal model: loaded from `checkpoint`, or else trained on `device`, saved.

    `device=None` picks the best one (get_device); `progress=True` shows a bar while training.
    """
    recipe = reversal_recipe(**changes)
    device = get_device() if device is None else torch.device(device)
    path = Path(checkpoint)
    if path.is_file():
        try:
            model, meta = load_checkpoint(path, map_location=device)
        except CheckpointError as err:
            if verbose:
                print(f"{err}; training a new model")
        else:
            if meta.get("recipe") == dataclasses.asdict(recipe):  # saved as plain data
                if verbose:
                    print(f"loaded {path}")
                return model
            if verbose:
                print(f"{path} was trained with another recipe; training a new model")
    model, history = train_reversal(device=device, progress=progress, **changes)
    save_checkpoint(
        path,
        model,
        recipe=dataclasses.asdict(recipe),  # plain data: loads with weights_only=True
        history=history,
        device=device.type,
        torch=str(torch.__version__),
    )
    if verbose:
        print(f"trained {recipe.steps} steps on {device.type} and saved {path}")
    return model


# %% tags=["nbval-ignore-output"]
saved_at = checkpoint.stat().st_mtime_ns  # when the file was last written
reloaded = get_reversal_model(device=device)

# %%
assert checkpoint.stat().st_mtime_ns == saved_at  # loaded: not trained and saved again
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                             reloaded.state_dict().values(), strict=True))
print("get_reversal_model loaded the file, not a new run: this notebook's model, the same weights")

# %% [markdown]
# That it loaded the file rather than trained is what the assert above checks: the weights
# cannot tell the two apart (a CPU run of the recipe under the same kernel would be the same
# model), but a recipe check that wrongly refused the file would have trained and saved over it,
# and the file's modification time would have changed.
#
# **Check:** the recipe check both ways. In a folder of its own: this notebook's model, saved with its recipe, is
# returned for that recipe; asked for under another one (two training steps, to be quick), it
# must not be: a new model is trained as that recipe says, saved over the file, and loaded on
# the next call; and a corrupt file is replaced by a new run, not an error.

# %%
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "reversal.pt"
    save_checkpoint(path, model, recipe=dataclasses.asdict(RECIPE))
    assert same_weights(get_reversal_model(path, device="cpu", verbose=False), model)
    quick = get_reversal_model(path, device="cpu", verbose=False, steps=2)  # another recipe
    assert not same_weights(quick, model)
    assert same_weights(quick, two_steps)  # trained as that recipe says (section 6's 2 steps)
    assert load_checkpoint(path)[1]["recipe"]["steps"] == 2  # and saved over the file
    assert same_weights(get_reversal_model(path, device="cpu", verbose=False, steps=2), quick)
    path.write_bytes(b"not a checkpoint")
    assert same_weights(get_reversal_model(path, device="cpu", verbose=False, steps=2), quick)
print("another recipe: trained, saved, then loaded; a corrupt file: trained again")

# %% [markdown]
# **A checkpoint is weights + config + metadata, written to a temporary file and renamed into
# place, read back with `weights_only=True`; anything unreadable is a clear `ValueError`.**

# %% [markdown]
# ## Appendix · Checking `greedy_decode` against the plain loop
#
# Section 5 named five changes from `plain_greedy_decode` to the package's `greedy_decode`
# (its code is in section 5, after the plain loop). In full:
#
# - **Checks at the boundary.** A wrong argument fails at once with a message, not deep inside
#   attention; `encode` checks the source's ids once, and the steps run inside `validated()`
#   (notebook 00), so the model does not check the loop's own tokens again at every step.
# - **One loop for every strategy.** `generate` takes a function `choose` that maps the logits
#   `(B, V)` to the next tokens `(B,)`: greedy decoding passes the argmax; notebook 12's sampling
#   will pass a random draw. One step of the decoder, `next_token_logits`, is shared too.
# - **One result.** Every strategy returns a `Generation`: the `tokens`, as the plain loop
#   returns them, and `log_probs`, the total log-probability $\sum_t \log p(y_t \mid y_{<t}, x)$
#   the model gives each row's tokens (up to and including `EOS`), added up in the loop at no
#   extra cost. It is what notebook 12's beam search maximises, so the strategies can be compared
#   by it.
# - **An optional cache.** Re-running the decoder over the whole prefix repeats the work of
#   every earlier step. With `use_cache=True` (a `KVCache`, built in notebook 12), each step
#   feeds only the newest token, `ys[:, -1:]`, and the decoder's attention layers keep the keys
#   and values of the earlier ones (`Transformer.decode` already takes a `cache`, notebook 10).
#   Until notebook 12 we leave it off (the default). In this notebook `use_cache=True` fails with
#   a `NameError`: `KVCache` is the part of the `decoding` module that notebook 12 writes. The
#   installed package has it (`from transformer_from_scratch.decoding import greedy_decode`).
# - **No wait at every step.** `bool(finished.all())` brings a flag from the device to Python;
#   on a GPU that means waiting until every queued kernel has run, so the CPU cannot queue the
#   next step ahead. `generate` asks only every 8 steps. In between, rows that are finished get
#   `PAD` as before, so a batch that finished early only adds columns of `PAD`; at the end the
#   result is cut right after the column where the last row emitted `EOS`, which is exactly
#   where the step-by-step loop would have stopped.
#
# Without the cache none of them changes a token. The cache computes the same attention in
# another order, so its logits differ in the last bits; notebook 12 checks that the tokens stay
# the same on a CPU, and argues that on a GPU a near-tie may flip one (its stored run is on a
# CPU, so it shows no such flip). The last change, no wait at every step (the every-8-steps exit
# and the final cut), is checked here rather than in the middle of the training story.
#
# **Check:** `greedy_decode` gives exactly the tokens of the plain loop. The untrained model of
# section 2 rarely emits `EOS`, so its rows run to the cap; a copy of it whose output layer
# favours `EOS` (a larger bias for that one logit: the smallest that does it for this draw of
# weights, found by bisection) stops its rows at different steps, and
# finishes the batch before the cap, so the final cut matters: the output ends at the column of
# the last `EOS`.
#
# For both, and in training mode as well as in evaluation mode: the same tokens
# and the same shape, nothing but `PAD` after a row's `EOS`, the output as long as the last row
# needed, and the model handed back in the mode it came in.
#
# The every-8-steps check cannot change a token (a finished row only gets `PAD`); what it changes is how many decoder steps
# run. So, last, the biased model decodes again with a cap three times as long, and a hook on
# its output layer counts the steps: the loop must stop at the first multiple of 8 after the
# last row's `EOS`, not at the cap.
# (The output is not compared: the step at which the last row stops depends on the bias the
# search finds, which another machine's rounding may move a little.)

# %% tags=["nbval-ignore-output"]
src, _, tgt_out, lengths = make_batch(32, MAX_LEN, VOCAB, torch.Generator().manual_seed(7))
src, src_mask = src.to(device), padding_mask(lengths, MAX_LEN).to(device)
eager = Transformer(VOCAB, VOCAB).to(device)
eager.load_state_dict(probe.state_dict())  # the untrained model again ...


def eos_steps(m):
    """The step at which each row first emits EOS in evaluation mode (MAX_LEN + 1: never)."""
    ys = plain_greedy_decode(m.eval(), src, MAX_LEN + 1, src_mask=src_mask).cpu()
    is_eos = ys == EOS
    return torch.where(is_eos.any(1), is_eos.long().argmax(1), MAX_LEN + 1)


def eos_steps_with(extra):
    """eos_steps of the untrained model with `extra` added to its EOS logit's bias."""
    with torch.no_grad():
        eager.out_proj.bias.copy_(probe.out_proj.bias)
        eager.out_proj.bias[EOS] += extra
    return eos_steps(eager)


# ... with a taste for EOS: the smallest extra bias under which every row emits EOS early
# enough that the output comes out shorter than the cap (EOS by step MAX_LEN - 1), found by
# bisection. Just above it the rows still stop at different steps (the last row only just
# makes it); a larger bias makes them all stop at once, at the first step.
low, high = 0.0, 8.0  # not every row / every row stops early
for _ in range(20):
    middle = (low + high) / 2
    low, high = (low, middle) if int(eos_steps_with(middle).max()) < MAX_LEN else (middle, high)
eager_ends = eos_steps_with(1.02 * high)  # a little above it: rounding elsewhere cannot flip it
for name, m, mode in (("untrained", probe, "eval"), ("EOS-biased", eager, "eval"),
                      ("EOS-biased", eager, "train")):
    m.train(mode == "train")
    ys = plain_greedy_decode(m, src, MAX_LEN + 1, src_mask=src_mask)
    assert torch.equal(greedy_decode(m, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask).tokens, ys)
    assert m.training == (mode == "train")
    ys = ys.cpu()
    is_eos = (ys == EOS).long()
    after_eos = is_eos.cumsum(dim=1) - is_eos  # (B, T): > 0 after a row's first EOS
    assert (ys[after_eos > 0] == PAD).all()
    finished_at = torch.where(is_eos.any(1), is_eos.argmax(1), MAX_LEN + 1)  # (B,): EOS column
    assert ys.size(1) == int(finished_at.max()) + 1  # as long as the last row needed
    ended = int(is_eos.any(1).sum())
    last = f"the last at step {int(finished_at.max())}" if ended == 32 else "the rest ran to the cap"
    print(f"{name} ({mode} mode): {ended:2d} of 32 rows emitted EOS, {last}; "
          f"output {tuple(ys.shape)}")
# In evaluation mode the biased model's rows stop at different steps, all before the cap, so
# its output is shorter than the cap of MAX_LEN + 1 tokens:
assert 1 < len(eager_ends.unique()) and int(eager_ends.max()) < MAX_LEN
# The early exit: with a cap of 3 * MAX_LEN steps, the loop stops at the first check (every
# _SYNC_EVERY steps) after the last row's EOS; the tokens are those of the shorter cap.
steps_run = []
counter = eager.out_proj.register_forward_hook(lambda *_: steps_run.append(1))  # one per step
long_cap = greedy_decode(eager.eval(), src, max_new_tokens=3 * MAX_LEN, src_mask=src_mask)
counter.remove()
assert len(steps_run) == _SYNC_EVERY * math.ceil(int(eager_ends.max()) / _SYNC_EVERY) < 3 * MAX_LEN
assert torch.equal(long_cap.tokens, greedy_decode(eager, src, max_new_tokens=MAX_LEN + 1,
                                                  src_mask=src_mask).tokens)
print(f"cap {3 * MAX_LEN} steps: the loop ran {len(steps_run)}")

# %% [markdown]
# ## Appendix · Why this notebook stops at 2,500 steps
#
# Every notebook of the course is executed top to bottom, and its outputs compared, on every
# change (`make test`, and CI), on a machine with two CPU cores shared by two notebooks at a
# time. This one already trains for 4,800 steps in all (the main run, the ablation, the
# warm-up runs and label smoothing), several minutes on one thread; the tutorial's 6,000 steps
# and an ablation on the same budget would nearly triple that. Section 7 says what the shorter
# run loses: in the stored run, one sequence of the tutorial's perfect score at the last
# evaluation (255 of 256; it was at 256 at 5 of its 25 evaluations, from step 1,600 on), and
# nothing that this notebook asserts.
#
# **What a step costs.** One training step takes about 80 ms of CPU time on one thread of a
# quiet machine, exact-match evaluations included, and several times that in wall-clock time on
# a busy one (the seed study's main runs: 515 to 602 ms; section 6's cell prints this run's
# times). The tutorial's 6,000 steps would take about eight minutes for one model on a quiet
# machine (at 80 ms per step) and about an hour at the seed study's rate, and an ablation on the
# same budget as long again. The whole notebook took 423 s in one run on a quiet machine with a
# CPU thread to itself (`make execute` prints the total, the main run's cell its own time);
# `tools/robust.md` records 559 to 1,692 s for it on two loaded cores, and the run stored here
# took 1,266 s (21 minutes) on two cores shared with other jobs.
#
# `make`, CI and `make lab` run every Jupyter kernel with one thread (`tools/kernel.env` sets
# `OMP_NUM_THREADS=1`); in a Jupyter you start yourself or on Colab PyTorch uses all cores, so
# your timings, and the last bits of the arithmetic, can differ (`torch.set_num_threads(1)` gives
# the one-thread setting). One thread is not all that the stored numbers need: the CPU kernel
# must be AVX2 as well, which only `make execute` sets by itself (the appendix "Reproducing the
# stored run: CPU kernels" says how to set it for `make lab`).

# %% [markdown]
# Next: [12 · Generation](12_generation.ipynb), where this model's cross-attention shows the
# reversal's anti-diagonal, greedy decoding gets a KV cache, and beam search and sampling join
# it.
