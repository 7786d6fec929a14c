# %% [markdown]
# # 14 · Efficient attention and a fast path
#
# **What you will build:** the `efficient` module. First you measure where attention's memory
# goes (the $T \times T$ matrix of scores), then you write **tiled attention with the online
# softmax**, the algorithm inside FlashAttention, in plain PyTorch: equal to the naive attention
# in values and gradients, with a backward pass that recomputes the scores instead of storing
# them. Then PyTorch's fused `F.scaled_dot_product_attention` and its backends, and the
# **fast path** of the course's model: the same weights, the same outputs and gradients, and a
# training step that `make bench` times against `nn.Transformer`'s (the goal, at most 0.85 of its
# time, is missed: section 5 says by how much and where the time goes). Last, counting work:
# FLOPs per token, the machine's matmul peak, model FLOPs utilisation, the KV cache's bytes,
# mixed precision and gradient checkpointing, and the `bench.json` that `make bench` writes.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/14_efficient_attention.ipynb) · Assumes: [02 · Self-attention](02_self_attention.ipynb), [05 · Masking](05_masking.ipynb), [10 · The full model](10_full_model.ipynb) (and its `TorchTransformer`), [11 · Training](11_training.ipynb) (the reversal task), [12 · Generation](12_generation.ipynb) (greedy decoding, the KV cache).

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
import platform
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.decoding import KVCache
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.measure import count_flops
from transformer_from_scratch.measure import fit_slope
from transformer_from_scratch.measure import peak_memory
from transformer_from_scratch.measure import time_call
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.reference import TorchTransformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.utils import COLORS
from transformer_from_scratch.utils import add_to_class
from transformer_from_scratch.utils import get_device
from transformer_from_scratch.utils import save_figure
from transformer_from_scratch.utils import set_seed

set_seed(0)
device = get_device()
ON_APPLE_GPU = device.type == "mps"  # PyTorch keeps no record of peak memory on MPS, and this
if ON_APPLE_GPU:  # notebook measures memory throughout: there it runs on the CPU (said below)
    device = torch.device("cpu")

# %% [markdown]
# What this notebook exports goes into the module `efficient`, except the attention half of the
# fast path, which goes into `attention` beside the from-scratch code (section 5), and two
# measuring tools, into `measure`:

# %%
#| default_exp efficient

# %%
#| export
"""Efficient attention: tiled attention with the online softmax and a recomputing backward (the
loop of FlashAttention-2, Dao 2023, in plain PyTorch), and the switch to the fast path of the
course's model (whose attention half lives in the attention module, beside the from-scratch
code)."""

import dataclasses
import math

import torch
from torch import Tensor
from torch import nn

from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.attention import check_attention_inputs
from transformer_from_scratch.checks import check_bool
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import checking
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.model import TransformerConfig


# %% [markdown]
# ## 1 · Where the memory goes
#
# Notebook 02 counted that attention's *work* grows as $T^2$. Its memory does too, and memory is
# what stops long sequences first. The naive attention of notebook 02 builds
#
# $$S = \frac{QK^\top}{\sqrt{d_k}} \in \mathbb{R}^{T\times T},\qquad
# P = \mathrm{softmax}(S),\qquad O = PV,$$
#
# and both $S$ and $P$ are $T \times T$: at $T = 8192$ one float32 copy is 256 MiB, per head and
# per sequence, while $Q$, $K$, $V$ and $O$ together, with a head size of $d_k = 64$ (the size
# used throughout this section), are 8 MiB. For training it is worse:
# autograd keeps $P$ (the softmax's backward needs its output; with a mask, the boolean mask
# too) for the backward pass, so the $T\times T$ matrices live until the gradients are computed.
#
# `peak_memory` (notebook 02) measures, not computes: it reads the allocator's record of what
# was allocated and freed while a function ran. One head, $d_k = 64$:

# %% tags=["nbval-ignore-output"]
def make_qkv(T, d_k=64, heads=1, batch=1, dtype=torch.float32, requires_grad=False, seed=0):
    """Random (batch, heads, T, d_k) queries, keys and values, drawn on the CPU, then moved."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, T, d_k)
    return tuple(torch.randn(shape, generator=gen, dtype=dtype).to(device)
                 .requires_grad_(requires_grad) for _ in range(3))


def naive_forward(Q, K, V):
    with torch.no_grad():
        return scaled_dot_product_attention(Q, K, V)[0]


def naive_training(Q, K, V):
    out = scaled_dot_product_attention(Q, K, V)[0]
    out.sum().backward()  # the weights are kept until here, then freed


if ON_APPLE_GPU:
    print("Apple GPU found: this notebook measures memory, which PyTorch cannot do on MPS, "
          "so it runs on the CPU.")
MiB = 2**20
if device.type == "cuda":  # the first matmul allocates cuBLAS's workspace (8-32 MiB), once:
    naive_training(*make_qkv(64, requires_grad=True))  # let that happen before measuring
    torch.cuda.synchronize()
lengths = [512, 1024, 2048, 4096]
naive_fwd_mem, naive_train_mem = [], []
for T in lengths:
    Q, K, V = make_qkv(T)
    naive_fwd_mem.append(peak_memory(lambda Q=Q, K=K, V=V: naive_forward(Q, K, V), device))
    Qg, Kg, Vg = make_qkv(T, requires_grad=True)
    naive_train_mem.append(peak_memory(lambda Q=Qg, K=Kg, V=Vg: naive_training(Q, K, V), device))
for T, fwd, train in zip(lengths, naive_fwd_mem, naive_train_mem, strict=True):
    print(f"T={T:5d}: forward {fwd / MiB:7.1f} MiB, forward+backward {train / MiB:7.1f} MiB, "
          f"one T x T matrix {T * T * 4 / MiB:6.1f} MiB")

# %% [markdown]
# The forward pass peaks at about two $T \times T$ matrices (the scores and the weights exist at
# once while the softmax runs), the training step at about three on this CPU. How many the
# backward holds at once depends on the device's kernels: on an H200 GPU (torch 2.11) we measured
# four. The check below allows from 1.5 to 3 matrices for the forward pass and from 2 to 5 for
# the training step. Both grow as $T^2$:

# %% tags=["nbval-ignore-output"]
slope_fwd, slope_train = fit_slope(lengths, naive_fwd_mem), fit_slope(lengths, naive_train_mem)
print(f"memory ~ T^k: forward k = {slope_fwd:.2f}, forward+backward k = {slope_train:.2f}")

# %%
assert 1.9 < slope_fwd < 2.1 and 1.9 < slope_train < 2.1
for T, fwd, train in zip(lengths, naive_fwd_mem, naive_train_mem, strict=True):
    square = T * T * 4  # bytes of one (T, T) float32 matrix
    assert 1.5 * square < fwd < 3 * square and 2 * square < train < 5 * square

# %% [markdown]
# **The cause is the $T \times T$ matrix: its bytes, not $Q$, $K$, $V$ or the output, are what
# the peak counts.** To attend to long sequences, never hold it.
#
# ## 2 · The online softmax
#
# The softmax of one row needs the whole row: $p_j = e^{s_j - m} / \ell$ with the row's maximum
# $m$ (subtracted so that nothing overflows) and the sum $\ell = \sum_j e^{s_j - m}$. But $m$ and
# $\ell$ can be computed **while the row streams by**, one block of keys at a time
# (Milakov and Gimelshein, 2018). After a block with scores $s^{(b)}$:
#
# $$m' = \max\bigl(m, \max_j s^{(b)}_j\bigr), \qquad
# \ell' = e^{m - m'}\,\ell + \sum_j e^{s^{(b)}_j - m'}, \qquad
# a' = e^{m - m'}\,a + \sum_j e^{s^{(b)}_j - m'}\, v_j .$$
#
# The factor $e^{m - m'}$ *rescales* what was summed under the old maximum to the new one. The
# accumulator $a$ is the unnormalised output $\sum_j e^{s_j - m} v_j$, and at the end
# $o = a / \ell$. Nothing of size $T$ is kept for a query: two running numbers ($m$ and $\ell$)
# and one vector ($a$, of size $d_v$). On one row, in plain Python-sized steps:

# %%
gen = torch.Generator().manual_seed(1)
s_row, v_rows = torch.randn(10, generator=gen) * 3, torch.randn(10, 4, generator=gen)
m, ell, acc = torch.tensor(-math.inf), torch.tensor(0.0), torch.zeros(4)
for block in range(0, 10, 3):  # blocks of 3 keys: 3, 3, 3, 1
    s_b, v_b = s_row[block : block + 3], v_rows[block : block + 3]
    m_new = torch.maximum(m, s_b.max())
    rescale = torch.exp(m - m_new)  # 0 at the first block: exp(-inf)
    ell = rescale * ell + torch.exp(s_b - m_new).sum()
    acc = rescale * acc + torch.exp(s_b - m_new) @ v_b
    m = m_new
streamed = acc / ell
assert_close(streamed, torch.softmax(s_row, dim=0) @ v_rows)
print("streamed:", [round(x, 4) for x in streamed.tolist()])


# %% [markdown]
# ## 3 · Tiled attention
#
# FlashAttention (Dao et al., 2022) applies this to whole tiles, and the loop below is in the
# order of FlashAttention-2 (Dao, 2023): the outer loop over query blocks, the inner one over key
# blocks, and the division by $\ell$ once per query block at the end. A block of `block_q` queries
# against a block of `block_k` keys is one small matmul; the running $m$, $\ell$ and $a$ of the
# query block are updated after every key block. The largest temporary is one
# `block_q × block_k` tile, whatever $T$ is. On a GPU the tile lives in fast on-chip memory and
# the whole loop is one kernel; here it is a Python loop over PyTorch matmuls: the same
# arithmetic and the same memory, without the speed of a fused kernel.
#
# Masks work tile by tile. Our masks are True where a query may attend (notebook 05); a
# forbidden pair scores $-\infty$ and so contributes $e^{-\infty} = 0$. A **causal** mask needs no
# tensor at all: a key tile that starts after the last query of the query tile is skipped, and
# only tiles that cross the diagonal are masked. A query with no allowed key keeps $m = -\infty$
# and $\ell = 0$; our policy since notebook 05 is zeros for such a row.

# %%
#| export
def _tile_scores(
    Q_i: Tensor,
    K_j: Tensor,
    mask: Tensor | None,
    causal: bool,
    i0: int,
    j0: int,
    scale: float,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Masked scores of one tile, in `dtype` (default Q's): (..., bq, d_k) @ (..., d_k, bk) ->
    (..., bq, bk)."""
    dtype = Q_i.dtype if dtype is None else dtype
    S = (Q_i.to(dtype) @ K_j.to(dtype).transpose(-2, -1)).mul_(scale)  # .to: a no-op if equal
    bq, bk = Q_i.size(-2), K_j.size(-2)
    if mask is not None:  # already expanded to (..., T_q, T_k): slicing is a view
        m = mask[..., i0 : i0 + bq, j0 : j0 + bk]
        if m.dtype == torch.bool:
            S.masked_fill_(~m, float("-inf"))  # True = may attend
        else:
            S.add_(m)  # a float mask is added to the scores
    if causal and j0 + bk - 1 > i0:  # the tile crosses the diagonal: key j > query i is hidden
        rows = torch.arange(i0, i0 + bq, device=S.device).unsqueeze(-1)  # (bq, 1)
        cols = torch.arange(j0, j0 + bk, device=S.device)  # (bk,)
        S.masked_fill_(cols > rows, float("-inf"))
    return S


def _key_starts(T_k: int, block_k: int, causal: bool, i1: int) -> range:
    """Where the key tiles start that queries i0 .. i1 - 1 may see (causal: keys j < i1 only)."""
    return range(0, min(T_k, i1) if causal else T_k, block_k)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs (as FlashAttention-2 accumulates), else the inputs' own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# %% [markdown]
# The forward pass. Besides the output it returns each row's **log-sum-exp**
# $L = m + \log \ell$, one number per query: it is all the backward pass needs to rebuild any
# tile of weights, since $p_{ij} = e^{s_{ij} - L_i}$. (A row with no allowed key gets
# $L = +\infty$, so that the rebuilt weights are $e^{-\infty} = 0$.) With 16-bit inputs
# (bfloat16, float16) the scores, $m$, $\ell$, $a$ and $L$ are float32, as in FlashAttention-2:
# a running sum over thousands of keys kept in bfloat16's 8 bits of precision would lose the
# small terms (section 7 measures what that costs); `acc_dtype` overrides the choice.

# %%
#| export
def tiled_attention_forward(
    Q: Tensor,  # (..., T_q, d_k)
    K: Tensor,  # (..., T_k, d_k)
    V: Tensor,  # (..., T_k, d_v)
    mask: Tensor | None = None,  # (..., T_q, T_k) expanded; bool True = may attend, or float
    causal: bool = False,
    block_q: int = 256,
    block_k: int = 256,
    acc_dtype: torch.dtype | None = None,  # default: float32 for 16-bit inputs, else Q's dtype
) -> tuple[Tensor, Tensor]:
    """Attention one (block_q x block_k) tile at a time, online softmax: O (..., T_q, d_v) in Q's
    dtype, L (..., T_q, 1) in the accumulators' dtype."""
    scale = 1.0 / math.sqrt(Q.size(-1))
    T_q, T_k = Q.size(-2), K.size(-2)
    acc_dtype = _accumulator_dtype(Q.dtype) if acc_dtype is None else acc_dtype
    O = Q.new_empty(*Q.shape[:-1], V.size(-1))  # (..., T_q, d_v)
    L = Q.new_empty(*Q.shape[:-1], 1, dtype=acc_dtype)  # (..., T_q, 1): log-sum-exp of each row
    for i0 in range(0, T_q, block_q):
        Q_i = Q[..., i0 : i0 + block_q, :]  # (..., bq, d_k)
        stats = (*Q_i.shape[:-1], 1)
        m = Q_i.new_full(stats, -math.inf, dtype=acc_dtype)  # running max of each row
        ell = Q_i.new_zeros(stats, dtype=acc_dtype)  # running sum of exp(s - m)
        acc = Q_i.new_zeros((*Q_i.shape[:-1], V.size(-1)), dtype=acc_dtype)  # sum of exp(s - m) v
        for j0 in _key_starts(T_k, block_k, causal, i0 + Q_i.size(-2)):
            S = _tile_scores(Q_i, K[..., j0 : j0 + block_k, :], mask, causal, i0, j0, scale,
                             acc_dtype)
            m_new = torch.maximum(m, S.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # no key seen yet: no shift
            P = S.sub_(m_safe).exp_()  # in place: the tile's scores are not needed again
            rescale = (m - m_safe).exp_()  # (..., bq, 1), 0 where m was -inf
            ell.mul_(rescale).add_(P.sum(dim=-1, keepdim=True))
            acc.mul_(rescale).add_(P @ V[..., j0 : j0 + block_k, :].to(acc_dtype))  # (.., bq, d_v)
            m = m_new
        no_key = ell == 0  # rows that could attend to nothing: zeros, as in notebook 05
        O[..., i0 : i0 + block_q, :] = acc.div_(ell.masked_fill(no_key, 1.0))  # to O's dtype
        m_safe = m.masked_fill(torch.isneginf(m), 0.0)
        L[..., i0 : i0 + block_q, :] = (m_safe + ell.log()).masked_fill(no_key, math.inf)
    return O, L


# %% [markdown]
# ### The backward pass, recomputed
#
# Autograd through a loop like the one above (written without in-place operations, which autograd
# cannot differentiate through; "Without the custom backward" below measures it) would keep every
# tile for the backward pass, all $T\times T$ of them again. Instead, a custom
# `torch.autograd.Function` saves only $Q, K, V, O$ and $L$, and its backward rebuilds each tile.
# With $dO$ the gradient of the output, for every tile:
#
# $$P = e^{S - L},\quad dV \mathrel{+}= P^\top dO,\quad dP = dO\,V^\top,\quad
# dS = P \odot (dP - D),\quad dQ \mathrel{+}= \tfrac{1}{\sqrt{d_k}}\, dS\,K,\quad
# dK \mathrel{+}= \tfrac{1}{\sqrt{d_k}}\, dS^\top Q,$$
#
# where $D_i = \sum_j P_{ij}\, dP_{ij} = \sum_c dO_{ic}\, O_{ic}$ is the softmax backward's row
# term, computed once from $dO$ and $O$ without any $P$. The price: $QK^\top$ is computed twice
# (once forward, once backward). A training step of naive attention does six $T \times T$-sized
# matmuls (two forward: $QK^\top$ and $PV$; four backward: $dV$, $dP$, $dQ$, $dK$); the
# recomputation adds a seventh, so about 1/6 ≈ 17 % more attention arithmetic for the whole step
# (1/4 more for the backward alone). The gain: the training memory of attention becomes linear
# in $T$.

# %%
#| export
def tiled_attention_backward(
    dO: Tensor,
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    O: Tensor,
    L: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    block_q: int = 256,
    block_k: int = 256,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of tiled attention, each tile's weights rebuilt from Q, K and L = logsumexp.
    Computed and accumulated in L's dtype (float32 for 16-bit inputs), returned in the inputs'."""
    scale = 1.0 / math.sqrt(Q.size(-1))
    T_q, T_k = Q.size(-2), K.size(-2)
    dtypes = Q.dtype, K.dtype, V.dtype
    dO, Q, K, V, O = (t.to(L.dtype) for t in (dO, Q, K, V, O))  # L's: the accumulators' dtype
    D = (dO * O).sum(dim=-1, keepdim=True)  # (..., T_q, 1) = rowsum(P * dP), without P
    dQ, dK, dV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for i0 in range(0, T_q, block_q):
        i1 = min(i0 + block_q, T_q)
        Q_i, dO_i, L_i, D_i = Q[..., i0:i1, :], dO[..., i0:i1, :], L[..., i0:i1, :], D[..., i0:i1, :]
        for j0 in _key_starts(T_k, block_k, causal, i1):
            j1 = min(j0 + block_k, T_k)
            K_j, V_j = K[..., j0:j1, :], V[..., j0:j1, :]
            P = _tile_scores(Q_i, K_j, mask, causal, i0, j0, scale).sub_(L_i).exp_()  # (.., bq, bk)
            dV[..., j0:j1, :] += P.transpose(-2, -1) @ dO_i
            dS = (dO_i @ V_j.transpose(-2, -1)).sub_(D_i).mul_(P)  # the softmax's backward
            dQ[..., i0:i1, :] += (dS @ K_j).mul_(scale)
            dK[..., j0:j1, :] += (dS.transpose(-2, -1) @ Q_i).mul_(scale)
    return dQ.to(dtypes[0]), dK.to(dtypes[1]), dV.to(dtypes[2])  # no copies if already so


class TiledAttention(torch.autograd.Function):
    """Tiled attention whose backward recomputes the weights: saves O(T) memory, not O(T^2)."""

    @staticmethod
    def forward(ctx, Q, K, V, mask, causal, block_q, block_k):
        O, L = tiled_attention_forward(Q, K, V, mask, causal, block_q, block_k)
        ctx.save_for_backward(Q, K, V, O, L, mask)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L, mask = ctx.saved_tensors
        dQ, dK, dV = tiled_attention_backward(
            dO.contiguous(), Q, K, V, O, L, mask, ctx.causal, ctx.block_q, ctx.block_k
        )
        return dQ, dK, dV, None, None, None, None  # no gradient for the mask and the settings


# %% [markdown]
# The public function checks its inputs as `scaled_dot_product_attention` does, broadcasts the
# batch dimensions (views, no copies; autograd sums the gradients back over them) and returns the
# context only: the whole point is never to form the weights.

# %%
#| export
def tiled_attention(
    Q: Tensor,  # (..., T_q, d_k)
    K: Tensor,  # (..., T_k, d_k)
    V: Tensor,  # (..., T_k, d_v)
    mask: Tensor | None = None,  # broadcastable to (..., T_q, T_k): bool (True = attend) or float
    causal: bool = False,
    block_q: int = 256,
    block_k: int = 256,
) -> Tensor:
    """softmax(Q K^T / sqrt(d_k) + mask) V without a (T_q, T_k) matrix: context (..., T_q, d_v)."""
    if checking():
        check_attention_inputs(Q, K, V, mask, 0.0)
        check_bool("causal", causal)
        check_int("block_q", block_q, minimum=1)
        check_int("block_k", block_k, minimum=1)
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    Q, K, V = (t.expand(*batch, *t.shape[-2:]) for t in (Q, K, V))
    if mask is not None:
        mask = mask.expand(*batch, Q.size(-2), K.size(-2))  # a view: tiles slice it
    return TiledAttention.apply(Q, K, V, mask, causal, block_q, block_k)


# %% [markdown]
# ### Checks: values and gradients
#
# In float64, against notebook 02's `scaled_dot_product_attention` (the naive one), for no
# mask, a causal mask, a padding mask with a fully padded sequence (all its rows fully masked),
# and the two together in both ways: as one combined mask tensor, and as `causal=True` (no
# tensor, tiles above the diagonal skipped) with the padding mask; and a float mask, which is
# added to the scores (one per query and key, shared by the batch and the heads); tiles of
# 16 × 32 over $T = 70$ so that the last tiles are ragged:

# %%
set_seed(0)
Q64, K64, V64 = (torch.randn(2, 3, 70, 16, dtype=torch.float64, device=device,
                             requires_grad=True) for _ in range(3))
padding = padding_mask(torch.tensor([70, 0], device=device), 70)  # (2, 1, 1, 70): one is empty
causal = causal_mask(70, device=device)  # (1, 1, 70, 70)
additive = torch.randn(70, 70, generator=torch.Generator().manual_seed(3),  # (T, T), added to
                       dtype=torch.float64).to(device)  # the scores
# name: (the naive attention's mask, the tiled attention's mask, its causal flag)
cases = {"none": (None, None, False), "causal": (causal, None, True),
         "padding": (padding, padding, False),
         "causal & padding": (causal & padding, causal & padding, False),
         "causal=True, padding": (causal & padding, padding, True),
         "float": (additive, additive, False)}
for name, (mask, tiled_mask, is_causal) in cases.items():
    reference, _ = scaled_dot_product_attention(Q64, K64, V64, mask=mask)
    ours = tiled_attention(Q64, K64, V64, mask=tiled_mask, causal=is_causal, block_q=16,
                           block_k=32)
    grad_out = torch.randn_like(reference)
    grads_ref = torch.autograd.grad(reference, (Q64, K64, V64), grad_out)
    grads_ours = torch.autograd.grad(ours, (Q64, K64, V64), grad_out)
    assert_close(ours, reference, atol=1e-12, rtol=1e-10)
    for g_ours, g_ref in zip(grads_ours, grads_ref, strict=True):
        assert_close(g_ours, g_ref, atol=1e-12, rtol=1e-10)
    if "padding" in name:
        assert torch.equal(ours[1], torch.zeros_like(ours[1]))  # the empty sequence: zeros
    print(f"{name:>20}: values and gradients equal the naive attention")

# %% [markdown]
# `torch.autograd.gradcheck` compares our backward with finite differences, and PyTorch's fused
# `F.scaled_dot_product_attention` (whose boolean masks also mean "may attend") agrees in float32:

# %%
small = tuple(t.detach()[:1, :1, :9, :4].clone().requires_grad_() for t in (Q64, K64, V64))
assert torch.autograd.gradcheck(lambda q, k, v: tiled_attention(q, k, v, causal=True, block_q=4,
                                                                block_k=3), small)
Q32, K32, V32 = make_qkv(300, d_k=32, heads=4, batch=2)
for mask in (None, padding_mask(torch.tensor([300, 123], device=device), 300)):
    assert_close(tiled_attention(Q32, K32, V32, mask=mask),
                 F.scaled_dot_product_attention(Q32, K32, V32, attn_mask=mask),
                 atol=1e-5, rtol=1e-5)
assert_close(tiled_attention(Q32, K32, V32, causal=True),
             F.scaled_dot_product_attention(Q32, K32, V32, is_causal=True), atol=1e-5, rtol=1e-5)
print("gradcheck passed; equal to F.scaled_dot_product_attention with and without masks")


# %% [markdown]
# ### Memory against $T$
#
# Now the point of it all. The forward pass at growing $T$, naive against tiled, and a training
# step (forward and backward) of each:

# %% tags=["nbval-ignore-output"]
def tiled_forward(Q, K, V):
    with torch.no_grad():
        return tiled_attention(Q, K, V)


def tiled_training(Q, K, V):
    tiled_attention(Q, K, V).sum().backward()


tiled_fwd_mem, tiled_train_mem = [], []
for T in lengths:
    Q, K, V = make_qkv(T)
    tiled_fwd_mem.append(peak_memory(lambda Q=Q, K=K, V=V: tiled_forward(Q, K, V), device))
    Qg, Kg, Vg = make_qkv(T, requires_grad=True)
    tiled_train_mem.append(peak_memory(lambda Q=Qg, K=Kg, V=Vg: tiled_training(Q, K, V), device))
T_long = 8192
Q_long, K_long, V_long = make_qkv(T_long)
naive_long = peak_memory(lambda: naive_forward(Q_long, K_long, V_long), device)
tiled_long = peak_memory(lambda: tiled_forward(Q_long, K_long, V_long), device)
for i, T in enumerate(lengths):
    print(f"T={T:5d}: forward naive {naive_fwd_mem[i] / MiB:7.1f} MiB, tiled "
          f"{tiled_fwd_mem[i] / MiB:5.2f} MiB; training naive {naive_train_mem[i] / MiB:7.1f} MiB, "
          f"tiled {tiled_train_mem[i] / MiB:5.2f} MiB")
print(f"T={T_long}: forward naive {naive_long / MiB:.1f} MiB, tiled {tiled_long / MiB:.2f} MiB, "
      f"ratio {tiled_long / naive_long:.4f}")

# %% [markdown]
# The notebook's target (`tiled_memory_ratio_8192` in section 8's table) is at most 1/8 of the naive
# peak at $T = 8192$; the tiled forward needs about 1/200: its peak is the output, the running
# statistics and one 256 × 256 tile. Its memory grows at most linearly in $T$ (less, at these
# lengths, since the tiles are a fixed cost), in training too, where from $T = 2048$ on it is under
# 1/8 of the naive step's:

# %% tags=["nbval-ignore-output"]
slope_tiled_fwd, slope_tiled_train = fit_slope(lengths, tiled_fwd_mem), fit_slope(lengths,
                                                                                  tiled_train_mem)
print(f"tiled memory ~ T^k: forward k = {slope_tiled_fwd:.2f}, training k = {slope_tiled_train:.2f}")

# %%
assert tiled_long <= naive_long / 8
assert slope_tiled_fwd < 1.2 and slope_tiled_train < 1.2
assert all(t < n / 8 for t, n in zip(tiled_train_mem[2:], naive_train_mem[2:], strict=True))

# %% jupyter={"source_hidden": true}
all_lengths = [*lengths, T_long]  # the forward passes were measured at T = 8192 too
fig, ax = plt.subplots(figsize=(6.4, 4), layout="constrained")
ax.loglog(all_lengths, [b / MiB for b in [*naive_fwd_mem, naive_long]], "o-", color=COLORS["accent"],
          label="naive, forward")
ax.loglog(lengths, [b / MiB for b in naive_train_mem], "s--", color=COLORS["accent"],
          label="naive, forward + backward")
ax.loglog(all_lengths, [b / MiB for b in [*tiled_fwd_mem, tiled_long]], "o-", color=COLORS["ours"],
          label="tiled, forward")
ax.loglog(lengths, [b / MiB for b in tiled_train_mem], "s--", color=COLORS["ours"],
          label="tiled (recomputing backward), forward + backward")
ax.loglog(all_lengths, [T * T * 4 / MiB for T in all_lengths], ":", color="gray",
          label="one T × T float32 matrix")
ax.set_xticks(all_lengths, [str(T) for T in all_lengths])
ax.minorticks_off()
ax.set_xlabel("sequence length T (tokens)")
ax.set_ylabel("peak memory (MiB)")
ax.set_title("Attention's peak memory, one head, $d_k$ = 64 (measured)")
ax.legend(fontsize=8)
save_figure(fig, "14_attention_memory")
plt.show()


# %% [markdown]
# **Tiling with the online softmax turns attention's memory from $O(T^2)$ into $O(T)$, with the
# same values and gradients.** (At these lengths the fitted exponents are well below 1: a fixed
# cost, the tiles, is a large part of the peak.) Speed is another matter: our Python loop launches many
# small matmuls. FlashAttention gets its speed from running this loop inside one GPU kernel,
# where a tile never leaves on-chip memory.
#
# ### Without the custom backward
#
# Is the custom `autograd.Function` needed, or would autograd through the tiled loop do? Our
# `tiled_attention_forward` updates its tiles in place, which autograd refuses to differentiate
# (it needs the values that the in-place operations overwrite). Written without in-place
# operations, the same loop is differentiable, and autograd keeps what each operation's backward
# needs: every tile's weights $P$, so all $T \times T$ of them again, in pieces. The peak memory
# of a training step, measured as above (fewer lengths: this one is slow):

# %%
def looped_attention(Q, K, V, block_q=256, block_k=256):
    """The tiled forward pass without in-place operations, differentiated by autograd."""
    scale = 1.0 / math.sqrt(Q.size(-1))
    outputs = []
    for i0 in range(0, Q.size(-2), block_q):
        Q_i = Q[..., i0 : i0 + block_q, :]  # (..., bq, d_k)
        m = Q_i.new_full((*Q_i.shape[:-1], 1), -math.inf)
        ell = Q_i.new_zeros((*Q_i.shape[:-1], 1))
        acc = Q_i.new_zeros((*Q_i.shape[:-1], V.size(-1)))
        for j0 in range(0, K.size(-2), block_k):
            S = Q_i @ K[..., j0 : j0 + block_k, :].transpose(-2, -1) * scale  # (..., bq, bk)
            m_new = torch.maximum(m, S.amax(dim=-1, keepdim=True))
            P = torch.exp(S - m_new)  # autograd keeps this tile for the backward
            rescale = torch.exp(m - m_new)
            ell = rescale * ell + P.sum(dim=-1, keepdim=True)
            acc = rescale * acc + P @ V[..., j0 : j0 + block_k, :]
            m = m_new
        outputs.append(acc / ell)
    return torch.cat(outputs, dim=-2)  # (..., T_q, d_v)


Qs, Ks, Vs = make_qkv(300, requires_grad=True)
assert_close(looped_attention(Qs, Ks, Vs, 64, 64), scaled_dot_product_attention(Qs, Ks, Vs)[0])
short = lengths[:3]
looped_train_mem = []
for T in short:
    Qg, Kg, Vg = make_qkv(T, requires_grad=True)
    looped_train_mem.append(peak_memory(lambda Q=Qg, K=Kg, V=Vg: looped_attention(Q, K, V).sum()
                                        .backward(), device))

# %% tags=["nbval-ignore-output"]
slope_looped = fit_slope(short, looped_train_mem)
slope_custom = fit_slope(short, tiled_train_mem[:3])
for T, looped, custom in zip(short, looped_train_mem, tiled_train_mem, strict=False):
    print(f"T={T:5d}: training, autograd through the loop {looped / MiB:6.1f} MiB, "
          f"recomputing backward {custom / MiB:5.2f} MiB")
print(f"memory ~ T^k: autograd through the loop k = {slope_looped:.2f}, "
      f"recomputing backward k = {slope_custom:.2f}")

# %%
assert slope_looped > 1.5 and slope_looped > slope_custom + 0.7
assert all(lo > 2 * T * T * 4 for lo, T in zip(looped_train_mem, short, strict=True))  # > 2 T x T

# %% [markdown]
# **The tiling saves memory in the forward pass; the recomputing backward is what keeps the
# training step's memory linear.** Autograd through the loop keeps more than two $T \times T$
# float32 matrices' worth of tiles: every tile's weights $P$, which the exponential's backward
# needs, and every tile's scores $S$ too, which `S.amax` keeps for its own backward (the maximum
# shifts every score of the row, so autograd differentiates through it, although the shift
# cancels in the output). Back on the quadratic slope of the naive attention.

# %% [markdown]
# ## 4 · PyTorch's fused kernels
#
# `F.scaled_dot_product_attention(Q, K, V, attn_mask, dropout_p, is_causal)` computes the same
# function and picks a **backend** (`torch.nn.attention.SDPBackend`) by device, dtype and
# arguments: the first, in a fixed order of preference, whose checks the call passes. What
# disqualifies each, in torch 2.13 (the checks are in PyTorch's `sdp_utils.cpp` and
# `sdp_utils_cpp.cpp`, under `aten/src/ATen/native/transformers/`; they change between
# releases, and the PyTorch documentation of `scaled_dot_product_attention` and `SDPBackend`
# lists the backends, not every check):
#
# | backend | what it is | devices and dtypes | `attn_mask` | `dropout_p > 0` |
# |---|---|---|---|---|
# | `MATH` | the naive formula in ATen ops, $T \times T$ in memory: the fallback | all | any | yes |
# | `FLASH_ATTENTION`, CPU | a tiled C++ kernel, this notebook's algorithm | float32, float64, bf16, fp16 | bool or float | **no** |
# | `FLASH_ATTENTION`, CUDA | FlashAttention-2 (Dao, 2023) | sm80+ (A100, L4, RTX 30xx on), fp16 or bf16 only; $d_k \le 256$ | **none** (`is_causal` only) | yes |
# | `EFFICIENT_ATTENTION` | the memory-efficient kernel (Rabe and Staats, 2021; xFormers): tiled | CUDA; float32, fp16, bf16 | bool or float | yes |
# | `CUDNN_ATTENTION` | cuDNN's fused attention | recent NVIDIA GPUs; fp16, bf16 | depends on the cuDNN version | depends on the version |
#
# So on a GPU a padding mask rules out the flash kernel (the efficient one takes it), float32
# rules out flash and cuDNN, and on the CPU dropout rules out flash, leaving the math backend.
# `torch.nn.attention.sdpa_kernel` restricts the choice, which lets us ask which backends run on
# this machine (a backend that cannot serve the call raises a `RuntimeError`; the warnings that
# explain why are silenced here):

# %%
import warnings

from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
# fp16 where a GPU is there (the flash kernel of CUDA wants it), float32 on the CPU
kernel_dtype = torch.float16 if device.type == "cuda" else torch.float32
Qk, Kk, Vk = make_qkv(1024, heads=4, dtype=kernel_dtype)
runs_here = {}
for name, backend in BACKENDS.items():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(Qk, Kk, Vk, is_causal=True)
            runs_here[name] = True
        except RuntimeError:
            runs_here[name] = False

# %% tags=["nbval-ignore-output"]
print(f"{device.type}, {kernel_dtype}: " + ", ".join(
    f"{name} {'runs' if ok else 'not available'}" for name, ok in runs_here.items()))

# %% [markdown]
# On a CPU, with torch 2.13, `math` and `flash` run (which backends a CPU build has is a
# property of the release, so only `math` is asserted). On a CUDA GPU `efficient` runs too; `flash` (FlashAttention-2)
# needs an Ampere or newer GPU (compute capability sm80+: A100, L4, RTX 30xx and later), so on
# Colab's free T4 (sm75) it is not available; `cudnn` needs a recent GPU and cuDNN as well. What
# holds everywhere:

# %%
# The math backend runs everywhere, so this checks the probe: one that failed for a reason of its
# own (a shape error is a RuntimeError too, and it catches those) would report no backend at all.
assert runs_here["math"]


# %% [markdown]
# The same question for the arguments, on this machine, for the flash backend against the
# math one: a causal call, a boolean and a float mask, dropout, bfloat16 inputs and a head
# size of 512:

# %%
def backend_runs(backend, dtype=kernel_dtype, d_k=64, **kwargs):
    """Whether F.scaled_dot_product_attention runs with only `backend` allowed."""
    q, k, v = make_qkv(128, d_k=d_k, heads=2, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
            return True
        except RuntimeError:
            return False


probe_mask = causal_mask(128, device=device)
probes = {"is_causal": {"is_causal": True}, "bool mask": {"attn_mask": probe_mask},
          "float mask": {"attn_mask": torch.zeros(128, 128, dtype=kernel_dtype, device=device)},
          "dropout 0.1": {"dropout_p": 0.1}, "bfloat16": {"dtype": torch.bfloat16},
          "d_k = 512": {"d_k": 512}}
probe_runs = {name: {b: backend_runs(BACKENDS[b], **kw) for b in ("math", "flash")}
              for name, kw in probes.items()}

# %% tags=["nbval-ignore-output"]
for name, ok in probe_runs.items():
    print(f"{name:>12}: " + ", ".join(f"{b} {'runs' if r else 'refuses'}" for b, r in ok.items()))

# %%
# Every probe's arguments are valid (the fallback takes them all): a "refuses" above is the flash
# backend's refusal, not a broken probe.
assert all(ok["math"] for ok in probe_runs.values())

# %% [markdown]
# On the CPU that stored these outputs the flash kernel took both masks, bfloat16 and
# $d_k = 512$, and refused only dropout: which is why the fast path of section 5 computes
# attention with dropout itself on a CPU. (On a CUDA GPU the rows differ, as the table says.)

# %% [markdown]
# Memory and time at $T = 2048$, four heads: the naive attention, ours tiled, and PyTorch's
# fused call (which picks its backend by itself):

# %%
Qm, Km, Vm = make_qkv(2048, heads=4)
candidates = {
    "naive (notebook 02)": lambda: naive_forward(Qm, Km, Vm),
    "tiled (ours)": lambda: tiled_forward(Qm, Km, Vm),
    "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(Qm, Km, Vm),
}
with torch.no_grad():
    kernel_mem = {name: peak_memory(fn, device) for name, fn in candidates.items()}
    kernel_time = {name: time_call(fn, warmup=1, repeats=3) for name, fn in candidates.items()}

# %% tags=["nbval-ignore-output"]
for name in candidates:
    print(f"{name:>31}: {kernel_mem[name] / MiB:6.1f} MiB, {1e3 * kernel_time[name]:7.1f} ms")
print(f"torch threads: {torch.get_num_threads()}")

# %% [markdown]
# On this course's CPU the fused kernel was both lean (a few MiB, like ours) and the fastest of
# the three, its tiles looped over in C++; ours came second, and the naive one last. They were
# timed with the threads PyTorch had (printed): one in the stored run, since the course's
# kernels run with `OMP_NUM_THREADS=1` (`tools/kernel.env`); elsewhere (on Colab, say) PyTorch's
# default is the number of cores. The training steps below set one thread themselves. The naive
# attention builds 64 MiB matrices (the scores and the weights of four heads at $T = 2048$)
# and passes over them element by element in its softmax; the tiled ones never build them.
# Where the naive attention's time goes, its matmuls or those element-wise passes, section 6
# measures with a profile. The memory part holds on any machine:

# %%
assert kernel_mem["tiled (ours)"] < kernel_mem["naive (notebook 02)"] / 8
assert kernel_mem["F.scaled_dot_product_attention"] < kernel_mem["naive (notebook 02)"] / 4

# %% [markdown]
# **Use `F.scaled_dot_product_attention` for speed; our `tiled_attention` is there to show what it
# does, and to check it.**
#
# ## 5 · The fast path of the course's model
#
# The from-scratch modules were written to be read: three projections, a softmax you can see,
# a `LayerNorm` in five lines. The **fast path** keeps every parameter where it is (`W_q`,
# `W_k`, `W_v`, `W_o`, the norms' `weight` and `bias`, so the same `state_dict`) and changes
# only how the forward pass computes:
#
# | piece | from scratch | fast path | why |
# |---|---|---|---|
# | projections | three matmuls, $W_q$, $W_k$, $W_v$ (each already holds all heads) | one, with the three concatenated into a $(3d, d)$ matrix (cross-attention: $W_k, W_v$ into $(2d, d)$); the heads are views of its output | one call instead of three, the same FLOPs |
# | attention | notebook 02's formula, $T \times T$ weights in memory | `F.scaled_dot_product_attention`; `is_causal=True` for the causal mask, so its kernel skips the tiles above the diagonal | a fused kernel (section 4) |
# | a row with no allowed key | zeros (notebook 05's policy) | the row opened to every key, its output then zeroed | PyTorch's CPU kernels give zeros (since torch 2.5); GPU kernels need not (appendix A) |
# | attention in training with dropout, on a CPU | as above | notebook 02's arithmetic, with the dropout below | the CPU flash kernel refuses dropout (section 4's probe), and the math backend would draw with `bernoulli_` |
# | layer norm | five operations | `F.layer_norm` | one kernel |
# | dropout on the attention weights, on a CPU | `F.dropout`: a mask from `bernoulli_` | `fast_dropout`: keep where $u \ge p$, $u \sim U[0, 1)$ | the same distribution, drawn as uniforms to save time (timed below); the weights are the model's largest dropout: $16 \cdot 4 \cdot 128^2$ numbers a layer for 16 sequences of 128 tokens and 4 heads, against $16 \cdot 128 \cdot 128$ for a sub-layer's output |
#
# Our boolean masks already mean what PyTorch's do (True: may attend), so they pass through,
# except the causal mask: `fused_attention_mask` recognises it (one $T \times T$ lower-triangular
# pattern, the same for every sequence and head) and passes `is_causal=True` instead.
#
# Where does the fast path live? Not in a second set of classes. Notebook 03 gave
# `MultiHeadAttention` a switch, `fast`, and notebook 06 gave `LayerNorm` one: each module computes
# its one function in two ways, as nanoGPT's attention does with `if self.flash:`. The blocks,
# the stacks and the model do not change at all: they call their attention, norm and dropout
# modules as before, so whatever a later notebook puts in place of a dropout module (notebook 15's
# DropPath) still runs. `LayerNorm`'s fast branch is one line, `F.layer_norm`, written in
# notebook 06. This section writes the attention's: the pieces first, then the method
# `fast_forward` that `MultiHeadAttention.forward` calls when `fast` is on. They go into the
# `attention` module, beside the from-scratch code.
#
# First the pieces. The `torch.compiler.is_compiling()` branches serve `torch.compile` (later in
# this section): a compiled graph cannot test the data of a mask, so there the code takes the
# plain arithmetic that is right for every mask.

# %%
#| export attention
import functools

from torch import Tensor


def fast_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout; on a CPU the mask is drawn as uniforms, faster than F.dropout's."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p == 1.0:  # on a GPU, F.dropout's fused kernel is the fast
        return F.dropout(x, p, True)  # one; p = 1 drops everything (no 1 / (1 - p) to scale by)
    keep = torch.rand_like(x).ge_(p).mul_(1.0 / (1.0 - p))  # 0 or 1 / (1 - p), like F.dropout
    return x * keep


def _causal_pattern(T: int, device: torch.device) -> Tensor:
    """(T, T) bool, True on and below the diagonal: our causal_mask without its leading dims."""
    if torch.compiler.is_compiling():  # torch.compile makes its own constant; no cache
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return _cached_causal_pattern(T, device)


@functools.lru_cache(maxsize=32)  # one (T, T) pattern per length and device, not one per call
def _cached_causal_pattern(T: int, device: torch.device) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def fused_attention_mask(mask: Tensor | None, T_q: int, T_k: int) -> tuple[Tensor | None, bool]:
    """Our mask as F.scaled_dot_product_attention's (attn_mask, is_causal) arguments."""
    if mask is None:
        return None, False
    if torch.compiler.is_compiling():  # no data-dependent test inside a compiled graph
        return mask, False
    # The causal mask is one (T, T) pattern shared by all sequences and heads: every leading
    # dim 1. Counting elements would not do: a padding mask (B, 1, 1, T) with B == T has T * T
    # of them too, and a batch sorted by length (lengths 1 .. T) reshapes to the causal pattern.
    if (
        mask.dtype == torch.bool
        and T_q == T_k
        and mask.shape[-2:] == (T_q, T_k)
        and all(size == 1 for size in mask.shape[:-2])
        and torch.equal(mask.reshape(T_q, T_k), _causal_pattern(T_q, mask.device))
    ):
        return None, True  # the causal mask: no tensor needed, and the kernel skips tiles
    return mask, False  # bool True = may attend, as ours; a float mask is added, as ours


# %% [markdown]
# The attention of the fast path, `fused_attention`: PyTorch's fused kernel when it can be, and
# on the CPU in training with dropout the same arithmetic as notebook 02 with the faster
# dropout. Both give zeros for a row with no allowed key.

# %%
#| export attention
def _attention_with_dropout(
    Q: Tensor, K: Tensor, V: Tensor, attn_mask: Tensor | None, is_causal: bool, p: float
) -> Tensor:
    """softmax(Q K^T / sqrt(d_k) + mask), `fast_dropout` on the weights, @ V: (B, h, T_q, d_k)."""
    scores = (Q * (1.0 / math.sqrt(Q.size(-1)))) @ K.transpose(-2, -1)  # (B, h, T_q, T_k)
    no_key = None
    if is_causal:
        T_q, T_k = scores.shape[-2:]
        scores = scores.masked_fill(~_causal_pattern(T_k, scores.device)[:T_q], -math.inf)
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
            blocked = ~attn_mask
        else:
            scores = scores + attn_mask
            blocked = torch.isneginf(attn_mask)
        no_key = blocked.all(dim=-1, keepdim=True)  # on the (small) mask, not on the scores
        if torch.compiler.is_compiling() or no_key.any():  # rows with no allowed key: zeros
            scores = scores.masked_fill(no_key, 0.0)
        else:
            no_key = None
    attn = torch.softmax(scores, dim=-1)
    if no_key is not None:
        attn = attn.masked_fill(no_key, 0.0)
    return fast_dropout(attn, p) @ V  # (B, h, T_q, T_k) @ (B, h, T_k, d_k)


def _open_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """The mask with every row that allows no key opened to all keys, and those rows (..., 1)."""
    blocked = ~mask if mask.dtype == torch.bool else torch.isneginf(mask)
    no_key = blocked.all(dim=-1, keepdim=True)  # (..., T_q or 1, 1), on the (small) mask
    opened = mask | no_key if mask.dtype == torch.bool else mask.masked_fill(no_key, 0.0)
    return opened, no_key


def fused_attention(
    Q: Tensor,  # (B, h, T_q, d_k)
    K: Tensor,  # (B, h, T_k, d_k)
    V: Tensor,  # (B, h, T_k, d_k)
    attn_mask: Tensor | None,  # from fused_attention_mask: None for no mask or the causal one
    is_causal: bool,
    dropout_p: float = 0.0,  # on the attention weights; 0 in evaluation
) -> Tensor:
    """Attention with PyTorch's fused kernel, rows with no allowed key zeroed: (B, h, T_q, d_k)."""
    if dropout_p > 0.0 and Q.device.type == "cpu":  # the flash kernel has no dropout on a CPU
        return _attention_with_dropout(Q, K, V, attn_mask, is_causal, dropout_p)
    no_key = None
    if attn_mask is not None:  # empty rows: zeros on every backend (some GPU kernels have
        attn_mask, no_key = _open_empty_rows(attn_mask)  # given NaN or non-zero values there)
    context = F.scaled_dot_product_attention(
        Q, K, V, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
    )  # (B, h, T_q, d_k)
    return context if no_key is None else context.masked_fill(no_key, 0.0)


# %% [markdown]
# And the method that `MultiHeadAttention.forward` hands over to when `fast` is on (notebook 03),
# given self-attention (`x_kv=None`) or cross-attention (`x_kv` the encoder's output): one packed
# projection, `fused_attention`, one output projection. `forward` has checked the inputs; the
# mask is checked here, against the number of keys. `add_to_class` adds it to the class, and the
# export puts it in the class body.

# %%
#| export attention
@add_to_class(MultiHeadAttention)
def fast_forward(self, x_q: Tensor, x_kv: Tensor | None, mask: Tensor | None) -> Tensor:
    """x_q (B, T_q, d) attends to x_kv (B, T_k, d), or to itself if x_kv is None: (B, T_q, d)"""
    B, T_q, d = x_q.shape
    T_k = T_q if x_kv is None else x_kv.size(1)
    if checking():
        self._check_mask(mask, B, T_q, T_k)
    attn_mask, is_causal = fused_attention_mask(mask, T_q, T_k)
    W_q, W_k, W_v = self.W_q, self.W_k, self.W_v
    has_bias = W_q.bias is not None
    # 1) Project with one packed matmul: (3d, d) for self-attention, (2d, d) for K, V.
    if x_kv is None:
        w = torch.cat([W_q.weight, W_k.weight, W_v.weight])  # (3d, d)
        b = torch.cat([W_q.bias, W_k.bias, W_v.bias]) if has_bias else None
        Q, K, V = F.linear(x_q, w, b).split(d, dim=-1)  # (B, T, 3d) -> 3 x (B, T, d)
    else:
        Q = F.linear(x_q, W_q.weight, W_q.bias)  # (B, T_q, d)
        w = torch.cat([W_k.weight, W_v.weight])  # (2d, d)
        b = torch.cat([W_k.bias, W_v.bias]) if has_bias else None
        K, V = F.linear(x_kv, w, b).split(d, dim=-1)  # 2 x (B, T_k, d)
    # (B, T, d) -> (B, T, h, d_k) -> (B, h, T, d_k): views of the packed output
    Q, K, V = (t.unflatten(-1, (self.num_heads, self.d_k)).transpose(1, 2) for t in (Q, K, V))
    # 2) Attend: fused, except for dropout in training on a CPU.
    p = self.dropout_p if self.training else 0.0
    context = fused_attention(Q, K, V, attn_mask, is_causal, p)  # (B, h, T_q, d_k)
    # 3) Concatenate the heads and mix them with W_o.
    context = context.transpose(1, 2).reshape(B, T_q, d)  # (B, h, T_q, d_k) -> (B, T_q, d)
    return F.linear(context, self.W_o.weight, self.W_o.bias)


# %% [markdown]
# The switch for a model that exists already. `use_fast_path` turns `fast` on (or off, with
# `enabled=False`) in every attention layer and norm of a model, in place: the parameters, the
# optimizer's references to them, the `state_dict` and the device stay as they are, and a
# `Transformer`'s `config` records the choice, so `Transformer(model.config)` builds the same.
# A model can also be built fast from the start: `Transformer(..., fast=True)`.

# %%
#| export
def use_fast_path(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every attention layer and norm of model to the fast path, in place; returns model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    check_bool("enabled", enabled)
    for module in model.modules():
        if isinstance(module, (MultiHeadAttention, LayerNorm)):
            module.fast = enabled
    if isinstance(getattr(model, "config", None), TransformerConfig):
        model.config = dataclasses.replace(model.config, fast=enabled)
    return model


# %% [markdown]
# ### Checks: the same model
#
# A model and a fast copy of it (`use_fast_path` on a deep copy), and the same model built fast
# from the start, `Transformer(12, 12, fast=True)` after the same seed: in both, every attention
# layer and norm must have its switch on (and the `config` must say so); the switch changes
# neither the initialisation nor the parameters' names, so the `state_dict` is the same, key for
# key and bit for bit. Then the same logits and the same gradients, with a causal target mask
# and a source padding mask with a fully padded sequence (compared in eval mode, where dropout is
# off: with dropout on, the two paths draw different random masks). On a CPU the fully padded
# sequence does not test the fast path's own handling of rows with no allowed key (open the row,
# zero its output): PyTorch's CPU kernels return zeros for such a row by themselves, so the check
# passes with that handling removed. It shows that the fast path computes the same model; the
# cell after it supplies a kernel that gets empty rows wrong, as some GPU kernels do (appendix A).

# %%
set_seed(0)
scratch_model = Transformer(12, 12).to(device)
fast_model = use_fast_path(copy.deepcopy(scratch_model))
switches = [m.fast for m in fast_model.modules() if isinstance(m, (MultiHeadAttention, LayerNorm))]
print(f"{sum(switches)} of {len(switches)} attention layers and norms on the fast path; "
      f"config.fast={fast_model.config.fast}; the blocks are still {type(fast_model.encoder.layers[0]).__name__}s")
assert all(switches) and fast_model.config.fast and not scratch_model.config.fast
set_seed(0)
built_fast = Transformer(12, 12, fast=True).to(device)
built_switches = [m.fast for m in built_fast.modules() if isinstance(m, (MultiHeadAttention, LayerNorm))]
assert len(built_switches) == len(switches) and all(built_switches) and built_fast.config.fast
state_s, state_f = scratch_model.state_dict(), built_fast.state_dict()
assert list(state_s) == list(state_f)
assert all(torch.equal(state_s[k], state_f[k]) for k in state_s)

gen = torch.Generator().manual_seed(0)
src = torch.randint(3, 12, (8, 10), generator=gen).to(device)  # (B, S)
tgt = torch.randint(3, 12, (8, 11), generator=gen).to(device)  # (B, T)
src_lengths = torch.tensor([10, 7, 3, 10, 0, 5, 10, 9], device=device)  # one fully padded
src_mask = padding_mask(src_lengths, 10)  # (B, 1, 1, S)
tgt_mask = causal_mask(11, device=device)  # (1, 1, T, T)
logits = {}
for name, mdl in (("scratch", scratch_model), ("fast", fast_model)):
    mdl.eval().zero_grad()
    logits[name] = mdl(src, tgt, src_mask, tgt_mask)  # (B, T, V)
    logits[name].square().mean().backward()
assert_close(logits["fast"], logits["scratch"], atol=1e-5, rtol=1e-5)
grads_fast = dict(fast_model.named_parameters())
for name, p in scratch_model.named_parameters():
    assert_close(grads_fast[name].grad, p.grad, atol=1e-5, rtol=1e-4)
print(f"logits and all {len(grads_fast)} gradients equal (to float32 rounding)")


# %% [markdown]
# A stand-in for `F.scaled_dot_product_attention` that returns finite, non-zero values for a row
# with no allowed key, as cuDNN's kernel did. Ours gets them by masking with a large finite
# number instead of $-\infty$, so that such a row averages all the values (how cuDNN gets its
# values we did not look into). With it in place, the fast path as written must still equal the
# from-scratch model, and the fast path without its handling (`_open_empty_rows` replaced by one
# that opens nothing, so that nothing is zeroed either) must not. The test suite runs the fast
# path against this stand-in and against one that returns NaN (`tests/test_efficient.py`). (How
# a replacement reaches the model, once for this notebook: a function looks a name up, when it
# runs, in the module where it was defined. `F.scaled_dot_product_attention` is replaced in the
# module `F`, through which `fused_attention` calls it; `_open_empty_rows` among the notebook's
# names, where the notebook's own `fused_attention` looks it up. The package's copy would not see
# the second. Two later checks replace a notebook name in the same way.)

# %%
def finite_kernel(Q, K, V, attn_mask=None, dropout_p=0.0, is_causal=False):
    """A stand-in for F.scaled_dot_product_attention (boolean masks only, no dropout) whose rows
    with no allowed key come out finite and non-zero: the mean of the values."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # (B, h, T_q, T_k)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -1e9)  # not -inf: an empty row stays finite
    return torch.softmax(scores, dim=-1) @ V  # (B, h, T_q, d_k)


real_kernel, real_open = F.scaled_dot_product_attention, _open_empty_rows
empty_rows_agree = {}
try:
    F.scaled_dot_product_attention = finite_kernel  # fused_attention calls it through F
    for name, opener in (("the fast path as written", real_open),
                         ("the fast path without its handling", lambda mask: (mask, None))):
        _open_empty_rows = opener
        with torch.no_grad():
            stand_in_logits = fast_model(src, tgt, src_mask, tgt_mask)  # (B, T, V)
        empty_rows_agree[name] = torch.allclose(stand_in_logits, logits["scratch"], atol=1e-5, rtol=1e-5)
finally:
    F.scaled_dot_product_attention, _open_empty_rows = real_kernel, real_open
for name, agrees in empty_rows_agree.items():
    print(f"stand-in kernel, {name}: {'equals' if agrees else 'differs from'} the from-scratch model")
assert list(empty_rows_agree.values()) == [True, False]

# %% [markdown]
# Equal outputs do not show that the fused kernel computed them: a `use_fast_path` that switched
# nothing on, or a `fast_forward` that called the from-scratch attention, would pass the
# comparison of logits and gradients above. A profile of one forward pass in evaluation mode shows which operators ran: in the fast
# model, every attention module must call PyTorch's `scaled_dot_product_attention` and its
# backend (whose operator names contain `scaled_dot_product`; which backend depends on the
# device and the release), and no softmax of its own; the from-scratch model, the broken
# variant, calls no such operator and one softmax per attention module:

# %%
from torch.profiler import ProfilerActivity
from torch.profiler import profile

from transformer_from_scratch.measure import stderr_silenced


def operator_calls(model):
    """{operator: number of calls} in one forward pass of model in evaluation mode."""
    with torch.no_grad(), stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model.eval()(src, tgt, src_mask, tgt_mask)  # some releases print the profiler's start
    return {event.key: event.count for event in prof.key_averages()}  # and stop to stderr


n_attention = sum(isinstance(m, MultiHeadAttention) for m in fast_model.modules())
kernel_calls = {}
for name, mdl in (("from scratch", scratch_model), ("fast path", fast_model)):
    calls_made = operator_calls(mdl)
    kernel_calls[name] = (sum(n for op, n in calls_made.items() if "scaled_dot_product" in op),
                          calls_made.get("aten::_softmax", 0))  # the softmax kernel
    print(f"{name:>12}: {n_attention} attention modules; operators named *scaled_dot_product*: "
          f"{'some' if kernel_calls[name][0] else 'none'}; "
          f"softmax kernel calls: {kernel_calls[name][1]}")
assert kernel_calls["fast path"][0] >= n_attention and kernel_calls["fast path"][1] == 0
assert kernel_calls["from scratch"] == (0, n_attention)  # the check tells the two apart

# %% [markdown]
# `fused_attention_mask` must take the causal mask, and nothing else, for `is_causal=True`. A
# batch sorted by length, as notebook 13's bucketing makes them, can look like it: $B = T$
# sequences of lengths $1, 2, \dots, T$ have a padding mask $(T, 1, 1, T)$ whose $T^2$ elements,
# read in order, are exactly the causal pattern. A test of the elements alone (an earlier version
# of `fused_attention_mask` compared the mask's element count, not its shape) takes this mask for
# the causal one, and the fast path then computes causal attention where padding attention was
# asked for. The check: the mask holds the pattern, `fused_attention_mask` keeps it as a mask, the
# fast model equals the from-scratch one on such a batch, and the broken reading is far off:

# %%
T_sorted = 10
sorted_gen = torch.Generator().manual_seed(2)
sorted_mask = padding_mask(torch.arange(1, T_sorted + 1), T_sorted).to(device)  # (B, 1, 1, B)
src_sorted = torch.randint(3, 12, (T_sorted, T_sorted), generator=sorted_gen).to(device)  # (B, S)
tgt_sorted = torch.randint(3, 12, (T_sorted, 11), generator=sorted_gen).to(device)  # (B, T)
looks_causal = sorted_mask.numel() == T_sorted**2 and torch.equal(  # the broken test: elements only
    sorted_mask.reshape(T_sorted, T_sorted), causal_mask(T_sorted, device=device)[0, 0])
sorted_attn_mask, sorted_is_causal = fused_attention_mask(sorted_mask, T_sorted, T_sorted)
assert looks_causal and sorted_attn_mask is sorted_mask and not sorted_is_causal
with torch.no_grad():
    sorted_logits = {name: mdl.eval()(src_sorted, tgt_sorted, sorted_mask, tgt_mask)
                     for name, mdl in (("scratch", scratch_model), ("fast", fast_model))}
    assert_close(sorted_logits["fast"], sorted_logits["scratch"], atol=1e-5, rtol=1e-5)
    Q_s, K_s, V_s = (torch.randn(T_sorted, 4, T_sorted, 32, generator=sorted_gen).to(device)
                     for _ in range(3))  # (B, h, S, d_k)
    padded_attention, _ = scaled_dot_product_attention(Q_s, K_s, V_s, mask=sorted_mask)
    assert_close(fused_attention(Q_s, K_s, V_s, sorted_attn_mask, sorted_is_causal),
                 padded_attention, atol=1e-5, rtol=1e-5)
    taken_for_causal = fused_attention(Q_s, K_s, V_s, None, True)  # what the broken test ran
assert (taken_for_causal - padded_attention).abs().max() > 0.5
print(f"lengths 1..{T_sorted}, B = {T_sorted}: the padding mask holds the causal pattern "
      f"({looks_causal}) and stays a mask; the fast model equals the from-scratch one; "
      "read as causal, the attention would be wrong by more than 0.5")

# %% [markdown]
# That was evaluation mode. With dropout on, the two models cannot agree number for number: they
# draw different masks. So the check of training mode comes in three parts. First, with
# `dropout_p=0`, training mode must give the same logits and gradients. This is a small check:
# with $p = 0$ the fast path hands `fused_attention` a dropout of 0, so it runs the same fused
# kernel as in evaluation, not its CPU dropout branch; it shows only that nothing else in the
# two models changes with the mode. The dropout itself (its rate, below) and the CPU dropout
# branch (its arithmetic, after that) are checked separately:

# %%
set_seed(0)
scratch_p0 = Transformer(12, 12, dropout_p=0.0).to(device).train()
fast_p0 = use_fast_path(copy.deepcopy(scratch_p0)).train()
logits_p0 = {}
for name, mdl in (("scratch", scratch_p0), ("fast", fast_p0)):
    mdl.zero_grad()
    logits_p0[name] = mdl(src, tgt, src_mask, tgt_mask)  # (B, T, V), in training mode
    logits_p0[name].square().mean().backward()
assert scratch_p0.training and fast_p0.training
assert_close(logits_p0["fast"], logits_p0["scratch"], atol=1e-5, rtol=1e-5)
grads_fast_p0 = dict(fast_p0.named_parameters())
for name, p in scratch_p0.named_parameters():
    assert_close(grads_fast_p0[name].grad, p.grad, atol=1e-5, rtol=1e-4)
print(f"training mode, dropout 0: logits and all {len(grads_fast_p0)} gradients equal")

# %% [markdown]
# With dropout on, the two attentions must drop the same *fraction* of the weights, $p$, and
# scale the survivors by $1/(1-p)$. A setting that makes the dropped weights visible in the
# output: $Q = K = 0$ makes every weight $1/T$, and $V = [\,I \mid \mathbf{1}\,]$ (the
# $T \times T$ identity and a column of ones) copies the weights into the first $T$ outputs of a
# row, so that an output there is zero exactly where a weight was dropped, and sums them into the
# last one. Over $n$ weights the dropped fraction has a standard deviation of $\sqrt{p(1-p)/n}$;
# the check allows six of them, which a correct dropout exceeds with a probability of about
# $2 \cdot 10^{-9}$, whatever the seed. The last output tells dropout on the *weights* from
# dropout on the *output* (the context), which the first two tests cannot: with the weights
# dropped it is the sum of the row's other outputs; with the output dropped it is dropped on its
# own (0 or $1/(1-p)$), whatever happened to the other outputs:

# %%
p_drop, T_d = 0.1, 64
Q_d = torch.zeros(2, 4, T_d, T_d + 1, device=device)  # every score 0: every weight 1 / T_d
V_d = torch.cat([torch.eye(T_d), torch.ones(T_d, 1)], dim=1).to(device).expand(2, 4, T_d, T_d + 1)
torch.manual_seed(0)
dropped_by = {
    "fast path (fused_attention)": fused_attention(Q_d, Q_d, V_d, None, False, dropout_p=p_drop),
    "from scratch (notebook 02)": scaled_dot_product_attention(Q_d, Q_d, V_d, dropout_p=p_drop,
                                                               training=True)[0],
}
# the broken variant: attention without dropout, then dropout on its output, the context
dropped_output = F.dropout(fused_attention(Q_d, Q_d, V_d, None, False), p_drop, training=True)
n_weights = 2 * 4 * T_d * T_d  # (batch, heads, queries, keys)
drop_sd = math.sqrt(p_drop * (1 - p_drop) / n_weights)
drop_fraction = {name: (out[..., :T_d] == 0).float().mean().item()
                 for name, out in (*dropped_by.items(), ("dropout on the output", dropped_output))}


def sums_the_kept_weights(out):
    """Whether each row's last output, through V's column of ones, is the sum of its others."""
    return torch.allclose(out[..., T_d], out[..., :T_d].sum(dim=-1), atol=1e-6, rtol=1e-5)


# %% tags=["nbval-ignore-output"]
for name, fraction in drop_fraction.items():
    dropped_what = "outputs" if name == "dropout on the output" else "weights"
    print(f"{name}: dropped {fraction:.4f} of the {dropped_what} (p = {p_drop}, "
          f"standard deviation {drop_sd:.4f})")
row_sums = dropped_by["fast path (fused_attention)"][..., T_d]  # (2, 4, T_d): one per row
print(f"fast path, last outputs: {row_sums.unique().numel()} different values, from "
      f"{row_sums.min().item():.3f} to {row_sums.max().item():.3f}")

# %%
for name, out in (*dropped_by.items(), ("dropout on the output", dropped_output)):
    weights_out = out[..., :T_d]  # (2, 4, T_d, T_d): the weights as dropped
    assert abs(drop_fraction[name] - p_drop) < 6 * drop_sd, name
    kept = weights_out[weights_out != 0]  # survivors: (1 / T_d) / (1 - p)
    assert_close(kept, torch.full_like(kept, 1 / T_d / (1 - p_drop)))
    assert sums_the_kept_weights(out) == (name != "dropout on the output"), name
print("dropout on the weights (both attentions): each row's last output is the sum of its kept "
      "weights; dropout on the output: it is not, and takes only the values "
      f"{sorted(round(x, 3) for x in dropped_output[..., T_d].unique().tolist())}")

# %% [markdown]
# The path that training on a CPU takes with dropout on is the other branch of
# `fused_attention`, the arithmetic of notebook 02 with the faster dropout. **Check** it against
# notebook 02's function with a dropout probability that almost surely drops nothing ($10^{-12}$:
# only a uniform of exactly 0 falls below it, which `torch.rand` draws with a probability of
# $2^{-24}$ per number), so that the two must agree, for a padding, a causal, a combined and a
# float mask:

# %%
Q_c, K_c, V_c = (torch.randn(2, 4, 9, 16, generator=gen).to(device) for _ in range(3))
pad_c = padding_mask(torch.tensor([9, 0]), 9).to(device)  # the second row of keys: all padding
float_c = torch.randn(2, 1, 9, 9, generator=gen).to(device)
for name, ours_mask, is_causal in (("padding", pad_c, False), ("causal", None, True),
                                   ("causal + padding", pad_c & causal_mask(9, device=device), False),
                                   ("float", float_c, False)):
    reference_mask = causal_mask(9, device=device) if is_causal else ours_mask
    expected, _ = scaled_dot_product_attention(Q_c, K_c, V_c, mask=reference_mask)
    got = fused_attention(Q_c.cpu(), K_c.cpu(), V_c.cpu(), None if ours_mask is None else ours_mask.cpu(),
                          is_causal, dropout_p=1e-12)  # the CPU branch, with dropout on
    assert_close(got, expected.cpu(), atol=1e-6, rtol=1e-5, msg=name)
print("the CPU training branch (dropout on): equal to notebook 02's attention for all four masks")

# %% [markdown]
# Two checks of the dispatch, which hold by construction: when the attention weights are
# requested, or a KV cache is passed (notebook 12), a module with `fast` on runs the from-scratch
# attention. So the attention's output and weights are bit for bit the same; in cached decoding
# the fast model's norms still take `F.layer_norm`, so what is compared there is the tokens
# decoded. They show that the hand-over works, not that the fast path is right:

# %%
from transformer_from_scratch.decoding import greedy_decode

x_test = torch.randn(2, 5, 128, generator=gen).to(device)
out_s, attn_s = scratch_model.decoder.layers[0].self_attn(x_test, return_attn=True)
out_f, attn_f = fast_model.decoder.layers[0].self_attn(x_test, return_attn=True)
assert torch.equal(out_f, out_s) and torch.equal(attn_f, attn_s)
decoded_cached = greedy_decode(scratch_model, src, max_new_tokens=12, src_mask=src_mask, use_cache=True).tokens
assert torch.equal(greedy_decode(fast_model, src, max_new_tokens=12, src_mask=src_mask, use_cache=True).tokens,
                   decoded_cached)
assert not use_fast_path(copy.deepcopy(fast_model), enabled=False).encoder.norm.fast
print("weights on request and cached decoding: handed over to the from-scratch code")

# %% [markdown]
# The fast path's own decoding: greedy decoding *without* the cache runs the whole prefix
# through the fast decoder at every step, with a causal mask that grows by one position each
# time, which `fast_forward` must hand the kernel as `is_causal=True`, with no mask tensor. It
# must produce the tokens of the from-scratch model, with or without its cache. The cell below
# records the arguments of every call that the first decoder layer's self-attention makes to
# `fused_attention`. Tokens alone cannot show the causal kernel at work: a `fast_forward` that
# handed on the mask tensor instead (here: `fused_attention_mask` replaced by one that keeps
# every mask) computes the same attention and decodes the same tokens; only the recorded
# arguments tell the two apart. (The replacements reach `fast_forward` as `_open_empty_rows`
# reached `fused_attention` above: it was defined in this notebook.)

# %%
fast_self_attn = fast_model.decoder.layers[0].self_attn
real_fused_attention, real_fused_attention_mask = fused_attention, fused_attention_mask


def decode_recording(mask_reader):
    """Fast-path greedy decoding (no cache) with mask_reader in place of fused_attention_mask:
    the tokens, and (no mask tensor?, is_causal) of each call that the first decoder layer's
    self-attention makes to fused_attention."""
    global fused_attention, fused_attention_mask
    received, inside = [], []

    def recording_fused_attention(Q, K, V, attn_mask, is_causal, dropout_p=0.0):
        if inside:  # called from the first decoder layer's self-attention
            received.append((attn_mask is None, is_causal))
        return real_fused_attention(Q, K, V, attn_mask, is_causal, dropout_p)

    def marked_fast_forward(x_q, x_kv, mask):
        inside.append(True)
        try:
            return type(fast_self_attn).fast_forward(fast_self_attn, x_q, x_kv, mask)
        finally:
            inside.pop()

    fused_attention, fused_attention_mask = recording_fused_attention, mask_reader
    fast_self_attn.fast_forward = marked_fast_forward  # an instance attribute: only this layer
    try:
        tokens = greedy_decode(fast_model, src, max_new_tokens=12, src_mask=src_mask).tokens
    finally:
        fused_attention, fused_attention_mask = real_fused_attention, real_fused_attention_mask
        del fast_self_attn.fast_forward
    return tokens, received


decoded_scratch = greedy_decode(scratch_model, src, max_new_tokens=12, src_mask=src_mask).tokens
decoded_fast, received = decode_recording(real_fused_attention_mask)
assert len(received) == decoded_fast.shape[1] - 1 > 0  # one call per generated token
assert all(no_tensor and is_causal for no_tensor, is_causal in received), received
assert torch.equal(decoded_fast, decoded_scratch) and torch.equal(decoded_fast, decoded_cached)
decoded_kept, received_kept = decode_recording(lambda mask, T_q, T_k: (mask, False))  # broken
assert torch.equal(decoded_kept, decoded_scratch)  # the same tokens: they cannot tell
assert not any(is_causal for _, is_causal in received_kept)  # the arguments can
print(f"fast-path greedy decoding: {decoded_fast.shape[1] - 1} tokens per sequence, the same as "
      f"the from-scratch model's; layer 0's self-attention: {len(received)} calls, "
      f"{sum(a and c for a, c in received)} of them with is_causal=True and no mask tensor")
print(f"with every mask handed on as a tensor: the same tokens, "
      f"{sum(c for _, c in received_kept)} of {len(received_kept)} calls with is_causal=True")

# %% [markdown]
# ### How much faster?
#
# Piece by piece first. The faster dropout draws other random numbers than `F.dropout`, so its
# rate and scale are checked before it is timed, on the CPU (where `fast_dropout` is ours; on a
# GPU it hands over to `F.dropout`), on attention weights of 16 sequences × 4 heads × 128 × 128:

# %%
weights_cpu = torch.rand(16, 4, 128, 128, generator=gen)  # on the CPU: there fast_dropout is ours
torch.manual_seed(0)  # fast_dropout draws from the global generator, as F.dropout does
dropped = fast_dropout(weights_cpu, 0.1)
kept = dropped != 0
print(f"kept {kept.float().mean().item():.2f} of the weights (expected 0.9), "
      f"survivors scaled by {(dropped[kept] / weights_cpu[kept]).mean().item():.4f} (1 / 0.9 = 1.1111)")
assert abs(kept.float().mean().item() - 0.9) < 0.002
assert_close(dropped[kept], weights_cpu[kept] / 0.9)
assert torch.equal(fast_dropout(weights_cpu, 0.1, training=False), weights_cpu)

# %% [markdown]
# Then each piece of the fast path against the from-scratch code it replaces, forward only, on
# 8 sequences of 128 tokens ($d = 128$, 4 heads), one thread, in turns (five rounds of three
# calls, the median of all fifteen): the projections (three matmuls, or one with the weights
# concatenated in the call, as `fast_forward` does), causal attention (notebook 02's, or
# `fused_attention`), layer norm (five operations, or `F.layer_norm`) and dropout on the
# attention weights:

# %% tags=["nbval-ignore-output"]
x_piece = torch.randn(8, 128, 128, generator=gen).to(device)  # (B, T, d)
W_piece = (fast_self_attn.W_q, fast_self_attn.W_k, fast_self_attn.W_v)  # (d, d) each
Q_p, K_p, V_p = (torch.randn(8, 4, 128, 32, generator=gen).to(device) for _ in range(3))
causal_p = causal_mask(128, device=device)  # (1, 1, T, T)
norm_scratch, norm_fast = LayerNorm(128).to(device), LayerNorm(128, fast=True).to(device)
weights = weights_cpu[:8].to(device)  # (B, h, T, T)
pieces = {  # name: (from scratch, fast path)
    "projections Q, K, V": (
        lambda: torch.cat([F.linear(x_piece, w.weight, w.bias) for w in W_piece], dim=-1),
        lambda: F.linear(x_piece, torch.cat([w.weight for w in W_piece]),
                         torch.cat([w.bias for w in W_piece]))),  # (B, T, 3d) both
    "causal attention": (lambda: scaled_dot_product_attention(Q_p, K_p, V_p, mask=causal_p)[0],
                         lambda: fused_attention(Q_p, K_p, V_p, None, True)),  # (B, h, T, d_k)
    "layer norm": (lambda: norm_scratch(x_piece), lambda: norm_fast(x_piece)),
    "dropout on the weights": (lambda: F.dropout(weights, 0.1), lambda: fast_dropout(weights, 0.1)),
}
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    with torch.no_grad():
        for scratch_fn, fast_fn in pieces.values():  # warm-up
            scratch_fn(), fast_fn()
        piece_turns = [{name: ([time_call(a, warmup=0, repeats=1) for _ in range(3)],
                               [time_call(b, warmup=0, repeats=1) for _ in range(3)])
                        for name, (a, b) in pieces.items()} for _ in range(5)]  # fmt: skip
finally:
    torch.set_num_threads(threads)
piece_time = {name: [sorted(t for turn in piece_turns for t in turn[name][k])[7] for k in (0, 1)]
              for name in pieces}  # medians of 15 calls: (from scratch, fast path)
for name, (t_scratch, t_fast) in piece_time.items():
    print(f"{name:>22}: from scratch {1e3 * t_scratch:6.2f} ms, fast path {1e3 * t_fast:6.2f} ms "
          f"({t_fast / t_scratch:.2f} of the time)")

# %% [markdown]
# The check: the same work on both sides (all but dropout compute the same numbers). This checks
# the timed pairs, which are written out in the cell above: the projections' pair repeats
# `fast_forward`'s packing rather than calling it (that method's own packing is checked by the
# model's logits and gradients at the start of this section). Then, on x86-64 CPUs, where we
# measured it, the fused attention and `F.layer_norm` must be faster than the code they replace;
# in our runs they took from about a twentieth to 0.6 of its time, so the bound holds with a
# margin. The other two pieces are not asserted faster: the faster dropout took
# from about a tenth to all of `F.dropout`'s time in our runs on a busy machine, and the packed
# projections, the same FLOPs in one call instead of three, moved to either side of 1.

# %%
with torch.no_grad():
    for name, (scratch_fn, fast_fn) in pieces.items():
        if name != "dropout on the weights":  # equal work for the timing, pair by pair
            assert_close(fast_fn(), scratch_fn(), atol=1e-5, rtol=1e-5, msg=name)
# The bounds on rates of time in this notebook were measured on x86-64 CPUs only (AVX2 and
# AVX-512); an Arm CPU's matrix library (on a Mac, Apple's) or a GPU may move them.
X86_CPU = device.type == "cpu" and platform.machine().lower() in {"x86_64", "amd64"}
if X86_CPU:
    for name in ("causal attention", "layer norm"):
        assert piece_time[name][1] < piece_time[name][0], (name, piece_time[name])


# %% [markdown]
# Then one training step of the model: forward, loss, backward, gradient clipping and an Adam
# step, on the reversal task of notebook 11 (a batch of 64 sources of 8 symbols), for the
# from-scratch model, its fast path, and `nn.Transformer` holding the same weights
# (`TorchTransformer` of notebook 10), in training mode with dropout 0.1, one thread.
#
# A comparison of speed is fair only if both sides do the same work. `nn.TransformerEncoderLayer`
# (and the decoder layer) computes its feed-forward as `linear2(dropout(activation(linear1(x))))`:
# one dropout more per layer than ours, which is `Linear`, activation, `Linear` (notebook 07):
# here four extra dropout masks a step, each over the hidden activations (512 encoder or 576 decoder tokens × 512). So
# the reference here, as in `make bench`, is `nn.Transformer` with that inner dropout replaced
# by `nn.Identity`; the check below counts the dropout sites of each model and compares their
# outputs in evaluation mode.

# %%
def reversal_batch(batch, src_len, vocab_size=12, seed=0):
    """Random sources (B, S) of symbols 3.., tgt_in = [BOS, reversed], tgt_out = [reversed, EOS]."""
    g = torch.Generator().manual_seed(seed)
    src_ids = torch.randint(EOS + 1, vocab_size, (batch, src_len), generator=g)
    reversed_ids = src_ids.flip(1)
    tgt_in = torch.cat([torch.full((batch, 1), BOS), reversed_ids], dim=1)
    tgt_out = torch.cat([reversed_ids, torch.full((batch, 1), EOS)], dim=1)
    return src_ids.to(device), tgt_in.to(device), tgt_out.to(device)


def make_train_step(model, src_ids, tgt_in, tgt_out, fused=False):
    """A closure: one training step (forward, loss, backward, clip, Adam); returns the loss.
    fused=True: Adam's one-kernel update (section 6)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=fused)
    mask = causal_mask(tgt_in.size(1), device=tgt_in.device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = model(src_ids, tgt_in, tgt_mask=mask)  # (B, T, V)
        loss = F.cross_entropy(out.flatten(0, 1), tgt_out.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    return step


set_seed(0)
bench_scratch = Transformer(12, 12).to(device).train()
bench_torch = TorchTransformer(bench_scratch).train()  # nn.Transformer with our weights
torch_layers = [*bench_torch.transformer.encoder.layers, *bench_torch.transformer.decoder.layers]
for layer in torch_layers:
    layer.dropout = nn.Identity()  # the dropout inside its feed-forward: ours has none
bench_fast = use_fast_path(copy.deepcopy(bench_scratch)).train()
train_batch = reversal_batch(64, 8)

# %% [markdown]
# **Check** that the three do the same work before timing them: as many dropout sites in each
# (dropout modules, and attention modules that drop weights), and equal outputs with dropout
# off.

# %%
#| export measure
from torch import nn

from transformer_from_scratch.attention import MultiHeadAttention


def dropout_sites(model: nn.Module) -> int:
    """How many places apply dropout with p > 0 in training mode (each module counted once):
    every nn.Dropout with p > 0, and every attention module that drops attention weights (our
    MultiHeadAttention's dropout_p, nn.MultiheadAttention's dropout)."""
    sites = 0
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            sites += m.p > 0
        elif isinstance(m, nn.MultiheadAttention):
            sites += m.dropout > 0
        elif isinstance(m, MultiHeadAttention):
            sites += m.dropout_p > 0
    return int(sites)


# %%
sites = {name: dropout_sites(m) for name, m in
         (("from scratch", bench_scratch), ("fast path", bench_fast), ("nn.Transformer", bench_torch))}
print("dropout sites:", sites, "- as PyTorch ships it:", sites["nn.Transformer"] + len(torch_layers))
assert len(set(sites.values())) == 1  # the same work: as many dropouts in each model
src_ids, tgt_in, _ = train_batch
with torch.no_grad():  # and the same function: equal outputs with dropout off
    eval_out = [m.eval()(src_ids, tgt_in, tgt_mask=causal_mask(tgt_in.size(1), device=device))
                for m in (bench_scratch, bench_fast, bench_torch)]
for m in (bench_scratch, bench_fast, bench_torch):
    m.train()
for out in eval_out[1:]:
    torch.testing.assert_close(out, eval_out[0], atol=1e-4, rtol=1e-4)

# %%
# Steps of copies: the three models stay as the cell above checked them, equal, if it is re-run.
steps = {name: make_train_step(copy.deepcopy(m), *train_batch) for name, m in
         (("from scratch", bench_scratch), ("fast path", bench_fast), ("nn.Transformer", bench_torch))}
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    for step in steps.values():  # warm-up
        step(), step()
    # In turns, five rounds, the median of each: a burst of other work slows all three alike.
    turns = [{name: time_call(step, warmup=0, repeats=1) for name, step in steps.items()}
             for _ in range(5)]  # fmt: skip
    step_time = {name: sorted(turn[name] for turn in turns)[len(turns) // 2] for name in steps}
finally:
    torch.set_num_threads(threads)

# %% tags=["nbval-ignore-output"]
for name, seconds in step_time.items():
    print(f"{name:>15}: {1e3 * seconds:6.1f} ms per step, "
          f"{seconds / step_time['nn.Transformer']:.2f} of nn.Transformer")

# %% [markdown]
# The ratios above are one run on this course's shared 2-core machine and move from run to run,
# so the notebook makes no claim about their order (appendix E lists the range we saw of every
# such number); `make bench` (section 8) measures them properly. The three are timed in turns
# (medians of five rounds), so that a burst of other work slows all three rather than one. A
# notebook cannot assert a time; it asserts a generous bound on the ratio, and a finite loss
# from each step:

# %%
assert step_time["fast path"] < 1.5 * step_time["nn.Transformer"]
assert all(math.isfinite(step()) for step in steps.values())

# %% [markdown]
# Why are the three so close, when the pieces are faster? At this shape, nine positions, what the
# fast path replaces is a small part of a step: attention's two matmuls are 1.4 % of its FLOPs
# (section 6). The largest part is the matmuls of the projections, the feed-forward and their
# gradients (over half of the operators' own time, in the profile below), the same arithmetic in
# all three models, so whatever one model saves elsewhere is a fraction of a step. Against
# `nn.Transformer` as PyTorch ships it, with its extra dropout, the fast path looks better by
# about a tenth of a step (`train_step_ratio_fast_vs_shipped`, section 8), but that tenth is work
# we skip, not speed we gained.
#
# ### Where a step's time goes
#
# *This subsection is measurement detail (its one new tool, `operator_times`, profiles a call;
# section 6 uses it again): on a first reading, skip to `torch.compile` below.*
#
# The course's goal for the fast path is a step at most 0.85 of `nn.Transformer`'s. Two runs of
# `make bench` on two of our 2-core machines (quoted in section 8) measured 0.79 to 1.02 at equal
# work over four shapes and thread counts: of those eight ratios, one met the goal. A profile says
# why, and what would close the gap. `torch.profiler` records every operator a step calls with
# its *self* time (the time in the operator itself, not in those it calls); we sum it over five
# steps of each model, one thread, and group the operators: the matmuls (`mm`, `addmm`, `bmm`
# and their batched forms), the random numbers of dropout (`uniform_`, `bernoulli_`), copies
# (`copy_`, `cat`), and the rest.

# %%
#| export measure
from collections.abc import Callable

from transformer_from_scratch.checks import check_int
from transformer_from_scratch.measure import stderr_silenced


def operator_times(fn: Callable[[], object], repeats: int = 5, warmup: int = 2) -> dict[str, float]:
    """Self CPU time of each operator fn() calls, in ms per call of fn: {name: ms}.

    torch.profiler records every operator with its *self* time (not counting the operators it
    calls), summed over `repeats` calls after `warmup` untimed ones; the profiler's own start and
    stop messages, which some torch versions print to stderr, are silenced."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    check_int("repeats", repeats, minimum=1)
    check_int("warmup", warmup, minimum=0)
    for _ in range(warmup):
        fn()
    prof = profile(activities=[ProfilerActivity.CPU])
    with stderr_silenced():
        prof.start()
    try:
        for _ in range(repeats):
            fn()
    finally:
        with stderr_silenced():
            prof.stop()
    return {e.key: e.self_cpu_time_total / repeats / 1e3 for e in prof.key_averages()}


# %% tags=["nbval-ignore-output"]
GROUPS = {
    "matmul": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"},
    "dropout's random numbers": {"aten::uniform_", "aten::bernoulli_"},
    "copies": {"aten::copy_", "aten::cat"},
}


def profile_step(model):
    """Self CPU time (ms per step) of each operator of a training step of a copy of model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return operator_times(make_train_step(copy.deepcopy(model), *train_batch))
    finally:
        torch.set_num_threads(threads)


# Three interleaved rounds, the smallest time of each operator: a profile on a busy machine moves
# from run to run, and the smallest is the one least disturbed by other programs.
rounds = [{name: profile_step(m) for name, m in (("fast path", bench_fast), ("nn.Transformer", bench_torch))}
          for _ in range(3)]
profiles = {name: {op: min(r[name].get(op, 0.0) for r in rounds) for op in rounds[0][name]}
            for name in rounds[0]}
by_group = {}
for name, ops in profiles.items():
    grouped = {g: sum(ops.get(op, 0.0) for op in members) for g, members in GROUPS.items()}
    grouped["everything else"] = sum(ops.values()) - sum(grouped.values())
    by_group[name] = grouped
print(f"{'ms per step (one thread)':<28}{'fast path':>10}{'nn.Transformer':>16}")
for group in by_group["fast path"]:
    print(f"{group:<28}{by_group['fast path'][group]:>10.1f}{by_group['nn.Transformer'][group]:>16.1f}")
totals = {name: sum(g.values()) for name, g in by_group.items()}
print(f"{'the whole step':<28}{totals['fast path']:>10.1f}{totals['nn.Transformer']:>16.1f}")
print("copies, by operator: " + "; ".join(
    f"{name} " + ", ".join(f"{op[6:]} {ops.get(op, 0.0):.1f}" for op in sorted(GROUPS["copies"], reverse=True))
    for name, ops in profiles.items()))
floor = by_group["fast path"]["matmul"] / totals["nn.Transformer"]
needed = totals["fast path"] - 0.85 * totals["nn.Transformer"]  # ms of operators' own time
needed_wall = 1e3 * (step_time["fast path"] - 0.85 * step_time["nn.Transformer"])  # ms, timed


def to_shed(ms):
    return f"{ms:.1f} ms" if ms > 0 else f"nothing ({-ms:.1f} ms to spare)"


print(f"the matmuls' share of the step: fast path {by_group['fast path']['matmul'] / totals['fast path']:.2f}, "
      f"nn.Transformer {by_group['nn.Transformer']['matmul'] / totals['nn.Transformer']:.2f}")
print(f"fast / torch: {totals['fast path'] / totals['nn.Transformer']:.2f} (matmuls alone: "
      f"{by_group['fast path']['matmul'] / by_group['nn.Transformer']['matmul']:.2f}); its matmuls "
      f"alone would be {floor:.2f} of torch's step")
print(f"to reach 0.85 of torch's step, the fast path must shed: by the profile, {to_shed(needed)} "
      f"of operators' own time; by the timing above, {to_shed(needed_wall)} of wall-clock time")
print(f"the fast path's step: {totals['fast path']:.1f} ms of operators' own time in the profile, "
      f"{1e3 * step_time['fast path']:.1f} ms of wall-clock time in the timing above")
for name, ops in profiles.items():
    top = sorted(((ms, op) for op, ms in ops.items() if op.startswith("aten::")), reverse=True)[:6]
    print(f"{name}, the largest operators:", ", ".join(f"{op[6:]} {ms:.1f}" for ms, op in top))

# %%
# The profile records CPU time: on a GPU that is the kernels' launch, not their run, and there
# the fast path's dropout is F.dropout's (no uniform_), so these checks are for a CPU only; the
# bounds on shares of time, as those on the pieces' times, for an x86-64 CPU (X86_CPU, above).
if device.type == "cpu":
    for name, grouped in by_group.items():  # the matmuls are a large share of the step in both
        assert not X86_CPU or grouped["matmul"] > 0.3 * sum(grouped.values()), (name, grouped)
    # and the two models do the same matmul work: their matmul times agree within a factor 2 (on a
    # machine busy with other work, one robustness run measured 1.6)
    matmul_ms = [grouped["matmul"] for grouped in by_group.values()]
    assert max(matmul_ms) < 2 * min(matmul_ms), matmul_ms
    assert profiles["fast path"].get("aten::uniform_", 0.0) > 0.0  # attention weights: uniforms
    assert profiles["nn.Transformer"].get("aten::uniform_", 0.0) == 0.0  # F.dropout: bernoulli_


# %% [markdown]
# **What the profile shows.** The two models do the same matmul work (the same weights applied to
# the same tokens: the same FLOPs), and in both the matmuls take a large share of the operators'
# own time (printed above). Whether the same work takes the same time the profile answers
# differently from run to run (the ratio "matmuls alone" came out between about 0.75 and 1.02 in
# our runs on a quiet machine, and at 1.6 once on a machine running four other notebooks), so the
# check asserts only that the two agree within a factor 2, and a share of the
# step above 0.3. The fast path's matmuls alone are a fraction of `nn.Transformer`'s whole step
# well below 0.85 ("its matmuls alone would be"), so the goal is reachable in principle if the
# fast path sheds from the rest of its step what the next line says, once in the profile's units
# (the operators' own time) and once in the timed step's wall-clock time, the target, since `make
# bench` measures wall-clock time (why the two differ: appendix C). Outside the matmuls:
#
# - *dropout's random numbers*: the fast path draws the attention weights' mask with `uniform_`
#   (only its profile has that operator: checked above) and the sub-layer outputs' with
#   `bernoulli_`, as `nn.Transformer` does for both. At nine positions the weights are the small
#   part of the dropout; appendix B counts the numbers each model draws;
# - *copies*: `cat` and `copy_` together. The fast path's `cat` concatenates $W^Q, W^K, W^V$ anew
#   in every call (and the gradient is split back in the backward), where `nn.MultiheadAttention`
#   *stores* one packed `in_proj_weight`; but `cat` is the smaller part of the fast path's row
#   ("copies, by operator", printed above: its `copy_` takes longer than its `cat`). `copy_` runs
#   wherever a tensor is made contiguous in a new layout, in both models: in the fast path, for
#   one, where the heads' transposed view of the context becomes $(B, T, d)$ again; in
#   `nn.MultiheadAttention`, where it transposes its batch-first inputs to $(T, B, d)$ and its
#   output back. The profile does not say which caller each `copy_` came from, so which of these
#   weighs most is not shown here;
# - *everything else*: element-wise work, layer norm, softmax, the optimizer.
#
# **What could close the gap** (proposals, not measured here): a stored packed weight (no
# concatenation, and Adam over one tensor instead of three), the faster mask on the sub-layer
# outputs too, fused element-wise kernels (what `torch.compile` generates, below), and fewer
# Python calls per block. The first changes the module's parameters, which this notebook keeps
# equal to the from-scratch model's so that one `state_dict` serves both; the second and the
# last would take the blocks' dropout and their `sublayer_connection` calls away from the
# modules that own them, and a later notebook relies on replacing those modules (notebook 15's
# DropPath; a fast path that bypassed them once dropped it silently). Those trades are why the
# goal is not met here.

# %% [markdown]
# ### `torch.compile`
#
# `torch.compile` traces the model into a graph (TorchDynamo) and hands the graph to a *backend*,
# by default Inductor, which generates fused kernels for it (Triton on a GPU, C++ on a CPU). Where
# the tracer meets Python it cannot put into a graph, it *breaks* the graph: the model then runs
# as several graphs with Python between them, and no kernel is fused across a break. Under
# compilation the fast path skips its data-dependent tests (the checks of the inputs, the
# causal-mask detection, the check for rows with no allowed key) and takes the plain arithmetic
# that is right for every mask: a second version of its code, which needs a check of its own.
#
# Compiling with Inductor takes long on this course's 2-core CPU (this model's forward and
# backward: over a minute of CPU time in one of our runs, as long as the rest of the notebook), so
# the cell below compiles with a backend of our own, which counts the graphs TorchDynamo hands
# it and runs each with PyTorch's ordinary kernels: seconds. That checks what is ours, the traced
# code of the fast path, not Inductor's generated kernels (PyTorch tests those). The compiled fast
# model, in evaluation mode on the batch of the first check of this section (a fully padded
# source, a causal target mask), must give the from-scratch model's logits and gradients. Then the
# graphs are counted, in evaluation and in training mode, and, to show that the count can fail,
# for the model called twice with a break put in by hand between the calls:

# %% tags=["nbval-ignore-output"]
def compiled_graphs(fn, *args, **kwargs):
    """fn compiled with a backend that records each graph and runs it as it is, called once:
    (its result, the graphs)."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward  # PyTorch's own kernels: no code generated

    torch._dynamo.reset()
    return torch.compile(fn, backend=recording_backend)(*args, **kwargs), graphs


compiled_fast = use_fast_path(copy.deepcopy(scratch_model)).eval()
for mdl in (scratch_model.eval(), compiled_fast):
    mdl.zero_grad(set_to_none=True)
reference_logits = scratch_model(src, tgt, src_mask, tgt_mask)  # (B, T, V)
reference_logits.square().mean().backward()
compiled_logits, graphs_eval = compiled_graphs(compiled_fast, src, tgt, src_mask, tgt_mask)
compiled_logits.square().mean().backward()  # through the compiled graphs
compiled_grads = dict(compiled_fast.named_parameters())
grad_gap = max((compiled_grads[name].grad - p.grad).abs().max().item()
               for name, p in scratch_model.named_parameters())

count_model = use_fast_path(copy.deepcopy(bench_scratch))
count_src, count_tgt, _ = train_batch
count_mask = causal_mask(count_tgt.size(1), device=device)


def with_a_break(src_ids, tgt_in, tgt_mask):
    """The model twice, with a graph break between the two calls."""
    first = count_model(src_ids, tgt_in, tgt_mask=tgt_mask)
    torch._dynamo.graph_break()
    return first + count_model(src_ids, tgt_in, tgt_mask=tgt_mask)


graph_counts = {"evaluation": len(graphs_eval)}
for name, fn, training in (("training", count_model, True), ("with a break put in", with_a_break, False)):
    count_model.train(training)
    graph_counts[name] = len(compiled_graphs(fn, count_src, count_tgt, tgt_mask=count_mask)[1])
torch._dynamo.reset()
print(f"compiled fast model, evaluation: logits within "
      f"{(compiled_logits - reference_logits).abs().max().item():.1e} of the from-scratch model's, "
      f"gradients within {grad_gap:.1e}")
print("graphs: " + ", ".join(f"{name} {n}" for name, n in graph_counts.items())
      + f"; torch {torch.__version__}")

# %%
assert_close(compiled_logits, reference_logits, atol=1e-5, rtol=1e-5)
for name, p in scratch_model.named_parameters():
    assert_close(compiled_grads[name].grad, p.grad, atol=1e-5, rtol=1e-4)
# One graph from torch 2.11 on, the oldest release we saw give one; 2.5.1 gives 6 (appendix D).
ONE_GRAPH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)
if ONE_GRAPH:  # the whole model is one graph in both modes: nothing breaks it
    assert graph_counts["evaluation"] == graph_counts["training"] == 1, graph_counts
assert graph_counts["with a break put in"] >= 2  # and the count does see a break

# %% [markdown]
# The traced fast path computes the same model, and with this release (printed) the forward pass
# is one graph in both modes, open to fusion whole; older releases break it (appendix D says
# which we tried). What fusion buys in time this notebook does not measure on the CPU, where
# compiling with Inductor takes that long, and a timing on a shared machine would not be worth
# quoting. What it can change is the profile's rows outside
# the matmuls (element-wise work, copies), which it fuses; the matmuls, the profile's largest
# group, it hands to the same matrix library as before. On a GPU, where launching many small
# kernels costs, fusing them is what compilation is good at; the cell below times it there only:

# %% tags=["nbval-ignore-output"]
RUN_COMPILE = device.type == "cuda"
if RUN_COMPILE:
    compiled_model = torch.compile(use_fast_path(copy.deepcopy(bench_scratch)).train())
    compiled_step = make_train_step(compiled_model, *train_batch)
    start = time.perf_counter()
    compiled_step()  # the first call compiles
    compile_s = time.perf_counter() - start
    compiled_time = time_call(compiled_step, warmup=2, repeats=5)
    eager_time = time_call(steps["fast path"], warmup=2, repeats=5)
    print(f"compile {compile_s:.0f} s; compiled step {1e3 * compiled_time:.1f} ms, "
          f"eager {1e3 * eager_time:.1f} ms")
else:
    print("torch.compile not timed on the CPU (compiling takes over a minute here); see the text above")


# %% [markdown]
# **The fast path is the same model (same parameters, outputs and gradients) computed with fewer,
# fused operations; it falls back to the from-scratch code wherever that one is needed.**
#
# ## 6 · Counting work
#
# ### FLOPs per token
#
# A matmul of an $(n, k)$ by a $(k, m)$ matrix costs $2nkm$ floating-point operations (a multiply
# and an add each). A linear layer with a weight of $N_\ell$ numbers therefore costs $2N_\ell$ per
# token it reads in the forward pass, and twice that in the backward (one matmul for the input's
# gradient, one for the weight's): **6 FLOPs per weight per token** for a training step (Kaplan
# et al., 2020). Attention adds two matmuls whose size is set by the lengths, not by weights:
# $QK^\top$ and $PV$, each $2\,T_q T_k d$ per sequence and layer, again ×3 for training.
#
# In an encoder–decoder not every weight reads the same tokens: the encoder's read the $S$
# source positions, the decoder's the $T$ target positions, except the cross-attention's $W_k$
# and $W_v$, which read the encoder's output ($S$ positions):

# %% tags=["nbval-ignore-output"]
def training_flops(model, batch, S, T):
    """6 x weights x tokens they read, plus the attention matmuls (x 3 for the backward)."""
    linear = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            reads_source = name.startswith("encoder") or name.endswith(("cross_attn.W_k",
                                                                       "cross_attn.W_v"))
            linear += 6 * module.weight.numel() * batch * (S if reads_source else T)
    d, layers = model.d_model, model.config.num_layers
    attention = 3 * 2 * 2 * batch * d * layers * (S * S + T * T + T * S)  # enc, dec self, cross
    return linear, attention


S_len, T_len = 8, 9  # the reversal batch: tgt_in is [BOS] + 8 symbols
flops_linear, flops_attention = training_flops(bench_fast, 64, S_len, T_len)
weights_n = sum(m.weight.numel() for m in bench_fast.modules() if isinstance(m, nn.Linear))
# in training mode, as benchmarked: on a CPU the attention then runs as matmuls, which the counter
# sees (it has no formula for the CPU's fused flash kernel, which it would count as 0)
counted = count_flops(lambda: make_train_step(copy.deepcopy(bench_fast), *train_batch)())


def flops_agree(counted, linear, attention):
    """Whether FlopCounterMode's count fits the formula: exactly on a CPU; elsewhere up to the
    recomputed Q K^T of a fused attention backward, which it counts (1/6 of attention's FLOPs)."""
    if device.type == "cpu":
        return counted == linear + attention
    return linear + attention <= counted <= linear + attention + attention // 6


print(f"{weights_n:,} weights in matmuls; formula {(flops_linear + flops_attention) / 1e9:.4f} "
      f"GFLOP a step ({flops_attention / (flops_linear + flops_attention):.1%} attention), "
      f"FlopCounterMode {counted / 1e9:.4f} GFLOP ({counted - flops_linear - flops_attention:,} more)")
assert flops_agree(counted, flops_linear, flops_attention)

# %% [markdown]
# The check can fail. It rejects the formula with the mistake the text above warns of: the
# cross-attention's $W_k$ and $W_v$ reading the $T$ target positions instead of the $S$ source
# ones. At these lengths ($S = 8$, $T = 9$) that mistake is worth less than 1 %, so a check
# with a 1 % tolerance would let it through:

# %%
cross_kv_weights = sum(m.weight.numel() for name, m in bench_fast.named_modules()
                       if name.endswith(("cross_attn.W_k", "cross_attn.W_v")))
mistaken_linear = flops_linear + 6 * cross_kv_weights * 64 * (T_len - S_len)  # T tokens, not S
mistake = mistaken_linear - flops_linear
print(f"cross-attention's W_k, W_v reading T tokens: {(mistaken_linear + flops_attention) / 1e9:.4f} "
      f"GFLOP, {mistake:,} FLOPs ({mistake / (flops_linear + flops_attention):.2%}) more than the "
      f"formula; rejected: {not flops_agree(counted, mistaken_linear, flops_attention)}")
assert not flops_agree(counted, mistaken_linear, flops_attention)

# %% [markdown]
# On the CPU the formula and PyTorch's `FlopCounterMode` (which counts every matmul as it runs)
# agree exactly, and the check asserts equality: there the attention of a training step runs as
# notebook 02's matmuls, which the counter sees one by one. It catches a mistake of any size,
# such as a cross term of $T \cdot T$ instead of $T \cdot S$ (1,769,472 FLOPs, 0.06 %).
# On a GPU the attention runs in a fused kernel whose backward recomputes $QK^\top$ (section 3's
# seventh matmul), and the counter counts that too: one sixth more attention FLOPs, 0.23 % of
# this step (3.0498 GFLOP counted against the formula's 3.0427, on an H200 with torch 2.11). So
# off the CPU the check allows the formula plus at most that recomputation: it still rejects the
# cross-attention mistake above (0.83 %), but no longer one of 0.06 %. At these lengths attention
# is a few per cent of the work. Per token and layer, with a feed-forward width
# $d_{ff} = 4d$ (as here: 512 and 128), the projections and the feed-forward network cost $12d^2$
# multiply-adds in an encoder layer ($4d^2$ and $2 d\, d_{ff}$) and $16d^2$ in a decoder layer (its
# cross-attention has projections too), attention's two $T$-long products $2Td$ and, in a decoder
# layer, $4Td$ (self- and cross-attention, $S = T$): attention is half the arithmetic at $T = 6d$ in
# an encoder layer and $T = 4d$ in a decoder layer. FLOPs are not where a fused attention kernel's
# speed comes from, though: it wins by never writing the $T \times T$ matrices to memory and reading
# them back, so on a GPU FlashAttention pays long before attention is half the arithmetic.
#
# ### The machine's peak and the model FLOPs utilisation
#
# **Model FLOPs utilisation** (MFU; Chowdhery et al., 2022) is the FLOPs a step needs divided
# by its time, as a fraction of the hardware's theoretical peak (from its data sheet: vector
# width, FMA units, clock). This cell divides by a *measured* peak instead, a large float32
# matmul on one thread, which is lower than the theoretical one and so gives a higher MFU;
# `make bench` reports both, `mfu_measured_peak` and `mfu_theoretical_peak`.
#
# One more overhead sits outside the model: the optimizer. Adam updates each of the model's 92
# parameter tensors with about a dozen element-wise operations (two moment updates, a square
# root, a division, ...), one tensor and one operation at a time: over a thousand small calls
# per step, each paying Python's and the dispatcher's fixed cost (on a GPU, Adam already defaults
# to its `foreach` form, which batches the tensors into a few calls). `Adam(fused=True)` (on the
# CPU since torch 2.4) does each tensor's whole update in one kernel. It is the same update,
# which the check below shows the way that can fail: both optimizers get the *same* gradients
# for five steps (random, their scales spread over six decades, so that the moments, the bias
# correction and $\epsilon$ all matter), and must end with the same weights to float rounding.
# (Two training runs would not do: after one step the two models differ in the last bits, and
# Adam's division by $\sqrt{v}$ can turn that into a step of size $\mathrm{lr}$ for a weight
# whose gradient is nearly zero.)

# %% tags=["nbval-ignore-output"]
adam_models = {fused: copy.deepcopy(bench_fast) for fused in (False, True)}
adams = {fused: torch.optim.Adam(m.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused)
         for fused, m in adam_models.items()}  # fmt: skip
grad_gen = torch.Generator().manual_seed(1)
for _ in range(5):
    for params in zip(*(m.parameters() for m in adam_models.values()), strict=True):
        scale = 10.0 ** (-6 * torch.rand((), generator=grad_gen))  # 1e-6 to 1
        grad = (scale * torch.randn(params[0].shape, generator=grad_gen)).to(params[0].device)
        for p in params:
            p.grad = grad.clone()
    for adam in adams.values():
        adam.step()
fused_check = {f: torch.cat([p.detach().flatten() for p in m.parameters()]) for f, m in adam_models.items()}
start_weights = torch.cat([p.detach().flatten() for p in bench_fast.parameters()])
fused_moved = (fused_check[False] - start_weights).abs().max()
fused_gap = (fused_check[True] - fused_check[False]).abs().max()
print(f"five steps moved the weights by up to {fused_moved:.1e}; fused and plain Adam differ by "
      f"up to {fused_gap:.1e}")

# %%
assert fused_moved > 1e-4  # five steps of about lr = 1e-4 each
assert fused_gap < 1e-3 * fused_moved  # the same update, to rounding

# %% [markdown]
# The difference is rounding (the kernel orders the same arithmetic differently). The fast
# path's training step is the fast model with the fused optimizer; the plain one is timed beside
# it:

# %%
torch.set_num_threads(1)
try:
    A = torch.randn(1024, 1024, generator=gen).to(device)
    fused_step = make_train_step(copy.deepcopy(bench_fast), *train_batch, fused=True)
    A @ A, fused_step(), steps["fast path"]()  # warm-up
    turns = [  # the peak's matmul and both steps in turns: all three see the same machine
        (time_call(lambda: A @ A, warmup=0, repeats=1), time_call(steps["fast path"], warmup=0, repeats=1),
         time_call(fused_step, warmup=0, repeats=1))
        for _ in range(7)
    ]
    matmul_s, fast_step_s, fused_step_s = (sorted(t)[len(t) // 2] for t in zip(*turns, strict=True))  # medians
finally:
    torch.set_num_threads(threads)
peak_flops = 2 * 1024**3 / matmul_s
mfu = {name: counted / seconds / peak_flops
       for name, seconds in (("Adam", fast_step_s), ("fused Adam", fused_step_s))}
# The rate of the step's matmuls alone: every FLOP counted is a matmul's, over the matmuls' time
# in section 5's profile. The profile records CPU time, which on a GPU is the kernels' launch,
# not their run, so the ratio means something on a CPU only.
matmul_rate = (counted / (by_group["fast path"]["matmul"] / 1e3) / peak_flops
               if device.type == "cpu" else None)
# Their share of the timed step: the profile's matmul time over the wall-clock time of a step
# (plain Adam, as profiled). The MFU is this share times their rate.
matmul_step_share = (by_group["fast path"]["matmul"] / 1e3 / fast_step_s
                     if device.type == "cpu" else None)
# The same step, the same closure, was timed in section 5 at another moment: the share against it
step_share_section5 = (by_group["fast path"]["matmul"] / 1e3 / step_time["fast path"]
                       if device.type == "cpu" else None)

# %% tags=["nbval-ignore-output"]
print(f"matmul peak {peak_flops / 1e9:.1f} GFLOP/s")
for name, seconds in (("Adam", fast_step_s), ("fused Adam", fused_step_s)):
    print(f"fast path with {name:>10}: {1e3 * seconds:5.1f} ms a step = "
          f"{counted / seconds / 1e9:4.1f} GFLOP/s; MFU {mfu[name]:.2f}")
print(f"fused / plain step time: {fused_step_s / fast_step_s:.2f}; the plain step in section 5's "
      f"timing: {1e3 * step_time['fast path']:.1f} ms, here {1e3 * fast_step_s:.1f} ms")
if matmul_rate is not None:
    print(f"the step's matmuls alone (section 5's profile): {matmul_rate:.2f} of the measured peak")
    print(f"the matmuls' share of the timed step (plain Adam): {matmul_step_share:.2f}; "
          f"times their rate: {matmul_step_share * matmul_rate:.2f} = the MFU with plain Adam")
    print(f"the same share against section 5's timing of the step: {step_share_section5:.2f}")

# %%
assert all(0.0 < value < 1.0 for value in mfu.values())  # a sanity check of the two measurements
assert fused_step_s < 2 * fast_step_s  # not slower beyond the noise (which is large here)
# FLOPs and profile roughly consistent (different runs on a shared machine: 1.6 has been seen)
assert matmul_rate is None or not X86_CPU or 0.3 < matmul_rate < 2.5


# %% [markdown]
# Both steps do the same update; which is faster, and by how much, moves from run to run on a
# shared machine: the printed ratio ranged from about 0.65 to 1.3 in our runs on this course's
# 2-core CPUs, so the notebook asserts only that the fused step is not twice as slow. `make bench`
# reports the fused step's MFU as `mfu_measured_peak`, with the matmul timed in turns with the step
# (0.53 and 0.44 in the two runs quoted in section 8, against a goal of 0.55). This cell also
# times the peak's matmul in turns with the two steps, so that a burst of other work slows the
# peak and the steps alike; but the machine's load moves between cells too: the plain step is
# the same closure that section 5 timed, and the two times printed for it need not agree (in one
# of our runs, 194 ms there and 292 ms here, half as much again). A step time of a shared machine
# is the time of that moment.
#
# *The next paragraph is measurement detail (where the rest of the step's time goes): on a first
# reading, skip to the roofline below.*
#
# Where does the rest go? The line "the step's matmuls alone" divides the FLOPs that
# `FlopCounterMode` counted (all of them matmul FLOPs) by the matmuls' own time in section 5's
# profile: the rate of the step's matmuls as a fraction of the measured peak. In our runs it came
# out between about two thirds and 1.6 (both on a busy machine). The ratio is rough: the profile
# and this cell are different runs, the profile keeps each operator's least disturbed round of
# three, and the peak is timed in this cell, so the ratio comes out above 1 when this cell's
# moment was busier than the profile's.
# What it does show: small as they are (512 or 576 rows of width 128: the encoder's 64 × 8 tokens,
# the decoder's 64 × 9), the step's matmuls run at a large fraction of the speed of the
# 1024 × 1024 one that defines the peak, or faster. So most of the gap between the MFU and 1
# is not slow matmuls but everything else: element-wise work on activations of a megabyte or so
# (dropout masks; the feed-forward's ReLU and its gradient; layer norm; softmax), copies, the
# optimizer and Python. Their time counts in the step, their arithmetic is not counted in the model
# FLOPs, so the MFU is the matmuls' share of the *timed* step (their time in the profile over the
# wall-clock time of a step) times their rate: the last line printed, whose product is the MFU of
# the plain-Adam step, by definition. The share depends on which timing of the step it divides:
# against section 5's timing (the last line) it is larger whenever the machine was quieter there,
# and the "everything else" smaller by as much; a share well below 1 in both means the gap is not
# the matmuls, though how large "everything else" is depends on the moment. That share is not the
# one section 5's profile prints: the profile's is a share of the operators' own time, without
# Python and the dispatcher between them, and so larger. On a GPU the same step would have a much
# lower MFU, since the model is far too small to fill it.
#
# ### Bytes moved: tiled attention on the roofline
#
# FLOPs count the arithmetic; the **roofline** model (Williams et al., 2009) asks whether the
# arithmetic or the memory traffic sets the time. A kernel's **arithmetic intensity** $I$ is its
# FLOPs per byte moved between main memory and the processor. A machine with peak $\pi$ (FLOP/s)
# and memory bandwidth $\beta$ (bytes/s) runs a kernel at most at $\min(\pi, I\beta)$: below
# the machine's **balance** $\pi / \beta$ a kernel is memory-bound. For one head's forward
# pass, with $d = d_k = d_v$, counting each tensor once per pass over it:
#
# - **naive** (section 1): $QK^\top$ reads $Q$ and $K$ and writes $S$; the softmax reads $S$ and
#   writes $P$; $PV$ reads $P$ and $V$ and writes $O$: $4Td + 4T^2$ numbers, at least;
# - **tiled** (section 3): $Q$ is read once, $K$ and $V$ once per query block ($T / b_q$ times),
#   $O$ written once, and the tiles never leave fast memory (on a GPU; on a CPU, its caches):
#   $2Td + 2T^2 d / b_q$ numbers.
#
# Both do $4T^2 d$ FLOPs in their two matmuls. With 4-byte numbers, for $T \gg d$ the naive
# intensity tends to $d/4$ (16 FLOP/byte for $d = 64$), the tiled one to $b_q / 2$ (128 for our
# 256-row tiles): **the tile size sets the intensity**. In bytes, with $d = 64$:

# %%
def attention_bytes(T, d=64, block_q=256, bytes_per_number=4):
    """Bytes one head's forward pass moves: (naive, tiled), and its matmul FLOPs."""
    naive = (4 * T * d + 4 * T * T) * bytes_per_number
    tiled = (2 * T * d + 2 * T * T * d // block_q) * bytes_per_number
    return naive, tiled, 4 * T * T * d


print(f"{'T':>6}{'GFLOP':>8}{'naive MB':>10}{'tiled MB':>10}{'naive FLOP/B':>14}{'tiled FLOP/B':>14}")
intensity = {}
for T in (512, 2048, 8192):
    naive_b, tiled_b, flops_T = attention_bytes(T)
    intensity[T] = (flops_T / naive_b, flops_T / tiled_b)
    print(f"{T:>6}{flops_T / 1e9:>8.3f}{naive_b / 1e6:>10.1f}{tiled_b / 1e6:>10.1f}"
          f"{intensity[T][0]:>14.1f}{intensity[T][1]:>14.1f}")
# The code against the algebra above (a check of the formula as typed, not a measurement):
assert all(tiled > 4 * naive for naive, tiled in intensity.values())
assert intensity[8192][0] < 64 / 4 < intensity[8192][1] < 256 / 2  # the limits d/4 and b_q/2

# %% [markdown]
# This machine's balance: the measured matmul peak above against the bandwidth of a copy of a
# 256 MiB tensor (read once, written once), one thread. Both tensors are written before the copy
# is timed: the source by `fill_`, the destination by the untimed first copy. (Memory that has
# never been written is, on Linux, one shared page of zeros, which stays in the cache: a copy from
# it reads no main memory, and overstated the bandwidth by 10 to 70 % in our tests.)

# %% tags=["nbval-ignore-output"]
torch.set_num_threads(1)
try:
    big = torch.empty(2**26, device=device).fill_(1.0)  # 256 MiB of float32, far larger than
    big_copy = torch.empty_like(big)  # the caches; written (warm-up) by the first copy
    copy_s = time_call(lambda src=big, dst=big_copy: dst.copy_(src), warmup=1, repeats=5)
finally:
    torch.set_num_threads(threads)
bandwidth = 2 * big.numel() * big.element_size() / copy_s  # bytes read and written per second
balance = peak_flops / bandwidth
del big, big_copy
print(f"bandwidth {bandwidth / 1e9:.1f} GB/s, matmul peak {peak_flops / 1e9:.1f} GFLOP/s: "
      f"balance {balance:.1f} FLOP/byte")

# %%
# A sanity check of the measurement's units and device, no more: one CPU thread copies at a few
# to some tens of GB/s, a GPU's memory at hundreds of GB/s (a T4) to a few TB/s (an H200).
bandwidth_low, bandwidth_high = (1e9, 2e11) if device.type == "cpu" else (5e10, 1e13)
assert bandwidth_low < bandwidth < bandwidth_high, bandwidth
if X86_CPU:  # what the text below reads off the roofline: this CPU's ridge lies left of the
    assert balance < intensity[2048][0]  # naive attention's float32 intensity (x86-64: measured)

# %% jupyter={"source_hidden": true}
A100_BALANCE = 312e12 / 2.0e12  # data sheet: bf16 tensor cores, HBM2e (A100 80 GB SXM)
naive_bf16, tiled_bf16, flops_2048 = attention_bytes(2048, bytes_per_number=2)
intensity_bf16 = (flops_2048 / naive_bf16, flops_2048 / tiled_bf16)  # 2-byte numbers
I_axis = torch.logspace(0, 3, 200)  # 1 to 1000 FLOP/byte
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True, layout="constrained")
panels = (  # (axis, machine, balance, how it was found, number format, (naive, tiled) intensities)
    (axes[0], "this machine, float32, one thread", balance, "measured", "float32", intensity[2048]),
    (axes[1], "A100, bfloat16", A100_BALANCE, "data sheet", "bfloat16", intensity_bf16),
)
for ax, machine, ridge, source, number, (I_naive, I_tiled) in panels:
    ax.loglog(I_axis, torch.clamp(I_axis / ridge, max=1.0), color="black", linewidth=2,
              label=f"roof (balance {ridge:.{1 if ridge < 10 else 0}f} FLOP/byte, {source})")
    for name, color, I_att in (("naive", COLORS["accent"], I_naive), ("tiled", COLORS["ours"], I_tiled)):
        ax.axvline(I_att, color=color, linestyle="--", linewidth=1)
        ax.plot([I_att], [min(1.0, I_att / ridge)], "o", color=color, markersize=8,
                label=f"{name} attention, {number}: {I_att:.0f} FLOP/byte")
    ax.set_title(machine)
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylim(4e-3, 2)
    ax.legend(fontsize=8, loc="lower right")
axes[0].set_ylabel("attainable fraction of the machine's own peak")
fig.suptitle("Roofline: one head of attention at T = 2048, $d$ = 64, on two machines")
save_figure(fig, "14_roofline")
plt.show()

# %% [markdown]
# Each panel is one machine with the number format it would run attention in: this CPU in float32,
# the A100 in bfloat16 (2-byte numbers, so each intensity is twice the float32 one). Each roof is a
# fraction of its own machine's peak, so the panels compare where each machine's ridge lies, not
# how fast the two machines are: the A100's bf16 peak, 312 TFLOP/s, is more than ten thousand
# times the float32 matmul peak that this CPU thread reached in the stored run (printed above). On
# this CPU with one thread the balance is low (printed above, and on an x86-64 CPU checked to lie
# below the naive attention's intensity): both dots sit on the flat part of the roof, so by the
# roofline neither attention's matmuls need wait for memory. On a GPU the balance is in the
# hundreds (156 FLOP/byte for the A100): there the naive attention (intensity about $d/2 = 32$ in
# bfloat16) is memory-bound at about a fifth of the peak, where its red dot sits on the sloped part
# of the roof, while the tiled one, with our 256-row tiles, lies right of the ridge. **Tiling
# raises the arithmetic intensity from $d/4$ to $b_q/2$ (float32): that, not fewer FLOPs, is where
# a fused attention kernel's speed comes from on a GPU.**
#
# *From here to the KV cache is measurement detail (a profile of the naive attention on this
# CPU): on a first reading, skip it.*
#
# A roofline is an upper bound, and it counts bytes, nothing else. Where the naive attention's
# time goes on this CPU, a profile says: section 4's call ($T = 2048$, four heads), one thread,
# by operator; and its first matmul $QK^\top$ timed two ways, in turns: into a new tensor, as
# the naive attention does, and into one allocated once and reused:

# %% tags=["nbval-ignore-output"]
Kt_m = Km.transpose(-2, -1)  # (1, 4, d_k, T)
scores_buffer = torch.empty(1, 4, 2048, 2048, device=device)  # 64 MiB, allocated once
torch.set_num_threads(1)
try:
    with torch.no_grad():
        naive_ops = operator_times(lambda: naive_forward(Qm, Km, Vm), repeats=3, warmup=1)
        qk_turns = [(time_call(lambda: torch.matmul(Qm, Kt_m), warmup=0, repeats=1),
                     time_call(lambda b=scores_buffer: torch.matmul(Qm, Kt_m, out=b), warmup=0, repeats=1))
                    for _ in range(5)]
finally:
    torch.set_num_threads(threads)
del scores_buffer
naive_total = sum(naive_ops.values())
naive_matmul_share = sum(naive_ops.get(op, 0.0) for op in GROUPS["matmul"]) / naive_total
naive_top = sorted(((ms, op) for op, ms in naive_ops.items() if op.startswith("aten::")), reverse=True)
qk_new, qk_reused = (sorted(t)[len(t) // 2] for t in zip(*qk_turns, strict=True))  # medians
qk_flops = 2 * 4 * 2048 * 2048 * 64
print(f"naive attention: {naive_total:.0f} ms of operators' own time, {naive_matmul_share:.2f} of it "
      f"in matmuls; the largest operators:", ", ".join(f"{op[6:]} {ms:.0f}" for ms, op in naive_top[:3]))
print(f"Q K^T into a new tensor {1e3 * qk_new:.0f} ms ({qk_flops / qk_new / 1e9:.1f} GFLOP/s), into a "
      f"reused one {1e3 * qk_reused:.0f} ms ({qk_flops / qk_reused / 1e9:.1f} GFLOP/s, "
      f"{qk_new / qk_reused:.1f} times as fast); the matmul peak {peak_flops / 1e9:.1f} GFLOP/s")

# %%
if X86_CPU:  # the profile records CPU time (on a GPU, the kernels' launch); measured on x86-64
    assert 0.15 < naive_matmul_share < 0.85, naive_matmul_share  # both parts weigh

# %% [markdown]
# So on this CPU the roofline's bound is not what limits the naive attention. A large part of its
# time is in its two matmuls (the share printed above: from about a third to a little over a half
# in our runs), and they are slow: $QK^\top$ into a new tensor ran far below the matmul peak,
# and faster into a reused one, by the factor printed above (from 1.9 to about 4 in our runs).
# The likely cause is the
# first write into new memory: a 64 MiB tensor is fresh pages from the operating system, each of
# which costs a page fault when it is first written, a cost that the copy measurement above (on
# buffers written before it was timed) does not see and that a count of bytes leaves out. The
# rest is the element-wise passes over the $T \times T$ matrices (the division by $\sqrt{d_k}$ and the softmax),
# each reading one and writing a new one for a few FLOPs per number. The tiled attentions allocate
# no $T \times T$ matrix, and pay for neither.

# %% [markdown]
# ### The KV cache in bytes
#
# Notebook 12's cache holds, per decoder layer, keys and values of $h \cdot d_k = d$ numbers for
# every generated position ($n$ at most) and every source position ($S$), for each of the $B$
# sequences of the batch. With $N$ decoder layers that is $2 N B d (n + S)$ numbers. Formula
# against measurement, on a cache filled by 512 steps of greedy decoding (a copy of the model
# that can never emit `EOS`, so that every row runs the full length). The growing buffers of the
# self-attention caches hold some spare room on top (they double when full, notebook 12):

# %%
endless = copy.deepcopy(scratch_model).eval()
with torch.no_grad():
    endless.out_proj.bias[EOS] = -math.inf  # EOS can never win: every row decodes 512 tokens
filled = KVCache()
greedy_decode(endless, src, max_new_tokens=512, src_mask=src_mask, cache=filled)
layers_n, (B_c, S_c), d_c = scratch_model.config.num_layers, src.shape, scratch_model.d_model
cache_formula = 2 * layers_n * B_c * d_c * (512 + S_c) * 4  # float32: 4 bytes a number
allocated = sum(  # the buffers themselves: kept positions plus the spare room of growing ones
    cache.allocated_bytes() for layer in filled.layers for cache in (layer.self_attn, layer.cross_attn)
)
print(f"formula {cache_formula / MiB:.3f} MiB, kept {filled.num_bytes() / MiB:.3f} MiB, "
      f"allocated {allocated / MiB:.3f} MiB")
assert filled.length == 512 and filled.num_bytes() == cache_formula
# A growing buffer doubles when it is full, so it is never more than twice what it keeps.
assert cache_formula <= allocated <= 2 * cache_formula

# %% [markdown]
# ## 7 · Mixed precision and checkpointing, in numbers
#
# **Mixed precision.** Under `torch.autocast`, matmuls run in a 16-bit type while the weights,
# the loss and the reductions that need it stay float32. Two 16-bit types exist:
#
# - **bfloat16** keeps float32's 8 exponent bits, so its range (no loss scaling needed), with 7
#   stored mantissa bits (8 bits of precision, about 2–3 decimal digits);
# - **float16** has 5 exponent bits and 10 mantissa bits: more precise, but small gradients
#   underflow to zero, so training with it needs a **loss scaler** (`torch.amp.GradScaler`)
#   that multiplies the loss before the backward and divides the gradients before the step.
#
# Which one is fast depends on the hardware: bfloat16 needs bf16 units (CPUs with AVX-512 BF16
# or AMX, Apple silicon from M2 on, NVIDIA GPUs from Ampere, sm80, on); older GPUs such as Colab's T4
# (sm75) have float16 tensor cores but no bf16 ones. The cell below picks float16 (with a
# scaler) on a CUDA GPU without native bf16, and bfloat16 everywhere else:

# %%
if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
    amp_dtype = torch.float16  # e.g. a T4: float16 tensor cores, no bf16 ones
else:
    amp_dtype = torch.bfloat16
amp_name = str(amp_dtype).removeprefix("torch.")

# %% [markdown]
# How much does a 16-bit forward pass change the model's output? An untrained model is no test:
# its logits are small and nearly flat, and a comparison of its losses would pass even for
# logits that were all zero. So first 100 steps of training on the reversal task (in float32),
# enough for the model to reverse most sequences of 8 symbols (printed below: the share of
# held-out sequences it gets right at every position given the right prefix, which is what greedy
# decoding would then reproduce), then its logits with and without autocast on held-out sequences:

# %%
set_seed(0)
amp_model = use_fast_path(copy.deepcopy(scratch_model)).train()
amp_optimizer = torch.optim.Adam(amp_model.parameters(), lr=1e-3)
short_mask = causal_mask(9, device=device)
for amp_step in range(100):
    src_t, tgt_in_t, tgt_out_t = reversal_batch(32, 8, seed=1 + amp_step)
    amp_train_loss = F.cross_entropy(amp_model(src_t, tgt_in_t, tgt_mask=short_mask).flatten(0, 1),
                                     tgt_out_t.flatten())
    amp_optimizer.zero_grad(set_to_none=True)
    amp_train_loss.backward()
    amp_optimizer.step()
amp_model.eval()
held_out = reversal_batch(64, 8, seed=10_000)


def held_out_logits(autocast):
    with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=autocast):
        return amp_model(held_out[0], held_out[1], tgt_mask=short_mask)  # (B, T, V)


logits_fp32, logits_amp = held_out_logits(False), held_out_logits(True)
logit_error = (logits_amp.float() - logits_fp32).abs()  # (B, T, V)
logit_scale = logits_fp32.std().item()
amp_right = logits_fp32.argmax(-1) == held_out[2]  # (B, T): each position, teacher-forced
amp_accuracy = amp_right.float().mean().item()
amp_sequences = amp_right.all(dim=-1).float().mean().item()  # every position of the sequence right
amp_agree = (logits_amp.argmax(-1) == logits_fp32.argmax(-1)).float().mean().item()

# %% tags=["nbval-ignore-output"]
print(f"held out: {amp_accuracy:.3f} of the positions predicted right (teacher-forced), "
      f"{amp_sequences:.3f} of the sequences right at every position; logits: standard "
      f"deviation {logit_scale:.2f}, largest {logits_fp32.abs().max().item():.2f}")
print(f"{amp_name} autocast against float32: largest error {logit_error.max().item():.4f}, "
      f"root mean square {logit_error.square().mean().sqrt().item():.4f} "
      f"({logit_error.square().mean().sqrt().item() / logit_scale:.4f} of the logits' spread); "
      f"the same prediction at {amp_agree:.1%} of the positions")

# %% [markdown]
# The errors are of the order of the 16-bit type's rounding ($2^{-8} \approx 0.004$ relative,
# for bfloat16) times the logits' size, a fraction of a per cent of their spread, and the
# predictions hardly change. The check asserts this against the logits' scale, with bounds a few
# times looser than what we measured, and that the logits did come out of a 16-bit matmul:

# %%
assert logits_amp.dtype == amp_dtype and logits_fp32.dtype == torch.float32
assert amp_accuracy > 0.5 and logit_scale > 1.0  # a trained model, not near-zero logits
# "most sequences": 0.63 to 0.94 under six seeds (0 and 1000 to 5000) in our runs
assert amp_sequences > 0.5
rms_error = logit_error.square().mean().sqrt().item()
assert 0.0 < rms_error < 0.02 * logit_scale  # nonzero: autocast did change the arithmetic
assert logit_error.max().item() < 0.05 * logits_fp32.abs().max().item()
assert amp_agree >= 0.98

# %% [markdown]
# For the timing below, a loss over longer sequences (16 of 32 symbols), with and without
# autocast:

# %%
amp_batch = reversal_batch(16, 32)
amp_mask = causal_mask(33, device=device)


def amp_logits(autocast):
    with torch.autocast(device.type, dtype=amp_dtype, enabled=autocast):
        return amp_model(amp_batch[0], amp_batch[1], tgt_mask=amp_mask)  # (B, T, V)


def amp_loss(autocast):
    return F.cross_entropy(amp_logits(autocast).float().flatten(0, 1), amp_batch[2].flatten())


# %% [markdown]
# Time and memory of a forward and backward pass. With float16 the backward goes through the
# scaler, as it would in training (here it multiplies the loss by its scale; with bfloat16 it is
# switched off and passes the loss through):

# %% tags=["nbval-ignore-output"]
amp_scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)


def amp_backward(autocast):
    loss = amp_loss(autocast)
    (amp_scaler.scale(loss) if autocast else loss).backward()


def cpu_bf16_instructions() -> bool | None:
    """Whether Linux's /proc/cpuinfo lists bfloat16 instructions: avx512_bf16 or amx_bf16 among
    an x86 CPU's flags, bf16 among an Arm CPU's features; None where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux (on a Mac, M2 and later chips have bfloat16 instructions, M1 not)
        return None
    names = {word for line in lines if line.startswith(("flags", "Features"))
             for word in line.partition(":")[2].split()}
    return bool(names & {"avx512_bf16", "amx_bf16", "bf16"})


amp_time = {on: time_call(lambda on=on: amp_backward(on), warmup=2, repeats=5) for on in (False, True)}
amp_mem = {on: peak_memory(lambda on=on: amp_backward(on), device) for on in (False, True)}
if device.type == "cpu":
    has_bf16 = cpu_bf16_instructions()
    print(f"bfloat16 instructions on this CPU: {'unknown (no /proc/cpuinfo)' if has_bf16 is None else has_bf16}")
print(f"forward+backward: float32 {1e3 * amp_time[False]:.0f} ms, {amp_mem[False] / MiB:.1f} MiB; "
      f"{amp_name} autocast {1e3 * amp_time[True]:.0f} ms, {amp_mem[True] / MiB:.1f} MiB "
      f"({amp_time[True] / amp_time[False]:.2f} of the time, "
      f"{amp_mem[True] / amp_mem[False]:.2f} of the memory)")

# %%
assert amp_mem[True] < amp_mem[False]  # 16-bit activations: less memory on any machine

# %% [markdown]
# **Memory: less, not half.** Autocast keeps 16-bit activations for the backward (the ratio
# printed above), while the float32 weights, their gradients, the logits cast back for the loss
# and the residual stream stay float32. (Which ops autocast holds in float32 depends on the
# device: on a CUDA GPU softmax and layer norm among them; on the CPU only the losses and a list
# of delicate ops. The course's norms still see float32 because the residual stream stays
# float32: a float32 tensor plus a bfloat16 sublayer output is float32.)
#
# **Time: it depends on the hardware.** Read the time ratio above as this machine's, not as a
# law. A CPU with bfloat16 instructions (on Linux, `avx512_bf16` or `amx_bf16` among an x86 CPU's
# flags in `/proc/cpuinfo`, `bf16` among an Arm CPU's features; the line above says whether this
# one has them) runs 16-bit matmuls fast enough to pay back much of the cost of casting their
# inputs: on ours (x86-64, with `avx512_bf16`) autocast took about as long as float32, within a
# factor of about 1.5 either way from run to run, since this toy model's matmuls are small and
# the casts weigh. A CPU without them converts back and forth, and autocast can then be up to an
# order of magnitude *slower*: 11 times, on one of our machines. We did not time an Arm CPU. On a
# GPU with tensor cores (float16 on a T4, bfloat16 or float16 on an A100) a model large enough to
# fill it typically runs about 2× faster or more; this toy model is too small to show it.
# **Mixed precision on a CPU is a memory saving first, and a speed-up only on the right
# hardware.**
#
# **16-bit inputs, float32 accumulators.** Our `tiled_attention_forward` keeps its running
# $m$, $\ell$ and $a$ (and the tile's scores) in float32 when $Q$, $K$, $V$ are bfloat16 or float16,
# as FlashAttention-2 does; its `acc_dtype` argument lets us see what the 16-bit alternative would
# cost. At $T = 2048$, one head, bfloat16 inputs, against the float64 attention of the *same*
# bfloat16 numbers (so that only the arithmetic differs), beside PyTorch's fused kernel:

# %%
Qh, Kh, Vh = (t.bfloat16() for t in make_qkv(2048, seed=2))
exact = F.scaled_dot_product_attention(Qh.double(), Kh.double(), Vh.double())  # (1, 1, T, d_k)
with torch.no_grad():
    accumulated = {
        "bfloat16 accumulators": tiled_attention_forward(Qh, Kh, Vh, acc_dtype=torch.bfloat16)[0],
        "float32 accumulators (default)": tiled_attention_forward(Qh, Kh, Vh)[0],
        "F.scaled_dot_product_attention": F.scaled_dot_product_attention(Qh, Kh, Vh),
    }
accumulation_error = {name: (out.double() - exact).abs().max().item()
                      for name, out in accumulated.items()}
largest = exact.abs().max().item()
half_ulp = 2.0 ** (math.floor(math.log2(largest)) - 8)  # half of bfloat16's spacing there

# %% tags=["nbval-ignore-output"]
for name, error in accumulation_error.items():
    print(f"{name:>31}: largest error {error:.5f}")
print(f"{'rounding the exact output':>31}: at most {half_ulp:.5f}")

# %% [markdown]
# With float32 accumulators the error is the rounding of the output to bfloat16 and hardly
# more, of the size of the fused kernel's; with bfloat16 ones every rescaling and every
# addition over the 2048 keys rounds again, and the error is several times larger:

# %%
assert all(out.dtype == torch.bfloat16 for out in accumulated.values())
assert accumulation_error["float32 accumulators (default)"] <= half_ulp + 1e-5  # + float32's
assert accumulation_error["bfloat16 accumulators"] > 2 * accumulation_error["float32 accumulators (default)"]


# %% [markdown]
# **Gradient checkpointing** keeps only each block's input in the forward pass and recomputes the
# block's inside during the backward (Chen et al., 2016), saving the activations of all but one
# block at a time. The cost in arithmetic is one more forward pass of the blocks: a backward
# costs about two forward passes, so a step of three forward-pass units becomes four, about a
# third more. `torch.utils.checkpoint` does it per call; it restores the random state, so
# dropout draws the same masks when the block is recomputed.

# %% tags=["nbval-ignore-output"]
def with_checkpointing(model):
    """A copy whose encoder and decoder blocks recompute their activations in the backward."""
    model = copy.deepcopy(model)
    for block in [*model.encoder.layers, *model.decoder.layers]:
        block.forward = lambda *args, f=block.forward, **kw: checkpoint(f, *args, use_reentrant=False,
                                                                         **kw)
    return model


ckpt_batch, ckpt_mask = reversal_batch(16, 128), causal_mask(129, device=device)
plain_model = use_fast_path(copy.deepcopy(scratch_model)).train()
ckpt_model = with_checkpointing(plain_model)


def ckpt_backward(model):
    out = model(ckpt_batch[0], ckpt_batch[1], tgt_mask=ckpt_mask)
    F.cross_entropy(out.flatten(0, 1), ckpt_batch[2].flatten()).backward()


for mdl in (plain_model, ckpt_model):
    mdl.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in both
    ckpt_backward(mdl)
ckpt_grads = dict(ckpt_model.named_parameters())
for name, p in plain_model.named_parameters():
    assert_close(ckpt_grads[name].grad, p.grad, atol=1e-5, rtol=1e-4)
mem_plain = peak_memory(lambda: ckpt_backward(plain_model), device)
mem_ckpt = peak_memory(lambda: ckpt_backward(ckpt_model), device)
print(f"the same gradients; peak memory of forward+backward: {mem_plain / MiB:.0f} MiB plain, "
      f"{mem_ckpt / MiB:.0f} MiB checkpointed ({mem_ckpt / mem_plain:.2f})")
assert mem_ckpt < 0.8 * mem_plain

# %% tags=["nbval-ignore-output"]
ckpt_models = {"plain": plain_model, "checkpointed": ckpt_model}
for mdl in ckpt_models.values():  # warm-up
    ckpt_backward(mdl)
# in turns, five rounds, the median of each: a burst of other work slows both alike
ckpt_turns = [{name: time_call(lambda m=m: ckpt_backward(m), warmup=0, repeats=1)
               for name, m in ckpt_models.items()} for _ in range(5)]
ckpt_time = {name: sorted(turn[name] for turn in ckpt_turns)[2] for name in ckpt_models}
ckpt_ratios = sorted(turn["checkpointed"] / turn["plain"] for turn in ckpt_turns)
print(f"time: plain {1e3 * ckpt_time['plain']:.0f} ms, checkpointed "
      f"{1e3 * ckpt_time['checkpointed']:.0f} ms ({ckpt_time['checkpointed'] / ckpt_time['plain']:.2f}x; "
      f"per round {ckpt_ratios[0]:.2f} to {ckpt_ratios[-1]:.2f})")

# %% [markdown]
# The measured ratio is what it cost on this machine, and it can land on either side of the third
# that the arithmetic predicts (the two are timed in turns, medians of five rounds, and the ratio
# still moves from round to round, printed): besides the recomputed forward pass, `checkpoint`
# saves and restores the
# random state at every block and runs each block's forward a second time in Python, overheads
# that weigh more in a small model on a CPU. The bound the notebook asserts is generous:

# %%
assert ckpt_time["checkpointed"] < 3 * ckpt_time["plain"]

# %% [markdown]
# **Mixed precision trades a little accuracy for memory (and, with the right hardware, speed);
# checkpointing trades time (about a third more in arithmetic; the ratio above is what it cost
# here) for a fraction of the activations' memory.**
#
# ## 8 · The benchmark: `make bench`
#
# A notebook shows a measurement; a claim about speed is made by `make bench`, which runs every
# benchmark in `benchmarks/` in one process, side by side on the same inputs (warm-up, several
# repeats, the median), prints a table and writes `bench.json`:
#
# | key | what it is | target |
# |---|---|---|
# | `train_step_ratio_fast` | fast path / `nn.Transformer` doing the same work (its feed-forward's inner dropout off, checked: equal outputs in evaluation mode, as many dropout sites), one training step (same config, weights, batch, optimizer; both eager); the worst over batches 64×8 and 16×128 and 1 and 2 threads | ≤ 0.85 |
# | `train_step_ratio_fast_vs_shipped` | the same against `nn.Transformer` as PyTorch ships it (one dropout more per layer) | |
# | `train_step_ratio_scratch`, `…_vs_shipped` | from-scratch model / `nn.Transformer`, the same two ways | |
# | `kv_cache_speedup_512` | greedy decoding of 512 tokens, without / with the KV cache | |
# | `tiled_memory_ratio_8192` | tiled / naive attention, peak memory of the forward pass at $T = 8192$ | ≤ 0.125 |
# | `mfu_measured_peak` | model FLOPs utilisation of the fast path's training step with fused Adam (FLOPs from `FlopCounterMode`, peak from a float32 matmul timed beside it), one thread (`mfu` is its old name) | ≥ 0.55 |
# | `mfu_theoretical_peak` | the same FLOP/s over the CPU's theoretical float32 peak (vector lanes × 2 for the FMA × 2 FMA units × the clock: assumptions, listed under `cpu`) | |
# | `device`, `torch`, `threads`, `cpu` | what it ran on (`cpu`: model name, AVX2 / AVX-512 / AMX flags, clock) | |
# | `targets` | each target, its value, and whether it was met | |
#
# Two runs of `make bench`, quoted here (their `bench.json` is not in the repository: run
# `make bench` for your machine's), with torch 2.13.0 on two of this course's 2-core AMD EPYC
# machines (the four numbers of a row are 1 thread 64×8, 16×128; 2 threads 64×8, 16×128):
#
# | | one with AVX-512 (shared with other work) | one with AVX2 only (quiet) |
# |---|---|---|
# | fast path / `nn.Transformer`, equal work | 0.94, 0.87, 0.94, 0.79 | 1.02, 0.89, 0.95, 0.87 |
# | fast path / `nn.Transformer` as shipped | 0.81, 0.73, 0.80, 0.65 | 0.89, 0.79, 0.83, 0.79 |
# | MFU, measured / theoretical peak | 0.53 / 0.31 | 0.44 / 0.39 |
#
# So the 0.85 goal is missed by seven of the eight ratios of the first row (the profile in
# section 5 says where the time goes): the matmuls, the same in both models, are the largest of the
# profile's groups, and the fast path sheds less than the rest would have to. The shipped
# comparison looks better by the work it skips. The measured peak is the denominator for "how much of what this machine's matmul can
# do", the theoretical one for "how much of the silicon"; the two machines rank differently on
# each, but the theoretical peak rests on an assumption about the CPU (appendix F).
#
# `benchmarks/model.py` holds the code (outside the package: a benchmark is not a library
# function); `python benchmarks/model.py --help` lists its options. The targets are the course's
# goals for this 2-core CPU, not asserts: the script prints each ratio beside its target and
# marks a miss, so that a slower or faster machine, where the ratios move, never fails a test.
#
# ## Recap
#
# | idea | code | shapes |
# |---|---|---|
# | the $T\times T$ matrix is the memory | `peak_memory(fn)` against $T$ | slope 2 on log-log |
# | online softmax | running $m$, $\ell$, $a$; rescale by $e^{m - m'}$ | per query: $O(d_v)$ |
# | tiled attention | `tiled_attention(Q, K, V, mask, causal, block_q, block_k)` | `(..., T_q, d_k)` → `(..., T_q, d_v)` |
# | recomputing backward | `TiledAttention` saves `Q, K, V, O, L` | memory $O(T)$ in training |
# | fused kernels | `F.scaled_dot_product_attention`, `sdpa_kernel(SDPBackend.…)` | `(B, h, T, d_k)` |
# | our mask for PyTorch's kernel | `fused_attention_mask(mask, T_q, T_k)` | → `(attn_mask, is_causal)` |
# | faster CPU dropout | `fast_dropout(x, p)` (on the attention weights) | any |
# | the fast path | `Transformer(..., fast=True)` or `use_fast_path(model)`: `fast` in every `MultiHeadAttention` (`fast_forward`, `fused_attention`) and `LayerNorm` | the same `state_dict` |
# | FLOPs | $6 \times$ weights × tokens + $12\,T_q T_k d$ per attention | `FlopCounterMode` agrees |
# | MFU | counted FLOPs / step time / matmul peak | a fraction |
# | benchmark | `make bench` | `bench.json` |
#
# ## Exercises
#
# 1. **Tile sizes.** Time `tiled_attention` at $T = 2048$ with tiles of 64, 256 and 1024. Why is
#    the smallest slowest, and what does the largest cost in memory?
# 2. **A causal saving.** How many of the $(T/b)^2$ tiles does the causal forward pass compute?
#    Check your count against the number of calls to `_tile_scores`.
# 3. **Sharing weights.** In a self-attention call, the fast path concatenates $W_q, W_k, W_v$ at
#    every step. Why does that not break training, and what would break if it kept the
#    concatenated copy between steps?
# 4. **The fast path's dropout.** With dropout on, the fast path and the from-scratch model
#    cannot give the same numbers (section 5). Show that `fast_dropout` on the CPU is exactly
#    "keep where $u \ge p$, $u \sim U[0, 1)$, scale by $1/(1-p)$", by drawing the uniforms
#    yourself from the same seed.
# 5. **FLOPs when the model widens.** Double `d_model` to 256 and `d_ff` to 1024, with the same
#    batch. By what factor do a training step's FLOPs grow, and why slightly less than 4?
# 6. **A KV cache in bytes.** A model with $d = 512$ and 6 decoder layers decodes a batch of 8
#    with sources of 100 tokens for 400 steps. How large is its cache in float32, and in
#    bfloat16?
#
# **Solutions.**
#
# 1. Each tile is a few small matmuls plus Python: with $b = 64$ there are 1024 tiles of work
#    each far below the matmul peak. Memory grows with the tile, $b^2$ floats per temporary:

# %% tags=["nbval-ignore-output"]
Qx, Kx, Vx = make_qkv(2048)
tile_mem = {}
for b in (64, 256, 1024):
    with torch.no_grad():
        t = time_call(lambda b=b: tiled_attention(Qx, Kx, Vx, block_q=b, block_k=b), repeats=1)
        tile_mem[b] = peak_memory(lambda b=b: tiled_attention(Qx, Kx, Vx, block_q=b, block_k=b),
                                  device)
    print(f"tiles of {b:4d}: {1e3 * t:6.1f} ms, {tile_mem[b] / MiB:5.1f} MiB")

# %%
assert tile_mem[64] < tile_mem[256] < tile_mem[1024]  # the temporaries grow with the tile

# %% [markdown]
# 2. Query tile $i$ (counting from 0) sees key tiles $0, \dots, i$, that is $i + 1$ of them:
#    $\sum_{i=0}^{n-1} (i + 1) = n(n+1)/2$ of the $n^2$ tiles, $n = T/b$, about half. (The
#    counter below reaches `tiled_attention_forward` as the replacements of section 5 did: it
#    was defined in this notebook.)

# %%
calls = 0
original_tile_scores = _tile_scores


def counting_tile_scores(*args):
    global calls
    calls += 1
    return original_tile_scores(*args)


_tile_scores = counting_tile_scores
try:
    with torch.no_grad():
        tiled_attention(Qx, Kx, Vx, causal=True, block_q=256, block_k=256)
finally:
    _tile_scores = original_tile_scores
n_tiles = 2048 // 256
print(f"{calls} tiles computed of {n_tiles**2}; n(n+1)/2 = {n_tiles * (n_tiles + 1) // 2}")
assert calls == n_tiles * (n_tiles + 1) // 2

# %% [markdown]
# 3. `torch.cat` is an operation autograd records: the gradient of the packed matrix is split
#    back into the gradients of $W_q$, $W_k$ and $W_v$, the optimizer updates those, and the
#    next step concatenates the new values. A packed copy kept between steps would be a separate
#    tensor: the optimizer would update $W_q, W_k, W_v$ and the copy would keep the old numbers.
#    The cost of concatenating, $3d^2$ numbers a call, is small next to the matmul it feeds.
# 4. On the CPU `fast_dropout` draws `torch.rand_like(x)` from the global generator and keeps
#    $u \ge p$; after the same seed, the same uniforms give the same mask:

# %%
x_drop = torch.rand(4, 8, generator=torch.Generator().manual_seed(3))  # on the CPU
torch.manual_seed(7)
ours_dropped = fast_dropout(x_drop, 0.25)
torch.manual_seed(7)
uniforms = torch.rand_like(x_drop)
assert torch.equal(ours_dropped, x_drop * (uniforms >= 0.25) * (1 / 0.75))
print("fast_dropout kept exactly the elements whose uniform was at least p, scaled by 1 / (1 - p)")

# %% [markdown]
# 5. Every $d \times d$ weight, and each feed-forward's $d \times d_{ff}$, grows fourfold, but
#    the output head ($d \times V$) only twofold, and so do attention's $QK^\top$ and $PV$
#    ($2T_qT_kd$): the factor is a little under 4. `training_flops` of section 6 counts it:

# %%
set_seed(0)
wide = Transformer(12, 12, d_model=256, d_ff=1024)
wide_ratio = sum(training_flops(wide, 64, S_len, T_len)) / (flops_linear + flops_attention)
print(f"{sum(training_flops(wide, 64, S_len, T_len)) / 1e9:.4f} GFLOP a step, {wide_ratio:.3f} "
      f"times the d = 128 model's")
assert 3.9 < wide_ratio < 4.0

# %% [markdown]
# 6. $2 N B d (n + S)$ numbers: $2 \cdot 6 \cdot 8 \cdot 512 \cdot (400 + 100)$, 24.6 million, so
#    98.3 MB in float32 and half that in bfloat16 (a growing buffer may hold up to twice as
#    much, section 6):

# %%
cache_numbers = 2 * 6 * 8 * 512 * (400 + 100)
print(f"{cache_numbers:,} numbers: {cache_numbers * 4 / 1e6:.1f} MB in float32, "
      f"{cache_numbers * 2 / 1e6:.1f} MB in bfloat16")


# %% [markdown]
# ## Appendix · Measurement notes
#
# What a reader re-measuring this notebook may want, and a learner can skip: what we saw on other
# machines and releases, a closer look at one row of section 5's profile, the range of every
# number that moves from run to run, and two details of section 6.
#
# **A · Rows with no allowed key on GPU kernels.** PyTorch's CPU kernels return zeros for such a
# row (since torch 2.5); GPU kernels need not: some have given NaN, and on an H200 GPU (torch
# 2.11) cuDNN's kernel returned finite, non-zero values (neither zeros nor NaN) for a float16 row
# with no allowed key. Section 5's check of the whole model passed on that H200 with the fast
# path's handling of such rows removed too: its float32 attention runs there in the
# memory-efficient kernel, which returns zeros, and cuDNN's takes no float32. Hence the stand-in
# kernel of section 5, and the unit tests against it and against one that returns NaN.
#
# **B · Dropout's random numbers, counted.** Both models draw with `bernoulli_` for the same
# sub-layer outputs. A profile of one more step that records the shapes of the operators' inputs
# counts the calls and the numbers each model draws; section 5's profile gives their time, per
# million numbers; and `bernoulli_` is timed alone, one thread, on each shape that
# `nn.Transformer` draws:

# %% tags=["nbval-ignore-output"]
def random_numbers_drawn(model):
    """{operator: (calls, numbers drawn, {input shapes})} of dropout's random-number operators in
    one training step of a copy of model, from a profile that records the shapes of their inputs."""
    step = make_train_step(copy.deepcopy(model), *train_batch)
    step()  # warm-up
    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    drawn = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in GROUPS["dropout's random numbers"]:
            calls, numbers, shapes = drawn.get(event.key, (0, 0, set()))
            shape = tuple(event.input_shapes[0])
            drawn[event.key] = (calls + event.count, numbers + event.count * math.prod(shape),
                                shapes | {shape})
    return drawn


drawn_by = {name: random_numbers_drawn(m) for name, m in
            (("fast path", bench_fast), ("nn.Transformer", bench_torch))}  # fmt: skip
per_million = {}
for name, drawn in drawn_by.items():
    for op, (calls, numbers, _) in sorted(drawn.items()):
        per_million[name, op] = profiles[name].get(op, 0.0) / (numbers / 1e6)
        print(f"{name:>14}, {op[6:]:>10}: {calls:2d} calls, {numbers:9,} numbers a step, "
              f"{profiles[name].get(op, 0.0):5.1f} ms = "
              f"{per_million[name, op]:5.1f} ms per million")
bernoulli_ratio = (per_million["fast path", "aten::bernoulli_"]
                   / per_million["nn.Transformer", "aten::bernoulli_"])
print(f"bernoulli_, ms per million numbers, fast path / nn.Transformer: {bernoulli_ratio:.2f}")
torch.set_num_threads(1)
try:
    alone = {}
    for shape in sorted(drawn_by["nn.Transformer"]["aten::bernoulli_"][2]):
        target = torch.empty(shape, device=device)
        seconds = time_call(lambda t=target: t.bernoulli_(0.9), warmup=2, repeats=20)
        alone[shape] = 1e3 * seconds / (math.prod(shape) / 1e6)  # ms per million numbers
finally:
    torch.set_num_threads(threads)
print("bernoulli_ alone, one thread, ms per million numbers: "
      + ", ".join(f"{'×'.join(map(str, shape))} {ms:.1f}" for shape, ms in alone.items()))
for name, drawn in drawn_by.items():
    print(f"{name:>14}, the shapes drawn: " + "; ".join(
        f"{op[6:]} " + ", ".join("×".join(map(str, shape)) for shape in sorted(shapes))
        for op, (_, _, shapes) in sorted(drawn.items())))

# %%
if device.type == "cpu":  # on a GPU both models drop with F.dropout's fused kernel
    numbers_of = {(name, op): numbers for name, drawn in drawn_by.items()
                  for op, (_, numbers, _) in drawn.items()}
    # the same dropout, split differently: nn.Transformer draws with bernoulli_ what the fast
    # path draws with bernoulli_ (the sub-layer outputs) and with uniform_ (the attention weights)
    assert numbers_of["nn.Transformer", "aten::bernoulli_"] == (
        numbers_of["fast path", "aten::bernoulli_"] + numbers_of["fast path", "aten::uniform_"])
    # and by calls and shapes: nn.Transformer's bernoulli_ draws the fast path's bernoulli_
    # tensors (the sub-layer outputs) and its uniform_ ones (the attention weights), no others
    (fb_calls, _, fb_shapes), (fu_calls, _, fu_shapes) = (
        drawn_by["fast path"][op] for op in ("aten::bernoulli_", "aten::uniform_"))
    tb_calls, _, tb_shapes = drawn_by["nn.Transformer"]["aten::bernoulli_"]
    assert tb_calls == fb_calls + fu_calls and fb_shapes.isdisjoint(fu_shapes)
    assert fb_shapes < tb_shapes and tb_shapes == fb_shapes | fu_shapes

# %% [markdown]
# At nine positions the attention weights are the small part of the model's dropout
# ($64 \cdot 4 \cdot 9^2$ numbers per attention layer against $64 \cdot 9 \cdot 128$ per sub-layer
# output). The fast path's `bernoulli_` draws a subset of what `nn.Transformer`'s draws, the same
# twelve tensors of the same shapes, and the rest with `uniform_` (the counts and shapes above,
# checked: the calls and the numbers drawn add up, and the shapes of `nn.Transformer`'s draws are
# those of the fast path's `bernoulli_` and `uniform_` together). Its
# row cannot be larger for any reason but noise, yet it can come out larger: the same operator on
# the same twelve tensors cost the fast path from about 0.6 to 2.4 times as much per number as
# `nn.Transformer` in our runs (the ratio printed above). The six smaller attention-weight tensors
# that only `nn.Transformer` draws ($64 \times 4 \times 9 \times 9$ and the like) would explain it
# only if `bernoulli_` cost less per number on them; timed alone (the last line above), it costs
# about the same on every shape. This row is the least steady of the profile: a reading of it,
# either way, needs this ratio beside it.
#
# **C · Profile and timing measure different things.** A profile is a picture of where the time
# goes, not a step time, and its ratio of the two steps (`fast / torch` in section 5) need not be
# the timed one. The timing is the wall-clock time of whole steps, the median of five turns. The
# profile sums only the operators' own time, each operator's the smallest of three interleaved
# rounds (so the sum can mix rounds), and leaves out what happens between operators, Python and
# the dispatcher: the line "the fast path's step" of the profile puts its profiled step beside its
# timed one. The profiler also adds a cost of its own to every operator call, and on a busy
# machine the two measurements saw different loads. `make bench`, like the timing cell, uses whole
# steps' wall-clock time (medians of interleaved runs).
#
# **D · Graphs per release.** The fast model traced to one graph, in evaluation and in training
# mode, with torch 2.13 (this stored run, on a CPU) and with 2.11 (on an H200 GPU), and to 6
# graphs with 2.5.1, the oldest release the course supports; releases 2.6 to 2.10 and 2.12 we did
# not try, nor 2.11 on a CPU. So section 5 asserts one graph from 2.11 on, and skips that assert
# before it.
#
# **E · What moves from run to run.** The notebook's own timings and profiles are single runs on a
# shared machine; the prose beside them quotes the range we saw over several runs on this course's
# 2-core x86-64 CPUs. Each such ratio, where it is printed, that range, and what the notebook
# asserts about it (a bound that holds far outside the range, or nothing):
#
# | ratio | printed in | range in our runs | asserted |
# |---|---|---|---|
# | fused attention, `F.layer_norm` / the from-scratch piece | section 5, "How much faster?" | about 0.05 to 0.6 | below 1 (x86-64) |
# | `fast_dropout` / `F.dropout`; packed / three projections | section 5, "How much faster?" | about 0.1 to 1; about 0.1 to 2.4 | nothing |
# | fast path / `nn.Transformer`, one timed step | section 5, "How much faster?" | `make bench`: 0.79 to 1.02 (section 8) | below 1.5 |
# | their matmuls' own times, fast path / `nn.Transformer` | section 5's profile ("matmuls alone") | 0.75 to 1.02 (1.6 once, on a busy machine) | within a factor 2 |
# | `bernoulli_`'s time per number, fast path / `nn.Transformer` | B, above | 0.6 to 2.4 | nothing |
# | fused Adam / plain Adam, one step | section 6, MFU | 0.65 to 1.3 | below 2 |
# | the step's matmuls' rate / the measured matmul peak | section 6, MFU ("the step's matmuls alone") | about 2/3 to 1.6 | 0.3 to 2.5 (x86-64) |
# | the naive attention's matmuls / all its operators' time | section 6, after the roofline | about 1/3 to 0.55 | 0.15 to 0.85 (x86-64) |
# | $QK^\top$ into a reused tensor / into a new one, speed | section 6, after the roofline | 1.9 to about 4 | nothing |
# | bfloat16 autocast / float32, time of a forward and backward | section 7 | 2/3 to 1.5 with bfloat16 instructions; 11 on one machine without | nothing (its memory: below float32's) |
# | checkpointed / plain, time of a forward and backward | section 7 | either side of the arithmetic's 4/3 | below 3 |
#
# **F · Two details of sections 6 and 8.** *The theoretical peak's assumption.* `make bench`
# takes the AVX-512 machine's theoretical peak to be twice as wide as the AVX2 one's (16 float32
# lanes instead of 8, and two FMA units for both). An AMD EPYC with AVX-512 is a Zen 4 or a Zen 5,
# and Zen 4 runs each 512-bit FMA on 256-bit units, at the float32 width per cycle of AVX2: on a
# Zen 4 the assumed peak is twice the real one at the same clock, and the MFU against it half the
# MFU against the real one (the benchmark's `cpu_info` warns of this in its `assumption`, stored
# in `bench.json`). *Plain and fused Adam, trained instead of fed the same gradients* (section
# 6): in our runs, five training steps of each, from the same weights and with the same dropout
# masks, ended as much as $3 \cdot 10^{-5}$ apart, where the check sees rounding only.

# %% [markdown]
# Next: notebook 15, *Tuning and generalisation*.
