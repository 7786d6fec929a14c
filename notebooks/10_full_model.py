# %% [markdown]
# # 10 · The full model
#
# **What you will build:** the encoder–decoder Transformer, complete. First the two stacks,
# `Encoder` and `Decoder`: $N$ blocks from notebook 08 in an `nn.ModuleList`, with the final
# `LayerNorm` that a pre-norm stack needs. Then `Transformer`, which wires the embeddings and the
# positional encoding (notebooks 04 and 09), the two stacks and the output head together, with
# `encode`, `decode` and `forward`. You will count its 930,828 parameters piece by piece, check
# which inputs each output can see, match PyTorch's `nn.Transformer` in outputs and gradients,
# draw the architecture with code, its labels checked against the model, and check the shapes
# of the recap table on a real forward pass.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/10_full_model.ipynb) · Assumes: [04 · Positional encoding](04_positional_encoding.ipynb), [05 · Masking](05_masking.ipynb), [08 · Encoder and decoder blocks](08_blocks.ipynb), [09 · Embeddings and the output head](09_embeddings_and_output_head.ipynb).

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
import dataclasses
import math
import warnings
from typing import Protocol, runtime_checkable

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import LogNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Patch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.testing import assert_close

# What this notebook builds on: the blocks, masks, positional encoding and embeddings of notebooks 04-09.
from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.layers import BlockCache, DecoderBlock, EncoderBlock, LayerNorm
from transformer_from_scratch.masks import causal_mask, padding_mask
from transformer_from_scratch.model import embed_tokens, init_token_embedding
from transformer_from_scratch.positional import PositionalEncoding
from transformer_from_scratch.reference import copy_block_to_torch, copy_norm_to_torch, torch_parameter
from transformer_from_scratch.tokens import BOS, EOS, PAD, check_token_ids
from transformer_from_scratch.utils import COLORS, PART_COLORS, add_to_class, get_device, save_figure, set_seed

# Notebook 00's argument checks, used by the exported cells (validated() also turns them off in some
# demonstrations below), and the activations a feed-forward network accepts (notebook 07).
from transformer_from_scratch.checks import (
    check_bool, check_choice, check_int, check_mask, check_probability, check_tensor, checking, validated,
)
from transformer_from_scratch.layers import ACTIVATIONS

generator = set_seed(0)
device = get_device()


# %% [markdown]
# The stacks join the blocks in the `layers` module; the model completes the `model` module that
# notebook 09 started.

# %%
#| default_exp model

# %% [markdown]
# ## Stacking the blocks
#
# The "$N\times$" of the paper's figure is a loop: the output of block $l$ is the input of block
# $l + 1$, and all $N$ blocks have the same shape and separate weights. Vaswani et al. (2017)
# use $N = 6$; the course's model, $N = 2$.
#
# Two details make the stack correct rather than merely runnable:
#
# * **`nn.ModuleList`, not a Python list.** A module finds its parameters by walking its
#   attributes that are modules. A list is not one, so blocks kept in a plain list are invisible
#   to `parameters()` (the optimiser never updates them), to `state_dict()` (checkpoints lose
#   them) and to `.to(device)` (they stay behind on the CPU). `nn.ModuleList` registers each
#   block as `layers.0`, `layers.1`, ...
# * **A final `LayerNorm`.** A pre-norm block normalises what its sub-layers read, never the
#   residual stream itself (notebook 08). The stream that leaves the last block is an
#   unnormalised sum of every update before it, so the stack ends with one more `LayerNorm`:
#   the decoder's output head and the decoder's cross-attention (which reads the encoder's output
#   as it is) then see vectors of a controlled scale. A post-norm stack (`norm_first=False`, the
#   paper's arrangement) ends in a norm already; it keeps the final one too, as `nn.Transformer`
#   does in both arrangements, so that the two compare weight for weight.
#
# A stack takes every setting of its blocks, with the blocks' defaults (notebook 08: ReLU, biases,
# pre-norm, no dropout), and passes them to each block: `Encoder(2, 32, 4, 64).layers[0]` is
# `EncoderBlock(32, 4, 64)`. The model's configuration below sets the paper's dropout, 0.1. One
# setting, `fast`, selects notebook 14's faster implementation of the same function; it stays off
# until then.
#
# The two stacks differ only in the block they repeat and in their `forward`, so, as the blocks
# of notebook 08 do, they share one constructor, in a base class `_Stack`; each stack names its
# block in a class attribute.

# %%
#| export layers
class _Stack(nn.Module):
    """num_layers blocks of one kind in an nn.ModuleList, then a final LayerNorm."""

    block: type[nn.Module]  # EncoderBlock or DecoderBlock, set by the two stacks below

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, **settings):
        """settings: the block's own keywords after d_ff (dropout_p, activation, bias, norm_first,
        fast), passed on unchanged, so a stack and its blocks share one set of defaults."""
        super().__init__()
        check_int("num_layers", num_layers, minimum=1)
        self.layers = nn.ModuleList(
            self.block(d_model, num_heads, d_ff, **settings) for _ in range(num_layers)
        )  # registered as layers.0, layers.1, ...: seen by parameters(), state_dict(), .to()
        fast = self.layers[0].norm1.fast  # the final norm takes the fast path when the blocks do
        self.norm = LayerNorm(d_model, fast=fast)  # pre-norm blocks leave the stream unnormalised
        self.num_layers, self.d_model = num_layers, d_model


class Encoder(_Stack):
    """A stack of num_layers encoder blocks (pre-norm by default), then a final LayerNorm."""

    block = EncoderBlock

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model); mask broadcastable to (B, h, T, T), True = attend."""
        for layer in self.layers:
            x = layer(x, mask=mask)  # (B, T, d_model) -> (B, T, d_model)
        return self.norm(x)


# %% [markdown]
# The decoder stack is the same loop over decoder blocks, and every block reads the **same**
# encoder output `enc_out`: the encoder runs once, and its result is the keys and values of the
# cross-attention of all $N$ decoder blocks.
#
# The stack also passes on a `cache`, which matters only for generation (notebook 12): until then
# every call leaves it at `None`, and you can skip the next cell. Such a cache holds one part per
# block, `cache.layer(i)`, which the stack hands to block $i$, and knows how many positions it
# holds, `cache.length` (where the model's `decode` places new tokens, below): the third and last
# cache `Protocol`, after notebook 03's and 08's. A `Protocol` (from `typing`) only lists what an
# object must have, here a `length` and a `layer(i)`; the bodies are `...`, and any class with
# those members fits, without inheriting from it.

# %%
#| export layers
@runtime_checkable
class DecoderCache(Protocol):
    """What Decoder.forward and Transformer.decode ask of a cache (notebook 12's KVCache is one)."""

    @property
    def length(self) -> int:  # positions kept so far: the position of the next token
        ...

    def layer(self, i: int) -> BlockCache:  # decoder block i's part
        ...


# %%
#| export layers
class Decoder(_Stack):
    """A stack of num_layers decoder blocks reading one enc_out, then a final LayerNorm."""

    block = DecoderBlock

    def forward(
        self,
        x: torch.Tensor,  # (B, T, d_model), the embedded target
        enc_out: torch.Tensor,  # (B, T_src, d_model), read by every block
        self_mask: torch.Tensor | None = None,  # broadcastable to (B, h, T, T)
        cross_mask: torch.Tensor | None = None,  # broadcastable to (B, h, T, T_src)
        cache: DecoderCache | None = None,  # every block's keys and values (notebook 12)
    ) -> torch.Tensor:
        """(B, T, d_model) and enc_out (B, T_src, d_model) -> (B, T, d_model)."""
        for i, layer in enumerate(self.layers):
            block_cache = None if cache is None else cache.layer(i)  # block i's part of the cache
            x = layer(x, enc_out, self_mask, cross_mask, cache=block_cache)  # (B, T, d_model)
        return self.norm(x)


# %% [markdown]
# **Check:** shapes, and each stack equals its blocks applied one after the other by hand, then
# its final norm, with masks in three places, of two shapes: the source's padding mask `src_pad`,
# $(B, 1, 1, T_\text{src})$, for the encoder and again as the decoder's `cross_mask`, and a causal
# `self_mask`, $(1, 1, T_\text{tgt}, T_\text{tgt})$, with $T_\text{src} = 7 \ne T_\text{tgt} = 5$
# (a stack that passed a mask to the wrong attention layer would fail here: neither shape
# broadcasts against the other layer's scores). The last lines confirm only that the norm is there: at initialisation
# ($\gamma = 1$, $\beta = 0$) every output vector has mean 0 and variance 1, as the output of
# any stack that ends in a fresh `LayerNorm` has.

# %%
small = dict(num_layers=3, d_model=32, num_heads=4, d_ff=64)  # a small stack for the checks
B, T_src, T_tgt, d_small = 2, 7, 5, small["d_model"]
x_src = torch.randn(B, T_src, d_small, generator=generator).to(device)
x_tgt = torch.randn(B, T_tgt, d_small, generator=generator).to(device)
encoder = Encoder(**small, dropout_p=0.0).to(device)
decoder = Decoder(**small, dropout_p=0.0).to(device)
src_pad = padding_mask(torch.tensor([T_src, 4]), T_src).to(device)  # (B, 1, 1, T_src): row 1 padded after 4
tgt_causal = causal_mask(T_tgt, device=device)  # (1, 1, T_tgt, T_tgt)

enc_out = encoder(x_src, mask=src_pad)  # (B, T_src, d_small)
dec_out = decoder(x_tgt, enc_out, self_mask=tgt_causal, cross_mask=src_pad)  # (B, T_tgt, d_small)
assert enc_out.shape == (B, T_src, d_small) and dec_out.shape == (B, T_tgt, d_small)

stream = x_src  # the residual stream, block by block
for block in encoder.layers:
    stream = block(stream, mask=src_pad)
assert_close(enc_out, encoder.norm(stream))
stream = x_tgt
for block in decoder.layers:
    stream = block(stream, enc_out, self_mask=tgt_causal, cross_mask=src_pad)  # the same enc_out for every block
assert_close(dec_out, decoder.norm(stream))

for out in (enc_out, dec_out):
    assert_close(out.mean(dim=-1), torch.zeros(out.shape[:-1], device=device), atol=1e-5, rtol=0)
    assert_close(out.var(dim=-1, unbiased=False), torch.ones(out.shape[:-1], device=device), atol=1e-3, rtol=0)
print(f"encoder {tuple(enc_out.shape)}, decoder {tuple(dec_out.shape)}: blocks in order, then the final norm")

# %% [markdown]
# What the final norm does to the stream, in a deeper stack: the root-mean-square of the residual
# stream after each of 6 encoder blocks at initialisation, and of the stack's output. Each block
# adds its update on top, and nothing scales the sum back (notebook 08 measured what that does to
# the gradients); the final norm does. **Check:** the stream grows at every block, by well over
# half its size in six blocks: that is what the final norm is for. The stack's own `forward`
# then brings it back to RMS 1, which again confirms only that the norm is there.

# %%
g = set_seed(0)  # the weights and the input both drawn afresh: the cell prints the same on a rerun
deep = Encoder(6, 128, 4, 512, dropout_p=0.0).to(device)
x_in = torch.randn(8, 16, 128, generator=g).to(device)  # (B, T, d): RMS 1
rms = [x_in.pow(2).mean().sqrt().item()]
with torch.no_grad():
    stream = x_in
    for block in deep.layers:
        stream = block(stream)
        rms.append(stream.pow(2).mean().sqrt().item())
    rms.append(deep(x_in).pow(2).mean().sqrt().item())  # the stack's forward: the blocks, then its norm
print("RMS: input", round(rms[0], 3), "| after blocks", [round(r, 3) for r in rms[1:-1]],
      "| the stack's output", round(rms[-1], 3))
assert all(b > a for a, b in zip(rms[:-1], rms[1:-1], strict=False))  # grows at every block
assert rms[-2] > 1.5 * rms[0]  # after 6 blocks: far from unit scale
assert abs(rms[-1] - 1) < 1e-3  # the output: unit scale (so the final norm is there)

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
labels = ["input"] + [f"block {i}" for i in range(1, 7)] + ["final norm"]
colors = ["#9a9a9a"] + [COLORS["ours"]] * 6 + [PART_COLORS["layer_norm"]]  # pre-norm blocks in blue, LayerNorm in purple
ax.bar(labels, rms, color=colors)
ax.axhline(1.0, color="black", lw=0.8, ls="--")
for i, r in enumerate(rms):
    ax.text(i, r + 0.02, f"{r:.2f}", ha="center", va="bottom", fontsize=9)
ax.legend(handles=[Patch(color=colors[0], label="the input, N(0, 1) entries"),
                   Patch(color=COLORS["ours"], label="after a pre-norm encoder block"),
                   Patch(color=colors[-1], label="after the stack's final LayerNorm"),
                   Line2D([], [], color="black", lw=0.8, ls="--", label="RMS 1")],
          loc="upper left", ncols=2, fontsize=9)
ax.set(ylabel="RMS of the residual stream", xlabel="where it is measured: the input, after each block, the stack's output",
       ylim=(0, max(rms) * 1.45),
       title=r"A 6-block pre-norm encoder at initialisation ($d_\mathrm{model}$ = 128): the stream grows, the final norm resets it")
save_figure(fig, "model_stack_rms")
plt.show()


# %% [markdown]
# Now the `ModuleList` point, shown: the same encoder with its blocks in a plain Python list.

# %%
class ListEncoder(nn.Module):
    """The mistake: blocks in a Python list, invisible to nn.Module's bookkeeping."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int):
        super().__init__()
        self.layers = [EncoderBlock(d_model, num_heads, d_ff) for _ in range(num_layers)]
        self.norm = LayerNorm(d_model)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


good, bad = Encoder(**small), ListEncoder(**small)
block_params = num_params(EncoderBlock(small["d_model"], small["num_heads"], small["d_ff"]))
print(f"ModuleList: {num_params(good):,} parameters, {len(good.state_dict())} state_dict entries")
print(f"plain list: {num_params(bad):,} parameters, {len(bad.state_dict())} state_dict entries")

# %% [markdown]
# **Check:** the `ModuleList` stack owns its 3 blocks' parameters plus the final norm's and names
# them `layers.0...`; the plain list owns only the norm's. And `.to()` moves only what it can
# see: `.to(device)`, `.to(dtype)` and `.double()` all walk the registered submodules, and a
# change of dtype shows it without a GPU. After `.double()`, the `ModuleList` stack runs in
# float64, while the list's blocks are still float32 and the forward pass fails.

# %%
assert num_params(good) == small["num_layers"] * block_params + 2 * d_small
assert num_params(bad) == 2 * d_small  # only the final norm
assert "layers.2.ffn.0.weight" in good.state_dict() and not any(k.startswith("layers") for k in bad.state_dict())

good, bad = good.double(), bad.double()
assert {p.dtype for p in good.parameters()} == {torch.float64}
assert {p.dtype for p in bad.layers[0].parameters()} == {torch.float32}  # left behind
x64 = torch.randn(B, T_src, d_small, dtype=torch.float64, generator=generator)
assert good(x64).dtype == torch.float64
try:
    bad(x64)
except RuntimeError as err:
    assert "dtype" in str(err), err  # a dtype mismatch (the wording varies by device), not some other failure
    print("plain list after .double(): the blocks are still float32 and the forward pass fails"
          " (RuntimeError, a dtype mismatch)")
else:
    raise AssertionError("expected a dtype mismatch")

# %% [markdown]
# **A stack is $N$ blocks in an `nn.ModuleList` and, in pre-norm, a final `LayerNorm`; every
# decoder block reads the same encoder output.**
#
# ## The model
#
# The whole model, bottom to top, with $S$ the source length, $T$ the target length,
# $d = d_\text{model}$, $w^\text{src} \in \{0, \dots, V_\text{src} - 1\}^{B \times S}$ the source
# ids, $w^\text{tgt}$ the target ids (`tgt_in`), and $E[w]$ the rows of a table $E$ picked by the
# ids $w$ (notebook 09's $E_{w_t}$ at every position):
#
# $$
# \begin{aligned}
# \text{enc\_out} &= \mathrm{Encoder}\Bigl(\mathrm{Dropout}\bigl(\sqrt{d}\, E^\text{src}[w^\text{src}] + \mathrm{PE}_{0..S-1}\bigr)\Bigr) &&\in \mathbb{R}^{B \times S \times d},\\
# \text{dec\_out} &= \mathrm{Decoder}\Bigl(\mathrm{Dropout}\bigl(\sqrt{d}\, E^\text{tgt}[w^\text{tgt}] + \mathrm{PE}_{0..T-1}\bigr),\ \text{enc\_out}\Bigr) &&\in \mathbb{R}^{B \times T \times d},\\
# \text{logits} &= \text{dec\_out}\, W_\text{out}^\top + b_\text{out} &&\in \mathbb{R}^{B \times T \times V_\text{tgt}}.
# \end{aligned}
# $$
#
# Dropout ($p = 0.1$ by default, active only in training mode) acts in three places. Two are the
# paper's (Vaswani et al., 2017, §5.4): the sum of embedding and positional encoding above
# (`model.pos.dropout`), and the output of every sub-layer before it is added to the residual
# stream (each block's `dropout1`, `dropout2`, ...:
# $x + \mathrm{Dropout}(\mathrm{sublayer}(\mathrm{norm}(x)))$, notebook 08). The third is on the
# attention weights inside every attention layer, as in `nn.Transformer`; the paper does not
# mention it (notebook 06).
#
# The source and the target get separate embedding tables (their vocabularies may differ) and
# share the positional encoding, which has no parameters. The constructor builds the parts from
# the bottom up and then applies notebook 09's `init_token_embedding` to both tables: the $\sqrt d$
# multiply in the forward pass assumes it. Besides the parts, it keeps `config`, every setting of
# the architecture, defaults filled in (below), so that the same architecture can be rebuilt (for
# checkpoints, notebook 11).

# %% [markdown]
# The architecture lives in one place, a dataclass, as nanoGPT's `GPTConfig` does: the sizes, the
# dropout, the block settings of notebook 08 (activation, biases, pre- or post-norm) and `fast`
# (off until notebook 14). `model.config` is a `TransformerConfig`; the constructor takes either
# a config or its fields as arguments, and builds the config first, so every part of the model
# reads its settings from the same object and a new field is declared once (notebook 11 saves it
# with every checkpoint, to rebuild the model). Building the config checks every value with
# notebook 00's `checks`, so a bad one fails before a single layer is made.
#
# The two calls build the same model: `Transformer(12, 12, d_model=64)` is the short form for a
# model written out in a cell, and makes the config itself; `Transformer(config)` is for a config
# that already exists (one read back from a checkpoint). `Transformer.from_config(config)` is the
# second call under a name that says what it does, and refuses anything but a `TransformerConfig`.
# The subsection *The config, checked*, once the model is written, shows each of these claims.

# %%
#| export
from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerConfig:
    """The architecture of a Transformer: Transformer(config) builds one."""

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 2
    dropout_p: float = 0.1  # embeddings + PE, every sub-layer's output, the attention weights
    max_len: int = 512
    activation: str = "relu"  # of the feed-forward networks: "relu", "gelu" or "silu"
    bias: bool = True  # in the attention projections and the feed-forward networks
    norm_first: bool = True  # pre-norm blocks; False: the paper's post-norm
    fast: bool = False  # notebook 14's fast path: packed projections, PyTorch's fused kernels

    def __post_init__(self):
        for name in ("src_vocab_size", "tgt_vocab_size"):  # room for PAD, BOS, EOS and a symbol
            check_int(name, getattr(self, name), minimum=EOS + 2)
        for name in ("d_model", "num_heads", "d_ff", "num_layers", "max_len"):
            check_int(name, getattr(self, name), minimum=1)
        check_probability("dropout_p", self.dropout_p)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_bool("bias", self.bias)
        check_bool("norm_first", self.norm_first)
        check_bool("fast", self.fast)
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                "every head needs the same width d_k = d_model / num_heads"
            )

    @property
    def block_settings(self) -> dict:
        """What every block of both stacks is built with: the block's keywords after d_ff."""
        names = ("dropout_p", "activation", "bias", "norm_first", "fast")
        return {name: getattr(self, name) for name in names}


# %% [markdown]
# Bad input should fail at the model's door with a message that names the argument, not deep
# inside an attention layer. Notebook 00 gave the course two switches: `checking()` says whether
# checks are on, and inside `with validated():` they are off. The model checks its inputs
# **once**, where they enter, and then runs its layers inside `validated()`, so that the layers,
# each of which checks its inputs when it is called on its own, do not check the same tensors
# again. So the door must check everything those layers would have: ids of the vocabulary that
# fit the positional table (the helper below), and masks that pass `check_mask` (bool or
# floating, and the right shape; an integer 0/1 mask would be *added* to the scores, masking
# nothing, as *Clear errors* shows).

# %%
#| export
def _check_tokens(name: str, tokens: torch.Tensor, vocab_size: int, max_len: int, offset: int = 0):
    """Raise unless tokens are (B, T) ids in [0, vocab_size) at positions below max_len."""
    check_token_ids(tokens, vocab_size, name)
    T = tokens.shape[1]
    if offset + T > max_len:
        where = f"positions {offset}..{offset + T - 1}" if offset else f"length {T}"
        raise ValueError(
            f"{name} has {where}, beyond the model's max_len={max_len} "
            "(the rows of its positional encoding)"
        )


# %% [markdown]
# The model itself:

# %%
#| export
class Transformer(nn.Module):
    """The encoder-decoder Transformer (Vaswani et al., 2017): token ids to logits.

    Transformer(config) or Transformer(src_vocab_size, tgt_vocab_size, **fields), where the
    fields are those of TransformerConfig (d_model, num_heads, ..., norm_first).
    """

    def __init__(
        self,
        src_vocab_size: "int | TransformerConfig",  # or a whole TransformerConfig, passed alone
        tgt_vocab_size: int | None = None,
        **fields,
    ):
        super().__init__()
        if isinstance(src_vocab_size, TransformerConfig):
            if tgt_vocab_size is not None or fields:
                raise TypeError("pass a TransformerConfig alone, or its fields, not both")
            config = src_vocab_size
        else:  # an unknown field is a TypeError, a bad value a ValueError, from the dataclass
            config = TransformerConfig(src_vocab_size, tgt_vocab_size, **fields)
        self.config = c = config  # the one record of the architecture; the properties read it

        self.src_embed = nn.Embedding(c.src_vocab_size, c.d_model, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=PAD)
        self.pos = PositionalEncoding(c.d_model, max_len=c.max_len, dropout_p=c.dropout_p)
        self.encoder = Encoder(c.num_layers, c.d_model, c.num_heads, c.d_ff, **c.block_settings)
        self.decoder = Decoder(c.num_layers, c.d_model, c.num_heads, c.d_ff, **c.block_settings)
        self.out_proj = nn.Linear(c.d_model, c.tgt_vocab_size)  # logits; the loss has the softmax
        # The scale that the sqrt(d_model) multiply in encode/decode assumes (notebook 09).
        init_token_embedding(self.src_embed)
        init_token_embedding(self.tgt_embed)

    @classmethod
    def from_config(cls, config: TransformerConfig) -> "Transformer":
        """A new model of the architecture `config` (the same as Transformer(config))."""
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"expected a TransformerConfig, got {type(config).__name__}")
        return cls(config)

    # Read from the config, not stored a second time.
    d_model = property(lambda self: self.config.d_model, doc="the width of every vector")
    num_heads = property(lambda self: self.config.num_heads, doc="heads per attention layer")
    max_len = property(lambda self: self.config.max_len, doc="rows of the positional table")


# %% [markdown]
# `encode` turns source ids into the encoder's output: check the ids and the mask, then look up
# and scale (notebook 09's `embed_tokens`), add positions, run the stack. `src_mask` is the
# source's padding mask (notebook 05), True on real tokens.

# %%
#| export
@add_to_class(Transformer)
def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Source ids (B, T_src) -> enc_out (B, T_src, d_model); src_mask True = a real token."""
    if checking():
        _check_tokens("src", src, self.src_embed.num_embeddings, self.max_len)
        B, T_src = src.shape
        check_mask("src_mask", src_mask, (B, self.num_heads, T_src, T_src), "(B, h, T, T)")
    with validated():  # the layers below need not check again
        x = embed_tokens(self.src_embed, src, "src")  # (B, T_src) -> (B, T_src, d_model), * sqrt(d)
        return self.encoder(self.pos(x), mask=src_mask)  # + PE, then N blocks and the final norm


# %% [markdown]
# `decode` does the same for the target and runs the decoder stack over `enc_out`. It takes two
# masks: `self_mask` for the masked self-attention (the causal mask, combined with the target's
# padding when the batch is padded) and `cross_mask` for the cross-attention (the source's
# padding). Generation calls it once per new token with the same `enc_out` (notebook 12), and may
# pass a `cache` of the keys and values of the tokens before: then `tgt` holds only the new
# tokens, which sit at positions `cache.length`, `cache.length + 1`, ..., and the positional
# encoding is taken from there (notebook 04's `offset`). In this notebook `cache` is always
# `None` and the offset 0: the lines of `decode` that handle a cache (the offset, and the check
# that several new tokens after cached ones come with a causal `self_mask`) are notebook 12's
# subject, where the cache is built, and can be skipped until then.

# %%
#| export
@add_to_class(Transformer)
def decode(
    self,
    tgt: torch.Tensor,  # (B, T_tgt) target ids, starting with BOS
    enc_out: torch.Tensor,  # (B, T_src, d_model) from encode
    self_mask: torch.Tensor | None = None,  # broadcastable to (B, h, T_tgt, T_kept + T_tgt)
    cross_mask: torch.Tensor | None = None,  # broadcastable to (B, h, T_tgt, T_src)
    cache: DecoderCache | None = None,  # keys and values of the T_kept tokens decoded before
) -> torch.Tensor:
    """Target ids (B, T_tgt) and enc_out (B, T_src, d_model) -> dec_out (B, T_tgt, d_model)."""
    offset = 0 if cache is None else cache.length  # where the tokens of tgt sit
    if checking():
        _check_tokens("tgt", tgt, self.tgt_embed.num_embeddings, self.max_len, offset)
        check_tensor("enc_out", enc_out, dim=3, kind="float")
        if enc_out.shape[0] != tgt.shape[0]:
            shapes = f"tgt {tuple(tgt.shape)} and enc_out {tuple(enc_out.shape)}"
            raise ValueError(f"{shapes} have different batch sizes")
        (B, T_tgt), h, T_src = tgt.shape, self.num_heads, enc_out.shape[1]
        if offset > 0 and T_tgt > 1 and self_mask is None:
            raise ValueError("several new tokens after cached ones need a (causal) self_mask")
        check_mask("self_mask", self_mask, (B, h, T_tgt, offset + T_tgt), "(B, h, T, T_k)")
        check_mask("cross_mask", cross_mask, (B, h, T_tgt, T_src), "(B, h, T, T_src)")
    with validated():  # the layers below need not check again
        x = embed_tokens(self.tgt_embed, tgt, "tgt")  # (B, T_tgt) -> (B, T_tgt, d_model), * sqrt(d)
        x = self.pos(x, offset=offset)  # + PE at positions offset .. offset + T_tgt - 1
        return self.decoder(x, enc_out, self_mask=self_mask, cross_mask=cross_mask, cache=cache)


# %% [markdown]
# `forward` is teacher forcing: the whole target at once, logits for every position. Which mask
# goes where (`True` = may attend, as everywhere in the course):
#
# | argument | used as | shape | why |
# |---|---|---|---|
# | `src_mask` | the encoder's self-attention mask **and** the decoder's `cross_mask` | $(B, 1, 1, T_\text{src})$, from `padding_mask` | both attend over the same source positions; serving queries of two lengths, it can mask source keys only |
# | `tgt_mask` | the decoder's `self_mask` | $(1, 1, T, T)$ causal, or $(B, 1, T, T)$ causal and padding | must be causal: `forward` checks it |
#
# Like `nn.Transformer`, the model applies no mask it is not given: `tgt_mask=None` means "no
# mask", so a **forgotten** causal mask lets the decoder read the answer, and nothing tells it
# from a mask left out on purpose. The way not to forget it is `make_masks`, after the next cell,
# which builds both masks from the token ids. A **wrong** `tgt_mask` `forward` does catch: a
# `ValueError` for a bool mask with `True` above the diagonal (a query that may attend to a later
# key) or a float mask with anything but $-\infty$ there, and a `TypeError` for an integer mask.
# The section *Clear errors* shows each of these, and why a float mask must hold $-\infty$
# rather than a large finite value. `decode` checks its ids, `enc_out` and its masks' shapes and
# dtypes, but not that `self_mask` is causal: with a cache (notebook 12) it covers only a part
# of the sequence.

# %%
#| export
def _check_causal(name: str, mask: torch.Tensor | None, T: int) -> None:
    """Raise unless mask (bool: True = may attend; float: -inf = blocked) hides later keys.
    The caller has passed it through check_mask first, so it is None, bool or floating."""
    if mask is None:
        return
    later = torch.ones(T, T, dtype=torch.bool, device=mask.device).triu(1)  # (T, T): key after query
    may_attend = mask if mask.dtype == torch.bool else ~mask.isneginf()  # float: all but -inf
    if (may_attend & later).any():
        if mask.dtype == torch.bool:
            wrong = (
                f"{name} lets a target position attend to later positions, the tokens it must "
                "predict"
            )
        else:  # a finite value may or may not block: that depends on the dtype and on the scores
            wrong = (
                f"{name} holds values other than -inf above the diagonal, where a float mask "
                "must hold -inf, the one value that blocks a later key in every dtype and at any "
                "size of the scores"
            )
        fix = "combine causal_mask(T_tgt) with the padding, or build it with make_masks"
        raise ValueError(f"{wrong}: {fix}")


@add_to_class(Transformer)
def forward(
    self,
    src: torch.Tensor,  # (B, T_src) source ids
    tgt: torch.Tensor,  # (B, T_tgt) target ids [BOS, y_1, ...] (teacher forcing)
    src_mask: torch.Tensor | None = None,  # (B, 1, 1, T_src) source padding, True = real token
    tgt_mask: torch.Tensor | None = None,  # causal (1, 1, T, T); with padding (B, 1, T, T)
) -> torch.Tensor:
    """Logits (B, T_tgt, tgt_vocab_size) for every target position; no softmax.

    Like nn.Transformer, no mask is applied that is not given: tgt_mask=None means no mask at
    all, so the decoder reads later target tokens. Build both masks with make_masks(src, tgt).
    """
    if checking():
        _check_tokens("src", src, self.src_embed.num_embeddings, self.max_len)
        _check_tokens("tgt", tgt, self.tgt_embed.num_embeddings, self.max_len)
        if src.shape[0] != tgt.shape[0]:
            shapes = f"src {tuple(src.shape)} and tgt {tuple(tgt.shape)}"
            raise ValueError(f"{shapes} have different batch sizes")
        (B, T_src), h, T_tgt = src.shape, self.num_heads, tgt.shape[1]
        check_mask(
            "src_mask", src_mask, (B, h, 1, T_src), "(B, h, 1, T_src)",
            hint="it masks source keys for the encoder's and the decoder's queries alike: "
            "build it with padding_mask",
        )  # fmt: skip
        check_mask("tgt_mask", tgt_mask, (B, h, T_tgt, T_tgt), "(B, h, T_tgt, T_tgt)")
        _check_causal("tgt_mask", tgt_mask, T_tgt)
    with validated():  # checked once, here: encode and decode skip their checks
        enc_out = self.encode(src, src_mask=src_mask)  # (B, T_src, d_model)
        # src_mask again, as cross_mask: the decoder attends over the same source positions.
        dec_out = self.decode(tgt, enc_out, tgt_mask, src_mask)  # (B, T_tgt, d_model)
    return self.out_proj(dec_out)  # (B, T_tgt, d_model) -> (B, T_tgt, tgt_vocab_size)


# %% [markdown]
# Both masks follow from the ids: the source's real tokens are its keys, for the encoder and the
# cross-attention alike; the target's are the real tokens among the earlier ones. `make_masks`
# writes that down, with `PAD` (notebook 09) as the padding id. Unlike `padding_mask(lengths, T)`,
# it finds the padding wherever it is, not only at the end.

# %%
#| export
def make_masks(
    src: torch.Tensor,  # (B, T_src) source ids
    tgt_in: torch.Tensor,  # (B, T_tgt) target ids fed to the decoder
    pad: int = PAD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_mask (B, 1, 1, T_src), tgt_mask (B, 1, T_tgt, T_tgt)), True = may attend."""
    check_tensor("src", src, dim=2, kind="int")
    check_tensor("tgt_in", tgt_in, dim=2, kind="int")
    check_int("pad", pad)
    if src.shape[0] != tgt_in.shape[0]:
        shapes = f"src {tuple(src.shape)} and tgt_in {tuple(tgt_in.shape)}"
        raise ValueError(f"{shapes} have different batch sizes")
    src_mask = (src != pad)[:, None, None, :]  # (B, 1, 1, T_src): the real source keys
    tgt_real = (tgt_in != pad)[:, None, None, :]  # (B, 1, 1, T_tgt): the real target keys
    tgt_mask = causal_mask(tgt_in.shape[1], device=tgt_in.device) & tgt_real  # (B, 1, T_tgt, T_tgt)
    return src_mask, tgt_mask


# %% [markdown]
# ### The config, checked
#
# What *The model* says about the config, shown on a model whose settings are none of the
# defaults: post-norm blocks with GELU, $d_\text{model} = 64$, three layers. `model.config`
# holds every setting, the untouched defaults filled in:

# %%
set_seed(0)
short = Transformer(12, 12, d_model=64, d_ff=256, num_layers=3, activation="gelu", norm_first=False).to(device)
print(short.config)
assert short.config == TransformerConfig(12, 12, 64, 4, 256, 3, 0.1, 512, "gelu", True, False, False)


# %% [markdown]
# **Check:** `Transformer(short.config)` and `Transformer.from_config(short.config)`, after the
# same seed, rebuild `short`: the same config, the same `state_dict` (names, shapes, values) and,
# in evaluation mode, the same logits on a small batch. The logits are compared too because two
# of the settings, the activation and the arrangement of the norms, leave no trace in the
# parameters: the same weights loaded into a model with the default block settings (ReLU,
# pre-norm) give other logits, so a setting lost on the way would show.

# %%
def same_tensors(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the same state_dict: the same names, shapes and values."""
    state_a, state_b = a.state_dict(), b.state_dict()
    return state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


rebuilt = {}
for route, build in (("Transformer(short.config)", lambda: Transformer(short.config)),
                     ("Transformer.from_config(short.config)", lambda: Transformer.from_config(short.config))):
    set_seed(0)  # the seed `short` was built after
    rebuilt[route] = build().to(device)
default_blocks = Transformer(12, 12, d_model=64, d_ff=256, num_layers=3).to(device)  # ReLU, pre-norm
default_blocks.load_state_dict(short.state_dict())  # the same names and shapes: the weights fit
src_cfg = torch.tensor([[5, 9, 3, 11, 7], [8, 3, 6, 4, 10]]).to(device)  # (B, T_src)
tgt_cfg = torch.cat([torch.full((2, 1), BOS), src_cfg.cpu().flip(1)], dim=1).to(device)  # (B, T_tgt)
with torch.no_grad():
    logits_cfg = {name: m.eval()(src_cfg, tgt_cfg, *make_masks(src_cfg, tgt_cfg))  # (B, T_tgt, V)
                  for name, m in [("short", short), *rebuilt.items(), ("default blocks", default_blocks)]}
for route, m in rebuilt.items():
    assert m.config == short.config and same_tensors(m, short), route
    assert torch.equal(logits_cfg[route], logits_cfg["short"]), route
    print(f"{route:>37}: the same config, state_dict and logits as short")
gap_defaults = (logits_cfg["default blocks"] - logits_cfg["short"]).abs().max().item()
print(f"{'the same weights, ReLU and pre-norm':>37}: logits differ by up to {gap_defaults:.1f}")
assert gap_defaults > 0.1

# %% [markdown]
# **Check:** a bad setting is refused before a single layer is made. A hook of PyTorch's
# (`register_module_parameter_registration_hook`) records every parameter any module creates;
# the refused calls create none, while one good model, built under the same hook, creates all of
# its own. The last two are the refusals of the constructor itself: a config passed together
# with fields, and `from_config` given anything but a `TransformerConfig` (here the config as a
# dict).

# %%
bad_builds = {
    "d_model=130, num_heads=4": lambda: Transformer(12, 12, d_model=130, num_heads=4),
    "activation='tanh'": lambda: Transformer(12, 12, activation="tanh"),
    "src_vocab_size=3": lambda: Transformer(3, 12),
    "dropout_p=1.5": lambda: Transformer(12, 12, dropout_p=1.5),
    "a misspelt field": lambda: Transformer(12, 12, d_modle=64),
    "a config and a field": lambda: Transformer(short.config, d_model=128),
    "from_config of a dict": lambda: Transformer.from_config(dataclasses.asdict(short.config)),
}
created = []  # the name of every parameter a module registers while the hook is on
hook = register_module_parameter_registration_hook(lambda module, name, param: created.append(name))
try:
    for what, build in bad_builds.items():
        try:
            build()
        except (ValueError, TypeError) as err:
            print(f"{what:>24} -> {type(err).__name__}: {err}")
        else:
            raise AssertionError(f"{what}: accepted")
    created_by_refused = len(created)
    good_model = Transformer(12, 12)  # for comparison: a good config
finally:
    hook.remove()
print(f"parameters created: {created_by_refused} by the refused calls,"
      f" {len(created) - created_by_refused} by Transformer(12, 12)")
assert created_by_refused == 0
assert len(created) - created_by_refused == len(list(good_model.parameters()))  # the hook sees every one

# %% [markdown]
# **One `TransformerConfig` describes the architecture: the constructor checks it before it
# builds anything, and `Transformer(model.config)` builds the same model again.**
#
# ## 930,828 parameters
#
# The configuration of the blog tutorial "Deep Learning: Transformers", the course's main source
# (README, *Where it comes from*; "the tutorial" below): vocabularies of 12 on both sides (the
# reversal task of notebook 11), $d_\text{model} = 128$, $h = 4$, $d_{ff} = 512$, $N = 2$,
# `max_len` 512; the defaults of `Transformer`. The tutorial prints 930,828 parameters for it.

# %%
set_seed(0)
VOCAB = 12
model = Transformer(VOCAB, VOCAB).to(device)
d_model = model.d_model  # 128, the width used in the shapes below
print(f"{num_params(model):,} parameters")

# %% [markdown]
# Where they are. With $d = 128$, $d_{ff} = 512$, $N = 2$, $V = 12$, an attention layer holds
# $4d^2 + 4d$ (four $d \times d$ matrices and their biases), a feed-forward network
# $2\,d\,d_{ff} + d_{ff} + d$, a `LayerNorm` $2d$, the output layer $dV + V$; the positional
# encoding is a *buffer*: saved with the model and moved by `.to()`, but not a parameter, so the
# optimiser never sees it. **Check:** each part counted from the module equals its formula, the
# parts cover every parameter exactly once, and the total is 930,828.

# %%
c = model.config  # the sizes the model was built with, a TransformerConfig
d, d_ff, N, V = c.d_model, c.d_ff, c.num_layers, c.tgt_vocab_size
attn, ffn, norm = 4 * d**2 + 4 * d, 2 * d * d_ff + d_ff + d, 2 * d
enc_blocks, dec_blocks = model.encoder.layers, model.decoder.layers
parts = [  # (part, its modules, formula as text, formula's value)
    ("src_embed", [model.src_embed], "V·d", V * d),
    ("tgt_embed", [model.tgt_embed], "V·d", V * d),
    ("pos (a buffer)", [model.pos], "0", 0),
    ("encoder self-attention", [b.self_attn for b in enc_blocks], "N(4d² + 4d)", N * attn),
    ("encoder FFN", [b.ffn for b in enc_blocks], "N(2·d·d_ff + d_ff + d)", N * ffn),
    ("encoder block norms", [n for b in enc_blocks for n in (b.norm1, b.norm2)], "N·2·2d", N * 2 * norm),
    ("encoder final norm", [model.encoder.norm], "2d", norm),
    ("decoder self-attention", [b.self_attn for b in dec_blocks], "N(4d² + 4d)", N * attn),
    ("decoder cross-attention", [b.cross_attn for b in dec_blocks], "N(4d² + 4d)", N * attn),
    ("decoder FFN", [b.ffn for b in dec_blocks], "N(2·d·d_ff + d_ff + d)", N * ffn),
    ("decoder block norms", [n for b in dec_blocks for n in (b.norm1, b.norm2, b.norm3)], "N·3·2d", N * 3 * norm),
    ("decoder final norm", [model.decoder.norm], "2d", norm),
    ("out_proj", [model.out_proj], "d·V + V", d * V + V),
]
counted = {name: sum(num_params(m) for m in modules) for name, modules, _, _ in parts}
print(f"{'part':<26}{'formula':<25}{'parameters':>11}{'share':>8}")
for name, _, formula, value in parts:
    assert counted[name] == value, (name, counted[name], value)
    print(f"{name:<26}{formula:<25}{counted[name]:>11,}{counted[name] / num_params(model):>8.1%}")
print(f"{'total':<51}{sum(counted.values()):>11,}")

# %%
seen = [id(p) for _, modules, _, _ in parts for m in modules for p in m.parameters()]
assert len(seen) == len(set(seen)) and set(seen) == {id(p) for p in model.parameters()}  # each once
assert sum(counted.values()) == num_params(model) == 930_828
shares = {kind: sum(v for k, v in counted.items() if kind in k) / 930_828 for kind in ("attention", "FFN")}
assert round(shares["attention"], 2) == 0.43 and round(shares["FFN"], 2) == 0.57
print(f"attention {shares['attention']:.1%}, FFN {shares['FFN']:.1%}, the rest {1 - sum(shares.values()):.1%}")
assert model.pos.pe.shape == (1, 512, d_model) and "pos.pe" in model.state_dict()  # saved, not trained
assert not any(p is model.pos.pe for p in model.parameters())
print(f"the positional table holds {model.pos.pe.numel():,} numbers, saved in the state_dict but not trained")

# %% [markdown]
# The same numbers as a picture, on a log axis so that the small parts show at all (their shares
# are in the table above). The embeddings and the output layer, the only parts that depend
# on the vocabulary, hold 0.5 % of the model here. With a real vocabulary they take over: at this
# width, three matrices for the paper's 37,000 tokens would hold 14.2 M parameters against the
# stacks' 0.93 M, and even at the paper's base width they are 56 % of the untied model
# (exercise 1).

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(10.5, 4.6), layout="constrained")
names = [name for name, *_ in parts][::-1]
values = [counted[n] for n in names]
# the part colours of notebook 06 (PART_COLORS), as in every figure of a model's parts
part_color = {"self-attention": PART_COLORS["attention"], "cross-attention": PART_COLORS["cross_attention"],
              "FFN": PART_COLORS["ffn"], "norm": PART_COLORS["layer_norm"], "embed": PART_COLORS["embedding"],
              "out_proj": PART_COLORS["head"]}
colors = [next((c for k, c in part_color.items() if k in n), PART_COLORS["positional"]) for n in names]  # pos: 0
ax.barh(names, values, color=colors, edgecolor="#888888", lw=0.5)  # an edge: the light grey shows
ax.set_xscale("log")  # a linear axis would hide the 256 to 1,548 of the small parts next to 263,424
for i, v in enumerate(values):
    ax.text(v * 1.1 if v else 110, i, f"{v:,}" if v else "0", va="center", fontsize=8)
ax.set(xlabel="parameters (log scale)", xlim=(100, 1_000_000),
       title=f"The {num_params(model):,} parameters of Transformer(12, 12) "
             "($d$=128, $h$=4, $d_{ff}$=512, $N$=2)")
ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{int(v):,}"))
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#888888") for c in part_color.values()],
          labels=["self-attention", "cross-attention", "feed-forward", "LayerNorm", "embeddings", "output head"],
          loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
save_figure(fig, "model_parameters")
plt.show()

# %% [markdown]
# **930,828 = 3,072 (embeddings) + 396,800 (encoder) + 529,408 (decoder) + 1,548 (output
# layer); the feed-forward networks hold 57 % of it, the attention layers 43 %, the rest under 1 %.**
#
# ## A forward pass, and what each output can see
#
# A batch of the reversal task with padding on both sides, its masks (notebook 05) and the
# logits:

# %%
src = torch.tensor([[5, 9, 3, 11, 7, PAD, PAD],
                    [8, 3, 6, 11, 9, 5, 10]])  # (B, T_src): lengths 5 and 7
tgt_in = torch.tensor([[BOS, 7, 11, 3, 9, 5, PAD, PAD],
                       [BOS, 10, 5, 9, 11, 6, 3, 8]])  # (B, T_tgt): [BOS, reversed source]
tgt_out = torch.tensor([[7, 11, 3, 9, 5, EOS, PAD, PAD],
                        [10, 5, 9, 11, 6, 3, 8, EOS]])  # (B, T_tgt): [reversed source, EOS]
src_lengths, tgt_lengths = (src != PAD).sum(dim=1), (tgt_in != PAD).sum(dim=1)
src, tgt_in, tgt_out = src.to(device), tgt_in.to(device), tgt_out.to(device)
B, T_src = src.shape
T_tgt = tgt_in.shape[1]

src_mask, tgt_mask = make_masks(src, tgt_in)  # (B, 1, 1, T_src), (B, 1, T_tgt, T_tgt)

model.eval()  # dropout off: the same logits on every call
logits = model(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # (B, T_tgt, V)
loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)
print(f"logits {tuple(logits.shape)}, loss of the untrained model {loss.item():.3f} (log 12 = {math.log(12):.3f})")

# %% [markdown]
# **Check:** `make_masks` gives notebook 05's masks built from the lengths; `forward` is exactly
# `encode`, then `decode`, then `out_proj`; in evaluation mode two calls agree bit for bit, and
# in training mode dropout makes them differ.

# %%
assert torch.equal(src_mask, padding_mask(src_lengths, T_src).to(device))
assert torch.equal(tgt_mask, causal_mask(T_tgt, device=device) & padding_mask(tgt_lengths, T_tgt).to(device))
with torch.no_grad():
    enc_out = model.encode(src, src_mask)  # (B, T_src, d_model)
    dec_out = model.decode(tgt_in, enc_out, self_mask=tgt_mask, cross_mask=src_mask)  # (B, T_tgt, d)
    assert torch.equal(model.out_proj(dec_out), logits)
    assert torch.equal(model(src, tgt_in, src_mask, tgt_mask), logits)
    model.train()
    assert not torch.equal(model(src, tgt_in, src_mask, tgt_mask), model(src, tgt_in, src_mask, tgt_mask))
    model.eval()
assert enc_out.shape == (B, T_src, d_model) and dec_out.shape == (B, T_tgt, d_model)

# %% [markdown]
# How close to a uniform guess is the untrained model? The loss of the 14 real targets is one
# sample, which moves by a few tenths with the seed. Averaged over all 12 possible targets
# instead, the loss is $-\tfrac{1}{V}\sum_v \log p_v$, never below $\log V$ and equal to it for
# a uniform guess. Notebook 09's exercise 2 estimated the excess for small logits of variance
# $s^2$ (across the vocabulary) as $s^2/2$; the print shows the two side by side (an expansion
# that holds for any small logits, so it tests nothing of the model and is not asserted).
# **Check:** the averaged loss is less than 0.3 above $\log 12$.

# %%
real = tgt_out != PAD  # (B, T_tgt)
z_real = logits[real].detach()  # (n_real, V)
averaged = -torch.log_softmax(z_real, dim=-1).mean().item()  # the loss averaged over all V targets
half_var = z_real.var(dim=-1, unbiased=False).mean().item() / 2
print(f"averaged over the targets: {averaged:.3f} = log 12 + {averaged - math.log(VOCAB):.3f};"
      f" s^2/2 = {half_var:.3f}; this batch's 14 targets: {loss.item():.3f}")
assert averaged - math.log(VOCAB) < 0.3  # close to a uniform guess

# %% [markdown]
# What keeps it there is the decoder's final norm, which hands `out_proj` vectors of unit scale.
# **Check:** a copy of the model with that norm replaced by the identity starts more than 1.5
# times as far above $\log 12$ (the ratio ranged from 2.5 to 5.2 over models built after
# `set_seed(0)` to `set_seed(39)`).

# %%
no_final_norm = copy.deepcopy(model)
no_final_norm.decoder.norm = nn.Identity()  # the stream of the last block goes to out_proj as it is
with torch.no_grad():
    z_no_norm = no_final_norm(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)[real]  # (n_real, V)
averaged_no_norm = -torch.log_softmax(z_no_norm, dim=-1).mean().item()
print(f"without the decoder's final norm: log 12 + {averaged_no_norm - math.log(VOCAB):.3f}")
assert averaged_no_norm - math.log(VOCAB) > 1.5 * (averaged - math.log(VOCAB))  # the norm keeps it small


# %% [markdown]
# Which inputs can each output see? Autograd answers, as in notebook 08, now through the whole
# model: take $x_s$, the embedded and position-encoded input at position $s$, and the norm of
# the Jacobian block $\partial\, \text{logits}_t / \partial x_s$. A nonzero norm proves that
# input $s$ influences output $t$. A zero on its own is local (the derivative could vanish at
# this one input by accident), but where a mask removes every path from $x_s$ to
# $\text{logits}_t$, the block is exactly zero for every input, and that is what the masks should
# guarantee.
#
# The inputs $x_s$ are made inside `forward` and not returned, so the caller has no handle on
# them. `torch.autograd.grad` can differentiate with respect to any tensor of the graph, leaf or
# not, but it must be given that tensor. A forward hook, a function that a module calls with its
# inputs and output every time it runs, hands it over: the hook on the positional encoding keeps
# its two outputs (source, then target, because `forward` encodes first):

# %%
def embedded_inputs_and_logits(model: Transformer, src, tgt, src_mask, tgt_mask):
    """Run the model on batch row 0; return what `pos` produced for it, (x_src, x_tgt), and the logits."""
    kept = []
    hook = model.pos.register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        row0 = [m if m is None else m[:1] for m in (src_mask, tgt_mask)]  # masks of shape (1 or B, ...)
        logits = model(src[:1], tgt[:1], *row0)  # (1, T_tgt, V)
    finally:
        hook.remove()
    x_src, x_tgt = kept  # encode runs first: (1, T_src, d), then (1, T_tgt, d)
    return x_src, x_tgt, logits


# %% [markdown]
# Then one backward pass per output logit, $(t, v)$, accumulating over $v$ and over the
# $d_\text{model}$ coordinates of $x_s$ the squared entries of the Jacobian:

# %%
def dependency_maps(model: Transformer, src, tgt, src_mask, tgt_mask) -> dict:
    """||d logits_t / d x_s|| for batch row 0: (T_tgt, T_src) to the source, (T_tgt, T_tgt) to the target."""
    x_src, x_tgt, logits = embedded_inputs_and_logits(model, src, tgt, src_mask, tgt_mask)
    T, V = logits.shape[1:]
    to_src, to_tgt = torch.zeros(T, x_src.shape[1]), torch.zeros(T, x_tgt.shape[1])
    for t in range(T):
        for v in range(V):  # one row of the Jacobian per (t, v)
            g_src, g_tgt = torch.autograd.grad(logits[0, t, v], (x_src, x_tgt), retain_graph=True)
            to_src[t] += g_src[0].pow(2).sum(dim=-1).cpu()  # (T_src,): sum over d of (d logit / d x_s)^2
            to_tgt[t] += g_tgt[0].pow(2).sum(dim=-1).cpu()  # (T_tgt,)
    return {"source": to_src.sqrt(), "target": to_tgt.sqrt()}


# %% [markdown]
# The first sequence of the batch (source length 5, target length 6), twice: with the correct
# masks, and with the causal part of `tgt_mask` forgotten, that is with the target's padding
# mask alone. `forward` refuses that mask (the section *Clear errors*), so the second run turns
# the checks off with `validated()`, the context in which the model's parts skip theirs.

# %%
tgt_padding_only = padding_mask(tgt_lengths, T_tgt).to(device)  # (B, 1, 1, T_tgt): no causal part
maps = dependency_maps(model, src, tgt_in, src_mask, tgt_mask)
with validated():  # forward refuses a non-causal tgt_mask; with the checks off it runs, to show why
    maps_no_causal = dependency_maps(model, src, tgt_in, src_mask, tgt_padding_only)

# %% [markdown]
# **Check:** with the masks, $\text{logits}_t$ depends on the target inputs $0..t$ only (lower
# triangular) and on every real source position but on no padded one, for the real target
# positions $t < 6$. Without the causal part it depends on every real target input, after $t$
# too, among them $x_{t+1}$ = the token it is supposed to predict; the padded target inputs
# stay hidden from the real positions in both cases. The padded positions 6 and 7 see their own
# input but not each other's (explained below the picture).

# %%
n_src, n_tgt = int(src_lengths[0]), int(tgt_lengths[0])  # 5 and 6 real positions
m_src, m_tgt = maps["source"][:n_tgt], maps["target"][:n_tgt]  # the real target positions
lower = torch.ones(n_tgt, T_tgt, dtype=torch.bool).tril()  # (n_tgt, T_tgt): s <= t
assert (m_tgt[~lower] == 0).all() and (m_tgt[lower] > 0).all()
assert (m_src[:, n_src:] == 0).all() and (m_src[:, :n_src] > 0).all()
m_open = maps_no_causal["target"][:n_tgt]  # (n_tgt, T_tgt)
assert (m_open[:, :n_tgt] > 0).all() and (m_open[:, n_tgt:] == 0).all()  # every real input, no padding
leak = m_open[torch.arange(n_tgt - 1), torch.arange(1, n_tgt)]  # d logits_t / d x_{t+1}
for m in (maps["target"], maps_no_causal["target"]):  # the padded queries 6 and 7
    assert m[6, 6] > 0 and m[7, 7] > 0  # their own input, through the residual stream
    assert m[7, 6] == 0 and m[6, 7] == 0  # the other padded input: only attention could carry it
print("with the masks: causal in the target, blind to source padding;"
      f" without the causal part, logits_t sees x_(t+1): norms {[round(v, 2) for v in leak.tolist()]}")

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
panels = [(maps["source"], "to the source, with src_mask", "source position $s$ (5 real + 2 PAD)"),
          (maps["target"], "to the target, with tgt_mask\n(causal & target padding)", "target input position $s$ (tgt_in)"),
          (maps_no_causal["target"], "to the target, causal part forgotten\n(target padding only)",
           "target input position $s$ (tgt_in)")]
# a log scale: the bright diagonal (1.1 to 1.9) would otherwise flatten the rest (mostly 0.2 to 0.7)
largest = max(m.max().item() for m, *_ in panels)
# the top of the colour scale rounded up to a multiple of 0.5, so that a tick labels it (the brightest cells lie below)
shared_norm = LogNorm(vmin=min(m[m > 0].min().item() for m, *_ in panels), vmax=math.ceil(2 * largest) / 2)
for ax, (m, title, xlabel) in zip(axes, panels, strict=True):
    shown = np.ma.masked_where(m.numpy() == 0, m.numpy())  # exact zeros drawn white (log 0 has no colour)
    image = ax.imshow(shown, cmap="viridis", norm=shared_norm)
    ax.axhline(n_tgt - 0.5, color="black", lw=1, ls="--")  # below: the padded target positions
    ax.set(title=title, xlabel=xlabel, ylabel="output position $t$ (logits; 6, 7: PAD)",
           xticks=range(m.shape[1]), yticks=range(m.shape[0]))
colorbar = fig.colorbar(image, ax=axes, fraction=0.02,
                        label=r"$\|\partial\,\mathrm{logits}_t / \partial x_s\|$, log scale (white: exactly 0)")
ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0) if shared_norm.vmin <= t <= shared_norm.vmax]
colorbar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])  # up to the top of the scale
colorbar.ax.yaxis.set_minor_formatter(plt.NullFormatter())
fig.suptitle("What each output of the full model can see (sequence 0: source length 5, target length 6)")
save_figure(fig, "model_dependencies")
plt.show()

# %% [markdown]
# In the right panel the upper triangle of the real positions lights up: trained like that, the
# decoder would learn to copy $x_{t+1}$ and be useless at generation time, when $x_{t+1}$ does
# not exist yet.
#
# The rows below the dashed line, positions 6 and 7, are padded *queries*: they compute
# something, which `ignore_index=PAD` keeps out of the loss. Two things in them are worth
# reading:
#
# * **$(6, 6)$ and $(7, 7)$ are bright** although the padding mask hides keys 6 and 7 from
#   every query. Attention is not the only path: $x_t$ flows to output $t$ through the residual
#   stream and the position-wise feed-forward networks, and no mask touches that.
# * **$(7, 6)$ is white** (and so is $(6, 7)$). Input 6 could reach output 7 only through
#   attention, and key 6 is padding.
#
# **`forward` = `encode` → `decode` → `out_proj`; `src_mask` serves the encoder and the
# cross-attention, `tgt_mask` the decoder's self-attention, and the model applies no mask it is
# not given.**
#
# ## Parity with `nn.Transformer`
#
# PyTorch's `nn.Transformer` is the two stacks without embeddings, positional encoding or output
# layer: it maps embedded sequences to the decoder's output. So we feed it the same embedded and
# position-encoded inputs as our model, and put our output layer on top. Its configuration must
# match ours: `batch_first=True`, `norm_first=True` (pre-norm), ReLU (its default and our stacks'),
# the same dropout probability. In training mode no two implementations give the same outputs
# call for call: each draws its own random dropout masks, in its own order and shapes. So parity
# is checked with $p = 0$, and in evaluation mode, where dropout is off. One dropout site
# differs besides, in the architecture itself: `nn.Transformer` also drops out inside its
# feed-forward network, between the two linear layers, and the course's `ffn` does not
# (notebooks 06 and 08), so even with shared random masks the two would not agree in training.
# Its stacks end in a `LayerNorm` too (`encoder.norm`, `decoder.norm`), so the weights map one to
# one: notebook 08's `copy_block_to_torch` for each block, and the two final norms.
#
# The masks change convention (notebook 05): PyTorch's boolean masks are `True` where attention
# is **blocked**, so each of ours is negated and reshaped:
#
# | ours (`True` = may attend) | `nn.Transformer`'s (`True` = blocked) | shape |
# |---|---|---|
# | `src_mask`, $(B, 1, 1, S)$ | `src_key_padding_mask`, and `memory_key_padding_mask` for the cross-attention | $(B, S)$ |
# | `tgt_mask` shared by all sequences, $(1, 1, T, T)$ | `tgt_mask` | $(T, T)$ |
# | `tgt_mask` with a row per sequence (causal and padding), $(B, 1, T, T)$ | `tgt_mask`, one per sequence *and head* | $(B h, T, T)$ |
#
# Building `nn.Transformer` with `norm_first=True` warns that the nested-tensor fast path is off
# (it only serves post-norm stacks); the warning is expected and filtered.
#
# Three pieces go into the package's `reference` module, where notebooks 03 and 08 put theirs,
# and where the tests and the benchmarks find them: `torch_transformer_like` builds the
# `nn.Transformer`, `torch_transformer_masks` translates the masks, and `TorchTransformer` wraps
# the two with copies of our embeddings and head, so that it is called exactly like our model.

# %%
#| export reference
import copy
import warnings


def torch_transformer_like(model: Transformer) -> nn.Transformer:
    """An nn.Transformer with our sizes, arrangement and dropout, holding our stacks' weights."""
    c = model.config  # nn.Transformer itself refuses other activations than "relu" and "gelu"
    # (a RuntimeError); copy_block_to_torch checks that the other settings match
    with warnings.catch_warnings():  # the nested-tensor fast path serves post-norm stacks only
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        theirs = nn.Transformer(
            d_model=c.d_model, nhead=c.num_heads, num_encoder_layers=c.num_layers,
            num_decoder_layers=c.num_layers, dim_feedforward=c.d_ff, dropout=c.dropout_p,
            activation=c.activation, batch_first=True, norm_first=c.norm_first, bias=c.bias,
        )  # fmt: skip
    weight = next(model.parameters())
    theirs = theirs.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for ours_stack, their_stack in zip(
            (model.encoder, model.decoder), (theirs.encoder, theirs.decoder), strict=True
        ):
            for ours_block, their_block in zip(ours_stack.layers, their_stack.layers, strict=True):
                copy_block_to_torch(ours_block, their_block)
            copy_norm_to_torch(ours_stack.norm, their_stack.norm, "final norm")
    return theirs


def torch_transformer_masks(src_mask, tgt_mask, num_heads: int) -> dict:
    """Our src_mask (B,1,1,S), tgt_mask ((1,1,T,T) or (B,1,T,T)) as nn.Transformer's arguments."""
    masks = {}  # PyTorch's boolean masks are True where attention is blocked
    if src_mask is not None:
        key_padding = ~src_mask[:, 0, 0]  # (B, 1, 1, S) -> (B, S)
        masks.update(src_key_padding_mask=key_padding, memory_key_padding_mask=key_padding)
    if tgt_mask is not None:
        blocked = ~tgt_mask[:, 0]  # (1 or B, T, T)
        # one (T, T) mask for all, or one per sequence and head: (B, T, T) -> (B * h, T, T)
        masks["tgt_mask"] = blocked[0] if blocked.shape[0] == 1 else blocked.repeat_interleave(num_heads, 0)
    return masks


class TorchTransformer(nn.Module):
    """Our model with nn.Transformer in place of its stacks: copies of our embeddings, positional
    encoding and head around PyTorch's encoder and decoder, holding our weights."""

    def __init__(self, ours: Transformer):
        super().__init__()
        self.src_embed, self.tgt_embed = copy.deepcopy(ours.src_embed), copy.deepcopy(ours.tgt_embed)
        self.pos, self.out_proj = copy.deepcopy(ours.pos), copy.deepcopy(ours.out_proj)
        self.transformer = torch_transformer_like(ours)
        self.num_heads = ours.num_heads

    def forward(self, src, tgt, src_mask=None, tgt_mask=None) -> torch.Tensor:
        """The call of Transformer.forward (our masks, True = may attend): logits (B, T, V)."""
        x_src = self.pos(embed_tokens(self.src_embed, src, "src"))  # (B, S, d_model)
        x_tgt = self.pos(embed_tokens(self.tgt_embed, tgt, "tgt"))  # (B, T, d_model)
        masks = torch_transformer_masks(src_mask, tgt_mask, self.num_heads)
        return self.out_proj(self.transformer(x_src, x_tgt, **masks))  # (B, T, V)


# %% [markdown]
# Gradients are compared parameter by parameter, with notebook 08's `torch_parameter` for the
# stacks (the same renaming rules hold for a whole stack as for a block), and name for name for
# the embeddings and the head, which `TorchTransformer` holds as copies of ours.
#
# The set-up: a model with every bias and norm parameter redrawn at random (a fresh model's
# norm weights are all 1 and its norm and attention biases all 0, values that would hide a
# missed copy; its feed-forward and output biases are already random, and are redrawn too),
# dropout 0, the padded batch above, and a random upstream gradient
# on the logits. The comparison uses notebook 08's tolerance, `PARITY` (a relative $10^{-4}$:
# room for another machine's roundings, far below the effect of a wrong weight), with full
# float32 products on a GPU (no TF32).

# %%
torch.set_float32_matmul_precision("highest")  # no TF32 on a GPU (the default); no effect on a CPU
PARITY = dict(rtol=1e-4, atol=1e-5)
g = set_seed(0)
ours = Transformer(VOCAB, VOCAB, dropout_p=0.0).to(device)
with torch.no_grad():
    for p in ours.parameters():
        if p.dim() == 1:  # biases, gamma and beta, drawn on the CPU
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
theirs = TorchTransformer(ours)  # copies of our weights, nn.Transformer in the middle
upstream = torch.randn(B, T_tgt, VOCAB, generator=g).to(device)  # a stand-in dL/d(logits)

logits_ours = ours(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # (B, T_tgt, V)
logits_theirs = theirs(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
(logits_ours * upstream).sum().backward()
(logits_theirs * upstream).sum().backward()


def their_gradient(name: str) -> torch.Tensor:
    """The gradient in `theirs` of the parameter that holds our parameter `name`."""
    if name.startswith(("encoder", "decoder")):
        param, rows = torch_parameter(theirs.transformer, name)
        return param.grad[rows]
    return theirs.get_parameter(name).grad  # src_embed, tgt_embed, out_proj: same names


# %% [markdown]
# **Check:** the logits, the gradients of all 88 parameter tensors of the stacks and those of
# the embeddings and the output layer agree.

# %%
assert_close(logits_ours, logits_theirs, **PARITY)
gaps = {"logits": (logits_ours - logits_theirs).abs().max().item()}
stack_params = [(n, p) for n, p in ours.named_parameters() if n.startswith(("encoder", "decoder"))]
outer = [(n, p) for n, p in ours.named_parameters() if not n.startswith(("encoder", "decoder"))]
for name, p in stack_params + outer:
    assert_close(p.grad, their_gradient(name), msg=name, **PARITY)
gaps["stack gradients"] = max((p.grad - their_gradient(n)).abs().max().item() for n, p in stack_params)
gaps["embedding and head gradients"] = max((p.grad - their_gradient(n)).abs().max().item() for n, p in outer)
assert len(stack_params) == 88 and len(stack_params) + len(outer) == len(list(ours.parameters()))
print(f"{len(stack_params)} stack and {len(outer)} embedding/head parameter tensors: same logits and gradients as nn.Transformer")

# %% tags=["nbval-ignore-output"]
for kind, gap in gaps.items():
    print(f"largest |ours - nn.Transformer|, {kind}: {gap:.1e}")

# %%
assert max(gaps.values()) < 1e-4  # float32 roundings, whatever the machine

# %% [markdown]
# The differences are float32 roundings: from about $2 \times 10^{-7}$ (the logits) to
# $2 \times 10^{-6}$ (the embedding and head gradients) on the CPU that built this page. They
# depend on the machine, so CI does not compare the printed values, only the bound after them. **Check:** with the model's default dropout
# $p = 0.1$, evaluation mode switches it off (in the model and in `nn.Transformer`), and the two
# still agree. The dropout inside `nn.Transformer`'s feed-forward network, which ours lacks, is
# printed too: a difference of architecture, on top of the separate random masks that already
# keep the two apart in training mode.

# %%
set_seed(0)
noisy = Transformer(VOCAB, VOCAB, dropout_p=0.1).to(device).eval()
noisy_theirs = TorchTransformer(noisy).eval()
with torch.no_grad():
    assert_close(noisy(src, tgt_in, src_mask, tgt_mask), noisy_theirs(src, tgt_in, src_mask, tgt_mask), **PARITY)
print("evaluation mode, dropout_p=0.1: equal to nn.Transformer")
their_ffn_dropout = noisy_theirs.transformer.decoder.layers[0].dropout  # in _ff_block, between linear1 and linear2
assert isinstance(their_ffn_dropout, nn.Dropout) and their_ffn_dropout.p == 0.1
assert not any(isinstance(m, nn.Dropout) for m in noisy.decoder.layers[0].ffn.modules())
print(f"our ffn: {noisy.decoder.layers[0].ffn}; nn.Transformer's has {their_ffn_dropout} after the activation")

# %% [markdown]
# **Check:** the paper's arrangement of the blocks. `Transformer(..., norm_first=False)` builds
# post-norm blocks in both stacks (the configuration reaches every block), plus the final norms
# that `nn.Transformer` keeps in both arrangements, and it equals
# `nn.Transformer(norm_first=False)`, PyTorch's default, in logits and in every gradient.

# %%
g = set_seed(0)
post = Transformer(VOCAB, VOCAB, dropout_p=0.0, norm_first=False).to(device)
assert not any(block.norm_first for block in [*post.encoder.layers, *post.decoder.layers])
with torch.no_grad():
    for p in post.parameters():
        if p.dim() == 1:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
post_theirs = TorchTransformer(post)
assert not post_theirs.transformer.encoder.layers[0].norm_first
logits_post = post(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
logits_post_theirs = post_theirs(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
assert_close(logits_post, logits_post_theirs, **PARITY)
(logits_post * upstream).sum().backward()
(logits_post_theirs * upstream).sum().backward()
for name, p in post.named_parameters():
    if name.startswith(("encoder", "decoder")):
        param, rows = torch_parameter(post_theirs.transformer, name)
        assert_close(p.grad, param.grad[rows], msg=name, **PARITY)
    else:
        assert_close(p.grad, post_theirs.get_parameter(name).grad, msg=name, **PARITY)
print("post-norm (norm_first=False): the same logits and gradients as nn.Transformer(norm_first=False)")


# %% [markdown]
# What these parity checks do **not** test: `TorchTransformer` reuses our `embed_tokens` and a
# copy of our `PositionalEncoding`, so the embedding path (lookup, $\times\sqrt d$,
# $+\,\mathrm{PE}$) is compared with itself; drop the $\sqrt d$ or shift the positions in both
# and the parity still passes. Only the stacks are PyTorch's. **Check:** the embedded inputs our
# model computes (caught with a hook on `pos`) against the paper's formula, written out here
# with no course code: $\sqrt{d}\,E[w] + \mathrm{PE}$, with
# $\mathrm{PE}_{t, 2i} = \sin(t / 10000^{2i/d})$ and $\mathrm{PE}_{t, 2i+1} = \cos(t / 10000^{2i/d})$
# (Vaswani et al., 2017, §3.4 and §3.5). The same formula without the $\sqrt d$, or with the
# positions shifted by one, must not match.

# %%
def formula_inputs(ids: torch.Tensor, weight: torch.Tensor, scale: float, first: int = 0) -> torch.Tensor:
    """scale * weight[ids] + the sinusoidal table at positions first..first+T-1: (B, T) -> (B, T, d)."""
    T, d = ids.shape[1], weight.shape[1]
    t = torch.arange(first, first + T, dtype=torch.float64)[:, None]  # (T, 1) positions
    angle = t / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (T, d/2)
    pe = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)  # (T, d): sin, cos, sin, ...
    return F.embedding(ids, weight) * scale + pe.to(weight)


kept = []
hook = ours.pos.register_forward_hook(lambda module, args, out: kept.append(out))
try:
    with torch.no_grad():
        ours(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # dropout 0: pos returns the sum itself
finally:
    hook.remove()
x_src_ours, x_tgt_ours = kept  # (B, S, d), (B, T, d)
with torch.no_grad():
    sqrt_d = math.sqrt(ours.d_model)
    assert_close(x_src_ours, formula_inputs(src, ours.src_embed.weight, sqrt_d), **PARITY)
    assert_close(x_tgt_ours, formula_inputs(tgt_in, ours.tgt_embed.weight, sqrt_d), **PARITY)
    broken = {"without sqrt(d)": formula_inputs(tgt_in, ours.tgt_embed.weight, 1.0),
              "with positions shifted by one": formula_inputs(tgt_in, ours.tgt_embed.weight, sqrt_d, first=1)}
    for what, x in broken.items():
        assert not torch.allclose(x_tgt_ours, x, **PARITY)
        print(f"the formula {what}: differs from our embedded target by up to {(x_tgt_ours - x).abs().max().item():.1f}")
print("our embedded inputs = sqrt(d) E[w] + PE, the formula written out")

# %% [markdown]
# **Our `Transformer` is embeddings + `nn.Transformer` + a linear head, weight for weight: the
# same logits and the same gradients for every parameter; its embedding path matches the
# paper's formula, written out independently.**
#
# ## The architecture, drawn with code
#
# The paper's Figure 1, redrawn for this model: the pre-norm blocks (norm before each sub-layer,
# the residual stream untouched), the dropouts (pink labels), the final norms, and the
# output layer without a softmax. The boxes are placed by hand, but their labels are the
# attribute names, so every box can be found in `print(model)`; the shapes are those of a batch
# of $B$ sources of length $S$ and targets of length $T$. The positional encoding has a dashed
# edge: it is a buffer, with no parameters. The colours are notebook 06's part colours (`PART_COLORS`), as in notebooks 07 and
# 08: attention cyan (cross-attention darker, and so is `enc_out`, which it reads), feed-forward
# olive, `LayerNorm` purple, dropout pink, embeddings light grey, the output head dark grey; the
# residual connections are the red accent. A key in the figure repeats them.
#
# **Check:** every module the figure names exists in `model` under that name, with the type the
# box says; the feed-forward boxes' text is read from `ffn` itself; and the dropout the figure
# shows on the attention weights is each attention layer's `dropout_p`, the model's $p$. A
# renamed attribute fails here, before the figure is drawn. The figure writes each module name
# through `checked`, which refuses a name this check did not find (in every block, for a block's
# part), so a box relabelled by mistake fails too; the type names in the boxes and the title's
# sizes are read from the model and its `config`.

# %%
figure_modules = {  # the name in a box of the figure -> the type it must have in the model
    "src_embed": nn.Embedding, "tgt_embed": nn.Embedding, "pos": PositionalEncoding, "pos.dropout": nn.Dropout,
    "encoder.layers": nn.ModuleList, "encoder.norm": LayerNorm, "decoder.layers": nn.ModuleList,
    "decoder.norm": LayerNorm, "out_proj": nn.Linear,
}
block_parts = {  # the boxes inside each block of the figure
    "encoder": {"norm1": LayerNorm, "self_attn": MultiHeadAttention, "dropout1": nn.Dropout,
                "norm2": LayerNorm, "ffn": nn.Sequential, "dropout2": nn.Dropout},
    "decoder": {"norm1": LayerNorm, "self_attn": MultiHeadAttention, "dropout1": nn.Dropout,
                "norm2": LayerNorm, "cross_attn": MultiHeadAttention, "dropout2": nn.Dropout,
                "norm3": LayerNorm, "ffn": nn.Sequential, "dropout3": nn.Dropout},
}
for i in range(model.config.num_layers):  # every block, so the "N ×" of the figure holds too
    figure_modules |= {f"encoder.layers.{i}": EncoderBlock, f"decoder.layers.{i}": DecoderBlock}
    figure_modules |= {f"{stack}.layers.{i}.{part}": kind
                       for stack, parts in block_parts.items() for part, kind in parts.items()}
for name, kind in figure_modules.items():
    assert isinstance(model.get_submodule(name), kind), name  # get_submodule raises for a missing name
ffn_text = " → ".join(type(m).__name__ for m in model.encoder.layers[0].ffn)  # written into the ffn boxes
attention_layers = [m for n, m in model.named_modules() if n.endswith(("self_attn", "cross_attn"))]
assert len(attention_layers) == 3 * model.config.num_layers  # self_attn in each block, cross_attn in the decoder's
assert {m.dropout_p for m in attention_layers} == {model.config.dropout_p} == {0.1}
print(f"{len(figure_modules)} module names of the figure found in the model; ffn: {ffn_text}")


def checked(name: str, stack: str | None = None) -> str:
    """`name` as a box of the figure writes it, once the check above found it: in every block of `stack`."""
    full_names = [f"{stack}.layers.{i}.{name}" for i in range(model.config.num_layers)] if stack else [name]
    missing = [n for n in full_names if n not in figure_modules]
    if missing:
        raise KeyError(f"the figure names {name!r}, but the check above did not find {missing[0]!r} in the model")
    return name


def type_name(name: str) -> str:
    """The class of the module `name` of the model, as a box of the figure writes it."""
    return type(model.get_submodule(checked(name))).__name__


try:
    checked("ln1", stack="encoder")  # a box relabelled by mistake
except KeyError as err:
    print(f"KeyError: {err.args[0]}")
else:
    raise AssertionError("the figure could name a module that the model does not have")

# %% jupyter={"source_hidden": true}
PALETTE = {"embed": PART_COLORS["embedding"], "pos": PART_COLORS["positional"], "attn": PART_COLORS["attention"],
           "cross": PART_COLORS["cross_attention"], "ffn": PART_COLORS["ffn"], "norm": PART_COLORS["layer_norm"],
           "head": PART_COLORS["head"], "frame": "#f7f7f7"}


def box(ax, x, y, text, kind, w=3.0, h=0.6, fontsize=9, ls="-"):
    """A rounded box centred at (x, y); white text on dark colours."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=PALETTE[kind], edgecolor="black", lw=1, ls=ls, zorder=3))
    dark = kind in ("cross", "norm", "head")
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color="white" if dark else "black", zorder=4)


def arrow(ax, points, color="black", lw=1.3):
    """A polyline through `points` with an arrow head at the end."""
    for a, b in zip(points[:-2], points[1:-1], strict=False):
        ax.plot([a[0], b[0]], [a[1], b[1]], color=color, lw=lw, zorder=2, solid_capstyle="round")
    ax.add_patch(FancyArrowPatch(points[-2], points[-1], arrowstyle="-|>", mutation_scale=12,
                                 color=color, lw=lw, shrinkA=0, shrinkB=0, zorder=2))


def add(ax, x, y):
    ax.add_patch(Circle((x, y), 0.2, facecolor="white", edgecolor="black", lw=1.2, zorder=3))
    ax.text(x, y, "+", ha="center", va="center", fontsize=12, zorder=4)


def shape(ax, x, y, text, ha="left"):
    ax.text(x, y, text, ha=ha, va="center", fontsize=8.5, color="#444444", style="italic", zorder=4)


DROPOUT_TAG = dict(color="black", bbox=dict(boxstyle="round,pad=0.15", facecolor=PART_COLORS["dropout"], edgecolor="none"))


def dropout_tag(ax, x, y, side):
    """A small 'dropout' label beside the arrow at (x, y), on the side opposite `side`."""
    ax.text(x - side * 0.12, y, "dropout", ha="right" if side > 0 else "left", va="center", fontsize=8,
            style="italic", zorder=4, **DROPOUT_TAG)


def attention_weights_note(ax, x_box_edge, x_text, y, text, side):
    """'weights (B, h, ., .)' and a dropout tag beside an attention box, joined to it by a thin line.
    side=+1: the note is to the left of the box, -1: to its right."""
    ax.plot([x_box_edge, x_text + side * 0.05], [y, y], color="#888888", lw=0.8, ls=":", zorder=2)
    ax.text(x_text, y + 0.2, text, ha="right" if side > 0 else "left", va="center", fontsize=8.5,
            color="#444444", style="italic", zorder=4)
    dropout_tag(ax, x_text + side * 0.12, y - 0.2, side)  # on the attention weights, inside the layer


def sublayers(ax, x, y0, specs, side):
    """Pre-norm sub-layers from y0 upwards: norm -> sub-layer -> dropout -> add, the residual on `side`."""
    y = y0
    for norm_name, text, kind in specs:
        box(ax, x, y + 0.45, norm_name, "norm", w=2.2, h=0.45, fontsize=8.5)
        box(ax, x, y + 1.3, text, kind, w=3.0, h=0.8, fontsize=8.5)
        arrow(ax, [(x, y), (x, y + 0.22)])
        arrow(ax, [(x, y + 0.68), (x, y + 0.9)])
        arrow(ax, [(x, y + 1.7), (x, y + 1.95)])
        dropout_tag(ax, x, y + 1.83, side)  # dropout1/2/3: on the sub-layer's output, before the add
        add(ax, x, y + 2.15)
        rx = x + side * 1.8  # the residual stream goes around the sub-layer
        arrow(ax, [(x, y + 0.1), (rx, y + 0.1), (rx, y + 2.15), (x + side * 0.2, y + 2.15)], color=COLORS["accent"])
        y += 2.35
    return y


fig, ax = plt.subplots(figsize=(12, 14.5))
ex, dx = 3.2, 9.6  # the encoder's and the decoder's column

# Encoder column.
shape(ax, ex, 0.25, "src: token ids (B, S)", ha="center")
arrow(ax, [(ex, 0.45), (ex, 0.95)])
box(ax, ex, 1.25, f"{checked('src_embed')} × √d_model", "embed")
arrow(ax, [(ex, 1.55), (ex, 2.0)])
add(ax, ex, 2.2)
box(ax, ex - 2.3, 2.2, f"{checked('pos')}: PE", "pos", w=1.3, h=0.45, ls="--")  # a buffer: no parameters
arrow(ax, [(ex - 1.65, 2.2), (ex - 0.2, 2.2)])
shape(ax, ex + 0.3, 2.62, "(B, S, d)")
arrow(ax, [(ex, 2.4), (ex, 3.1)])
dropout_tag(ax, ex, 2.75, +1)  # pos.dropout, on embedding + PE
ax.add_patch(FancyBboxPatch((ex - 2.3, 3.0), 4.4, 4.9, boxstyle="round,pad=0.05,rounding_size=0.2",
                            facecolor=PALETTE["frame"], edgecolor="#888888", lw=1.2, zorder=1))
ax.text(ex - 2.5, 6.85, f"N × {type_name('encoder.layers.0')}\n{checked('encoder.layers')}", ha="right", va="center", fontsize=10, weight="bold")
attention_weights_note(ax, ex - 1.5, ex - 2.5, 4.4, "weights (B, h, S, S)", +1)  # self_attn's box: 4.4
top = sublayers(ax, ex, 3.1, [(checked("norm1", "encoder"),
                              f"{checked('self_attn', 'encoder')}\nmulti-head self-attention\nmask: src_mask", "attn"),
                             (checked("norm2", "encoder"), f"{checked('ffn', 'encoder')}\n{ffn_text}", "ffn")], side=+1)
arrow(ax, [(ex, top - 0.0), (ex, 8.35)])
shape(ax, ex + 0.3, 8.1, "(B, S, d)")
box(ax, ex, 8.6, f"{checked('encoder.norm')} ({type_name('encoder.norm')})", "norm", w=2.8, h=0.5)
arrow(ax, [(ex, 8.85), (ex, 9.6), (6.3, 9.6), (6.3, 6.85), (dx - 1.55, 6.85)], color=PALETTE["cross"], lw=2)
ax.text(4.8, 9.78, "enc_out (B, S, d): keys and values\nof every decoder block's cross-attention",
        ha="center", va="bottom", fontsize=9, color=PALETTE["cross"])

# Decoder column.
shape(ax, dx, 0.25, "tgt_in: token ids (B, T) = [BOS, y₁, …]", ha="center")
arrow(ax, [(dx, 0.45), (dx, 0.95)])
box(ax, dx, 1.25, f"{checked('tgt_embed')} × √d_model", "embed")
arrow(ax, [(dx, 1.55), (dx, 2.0)])
add(ax, dx, 2.2)
box(ax, dx + 2.3, 2.2, f"{checked('pos')}: PE", "pos", w=1.3, h=0.45, ls="--")
arrow(ax, [(dx + 1.65, 2.2), (dx + 0.2, 2.2)])
shape(ax, dx - 0.3, 2.62, "(B, T, d)", ha="right")
arrow(ax, [(dx, 2.4), (dx, 3.1)])
dropout_tag(ax, dx, 2.75, -1)
ax.add_patch(FancyBboxPatch((dx - 2.1, 3.0), 4.4, 7.25, boxstyle="round,pad=0.05,rounding_size=0.2",
                            facecolor=PALETTE["frame"], edgecolor="#888888", lw=1.2, zorder=1))
ax.text(dx + 2.5, 9.2, f"N × {type_name('decoder.layers.0')}\n{checked('decoder.layers')}", ha="left", va="center", fontsize=10, weight="bold")
ax.text(dx + 2.5, 8.5, f"every block's\n{checked('cross_attn', 'decoder')} reads\nthe same enc_out", ha="left", va="center", fontsize=8.5,
        color=PALETTE["cross"])
attention_weights_note(ax, dx + 1.5, dx + 2.5, 4.4, "weights (B, h, T, T)", -1)  # self_attn's box
attention_weights_note(ax, dx + 1.5, dx + 2.5, 6.75, "weights (B, h, T, S)", -1)  # cross_attn's box
top = sublayers(ax, dx, 3.1, [(checked("norm1", "decoder"),
                              f"{checked('self_attn', 'decoder')}\nmasked self-attention\nmask: tgt_mask (causal)", "attn"),
                             (checked("norm2", "decoder"),
                              f"{checked('cross_attn', 'decoder')}\nQ: decoder, K, V: enc_out\nmask: src_mask", "cross"),
                             (checked("norm3", "decoder"), f"{checked('ffn', 'decoder')}\n{ffn_text}", "ffn")], side=-1)
arrow(ax, [(dx, top), (dx, 10.75)])
shape(ax, dx - 0.3, 10.55, "(B, T, d)", ha="right")
box(ax, dx, 11.0, f"{checked('decoder.norm')} ({type_name('decoder.norm')})", "norm", w=2.8, h=0.5)
arrow(ax, [(dx, 11.25), (dx, 11.75)])
box(ax, dx, 12.05, f"{checked('out_proj')}: {type_name('out_proj')}(d, V)", "head", w=2.8, h=0.55)
arrow(ax, [(dx, 12.33), (dx, 12.85)])
shape(ax, dx, 13.05, "logits (B, T, V)", ha="center")
ax.text(dx, 13.55, "softmax: inside F.cross_entropy (training),\nskipped by argmax (decoding)",
        ha="center", va="center", fontsize=8.5, color="#666666")

sizes = ", ".join(f"{field}={getattr(model.config, field)}" for field in
                  ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "num_layers"))
ax.text(6.4, 14.3, f"{type(model).__name__}({sizes})", ha="center", fontsize=11, weight="bold")
ax.text(0.2, 10.75, "red: the residual connections;\nthe stream itself is never normalised\ninside a block (pre-norm)",
        fontsize=9, color=COLORS["accent"], va="center")
ax.text(0.2, 11.65, f"dropout (p = {model.config.dropout_p}, training only): on embedding + PE,\n"
        "on each sub-layer's output before ⊕, and on the\nattention weights inside every attention layer",
        fontsize=9, style="italic", va="center",
        bbox=dict(boxstyle="round", facecolor="#fbe6f3", edgecolor=PART_COLORS["dropout"]))
key = [Patch(facecolor=PALETTE["embed"], edgecolor="black", label="token embedding"),
       Patch(facecolor=PALETTE["pos"], edgecolor="black", ls="--", label="positional encoding\n(dashed: a buffer, no parameters)"),
       Patch(facecolor=PALETTE["attn"], edgecolor="black", label="self-attention"),
       Patch(facecolor=PALETTE["cross"], edgecolor="black", label="cross-attention, and the enc_out it reads"),
       Patch(facecolor=PALETTE["ffn"], edgecolor="black", label="feed-forward network"),
       Patch(facecolor=PALETTE["norm"], edgecolor="black", label="LayerNorm"),
       Patch(facecolor=PALETTE["head"], edgecolor="black", label="output head"),
       Patch(facecolor=PART_COLORS["dropout"], edgecolor="none", label="dropout"),
       Line2D([], [], color=COLORS["accent"], lw=1.3, label="residual connection")]
ax.legend(handles=key, loc="upper left", bbox_to_anchor=(0.15, 14.0), bbox_transform=ax.transData, fontsize=8.5,
          ncols=2, title="colours", title_fontsize=9, frameon=True)
ax.set_xlim(-0.2, 12.8)
ax.set_ylim(0, 14.6)
ax.set_aspect("equal")
ax.set_axis_off()
fig.tight_layout()
save_figure(fig, "model_architecture")
plt.show()

# %% [markdown]
# **Every box of the figure is an attribute of `Transformer`: `src_embed`/`tgt_embed`, `pos`,
# `encoder.layers[i]`, `encoder.norm`, `decoder.layers[i]`, `decoder.norm`, `out_proj`.**
#
# ## Recap: diagram box → code → shape
#
# With $B$ the batch, $S$ the source length, $T$ the target length, $d = d_\text{model}$, $h$
# heads of width $d_k = d/h$, and $V$ the target vocabulary:
#
# | diagram box | code | output shape |
# |---|---|---|
# | input embedding | `embed_tokens(model.src_embed, src)`: lookup × $\sqrt d$ | $(B, S, d)$ |
# | output embedding | `embed_tokens(model.tgt_embed, tgt)` | $(B, T, d)$ |
# | positional encoding ⊕, then dropout | `model.pos` (its `dropout`, training only) | $(B, S, d)$, $(B, T, d)$ |
# | Q, K, V projections, split into heads | `W_q`, `W_k`, `W_v`, then `split_heads` | $(B, h, \cdot, d_k)$ |
# | encoder self-attention weights (dropout on them in training) | `scaled_dot_product_attention` inside `self_attn` | $(B, h, S, S)$ |
# | multi-head attention (concat → $W_o$) | `encoder.layers[i].self_attn` | $(B, S, d)$ |
# | feed-forward | `encoder.layers[i].ffn` | $(B, S, d)$ |
# | add & norm (the paper's box; pre-norm does norm → sub-layer → dropout → add) | `x + dropout(sublayer(norm(x)))`: each block's `dropout1`, `dropout2`, ... | $(B, S, d)$ |
# | $N\times$ encoder block | `encoder.layers` (`nn.ModuleList`) | $(B, S, d)$ |
# | encoder output | `encoder.norm`, `model.encode(src, src_mask)` | $(B, S, d)$ |
# | the masks, from the ids | `make_masks(src, tgt_in)`; `forward` refuses a non-causal `tgt_mask` (but `None` means no mask) | $(B, 1, 1, S)$, $(B, 1, T, T)$ |
# | masked self-attention, its weights | `decoder.layers[i].self_attn`, `tgt_mask` | $(B, T, d)$; $(B, h, T, T)$ |
# | cross-attention, its weights | `decoder.layers[i].cross_attn`, keys/values `enc_out`, `src_mask` | $(B, T, d)$; $(B, h, T, S)$ |
# | $N\times$ decoder block | `decoder.layers` | $(B, T, d)$ |
# | decoder output | `decoder.norm`, `model.decode(tgt, enc_out, ...)` | $(B, T, d)$ |
# | linear | `model.out_proj` | $(B, T, V)$ |
# | softmax | left to `F.cross_entropy` / `argmax` | — |
#
# The cells up to *Clear errors* check this table against a running model, with PyTorch's
# forward hooks; a first reading can skip them.

# %% [markdown]
# ### Checking the recap on a running model
#
# **Check:** the rows, on the forward pass of the padded batch above ($B = 2$, $S = 7$,
# $T = 8$, $d = 128$, $h = 4$, $V = 12$). Forward hooks record the inputs and the output of each
# module as the model runs (`with_kwargs=True` also keeps the keyword arguments, such as the
# masks). How to read a record: `recorded[name]` is a list with one entry per call of that
# module, and each entry is a triple `(args, kwargs, out)`, the positional arguments as a tuple,
# the keyword arguments as a dict, and the output; `(args, kwargs, out), = recorded[name]` takes
# the one entry of a module called once. For the add & norm row they watch the first block's `norm1` and `dropout1`. An
# `nn.ModuleList` has no `forward` of its own, so for the $N\times$ rows they watch the last
# block (`layers.1`, since $N = 2$): the stack's output before its final norm is that block's
# output. Each watched module must run exactly once in the forward pass (`pos` twice: once for
# the source, once for the target), and the output recorded for `out_proj` must be the very
# tensor the model returns (`is`, not just equal values). Then the shapes of the table, and the
# wiring of the figure: what each box reads is what the box below it produced. Two rows are not
# outputs of a module, so hooks cannot see them: the split into heads (`split_heads` is a method,
# applied to the recorded queries) and the attention weights (recomputed from the recorded
# inputs), both at the end.

# %%
recorded = {}


def record(name):
    def hook(module, args, kwargs, out):
        recorded.setdefault(name, []).append((args, kwargs, out))  # returns None: out is kept as it is
    return hook


watch = {"src_embed": model.src_embed, "tgt_embed": model.tgt_embed, "pos": model.pos,
         "encoder.layers.0.self_attn": model.encoder.layers[0].self_attn,
         "encoder.layers.0.ffn": model.encoder.layers[0].ffn,
         "encoder.layers.0.norm1": model.encoder.layers[0].norm1,
         "encoder.layers.0.dropout1": model.encoder.layers[0].dropout1,
         "encoder.layers.1 (last)": model.encoder.layers[-1], "encoder.norm": model.encoder.norm,
         "decoder.layers.0.self_attn": model.decoder.layers[0].self_attn,
         "decoder.layers.0.cross_attn": model.decoder.layers[0].cross_attn,
         "decoder.layers.0.ffn": model.decoder.layers[0].ffn,
         "decoder.layers.1 (last)": model.decoder.layers[-1], "decoder.norm": model.decoder.norm,
         "out_proj": model.out_proj}
with torch.no_grad():
    handles = [m.register_forward_hook(record(n), with_kwargs=True) for n, m in watch.items()]
    try:
        logits_hooked = model(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # hooks attached
    finally:
        for handle in handles:
            handle.remove()
calls = {name: len(v) for name, v in recorded.items()}
assert calls == {name: 2 if name == "pos" else 1 for name in watch}, calls  # pos: source and target
assert recorded["out_proj"][0][2] is logits_hooked  # the same tensor: forward returns out_proj's output
print(f"recorded {sum(calls.values())} module calls, each module once (pos twice); "
      "out_proj's recorded output is the logits the model returned")

# %% [markdown]
# The output shape of every module, against the table (a check of shapes only: a stack that
# skipped its final norm would pass it, though not the count of calls above):

# %%
d, h, S, T = model.d_model, model.num_heads, T_src, T_tgt
expected = {
    "src_embed": [(B, S, d)], "tgt_embed": [(B, T, d)], "pos": [(B, S, d), (B, T, d)],
    "encoder.layers.0.self_attn": [(B, S, d)], "encoder.layers.0.ffn": [(B, S, d)],
    "encoder.layers.0.norm1": [(B, S, d)], "encoder.layers.0.dropout1": [(B, S, d)],
    "encoder.layers.1 (last)": [(B, S, d)], "encoder.norm": [(B, S, d)],
    "decoder.layers.0.self_attn": [(B, T, d)], "decoder.layers.0.cross_attn": [(B, T, d)],
    "decoder.layers.0.ffn": [(B, T, d)], "decoder.layers.1 (last)": [(B, T, d)], "decoder.norm": [(B, T, d)],
    "out_proj": [(B, T, VOCAB)],
}
for name, shapes in expected.items():
    got = [tuple(out.shape) for _, _, out in recorded[name]]
    assert got == shapes, (name, got, shapes)
    print(f"{name:<28} {', '.join(str(s) for s in got)}")

# %% [markdown]
# **Check:** the wiring, from the recorded arguments. `pos` reads each embedding times
# $\sqrt d$; `encoder.norm` reads the very tensor the last encoder block returned; both decoder
# blocks read the encoder's final output as `enc_out`, `tgt_mask` as their `self_mask` and
# `src_mask` as their `cross_mask`, as the table says (the last block in its arguments, the first
# in those of its two attention layers); `decoder.norm` reads the last decoder block's output,
# and `out_proj` the decoder's final norm's.

# %%
(enc_last_args, enc_last_kwargs, enc_last_out), = recorded["encoder.layers.1 (last)"]
(enc_norm_args, _, enc_norm_out), = recorded["encoder.norm"]
(dec_last_args, _, dec_last_out), = recorded["decoder.layers.1 (last)"]
(dec_norm_args, _, dec_norm_out), = recorded["decoder.norm"]
(out_proj_args, _, _), = recorded["out_proj"]
for (pos_args, _, _), table in zip(recorded["pos"], ("src_embed", "tgt_embed"), strict=True):
    assert_close(pos_args[0], recorded[table][0][2] * math.sqrt(d))  # embed_tokens: lookup x sqrt(d)
assert enc_last_kwargs["mask"] is src_mask and enc_norm_args[0] is enc_last_out
_, enc_out_seen, self_mask_seen, cross_mask_seen = dec_last_args  # Decoder.forward's call of a block
assert enc_out_seen is enc_norm_out and self_mask_seen is tgt_mask and cross_mask_seen is src_mask
(_, first_self_kwargs, _), = recorded["decoder.layers.0.self_attn"]  # self_attn(h, mask=self_mask)
(first_cross_args, first_cross_kwargs, _), = recorded["decoder.layers.0.cross_attn"]  # cross_attn(h, enc_out, mask=...)
assert first_self_kwargs["mask"] is tgt_mask
assert first_cross_args[1] is enc_norm_out and first_cross_kwargs["mask"] is src_mask
assert dec_norm_args[0] is dec_last_out and out_proj_args[0] is dec_norm_out
print("wiring: embeddings x sqrt(d) -> pos; last block -> final norm in both stacks; "
      "enc_out, tgt_mask, src_mask -> both decoder blocks; decoder.norm -> out_proj")


# %% [markdown]
# The attention weights are not an output of the layers in a normal call; they are recomputed
# with `return_attn=True` from the very inputs and masks the hooks saw. **Check:** their shapes,
# and that each is exactly 0 where its mask blocks (padded source keys; later and padded target
# keys) and positive everywhere else. And `split_heads` on the recorded queries of the first
# encoder layer: head $i$ holds channels $i\,d_k$ to $(i + 1)\,d_k - 1$, $d_k = d/h = 32$.

# %%
def attention_weights(name):
    (args, kwargs, _), = recorded[name]
    with torch.no_grad():
        return model.get_submodule(name)(*args, **kwargs, return_attn=True)[1]


weights = {n: attention_weights(n) for n in ("encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                                             "decoder.layers.0.cross_attn")}
assert weights["encoder.layers.0.self_attn"].shape == (B, h, S, S)
assert weights["decoder.layers.0.self_attn"].shape == (B, h, T, T)
assert weights["decoder.layers.0.cross_attn"].shape == (B, h, T, S)
blocked = {"encoder.layers.0.self_attn": ~src_mask, "decoder.layers.0.self_attn": ~tgt_mask,
           "decoder.layers.0.cross_attn": ~src_mask}  # True where the mask blocks: (B, 1, 1, S), (B, 1, T, T)
for name, w in weights.items():
    gone = blocked[name].expand_as(w)  # (B, h, T_q, T_k)
    assert (w[gone] == 0).all() and (w[~gone] > 0).all(), name
    print(f"{name:<28} attention weights {tuple(w.shape)}, {int(gone.sum()):>3} of {w.numel()} blocked")

first_attn = model.encoder.layers[0].self_attn
(attn_args, _, _), = recorded["encoder.layers.0.self_attn"]
with torch.no_grad():
    queries = first_attn.W_q(attn_args[0])  # (B, S, d): the queries of the recorded input
    heads = first_attn.split_heads(queries)  # (B, S, d) -> (B, h, S, d_k)
d_k = d // h
assert heads.shape == (B, h, S, d_k)
assert all(torch.equal(heads[:, i], queries[..., i * d_k:(i + 1) * d_k]) for i in range(h))

# %% [markdown]
# ## Clear errors
#
# The mistakes that are easy to make with a model like this, and what each one says. Every one
# is a `ValueError` (or a `TypeError` for a wrong kind of object or dtype) raised before the bad argument
# is used (ids and lengths before the embedding lookup, masks and `enc_out` before the stacks),
# naming the argument and the shapes or values involved. For comparison, `nn.Transformer` answers
# the first one with `RuntimeError: the batch number of src and tgt must be equal`, and
# `nn.Embedding` answers an id out of range with `IndexError: index out of range in self` on the
# CPU and a device-side assertion on a GPU. (The mistakes of building a model, a bad setting or a
# config passed with fields, are refused by the constructor: *The config, checked* lists them.)

# %%
long_src = torch.full((B, 513), 5, device=device)  # one more than max_len
tgt_mask_1e9 = torch.where(tgt_mask, 0.0, -1e9)  # blocks in float32, but finite: the rule refuses it
bad_calls = {
    "batch sizes differ": lambda: model(src, tgt_in[:1]),
    "target id >= vocab": lambda: model(src, tgt_in.masked_fill(tgt_in == 11, 12)),
    "negative source id": lambda: model(src.masked_fill(src == PAD, -1), tgt_in),
    "float ids": lambda: model(src.float(), tgt_in),
    "source longer than max_len": lambda: model(long_src, tgt_in),
    "src_mask for another length": lambda: model(src, tgt_in, src_mask=padding_mask(src_lengths, T_src + 1).to(device)),
    "src_mask per query": lambda: model(src, tgt_in, src_mask=src_mask & causal_mask(T_src, device=device)),
    "tgt_mask of the source's length": lambda: model(src, tgt_in, src_mask, causal_mask(T_src, device=device)),
    "tgt_mask without the causal part": lambda: model(src, tgt_in, src_mask, tgt_padding_only),
    "integer 0/1 src_mask": lambda: model(src, tgt_in, src_mask.long(), tgt_mask),
    "integer 0/1 tgt_mask (causal)": lambda: model(src, tgt_in, src_mask, tgt_mask.long()),
    "integer src_mask to encode": lambda: model.encode(src, src_mask.long()),
    "integer cross_mask to decode": lambda: model.decode(tgt_in, enc_out, tgt_mask, src_mask.long()),
    "float tgt_mask with -1e9": lambda: model(src, tgt_in, src_mask, tgt_mask_1e9),
    "make_masks with float ids": lambda: make_masks(src.float(), tgt_in),
    "make_masks, batches differ": lambda: make_masks(src, tgt_in[:1]),
    "enc_out from another batch": lambda: model.decode(tgt_in, enc_out[:1]),
}
for what, call in bad_calls.items():
    try:
        call()
    except (ValueError, TypeError) as err:
        print(f"{what:>32} -> {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{what}: accepted")

# %% [markdown]
# **Check** (why the model checks a mask's dtype itself): skip the door's checks with
# `validated()`, as the model does for its layers, and an integer `src_mask` goes through. Give
# the padded source positions another id: with the bool mask the logits do not move, because no
# query can see those keys; with the same mask as 0s and 1s they do, because attention adds it
# to the scores instead of blocking.

# %%
src_other_pad = src.masked_fill(src == PAD, 4)  # another id at the padded source positions
pad_leak = {}
with torch.no_grad(), validated():  # the checks off, as inside the model: nothing refuses the int mask
    for what, mask in (("bool src_mask", src_mask), ("integer src_mask", src_mask.long())):
        moved = model(src_other_pad, tgt_in, mask, tgt_mask) - model(src, tgt_in, mask, tgt_mask)
        pad_leak[what] = moved.abs().max().item()
print("\n".join(f"{what:>16}: logits change by up to {change:.2f}" for what, change in pad_leak.items()))
assert pad_leak["bool src_mask"] < 1e-6 and pad_leak["integer src_mask"] > 1e-2  # the padding leaks in

# %% [markdown]
# One mistake is not on the list: a `tgt_mask` left out, which the model cannot tell from a
# deliberate `None` (*The model*). **Check** (what a forgotten mask costs): change a later target
# token, at position 3, and compare the logits at position 0, which may depend on the source but,
# among the target tokens, on `BOS` alone. With `tgt_mask=None` the call is accepted and they
# change; with `causal_mask` they do not, and neither with `make_masks`, which is the way not to
# forget it.

# %%
changed = tgt_in.clone()
changed[:, 3] = 4  # a later target token, in both sequences (3 and 9 before)
assert not torch.equal(changed, tgt_in)
position0_change = {}
with torch.no_grad():
    for what, mask in (("tgt_mask=None", None), ("causal_mask(T_tgt)", causal_mask(T_tgt, device=device)),
                       ("make_masks", tgt_mask)):
        before = model(src, tgt_in, src_mask, mask)[:, 0]  # (B, V): the logits at position 0, accepted
        after = model(src, changed, src_mask, mask)[:, 0]
        position0_change[what] = (after - before).abs().max().item()
print("\n".join(f"{what:>19}: logits at position 0 change by up to {change:.2f}"
                for what, change in position0_change.items()))
assert position0_change["tgt_mask=None"] > 1e-2  # the future leaks in, silently
assert position0_change["causal_mask(T_tgt)"] < 1e-6 and position0_change["make_masks"] < 1e-6

# %% [markdown]
# Why a float `tgt_mask` must hold $-\infty$ above the diagonal. The rule: a later key whose
# score is $g$ above an allowed key's, and whose mask entry is a finite $v$, gets $e^{v + g}$
# times the allowed key's weight. That is exactly 0 only where the exponential underflows, which
# depends on the dtype and on scores the door has not seen.
#
# Why $-\infty$ in particular: it is the one value that blocks in every dtype and at any score.
# It is also the value notebook 02's rule for a query with no allowed key looks for (the $-10^9$
# of some tutorials spreads such a row's weight evenly over all keys instead, notebook 05).
#
# **Check** (what the rule guards against, and what it does not claim): the door refused the
# $-10^9$ mask above, but not because it leaks here. With the checks off, fill the later keys
# with a finite value and change the same later token: with $-10$ the logits at position 0 move,
# by about $10^{-4}$ here (its last digit depends on the machine's roundings, so CI checks only
# the bound after the print); with $-10^9$ they do not, in this float32 model.

# %% tags=["nbval-ignore-output"]
FILL_NAMES = {-10.0: "-10", -50.0: "-50", -1e9: "-1e9", -math.inf: "-inf"}  # for the prints
finite_leak = {}
with torch.no_grad(), validated():  # the checks off: nothing refuses a finite float mask
    for fill in (-10.0, -1e9):
        finite = torch.where(tgt_mask, 0.0, fill)  # (B, 1, T, T): 0 where allowed, `fill` elsewhere
        before = model(src, tgt_in, src_mask, finite)[:, 0]  # (B, V): the logits at position 0
        after = model(src, changed, src_mask, finite)[:, 0]
        finite_leak[fill] = (after - before).abs().max().item()
for fill, change in finite_leak.items():
    print(f"float tgt_mask, {FILL_NAMES[fill]} above the diagonal: logits at position 0 change by up to"
          f" {change:.1e}")

# %%
assert 1e-5 < finite_leak[-10.0] < 1e-2  # -10 leaks (far above float32 rounding, far below a forgotten mask)
assert finite_leak[-1e9] < 1e-6  # -1e9 blocks in float32


# %% [markdown]
# Then the rule's reason, on two keys, one allowed and one later, with the later key's mask entry
# $v$: its softmax weight depends on the dtype and on how far its score sits above the allowed
# one. $v = -50$ blocks it in float16 (where $e^{-50}$ underflows to 0), not in float32, and not
# at all once the later key scores 50 higher; $-10^9$ blocks in each case here (in float16 it
# does not fit and becomes $-\infty$); $-\infty$ blocks in every case.

# %%
def later_weight(fill: float, gap: float, dtype: torch.dtype) -> float:
    """Softmax weight of a later key masked with `fill`, its score `gap` above the allowed key's."""
    scores = torch.tensor([0.0, gap]).to(dtype) + torch.tensor([0.0, fill]).to(dtype)  # (allowed, later)
    return torch.softmax(scores, dim=-1)[1].item()


mask_cases = {"float16, equal scores": (0.0, torch.float16), "float32, equal scores": (0.0, torch.float32),
              "float32, later key 50 higher": (50.0, torch.float32)}  # (gap, dtype)
later_weights = {fill: [later_weight(fill, gap, dtype) for gap, dtype in mask_cases.values()]
                 for fill in (-50.0, -1e9, -math.inf)}
print(f"{'weight of the later key':<24}" + "".join(f"{case:>30}" for case in mask_cases))
for fill, row in later_weights.items():
    print(f"{'mask entry ' + FILL_NAMES[fill]:<24}" + "".join(f"{w:>30.2g}" for w in row))
assert later_weights[-50.0][0] == 0 and 0 < later_weights[-50.0][1] < 1e-20 and later_weights[-50.0][2] == 0.5
assert all(w == 0 for fill in (-1e9, -math.inf) for w in later_weights[fill])

# %% [markdown]
# **The model checks its inputs at the door and names what is wrong, down to a `tgt_mask` that is
# not causal; a `tgt_mask` left out it cannot catch, so build the masks with `make_masks`.**
#
# ## Exercises
#
# 1. **The paper's base model.** Count the parameters of `Transformer` at the paper's base size
#    ($d_\text{model} = 512$, $h = 8$, $d_{ff} = 2048$, $N = 6$) with a shared source–target
#    vocabulary of 37,000 tokens, once as built and once with all three token matrices tied
#    (Vaswani et al., 2017, §3.4; notebook 09). Compare with the 65 million of the paper's
#    Table 3. Build it on the `meta` device, so that no memory is allocated for its weights.
# 2. **Tie our model.** Tie `src_embed`, `tgt_embed` and `out_proj` of the course's model (both
#    vocabularies have 12 tokens), check the new parameter count against 930,828, and check that
#    one backward pass puts gradient from all three uses into the one shared matrix.
# 3. **Prefixes.** Generation (notebook 12) decodes a growing prefix one token at a time. Show
#    that, with the causal mask, decoding the first $k$ target tokens gives the first $k$ rows of
#    decoding the whole target, for every $k$, up to float32 rounding (a shorter input may take
#    other kernels, which add in another order); and that without the mask it does not.
#
# **Solutions.**
#
# 1. On the `meta` device every tensor has a shape and no data, so counting costs nothing. The
#    untied model has $2 \cdot 37{,}000 \cdot 512 \approx 37.9$ M parameters in its two tables,
#    plus 19.0 M in the output layer ($512 \cdot 37{,}000$ weights and $37{,}000$ biases); tying
#    all three leaves one table. The vocabulary's three matrices are 56 % of the untied model. The
#    tied count, 63.1 M, is within 3 % of the paper's 65 M (the paper gives the vocabulary only as
#    "about 37000" tokens, and does not list its count's parts).

# %%
with torch.device("meta"):
    base = Transformer(37_000, 37_000, d_model=512, num_heads=8, d_ff=2048, num_layers=6)
untied = num_params(base)
tied_count = untied - 2 * 37_000 * 512  # tgt_embed and out_proj.weight share src_embed's matrix
vocab_share = sum(num_params(m) for m in (base.src_embed, base.tgt_embed, base.out_proj)) / untied
print(f"untied {untied / 1e6:.1f} M, of which the embeddings and the output layer {vocab_share:.0%};"
      f" tied {tied_count / 1e6:.1f} M, {tied_count / 65e6 - 1:+.1%} from the paper's 65 M")
assert untied == 3 * 37_000 * 512 + 37_000 + 6 * (4 * 512**2 + 2 * 512 * 2048 + 2048 + 9 * 512) \
    + 6 * (8 * 512**2 + 2 * 512 * 2048 + 2048 + 15 * 512) + 2 * 2 * 512
assert round(vocab_share, 2) == 0.56 and abs(tied_count / 65e6 - 1) < 0.03  # as the text says

# %% [markdown]
# 2. Assign the `Parameter`s; `parameters()` lists a shared one once, so two matrices of
#    $12 \times 128$ go: $930{,}828 - 2 \cdot 1{,}536 = 927{,}756$. Every use adds its gradient to
#    the shared `.grad`, which an untied copy with the same values shows term by term. One
#    consequence is easy to miss: the embeddings send no gradient into the `PAD` row, twice over.
#    On this batch the masks and `ignore_index` cut every path from a padded position to the
#    loss (the cell checks it on the embedded inputs that `pos` returns: their gradient is exactly
#    zero at every padded position, and non-zero at every real one); and the tables are built
#    with `padding_idx=PAD`, which would block that row's gradient even without the masks. But
#    the output layer computes a logit for `PAD` at every position and writes a gradient into
#    that row, so in a tied model the `PAD` vector is trained like any other.

# %%
set_seed(0)
untied_model = Transformer(VOCAB, VOCAB).to(device).eval()
tied_model = copy.deepcopy(untied_model)
shared = tied_model.src_embed.weight  # (V, d)
tied_model.tgt_embed.weight = shared
tied_model.out_proj.weight = shared
with torch.no_grad():  # the untied copy gets the same values, so it computes the same function
    untied_model.tgt_embed.weight.copy_(shared)
    untied_model.out_proj.weight.copy_(shared)
assert num_params(tied_model) == 930_828 - 2 * VOCAB * d_model == 927_756


def reversal_loss(m: Transformer) -> torch.Tensor:
    logits = m(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)


def keep_with_grad(module, args, out):  # a forward hook: keep pos's output and its gradient
    out.retain_grad()  # a non-leaf tensor keeps its .grad only when asked
    embedded.append(out)


reversal_loss(tied_model).backward()
embedded = []
hook = untied_model.pos.register_forward_hook(keep_with_grad)
try:
    reversal_loss(untied_model).backward()
finally:
    hook.remove()
x_src_grad, x_tgt_grad = (x.grad for x in embedded)  # (B, S, d), (B, T, d): dL/d(embedded input)
uses = {"src_embed": untied_model.src_embed.weight.grad, "tgt_embed": untied_model.tgt_embed.weight.grad,
        "out_proj": untied_model.out_proj.weight.grad}
assert_close(shared.grad, sum(uses.values()))  # the shared gradient is the sum of the three uses
for x_grad, ids in ((x_src_grad, src), (x_tgt_grad, tgt_in)):  # no path from a padded position to the loss
    assert torch.count_nonzero(x_grad[ids == PAD]) == 0 and (x_grad[ids != PAD].abs().sum(dim=-1) > 0).all()
assert untied_model.src_embed.padding_idx == untied_model.tgt_embed.padding_idx == PAD
assert torch.count_nonzero(uses["src_embed"][PAD]) == torch.count_nonzero(uses["tgt_embed"][PAD]) == 0
assert torch.count_nonzero(uses["out_proj"][PAD]) == d_model  # the head trains the PAD row
print(f"tied: {num_params(tied_model):,} parameters; largest gradient in the PAD row from each use:",
      {k: f"{g[PAD].abs().max().item():.1e}" for k, g in uses.items()})

# %% [markdown]
# 3. Position $t$ of the decoder reads target inputs $0..t$ only (the dependency map above), so
#    its output cannot change when tokens after $t$ are cut off. Without the mask, each position
#    attends to the whole prefix it is given, and cutting changes it.

# %%
with torch.no_grad():
    enc_out = model.encode(src, src_mask)
    full = model.decode(tgt_in, enc_out, causal_mask(T_tgt, device=device), src_mask)  # (B, T, d)
    full_unmasked = model.decode(tgt_in, enc_out, None, src_mask)
    for k in range(1, T_tgt + 1):
        prefix = model.decode(tgt_in[:, :k], enc_out, causal_mask(k, device=device), src_mask)  # (B, k, d)
        assert_close(prefix, full[:, :k], **PARITY)  # other lengths: other kernels on a GPU
    prefix_unmasked = model.decode(tgt_in[:, :3], enc_out, None, src_mask)
    assert not torch.allclose(prefix_unmasked, full_unmasked[:, :3])
print("with the causal mask, every prefix decodes to the first rows of the full decode")

# %% [markdown]
# Next: notebook 11, *Training*, which trains this model to reverse sequences (255 to 256 of 256
# exact matches) and runs a shorter version of the tutorial's initialisation ablation.
