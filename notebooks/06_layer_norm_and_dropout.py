# %% [markdown]
# # 06 · Layer norm and dropout
#
# **What you will build:** `LayerNorm`, written from scratch and equal to `nn.LayerNorm` in its
# outputs, its gradients and its `state_dict`; an experiment that shows why a Transformer
# normalises each token on its own rather than across the batch; inverted dropout and its
# expectation-preserving scale; and a diagram of the three places the Transformer applies
# dropout. The two serve different ends: layer norm is there mainly so that a deep stack of
# blocks trains at all, dropout so that it does not overfit. Dropout is the identity at
# evaluation, so a trained model computes as if it were not there. Layer norm is applied at
# evaluation exactly as in training, and it cannot be folded into the next layer's weights
# either: it divides each token by that token's own spread, which no fixed matrix does.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/06_layer_norm_and_dropout.ipynb) · Assumes: [00 · Setup](00_setup.ipynb); the attention of notebooks 01–03 helps for the last section.

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
import copy
import math

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.utils import COLORS, add_to_class, get_device, save_figure, set_seed

generator = set_seed(0)
device = get_device()

# %% [markdown]
# **Colours of the parts.** From here on, figures draw the parts of a Transformer: embeddings,
# attention, the feed-forward network, `LayerNorm`, dropout, the output head. Notebook 00's
# `COLORS` are for *roles* (blue for queries and for our implementation, orange for keys and for
# PyTorch's, green for values, red for the accent); a part is not a role, so the parts get
# colours of their own, defined once here and used by every figure of notebooks 06–10 that
# shows a part: `LayerNorm` is always purple, attention always
# cyan, dropout always pink. A figure that draws parts uses none of these colours for anything
# else.

# %%
#| export utils
# The parts of a Transformer, one colour each in every figure that draws them (notebooks 06-10).
PART_COLORS = {
    "embedding": "#d9d9d9",  # light grey: the token embeddings
    "positional": "#f0f0f0",  # lighter grey: the positional encodings
    "attention": "#17becf",  # cyan: (self-)attention
    "cross_attention": "#0e7c86",  # dark cyan: the decoder's cross-attention
    "ffn": "#bcbd22",  # olive: the feed-forward network
    "layer_norm": "#9467bd",  # purple: LayerNorm
    "dropout": "#e377c2",  # pink: dropout
    "head": "#525252",  # dark grey: the output head
}

# %%
LAYER_NORM_COLOR = PART_COLORS["layer_norm"]
BATCH_NORM_COLOR = "#8c564b"  # brown: not a part of the Transformer, only compared with in this notebook


# %% [markdown]
# ## Why normalise
#
# A Transformer is a deep stack: the base model of Vaswani et al. (2017) has 6 encoder and 6
# decoder blocks, each with two or three sub-layers, and modern models have dozens. Every layer
# multiplies its input by a weight matrix, so the scale of the activations is multiplied at
# every layer by a factor that depends on the weights. A factor slightly below 1 makes the
# signal vanish with depth; slightly above 1 makes it explode; and since the weights change
# during training, so does the factor. A layer whose input drifts in scale must keep
# re-adapting to it, and the gradients drift with it.
#
# Normalisation removes the drift: it rescales each layer's input to zero mean and unit
# variance, whatever came before. Ba, Kiros and Hinton (2016) introduced *layer* normalisation
# for recurrent networks and showed that it shortens training and makes it more stable; the
# Transformer put it around every sub-layer.
#
# The drift is easy to see. Below, a 32-layer stack of `Linear` + ReLU with He-initialised
# weights scaled by a gain: 0.8 (a little too small) and 1.2 (a little too large). It is a plain
# stack, *without* the residual connections a Transformer block has: there each layer adds its
# output to a stream that carries its input past it, so the signal does not vanish like $0.8^l$;
# the stream grows instead, which notebook 08 measures. The plain stack shows the drift in its
# simplest form. He initialisation keeps the root-mean-square (RMS) of a unit-RMS input at 1, so
# each such layer multiplies the RMS by about its gain. We record the RMS of each layer's
# *output*. With no normalisation the factors compound, and the RMS changes geometrically with
# depth, like $0.8^l$ or $1.2^l$. Standardising each token's feature vector before each layer resets the
# input to RMS 1, so each layer's output should stay near its gain at every depth. For now the
# standardisation is two lines; the real `LayerNorm` follows.

# %%
def standardise(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Zero mean, unit variance over the last axis (a first, parameter-free layer norm)."""
    mean = x.mean(dim=-1, keepdim=True)  # (N, D) -> (N, 1)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # (N, D) -> (N, 1)
    return (x - mean) / torch.sqrt(var + eps)


def rms_through_depth(gain: float, normalise: bool, num_layers: int = 32, d: int = 256) -> list[float]:
    """RMS of each layer's output in a ReLU stack whose weights are He init times `gain`."""
    g = torch.Generator().manual_seed(1)  # the same weights and inputs for every variant
    x = torch.randn(64, d, generator=g)  # (N, D): 64 tokens
    rms = []
    for _ in range(num_layers):
        if normalise:
            x = standardise(x)
        W = torch.randn(d, d, generator=g) * gain * math.sqrt(2 / d)  # He init, scaled
        x = torch.relu(x @ W.T)  # (N, D) -> (N, D)
        rms.append(x.pow(2).mean().sqrt().item())  # the output, before any normalisation
    return rms


depth_runs = {(gain, norm): rms_through_depth(gain, norm) for gain in (0.8, 1.2) for norm in (False, True)}
for (gain, norm), rms in depth_runs.items():
    print(f"gain {gain}  normalised {norm!s:5}  output RMS of layer 32: {rms[-1]:.3g}")

# %% [markdown]
# **Check:** without normalisation the last layer's output is about a thousand times too small
# or hundreds of times too large. With it, every layer's output, at every depth measured (layers
# 1 to 32), has an RMS within 10 % of that layer's own gain: the factor is applied once and then reset by the next
# standardisation instead of being passed on. (The RMS is measured *before* the next
# standardisation, so this could fail: a standardisation that did not reset the scale would let
# the factors compound again.)

# %%
assert depth_runs[(0.8, False)][-1] < 1e-2 and depth_runs[(1.2, False)][-1] > 1e2
for gain in (0.8, 1.2):
    assert all(abs(r / gain - 1) < 0.1 for r in depth_runs[(gain, True)]), gain

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(9.5, 3.6))
layers = range(1, 33)
# Colour = normalisation (purple, the course's colour for layer norm; grey: none), style = gain.
for gain, style in ((0.8, "--"), (1.2, "-")):
    ax.plot(layers, depth_runs[(gain, False)], color="0.35", linestyle=style,
            label=f"gain {gain}, no normalisation")
    ax.plot(layers, depth_runs[(gain, True)], color=LAYER_NORM_COLOR, linestyle=style, linewidth=2,
            label=f"gain {gain}, standardised before each layer")
ax.set_yscale("log")
ax.set_xlabel("layer $l$")
ax.set_ylabel("RMS of layer $l$'s output (log scale)")
ax.set_title("Activation scale through a 32-layer ReLU stack")
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: covers no line
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# **Normalising before every layer stops the scale from compounding: each layer's output stays
# at the scale its own weights give it, whatever the depth.**
#
# ## Layer normalisation, per token
#
# A Transformer's activations have shape $(B, T, D)$: $B$ sequences of $T$ tokens, each a
# vector of $D = d_{\text{model}}$ features. Layer norm standardises **each token's feature
# vector on its own**. For one token $x \in \mathbb{R}^{D}$:
#
# $$\mu = \frac{1}{D}\sum_{i=1}^{D} x_i, \qquad
#   \sigma^2 = \frac{1}{D}\sum_{i=1}^{D} (x_i - \mu)^2, \qquad
#   y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \odot \gamma + \beta .$$
#
# Three details matter for matching PyTorch exactly:
#
# - $\sigma^2$ is the **biased** variance: it divides by $D$, not $D - 1$. It describes these
#   $D$ numbers; it does not estimate the variance of a population.
# - $\epsilon$ (default $10^{-5}$) sits *inside* the square root. It keeps a constant vector
#   ($\sigma^2 = 0$) from dividing by zero.
# - $\gamma$ (the gain) and $\beta$ (the bias) are learned vectors of length $D$, initialised
#   to ones and zeros, so a fresh layer norm is a pure standardisation. They let the network
#   choose, feature by feature, the scale and offset that the next layer sees; for one given
#   token, $\gamma = \sqrt{\sigma^2 + \epsilon}\,\mathbf{1}$ and $\beta = \mu\,\mathbf{1}$
#   even give that token back unchanged (checked below).
#
# On a $(B, T, D)$ tensor this is $B \times T$ independent standardisations: a token's output
# depends on its own $D$ features only, never on the other tokens of its sequence nor on the
# other sequences of the batch.
#
# The package's `layers` module starts here (notebooks 07 and 08 add the feed-forward network
# and the blocks to it):

# %%
#| default_exp layers

# %%
#| export
"""Layers of a Transformer block: layer normalisation, the feed-forward network, the blocks."""

import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.checks import check_bool, check_float, check_int, check_tensor, checking


# %% [markdown]
# The parameters are called `weight` ($\gamma$) and `bias` ($\beta$), the names `nn.LayerNorm`
# uses, so a `state_dict` moves between the two unchanged. The constructor refuses values that
# would only fail later, or silently: a width below 1, a non-positive or infinite $\epsilon$.
#
# *Two switches in this code serve later notebooks; skip them on a first reading.* `fast=True`
# (notebook 14) computes the same function with PyTorch's one fused kernel, `F.layer_norm`,
# equal up to float32 rounding (the closeness is checked below; whether the last bits also agree
# depends on the machine's kernels, so nothing here claims it); `checking()` (notebook 00's
# `checks` module) lets a caller that has already checked the input, such as notebook 08's
# blocks, switch the input checks off.

# %%
#| export
class LayerNorm(nn.Module):
    """Layer normalisation over the last dimension, with the same numbers as nn.LayerNorm."""

    def __init__(self, d_model: int, eps: float = 1e-5, fast: bool = False):
        super().__init__()
        self.d_model = check_int("d_model", d_model, minimum=1)
        self.eps = check_float("eps", eps, 0.0, low_open=True)
        self.fast = check_bool("fast", fast)  # notebook 14: the same function in one fused kernel
        self.weight = nn.Parameter(torch.empty(d_model))  # gamma
        self.bias = nn.Parameter(torch.empty(d_model))  # beta
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set gamma to ones and beta to zeros: a fresh layer norm only standardises."""
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        """Shown by print(module)."""
        return f"{self.d_model}, eps={self.eps}" + (", fast=True" if self.fast else "")


# %% [markdown]
# The forward pass is the formula, line by line. The statistics keep their reduced axis
# (`keepdim=True`) so they broadcast back over the $D$ features; $\gamma$ and $\beta$, of shape
# $(D,)$, broadcast over every leading dimension, so any input shaped $(\ldots, D)$ works.

# %%
#| export
@add_to_class(LayerNorm)
def forward(self, x: torch.Tensor) -> torch.Tensor:
    """Normalise each vector along the last dimension, then scale by weight, shift by bias."""
    if checking():  # off inside a block that checked its input already
        check_tensor("x", x, kind="float")
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"LayerNorm({self.d_model}) expects input of shape (..., {self.d_model}), "
                f"got {tuple(x.shape)}"
            )
    if self.fast:  # notebook 14: one fused kernel, equal to float32 rounding
        return F.layer_norm(x, (self.d_model,), self.weight, self.bias, self.eps)
    mean = x.mean(dim=-1, keepdim=True)  # (..., D) -> (..., 1)
    centred = x - mean  # (..., D)
    # the biased variance: divide by D, not D - 1
    var = centred.pow(2).mean(dim=-1, keepdim=True)  # (..., D) -> (..., 1)
    x_hat = centred / torch.sqrt(var + self.eps)  # (..., D): mean 0, variance 1 per row
    return x_hat * self.weight + self.bias  # gamma, beta (D,) broadcast over (..., D)


# %% [markdown]
# ### Parity with `nn.LayerNorm`
#
# A fresh layer norm has $\gamma = 1$ and $\beta = 0$, which would hide a mix-up of the two.
# So we draw random ones, load our `state_dict` into `nn.LayerNorm` (the keys must match for
# that to work at all), and compare outputs and the gradients with respect to the input, the
# gain and the bias, for the same random upstream gradient.

# %%
B, T, d_model = 4, 6, 16
x = torch.randn(B, T, d_model, generator=generator).to(device)  # (B, T, D)
upstream = torch.randn(B, T, d_model, generator=generator).to(device)  # dL/dy, (B, T, D)

ours = LayerNorm(d_model).to(device)
with torch.no_grad():
    ours.weight.copy_(torch.randn(d_model, generator=generator))
    ours.bias.copy_(torch.randn(d_model, generator=generator))
reference = nn.LayerNorm(d_model).to(device)
reference.load_state_dict(ours.state_dict())  # same keys: weight, bias


def output_and_grads(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward, backward with `upstream`; return (y, dL/dx, dL/dgamma, dL/dbeta)."""
    x = x.clone().requires_grad_(True)
    norm.zero_grad()
    y = norm(x)
    y.backward(upstream.to(y.dtype))
    return y.detach(), x.grad, norm.weight.grad, norm.bias.grad


print(ours, "| state_dict:", list(ours.state_dict()))
# the attributes we rely on, not nn.LayerNorm's repr (whose fields vary across torch versions)
print(f"nn.LayerNorm(normalized_shape={reference.normalized_shape}, eps={reference.eps}) "
      "| state_dict:", list(reference.state_dict()))

# %% [markdown]
# The two compute the same formula in different orders (PyTorch's kernel accumulates the mean and
# variance in one pass), so they agree to rounding, not bit for bit; how closely depends on the
# machine, so this cell's output is not compared.

# %% tags=["nbval-ignore-output"]
parity = dict(zip(("y", "dL/dx", "dL/dgamma", "dL/dbeta"),
                  zip(output_and_grads(ours, x), output_and_grads(reference, x), strict=True),
                  strict=True))
for name, (a, b) in parity.items():
    print(f"{name:10} largest |ours - nn.LayerNorm| = {(a - b).abs().max().item():.1e}")

# %% [markdown]
# **Check:** outputs and all three gradients agree to within $10^{-5}$, relative and absolute,
# the tolerance this notebook uses for float32 parity. (The unit tests in
# `tests/test_layernorm.py` use `assert_close`'s float32 defaults, tighter in relative terms:
# $1.3 \cdot 10^{-6}$ relative, $10^{-5}$ absolute.) So do those of the same module with its
# `fast` switch on (notebook 14), which hands the work to `F.layer_norm`.

# %%
for name, (a, b) in parity.items():
    assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
fast_norm = copy.deepcopy(ours)
fast_norm.fast = True
for name, a, b in zip(parity, output_and_grads(fast_norm, x), output_and_grads(ours, x), strict=True):
    assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"fast {name}")

# %% [markdown]
# #### Does the test catch a real mistake?
#
# A parity test is only as good as the mistakes it catches, and *where* it compares matters as
# much as how tightly. The tokens of `x` have a spread near 1, and there $\epsilon = 10^{-5}$
# hardly moves the output: a layer norm with $\epsilon$ moved outside the square root,
# $(x - \mu)/(\sigma + \epsilon)$, passes this test on `x`. Scale the same tokens by 0.1 (a
# spread near 0.1, so $\epsilon$ is 100 times larger relative to $\sigma^2$) and the same test
# catches that mistake, while ours still passes. So the next cell repeats the parity test on
# the scaled tokens and runs the mistaken formula through the test at both spreads. (Appendix A,
# at the end, measures how much each tolerance sees, and compares in float64.)

# %%
x_small = 0.1 * x  # the same tokens with a spread near 0.1, where eps matters; (B, T, D)
for name, a, b in zip(parity, output_and_grads(ours, x_small), output_and_grads(reference, x_small),
                      strict=True):
    assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"spread near 0.1: {name}")


def layer_norm_eps_outside(x, weight, bias, eps=1e-5):
    """The mistake: eps added to the standard deviation, outside the square root."""
    centred = x - x.mean(dim=-1, keepdim=True)
    return centred / (centred.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps) * weight + bias


eps_outside_caught = {}
for spread, inputs in (("near 1", x), ("near 0.1", x_small)):
    with torch.no_grad():  # x_hat only: gamma = 1, beta = 0
        misplaced_hat = layer_norm_eps_outside(inputs, 1.0, 0.0)
        correct_hat = F.layer_norm(inputs, (d_model,))
    eps_outside_caught[spread] = not torch.allclose(misplaced_hat, correct_hat, rtol=1e-5, atol=1e-5)
assert eps_outside_caught == {"near 1": False, "near 0.1": True}
for spread, caught in eps_outside_caught.items():
    print(f"eps outside the square root, float32 test at 1e-5, token spread {spread:8}: "
          f"{'caught' if caught else 'missed'}")


# %% [markdown]
# ### The unbiased-variance mistake
#
# `torch.var` divides by $D - 1$ by default (Bessel's correction), so the tempting one-liner
# `x.var(-1, keepdim=True)` computes a slightly larger variance than layer norm's. The output
# then shrinks by the factor $\sqrt{(D-1)/D}$ (when $\epsilon$ is negligible): 6.5 % at
# $D = 8$, only 0.1 % at $D = 512$. Small, but large enough that the weights of a model
# trained with one do not give the same numbers in the other.

# %%
def layer_norm_unbiased(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The mistake: torch.var's default divides by D - 1."""
    mean = x.mean(dim=-1, keepdim=True)  # (..., D) -> (..., 1)
    var = x.var(dim=-1, keepdim=True)  # unbiased, (..., 1)
    return (x - mean) / torch.sqrt(var + eps)


fresh = LayerNorm(d_model).to(device)  # gamma = 1, beta = 0
with torch.no_grad():
    right, wrong = fresh(x), layer_norm_unbiased(x)
print(f"D = {d_model}: max |difference| = {(right - wrong).abs().max().item():.4f}")

# %% [markdown]
# **Check:** the two are *not* close, and the wrong one is the right one times
# $\sqrt{(D-1)/D}$ (to within the effect of $\epsilon$).

# %%
# assert_close's own float32 tolerances: the mistake is far outside them
assert not torch.allclose(wrong, right, rtol=1.3e-6, atol=1e-5)
assert_close(wrong, right * math.sqrt((d_model - 1) / d_model), rtol=1e-4, atol=1e-5)

# %% [markdown]
# Is the mistake still visible at the widths of real models? We measure the shrinkage against an
# implementation we did not write, `nn.LayerNorm`, at widths from 4 to 1024. **Check:** at every
# width the measured shrinkage is the predicted $1 - \sqrt{(D-1)/D}$, and the mistaken output
# fails the float32 parity test that ours passes, at the same tolerances (relative and absolute
# $10^{-5}$).

# %%
widths = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
measured = []
for D in widths:
    x_D = torch.randn(256, D, generator=generator)  # (N, D)
    with torch.no_grad():
        mistaken, builtin = layer_norm_unbiased(x_D), nn.LayerNorm(D)(x_D)
    # the sums in float64: a float32 ratio near 1 moves in steps of 6e-8, enough to flip a digit
    measured.append(1 - (mistaken.double().abs().sum() / builtin.double().abs().sum()).item())
    assert not torch.allclose(mistaken, builtin, rtol=1e-5, atol=1e-5), D  # caught
    assert_close(LayerNorm(D)(x_D), builtin, rtol=1e-5, atol=1e-5)  # ours passes
predicted = [1 - math.sqrt((D - 1) / D) for D in widths]
assert_close(torch.tensor(measured), torch.tensor(predicted), rtol=1e-2, atol=0.0)
print("shrinkage at D = 4, 64, 1024:", [f"{measured[widths.index(D)]:.2e}" for D in (4, 64, 1024)])

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(widths, predicted, color="black", label=r"$1 - \sqrt{(D-1)/D} \approx 1/(2D)$")
ax.plot(widths, measured, "o", color=LAYER_NORM_COLOR,
        label="measured against nn.LayerNorm")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel(r"$d_{model}$ (features per token)")
ax.set_ylabel("relative shrinkage of the output")
ax.set_title("Dividing by D - 1 instead of D shrinks the output")
ax.legend()
ax.grid(alpha=0.3, which="both")
plt.show()

# %% [markdown]
# **Layer norm uses the biased variance (divide by $D$); the unbiased one is off by
# $\approx 1/(2D)$, which a float32 parity test caught at every width tested (4 to 1024).**
#
# ### What the output looks like
#
# Give three tokens very different offsets and spreads. After layer norm (with $\gamma = 1$,
# $\beta = 0$) each has mean 0 and variance $\sigma^2 / (\sigma^2 + \epsilon)$, which is 1 up to
# $\epsilon$; the *pattern* across features, which is the information, is untouched.

# %%
D_show = 16
offsets = torch.tensor([[-6.0], [1.0], [8.0]])  # (3, 1)
spreads = torch.tensor([[0.5], [3.0], [0.2]])  # (3, 1)
tokens = offsets + spreads * torch.randn(3, D_show, generator=generator)  # (3, D)
with torch.no_grad():
    normed = LayerNorm(D_show)(tokens)  # (3, D)

mean_out = normed.mean(dim=-1)
var_out = normed.var(dim=-1, unbiased=False)
var_in = tokens.var(dim=-1, unbiased=False)
print("mean after:    ", [round(abs(m), 4) for m in mean_out.tolist()])
print("variance after:", [round(v, 4) for v in var_out.tolist()])

# %% [markdown]
# **Check:** per-token mean 0; per-token variance $\sigma^2/(\sigma^2+\epsilon)$ up to float32
# rounding; and a constant token comes out as $\beta$, not NaN. The variance check can tell
# $\sigma^2/(\sigma^2+\epsilon) = 1 - \epsilon/(\sigma^2+\epsilon)$ from 1 only for the two narrow
# tokens (spreads 0.5 and 0.2: 0.9999 and 0.9998 above), and the cell shows that a variance of
# exactly 1 would fail there. For the wide token (spread 3) the difference from 1 is about
# $10^{-6}$, below what a float32 comparison resolves.

# %%
assert_close(mean_out, torch.zeros(3), atol=1e-5, rtol=0)
assert_close(var_out, var_in / (var_in + 1e-5))
narrow = [0, 2]  # spreads 0.5 and 0.2: the check resolves their sigma^2 / (sigma^2 + eps) ...
assert not torch.allclose(var_out[narrow], torch.ones(2), rtol=1.3e-6, atol=1e-5)  # ... so 1 fails
constant_norm = LayerNorm(D_show)
with torch.no_grad():
    constant_norm.bias.copy_(torch.randn(D_show, generator=generator))
    out_constant = constant_norm(torch.full((1, D_show), 7.0))  # sigma^2 = 0
assert torch.equal(out_constant[0], constant_norm.bias.detach())

# %% [markdown]
# **Check:** what $\gamma$ and $\beta$ can do. Set them, for one token at a time, to that
# token's own $\sqrt{\sigma^2 + \epsilon}$ and $\mu$, and the layer norm returns the token it
# was given: the standardisation is undone. The same parameters do not give back the other two
# tokens. $\gamma$ and $\beta$ are shared by every token, so they can undo one token's
# statistics, not every token's: what they learn is a scale and an offset per feature.

# %%
undo_norm = LayerNorm(D_show)
for i in range(3):
    with torch.no_grad():
        undo_norm.weight.fill_(math.sqrt(var_in[i].item() + 1e-5))  # gamma = sqrt(sigma^2 + eps)
        undo_norm.bias.fill_(tokens[i].mean().item())  # beta = mu
        restored = undo_norm(tokens)  # (3, D)
    assert_close(restored[i], tokens[i])  # token i comes back
    other = (i + 1) % 3
    assert not torch.allclose(restored[other], tokens[other], atol=1e-2)  # another does not

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.9))
# three tokens, neither roles nor parts: greys, told apart by their markers
styles = [("black", "o"), ("0.45", "s"), ("0.7", "^")]
for i, (color, marker) in enumerate(styles):
    label = f"token {i}: drawn with mean {offsets[i, 0]:.0f}, std {spreads[i, 0]:.1f}"
    axes[0].plot(tokens[i], "-", marker=marker, color=color, markersize=4, label=label)
    axes[1].plot(normed[i], "-", marker=marker, color=color, markersize=4)
axes[0].set_title("Before: each token at its own offset and scale", fontsize=10)
axes[1].set_title("After LayerNorm: each token mean 0, variance 1", fontsize=10)
for ax in axes:
    ax.set_xlabel("feature index")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("feature value")
axes[1].set_ylabel("normalised value")
fig.legend(loc="lower center", ncol=3, fontsize=9, frameon=False)
plt.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()

# %% [markdown]
# **`LayerNorm` standardises every token independently: same shape in, same shape out, the
# pattern kept and the scale removed.**
#
# Where it sits in a block is a separate choice: the original Transformer is *post-norm*,
# $x \leftarrow \mathrm{LayerNorm}(x + \mathrm{Sublayer}(x))$, while this course's blocks are
# *pre-norm*, $x \leftarrow x + \mathrm{Sublayer}(\mathrm{LayerNorm}(x))$; notebook 08 builds
# both and compares their gradients at initialisation, before any training.
#
# ## Batch norm depends on its batch
#
# Batch normalisation (Ioffe and Szegedy, 2015), the standard in convolutional networks,
# normalises along the other axis: **each feature** is standardised with the mean and variance
# of that feature over all the examples (here: all tokens of all sequences) in the batch. (Why it
# helps is still argued over: Ioffe and Szegedy's explanation was a reduced drift of each layer's
# input distribution, while Santurkar et al. (2018) argue that batch norm works mostly by making
# the loss surface smoother, so that larger learning rates are safe.)
#
# $$\text{LayerNorm: } \mu_{b,t} = \frac{1}{D}\sum_{i} x_{b,t,i} \qquad\qquad
#   \text{BatchNorm: } \mu_{i} = \frac{1}{BT}\sum_{b,t} x_{b,t,i}$$
#
# The two groupings, drawn for a batch of 3 sequences of 4 tokens with 6 features:

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
n_tokens, n_features = 12, 6
for ax, title, highlight, color in (
    (axes[0], "LayerNorm: one token,\nall of its features", "row", LAYER_NORM_COLOR),
    (axes[1], "BatchNorm: one feature,\nall tokens of the batch", "column", BATCH_NORM_COLOR),
):
    grid = torch.zeros(n_tokens, n_features)
    if highlight == "row":
        grid[5, :] = 1  # token 5 is normalised with its own 6 features
    else:
        grid[:, 2] = 1  # feature 2 is normalised over all 12 tokens
    group_cmap = ListedColormap(["#f2f2f2", color])  # two values: other, in the group
    ax.imshow(grid, cmap=group_cmap, vmin=0, vmax=1, aspect="auto")
    for boundary in (3.5, 7.5):  # sequence boundaries
        ax.axhline(boundary, color="black", linewidth=1.5)
    ax.set_xticks(range(n_features))
    ax.set_yticks(range(n_tokens), [f"seq {t // 4}, token {t % 4}" for t in range(n_tokens)], fontsize=8)
    ax.set_xlabel("feature (D = 6)")
    ax.set_title(title, fontsize=10)
fig.legend(handles=[Patch(color=LAYER_NORM_COLOR, label="one LayerNorm group"),
                    Patch(color=BATCH_NORM_COLOR, label="one BatchNorm group"),
                    Patch(facecolor="#f2f2f2", edgecolor="0.7", label="other entries")],
           loc="lower center", ncol=3, fontsize=9, frameon=False)
fig.subplots_adjust(bottom=0.24)
plt.show()

# %% [markdown]
# Because batch norm's statistics come from the batch, a token's output depends on **which
# other tokens happen to share its batch**. To see it, take one fixed token and put it into 12
# batches whose 7 other tokens come from differently shifted and scaled distributions, like
# sentences on different topics. Run it through `nn.BatchNorm1d` in training mode and through
# our `LayerNorm`, and keep only the fixed token's output each time.

# %%
d_feat, num_batches, companions = 16, 12, 7
probe = torch.randn(d_feat, generator=generator)  # the one token we follow, (D,)
batch_norm = nn.BatchNorm1d(d_feat).to(device).train()
layer_norm = LayerNorm(d_feat).to(device)

bn_outputs, ln_outputs, batch_stats = [], [], []
for _ in range(num_batches):
    scale = 0.5 + 2 * torch.rand(1, generator=generator)  # each batch its own spread ...
    shift = torch.randn(1, d_feat, generator=generator)  # ... and its own offset
    others = shift + scale * torch.randn(companions, d_feat, generator=generator)  # (7, D)
    batch = torch.cat([probe[None], others]).to(device)  # (8, D): the probe is row 0
    with torch.no_grad():
        bn_outputs.append(batch_norm(batch)[0].cpu())  # (D,)
        ln_outputs.append(layer_norm(batch)[0].cpu())  # (D,)
    batch_stats.append((batch.mean(dim=0), batch.var(dim=0)))  # per feature; var unbiased
bn_outputs, ln_outputs = torch.stack(bn_outputs), torch.stack(ln_outputs)  # (12, D) each
last_batch = batch.clone()  # the 12th batch, (8, D): the mode check below reads it

bn_spread = (bn_outputs.max(dim=0).values - bn_outputs.min(dim=0).values).max().item()
ln_spread = (ln_outputs.max(dim=0).values - ln_outputs.min(dim=0).values).max().item()
print(f"largest spread of the probe's output over 12 batches: BatchNorm {bn_spread:.2f}, "
      f"LayerNorm {ln_spread:.4f}")

# %% [markdown]
# **Check:** batch norm gives the same token different outputs in different batches; layer
# norm gives it the same output every time.

# %%
assert bn_spread > 1.0
for out in ln_outputs:
    assert_close(out, ln_outputs[0], rtol=0, atol=1e-6)
assert not torch.allclose(bn_outputs[0], bn_outputs[1], atol=1e-2)

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
features = torch.arange(d_feat)
for ax, outputs, color, title in (
    (axes[0], bn_outputs, BATCH_NORM_COLOR, "BatchNorm (train mode): depends on the batch"),
    (axes[1], ln_outputs, LAYER_NORM_COLOR, "LayerNorm: the same in every batch (12 dots overlap)"),
):
    for out in outputs:
        ax.plot(features, out, "o", color=color, alpha=0.55, markersize=4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("feature index")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("normalised value of the same token")
fig.suptitle("One token, normalised in 12 batches with different companions (one dot per batch)")
plt.tight_layout()
save_figure(fig, "layernorm_vs_batchnorm")
plt.show()

# %% [markdown]
# **Batch norm's output for a token changes with the batch around it; layer norm's does not.**
#
# For sequences that dependence brings three practical problems, all absent from layer norm:
#
# 1. **Padding and variable lengths.** A batch of sentences is padded to its longest member.
#    Batch norm's per-feature statistics then mix real tokens with padding, so the same
#    sentence is normalised differently depending on how long its batch-mates are. (One could
#    mask the padding out of the statistics, but every implementation then has to.)
# 2. **Train versus eval.** In training, batch norm uses the current batch's statistics; in
#    evaluation, running averages collected during training. The same input therefore gives a
#    different output in the two modes: the model is evaluated as a function it was never
#    trained as. Keeping the batch's own statistics at inference is no way out. A decoder
#    generates one token at a time, so each step would normalise over one new position per
#    sequence (a single vector, when one sequence is decoded alone): statistics unlike any it
#    saw in training, or none at all.
# 3. **Small batches.** Statistics from a few tokens are noisy; from one token, impossible.
#
# Each of these is a short experiment. First, padding: the same two sentences (lengths 5 and 3)
# padded with zeros to length 5 and then to length 9.

# %%
lengths = [5, 3]
sentences = [torch.randn(n, d_feat, generator=generator) for n in lengths]  # (T_b, D) each


def pad(seqs: list[torch.Tensor], T: int) -> torch.Tensor:
    """Stack sequences into (B, T, D), filling the tail of each with zeros."""
    out = torch.zeros(len(seqs), T, seqs[0].shape[-1])
    for b, seq in enumerate(seqs):
        out[b, : len(seq)] = seq
    return out.to(device)


def real_tokens(y: torch.Tensor) -> torch.Tensor:
    """Concatenate the unpadded positions of a (B, T, D) batch into (sum of lengths, D)."""
    return torch.cat([y[b, :n] for b, n in enumerate(lengths)])


bn_seq = nn.BatchNorm1d(d_feat).to(device).train()
with torch.no_grad():
    # BatchNorm1d wants features in dim 1: (B, T, D) -> (B, D, T) and back
    bn_short = real_tokens(bn_seq(pad(sentences, 5).transpose(1, 2)).transpose(1, 2))
    bn_long = real_tokens(bn_seq(pad(sentences, 9).transpose(1, 2)).transpose(1, 2))
    ln_short = real_tokens(layer_norm(pad(sentences, 5)))
    ln_long = real_tokens(layer_norm(pad(sentences, 9)))
print(f"change in the real tokens' outputs when padded further: "
      f"BatchNorm {(bn_short - bn_long).abs().max().item():.2f}, "
      f"LayerNorm {(ln_short - ln_long).abs().max().item():.4f}")

# %% [markdown]
# Then the modes. `batch_norm` has by now seen 12 batches in training mode. It does not keep
# their average: it keeps *running* statistics, updated after each batch as an exponential
# moving average, $r \leftarrow (1 - m)\,r + m\,s$ with momentum $m = 0.1$ and $s$ the batch's
# mean (and its unbiased variance), starting from mean 0 and variance 1. After 12 batches the
# starting values still carry $0.9^{12} \approx 28\,\%$ of the weight. In eval mode it uses
# these running statistics instead of the batch's own, so the same batch comes out differently
# (a copy is switched between the modes, because a forward pass in training mode updates them
# again). Layer norm has no mode. And a batch holding a single token cannot be batch-normalised
# in training mode at all.

# %%
running_mean, running_var = torch.zeros(d_feat), torch.ones(d_feat)  # BatchNorm1d's start
for mean_s, var_s in batch_stats:  # the 12 batches, in order
    running_mean = 0.9 * running_mean + 0.1 * mean_s.cpu()
    running_var = 0.9 * running_var + 0.1 * var_s.cpu()
# These two lines test PyTorch's BatchNorm1d, not course code: a demonstration of its rule.
assert_close(batch_norm.running_mean.cpu(), running_mean)  # an exponential moving average ...
assert_close(batch_norm.running_var.cpu(), running_var)  # ... of the unbiased variance too
print(f"running statistics: momentum {batch_norm.momentum}, weight left on the start values "
      f"0.9^{num_batches} = {0.9**num_batches:.2f}")

bn_modes = copy.deepcopy(batch_norm)  # a copy: training mode updates the running statistics
with torch.no_grad():
    bn_eval_out = bn_modes.eval()(last_batch)  # the running statistics (moving averages)
    bn_train_out = bn_modes.train()(last_batch)  # the batch's own statistics
    ln_train_out = layer_norm.train()(last_batch)
    ln_eval_out = layer_norm.eval()(last_batch)
print(f"train vs eval mode, max |difference|: BatchNorm "
      f"{(bn_train_out - bn_eval_out).abs().max().item():.2f}, "
      f"LayerNorm {(ln_train_out - ln_eval_out).abs().max().item():.4f}")

try:
    nn.BatchNorm1d(d_feat).train()(torch.randn(1, d_feat, generator=generator))
    single_token_error = None
except ValueError as err:
    single_token_error = err
# the type only: the wording of the message is PyTorch's and may change between versions
print("BatchNorm on a single token in training mode raises", type(single_token_error).__name__)

# %% [markdown]
# **Check:** padding and the mode change batch norm's output for real tokens and leave layer
# norm's as it was (bit for bit on the CPU; within float32 rounding on a GPU, whose kernels may
# group the sums differently for another shape); batch norm refuses a batch of one (PyTorch 2.13
# says "Expected more than 1 value per channel when training": one value has no variance). For layer
# norm the mode half is a demonstration, not a test: our `forward` never reads
# `self.training`, so its two outputs are equal by construction.

# %%
assert (bn_short - bn_long).abs().max() > 0.1
assert_close(ln_short, ln_long, rtol=0, atol=1e-6)  # on any device: within float32 rounding
if device.type == "cpu":
    assert torch.equal(ln_short, ln_long)  # on the CPU: bit for bit
assert (bn_train_out - bn_eval_out).abs().max() > 0.1
assert torch.equal(ln_train_out, ln_eval_out)  # by construction: LayerNorm has no mode
assert isinstance(single_token_error, ValueError)  # refused (the message is PyTorch's own)


# %% [markdown]
# **Layer norm depends on nothing but the token itself, so padding, batch size and train/eval
# mode cannot change it; that is why Transformers use it.**
#
# ## Dropout
#
# Dropout (Srivastava et al., 2014) fights overfitting by training with noise: during training
# each activation is zeroed independently with probability $p$, so no unit can rely on any
# particular other unit being present. The network is, in effect, trained as a large ensemble
# of thinned sub-networks that share weights.
#
# Zeroing a fraction $p$ of the activations shrinks their expected value to $(1-p)\,x$. To keep
# training and inference consistent, **inverted dropout** divides the survivors by $1 - p$
# during training:
#
# $$y = \frac{m \odot x}{1-p}, \quad m_i \sim \mathrm{Bernoulli}(1-p)
#   \qquad\Longrightarrow\qquad \mathbb{E}[y_i] = \frac{(1-p)\,x_i}{1-p} = x_i ,$$
#
# and at evaluation time dropout is simply the identity: nothing to rescale, nothing to
# remember. (The original paper instead scaled the weights by $1-p$ at test time; the inverted
# form, which PyTorch uses, moves that work into training.) The expectation is kept; the
# variance is not: $\operatorname{Var}[y_i] = x_i^2\, p/(1-p)$.

# %%
def dropout(x: torch.Tensor, p: float, training: bool = True,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverted dropout: zero each element with probability p, scale survivors by 1/(1-p)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    # draw on the CPU so that the mask is the same on every device
    keep = torch.rand(x.shape, generator=generator) >= p  # same shape as x, True = kept
    return x * keep.to(x.device) / (1 - p)


# %% [markdown]
# A check needs many samples. We drop out the same random vector $x$ (of 256 features) 2,000
# times with $p = 0.1$, with our function and with `nn.Dropout`. Each feature's sample mean
# then has standard error $|x_i|\sqrt{p/((1-p)\,S)}$ with $S = 2000$ samples. We allow six
# standard errors: a false alarm about once in 330,000 seeds (see the note), so the check holds
# for other seeds, not just this one. The fraction of zeros among the 512,000 draws has
# standard error $\sqrt{p(1-p)/512000} \approx 0.0004$, and we allow 0.003.
#
# *Note.* The number of kept draws of a feature is binomial; its two tails beyond six standard
# errors hold $6 \times 10^{-9}$ of the probability, three times a normal distribution's.
# Over 256 features and two implementations that makes $3 \times 10^{-6}$.

# %%
p, S, D_drop = 0.1, 2000, 256
x_drop = torch.randn(D_drop, generator=generator).to(device)  # (D,)
samples = x_drop.expand(S, D_drop)  # (S, D): S copies of the same vector

ours_drop = dropout(samples, p, generator=generator)  # (S, D)
torch_drop = nn.Dropout(p).train()(samples)  # (S, D)

tolerance = 6 * x_drop.abs() * math.sqrt(p / ((1 - p) * S))  # per feature, (D,)
error_ours = (ours_drop.mean(dim=0) - x_drop).abs()
zeros_ours = (ours_drop == 0).float().mean().item()
print(f"ours: fraction of zeros {zeros_ours:.4f} (p = {p}), "
      f"worst |mean - x| / allowed = {(error_ours / tolerance).max().item():.2f}")

# %% [markdown]
# **Check:** for both implementations the mean over samples is $x$ within tolerance and the
# fraction of zeros is $p$. Every survivor of `nn.Dropout` is $x_i/(1-p)$, and every survivor of
# ours has the value that `nn.Dropout` gives the same feature, to float32 rounding (the two
# compute $x_i/(1-p)$ in different orders, so the last bit can differ).

# %%
for name, y in (("ours", ours_drop), ("nn.Dropout", torch_drop)):
    assert ((y.mean(dim=0) - x_drop).abs() <= tolerance).all(), name
    assert abs((y == 0).float().mean().item() - p) < 0.003, name
kept_torch, kept_ours = torch_drop != 0, ours_drop != 0  # (S, D) each
assert_close(torch_drop[kept_torch], (samples / (1 - p))[kept_torch])  # PyTorch's rule, shown
survivor = torch_drop.abs().amax(dim=0) * x_drop.sign()  # (D,): nn.Dropout's value per feature
assert_close(ours_drop[kept_ours], survivor.expand_as(ours_drop)[kept_ours])

# %% [markdown]
# In evaluation mode both are the identity, to the last bit:

# %%
drop_module = nn.Dropout(p)
drop_module.eval()
assert torch.equal(drop_module(samples), samples)  # PyTorch's nn.Dropout, shown, not course code
assert torch.equal(dropout(samples, p, training=False), samples)  # ours: fails if eval drops
drop_module.train()
assert not torch.equal(drop_module(samples), samples)  # PyTorch's again: training mode drops

# %% [markdown]
# The picture: on the left, which entries of a $(T, D) = (12, 48)$ activation one dropout mask
# zeroes at $p = 0.1$; on the right, the running mean of one activation ($x_i = 1$) over
# repeated draws. Inverted dropout averages to $x_i$. Plain masking without the rescale
# averages to $(1-p)\,x_i$: during training the next layer would see inputs 10 % smaller on
# average than at evaluation, where dropout is off and nothing is zeroed, so the trained model
# would meet inputs of a different scale as soon as it is evaluated.

# %% jupyter={"source_hidden": true}
figure_draws = torch.Generator().manual_seed(58)  # its own stream: later cells never depend on it
mask_image = (dropout(torch.ones(12, 48), p, generator=figure_draws) != 0).float()  # (T, D)
draws = torch.rand(5000, generator=figure_draws) >= p  # one activation, 5000 draws
steps = torch.arange(1, 5001)
running_inverted = torch.cumsum(draws / (1 - p), dim=0) / steps
running_plain = torch.cumsum(draws.float(), dim=0) / steps

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1.3, 1]})
drop_cmap = ListedColormap([PART_COLORS["dropout"], "#e6e6e6"])  # two values: dropped, kept
axes[0].imshow(mask_image, cmap=drop_cmap, vmin=0, vmax=1, aspect="auto")
axes[0].set_xlabel("feature")
axes[0].set_ylabel("token position")
axes[0].set_title(f"One dropout mask, p = {p}: {int((mask_image == 0).sum())} of 576 zeroed",
                  fontsize=10)
axes[0].legend(handles=[Patch(color=PART_COLORS["dropout"], label="dropped (0)"),
                        Patch(facecolor="#e6e6e6", edgecolor="0.6", label="kept (x / (1 - p))")],
               loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=9, frameon=False)
axes[1].plot(steps, running_inverted, color="0.2", label="inverted: mask / (1 - p)")
axes[1].plot(steps, running_plain, color=COLORS["accent"], label="mask only")
axes[1].axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="$x_i = 1$ (evaluation)")
axes[1].axhline(1 - p, color="black", linewidth=0.8, linestyle=":", label=f"$(1 - p)\\,x_i = {1 - p:g}$")
axes[1].set_xscale("log")
lowest = min(running_inverted.min().item(), running_plain.min().item())  # early draws swing most
highest = max(running_inverted.max().item(), running_plain.max().item())
axes[1].set_ylim(lowest - 0.05, highest + 0.25)  # every draw in view, room for the legend
axes[1].set_xlabel("number of draws (log scale)")
axes[1].set_ylabel(r"running mean of $y_i$ for $x_i = 1$")
axes[1].set_title("The 1/(1-p) scale keeps the expectation", fontsize=10)
axes[1].legend(fontsize=9)
plt.tight_layout()
plt.show()


# %% [markdown]
# **Inverted dropout zeroes a fraction $p$ and rescales the rest by $1/(1-p)$: the expectation
# is unchanged in training, and evaluation is the identity.**
#
# Because the two modes differ, a model must hold its dropouts as `nn.Dropout` modules (or pass
# `training=self.training` to `F.dropout`): `model.eval()` then switches every one of them off.
#
# ## The three places dropout sits
#
# In short: the paper drops out in places (1) and (3) below; (2) is optional, a choice each
# implementation makes.
#
# Vaswani et al. (2017, §5.4, "Residual Dropout") specify dropout in two places, with
# $P_{\text{drop}} = 0.1$ for the base model; most implementations add a third. Numbered from the
# bottom of the stack up:
#
# 1. **On the sum of the token embeddings and the positional encodings**, at the bottom of the
#    encoder and of the decoder stack (notebook 04's `PositionalEncoding(dropout_p=...)`). In
#    the paper, $P_{\text{drop}} = 0.1$.
# 2. **On the attention weights**, after the softmax and before they average the values. The
#    paper does not mention it, and the authors' own code of the paper's era did not use it
#    (see the note below). PyTorch offers it, and so does this course's
#    `scaled_dot_product_attention` (notebooks 02–03); its rate is a choice. By default it is
#    0.1 in `nn.Transformer` and its encoder and decoder layers (which give their one `dropout`
#    rate to `nn.MultiheadAttention`), but 0 in `nn.MultiheadAttention` and
#    `F.scaled_dot_product_attention` used on their own.
# 3. **On the output of every sub-layer** (attention or feed-forward), before it is added to the
#    residual stream. In the paper, $P_{\text{drop}} = 0.1$. The residual path itself is never
#    dropped.
#
# (PyTorch's `nn.TransformerEncoderLayer` also drops out inside the feed-forward network, after
# the activation; this course's feed-forward network of notebook 07 does not.)
#
# *Note on (2).* In the authors' tensor2tensor library, the `transformer_base_v1` settings of
# the paper's era have `attention_dropout = 0.0` and `relu_dropout = 0.0` (the dropout inside the
# feed-forward network), with only the residual dropout at 0.1; the later `transformer_base_v2`
# set both to 0.1, in the same settings that moved the library to pre-norm
# (`layer_preprocess_sequence = "n"`).

# %% jupyter={"source_hidden": true}
def draw_box(ax, xy, text, color, width=2.2, height=0.62, text_color="white"):
    """A rounded box centred at xy."""
    x, y = xy
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                boxstyle="round,pad=0.04,rounding_size=0.12",
                                facecolor=color, edgecolor="black", linewidth=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=9, color=text_color)


def draw_arrow(ax, start, end, **kwargs):
    """A straight arrow between two points."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12,
                                 linewidth=1.2, color="black", shrinkA=0, shrinkB=0, **kwargs))


def draw_add(ax, xy):
    """The residual addition: a circle with a plus."""
    ax.add_patch(plt.Circle(xy, 0.22, facecolor="white", edgecolor="black", linewidth=1.2))
    ax.text(*xy, "+", ha="center", va="center", fontsize=13)


fig, ax = plt.subplots(figsize=(9, 9.6))
stream_x, branch_x, inner_x = 2.5, 5.6, 8.9  # residual stream, sub-layer branch, inside attention
drop, norm = PART_COLORS["dropout"], PART_COLORS["layer_norm"]

# bottom of the stack: embeddings + positional encodings, then dropout (1)
draw_box(ax, (1.3, 0.4), "token embedding", PART_COLORS["embedding"], width=2.3, text_color="black")
draw_box(ax, (4.05, 0.4), "positional encoding", PART_COLORS["positional"], width=2.6, text_color="black")
draw_add(ax, (stream_x, 1.35))
draw_arrow(ax, (1.3, 0.71), (stream_x - 0.16, 1.2))
draw_arrow(ax, (4.05, 0.71), (stream_x + 0.16, 1.2))
draw_box(ax, (stream_x, 2.2), "Dropout (1)", drop, width=1.7, text_color="black")
draw_arrow(ax, (stream_x, 1.57), (stream_x, 1.89))

# two pre-norm sub-layers: x + Dropout(Sublayer(LayerNorm(x)))
for name, base, sub in (("multi-head attention", 2.9, PART_COLORS["attention"]),
                        ("feed-forward network", 7.0, PART_COLORS["ffn"])):
    top = base + 3.4
    draw_box(ax, (branch_x, base + 0.75), "LayerNorm", norm)
    draw_box(ax, (branch_x, base + 1.75), name, sub, width=2.9, text_color="black")
    draw_box(ax, (branch_x, base + 2.75), "Dropout (3)", drop, width=1.7, text_color="black")
    draw_add(ax, (stream_x, top))
    # the branch leaves the stream, passes the three boxes, and comes back to the add
    ax.plot([stream_x, branch_x], [base + 0.2, base + 0.2], color="black", linewidth=1.2)
    draw_arrow(ax, (branch_x, base + 0.2), (branch_x, base + 0.44))
    draw_arrow(ax, (branch_x, base + 1.06), (branch_x, base + 1.44))
    draw_arrow(ax, (branch_x, base + 2.06), (branch_x, base + 2.44))
    ax.plot([branch_x, branch_x], [base + 3.06, top], color="black", linewidth=1.2)
    draw_arrow(ax, (branch_x, top), (stream_x + 0.22, top))
    ax.text(stream_x - 0.15, base + 1.9, "residual path\n(never dropped)", ha="right",
            va="center", fontsize=9)

# the residual stream itself
draw_arrow(ax, (stream_x, 2.51), (stream_x, 6.3 - 0.22))
draw_arrow(ax, (stream_x, 6.3 + 0.22), (stream_x, 10.4 - 0.22))
draw_arrow(ax, (stream_x, 10.4 + 0.22), (stream_x, 11.1))
ax.text(stream_x, 11.2, "to the next block (× N)", ha="center", va="bottom", fontsize=9)

# dropout (2) lives inside the attention, on the softmax weights
draw_box(ax, (inner_x, 4.65), r"softmax($QK^{\top}/\sqrt{d_k}$)", "#9a9a9a", width=2.5)
draw_box(ax, (inner_x, 5.55), "Dropout (2)", drop, width=1.7, text_color="black")
draw_arrow(ax, (inner_x, 4.96), (inner_x, 5.24))
ax.text(inner_x, 6.0, "then weights @ V", ha="center", va="bottom", fontsize=9)
ax.plot([branch_x + 1.45, inner_x - 1.25], [4.65, 4.65], color="black", linewidth=0.8,
        linestyle=":")
ax.text(inner_x, 4.1, "inside the attention", ha="center", va="top", fontsize=9, style="italic")

# a frame around one block, and the key to the three spots
ax.add_patch(FancyBboxPatch((0.55, 2.75), 9.85, 7.95, boxstyle="round,pad=0.05,rounding_size=0.2",
                            facecolor="none", edgecolor="0.6", linestyle="--"))
ax.text(10.3, 10.55, "one pre-norm encoder block", ha="right", va="top", fontsize=9, color="0.35")
legend_text = ("(1) on the sum of embeddings and positional encodings:\n"
               "     $P_{drop}$ = 0.1 in the base model (Vaswani et al., 2017, §5.4)\n"
               "(2) on the attention weights: not in the paper; an implementation's choice\n"
               "     (default 0.1 in nn.Transformer's layers, 0 in nn.MultiheadAttention)\n"
               "(3) on each sub-layer's output, before the residual add:\n"
               "     $P_{drop}$ = 0.1 in the base model (Vaswani et al., 2017, §5.4)")
ax.text(0.2, -0.55, legend_text, ha="left", va="top", fontsize=9, linespacing=1.5,
        bbox={"boxstyle": "round", "facecolor": "#fbe6f3", "edgecolor": drop})
ax.set_xlim(0, 10.6)
ax.set_ylim(-3.2, 11.7)
ax.set_aspect("equal")
ax.set_axis_off()
ax.set_title("Where dropout sits in a pre-norm Transformer block")
save_figure(fig, "dropout_placement")
plt.show()


# %% [markdown]
# In code, one pre-norm sub-layer with all its dropouts is three lines. Notebook 08 builds the
# real encoder and decoder blocks; here the attention is PyTorch's own, so that the only new
# pieces are ours: the layer norm and where the dropouts go.

# %%
class PreNormSelfAttention(nn.Module):
    """x + Dropout(SelfAttention(LayerNorm(x))), with dropout on the attention weights too."""

    def __init__(self, d_model: int, num_heads: int, dropout_p: float = 0.1):
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, num_heads, dropout=dropout_p, batch_first=True)  # (2)
        self.dropout = nn.Dropout(dropout_p)  # (3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)  # (B, T, D)
        h, _ = self.attn(h, h, h, need_weights=False)  # (B, T, D)
        return x + self.dropout(h)  # the residual path x is never dropped


embeddings = torch.randn(2, 10, 32, generator=generator).to(device)  # (B, T, D)
embed_dropout = nn.Dropout(0.1)  # (1), on embeddings + positional encodings
sublayer = PreNormSelfAttention(d_model=32, num_heads=4, dropout_p=0.1).to(device)

sublayer.train()
train_a, train_b = sublayer(embed_dropout(embeddings)), sublayer(embed_dropout(embeddings))
sublayer.eval()
embed_dropout.eval()
with torch.no_grad():
    eval_a, eval_b = sublayer(embed_dropout(embeddings)), sublayer(embed_dropout(embeddings))
print("with dropout (1), train: two passes differ:", not torch.equal(train_a, train_b))
print("with dropout (1), eval:  two passes equal: ", torch.equal(eval_a, eval_b))


def train_passes_differ(module: nn.Module) -> bool:
    """Do two training-mode passes of `module` over the same embeddings differ?"""
    module.train()
    with torch.no_grad():
        return not torch.equal(module(embeddings), module(embeddings))


only_weights = copy.deepcopy(sublayer)
only_weights.dropout = nn.Dropout(0.0)  # (3) off: only (2), on the attention weights, is left
only_output = copy.deepcopy(sublayer)
# nn.MultiheadAttention keeps its weight-dropout rate as a plain float, read at every call
only_output.attn.dropout = 0.0  # (2) off: only (3), on the sub-layer's output, is left
no_dropout = PreNormSelfAttention(d_model=32, num_heads=4, dropout_p=0.0).to(device)  # broken
sublayer_alone = {
    "(2) and (3)": train_passes_differ(sublayer),
    "(2) only": train_passes_differ(only_weights),
    "(3) only": train_passes_differ(only_output),
    "none": train_passes_differ(no_dropout),
}
sublayer.eval()  # leave it in evaluation mode, as above
for sites, differ in sublayer_alone.items():
    print(f"sub-layer alone, dropout {sites:11}: two training passes differ: {differ}")

# %% [markdown]
# **Check:** training passes are random and evaluation passes deterministic. The first line
# alone would prove little about the sub-layer: dropout (1) draws a new mask on the embeddings
# for each pass, so the two passes would differ even through a sub-layer without any dropout.
# The next lines therefore give the sub-layer the same embeddings twice. Its two training passes
# differ with both its dropouts on, with only (2) on the attention weights, and with only (3) on
# its output, so each site draws a mask of its own; and a copy built without dropout, the broken
# variant this check must reject, gives two equal passes.
#
# A *demonstration*, not a test: with the sub-layer's output dropout at $p = 1$ the sub-layer
# returns its input exactly, because dropout acts on the branch and never on the residual path.
# Any $x + \mathrm{Dropout}_{p=1}(\ldots)$ does that, whatever the branch computes, so it shows
# where the dropout sits, not that the norm and the attention are right (notebook 08 tests the
# blocks against PyTorch's, and runs the site test below on the course's own blocks).
#
# **Check:** PyTorch's own (pre-norm) encoder layer drops out in the same places, plus one
# inside the feed-forward network. Its one `dropout` rate (default 0.1) goes to four sites. We
# build it with rate 0, set one site at a time to $p = 1$ in training mode, and compare with
# what that site predicts, up to float rounding ($h$ is the stream between the two sub-layers).
# The test runs on the CPU whatever `device` is: where a layer's dropouts sit does not depend on
# the device, and $p = 1$ on the attention weights has not been tried on every fused GPU
# attention kernel.
#
# | site at $p = 1$ | where it acts | the layer then computes |
# |---|---|---|
# | `dropout1` | the self-attention's output, (3) | $x + \mathrm{FFN}(\mathrm{LN}_2(x))$ |
# | `dropout2` | the FFN's output, (3) | $x + \mathrm{Attn}(\mathrm{LN}_1(x))$ |
# | `self_attn.dropout` | the attention weights, (2) | $h + \mathrm{FFN}(\mathrm{LN}_2(h))$ with $h = x + b_o$, the attention's output bias alone |
# | `dropout` | inside the FFN, after the activation (not in this course) | $h + b_2$, the FFN's second bias alone, with $h = x + \mathrm{Attn}(\mathrm{LN}_1(x))$ |

# %%
assert not torch.equal(train_a, train_b)
assert torch.equal(eval_a, eval_b)
assert sublayer_alone["(2) and (3)"] and sublayer_alone["(2) only"] and sublayer_alone["(3) only"]
assert not sublayer_alone["none"]  # a sub-layer without dropout fails the check above

all_dropped = PreNormSelfAttention(d_model=32, num_heads=4, dropout_p=0.0).to(device).train()
all_dropped.dropout = nn.Dropout(1.0)  # zero the whole sub-layer output
assert torch.equal(all_dropped(embeddings), embeddings)  # a demonstration: any x + Dropout_1(...)



def builtin_with_one_site_dropped(site: str) -> nn.TransformerEncoderLayer:
    """PyTorch's pre-norm encoder layer in training mode, dropout 0 except p = 1 at `site`."""
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dropout=0.0, batch_first=True,
                                       norm_first=True).train()  # on the CPU
    with torch.no_grad():  # random biases and norm parameters (fresh ones are 0 and 1)
        for param in layer.parameters():
            if param.dim() == 1:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    if site == "attention weights":
        layer.self_attn.dropout = 1.0  # (2): a plain float that nn.MultiheadAttention reads per call
    else:
        setattr(layer, site, nn.Dropout(1.0))
    return layer


def builtin_attention(layer, h):  # (B, T, D) -> (B, T, D)
    return layer.self_attn(h, h, h, need_weights=False)[0]


def builtin_ffn(layer, h):  # (B, T, D) -> (B, T, D), with the layer's inner dropout
    return layer.linear2(layer.dropout(layer.activation(layer.linear1(h))))


assert nn.TransformerEncoderLayer(d_model=32, nhead=4).dropout1.p == 0.1  # the default rate
with torch.no_grad():
    x_in = embeddings.cpu()
    layer = builtin_with_one_site_dropped("dropout1")  # (3) on the attention's output
    assert_close(layer(x_in), x_in + builtin_ffn(layer, layer.norm2(x_in)))
    layer = builtin_with_one_site_dropped("dropout2")  # (3) on the FFN's output
    assert_close(layer(x_in), x_in + builtin_attention(layer, layer.norm1(x_in)))
    layer = builtin_with_one_site_dropped("attention weights")  # (2) every weight zeroed
    h_mid = x_in + layer.self_attn.out_proj.bias  # the attention contributes only its bias
    assert_close(layer(x_in), h_mid + builtin_ffn(layer, layer.norm2(h_mid)))
    layer = builtin_with_one_site_dropped("dropout")  # the extra one, inside the FFN
    h_mid = x_in + builtin_attention(layer, layer.norm1(x_in))
    assert_close(layer(x_in), h_mid + layer.linear2.bias)
print("PyTorch's encoder layer: dropout acts after each sub-layer, on the attention weights, inside the FFN")

# %% [markdown]
# Dropout on the attention weights has one visible side effect: a row of weights no longer sums
# to 1, only on average. The model must cope with each query's mixture of values being a bit
# too strong or too weak.

# %%
scores = torch.randn(6, 6, generator=generator)  # (T_q, T_k)
attn = scores.softmax(dim=-1)  # (T_q, T_k), rows sum to 1
attn_dropped = dropout(attn.expand(4000, 6, 6), 0.1, generator=generator)  # (S, T_q, T_k)
row_sums = attn_dropped.sum(dim=-1)  # (S, T_q)
print("row sums of one dropped-out matrix:", [round(v, 3) for v in row_sums[0].tolist()])
print("mean row sum over 4000 draws:      ", [round(v, 3) for v in row_sums.mean(dim=0).tolist()])

# %%
assert (row_sums[0] - 1).abs().max() > 0.05  # one draw: not a distribution any more
# the sum of a row has std at most sqrt(p / (1 - p) / S) = 0.0053 over S draws; allow 6x
assert_close(row_sums.mean(dim=0), torch.ones(6), atol=6 * math.sqrt(0.1 / 0.9 / 4000), rtol=0)


# %% [markdown]
# **Dropout goes on the embeddings and on every sub-layer's output before the residual add (the
# paper's two places, $P_{\text{drop}} = 0.1$ in the base model), optionally on the attention
# weights as well (an implementation choice the paper-era code did not make), and never on the
# residual path.**
#
# ## Recap
#
# | concept | code | shape |
# |---|---|---|
# | layer norm | `LayerNorm(d_model, eps=1e-5)(x)` | $(\ldots, D) \to (\ldots, D)$ |
# | per-token statistics | `x.mean(-1, keepdim=True)`, biased `((x - mean)**2).mean(-1, keepdim=True)` | $(\ldots, D) \to (\ldots, 1)$ |
# | gain $\gamma$, bias $\beta$ | `weight` (ones), `bias` (zeros); `state_dict` shared with `nn.LayerNorm` | $(D,)$ |
# | the mistake to avoid | `x.var(-1)` divides by $D-1$: output $\times\sqrt{(D-1)/D}$ | |
# | batch norm (contrast) | `nn.BatchNorm1d(D)` on `x.transpose(1, 2)`: statistics over $B \cdot T$ | $(B, D, T)$ |
# | inverted dropout | `x * mask / (1 - p)`, identity in `eval()` | any, unchanged |
# | dropout (1) | `PositionalEncoding(d_model, dropout_p=0.1)` | $(B, T, D)$ |
# | dropout (2) | `scaled_dot_product_attention(..., dropout_p=0.1, training=self.training)`: its `training` defaults to `True`, so without it the weights are dropped in evaluation too | $(B, h, T_q, T_k)$ |
# | dropout (3) | `x + dropout(sublayer(norm(x)))` | $(B, T, D)$ |
#
# ## Exercises
#
# 1. **RMSNorm.** Many recent models (Zhang and Sennrich, 2019) drop the centring and the
#    bias: $y = x / \sqrt{\tfrac{1}{D}\sum_i x_i^2 + \epsilon} \odot \gamma$. Write it and show
#    that it equals `LayerNorm` (with $\beta = 0$) exactly when every token has mean zero.
# 2. **The gradient of a standardisation.** Show that the gradient of any loss with respect
#    to a token's input $x$ sums to zero over the features and is (up to $\epsilon$)
#    orthogonal to $\hat{x}$. What does that say about which changes of $x$ layer norm
#    ignores?
# 3. **Dropout's variance.** Check $\operatorname{Var}[y_i] = x_i^2\,p/(1-p)$ by sampling, and
#    say what it implies for the scale of activations when dropout is switched off at
#    evaluation.
#
# **Solutions.**
#
# 1. RMSNorm divides by the root mean square instead of the standard deviation. The two
#    coincide when $\mu = 0$, because then $\sigma^2 = \frac{1}{D}\sum_i x_i^2$:

# %%
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm: scale each vector by its root mean square; no centring, no bias."""
    rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., D) -> (..., 1)
    return x / rms * weight


x_ex = torch.randn(3, 7, 24, generator=generator)  # (B, T, D)
gamma = torch.randn(24, generator=generator)
ln_ex = LayerNorm(24)
with torch.no_grad():
    ln_ex.weight.copy_(gamma)
    centred_x = x_ex - x_ex.mean(dim=-1, keepdim=True)  # every token now has mean 0
    assert_close(rms_norm(centred_x, gamma), ln_ex(centred_x))
    assert not torch.allclose(rms_norm(x_ex, gamma), ln_ex(x_ex), atol=1e-3)  # not otherwise
if hasattr(nn, "RMSNorm"):  # torch >= 2.4 ships one
    builtin_rms = nn.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        builtin_rms.weight.copy_(gamma)
        assert_close(rms_norm(x_ex, gamma), builtin_rms(x_ex))

# %% [markdown]
# 2. Write $\hat{x} = (x - \mu)/s$ with $s = \sqrt{\sigma^2 + \epsilon}$. Since
#    $\partial\mu/\partial x = \mathbf{1}/D$ and $\partial s/\partial x = (x-\mu)/(sD)$, the
#    Jacobian is the symmetric matrix
#    $$J = \frac{\partial \hat{x}}{\partial x} = \frac{1}{s}\Big(I - \tfrac{1}{D}\mathbf{1}\mathbf{1}^{\top}
#    - \tfrac{1}{D}\,\hat{x}\hat{x}^{\top}\Big).$$
#    Using $\mathbf{1}^\top\hat{x} = 0$ and $\hat{x}^\top\hat{x} = D\sigma^2/(\sigma^2+\epsilon)$:
#    $J\mathbf{1} = 0$ and $J\hat{x} = \frac{\epsilon}{s^3}\,\hat{x}$. The input gradient is
#    $\nabla_x L = J\,\nabla_{\hat{x}} L$ (for any $\gamma$, $\beta$), so
#    $\mathbf{1}^\top\nabla_x L = 0$ exactly and
#    $\hat{x}^\top\nabla_x L = \frac{\epsilon}{s^3}\,\hat{x}^\top\nabla_{\hat{x}} L \approx 0$.
#    Layer norm ignores shifting a token (adding a constant to all its features) and, up to
#    $\epsilon$, scaling its deviation from the mean; the gradient has no component along
#    either, so learning cannot waste effort on them. Checked with autograd, in float64; the
#    printout sets the $\epsilon$-sized component against the size of the two vectors:

# %%
x_grad = torch.randn(5, 32, generator=generator, dtype=torch.float64).requires_grad_(True)  # (N, D)
norm_grad = LayerNorm(32).double()
with torch.no_grad():
    norm_grad.weight.copy_(torch.randn(32, generator=generator))  # any gamma
upstream_grad = torch.randn(5, 32, generator=generator, dtype=torch.float64)  # dL/dy, (N, D)
norm_grad(x_grad).backward(upstream_grad)
with torch.no_grad():
    mean_g = x_grad.mean(dim=-1, keepdim=True)  # (N, 1)
    s_g = torch.sqrt(((x_grad - mean_g) ** 2).mean(dim=-1, keepdim=True) + 1e-5)  # (N, 1)
    x_hat = (x_grad - mean_g) / s_g  # (N, D)
    grad_x_hat = upstream_grad * norm_grad.weight  # dL/dx_hat, (N, D)
    assert_close(x_grad.grad.sum(dim=-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    along_x_hat = (x_grad.grad * x_hat).sum(dim=-1)  # (N,)
    assert_close(along_x_hat, 1e-5 / s_g[:, 0] ** 3 * (x_hat * grad_x_hat).sum(dim=-1))
cosine = along_x_hat / (x_hat.norm(dim=-1) * x_grad.grad.norm(dim=-1))  # (N,), scale-free
print(f"largest |x_hat . grad|: {along_x_hat.abs().max().item():.1e}, "
      f"against a smallest |x_hat| |grad| of {(x_hat.norm(dim=-1) * x_grad.grad.norm(dim=-1)).min().item():.0f}; "
      f"largest |cosine(x_hat, grad)| {cosine.abs().max().item():.1e}")

# %% [markdown]
# 3. Each $y_i$ is $x_i/(1-p)$ with probability $1-p$ and $0$ otherwise, so
#    $\mathbb{E}[y_i^2] = x_i^2/(1-p)$ and $\operatorname{Var}[y_i] = x_i^2/(1-p) - x_i^2 =
#    x_i^2\,p/(1-p)$. The mean is kept but the spread grows; in evaluation the spread goes back
#    down, so the layers after dropout see activations with the same mean and a slightly
#    smaller variance than in training. For $p = 0.1$ the extra variance is $11\%$ of $x_i^2$.
#    The next layer norm divides every token by its own standard deviation, so an overall change
#    of scale does not get past it; how much the mismatch costs a trained model is not measured
#    here.

# %%
x_var = torch.tensor([0.5, -1.0, 2.0])  # (3,)
draws_var = dropout(x_var.expand(100_000, 3), 0.1, generator=generator)  # (S, 3)
empirical = draws_var.var(dim=0)
predicted_var = x_var**2 * 0.1 / 0.9
print("empirical:", [round(v, 3) for v in empirical.tolist()],
      " predicted:", [round(v, 3) for v in predicted_var.tolist()])
assert_close(empirical, predicted_var, rtol=0.05, atol=0)

# %% [markdown]
# ## Appendix A · How much a float32 parity test sees
#
# The main text compared on inputs with a spread near 0.1, where a misplaced $\epsilon$ is
# caught. This appendix measures why the comparison on `x` (spread near 1) missed it, and what
# the alternatives see; nothing else in the notebook depends on it.
#
# Moving $\epsilon$ outside the square root, $(x - \mu)/(\sigma + \epsilon)$, multiplies a
# token's $\hat{x}$ by
# $\sqrt{\sigma^2 + \epsilon}/(\sigma + \epsilon) \approx 1 - \frac{\epsilon}{\sigma}\bigl(1 - \frac{1}{2\sigma}\bigr)$,
# a relative change of at most $\epsilon/2 = 5 \cdot 10^{-6}$ (reached at $\sigma = 1$) for
# every token with $\sigma \ge 1/2$, and of about $10^{-4}$ to $10^{-3}$ for the main text's tokens
# scaled by 0.1 ($\sigma$ from 0.065 to 0.16). Whether a comparison of $\hat{x}$ sees that
# depends on its inputs and its tolerance:
#
# | comparison of $\hat{x}$ | tolerance (relative, absolute) | $\epsilon$ outside the root |
# |---|---|---|
# | float32, this notebook's parity test, inputs like `x` (token $\sigma$ near 1) | $10^{-5}$, $10^{-5}$ | missed on every one of the 200 draws below: the change is below the relative tolerance |
# | float32, the same test, the tokens scaled by 0.1 (the main text; the unit test `test_parity_for_several_eps` uses such inputs too) | $10^{-5}$, $10^{-5}$ | caught: the change is over ten times the relative tolerance |
# | float32, `assert_close`'s defaults, inputs like `x` | $1.3 \cdot 10^{-6}$, $10^{-5}$ | up to chance: caught only where a token with $\sigma$ near 1 has an entry with $\lvert\hat{x}_i\rvert$ above about 2.7, so that $5 \cdot 10^{-6}\lvert\hat{x}_i\rvert$ exceeds $10^{-5} + 1.3 \cdot 10^{-6}\lvert\hat{x}_i\rvert$ |
# | float64, `assert_close`'s defaults, inputs like `x` | $10^{-7}$, $10^{-7}$ | caught: the relative change reaches $5 \cdot 10^{-6}$, 50 times the relative tolerance |
#
# The next cell repeats the comparison on `x` in float64, where the two correct implementations
# agree to within $10^{-12}$ relative to the largest value (asserted) and the misplaced
# $\epsilon$ fails. It also counts, over 200 fresh draws of inputs like `x`, how often the
# float32 defaults would have caught it. (We compare $\hat{x}$, before $\gamma$ and $\beta$: on
# $y = \gamma\hat{x} + \beta$ the same absolute change is judged relative to $|y|$, which is
# small wherever $\beta$ nearly cancels $\gamma\hat{x}$; a float32 test of $y$ would depend on
# the draw even more.)

# %%
# float64: the same comparison at assert_close's float64 tolerances (rtol = atol = 1e-7)
x64, ours64, reference64 = x.double(), copy.deepcopy(ours).double(), copy.deepcopy(reference).double()
for name, a, b in zip(parity, output_and_grads(ours64, x64), output_and_grads(reference64, x64), strict=True):
    assert_close(a, b, msg=f"float64 {name}")
    assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name  # far inside the float64 tolerance

with torch.no_grad():  # x_hat only: gamma = 1, beta = 0
    misplaced, correct = layer_norm_eps_outside(x64, 1.0, 0.0), F.layer_norm(x64, (d_model,))
assert not torch.allclose(misplaced, correct, rtol=1e-7, atol=1e-7)  # float64: caught
assert torch.allclose(misplaced.float(), correct.float(), rtol=1e-5, atol=1e-5)  # our float32 test: missed
token_std = x64.std(dim=-1, unbiased=False)  # (B, T)
print(f"eps outside the square root: largest relative change of x_hat "
      f"{((misplaced - correct) / correct).abs().max().item():.1e} (eps/2 = 5.0e-06); "
      f"token std from {token_std.min().item():.2f} to {token_std.max().item():.2f}")

# assert_close's float32 defaults (rtol 1.3e-6, atol 1e-5) on 200 fresh draws of x
eps_draws = torch.Generator().manual_seed(0)  # a stream of its own: `generator` is left as it was
caught_by_default = 0
for _ in range(200):
    x_draw = torch.randn(B, T, d_model, generator=eps_draws, dtype=torch.float64)  # (B, T, D)
    with torch.no_grad():
        misplaced_32 = layer_norm_eps_outside(x_draw, 1.0, 0.0).float()
        correct_32 = F.layer_norm(x_draw, (d_model,)).float()
    assert torch.allclose(misplaced_32, correct_32, rtol=1e-5, atol=1e-5)  # missed every time
    caught_by_default += not torch.allclose(misplaced_32, correct_32, rtol=1.3e-6, atol=1e-5)
on_this_draw = not torch.allclose(misplaced.float(), correct.float(), rtol=1.3e-6, atol=1e-5)
assert 0 < caught_by_default < 200  # sometimes caught, sometimes not: up to chance
print(f"float32 at assert_close's defaults: caught in {caught_by_default} of 200 fresh draws; "
      f"on this notebook's draw: {'caught' if on_this_draw else 'missed'}")

# %% [markdown]
# **A parity test should compare where the detail under test changes the output: on inputs
# with a small spread a float32 test sees a misplaced $\epsilon$; on inputs with a spread near
# 1 only a float64 test sees it reliably.**
#
# Next: [07 · Feed-forward network](07_feed_forward.ipynb), the position-wise network that
# fills the other sub-layer of every block.
