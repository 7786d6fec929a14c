# %% [markdown]
# # 02 · Self-attention
#
# **What you will build:** attention for every query of a batch of sequences at once, as two
# matrix products; self-attention, where queries, keys and values are three projections of the
# same sequence; the course's `scaled_dot_product_attention` (masks, dropout, errors), equal to
# PyTorch's own in values and gradients; a heatmap helper; and two facts about self-attention,
# both checked: it has no idea of word order, and its work grows like $T^2$ (so does its memory
# when the $T \times T$ weights are stored, as ours are); and the small `measure` module that
# counts, weighs and times a function.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/02_self_attention.ipynb) · Assumes: [00 · Setup](00_setup.ipynb) and [01 · Attention](01_attention.ipynb) (single-query attention and its softmax).

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
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.utils import COLORS, get_device, save_figure, set_seed

set_seed(0)
device = get_device()


# %% [markdown]
# This notebook writes three modules of the package: `attention` (the function at the heart of
# the course; notebook 03 adds the multi-head module to it), `viz` (the attention heatmap) and
# `measure` (FLOPs, peak memory and time of any function, used again in later notebooks).

# %%
#| default_exp attention

# %% [markdown]
# ## 1. From one query to all of them
#
# Notebook 01 answered one query $q \in \mathbb{R}^{d_k}$ against $T_k$ keys
# $K \in \mathbb{R}^{T_k \times d_k}$ and values $V \in \mathbb{R}^{T_k \times d_v}$:
#
# $$\alpha = \mathrm{softmax}\!\left(\frac{K q}{\sqrt{d_k}}\right) \in \mathbb{R}^{T_k}, \qquad
#   \mathrm{context} = \alpha^\top V \in \mathbb{R}^{d_v}.$$
#
# In a sequence model every position asks a question, so there are $T_q$ queries. Nothing in the
# formula couples one query to another, so we can stack them as the rows of
# $Q \in \mathbb{R}^{T_q \times d_k}$ and do all the dot products in one matrix product:
# $(QK^\top)_{ij} = q_i \cdot k_j$ is the score of query $i$ for key $j$. The softmax runs along
# each row, and one more product forms every weighted average:
#
# $$\mathrm{Attention}(Q, K, V) = \underbrace{\mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right)}_{A \,\in\, \mathbb{R}^{T_q \times T_k}} V \;\in\; \mathbb{R}^{T_q \times d_v}
# \qquad \text{(Vaswani et al., 2017, eq. 1)}.$$
#
# First the single-query version again, as the reference to check against:

# %%
def single_query_attention(q, K, V):
    """Single-query attention from notebook 01: q (d_k,), K (T_k, d_k), V (T_k, d_v)."""
    scores = K @ q / math.sqrt(q.size(-1))  # (T_k, d_k) @ (d_k,) -> (T_k,)
    weights = torch.softmax(scores, dim=-1)  # (T_k,)
    return weights @ V, weights  # (T_k,) @ (T_k, d_v) -> (d_v,)


# %% [markdown]
# Now all queries at once. `K.transpose(-2, -1)` swaps only the last two axes, so the same line
# works whatever sits in front of them (batches, later heads):

# %%
def batched_attention(Q, K, V):
    """All queries at once: softmax(Q K^T / sqrt(d_k)) V over the last two axes."""
    d_k = Q.size(-1)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)  # (..., T_q, d_k) @ (..., d_k, T_k) -> (..., T_q, T_k)
    weights = torch.softmax(scores, dim=-1)  # row i: query i's distribution over the keys
    return weights @ V, weights  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)


# %% [markdown]
# **Check:** the matrix form gives, row for row, what a loop over single queries gives, and the
# same as PyTorch's `F.scaled_dot_product_attention` (a mistake that both of our versions share,
# such as a wrong scale, would pass the first comparison but not the second).

# %%
gen = torch.Generator().manual_seed(0)  # every cell that draws makes its own generator
T_q, T_k, d_k, d_v = 4, 6, 8, 3
Q = torch.randn(T_q, d_k, generator=gen).to(device)
K = torch.randn(T_k, d_k, generator=gen).to(device)
V = torch.randn(T_k, d_v, generator=gen).to(device)

context, weights = batched_attention(Q, K, V)
rows = [single_query_attention(q, K, V) for q in Q]  # one query at a time
torch.testing.assert_close(context, torch.stack([c for c, _ in rows]))
torch.testing.assert_close(weights, torch.stack([w for _, w in rows]))
# PyTorch's fused kernels add up in another order than ours; on a GPU the difference can reach
# about 1e-5 in float32, so the comparisons with the built-in allow more there.
tol = {} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}
torch.testing.assert_close(context, F.scaled_dot_product_attention(Q, K, V), **tol)
print("context", tuple(context.shape), "weights", tuple(weights.shape))

# %% [markdown]
# A batch of sequences adds a leading axis $B$: `Q` is $(B, T_q, d_k)$. The `@` operator treats
# every axis but the last two as a batch axis, so `batched_attention` needs no change.
#
# **Check:** the batched call equals a loop over the batch.

# %%
gen = torch.Generator().manual_seed(1)
Qb = torch.randn(3, 4, 8, generator=gen).to(device)  # (B, T_q, d_k)
Kb = torch.randn(3, 6, 8, generator=gen).to(device)  # (B, T_k, d_k)
Vb = torch.randn(3, 6, 3, generator=gen).to(device)  # (B, T_k, d_v)

context_b, weights_b = batched_attention(Qb, Kb, Vb)  # (B, T_q, d_v), (B, T_q, T_k)
for b in range(Qb.size(0)):
    c, w = batched_attention(Qb[b], Kb[b], Vb[b])  # one sequence: (T_q, d_v), (T_q, T_k)
    torch.testing.assert_close(context_b[b], c)
    torch.testing.assert_close(weights_b[b], w)
print("context", tuple(context_b.shape), "weights", tuple(weights_b.shape))

# %% [markdown]
# ### Looking at the weights
#
# The weights $A$ form a $T_q \times T_k$ table: one row per query, one column per key, each row
# a probability distribution. A heatmap is the natural picture, and every later notebook draws
# one, so the helper goes into the package (module `viz`). It takes one 2-D matrix (pick the
# example and the head first), puts the queries down and the keys across, and always draws a
# colorbar unless asked not to. Weights lie in $[0, 1]$, so the default colour map is the
# sequential `Blues`; signed numbers such as scores get a diverging map centred on zero. Numbers
# written into the cells are white on dark cells and black on light ones, judged by the cell's
# own colour, whatever the map.

# %%
#| export viz
"""Pictures of attention: the heatmap every notebook of the course draws."""

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator


def plot_attention(
    weights,
    x_labels=None,
    y_labels=None,
    ax: Axes | None = None,
    title: str | None = None,
    cmap: str = "Blues",
    colorbar: bool = True,
    annotate: bool = False,
    vmin: float | None = 0.0,
    vmax: float | None = None,
    label: str = "attention weight",
    fmt: str = "{:.2f}",
) -> Axes:
    """Heatmap of a (T_q, T_k) attention matrix: queries down, keys across; returns the Axes."""
    if isinstance(weights, torch.Tensor):
        data = weights.detach().to("cpu", torch.float64).numpy()
    else:
        data = np.asarray(weights, dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(
            f"weights must be 2-D (T_q, T_k), got shape {tuple(data.shape)}; "
            "select one example and head first, e.g. attn[0, h]"
        )
    T_q, T_k = data.shape
    if y_labels is None and x_labels is not None and T_q == T_k:
        y_labels = x_labels  # self-attention: the same tokens on both axes
    for name, labels, size, axis in (("x_labels", x_labels, T_k, "keys"),
                                     ("y_labels", y_labels, T_q, "queries")):
        if labels is not None and len(labels) != size:
            raise ValueError(
                f"{name} has {len(labels)} entries but weights of shape {(T_q, T_k)} "
                f"have {size} {axis}"
            )
    if ax is None:
        size_in = (min(max(0.55 * T_k + 2.0, 3.5), 11.0), min(max(0.5 * T_q + 1.2, 2.5), 10.0))
        _, ax = plt.subplots(figsize=size_in)
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    if x_labels is not None:
        ax.set_xticks(range(T_k), [str(s) for s in x_labels], rotation=45, ha="right",
                      rotation_mode="anchor")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y_labels is not None:
        ax.set_yticks(range(T_q), [str(s) for s in y_labels])
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label=label)
    if annotate:
        for i in range(T_q):
            for j in range(T_k):
                value = data[i, j]
                if np.isfinite(value):
                    rgb = np.asarray(image.cmap(image.norm(value))[:3])  # the cell's colour
                    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
                    # WCAG's relative luminance; below 0.179 white contrasts more than black
                    dark = float(linear @ [0.2126, 0.7152, 0.0722]) < 0.179
                    ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
    return ax


# %% [markdown]
# The weights of the first sequence of the batch above: four queries, six keys.

# %%
fig_b, ax_b = plt.subplots(figsize=(5.4, 3.2))
key_names = [f"k{j}" for j in range(weights_b.size(-1))]
query_names = [f"q{i}" for i in range(weights_b.size(-2))]
plot_attention(weights_b[0], x_labels=key_names, y_labels=query_names, ax=ax_b, annotate=True,
               title="All queries at once: one softmax per row")
plt.show()

# %% [markdown]
# **Check** the picture: one heatmap with its colorbar, the keys' names across, and in every cell
# the weight it shows, in black or white, whichever contrasts more with the cell. This cell pins
# down only the extremes (white on the darkest cell, black on the palest), so a simpler, wrong
# rule for the cells in between would pass it too; the appendix at the end of the notebook
# measures the contrast on the rendered pixels, and that check does tell the rules apart.

# %%
assert len(ax_b.images) == 1 and len(fig_b.axes) == 2  # the heatmap and its colorbar
assert [t.get_text() for t in ax_b.get_xticklabels()] == key_names
assert len(ax_b.texts) == weights_b[0].numel()  # one number per cell
largest = weights_b[0].max().item()  # the top of the colour scale: the darkest blue
for text in ax_b.texts:
    column, row = (round(c) for c in text.get_position())
    value = weights_b[0, row, column].item()
    assert text.get_text() == f"{value:.2f}"
    if value == largest:
        assert text.get_color() == "white"  # on the darkest cell
    elif value < 0.25 * largest:
        assert text.get_color() == "black"  # on the palest cells
# The cells in between get whichever colour contrasts more; the appendix measures that contrast
# on the rendered pixels of every cell.

# %% [markdown]
# **Takeaway: attention for all queries is two matrix products and a row-wise softmax; leading
# axes are batch axes for free.**
#
# ## 2. Self-attention: queries, keys and values from one sequence
#
# In *self*-attention the queries, the keys and the values all come from the same sequence
# $X \in \mathbb{R}^{T \times d_{\text{model}}}$ (one row per token). Each is a linear projection
# of it, with its own matrix:
#
# $$Q = X W_q, \quad K = X W_k, \quad V = X W_v, \qquad
#   W_q, W_k \in \mathbb{R}^{d_{\text{model}} \times d_k},\; W_v \in \mathbb{R}^{d_{\text{model}} \times d_v}.$$
#
# The same row $x_t$ therefore plays three roles: as $x_t W_q$ it asks a question, as $x_t W_k$
# it advertises what it contains, as $x_t W_v$ it is what gets copied out. Nothing in $X$ marks a
# row as a query or a key; the three matrices make the difference, and training chooses them.
# Cross-attention (the decoder looking at the encoder, notebook 08) takes $Q$ from one sequence
# and $K, V$ from another, so there $T_q$ and $T_k$ may differ.
#
# The whole computation of one head, from $X$ to the context, with the shapes for one sequence
# (its code is folded away; the rest of the notebook builds it box by box):

# %% jupyter={"source_hidden": true}
def flow_box(ax, xy, text, color, fill_alpha=0.25):
    """A rounded box with a label, centred at xy, filled with `color` mixed into white."""
    fill = tuple(1 - fill_alpha + fill_alpha * c for c in plt.matplotlib.colors.to_rgb(color))
    ax.text(*xy, text, ha="center", va="center", fontsize=10.5, zorder=3,
            bbox=dict(boxstyle="round,pad=0.45", fc=fill, ec=color, lw=1.5))


def flow_arrow(ax, start, end, color="0.35"):
    """An arrow from start to end, both on the edges of the boxes they join."""
    ax.annotate("", xy=end, xytext=start, zorder=2, arrowprops=dict(
        arrowstyle="-|>", color=color, lw=1.4, shrinkA=0, shrinkB=2))


fig_flow, ax_flow = plt.subplots(figsize=(13, 4.2))
roles = {"q": (2.0, COLORS["query"]), "k": (1.0, COLORS["key"]), "v": (0.0, COLORS["value"])}
flow_box(ax_flow, (0, 1), "$X$\n$(T, d_{model})$\none row per token", "0.4", 0.1)
for role, (y, color) in roles.items():
    width = "d_v" if role == "v" else "d_k"
    flow_box(ax_flow, (2.1, y), f"$\\times\\, W_{role}$\n$(d_{{model}}, {width})$", color, 0.12)
    flow_box(ax_flow, (4.0, y), f"${role.upper()} = X W_{role}$\n$(T, {width})$", color)
    flow_arrow(ax_flow, (0.88, 1 + 0.32 * (y - 1)), (1.55, y + 0.15 * (1 - y)))  # X -> W
    flow_arrow(ax_flow, (2.65, y), (3.55, y), color)  # W -> Q, K, V
flow_box(ax_flow, (6.2, 1.5), "scores\n$S = QK^\\top / \\sqrt{d_k}$\n$(T, T)$", "0.4", 0.1)
flow_box(ax_flow, (8.7, 1.5), "weights\n$A = \\mathrm{softmax}(S)$\nper row, $(T, T)$", "0.4", 0.1)
flow_box(ax_flow, (10.9, 0.75), "context\n$A V$\n$(T, d_v)$", COLORS["accent"], 0.35)
flow_arrow(ax_flow, (4.45, 1.9), (5.51, 1.62), COLORS["query"])
flow_arrow(ax_flow, (4.45, 1.1), (5.51, 1.38), COLORS["key"])
flow_arrow(ax_flow, (6.87, 1.5), (7.95, 1.5))
flow_arrow(ax_flow, (9.43, 1.3), (10.48, 0.9))
flow_arrow(ax_flow, (4.45, 0.05), (10.48, 0.62), COLORS["value"])
# Where section 3's two additions act: the mask on the scores, before the softmax; dropout on
# the weights, after it.
ax_flow.text(7.41, 1.6, "mask\n(section 3)", ha="center", fontsize=9, color="0.35")
ax_flow.text(9.85, 1.45, "dropout\n(section 3)", ha="left", fontsize=9, color="0.35")
ax_flow.set_xlim(-0.9, 11.8)
ax_flow.set_ylim(-0.6, 2.6)
ax_flow.set_axis_off()
ax_flow.set_title("Self-attention, one head: three projections of the same $X$, "
                  "then scores, a row-wise softmax and a weighted sum")
save_figure(fig_flow, "02_self_attention_dataflow")
plt.show()

# %% [markdown]
# In code, for a batch of two sequences:

# %%
gen = torch.Generator().manual_seed(1)
B, T, d_model, d_k, d_v = 2, 5, 16, 8, 8
X = torch.randn(B, T, d_model, generator=gen).to(device)
# Scaled by 1/sqrt(d_model) so that the entries of Q, K, V have variance about 1.
W_q = (torch.randn(d_model, d_k, generator=gen) / math.sqrt(d_model)).to(device)
W_k = (torch.randn(d_model, d_k, generator=gen) / math.sqrt(d_model)).to(device)
W_v = (torch.randn(d_model, d_v, generator=gen) / math.sqrt(d_model)).to(device)

Q = X @ W_q  # (B, T, d_model) @ (d_model, d_k) -> (B, T, d_k)
K = X @ W_k  # (B, T, d_model) @ (d_model, d_k) -> (B, T, d_k)
V = X @ W_v  # (B, T, d_model) @ (d_model, d_v) -> (B, T, d_v)
context, weights = batched_attention(Q, K, V)  # (B, T, d_v), (B, T, T)
print("X", tuple(X.shape), "-> Q, K", tuple(Q.shape), "V", tuple(V.shape))
print("context", tuple(context.shape), "weights", tuple(weights.shape))

# %% [markdown]
# In a model these matrices are `nn.Linear` layers. `nn.Linear(d_model, d_k, bias=False)` stores
# its weight as $(d_k, d_{\text{model}})$ and computes $x W^\top$, so its `weight` is our
# $W_q^\top$.
#
# **Check** PyTorch's convention, which the later notebooks rely on: a bias-free `nn.Linear`
# holding $W_q^\top$ computes $X W_q$, up to float32 rounding (it runs another kernel than `@`,
# which may add up in another order; `assert_close` allows for that).

# %%
proj_q = nn.Linear(*W_q.shape, bias=False).to(device)  # d_model inputs, d_k outputs
with torch.no_grad():
    proj_q.weight.copy_(W_q.T)  # (d_k, d_model): nn.Linear computes x @ weight.T
torch.testing.assert_close(proj_q(X), X @ W_q)
print("nn.Linear weight", tuple(proj_q.weight.shape), "holds W_q.T")

# %% [markdown]
# **Takeaway: self-attention is attention where $Q$, $K$ and $V$ are three learned projections of
# the same $X$; the projections, not the data, decide who asks and who answers.**
#
# ## 3. The course's `scaled_dot_product_attention`
#
# The function every later notebook calls adds two things to `batched_attention`: a **mask**
# that forbids some query–key pairs (padding, or the future in a decoder; notebook 05 is about
# them), and **dropout** on the attention weights during training. We build it one step at a
# time on a small example, then write it out once, with checks of its inputs.
#
# **Step 1, scores.** $S = QK^\top/\sqrt{d_k}$, shape $(\dots, T_q, T_k)$.

# %%
gen = torch.Generator().manual_seed(2)
T_s, d_k_s, d_v_s = 5, 4, 3
# Names of their own (Q_s: "of the steps"), which steps 1-5 and Check 2 below share.
Q_s = torch.randn(T_s, d_k_s, generator=gen).to(device)
K_s = torch.randn(T_s, d_k_s, generator=gen).to(device)
V_s = torch.randn(T_s, d_v_s, generator=gen).to(device)

scores = Q_s @ K_s.transpose(-2, -1) / math.sqrt(d_k_s)  # (T, d_k) @ (d_k, T) -> (T, T)
print(scores.cpu().round(decimals=2))

# %% [markdown]
# **Step 2, mask.** A boolean mask says which pairs are allowed (`True` = "may attend", the
# course's convention and `F.scaled_dot_product_attention`'s). A forbidden score becomes
# $-\infty$, because $e^{-\infty} = 0$: the key then gets weight exactly zero. As an example, the
# *causal* mask of a decoder: query $t$ may look at keys $0, \dots, t$ only. The same effect comes
# from a float mask of $0$ and $-\infty$ *added* to the scores; the function accepts both kinds.

# %%
causal = torch.ones_like(scores, dtype=torch.bool).tril()  # (T, T), True on and below the diagonal
masked = scores.masked_fill(~causal, float("-inf"))  # (T, T)
print(masked.cpu().round(decimals=2))

# %% [markdown]
# **Step 3, softmax** along each row (over the keys).

# %%
attn = torch.softmax(masked, dim=-1)  # (T, T), each row sums to one
print(attn.cpu().round(decimals=3))

# %% [markdown]
# **Check** what the mask does to the softmax: forbidden pairs get exactly zero weight, and the
# allowed keys of a row share it as if the others did not exist. Query 0 sees only key 0, so its
# row is $(1, 0, \dots, 0)$; query 1 sees keys 0 and 1, so its row is the softmax of its first two
# scores alone.

# %%
assert torch.all(attn[~causal] == 0)
torch.testing.assert_close(attn[0], torch.eye(len(attn), device=device)[0])
torch.testing.assert_close(attn[1, :2], torch.softmax(scores[1, :2], dim=-1))

# %% [markdown]
# One row needs a decision. If a query has *no* allowed key (a row of the mask all `False`, which
# happens with some padding layouts), its softmax is $e^{-\infty} / \sum e^{-\infty} = 0/0$:

# %%
print(torch.softmax(torch.full((3,), float("-inf")), dim=-1))

# %% [markdown]
# A single NaN spreads through every later layer and into the loss. The course's **policy** for
# such a row: all its weights are zero and its context vector is zero, and neither the forward nor
# the backward pass produces a NaN. The function fills such a row's scores with $0$ before the
# softmax (so no $0/0$ is ever computed, not even in the backward pass) and zeroes its weights
# after. Notebook 05 compares this with what PyTorch's built-ins do.
#
# **Step 4, dropout** on the weights, in training only. The paper drops each sub-layer's output
# with $P_{\text{drop}} = 0.1$ (Vaswani et al., 2017, §5.4); dropping attention weights too is a
# common addition (it is the `dropout` argument of PyTorch's `nn.MultiheadAttention`). Each
# weight is zeroed with probability $p$ and the survivors are
# multiplied by $1/(1-p)$ ("inverted" dropout), so that every weight keeps its expected value and
# nothing needs rescaling at evaluation time. A row no longer sums to exactly one, only on
# average. Notebook 06 takes dropout apart.
#
# This example runs on the CPU, after `set_seed`. The mask it draws still depends on the machine
# (the appendix says why), so CI does not compare the printed mask (`nbval-ignore-output`). The
# asserts check what holds for any mask: the survivors are doubled, and some weights are dropped
# and some kept. They test PyTorch's `F.dropout`, which our function calls; check 5 below tests
# the function itself.

# %% tags=["nbval-ignore-output"]
set_seed(0)
attn_cpu = attn.cpu()
dropped = F.dropout(attn_cpu, p=0.5, training=True)  # (T, T); survivors scaled by 1 / (1 - 0.5) = 2
print(dropped.round(decimals=3))
kept = dropped != 0
torch.testing.assert_close(dropped[kept], 2 * attn_cpu[kept])  # survivors doubled
assert 0 < kept.sum() < (attn_cpu != 0).sum()  # some of the 15 allowed weights dropped, some kept

# %% [markdown]
# **Step 5, weighted sum** of the values: $\mathrm{context} = AV$, one row per query.

# %%
context = attn @ V_s  # (T, T) @ (T, d_v) -> (T, d_v)
torch.testing.assert_close(context[0], V_s[0])  # query 0 may only see key 0: it copies value 0
print(context.cpu().round(decimals=3))

# %% [markdown]
# ### The function
#
# Here are the five steps as the package's function. The module begins with its docstring and
# imports:

# %%
#| export
"""Attention: scaled dot-product attention (notebook 02) and multi-head attention (notebook 03)."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_from_scratch.checks import (
    check_int,
    check_mask,
    check_probability,
    check_tensor,
    checking,
)


# %% [markdown]
# The function, the five steps in order. Its first line checks the inputs, with the policy of
# notebook 00: `checking()` is off only inside a `validated()` block, which a caller opens once
# it has checked the inputs itself. Notebook 03's multi-head attention does that: it checks its
# own inputs once per call, and the shapes it then passes to this function are right by
# construction, so checking them again for every call would repeat the same work. The checker
# is the next cell; check 6 below shows what it catches, and what happens to the same mistake
# inside a `validated()` block.

# %%
#| export
def scaled_dot_product_attention(
    Q: Tensor,  # (..., T_q, d_k)
    K: Tensor,  # (..., T_k, d_k)
    V: Tensor,  # (..., T_k, d_v)
    mask: Tensor | None = None,  # bool (True = may attend) or float (added); (..., T_q, T_k)
    dropout_p: float = 0.0,
    training: bool = True,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d_k) + mask) V, dropout on the weights; returns (context, attn)."""
    if checking():  # off when a caller (multi-head attention, a block) has checked already
        check_attention_inputs(Q, K, V, mask, dropout_p)
    d_k = Q.size(-1)
    # 1) Scores of every query against every key.
    # (..., T_q, d_k) @ (..., d_k, T_k) -> (..., T_q, T_k)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)
    # 2) Mask: a forbidden pair scores -inf, so its weight is exactly 0.
    no_key = None
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
        # A query with no allowed key would be softmax(-inf, ..., -inf) = 0/0 = NaN. Policy: zero
        # weights and zero context. Setting its scores to 0 first keeps NaN out of the backward
        # pass as well.
        no_key = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., T_q, 1)
        scores = scores.masked_fill(no_key, 0.0)
    # 3) Softmax over the keys: each row becomes a distribution.
    attn = torch.softmax(scores, dim=-1)  # (..., T_q, T_k)
    if no_key is not None:
        attn = attn.masked_fill(no_key, 0.0)
    # 4) Dropout on the weights, in training only; survivors are scaled by 1 / (1 - dropout_p).
    if training and dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    # 5) Weighted sum of the values.
    context = attn @ V  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)
    return context, attn


# %% [markdown]
# The checks. A mistake in shapes should stop with a message that names the shapes, not surface
# three layers later as a broadcasting error deep inside `matmul`, or never surface at all as a
# silently wrong result. Each `if` below turns one such mistake into a `TypeError` or a
# `ValueError`:

# %%
#| export
def check_attention_inputs(
    Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, dropout_p: float
) -> None:
    """Raise a TypeError/ValueError naming the shapes when attention cannot take these inputs."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        check_tensor(name, t, kind="float")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., T, d), got {tuple(t.shape)}")
    if not Q.dtype == K.dtype == V.dtype:
        raise TypeError(f"Q, K, V must share one dtype, got {Q.dtype}, {K.dtype}, {V.dtype}")
    shapes = f"Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}"
    if Q.size(-1) != K.size(-1):
        raise ValueError(f"Q and K must have the same last dim d_k, got {shapes}")
    if K.size(-2) != V.size(-2):
        raise ValueError(f"K and V must have the same number of keys T_k (dim -2), got {shapes}")
    try:
        batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the batch dims (all but the last 2) do not broadcast: {shapes}") from None
    scores_shape = (*batch, Q.size(-2), K.size(-2))
    check_mask("mask", mask, scores_shape, "(..., T_q, T_k)", hint=f"got {shapes}")
    check_probability("dropout_p", dropout_p)


# %% [markdown]
# ### Checks
#
# **Check 1, parity with PyTorch.** `F.scaled_dot_product_attention` computes the same thing
# (it returns the context only). We compare values *and* gradients with respect to $Q$, $K$ and
# $V$ across shapes: self- and cross-attention ($T_q \ne T_k$, $d_v \ne d_k$), 2-D, 3-D and
# 4-D $(B, h, T, d_k)$ inputs, a causal and a padding mask (boolean) and an additive float mask.

# %%
def random_inputs(shape_q, shape_k, shape_v, seed):
    """Q, K, V drawn on the CPU (reproducible), moved to the device, tracking gradients."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in (shape_q, shape_k, shape_v)]


# PyTorch's fused kernels add up in another order than ours; on a GPU the difference can reach
# about 1e-5 in float32, so the comparison allows more there.
tol = {} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


def check_parity(shape_q, shape_k, shape_v, mask, seed):
    """Our function and PyTorch's agree in the context and in the gradients of Q, K, V."""
    Q, K, V = random_inputs(shape_q, shape_k, shape_v, seed)
    mask = None if mask is None else mask.to(device)
    ours, _ = scaled_dot_product_attention(Q, K, V, mask=mask)
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, **tol)
    gen = torch.Generator().manual_seed(100 + seed)
    upstream = torch.randn(ours.shape, generator=gen).to(device)  # the same upstream gradient for both
    grads_ours = torch.autograd.grad(ours, (Q, K, V), upstream)
    grads_theirs = torch.autograd.grad(theirs, (Q, K, V), upstream)
    for g_ours, g_theirs in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(g_ours, g_theirs, **tol)
    return tuple(ours.shape)


gen = torch.Generator().manual_seed(3)
padding = torch.arange(6) < torch.tensor([6, 4]).view(2, 1, 1, 1)  # (2, 1, 1, 6): lengths 6 and 4
additive = torch.randn(5, 7, generator=gen)  # (T_q, T_k) float mask: a learned-looking bias ...
additive[torch.rand(5, 7, generator=gen) < 0.3] = float("-inf")  # ... that also forbids some pairs
additive[:, 0] = 0.0  # every query keeps at least one key
cases = {  # name: (Q shape, K shape, V shape, mask)
    "self-attention (B, T, d)": ((2, 6, 8), (2, 6, 8), (2, 6, 8), None),
    "cross-attention T_q != T_k, d_v != d_k": ((2, 5, 8), (2, 7, 8), (2, 7, 3), None),
    "2-D (T, d)": ((6, 8), (6, 8), (6, 8), None),
    "4-D (B, h, T, d_k)": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), None),
    "causal bool mask (T, T)": ((2, 6, 8), (2, 6, 8), (2, 6, 8), torch.ones(6, 6, dtype=torch.bool).tril()),
    "padding bool mask (B, 1, 1, T_k)": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), padding),
    "additive float mask, cross": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), additive),
}
for seed, (name, case) in enumerate(cases.items()):
    shape = check_parity(*case, seed=seed)
    print(f"{name:<40} context {str(shape):<15} values and gradients match")

# %% [markdown]
# **Check 2, the two kinds of mask.** On the causal example of steps 1–5, a boolean mask and the
# float mask of $0$ and $-\infty$ that means the same give the same weights and the same context;
# and the function's five steps give what the steps above gave one at a time.

# %%
additive_causal = torch.zeros(causal.shape, device=device).masked_fill(~causal, float("-inf"))
context_bool, attn_bool = scaled_dot_product_attention(Q_s, K_s, V_s, mask=causal)
context_float, attn_float = scaled_dot_product_attention(Q_s, K_s, V_s, mask=additive_causal)
torch.testing.assert_close(attn_float, attn_bool)
torch.testing.assert_close(context_float, context_bool)
torch.testing.assert_close(attn_bool, attn)  # the steps, one at a time
print("bool and float causal masks: the same weights and context")

# %% [markdown]
# **Check 3, padding.** Padding keys must not matter at all: the second sequence below has 4 real
# keys and 2 of padding, and its weights and context equal those of the same sequence cut to
# its 4 real keys.

# %%
Q_pad, K_pad, V_pad = random_inputs((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), seed=10)
context_pad, attn_pad = scaled_dot_product_attention(Q_pad, K_pad, V_pad, mask=padding.to(device))
context_cut, attn_cut = scaled_dot_product_attention(Q_pad[1], K_pad[1, :, :4], V_pad[1, :, :4])
torch.testing.assert_close(attn_pad[1, :, :, :4], attn_cut)
torch.testing.assert_close(context_pad[1], context_cut)
assert torch.all(attn_pad[1, :, :, 4:] == 0)  # keys 4 and 5 are padding
print("padded sequence == the same sequence without its padding; largest weight on padding:",
      attn_pad[1, :, :, 4:].max().item())

# %% [markdown]
# **Check 4, the fully masked row.** Query 0 may see no key. Its weights and its context are zero,
# the other rows are untouched, and the gradients are finite. The check runs with the boolean
# mask and with the same mask written as an additive float mask ($0$ or $-\infty$). Only the
# float mask can catch a missing $0$-fill: with a boolean mask, `masked_fill` already sends a zero
# gradient into the forbidden scores, so the NaN of the softmax's backward pass never reaches
# $Q$ or $K$; an added $-\infty$ passes the gradient through unchanged, NaN included.

# %%
Q_e, K_e, V_e = random_inputs((4, 8), (5, 8), (5, 3), seed=11)
no_keys = torch.ones(4, 5, dtype=torch.bool, device=device)
no_keys[0] = False  # query 0: every key forbidden
additive_e = torch.zeros(4, 5, device=device).masked_fill(~no_keys, float("-inf"))  # 0 or -inf
for mask_e in (no_keys, additive_e):
    for t in (Q_e, K_e, V_e):
        t.grad = None
    context_e, attn_e = scaled_dot_product_attention(Q_e, K_e, V_e, mask=mask_e)
    context_e.sum().backward()
    assert torch.all(attn_e[0] == 0) and torch.all(context_e[0] == 0)
    torch.testing.assert_close(attn_e[1:], scaled_dot_product_attention(Q_e[1:], K_e, V_e)[1])
    assert all(torch.isfinite(t.grad).all() for t in (Q_e, K_e, V_e)), mask_e.dtype
    assert torch.all(Q_e.grad[0] == 0)  # nothing flows back through the empty row
print("row 0 weights:", attn_e[0].tolist(), "| context:", context_e[0].tolist())

# %% [markdown]
# What the $0$-fill prevents, on one row of three scores: without it, the float mask lets a NaN
# into the gradient of the scores, even though the row's weights are zeroed after the softmax;
# the boolean mask hides the same bug. (A demonstration on PyTorch's softmax, without our
# function; check 4 above is the test of the function.)

# %%
for kind in ("bool", "float"):
    raw_row = torch.zeros(3, requires_grad=True)
    if kind == "bool":
        masked_row = raw_row.masked_fill(torch.ones(3, dtype=torch.bool), float("-inf"))
    else:
        masked_row = raw_row + torch.full((3,), float("-inf"))
    weights_row = torch.softmax(masked_row, dim=-1).masked_fill(torch.tensor(True), 0.0)  # no 0-fill
    weights_row.sum().backward()
    print(f"{kind:5s} mask, no 0-fill: gradient of the scores {raw_row.grad.tolist()}")
    assert torch.isnan(raw_row.grad).all() == (kind == "float")

# %% [markdown]
# **Check 5, dropout.** In evaluation (`training=False`) dropout does nothing. In training about a
# fraction $p$ of the weights is zeroed and each survivor is exactly $1/(1-p)$ times its
# undropped value, so the row sums still average one. (On the CPU, like step 4. The printed
# numbers depend on the mask, which depends on the machine, so CI does not compare them; the
# asserts bound them for any mask: the fraction zeroed has standard deviation
# $\sqrt{p(1-p)/32768} \approx 0.0017$.)

# %% tags=["nbval-ignore-output"]
Q_d, K_d, V_d = (t.detach().cpu() for t in random_inputs((8, 64, 16), (8, 64, 16), (8, 64, 16), seed=12))
p = 0.1
plain_context, plain = scaled_dot_product_attention(Q_d, K_d, V_d)  # (8, 64, 64)
eval_context, eval_attn = scaled_dot_product_attention(Q_d, K_d, V_d, dropout_p=p, training=False)
assert torch.equal(eval_attn, plain) and torch.equal(eval_context, plain_context)

set_seed(0)
_, train_attn = scaled_dot_product_attention(Q_d, K_d, V_d, dropout_p=p, training=True)
kept = train_attn != 0
torch.testing.assert_close(train_attn[kept], plain[kept] / (1 - p))
zeroed = 1 - kept.float().mean().item()
mean_row_sum = train_attn.sum(dim=-1).mean().item()
assert abs(zeroed - p) < 0.01 and abs(mean_row_sum - 1) < 0.02
print(f"fraction zeroed {zeroed:.3f} (p = {p}), mean row sum {mean_row_sum:.3f}")

# %% [markdown]
# **Check 6, bad input stops with a message that says what is wrong** (the shapes, when a shape
# is wrong). A few of them (the unit tests in `tests/test_attention.py` go through every case):

# %%
gen = torch.Generator().manual_seed(6)
Q_bad, K_bad, V_bad = (torch.randn(2, T_bad, d, generator=gen) for T_bad, d in ((5, 8), (7, 8), (7, 4)))
bad_calls = {
    "d_k differs": lambda: scaled_dot_product_attention(Q_bad, K_bad[..., :6], V_bad),
    "T_k differs": lambda: scaled_dot_product_attention(Q_bad, K_bad, V_bad[:, :6]),
    "mask wrong T_k": lambda: scaled_dot_product_attention(
        Q_bad, K_bad, V_bad, mask=torch.ones(5, 5, dtype=torch.bool)),
    "int mask": lambda: scaled_dot_product_attention(
        Q_bad, K_bad, V_bad, mask=torch.ones(5, 7, dtype=torch.int64)),
    "dropout_p = 1": lambda: scaled_dot_product_attention(Q_bad, K_bad, V_bad, dropout_p=1.0),
}
for name, call in bad_calls.items():
    try:
        call()
    except (ValueError, TypeError) as err:
        print(f"{name:<14} {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{name}: no error raised")

# Inside validated(), the promise of a caller that has checked already, the function skips the
# check: the same wrong d_k reaches the first matrix product, and PyTorch stops it there with a
# RuntimeError that knows nothing of Q, K and V.
from transformer_from_scratch.checks import validated

with validated():
    try:
        bad_calls["d_k differs"]()
    except RuntimeError as err:
        print(f"{'inside validated()':<14} {type(err).__name__} from the product Q @ K^T")
    else:
        raise AssertionError("inside validated(): no error raised")

# %% [markdown]
# ### Picture: the steps on one example
#
# The causal example of steps 1–3: raw scores, the scores after the mask (forbidden cells blank),
# and the weights. Scores are signed, so they get a diverging colour map centred on zero; the
# weights lie in $[0, 1]$ and get the sequential one.

# %% jupyter={"source_hidden": true}
limit = scores.abs().max().item()
positions = [str(t) for t in range(len(scores))]
fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), constrained_layout=True)
plot_attention(scores, positions, ax=axes[0], cmap="RdBu_r", vmin=-limit, vmax=limit,
               label="score", annotate=True, title="1. scores $QK^T/\\sqrt{d_k}$")
plot_attention(scores.masked_fill(~causal, float("nan")), positions, ax=axes[1], cmap="RdBu_r",
               vmin=-limit, vmax=limit, label="score", annotate=True,
               title="2. causal mask: $-\\infty$ (blank)")
plot_attention(attn, positions, ax=axes[2], vmin=0, vmax=1, annotate=True,
               title="3. softmax over each row")
save_figure(fig, "02_attention_steps")
plt.show()

# %% [markdown]
# **Takeaway: `scaled_dot_product_attention` is scores → mask → softmax → dropout → weighted sum;
# it matches PyTorch's values and gradients, and a query with no key gets zeros, not NaN.**
#
# ## 4. Attention over a sentence
#
# What does a useful pattern of attention look like? Trained models learn heads that follow
# grammar: Clark et al. (2019, *What Does BERT Look At?*, Figure 5) found heads of BERT in which
# determiners attend to their nouns, and others in which direct objects attend to their verbs. We
# build a head of that kind by hand, so that every weight can be explained.
#
# The toy embedding knows one thing about a word, its class: the rows of $X$ are one-hot over
# (determiner, adjective, noun, verb), so words of the same class share a direction. Keys announce
# the class ($W_k = I$). Queries ask for classes: row $c$ of $W_q$ says how strongly a word of
# class $c$ looks for each class. The score of query $i$ for key $j$ is then
# $x_i W_q W_k^\top x_j^\top / \sqrt{d_k} = (W_q)_{c_i c_j}/2$.

# %%
tokens = ["the", "hungry", "cat", "chased", "a", "small", "grey", "mouse"]
word_class = {"the": "det", "a": "det", "hungry": "adj", "small": "adj", "grey": "adj",
              "cat": "noun", "mouse": "noun", "chased": "verb"}
classes = ["det", "adj", "noun", "verb"]
looks_for = {  # query class -> {key class: strength}
    "det": {"noun": 6.0},  # a determiner looks for its noun
    "adj": {"noun": 6.0},  # so does an adjective
    "noun": {"verb": 6.0, "det": 2.0, "adj": 2.0},  # a noun looks for its verb, a little for modifiers
    "verb": {"noun": 6.0},  # a verb looks for its subject and object
}

d_sentence = len(classes)  # d_model = d_k = d_v = 4
X_sentence = torch.zeros(1, len(tokens), d_sentence)  # (B=1, T, d_model), one-hot word classes
for t, token in enumerate(tokens):
    X_sentence[0, t, classes.index(word_class[token])] = 1.0
W_q_sentence = torch.zeros(d_sentence, d_sentence)  # (d_model, d_k)
for c_query, wanted in looks_for.items():
    for c_key, strength in wanted.items():
        W_q_sentence[classes.index(c_query), classes.index(c_key)] = strength
W_k_sentence = W_v_sentence = torch.eye(d_sentence)  # keys and values: the class itself
X_sentence, W_q_sentence, W_k_sentence, W_v_sentence = (
    t.to(device) for t in (X_sentence, W_q_sentence, W_k_sentence, W_v_sentence))

context_sentence, attn_sentence = scaled_dot_product_attention(
    X_sentence @ W_q_sentence, X_sentence @ W_k_sentence, X_sentence @ W_v_sentence
)  # queries, keys, values (1, T, 4) each -> context (1, T, 4), weights (1, T, T)

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(7.2, 5.6))
plot_attention(attn_sentence[0], tokens, ax=ax, annotate=True, vmax=1.0,
               title="A hand-built 'grammar' head: who looks at whom")
save_figure(fig, "02_self_attention_heatmap")
plt.show()

# %% [markdown]
# Read it row by row. "the", "hungry", "a", "small" and "grey" put 0.435 on each noun (0.44 in
# the picture, rounded); "chased" does the same; the nouns put 0.56 on the verb and spread most
# of the rest over the determiners and adjectives.
#
# **Check:** the weights are what the table predicts. A determiner's row has two scores of
# $6/2 = 3$ (the nouns) and six of $0$, so the nouns get $e^3/(2e^3 + 6)$ each.

# %%
position = {token: t for t, token in enumerate(tokens)}
expected = math.exp(3) / (2 * math.exp(3) + 6)
row_the = attn_sentence[0, position["the"]]
assert math.isclose(row_the[position["cat"]].item(), expected, rel_tol=1e-5)
assert math.isclose(row_the[position["mouse"]].item(), expected, rel_tol=1e-5)
assert attn_sentence[0, position["cat"]].argmax().item() == position["chased"]
# What "the" gathers is mostly noun: its context vector, over (det, adj, noun, verb).
print(f"e^3 / (2 e^3 + 6) = {expected:.4f}")
print("context of 'the':", [round(v, 3) for v in context_sentence[0, position["the"]].tolist()])


# %% [markdown]
# Note what the head *cannot* do. "hungry" belongs to "cat" and "small grey" to "mouse", yet each
# adjective splits its attention evenly between the two nouns, and "the" and "a" have identical
# rows. Nothing in $X$ says where a word stands, so nothing can prefer the *nearer* noun. The next
# section makes this precise.
#
# **Takeaway: a heatmap row is one word's distribution over the sentence; $W_q$ and $W_k$
# decide which classes of word find each other.**
#
# ## 5. Self-attention ignores order: permutation equivariance
#
# Shuffle the tokens of $X$ with a permutation matrix $P$ (row $i$ of $PX$ is row $\pi(i)$ of
# $X$). Then $Q, K, V$ are shuffled the same way, and since $P^\top P = I$ and a row-wise softmax
# does not care in which order a row lists its entries,
#
# $$\mathrm{softmax}\!\left(\frac{PQ\,(PK)^\top}{\sqrt{d_k}}\right)PV
#   = P\,\mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right)P^\top P V
#   = P\,\mathrm{Attention}(Q, K, V).$$
#
# Permuting the input permutes the output rows in the same way, and nothing else changes:
# self-attention is **permutation equivariant**. To the layer, a sentence is a bag of words.

# %%
def self_attention(X, W_q, W_k, W_v, mask=None):
    """One head of self-attention: Q, K and V all projected from the same X."""
    Q, K, V = X @ W_q, X @ W_k, X @ W_v  # (B, T, d_model) @ (d_model, d_k) -> (B, T, d_k); V: (B, T, d_v)
    return scaled_dot_product_attention(Q, K, V, mask=mask)  # (B, T, d_v), (B, T, T)


# %% [markdown]
# **Check:** for random inputs, random projections and a random permutation, permuting the input
# rows gives the permuted output rows, and the weights are permuted along both axes,
# $A' = PAP^\top$.

# %%
gen = torch.Generator().manual_seed(4)
# Names of their own ("eq": equivariance), which this section shares.
B_eq, T_eq, d_model_eq, d_k_eq = 2, 10, 16, 8  # d_v = d_k
X_eq = torch.randn(B_eq, T_eq, d_model_eq, generator=gen).to(device)
W_q_eq, W_k_eq, W_v_eq = ((torch.randn(d_model_eq, d_k_eq, generator=gen) / math.sqrt(d_model_eq))
                          .to(device) for _ in range(3))
perm_eq = torch.randperm(T_eq, generator=gen).to(device)
P_eq = torch.eye(T_eq, device=device)[perm_eq]  # (T, T) permutation: (P @ X)[:, i] = X[:, perm[i]]

out_orig, attn_orig = self_attention(X_eq, W_q_eq, W_k_eq, W_v_eq)
out_perm, attn_perm = self_attention(P_eq @ X_eq, W_q_eq, W_k_eq, W_v_eq)  # the shuffled sentence
torch.testing.assert_close(out_perm, P_eq @ out_orig)  # output rows shuffled the same way
torch.testing.assert_close(attn_perm, P_eq @ attn_orig @ P_eq.T)  # weights shuffled along both axes
torch.testing.assert_close(out_perm, out_orig[:, perm_eq])  # the same, with indexing instead of P
print("permutation:", perm_eq.tolist())

# %% [markdown]
# The assertion has teeth: give every position its own vector (any fixed pattern, here a random
# one; notebook 04 uses sinusoids) and add it to $X$. The order is then part of the input, and
# shuffling the tokens no longer just shuffles the output.

# %%
gen = torch.Generator().manual_seed(14)
pos_vectors = 0.5 * torch.randn(X_eq.shape[1:], generator=gen).to(device)  # (T, d_model), one per position
out_pos, _ = self_attention(X_eq + pos_vectors, W_q_eq, W_k_eq, W_v_eq)
out_pos_perm, _ = self_attention(P_eq @ X_eq + pos_vectors, W_q_eq, W_k_eq, W_v_eq)  # same positions
gap = (out_pos_perm - P_eq @ out_pos).abs().max().item()
assert gap > 1e-2
print(f"with positions, largest difference from P @ output: {gap:.3f}")

# %% [markdown]
# **Picture:** the sentence of section 4 before and after a random shuffle. Every number of the
# left map appears in the right one, moved to the new positions of its query and its key (the
# cell checks it before drawing).

# %%
gen = torch.Generator().manual_seed(5)
perm_sentence = torch.randperm(len(tokens), generator=gen)
shuffled = [tokens[i] for i in perm_sentence]
_, attn_shuffled = self_attention(X_sentence[:, perm_sentence.to(device)], W_q_sentence,
                                  W_k_sentence, W_v_sentence)
index = perm_sentence.to(device)
torch.testing.assert_close(attn_shuffled[0], attn_sentence[0][index][:, index])  # moved, not changed
print(" ".join(shuffled))

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(14, 5.6), constrained_layout=True)
plot_attention(attn_sentence[0], tokens, ax=axes[0], annotate=True, vmax=1.0,
               title="original order")
plot_attention(attn_shuffled[0], shuffled, ax=axes[1], annotate=True, vmax=1.0,
               title="tokens shuffled: the same weights, moved")
save_figure(fig, "02_permutation_equivariance")
plt.show()

# %% [markdown]
# **Takeaway: without positional information, self-attention sees a set, not a sequence;
# notebook 04 adds the order back.**
#
# ## 6. The cost: $O(T^2)$ work, and $O(T^2)$ memory where the weights are stored
#
# For self-attention over $T$ tokens the weights are a $T \times T$ matrix per sequence and head.
# Computing it takes $T^2 d_k$ multiply-adds for $QK^\top$ and another $T^2 d_v$ for $AV$:
#
# $$\text{FLOPs} = 2\,T^2\,(d_k + d_v) \text{ per head}, \qquad
#   \text{memory of } A = B \cdot h \cdot T^2 \cdot (\text{bytes per number}).$$
#
# The projections cost $2\,T\,d_{\text{model}}\,(2d_k + d_v)$, linear in $T$, so for long
# sequences the quadratic term wins. Doubling $T$ quadruples both the work and the memory of the
# weights. At $T = 32{,}768$ one head's weights in float32 take $4\,\text{GiB}$; that is why long
# contexts are expensive, and why FlashAttention (Dao et al., 2022) computes attention without ever
# storing $A$ ([notebook 14](14_efficient_attention.ipynb) writes that algorithm).
#
# We measure two of the costs, the work exactly and the memory to within 1%, with helpers that
# later notebooks use again, in the module `measure`: `count_flops` and `peak_memory`. They are
# plumbing, not attention: their code is collapsed below, and the appendix at the end of the
# notebook says how they work. Time is a noisier measurement; the appendix times both functions
# too, with the module's `time_call` and `fit_slope`.

# %% jupyter={"source_hidden": true}
#| export measure
"""Measure a function: its FLOPs, its peak memory and its median time; fit a log-log slope."""

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from transformer_from_scratch.checks import check_int  # time_call checks its counts


# %% [markdown]
# ### Work: counting FLOPs
#
# PyTorch counts them for us: `FlopCounterMode` records the floating-point operations of every
# matrix product that runs inside it.

# %%
#| export measure
def count_flops(fn: Callable[[], object]) -> int:
    """Floating-point operations of the matrix products that fn() runs, counted by PyTorch."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# %% [markdown]
# On the `meta` device tensors have shapes but no data, so counting costs nothing, even for a $T$
# whose weights would not fit in memory.
#
# **Check:** the counted FLOPs of our function are exactly $2 \cdot B h \cdot T^2 (d_k + d_v)$,
# so they quadruple when $T$ doubles. `FlopCounterMode` counts only the operations it has a
# formula for, in practice the **matrix products**: it adds up the two products our code runs.
# The scaling and the softmax add a handful of operations per entry of the $T \times T$ matrix,
# also proportional to $T^2$ but small next to the $2(d_k + d_v) = 256$ per entry that the two
# products cost at $d_k = d_v = 64$. The cell asserts the same count for PyTorch's
# `F.scaled_dot_product_attention`, and prints, for both functions, what the counter saw
# operation by operation.

# %%
def attention_flops(T: int, fn=scaled_dot_product_attention, batch: int = 1, heads: int = 1) -> int:
    """FLOPs of one call of `fn` on (batch, heads, T, 64) queries, keys and values."""
    Q, K, V = (torch.empty(batch, heads, T, 64, device="meta") for _ in range(3))
    return count_flops(lambda: fn(Q, K, V))


for T_flops in (256, 512, 1024, 32768):
    for fn in (scaled_dot_product_attention, F.scaled_dot_product_attention):
        assert attention_flops(T_flops, fn, batch=2, heads=4) == 2 * 2 * 4 * T_flops**2 * (64 + 64)
flops_512, flops_1024 = attention_flops(512), attention_flops(1024)  # fourfold: the asserts above
print(f"one head, d_k = d_v = 64: T = 512 -> {flops_512 / 1e6:.0f} MFLOP, "
      f"T = 1024 -> {flops_1024 / 1e6:.0f} MFLOP")
print(f"T = 32768: {attention_flops(32768) / 1e12:.2f} TFLOP per head")

# What the counter saw, operation by operation, at T = 512 on the meta device:
from torch.utils.flop_counter import FlopCounterMode, flop_registry

both_functions = {"ours": scaled_dot_product_attention, "PyTorch's": F.scaled_dot_product_attention}
Q_meta = torch.empty(1, 1, 512, 64, device="meta")  # (B, h, T, d_k)
counted_ops = {}
for name, fn in both_functions.items():
    with FlopCounterMode(display=False) as counter:
        fn(Q_meta, Q_meta, Q_meta)
    counted_ops[name] = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    print(f"{name:<9} on meta, counted: {counted_ops[name]}")
assert counted_ops["PyTorch's"] == counted_ops["ours"] == {"aten.bmm": flops_512}

# %% [markdown]
# PyTorch's function gets our count on the `meta` device, but not because the counter knows its
# fused kernels: on `meta` it runs its plain "math" version, and the counter sees two batched
# products (`aten.bmm`), exactly ours, as printed above. So that half of the check says only that
# PyTorch's math version does the products ours does, and nothing about its fused kernels.
#
# On real tensors PyTorch picks a fused kernel, and the counter counts it only if it has a
# formula for that kernel. The cell below lists the formulas it has for attention, and counts
# the same call on CPU tensors. In the stored run (torch 2.13) the list holds the CUDA kernels
# (flash, memory-efficient and cuDNN, forward and backward; each formula computed from the
# shapes, not measured from the kernel's work) but not the CPU's fused kernel
# (`_scaled_dot_product_flash_attention_for_cpu`), and PyTorch's function on CPU tensors
# counts **0** FLOPs. So a fused function is counted on `meta`,
# and a count of 0 means "no formula", not "no work". Which kernels have a formula depends on
# the version of PyTorch, so CI does not compare this cell's output; the asserts hold either way.

# %% tags=["nbval-ignore-output"]
print("formulas for attention kernels:",
      sorted(str(op) for op in flop_registry if "scaled_dot_product" in str(op)))
Q_real = torch.randn(1, 1, 512, 64, generator=torch.Generator().manual_seed(0))  # CPU tensors
real_counts = {name: count_flops(lambda fn=fn: fn(Q_real, Q_real, Q_real))
               for name, fn in both_functions.items()}
print("T = 512 on CPU tensors, counted:",
      ", ".join(f"{name} {n / 1e6:.0f} MFLOP" for name, n in real_counts.items()))
assert real_counts["ours"] == flops_512  # our two products, on any device
assert real_counts["PyTorch's"] in (0, flops_512)  # no formula, or one that agrees


# %% [markdown]
# ### Memory: the peak of one call
#
# The formula above counts the weights alone. While it runs, a call holds more: which tensors
# exist at the same moment depends on how the function is written. So we measure the peak, the
# most memory in use at any moment of the call, beyond what was in use before it:
# `peak_memory(fn)`. The peak is the number that matters: a call fails with "out of memory"
# (on a GPU, the first resource long sequences exhaust) as soon as its peak does not fit, however
# little it holds on average.

# %% jupyter={"source_hidden": true}
#| export measure
@contextlib.contextmanager
def stderr_silenced():
    """Send whatever is written to the process's stderr (file descriptor 2) to /dev/null."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's bytes in use while fn() runs, above where they started."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with stderr_silenced():  # some torch versions log the profiler's start and stop there
        prof.start()
    try:
        fn()
    finally:
        with stderr_silenced():
            prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    # One "[memory]" event per allocation (+bytes) and per free (-bytes); device type 0 is the CPU.
    changes = sorted(
        (event["ts"], event["args"]["Bytes"])
        for event in events
        if event.get("name") == "[memory]" and event.get("args", {}).get("Device Type") == 0
    )
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Most bytes that fn()'s allocations on `device` ("cpu" or "cuda") hold at one moment."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_peak_bytes(fn)
    if device.type != "cuda":
        raise ValueError(f"peak_memory measures the 'cpu' or a 'cuda' device, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# %% [markdown]
# **Check** the measurement against an accounting of our function. Its first line makes the
# products $QK^\top$ and divides them by $\sqrt{d_k}$ into a new tensor (for a moment two
# $T \times T$ matrices); the softmax then makes the weights while the scores are still alive
# (two again); and the context adds $T d_v$ numbers per head while both are still held, since
# the local variable `scores` lives until the function returns. So the peak should be two
# $T \times T$ matrices plus the context, $B h\,(2T^2 + T d_v) \cdot 4$ bytes in float32: three
# times the weights at $T = d_v$, and closer and closer to twice the weights as $T$ grows.
# Nothing in the measurement knows this formula. We measure on the CPU, where the profiler
# counts the bytes PyTorch's allocator hands out, whatever the machine (on a GPU,
# `peak_memory(fn, "cuda")` reads the CUDA allocator's peak instead), and allow 1% for small
# bookkeeping tensors that some versions of PyTorch keep.
# Because of that 1%, CI does not compare the printed peaks (here and below) with the stored
# ones; the asserts hold them to the accounting.

# %% tags=["nbval-ignore-output"]
def attention_peak(T: int, fn=scaled_dot_product_attention, batch: int = 1, heads: int = 1,
                   d_k: int = 64) -> int:
    """Peak bytes of one call of `fn` on random (batch, heads, T, d_k) inputs, on the CPU."""
    gen = torch.Generator().manual_seed(T)
    Q, K, V = (torch.randn(batch, heads, T, d_k, generator=gen) for _ in range(3))
    with torch.no_grad():
        return peak_memory(lambda: fn(Q, K, V))


lines = [f"{'T':>5} {'weights MiB':>12} {'peak MiB':>9} {'peak / weights':>15}"]
for T_mem in (64, 128, 256, 512, 1024):
    weights_bytes = 2 * 4 * T_mem**2 * 4  # B * h * T^2 float32 numbers
    accounting = 2 * 4 * (2 * T_mem**2 + T_mem * 64) * 4
    peak = attention_peak(T_mem, batch=2, heads=4)
    assert accounting <= peak <= 1.01 * accounting, (T_mem, peak, accounting)
    lines.append(f"{T_mem:>5} {weights_bytes / 2**20:>12.2f} {peak / 2**20:>9.2f}"
                 f" {peak / weights_bytes:>15.3f}")
print("\n".join(lines))


# %% [markdown]
# What can this check catch? A change in how many $T \times T$ matrices are alive together.
# Three other ways to write the function, measured the same way at $T = 1024$: one that drops
# the scores (`del scores`) before the last product peaks *below* the accounting (two
# $T \times T$ matrices, no context on top), one that takes the softmax of a copy of the scores
# peaks above it (three). The check cannot tell apart versions that hold the same matrices at
# their peak: dividing $Q$ by $\sqrt{d_k}$ before the product gives exactly our number.

# %% tags=["nbval-ignore-output"]
def frees_scores(Q, K, V):
    """Ours without mask and dropout, but the scores are freed before the last product."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    attn = torch.softmax(scores, dim=-1)
    del scores
    return attn @ V, attn


def softmax_of_copy(Q, K, V):
    """Ours without mask and dropout, with the softmax taken of a copy of the scores."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    attn = torch.softmax(scores.clone(), dim=-1)
    return attn @ V, attn


def scales_q_first(Q, K, V):
    """Ours without mask and dropout, with Q divided by sqrt(d_k) before the product."""
    scores = (Q / math.sqrt(Q.size(-1))) @ K.transpose(-2, -1)
    attn = torch.softmax(scores, dim=-1)
    return attn @ V, attn


accounting = 2 * 4 * (2 * 1024**2 + 1024 * 64) * 4
verdicts = {}
for fn in (frees_scores, softmax_of_copy, scales_q_first):
    ratio = attention_peak(1024, fn, batch=2, heads=4) / accounting
    verdicts[fn.__name__] = accounting <= ratio * accounting <= 1.01 * accounting
    print(f"{fn.__name__:>16}: peak / accounting {ratio:.3f}, "
          f"{'passes' if verdicts[fn.__name__] else 'fails'} the check")
assert verdicts == {"frees_scores": False, "softmax_of_copy": False, "scales_q_first": True}

# %% [markdown]
# ### Memory against $T$
#
# The peak of one call, one head, for $T$ from 64 to 2048: ours and PyTorch's
# `F.scaled_dot_product_attention` side by side, beside one $T \times T$ matrix of float32 (the
# weights alone). PyTorch's peak depends on its version and on the device, so CI does not compare
# this cell's output; the next cell asserts what holds for ours.

# %% tags=["nbval-ignore-output"]
Ts = [64, 128, 256, 512, 1024, 2048]
functions = {"ours": scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
peaks = {name: [attention_peak(T_peak, fn) for T_peak in Ts] for name, fn in functions.items()}
lines = [f"{'T':>5} {'one T x T MiB':>13} {'ours MiB':>9} {'torch MiB':>10} {'torch / one T x T':>18}"]
for i, T_peak in enumerate(Ts):
    matrix_bytes = T_peak**2 * 4  # one T x T matrix of float32
    lines.append(f"{T_peak:>5} {matrix_bytes / 2**20:>13.3f} {peaks['ours'][i] / 2**20:>9.3f}"
                 f" {peaks['torch'][i] / 2**20:>10.3f} {peaks['torch'][i] / matrix_bytes:>18.3f}")
lines.append(f"peak grew from T = {Ts[-2]} to {Ts[-1]}: " + ", ".join(
    f"{name} {peaks[name][-1] / peaks[name][-2]:.2f}x" for name in functions))
print("\n".join(lines))

# %% [markdown]
# **Check** that our function's peak follows the accounting at every length (one head now):
# between $(2T^2 + T d_v) \cdot 4$ bytes and 1% more.

# %%
assert all(2 * T**2 * 4 + T * 64 * 4 <= peak <= 1.01 * (2 * T**2 * 4 + T * 64 * 4)
           for T, peak in zip(Ts, peaks["ours"], strict=True))

# %% [markdown]
# **Picture:** the peaks against $T$ on log-log axes, where a power law $T^k$ is a straight line
# of slope $k$. The dashed line is the accounting, $(2T^2 + T d_v) \times 4$ bytes, whose slope
# is below 2 at short lengths (where the context's $T d_v$ term still counts) and approaches 2
# as $T$ grows; the dotted one, one $T \times T$ matrix alone, has slope exactly 2.

# %% jupyter={"source_hidden": true}
fig_mem, ax_mem = plt.subplots(figsize=(7.5, 4.6), constrained_layout=True)
ax_mem.plot(Ts, [b / 2**20 for b in peaks["ours"]], "o", color=COLORS["ours"], markersize=8,
            label="measured peak, ours")
ax_mem.plot(Ts, [b / 2**20 for b in peaks["torch"]], "s-", color=COLORS["torch"],
            label="measured peak, F.scaled_dot_product_attention")
ax_mem.plot(Ts, [(2 * T**2 + 64 * T) * 4 / 2**20 for T in Ts], "--", color="0.4",
            label="$(2T^2 + T d_v) \\times 4$ bytes: scores, weights, context")
ax_mem.plot(Ts, [T**2 * 4 / 2**20 for T in Ts], ":", color="0.4",
            label="$T^2 \\times 4$ bytes: one $T \\times T$ matrix (the weights)")
ax_mem.set_title("Peak memory of one call (CPU, one head, float32, $d_k = d_v = 64$)")
ax_mem.set_ylabel("memory (MiB, log scale)")
ax_mem.set_xscale("log", base=2)
ax_mem.set_yscale("log")
ax_mem.set_xticks(Ts, [str(T) for T in Ts])
ax_mem.set_xlabel("sequence length T (tokens)")
ax_mem.grid(True, which="major", alpha=0.3)
ax_mem.legend(fontsize=8)
save_figure(fig_mem, "02_attention_memory")
plt.show()

# %% [markdown]
# Our measured peak sits on the accounting at every length. It grows $3.33$ times over the first
# doubling (64 to 128) and $3.94$ times over the last (1024 to 2048), both from the accounting:
# the context's $T d_v$ term, linear in $T$, weighs less and less, and the ratio approaches four.
# PyTorch's fused function is another story, and what it does depends on its version and on the
# device. In the stored run (the table's last column) its peak is about twice one $T \times T$
# matrix at $T = 64$, below one such matrix from $T = 128$ on, and a small fraction of one at
# $T = 2048$, having grown far less than fourfold over the last doubling (the table's last line).
# A peak below one $T \times T$ matrix means that, at those lengths, its kernel never holds the
# whole matrix at once ([notebook 14](14_efficient_attention.ipynb) writes such a kernel).
#
# How these counts compare with the layers attention replaced, the recurrent and convolutional
# ones of Table 1 of Vaswani et al. (2017), is in the appendix.

# %% [markdown]
# **Takeaway: double the sequence and the FLOPs of attention's matrix products grow fourfold,
# exactly $2T^2(d_k + d_v)$ per head: counted for our function, and for PyTorch's on the `meta`
# device, where it runs the same two products (on CPU tensors the counter has no formula for its
# fused kernel and counts 0). The memory grows about fourfold only where the $T \times T$ weights are
# stored: our function's measured peak is two such matrices per head (scores and weights) plus
# the context, while PyTorch's fused function, in the stored run, peaked below one such matrix
# from $T = 128$ on ([notebook 14](14_efficient_attention.ipynb)). The clock, timed in the
# appendix, follows $T^2$ only roughly.**
#
# ## Recap
#
# | idea | code | shape |
# |---|---|---|
# | all queries at once | `scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)` | $(\dots, T_q, T_k)$ |
# | self-attention projections | `Q, K, V = X @ W_q, X @ W_k, X @ W_v` | $(B, T, d_k)$, $(B, T, d_k)$, $(B, T, d_v)$ |
# | mask | bool (`True` = may attend) or float (added to the scores) | broadcast to $(\dots, T_q, T_k)$ |
# | weights | `attn = torch.softmax(scores, dim=-1)` | $(\dots, T_q, T_k)$, rows sum to 1 (0 if fully masked) |
# | dropout | `F.dropout(attn, p)` in training: zero with prob. $p$, rest $\times 1/(1-p)$ | unchanged |
# | context | `context = attn @ V` | $(\dots, T_q, d_v)$ |
# | the function | `scaled_dot_product_attention(Q, K, V, mask, dropout_p, training)` | `(context, attn)` |
# | heatmap | `plot_attention(attn[0], tokens, annotate=True)` | one $(T_q, T_k)$ matrix |
# | equivariance | `f(X[:, perm]) == f(X)[:, perm]` | order is invisible |
# | measuring (module `measure`) | `count_flops(fn)`, `peak_memory(fn, device)`, `time_call(fn)`, `fit_slope(xs, ys)` | FLOPs, bytes, seconds (median), exponent |
# | cost of attention | $2T^2(d_k + d_v)$ FLOPs; our peak $2T^2 + T d_v$ numbers per head | FLOPs quadruple when $T$ doubles; the peak's ratio approaches 4 as $T$ grows |
#
# ## Exercises
#
# 1. **Keys are a set too.** In cross-attention ($T_q \ne T_k$), shuffle the keys and the values
#    *together*. What happens to the output? And if you shuffle only the keys?
# 2. **Does a causal mask keep the equivariance?** Repeat the check of section 5 with the causal
#    mask of section 3 (on the original and on the shuffled sequence). Predict first.
# 3. **A memory budget.** A layer runs 8 heads of width $d_k = d_v = 16$ over a batch of 8
#    sequences in float32. What is the longest sequence whose attention weights fit in 16 GiB?
#    Measure the peak of one call of our function at a small $T$: how long a sequence fits once
#    the whole call must fit?
#
# **Solutions.**
#
# 1. The output does not change at all: the weighted sum $\sum_j \alpha_j v_j$ runs over the
#    pairs $(k_j, v_j)$ in any order, so attention is permutation *invariant* in its keys and
#    values. Shuffling only the keys breaks the pairs, so each value gets another key's weight:

# %%
gen = torch.Generator().manual_seed(6)
Q_x = torch.randn(2, 3, 8, generator=gen).to(device)  # (B, T_q, d_k)
K_x = torch.randn(2, 7, 8, generator=gen).to(device)  # (B, T_k, d_k)
V_x = torch.randn(2, 7, 4, generator=gen).to(device)  # (B, T_k, d_v)
shuffle = torch.randperm(7, generator=gen).to(device)
out_x, _ = scaled_dot_product_attention(Q_x, K_x, V_x)
out_pairs, _ = scaled_dot_product_attention(Q_x, K_x[:, shuffle], V_x[:, shuffle])
out_keys_only, _ = scaled_dot_product_attention(Q_x, K_x[:, shuffle], V_x)
torch.testing.assert_close(out_pairs, out_x)  # invariant
assert not torch.allclose(out_keys_only, out_x, atol=1e-3)  # pairs broken
print("keys and values shuffled together: unchanged; keys alone: changed")

# %% [markdown]
# 2. No. The mask is a function of positions: query $t$ sees keys $\le t$. Shuffle the tokens and
#    each one sees a different set of neighbours, so the output is no longer a shuffle of the old
#    one. (That is why a decoder with a causal mask can pick up some sense of order even without
#    positional encodings; Haviv et al., 2022.) One row is easy to predict: query 0 sees only
#    itself, so its output is its own value, whichever token lands there.

# %%
gen = torch.Generator().manual_seed(4)  # section 5's inputs, drawn again from the same seed
X_c = torch.randn(2, 10, 16, generator=gen).to(device)  # (B, T, d_model)
W_q_c, W_k_c, W_v_c = ((torch.randn(16, 8, generator=gen) / math.sqrt(16)).to(device)
                       for _ in range(3))  # (d_model, d_k) each
P_c = torch.eye(10, device=device)[torch.randperm(10, generator=gen).to(device)]  # (T, T)
causal_T = torch.ones(10, 10, dtype=torch.bool, device=device).tril()  # (T, T)
out_c, _ = self_attention(X_c, W_q_c, W_k_c, W_v_c, mask=causal_T)
out_c_perm, _ = self_attention(P_c @ X_c, W_q_c, W_k_c, W_v_c, mask=causal_T)
gap_causal = (out_c_perm - P_c @ out_c).abs().max().item()
assert gap_causal > 1e-2
torch.testing.assert_close(out_c_perm[:, 0], (P_c @ X_c @ W_v_c)[:, 0])  # query 0 copies its own value
print(f"causal mask: largest difference from P @ output: {gap_causal:.3f}")

# %% [markdown]
# 3. The weights take $B \cdot h \cdot T^2 \cdot 4$ bytes. Solve
#    $8 \cdot 8 \cdot T^2 \cdot 4 \le 16 \cdot 2^{30}$: $T^2 \le 2^{34}/2^{8} = 2^{26}$, so
#    $T = 2^{13} = 8192$ tokens, for the weights of one layer alone. The call needs more. Measured
#    at $T = 256$, its peak is just over twice the weights: section 6 found the scores and the
#    weights alive together, plus the context, $B h\,(2T^2 + T d_v) \cdot 4$ bytes. Solving
#    $2T^2 + 16\,T \le 2^{26}$ instead gives about 5,800 tokens. (The peak counts what the call
#    allocates. Its inputs $Q$, $K$, $V$ exist before it, $3\,T d_k$ numbers per head, which at
#    this length add less than 1% and do not change the answer's first digits.)

# %% tags=["nbval-ignore-output"]
T_small = 256
measured = attention_peak(T_small, batch=8, heads=8, d_k=16)
weights_small = 8 * 8 * T_small**2 * 4
ratio = measured / weights_small
assert 2.0 < ratio < 2.1  # two T x T matrices, plus a context of T * d_v = T^2 / 16 numbers

T_weights = math.isqrt(16 * 2**30 // (8 * 8 * 4))  # weights alone: T^2 <= 2^26
T_call = int((-16 + math.sqrt(16**2 + 8 * 2**26)) / 4)  # whole call: 2 T^2 + 16 T <= 2^26
print(f"T = {T_small}: peak {measured / 2**20:.1f} MiB = {ratio:.4f} x the weights")
print(f"longest T in 16 GiB: weights alone {T_weights}, the whole call {T_call}")


# %% [markdown]
# ## Appendix · Under the hood
#
# Optional reading, mostly about measuring rather than attention: how the helpers of `measure`
# work; the time of section 6's two functions, a noisy measurement; section 6's counts beside
# Table 1 of Vaswani et al. (2017), attention against a recurrent layer; why the dropout masks of
# section 3 differ between machines; and how readable `plot_attention`'s numbers are.
#
# ### How `measure` measures
#
# - **Peak memory** (`peak_memory`). On a GPU the CUDA allocator keeps the peak itself: reset it,
#   call, read `torch.cuda.max_memory_allocated` and subtract what was in use before. On a CPU
#   we ask PyTorch's profiler to record every allocation and every free (`profile_memory=True`),
#   export its trace, add the changes up in the order they happened and keep the largest running
#   total. The profiler starts slowly the first time, a few seconds, and some torch versions log
#   its start and stop on stderr, which `stderr_silenced` sends to `/dev/null`.
# - **Time** (`time_call`). One call, timed with `time.perf_counter`, after a
#   synchronize on a GPU, whose kernels run asynchronously. It leaves autograd as the caller set
#   it: the sweep below turns it off with `torch.no_grad()`, so that no graph is built. A first untimed call warms up
#   (allocations, caches); then the **median** of several timed calls, which one slow call, caused
#   by another program on the machine, cannot move much.
# - **Slope** (`fit_slope`). A least-squares line through $(\log x, \log y)$; its slope is the
#   exponent $k$ of $y \propto x^k$.

# %% [markdown]
# ### Time: a noisy measurement
#
# `time_call(fn)` gives the median wall-clock time of one call, after an untimed warm-up call;
# `fit_slope(xs, ys)` the exponent $k$ of a power law $y \propto x^k$ fitted on log-log axes.

# %% jupyter={"source_hidden": true}
#| export measure
def _synchronize() -> None:
    """Wait for the GPU's queued work, where there is a GPU in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.synchronize()


def time_call(fn: Callable[[], object], warmup: int = 1, repeats: int = 5) -> float:
    """Median wall-clock seconds of fn() over `repeats` timed calls, after `warmup` untimed ones."""
    check_int("warmup", warmup, minimum=0)
    check_int("repeats", repeats, minimum=1)
    for _ in range(warmup):
        fn()
    _synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x): the exponent k of y ~ x^k."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need two sequences of one length >= 2, got {len(xs)} and {len(ys)}")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError("fit_slope needs positive values (it fits on a log-log scale)")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    spread = sum((x - mx) ** 2 for x in lx)
    if spread == 0:
        raise ValueError("fit_slope needs at least two different x values")
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / spread


# %% [markdown]
# A sweep over the lengths of section 6, ours and PyTorch's `F.scaled_dot_product_attention`
# side by side at each length (so that both see the same machine load), on **one** CPU thread:
# with several, each operation is finished only when its slowest thread is, and on a busy
# machine that adds noise at every size. The sweep runs seven times over all the lengths, three
# timed calls per point each time (`time_call`'s median), and each point keeps its **fastest**
# round. Another program on the machine can only slow a round down, never speed it up, so the
# fastest round is the one least disturbed (the advice of Python's `timeit` too); the table's
# last lines say how far the rounds disagreed and how long the sweep took.
#
# The *local slope* between two neighbouring lengths is $\log_2$ of the ratio of their times,
# since each length doubles the last: 2 means exactly fourfold. The table also divides the exact
# FLOP count by the time: the **throughput** in GFLOP/s. The FLOPs grow exactly like $T^2$, so a
# time that grows like $T^k$ is a throughput that grows like $T^{2-k}$: a constant throughput
# would be exactly quadratic time, a rising one means a slope below 2, a falling one a slope
# above 2. Read a slope above 2 as "this doubling cost more than four times as much on this
# machine", not as a new law: the work is exactly $T^2$ (section 6), and the text after the
# picture says what can make the clock disagree. The numbers depend on the machine, so CI does
# not compare this cell's output.

# %% tags=["nbval-ignore-output"]
import statistics
from functools import partial

Ts = [64, 128, 256, 512, 1024, 2048]  # as in section 6
ROUNDS = 7  # sweeps over all lengths; a point's time is its fastest round
functions = {"ours": scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}
inputs = {}  # T -> (Q, K, V), each (1, 1, T, 64)
for T_time in Ts:
    gen = torch.Generator().manual_seed(T_time)
    inputs[T_time] = tuple(torch.randn(1, 1, T_time, 64, generator=gen).to(device) for _ in range(3))
rounds = {name: {T_time: [] for T_time in Ts} for name in functions}  # seconds, one per round
threads = torch.get_num_threads()
torch.set_num_threads(1)
sweep_start = time.perf_counter()
try:
    with torch.no_grad():
        for _ in range(ROUNDS):
            for T_time in Ts:
                for name, fn in functions.items():  # side by side: the same machine load
                    call = partial(fn, *inputs[T_time])
                    rounds[name][T_time].append(time_call(call, warmup=1, repeats=3))
finally:
    torch.set_num_threads(threads)
sweep_seconds = time.perf_counter() - sweep_start
times = {name: [min(rounds[name][T_time]) for T_time in Ts] for name in functions}

flops_T = [attention_flops(T_flop) for T_flop in Ts]  # exact, the same for both functions
gflops = {name: [f / t / 1e9 for f, t in zip(flops_T, times[name], strict=True)] for name in times}

lines = [f"{'T':>5} {'ours ms':>9} {'torch ms':>9}   {'GFLOP/s: ours':>13} {'torch':>6}"
         f"   {'local slope: ours':>17} {'torch':>6}"]
for i, T_time in enumerate(Ts):
    row = (f"{T_time:>5} {1e3 * times['ours'][i]:>9.3f} {1e3 * times['torch'][i]:>9.3f}"
           f"   {gflops['ours'][i]:>13.2f} {gflops['torch'][i]:>6.2f}")
    if i > 0:
        row += "   " + " ".join(f"{math.log2(times[n][i] / times[n][i - 1]):>{w}.2f}"
                                for n, w in (("ours", 17), ("torch", 6)))
    lines.append(row)
upper = slice(len(Ts) // 2, None)  # the longer half, where the T^2 term should dominate
lines.append(f"fitted slope for T >= {Ts[upper][0]}: ours {fit_slope(Ts[upper], times['ours'][upper]):.2f}, "
             f"torch {fit_slope(Ts[upper], times['torch'][upper]):.2f}")
for name in times:
    best = max(range(len(Ts)), key=lambda i, name=name: gflops[name][i])
    lines.append(f"{name}: throughput highest at T = {Ts[best]}, {gflops[name][best] / gflops[name][0]:.1f}x "
                 f"that at T = {Ts[0]}; at T = {Ts[-1]} {gflops[name][-1] / gflops[name][best]:.2f}x the highest")
noise = {name: max(max(r) / min(r) for r in rounds[name].values()) for name in functions}
lines.append(f"rounds of one point differ by at most {noise['ours']:.1f}x (ours), "
             f"{noise['torch']:.1f}x (torch); the sweep took {sweep_seconds:.0f} s")
print("\n".join(lines))

# %% [markdown]
# **Check** what does not depend on the clock. `fit_slope` recovers the exponent of exact power
# laws. `time_call` is run on a fake clock that moves only when asked: each call of the timed
# function queues some seconds of work, as a GPU's asynchronous kernels do, and the clock
# advances by them only when `_synchronize` waits for the queue. `time_call` must return the
# median of the timed calls, 2 s; the mean (2.33 s), the longest call (4 s), the warm-up alone
# (5 s), a version that forgets to wait after the warm-up (a median of 4 s) or after each call
# (0 s) all give another number. The times of the sweep themselves are not asserted: any bound
# on a wall-clock time can fail on a loaded machine, and the course's tests never assert on one.
# The table above and the picture below show them, for this machine at this moment.

# %%
assert math.isclose(fit_slope(Ts, [T**2 for T in Ts]), 2.0)
assert math.isclose(fit_slope(Ts, [3e-9 * T**1.5 for T in Ts]), 1.5)

work = iter([5.0, 1.0, 4.0, 2.0])  # seconds of queued work: the warm-up call, then 3 timed calls
fake = {"now": 0.0, "queued": 0.0}  # the fake clock, and the work not yet waited for


def queue_work():
    fake["queued"] += next(work)


def fake_synchronize():
    fake["now"] += fake["queued"]  # waiting for the queue takes as long as its work
    fake["queued"] = 0.0


real_clock, real_synchronize = time.perf_counter, _synchronize
time.perf_counter, _synchronize = (lambda: fake["now"]), fake_synchronize
try:
    fake_median = time_call(queue_work, warmup=1, repeats=3)
finally:
    time.perf_counter, _synchronize = real_clock, real_synchronize
assert fake_median == 2.0, fake_median
print(f"time_call on the fake clock: {fake_median} s")

# %% [markdown]
# **Picture:** time and throughput against $T$, the time on log-log axes, where a power law $T^k$
# is a straight line of slope $k$. The dashed line is a guide of slope 2, drawn through our
# function's time at $T = 512$: it is not fitted to the points. In the throughput panel
# exactly quadratic time would be a horizontal line.

# %% jupyter={"source_hidden": true}
fig_time, (ax_time, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
labels = {"ours": "ours", "torch": "F.scaled_dot_product_attention"}
ax_time.plot(Ts, [1e3 * t for t in times["ours"]], "o-", color=COLORS["ours"], label=labels["ours"])
ax_time.plot(Ts, [1e3 * t for t in times["torch"]], "s-", color=COLORS["torch"],
             label=labels["torch"])
T_guide = 512
guide_ms = 1e3 * times["ours"][Ts.index(T_guide)]
ax_time.plot(Ts, [guide_ms * (T / T_guide) ** 2 for T in Ts], "--", color="0.4",
             label=f"guide of slope 2 ($\\propto T^2$) through ours at T = {T_guide}, not a fit")
# One CPU thread is what the sweep sets; on a GPU that setting only affects the host side.
where = "CPU, one thread" if device.type == "cpu" else device.type.upper()
ax_time.set_title(f"Time of one forward pass ({where}, one head)")
ax_time.set_ylabel(f"time per call (ms, fastest of {ROUNDS} rounds, log scale)")
ax_time.set_yscale("log")

ax_rate.plot(Ts, gflops["ours"], "o-", color=COLORS["ours"], label=labels["ours"])
ax_rate.plot(Ts, gflops["torch"], "s-", color=COLORS["torch"], label=labels["torch"])
ax_rate.set_title(f"Throughput: exact FLOPs / time ({where})")
ax_rate.set_ylabel("GFLOP/s (flat = time exactly $\\propto T^2$)")
ax_rate.set_ylim(bottom=0)  # throughput on a linear scale, from zero
for ax in (ax_time, ax_rate):
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ts, [str(T) for T in Ts])
    ax.set_xlabel("sequence length T (tokens)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
plt.show()


# %% [markdown]
# The time panel is wall-clock evidence from one machine at one moment. It changes from run to
# run, more on a loaded machine than on a quiet one; the table's line "rounds of one point
# differ" says how far the rounds of this run disagreed. The throughput panel shows how far the
# time is from $T^2$. Where fixed costs (starting each operation, whatever its size) dominate,
# at small $T$, the throughput rises with $T$ and the local slope is below 2. Where the
# throughput falls at larger $T$, a single doubling costs more than four times as much; the
# table says at which lengths that happened in the stored run.
#
# Why it falls is a hypothesis this notebook does not test, and it is about our function only.
# Ours writes two $T \times T$ matrices per call (section 6), each 1 MiB at $T = 512$, 4 MiB at
# $T = 1024$ and 16 MiB at $T = 2048$; once they no longer fit in the processor's caches, each
# entry costs more to stream through memory, and tensors this large may also cost the allocator
# more to obtain at every call. PyTorch's fused kernel holds less than one such matrix at these
# lengths (section 6's table of peaks), so the same story cannot explain a fall of its
# throughput. Where its throughput falls too, the cause lies elsewhere, and this notebook does
# not pin it down; on a shared machine, other programs competing for the caches and the memory
# bus are one candidate, and they vary from run to run. So the fitted slope over the longer half
# is a rough exponent, not a law, and the dashed guide need not follow the other points. The quadratic law itself is in the FLOP count and, for our function, in the memory,
# which section 6 pins down; the clock agrees with it only roughly.
#
# `benchmarks/attention.py`, outside the package at the root of the repository, repeats these
# measurements for more lengths and writes them to a JSON file (`make bench`).

# %% [markdown]
# ### Against the alternatives: Table 1 of Vaswani et al. (2017)
#
# The paper weighs self-attention against the layers it replaced, for a sequence of length $n$
# and representations of width $d$ ($k$: a convolution's kernel width; $r$: the neighbourhood a
# *restricted* self-attention looks at):
#
# | layer type | complexity per layer | sequential operations | maximum path length |
# |---|---|---|---|
# | self-attention | $O(n^2 \cdot d)$ | $O(1)$ | $O(1)$ |
# | recurrent | $O(n \cdot d^2)$ | $O(n)$ | $O(n)$ |
# | convolutional | $O(k \cdot n \cdot d^2)$ | $O(1)$ | $O(\log_k n)$ |
# | self-attention (restricted) | $O(r \cdot n \cdot d)$ | $O(1)$ | $O(n/r)$ |
#
# How the columns meet what this notebook measured:
#
# - **Complexity per layer** is the $T \times T$ work counted in section 6, $2T^2(d_k + d_v)$ per head,
#   so $4 n^2 d$ over $h$ heads of width $d_k = d_v = d/h$. It leaves out the four projections
#   (queries, keys, values, output), $8 n d^2$. A recurrent layer
#   $h_t = \tanh(x_t W + h_{t-1} U)$ has a counterpart of those, the input product $x_t W$, and
#   one product that only it has, $h_{t-1} U$: $2 d^2$ at each of the $n$ steps, $2 n d^2$. The
#   table's $O(\cdot)$ compares what each layer adds, $n^2 d$ against $n d^2$, and drops the
#   constants: self-attention does less work when $n$ is small compared with $d$, which the paper
#   notes is the usual case for sentences (its $d$ is 512). Where exactly the two meet depends
#   on what one counts, as the count below shows.
# - **Sequential operations:** our function is two matrix products and a softmax whatever $T$ is;
#   every query is computed at once. A recurrent layer needs $n$ steps, each waiting for the one
#   before.
# - **Maximum path length:** one attention step connects every output to every input (the
#   weights of section 4 have no zero outside a mask), where a recurrent layer passes information
#   along $n$ steps. Restricted self-attention trades this back for less work: each query sees
#   only the $r$ keys of a window centred on its own position, the symmetric window that
#   notebook 05's exercise 1 mentions beside the causal one it builds.
#
# **Count** the first column with the FLOP counter, a recurrent layer of width $d = 512$ (on the
# `meta` device) against 8 heads of width 64. This is a demonstration, not a test: the counter
# charges $2mnk$ for each product, so the numbers follow from the shapes. Counting what each
# layer adds (the $T \times T$ products against $h_{t-1} U$), attention does
# $4n^2d / 2nd^2 = 2n/d$ times the work: equal at $n = d/2 = 256$, not at $n = d$. Counting both
# layers whole (attention with its four projections, $4n^2 d + 8 n d^2$, against $4 n d^2$), the
# ratio is $n/d + 2$, and this plain recurrent layer does less work at every $n$.

# %%
def recurrent_flops(n: int, d: int, whole: bool = True) -> int:
    """FLOPs of the products of a plain recurrent layer over n steps, width d; without the
    input product x_t W (whole=False), only the recurrence h_{t-1} U."""
    x, W, U = (torch.empty(*shape, device="meta") for shape in ((n, 1, d), (d, d), (d, d)))

    def run():
        state = torch.empty(1, d, device="meta")
        for t in range(n):  # n sequential steps: step t needs the state of step t - 1
            mixed = state @ U  # the product only a recurrent layer has
            state = torch.tanh(x[t] @ W + mixed if whole else mixed)

    return count_flops(run)


def projection_flops(n: int, d: int) -> int:
    """FLOPs of the four d x d projections of an attention layer (queries, keys, values, output)."""
    X, W = torch.empty(n, d, device="meta"), torch.empty(d, d, device="meta")
    return count_flops(lambda: [X @ W for _ in range(4)])


d_layer = 512
lines = [f"{'n':>5} | {'T x T products':>14} {'h U':>5} {'ratio':>5} |"
         f" {'attention layer':>15} {'recurrent layer':>15} {'ratio':>5}   (MFLOP)"]
for n in (128, 256, 512, 1024):
    attention_work = attention_flops(n, heads=d_layer // 64)  # 8 heads of width 64: 4 n^2 d
    recurrence_work = recurrent_flops(n, d_layer, whole=False)  # 2 n d^2
    attention_layer = attention_work + projection_flops(n, d_layer)  # 4 n^2 d + 8 n d^2
    recurrent_layer = recurrent_flops(n, d_layer)  # 4 n d^2
    assert attention_work * d_layer == 2 * n * recurrence_work  # ratio 2n / d
    assert attention_layer * d_layer == (n + 2 * d_layer) * recurrent_layer  # ratio n / d + 2
    lines.append(f"{n:>5} | {attention_work / 1e6:>14.0f} {recurrence_work / 1e6:>5.0f}"
                 f" {attention_work / recurrence_work:>5.2f} | {attention_layer / 1e6:>15.0f}"
                 f" {recurrent_layer / 1e6:>15.0f} {attention_layer / recurrent_layer:>5.2f}")
print("\n".join(lines))

# %% [markdown]
# ### Why the dropout masks differ between machines
#
# Dropout draws its random mask from the generator of the device it runs on, and a GPU's
# generator is not the CPU's; so the dropout examples of section 3 (step 4 and check 5) run on
# the CPU, whatever the device, and the code is the same everywhere. Even on the CPU the mask
# depends on the machine (notebook 00 measures it): on an Intel CPU, PyTorch builds with MKL draw
# it from MKL's random stream, on other CPUs from PyTorch's own generator. That is why CI does
# not compare the printed masks and fractions, and why the asserts there hold for any mask.

# %% [markdown]
# ### The contrast of `plot_attention`'s numbers
#
# Section 1 checked that `plot_attention` writes each weight in black or white. "Stands out" is
# measured the way the Web Content Accessibility Guidelines (WCAG 2) do, and on the picture as
# drawn, not on what `plot_attention` meant to draw: we draw section 1's figure again, read
# each cell's colour from the pixels next to its number, and compute the contrast ratio
# $(L_1 + 0.05)/(L_2 + 0.05)$ of the text and the cell, with $L$ the relative luminance of
# linearised sRGB. The ratio runs from 1 (the same colour) to 21 (black on white); WCAG's level
# AA asks for at least 4.5 for text of this size. `plot_attention` picks black or white by the
# same luminance: white and black contrast equally with a cell of $L = \sqrt{0.0525} - 0.05
# \approx 0.179$, so choosing white below it and black above gives every cell a ratio of at
# least $1.05 / (0.179 + 0.05) \approx 4.58$, whatever its colour. The check measures that on
# the pixels of these cells and over every colour of the colour map, and shows what a simpler
# rule does: "white when the *unlinearised* brightness $0.2126R + 0.7152G + 0.0722B$ is below
# 0.5", which looks equivalent and was this function's first version, falls to about 3.7 on
# some blues (found when the notebook ran under other seeds: other weights, other cells).
# Notebook 00's `text_color`, which labels the course's palette, uses the same luminance rule.
# Last, the text colour not picked must fail on some cell, or the choice would not matter.

# %%
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb


def contrast_ratio(color_a, color_b) -> float:
    """WCAG 2 contrast ratio of two colours: 1 (identical) to 21 (black and white)."""
    linear = []
    for color in (color_a, color_b):
        channels = np.asarray(to_rgb(color))  # sRGB in [0, 1]
        channels = np.where(
            channels <= 0.04045, channels / 12.92, ((channels + 0.055) / 1.055) ** 2.4
        )
        linear.append(float(channels @ [0.2126, 0.7152, 0.0722]))  # relative luminance
    return (max(linear) + 0.05) / (min(linear) + 0.05)


# Section 1's figure, drawn again from its weights (weights_b, section 1), then rendered.
fig_c, ax_c = plt.subplots(figsize=(5.4, 3.2))
plot_attention(weights_b[0], x_labels=[f"k{j}" for j in range(weights_b.size(-1))],
               y_labels=[f"q{i}" for i in range(weights_b.size(-2))], ax=ax_c, annotate=True,
               title="All queries at once: one softmax per row")
plt.close(fig_c)  # not shown again: only its pixels are needed
canvas = FigureCanvasAgg(fig_c)
canvas.draw()
pixels = np.asarray(canvas.buffer_rgba())[..., :3] / 255  # (H, W, 3), top row first
ratios, other_ratios = [], []
for text in ax_c.texts:
    column, row = (round(c) for c in text.get_position())
    # A point inside the cell, beside the digits: display coordinates count up from the bottom.
    x_px, y_px = ax_c.transData.transform((column - 0.35, row - 0.35))
    cell = pixels[pixels.shape[0] - 1 - round(y_px), round(x_px)]
    ratios.append(contrast_ratio(text.get_color(), cell))
    other = "black" if text.get_color() == "white" else "white"
    other_ratios.append(contrast_ratio(other, cell))
print(f"contrast of each number with its cell: lowest {min(ratios):.1f}, "
      f"highest {max(ratios):.1f}; with the other text colour, lowest {min(other_ratios):.1f}")
assert min(ratios) >= 4.5  # readable: WCAG's level AA for small text
assert min(other_ratios) < 3  # the choice matters: the other colour would not be

# Every colour the map can give a cell: a 1 x 256 ramp from 0 to 1, annotated by plot_attention.
ramp = np.linspace(0, 1, 256)[None, :]
fig_r, ax_r = plt.subplots()
plot_attention(ramp, ax=ax_r, vmin=0, vmax=1, annotate=True)
plt.close(fig_r)
colours = plt.get_cmap("Blues")(ramp[0])[:, :3]  # (256, 3): each cell's colour
ramp_ratios = [contrast_ratio(t.get_color(), c) for t, c in zip(ax_r.texts, colours, strict=True)]
naive = [contrast_ratio("white" if c @ [0.2126, 0.7152, 0.0722] < 0.5 else "black", c)
         for c in colours]
print(f"over the 256 colours of Blues, lowest contrast: {min(ramp_ratios):.2f} with "
      f"plot_attention's rule, {min(naive):.2f} with the naive brightness rule")
assert min(ramp_ratios) >= 4.5 > min(naive)

# %% [markdown]
# Next: [03 · Multi-head attention](03_multi_head_attention.ipynb), which runs several of these
# heads side by side, each with its own $W_q$, $W_k$, $W_v$, and joins their outputs.
