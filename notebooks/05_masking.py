# %% [markdown]
# # 05 · Masking
#
# **What you will build:** the two masks every Transformer needs, as the functions `causal_mask`
# and `padding_mask` of `transformer_from_scratch.masks`. A causal mask keeps the decoder from
# reading the future; a padding mask hides the filler that makes short sequences as long as the
# longest one in their batch. Then the case that breaks naive code: a query left with no key at
# all, which turns the softmax into $0/0$ and fills a network with NaN. Last, the one PyTorch
# convention that means the opposite of ours, checked so that you never mix them up.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/05_masking.ipynb) · Assumes: [02 · Self-attention](02_self_attention.ipynb) (`scaled_dot_product_attention` and its `mask` argument).

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
import textwrap

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap, PowerNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.utils import COLORS, get_device, save_figure, set_seed
from transformer_from_scratch.viz import plot_attention

set_seed(0)
device = get_device()

# %% [markdown]
# ## 1 · What a mask does
#
# Attention gives query $i$ a weighted average of the values, $c_i = \sum_j \alpha_{ij} v_j$,
# with weights $\alpha_{ij} = \operatorname{softmax}_j(s_{ij})$ over the scores
# $s_{ij} = q_i \cdot k_j / \sqrt{d_k}$. A **mask** $M \in \{0, 1\}^{T_q \times T_k}$ says which
# query–key pairs are allowed, and masked attention renormalises over the allowed keys only:
#
# $$\alpha_{ij} = \frac{M_{ij}\, e^{s_{ij}}}{\sum_{j'} M_{ij'}\, e^{s_{ij'}}}.$$
#
# Code gets the same numbers by setting the blocked scores to $-\infty$ before the softmax:
# $e^{-\infty} = 0$, so a blocked key gets a weight of exactly zero, adds nothing to $c_i$ and
# receives no gradient. Keep an eye on the denominator: when a whole row of $M$ is zero it is
# $0/0$. Section 5 is about that row.
#
# The course's convention, fixed in notebook 02: a boolean mask holds **True where the query may
# attend**. A mask only has to *broadcast* to the scores' shape $(B, h, T_q, T_k)$, so each one
# is stored at the smallest shape that says what it depends on.
#
# **Check:** our `scaled_dot_product_attention` with a random mask equals the formula above,
# row by row, and a key that every query blocks gets no gradient at all.

# %%
g = torch.Generator().manual_seed(0)
T_q, T_k, d_k = 4, 6, 8
Q1 = torch.randn(T_q, d_k, generator=g).to(device)
K1 = torch.randn(T_k, d_k, generator=g).to(device).requires_grad_()
V1 = torch.randn(T_k, d_k, generator=g).to(device).requires_grad_()
allowed = torch.rand(T_q, T_k, generator=g) < 0.6  # (T_q, T_k), True = may attend
allowed[:, 0] = True  # every query keeps a key here (section 5 is about the other case)
allowed[:, -1] = False  # the last key is blocked for every query
allowed = allowed.to(device)

context, attn = scaled_dot_product_attention(Q1, K1, V1, mask=allowed)
scores = Q1 @ K1.T / d_k**0.5  # (T_q, d_k) @ (d_k, T_k) -> (T_q, T_k)
for i in range(T_q):
    keep = allowed[i]
    weights_i = torch.softmax(scores[i, keep], dim=-1)  # the formula, over the allowed keys only
    torch.testing.assert_close(attn[i, keep], weights_i)
    assert (attn[i, ~keep] == 0).all()  # exactly zero, not merely small
    torch.testing.assert_close(context[i], weights_i @ V1[keep])

context.pow(2).sum().backward()
assert (K1.grad[-1] == 0).all() and (V1.grad[-1] == 0).all()  # the blocked key learns nothing
assert K1.grad[:-1].abs().sum() > 0 and V1.grad[:-1].abs().sum() > 0
# Printed from a CPU run of the same inputs, so that the rounded digits do not depend on `device`.
_, attn_cpu = scaled_dot_product_attention(Q1.detach().cpu(), K1.detach().cpu(), V1.detach().cpu(),
                                           mask=allowed.cpu())
torch.testing.assert_close(attn.detach().cpu(), attn_cpu)
print(attn_cpu.round(decimals=3))

# %% [markdown]
# Every picture of a mask in this notebook uses the same two colours and the same axes: rows are
# query positions $i$ (the position being computed), columns are key positions $j$ (what it may
# read). Attention weights are drawn with the course's `plot_attention` from notebook 02.

# %% jupyter={"source_hidden": true}
# Masks are not queries, keys or values, so they are drawn in greys, coloured by what they mean
# (as in notebook 03's padding-mask figure): dark = may attend, light = blocked.
MASK_CMAP = ListedColormap(["#e6e6e6", "#4d4d4d"])  # False = blocked, True = may attend


def draw_mask(ax, mask_2d, title):
    """Draw a (T_q, T_k) boolean mask: query position down, key position across."""
    grid = mask_2d.detach().cpu().int()
    T_rows, T_cols = grid.shape
    image = ax.imshow(grid.numpy(), cmap=MASK_CMAP, vmin=0, vmax=1)
    ax.set_xticks(range(T_cols))
    ax.set_yticks(range(T_rows))
    ax.set_xticks([x - 0.5 for x in range(1, T_cols)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, T_rows)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position $j$")
    ax.set_ylabel("query position $i$")
    ax.set_title(title)
    return image


def mask_colorbar(fig, image, axes, show_bool=True):
    """A two-entry colorbar that says what the colours mean (and, for our masks, which boolean)."""
    bar = fig.colorbar(image, ax=axes, ticks=[0.25, 0.75], fraction=0.046, pad=0.04)
    labels = ["blocked\n(False)", "may attend\n(True)"] if show_bool else ["blocked", "may attend"]
    bar.ax.set_yticklabels(labels, fontsize=11)
    return bar


# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(13, 3.9), layout="constrained")
image = draw_mask(axes[0], allowed, "mask $M$")
mask_colorbar(fig, image, axes[0])
# Blocked cells look the same in all three panels: the mask's light grey, hatched. Dark never
# means "blocked": in the mask it means "may attend", in the weights a large weight.
blocked_grey = MASK_CMAP.colors[0]
shown_scores = scores.detach().masked_fill(~allowed, float("nan"))  # blocked -> "bad" colour
shown_weights = attn.detach().masked_fill(~allowed, float("nan"))
score_lim = max(2.5, scores.detach()[allowed].abs().max().item())  # never clips an allowed score
plot_attention(shown_scores, ax=axes[1], cmap=plt.get_cmap("RdBu_r").with_extremes(bad=blocked_grey),
               vmin=-score_lim, vmax=score_lim, label="score", title=r"scores $s_{ij}$ (blocked: $-\infty$)")
plot_attention(shown_weights, ax=axes[2], cmap=plt.get_cmap("Blues").with_extremes(bad=blocked_grey),
               vmax=1, title=r"weights $\alpha_{ij}$ (blocked: exactly 0)")
for ax in axes:
    for i, j in (~allowed).nonzero().tolist():
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                               edgecolor="#9a9a9a", linewidth=0))
for ax in axes[1:]:
    ax.set_xlabel("key position $j$")
    ax.set_ylabel("query position $i$")
fig.legend(handles=[Patch(facecolor=blocked_grey, edgecolor="#9a9a9a", hatch="///",
                          label="blocked pair: mask False, score $-\\infty$, weight 0")],
           loc="outside lower center", fontsize=10)
fig.suptitle("A mask removes keys before the softmax; the allowed keys share all the weight")
plt.show()

# %% [markdown]
# **A mask is a renormalisation: blocked keys get weight exactly 0, the allowed ones share all of
# it, and nothing flows back to a key that nobody may see.**
#
# ## 2 · The causal mask
#
# A decoder is trained with **teacher forcing**: it reads the correct target shifted by one,
# $\text{tgt\_in} = [\texttt{BOS}, y_1, \dots, y_L]$, and at every position predicts the next
# token, $\text{tgt\_out} = [y_1, \dots, y_L, \texttt{EOS}]$, all positions in one parallel pass.
# The answer at position $t$ is therefore the input at position $t + 1$. If query $t$ could read
# key $t + 1$ it would copy the answer, and training would learn a trick that generation cannot
# use, since there the later tokens do not exist yet (Vaswani et al., 2017, §3.2.3). The
# **causal mask** lets query $i$ see keys $0, \dots, i$ only:
#
# $$M_{ij} = [\, j \le i \,], \qquad \text{a lower-triangular matrix including the diagonal.}$$
#
# It is the same for every sequence and every head, so it is stored once, as $(1, 1, T, T)$.

# %%
#| default_exp masks

# %%
#| export
"""Attention masks: which keys each query may attend to (True = may attend)."""

from collections.abc import Sequence

import torch

from transformer_from_scratch.checks import check_int, check_tensor


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(1, 1, T, T) bool mask letting query i attend to keys 0..i only (True = may attend)."""
    T = check_int("T", T, minimum=1)
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T), j <= i
    return allowed.view(1, 1, T, T)  # (T, T) -> (1, 1, T, T): shared by every sequence and head


# %% [markdown]
# **Check:** it is the rule written out, True exactly where $j \le i$ (checked from the indices,
# not with `tril`, which is how `causal_mask` builds it); it is exactly where PyTorch's own
# `nn.Transformer.generate_square_subsequent_mask` (a float mask, $0$ or $-\infty$) holds $0$;
# it lands on the device it was asked for.

# %%
mask = causal_mask(5, device=device)
assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
assert mask.device.type == device.type
i, j = torch.arange(5).unsqueeze(1), torch.arange(5)  # (5, 1) query and (5,) key positions
assert torch.equal(mask[0, 0].cpu(), j <= i)  # broadcast to (5, 5)
builtin = nn.Transformer.generate_square_subsequent_mask(5)  # (5, 5) float: 0 or -inf
assert torch.equal(mask[0, 0].cpu(), builtin == 0)
print(mask[0, 0].int().cpu())

# %%
fig, ax = plt.subplots(figsize=(5, 4), layout="constrained")
image = draw_mask(ax, causal_mask(8)[0, 0], "causal_mask(8): query $i$ sees keys $0..i$")
mask_colorbar(fig, image, ax)
plt.show()

# %% [markdown]
# ### Why it is needed: a head that cheats
#
# Here is an attention head that a model could easily learn, built by hand: the query at position
# $t$ points at position $t + 1$ (the last query, with no $t + 1$, points nowhere), keys carry
# their position, values carry their token. Under
# teacher forcing it reads the answer straight off the input, whatever the target is; here an
# arbitrary one, $y = (7, 4, 9, 3, 5)$:

# %%
BOS, EOS = 1, 2
y = torch.tensor([7, 4, 9, 3, 5])
tgt_in = torch.cat([torch.tensor([BOS]), y])  # (T,) what the decoder reads
tgt_out = torch.cat([y, torch.tensor([EOS])])  # (T,) what it must predict at each position
# The answer at t is the input at t + 1 (true by construction: a reminder, not a test).
assert torch.equal(tgt_out[:-1], tgt_in[1:])

T_tgt, vocab = len(tgt_in), 10
positions = torch.eye(T_tgt)  # (T, T): row t is the one-hot code of position t
# (T, T): query t looks for the key of position t + 1; the last query, with no t + 1, for none.
# That key scores 8 / sqrt(6) = 3.3 and every other key 0. Any positive factor would make it the
# key with the largest weight; 8.0 gives it most of the weight (0.84 with all six keys visible).
Q_peek = 8.0 * torch.diag(torch.ones(T_tgt - 1), diagonal=1)
K_peek = positions  # (T, T): each key says where it is
V_peek = F.one_hot(tgt_in, vocab).float()  # (T, vocab): each value says which token it is


def teacher_forced_accuracy(mask):
    """Share of positions 0..T-2 where the head's strongest token is the right answer."""
    context, _ = scaled_dot_product_attention(
        Q_peek.to(device), K_peek.to(device), V_peek.to(device), mask=mask
    )
    predicted = context.argmax(dim=-1).cpu()  # (T, vocab) -> (T,)
    return (predicted[:-1] == tgt_out[:-1]).float().mean().item()


no_mask = teacher_forced_accuracy(None)
with_mask = teacher_forced_accuracy(causal_mask(T_tgt, device=device)[0, 0])
print(f"teacher-forced accuracy of the peeking head: no mask {no_mask:.0%}, causal {with_mask:.0%}")
assert no_mask == 1.0 and with_mask == 0.0
# Without a mask, the weight query 0 puts on key 1, the one it looks for (on the CPU):
_, peek_weights_free = scaled_dot_product_attention(Q_peek, K_peek, V_peek)  # (T, T)
print(f"no mask: weight of query 0 on key 1 {peek_weights_free[0, 1].item():.2f}")
assert 0.8 < peek_weights_free[0, 1] < 0.9
assert torch.equal(peek_weights_free.argmax(-1)[:-1], torch.arange(1, T_tgt))  # each t: key t + 1
# Under the mask, query t spreads its weight evenly over the keys 0..t it may see.
peek_mask = causal_mask(T_tgt, device=device)[0, 0]  # (T, T)
_, peek_weights = scaled_dot_product_attention(
    Q_peek.to(device), K_peek.to(device), V_peek.to(device), mask=peek_mask
)  # (T, T)
# Expected weights, built without `causal_mask`: 1/(t+1) on keys 0..t, 0 after.
uniform = torch.tril(torch.ones(T_tgt, T_tgt)) / torch.arange(1, T_tgt + 1).unsqueeze(1)  # (T, T)
torch.testing.assert_close(peek_weights.cpu(), uniform)

# %% [markdown]
# Without the mask, the head is perfect during training and useless when generating. With it, the
# key it looks for is blocked, its scores over the visible keys are all equal (all 0: the query
# matches no key it may see), so its weights are uniform over them (checked above, for every
# query), and it can only average what came before. Since the six tokens are distinct, that
# average never names the answer, hence 0%. The 0% also tests `causal_mask`: a mask that let
# query $t$ read key $t + 1$ as well would give 100% again.
#
# **Check:** the general property. With a causal mask, changing the token at position 5 leaves
# the outputs at positions 0–4 as they were (the check allows 10⁻⁶ for other devices' kernels;
# the stored run prints 0.0000 there); without the mask, every output moves.

# %%
g = torch.Generator().manual_seed(1)
T_causal, d_model = 8, 16
embedding = torch.randn(vocab, d_model, generator=g)
W_q, W_k, W_v = (torch.randn(d_model, d_model, generator=g) / d_model**0.5 for _ in range(3))


def self_attention(x, mask):
    """One head of self-attention over x (T, d_model), with fixed random projections."""
    Wq, Wk, Wv = W_q.to(x.device), W_k.to(x.device), W_v.to(x.device)
    context, _ = scaled_dot_product_attention(x @ Wq, x @ Wk, x @ Wv, mask=mask)
    return context  # (T, d_model)


tokens = torch.randperm(vocab, generator=g)[:T_causal]  # T distinct tokens: no two inputs are equal
unused = [v for v in range(vocab) if v not in tokens.tolist()]
changed = tokens.clone()
changed[5] = unused[0]  # a different token at position 5 only
x, x_changed = embedding[tokens].to(device), embedding[changed].to(device)  # (T, d_model)

causal = causal_mask(T_causal, device=device)[0, 0]
moved_causal = (self_attention(x_changed, causal) - self_attention(x, causal)).abs().amax(-1)
moved_full = (self_attention(x_changed, None) - self_attention(x, None)).abs().amax(-1)
assert (moved_causal[:5] < 1e-6).all() and (moved_causal[5:] > 1e-3).all()
assert (moved_full > 1e-3).all()
# Printed from a CPU run of the same inputs, so that the rounded digits do not depend on `device`.
x_cpu, x_changed_cpu = x.cpu(), x_changed.cpu()
moved_causal_cpu = (self_attention(x_changed_cpu, causal.cpu())
                    - self_attention(x_cpu, causal.cpu())).abs().amax(-1)
moved_full_cpu = (self_attention(x_changed_cpu, None) - self_attention(x_cpu, None)).abs().amax(-1)
torch.testing.assert_close(moved_causal.cpu(), moved_causal_cpu, atol=1e-5, rtol=1e-4)
torch.testing.assert_close(moved_full.cpu(), moved_full_cpu, atol=1e-5, rtol=1e-4)
print("largest change per position, causal:", moved_causal_cpu.round(decimals=3))
print("largest change per position, no mask:", moved_full_cpu.round(decimals=3))

# %% [markdown]
# The same fact, for every pair at once: the Jacobian block
# $\partial c_i / \partial x_j$ says how much output $i$ depends on input $j$. With the causal mask
# its norm must vanish exactly above the diagonal, so the picture of what each output depends on
# *is* the picture of the mask.

# %%
J_full = torch.autograd.functional.jacobian(lambda x: self_attention(x, None), x)
J_causal = torch.autograd.functional.jacobian(lambda x: self_attention(x, causal), x)
# (T, d_model, T, d_model) -> (T, T): the size of d c_i / d x_j for every pair (i, j)
depends_full = J_full.pow(2).sum(dim=(1, 3)).sqrt().cpu()
depends_causal = J_causal.pow(2).sum(dim=(1, 3)).sqrt().cpu()

lower = torch.ones(T_causal, T_causal, dtype=torch.bool).tril()
assert (depends_causal[~lower] == 0).all() and (depends_causal[lower] > 0).all()
assert (depends_full > 0).all()

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True, layout="constrained")
norm = PowerNorm(gamma=0.5, vmin=0, vmax=max(depends_full.max(), depends_causal.max()).item())
cmap = plt.get_cmap("viridis").with_extremes(bad="#e6e6e6")  # exact zeros drawn light grey
for ax, depends, title in [(axes[0], depends_full, "no mask"),
                           (axes[1], depends_causal, "causal mask")]:
    shown = depends.masked_fill(depends == 0, float("nan"))  # exactly 0 -> "bad" colour
    image = ax.imshow(shown.numpy(), cmap=cmap, norm=norm)
    ax.set_title(f"{title}: output $i$ depends on input $j$")
    ax.set_xlabel("input (key) position $j$")
    ax.set_xticks(range(T_causal))
    ax.set_yticks(range(T_causal))
axes[0].set_ylabel("output (query) position $i$")
axes[1].legend(handles=[Patch(color="#e6e6e6", label="exactly 0")], loc="upper right",
               fontsize=10, framealpha=0.9)
fig.colorbar(image, ax=axes, fraction=0.046, pad=0.04,
             label=r"$\|\partial c_i / \partial x_j\|$ (Frobenius norm, square-root scale)")
plt.show()


# %% [markdown]
# **A causal mask makes output $i$ a function of inputs $0..i$ only, so teacher-forced training
# sees exactly what generation will see.**
#
# ## 3 · The padding mask
#
# Sequences in a batch have different lengths, so the short ones are padded with a `PAD` token up
# to a common length $T$. Padding carries no content. A query that attends to it averages in
# filler, and worse, its output would then depend on how much padding its batch happened to need.
# The **padding mask** blocks the keys past each sequence's length $\ell_b$:
#
# $$M_{b,ij} = [\, j < \ell_b \,].$$
#
# It depends on the sequence $b$ and the key $j$, not on the head or the query, so it is stored
# as $(B, 1, 1, T_k)$. Only keys are masked: every query keeps at least key 0, as long as
# $\ell_b \ge 1$ (section 5 shows what goes wrong otherwise, and builds a length 0). Lengths are counts, so they must be integers between $0$ and $T_k$.
# The encoder's self-attention needs only this mask, and so does the decoder's cross-attention,
# whose keys are the encoded source: nothing there is in the future, only some of it is filler.

# %%
#| export
def padding_mask(lengths: torch.Tensor | Sequence[int], T_k: int) -> torch.Tensor:
    """(B, 1, 1, T_k) bool mask that is True on the first lengths[b] keys of each sequence b."""
    lengths = torch.as_tensor(lengths)  # a tensor keeps its device; a list lands on the CPU
    check_tensor("lengths", lengths, dim=1, kind="int")  # (B,)
    T_k = check_int("T_k", T_k, minimum=1)
    bad = (lengths < 0) | (lengths > T_k)
    if bad.any():
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"every length must be between 0 and T_k={T_k}, got lengths[{b}]={int(lengths[b])}"
        )
    keys = torch.arange(T_k, device=lengths.device)  # (T_k,)
    allowed = keys.unsqueeze(0) < lengths.unsqueeze(1)  # (1, T_k) < (B, 1) -> (B, T_k)
    return allowed.view(-1, 1, 1, T_k)  # (B, T_k) -> (B, 1, 1, T_k): same for heads and queries


# %% [markdown]
# **Check:** on a small batch, row $b$ holds exactly $\ell_b$ leading Trues.

# %%
lengths = torch.tensor([4, 2, 5])
pad = padding_mask(lengths.to(device), T_k=5)
assert pad.shape == (3, 1, 1, 5) and pad.dtype == torch.bool and pad.device.type == device.type
assert torch.equal(pad.sum(dim=-1).flatten().cpu(), lengths)
assert torch.equal(pad, pad.cummin(dim=-1).values)  # Trues first, then Falses
print(pad[:, 0, 0].int().cpu())

# %% [markdown]
# Lengths that cannot be right fail at once, with the offending value in the message, instead of
# producing a mask that is silently wrong: lengths of a floating dtype (a `TypeError` even for
# whole numbers such as 4.0: lengths are counts), a batch of lengths that is not 1-D, a length
# longer than the sequence, a negative one, and $T_k = 0$.

# %%
bad_calls = {
    "float lengths": lambda: padding_mask(torch.tensor([4.0, 2.0]), T_k=5),  # whole, still refused
    "2-D lengths": lambda: padding_mask(torch.tensor([[4, 2]]), T_k=5),
    "length > T_k": lambda: padding_mask([4, 6, 5], T_k=5),
    "negative length": lambda: padding_mask([4, -1], T_k=5),
    "T_k = 0": lambda: padding_mask([0, 0], T_k=0),
}
for name, call in bad_calls.items():
    try:
        call()
    except (TypeError, ValueError) as err:
        print(f"{name:16s} {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{name} was accepted")

# %% [markdown]
# **Check:** the point of it. A sequence of length 4 run alone gives the same outputs as when it
# sits, padded with random filler to length 7, in a batch next to a longer sequence, provided the
# padding mask is on. Without the mask the filler leaks in.

# %%
g = torch.Generator().manual_seed(2)
alone = torch.randn(1, 4, d_model, generator=g)  # (1, 4, d_model): a sequence of length 4
batch = torch.randn(2, 7, d_model, generator=g)  # (2, 7, d_model): filler everywhere...
batch[0, :4] = alone[0]  # ...except the real tokens of sequence 0; sequence 1 is all real
alone, batch = alone.to(device), batch.to(device)
batch_mask = padding_mask(torch.tensor([4, 7], device=device), T_k=7)  # (2, 1, 1, 7)

expected = self_attention(alone[0], None)  # (4, d_model)
# This toy has no head axis: (B, 1, 1, T_k) -> (B, 1, T_k), which broadcasts over the queries.
masked = self_attention(batch, batch_mask[:, 0])  # (2, 7, d_model)
unmasked = self_attention(batch, None)
torch.testing.assert_close(masked[0, :4], expected)
assert not torch.allclose(unmasked[0, :4], expected, atol=1e-3)
# Printed from a CPU run of the same inputs, so that the rounded digits do not depend on `device`.
expected_cpu = self_attention(alone[0].cpu(), None)
masked_cpu = self_attention(batch.cpu(), batch_mask[:, 0].cpu())
unmasked_cpu = self_attention(batch.cpu(), None)
torch.testing.assert_close(unmasked_cpu, unmasked.cpu(), atol=1e-5, rtol=1e-4)
print("largest difference from running alone, masked:  ",
      round((masked_cpu[0, :4] - expected_cpu).abs().max().item(), 4))
print("largest difference from running alone, unmasked:",
      round((unmasked_cpu[0, :4] - expected_cpu).abs().max().item(), 2))

# %% jupyter={"source_hidden": true}
lengths_fig = torch.tensor([6, 3])
pad_demo = padding_mask(lengths_fig, T_k=6)  # (2, 1, 1, 6)
fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.2), sharey=True, layout="constrained")
for b, ax in enumerate(axes):
    # (1, T_k) -> (T_q, T_k): the same row for every query, as broadcasting will make it
    image = draw_mask(ax, pad_demo[b, 0].expand(6, 6),
                      f"sequence {b}: length {lengths_fig[b].item()} of 6")
axes[1].set_ylabel("")
mask_colorbar(fig, image, axes)
fig.suptitle("padding_mask([6, 3], 6): keys past each length are blocked, for every query")
plt.show()

# %% [markdown]
# **A padding mask hides the filler keys, so a sequence's outputs do not depend on how much
# padding its batch needed.**
#
# ## 4 · Combining the two
#
# A decoder reading a padded batch of targets needs both: query $i$ of sequence $b$ may read key
# $j$ when $j \le i$ **and** $j < \ell_b$. The masks are booleans with the same meaning, so they
# combine with `&`, and broadcasting builds the full mask:
#
# $$\underbrace{(1, 1, T, T)}_{\text{causal}} \;\&\; \underbrace{(B, 1, 1, T)}_{\text{padding}}
# \;\longrightarrow\; (B, 1, T, T),$$
#
# which broadcasts once more, over the $h$ heads, against the scores $(B, h, T, T)$. No helper
# function is needed: `causal_mask(T) & padding_mask(lengths, T)`.

# %%
lengths_comb = torch.tensor([7, 4])
T_comb, B, num_heads = 7, 2, 3
combined = causal_mask(T_comb) & padding_mask(lengths_comb, T_comb)  # (B, 1, T, T), on the CPU
assert combined.shape == (B, 1, T_comb, T_comb)
for b in range(B):
    for i in range(T_comb):
        for j in range(T_comb):
            assert combined[b, 0, i, j] == (j <= i and j < lengths_comb[b])
# Right padding keeps key 0 for every query, so no row is empty.
assert combined.any(dim=-1).all()

# It broadcasts against multi-head shapes: Q, K, V of shape (B, h, T, d_k), on `device`.
QKV = torch.randn(3, B, num_heads, T_comb, d_k, generator=torch.Generator().manual_seed(3)).to(device)
combined_d = combined.to(device)
context_mh, attn_mh = scaled_dot_product_attention(*QKV, mask=combined_d)
assert context_mh.shape == (B, num_heads, T_comb, d_k) and attn_mh.shape == (B, num_heads, T_comb, T_comb)
assert (attn_mh.masked_select(~combined_d.expand_as(attn_mh)) == 0).all()
# Rows still sum to 1 (any mask with no empty row gives this; the line above is the real test).
torch.testing.assert_close(attn_mh.sum(dim=-1), torch.ones(B, num_heads, T_comb, device=device))
print(combined[1, 0].int())

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), sharey=True, layout="constrained")
for b, ax in enumerate(axes):
    length = lengths_comb[b].item()
    title = f"sequence {b}: length {length} of {T_comb}"
    if length < T_comb:  # mark where the padding starts (a full sequence has none to mark)
        ax.axvline(length - 0.5, color=COLORS["accent"], linestyle="--", linewidth=2.5)
        ax.axhline(length - 0.5, color=COLORS["accent"], linestyle=":", linewidth=2.5)
    else:
        title += " (no padding)"
    image = draw_mask(ax, combined[b, 0], title)
axes[1].set_ylabel("")
mask_colorbar(fig, image, axes)
fig.legend(handles=[Line2D([], [], color=COLORS["accent"], linestyle="--", linewidth=2.5,
                           label="end of the real keys"),
                    Line2D([], [], color=COLORS["accent"], linestyle=":", linewidth=2.5,
                           label="end of the real queries")],
           loc="outside lower center", ncols=2, fontsize=10)
fig.suptitle("causal_mask(7) & padding_mask([7, 4], 7)")
save_figure(fig, "05_causal_and_padding")
plt.show()

# %% [markdown]
# The rows below the dotted line belong to padded *queries*. They still read the real keys, so
# their outputs are finite but meaningless; nothing downstream uses them (section 5 checks this,
# for this mask among others).
#
# **`causal_mask(T) & padding_mask(lengths, T)` is the decoder's self-attention mask: one `&`,
# and broadcasting does the rest.**
#
# ## 5 · The fully masked row
#
# The map of this section:
#
# - **the problem:** some masks leave a query with no key at all; a plain masked softmax then
#   returns NaN, which reaches the gradients and, after one step, the weights;
# - **the built-ins:** what PyTorch returns there depends on its version and kernel, so it is
#   shown, not relied on;
# - **the course's policy:** our attention returns zero weights and a zero context, which
#   nothing downstream reads;
# - *optional:* the alternatives, $-10^9$ and `torch.finfo(dtype).min`, which give uniform
#   rows instead in float32 and float64, and what changes in float16.
#
# ### Where it comes from
#
# Section 4's mask never leaves a query without keys, as long as no sequence is empty. Three
# common ways to build one that does:
#
# 1. **Masking padded queries too**, with a "square" padding mask `pad_q & pad_k` that looks
#    tidier than the key-only one. A padded query then has nothing left to read.
# 2. **Left padding with a causal mask.** Batched generation pads prompts on the left, so that
#    they all end in the last column. The padding positions in front of a short prompt are
#    queries too, and their causal past holds only padding, which the padding mask blocks: they
#    have no key at all. (The prompt's own first token still sees itself.)
# 3. **An empty sequence**, say an empty source sentence in cross-attention: length 0 blocks
#    every key for every query.
#
# **Check:** count the rows with no True in each, for a batch of lengths $(6, 4)$ (and $(6, 0)$
# for the third).

# %%
T = 6  # the length in this section
lengths_pad = torch.tensor([6, 4])
key_pad = padding_mask(lengths_pad, T)  # (B, 1, 1, T)
query_pad = key_pad.transpose(-1, -2)  # (B, 1, 1, T) -> (B, 1, T, 1): a padded query row
ways = {
    "causal & padded queries and keys": causal_mask(T) & key_pad & query_pad,  # (B, 1, T, T)
    "causal & left padding": causal_mask(T) & key_pad.flip(-1),  # pads first, tokens last
    "padding with length 0": padding_mask(torch.tensor([6, 0]), T).expand(-1, -1, T, -1),
}
for name, way in ways.items():
    no_key = ~way.any(dim=-1)  # (B, 1, T): True where a query has no key at all
    print(f"{name:34s} empty rows per sequence: {no_key.sum(dim=(1, 2)).tolist()}")
empty = {name: (~way.any(dim=-1)).sum(dim=(1, 2)).tolist() for name, way in ways.items()}
assert empty == {"causal & padded queries and keys": [0, 2], "causal & left padding": [0, 2],
                 "padding with length 0": [0, 6]}

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), sharey=True, layout="constrained")
for ax, (name, way) in zip(axes, ways.items(), strict=True):
    image = draw_mask(ax, way[1, 0], f"{name}\n(sequence 1)")
    for i in (~way[1, 0].any(dim=-1)).nonzero().flatten().tolist():
        ax.add_patch(Rectangle((-0.42, i - 0.42), T - 0.16, 0.84, fill=False, zorder=3,
                               edgecolor=COLORS["accent"], linewidth=2.5))
for ax in axes[1:]:
    ax.set_ylabel("")
mask_colorbar(fig, image, axes)
fig.legend(handles=[Patch(fill=False, edgecolor=COLORS["accent"], linewidth=2.5,
                          label="query with no key to attend to")],
           loc="outside lower center", fontsize=11)
fig.suptitle("Three masks that leave some queries with nothing to attend to")
plt.show()


# %% [markdown]
# ### A naive masked softmax returns NaN there
#
# The textbook line `scores.masked_fill(~mask, -inf).softmax(-1)` computes, for an empty row,
# $e^{-\infty} / \sum e^{-\infty} = 0/0$. Floating point says NaN. (The softmax first subtracts
# the row's maximum, and $-\infty - (-\infty)$ is NaN already.) From here on, the mask `square`
# is the first of the three ways above, **causal & padded queries and keys** (so its rows are a
# causal triangle, cut short for padded queries), in which sequence 1 (length 4) has no key for
# its queries 4 and 5.

# %%
def naive_attention(Q, K, V, mask, fill=float("-inf")):
    """Textbook masked attention: blocked scores set to `fill`, then a plain softmax."""
    scores = Q @ K.transpose(-2, -1) / Q.size(-1) ** 0.5  # (..., T_q, d_k) -> (..., T_q, T_k)
    attn = scores.masked_fill(~mask, fill).softmax(dim=-1)
    return attn @ V, attn  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)


# `square` for short: causal & padded queries and keys (the first of the three ways above).
square = ways["causal & padded queries and keys"]  # (B, 1, T, T); rows 4, 5 of sequence 1 empty
g = torch.Generator().manual_seed(4)
Q, K, V = torch.randn(3, 2, 1, T, d_k, generator=g)  # each (B, h=1, T, d_k), on the CPU
context_naive, attn_naive = naive_attention(Q, K, V, square)
print(attn_naive[1, 0].round(decimals=3))
empty_rows = ~square.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
assert attn_naive.isnan().equal(empty_rows.expand_as(attn_naive))  # NaN exactly on empty rows
assert context_naive.isnan().equal(empty_rows.expand_as(context_naive))

# %% [markdown]
# ### The NaN does not stay put
#
# "The padded positions are ignored by the loss anyway" is true for the forward pass only. Take a
# one-layer toy model on a padded batch, with the mask `square`, and a cross-entropy that ignores
# `PAD` targets. The loss comes out finite, but the backward pass sends NaN into some of the
# weights' gradients, and one SGD step (run below) writes that NaN into the weights themselves.
# Which weights, and why, follows from one rule of floating point: $0 \cdot \text{NaN} = \text{NaN}$.
#
# - **`W_out`.** The padded positions' activations are NaN, and
#   $\partial L / \partial W_\text{out} = x^\top\, \partial L / \partial \text{logits}$. The
#   loss ignores those positions, so their upstream gradient is exactly 0, but $0 \cdot \text{NaN}$
#   is still NaN.
# - **`W_v`** (and through it `embed`). $\partial L / \partial V = \alpha^\top\, \partial L /
#   \partial c$: the NaN rows of $\alpha$ meet the zero gradient of the padded queries, with the
#   same result.
# - **`W_q` and `W_k` stay finite.** The gradient reaches them through the scores, and every score
#   of an empty row was overwritten by `masked_fill`. Its backward pass does not multiply, it puts
#   an exact 0 where a value was overwritten, so the NaN coming back from the softmax never gets
#   past it.
#
# Stack a second layer and the forward pass breaks too: the padded positions' NaN outputs are
# the second layer's keys and values, and the zero weight that blocks a padded key cannot cancel
# the NaN value stored there. Every position of the padded sequence becomes NaN, so the mean
# loss over the batch is NaN. (The full-length sequence, with no empty row, stays finite.)

# %%
PAD = 0
g = torch.Generator().manual_seed(5)
src_tokens = torch.randint(3, vocab, (2, T), generator=g)  # (B, T)
targets = torch.randint(3, vocab, (2, T), generator=g)  # (B, T)
padded = ~key_pad[:, 0, 0]  # (B, 1, 1, T) -> (B, T): True on padding positions
src_tokens[padded], targets[padded] = PAD, PAD
weights = {name: (torch.randn(*shape, generator=g) / shape[0] ** 0.5).requires_grad_()
           for name, shape in [("embed", (vocab, d_model)), ("W_q", (d_model, d_model)),
                               ("W_k", (d_model, d_model)), ("W_v", (d_model, d_model)),
                               ("W_out", (d_model, vocab))]}


def toy_logits(attention, mask, num_layers=1, shift=None):
    """Embed, apply `num_layers` self-attention layers (residual), project to the vocabulary.

    shift (d_model,), for a check in section 5: added to the first layer's output at the padded
    positions.
    """
    w = weights
    x = w["embed"][src_tokens]  # (B, T) -> (B, T, d_model)
    for layer in range(num_layers):
        context, _ = attention(x @ w["W_q"], x @ w["W_k"], x @ w["W_v"], mask)
        x = x + context  # (B, T, d_model)
        if shift is not None and layer == 0:
            x = x + padded.unsqueeze(-1) * shift  # (B, T, 1) * (d_model,): padded rows only
    return x @ w["W_out"]  # (B, T, d_model) -> (B, T, vocab)


def toy_loss(attention, mask, num_layers=1, shift=None):
    """Cross-entropy of the toy model, ignoring PAD targets."""
    logits = toy_logits(attention, mask, num_layers, shift)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=PAD)


def loss_and_grads(attention, mask, num_layers=1, shift=None):
    for w in weights.values():
        w.grad = None
    loss = toy_loss(attention, mask, num_layers, shift)
    loss.backward()
    return loss.item(), {name: w.grad.clone() for name, w in weights.items()}


square_2d = square[:, 0]  # (B, 1, T, T) -> (B, T, T): the toy model has no head dimension
loss_naive, grads_naive = loss_and_grads(naive_attention, square_2d)
loss_naive_2, _ = loss_and_grads(naive_attention, square_2d, num_layers=2)
with torch.no_grad():
    nan_positions_2 = toy_logits(naive_attention, square_2d, num_layers=2).isnan().any(dim=-1)
nan_grads = [name for name, gr in grads_naive.items() if gr.isnan().any()]
print(f"one layer:  loss {loss_naive:.4f}, NaN in the gradient of {nan_grads}")
print(f"two layers: NaN logits at positions {nan_positions_2.int().tolist()} (rows = sequences), "
      f"loss {loss_naive_2}")
assert torch.isfinite(torch.tensor(loss_naive))
assert nan_grads == ["embed", "W_v", "W_out"]  # W_q and W_k are finite
assert torch.equal(nan_positions_2, torch.tensor([[False] * T, [True] * T]))  # all of sequence 1
assert torch.tensor(loss_naive_2).isnan()

# One SGD step (learning rate 0.1) on copies of the weights: the NaN gradients become NaN weights.
# A demonstration, not a further test: w - 0.1 * NaN is NaN, so it follows from the assert above.
stepped = {name: w.detach() - 0.1 * grads_naive[name] for name, w in weights.items()}
nan_weights = [name for name, w in stepped.items() if w.isnan().any()]
print(f"after one SGD step: NaN in the weights {nan_weights}")


# %% [markdown]
# ### What PyTorch's built-ins do: it depends on the version
#
# In short: the next cell *shows* what your torch's built-ins return for a query with no key;
# the cell after it *asserts* only what every supported version agrees on. The background:
#
# #### Why it varies (optional on a first reading)
#
# The built-ins have no single answer here. `F.scaled_dot_product_attention` is one front end to
# several kernels: a reference ("math") kernel written with ordinary tensor operations, and
# fused kernels that do the whole computation in one pass, for GPUs and for the CPU as well. It
# picks one from its inputs (device, dtype, shape, mask, ...). It returned NaN for such a row up
# to torch 2.4 (pytorch/pytorch#103963). From torch 2.5 the math kernel uses a *safe* softmax
# that returns zeros for a row with no allowed key (the math-path change is
# pytorch/pytorch#131844). The fused kernels do not go through that softmax: the same stack of
# changes updated each of them separately, in its own code (#131863, landed as #133882), and a
# later version may change any of them again. The CPU is no exception: for 4-D inputs such as the
# ones below, torch 2.13 (the version that stored this notebook) picks the CPU's fused flash
# kernel, not the math one; the next cell prints the choice, as PyTorch's private
# `torch._fused_sdp_choice` reports it.
#
# `nn.MultiheadAttention`, in the torch that stored this notebook, computes the attention weights
# with a plain softmax, as the naive code above does, when it returns them (its default,
# `need_weights=True`). A safe softmax there too has been proposed (pytorch/pytorch#185338, for
# issue #160064), so a later version may return zeros instead. With
# `need_weights=False` it calls `F.scaled_dot_product_attention` and passes whatever that returns
# through its output projection; a zero context comes out as `out_proj(0)`, which is
# `out_proj.bias` (zero only while the bias keeps its initial value, so we give it random values
# to tell the two apart).
#
# #### What the next two cells do
#
# So the next cell only *shows* what the torch you are running does, on the CPU, with its version
# number: what you see may differ from what is stored here. It asks
# `F.scaled_dot_product_attention` twice: once leaving the choice of kernel to PyTorch (and
# printing which kernel that is), and once with the math kernel forced by
# `torch.nn.attention.sdpa_kernel`.
# `F.scaled_dot_product_attention` does not return its weights, but with $V = I$ the
# context *is* the weight matrix, so we can draw them. Its boolean `attn_mask` means "may attend",
# like ours, so our mask goes in unchanged; `nn.MultiheadAttention`'s means the opposite
# (section 6), hence the `~`. The cell after it asserts only what holds on every supported
# version: on each row that has a key, both built-ins give the weights of the formula (the naive
# version above; for `nn.MultiheadAttention`, on its own projections of the input), and
# `nn.MultiheadAttention`'s two paths agree.

# %% tags=["nbval-ignore-output"]
def empty_row_answer(
    rows: torch.Tensor, zero: torch.Tensor | float = 0.0, zero_name: str = "zeros"
) -> str:
    """What the rows of an empty query hold: NaN, `zero` (called `zero_name`), or other values."""
    if rows.isnan().all():
        return "NaN"
    return zero_name if torch.equal(rows, torch.as_tensor(zero).expand_as(rows)) else "other values"


identity = torch.eye(T).expand(2, 1, T, T)  # V = I: the context is the weight matrix
builtin_context = F.scaled_dot_product_attention(Q, K, V, attn_mask=square)  # (B, 1, T, d_k)
builtin_weights = F.scaled_dot_product_attention(Q, K, identity, attn_mask=square)  # (B, 1, T, T)

mha_empty = nn.MultiheadAttention(d_k, num_heads=1, batch_first=True)
with torch.no_grad():  # a nonzero output bias, so that "zero" and "the bias" differ
    mha_empty.out_proj.bias.normal_(generator=torch.Generator().manual_seed(11))
x_mha = Q[:, 0]  # (B, 1, T, d_k) -> (B, T, d_k)
mha_attn_mask = ~square[:, 0]  # (B, 1, T, T) -> (B*h, T, T) with h = 1; True = blocked
with torch.no_grad():
    out_weights, mha_weights = mha_empty(x_mha, x_mha, x_mha, attn_mask=mha_attn_mask)
    out_no_weights, _ = mha_empty(x_mha, x_mha, x_mha, attn_mask=mha_attn_mask, need_weights=False)
bias = mha_empty.out_proj.bias.detach()

with sdpa_kernel(SDPBackend.MATH):  # the reference kernel only
    math_context = F.scaled_dot_product_attention(Q, K, V, attn_mask=square)  # (B, 1, T, d_k)

pick = getattr(torch, "_fused_sdp_choice", None)  # private: a later torch may rename it
kernel = SDPBackend(pick(Q, K, V, square, 0.0, False)).name if pick else "not reported"
print(f"torch {torch.__version__}, CPU; kernel picked for these inputs: {kernel}")
print("sequence 1, rows 4-5 (the queries with no key):")
print("  F.scaled_dot_product_attention, context:           ",
      empty_row_answer(builtin_context[1, 0, 4:]))
print("  the same, math kernel forced, context:             ",
      empty_row_answer(math_context[1, 0, 4:]))
print("  nn.MultiheadAttention, need_weights=True, weights: ", empty_row_answer(mha_weights[1, 4:]))
print("  nn.MultiheadAttention, need_weights=True, output:  ", empty_row_answer(out_weights[1, 4:]))
print("  nn.MultiheadAttention, need_weights=False, output: ",
      empty_row_answer(out_no_weights[1, 4:], bias, "out_proj.bias"))
if device.type != "cpu":
    on_device = F.scaled_dot_product_attention(Q.to(device), K.to(device), V.to(device),
                                               attn_mask=square.to(device))
    print(f"  F.scaled_dot_product_attention on {device.type}, context: ",
          empty_row_answer(on_device[1, 0, 4:].cpu()))

# %%
# What holds on every supported version: on each row that has a key, both built-ins give the
# weights of the formula (nn.MultiheadAttention on its own projections of the input), and
# nn.MultiheadAttention's two paths agree.
full_rows = ~empty_rows.expand_as(attn_naive)  # (B, 1, T, T): the rows of queries with a key
torch.testing.assert_close(builtin_weights[full_rows], attn_naive[full_rows])

W_in, b_in = mha_empty.in_proj_weight.detach(), mha_empty.in_proj_bias.detach()  # (3 d_k, d_k)
q_mha, k_mha, v_mha = (x_mha @ W.T + b for W, b in zip(W_in.chunk(3), b_in.chunk(3), strict=True))
_, attn_mha_naive = naive_attention(q_mha, k_mha, v_mha, square[:, 0])  # (B, T, T)
torch.testing.assert_close(mha_weights.unsqueeze(1)[full_rows], attn_mha_naive.unsqueeze(1)[full_rows])
full_queries = ~empty_rows[:, 0, :, 0]  # (B, T): True for the queries with a key
torch.testing.assert_close(out_no_weights[full_queries], out_weights[full_queries])

# %% [markdown]
# The picture, for the torch you are running:

# %% jupyter={"source_hidden": true} tags=["nbval-ignore-output"]
cmap = plt.get_cmap("Blues").with_extremes(bad=COLORS["accent"])  # NaN cells are drawn in red
panels = [(f"F.scaled_dot_product_attention:\n{empty_row_answer(builtin_weights[1, 0, 4:])}",
           builtin_weights[1, 0]),
          ("nn.MultiheadAttention (need_weights=True, its own\n"
           f"projections of the input): {empty_row_answer(mha_weights[1, 4:])}", mha_weights[1])]
fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.6), sharey=True, layout="constrained")
for ax, (title, weights_2d) in zip(axes, panels, strict=True):
    plot_attention(weights_2d, ax=ax, cmap=cmap, vmax=1, colorbar=False, title=title, annotate=True)
    for text in ax.texts:  # the annotated weights, larger than plot_attention's default
        text.set_fontsize(10)
    ax.add_patch(Rectangle((-0.5, 3.5), T, 2, fill=False, edgecolor="black", linewidth=2,
                           linestyle="--"))
    ax.set_xlabel("key position $j$")
    ax.set_ylabel("")
axes[0].set_ylabel("query position $i$")
fig.colorbar(axes[0].images[0], ax=axes, fraction=0.046, pad=0.04, label="attention weight")
fig.legend(handles=[Patch(color=COLORS["accent"], label="NaN"),
                    Patch(fill=False, edgecolor="black", linestyle="--",
                          label="queries with no key")],
           loc="outside lower center", ncols=2, fontsize=10)
fig.suptitle(f"What torch {torch.__version__} (CPU) gives the empty rows of sequence 1")
plt.show()

# %% [markdown]
# ### The course's answer: zero weights, zero context
#
# Notebook 02 fixed the policy for the whole course: a query whose keys are all masked gets
# attention weights of all zeros and a zero context vector, never NaN. The formula of section 1
# has no value there ($0/0$), so any answer is a convention. Zeros are the natural one: a weighted
# sum over no keys is an empty sum, which is 0; it is the choice the math kernel of
# `F.scaled_dot_product_attention` makes from torch 2.5 on; and, as the next subsection shows,
# nothing downstream reads it.
#
# The fix is three lines of `scaled_dot_product_attention` (notebook 02), the ones that mention
# `no_key`. Here is the mask-and-softmax part of the function, printed from the package's source:

# %%
source = textwrap.dedent(inspect.getsource(scaled_dot_product_attention)).splitlines()
start = next(i for i, line in enumerate(source) if line.strip() == "no_key = None")
end = next(i for i, line in enumerate(source) if "attn = attn.masked_fill(no_key" in line)
print(textwrap.dedent("\n".join(source[start:end + 1])))

# %% [markdown]
# 1. `no_key = torch.isneginf(scores).all(...)` marks the rows in which every score is $-\infty$:
#    the queries with no allowed key, one flag per query, of shape $(\dots, T_q, 1)$.
# 2. `scores.masked_fill(no_key, 0.0)`, before the softmax, sets those rows' scores to $0$. Their
#    softmax is then a harmless uniform row instead of $0/0$, and the softmax's backward pass
#    gets no NaN to send back. Rows with an allowed key are untouched. With a boolean mask this
#    step is not what keeps the gradients finite: as for `W_q` and `W_k` in the toy model above,
#    the first `masked_fill` already stops the NaN, since it overwrote every score of the row. It
#    is needed for a **float mask**, which is *added* to the scores: the backward pass of an
#    addition hands the gradient on unchanged, so without this step the NaN reaches $Q$ and $K$.
# 3. `attn.masked_fill(no_key, 0.0)`, after the softmax, sets the flagged rows' weights to $0$,
#    so the context $\alpha V$ of such a query is $0$. `masked_fill` writes constants there, so
#    no gradient flows back through those rows either.
#
# **Step 2 in one line:** with a bool mask the first `masked_fill` already keeps the gradients
# finite; with a float mask only step 2 does (the 2×2 table at the end of the next cell).
#
# **Check:** on the same inputs, on `device`, ours has no NaN, zeros on the empty rows (the
# course's policy), and on the other rows the weights of the naive version and the context of the
# built-in. Its gradients equal the built-in's too. So that the built-in's answer on the empty rows,
# whatever this torch makes it, cannot enter the comparison, the built-in gets those rows opened
# to every key and no upstream gradient there; ours sends no gradient through them anyway.
#
# Then step 2, with a copy of our function that leaves it out. With the boolean mask, the copy's
# gradients stay finite (the first `masked_fill` stops the NaN); with the same mask as a float
# tensor, $0$ or $-\infty$, they turn NaN for $Q$ and $K$, while ours stay finite. Both versions
# give the same forward pass, so only a gradient can tell them apart.

# %%
Qg, Kg, Vg = (t.clone().to(device).requires_grad_() for t in (Q, K, V))
context_ours, attn_ours = scaled_dot_product_attention(Qg, Kg, Vg, mask=square.to(device))
assert not context_ours.isnan().any() and not attn_ours.isnan().any()
empty_on_device = empty_rows.to(device)
assert (attn_ours.masked_select(empty_on_device) == 0).all()
assert (context_ours.masked_select(empty_on_device) == 0).all()
torch.testing.assert_close(attn_ours.detach().cpu()[full_rows], attn_naive[full_rows],
                           rtol=1e-4, atol=1e-6)
context_rows = full_rows[..., :1].expand_as(builtin_context)  # (B, 1, T, d_k)
torch.testing.assert_close(context_ours.detach().cpu()[context_rows], builtin_context[context_rows],
                           rtol=1e-4, atol=1e-5)

# Gradients: the same upstream gradient through ours and through the built-in.
upstream = torch.randn(context_ours.shape, generator=torch.Generator().manual_seed(6))
(context_ours * upstream.to(device)).sum().backward()
# Open the empty rows to every key: the built-in then computes ordinary numbers there, whatever
# this torch does with an empty row, and the zero upstream gradient below keeps them out.
opened = square | empty_rows  # (B, 1, T, T): an empty row may now attend to every key
Qb, Kb, Vb = (t.clone().requires_grad_() for t in (Q, K, V))
builtin_opened = F.scaled_dot_product_attention(Qb, Kb, Vb, attn_mask=opened)
(builtin_opened * upstream.masked_fill(empty_rows, 0.0)).sum().backward()
for mine, theirs in [(Qg, Qb), (Kg, Kb), (Vg, Vb)]:
    assert torch.isfinite(mine.grad).all()
    torch.testing.assert_close(mine.grad.cpu(), theirs.grad, rtol=1e-4, atol=1e-5)
# Printed from a CPU run, so that the rounded digits do not depend on `device`.
print(scaled_dot_product_attention(Q, K, V, mask=square)[1][1, 0].round(decimals=3))


def without_step_2(Q, K, V, mask):
    """Our scaled_dot_product_attention with step 2 left out (a mistake): (context, attn)."""
    scores = Q @ K.transpose(-2, -1) / Q.size(-1) ** 0.5  # (..., T_q, T_k)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask  # a float mask is added
    no_key = torch.isneginf(scores).all(dim=-1, keepdim=True)  # step 1
    attn = scores.softmax(dim=-1).masked_fill(no_key, 0.0)  # step 3; NaN rows overwritten
    return attn @ V, attn


square_float = torch.zeros(square.shape).masked_fill(~square, float("-inf"))  # (B, 1, T, T)
finite_grads = {}  # (function, mask kind) -> are the gradients of Q, K, V finite?
forward_ours = {}  # mask kind -> ours's (context, attn), to compare with the copy's
for name, attention in [("ours", lambda *a: scaled_dot_product_attention(*a)),
                        ("without step 2", without_step_2)]:
    for kind, mask_kind in [("bool", square), ("float", square_float)]:
        Qs, Ks, Vs = (t.clone().requires_grad_() for t in (Q, K, V))
        context_s, attn_s = attention(Qs, Ks, Vs, mask_kind)
        assert not context_s.isnan().any() and (attn_s.masked_select(empty_rows) == 0).all()
        if name == "ours":
            forward_ours[kind] = (context_s.detach(), attn_s.detach())
        else:  # the same forward pass as ours: only the gradients can differ
            torch.testing.assert_close(context_s.detach(), forward_ours[kind][0])
            torch.testing.assert_close(attn_s.detach(), forward_ours[kind][1])
        (context_s * upstream).sum().backward()
        finite_grads[name, kind] = [bool(torch.isfinite(t.grad).all()) for t in (Qs, Ks, Vs)]
print("gradients of Q, K, V finite:")
for (name, kind), finite in finite_grads.items():
    print(f"  {name:<15}{kind + ' mask':<12}{finite}")
assert all(all(finite) for key, finite in finite_grads.items() if key != ("without step 2", "float"))
assert finite_grads["without step 2", "float"] == [False, False, True]  # step 2 is what saves ours


# %% [markdown]
# ### Why zeros are safe
#
# The output of a padded query goes to two places, and neither uses it. The loss ignores its
# target (`ignore_index=PAD`). A later attention layer sees it only as a key, which the padding
# mask blocks with a weight of exactly 0, and $0 \cdot 0 = 0$ where $0 \cdot \text{NaN}$ was NaN.
#
# **Check:** the toy model trains with our attention. The one-layer loss equals the naive one (the
# real positions are computed identically), every gradient is finite, two layers stay finite.
# Then the two places, one at a time. The loss: overwriting the logits at padded positions
# changes neither the loss nor a gradient (that is `ignore_index` at work). A later layer: in
# the two-layer model, add a large vector to the first layer's output at the padded positions;
# the loss and every gradient must stay exactly as they were. We run that with three masks that
# block padded keys, section 4's (causal and padded keys, whose padded queries still read real
# keys), this section's `square` (causal, padded queries and keys) and the encoder's kind
# (padded queries and keys, no causal mask), and with one that does not block them (padded
# queries only), where the shift must get through. (With the causal mask the padded positions
# come after every real one, so causality alone already hides them; without it, the padding
# mask is what does.)
#
# | mask of the two-layer model | blocks padded keys? | may the shift change anything? |
# |---|---|---|
# | causal, padded keys (section 4) | yes (and causality hides them too) | no |
# | causal, padded queries and keys (`square`) | yes | no |
# | padded queries and keys, no causal | yes (only the padding mask) | no |
# | padded queries only | no | yes: the check must see it |

# %%
def ours(Q, K, V, mask):
    return scaled_dot_product_attention(Q, K, V, mask=mask)


loss_ours, grads_ours = loss_and_grads(ours, square_2d)
loss_ours_2, grads_ours_2 = loss_and_grads(ours, square_2d, num_layers=2)
assert abs(loss_ours - loss_naive) < 1e-6
assert all(torch.isfinite(gr).all() for gr in [*grads_ours.values(), *grads_ours_2.values()])
assert torch.isfinite(torch.tensor(loss_ours_2))

# Padded positions are invisible to the loss: overwrite their logits, nothing changes.
logits = torch.randn(2, T, vocab, generator=torch.Generator().manual_seed(7), requires_grad=True)
junk = torch.where(padded.unsqueeze(-1), torch.full_like(logits, 1e4), logits)  # (B, T, vocab)
loss_a = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=PAD)
loss_b = F.cross_entropy(junk.reshape(-1, vocab), targets.reshape(-1), ignore_index=PAD)
grad_a, = torch.autograd.grad(loss_a, logits)
grad_b, = torch.autograd.grad(loss_b, logits)
assert loss_a.item() == loss_b.item() and torch.equal(grad_a[~padded], grad_b[~padded])
assert (grad_a[padded] == 0).all()
print(f"loss: naive {loss_naive:.4f}, ours {loss_ours:.4f}; two layers of ours {loss_ours_2:.4f}")

# A later layer reads a padded position's output only as a key: move those outputs far away.
shift = 100 * torch.randn(d_model, generator=torch.Generator().manual_seed(8))  # (d_model,)
two_layer_masks = {  # (B, T, T), True = may attend
    "causal, padded keys (section 4)": (causal_mask(T) & key_pad)[:, 0],
    "causal, padded queries and keys": square_2d,
    "padded queries and keys, no causal": (key_pad & query_pad)[:, 0],
    "padded queries only (keys not masked)": query_pad[:, 0].expand(-1, T, T),
}
shift_effect = {}  # mask -> largest change of the loss or of any gradient
for name, mask_2d in two_layer_masks.items():
    loss_0, grads_0 = loss_and_grads(ours, mask_2d, num_layers=2)
    loss_1, grads_1 = loss_and_grads(ours, mask_2d, num_layers=2, shift=shift)
    shift_effect[name] = max(abs(loss_1 - loss_0),
                             *((grads_1[n] - grads_0[n]).abs().max().item() for n in grads_0))
print("two layers, padded outputs of layer 1 shifted: largest change of the loss or a gradient")
for name, change in shift_effect.items():
    print(f"  {name:<40}{change:.3g}")
assert shift_effect["causal, padded keys (section 4)"] < 1e-6
assert shift_effect["causal, padded queries and keys"] < 1e-6
assert shift_effect["padded queries and keys, no causal"] < 1e-6
assert shift_effect["padded queries only (keys not masked)"] > 1e-2  # the check can fail

# %% [markdown]
# ### The alternative: a large negative number instead of $-\infty$
#
# *Optional, down to the figure that ends this section: these are other codebases' conventions
# ($-10^9$, `torch.finfo(dtype).min`, and what float16 does to them); the course's masks do not
# use them.*
#
# Many codebases fill with $-10^9$ instead (The Annotated Transformer does). On a row with some
# allowed key nothing changes, since $e^{-10^9 - s}$ underflows to exactly 0 in float32. On an
# empty row every score equals $-10^9$, the softmax is uniform, and the query gets the plain
# average of **all** values, padding included: finite, and as harmless as our zeros once the
# loss ignores it, but it depends on the content of the padding. Note also that $-10^9$ does not
# fit in float16 (its largest magnitude is 65504): `masked_fill` refuses it, so such code uses
# `torch.finfo(dtype).min` instead.

# %%
context_big, attn_big = naive_attention(Q, K, V, square, fill=-1e9)
torch.testing.assert_close(attn_big[full_rows], attn_naive[full_rows], rtol=0, atol=0)
torch.testing.assert_close(attn_big[1, 0, 4:], torch.full((2, T), 1 / T))  # uniform rows
torch.testing.assert_close(context_big[1, 0, 4:], V[1, 0].mean(dim=0).expand(2, d_k))
try:
    torch.zeros(3, dtype=torch.float16).masked_fill(torch.ones(3, dtype=torch.bool), -1e9)
except RuntimeError as err:  # the message is PyTorch's, and its wording may change
    assert "overflow" in str(err)
    print(f"float16: masked_fill(..., -1e9) raises {type(err).__name__} (overflow)")
else:
    raise AssertionError("expected an overflow error")
print(attn_big[1, 0, 4:].round(decimals=4))

# %% [markdown]
# **Check, the `torch.finfo(dtype).min` convention.** A float mask that holds the most negative
# finite number of the dtype, instead of $-\infty$, is what libraries build when one code path
# must serve several dtypes. In float32 and float64, on a row with an allowed key it changes
# nothing: a score plus `finfo.min` is so far below the rest that its weight underflows to
# exactly 0. On a fully masked row every entry equals `finfo.min` (a score of order 1 is far
# below the spacing of floats there, $2^{104} \approx 2 \cdot 10^{31}$ in float32), so the softmax
# is **uniform**: not zeros, not NaN. The convention lives in the mask, not in the function: our
# `scaled_dot_product_attention` gives the uniform row too, because no score is $-\infty$, and so
# does the built-in.

# %%
for dtype in (torch.float32, torch.float64):
    smallest = torch.finfo(dtype).min  # float32: about -3.4e38
    min_mask = torch.zeros(square.shape, dtype=dtype).masked_fill(~square, smallest)  # (B, 1, T, T)
    Q_m, K_m, V_m = (t.to(dtype) for t in (Q, K, V))
    context_min, attn_min = scaled_dot_product_attention(Q_m, K_m, V_m, mask=min_mask)
    assert not attn_min.isnan().any() and not context_min.isnan().any()
    # Rows with a key: exactly the weights of the -inf mask (blocked weights exactly 0).
    assert (attn_min.masked_select(full_rows & ~square) == 0).all()
    torch.testing.assert_close(attn_min[full_rows], attn_naive[full_rows].to(dtype))
    # Empty rows (queries 4 and 5 of sequence 1): uniform weights, the plain mean of the values.
    empty_weights = attn_min[1, 0, 4:]  # (2, T)
    assert (empty_weights == empty_weights[:, :1]).all()  # every key gets the same weight
    torch.testing.assert_close(empty_weights, torch.full((2, T), 1 / T, dtype=dtype))
    torch.testing.assert_close(context_min[1, 0, 4:], V_m[1, 0].mean(dim=0).expand(2, d_k))
    # The built-in, with the same float mask, gives the same context.
    torch.testing.assert_close(F.scaled_dot_product_attention(Q_m, K_m, V_m, attn_mask=min_mask),
                               context_min)
    print(f"{str(dtype):14s} finfo.min = {smallest:.3g}; empty rows' weights:",
          [round(w, 4) for w in empty_weights[0].tolist()])

# %% [markdown]
# **float16 is different.** Its `finfo.min` is only $-65504$, and floats there are $2^5 = 32$
# apart, so a score added to it is rounded to a multiple of 32: a score strictly between $-16$
# and $16$ disappears (the sum is $-65504$), a score of $16$ or more lands one step or more
# higher, and a score of $-16$ or below rounds to $-\infty$. Two entries one step apart differ in
# weight by a factor $e^{32} \approx 8 \cdot 10^{13}$, and float16 stores the smaller weight as 0.
# So in a fully masked row the weight goes, shared equally, to the keys whose sums are the row's
# highest:
#
# - every score strictly between $-16$ and $16$ (the common case, scores of order 1): all sums
#   are $-65504$, and the row is **uniform**, as in float32;
# - scores on both sides of $\pm 16$: only the highest sums share the weight, so one score of
#   16 or more among ordinary ones, or one ordinary score among scores of $-16$ or below, takes
#   all of it (**one-hot**);
# - every score $-16$ or below: the row is all $-\infty$ and its softmax is **NaN**. (Our
#   attention treats an all-$-\infty$ row as a query with no key: zeros.)
#
# **Check**, on four fully masked rows of scores computed in float16, one for each case (two for
# one-hot):

# %%
half_min = torch.finfo(torch.float16).min  # -65504
near_min = torch.tensor(half_min, dtype=torch.float16) + torch.tensor([-15.0, -16.0, -17.0],
                                                                       dtype=torch.float16)
print("float16: finfo.min + (-15, -16, -17) =", near_min.tolist())
assert near_min[0] == half_min and near_min[1:].isneginf().all()

half_rows = torch.tensor([[0.5, -1.25, 2.25],  # ordinary scores, all within (-16, 16)
                          [20.0, 0.5, -1.0],  # one score of 16 or more
                          [1.0, -20.0, -30.0],  # the others at -16 or below
                          [-17.0, -20.0, -30.0]], dtype=torch.float16)  # all at -16 or below
half_mask = torch.full_like(half_rows, half_min)  # every key blocked, finfo.min convention
half_softmax = (half_rows + half_mask).softmax(dim=-1)  # (4, 3)
# Ours on the same scores: Q = 1 and keys of width 1 make each score the key itself.
_, half_ours = scaled_dot_product_attention(
    torch.ones(4, 1, 1, dtype=torch.float16), half_rows.unsqueeze(-1),
    torch.eye(3, dtype=torch.float16).expand(4, 3, 3), mask=half_mask.unsqueeze(1))
for row in range(4):
    print(f"scores {half_rows[row].tolist()} + finfo.min -> {(half_rows + half_mask)[row].tolist()}: "
          f"softmax {[round(w, 4) for w in half_softmax[row].tolist()]}, "
          f"ours {[round(w, 4) for w in half_ours[row, 0].tolist()]}")
assert (half_softmax[0] == half_softmax[0, 0]).all() and abs(half_softmax[0, 0].item() - 1 / 3) < 1e-3
assert half_softmax[1].tolist() == [1.0, 0.0, 0.0] and half_softmax[2].tolist() == [1.0, 0.0, 0.0]
assert torch.equal(half_ours[:3, 0], half_softmax[:3])  # no -inf row: ours is the plain softmax
assert half_softmax[3].isnan().all() and (half_ours[3] == 0).all()  # NaN; ours: zeros

# %% jupyter={"source_hidden": true}
panels = [("$-\\infty$ + plain softmax: NaN", attn_naive[1, 0]),
          ("$-10^9$ + plain softmax: uniform", attn_big[1, 0]),
          ("ours: zero weights", attn_ours[1, 0].detach().cpu())]
cmap = plt.get_cmap("Blues").with_extremes(bad=COLORS["accent"])  # NaN cells are drawn in red
fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), sharey=True, layout="constrained")
for ax, (title, weights_2d) in zip(axes, panels, strict=True):
    plot_attention(weights_2d, ax=ax, cmap=cmap, vmax=1, colorbar=False, title=title,
                   annotate=True)
    for text in ax.texts:  # the annotated weights, larger than plot_attention's default
        text.set_fontsize(10)
    ax.add_patch(Rectangle((-0.5, 3.5), T, 2, fill=False, edgecolor="black", linewidth=2,
                           linestyle="--"))
    ax.set_xlabel("key position $j$")
    ax.set_ylabel("")
axes[0].set_ylabel("query position $i$")
fig.colorbar(axes[0].images[0], ax=axes, fraction=0.046, pad=0.04, label="attention weight")
fig.legend(handles=[Patch(color=COLORS["accent"], label="NaN"),
                    Patch(fill=False, edgecolor="black", linestyle="--",
                          label="padded queries: no key to attend to")],
           loc="outside lower center", ncols=2, fontsize=11)
fig.suptitle("Sequence 1 (length 4 of 6), causal mask & padded queries and keys: three answers to 0/0")
save_figure(fig, "05_fully_masked_row")
plt.show()

# %% [markdown]
# **A query with no key to attend to is $0/0$: naive code returns NaN that spreads through the
# gradients, while the course's attention returns zero weights and a zero context, which the loss
# and the later masks ignore.**
#
# ## 6 · Our convention against the built-ins'
#
# Masks in PyTorch come in two kinds, and the boolean kind does not mean the same thing
# everywhere:
#
# | where | argument | dtype | `True` means | shape it accepts |
# |---|---|---|---|---|
# | ours: `scaled_dot_product_attention`, `MultiHeadAttention` | `mask` | bool | **may attend** | broadcasts to $(B, h, T_q, T_k)$ |
# | `F.scaled_dot_product_attention` | `attn_mask` | bool | **may attend** | broadcasts to $(B, h, T_q, T_k)$ |
# | `nn.MultiheadAttention` | `attn_mask` | bool | **blocked** | $(T_q, T_k)$ or $(B \cdot h, T_q, T_k)$ |
# | `nn.MultiheadAttention` | `key_padding_mask` | bool | **padding (blocked)** | $(B, T_k)$ |
# | all of the above | a float mask | float | added to the scores: $0$ keeps, $-\infty$ blocks | as for bool |
#
# The `nn.Transformer*Layer` modules hand their masks to `nn.MultiheadAttention` and share its
# meaning. The float kind is the same everywhere, so the safe habit at a boundary with
# `nn.MultiheadAttention` is either `~mask` or a float mask.
#
# **Check, `F.scaled_dot_product_attention`:** our mask goes in as it is; `is_causal=True` is our
# causal mask; passing `~mask` gives something else. The mask is section 4's `combined`
# (causal, lengths 7 and 4), on the CPU.

# %%
g = torch.Generator().manual_seed(8)
Q_c, K_c, V_c = torch.randn(3, 2, 1, T_comb, d_k, generator=g)  # each (B, h=1, T, d_k), on the CPU

ours_context, ours_attn = scaled_dot_product_attention(Q_c, K_c, V_c, mask=combined)
torch.testing.assert_close(ours_context,
                           F.scaled_dot_product_attention(Q_c, K_c, V_c, attn_mask=combined))
torch.testing.assert_close(scaled_dot_product_attention(Q_c, K_c, V_c, mask=causal_mask(T_comb))[0],
                           F.scaled_dot_product_attention(Q_c, K_c, V_c, is_causal=True))
flipped = F.scaled_dot_product_attention(Q_c, K_c, V_c, attn_mask=~combined)
assert not torch.allclose(flipped.nan_to_num(), ours_context, atol=1e-3)

# %% [markdown]
# ### `is_causal` when there are more keys than queries
#
# `causal_mask(T)` is square, and so far $T_q = T_k$. A decoder that generates with a **KV cache**
# (notebook 12) breaks that: the keys and values of the $T_k - T_q$ earlier tokens are kept, and
# only the $T_q$ new tokens make queries. New query $i$ sits at position $i + (T_k - T_q)$, so it
# must see keys $0, \dots, i + T_k - T_q$: the triangle aligned to the **bottom-right** corner,
# $M_{ij} = [\, j \le i + T_k - T_q \,]$. `F.scaled_dot_product_attention(..., is_causal=True)`
# aligns it to the **top-left** instead, $M_{ij} = [\, j \le i \,]$, as if the queries were the
# first $T_q$ positions; PyTorch spells the other alignment
# `torch.nn.attention.bias.causal_lower_right(T_q, T_k)`. With the course's square mask you pick
# the alignment by slicing rows: `causal_mask(T_k)[..., -T_q:, :]` is the bottom-right one, the
# rows of the last $T_q$ positions.
#
# **Check:** a cache of 5 tokens and 3 new queries, so $T_q = 3$, $T_k = 8$. The bottom-right
# slice gives exactly the last three rows of the full causal pass (what a cached decoder must
# reproduce) and equals `causal_lower_right`; `is_causal=True` equals the top-left slice, and
# its answers differ from the full pass.

# %%
T_cache, T_new = 5, 3
T_all = T_cache + T_new  # T_k = 8 keys; T_q = 3 queries, at positions 5, 6, 7
g = torch.Generator().manual_seed(12)
Q_all, K_all, V_all = torch.randn(3, 1, 1, T_all, d_k, generator=g)  # each (1, h=1, T_k, d_k)
Q_new = Q_all[..., T_cache:, :]  # (1, 1, T_q, d_k): only the new tokens ask
full_pass, _ = scaled_dot_product_attention(Q_all, K_all, V_all, mask=causal_mask(T_all))

bottom_right = causal_mask(T_all)[..., -T_new:, :]  # (1, 1, T_q, T_k): j <= i + T_k - T_q
top_left = causal_mask(T_all)[..., :T_new, :]  # (1, 1, T_q, T_k): j <= i
cached, _ = scaled_dot_product_attention(Q_new, K_all, V_all, mask=bottom_right)
torch.testing.assert_close(cached, full_pass[..., T_cache:, :])  # the cache changes nothing
torch.testing.assert_close(
    F.scaled_dot_product_attention(Q_new, K_all, V_all, attn_mask=causal_lower_right(T_new, T_all)),
    cached)
builtin_causal = F.scaled_dot_product_attention(Q_new, K_all, V_all, is_causal=True)
torch.testing.assert_close(builtin_causal,
                           scaled_dot_product_attention(Q_new, K_all, V_all, mask=top_left)[0])
gap = (builtin_causal - full_pass[..., T_cache:, :]).abs().amax(dim=-1)  # (1, 1, T_q)
assert (gap > 1e-3).all()  # every new query reads the wrong keys
print("keys each new query sees: bottom-right", bottom_right.sum(dim=-1).flatten().tolist(),
      "top-left (is_causal=True)", top_left.sum(dim=-1).flatten().tolist())

# %% [markdown]
# **Check, `nn.MultiheadAttention`:** with one head and identity projections it computes exactly
# $\operatorname{softmax}(x x^\top / \sqrt{d})\, x$, so it must agree with ours on $Q = K = V = x$,
# outputs and weights, once its masks are flipped: `~combined` as `attn_mask`, or `~causal` plus
# `~padding` as `key_padding_mask`. Passing our masks unflipped is not an error; it is silently
# wrong. Where reading the mask the wrong way round leaves a row empty it is worse: the last
# query of a causal mask keeps every key, so read as "True = blocked" it keeps none, and gets whatever this torch gives an empty row
# (section 5).

# %%
mha = nn.MultiheadAttention(d_k, num_heads=1, bias=False, batch_first=True)
with torch.no_grad():
    mha.in_proj_weight.copy_(torch.eye(d_k).repeat(3, 1))  # W_q = W_k = W_v = I: (3 d_k, d_k)
    mha.out_proj.weight.copy_(torch.eye(d_k))  # W_o = I

x_seq = Q_c[:, 0]  # (B, 1, T, d_k) -> (B, T, d_k)
ours_x, ours_x_attn = scaled_dot_product_attention(x_seq, x_seq, x_seq, mask=combined[:, 0])

# One (B*h, T, T) attn_mask: (B, 1, T, T) -> (B*h, T, T) with h = 1, True = blocked.
out_a, weights_a = mha(x_seq, x_seq, x_seq, attn_mask=~combined.reshape(-1, T_comb, T_comb))
# Or a (T, T) causal attn_mask and a (B, T_k) key_padding_mask, both True = blocked.
out_b, weights_b = mha(x_seq, x_seq, x_seq, attn_mask=~causal_mask(T_comb)[0, 0],
                       key_padding_mask=~padding_mask(lengths_comb, T_comb)[:, 0, 0])
for out, weights_mha in [(out_a, weights_a), (out_b, weights_b)]:
    torch.testing.assert_close(out, ours_x)
    torch.testing.assert_close(weights_mha, ours_x_attn)

wrong, _ = mha(x_seq, x_seq, x_seq, attn_mask=causal_mask(T_comb)[0, 0])  # our mask, unflipped
# Query 0 reads keys 1..6 instead of key 0: finite, and far from our answer. (A NaN fails here,
# since every comparison with NaN is False.)
assert ((wrong[:, 0] - ours_x[:, 0]).abs().amax(dim=-1) > 1e-3).all()
# The last query may read every key, so the unflipped mask blocks it from all of them: a row
# with no key, which nn.MultiheadAttention (need_weights=True) sends through a plain softmax.
# Whatever this torch makes of it, NaN or numbers, it must not be our answer.
last_wrong = wrong[:, -1]  # (B, d_k)
assert last_wrong.isnan().all() or ((last_wrong - ours_x[:, -1]).abs().amax(dim=-1) > 1e-3).all()
print("unflipped causal mask, query 0 of sequence 0, largest error:",
      round((wrong[0, 0] - ours_x[0, 0]).abs().max().item(), 3))

# %% [markdown]
# **Check, float masks:** a float mask of $0$ (keep) and $-\infty$ (block) is added to the scores
# by all three, so the same float tensor gives the same answer everywhere, and the same answer as
# our boolean mask.
#
# The picture after this check spells one mask, that of sequence 1 of section 4 (causal, length
# 4 of 7), in the three ways.

# %%
additive = torch.zeros(combined.shape).masked_fill(~combined, float("-inf"))  # (B, 1, T, T)
torch.testing.assert_close(scaled_dot_product_attention(Q_c, K_c, V_c, mask=additive)[0],
                           ours_context)
torch.testing.assert_close(F.scaled_dot_product_attention(Q_c, K_c, V_c, attn_mask=additive),
                           ours_context)
out_float, _ = mha(x_seq, x_seq, x_seq, attn_mask=additive.reshape(-1, T_comb, T_comb))
torch.testing.assert_close(out_float, ours_x)
print(additive[1, 0])

# %% jupyter={"source_hidden": true}
spellings = [
    ("ours, F.scaled_dot_product_attention\nbool: True = may attend", combined[1, 0], "bool"),
    ("nn.MultiheadAttention attn_mask\nbool: True = blocked", ~combined[1, 0], "bool"),
    ("any of them, float mask\nadded to the scores", additive[1, 0], "float"),
]
fig, axes = plt.subplots(1, 3, figsize=(13, 4.6), sharey=True, layout="constrained")
for ax, (title, spelled, kind) in zip(axes, spellings, strict=True):
    allowed_2d = combined[1, 0]
    image = draw_mask(ax, allowed_2d, title)  # colour = what the mask means, the same in all
    for i in range(T_comb):
        for j in range(T_comb):
            if kind == "bool":
                text = "T" if spelled[i, j] else "F"
            else:
                text = "0" if spelled[i, j] == 0 else r"$-\infty$"
            ax.text(j, i, text, ha="center", va="center", fontsize=11,
                    color="white" if allowed_2d[i, j] else "#444444")
for ax in axes[1:]:
    ax.set_ylabel("")
mask_colorbar(fig, image, axes, show_bool=False)  # colour = meaning, whatever the spelling
fig.suptitle("One mask, three spellings (colour: what it means; text: what you pass)",
             fontsize=13, y=1.05)  # clear of the two-line panel titles
save_figure(fig, "05_mask_conventions")
plt.show()


# %% [markdown]
# **Booleans mean "may attend" for us and for `F.scaled_dot_product_attention`, but "blocked"
# for `nn.MultiheadAttention`: flip with `~` at that boundary, or pass a float mask, which means
# the same everywhere.**
#
# ## Recap
#
# | concept | code | shape |
# |---|---|---|
# | a mask | bool, True = may attend; blocked scores become $-\infty$ | broadcasts to $(B, h, T_q, T_k)$ |
# | causal mask (decoder self-attention) | `causal_mask(T, device)` | $(1, 1, T, T)$ |
# | padding mask (encoder, cross-attention) | `padding_mask(lengths, T_k)` | $(B, 1, 1, T_k)$ |
# | decoder self-attention on a padded batch | `causal_mask(T) & padding_mask(lengths, T)` | $(B, 1, T, T)$ |
# | query with no key | `scaled_dot_product_attention` returns zero weights and context | row of $(\dots, T_q, T_k)$ |
# | `nn.MultiheadAttention` | `attn_mask=~mask.expand(B, h, T_q, T_k).reshape(B * h, T_q, T_k)` (exercise 3) or `~causal[0, 0]`; `key_padding_mask=~pad[:, 0, 0]` | $(B \cdot h, T_q, T_k)$ or $(T_q, T_k)$; $(B, T_k)$ |
# | float mask, any API | `zeros.masked_fill(~mask, -inf)` | as the bool mask |
# | float mask with `torch.finfo(dtype).min` | a query with no key gets *uniform* weights in float32/64; in float16 the keys whose score plus `finfo.min` rounds highest share them: uniform when all scores lie strictly within $\pm 16$, NaN when all are $\le -16$ | as the bool mask |
# | causal with a KV cache ($T_q < T_k$) | `causal_mask(T_k)[..., -T_q:, :]` (bottom-right); not `is_causal=True` (top-left) | $(1, 1, T_q, T_k)$ |
#
# ## Exercises
#
# 1. **Sliding window.** Build a causal mask in which query $i$ sees only the last $w$ keys,
#    $i - w < j \le i$ (a window of $w$ keys, like the sliding-window attention of Mistral,
#    Jiang et al., 2023, whose paper counts the window's edge differently; Longformer's
#    window, Beltagy et al., 2020, is the symmetric kind, $w/2$ keys on each side of $i$). How many
#    keys does each query see?
# 2. **Left padding.** Prompts for batched generation are padded on the left. Build the
#    combined causal and left-padding mask for lengths $(5, 2)$ and $T = 5$, predict which queries
#    have no key, and check what our attention returns for them.
# 3. **Many heads in `nn.MultiheadAttention`.** Its 3-D `attn_mask` has shape
#    $(B \cdot h, T_q, T_k)$. Turn our $(B, 1, T, T)$ mask into it for $h = 2$ heads, and check it
#    against passing the causal part as `attn_mask` and the padding part as `key_padding_mask`.
#
# **Solutions.**
#
# 1. Keep the causal triangle and drop what lies $w$ or more below the diagonal. Query $i$ sees
#    $\min(i + 1, w)$ keys.

# %%
def sliding_window_mask(T, w, device=None):
    """(1, 1, T, T) bool: query i may attend to keys i - w + 1 .. i."""
    recent = torch.ones(T, T, dtype=torch.bool, device=device).triu(-(w - 1))  # j >= i - w + 1
    return causal_mask(T, device=device) & recent


T_window, w = 8, 3
window = sliding_window_mask(T_window, w)
expected_window = torch.tensor([[i - w < j <= i for j in range(T_window)] for i in range(T_window)])
assert torch.equal(window[0, 0], expected_window)
assert window[0, 0].sum(dim=-1).tolist() == [min(i + 1, w) for i in range(T_window)]
print(window[0, 0].int())

# %% [markdown]
# 2. Left padding is the padding mask flipped along the keys. A sequence of length $\ell$ starts
#    at column $T - \ell$, and a causal query $i < T - \ell$ sees only padding: for lengths
#    $(5, 2)$ that is queries 0, 1 and 2 of sequence 1. Our attention gives them zero weights and
#    a zero context, and the real queries of the short sequence give what they would alone.

# %%
T_left, lengths_left = 5, torch.tensor([5, 2])
left = causal_mask(T_left) & padding_mask(lengths_left, T_left).flip(-1)  # (B, 1, T, T)
assert (~left.any(dim=-1))[1, 0].nonzero().flatten().tolist() == [0, 1, 2]

g = torch.Generator().manual_seed(9)
Q_left, K_left, V_left = torch.randn(3, 2, 1, T_left, d_k, generator=g)  # each (B, h=1, T, d_k)
context_left, attn_left = scaled_dot_product_attention(Q_left, K_left, V_left, mask=left)
assert (attn_left[1, 0, :3] == 0).all() and (context_left[1, 0, :3] == 0).all()
alone_context, _ = scaled_dot_product_attention(Q_left[1:, :, 3:], K_left[1:, :, 3:],
                                                V_left[1:, :, 3:], mask=causal_mask(2))
torch.testing.assert_close(context_left[1:, :, 3:], alone_context)
print(attn_left[1, 0].round(decimals=3))

# %% [markdown]
# 3. Repeat the mask for each head, in the order `nn.MultiheadAttention` lays them out (batch
#    major, then head), and flip it: $(B, 1, T, T) \to (B, h, T, T) \to (B \cdot h, T, T)$.

# %%
h, d_mha = 2, 8  # two heads; the mask is section 4's `combined`, (B, 1, T, T) with T = 7
mha_mask = ~combined.expand(B, h, T_comb, T_comb).reshape(B * h, T_comb, T_comb)  # True = blocked

set_seed(0)
mha2 = nn.MultiheadAttention(d_mha, num_heads=h, batch_first=True)
x_two = torch.randn(B, T_comb, d_mha, generator=torch.Generator().manual_seed(10))
out_3d, w_3d = mha2(x_two, x_two, x_two, attn_mask=mha_mask, average_attn_weights=False)
out_split, w_split = mha2(x_two, x_two, x_two, attn_mask=~causal_mask(T_comb)[0, 0],
                          key_padding_mask=~padding_mask(lengths_comb, T_comb)[:, 0, 0],
                          average_attn_weights=False)
torch.testing.assert_close(out_3d, out_split)
torch.testing.assert_close(w_3d, w_split)
assert (w_3d.masked_select(~combined.expand(B, h, T_comb, T_comb)) == 0).all()  # (B, h, T, T)
print(w_3d[1, 0].detach().round(decimals=3))

# %% [markdown]
# Next: [06 · Layer norm and dropout](06_layer_norm_and_dropout.ipynb), the two small pieces that sit
# around every attention and feed-forward block.
