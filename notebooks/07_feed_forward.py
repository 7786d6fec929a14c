# %% [markdown]
# # 07 · The feed-forward network
#
# **What you will build:** the second sublayer of every Transformer block, the position-wise
# feed-forward network (FFN): two linear maps with a nonlinearity between them, applied to every
# position on its own. You will write the builder that the encoder and decoder blocks of notebook
# 08 use, show that it really treats positions independently (by perturbation, by its Jacobian
# and as a 1×1 convolution), count where a block's parameters live, compare ReLU with GELU, and
# build the gated variant (SwiGLU/GEGLU) that most recent language models use instead.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/07_feed_forward.ipynb) · Assumes: [02 · Self-attention](02_self_attention.ipynb) and [03 · Multi-head attention](03_multi_head_attention.ipynb) (what attention computes and its four projections), [06 · Layer norm and dropout](06_layer_norm_and_dropout.ipynb) (the `layers` module this notebook adds to, and the colours of a layer's parts).

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
import re
import warnings
from contextlib import contextmanager

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.utils import PART_COLORS, add_to_class, get_device, save_figure, set_seed

set_seed(0)
device = get_device()
# colours of the sub-layers (notebook 06's PART_COLORS) and of the three activations
RELU_COLOR, GELU_COLOR, SILU_COLOR = "black", "#8c564b", "#e7ba52"  # black, brown, gold
ATTENTION_COLOR, FFN_COLOR, LAYER_NORM_COLOR = PART_COLORS["attention"], PART_COLORS["ffn"], PART_COLORS["layer_norm"]

# %% [markdown]
# ## Why a block needs a second sublayer
#
# Self-attention moves information *between* positions. For fixed attention weights
# $\alpha_{ij}$ (notebooks 01–02), the output at position $i$ is $\sum_j \alpha_{ij}\, v_j$: a
# weighted average of value vectors, which are themselves linear maps of the inputs. The
# softmax only computes the weights; the vectors being averaged pass through nothing but matrices.
#
# The feed-forward sublayer does the complementary job. It transforms the vector *at* each
# position, through a nonlinearity, and never looks at the neighbours. Vaswani et al. (2017, §3.3)
# define it as
#
# $$\mathrm{FFN}(x) = \max(0,\; x W_1 + b_1)\, W_2 + b_2,
# \qquad W_1 \in \mathbb{R}^{d_\text{model} \times d_{ff}},\;
# W_2 \in \mathbb{R}^{d_{ff} \times d_\text{model}},$$
#
# with $d_\text{model} = 512$ and a hidden width $d_{ff} = 2048$ in the base model: the vector is
# widened fourfold, passed through a ReLU, and projected back. The same $W_1, b_1, W_2, b_2$
# are used at every position $t$ of a sequence $x \in \mathbb{R}^{T \times d_\text{model}}$ (each
# layer has its own). In short: **attention mixes across positions, the FFN transforms within a
# position.**
#
# Everything this notebook exports goes into the `layers` module, next to notebook 06's
# `LayerNorm`:

# %%
#| default_exp layers

# %% [markdown]
# ## The activation: ReLU and GELU
#
# The paper's nonlinearity is the rectifier $\mathrm{ReLU}(x) = \max(0, x)$. BERT and GPT
# replaced it with the Gaussian error linear unit (Hendrycks and Gimpel, 2016),
#
# $$\mathrm{GELU}(x) = x\,\Phi(x), \qquad \Phi(x) = \tfrac12\bigl(1 + \operatorname{erf}(x/\sqrt2)\bigr),$$
#
# where $\Phi$ is the standard normal CDF: the input is kept with the probability that a standard
# normal variable falls below it. It is a smooth ReLU: close to $x$ for large $x$, close to $0$
# for very negative $x$, with a small dip below zero in between. Some implementations
# use instead the tanh approximation from the same paper,
#
# $$\mathrm{GELU}(x) \approx \tfrac12\, x \Bigl(1 + \tanh\bigl(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\bigr)\Bigr).$$
#
# The builder takes the activation by name, so a block can say `activation="gelu"`. It also knows
# SiLU, $x\,\sigma(x)$ (Swish with $\beta = 1$), which the gated variant at the end uses.
#
# The default is ReLU, as in the paper and in PyTorch (`nn.TransformerEncoderLayer`), everywhere
# in the course: here, in notebook 08's blocks, in notebook 10's stacks and in the model's
# configuration, so a block built on its own is the block the model builds.

# %%
#| export
import torch
from torch import nn

from transformer_from_scratch.checks import (
    check_bool,
    check_choice,
    check_int,
    check_probability,
    check_tensor,
    checking,
)

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}  # the names a block accepts


def get_activation(name: str) -> nn.Module:
    """A new activation module by name: "relu", "gelu" or "silu"."""
    return ACTIVATIONS[check_choice("activation", name, list(ACTIVATIONS))]()


# %% [markdown]
# Both GELU formulas, written out from the definitions above (teaching versions; the modules use
# PyTorch's `nn.GELU`):

# %%
def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    phi = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # standard normal CDF
    return x * phi


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1.0 + torch.tanh(inner))


# %% [markdown]
# **Check:** our formulas against PyTorch's `F.gelu` (exact, and `approximate="tanh"`), and
# `get_activation` against the built-in modules. Then: how far apart are the exact GELU and its
# approximation?

# %%
xs = torch.arange(-1200, 1201, dtype=torch.float64) * 0.005  # -6 to 6, step 0.005, x = 0 exactly
assert_close(gelu_exact(xs), F.gelu(xs))
assert_close(gelu_tanh(xs), F.gelu(xs, approximate="tanh"))
assert isinstance(get_activation("relu"), nn.ReLU) and isinstance(get_activation("gelu"), nn.GELU)
assert_close(get_activation("gelu")(xs), gelu_exact(xs))
assert_close(get_activation("silu")(xs), xs * torch.sigmoid(xs))

gap = (gelu_exact(xs) - gelu_tanh(xs)).abs()
i_min = gelu_exact(xs).argmin()
print(f"max |exact - tanh approximation| = {gap.max().item():.1e} at |x| = {xs[gap.argmax()].abs().item():.2f}")
print(f"GELU's minimum: {gelu_exact(xs)[i_min].item():.4f} at x = {xs[i_min].item():.3f}")
assert gap.max() < 5e-4  # the bound the next paragraph states
assert -0.18 < gelu_exact(xs).min() < -0.16


# %% [markdown]
# On the grid from $-6$ to $6$ the approximation is off by less than $5 \cdot 10^{-4}$ (asserted),
# most near $|x| = 2.7$ (the right panel of the figure below): small but not zero, so
# swapping one for the other in a trained model changes its outputs a little; run a model with
# the variant it was trained with.
#
# The derivatives tell the real difference. ReLU's gradient is a step: exactly zero for every
# negative input, so a unit whose pre-activation is negative for all inputs gets a zero gradient
# on every input, and the loss's gradient never changes its incoming weights again (a "dead"
# unit; weight decay, which notebook 13's AdamW applies, still shrinks them towards zero).
# GELU's derivative, $\Phi(x) + x\,\varphi(x)$ with $\varphi$ the normal density, is smooth and
# slightly negative below $x \approx -0.75$.
#
# At $x = 0$ ReLU has no derivative, and PyTorch's autograd takes it to be 0. The grid holds
# $x = 0$ exactly, so the check below covers that point too: a ReLU written with `t >= 0`, whose
# autograd derivative at 0 is 1, fails it.
#
# **Check:** autograd agrees with both derivatives.

# %%
def derivative(fn, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(x).sum(), x)  # elementwise fn: d(sum)/dx_i = fn'(x_i)
    return grad


normal_pdf = torch.exp(-0.5 * xs**2) / math.sqrt(2 * math.pi)
normal_cdf = 0.5 * (1 + torch.erf(xs / math.sqrt(2)))
assert_close(derivative(F.gelu, xs), normal_cdf + xs * normal_pdf)
assert_close(derivative(F.relu, xs), (xs > 0).double())  # PyTorch takes ReLU'(0) = 0 ...
assert (xs == 0).sum() == 1 and derivative(F.relu, xs)[xs == 0].item() == 0.0  # ... on the grid


def relu_one_at_zero(t: torch.Tensor) -> torch.Tensor:
    """The same function as ReLU, but with ReLU'(0) = 1: the check above must reject it."""
    return torch.where(t >= 0, t, torch.zeros_like(t))


assert torch.equal(relu_one_at_zero(xs), F.relu(xs))  # equal values ...
assert not torch.allclose(derivative(relu_one_at_zero, xs), (xs > 0).double())  # ... caught at 0
print("GELU'(-2), GELU'(0), GELU'(2):",
      [round(v, 4) for v in derivative(F.gelu, torch.tensor([-2.0, 0.0, 2.0])).tolist()])

# %% jupyter={"source_hidden": true}
fig, (ax_f, ax_d, ax_gap) = plt.subplots(1, 3, figsize=(14, 3.8))
x_plot = torch.linspace(-4, 4, 801, dtype=torch.float64)
curves = [  # activations are variants, not parts: black, brown, gold (setup cell)
    ("ReLU", F.relu, dict(color=RELU_COLOR, lw=2)),
    ("GELU  $x\\Phi(x)$", F.gelu, dict(color=GELU_COLOR, lw=2)),
    ("SiLU  $x\\sigma(x)$", F.silu, dict(color=SILU_COLOR, lw=2, ls=":")),
]
for label, fn, style in curves:
    ax_f.plot(x_plot, fn(x_plot), label=label, **style)
    ax_d.plot(x_plot, derivative(fn, x_plot), label=label, **style)
# The tanh approximation would hide under the exact GELU at this scale: plot the difference.
ax_gap.plot(x_plot, (gelu_exact(x_plot) - gelu_tanh(x_plot)) * 1e4, color=GELU_COLOR, lw=2)
ax_f.set(title="Activations", xlabel="pre-activation $x$", ylabel="output", ylim=(-0.6, 4))
ax_d.set(title="Their derivatives (autograd)", xlabel="pre-activation $x$",
         ylabel="d output / d$x$", ylim=(-0.2, 1.2))
ax_gap.set(title="GELU: exact minus its tanh approximation", xlabel="pre-activation $x$",
           ylabel="exact $-$ tanh approximation ($\\times 10^{-4}$)")
for ax in (ax_f, ax_d, ax_gap):
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.grid(alpha=0.3)
for ax in (ax_f, ax_d):  # the third panel has one curve, named by its title and axis label
    ax.legend(loc="upper left", fontsize=9)
fig.tight_layout()
save_figure(fig, "ffn_activations")
plt.show()


# %% [markdown]
# **ReLU cuts negative inputs to zero and its gradient with them; GELU (and SiLU) bend smoothly,
# pass a little negative signal, and keep a nonzero gradient around zero.**
#
# ## The builder
#
# The FFN is three modules in a row, so the course builds it as an `nn.Sequential`: `ffn[0]` the
# widening `nn.Linear(d_model, d_ff)`, `ffn[1]` the activation, `ffn[2]` the
# `nn.Linear(d_ff, d_model)` back. That layout is a contract: notebook 08's blocks hold exactly
# this as `ffn`, and copying weights into `nn.TransformerEncoderLayer` reads `ffn[0]` and `ffn[2]`.
#
# Where does dropout go? The paper drops each sublayer's *output* before the residual addition
# (§5.4), and our blocks do that themselves, so the default here is no dropout at all. For an FFN
# used on its own, `dropout_p > 0` appends an `nn.Dropout` as `ffn[3]`, on the output, leaving
# `ffn[0..2]` as they are. (PyTorch's `nn.TransformerEncoderLayer` also drops the hidden
# activations, between `ffn[1]` and `ffn[2]`; the paper does not describe that and we leave it out.)

# %%
#| export
def feed_forward(
    d_model: int, d_ff: int, activation: str = "relu", dropout_p: float = 0.0, bias: bool = True
) -> nn.Sequential:
    """The position-wise FFN: Sequential(Linear d_model->d_ff, activation, Linear d_ff->d_model)."""
    d_model, d_ff = check_int("d_model", d_model, minimum=1), check_int("d_ff", d_ff, minimum=1)
    check_probability("dropout_p", dropout_p)
    check_bool("bias", bias)
    layers = [
        nn.Linear(d_model, d_ff, bias=bias),  # widen: (..., d_model) -> (..., d_ff)
        get_activation(activation),
        nn.Linear(d_ff, d_model, bias=bias),  # back: (..., d_ff) -> (..., d_model)
    ]
    if dropout_p > 0:
        layers.append(nn.Dropout(dropout_p))  # on the sublayer output, as ffn[3]
    return nn.Sequential(*layers)


# %% [markdown]
# The paper's base FFN:

# %%
print(feed_forward(d_model=512, d_ff=2048))

# %% [markdown]
# **Check:** the layout, the shapes for any number of leading dimensions, and the formula itself,
# $\max(0, xW_1 + b_1)W_2 + b_2$, written with the weights of the module.
#
# > **Orientation.** The paper multiplies row vectors from the right, $y = xW$, so
# > $W_1 \in \mathbb{R}^{d_\text{model} \times d_{ff}}$. An `nn.Linear` stores its matrix as
# > `(out, in)`, which is $W^\top$: the paper's $W_1$ is `ffn[0].weight.T` and its $W_2$ is
# > `ffn[2].weight.T`. The rest of the notebook uses this without saying it again.

# %%
d_model, d_ff = 16, 64
ffn = feed_forward(d_model, d_ff).to(device)
assert [type(m) for m in ffn] == [nn.Linear, nn.ReLU, nn.Linear]
ffn_dropout = feed_forward(8, 32, activation="gelu", dropout_p=0.1)
assert type(ffn_dropout[3]) is nn.Dropout and ffn_dropout[3].p == 0.1  # the p asked for
with torch.random.fork_rng(devices=[]):  # leaves the global random stream as it was
    ffn_gelu = feed_forward(8, 32, activation="gelu")  # the activation argument is used, not just checked
    x_gelu = torch.randn(3, 8)  # (N, d_model)
assert type(ffn_gelu[1]) is nn.GELU
assert_close(ffn_gelu(x_gelu), F.gelu(ffn_gelu[0](x_gelu)) @ ffn_gelu[2].weight.T + ffn_gelu[2].bias)

x = torch.randn(2, 5, d_model).to(device)  # (B, T, d_model)
y = ffn(x)  # (B, T, d_model) -> (B, T, d_ff) -> (B, T, d_model)
assert y.shape == x.shape
assert ffn(x[0, 0]).shape == (d_model,) and ffn(torch.randn(3, 2, 4, d_model).to(device)).shape == (3, 2, 4, d_model)

W_1, b_1 = ffn[0].weight.T, ffn[0].bias  # (d_model, d_ff), (d_ff,)
W_2, b_2 = ffn[2].weight.T, ffn[2].bias  # (d_ff, d_model), (d_model,)
assert_close(y, torch.clamp(x @ W_1 + b_1, min=0) @ W_2 + b_2)
print(tuple(x.shape), "->", tuple(ffn[1](ffn[0](x)).shape), "->", tuple(y.shape))

# %% [markdown]
# Bad sizes, a dropout probability outside $[0, 1)$ and unknown activations fail when the module is
# built, with a message that names the value:

# %%
for bad in [dict(d_model=0, d_ff=8), dict(d_model=8, d_ff=-1), dict(d_model=8, d_ff=32, dropout_p=1.0),
            dict(d_model=8, d_ff=32, activation="tanh")]:
    try:
        feed_forward(**bad)
    except ValueError as err:
        print(f"ValueError: {err}")
    else:
        raise AssertionError(f"{bad} was accepted")

# %% [markdown]
# ### What the FFN computes: a key–value memory
#
# Regroup the formula by hidden unit. Write $k_i$ for column $i$ of $W_1$ and $v_i$ for row $i$
# of $W_2$; then
#
# $$\mathrm{FFN}(x) = \sum_{i=1}^{d_{ff}} \underbrace{\max(0,\; x \cdot k_i + b_{1,i})}_{\text{how well } x \text{ matches key } i}\; v_i \;+\; b_2 .$$
#
# Each of the $d_{ff}$ hidden units holds a *key* $k_i$, a pattern it compares the input with,
# and a *value* $v_i$, a vector it adds to the output in proportion to the match; the ReLU keeps
# only positive matches. Geva et al. (2021), "Transformer Feed-Forward Layers Are Key-Value
# Memories", read a trained language model this way: its keys correlate with human-readable
# patterns in the text (shallow ones, such as a shared last word, in the lower layers; more
# semantic ones, such as a topic, in the upper layers), and its values, particularly in the upper
# layers, raise the probability of the tokens likely to follow the pattern. In that reading $d_{ff}$ is the number of memories a block holds: 2048 in the
# paper's base model, four times the width of the vector that reads them. The nonlinearity is
# what makes them separate memories: without it the sum collapses into one $d \times d$ linear
# map, whatever $d_{ff}$ is (exercise 2 shows it).
#
# The regrouping is the formula of the check above, summed unit by unit; the cell below computes
# it with the module's own weights (`ffn[0].weight` holds the keys as rows, `ffn[2].weight` the
# values as columns) to make the reading concrete, not to test new code.

# %%
memory_draws = torch.Generator().manual_seed(7)  # its own stream: later cells do not depend on it
x_memory = torch.randn(5, d_model, generator=memory_draws).to(device)  # 5 positions, (N, d_model)
keys, values = ffn[0].weight, ffn[2].weight.T  # (d_ff, d_model) each: key i, value i in row i
match = torch.relu(x_memory @ keys.T + ffn[0].bias)  # (N, d_ff): how strongly each key fires
memory_read = sum(match[:, i, None] * values[i] for i in range(d_ff)) + ffn[2].bias  # (N, d_model)
assert_close(memory_read, ffn(x_memory), rtol=1e-5, atol=1e-5)
print(f"{d_ff} keys and {d_ff} values, each of length {d_model}; the sum of the {d_ff} weighted "
      f"values is the FFN's output")

# %% [markdown]
# **The FFN is two `nn.Linear`s around an activation, widening `d_model` to `d_ff` and back, the
# same for every position.**
#
# ## Position-wise: what "independently" means
#
# Because the same function is applied to each row of $x \in \mathbb{R}^{T \times d_\text{model}}$,
#
# $$y_t = \mathrm{FFN}(x_t) \quad\Longrightarrow\quad
# \frac{\partial y_t}{\partial x_s} = 0 \;\; (s \ne t), \qquad
# \frac{\partial y_t}{\partial x_t} = W_2^\top \operatorname{diag}\bigl(\mathbb{1}[x_t W_1 + b_1 > 0]\bigr) W_1^\top.$$
#
# (With the orientation above, the diagonal block in code is
# `ffn[2].weight @ diag(.) @ ffn[0].weight`: no `.T`.)
#
# The Jacobian of the whole sequence map, a $(T d_\text{model}) \times (T d_\text{model})$ matrix,
# is block-diagonal. Four demonstrations make this concrete. They hold for any stack of `Linear`,
# an elementwise function and `Linear`, so they exercise PyTorch's layers rather than test our
# builder (the comparison with the formula above is that test); what they show is what
# "position-wise" means:
#
# 1. change every position except $t$: $y_t$ does not move;
# 2. apply the FFN to each position alone, in a loop: same result as the batched call;
# 3. permute the positions: the outputs are permuted the same way (the FFN is permutation
#    equivariant, like attention without positional encodings, notebook 02);
# 4. the Jacobian's off-diagonal blocks are exactly zero and its diagonal blocks match the formula.

# %%
B, T = 2, 6
x = torch.randn(B, T, d_model).to(device)
y = ffn(x)

# 1. Perturb every position but t.
t = 2
x_other = x.clone()
others = [s for s in range(T) if s != t]
x_other[:, others] += 10 * torch.randn(B, T - 1, d_model).to(device)
y_other = ffn(x_other)
assert_close(y_other[:, t], y[:, t])
assert not torch.allclose(y_other[:, others], y[:, others])

# 2. One position at a time.
y_loop = torch.stack([ffn(x[:, s]) for s in range(T)], dim=1)  # T x (B, d_model) -> (B, T, d_model)
assert_close(y_loop, y)

# 3. Permutation equivariance, for a fixed permutation that moves every position (a random one
# could be the identity, which would test nothing).
perm = torch.arange(T).flip(0)  # (T,): 5, 4, 3, 2, 1, 0
assert_close(ffn(x[:, perm]), y[:, perm])
print("perturbation, per-position loop and permutation: as position-wise predicts")

# %% [markdown]
# For the Jacobian we take one sequence, $x \in \mathbb{R}^{T \times d_\text{model}}$, and let
# autograd differentiate all $T d_\text{model}$ outputs with respect to all $T d_\text{model}$
# inputs.

# %%
x_seq = x[0]  # (T, d_model)
J = torch.autograd.functional.jacobian(ffn, x_seq)  # (T, d_model, T, d_model): dy[t, i] / dx[s, j]
blocks = J.permute(0, 2, 1, 3)  # (T, T, d_model, d_model): block (t, s) = dy_t / dx_s

off_diagonal = ~torch.eye(T, dtype=torch.bool, device=device)
assert torch.count_nonzero(blocks[off_diagonal]) == 0  # exactly zero, not just small

for t in range(T):
    active = (ffn[0](x_seq[t]) > 0).to(x_seq.dtype)  # which of the d_ff ReLUs pass, (d_ff,)
    analytic = ffn[2].weight @ torch.diag(active) @ ffn[0].weight  # W_2^T diag(.) W_1^T, (d_model, d_model)
    assert_close(blocks[t, t], analytic)
# The diagonal blocks differ from one another (next paragraph): no two positions share one.
assert all(not torch.equal(blocks[t, t], blocks[s, s]) for t in range(T) for s in range(t))
print(f"Jacobian {tuple(J.shape)}: {int(off_diagonal.sum())} off-diagonal blocks, all exactly zero; "
      f"the {T} diagonal blocks all differ")

# %% [markdown]
# The diagonal blocks are not equal to each other (asserted above): each depends on which ReLUs
# $x_t$ switches on.
# The *function* is shared across positions; its local linearisation is not, which is the point of
# having a nonlinearity.
#
# For contrast, the same Jacobian for a self-attention layer (PyTorch's `nn.MultiheadAttention`
# with one head; notebook 03 builds our own). Every output position depends on every input
# position, so no block is zero:

# %%
attention = nn.MultiheadAttention(d_model, num_heads=1, batch_first=True).to(device)


def self_attention(x_seq: torch.Tensor) -> torch.Tensor:
    x_b = x_seq.unsqueeze(0)  # (T, d_model) -> (1, T, d_model)
    return attention(x_b, x_b, x_b, need_weights=False)[0].squeeze(0)  # (T, d_model)


J_attn = torch.autograd.functional.jacobian(self_attention, x_seq)  # (T, d_model, T, d_model)
block_norm_ffn = torch.linalg.matrix_norm(blocks)  # (T, T) Frobenius norm of each block
block_norm_attn = torch.linalg.matrix_norm(J_attn.permute(0, 2, 1, 3))  # (T, T)
assert (block_norm_attn > 0).all()
print(f"nonzero (t, s) blocks: FFN {int((block_norm_ffn > 0).sum())} of {T * T} "
      f"| self-attention {int((block_norm_attn > 0).sum())} of {T * T}")  # one string, one write

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.6))
cmap = plt.get_cmap("viridis").with_extremes(bad="#e6e6e6")  # exact zeros drawn light grey
for ax, jac, name in [(axes[0], J, "position-wise FFN"), (axes[1], J_attn, "self-attention")]:
    magnitude = jac.reshape(T * d_model, T * d_model).abs().cpu()
    image = ax.imshow(magnitude.masked_fill(magnitude == 0, float("nan")), cmap=cmap)
    for k in range(1, T):  # block boundaries between positions
        ax.axhline(k * d_model - 0.5, color="grey", lw=0.5)
        ax.axvline(k * d_model - 0.5, color="grey", lw=0.5)
    ticks = [k * d_model + d_model / 2 - 0.5 for k in range(T)]
    ax.set_xticks(ticks, [f"$x_{k}$" for k in range(T)])
    ax.set_yticks(ticks, [f"$y_{k}$" for k in range(T)])
    ax.set(title=f"|Jacobian| of {name}", xlabel="input position (each block: d_model features)",
           ylabel="output position")
    fig.colorbar(image, ax=ax, fraction=0.046, label="|∂ output / ∂ input| (grey: exactly 0)")
fig.tight_layout()
save_figure(fig, "ffn_jacobian")
plt.show()

# %% [markdown]
# **The FFN's Jacobian is block-diagonal: $y_t$ depends on $x_t$ alone. All exchange between
# positions happens in attention.**
#
# ## The same thing as a 1×1 convolution
#
# The paper describes the FFN in a second way: "two convolutions with kernel size 1" (Vaswani et
# al., 2017, §3.3). A 1-D convolution slides a kernel along the sequence; with kernel size 1 the
# kernel sees a single position, so it is a `Linear` applied at each position, which is what we
# have. `nn.Conv1d` wants channels before time, `(B, d_model, T)`, and stores its kernel as
# `(out, in, 1)`. A demonstration (it holds for any such pair of layers, not only ours): with
# the FFN's weights copied in, the convolutional version gives the same outputs and the same
# gradients. They are computed with `torch.autograd.grad`, which returns them instead of adding
# them to `.grad`, so running the cell again gives the same numbers. (The comparison runs inside
# `with full_float32():`, which matters only on recent NVIDIA GPUs; Appendix B says why.)

# %%
conv_ffn = nn.Sequential(
    nn.Conv1d(d_model, d_ff, kernel_size=1),
    nn.ReLU(),
    nn.Conv1d(d_ff, d_model, kernel_size=1),
).to(device)
with torch.no_grad():
    for conv, linear in [(conv_ffn[0], ffn[0]), (conv_ffn[2], ffn[2])]:
        conv.weight.copy_(linear.weight.unsqueeze(-1))  # (out, in) -> (out, in, 1)
        conv.bias.copy_(linear.bias)


@contextmanager
def full_float32():
    """Switch TF32 off for matrix products and cuDNN convolutions; restore the flags after."""
    with warnings.catch_warnings():  # torch 2.9, for one, announces these flags' deprecation (Appendix B)
        warnings.filterwarnings("ignore", message="Please use the new API settings", category=UserWarning)
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


x_grad = x.clone().requires_grad_(True)
x_conv = x.clone().requires_grad_(True)
with full_float32():
    y_lin = ffn(x_grad)  # (B, T, d_model)
    y_conv = conv_ffn(x_conv.transpose(1, 2)).transpose(1, 2)  # (B, T, d) -> (B, d, T) -> (B, T, d)
    grads_lin = torch.autograd.grad(y_lin.square().sum(), [x_grad, ffn[0].weight])
    grads_conv = torch.autograd.grad(y_conv.square().sum(), [x_conv, conv_ffn[0].weight])
assert_close(y_conv, y_lin, rtol=1e-5, atol=1e-5)
assert_close(grads_conv[0], grads_lin[0], rtol=1e-5, atol=1e-5)  # d/dx
assert_close(grads_conv[1].squeeze(-1), grads_lin[1], rtol=1e-5, atol=1e-5)  # d/dW_1
print("1x1 convolution == position-wise FFN (outputs and gradients)")


# %% [markdown]
# **A position-wise FFN is a pair of kernel-size-1 convolutions: same weights, same numbers.**
#
# ## Where the parameters live
#
# Count the parameters of one block's two sublayers, with $d = d_\text{model}$:
#
# | sublayer | weights | biases | total |
# |---|---|---|---|
# | attention: $W_q, W_k, W_v, W_o$, each $d \times d$ | $4d^2$ | $4d$ | $4d^2 + 4d$ |
# | FFN: $W_1$ ($d \times d_{ff}$), $W_2$ ($d_{ff} \times d$) | $2\, d\, d_{ff}$ | $d_{ff} + d$ | $2\, d\, d_{ff} + d_{ff} + d$ |
# | one LayerNorm | | | $2d$ |
#
# With the usual $d_{ff} = 4d$ the FFN has about $8d^2$ parameters against attention's $4d^2$:
# twice as many, so about **two thirds** of an encoder block. (The number of heads does not
# matter: the heads split $d$, they do not add weights.) We count real modules rather than trust
# the table: our FFN, PyTorch's `nn.MultiheadAttention` and `nn.LayerNorm`, and, as an independent
# total, PyTorch's whole `nn.TransformerEncoderLayer` and `nn.TransformerDecoderLayer`.

# %%
def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_counts(d_model: int, num_heads: int, d_ff: int) -> dict[str, int]:
    return {
        "attention": num_params(nn.MultiheadAttention(d_model, num_heads)),
        "ffn": num_params(feed_forward(d_model, d_ff)),
        "layernorm": num_params(nn.LayerNorm(d_model)),
    }


configs = {  # name: (d_model, num_heads, d_ff)
    "paper base": (512, 8, 2048),  # Vaswani et al. (2017), Table 3
    "course": (128, 4, 512),  # the model of notebooks 10-12
}
counts = {name: block_counts(*cfg) for name, cfg in configs.items()}
count_lines = []
for name, (d, _, dff) in configs.items():
    c = counts[name]
    encoder_block = c["attention"] + c["ffn"] + 2 * c["layernorm"]
    decoder_block = 2 * c["attention"] + c["ffn"] + 3 * c["layernorm"]
    count_lines.append(
        f"{name:>10}: d={d}, d_ff={dff} | attention {c['attention']:>9,} | FFN {c['ffn']:>9,} "
        f"| FFN share: encoder block {c['ffn'] / encoder_block:.1%}, decoder block {c['ffn'] / decoder_block:.1%}")
print("\n".join(count_lines))  # one write, so the output is one stream

# %% [markdown]
# **Check:** the counts equal the formulas, the sum of the parts equals PyTorch's own encoder and
# decoder layers, and the FFN's share of an encoder block is within half a percent of $2/3$.

# %%
for name, (d, h, dff) in configs.items():
    c = counts[name]
    assert c["ffn"] == 2 * d * dff + dff + d
    # The next two lines count PyTorch's modules (a check of the table, not of our code).
    assert c["attention"] == 4 * d**2 + 4 * d
    assert c["layernorm"] == 2 * d
    reference_encoder = nn.TransformerEncoderLayer(d, h, dim_feedforward=dff, batch_first=True)
    reference_decoder = nn.TransformerDecoderLayer(d, h, dim_feedforward=dff, batch_first=True)
    assert num_params(reference_encoder) == c["attention"] + c["ffn"] + 2 * c["layernorm"]
    assert num_params(reference_decoder) == 2 * c["attention"] + c["ffn"] + 3 * c["layernorm"]
    share = c["ffn"] / (c["attention"] + c["ffn"] + 2 * c["layernorm"])
    assert abs(share - 2 / 3) < 0.005, share
print(f"paper base: FFN {counts['paper base']['ffn']:,} = 2·512·2048 + 2048 + 512; "
      f"attention {counts['paper base']['attention']:,} = 4·512² + 4·512")

# %% [markdown]
# Across a whole model the picture is much the same. The paper's base model has 6 encoder and
# 6 decoder blocks, so 12 FFNs; they hold 57 % of its parameters outside the embedding, and
# about 40 % of all of them once its 37,000-token embedding table is counted (Appendix A counts
# both from real modules, and rebuilds the course model's 930,828 parameters from its parts).
#
# The FFN's share depends only on the ratio $r = d_{ff}/d$: ignoring biases and norms it is
# $2rd^2 / (2rd^2 + 4d^2) = r / (r + 2)$, which is $2/3$ at $r = 4$. The left panel shows the two
# configurations, the right one the share for other ratios.

# %% jupyter={"source_hidden": true}
fig, (ax_bar, ax_r) = plt.subplots(1, 2, figsize=(11, 3.9), gridspec_kw=dict(width_ratios=[1.5, 1]))
rows = []
for name in configs:
    c = counts[name]
    rows.append((f"{name}\nencoder block", c["attention"], c["ffn"], 2 * c["layernorm"]))
    rows.append((f"{name}\ndecoder block", 2 * c["attention"], c["ffn"], 3 * c["layernorm"]))
labels = [r[0] for r in rows]
parts = np.array([r[1:] for r in rows], dtype=float)  # (4 blocks, 3 parts)
shares = parts / parts.sum(axis=1, keepdims=True)
left = np.zeros(len(rows))
for k, (part, color) in enumerate(zip(["attention", "FFN", "LayerNorms (under 0.5%)"],
                                      [ATTENTION_COLOR, FFN_COLOR, LAYER_NORM_COLOR], strict=True)):
    ax_bar.barh(labels, shares[:, k], left=left, color=color, label=part)
    for i in range(len(rows)):
        if shares[i, k] > 0.05:  # dark text: both colours are light
            ax_bar.text(left[i] + shares[i, k] / 2, i, f"{shares[i, k]:.1%}\n({int(parts[i, k]):,})",
                        ha="center", va="center", color="black", fontsize=9)
    left += shares[:, k]
ax_bar.invert_yaxis()
ax_bar.set(xlim=(0, 1), xlabel="share of the block's parameters",
           title="Parameters per block (counted from real modules)")
ax_bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=9)

ratios = np.linspace(0.5, 8, 200)
ax_r.plot(ratios, ratios / (ratios + 2), color=FFN_COLOR, lw=2, label="$r/(r+2)$")
for name, (d, _, dff) in configs.items():
    c = counts[name]
    style = (dict(ms=12, mfc="none", mew=2, color="black") if name == "paper base"
             else dict(ms=5, color="0.45"))  # both sit at r = 4: a ring around a dot
    ax_r.plot(dff / d, c["ffn"] / (c["attention"] + c["ffn"] + 2 * c["layernorm"]), "o",
              label=f"{name}, counted ({'ring' if name == 'paper base' else 'dot inside the ring'})",
              **style)
ax_r.axhline(2 / 3, color="grey", lw=0.5, ls="--")
ax_r.annotate("$r = 4$: 2/3", (4, 2 / 3), xytext=(5, 0.5), fontsize=9,
              arrowprops=dict(arrowstyle="->", color="grey"))
ax_r.set(xlabel="expansion ratio $r = d_{ff} / d_{model}$", ylabel="FFN share of an encoder block",
         title="FFN share against width", ylim=(0, 1))
ax_r.legend(fontsize=9, loc="lower right")
ax_r.grid(alpha=0.3)
fig.tight_layout()
save_figure(fig, "ffn_parameter_share")
plt.show()


# %% [markdown]
# **With $d_{ff} = 4\,d_\text{model}$ the FFN holds two thirds of an encoder block's parameters
# (half of a decoder block's, which has a second attention): most of a Transformer's
# non-embedding weights are in its feed-forward networks, about 40 % of the tied base model's
# weights in all.**
#
# ## A gated variant: SwiGLU and GEGLU
#
# Shazeer (2020), "GLU Variants Improve Transformer", replaces the activation by a *gate*. The
# input is projected twice, once through an activation and once linearly, and the two are
# multiplied elementwise before the way back:
#
# $$\mathrm{FFN}_\text{act-GLU}(x) = \bigl(\mathrm{act}(x W) \odot x V\bigr) W_2,
# \qquad W, V \in \mathbb{R}^{d_\text{model} \times d_{ff}},\; W_2 \in \mathbb{R}^{d_{ff} \times d_\text{model}}.$$
#
# With $\mathrm{act} = \mathrm{SiLU}$ (Swish) it is **SwiGLU**, with GELU **GEGLU**, with ReLU
# **ReGLU**; the paper leaves out the biases. Each hidden unit now multiplies two readings of the
# input, so it can flip sign and scale with the input rather than only switch off. Shazeer reports
# better perplexity for GEGLU and SwiGLU than for the ReLU and GELU FFNs at equal parameters and
# compute, and SwiGLU is the FFN of PaLM and LLaMA.
#
# The class is built in two cells: the constructor, then the forward pass.

# %%
#| export
class GatedFeedForward(nn.Module):
    """Gated FFN (Shazeer, 2020): W_2(act(x W) * x V); SwiGLU for "silu", GEGLU for "gelu"."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.d_model = check_int("d_model", d_model, minimum=1)
        self.d_ff = check_int("d_ff", d_ff, minimum=1)
        check_bool("bias", bias)
        self.W = nn.Linear(d_model, d_ff, bias=bias)  # gate branch, goes through the activation
        self.V = nn.Linear(d_model, d_ff, bias=bias)  # linear branch, multiplied by the gate
        self.W_2 = nn.Linear(d_ff, d_model, bias=bias)  # back to d_model
        self.activation = get_activation(activation)


# %%
#| export
@add_to_class(GatedFeedForward)
def forward(self, x: torch.Tensor) -> torch.Tensor:
    """(..., d_model) -> (..., d_model), each position on its own."""
    if checking():  # the course's policy for a public entry point (notebook 00)
        check_tensor("x", x, kind="float")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"GatedFeedForward({self.d_model}, {self.d_ff}) expects x of shape "
                f"(..., {self.d_model}), got {tuple(x.shape)}"
            )
    hidden = self.activation(self.W(x)) * self.V(x)  # (..., d_model) -> (..., d_ff)
    return self.W_2(hidden)  # (..., d_ff) -> (..., d_model)


# %% [markdown]
# (`make export` moves a method added with `@add_to_class` back into the class body in `src/`,
# so the package has one ordinary class; notebook 00 explains how.)
#
# **Check:** all three variants against a computation written out with plain matrix products and
# PyTorch's functional activations; then the refusals, by the course's input policy (notebook
# 00): a wrong width is a `ValueError`, a list where a tensor goes and a `1` where a bool goes are
# `TypeError`s, each message naming the argument.

# %%
d_hidden = 48
x_gated = torch.randn(B, T, d_model).to(device)
for act, fn in [("silu", F.silu), ("gelu", F.gelu), ("relu", F.relu)]:
    gated = GatedFeedForward(d_model, d_hidden, activation=act).to(device)
    W, V, W_2 = gated.W.weight.T, gated.V.weight.T, gated.W_2.weight.T  # paper orientation
    out = gated(x_gated)  # (B, T, d_model)
    manual = (fn(x_gated @ W) * (x_gated @ V)) @ W_2
    assert out.shape == (B, T, d_model)
    assert_close(out, manual)
    # (no gradient check: both sides are the same autograd operations, so equal outputs mean
    # equal gradients; GatedFeedForward has no backward of its own to test)

with_bias = GatedFeedForward(d_model, d_hidden, bias=True).to(device)
manual = (F.silu(with_bias.W(x_gated)) * with_bias.V(x_gated)) @ with_bias.W_2.weight.T + with_bias.W_2.bias
assert_close(with_bias(x_gated), manual)
gated_mistakes = {
    "x of width d_model + 1": (lambda: with_bias(torch.randn(B, T, d_model + 1).to(device)), ValueError),
    "x as a list": (lambda: with_bias(x_gated.tolist()), TypeError),
    "bias=1": (lambda: GatedFeedForward(d_model, d_hidden, bias=1), TypeError),
}
for label, (call, expected) in gated_mistakes.items():
    try:
        call()
    except expected as err:
        argument = re.match(r"\w+", label)[0]  # "x" in "x as a list"
        assert re.search(rf"\b{argument}\b", str(err)), (label, str(err))  # the message names it
        print(f"{label:<23} {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{label} was accepted")


# %% [markdown]
# ### Matching the parameter count
#
# Three matrices instead of two: at the same $d_{ff}$ a gated FFN has 1.5 times the parameters and
# the compute. To compare fairly, Shazeer shrinks the hidden width to $2/3$ of $d_{ff}$. Without biases the
# counts are $2\, d\, d_{ff}$ and $3\, d\, d_{ff}'$, equal when
#
# $$d_{ff}' = \tfrac23\, d_{ff}.$$
#
# His baseline (T5 base: $d_\text{model} = 768$, $d_{ff} = 3072$) becomes $d_{ff}' = 2048$ exactly.
# For the paper's and the course's widths $\tfrac23 d_{ff}$ is not an integer, so we round it and
# the counts agree to within 0.1%.

# %%
def matched_d_ff(d_ff: int) -> int:
    return round(2 * d_ff / 3)


for name, d, dff in [("Shazeer's T5 base", 768, 3072), ("paper base", 512, 2048), ("course", 128, 512)]:
    standard = num_params(feed_forward(d, dff, bias=False))
    gated = num_params(GatedFeedForward(d, matched_d_ff(dff)))
    unmatched = num_params(GatedFeedForward(d, dff))
    assert standard == 2 * d * dff and gated == 3 * d * matched_d_ff(dff) and unmatched == 3 * d * dff
    # arithmetic on round(): 2 d_ff / 3 has a fractional part of 0, 1/3 or 2/3, so
    # |round(2 d_ff / 3) - 2 d_ff / 3| <= 1/3 and the relative gap is at most 3 (1/3) / (2 d_ff)
    # = 1 / (2 d_ff): under 0.1 % for every d_ff > 500 (exactly 0.1 % at d_ff = 500)
    assert abs(gated - standard) / standard < 1e-3
    print(f"{name:>17}: FFN d_ff={dff} {standard:>9,} | gated d_ff'={matched_d_ff(dff)} {gated:>9,} "
          f"({gated / standard - 1:+.4%}) | gated at d_ff={dff} {unmatched:>9,}")

# %% [markdown]
# What a single hidden unit computes, as a function of its two pre-activations $a = x\cdot w$ (the
# gate) and $b = x\cdot v$ (the linear reading). A ReLU unit only sees $a$ and is either off or
# linear in it; a SwiGLU unit is a product, positive or negative depending on both readings.
# The black lines mark where the output is 0: for ReLU the edge $a = 0$ of the half-plane where
# the unit is off, for SwiGLU the two lines $a = 0$ and $b = 0$ along which the product changes
# sign.

# %% jupyter={"source_hidden": true}
grid = torch.linspace(-3, 3, 241)
a, b = torch.meshgrid(grid, grid, indexing="xy")  # a varies along x, b along y: (241, 241)
surfaces = [("ReLU unit: ReLU(a)", F.relu(a)), ("SwiGLU unit: SiLU(a) · b", F.silu(a) * b)]
zero_labels = ["$a = 0$ (output 0 for every $a \\leq 0$)", "output = 0"]  # what the black lines are
fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2), layout="constrained")
limit = max(z.abs().max().item() for _, z in surfaces)  # one colour scale for both panels
for ax, (title, z), zero_label in zip(axes, surfaces, zero_labels, strict=True):
    image = ax.imshow(z, origin="lower", extent=(-3, 3, -3, 3), cmap="RdBu_r", vmin=-limit, vmax=limit)
    ax.contour(a, b, z, levels=[0], colors="black", linewidths=0.8)
    ax.plot([], [], color="black", linewidth=0.8, label=zero_label)  # the contour's legend entry
    ax.legend(loc="upper left", fontsize=9)
    ax.set(title=title, xlabel="gate pre-activation $a = x \\cdot w$",
           ylabel="linear reading $b = x \\cdot v$")
fig.colorbar(image, ax=axes, fraction=0.046, label="unit output (same scale in both panels)")
save_figure(fig, "ffn_gated_unit")
plt.show()

# %% [markdown]
# **A gated FFN multiplies an activated projection by a linear one; at $\tfrac23 d_{ff}$ it costs
# what the two-matrix FFN costs.**
#
# ## Recap
#
# | concept | code | shape |
# |---|---|---|
# | activation by name | `get_activation("gelu")` | elementwise |
# | position-wise FFN (the block's `ffn`) | `feed_forward(d_model, d_ff, activation)` → `Sequential(Linear, act, Linear)` | $(B, T, d) \to (B, T, d_{ff}) \to (B, T, d)$ |
# | independence of positions | block-diagonal Jacobian, $\partial y_t / \partial x_s = 0$ | $(T d) \times (T d)$ |
# | the same as a 1×1 convolution | `nn.Conv1d(d_model, d_ff, kernel_size=1)` | $(B, d, T)$ |
# | parameters | FFN $2\,d\,d_{ff} + d_{ff} + d$ vs attention $4d^2 + 4d$ | about $2/3$ of an encoder block at $d_{ff} = 4d$ |
# | gated FFN (SwiGLU, GEGLU) | `GatedFeedForward(d_model, d_ff, "silu")`: $(\mathrm{act}(xW) \odot xV) W_2$ | $(B, T, d) \to (B, T, d_{ff}) \to (B, T, d)$ |
# | matching the gated count | $d_{ff}' = \tfrac23 d_{ff}$ | 3072 → 2048 |
#
# ## Exercises
#
# 1. For what $d_{ff}$ does the FFN hold as many parameters as the attention sublayer? Check with
#    real modules for $d_\text{model} = 512$.
# 2. Remove the activation (put `nn.Identity()` in `ffn[1]`). Show that the FFN then collapses to
#    a single affine map $x \mapsto xA + c$ with $A \in \mathbb{R}^{d \times d}$, and say why the
#    wide hidden layer is then worth nothing.
# 3. Implementations of SwiGLU often fuse $W$ and $V$ into one `nn.Linear(d_model, 2 * d_ff)` and
#    split its output in two. Build that version, copy the weights of a `GatedFeedForward` into
#    it, and check that outputs and parameter counts agree.
#
# **Solutions.**
#
# 1. Without biases, $2\,d\,d_{ff} = 4d^2$ gives $d_{ff} = 2d = 1024$. With biases the counts
#    differ only by the bias terms: $(4d^2 + 4d) - (2d \cdot 2d + 2d + d) = d$.

# %%
d = 512
attention_count = num_params(nn.MultiheadAttention(d, num_heads=8))
ffn_count = num_params(feed_forward(d, 2 * d))
assert num_params(feed_forward(d, 2 * d, bias=False)) == 4 * d**2
assert attention_count - ffn_count == d
print(f"d_ff = {2 * d}: FFN {ffn_count:,}, attention {attention_count:,}")

# %% [markdown]
# 2. Without the activation, $(xW_1 + b_1)W_2 + b_2 = x\,(W_1W_2) + (b_1W_2 + b_2)$: two affine maps
#    compose into one affine map, with the $d \times d$ matrix $A = W_1W_2$ and the bias
#    $c = b_1W_2 + b_2$. So a single `nn.Linear(d_model, d_model)` holding $A$ and $c$ computes
#    exactly the same function, with $d^2 + d$ parameters instead of $2\,d\,d_{ff} + d_{ff} + d$.
#    The $d_{ff}$-wide middle adds parameters but no function that one $d \times d$ layer could not
#    already compute; only a nonlinearity between the two maps makes the width worth having.

# %%
linear_ffn = feed_forward(d_model, d_ff).to(device)
linear_ffn[1] = nn.Identity()
W_in, b_in = linear_ffn[0].weight.T, linear_ffn[0].bias  # W_1 (d_model, d_ff), b_1 (d_ff,)
W_out, b_out = linear_ffn[2].weight.T, linear_ffn[2].bias  # W_2 (d_ff, d_model), b_2 (d_model,)
single = nn.Linear(d_model, d_model).to(device)  # the one affine map
with torch.no_grad():
    single.weight.copy_((W_in @ W_out).T)  # A = W_1 W_2: (d_model, d_ff) @ (d_ff, d_model); Linear stores A^T
    single.bias.copy_(b_in @ W_out + b_out)  # c: (d_model,)
x_affine = torch.randn(B, T, d_model).to(device)
assert_close(single(x_affine), linear_ffn(x_affine), rtol=1e-4, atol=1e-5)  # one Linear does it
relu_ffn = feed_forward(d_model, d_ff).to(device)
relu_ffn.load_state_dict(linear_ffn.state_dict())  # the same weights, with the ReLU back in
assert not torch.allclose(single(x_affine), relu_ffn(x_affine), atol=1e-3)  # another function
print(f"two Linears without activation: {num_params(linear_ffn):,} parameters; "
      f"the same function as one Linear: {num_params(single):,}")


# %% [markdown]
# 3. The fused projection holds $[W \mid V]$ side by side; `chunk(2, dim=-1)` splits its output
#    into the gate half and the linear half.

# %%
class FusedSwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.W_in = nn.Linear(d_model, 2 * d_ff, bias=False)  # [W | V] in one matrix
        self.W_2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, linear = self.W_in(x).chunk(2, dim=-1)  # (..., 2 d_ff) -> 2 x (..., d_ff)
        return self.W_2(F.silu(gate) * linear)


gated = GatedFeedForward(d_model, d_hidden).to(device)
fused = FusedSwiGLU(d_model, d_hidden).to(device)
with torch.no_grad():
    fused.W_in.weight.copy_(torch.cat([gated.W.weight, gated.V.weight], dim=0))  # (2 d_ff, d_model)
    fused.W_2.weight.copy_(gated.W_2.weight)
assert_close(fused(x_gated), gated(x_gated))
assert num_params(fused) == num_params(gated) == 3 * d_model * d_hidden
print("fused SwiGLU == GatedFeedForward, parameters:", num_params(fused))

# %% [markdown]
# ## Appendix A · The FFN's share of a whole model
#
# The main text counted one block. Here the count goes to whole models; nothing else in the
# notebook depends on it. The base model has 6 encoder and 6 decoder layers, so 12 FFNs. The
# course's model (2 + 2 layers, $d = 128$, $d_{ff} = 512$, a vocabulary of
# 12 tokens for the reversal task) has 930,828 parameters: the count that the course's main
# source, the blog tutorial "Deep Learning: Transformers" (README, "Where it comes from"),
# reports for its model, and that notebook 10 reproduces. We rebuild that total from the parts.
# Besides the 2 encoder and 2 decoder blocks it holds:
#
# - **two final `LayerNorm`s**, one after the last block of each stack: the course's blocks are
#   pre-norm, whose residual stream is never normalised inside the stack (notebook 08 shows why
#   it needs this last norm, notebook 10 adds it);
# - **two embedding tables**, $12 \times 128$ each: the source and the target have separate
#   vocabularies in general, so each side has its own (notebooks 09 and 10);
# - **the output head**, an `nn.Linear(128, 12)` with its own weight and bias, *not* tied to the
#   target embedding (notebook 09 shows weight tying, which would save the $12 \times 128$).
#
# In numbers (the next cell counts each row from real modules, the blocks from the parts counted
# above, the tables as `nn.Embedding(12, 128)` and the head as `nn.Linear(128, 12)`, and prints
# the rows):
#
# | part | count |
# |---|---|
# | 2 encoder blocks | $2 \times 198{,}272$ |
# | 2 decoder blocks | $2 \times 264{,}576$ |
# | 2 final `LayerNorm`s | $2 \times 256$ |
# | 2 embedding tables | $2 \times 1{,}536$ |
# | output head | $1{,}548$ |
# | **total** | **930,828** |

# %%
c = counts["paper base"]
base_ffn_total = 12 * c["ffn"]
base_attention_total = (6 * 1 + 6 * 2) * c["attention"]  # encoder: self; decoder: self + cross
print(f"paper base, 12 layers: FFNs {base_ffn_total / 1e6:.1f}M, attention {base_attention_total / 1e6:.1f}M")

c = counts["course"]
vocab, d = 12, 128
course_parts = {  # part: (how many, parameters of one), each counted from real modules
    "encoder blocks": (2, c["attention"] + c["ffn"] + 2 * c["layernorm"]),
    "decoder blocks": (2, 2 * c["attention"] + c["ffn"] + 3 * c["layernorm"]),
    "final LayerNorms": (2, c["layernorm"]),  # one after each pre-norm stack
    "embedding tables": (2, num_params(nn.Embedding(vocab, d))),  # source and target
    "output head": (1, num_params(nn.Linear(d, vocab))),  # untied: its own weight and bias
}
print("course model, part by part:")
for part, (n, each) in course_parts.items():
    print(f"  {part:<17} {n} x {each:>7,} = {n * each:>7,}")
course_total = sum(n * each for n, each in course_parts.values())
course_ffn_total = 4 * c["ffn"]
assert course_total == 930_828
print(f"course model: {course_total:,} parameters, of which its 4 FFNs hold "
      f"{course_ffn_total:,} ({course_ffn_total / course_total:.1%})")

# %% [markdown]
# "Most of the weights" needs a qualifier once the vocabulary is counted. The base model shares one
# embedding matrix between the source and target embeddings and the output layer (Vaswani et al.,
# 2017, §3.4) over a shared vocabulary of about 37,000 byte-pair tokens (§5.1): $37{,}000 \times
# 512 \approx 19$ million parameters, as many as all its attention layers. We count a real
# module: PyTorch's `nn.Transformer` with the base sizes (its 6 + 6 layers and two final norms,
# built on the `meta` device, which records shapes without allocating memory) plus one
# `nn.Embedding(37000, 512)` for the tied table, and take the FFNs' share twice, with and without
# the embedding.

# %%
with torch.device("meta"):  # shapes only: nothing is allocated or initialised
    base_body = nn.Transformer(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                               dim_feedforward=2048, batch_first=True)
    base_tied_embedding = nn.Embedding(37_000, 512)  # source, target and output layer share it
base_ffn = sum(num_params(m) for name, m in base_body.named_modules() if name.endswith(("linear1", "linear2")))
base_non_embedding = num_params(base_body)
base_total = base_non_embedding + num_params(base_tied_embedding)
ffn_share_body, ffn_share_total = base_ffn / base_non_embedding, base_ffn / base_total
print(f"paper base: FFNs {base_ffn / 1e6:.1f}M of {base_non_embedding / 1e6:.1f}M non-embedding "
      f"parameters ({ffn_share_body:.1%}), of {base_total / 1e6:.1f}M with the tied embedding ({ffn_share_total:.1%})")

# %%
assert base_ffn == 12 * counts["paper base"]["ffn"]  # the same FFNs as counted above
assert 0.5 < ffn_share_body < 0.6  # a majority of the non-embedding weights
assert 0.35 < ffn_share_total < 0.45  # but well under half of the whole model

# %% [markdown]
# The FFNs hold 57 % of the base model's non-embedding parameters but only 40 % of all
# 63 million. Table 3 of the paper lists 65 million for the base model; the paper gives the
# vocabulary only as "about 37000" tokens and does not list the parts of its count, so the 3 %
# gap cannot be traced (notebook 10, exercise 1, counts the course's own model at this size:
# 63.1 million too). The course's small model has a 12-token vocabulary, so there the FFNs are
# 57 % (56.6 %) of everything.

# %% [markdown]
# ## Appendix B · `full_float32()`, for GPU readers
#
# On NVIDIA GPUs since Ampere (A100, RTX 30xx and newer), PyTorch lets cuDNN run float32
# convolutions in TF32 by default, a format with a 10-bit mantissa whose results differ from
# float32 by about $10^{-3}$; float32 matrix products do not use it unless asked to. So the
# comparison of the 1×1 convolution with the FFN switches TF32 off for both and switches it back
# as it was afterwards. On a CPU, and on older GPUs, the two flags change nothing.
#
# PyTorch 2.9 added a second way to say the same thing, `torch.backends.cuda.matmul.fp32_precision`
# and `torch.backends.cudnn.conv.fp32_precision`, and some versions, 2.9 for one, warn once that
# the `allow_tf32` flags will be deprecated. The check that warns sits in PyTorch's core (ATen's
# `Context.cpp`), not in CUDA-only code, so CPU-only builds of those versions may warn too; the
# course's pinned 2.13 no longer does. `full_float32()` keeps the `allow_tf32` flags, which every
# supported version (2.5 and later) has, and which set the old and the new settings together in
# the versions that have both; and it silences that one warning while it runs, so that no
# version adds a stderr stream to the cell.
# Setting only the new settings instead could leave the two disagreeing, if the old ones had been
# set elsewhere, and the versions that have both refuse that with an error ("you have used mix
# of the legacy and new APIs").

# %% [markdown]
# Next: [08 · Encoder and decoder blocks](08_blocks.ipynb), where attention, this FFN, layer norm
# and residual connections are assembled into the Transformer's blocks.
