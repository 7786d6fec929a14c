# %% [markdown]
# # 03 · Multi-head attention
#
# **What you will build:** `MultiHeadAttention`, the layer the Transformer uses everywhere: $h$
# small attentions that run side by side, each with its own learned projections, concatenated
# and mixed again. It goes into the package next to notebook 02's
# `scaled_dot_product_attention`. On the way you will see why the projections start from Xavier
# initialisation, draw what each head attends to, match PyTorch's `nn.MultiheadAttention` and
# `F.scaled_dot_product_attention` to float tolerance (gradients too), and find out what goes
# wrong if queries and keys share one projection.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/03_multi_head_attention.ipynb) · Assumes: [00 · Setup](00_setup.ipynb) (the `checks` helpers: `checking()`, `validated()`), [01 · Attention](01_attention.ipynb) (why scores are divided by $\sqrt{d_k}$) and [02 · Self-attention](02_self_attention.ipynb) (`scaled_dot_product_attention` on batched tensors, masks where `True` means "may attend").

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
from torch import nn

from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.utils import (
    COLORS,
    OTHER_COLORS,
    add_to_class,
    get_device,
    save_figure,
    set_seed,
)
from transformer_from_scratch.viz import plot_attention

set_seed(0)
device = get_device()

# %% [markdown]
# ## Why more than one head
#
# One attention head gives each query **one** probability distribution over the keys and hands
# back **one** weighted average of the values. That is a problem as soon as a word needs two
# different things from its context. In "the cat sat on the mat", the verb *sat* would like to
# know its subject (*cat*) and where the sitting happened (*on the mat*). A single head has to
# split its weight between them and returns a blend such as $\tfrac12 v_{\text{cat}} +
# \tfrac12 v_{\text{on}}$; the blend no longer says which word played which part.
#
# Multi-head attention (Vaswani et al., 2017) runs $h$ attentions in parallel. Head $i$ has its own
# projections $W_i^Q, W_i^K, W_i^V \in \mathbb{R}^{d_{\text{model}} \times d_k}$, so it compares
# tokens in its own $d_k$-dimensional subspace and can pick out its own relation:
#
# $$\mathrm{head}_i = \mathrm{Attention}\big(X_q W_i^Q,\; X_k W_i^K,\; X_v W_i^V\big) \in \mathbb{R}^{T_q \times d_k}.$$
#
# The heads' outputs are **concatenated**, so each keeps its own coordinates, and a last
# projection $W^O \in \mathbb{R}^{h d_k \times d_{\text{model}}}$ mixes them:
#
# $$\mathrm{MultiHead}(X_q, X_k, X_v) = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_h)\, W^O .$$
#
# The paper takes $d_{\text{model}} = 512$, $h = 8$ and $d_k = d_v = d_{\text{model}}/h = 64$:
# eight narrow heads cost about as much as one wide one. The last section counts both costs,
# parameters and FLOPs, for every $h$.
#
# ### Packed projections
#
# Nobody runs $h$ separate matrix products. Stack the heads' matrices side by side,
# $W^Q = [W_1^Q \,|\, W_2^Q \,|\, \cdots \,|\, W_h^Q] \in \mathbb{R}^{d_{\text{model}} \times h d_k}$,
# and one product $X W^Q$ computes every head's queries at once: head $i$'s queries are columns
# $i d_k$ to $(i+1) d_k - 1$ of the result. With $h d_k = d_{\text{model}}$ this is a single
# `nn.Linear(d_model, d_model)`. PyTorch stores a `Linear`'s weight transposed, as
# (out_features, in_features), so head $i$ owns **rows** $i d_k, \dots, (i+1) d_k - 1$ of
# `weight`.
#
# **Check:** $h$ separate per-head projections, `nn.Linear(d_model, d_k)` each, stacked into one
# packed `Linear` (each head's weight below the previous one's, as rows), give exactly what
# the separate projections give, head $i$ in columns $i d_k, \dots, (i+1) d_k - 1$ of the packed
# output; reading head $i$ from any other block of columns fails it.

# %%
d_model, num_heads = 12, 3
d_k = d_model // num_heads
X = torch.randn(5, d_model)  # (T, d_model): five tokens
W_packed = nn.Linear(d_model, d_model, bias=False)
with torch.random.fork_rng(devices=[]):  # the separate heads do not shift later random draws
    torch.manual_seed(1)
    separate_heads = [nn.Linear(d_model, d_k, bias=False) for _ in range(num_heads)]  # (d_k, d_model) each
with torch.no_grad():
    W_packed.weight.copy_(torch.cat([head.weight for head in separate_heads]))  # (h * d_k, d_model)
Q_packed = W_packed(X)  # (T, d_model) = (T, h * d_k)

for i, head in enumerate(separate_heads):
    torch.testing.assert_close(Q_packed[:, i * d_k : (i + 1) * d_k], head(X))  # head i: (T, d_k)
    for other in range(num_heads):  # any other block of columns is another head's queries
        if other != i:
            assert not torch.allclose(Q_packed[:, other * d_k : (other + 1) * d_k], head(X))

# %% [markdown]
# The picture: the packed weight, with the rows that belong to each head marked, and the
# queries it produces, whose columns fall into the same $h$ blocks.

# %% jupyter={"source_hidden": true}
packed_heads, packed_width = 3, W_packed.out_features // 3  # h and d_k of this example
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 1.1]})
panels = [
    (W_packed.weight.detach(), "packed weight W_packed.weight: (h·d_k, d_model)",
     "input channel", "output channel (rows)", "weight"),
    (Q_packed.detach(), "queries Q = X · W_packed.weightᵀ: (T, h·d_k)", "query channel (columns)",
     "token", "query component"),
]
for ax, (values, title, xlabel, ylabel, bar_label) in zip(axes, panels, strict=True):
    im = ax.imshow(values.numpy(), cmap="RdBu_r", vmin=-values.abs().max(), vmax=values.abs().max())
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=bar_label)
for i in range(1, packed_heads):
    axes[0].axhline(i * packed_width - 0.5, color="black", lw=2)
    axes[1].axvline(i * packed_width - 0.5, color="black", lw=2)
centres = [i * packed_width + (packed_width - 1) / 2 for i in range(packed_heads)]
for i, centre in enumerate(centres):  # name each block of d_k = 4 channels after its head
    axes[0].text(-2.7, centre, f"head {i}", ha="center", va="center", fontsize=9, weight="bold",
                 rotation=90)
    axes[1].text(centre, 5.6, f"head {i}", ha="center", va="top", fontsize=9, weight="bold")
axes[0].set_ylabel("output channel (rows)", labelpad=28)
axes[1].set_xlabel("query channel (columns)", labelpad=22)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Takeaway: $h$ heads of width $d_k = d_{\text{model}}/h$ are one `Linear(d_model, d_model)`
# whose output channels are read in $h$ blocks.**
#
# ## The module, one method at a time
#
# The class goes into the package's `attention` module, where notebook 02 put
# `scaled_dot_product_attention`. The forward pass calls that function; it is not written again.

# %%
#| default_exp attention

# %%
#| export
import torch
from torch import nn

from transformer_from_scratch.checks import (
    check_bool,
    check_int,
    check_mask,
    check_probability,
    check_tensor,
    checking,
    validated,
)


# %% [markdown]
# The constructor holds the four packed projections, named after the paper's matrices, and
# refuses a `d_model` that the heads cannot share equally.

# %%
#| export
class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al., 2017) with packed projections W_q, W_k, W_v, W_o."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout_p: float = 0.0,
        bias: bool = True,
        fast: bool = False,  # notebook 14's implementation: Q, K, V in one matmul, fused kernels
    ):
        super().__init__()
        d_model, num_heads = check_int("d_model", d_model, 1), check_int("num_heads", num_heads, 1)
        if d_model % num_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}: "
                "every head needs the same width d_k = d_model / num_heads"
            )
        dropout_p = check_probability("dropout_p", dropout_p)
        check_bool("bias", bias)
        self.fast = check_bool("fast", fast)
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads  # width of one head (d_v = d_k as well)
        self.dropout_p = float(dropout_p)
        # Each Linear computes all h heads at once: output channels i*d_k .. (i+1)*d_k - 1
        # belong to head i.
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, d_model, bias=bias)
        self.W_v = nn.Linear(d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias)  # mixes the concatenated heads
        self._reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, d_k={self.d_k}, "
            f"dropout_p={self.dropout_p}" + (", fast=True" if self.fast else "")
        )


# %% [markdown]
# ## Initialisation: Xavier, and why
#
# Take one output of a projection, $y_j = \sum_{i=1}^{n_{\text{in}}} W_{ji} x_i$, with weights and
# inputs independent and of mean zero. Its variance is
#
# $$\operatorname{Var}(y_j) = n_{\text{in}} \operatorname{Var}(W) \operatorname{Var}(x).$$
#
# The activations keep their scale on the way forward if $\operatorname{Var}(W) = 1/n_{\text{in}}$;
# the same argument for the gradients on the way back asks for $1/n_{\text{out}}$. Glorot and
# Bengio (2010) split the difference, $\operatorname{Var}(W) = 2/(n_{\text{in}} + n_{\text{out}})$,
# drawn uniformly from $[-a, a]$ with $a = \sqrt{6/(n_{\text{in}} + n_{\text{out}})}$ (a uniform
# distribution on $[-a, a]$ has variance $a^2/3$). Our four projections are square, so
# $n_{\text{in}} = n_{\text{out}} = d_{\text{model}}$ and Xavier gives exactly
# $1/d_{\text{model}}$: the scale is preserved in **both** directions.
#
# PyTorch's default for `nn.Linear` is different: uniform on $[-1/\sqrt{n_{\text{in}}},
# 1/\sqrt{n_{\text{in}}}]$, a variance of $1/(3 n_{\text{in}})$, so each projection shrinks the
# variance of its input by a factor of three. For attention that matters twice. The scores
# $q \cdot k / \sqrt{d_k}$ have variance $\operatorname{Var}(q)\operatorname{Var}(k)$, and
# notebook 01's argument for dividing by $\sqrt{d_k}$ assumed unit-variance queries and keys.
# With the default init they have variance $1/3$ each, the scores $1/9$, and every head starts
# out attending almost uniformly: in the check below, a row of such scores over 256 keys spreads
# its weight as evenly as a uniform row over about 242 keys would (Xavier: about 158), a count
# the check defines from the entropy of the row.
#
# Our module uses Xavier-uniform weights and zero biases:

# %%
#| export
@add_to_class(MultiHeadAttention)
def _reset_parameters(self) -> None:
    """Xavier-uniform weights and zero biases: projections that keep the variance of x."""
    for proj in (self.W_q, self.W_k, self.W_v, self.W_o):
        nn.init.xavier_uniform_(proj.weight)
        if proj.bias is not None:
            nn.init.zeros_(proj.bias)


# %% [markdown]
# **Check:** feed unit-variance inputs through one projection of width 256 initialised each way,
# and compare the output variance with the prediction ($1$ for Xavier, $1/3$ for the default).
# Then the scores of one head of width 256: variance $1$ against $1/9$. How uniform a row of
# weights $a = \mathrm{softmax}(s)$ is, we measure by $e^{H(a)}$, the exponential of its entropy
# $H(a) = -\sum_j a_j \log a_j$: the number of keys a uniform row with the same entropy would
# cover, $T$ for a uniform row, $1$ for a row on one key. The helper `projection` initialises one
# `nn.Linear` each way; the module's own `_reset_parameters` is checked further down.

# %%
def projection(init: str, n: int, bias: bool = True) -> nn.Linear:
    """A square nn.Linear with PyTorch's default init, or with Xavier weights and zero bias."""
    layer = nn.Linear(n, n, bias=bias)
    if init == "xavier":
        nn.init.xavier_uniform_(layer.weight)
        if bias:
            nn.init.zeros_(layer.bias)
    return layer


d_init = 256
x_unit = torch.randn(8192, d_init)  # (N, d): unit-variance inputs, one row per token
x_head = torch.randn(256, d_init)  # (T, d): the input of one head of width d_k = d
out_var, scores = {}, {}
with torch.no_grad():
    for init in ("xavier", "default"):
        out_var[init] = projection(init, d_init)(x_unit).var().item()
        q, k = projection(init, d_init)(x_head), projection(init, d_init)(x_head)  # (T, d_k) each
        scores[init] = q @ k.T / math.sqrt(d_init)  # (T, T)

weights_init = {init: s.softmax(dim=-1) for init, s in scores.items()}  # (T, T) each
keys_used = {init: (-(a * a.log()).sum(-1)).exp().mean().item() for init, a in weights_init.items()}
print(f"output variance   Xavier {out_var['xavier']:.2f}   default {out_var['default']:.2f}   (theory 1 and 0.33)")
print(f"score variance    Xavier {scores['xavier'].var():.2f}   default {scores['default'].var():.2f}   (theory 1 and 0.11)")
print(f"keys a row spreads over, exp(entropy), of {x_head.shape[0]}:   "
      f"Xavier {keys_used['xavier']:.0f}   default {keys_used['default']:.0f}")
assert abs(out_var["xavier"] - 1.0) < 0.05 and abs(out_var["default"] - 1 / 3) < 0.03
assert abs(scores["xavier"].var() - 1.0) < 0.15 and abs(scores["default"].var() - 1 / 9) < 0.03
# over 300 seeds: default 241 to 243, Xavier 153 to 161
assert keys_used["default"] > 0.9 * x_head.shape[0] and keys_used["xavier"] < 0.75 * x_head.shape[0]

# %% [markdown]
# Now a stack of bias-free projections (no nonlinearity and no bias, so only the weights act on
# the scale). Inside a real Transformer, residual connections and layer norm stop the shrinking
# from compounding layer after layer (notebooks 06 and 08 show how); the stack only makes the
# per-projection factor visible. **Check:** with Xavier the variance stays within 10% of 1 through ten
# projections; with the default it falls like $3^{-L}$. Then the picture, with the distribution of
# the head's scores from the check above.

# %%
depth = 10
variances = {}
with torch.no_grad():
    for init in ("xavier", "default"):
        act, variances[init] = x_unit, [1.0]
        for _ in range(depth):
            act = projection(init, d_init, bias=False)(act)  # (N, d) -> (N, d)
            variances[init].append(act.var().item())
assert all(abs(v - 1.0) < 0.1 for v in variances["xavier"])
assert abs(variances["default"][-1] / 3.0**-depth - 1.0) < 0.2  # shrinks like 3^-L
print(f"variance after {depth} projections: Xavier {variances['xavier'][-1]:.2f}, "
      f"default {variances['default'][-1]:.1e} (3^-{depth} = {3.0**-depth:.1e})")

# %% jupyter={"source_hidden": true}
layers = np.arange(depth + 1)
labels = {"xavier": "Xavier uniform (ours)", "default": "nn.Linear default"}
colors = {"xavier": COLORS["ours"], "default": COLORS["torch"]}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
for init, marker in (("xavier", "o-"), ("default", "s-")):
    ax1.semilogy(layers, variances[init], marker, color=colors[init], label=labels[init])
    ax2.hist(scores[init].flatten().numpy(), bins=80, range=(-4, 4), density=True, alpha=0.6,
             color=colors[init], label=f"{labels[init]}: variance {scores[init].var():.2f}")
ax1.semilogy(layers, 3.0**-layers, ":", color="black", lw=2, zorder=3,
             label="theory for the default: $3^{-L}$")
ax1.set_xlabel("number of projections L")
ax1.set_ylabel("variance of the activations")
ax1.set_title(f"Unit-variance input through L projections (d = {d_init})")
ax1.legend()
ax2.set_xlabel("score $q \\cdot k / \\sqrt{d_k}$")
ax2.set_ylabel("density")
ax2.set_title(f"One head's scores at initialisation ($d_k$ = {d_init})")
ax2.legend()
fig.tight_layout()
save_figure(fig, "mha_xavier_init")
plt.show()

# %% [markdown]
# `nn.MultiheadAttention` uses Xavier too, but on its packed $(3 d_{\text{model}},
# d_{\text{model}})$ input matrix as a whole: $n_{\text{out}} = 3 d_{\text{model}}$ gives a
# weight variance of $2/(4 d_{\text{model}})$, half of ours, while the weight of its output
# projection keeps the `Linear` default, variance $1/(3 d_{\text{model}})$; both of its biases
# start at 0, like ours. The two modules start from different weights, which is one more reason
# the parity checks below copy weights instead of comparing fresh modules.
#
# **Check:** all four of our projections start with $d_{\text{model}} \operatorname{Var}(W)
# \approx 1$ and biases of exactly 0. To show the check can fail, a second module gets its
# output projection reset to the `Linear` default, as a `_reset_parameters` that forgot `W_o`
# would leave it: weight variance $1/(3 d_{\text{model}})$ and a random bias.

# %%
torch_mha = nn.MultiheadAttention(512, 8)
in_var = torch_mha.in_proj_weight.var().item() * 512
out_proj_var = torch_mha.out_proj.weight.var().item() * 512
ours_init = MultiHeadAttention(512, 8)


def init_report(module: MultiHeadAttention) -> dict[str, tuple[float, float]]:
    """(d_model * Var(W), largest |bias|) for each of the module's four projections."""
    projections = {"W_q": module.W_q, "W_k": module.W_k, "W_v": module.W_v, "W_o": module.W_o}
    return {name: (proj.weight.var().item() * module.d_model, proj.bias.abs().max().item())
            for name, proj in projections.items()}


def xavier_and_zero_bias(module: MultiHeadAttention) -> bool:
    """All four projections: d_model * Var(W) within 3% of 1, and every bias exactly 0."""
    return all(abs(var - 1) < 0.03 and bias == 0 for var, bias in init_report(module).values())


with torch.random.fork_rng(devices=[]):  # the broken module does not shift later random draws
    broken = MultiHeadAttention(512, 8)
    broken.W_o.reset_parameters()  # as if _reset_parameters skipped W_o: the Linear default

print(f"nn.MultiheadAttention, d_model x Var(W):  in_proj {in_var:.2f}   out_proj {out_proj_var:.2f}")
print("d_model x Var(W) / largest |bias|:")
for label, module in [("ours", ours_init), ("W_o skipped", broken)]:
    print(f"  {label:<12}" + "   ".join(f"{name} {var:.2f} / {bias:.3f}"
                                         for name, (var, bias) in init_report(module).items()))
assert abs(in_var - 0.5) < 0.02 and abs(out_proj_var - 1 / 3) < 0.02
assert xavier_and_zero_bias(ours_init)
assert not xavier_and_zero_bias(broken)  # the check catches a projection left at the default


# %% [markdown]
# **Takeaway: for a square projection, Xavier's variance $1/d_{\text{model}}$ keeps unit-variance
# inputs at unit variance, which is what the $1/\sqrt{d_k}$ scaling of the scores assumes;
# PyTorch's `Linear` default would shrink them by three at every projection.**
#
# ## Splitting and combining heads
#
# After the packed projection, a tensor of shape $(B, T, d_{\text{model}})$ holds all heads side by
# side in its last axis. `split_heads` reshapes the last axis into $(h, d_k)$ and moves the head
# axis forward, to $(B, h, T, d_k)$: the head axis then behaves like a second batch axis, and one
# call to `scaled_dot_product_attention` runs every head at once. `combine_heads` is the inverse
# (the "Concat" of the formula).

# %%
#| export
@add_to_class(MultiHeadAttention)
def split_heads(self, x: torch.Tensor) -> torch.Tensor:
    """(B, T, d_model) -> (B, h, T, d_k): head i gets channels i*d_k .. (i+1)*d_k - 1."""
    B, T, _ = x.shape
    x = x.view(B, T, self.num_heads, self.d_k)  # (B, T, d_model) -> (B, T, h, d_k)
    return x.transpose(1, 2)  # (B, T, h, d_k) -> (B, h, T, d_k)


@add_to_class(MultiHeadAttention)
def combine_heads(self, x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d_k) -> (B, T, d_model): concatenate the heads' outputs again."""
    B, h, T, d_k = x.shape
    x = x.transpose(1, 2)  # (B, h, T, d_k) -> (B, T, h, d_k)
    # reshape, not view: after the transpose the memory is no longer in (B, T, h, d_k) order.
    return x.reshape(B, T, h * d_k)  # (B, T, h, d_k) -> (B, T, d_model)


# %% [markdown]
# **Check:** combining undoes splitting exactly, and head $i$ of the split is channel block $i$.
# The split is free: a view of the same memory with other strides. Combining is also a view when
# it merely undoes a split, as in the round trip. But the context that attention returns is a
# new, contiguous $(B, h, T, d_k)$ tensor, in which the $d_{\text{model}}$ channels of one token
# lie in $h$ separate places; `reshape` must gather them, and makes one copy.

# %%
mha_small = MultiHeadAttention(d_model=12, num_heads=3)
x_small = torch.randn(2, 5, 12)  # (B, T, d_model)
split = mha_small.split_heads(x_small)  # (B, h, T, d_k)

assert split.shape == (2, 3, 5, 4)
assert torch.equal(mha_small.combine_heads(split), x_small)  # exact round trip
for i in range(mha_small.num_heads):
    assert torch.equal(split[:, i], x_small[..., i * mha_small.d_k : (i + 1) * mha_small.d_k])
assert split.data_ptr() == x_small.data_ptr() and not split.is_contiguous()  # a view, no copy
assert mha_small.combine_heads(split).data_ptr() == x_small.data_ptr()  # undoing it: a view too

context_small = torch.randn(2, 3, 5, 4)  # (B, h, T, d_k), contiguous, as attention returns it
combined = mha_small.combine_heads(context_small)  # (B, T, d_model)
assert combined.data_ptr() != context_small.data_ptr() and combined.is_contiguous()  # one copy
assert torch.equal(combined, torch.cat(context_small.unbind(dim=1), dim=-1))  # Concat(head_0, ...)
print(tuple(x_small.shape), "->", tuple(split.shape), "->", tuple(combined.shape))

# %% [markdown]
# The picture: one sequence of $T = 5$ tokens with $d_{\text{model}} = 12$ channels, each cell
# coloured by the head that owns it and labelled with its channel number; after the split, each
# head is a $(T, d_k)$ matrix of its own.

# %% jupyter={"source_hidden": true}
from matplotlib.colors import ListedColormap

# Heads are not roles: they take the first three of OTHER_COLORS (purple, brown, pink).
head_colors = ListedColormap(OTHER_COLORS[:3])
channel = np.tile(np.arange(12), (5, 1))  # (T, d_model): channel number of every cell
owner = channel // mha_small.d_k  # (T, d_model): which head owns the cell

fig = plt.figure(figsize=(11, 2.6))
grid = fig.add_gridspec(1, 4, width_ratios=[12, 4, 4, 4], wspace=0.35)
panels = [(owner, channel, "x: (T, d_model)")]
with torch.no_grad():
    split_channel = mha_small.split_heads(torch.as_tensor(channel)[None].float())[0]  # (h, T, d_k)
for i in range(mha_small.num_heads):
    panels.append((np.full((5, 4), i), split_channel[i].int().numpy(), f"head {i}: (T, d_k)"))
for g, (colours, labels, title) in enumerate(panels):
    ax = fig.add_subplot(grid[g])
    ax.imshow(colours, cmap=head_colors, vmin=0, vmax=2)
    for (t, c), label in np.ndenumerate(labels):
        ax.text(c, t, str(label), ha="center", va="center", color="white", fontsize=9, weight="bold")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("channel" if g == 0 else "")
    ax.set_xticks([])
    ax.set_yticks(range(5))
    ax.set_ylabel("token" if g == 0 else "")
fig.suptitle("split_heads: the channel axis is cut into h = 3 blocks of d_k = 4", y=1.04)
plt.show()


# %% [markdown]
# **Takeaway: splitting is a reshape and a transpose, no arithmetic; the heads never mix until
# $W^O$.**
#
# ## Input checks
#
# A broadcasting mistake in attention rarely crashes: a wrong mask or a swapped axis usually
# broadcasts into *something* and silently attends to the wrong tokens. So the forward pass checks
# its inputs first and names the offending shape. A mask must broadcast to $(B, h, T_q, T_k)$;
# the common ones are $(1, 1, T_q, T_k)$ (the same for every sequence, like a causal mask) and
# $(B, 1, 1, T_k)$ (padding, per sequence). The helpers come from notebook 00's `checks` module,
# so every mistake gets the same kind of error (`TypeError` for a wrong type, `ValueError` for a
# wrong shape) as everywhere else in the course. A shape check stops only the masks that do not
# broadcast; a wrong mask that happens to broadcast passes it, and two such masks are shown after
# the checks below.

# %%
#| export
@add_to_class(MultiHeadAttention)
def _check_inputs(self, x_q: torch.Tensor, x_k: torch.Tensor, x_v: torch.Tensor) -> None:
    """Raise a TypeError/ValueError naming the shapes if the inputs cannot attend together."""
    for name, x in (("x_q", x_q), ("x_k", x_k), ("x_v", x_v)):
        check_tensor(name, x, dim=3, kind="float")
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}: last dimension {x.shape[-1]} "
                f"!= d_model={self.d_model}"
            )
    shapes = f"x_q {tuple(x_q.shape)}, x_k {tuple(x_k.shape)}, x_v {tuple(x_v.shape)}"
    if not x_q.shape[0] == x_k.shape[0] == x_v.shape[0]:
        raise ValueError(f"batch sizes differ: {shapes}")
    if x_k.shape[1] != x_v.shape[1]:
        raise ValueError(f"x_k and x_v must have the same length T_k, got {shapes}")


@add_to_class(MultiHeadAttention)
def _check_mask(self, mask: torch.Tensor | None, B: int, T_q: int, T_k: int) -> None:
    """The mask must broadcast to (B, h, T_q, T_k), and be bool (True = may attend) or float."""
    check_mask("mask", mask, (B, self.num_heads, T_q, T_k), "(B, h, T_q, T_k)")


# %% [markdown]
# ## The forward pass
#
# Three steps, as in the formula: project and split, attend in every head, concatenate and mix.
# Dropout, when the module has it, acts on the attention weights inside
# `scaled_dot_product_attention`, and only in training mode: `self.training` is passed down, so
# `model.eval()` switches it off. Without `x_k` and `x_v` the module does self-attention; with a
# different `x_k` (and `x_v`, which defaults to `x_k`) it does cross-attention, where the
# decoder's $T_q$ queries read an encoder output of length $T_k$.
#
# First the three steps alone, as a plain function of a module. It is a teaching version: the
# exported `forward` further down runs exactly these lines, with more around them.

# %%
def plain_forward(mha, x_q, x_k=None, x_v=None, mask=None):
    """The three steps of MultiHeadAttention.forward, nothing else: (out, attn). Not exported."""
    x_k = x_q if x_k is None else x_k
    x_v = x_k if x_v is None else x_v
    # 1) Project with the packed matrices, then split into h heads of width d_k.
    Q = mha.split_heads(mha.W_q(x_q))  # (B, T_q, d_model) -> (B, h, T_q, d_k)
    K = mha.split_heads(mha.W_k(x_k))  # (B, T_k, d_model) -> (B, h, T_k, d_k)
    V = mha.split_heads(mha.W_v(x_v))  # (B, T_k, d_model) -> (B, h, T_k, d_k)
    # 2) Attend in all heads at once: the head axis is one more batch axis.
    context, attn = scaled_dot_product_attention(
        Q, K, V, mask=mask, dropout_p=mha.dropout_p, training=mha.training
    )  # context (B, h, T_q, d_k), attn (B, h, T_q, T_k)
    # 3) Concatenate the heads and mix them with W_o.
    return mha.W_o(mha.combine_heads(context)), attn  # (B, T_q, d_model), (B, h, T_q, T_k)


# %% [markdown]
# **Check** it against the formula of the first section, computed head by head with no
# packing and no reshaping: head $i$ projects with its own rows of each weight and bias,
# attends, and the heads' outputs are concatenated and multiplied by $W^O$. The biases are set
# to random values first (Xavier leaves them at zero, and zeros would not test them).

# %%
import copy

gen = torch.Generator().manual_seed(2)
mha_plain = copy.deepcopy(mha_small)  # d_model = 12, h = 3, d_k = 4
with torch.no_grad():
    for proj in (mha_plain.W_q, mha_plain.W_k, mha_plain.W_v, mha_plain.W_o):
        proj.bias.copy_(0.1 * torch.randn(12, generator=gen))
x_plain = torch.randn(2, 5, 12, generator=gen)  # (B, T, d_model)
out_plain, attn_plain = plain_forward(mha_plain, x_plain)  # (B, T, d_model), (B, h, T, T)

heads_plain = []
for i in range(mha_plain.num_heads):  # head_i = Attention(X W_i^Q, X W_i^K, X W_i^V)
    rows = slice(i * mha_plain.d_k, (i + 1) * mha_plain.d_k)  # head i's rows of every projection
    q_i, k_i, v_i = (F.linear(x_plain, W.weight[rows], W.bias[rows])  # (B, T, d_k) each
                     for W in (mha_plain.W_q, mha_plain.W_k, mha_plain.W_v))
    weights_i = torch.softmax(q_i @ k_i.transpose(-2, -1) / math.sqrt(mha_plain.d_k), dim=-1)
    torch.testing.assert_close(attn_plain[:, i], weights_i)  # (B, T, T)
    heads_plain.append(weights_i @ v_i)  # (B, T, d_k)
concat_plain = torch.cat(heads_plain, dim=-1)  # Concat(head_1, ..., head_h): (B, T, d_model)
torch.testing.assert_close(out_plain, mha_plain.W_o(concat_plain))
print("plain_forward == Concat(head_1, ..., head_h) W^O, every head's weights too")

# %% [markdown]
# The exported `forward` runs the same three lines and adds what a library needs around them.
# First, the checks, which follow notebook 00's policy: `checking()` is true unless an outer
# module that has already checked its inputs called this one inside `validated()`, and
# `forward` itself calls `scaled_dot_product_attention` inside `validated()`, so each input is
# checked once per call, not again in every function it passes through.
#
# **Used later; skip on a first reading.** Two more things in `forward` serve later notebooks
# and do nothing in this one:
#
# - the argument `cache` (notebook 12, generation one token at a time): keys and values kept
#   from earlier calls, so that the prefix is not projected again at every step. A *frozen*
#   cache hands back what it holds (cross-attention: the encoder output does not change); any
#   other stores this call's keys and values and returns all it holds (self-attention). What
#   `forward` asks of a cache is the `typing.Protocol` in the next cell, `KeyValueCache`: any
#   object with these members will do (notebook 12's `AttentionCache` is one), and
#   `runtime_checkable` lets `isinstance` test that the members exist, not what they do.
# - the attribute `fast` (notebook 14): a switch, like nanoGPT's `if self.flash:`, to one packed
#   projection for $Q$, $K$, $V$ and PyTorch's fused kernel, the method `fast_forward`, which
#   notebook 14 writes; `fast=True` is for notebook 14 on. Calls that need the weights, a cache
#   or values other than the keys take the from-scratch steps whatever the switch says.

# %%
#| export
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class KeyValueCache(Protocol):
    """What MultiHeadAttention.forward asks of a cache (notebook 12's AttentionCache is one)."""

    @property
    def frozen(self) -> bool:
        """True once the keys and values are complete (cross-attention): reuse them as they are."""
        ...

    @property
    def keys(self) -> Tensor:  # (B, h, T_kept, d_k)
        ...

    @property
    def values(self) -> Tensor:  # (B, h, T_kept, d_k)
        ...

    def update(self, K: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
        """Keep this call's K, V (B, h, T_new, d_k); return all, (B, h, T_kept + T_new, d_k)."""
        ...


# %%
#| export
@add_to_class(MultiHeadAttention)
def forward(
    self,
    x_q: torch.Tensor,  # (B, T_q, d_model)
    x_k: torch.Tensor | None = None,  # (B, T_k, d_model); None: x_q (self-attention)
    x_v: torch.Tensor | None = None,  # (B, T_k, d_model); None: x_k
    mask: torch.Tensor | None = None,  # broadcastable to (B, h, T_q, T_k); True = may attend
    return_attn: bool = False,
    cache: "KeyValueCache | None" = None,  # keys and values kept from earlier calls (nb. 12)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attend from x_q to x_k/x_v with h heads: out (B, T_q, d_model), attn (B, h, T_q, T_k)."""
    x_k = x_q if x_k is None else x_k
    x_v = x_k if x_v is None else x_v
    if checking():
        self._check_inputs(x_q, x_k, x_v)
    if self.fast and not return_attn and cache is None and x_v is x_k:  # notebook 14
        return self.fast_forward(x_q, None if x_k is x_q else x_k, mask)
    # 1) Project with the packed matrices, then split into h heads of width d_k.
    Q = self.split_heads(self.W_q(x_q))  # (B, T_q, d_model) -> (B, h, T_q, d_k)
    if cache is not None and cache.frozen:  # x_k never changes (cross-attention): reuse its K, V
        K, V = cache.keys, cache.values  # (B, h, T_k, d_k)
    else:
        K = self.split_heads(self.W_k(x_k))  # (B, T_k, d_model) -> (B, h, T_k, d_k)
        V = self.split_heads(self.W_v(x_v))  # (B, T_k, d_model) -> (B, h, T_k, d_k)
        if cache is not None:  # keep them, and attend to every key kept so far
            K, V = cache.update(K, V)  # (B, h, T_kept + T_k, d_k)
    if checking():
        self._check_mask(mask, x_q.shape[0], x_q.shape[1], K.shape[2])
    # 2) Attend in all heads at once: the head axis is one more batch axis.
    with validated():  # the inputs were checked above
        context, attn = scaled_dot_product_attention(
            Q, K, V, mask=mask, dropout_p=self.dropout_p, training=self.training
        )  # context (B, h, T_q, d_k), attn (B, h, T_q, T_k)
    # 3) Concatenate the heads and mix them with W_o.
    out = self.W_o(self.combine_heads(context))  # (B, h, T_q, d_k) -> (B, T_q, d_model)
    return (out, attn) if return_attn else out


# %% [markdown]
# **Check:** shapes for self- and cross-attention, attention rows that sum to one, a padding
# mask of shape $(B, 1, 1, T_k)$ that gives the hidden keys exactly zero weight, and the same
# output and weights, bit for bit, as `plain_forward`.

# %%
set_seed(0)
mha = MultiHeadAttention(d_model=32, num_heads=4).to(device)
print(mha)

x = torch.randn(2, 6, 32).to(device)  # (B, T, d_model)
memory = torch.randn(2, 9, 32).to(device)  # (B, T_k, d_model), e.g. an encoder output

out, attn = mha(x, return_attn=True)  # self-attention
assert out.shape == (2, 6, 32) and attn.shape == (2, 4, 6, 6)
out, attn = mha(x, memory, return_attn=True)  # cross-attention: T_q = 6, T_k = 9
assert out.shape == (2, 6, 32) and attn.shape == (2, 4, 6, 9)
torch.testing.assert_close(attn.sum(-1), torch.ones(2, 4, 6, device=device))

lengths = torch.tensor([9, 4])  # the second memory has 5 padding positions
keep = (torch.arange(9)[None, :] < lengths[:, None])[:, None, None, :].to(device)  # (B, 1, 1, T_k)
out, attn = mha(x, memory, mask=keep, return_attn=True)
assert torch.all(attn[1, :, :, 4:] == 0)
# The checks and the cache change nothing in the result: exactly the teaching version's output.
out_plain_check, attn_plain_check = plain_forward(mha, x, memory, mask=keep)
assert torch.equal(out, out_plain_check) and torch.equal(attn, attn_plain_check)
print("self:", tuple(mha(x).shape), " cross:", tuple(out.shape), " attn:", tuple(attn.shape))

# %% [markdown]
# **Check:** dropout on the attention weights. In training mode it zeroes weights and scales the
# rest by $1/(1-p)$, so rows no longer sum to one; in eval mode the module is exactly the same
# module without dropout.

# %%
set_seed(0)
with_dropout = MultiHeadAttention(32, 4, dropout_p=0.5).to(device)
without = MultiHeadAttention(32, 4).to(device)
without.load_state_dict(with_dropout.state_dict())

with_dropout.train()
_, attn_train = with_dropout(x, return_attn=True)
with_dropout.eval()
_, attn_eval = with_dropout(x, return_attn=True)
assert not torch.allclose(attn_train.sum(-1), torch.ones(2, 4, 6, device=device))
# every weight is either dropped or kept and scaled by 1 / (1 - p) = 2
assert torch.all((attn_train == 0) | torch.isclose(attn_train, 2 * attn_eval))
assert 0.4 < (attn_train == 0).float().mean().item() < 0.6

torch.testing.assert_close(with_dropout(x), without(x), rtol=0, atol=0)
print("eval mode: identical to the module without dropout")

# %% [markdown]
# **Check:** each of these bad inputs fails with an error that says what is wrong, and names the
# shapes when a shape is wrong: a `ValueError` for a wrong value or shape, a `TypeError` for a
# wrong type. The last one is a 0/1 integer mask, a real trap: added to the scores it would
# mask nothing, so it must be `bool` (True = may attend) or floating (added to the scores).
# (Inputs of different dtypes are not on the list: they are legal inside `torch.autocast`,
# notebook 13's mixed precision, so our checks leave them to PyTorch; the cell after the list
# shows both cases.)

# %%
bad_calls = {
    "d_model % num_heads != 0": lambda: MultiHeadAttention(10, 3),
    "dropout_p = 1": lambda: MultiHeadAttention(32, 4, dropout_p=1.0),
    "2-D input": lambda: mha(torch.randn(6, 32, device=device)),
    "wrong d_model in x_q": lambda: mha(torch.randn(2, 6, 16, device=device)),
    "wrong d_model in x_k": lambda: mha(x, torch.randn(2, 9, 16, device=device)),
    "batch sizes differ": lambda: mha(x, torch.randn(3, 9, 32, device=device)),
    "T_k of x_k != T_k of x_v": lambda: mha(x, memory, memory[:, :5]),
    "mask (B, 1, 1, T_q)": lambda: mha(x, memory, mask=keep[..., :6]),
    "mask (B, 2, T_q, T_k)": lambda: mha(x, memory, mask=keep.expand(2, 2, 6, 9)),
    "mask (B, T_k), B != T_q": lambda: mha(x, memory, mask=keep[:, 0, 0]),
    "mask of 0/1 integers": lambda: mha(x, memory, mask=keep.long()),  # the one TypeError
}
for what, call in bad_calls.items():
    expected = TypeError if what == "mask of 0/1 integers" else ValueError
    try:
        call()
    except (TypeError, ValueError) as err:
        assert type(err) is expected, f"{what}: {type(err).__name__}, expected {expected.__name__}"
        print(f"{what:<26} {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{what}: no error raised")

# %%
mha_cpu, x_cpu, memory_cpu = copy.deepcopy(mha).cpu(), x.cpu(), memory.cpu()
try:
    mha_cpu(x_cpu, memory_cpu.double())  # x_q float32, x_k float64
except RuntimeError:
    print(f"{'x_k float64, x_q float32':<26} RuntimeError from nn.Linear (PyTorch's check, not ours)")
else:
    raise AssertionError("mixed dtypes: no error raised")
with torch.autocast("cpu", dtype=torch.bfloat16):  # every product in bfloat16
    out_autocast = mha_cpu(x_cpu, memory_cpu.bfloat16())
print(f"{'the same under autocast':<26} runs, output {out_autocast.dtype}")

# %% [markdown]
# **What the checks cannot catch.** A wrong mask that broadcasts to $(B, h, T_q, T_k)$ passes
# every check above. Two such mistakes are easy to make:
#
# - **PyTorch's shape.** `nn.MultiheadAttention` takes a padding mask of shape $(B, T_k)$ (the
#   parity section below uses one). Given to our module as it is, its two axes line up with
#   $(T_q, T_k)$: query $q$ of *every* sequence gets the padding of sequence $q$. When
#   $B \ne T_q$ and $B \ne 1$ it does not broadcast, and the check stops it (the `ValueError`
#   of `mask (B, T_k), B != T_q` above); when $B = T_q$ it broadcasts and the module runs.
#   (With $B = 1$ it broadcasts too, and happens to mean the right thing: the one sequence's
#   padding, for every query.)
# - **PyTorch's convention.** Its masks say `True` = *ignore*, ours `True` = *may attend*. An
#   inverted mask has the right shape and dtype, and attends to exactly the keys it should hide.
#   A sequence without padding has no key to hide, so the inverted mask blocks all of its keys:
#   by notebook 02's rule for a query with no key, its weights are all zero and its context is
#   zero, so its output is just the bias of $W^O$ (zero in this module). Its 0.00 below means
#   "no weight anywhere", not "fine".
#
# Below, $B = T_q = 3$ sequences with 5, 3 and 1 real keys out of $T_k = 5$, and the largest
# weight that any row of each sequence puts on padding, for the right mask and the two wrong
# ones. No call raises. What the course does about it: masks are made by two helpers of
# notebook 05, `padding_mask(lengths, T_k)`, which builds the $(B, 1, 1, T_k)$ form from the
# lengths, and `causal_mask(T)`, which builds $(1, 1, T, T)$; turning our masks into PyTorch's
# shape and convention happens in one function, `to_torch_masks` in the `reference` module
# (notebook 08); and an assert like the one in the check of the forward pass above (padded keys
# get exactly zero weight) would fail with the $(B, T_k)$ mask here, which puts up to 0.82 and
# 0.94 of a row on padding.

# %%
# `mha` is the module of the forward-pass check above (d_model = 32, h = 4).
gen = torch.Generator().manual_seed(3)
x_3 = torch.randn(3, 3, 32, generator=gen).to(device)  # (B, T_q, d_model) with B == T_q == 3
memory_3 = torch.randn(3, 5, 32, generator=gen).to(device)  # (B, T_k, d_model)
lengths_3 = torch.tensor([5, 3, 1])
keep_3 = (torch.arange(5)[None, :] < lengths_3[:, None]).to(device)  # (B, T_k), True = real key
padding_3 = ~keep_3[:, None, None, :]  # (B, 1, 1, T_k): the keys no row may see
masks_3 = {
    "(B, 1, 1, T_k), True = attend": keep_3[:, None, None, :],  # right
    "(B, T_k), as PyTorch's": keep_3,  # read as (T_q, T_k)
    "(B, 1, 1, T_k), True = ignore": ~keep_3[:, None, None, :],  # PyTorch's convention
}
on_padding = {}
for what, mask_3 in masks_3.items():
    _, attn_3 = mha(x_3, memory_3, mask=mask_3, return_attn=True)  # (B, h, T_q, T_k)
    on_padding[what] = (attn_3 * padding_3).sum(-1).amax(dim=(1, 2)).cpu()  # (B,)
    print(f"{what:<30} largest weight on padding, sequences 0, 1, 2: "
          + "  ".join(f"{w:.2f}" for w in on_padding[what]))
right, pytorch_shape, inverted = on_padding.values()
assert torch.all(right == 0)
# sequence 0 has no padding; over 300 draws of the module, sequences 1 and 2 got at least 0.19
assert pytorch_shape[0] == 0 and torch.all(pytorch_shape[1:] > 0.1)
# with B = 1 the (B, T_k) mask broadcasts like (B, 1, 1, T_k), and gives the same output
torch.testing.assert_close(mha(x[:1], memory[:1], mask=keep[:1, 0, 0]),
                           mha(x[:1], memory[:1], mask=keep[:1]), rtol=0, atol=0)
assert inverted[0] == 0 and torch.allclose(inverted[1:], torch.ones(2), atol=1e-5)  # all on padding
# the inverted mask blocks every key of sequence 0: zero weights, and the output is W_o's bias
inverted_mask = masks_3["(B, 1, 1, T_k), True = ignore"]
out_inv, attn_inv = mha(x_3, memory_3, mask=inverted_mask, return_attn=True)  # (B, T_q, d_model)
assert torch.all(attn_inv[0] == 0)
torch.testing.assert_close(out_inv[0], mha.W_o.bias.expand(3, -1))

# %% [markdown]
# **Takeaway: `MultiHeadAttention` is three lines of work (project and split, attend, combine and
# mix) behind checks that turn shape mistakes into readable errors. A mask of the wrong meaning
# that still broadcasts gets through them: make masks with notebook 05's helpers.**
#
# ## What the heads can do: four relations at once
#
# A freshly initialised module attends without a pattern that means anything; what heads attend to
# is learned. To see that the module *can* keep several relations apart, we set its weights by hand. Each token of
# "the cat sat on the mat" is a vector that holds a one-hot **position** (channels 0–7) and a
# one-hot **word** (channels 8–15). With $d_{\text{model}} = 32$ and $h = 4$ heads of
# $d_k = 8$, we write four relations into the four blocks of `W_q` and `W_k`:
#
# | head | query of token $t$ | key of token $s$ | attends to |
# |---|---|---|---|
# | 0 | its position $t$, in channel $t$ | its position $s$, in channel $s + 1$ | the previous token ($s = t - 1$) |
# | 1 | its position $t$, in channel $t$ | its position $s$, in channel $s - 1$ | the next token ($s = t + 1$) |
# | 2 | its word | its word | tokens with the same word (and itself) |
# | 3 | a constant (the bias) | "I am a noun" | the two nouns, half each, from every token |
#
# "Channel $t$" is a channel of the head, one of its $d_k = 8$: channel $t$ of head $i$ is row
# $i d_k + t$ of `W_q.weight` (or `W_k.weight`), as in the packed projections above. So the
# code writes head 0's query as `Wq[0 * d_k + j, POS + j] = beta`: row $j$ of head 0 reads
# input channel `POS + j`, the one-hot of position $j$.
#
# A match gives a score of $\beta/\sqrt{d_k}$ and a mismatch $0$; with $\beta = 8\sqrt{d_k}$ a
# single match takes 99.8% of a row; a query with no match at all (the first token has no previous
# token, the last no next one) scores every key $0$ and spreads its weight evenly. Every head's value
# copies the word, and $W^O$ is the identity, so block $i$ of the output holds the words head $i$
# found. First the tokens and a module whose queries and keys are all zero (so every head starts
# out uniform); then one head at a time, each followed by its check.

# %%
words = ["the", "cat", "sat", "on", "the", "mat"]
vocab = sorted(set(words))  # ['cat', 'mat', 'on', 'sat', 'the']
word_id = torch.tensor([vocab.index(w) for w in words])
T, d_model, num_heads, d_k = len(words), 32, 4, 8
POS, WORD = 0, 8  # first channel of the position and of the word one-hots

tokens = torch.zeros(1, T, d_model)  # (B=1, T, d_model)
tokens[0, torch.arange(T), POS + torch.arange(T)] = 1.0
tokens[0, torch.arange(T), WORD + word_id] = 1.0

beta = 8 * math.sqrt(d_k)
hand = MultiHeadAttention(d_model, num_heads).to(device)
Wq, Wk, Wv, bq = hand.W_q.weight, hand.W_k.weight, hand.W_v.weight, hand.W_q.bias
with torch.no_grad():
    for p in hand.parameters():
        p.zero_()  # every head starts with zero queries: uniform attention
    for i in range(num_heads):
        for j in range(d_k):  # rows of head i are i * d_k + j
            Wv[i * d_k + j, WORD + j] = 1.0  # every head's value: its word
    hand.W_o.weight.copy_(torch.eye(d_model))  # block i of the output is head i's context


def run_hand() -> tuple[torch.Tensor, torch.Tensor]:
    """The hand-set module on the sentence: output (T, d_model) and weights (h, T, T), on the CPU."""
    with torch.no_grad():
        out, attn = hand(tokens.to(device), return_attn=True)  # (1, T, d_model), (1, h, T, T)
    return out[0].cpu(), attn[0].cpu()


def decode_block(out: torch.Tensor, i: int) -> list[str]:
    """The word that block i of each output row (head i's context) holds most of."""
    return [vocab[w] for w in out[:, i * d_k : i * d_k + len(vocab)].argmax(-1)]


# %% [markdown]
# **Head 0, the previous token.** The query at position $t$ lights up channel $t$ of the head; the
# key at position $s$ lights up channel $s + 1$. They meet when $s = t - 1$.

# %%
with torch.no_grad():
    for j in range(d_k):
        Wq[0 * d_k + j, POS + j] = beta  # query: my position t
    for j in range(d_k - 1):
        Wk[0 * d_k + j + 1, POS + j] = 1.0  # key: position s, written in channel s + 1

# %%
out, attn = run_hand()
assert torch.equal(attn[0, 1:].argmax(-1), torch.arange(T - 1))  # previous token ...
assert torch.all(attn[0, 1:].amax(-1) > 0.99)  # ... with 99.8% of the weight
torch.testing.assert_close(attn[0, 0], torch.full((T,), 1 / T))  # the first token: no match
assert decode_block(out, 0)[1:] == words[:-1]  # block 0 holds the previous word

# %% [markdown]
# **Head 1, the next token**: the same query, and the key of position $s$ in channel $s - 1$.

# %%
with torch.no_grad():
    for j in range(d_k):
        Wq[1 * d_k + j, POS + j] = beta  # query: my position t
    for j in range(d_k - 1):
        Wk[1 * d_k + j, POS + j + 1] = 1.0  # key: position s, written in channel s - 1

# %%
out, attn = run_hand()
assert torch.equal(attn[1, :-1].argmax(-1), torch.arange(1, T))  # next token
assert torch.all(attn[1, :-1].amax(-1) > 0.99)
torch.testing.assert_close(attn[1, -1], torch.full((T,), 1 / T))  # the last token: no match
assert decode_block(out, 1)[:-1] == words[1:]  # block 1 holds the next word
assert decode_block(out, 0)[1:] == words[:-1]  # head 0 is untouched

# %% [markdown]
# **Head 2, the same word**: query and key both read the word one-hot, so a token matches every
# token with its word, itself included.

# %%
with torch.no_grad():
    for j in range(d_k):
        Wq[2 * d_k + j, WORD + j] = beta  # query: my word
        Wk[2 * d_k + j, WORD + j] = 1.0  # key: its word

# %%
out, attn = run_hand()
same_word = word_id[:, None] == word_id[None, :]  # (T, T): True where two tokens share a word
torch.testing.assert_close(attn[2][same_word.logical_not()].max(), torch.tensor(0.0), atol=1e-3, rtol=0)
torch.testing.assert_close(attn[2, 0, [0, 4]], torch.tensor([0.5, 0.5]), atol=1e-3, rtol=0)  # two "the"
assert decode_block(out, 2) == words  # what a token finds is its own word

# %% [markdown]
# **Head 3, the nouns**: the query is the same for every token (a bias, no weight), and the key
# says "I am a noun" in the head's first channel.

# %%
with torch.no_grad():
    bq[3 * d_k] = beta  # query: a constant
    for noun in ("cat", "mat"):
        Wk[3 * d_k, WORD + vocab.index(noun)] = 1.0  # key: "I am a noun"

# %%
out, attn = run_hand()
nouns = [words.index("cat"), words.index("mat")]
# every row splits its weight between the two nouns, e^8 / (2 e^8 + 4) = 0.4997 on each
torch.testing.assert_close(attn[3][:, nouns], torch.full((T, 2), 0.5), atol=1e-3, rtol=0)
torch.testing.assert_close(attn[3], attn[3][:1].expand(T, T))  # every row the same
# so block 3 holds half "cat" and half "mat" (decode_block's argmax would pick one of the two)
half_each = torch.zeros(len(vocab))
half_each[[vocab.index("cat"), vocab.index("mat")]] = 0.5
block_3 = out[:, 3 * d_k : 3 * d_k + len(vocab)]  # (T, vocab)
torch.testing.assert_close(block_3, half_each.expand(T, -1), atol=1e-3, rtol=0)

# %% [markdown]
# The split is what makes this check able to fail. A broken head 3 whose key forgets that "mat"
# is a noun still puts nearly all of every row on the nouns, all of it on "cat": a check of the
# weight on the two nouns together passes it, the check of the split stops it.

# %%
mat_channel = WORD + vocab.index("mat")
with torch.no_grad():
    Wk[3 * d_k, mat_channel] = 0.0  # break head 3: only "cat" is a noun
try:
    _, attn_cat_only = run_hand()
finally:
    with torch.no_grad():
        Wk[3 * d_k, mat_channel] = 1.0  # mend it
torch.testing.assert_close(attn_cat_only[3][:, nouns].sum(-1), torch.ones(T), atol=1e-2, rtol=0)
assert not torch.allclose(attn_cat_only[3][:, nouns], torch.full((T, 2), 0.5), atol=1e-3, rtol=0)
cat_weight, mat_weight = attn_cat_only[3][0, nouns].tolist()
print(f"broken head 3, every row: {cat_weight:.3f} on cat, {mat_weight:.3f} on mat")

# %% [markdown]
# **Check** all four at once: the output keeps the previous and the next word in separate
# blocks. Block 0 of token $t$ decodes to word $t-1$, block 1 to word $t+1$.

# %%
prev_found, next_found = decode_block(out, 0)[1:], decode_block(out, 1)[:-1]
assert prev_found == words[:-1] and next_found == words[1:]
for t, word in enumerate(words):
    before = prev_found[t - 1] if t > 0 else "-"
    after = next_found[t] if t < T - 1 else "-"
    print(f"{word:>4}   block 0 (previous): {before:<4} block 1 (next): {after}")

# %% [markdown]
# Compare one head that must find both neighbours (its key matches position $s + 1$ **and**
# $s - 1$): for *sat* it returns half *cat* plus half *on*, the same blend it would return if the
# two words were swapped. Two heads keep "before" and "after" apart; this head, with equal weight
# on both neighbours, cannot.

# %%
one_head = MultiHeadAttention(d_model, 1)
with torch.no_grad():
    for p in one_head.parameters():
        p.zero_()
    # the same score, 8, per match as before, now that the head is d_model = 32 wide
    one_head.W_q.weight[POS : POS + d_k, POS : POS + d_k] = 8 * math.sqrt(d_model) * torch.eye(d_k)
    for j in range(d_k - 1):
        one_head.W_k.weight[POS + j + 1, POS + j] = 1.0  # matches position s + 1 ...
        one_head.W_k.weight[POS + j, POS + j + 1] = 1.0  # ... and position s - 1
    one_head.W_v.weight[:d_k, WORD : WORD + d_k] = torch.eye(d_k)
    one_head.W_o.weight.copy_(torch.eye(d_model))
    blend = one_head(tokens)[0, words.index("sat"), : len(vocab)]  # (vocab,)

expected = torch.zeros(len(vocab))
expected[[vocab.index("cat"), vocab.index("on")]] = 0.5
torch.testing.assert_close(blend, expected, atol=1e-2, rtol=0)
print("one head, token 'sat':", dict(zip(vocab, blend.round(decimals=2).tolist(), strict=True)))

# %% [markdown]
# For comparison, a freshly initialised module on the same sentence, with a random embedding
# table (one random vector per word). Does any of its heads follow one of the four relations?
# For each head and each relation we measure the weight a row puts on the keys that relation
# asks for (the previous token; the next one; tokens with the same word; the nouns), averaged
# over the rows where the relation has a key. The hand-set heads score about 1 on their own.

# %%
set_seed(0)
fresh = MultiHeadAttention(d_model, num_heads).to(device)
embeddings = torch.randn(len(vocab), d_model)[word_id][None]  # (1, T, d_model): a random table
with torch.no_grad():
    _, fresh_attn = fresh(embeddings.to(device), return_attn=True)
fresh_attn = fresh_attn[0].cpu()  # (h, T, T)
_, hand_attn = run_hand()  # (h, T, T), the four hand-set heads

positions = torch.arange(T)
is_noun = torch.tensor([w in ("cat", "mat") for w in words])
targets = {  # relation -> (T, T): True where query t should look at key s
    "previous": positions[None, :] == positions[:, None] - 1,
    "next": positions[None, :] == positions[:, None] + 1,
    "same word": same_word,
    "nouns": is_noun[None, :].expand(T, T),
}


def weight_on(attn_head: torch.Tensor, target: torch.Tensor) -> float:
    """Mean over the rows that have a target of the weight the row puts on its targets."""
    rows = target.any(dim=-1)
    return (attn_head * target).sum(dim=-1)[rows].mean().item()


table = torch.tensor([[weight_on(a, t) for t in targets.values()] for a in fresh_attn])  # (h, 4)
hand_table = torch.tensor([weight_on(hand_attn[i], t) for i, t in enumerate(targets.values())])
print(f"{'':>8} " + " ".join(f"{name:>10}" for name in targets) + f" {'largest weight':>15}")
for i in range(num_heads):
    print(f"fresh {i}: " + " ".join(f"{v:>10.2f}" for v in table[i])
          + f" {fresh_attn[i].max().item():>15.2f}")
print(f"{'hand-set':>8}: " + " ".join(f"{v:>10.2f}" for v in hand_table) + "   (head i, relation i)")
assert torch.all(hand_table > 0.99)

# Other draws of the module and the word table (seed 0 is the draw above): the largest entry
# of each draw's table, the relation some fresh head follows best.
largest_by_draw = []
for seed in range(200):
    set_seed(seed)
    module = MultiHeadAttention(d_model, num_heads)
    table_embeddings = torch.randn(len(vocab), d_model)[word_id][None]  # (1, T, d_model)
    with torch.no_grad():
        _, draw_attn = module(table_embeddings, return_attn=True)
    largest_by_draw.append(max(weight_on(a, t) for a in draw_attn[0] for t in targets.values()))
largest_by_draw = torch.tensor(largest_by_draw)
print(f"largest entry of the table over 200 draws: median {largest_by_draw.median():.2f}, "
      f"99th percentile {largest_by_draw.quantile(0.99):.2f}, highest {largest_by_draw.max():.2f}")
assert largest_by_draw.max() < 0.9  # no fresh head follows a relation the way the hand-set ones do

# %% [markdown]
# The picture: the four hand-set heads (bottom row) next to the four heads of the fresh module
# (top row).

# %% jupyter={"source_hidden": true}
titles = ["previous token", "next token", "same word", "the nouns"]
fig, axes = plt.subplots(2, num_heads, figsize=(13, 6.6), layout="constrained")
for i in range(num_heads):
    for row, (weights, name) in enumerate([(fresh_attn[i], "fresh init"), (hand_attn[i], titles[i])]):
        ax = plot_attention(weights, words, ax=axes[row, i], colorbar=False, vmin=0, vmax=1)
        ax.set_title(f"head {i}: {name}", fontsize=10)
        if i > 0:
            ax.set_ylabel("")
        if row == 0:
            ax.set_xlabel("")
fig.colorbar(axes[0, 0].images[0], ax=axes, shrink=0.8, label="attention weight")
fig.suptitle("Per-head attention weights: a fresh module on random word vectors (top), "
             "hand-set heads on one-hot position + word (bottom)")
save_figure(fig, "mha_heads")
plt.show()

# %% [markdown]
# A fresh head has no relation built in. Its rows put their weight wherever the random weights
# and embeddings happen to point, some rows mostly on one token (the largest weights in the table
# run from 0.48 to 0.86), but in this draw no head gives any relation more than 0.47 of a row on
# average, against 1.00 for the hand-set heads; a uniform row would already give the two nouns
# $2/6$. Chance does better in some draws: over 200 draws of the module and the word table, the
# relation some fresh head follows best gets 0.44 of a row in the median draw and 0.75 in the
# luckiest (the last line), still far from 1.00. The structure is in the weights, and training
# has to find it.

# %% [markdown]
# **Takeaway: each head has its own query–key subspace, so one layer can follow several
# relations at once, and concatenation keeps their answers apart for $W^O$.**
#
# ## Parity with `nn.MultiheadAttention`
#
# PyTorch's module computes the same function with the same parameters, stored differently:
#
# | ours | `nn.MultiheadAttention` |
# |---|---|
# | `W_q.weight`, `W_k.weight`, `W_v.weight`, each $(d, d)$ | `in_proj_weight`, $(3d, d)$: the three stacked |
# | `W_q.bias`, `W_k.bias`, `W_v.bias` | `in_proj_bias`, $(3d,)$ |
# | `W_o` | `out_proj` |
# | input $(B, T, d)$ | input $(B, T, d)$ with `batch_first=True` (the default is $(T, B, d)$) |
# | `mask`: `True` = **may attend** | `key_padding_mask`, `attn_mask`: `True` = **ignore** |
# | `attn` $(B, h, T_q, T_k)$ | `need_weights=True, average_attn_weights=False` |
#
# We copy our weights into a fresh `nn.MultiheadAttention`; give the biases random values first,
# since Xavier leaves them at zero and zeros would not test them.
#
# The copy goes into the package's `reference` module, which gathers everything that puts our
# weights into PyTorch's own modules; notebooks 08 and 10 add the blocks and the whole model.
# (Here `MultiHeadAttention` is the class built above, so the checks below test that class.)

# %%
#| export reference
"""PyTorch's built-in twins of our modules: our weights copied into nn.MultiheadAttention (03),
nn.TransformerEncoderLayer/DecoderLayer (08) and nn.Transformer (10), and our masks in their
convention. The parity checks of the notebooks, the tests and the benchmarks all use these."""

import torch
from torch import nn


def copy_attention_to_torch(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    """Copy our W_q, W_k, W_v (stacked into in_proj) and W_o (out_proj) into `theirs`, in place."""
    with torch.no_grad():
        # 3 x (d, d) -> (3d, d): rows 0..d-1 project queries, then keys, then values.
        theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
        theirs.out_proj.weight.copy_(ours.W_o.weight)
        if ours.W_q.bias is not None:
            theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
            theirs.out_proj.bias.copy_(ours.W_o.bias)


def torch_attention_like(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    """A batch_first nn.MultiheadAttention with our module's sizes, dropout and weights."""
    theirs = nn.MultiheadAttention(
        ours.d_model, ours.num_heads, dropout=ours.dropout_p, bias=ours.W_q.bias is not None,
        batch_first=True,
    )  # fmt: skip
    copy_attention_to_torch(ours, theirs.to(ours.W_q.weight.device))
    return theirs


# %%
# The two modules add up in different orders; on a GPU that can differ by about 1e-5.
tol = {} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}


def assert_grads_match(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    """Every parameter gradient of `ours` equals the matching slice of `theirs`."""
    d = ours.d_model
    for i, proj in enumerate((ours.W_q, ours.W_k, ours.W_v)):
        torch.testing.assert_close(
            proj.weight.grad, theirs.in_proj_weight.grad[i * d : (i + 1) * d], **tol
        )
        torch.testing.assert_close(
            proj.bias.grad, theirs.in_proj_bias.grad[i * d : (i + 1) * d], **tol
        )
    torch.testing.assert_close(ours.W_o.weight.grad, theirs.out_proj.weight.grad, **tol)
    torch.testing.assert_close(ours.W_o.bias.grad, theirs.out_proj.bias.grad, **tol)


set_seed(0)
ours = MultiHeadAttention(d_model=32, num_heads=4).to(device)
with torch.no_grad():
    for proj in (ours.W_q, ours.W_k, ours.W_v, ours.W_o):
        proj.bias.copy_(0.1 * torch.randn(32))
theirs = torch_attention_like(ours)

# %% [markdown]
# **Check 1, self-attention:** outputs, per-head weights, and the gradients of the input and of
# every parameter, for a loss $\sum_{b,t,c} g_{btc}\, y_{btc}$ with a fixed random $g$.

# %%
for module in (ours, theirs):
    module.zero_grad()  # so that running the cell again compares fresh gradients
x_p = torch.randn(3, 7, 32).to(device).requires_grad_()  # (B, T, d_model)
g = torch.randn(3, 7, 32).to(device)  # weights of the test loss

y_ours, a_ours = ours(x_p, return_attn=True)
y_theirs, a_theirs = theirs(x_p, x_p, x_p, need_weights=True, average_attn_weights=False)
torch.testing.assert_close(y_ours, y_theirs, **tol)
torch.testing.assert_close(a_ours, a_theirs, **tol)  # (B, h, T, T)

(grad_ours,) = torch.autograd.grad((y_ours * g).sum(), x_p, retain_graph=True)
(y_ours * g).sum().backward()
(grad_theirs,) = torch.autograd.grad((y_theirs * g).sum(), x_p, retain_graph=True)
(y_theirs * g).sum().backward()
torch.testing.assert_close(grad_ours, grad_theirs, **tol)
assert_grads_match(ours, theirs)
print("self-attention: outputs, weights and gradients match")

# %% [markdown]
# The loss is computed twice per module above: `autograd.grad` returns the input gradient
# without touching `.grad`, and `backward()` then fills the parameters' `.grad`.
#
# **Check 2, cross-attention** with $T_q = 4 \ne T_k = 9$, and different keys and values.

# %%
for module in (ours, theirs):
    module.zero_grad()
x_q = torch.randn(3, 4, 32).to(device).requires_grad_()  # (B, T_q, d_model)
x_k = torch.randn(3, 9, 32).to(device).requires_grad_()  # (B, T_k, d_model)
x_v = torch.randn(3, 9, 32).to(device).requires_grad_()  # (B, T_k, d_model)
g = torch.randn(3, 4, 32).to(device)

y_ours, a_ours = ours(x_q, x_k, x_v, return_attn=True)
y_theirs, a_theirs = theirs(x_q, x_k, x_v, need_weights=True, average_attn_weights=False)
torch.testing.assert_close(y_ours, y_theirs, **tol)
torch.testing.assert_close(a_ours, a_theirs, **tol)  # (B, h, T_q, T_k)

inputs = (x_q, x_k, x_v)
grads_ours = torch.autograd.grad((y_ours * g).sum(), inputs, retain_graph=True)
grads_theirs = torch.autograd.grad((y_theirs * g).sum(), inputs, retain_graph=True)
for a, b in zip(grads_ours, grads_theirs, strict=True):
    torch.testing.assert_close(a, b, **tol)
(y_ours * g).sum().backward()
(y_theirs * g).sum().backward()
assert_grads_match(ours, theirs)
print("cross-attention: outputs, weights and gradients match; attn", tuple(a_ours.shape))

# %% [markdown]
# **Check 3, key padding.** `nn.MultiheadAttention` takes a `key_padding_mask` of shape
# $(B, T_k)$ whose `True` entries are keys to **ignore**. Ours says the opposite, `True` = may
# attend, and is shaped to broadcast over heads and queries, $(B, 1, 1, T_k)$. The conversion is a
# negation and two new axes:
#
# $$\texttt{mask} = \lnot\,\texttt{key\_padding\_mask}[:, \texttt{None}, \texttt{None}, :].$$

# %%
for module in (ours, theirs):
    module.zero_grad()
xq_pad = torch.randn(3, 4, 32).to(device).requires_grad_()  # (B, T_q, d_model)
xk_pad = torch.randn(3, 9, 32).to(device).requires_grad_()  # (B, T_k, d_model)
xv_pad = torch.randn(3, 9, 32).to(device).requires_grad_()  # (B, T_k, d_model)
inputs_pad = (xq_pad, xk_pad, xv_pad)
g_pad = torch.randn(3, 4, 32).to(device)  # weights of the test loss
lengths = torch.tensor([9, 6, 3])  # real keys per sequence; the rest is padding
key_padding_mask = torch.arange(9)[None, :] >= lengths[:, None]  # (B, T_k), True = ignore
mask = ~key_padding_mask[:, None, None, :]  # (B, T_k) -> (B, 1, 1, T_k), True = attend
key_padding_mask, mask = key_padding_mask.to(device), mask.to(device)
print("key_padding_mask (PyTorch, True = ignore):\n", key_padding_mask.int().cpu())
print("mask (ours, True = attend), squeezed to (B, T_k):\n", mask[:, 0, 0].int().cpu())

y_ours, a_ours = ours(*inputs_pad, mask=mask, return_attn=True)
y_theirs, a_theirs = theirs(
    *inputs_pad, key_padding_mask=key_padding_mask, need_weights=True, average_attn_weights=False
)
torch.testing.assert_close(y_ours, y_theirs, **tol)
torch.testing.assert_close(a_ours, a_theirs, **tol)
assert torch.all(a_ours.masked_select(key_padding_mask[:, None, None, :]) == 0)

grads_ours = torch.autograd.grad((y_ours * g_pad).sum(), inputs_pad, retain_graph=True)
grads_theirs = torch.autograd.grad((y_theirs * g_pad).sum(), inputs_pad, retain_graph=True)
for a, b in zip(grads_ours, grads_theirs, strict=True):
    torch.testing.assert_close(a, b, **tol)
assert torch.all(grads_ours[1][key_padding_mask] == 0)  # padded keys get no gradient
(y_ours * g_pad).sum().backward()
(y_theirs * g_pad).sum().backward()
assert_grads_match(ours, theirs)

# %% [markdown]
# The picture: the two masks, and head 0's weights for the third sequence (3 real keys) from both
# modules. The masks are coloured by what they mean, dark = may attend, as in notebook 05; the
# letter in each cell is the boolean the module is passed, which is why T sits on light cells on
# the left and on dark cells on the right.

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(2, 2, figsize=(11, 5.6), layout="constrained")
# Colour = what the mask means, as in notebook 05 (dark = may attend, light = blocked); the
# text in each cell is the boolean that module is passed, so True is dark on the right only.
mask_cmap = ListedColormap(["#e6e6e6", "#4d4d4d"])  # 0 = blocked, 1 = may attend
allowed_keys = mask[:, 0, 0].cpu()  # (B, T_k): True = may attend, the meaning of both masks
masks = [(key_padding_mask.cpu(), "PyTorch: key_padding_mask, True = ignore"),
         (allowed_keys, "ours: mask[:, 0, 0], True = may attend")]
for ax, (m, title) in zip(axes[0], masks, strict=True):
    im = ax.imshow(allowed_keys.int().numpy(), cmap=mask_cmap, vmin=0, vmax=1)
    for b, j in np.ndindex(*m.shape):
        ax.text(j, b, "T" if m[b, j] else "F", ha="center", va="center", fontsize=9,
                color="white" if allowed_keys[b, j] else "#444444")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key position")
    ax.set_ylabel("sequence in batch")
    ax.set_yticks(range(3))
bar = fig.colorbar(im, ax=axes[0], ticks=[0.25, 0.75], shrink=0.8)
bar.ax.set_yticklabels(["blocked", "may attend"])
weights = [(a_ours, "ours"), (a_theirs, "nn.MultiheadAttention")]
for ax, (a, title) in zip(axes[1], weights, strict=True):
    plot_attention(a[2, 0], ax=ax, colorbar=False, vmin=0, vmax=1)
    ax.set_title(f"{title}: sequence 2 (3 real keys), head 0", fontsize=10)
fig.colorbar(axes[1, 0].images[0], ax=axes[1], label="attention weight", shrink=0.8)
plt.show()

# %% [markdown]
# **Takeaway: with the weights copied and the mask negated, our module and
# `nn.MultiheadAttention` agree in outputs, attention weights and gradients, for self-attention,
# cross-attention and padding.**
#
# ## Parity with `F.scaled_dot_product_attention`, head by head
#
# Inside the module, step 2 is plain scaled dot-product attention on $(B, h, T, d_k)$ tensors.
# PyTorch's fused `F.scaled_dot_product_attention` does that step (it picks a fast kernel where one
# exists, but does not return the weights). Its boolean `attn_mask` uses **our** convention:
# `True` means the key takes part. So we can swap it in for step 2 and must get the module's
# output back.

# %%
with torch.no_grad():
    Q = ours.split_heads(ours.W_q(xq_pad))  # (B, h, T_q, d_k), the inputs of Check 3
    K = ours.split_heads(ours.W_k(xk_pad))  # (B, h, T_k, d_k)
    V = ours.split_heads(ours.W_v(xv_pad))  # (B, h, T_k, d_k)
Q, K, V = (t.clone().requires_grad_() for t in (Q, K, V))

# PyTorch's fused kernels add up in another order too: the same `tol` as above.
ctx_torch = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)  # (B, h, T_q, d_k)
ctx_ours, _ = scaled_dot_product_attention(Q, K, V, mask=mask)
torch.testing.assert_close(ctx_ours, ctx_torch, **tol)

g_ctx = torch.randn(ctx_ours.shape).to(device)
grads_ours = torch.autograd.grad((ctx_ours * g_ctx).sum(), (Q, K, V))
grads_torch = torch.autograd.grad((ctx_torch * g_ctx).sum(), (Q, K, V))
for a, b in zip(grads_ours, grads_torch, strict=True):
    torch.testing.assert_close(a, b, **tol)

with torch.no_grad():  # the whole module with the fused kernel as step 2
    y_fused = ours.W_o(ours.combine_heads(ctx_torch))  # (B, h, T_q, d_k) -> (B, T_q, d_model)
    torch.testing.assert_close(y_fused, ours(*inputs_pad, mask=mask), **tol)
print("per-head context and its gradients match F.scaled_dot_product_attention")


# %% [markdown]
# **Takeaway: a multi-head layer is projections around one batched scaled dot-product attention;
# the fused kernel can replace ours in step 2, and the outputs and gradients agree to float
# tolerance.**
#
# ## Why queries and keys need separate projections
#
# Suppose one matrix did both jobs, $W^Q = W^K = W$. Then for every head
#
# $$S = \frac{(XW)(XW)^\top}{\sqrt{d_k}} = \frac{X\, W W^\top X^\top}{\sqrt{d_k}},
# \qquad S^\top = S .$$
#
# Two consequences, both bad for a language model:
#
# 1. **Relations become mutual.** The score of $i \to j$ equals the score of $j \to i$, so
#    "the verb looks for its subject" comes with "the subject looks for its verb" at the same
#    strength. The weights are tied too: with row sums $Z_i = \sum_k e^{S_{ik}}$,
#    $A_{ij} Z_i = e^{S_{ij}} = A_{ji} Z_j$. Relations such as "previous token" or "my head
#    noun" are directed.
# 2. **Tokens favour themselves.** The simplest way to see it: $S_{ii} = \lVert x_i W
#    \rVert^2 / \sqrt{d_k}$ is a sum of $d_k$ squares. If the projected components have mean 0
#    and variance 1 (what the Xavier initialisation above gives), its mean is $d_k / \sqrt{d_k} =
#    \sqrt{d_k}$, while the score $S_{ij}$ of two unrelated tokens is a sum of products with
#    random signs, of mean 0 and variance about 1. Every diagonal entry starts about $\sqrt{d_k}$
#    standard deviations ahead of the rest of its row. More strongly, by Cauchy–Schwarz
#    $S_{ij} \le \sqrt{S_{ii} S_{jj}} \le \max(S_{ii}, S_{jj})$: of any two tokens, at least one
#    scores itself at least as high as the other. When the projected vectors have similar
#    lengths, the diagonal wins every row and heads waste their attention on the token they
#    already are.
#
# With two matrices, $W^Q W^{K\top}$ is any $d_{\text{model}} \times d_{\text{model}}$ matrix of
# rank at most $d_k$, not necessarily symmetric; with one it is forced to be symmetric and
# positive semi-definite. We tie the projections of a module by pointing `W_k` at `W_q`.

# %%
def head_scores(module: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Pre-softmax scores of every head: (B, T, d_model) -> (B, h, T, T)."""
    Q = module.split_heads(module.W_q(x))  # (B, h, T, d_k)
    K = module.split_heads(module.W_k(x))  # (B, h, T, d_k)
    return Q @ K.transpose(-2, -1) / math.sqrt(module.d_k)  # (B, h, T, T)


set_seed(0)
separate = MultiHeadAttention(32, 4).to(device)
shared = MultiHeadAttention(32, 4).to(device)
shared.W_k = shared.W_q  # one projection for queries and keys

xs = torch.randn(16, 24, 32).to(device)  # (B, T, d_model): 16 random sequences
with torch.no_grad():
    S_shared, S_separate = head_scores(shared, xs), head_scores(separate, xs)

# %% [markdown]
# **Check:** the shared scores are symmetric, their diagonal has mean about $\sqrt{d_k}$ and the
# rest mean about 0 and a spread of about 1.1, and they obey the Cauchy–Schwarz bound; the
# separate ones are not symmetric, and their diagonal is not favoured; and the share of queries
# whose largest weight is on themselves. For inputs with independent unit-variance components,
# where $W_h$ is head $h$'s $d_{\text{model}} \times d_k$ block of a projection:
#
# - an off-diagonal shared score has variance $\lVert W_h^\top W_h \rVert_F^2 / d_k$. It would
#   be 1 if $W_h^\top W_h$ were the identity; random weights make it a little larger on average,
#   hence a spread slightly above 1;
# - a separate self-score has mean $\operatorname{tr}(W^Q_h W^{K\top}_h) / \sqrt{d_k}$, a number
#   that changes with the draw of the weights but stays near 0, far below $\sqrt{d_k}$.
#
# The check predicts both from the module's own weights.

# %%
torch.testing.assert_close(S_shared, S_shared.transpose(-2, -1))
diag = S_shared.diagonal(dim1=-2, dim2=-1)  # (B, h, T)
off_diag = S_shared[..., ~torch.eye(24, dtype=torch.bool, device=device)]  # (B, h, T * (T - 1))
W_heads = shared.W_q.weight.detach().view(shared.num_heads, shared.d_k, -1)  # (h, d_k, d_model)
gram = W_heads @ W_heads.transpose(-2, -1)  # (h, d_k, d_k): W_h^T W_h of each head
predicted_std = (gram.pow(2).sum(dim=(-2, -1)) / shared.d_k).mean().sqrt().item()
print(f"shared scores: diagonal mean {diag.mean():.2f} (sqrt(d_k) = {math.sqrt(shared.d_k):.2f}), "
      f"off-diagonal mean {off_diag.mean():.2f}, std {off_diag.std():.2f} "
      f"(predicted from the weights: {predicted_std:.2f})")
assert abs(diag.mean() / math.sqrt(shared.d_k) - 1) < 0.15
assert abs(off_diag.mean()) < 0.1 and abs(off_diag.std() - predicted_std) < 0.08
assert not torch.allclose(S_separate, S_separate.transpose(-2, -1), atol=1e-2)
bound = torch.maximum(diag[..., :, None], diag[..., None, :])  # (B, h, T, T)
assert torch.all(S_shared <= bound + 1e-5)
diag_separate = S_separate.diagonal(dim1=-2, dim2=-1)  # (B, h, T)
Wq_heads, Wk_heads = (W.weight.detach().view(separate.num_heads, separate.d_k, -1)
                      for W in (separate.W_q, separate.W_k))  # (h, d_k, d_model) each
predicted_self = ((Wq_heads * Wk_heads).sum(dim=(-2, -1)) / math.sqrt(separate.d_k)).mean().item()
print(f"separate scores: diagonal mean {diag_separate.mean():.2f} "
      f"(predicted from the weights: {predicted_self:.2f})")
assert abs(diag_separate.mean() - predicted_self) < 0.12  # over seeds 0-299: largest 0.0816
assert abs(predicted_self) < 0.25 * math.sqrt(separate.d_k)  # over seeds 0-299: |.| largest 0.2822

eye = torch.arange(24, device=device)
self_share = {
    name: (S.argmax(-1) == eye).float().mean().item()
    for name, S in (("shared", S_shared), ("separate", S_separate))
}
print(f"queries attending most to themselves: shared {self_share['shared']:.2f}, "
      f"separate {self_share['separate']:.2f} (chance 1/24 = {1 / 24:.2f})")
assert self_share["shared"] > 0.5  # most queries pick themselves ...
assert self_share["separate"] < 0.2  # ... against roughly chance with separate projections

# %% [markdown]
# The hand-set "previous token" head from above is directed by construction (its score is large
# at key $t - 1$ and 0 elsewhere), so it is far from symmetric, and its diagonal is not where its
# weight goes. A demonstration, not a check: the printout restates the construction.

# %%
with torch.no_grad():
    S_prev = head_scores(hand, tokens.to(device))[0, 0].cpu()  # (T, T), head 0
print("queries 1 to 5: largest score at key", S_prev[1:].argmax(-1).tolist())
print(f"largest |S - S^T|: {(S_prev - S_prev.T).abs().max().item():.1f}")

# %% [markdown]
# The picture: the scores and weights of head 0 on "the cat sat on the mat", with the random word
# table from before, for a module with separate projections and one with a shared projection.

# %%
with torch.no_grad():
    emb = embeddings.to(device)  # (1, T, d_model)
    rows = []
    for module in (separate, shared):
        _, w = module(emb, return_attn=True)
        rows.append((head_scores(module, emb)[0, 0].cpu(), w[0, 0].cpu()))
(S_sep0, _), (S_sh0, _) = rows  # head 0's scores, (T, T) each
print("shared, diagonal:           ", [round(v, 2) for v in S_sh0.diagonal().tolist()])
print("shared, largest off-diagonal:", round(S_sh0[~torch.eye(T, dtype=torch.bool)].max().item(), 2))
print("separate, largest |score|:  ", round(S_sep0.abs().max().item(), 2))
on_diagonal = S_sh0.diagonal() >= S_sh0.amax(dim=-1) - 1e-4  # (T,): the row's largest score?
print(f"rows whose largest shared score is their own: {int(on_diagonal.sum())} of {T}")
# Always true of a shared projection (Cauchy-Schwarz): S_ij <= sqrt(S_ii * S_jj).
d_sh = S_sh0.diagonal()
assert torch.all(S_sh0 <= (d_sh[:, None] * d_sh[None, :]).sqrt() + 1e-4)
# The rest depends on the draw of the weights: the same sentence under 40 draws (seed 0 is the
# one above), the mean self-score over the mean size of a separate score, and the self-picks.
ratio_by_draw, self_rows_by_draw = [], []
for seed in range(40):
    set_seed(seed)
    separate_s, shared_s = MultiHeadAttention(32, 4).to(device), MultiHeadAttention(32, 4).to(device)
    shared_s.W_k = shared_s.W_q
    with torch.no_grad():
        S_a, S_b = head_scores(shared_s, emb)[0, 0].cpu(), head_scores(separate_s, emb)[0, 0].cpu()
    ratio_by_draw.append((S_a.diagonal().mean() / S_b.abs().mean()).item())
    self_rows_by_draw.append(int((S_a.diagonal() >= S_a.amax(dim=-1) - 1e-4).sum()))
print(f"mean self-score / mean |separate score|: {(d_sh.mean() / S_sep0.abs().mean()).item():.2f} "
      f"here, {min(ratio_by_draw):.2f} to {max(ratio_by_draw):.2f} over 40 draws")
print(f"rows picking themselves over 40 draws: {sum(self_rows_by_draw)} of {40 * T}, "
      f"at least {min(self_rows_by_draw)} of {T} in every draw")
assert min(ratio_by_draw) > 1  # larger than the separate scores in every draw
assert sum(self_rows_by_draw) > 0.5 * 40 * T  # most rows pick themselves

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(2, 2, figsize=(10, 8.2), layout="constrained")
for r, (name, (S, A)) in enumerate(zip(["separate W_q, W_k", "shared W_q = W_k"], rows, strict=True)):
    lim = max(S_row.abs().max().item() for S_row, _ in rows)  # one symmetric scale for both maps
    for c, (values, kind, cmap, vmin, vmax, label) in enumerate([
        (S, "scores", "RdBu_r", -lim, lim, "score $q \\cdot k / \\sqrt{d_k}$"),
        (A, "attention weights", "Blues", 0, 1, "attention weight"),
    ]):
        largest = f"largest |score| {values.abs().max().item():.2f}" if kind == "scores" else "rows sum to 1"
        plot_attention(values, words, ax=axes[r, c], cmap=cmap, vmin=vmin, vmax=vmax, label=label,
                       title=f"{name}: {kind} (head 0)\n{largest}")
save_figure(fig, "mha_shared_qk")
plt.show()


# %% [markdown]
# The two score maps share one colour scale, so their sizes compare at a glance (each title gives
# its map's largest score in size): the pale separate map has small scores, not no structure. With a shared
# projection the score matrix is a mirror image of itself, and in this draw every row's largest
# score is on the diagonal (for *the* it ties with the other *the*, the same vector): each word
# mostly finds itself. The diagonal runs from 1.89 to 6.24; its two largest entries, 6.24 (*sat*)
# and 5.17 (*mat*), are about 3.1 and 2.6 times the largest score, in size, that the separate
# projections produce anywhere (2.02), and on average the self-scores are 6.15 times the separate
# scores' mean size. With separate projections the scores are smaller and the pattern has a
# direction.
#
# How robust this is. Picking itself is likely, not certain: Cauchy–Schwarz bounds $S_{ij}$ by
# $\sqrt{S_{ii} S_{jj}}$, not by $S_{ii}$, so a word whose query is much longer can outscore a
# short one's self-score. Over 40 draws of the weights a few rows of this sentence do, up to two
# of six in one draw (printed above); over the batches above about three queries in four pick
# themselves. The ratio of mean sizes depends a lot on the draw: 6.15 here, between 1.73 and
# 10.31 over the 40 draws. So the asserts keep only what held in every draw: the self-scores are
# larger at all, and most rows pick themselves.
#
# **Takeaway: separate $W^Q$ and $W^K$ let "who looks at whom" be asymmetric; one shared
# projection forces symmetric scores and pulls every token's attention towards itself.**
#
# ## What the heads cost: parameters and FLOPs
#
# Four $d_{\text{model}} \times d_{\text{model}}$ matrices and four bias vectors:
# $4 d_{\text{model}}^2 + 4 d_{\text{model}}$, whatever the number of heads, because more heads
# only cut the same matrices into thinner blocks. For the paper's base model ($d_{\text{model}} =
# 512$, $h = 8$) that is 1,050,624 per attention layer. We count the real modules, ours against
# PyTorch's. (The loop over $h$ is a demonstration rather than a test: our constructor builds
# the same four `Linear`s for every $h$, so it holds by construction. The comparisons with the
# formula and with `nn.MultiheadAttention` are the tests.)

# %%
def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


d = 512
n_ours = count(MultiHeadAttention(d, 8))
n_no_bias = count(MultiHeadAttention(d, 8, bias=False))
n_torch = count(nn.MultiheadAttention(d, 8))
print(f"{'module':<42}{'parameters':>12}")
print(f"{'MultiHeadAttention(512, 8)':<42}{n_ours:>12,}")
print(f"{'MultiHeadAttention(512, 8, bias=False)':<42}{n_no_bias:>12,}")
print(f"{'nn.MultiheadAttention(512, 8)':<42}{n_torch:>12,}")
for h in (1, 2, 4, 8, 16, 64):
    assert count(MultiHeadAttention(d, h)) == n_ours  # independent of the number of heads
assert n_ours == 4 * d**2 + 4 * d == 1_050_624 == n_torch
assert n_no_bias == 4 * d**2
assert count(shared) == count(separate) - (32 * 32 + 32)  # tying removes one projection

# %% [markdown]
# The work, counted with notebook 02's `count_flops` on the `meta` device, for one sequence of
# $T$ tokens: the four projections cost $2 T d_{\text{model}}^2$ each, and the two products of
# attention $2T^2(d_k + d_v)$ per head, so $h \cdot 2T^2 \cdot 2d_{\text{model}}/h =
# 4T^2 d_{\text{model}}$ over all heads, whatever $h$ is. One wide head and 64 narrow ones do
# exactly the same matrix-product FLOPs; this is what "eight narrow heads cost about as much as
# one wide one" means. (Only the FLOPs: the softmax and the reshapes are not counted, and many
# small products may run at another speed than a few large ones.) A module that split the heads
# wrongly, for example into heads of width $d_{\text{model}}$, would not match the formula.

# %%
from transformer_from_scratch.measure import count_flops  # notebook 02

T_cost = 128
x_cost = torch.empty(1, T_cost, d, device="meta")  # (B, T, d_model): shapes only, no data
lines = [f"{'heads h':>7} {'d_k':>4} {'matrix-product MFLOP':>21}"]
for h in (1, 2, 8, 64):
    module = MultiHeadAttention(d, h).to("meta")
    flops = count_flops(lambda module=module: module(x_cost))
    assert flops == 4 * 2 * T_cost * d**2 + 4 * T_cost**2 * d  # projections + attention, any h
    lines.append(f"{h:>7} {d // h:>4} {flops / 1e6:>21.1f}")
print("\n".join(lines))

# %% [markdown]
# **Takeaway: heads are free in parameters, $4 d_{\text{model}}^2 + 4 d_{\text{model}}$ for any
# $h$ that divides $d_{\text{model}}$, and in matrix-product FLOPs, $8Td_{\text{model}}^2 +
# 4T^2 d_{\text{model}}$ for any such $h$.**
#
# ## Recap
#
# | concept | code | shape |
# |---|---|---|
# | packed projections $XW^Q, XW^K, XW^V$ | `self.W_q(x_q)`, `self.W_k(x_k)`, `self.W_v(x_v)` | $(B, T, d_{\text{model}})$ |
# | split into heads | `self.split_heads(...)` | $(B, T, d_{\text{model}}) \to (B, h, T, d_k)$ |
# | attention in every head | `scaled_dot_product_attention(Q, K, V, mask, ...)` | context $(B, h, T_q, d_k)$, weights $(B, h, T_q, T_k)$ |
# | Concat | `self.combine_heads(context)` | $(B, h, T_q, d_k) \to (B, T_q, d_{\text{model}})$ |
# | $W^O$ | `self.W_o(...)` | $(B, T_q, d_{\text{model}})$ |
# | mask (True = may attend) | `mask=` | broadcastable to $(B, h, T_q, T_k)$, e.g. $(B, 1, 1, T_k)$ |
# | Xavier init | `_reset_parameters()` | $\operatorname{Var}(W) = 1/d_{\text{model}}$, biases $0$ |
# | parameters | `sum(p.numel() ...)` | $4 d_{\text{model}}^2 + 4 d_{\text{model}}$ |
# | matrix-product FLOPs | `count_flops(lambda: mha(x))` (notebook 02), on `meta` | $8 T d_{\text{model}}^2 + 4 T^2 d_{\text{model}}$ per sequence, for any $h$ |
# | PyTorch's equivalent | `nn.MultiheadAttention(..., batch_first=True)` | its masks: True = ignore |
#
# ## Exercises
#
# 1. With `num_heads=1`, show that the module is plain scaled dot-product attention of width
#    $d_{\text{model}}$ between the projections.
# 2. Show that "concatenate, then $W^O$" equals a **sum over heads**: head $i$ writes into the
#    output through its own block of rows $W^O_i$ of $W^O$ (in code, a block of *columns* of
#    `W_o.weight`).
# 3. Heads have no order. Permute the heads of a module (the row blocks of `W_q`, `W_k`, `W_v` and
#    the column blocks of `W_o`) and check that the output does not change, while the attention
#    weights come back permuted.
#
# **Solutions.**
#
# 1. With $h = 1$, $d_k = d_{\text{model}}$, the split only adds a head axis of size one.

# %%
set_seed(0)
single = MultiHeadAttention(32, 1).to(device)
x_ex = torch.randn(2, 6, 32).to(device)  # (B, T, d_model)
with torch.no_grad():
    Q, K, V = single.W_q(x_ex), single.W_k(x_ex), single.W_v(x_ex)  # (B, T, d_model) each
    context, _ = scaled_dot_product_attention(Q, K, V)  # (B, T, d_model), no head axis
    torch.testing.assert_close(single(x_ex), single.W_o(context))

# %% [markdown]
# 2. Split $W^O \in \mathbb{R}^{h d_k \times d_{\text{model}}}$ into $h$ blocks of $d_k$ rows,
#    $W^O_i \in \mathbb{R}^{d_k \times d_{\text{model}}}$ (rows $i d_k, \dots, (i+1) d_k - 1$): the
#    rows that multiply head $i$'s channels of the concatenation. A row vector times a matrix
#    splits the same way, so $\mathrm{Concat}(c_1, \dots, c_h)\, W^O = \sum_i c_i W^O_i$.
#    `nn.Linear` stores $W^O$ transposed, as `W_o.weight` $= (W^O)^\top$, so $W^O_i$ is
#    `W_o.weight[:, i * d_k : (i + 1) * d_k].T`, a block of *columns* of the stored weight.

# %%
# `ours` is the module of the parity section (random biases), `x_ex` the input of solution 1.
with torch.no_grad():
    Q, K, V = (ours.split_heads(W(x_ex)) for W in (ours.W_q, ours.W_k, ours.W_v))  # (B, h, T, d_k)
    context, _ = scaled_dot_product_attention(Q, K, V)  # (B, h, T, d_k)
    W_O = ours.W_o.weight.T  # (h * d_k, d_model): the paper's W^O
    blocks = [W_O[i * ours.d_k : (i + 1) * ours.d_k] for i in range(ours.num_heads)]  # W^O_i: (d_k, d_model)
    per_head = [context[:, i] @ W_O_i for i, W_O_i in enumerate(blocks)]  # (B, T, d_k) -> (B, T, d_model)
    torch.testing.assert_close(sum(per_head) + ours.W_o.bias, ours(x_ex))
    # Head i's term is what W_o makes of the concatenation with every other head's channels zeroed.
    concat = ours.combine_heads(context)  # (B, T, h * d_k)
    for i, term in enumerate(per_head):
        only_head_i = torch.zeros_like(concat)
        only_head_i[..., i * ours.d_k : (i + 1) * ours.d_k] = concat[..., i * ours.d_k : (i + 1) * ours.d_k]
        torch.testing.assert_close(term, ours.W_o(only_head_i) - ours.W_o.bias)

# %% [markdown]
# 3. Reorder the head blocks with one permutation everywhere: rows of the three input projections
#    (weights and biases), columns of `W_o.weight`. The output is unchanged; head $i$ of the
#    permuted module is head `perm[i]` of the original.

# %%
perm = [2, 0, 3, 1]
channels = torch.cat([torch.arange(p * ours.d_k, (p + 1) * ours.d_k) for p in perm]).to(device)  # (d_model,)
permuted = MultiHeadAttention(32, 4).to(device)
with torch.no_grad():
    for mine, orig in ((permuted.W_q, ours.W_q), (permuted.W_k, ours.W_k), (permuted.W_v, ours.W_v)):
        mine.weight.copy_(orig.weight[channels])  # permute output channels (rows)
        mine.bias.copy_(orig.bias[channels])
    permuted.W_o.weight.copy_(ours.W_o.weight[:, channels])  # permute input channels (columns)
    permuted.W_o.bias.copy_(ours.W_o.bias)
    y_perm, a_perm = permuted(x_ex, return_attn=True)
    y, a = ours(x_ex, return_attn=True)
torch.testing.assert_close(y_perm, y)
torch.testing.assert_close(a_perm, a[:, perm])

# %% [markdown]
# Next: [04 · Positional encoding](04_positional_encoding.ipynb). Everything so far treats the
# input as a set: shuffle the tokens and the outputs shuffle with them. Positions have to be added
# to the vectors themselves.
