# %% [markdown]
# # 01 · Attention
#
# **What you will build:** attention for a single query, written from scratch: scores, softmax,
# weighted average. On the way you will derive the softmax's Jacobian and check it against
# autograd, make the softmax numerically safe, and measure why the Transformer divides its
# scores by $\sqrt{d_k}$: without it, the softmax saturates and its gradient vanishes as $d_k$
# grows. A slider lets you watch that happen.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/01_attention.ipynb) · Assumes: [00 · Setup](00_setup.ipynb) (`set_seed`, `get_device`, `COLORS`, `save_figure`).

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
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import to_rgba

from transformer_from_scratch.utils import COLORS, OTHER_COLORS, get_device, save_figure, set_seed

set_seed(0)
device = get_device()


# %% [markdown]
# ## 1. The fixed-length bottleneck
#
# Before attention, neural machine translation used an **encoder–decoder** pair of recurrent
# networks (Sutskever, Vinyals and Le, 2014, *Sequence to Sequence Learning with Neural
# Networks*). The encoder reads the source sentence $x_1, \dots, x_T$ one token at a time,
# updating a hidden state $h_t = f(h_{t-1}, x_t)$. Its last state becomes the summary
# $c = h_T$, and the decoder writes the translation from $c$ alone.
#
# The trouble is the size of $c$: it is fixed before training, while sentences are not. A
# five-word sentence and a fifty-word one must both fit into the same $d$ numbers. The
# symptoms were visible at the time. Sutskever et al. found that *reversing* the source
# sentence helped, because it put the first source words close to the first target words;
# Cho et al. (2014, *On the Properties of Neural Machine Translation*) measured translation
# quality falling quickly as sentences grew longer.
#
# **Attention** removes the bottleneck (Bahdanau, Cho and Bengio, 2014, *Neural Machine
# Translation by Jointly Learning to Align and Translate*). The encoder keeps *all* its states
# $h_1, \dots, h_T$. At every output step $t$ the decoder scores each of them against its own
# state, turns the scores into weights $\alpha_{t1}, \dots, \alpha_{tT}$ that sum to one, and
# reads a fresh context $c_t = \sum_j \alpha_{tj} h_j$. The memory now grows with the sentence,
# and each output word can look at the source words it needs. Bahdanau et al. showed that
# their model's quality no longer collapsed on long sentences, and that the weights
# $\alpha_{tj}$ line up with a sensible word alignment.
#
# The picture below (its code is folded away in JupyterLab and on the course's site: click to
# show it) draws both. Only (b) has
# queries and keys, so only (b) uses their colours: the decoder's state asks (blue), the
# encoder's states answer (orange), and the context vector in each panel is the accent (red).
# The decoder's state does not enter the sum $c_t$ itself: it scores each $h_j$, and so sets the
# weights $\alpha_{tj}$ (the dashed frame its arrow points at). Following Bahdanau et al., $s$
# is a decoder state in this section only; from section 3 on, $s$ is a softmax's output.
# Panel (b) simplifies Bahdanau et al.'s encoder to one direction: theirs is bidirectional, and
# each $h_j$ joins the state of a left-to-right pass with that of a right-to-left one. Both
# panels also leave out an input of each decoder state: the word written at the step before
# ($y_{t-1}$ enters $s_t$).

# %% jupyter={"source_hidden": true}
def draw_node(ax, xy, label, color, fill_alpha=0.25):
    """A rounded box with a math label, centred at xy: `color` mixed into white, opaque, so
    that the lines drawn below it (lower zorder) end at its edge instead of crossing the label."""
    fill = tuple(1 - fill_alpha + fill_alpha * c for c in to_rgba(color)[:3])
    ax.text(*xy, label, ha="center", va="center", fontsize=12, zorder=3,
            bbox=dict(boxstyle="round,pad=0.35", fc=fill, ec=color, lw=1.5))


def draw_arrow(ax, start, end, color="0.35", lw=1.2, style="-|>"):
    """An arrow from start to end that stops short of the boxes at both ends."""
    ax.annotate("", xy=end, xytext=start, zorder=2,
                arrowprops=dict(arrowstyle=style, color=color, lw=lw, shrinkA=14, shrinkB=14))


fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(13, 3.8))
T_src = 5
grey = "0.5"

# (a) Encoder-decoder without attention: everything passes through one vector c.
for j in range(T_src):
    draw_node(ax_a, (j, 0), f"$x_{j + 1}$", grey, 0.1)
    draw_node(ax_a, (j, 1), f"$h_{j + 1}$", "0.3")
    draw_arrow(ax_a, (j, 0), (j, 1))
    if j > 0:
        draw_arrow(ax_a, (j - 1, 1), (j, 1))
draw_node(ax_a, (5.3, 1), "$c$", COLORS["accent"], 0.45)
draw_arrow(ax_a, (T_src - 1, 1), (5.3, 1), COLORS["accent"], lw=2)
for i in range(3):
    draw_node(ax_a, (6.6 + i, 1), f"$s_{i + 1}$", "0.3")
    draw_node(ax_a, (6.6 + i, 2), f"$y_{i + 1}$", grey, 0.1)
    draw_arrow(ax_a, (6.6 + i, 1), (6.6 + i, 2))
    draw_arrow(ax_a, (5.3, 1) if i == 0 else (5.6 + i, 1), (6.6 + i, 1),
               COLORS["accent"] if i == 0 else "0.35", lw=2 if i == 0 else 1.2)
ax_a.text(5.3, 0.35, "fixed size $d$,\nwhatever $T$ is", ha="center", va="center",
          fontsize=10, color=COLORS["accent"])
ax_a.set_xlim(-0.6, 9.2)
ax_a.set_ylim(-0.5, 2.9)
ax_a.set_title("(a) Sutskever et al., 2014: the whole source squeezed into $c$")
ax_a.set_axis_off()

# (b) With attention: the decoder re-reads every encoder state, weighted by alpha.
alpha = [0.05, 0.1, 0.6, 0.2, 0.05]
for j in range(T_src):
    draw_node(ax_b, (j, 0), f"$x_{j + 1}$", grey, 0.1)
    draw_node(ax_b, (j, 1), f"$h_{j + 1}$", COLORS["key"])
    draw_arrow(ax_b, (j, 0), (j, 1))
    if j > 0:
        draw_arrow(ax_b, (j - 1, 1), (j, 1))
    # Line width 0.5 + 10 alpha: it grows with the weight this output step gives to h_j.
    draw_arrow(ax_b, (j, 1), (2, 2.5), COLORS["accent"], lw=0.5 + 10 * alpha[j], style="-")
    ax_b.text(j, 1.45, rf"$\alpha_{{t{j + 1}}}$={alpha[j]:.2f}", fontsize=9, ha="center",
              va="center", color=COLORS["accent"], zorder=4,
              bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none"))
draw_node(ax_b, (2, 2.5), r"$c_t = \sum_j \alpha_{tj} h_j$", COLORS["accent"], 0.45)
# The decoder state enters the scores, and through them every weight alpha_tj (not the sum):
# its arrow ends at a dashed frame around the row of weights.
ax_b.add_patch(plt.Rectangle((-0.55, 1.3), 5.1, 0.3, fill=False, ls="--", lw=1.2,
                             ec=COLORS["query"], zorder=1))
draw_node(ax_b, (5.3, 2.5), "$s_{t-1}$", COLORS["query"])
ax_b.annotate("", xy=(4.55, 1.6), xytext=(5.3, 2.5), zorder=2, arrowprops=dict(
    arrowstyle="-|>", color=COLORS["query"], lw=1.5, shrinkA=14, shrinkB=0))
ax_b.text(3.95, 2.5, "query: decoder state,\nscores each $h_j$", ha="center", va="center",
          fontsize=10, color=COLORS["query"])
ax_b.text(5.3, 0.75, "keys: encoder\nstates $h_j$ (also\nthe values)", ha="center", va="center",
          fontsize=10, color=COLORS["key"])
ax_b.set_xlim(-0.6, 6.2)
ax_b.set_ylim(-0.5, 2.9)
ax_b.set_title("(b) Bahdanau et al., 2014: a new weighted average $c_t$ per output step")
ax_b.set_axis_off()
fig.tight_layout()
save_figure(fig, "01_bottleneck")
plt.show()

# %% [markdown]
# The counting argument behind (a) is easy to make concrete. Take the simplest encoder, a
# linear map $W \in \mathbb{R}^{d \times Tm}$ from $T$ tokens of $m$ numbers each to a summary of
# $d$ numbers. When $Tm > d$ it has a null space, so two *different* inputs get the *same*
# summary and no decoder, however clever, can tell them apart:

# %%
T_src, m, d = 8, 4, 16                     # 32 input numbers into a 16-number summary
g = torch.Generator().manual_seed(0)
W_enc = torch.randn(d, T_src * m, generator=g, dtype=torch.float64)
sentence_1 = torch.randn(T_src * m, generator=g, dtype=torch.float64)
# The last right-singular vectors of W span its null space (rank <= d < T_src * m).
null_direction = torch.linalg.svd(W_enc).Vh[-1]        # (T_src * m,)
sentence_2 = sentence_1 + 3.0 * null_direction

# %% [markdown]
# **Check:** the inputs differ by 3 (by construction); their summaries differ by float64 rounding
# only (the cell asserts a distance below $10^{-10}$; it prints as 0.0 at four decimals). And
# the blind spot is not one unlucky direction: $W$ has rank 16, so its null space is a
# 16-dimensional subspace of the 32-dimensional input space, and adding any vector of that
# subspace to an input leaves no trace in the summary. (That a random $16 \times 32$ matrix has
# rank 16 is a demonstration, not a test: it does with probability 1.)

# %%
torch.testing.assert_close(W_enc @ sentence_1, W_enc @ sentence_2)
assert (W_enc @ sentence_1 - W_enc @ sentence_2).norm() < 1e-10  # rounding only, not 3 * ...
rank = torch.linalg.matrix_rank(W_enc).item()
assert rank == d       # a demonstration: full rank, and still a (T_src * m - d)-dim null space
print("input distance:  ", round((sentence_1 - sentence_2).norm().item(), 4))
print("summary distance:", round((W_enc @ sentence_1 - W_enc @ sentence_2).norm().item(), 4))
print(f"rank of W: {rank}; dimension of its null space (changes the summary cannot see): "
      f"{T_src * m - rank} of {T_src * m}")


# %% [markdown]
# A recurrent encoder is not linear, but the point stands: $d$ numbers of finite precision hold
# a fixed amount of information, and a long enough input exceeds it. Attention keeps the $T$
# encoder states themselves, so the memory grows with $T$.
#
# **Takeaway: a fixed-length summary must forget once the input outgrows it; attention keeps
# every encoder state and re-reads them at each step.**
#
# ## 2. Attention as a weighted average
#
# Strip away the recurrent networks and what remains is one operation. There is a **query**
# $q$ (what we are looking for), and $T$ pairs of a **key** $k_j$ (what item $j$ is about) and a
# **value** $v_j$ (what item $j$ carries). Attention scores each key against the query, turns
# the scores into weights with a softmax, and returns the weighted average of the values:
#
# $$z_j = \operatorname{score}(q, k_j), \qquad
#   \alpha = \operatorname{softmax}(z), \qquad
#   \operatorname{attention}(q, K, V) = \sum_{j=1}^{T} \alpha_j v_j .$$
#
# The weights are positive and sum to one, so the output is a *convex combination* of the
# values: it always lies inside their convex hull, pulled towards the values whose keys match
# the query best. Different papers chose different scores:
#
# | score$(q, k)$ | name | paper |
# |---|---|---|
# | $w^\top \tanh(W_q q + W_k k)$ | additive | Bahdanau et al., 2014 |
# | $q^\top k$ | dot product | Luong, Pham and Manning, 2015 |
# | $q^\top k / \sqrt{d_k}$ | scaled dot product | Vaswani et al., 2017 |
#
# The Transformer uses the last one. With the keys stacked as rows of $K \in \mathbb{R}^{T\times
# d_k}$ and the values as rows of $V \in \mathbb{R}^{T \times d_v}$, for one query
# $q \in \mathbb{R}^{d_k}$:
#
# $$\operatorname{attention}(q, K, V) =
#   \operatorname{softmax}\!\left(\frac{K q}{\sqrt{d_k}}\right)^{\!\top} V \in \mathbb{R}^{d_v}.$$
#
# Section 4 explains the $\sqrt{d_k}$. Here is the whole thing for a single query. It is a
# teaching version: notebook 02 writes the batched one that the package exports.

# %%
def single_query_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor):
    """Scaled dot-product attention of one query: (d_k,), (T, d_k), (T, d_v) -> (d_v,), (T,)."""
    d_k = q.shape[-1]
    scores = K @ q / math.sqrt(d_k)         # (T, d_k) @ (d_k,) -> (T,)
    weights = torch.softmax(scores, dim=0)  # (T,): positive, sums to 1
    context = weights @ V                   # (T,) @ (T, d_v) -> (d_v,)
    return context, weights


# %% [markdown]
# A small example we can do by hand. With $d_k = 4$ the scale is $\sqrt{4} = 2$; the query
# $q = (2, 0, 2, 0)$ and three keys give the dot products $4, 0, 2$ and so the scores
# $z = (2, 0, 1)$ (here $e$ is only Euler's number):
#
# $$\alpha = \frac{(e^2, e^0, e^1)}{e^2 + e^0 + e^1} \approx (0.6652,\ 0.0900,\ 0.2447).$$
#
# With values $v_1 = (1, 0)$, $v_2 = (0, 1)$ and $v_3 = (1, 1)$ the output is
# $\alpha_1 v_1 + \alpha_2 v_2 + \alpha_3 v_3 = (\alpha_1 + \alpha_3,\ \alpha_2 + \alpha_3)
# \approx (0.9100, 0.3348)$.

# %%
q = torch.tensor([2.0, 0.0, 2.0, 0.0], device=device)       # (d_k,) = (4,)
K = torch.tensor([[1.0, 0.0, 1.0, 0.0],
                  [0.0, 1.0, 0.0, 1.0],
                  [1.0, 0.0, 0.0, 0.0]], device=device)     # (T, d_k) = (3, 4)
V = torch.tensor([[1.0, 0.0],
                  [0.0, 1.0],
                  [1.0, 1.0]], device=device)                # (T, d_v) = (3, 2)

context, weights = single_query_attention(q, K, V)
print("weights:", weights.cpu().round(decimals=4))
print("context:", context.cpu().round(decimals=4))

# %% [markdown]
# **Check** against the hand computation, and against PyTorch's own
# `F.scaled_dot_product_attention`. The built-in works on batches of query sequences, so the
# single query becomes a batch of one sequence of length one, shape `(1, 1, d_k)`.

# %%
exps = [math.exp(2), math.exp(0), math.exp(1)]
by_hand = torch.tensor([x / sum(exps) for x in exps], device=device)
torch.testing.assert_close(weights, by_hand)
torch.testing.assert_close(context, torch.stack([by_hand[0] + by_hand[2], by_hand[1] + by_hand[2]]))

# PyTorch's fused kernels add up in another order; on a GPU that can differ by about 1e-5.
tol = {} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}
builtin = F.scaled_dot_product_attention(q[None, None], K[None], V[None])  # (1, 1, d_v)
torch.testing.assert_close(context, builtin[0, 0], **tol)

# The same on random data: 9 keys, d_k = 16, d_v = 5.
gen = torch.Generator().manual_seed(1)  # each cell that draws makes its own generator
q_r = torch.randn(16, generator=gen).to(device)             # (d_k,)
K_r = torch.randn(9, 16, generator=gen).to(device)          # (T, d_k)
V_r = torch.randn(9, 5, generator=gen).to(device)           # (T, d_v)
context_r, weights_r = single_query_attention(q_r, K_r, V_r)
builtin_r = F.scaled_dot_product_attention(q_r[None, None], K_r[None], V_r[None])
torch.testing.assert_close(context_r, builtin_r[0, 0], **tol)
assert context_r.shape == (5,) and weights_r.shape == (9,)

# %% [markdown]
# **Check** the properties of a weighted average: the weights are positive and sum to one, the
# output lies between the smallest and largest value in every coordinate, and shuffling the
# key–value pairs (together) changes nothing, since a sum has no order. These hold for *any*
# softmax-weighted average, whatever the scores (a wrong sign or scale in the scores would pass
# them too), so they check the averaging, not the scoring; the parity checks above test the
# scores. The box is a weaker statement than section 2's convex hull, which lies inside it: the
# box is simple to assert, and the figure below draws the hull.

# %%
assert (weights_r > 0).all()
torch.testing.assert_close(weights_r.sum(), torch.tensor(1.0, device=device))
assert (context_r >= V_r.min(dim=0).values).all() and (context_r <= V_r.max(dim=0).values).all()

perm = torch.randperm(9, generator=torch.Generator().manual_seed(2)).to(device)
context_p, weights_p = single_query_attention(q_r, K_r[perm], V_r[perm])
torch.testing.assert_close(context_p, context_r)
torch.testing.assert_close(weights_p, weights_r[perm])

# %% [markdown]
# A picture in two dimensions ($d_k = d_v = 2$). Left: the query and five keys; each key is
# labelled with its weight, and the keys with the largest dot product with the query win (a
# dot product grows with a key's length as well as with its alignment). Right: the five
# values, their convex hull, and the output, the weighted average, inside it.

# %%
q_2d = torch.tensor([1.6, 1.2])                                   # (d_k,) = (2,)
K_2d = torch.tensor([[2.0, 1.0], [1.0, 2.0], [-1.5, 1.0],
                     [-1.0, -1.5], [1.5, -1.5]])                  # (T, d_k) = (5, 2)
V_2d = torch.tensor([[3.0, 1.0], [1.0, 3.0], [-2.0, 2.0],
                     [-2.0, -2.0], [2.0, -2.5]])                  # (T, d_v) = (5, 2)
out_2d, w_2d = single_query_attention(q_2d, K_2d, V_2d)
print("weights:", [round(w, 3) for w in w_2d.tolist()],
      " output:", [round(o, 3) for o in out_2d.tolist()])

# %% jupyter={"source_hidden": true}
fig, (ax_k, ax_v) = plt.subplots(1, 2, figsize=(11, 5.6))
# The arrow is drawn above the keys' markers (zorder), its label below the shaft.
ax_k.annotate("", xy=q_2d.tolist(), xytext=(0, 0), zorder=4,
              arrowprops=dict(arrowstyle="-|>", color=COLORS["query"], lw=2.5, shrinkA=0, shrinkB=0))
ax_k.text(0.9, -0.05, "query $q$", color=COLORS["query"], fontsize=11, rotation=37,
          rotation_mode="anchor", ha="left", va="top", zorder=4)
ax_k.scatter(K_2d[:, 0], K_2d[:, 1], s=3000 * w_2d + 30, color=COLORS["key"], alpha=0.7,
             label="keys $k_j$ (area $30 + 3000\\,\\alpha_j$ pt²)")
for j, (x, y) in enumerate(K_2d.tolist()):
    # Offset the label by roughly the marker's radius, which grows like sqrt(weight).
    ax_k.text(x + 0.25 + 0.6 * w_2d[j].sqrt().item(), y, rf"$\alpha_{j + 1}={w_2d[j]:.2f}$",
              fontsize=10, va="center")
ax_k.set_title(r"Weights $\alpha_j$: softmax of how well each key matches $q$")
ax_k.set_xlabel("feature 1")
ax_k.set_ylabel("feature 2")

hull = V_2d.tolist() + [V_2d[0].tolist()]  # the five values are in convex position
ax_v.fill(*zip(*hull, strict=True), color=COLORS["value"], alpha=0.12, label="convex hull")
ax_v.scatter(V_2d[:, 0], V_2d[:, 1], s=3000 * w_2d + 30, color=COLORS["value"], alpha=0.7,
             label="values $v_j$ (area $30 + 3000\\,\\alpha_j$ pt²)")
ax_v.scatter(*out_2d.tolist(), marker="*", s=350, color=COLORS["accent"], zorder=3,
             label=r"output $\sum_j \alpha_j v_j$")
for j, (x, y) in enumerate(V_2d.tolist()):  # value j belongs to key j
    ax_v.text(x + 0.25 + 0.6 * w_2d[j].sqrt().item(), y, f"$v_{j + 1}$", fontsize=10, va="center")
ax_v.set_title("Output: the weighted average of the values")
ax_v.set_xlabel("feature 1")
ax_v.set_ylabel("feature 2")
for ax in (ax_k, ax_v):
    ax.set_xlim(-3.2, 4.0)
    ax.set_ylim(-3.2, 3.8)
    ax.set_aspect("equal")
    ax.grid(alpha=0.3)
    # Below the axes, so that it hides no point.
    legend = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=9)
    for handle in legend.legend_handles:  # one marker size in the legend, not the first point's
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([80])
fig.tight_layout()
plt.show()


# %% [markdown]
# **Takeaway: attention is a weighted average of values, with weights from a softmax over
# query–key scores; with one query it is three lines of code and matches PyTorch's built-in.**
#
# ## 3. The softmax
#
# The softmax turns any real vector $z \in \mathbb{R}^T$ (the *logits*) into a probability
# vector:
#
# $$s_i = \operatorname{softmax}(z)_i = \frac{e^{z_i}}{\sum_{j=1}^{T} e^{z_j}} .$$
#
# In attention, $z$ are the scores and $s$ the weights that section 2 called $\alpha$: $s = \alpha$.
# This section writes $s$, for the softmax on its own.
#
# Every $s_i$ is positive and they sum to one. Adding the same constant $c$ to every logit
# changes nothing, since $e^{z_i + c} = e^c e^{z_i}$ and $e^c$ cancels. Scaling the logits does
# change things: larger logits give a peakier distribution. That is the whole story of section 4.
#
# ### Numerical stability
#
# Written literally, the formula breaks in floating point. In float32, $e^{89}$ is already
# infinite, and $\infty / \infty$ is NaN; at the other end, $e^{-104}$ is already 0, so for very
# negative logits every term underflows to 0 and the softmax is $0/0$, NaN again. Shift-invariance
# is the fix: subtract the largest
# logit first. Then every exponent is $\le 0$, the largest term is exactly $e^0 = 1$, and the
# sum lies between $1$ and $T$: no overflow, and no division by zero.

# %%
def softmax_naive(z: torch.Tensor) -> torch.Tensor:
    """The softmax over the last dimension, exactly as the formula reads (unsafe)."""
    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)


def softmax(z: torch.Tensor) -> torch.Tensor:
    """The softmax over the last dimension, with the max subtracted so exp() cannot overflow."""
    e = (z - z.amax(dim=-1, keepdim=True)).exp()  # (..., T), largest entry exactly 1
    return e / e.sum(dim=-1, keepdim=True)


# %% [markdown]
# **Check:** on ordinary logits all three agree; on logits of size 1000 the naive formula returns
# NaN (the first row overflows, the second underflows), while ours still matches `torch.softmax`.
# And ours is what `single_query_attention` computes with `torch.softmax`: plugged into it,
# the weights come out the same.

# %%
gen = torch.Generator().manual_seed(3)
z_small = torch.randn(4, 7, generator=gen)                         # (batch, T)
torch.testing.assert_close(softmax(z_small), torch.softmax(z_small, dim=-1))
torch.testing.assert_close(softmax_naive(z_small), torch.softmax(z_small, dim=-1))

z_large = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]])
print("naive:", softmax_naive(z_large))
print("ours: ", softmax(z_large).round(decimals=4))
assert softmax_naive(z_large).isnan().all()
torch.testing.assert_close(softmax(z_large), torch.softmax(z_large, dim=-1))
# Shift invariance: both rows are the logits (2, 1, 0) shifted, reversed in the first.
torch.testing.assert_close(softmax(z_large)[0], softmax(torch.tensor([2.0, 1.0, 0.0])).flip(0))
# Section 2's weights, from our softmax: the scores K q / sqrt(16) of the random example.
torch.testing.assert_close(softmax(K_r @ q_r / math.sqrt(16)), weights_r, **tol)


# %% [markdown]
# ### The Jacobian of the softmax
#
# To see how gradients pass through the softmax we need $\partial s_i / \partial z_j$. Write
# $\Sigma = \sum_k e^{z_k}$, so $s_i = e^{z_i} / \Sigma$ and $\partial \Sigma / \partial z_j =
# e^{z_j}$. The quotient rule gives
#
# $$\frac{\partial s_i}{\partial z_j}
#   = \frac{\delta_{ij}\, e^{z_i}\, \Sigma - e^{z_i}\, e^{z_j}}{\Sigma^2}
#   = \frac{e^{z_i}}{\Sigma}\left(\delta_{ij} - \frac{e^{z_j}}{\Sigma}\right)
#   = s_i\,(\delta_{ij} - s_j),$$
#
# where $\delta_{ij}$ is 1 when $i = j$ and 0 otherwise. As a matrix,
#
# $$J = \frac{\partial s}{\partial z} = \operatorname{diag}(s) - s\, s^\top .$$
#
# Four facts can be read off. $J$ is symmetric. Each row sums to zero, $J\mathbf{1} = 0$,
# because shifting all logits together changes nothing. $J$ is positive semi-definite: for any
# vector $v$,
#
# $$v^\top J v = \sum_i s_i v_i^2 - \Big(\sum_i s_i v_i\Big)^2 \ge 0,$$
#
# since the right-hand side is the variance of the numbers $v_i$ when $i$ is drawn with
# probabilities $s_i$. And every entry carries a factor $s_i$: when the softmax is
# **saturated**, one $s_i \approx 1$ and the rest $\approx 0$, so $s_i(\delta_{ij} - s_j)
# \approx 0$ for *all* $i, j$ (for the winner's own entry, because $1 - s_i \approx 0$), and no
# gradient gets through.

# %%
def softmax_jacobian(z: torch.Tensor) -> torch.Tensor:
    """The softmax's Jacobian over the last dim: (..., T) -> (..., T, T), J[i, j] = ds_i/dz_j."""
    s = softmax(z)                                          # (..., T)
    # diag(s) - s s^T, batched: (..., T, T) - (..., T, 1) * (..., 1, T)
    return torch.diag_embed(s) - s.unsqueeze(-1) * s.unsqueeze(-2)


# %% [markdown]
# **Check** against autograd, which knows nothing of our derivation:
# `torch.autograd.functional.jacobian` builds the Jacobian of `torch.softmax` one row at a time
# from PyTorch's own backward pass. We use float64 so the comparison is tight.

# %%
gen = torch.Generator().manual_seed(84)
z = torch.randn(6, generator=gen, dtype=torch.float64)               # (T,)
J_ours = softmax_jacobian(z)                                          # (T, T)
J_autograd = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, dim=-1), z)
torch.testing.assert_close(J_ours, J_autograd)

# Batched: a (3, 6) batch of logits gives a (3, 6, 6) batch of Jacobians.
z_batch = torch.randn(3, 6, generator=gen, dtype=torch.float64)
J_batch = softmax_jacobian(z_batch)
for b in range(3):
    J_b = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, dim=-1), z_batch[b])
    torch.testing.assert_close(J_batch[b], J_b)

# Three of the facts, on autograd's Jacobian: symmetric, rows sum to zero, positive
# semi-definite. (On J_ours they would test only our algebra: diag(s) - s s^T is symmetric for
# any vector s, right or wrong.)
torch.testing.assert_close(J_autograd, J_autograd.T)
torch.testing.assert_close(J_autograd.sum(dim=-1), torch.zeros(6, dtype=torch.float64))
assert torch.linalg.eigvalsh(J_autograd).min() > -1e-12
print(J_ours.round(decimals=4))


# %% [markdown]
# In backpropagation we never build $J$: we need the product of an upstream gradient
# $g = \partial L / \partial s$ with it. Because $J$ is symmetric,
#
# $$\frac{\partial L}{\partial z} = J^\top g = s \odot g - s\,(s^\top g) = s \odot \bigl(g - \langle s, g\rangle\bigr),$$
#
# which costs $O(T)$ instead of $O(T^2)$. **Check** it against autograd's backward pass:

# %%
def softmax_backward(s: torch.Tensor, grad_s: torch.Tensor) -> torch.Tensor:
    """dL/dz from the softmax output s and dL/ds, both (..., T), without building J."""
    return s * (grad_s - (s * grad_s).sum(dim=-1, keepdim=True))


z_leaf = z_batch.clone().requires_grad_()
upstream = torch.randn(3, 6, generator=torch.Generator().manual_seed(5),
                       dtype=torch.float64)                          # dL/ds, (batch, T)
torch.softmax(z_leaf, dim=-1).backward(upstream)
torch.testing.assert_close(softmax_backward(softmax(z_batch), upstream), z_leaf.grad)
torch.testing.assert_close(softmax_backward(softmax(z_batch), upstream),
                           (J_batch.mT @ upstream.unsqueeze(-1)).squeeze(-1))

# %% [markdown]
# How much gradient is left when the logits grow? In one sentence: multiply the logits by a
# large factor and the softmax becomes nearly one-hot, and then its Jacobian is nearly zero,
# unless the two largest logits nearly tie. The rest of this section makes that precise.
#
# Take the factor $32$; any large factor would do. (This one returns in section 4: at
# $d_k = 1024$, the largest width measured there, scores without the $1/\sqrt{d_k}$ scale are
# $\sqrt{1024} = 32$ times those with it.) Every gap between two logits grows 32-fold. If the
# largest logit leads the runner-up by $\Delta$, each other weight is at most $e^{-32\Delta}$
# times the largest, so
#
# $$1 - \max_i s_i \;\le\; (T - 1)\, e^{-32\Delta}.$$
#
# The Jacobian shrinks with it. Its entries add up, in absolute value, to
# $\sum_i s_i(1 - s_i) + \sum_{i \ne j} s_i s_j = 2\bigl(1 - \sum_i s_i^2\bigr)$, which is at
# most $4\,(1 - \max_i s_i)$, and the Frobenius norm is no larger than that sum:
#
# $$\|J\|_F \;\le\; 4\,(1 - \max_i s_i).$$
#
# So sharpening gives a near one-hot softmax and a near-zero Jacobian *unless the two largest
# logits nearly tie*: with $T = 6$, a lead of $\Delta > 0.2$ already guarantees
# $\max_i s_i > 1 - 5e^{-6.4} > 0.99$. Our six logits:

# %%
sharpen = 32                                   # sqrt(1024): raw over scaled scores at d_k = 1024
J_sharp = softmax_jacobian(sharpen * z)        # (T, T)
s_sharp = softmax(sharpen * z)                 # (T,)
top_two = z.topk(2).values
delta = (top_two[0] - top_two[1]).item()       # the lead of the largest logit
norm_z, norm_sharp = torch.linalg.matrix_norm(J_ours).item(), torch.linalg.matrix_norm(J_sharp).item()
print(f"lead of the largest logit: Delta = {delta:.3f}; bound on 1 - max s_i at {sharpen}z: "
      f"{5 * math.exp(-sharpen * delta):.4f}")
print(f"logits z:   max s_i = {softmax(z).max().item():.4f}, ||J||_F = {norm_z:.4f}")
print(f"logits {sharpen}z: max s_i = {s_sharp.max().item():.4f}, ||J||_F = {norm_sharp:.4f}")

# %% [markdown]
# **Check** both bounds on these logits, and what is left of $J$ at $32z$. (The bounds are
# theorems, so they can fail only if `softmax` or `softmax_jacobian` is wrong; the appendix
# checks them on 100,000 random draws, near-ties included.) The last lines pick the entries
# outside the $2 \times 2$ block of the two largest logits with a boolean mask: indexing with a
# column of two row numbers and a row of two column numbers,
# `rest[top_two_idx.unsqueeze(-1), top_two_idx]` (shapes $(2, 1)$ and $(2,)$, both holding the
# positions of the two largest logits), addresses the four entries where those rows and
# columns cross.

# %%
assert 1 - s_sharp.max() <= 5 * math.exp(-sharpen * delta)
assert norm_sharp <= 4 * (1 - s_sharp.max())
# The bounds only get looser if J is too small; this identity (the sum above) would catch it.
torch.testing.assert_close(J_sharp.abs().sum(), 2 * (1 - s_sharp.pow(2).sum()))
assert delta <= 0.2 or s_sharp.max() > 0.99   # the guarantee, whatever these six logits are
# What is left at 32z: outside the 2 x 2 block of the two largest logits, every entry has a
# factor s_i or s_j of a smaller logit, so it is at most the third-largest weight.
top_two_idx = z.topk(2).indices
rest = torch.ones(6, 6, dtype=torch.bool)
rest[top_two_idx.unsqueeze(-1), top_two_idx] = False   # (2, 1) rows x (2,) cols: the 2 x 2 block
third_weight = s_sharp.sort(descending=True).values[2]
assert (J_sharp[rest].abs() <= third_weight).all()
print(f"J at {sharpen}z: largest entry in the block of the top two logits "
      f"{J_sharp[~rest].abs().max():.1e}, elsewhere {J_sharp[rest].abs().max():.1e} "
      f"(third-largest weight {third_weight:.1e})")

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.4))
titles = ("logits $z$", f"logits ${sharpen}z$")
for ax, J, s, title in zip(axes, (J_ours, J_sharp), (softmax(z), s_sharp), titles, strict=True):
    limit = J.abs().max().item()  # each panel on its own scale, centred on zero
    power = math.floor(math.log10(limit)) if limit < 0.01 else 0  # -4 on the right
    unit = 10.0**power
    im = ax.imshow(J / unit, cmap="RdBu_r", vmin=-limit / unit, vmax=limit / unit)
    ax.set_title(f"Jacobian for {title}\nmax $s_i$ = {s.max().item():.4f}, "
                 f"$\\|J\\|_F$ = {torch.linalg.matrix_norm(J).item():.4f}")
    ax.set_xlabel("$j$ (logit $z_j$)")
    ax.set_ylabel("$i$ (weight $s_i$)")
    ax.set_xticks(range(6), range(1, 7))
    ax.set_yticks(range(6), range(1, 7))
    fig.colorbar(im, ax=ax, label=r"$\partial s_i / \partial z_j$"
                 + (rf"  (in units of $10^{{{power}}}$)" if power else ""))
axes[1].text(0.5, -0.27, f"colour scale {J_ours.abs().max() / J_sharp.abs().max():.0f} times "
             "finer than on the left", transform=axes[1].transAxes, ha="center", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# On a colour scale of its own, the right panel shows what is left of the Jacobian at $32z$: a
# $2 \times 2$ block on the largest logit and the runner-up (here logits 2 and 4), and nothing
# else visible. Every other entry has a factor $s_i$ or $s_j$ of a smaller logit, so it is at
# most the third-largest weight (printed above; here more than seven orders of magnitude below
# the block). The little gradient that still passes only moves weight between the two that
# nearly tie.
#
# **Takeaway: the softmax's Jacobian is $\operatorname{diag}(s) - ss^\top$; it vanishes as the
# softmax approaches one-hot, so a saturated softmax passes almost no gradient.**
#
# ## 4. Softmax saturation, and why we divide by $\sqrt{d_k}$
#
# Why do scores get large? Vaswani et al. (2017, footnote 4) give the argument: if the
# components of $q$ and $k$ are independent with mean 0 and variance 1, then $q \cdot k =
# \sum_{i=1}^{d_k} q_i k_i$ has mean 0 and **variance $d_k$** (exercise 1 derives it). Its
# typical size is $\sqrt{d_k}$. With $d_k = 64$, the per-head width of the original Transformer,
# raw scores spread over a range of about $\pm 16$ (two standard deviations), and the softmax of
# such logits is nearly one-hot. Dividing by $\sqrt{d_k}$ brings the variance back to 1 for
# every $d_k$.
#
# We measure three things for $d_k = 1, 2, 4, \dots, 1024$, each over 1,000 random queries
# with $T = 16$ keys apiece, all with independent unit-variance components:
#
# - **(a)** the variance of the scores $q \cdot k$, raw and divided by $\sqrt{d_k}$;
# - **(b)** the largest softmax weight $\max_j \alpha_j$ (for uniform weights it would be $1/T$);
# - **(c)** the size of the gradient through the softmax, the Frobenius norm $\|J\|_F$ of its
#   Jacobian at the logits it actually receives. For an upstream gradient $g$ with independent,
#   zero-mean, unit-variance entries, $\mathbb{E}\,\|J^\top g\|^2 = \|J\|_F^2$, so $\|J\|_F$ is the typical
#   size of what passes back (checked below).
#
# This is a measurement of random numbers rather than a model, so it runs on the CPU in
# float64, from the random draws to the Jacobians: in float32 many saturated weights round to
# exactly 1, which distorts (c). (The appendix at the end, *Going deeper*, counts how often.)

# %%
D_K_VALUES = [2**p for p in range(11)]    # 1, 2, 4, ..., 1024
NUM_QUERIES, NUM_KEYS = 1000, 16


def raw_scores(d_k: int) -> torch.Tensor:
    """Unscaled scores q . k of 1,000 random queries against 16 random keys each, in float64."""
    g = torch.Generator().manual_seed(d_k)  # one stream per d_k: results do not depend on order
    q = torch.randn(NUM_QUERIES, 1, d_k, generator=g, dtype=torch.float64)          # (N, 1, d_k)
    K = torch.randn(NUM_QUERIES, NUM_KEYS, d_k, generator=g, dtype=torch.float64)   # (N, T, d_k)
    return (q @ K.mT).squeeze(1)   # (N, 1, d_k) @ (N, d_k, T) -> (N, 1, T) -> (N, T)


def saturation_stats(d_k: int) -> dict:
    """Scores, max weights and Jacobian norms for random unit-variance q, k of width d_k."""
    raw = raw_scores(d_k)                                             # (N, T), float64
    stats = {"var_raw": raw.var().item(), "var_scaled": (raw / math.sqrt(d_k)).var().item()}
    for name, logits in (("raw", raw), ("scaled", raw / math.sqrt(d_k))):
        stats[f"max_weight_{name}"] = softmax(logits).amax(dim=-1)            # (N,)
        stats[f"jac_norm_{name}"] = torch.linalg.matrix_norm(softmax_jacobian(logits))  # (N,)
    return stats


results = {d_k: saturation_stats(d_k) for d_k in D_K_VALUES}

# %% [markdown]
# A table of the measurements, with medians over the 1,000 queries:

# %%
print(f"{'d_k':>5} | {'Var(q·k)':>8} {'Var(q·k/√d_k)':>13} | {'max α raw':>9} {'scaled':>7} |"
      f" {'‖J‖ raw':>9} {'scaled':>7}")
for d_k, r in results.items():
    print(f"{d_k:5d} | {r['var_raw']:8.2f} {r['var_scaled']:13.3f} |"
          f" {r['max_weight_raw'].median().item():9.3f} {r['max_weight_scaled'].median().item():7.3f} |"
          f" {r['jac_norm_raw'].median().item():9.2e} {r['jac_norm_scaled'].median().item():7.3f}")

# %% [markdown]
# **Check** the trends: the raw variance grows like $d_k$ (a log–log slope of 1, and within 10%
# of $d_k$ at $d_k = 1024$), the scaled one stays near 1 (within 0.25 at all 11 widths; the
# appendix narrows this to a few standard errors). At $d_k = 1024$ the raw softmax is nearly
# one-hot while the scaled one is far from it; the typical raw gradient is thousands of times
# smaller than the scaled one; and with the scale, the median largest weight and the median
# gradient stay in narrow bands for every $d_k$ (narrow, but not constant). The bands asserted
# are wider than this draw's values, so that they hold for other seeds too (the appendix says
# how wide the values ran over 200 seeds).

# %%
var_raw = np.array([results[d]["var_raw"] for d in D_K_VALUES])
var_scaled = np.array([results[d]["var_scaled"] for d in D_K_VALUES])
slope = np.polyfit(np.log(D_K_VALUES), np.log(var_raw), 1)[0]
assert 0.95 < slope < 1.05, slope
assert 0.9 < var_raw[-1] / 1024 < 1.1
assert np.all(np.abs(var_scaled - 1) < 0.25), var_scaled  # the appendix: a few standard errors

last = results[1024]
assert last["max_weight_raw"].median() > 0.9          # nearly one-hot
assert last["max_weight_scaled"].median() < 0.5       # still spread over several keys
assert last["max_weight_scaled"].median() < 0.5 * last["max_weight_raw"].median()

jac_ratio = last["jac_norm_scaled"].median() / last["jac_norm_raw"].median()
assert jac_ratio > 1e3, jac_ratio
# With the scale: bands over a 1024-fold range of d_k, wide enough for other seeds (appendix).
max_w_scaled = np.array([results[d]["max_weight_scaled"].median().item() for d in D_K_VALUES])
jac_scaled = np.array([results[d]["jac_norm_scaled"].median().item() for d in D_K_VALUES])
assert np.all((0.12 < max_w_scaled) & (max_w_scaled < 0.3))    # far from 1, and from 1/16
assert jac_scaled.max() / jac_scaled.min() < 1.2                # within 20% of each other
print(f"log-log slope of Var(q·k) against d_k: {slope:.3f}")
print(f"scaled variance, all d_k: {var_scaled.min():.3f} to {var_scaled.max():.3f}")
print(f"median ‖J‖_F at d_k = 1024, scaled / raw: {jac_ratio.item():.2e}")
print(f"scaled, all d_k: median max weight {max_w_scaled.min():.3f} to {max_w_scaled.max():.3f},"
      f" median ‖J‖_F {jac_scaled.min():.3f} to {jac_scaled.max():.3f}")

# %% [markdown]
# **Check** that $\|J\|_F$ measures the gradient that passes back: over many random upstream
# gradients $g$, the mean of $\|J^\top g\|^2$ matches $\|J\|_F^2$ (for eight logit vectors).
# This identity holds for any matrix $J$, so it is a demonstration of what (c) measures, not a
# test of the softmax; the exact test of $J$ is the autograd check of section 3.

# %%
gen = torch.Generator().manual_seed(6)
z_8 = torch.randn(8, NUM_KEYS, generator=gen, dtype=torch.float64)                  # (8, T)
J_8 = softmax_jacobian(z_8)                                                          # (8, T, T)
g_samples = torch.randn(20_000, 8, NUM_KEYS, generator=gen, dtype=torch.float64)    # (S, 8, T)
passed_back = softmax_backward(softmax(z_8), g_samples)          # J^T g for each sample, (S, 8, T)
mean_sq = passed_back.pow(2).sum(dim=-1).mean(dim=0)                                 # (8,)
torch.testing.assert_close(mean_sq, torch.linalg.matrix_norm(J_8) ** 2, rtol=0.05, atol=0.0)


# %% [markdown]
# The three measurements in one figure. Lines are medians over the 1,000 queries, the same
# numbers as in the table (`Tensor.median`, which for an even count takes the lower of the two
# middle values); the shaded bands span the middle half of them (25th to 75th percentile). Raw
# scores are drawn in brown, scaled ones in purple.

# %% jupyter={"source_hidden": true}
def median_and_quartiles(key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median, 25th and 75th percentile of a per-query statistic, one entry per d_k."""
    rows = torch.stack([results[d][key] for d in D_K_VALUES])          # (len(D_K_VALUES), N)
    q25, q75 = torch.quantile(rows, torch.tensor([0.25, 0.75], dtype=rows.dtype), dim=1)
    return rows.median(dim=1).values.numpy(), q25.numpy(), q75.numpy()  # the table's medians


RAW_COLOR, SCALED_COLOR = OTHER_COLORS[1], OTHER_COLORS[0]     # brown, purple
styles = {"raw": dict(color=RAW_COLOR, label=r"raw $q\cdot k$"),
          "scaled": dict(color=SCALED_COLOR, label=r"scaled $q\cdot k/\sqrt{d_k}$")}
fig, (ax_a, ax_b, ax_c) = plt.subplots(1, 3, figsize=(16, 5.4))

ax_a.loglog(D_K_VALUES, D_K_VALUES, "--", color="0.5", base=2, label="$y = d_k$")
ax_a.loglog(D_K_VALUES, np.ones(len(D_K_VALUES)), ":", color="0.5", base=2, label="$y = 1$")
ax_a.loglog(D_K_VALUES, var_raw, "o", ms=11, mfc="none", mew=2, base=2,
            **styles["raw"])  # hollow: at d_k = 1 the scaled square sits inside
ax_a.loglog(D_K_VALUES, var_scaled, "s", ms=6, base=2, **styles["scaled"])
ax_a.set_title("(a) Variance of the scores")
ax_a.set_ylabel("measured variance over 16,000 scores")

for name in ("raw", "scaled"):
    mid, lo, hi = median_and_quartiles(f"max_weight_{name}")
    ax_b.plot(D_K_VALUES, mid, "o-", **styles[name])
    ax_b.fill_between(D_K_VALUES, lo, hi, color=styles[name]["color"], alpha=0.2)
    mid, lo, hi = median_and_quartiles(f"jac_norm_{name}")
    ax_c.plot(D_K_VALUES, mid, "o-", **styles[name])
    ax_c.fill_between(D_K_VALUES, lo, hi, color=styles[name]["color"], alpha=0.2)
ax_b.axhline(1 / NUM_KEYS, ls=":", color="0.5", label=f"uniform, $1/T$ = 1/{NUM_KEYS}")
ax_b.axhline(1.0, ls="--", color="0.5", label="one-hot")
ax_b.set_xscale("log", base=2)
ax_b.set_ylim(0, 1.05)
ax_b.set_title(f"(b) Largest softmax weight ($T$ = {NUM_KEYS} keys)")
ax_b.set_ylabel(r"largest weight $\mathrm{max}_j\,\alpha_j$")
ax_c.set_xscale("log", base=2)
ax_c.set_yscale("log")
ax_c.set_ylim(top=2)  # room above the scaled line, which sits just below 10^0
ax_c.set_title("(c) Gradient through the softmax")
ax_c.set_ylabel(r"$\|J\|_F$ at the softmax's input (log scale)")
for ax in (ax_a, ax_b, ax_c):
    ax.set_xlabel("$d_k$ (width of queries and keys)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # hides no data
fig.suptitle(r"Softmax saturation: without the $1/\sqrt{d_k}$ scale the scores grow, "
             "the softmax turns one-hot and its gradient vanishes"
             f"\n(b, c: lines are medians over {NUM_QUERIES:,} queries, shaded bands their "
             "middle half, 25th to 75th percentile)", fontsize=12)
fig.tight_layout()
save_figure(fig, "softmax_saturation")
plt.show()

# %% [markdown]
# Reading the figure from left to right. (a) The raw variance sits on the line $y = d_k$; the
# scaled one stays near 1. (b) With raw scores the largest weight climbs towards 1 as $d_k$
# grows: the softmax picks one key and ignores the others. With the scale it stays between 0.16
# and 0.23, far from one-hot and far from uniform ($1/16 \approx 0.06$). (c) The consequence for
# learning: the typical gradient through a raw softmax falls by orders of magnitude, because
# every entry $s_i(\delta_{ij} - s_j)$ of $J$ has a factor that is nearly 0: $s_i$ or $s_j$ for a
# losing key, and $1 - s_i$ on the winner's own diagonal entry. Scaled, it stays between 0.27
# and 0.31 (the table): not exactly constant, but within 12% over a 1,024-fold range of $d_k$.
#
# Why not exactly constant, and why lowest at $d_k = 1$? The scale fixes the spread of the scores
# *on average over all queries*. Given $q$, one query's scaled scores $q \cdot k_j / \sqrt{d_k}$
# have the spread $\|q\| / \sqrt{d_k}$. At $d_k = 1$ that is $|q|$ for a single standard normal
# number $q$, whose mean is $\sqrt{2/\pi} \approx 0.80$ and whose median is 0.67: the typical
# query's scores are squeezed together, flatter logits give a smaller largest weight, and so
# the median largest weight is lowest there (0.161 in the table, against 0.20 to 0.23 from
# $d_k = 4$ on). One query's scores may also be spread out and the next one's squeezed. As $d_k$
# grows, $\|q\| / \sqrt{d_k}$ settles near 1 and every query gets about the same spread. The
# appendix measures both effects.

# %% [markdown]
# The bands in (c) are wide for raw scores: a query whose two best keys happen to score almost
# the same keeps a sizeable gradient, most queries get almost none. A network cannot rely on
# such lucky near-ties.
#
# Panel (c) is the gradient with respect to the logits; on the way back to $q$ the chain rule
# multiplies it by $\partial(q \cdot k)/\partial q = k$, a vector of length about $\sqrt{d_k}$,
# and, with the scale, by $1/\sqrt{d_k}$. For scaled scores the two factors cancel, and for raw
# scores the extra factor is about $\sqrt{1024} = 32$ (the length of $k$; not a strict bound,
# but a random $k$'s length stays close to $\sqrt{d_k}$), far too little to make up for the
# thousandfold drop measured above.
#
# **Takeaway: raw dot products have variance $d_k$, which drives the softmax into saturation
# and its gradient towards zero; dividing by $\sqrt{d_k}$ keeps the scores at unit variance and
# the gradient about the same size for every $d_k$.**
#
# ### Seeing it for one query
#
# The same effect for a single query and 16 keys. We draw one query and 16 keys of width 1024
# once, and use their first $d_k$ coordinates, so that moving $d_k$ adds dimensions to the same
# vectors rather than drawing new ones. (Another seed gives another picture; now and then two
# keys nearly tie, the lucky case behind the wide bands in panel (c).) A check first, then a
# static figure for three values of $d_k$.

# %%
g_demo = torch.Generator().manual_seed(5)
q_demo = torch.randn(max(D_K_VALUES), generator=g_demo)                   # (1024,)
K_demo = torch.randn(NUM_KEYS, max(D_K_VALUES), generator=g_demo)         # (T, 1024)


def demo_weights(d_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The demo query's weights over the 16 keys from their first d_k coordinates: raw, scaled."""
    raw = K_demo[:, :d_k] @ q_demo[:d_k]                 # (T, d_k) @ (d_k,) -> (T,)
    return softmax(raw), softmax(raw / math.sqrt(d_k))


# %% [markdown]
# **Check** the demo before drawing it: its scaled weights are PyTorch's softmax of the scaled
# scores, and at every width the raw weights top out at least as high as the scaled ones. That
# holds for any query: multiplying the logits by a factor $\beta \ge 1$ never lowers the largest
# weight, since $\frac{d}{d\beta} \log s_{\max} = z_{\max} - \sum_j s_j z_j \ge 0$. How *much*
# higher depends on the draw: one query is one draw, so the appendix checks the saturation on
# 1,000 queries.

# %%
for d_k in D_K_VALUES:
    w_raw_demo, w_scaled_demo = demo_weights(d_k)
    assert w_raw_demo.max() >= w_scaled_demo.max(), d_k  # fails if the two came back swapped
scores_1024 = K_demo @ q_demo / math.sqrt(1024)                          # (T,)
w_raw_1024, w_scaled_1024 = demo_weights(1024)
torch.testing.assert_close(w_scaled_1024, torch.softmax(scores_1024, dim=0))
print(f"the demo query at d_k = 1024: largest weight raw {w_raw_1024.max():.3f}, "
      f"scaled {w_scaled_1024.max():.3f}")


# %% jupyter={"source_hidden": true}
def plot_weights(ax, d_k: int) -> None:
    """Bar chart of the demo query's weights, raw against scaled, at width d_k."""
    w_raw, w_scaled = demo_weights(d_k)
    keys = np.arange(1, NUM_KEYS + 1)
    ax.bar(keys - 0.2, w_scaled, width=0.4, color=SCALED_COLOR, label=r"scaled, $/\sqrt{d_k}$")
    ax.bar(keys + 0.2, w_raw, width=0.4, color=RAW_COLOR, label="raw")
    ax.axhline(1 / NUM_KEYS, ls=":", color="0.5", label="uniform")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(keys)
    ax.set_xlabel("key $j$")
    ax.set_ylabel(r"attention weight $\alpha_j$")
    ax.set_title(f"$d_k$ = {d_k}: max weight raw {w_raw.max():.2f}, scaled {w_scaled.max():.2f}")
    ax.legend(fontsize=9, loc="upper left")


fig, axes = plt.subplots(1, 3, figsize=(16, 3.8), sharey=True)
for ax, d_k in zip(axes, (4, 64, 1024), strict=True):
    plot_weights(ax, d_k)
for ax in axes[1:]:
    ax.set_ylabel("")  # the panels share their y-axis and its label
fig.tight_layout()
plt.show()

# %% [markdown]
# And a slider for $d_k$, if you run the notebook yourself. It calls `plot_weights(ax, d_k)`, the
# function defined in the figure cell above (folded in JupyterLab and on the site: click it to
# show its code). It needs a live kernel, because each move redraws the figure in Python. Without one (on GitHub, or on the course's website) you
# see at most the slider and the figure stored for $d_k = 64$, and moving the slider changes
# nothing; the three panels above show the same query at three widths instead. The cell uses
# only what ipywidgets 7 (Colab's) and 8 both provide.

# %% tags=["nbval-ignore-output"]
import ipywidgets as widgets
from IPython.display import display


def draw(d_k: int) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.6))
    plot_weights(ax, d_k)
    plt.show()


slider = widgets.SelectionSlider(options=D_K_VALUES, value=64, description="d_k",
                                 continuous_update=False)
display(widgets.interactive(draw, d_k=slider))

# %% [markdown]
# ## Recap
#
# | concept | code | shape |
# |---|---|---|
# | query, keys, values | `q`, `K`, `V` | `(d_k,)`, `(T, d_k)`, `(T, d_v)` |
# | scores | `K @ q / math.sqrt(d_k)` | `(T,)` |
# | weights | `torch.softmax(scores, dim=0)`; our `softmax(scores)` gives the same (checked): subtract the max, exponentiate, normalise | `(T,)`, sum 1 |
# | context | `weights @ V` | `(d_v,)` |
# | built-in | `F.scaled_dot_product_attention(q[None, None], K[None], V[None])` | `(1, 1, d_v)` |
# | softmax Jacobian | `softmax_jacobian(z)` $= \operatorname{diag}(s) - ss^\top$ | `(..., T, T)` |
# | softmax backward | `softmax_backward(s, g)` $= s \odot (g - \langle s, g\rangle)$ | `(..., T)` |
# | why $\sqrt{d_k}$ | $\operatorname{Var}(q\cdot k) = d_k$; scaled scores have variance 1 | |
#
# Next: [02 · Self-attention](02_self_attention.ipynb) gives every position its own query and
# batches the whole computation into matrix products.
#
# ## Exercises
#
# 1. Show that if $q, k \in \mathbb{R}^{d_k}$ have independent components with mean 0 and
#    variance 1, then $q \cdot k$ has mean 0 and variance $d_k$. What is the variance when the
#    components of $q$ have variance $\sigma_q^2$ and those of $k$ variance $\sigma_k^2$? Check
#    both answers empirically.
# 2. The softmax with a **temperature** $\tau > 0$ is $\operatorname{softmax}(z / \tau)$. What
#    happens as $\tau \to 0$ and as $\tau \to \infty$? Which temperature does the $1/\sqrt{d_k}$
#    scale set? Check the limits in code.
# 3. Nothing forces values to have the width of keys. Run single-query attention with
#    $d_k = 8$ and $d_v = 3$. What is the output's shape, which width enters the scale, and does
#    PyTorch's built-in agree?
#
# ### Solutions
#
# **1.** The terms $q_i k_i$ are independent, and $\mathbb{E}[q_i k_i] = \mathbb{E}[q_i]\,
# \mathbb{E}[k_i] = 0$, so $\mathbb{E}[q \cdot k] = 0$. Variances of independent terms add, and
# $\operatorname{Var}(q_i k_i) = \mathbb{E}[q_i^2 k_i^2] - 0 = \mathbb{E}[q_i^2]\,
# \mathbb{E}[k_i^2] = 1 \cdot 1$. Hence $\operatorname{Var}(q\cdot k) = \sum_{i=1}^{d_k} 1 =
# d_k$. With variances $\sigma_q^2$ and $\sigma_k^2$ each term has variance
# $\sigma_q^2\sigma_k^2$, and the sum $d_k\,\sigma_q^2\sigma_k^2$. So $1/\sqrt{d_k}$ only
# normalises the scores when $q$ and $k$ have unit-variance components, which is one reason
# careful initialisation (notebook 03) and layer norm (notebook 06) matter.

# %%
g_ex = torch.Generator().manual_seed(1)
lines = []
for d_k, sigma_q, sigma_k in ((64, 1.0, 1.0), (64, 2.0, 1.0), (32, 1.5, 2.0)):
    # float64: the printed variances do not depend on the CPU's float32 kernels
    q_ex = sigma_q * torch.randn(100_000, d_k, generator=g_ex, dtype=torch.float64)  # (N, d_k)
    k_ex = sigma_k * torch.randn(100_000, d_k, generator=g_ex, dtype=torch.float64)  # (N, d_k)
    dots = (q_ex * k_ex).sum(dim=-1)                                # (N,)
    predicted = d_k * sigma_q**2 * sigma_k**2  # the wrong d_k σ_q σ_k: 128 and 96 in the last two
    assert abs(dots.mean().item()) < 0.05 * math.sqrt(predicted)
    assert abs(dots.var().item() / predicted - 1) < 0.03
    lines.append(f"d_k={d_k:3d} σ_q={sigma_q} σ_k={sigma_k}: measured {dots.var().item():6.1f},"
                 f" predicted {predicted:6.1f}")
print("\n".join(lines))

# %% [markdown]
# **2.** Dividing the logits by $\tau$ multiplies every gap $z_i - z_j$ by $1/\tau$. As
# $\tau \to 0$ the gaps blow up and the softmax tends to a one-hot vector on the largest logit
# (the argmax); as $\tau \to \infty$ the gaps shrink to 0 and the softmax tends to the uniform
# distribution $1/T$. The order of the weights never changes, only how peaked they are, and
# the entropy grows with $\tau$. Dividing raw scores by $\sqrt{d_k}$ is a softmax with
# temperature $\tau = \sqrt{d_k}$: the temperature that keeps the logits at unit variance.
# Notebook 12 uses temperature again, to sample from a language model.

# %%
z_t = torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64)
temperatures = [0.01, 0.1, 0.5, 1.0, 2.0, 10.0, 1e4]
probs = torch.stack([softmax(z_t / tau) for tau in temperatures])          # (len(tau), T)
entropy = -(probs * probs.log()).sum(dim=-1)                               # (len(tau),)

torch.testing.assert_close(probs[0], F.one_hot(z_t.argmax(), 4).double())  # tau -> 0
torch.testing.assert_close(probs[-1], torch.full((4,), 0.25, dtype=torch.float64),
                           atol=1e-3, rtol=0)                             # tau -> infinity
assert (entropy.diff() > 0).all()                                          # entropy grows
assert all(torch.equal(p.argsort(), z_t.argsort()) for p in probs[:-1])    # order is kept
print("\n".join(f"tau={tau:>7}: weights {p.numpy().round(3)}, entropy {h.item():.3f}"
                for tau, p, h in zip(temperatures, probs, entropy, strict=True)))

# %% [markdown]
# **3.** The weights come from $q$ and $K$ alone, so their shape is $(T,)$ whatever $d_v$ is;
# the output is a weighted average of rows of $V$ and has shape $(d_v,)$. The scale uses $d_k$:
# it corrects the size of $q \cdot k$, a sum of $d_k$ products, and the values take no part in
# it. PyTorch's built-in accepts $d_v \ne d_k$ and agrees:

# %%
g_v = torch.Generator().manual_seed(9)
q_v = torch.randn(8, generator=g_v).to(device)             # (d_k,) = (8,)
K_v = torch.randn(10, 8, generator=g_v).to(device)         # (T, d_k) = (10, 8)
V_v = torch.randn(10, 3, generator=g_v).to(device)         # (T, d_v) = (10, 3)
context_v, weights_v = single_query_attention(q_v, K_v, V_v)
assert context_v.shape == (3,) and weights_v.shape == (10,)
torch.testing.assert_close(context_v,
                           F.scaled_dot_product_attention(q_v[None, None], K_v[None], V_v[None])[0, 0],
                           **tol)
# A demonstration, not a test (single_query_attention computes the weights before it touches
# V, so this holds by construction): other values, even of another width, give the same weights.
_, weights_other_v = single_query_attention(q_v, K_v, torch.randn(10, 7, generator=g_v).to(device))
torch.testing.assert_close(weights_v, weights_other_v)
print(tuple(context_v.shape), tuple(weights_v.shape))

# %% [markdown]
# ## Appendix · Going deeper: the checks and statistics behind sections 3 and 4
#
# Optional reading. What it teaches beyond the main line: how to tell whether a measured number
# that differs from theory is chance or a bug (its standard error), and how to choose an
# assert's band so that it holds for other random draws, not only for the one stored here. The
# main line states each result and checks it on the example at hand; this appendix checks the
# same results on many random draws, and explains details behind
# section 4's bands: section 3's bounds on 100,000 random logit vectors; how far the scaled
# variance may stray from 1 by chance; why the measurement runs in float64; the saturation on
# 1,000 queries rather than the demo's one; and how the per-query spread of the scaled scores
# varies with the width, and why its mean sits a little below 1 at small widths. It also records
# how section 4's bands were chosen: they are wider than the stored run's values so that other
# seeds pass. Over 200 seeds the median largest scaled weight ran from 0.144 (at $d_k = 1$) to
# 0.234, and the median gradients' max / min reached 1.146, against the asserted bands 0.12 to
# 0.3 and 1.2.
#
# ### Section 3's bounds on random logits
#
# **Check** the two bounds of section 3 on 100,000 random draws of six logits, where some draws
# are near-ties: the bounds must hold for every draw, every draw with a lead above 0.2 must be
# near one-hot at $32z$, and the near-ties are the only exceptions. (The bounds are theorems:
# what could fail here is `softmax` or `softmax_jacobian`.)

# %%
draws = torch.randn(100_000, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
top_two_d = draws.topk(2, dim=-1).values                                  # (N, 2)
lead = top_two_d[:, 0] - top_two_d[:, 1]                                  # (N,)
s_max = softmax(sharpen * draws).amax(dim=-1)                             # (N,)
jac_norm = torch.linalg.matrix_norm(softmax_jacobian(sharpen * draws))    # (N,)
assert torch.all(1 - s_max <= 5 * torch.exp(-sharpen * lead) + 1e-12)
assert torch.all(jac_norm <= 4 * (1 - s_max) + 1e-12)
near_one_hot = s_max > 0.99
assert near_one_hot[lead > 0.2].all() and not near_one_hot.all()
print(f"random draws near one-hot at {sharpen}z: {near_one_hot.double().mean():.1%}; "
      f"draws with a lead > 0.2: {(lead > 0.2).double().mean():.1%}, every one of them near "
      f"one-hot; largest lead among the draws that are not: {lead[~near_one_hot].max():.3f}")

# %% [markdown]
# ### The standard error of the scaled variance
#
# Section 4 estimates the variance of the scaled scores from 1,000 queries times 16 keys, and the
# 16 scores of a query share its $q$, so they are not independent. Write $u = q \cdot k /
# \sqrt{d_k}$ for one scaled score. Given $q$, $u$ is normal with variance $\lVert q \rVert^2 /
# d_k$, so $\operatorname{Var}(u^2) = 2 + 6/d_k$, and two scores of one query have
# $\operatorname{Cov}(u_i^2, u_j^2) = 2/d_k$. The standard error of the estimate is therefore
# $\sqrt{(2 + 6/d_k + 15 \cdot 2/d_k) / 16{,}000}$: 0.049 at $d_k = 1$ (where a band of ±10%
# would be only two standard errors) and 0.011 at $d_k = 1024$. **Check:** the scaled variance
# lies within 4.5 standard errors of 1 at all 11 widths, a band that 1,000 other seeds all kept
# (see the comment in the code).

# %%
d_k_array = np.array(D_K_VALUES)
std_error = np.sqrt((2 + 6 / d_k_array + (NUM_KEYS - 1) * 2 / d_k_array) / (NUM_QUERIES * NUM_KEYS))
distance = np.abs(var_scaled - 1) / std_error  # in standard errors
# All 11 widths at once. Over 1,000 seeds (d_k + 1000 s for s = 0 ... 999) the largest of the 11
# distances stayed below 3.5 for 999 of them and reached 4.3 once (at d_k = 1024); a normal tail
# puts a distance above 4.5 at one of 11 widths about once in 13,000 seeds.
assert np.all(distance < 4.5), distance
print(f"scaled variance: at most {distance.max():.1f} standard errors from 1 (at d_k = "
      f"{D_K_VALUES[distance.argmax()]}; standard error {std_error[0]:.3f} at d_k = 1, "
      f"{std_error[-1]:.3f} at d_k = 1024)")

# %% [markdown]
# ### Why float64
#
# Float32 cannot resolve a weight closer to 1 than about $6 \times 10^{-8}$, and in the saturated
# regime many weights are that close: they round to exactly 1, the winner's entry
# $s_i(1 - s_i)$ of $J$ comes out as exactly 0 instead of a tiny positive number, and $\|J\|_F$
# is distorted. Float64 moves that limit down to about $10^{-16}$. Float64 still rounds the
# largest weight of some queries to 1 at $d_k = 1024$, but only for queries whose $\|J\|_F$ lies
# orders of magnitude below the band plotted in (c).
#
# **Check** why the measurement runs in float64: the same raw scores at $d_k = 1024$, pushed
# through the softmax and its Jacobian in float32, then the same count in float64. (The exact
# counts can differ by a few from one CPU to another, since the last bit of an `exp` does; the
# cell asserts only what holds everywhere.)

# %% tags=["nbval-ignore-output"]
raw_1024 = raw_scores(1024)                                                    # (N, T), float64
norm_64 = torch.linalg.matrix_norm(softmax_jacobian(raw_1024))                 # (N,)
norm_32 = torch.linalg.matrix_norm(softmax_jacobian(raw_1024.float())).double()  # (N,)
rounds_to_one = (softmax(raw_1024.float()).amax(dim=-1) == 1).sum().item()
off_by_10 = ((norm_32 - norm_64).abs() > 0.1 * norm_64).sum().item()
exactly_zero = (norm_32 == 0).sum().item()
print(f"float32, out of {NUM_QUERIES} queries: largest weight exactly 1: {rounds_to_one}; "
      f"‖J‖_F off by more than 10%: {off_by_10}; ‖J‖_F exactly 0: {exactly_zero}")
at_one_64 = softmax(raw_1024).amax(dim=-1) == 1                               # float64 too
worst_64 = norm_64[at_one_64].max().item() if at_one_64.any() else 0.0
q25_64 = norm_64.quantile(0.25).item()  # the lower edge of the raw band in (c) at d_k = 1024
print(f"float64: largest weight exactly 1: {at_one_64.sum().item()}, all with ‖J‖_F <= "
      f"{worst_64:.1e}; 25th percentile of ‖J‖_F: {q25_64:.1e}")

# %%
assert rounds_to_one > NUM_QUERIES // 5      # many weights within 6e-8 of 1
assert off_by_10 > NUM_QUERIES // 10         # the gradient's size is distorted for many queries
assert exactly_zero < NUM_QUERIES // 10      # but rarely all the way to 0: losers' tiny weights survive
# In float64 no query's ||J||_F is exactly 0 (float32 had some): a loser's weight would underflow
# only past a logit gap of about 745, and the raw scores' standard deviation is about 32. It
# fails only if softmax or softmax_jacobian loses the small weights.
assert (norm_64 > 0).all()
assert worst_64 < 1e-3 * q25_64  # float64's rounded queries are far below the plotted band

# %% [markdown]
# ### The saturation on 1,000 queries
#
# **Check:** one query is one draw, and a check on one draw holds by luck (for about one
# seed in four, even this demo's raw weights at $d_k = 1024$ would top out below 0.99). So the
# claim is checked on 1,000 fresh queries, each with its own 16 keys: at $d_k = 1024$ most raw
# weight vectors are nearly one-hot (the largest weight above 0.99 for about three queries in
# four) and almost no scaled one is (the largest weight below 0.5 for 98 or 99 in 100); and the
# argument above holds on average: at every width from 1 to 1024 the standard deviation of the
# scaled scores (over the 16 keys, averaged over the queries) stays between 0.7 and 1.1, while
# that of the raw scores grows with the width, to about $\sqrt{1024} = 32$ at $d_k = 1024$.
# The average sits a little below 1 at small widths; the last section below explains why.

# %%
g_many = torch.Generator().manual_seed(8)
q_many = torch.randn(1000, max(D_K_VALUES), generator=g_many)  # (N, 1024): N queries
K_many = torch.randn(1000, NUM_KEYS, max(D_K_VALUES), generator=g_many)  # (N, T, 1024)
raw_many = {d_k: torch.einsum("ntd,nd->nt", K_many[..., :d_k], q_many[:, :d_k])  # (N, T)
            for d_k in D_K_VALUES}
top_raw = softmax(raw_many[1024]).max(dim=-1).values  # (N,): each query's largest weight
top_scaled = softmax(raw_many[1024] / math.sqrt(1024)).max(dim=-1).values  # (N,)
share_raw, share_scaled = (top_raw > 0.99).float().mean(), (top_scaled < 0.5).float().mean()
assert share_raw > 0.6 and share_scaled > 0.9
raw_spread = {d_k: raw.std(dim=-1).mean().item() for d_k, raw in raw_many.items()}
scaled_spread = {d_k: spread / math.sqrt(d_k) for d_k, spread in raw_spread.items()}
assert all(0.7 < spread < 1.1 for spread in scaled_spread.values())
assert 28 < raw_spread[1024] < 36
print(f"d_k = 1024, 1,000 queries: largest raw weight > 0.99 for {share_raw:.0%}, "
      f"largest scaled weight < 0.5 for {share_scaled:.0%}")
print("mean std of the scaled scores, d_k = 1 .. 1024:",
      [round(spread, 1) for spread in scaled_spread.values()])
print(f"mean std of the raw scores at d_k = 1024: {raw_spread[1024]:.1f} (sqrt(1024) = 32)")

# %% [markdown]
# ### How much one query's spread varies
#
# Section 4 said that at $d_k = 1$ one query's scaled scores may be spread out and the next
# one's squeezed together, with a typical (median) spread near 0.67, and that as $d_k$ grows
# the spreads settle near 1. **Check:** the quartiles of the per-query spreads (the
# standard deviation of one query's 16 scaled scores) at the two ends.

# %%
spread, lines = {}, []
for d_k in (1, 1024):
    per_query = (raw_scores(d_k) / math.sqrt(d_k)).std(dim=-1)                       # (N,)
    spread[d_k] = torch.quantile(per_query, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    lines.append(f"d_k = {d_k:4d}: per-query spread of the scaled scores, 25th, 50th and 75th "
                 f"percentile: {spread[d_k][0]:.2f}, {spread[d_k][1]:.2f}, {spread[d_k][2]:.2f}")
iqr_ratio = ((spread[1][2] - spread[1][0]) / (spread[1024][2] - spread[1024][0])).item()
lines.append(f"the middle half is {iqr_ratio:.1f} times as wide at d_k = 1 as at d_k = 1024")
print("\n".join(lines))
assert iqr_ratio > 2  # 3.8 here; over 200 seeds at least 2.85
# The typical query: squeezed at d_k = 1 (medians over 60 seeds: 0.58 to 0.69; at 1024, 0.96 to 0.99).
assert spread[1][1] < 0.8 < 0.9 < spread[1024][1] < 1.05

# %% [markdown]
# ### Why the scaled scores' spread sits below 1 at small widths
#
# The check on 1,000 queries above printed the mean standard deviation of the scaled
# scores at each width: it sits a little below 1 at small widths, and the reason is the query.
# Given $q$,
# its 16 raw scores $q \cdot k_j$ are independent normal numbers with standard deviation
# $\|q\|$, at every width; a standard deviation measured on 16 samples is on average a fixed
# $0.983$ of the true one (about 1.7 % low), whatever the width. (Statisticians call this factor
# $c_4(n)$; for $n = 16$ samples it is $\sqrt{2/15}\,\Gamma(8)/\Gamma(7.5)$, the `c4` of the
# code.) What changes with the width is the mean of the per-query spread $\|q\| / \sqrt{d_k}$:
# $\mathbb{E}\|q\|^2 = d_k$, but
# $\mathbb{E}\|q\| < \sqrt{\mathbb{E}\|q\|^2}$, well below when few coordinates are summed
# ($\sqrt{2/\pi} \approx 0.80$ at $d_k = 1$) and closer as $d_k$ grows. **Check:** at every
# width, the measured average is $0.983$ times the mean of $\|q\| / \sqrt{d_k}$, within 3 %.

# %%
# Below 1 at small widths: the mean of ||q|| / sqrt(d_k), times the 16-sample factor c4(16).
query_spread = {d_k: (q_many[:, :d_k].norm(dim=-1) / math.sqrt(d_k)).mean().item()
                for d_k in D_K_VALUES}
c4 = math.sqrt(2 / 15) * math.gamma(8) / math.gamma(7.5)  # E[std of 16 normal samples] / sigma
assert all(abs(scaled_spread[d_k] / (c4 * query_spread[d_k]) - 1) < 0.03 for d_k in D_K_VALUES)
print(f"d_k = 1, 2, 4, 8: mean std of the scaled scores "
      f"{[round(scaled_spread[d_k], 3) for d_k in (1, 2, 4, 8)]}, {c4:.3f} x mean of "
      f"||q||/sqrt(d_k) {[round(c4 * query_spread[d_k], 3) for d_k in (1, 2, 4, 8)]}")
