# %% [markdown]
# # 09 · Embeddings and the output head
#
# **What you will build:** the two ends of the model, where discrete tokens meet the vectors the
# blocks work on. At the bottom, three reserved token ids (`PAD`, `BOS`, `EOS`) and an embedding
# table whose padding row stays zero and receives no gradient; the $\sqrt{d_\text{model}}$
# multiply of Vaswani et al. (2017) together with the initialisation it assumes, measured against
# the size of the positional encoding. At the top, a linear layer that returns **logits**, and
# why the softmax drawn after it in the paper's figure belongs in the loss, not in the model.
# On the side: weight tying (Press and Wolf, 2017). The reserved ids and the check of a batch of
# ids go into the module `transformer_from_scratch.tokens`; the embedding and the head into
# `transformer_from_scratch.model`, which notebook 10 completes.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/09_embeddings_and_output_head.ipynb) · Assumes: [04 · Positional encoding](04_positional_encoding.ipynb), [05 · Masking](05_masking.ipynb), [06 · Layer norm and dropout](06_layer_norm_and_dropout.ipynb).

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
import itertools
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.checks import validated
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.positional import PositionalEncoding, sinusoidal_table
from transformer_from_scratch.utils import COLORS, get_device, save_figure, set_seed

generator = set_seed(0)
device = get_device()

# %% [markdown]
# ## Three reserved ids
#
# A model reads and writes integers: token ids $0, 1, \dots, V - 1$ from a vocabulary of size
# $V$. Before the vocabulary holds a single real symbol, an encoder–decoder needs three ids with
# a fixed job:
#
# | id | name | job |
# |---|---|---|
# | 0 | `PAD` | fills short sequences up to the length of the longest one in the batch; masked as a key (notebook 05) and ignored by the loss |
# | 1 | `BOS` | *beginning of sequence*: the first input of the decoder, which has nothing else to condition on at step one |
# | 2 | `EOS` | *end of sequence*: the last target; generation stops when the model emits it |
#
# Putting `PAD` at 0 is a convention, not a necessity, but a convenient one: tools that pad with
# zeros by default, `torch.zeros` and `pad_sequence` (whose `padding_value` is 0), then pad with
# `PAD` without being told. The three go into a small module of their
# own, `transformer_from_scratch.tokens`: the model needs them, and so do the data that notebook
# 11 makes and the tokenizer of notebook 13, which should not have to import a model to know
# which id means padding. Every reserved id of the course lives there, so the module also holds
# the one notebook 13's tokenizer adds, `UNK = 3`, for a character it never saw in training.
# `UNK` is reserved only in notebook 13's vocabulary: the reversal task below has no unknown
# symbols, and there id 3 is an ordinary symbol.

# %%
#| default_exp model

# %%
#| export tokens
"""Token ids the whole library agrees on: the reserved ids, and the check of a batch of ids."""

import torch

from transformer_from_scratch.checks import check_tensor

PAD, BOS, EOS = 0, 1, 2  # reserved token ids: padding, beginning and end of sequence
UNK = 3  # an unknown symbol: notebook 13's tokenizer writes it for a character it never saw

# %% [markdown]
# The embeddings and the output head go into the package's `model` module, which this notebook
# starts and notebook 10 completes. Its imports name `checking`, notebook 00's switch that says
# whether inputs are still to be checked; the section *A clear error for a bad id* uses it, with
# `check_token_ids`, which that section adds to the `tokens` module. `make export` adds
# `from transformer_from_scratch.tokens import check_token_ids` to `src/`'s `model.py`; if you copy
# these cells into a module of your own, add that line to its imports.

# %%
#| export
"""The encoder-decoder Transformer: token embeddings and the output head (09), the model (10)."""

import math

import torch
from torch import nn

from transformer_from_scratch.checks import checking
from transformer_from_scratch.tokens import PAD

# %% [markdown]
# With them, a batch of the task that notebook 11 trains on, reversing a sequence of symbols
# (the ids $3, \dots, 11$ of a vocabulary of $V = 12$; id 3 is a symbol here, not `UNK`). The decoder is trained with *teacher
# forcing*: it reads the correct target shifted right by one, `tgt_in` $= [\mathrm{BOS}, y_1,
# \dots, y_L]$, and must predict `tgt_out` $= [y_1, \dots, y_L, \mathrm{EOS}]$, the same sequence
# shifted left. Position $t$ of `tgt_in` is the last token the decoder has seen when it predicts
# position $t$ of `tgt_out`. Notebook 11 exports a random batch maker; here three sequences are
# written out by hand.

# %%
V = 12  # vocabulary: PAD, BOS, EOS and the nine symbols 3..11
sequences = [[5, 9, 3, 11, 7], [4, 4, 10], [8, 3, 6, 11, 9, 5, 10]]
B, T_max = len(sequences), max(len(s) for s in sequences)

src = torch.full((B, T_max), PAD)  # (B, T_src), PAD everywhere first
tgt_in = torch.full((B, T_max + 1), PAD)  # (B, T_tgt): one longer, for BOS
tgt_out = torch.full((B, T_max + 1), PAD)  # (B, T_tgt): one longer, for EOS
for b, seq in enumerate(sequences):
    L, reversed_seq = len(seq), seq[::-1]
    src[b, :L] = torch.tensor(seq)
    tgt_in[b, : L + 1] = torch.tensor([BOS, *reversed_seq])
    tgt_out[b, : L + 1] = torch.tensor([*reversed_seq, EOS])
print("src\n", src, "\ntgt_in\n", tgt_in, "\ntgt_out\n", tgt_out)


# %% [markdown]
# **Check:** the batch against what it should hold, computed from the tensors rather than
# from the loop's expressions. `src` is what PyTorch's `pad_sequence` makes of the list. Each
# row of `tgt_out` holds that row of `src` backwards (its length read off the padding), then
# `EOS`, then padding. And the relation that training relies on (notebook 11): `tgt_in` is
# `tgt_out` moved one place to the right, with `BOS` in front and the `EOS` left out, so the
# decoder reads at position $t$ exactly the tokens it must predict before $t$.

# %%
def padded(rows: list[list[int]]) -> torch.Tensor:
    """PyTorch's own padding of a list of id lists: (B, longest) filled with PAD."""
    return nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=PAD)


assert torch.equal(padded(sequences), src)
src_lengths = (src != PAD).sum(dim=1)  # (B,): the real tokens of each row
for b, L in enumerate(src_lengths.tolist()):
    assert torch.equal(tgt_out[b, :L], src[b, :L].flip(0))  # the source, reversed
    assert tgt_out[b, L] == EOS and (tgt_out[b, L + 1 :] == PAD).all()  # then EOS, then padding
shifted = torch.cat([torch.full((B, 1), BOS), tgt_out[:, :-1]], dim=1)  # (B, T_tgt): one place right
shifted[shifted == EOS] = PAD  # EOS is never an input
assert torch.equal(shifted, tgt_in)
print("src as pad_sequence builds it; tgt_out is src reversed, then EOS; tgt_in is tgt_out shifted right by one")

# %% [markdown]
# The same batch as a picture, one shade per kind of token: greys, because blue, orange and green
# have fixed meanings in every figure of the course (queries, keys and values, or blue for ours
# and orange for PyTorch's; notebook 00), and a kind of token is none of them; `EOS`, where
# generation stops, in red, the accent:

# %% jupyter={"source_hidden": true}
kinds = {"PAD": "#f0f0f0", "BOS": "#404040", "EOS": COLORS["accent"], "symbol": "#bdbdbd"}
text_color = {PAD: "black", BOS: "white", EOS: "white"}  # symbols: black


def token_kind(ids: torch.Tensor) -> np.ndarray:
    """0 PAD, 1 BOS, 2 EOS, 3 any real symbol: the row index into `kinds`."""
    return ids.clamp(max=3).numpy()


fig, axes = plt.subplots(1, 3, figsize=(12, 2.8), layout="constrained", width_ratios=[T_max, T_max + 1, T_max + 1])
cmap = ListedColormap(list(kinds.values()))
for ax, (name, ids) in zip(axes, {"src": src, "tgt_in (decoder reads)": tgt_in,
                                  "tgt_out (decoder predicts)": tgt_out}.items(), strict=True):
    ax.imshow(token_kind(ids), cmap=cmap, vmin=-0.5, vmax=3.5)
    for (b, t), v in np.ndenumerate(ids.numpy()):
        ax.text(t, b, str(v), ha="center", va="center", fontsize=9, color=text_color.get(v, "black"))
    ax.set(title=name, xlabel="position $t$", ylabel="sequence $b$",
           xticks=range(ids.shape[1]), yticks=range(B))
fig.legend(handles=[Patch(facecolor=c, edgecolor="#888888", label=k) for k, c in kinds.items()], loc="outside lower center",
           ncols=4, fontsize=9)
fig.suptitle("A padded batch of the reversal task (vocabulary of 12: PAD=0, BOS=1, EOS=2, symbols 3..11)")
fig.get_layout_engine().set(h_pad=0.06)  # keep the panel titles clear of the figure title
save_figure(fig, "embeddings_special_tokens")
plt.show()

# %% [markdown]
# **`PAD`, `BOS` and `EOS` are ordinary ids with reserved jobs; teacher forcing feeds the
# decoder `[BOS, y]` and grades it on `[y, EOS]`.**
#
# ## The embedding table
#
# An embedding is a trainable matrix $E \in \mathbb{R}^{V \times d_\text{model}}$ whose row $v$
# is the vector of token $v$. Looking a token up is the same as multiplying its one-hot vector by
# $E$: $\operatorname{onehot}(v)^\top E = E_v$. `nn.Embedding` does the lookup without building
# the one-hot matrix. Its gradient is a full $(V \times d_\text{model})$ tensor, but only the
# rows of tokens that were used get a non-zero gradient: row $v$ gets the sum of the gradients of
# every position where token $v$ appears.
#
# **Check:** the lookup equals the one-hot product, and so does its gradient; rows of tokens
# absent from the batch get a zero gradient.

# %%
d_small = 8  # a narrow table, so that its numbers fit on screen
emb = nn.Embedding(V, d_small).to(device)  # no padding_idx yet
ids = src.to(device)  # (B, T_src)
onehot = F.one_hot(ids, num_classes=V).float()  # (B, T_src) -> (B, T_src, V)
assert_close(emb(ids), onehot @ emb.weight)  # (B, T, V) @ (V, d) -> (B, T, d)

upstream_emb = torch.randn(B, T_max, d_small, generator=generator).to(device)  # a stand-in dL/d(emb)
(emb(ids) * upstream_emb).sum().backward()
grad_lookup = emb.weight.grad.clone()
emb.weight.grad = None
((onehot @ emb.weight) * upstream_emb).sum().backward()
assert_close(grad_lookup, emb.weight.grad)
used = torch.zeros(V, dtype=torch.bool, device=device)
used[ids.unique()] = True
assert (grad_lookup[~used] == 0).all() and (grad_lookup[used].abs().sum(dim=1) > 0).all()
assert grad_lookup[PAD].abs().sum() > 0  # the padding row gets a gradient like any other
print("rows with a gradient:", used.nonzero().flatten().tolist(),
      "(PAD=0 among them; BOS=1 and EOS=2 are not in src)")

# %% [markdown]
# ### `padding_idx`: a row that stays zero
#
# Look at the rows with a gradient above: row 0, `PAD`, is one of them. Every padded position
# sends its upstream gradient into the padding row, so a plain embedding trains a vector for a
# token that carries no information. `padding_idx` exists to stop that.
#
# `nn.Embedding(V, d_model, padding_idx=PAD)` does two things for the padding row: it is filled
# with zeros when the table is built, and the backward pass never writes a gradient into it. A
# padded position still enters the model (with its positional encoding added), but its token
# vector is zero and stays zero for the whole of training. The masks of notebook 05 keep other
# positions from reading it, and `ignore_index=PAD` keeps the loss from grading it.
#
# **Check:** at construction the `PAD` row is zero; after a backward pass through a batch that
# contains padding its gradient is exactly zero; and after a few Adam steps the row is still
# exactly zero (Adam's update is $m / (\sqrt{v} + \epsilon)$, and a gradient that is always zero
# leaves $m = v = 0$).

# %%
emb = nn.Embedding(V, d_small, padding_idx=PAD).to(device)
assert torch.count_nonzero(emb.weight[PAD]) == 0
optimizer = torch.optim.Adam(emb.parameters(), lr=0.1)
for _ in range(5):
    optimizer.zero_grad()
    (emb(ids) * upstream_emb).sum().backward()
    assert torch.count_nonzero(emb.weight.grad[PAD]) == 0
    optimizer.step()
assert torch.count_nonzero(emb.weight[PAD]) == 0
print(f"PAD appears {int((ids == PAD).sum())} times; its row after 5 Adam steps:",
      emb.weight[PAD].tolist())

# %% [markdown]
# The trap: `padding_idx` zeroes the row **only at construction**. Any initialisation applied
# afterwards (and the next section applies one) overwrites it with random numbers, and, because
# the row never receives a gradient, no gradient step ever removes them: with Adam they stay
# exactly as drawn, and AdamW's weight decay (notebook 13) only shrinks them by a factor
# $1 - \eta\lambda$ per step. The gradient masking still works; the zero row is gone. **Check:** re-initialise, then train
# as above: the `PAD` row is a random vector, and five Adam steps leave it bit for bit as the
# initialisation drew it, while every other row that was used has moved.

# %%
emb = nn.Embedding(V, d_small, padding_idx=PAD)
nn.init.normal_(emb.weight, std=d_small**-0.5)  # re-initialised after construction (on the CPU)
emb = emb.to(device)
drawn = emb.weight.detach().clone()  # (V, d): the table as the initialisation left it
optimizer = torch.optim.Adam(emb.parameters(), lr=0.1)
for _ in range(5):
    optimizer.zero_grad()
    (emb(ids) * upstream_emb).sum().backward()
    optimizer.step()
print("PAD row after nn.init.normal_ and 5 Adam steps:", [round(v, 3) for v in emb.weight[PAD].tolist()])
symbol_rows = used.clone()
symbol_rows[PAD] = False  # the rows of the real tokens in the batch
assert drawn[PAD].norm() > 0.2  # the initialisation overwrote the zero row (norm about 1)
assert torch.equal(emb.weight[PAD], drawn[PAD])  # never trained: the random draw stays
assert (emb.weight[symbol_rows] != drawn[symbol_rows]).any(dim=1).all()  # every used row moved

# %% [markdown]
# **`padding_idx=PAD` gives the padding token a zero vector that no gradient ever changes, but
# only if nothing re-initialises the table after it is built.**
#
# ## Why $\sqrt{d_\text{model}}$, and the initialisation it assumes
#
# The input of the first block is the token's vector plus its position's (notebook 04):
#
# $$x_t = \sqrt{d_\text{model}}\; E_{w_t} + \mathrm{PE}_t ,$$
#
# where $w_t$ is the token id at position $t$ and $E_{w_t}$ its row of the table. Vaswani et al.
# (2017, §3.4) write only that "in the embedding layers, we multiply those weights by
# $\sqrt{d_\text{model}}$".
#
# The upshot, measured below: **multiply by $\sqrt{d_\text{model}}$ only a table drawn from
# $\mathcal{N}(0, 1/d_\text{model})$** (what `init_token_embedding` does); PyTorch's default
# $\mathcal{N}(0, 1)$ table, multiplied, makes the token vectors 16 times as long as the
# positional encoding at $d_\text{model} = 128$, and the gap grows with the width.
#
# The section compares three set-ups: the course's table, drawn from $\mathcal{N}(0, 1/d_\text{model})$
# and multiplied; a table drawn from $\mathcal{N}(0, 1)$ and not multiplied; and PyTorch's default
# table, $\mathcal{N}(0, 1)$, with the multiply. A table at the end of the section sums up what
# it measures.
#
# First, plainly: **for a table that is not shared with anything, the multiply changes nothing
# at initialisation, provided the table's scale matches it.** A table drawn from
# $\mathcal{N}(0, 1/d_\text{model})$ and multiplied by $\sqrt{d_\text{model}}$, and a table drawn
# from $\mathcal{N}(0, 1)$ and not multiplied, give the first block the same inputs: entries of
# variance 1, token vectors of norm $\approx \sqrt{d_\text{model}}$. What the convention buys is
# elsewhere:
#
# 1. **Tying.** When the same matrix is also the output layer (as in the paper; the last section
#    of this notebook), its rows must be small, $\mathcal{N}(0, 1/d_\text{model})$, for the logits
#    $h_t \cdot E_v$ to start at unit scale. The multiply then brings those small rows back to
#    unit-scale entries at the input.
# 2. **A different step size.** Adam moves each entry that has a gradient by a step of the
#    order of the learning rate, whatever the size of that gradient: on the first step by
#    $\eta\,|g| / (|g| + \epsilon)$, the learning rate $\eta$ itself unless $|g|$ is as small as
#    $\epsilon = 10^{-8}$; later by less where the gradient's sign keeps changing (notebook 08
#    measures both). An entry whose gradient is zero (a token absent from the batch) does not
#    move. Through the multiply, the same change of $E$ moves the input $\sqrt{d_\text{model}}$
#    times more (11 times at $d_\text{model} = 128$). Two set-ups that start out identical
#    therefore train differently.

# %% [markdown]
# **Check (the second point; the first is checked in the section on tying):** two tables that
# give the same inputs, one optimiser step on each with the same loss and learning rate. By the
# chain rule the multiplied table's gradient is $\sqrt{d_\text{model}}$ times the other's (the
# printed gradient norms show it; it follows from the set-up, so no assert tests it). What the
# check tests is Adam's side of the argument: every entry with a non-zero gradient moves by
# the learning rate in *both* tables (to a relative $10^{-3}$), and the input behind the multiply
# moves $\sqrt{d_\text{model}}$ times further. The first cell builds the two tables, a target
# for their input and `one_step`, which takes one optimiser step on either table from its
# starting weights. It draws the target from its own seeded generator, so that it prints the same
# numbers when run again.

# %%
sqrt_generator = set_seed(0)  # this cell's own stream: run again, it draws the same x_goal
d_model = 128  # the course's model width, from here on
table_scaled = nn.Embedding(V, d_model)  # E ~ N(0, 1/d), multiplied by sqrt(d)
nn.init.normal_(table_scaled.weight, std=d_model**-0.5)  # drawn on the CPU, then moved
table_scaled = table_scaled.to(device)
table_plain = nn.Embedding(V, d_model).to(device)  # E' = sqrt(d) E ~ N(0, 1), not multiplied
with torch.no_grad():
    table_plain.weight.copy_(table_scaled.weight * math.sqrt(d_model))

tokens = src.to(device)  # (B, T_src)
x_start = (table_scaled(tokens) * math.sqrt(d_model)).detach()  # (B, T_src, d)
assert_close(table_plain(tokens), x_start)  # the same input at initialisation
x_goal = torch.randn(B, T_max, d_model, generator=sqrt_generator).to(device)  # any loss of the input will do
scaled_start = table_scaled.weight.detach().clone()  # each optimiser starts from these tables
plain_start = table_plain.weight.detach().clone()
setups = {"times sqrt(d)": (table_scaled, math.sqrt(d_model), scaled_start),  # name -> (table, multiply, start)
          "no multiply": (table_plain, 1.0, plain_start)}


def one_step(make_optimizer, name: str) -> dict:
    """One step of `make_optimizer` (lr 1e-3) on set-up `name`, from its starting table: what moved."""
    table, scale, start = setups[name]
    with torch.no_grad():
        table.weight.copy_(start)
    table.zero_grad()
    optimizer = make_optimizer(table.parameters(), lr=1e-3)  # the same learning rate for all
    (table(tokens) * scale - x_goal).pow(2).sum().backward()
    optimizer.step()
    step = (table.weight - start).detach()  # (V, d): how far each entry moved
    used_entries = table.weight.grad.abs() > 0  # (V, d): the entries of the rows the batch uses
    result = {"gradient norm": table.weight.grad.norm().item(),
              "entry step": step[used_entries].abs(),
              "unused still": bool((step[~used_entries] == 0).all()),  # BOS, EOS: not in src
              "input moved": (table(tokens) * scale - x_start).norm().item()}
    print(f"{make_optimizer.__name__:>4}, {name:>13}: gradient norm {result['gradient norm']:8.1f}, median entry "
          f"step {result['entry step'].median().item():.2e}, the input moved by {result['input moved']:.4g}")
    return result


# %%
adam_steps = {name: one_step(torch.optim.Adam, name) for name in setups}
ratio_adam = adam_steps["times sqrt(d)"]["input moved"] / adam_steps["no multiply"]["input moved"]
print(f"Adam: input moved, with the multiply / without: {ratio_adam:.2f} (sqrt(d) = {math.sqrt(d_model):.2f})")

# %%
for result in adam_steps.values():  # every used entry moves by the learning rate
    assert_close(result["entry step"], torch.full_like(result["entry step"], 1e-3), rtol=1e-3, atol=0)
    assert result["unused still"]  # and an entry without a gradient does not move
assert abs(ratio_adam / math.sqrt(d_model) - 1) < 1e-3  # so the input moves sqrt(d) times further

# %% [markdown]
# That ratio is Adam's doing, not the multiply's alone. Plain SGD, whose step is proportional to
# the gradient, makes the ratio $d_\text{model}$: the larger gradient *and* the multiply.
# **Check,** with the same tables, target and learning rate:

# %%
sgd_steps = {name: one_step(torch.optim.SGD, name) for name in setups}
ratio_sgd = sgd_steps["times sqrt(d)"]["input moved"] / sgd_steps["no multiply"]["input moved"]
print(f"SGD: input moved, with the multiply / without: {ratio_sgd:.1f} (d = {d_model})")
assert abs(ratio_sgd / d_model - 1) < 1e-3  # d times further


# %% [markdown]
# **At initialisation, $\mathcal{N}(0, 1/d)$ times $\sqrt d$ and $\mathcal{N}(0, 1)$ alone are
# the same input; the multiply matters for a tied output layer and for the size of each step.**
#
# What does go wrong is the third combination, which many published implementations carry:
# the multiply **together with** PyTorch's default table. Compare the sizes of the two terms of
# $x_t$:
#
# * **The positional encoding** has a fixed size. Its $d_\text{model}/2$ (sin, cos) pairs each
#   have $\sin^2 + \cos^2 = 1$, so for every position
#   $$\|\mathrm{PE}_t\| = \sqrt{d_\text{model}/2}\,.$$
# * **A token vector** with entries drawn from $\mathcal{N}(0, \sigma^2)$ has
#   $\mathbb{E}\,\|E_v\|^2 = d_\text{model}\,\sigma^2$, so after the multiply
#   $\|\sqrt{d_\text{model}}\,E_v\| \approx d_\text{model}\,\sigma$.
#
# The authors' code (tensor2tensor) draws the shared matrix from a normal distribution with
# $\sigma = d_\text{model}^{-1/2}$. Then the scaled token vector has norm $\approx \sqrt{d_\text{model}}$, a factor $\sqrt 2$ above the positional
# encoding: the two are comparable, each visible to the first layer. PyTorch's `nn.Embedding`
# instead starts from $\mathcal{N}(0, 1)$. Keep the multiply with that default and the token
# vector has norm $\approx d_\text{model}$, a factor $\sqrt{2 d_\text{model}}$ (16 at
# $d_\text{model} = 128$, 32 at 512) above the positional encoding, which then barely moves the
# input.
#
# What this costs was measured by the blog tutorial this course follows, "Deep Learning:
# Transformers" (README, "Where it comes from"), on its reversal model. With the default
# initialisation and the multiply, the model gets 244 of 256 test sequences right after 6,000
# steps instead of all 256. Its losses at that step, 0.0985 against 0.0059, are each from a
# single batch of 64 and move a lot from step to step, so the exact-match counts are the firmer
# evidence. Notebook 11 runs an 800-step version of the ablation and finds the same direction.
#
# The fix is one line, kept in one function so that the model cannot forget it: draw the table
# from $\mathcal{N}(0, 1/d_\text{model})$, then zero the padding row again.

# %%
#| export
def init_token_embedding(embedding: nn.Embedding) -> nn.Embedding:
    """Draw weights from N(0, 1/d_model), the scale sqrt(d_model) restores; zero the PAD row."""
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"expected an nn.Embedding, got {type(embedding).__name__}")
    d_model = embedding.embedding_dim
    nn.init.normal_(embedding.weight, mean=0.0, std=d_model**-0.5)
    if embedding.padding_idx is not None:
        with torch.no_grad():  # padding_idx zeroes the row at construction only: do it again
            embedding.weight[embedding.padding_idx].zero_()
    return embedding


# %% [markdown]
# **Check:** the statistics of an initialised table (large, so that the sample statistics are
# tight), and the zero `PAD` row, which still gets no gradient. The standard deviation alone would
# not tell a normal draw from another one of the same spread, so the check also measures the
# *kurtosis*, $\mathbb{E}[(w - \mu)^4] / \sigma^4$: 3 for a normal distribution, 1.8 for a
# uniform one with the same standard deviation (what `nn.Linear`'s initialisation would give).
# Over $2.5 \cdot 10^6$ entries its sampling error is about $\sqrt{24/n} \approx 0.003$.

# %%
big = init_token_embedding(nn.Embedding(20_000, d_model, padding_idx=PAD)).to(device)
non_pad_rows = big.weight[1:]  # (20_000 - 1, d): every row but PAD's
centred = non_pad_rows.detach() - non_pad_rows.mean()
kurtosis = (centred.pow(4).mean() / centred.pow(2).mean().pow(2)).item()  # 3 for a normal draw
print(f"std {non_pad_rows.std().item():.4f} (target {d_model}^-0.5 = {d_model**-0.5:.4f}), "
      f"mean row norm {non_pad_rows.norm(dim=1).mean().item():.3f} (target 1), "
      f"kurtosis {kurtosis:.2f} (normal: 3, uniform: 1.8)")
assert abs(non_pad_rows.std().item() - d_model**-0.5) < 0.002
assert abs(non_pad_rows.mean().item()) < 1e-3  # centred on 0 (the sample mean's error: about 6e-5)
assert abs(kurtosis - 3) < 0.05  # normal, not uniform
assert torch.count_nonzero(big.weight[PAD]) == 0
big(torch.tensor([[PAD, 5, PAD]], device=device)).sum().backward()
assert torch.count_nonzero(big.weight.grad[PAD]) == 0 and torch.count_nonzero(big.weight.grad[5]) == d_model

# %% [markdown]
# Now the measurement: for $d_\text{model}$ from 16 to 1024, build a table of $V = 1000$ tokens
# with each initialisation, multiply by $\sqrt{d_\text{model}}$, and compare the mean norm of a
# token vector with the norm of the positional encoding (the same at every position).

# %%
d_models = [16, 32, 64, 128, 256, 512, 1024]
norms = {"default": [], "t2t": [], "pe": []}
for d in d_models:
    set_seed(0)
    default = nn.Embedding(1000, d, padding_idx=PAD).to(device)  # N(0, 1)
    t2t = init_token_embedding(nn.Embedding(1000, d, padding_idx=PAD)).to(device)  # N(0, 1/d), as tensor2tensor
    for name, table in (("default", default), ("t2t", t2t)):
        scaled = table.weight[1:] * math.sqrt(d)  # (V - 1, d): sqrt(d_model) * E_v, PAD left out
        norms[name].append(scaled.norm(dim=1).mean().item())
    pe = PositionalEncoding(d, max_len=512).to(device).pe[0]  # (max_len, d)
    pe_norm = pe.norm(dim=1)  # (max_len,): the same at every position
    assert_close(pe_norm, torch.full_like(pe_norm, math.sqrt(d / 2)))
    norms["pe"].append(pe_norm.mean().item())

print(f"{'d_model':>8} {'|sqrt(d) E_v|, N(0,1)':>22} {'|sqrt(d) E_v|, N(0,1/d)':>24} {'|PE_t|':>8}")
for d, a, b, c in zip(d_models, norms["default"], norms["t2t"], norms["pe"], strict=True):
    print(f"{d:>8} {a:>22.1f} {b:>24.2f} {c:>8.2f}")

# %% [markdown]
# **Check:** the predictions, with generous bands. With PyTorch's default the token vector is
# $\approx d_\text{model}$ long and $\approx \sqrt{2 d_\text{model}}$ times the positional
# encoding; with tensor2tensor's scale it is $\approx \sqrt{d_\text{model}}$ long and $\approx \sqrt 2$
# times the positional encoding, whatever the width.

# %%
default_n, t2t_n, pe_n = (np.array(norms[k]) for k in ("default", "t2t", "pe"))
dims = np.array(d_models)
assert np.all(np.abs(default_n / dims - 1) < 0.1)  # |sqrt(d) E_v| ~ d
assert np.all(np.abs(t2t_n / np.sqrt(dims) - 1) < 0.1)  # |sqrt(d) E_v| ~ sqrt(d)
assert np.all(np.abs(default_n / pe_n / np.sqrt(2 * dims) - 1) < 0.1)  # ratio ~ sqrt(2 d)
assert np.all((1.2 < t2t_n / pe_n) & (t2t_n / pe_n < 1.65))  # ratio ~ sqrt(2) = 1.41
ratios = ", ".join(f"{r:.1f}" for r in default_n / pe_n)
print(f"token/PE ratio, N(0,1):   {ratios}")
print(f"token/PE ratio, N(0,1/d): {', '.join(f'{r:.2f}' for r in t2t_n / pe_n)}")

# %% [markdown]
# The picture: the norms against $d_\text{model}$ (left), and the twelve rows of the course's
# table at $d_\text{model} = 128$ token by token (right), next to the positional encoding. Both
# panels have a logarithmic norm axis, on which equal ratios are equal gaps: the factor 16 and
# the factor $\sqrt 2$ can be read off the same axis. Colours: orange for PyTorch's default, blue for the course's
# `init_token_embedding`, black for the positional encoding.

# %% jupyter={"source_hidden": true}
set_seed(0)
tables = {"N(0, 1): nn.Embedding's default": nn.Embedding(V, d_model, padding_idx=PAD),
          "N(0, 1/d_model): init_token_embedding": init_token_embedding(nn.Embedding(V, d_model, padding_idx=PAD))}
per_token = {name: (t.weight.detach() * math.sqrt(d_model)).norm(dim=1).numpy() for name, t in tables.items()}

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
ax1.plot(dims, default_n, "o-", color=COLORS["torch"],
         label=r"$\|\sqrt{d}\,E_v\|$, $E \sim \mathcal{N}(0, 1)$ (default), mean over 999 tokens")
ax1.plot(dims, t2t_n, "o-", color=COLORS["ours"],
         label=r"$\|\sqrt{d}\,E_v\|$, $E \sim \mathcal{N}(0, 1/d)$ (tensor2tensor), mean over 999 tokens")
ax1.plot(dims, pe_n, "s--", color="black", label=r"$\|\mathrm{PE}_t\| = \sqrt{d/2}$, the same for every $t$")
ax1.set(xscale="log", yscale="log", xlabel=r"$d_\mathrm{model}$", ylabel="vector norm",
        title="Scaled token vector vs positional encoding")
ax1.set_xticks(d_models, [str(x) for x in d_models])
ax1.minorticks_off()
ax1.grid(alpha=0.3, which="both")
ax1.legend(fontsize=8.5)
token_ids = np.arange(V)
pe_128 = math.sqrt(d_model / 2)
for offset, (name, n), color in zip((-0.2, 0.2), per_token.items(), (COLORS["torch"], COLORS["ours"]), strict=True):
    ratio = n[1:].mean() / pe_128  # the mean over the 11 tokens, PAD's zero row left out
    ax2.bar(token_ids + offset, n, width=0.4, color=color, label=f"{name} (mean {ratio:.2f} × PE)")
ax2.axhline(pe_128, color="black", ls="--", label=r"$\|\mathrm{PE}_t\| = 8$ (any $t$)")
ax2.set(xlabel="token id (0 = PAD: zero vector in both tables, no bar)", ylabel=r"$\|\sqrt{d}\,E_v\|$ (log scale)",
        title=r"Each token at $d_\mathrm{model}$ = 128", xticks=token_ids, yscale="log", ylim=(2, 3000))
ax2.legend(fontsize=9, loc="upper left")
save_figure(fig, "embeddings_norms")
plt.show()

# %% [markdown]
# With the default initialisation the token vectors stand 16 times taller than the positional
# encoding at $d_\text{model} = 128$, and the gap widens with width; with tensor2tensor's, the two
# stay within a factor $\sqrt 2$ at every width. In terms of energy, the position's share of
# $\|x_t\|^2$ is $\tfrac{d/2}{d^2 + d/2} \approx \tfrac{1}{2d}$ (0.4 % at $d = 128$) against
# $\tfrac{d/2}{d + d/2} = \tfrac13$:

# %%
for name, n in (("N(0, 1)", default_n), ("N(0, 1/d)", t2t_n)):
    share = pe_n**2 / (n**2 + pe_n**2)  # token and PE are nearly orthogonal in high dimension
    print(f"{name:>9}: PE's share of |x|^2 at d = 128: {share[d_models.index(128)]:.3f}, "
          f"at d = 1024: {share[-1]:.4f}")

# %% [markdown]
# The section in one table ($\eta$ is the learning rate, $d = d_\text{model} = 128$, and
# $\|\mathrm{PE}_t\| = 8$):
#
# | set-up | table drawn from | multiply | token vector's norm | tied logits' std | one Adam step moves each entry of $x_t$ by |
# |---|---|---|---|---|---|
# | the course (tensor2tensor's) | $\mathcal{N}(0, 1/d)$ | $\sqrt d$ | $\approx \sqrt d \approx 11.3$, $\sqrt 2 \times$ PE | $\approx 1$ | $\sqrt d\,\eta$ |
# | no multiply | $\mathcal{N}(0, 1)$ | none | $\approx \sqrt d \approx 11.3$, $\sqrt 2 \times$ PE | $\approx \sqrt d \approx 11$ | $\eta$ |
# | PyTorch's default with the multiply | $\mathcal{N}(0, 1)$ | $\sqrt d$ | $\approx d = 128$, $\sqrt{2d} = 16 \times$ PE | $\approx \sqrt d \approx 11$ | $\sqrt d\,\eta$ |
#
# The token vectors' norms of the first and third rows are the measurement above at $d = 128$
# (11.30 and 127.9, 1.41 and 16.0 times the positional encoding); the second row's input is the
# first row's, as the check with two tables asserts. Its Adam step showed the last column of the
# first two rows: each used entry of $E$ moved by $\eta$, the input $\sqrt d$ times further with
# the multiply. The tied logits' standard deviations are measured in the
# section on tying, below. The third row's Adam column is not measured separately: Adam's first
# step is $\eta$ per entry of $E$ whatever the table's scale, so through the multiply it is the
# first row's.
#
# **The $\sqrt{d_\text{model}}$ multiply assumes a table drawn with standard deviation
# $d_\text{model}^{-1/2}$; with PyTorch's $\mathcal{N}(0, 1)$ it inflates the tokens by
# $\sqrt{2 d_\text{model}}$ over the positions instead.**
#
# ### A clear error for a bad id
#
# `nn.Embedding` fails on an id outside $[0, V)$, but on the CPU with a terse message and on a
# GPU with a device-side assertion that leaves the CUDA context unusable until the process
# restarts. The lookup the model uses checks first: integer ids of shape $(B, T)$, each in
# $[0, V)$, and only then looks up and multiplies by $\sqrt{d_\text{model}}$.

# %%
try:
    nn.Embedding(V, 4)(torch.tensor([[3, 12]]))  # on the CPU, whatever the device
except IndexError as err:
    print(f"nn.Embedding on the CPU: IndexError: {err}")


# %%
#| export tokens
def check_token_ids(tokens: torch.Tensor, vocab_size: int, name: str = "tokens") -> None:
    """Raise a TypeError/ValueError unless tokens is a (B, T) integer tensor of ids in [0, V)."""
    check_tensor(name, tokens, kind="int")
    if tokens.dtype not in (torch.int64, torch.int32):  # the index types nn.Embedding accepts
        raise TypeError(f"{name} must hold int64 or int32 token ids, got dtype {tokens.dtype}")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"{name} must have shape (B, T) with T >= 1, got {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one pass, one device sync
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        where = tuple((tokens == bad).nonzero()[0].tolist())
        raise ValueError(
            f"{name} holds token id {bad} at position {where}, outside [0, {vocab_size}) "
            f"(vocab_size={vocab_size})"
        )



# %% [markdown]
# The check needs the smallest and the largest id on the host, so on a GPU it synchronises: the
# CPU waits until the GPU has computed the ids and their `aminmax` (two numbers are copied; the
# cost is the wait). So the ids are checked where they enter: when the model's `encode` or `decode` (notebook 10) is called
# from outside. A generation loop (notebook 12) calls `decode` once per generated token, after
# `encode` has checked the source ids, and runs inside notebook 00's `validated()`, which
# switches the checks off there. `embed_tokens` checks unless an outer entry point already has
# (`checking()`):

# %%
#| export
def embed_tokens(embedding: nn.Embedding, tokens: torch.Tensor, name: str = "tokens") -> torch.Tensor:
    """Look up (B, T) token ids and multiply by sqrt(d_model): (B, T) -> (B, T, d_model)."""
    if checking():
        check_token_ids(tokens, embedding.num_embeddings, name)
    return embedding(tokens) * math.sqrt(embedding.embedding_dim)  # (B, T) -> (B, T, d_model)


# %% [markdown]
# **Check:** `embed_tokens` is the lookup times $\sqrt{d_\text{model}}$, and each kind of bad input
# gets a message that names it. Inside `validated()` the check is skipped: the same out-of-range
# id then reaches `nn.Embedding` and fails with its `IndexError` instead of the course's
# `ValueError` (shown with a CPU copy of the table, since on a GPU it would break the CUDA
# context).

# %%
table = init_token_embedding(nn.Embedding(V, d_model, padding_idx=PAD)).to(device)
x_tok = embed_tokens(table, src.to(device))  # (B, T_src) -> (B, T_src, d_model)
assert x_tok.shape == (B, T_max, d_model)
assert_close(x_tok, table(src.to(device)) * math.sqrt(d_model))
assert (x_tok[src.to(device) == PAD] == 0).all()  # padding: exact zeros

bad_inputs = [torch.tensor([[3, 12]]), torch.tensor([[-1, 4]]), torch.tensor([3, 4]),
              torch.tensor([[3.0, 4.0]])]
for bad in bad_inputs:
    try:
        embed_tokens(table, bad.to(device), name="src")
    except (ValueError, TypeError) as err:
        print(f"{type(err).__name__}: {err}")
    else:
        raise AssertionError("bad token ids were accepted")

cpu_table = nn.Embedding.from_pretrained(table.weight.detach().cpu(), padding_idx=PAD)  # the same weights
with validated():  # as if an outer entry point had checked the ids
    try:
        embed_tokens(cpu_table, torch.tensor([[3, 12]]), name="src")
    except IndexError:
        print("inside validated(): no check, so id 12 fails in nn.Embedding with an IndexError")
    else:
        raise AssertionError("an out-of-range id was looked up without an error")

# %% [markdown]
# **Ids are checked before the lookup, so a bad one is reported by value and position, on any
# device.**
#
# ## The output head returns logits
#
# At the top of the decoder, one linear layer maps each position's $d_\text{model}$-vector $h_t$
# to $V$ scores, the **logits** $z_t = W h_t + b \in \mathbb{R}^V$. The paper's figure draws a
# softmax after it, turning the scores into probabilities $p_t = \operatorname{softmax}(z_t)$,
# but the model should return $z_t$ and leave the softmax to whoever uses it:
#
# * **Training** uses the cross-entropy $-\log p_{t, y_t}$, and `F.cross_entropy` takes logits:
#   it computes $\log \operatorname{softmax}$ in one fused, stable step,
#   $$\log p_{t,v} = z_{t,v} - m_t - \log \sum_{u} e^{z_{t,u} - m_t}, \qquad m_t = \max_u z_{t,u},$$
#   where no exponential can overflow and none of the terms that matter can underflow.
# * **Greedy decoding** takes $\arg\max_v z_{t,v}$, which is $\arg\max_v p_{t,v}$: every
#   $p_{t,v} = e^{z_{t,v}} / \sum_u e^{z_{t,u}}$ has the same positive denominator, and $\exp$ is
#   strictly increasing, so the largest logit gives the largest probability.
#
# The head is an `nn.Linear(d_model, V)`. Feed it vectors like the ones the decoder's final
# `LayerNorm` produces, and grade it with `ignore_index=PAD` so that padded positions count for
# nothing.

# %%
set_seed(0)  # seeded here, so that this cell alone fixes its weights and inputs (both from the global stream)
out_proj = nn.Linear(d_model, V).to(device)
final_norm = LayerNorm(d_model).to(device)
h_dec = final_norm(torch.randn(B, T_max + 1, d_model).to(device))  # (B, T_tgt, d), drawn on the CPU
logits = out_proj(h_dec)  # (B, T_tgt, d) -> (B, T_tgt, V)
targets = tgt_out.to(device)  # (B, T_tgt)
print("logits", tuple(logits.shape), " first row:", [round(v, 2) for v in logits[0, 0].tolist()])
print(f"standard deviation of the initial logits: {logits.std().item():.2f}")

# %% [markdown]
# **Check** of PyTorch's function against the formula (no course code is under test here):
# `F.cross_entropy` on logits (inside PyTorch, `nll_loss` on `log_softmax`) is the mean over the
# real target positions of $-\log p_{t, y_t}$ computed by hand, and matches it in its gradient
# too. That the argmax does not change under the softmax follows from $\exp$ being increasing,
# as argued above; an assert would test only that.

# %%
flat_logits, flat_targets = logits.reshape(-1, V), targets.reshape(-1)  # (B*T, V), (B*T,)
ce = F.cross_entropy(flat_logits, flat_targets, ignore_index=PAD)
keep = flat_targets != PAD
by_hand = -torch.log(torch.softmax(flat_logits[keep], dim=-1)[torch.arange(int(keep.sum())), flat_targets[keep]]).mean()
assert_close(ce, by_hand)
(grad_ce,) = torch.autograd.grad(ce, logits)
(grad_hand,) = torch.autograd.grad(by_hand, logits)
assert_close(grad_ce, grad_hand)
print(f"cross-entropy over {int(keep.sum())} real positions: {ce.item():.4f}"
      f" (a uniform guess gives log V = {math.log(V):.4f})")


# %% [markdown]
# ### Where softmax-then-log breaks
#
# Take two classes with logits $(0, -m)$ and a target on the second: a confidently wrong
# prediction. A freshly initialised model does not make these (the head above starts with logits
# of standard deviation about 0.6); an overconfident model does, later in training, on a hard or
# mislabelled example, and a bug that mis-scales the logits makes them at any time. The true loss
# is $-\log p_2 = m + \log(1 + e^{-m}) \approx m$. Computing $p_2 = e^{-m}/(1 + e^{-m})$ first
# and taking its log afterwards fails once $e^{-m}$ is too small for the number format:
#
# * Below the format's smallest **normal** number ($2^{-126} \approx 1.2 \cdot 10^{-38}$ in
#   float32, $2^{-14} \approx 6.1 \cdot 10^{-5}$ in float16) values are **subnormal**: stored
#   with fewer significant bits the smaller they get, so $p_2$ loses relative precision, and,
#   once enough bits are gone, its log loses digits (the appendix measures where and how many).
# * Soon after, the **gradient** breaks while the loss still looks right. The backward pass of
#   $\log p_2$ multiplies by $1/p_2$, and once $p_2$ is below $1/\text{max}$, the reciprocal of
#   the format's largest number ($\text{max} \approx 3.4 \cdot 10^{38}$ in float32, 65,504 in
#   float16), that factor overflows, and the softmax's backward pass turns the infinite gradient
#   into $+\infty$ for one logit and $\infty - \infty = $ NaN for the other. A training step taken
#   there writes NaN into the weights, while the logged loss looks normal.
# * Below half the smallest subnormal, $2^{-150}$ in float32 and $2^{-25}$ in float16, they round
#   to exactly 0: the loss becomes $-\log 0 = +\infty$ as well.
#
# The three limits, as margins $m$, follow from `torch.finfo`: $p_2$ starts losing precision from
# $m \approx 87.3$ in float32 and $m \approx 9.7$ in float16, the gradient is infinite and NaN
# from $m = \ln \text{max} \approx 88.7$ and $\approx 11.1$, and the loss is infinite from
# $m \approx 104$ and $\approx 17.3$. In short: the gradient breaks from $m \approx 88.7$
# (float32) and $m \approx 11.1$ (float16), the loss only later. (How many digits the loss loses
# before it becomes infinite is measured in the appendix.)

# %%
def underflow_margins(dtype: torch.dtype) -> tuple[float, float, float]:
    """Margins m beyond which, in `dtype`, e^-m is subnormal; 1/e^-m overflows; e^-m rounds to 0."""
    info = torch.finfo(dtype)
    smallest_subnormal = info.smallest_normal * info.eps  # 2^-149 (float32), 2^-24 (float16)
    return -math.log(info.smallest_normal), math.log(info.max), -math.log(smallest_subnormal / 2)


limits = {dtype: underflow_margins(dtype) for dtype in (torch.float32, torch.float16)}
for dtype, (subnormal_from, overflow_from, zero_from) in limits.items():
    print(f"{str(dtype):>14}: e^-m subnormal from m = {subnormal_from:.2f}, its reciprocal (the gradient of"
          f" the log) overflows from m = {overflow_from:.2f}, e^-m is zero from m = {zero_from:.2f}")

# %% [markdown]
# Now both routes over a grid of margins, in each format: softmax then log, and the fused
# `F.log_softmax` (what `F.cross_entropy` uses), both computed in the format itself. The grid is
# computed on the CPU, whatever the device, because the limits above assume that subnormal
# numbers are kept; a GPU may flush them to zero for speed (Apple's Metal compiles its kernels
# with fast math by default). There $e^{-m}$ becomes 0 as soon as it would be subnormal, and
# softmax-then-log would fail, its gradient and its loss alike, from the first limit: the
# gradient instead of from the second, the loss instead of from the third.

# %%
margins = torch.arange(0.0, 130.5, 0.5)  # (M,)
stability, grad_finite = {}, {}
for dtype in (torch.float32, torch.float16):
    z_margin = torch.stack([torch.zeros_like(margins), -margins], dim=1).to(dtype)  # (M, 2), on the CPU
    z_margin.requires_grad_(True)
    naive = -torch.log(torch.softmax(z_margin, dim=-1))[:, 1]  # (M,): softmax, then log
    fused = -F.log_softmax(z_margin, dim=-1)[:, 1]  # (M,): one fused, shifted step
    # The rows are independent, so the gradient of the sum holds each margin's gradient in its own row.
    (naive_grads,) = torch.autograd.grad(naive.sum(), z_margin)  # (M, 2)
    (fused_grads,) = torch.autograd.grad(fused.sum(), z_margin)  # (M, 2)
    stability[dtype] = {"naive": naive.detach().float(), "fused": fused.detach().float()}
    grad_finite[dtype] = {"naive": torch.isfinite(naive_grads).all(dim=1),  # (M,): both entries finite
                          "fused": torch.isfinite(fused_grads).all(dim=1)}
    first_inf = margins[torch.isinf(stability[dtype]["naive"])][0].item()
    first_bad_grad = margins[~grad_finite[dtype]["naive"]][0].item()
    print(f"{str(dtype):>14}: softmax-then-log's gradient is not finite from m = {first_bad_grad:5.1f},"
          f" its loss is inf from m = {first_inf:5.1f}; log_softmax at m = 130: loss"
          f" {stability[dtype]['fused'][-1].item():.1f}, gradient {fused_grads[-1].tolist()}")

# %% [markdown]
# **Check:** softmax-then-log's gradient is finite up to the overflow limit computed above and
# not finite past it. Its loss is finite up to the zero limit and infinite past it; between the
# two limits, where the gradient is already broken, the loss is within 3 % of the exact one (the
# appendix counts the digits it loses there), nothing that would stand out in a log of training.
# The fused route is within a relative $2\epsilon$ of the exact loss, with $\epsilon$ the format's
# machine epsilon and the exact loss computed in float64, and has a finite gradient, at every
# margin up to 130 in both formats. At $m = 120$ the fused route's
# gradient is the textbook $\operatorname{softmax}(z) - \operatorname{onehot}(y) = (1, -1)$; the
# naive route's is NaN.

# %%
true_loss = margins.double() + torch.log1p(torch.exp(-margins.double()))  # (M,): m + log(1 + e^-m)
for dtype, (_, overflow_from, zero_from) in limits.items():
    naive, fused = stability[dtype]["naive"], stability[dtype]["fused"]
    assert torch.isinf(naive[margins > zero_from]).all() and torch.isfinite(naive[margins < zero_from]).all()
    naive_grad_ok = grad_finite[dtype]["naive"]
    assert naive_grad_ok[margins < overflow_from].all() and not naive_grad_ok[margins > overflow_from].any()
    between = (margins > overflow_from) & (margins < zero_from)  # broken gradient, finite loss
    assert_close(naive[between].double(), true_loss[between], rtol=0.03, atol=0.0)
    assert_close(fused.double(), true_loss, rtol=2 * torch.finfo(dtype).eps, atol=0.0)  # every margin
    assert grad_finite[dtype]["fused"].all()
    print(f"{str(dtype):>14}: from m = {margins[between][0].item()} to {margins[between][-1].item()}, softmax-then-log's"
          f" gradient is not finite while its loss is within 3 % of the exact loss")

z120 = torch.tensor([[0.0, -120.0]], device=device, requires_grad=True)
naive_loss = -torch.log(torch.softmax(z120, dim=-1))[0, 1]
(naive_grad,) = torch.autograd.grad(naive_loss, z120)
fused_loss = F.cross_entropy(z120, torch.tensor([1], device=device))
(fused_grad,) = torch.autograd.grad(fused_loss, z120)
assert torch.isinf(naive_loss) and torch.isnan(naive_grad).all()
assert fused_loss.item() == 120.0 and torch.equal(fused_grad, torch.tensor([[1.0, -1.0]], device=device))
print(f"m = 120: naive loss {naive_loss.item()}, gradient {naive_grad.tolist()};"
      f" cross_entropy {fused_loss.item()}, gradient {fused_grad.tolist()}")

# %% [markdown]
# So softmax-then-log's gradient is infinite and NaN from $m \approx 88.7$ in float32 and from
# $m \approx 11.1$ in float16, while its loss stays finite and within 3 % of the exact one up to
# $m \approx 104$ and $m \approx 17.3$, where the loss becomes infinite too. The fused `log_softmax` is right, loss and
# gradient, at every margin. The appendix, *How many digits softmax-then-log loses*, measures the
# errors of both losses in units in the last place, with a figure that marks the three limits.

# %% [markdown]
# ### Which format applies: mixed precision
#
# The float16 limits hold for tensors that really are float16: a model converted with
# `model.half()`, or logits cast by hand. Ordinary mixed-precision training does not do that.
# It runs the forward pass under `torch.autocast`, which picks a dtype op by op: matrix products
# in the low precision, and a list of ops that need range or accuracy in float32. On CUDA that
# list contains `softmax`, `log`, `log_softmax` and `cross_entropy` (PyTorch's "Automatic Mixed
# Precision" op reference), so there even softmax-then-log fails only at the float32 limit.
# The lists differ by device: the CPU's has `cross_entropy` but not `softmax` (the cell below
# prints both dtypes). `F.cross_entropy` on the logits is the one route that is safe in every
# case. **Check:** under
# autocast on the CPU with bfloat16, the logits come out in bfloat16, so does their softmax, and
# `F.cross_entropy` computes in float32.

# %%
amp_layer = nn.Linear(d_model, V)  # on the CPU, so that the CPU's autocast rules apply on any machine
amp_targets = torch.tensor([3, 4, 5])
with torch.autocast("cpu", dtype=torch.bfloat16):
    amp_logits = amp_layer(torch.randn(3, d_model, generator=generator))  # (3, d) -> (3, V)
    amp_loss = F.cross_entropy(amp_logits, amp_targets)
    amp_softmax = torch.softmax(amp_logits, dim=-1)
print(f"under torch.autocast('cpu', bfloat16): logits {amp_logits.dtype}, softmax {amp_softmax.dtype},"
      f" cross_entropy {amp_loss.dtype}")
assert amp_logits.dtype == amp_softmax.dtype == torch.bfloat16  # softmax is not on the CPU's float32 list
assert amp_loss.dtype == torch.float32  # cross_entropy is
# computed in float32 on the bf16 logits; a bf16 loss cast to float32 afterwards, with the
# right dtype, would be off by bf16's rounding (a relative error of up to 0.2 %) and fail this
assert_close(amp_loss, F.cross_entropy(amp_logits.float(), amp_targets))

# %% [markdown]
# ### The double softmax
#
# A model that applies the softmax itself and then hands its probabilities to `F.cross_entropy`
# gets them softmaxed a second time. Nothing crashes, but the loss can no longer reach zero:
# inputs in $[0, 1]$ give a second softmax no sharper than $e^1$ against $e^0$, so the best the
# model can do, putting probability one on the target, costs
#
# $$-\log \frac{e}{e + (V - 1)} = \log\Bigl(1 + \frac{V - 1}{e}\Bigr) \approx 1.62 \text{ nats for } V = 12,$$
#
# and the gradient vanishes as the model approaches that floor, so nothing pushes the loss below
# it. **Check:** the floor, reached by a maximally confident and correct model; then, for a model
# that gives the right token a logit $+c$ and the eleven others $-c$, the double-softmax loss and
# its gradient with respect to the logits as the confidence $c$ grows: the loss settles on the
# floor while the gradient falls towards zero. The logits route's loss, beside it, goes to 0.
# The sweep runs in float64 on the CPU, whatever the device: in float32 the right token's
# probability at $c = 10$, $1 - 2.3 \cdot 10^{-8}$, rounds to exactly 1, so its component of
# the gradient comes out 0 and the norm about a third of the exact one.

# %%
confident = torch.full((1, V), -50.0, device=device)
confident[0, 5] = 50.0  # certain that the answer is token 5, and right
y = torch.tensor([5], device=device)
floor = math.log(1 + (V - 1) / math.e)
double = F.cross_entropy(torch.softmax(confident, dim=-1), y)
assert_close(double, torch.tensor(floor, device=device))
assert F.cross_entropy(confident, y).item() < 1e-6  # the logits route: loss 0
print(f"cross_entropy(softmax(z)) of a perfect model: {double.item():.4f} = log(1 + 11/e);"
      f" cross_entropy(z): {F.cross_entropy(confident, y).item():.1e}")

# %%
y_conf = torch.tensor([5])  # the right token
double_grad_norms = []
for c in (1.0, 2.0, 3.0, 5.0, 10.0):  # the confidence: logit +c on the right token, -c elsewhere
    z_conf = torch.full((1, V), -c, dtype=torch.float64)  # on the CPU, in float64
    z_conf[0, 5] = c
    z_conf.requires_grad_(True)
    double_c = F.cross_entropy(torch.softmax(z_conf, dim=-1), y_conf)
    (grad_c,) = torch.autograd.grad(double_c, z_conf)
    double_grad_norms.append(grad_c.norm().item())
    print(f"c = {c:4}: cross_entropy(softmax(z)) {double_c.item():.4f} (floor {floor:.4f}),"
          f" its gradient's norm {double_grad_norms[-1]:.1e}; cross_entropy(z) {F.cross_entropy(z_conf, y_conf).item():.4f}")
assert all(a > b for a, b in itertools.pairwise(double_grad_norms))  # falls as c grows
assert double_grad_norms[-1] < 1e-7 and abs(double_c.item() - floor) < 1e-6  # at the floor, no gradient left
assert grad_c[0, 5] < 0  # the right token's component, which float32 rounds to 0, is still there


# %% [markdown]
# **The head is `nn.Linear(d_model, V)` and returns logits; the softmax lives inside
# `F.cross_entropy` (fused with the log, so it cannot underflow) and is skipped by `argmax`.**
#
# ## Side note: weight tying
#
# The input table $E \in \mathbb{R}^{V \times d}$ and the output weight $W \in \mathbb{R}^{V
# \times d}$ have the same shape, and both hold one $d$-vector per token. Press and Wolf (2017,
# "Using the Output Embedding to Improve Language Models") use the same matrix for both; Vaswani
# et al. (2017, §3.4) share one matrix among the source embedding, the target embedding and the
# output layer, with a joint source–target vocabulary. Tying saves $V d$ parameters per shared
# use (a large share of a small model with a big vocabulary) and gives rare tokens an input vector
# that is also trained by every output step.
#
# In PyTorch, tying is one assignment: the `Parameter` object itself is shared.

# %%
def tied_pair(seed: int = 0) -> nn.ModuleDict:
    """A fresh embedding table and output layer that share one (V, d) weight."""
    set_seed(seed)
    embed = init_token_embedding(nn.Embedding(V, d_model, padding_idx=PAD)).to(device)
    head = nn.Linear(d_model, V).to(device)
    head.weight = embed.weight  # the same Parameter: (V, d) in both roles
    return nn.ModuleDict({"embed": embed, "head": head})


untied_count = 2 * V * d_model + V
print(f"tied: {sum(p.numel() for p in tied_pair().parameters()):,} parameters, untied: {untied_count:,}")

# %% [markdown]
# **Check:** the module counts the shared matrix once; the shared gradient is the sum of the
# gradients from its two uses (computed with two separate copies); and one optimiser step through
# the tied pair moves both roles at once, so that afterwards the head computes its logits with
# the updated table. None of the three would hold for a copy of the matrix,
# `nn.Parameter(tied_embed.weight.clone())`. The cell builds its own pair, because it trains it,
# and draws its stand-in gradient from the stream that `tied_pair` seeds: run again, it starts
# from the same fresh pair with the same stand-in. (`final_norm` is the logits section's
# `LayerNorm`, which no optimiser here updates: weight one, bias zero.)

# %%
tied = tied_pair()
tied_embed, tied_head = tied["embed"], tied["head"]
assert sum(p.numel() for p in tied.parameters()) == untied_count - V * d_model

tokens_in = tgt_in.to(device)  # (B, T_tgt)
upstream_logits = torch.randn(B, T_max + 1, V).to(device)  # a stand-in dL/d(logits), after tied_pair's seed
x_norm = final_norm(embed_tokens(tied_embed, tokens_in))  # a stand-in for the decoder: just a norm
(tied_head(x_norm) * upstream_logits).sum().backward()

copy_embed = nn.Embedding(V, d_model, padding_idx=PAD).to(device)
copy_head = nn.Linear(d_model, V).to(device)
copy_embed.load_state_dict(tied_embed.state_dict())
copy_head.load_state_dict(tied_head.state_dict())
x_copy = final_norm(embed_tokens(copy_embed, tokens_in))
(copy_head(x_copy) * upstream_logits).sum().backward()
assert_close(tied_embed.weight.grad, copy_embed.weight.grad + copy_head.weight.grad)

table_before = tied_embed.weight.detach().clone()
torch.optim.SGD(tied.parameters(), lr=0.1).step()  # one update of everything the pair owns
assert not torch.equal(tied_embed.weight, table_before)  # a precondition only: any step with a gradient does this
with torch.no_grad():  # the test of tying: the head's logits already use the changed table
    assert_close(tied_head(x_norm), x_norm @ tied_embed.weight.T + tied_head.bias)
print("shared gradient = embedding's + head's; one step updates the table in both roles")

# %% [markdown]
# ### Tying undoes `padding_idx`
#
# `padding_idx` keeps the gradient of the *lookup* out of the `PAD` row; it does nothing about
# other uses of the same `Parameter`. Tied, that row is also the head's weight for the `PAD`
# logit, $z_{t,\mathrm{PAD}} = h_t \cdot E_\mathrm{PAD} + b_\mathrm{PAD}$, and the head's
# gradient is not masked. `PAD` is never a graded target (`ignore_index=PAD` drops the padded
# positions), but every graded position's softmax has the `PAD` logit in its denominator, so
# the loss $-\log p_{t, y_t}$ has $\partial / \partial z_{t,\mathrm{PAD}} = p_{t,\mathrm{PAD}} > 0$.
# Averaged over the $N$ graded positions, the head sends the `PAD` row the gradient
#
# $$\frac{1}{N} \sum_{t \text{ graded}} p_{t,\mathrm{PAD}}\; h_t ,$$
#
# which is not zero, and the first update makes the row non-zero. From then on a padded position
# enters the first block with a trained vector instead of its positional encoding alone; the
# masks of notebook 05 still keep other positions from reading it, and the loss still ignores it.
# The course's model does not tie (below), so its `PAD` rows stay zero.
#
# **Check,** with the real loss on the batch of this notebook. The stand-in for the decoder is a
# random linear layer and the final norm. The norm alone, as above, would not do: it leaves each
# position's vector $h_t$ pointing along its own input token's row $E_w$, so the logit of that
# token, $h_t \cdot E_w \approx \|h_t\|\,\|E_w\| \approx \sqrt{128} \cdot 1 \approx 11$, takes
# nearly all the probability, and $p_{t,\mathrm{PAD}}$, whose logit is the small bias alone, is
# tiny (the cell prints both).
# The tied `PAD` row's gradient is the sum above, computed by hand (the lookup adds nothing to
# it), so it is not zero; after one SGD step the padded positions' token vectors are no longer
# zero. And the cause is the denominator: with the `PAD` logit set to $-\infty$ before the loss,
# so that it drops out of every softmax, the row gets no gradient at all. (Masking that logit is
# also a fix, for a model that should never emit `PAD`.)

# %%
tied_pad = tied_pair()  # a fresh pair: its PAD row is zero
stand_in = nn.Linear(d_model, d_model).to(device)  # with final_norm, a stand-in for the decoder
pad_targets = tgt_out.to(device)  # (B, T_tgt)
graded = pad_targets != PAD  # (B, T_tgt): the positions the loss grades
with torch.no_grad():  # the norm alone, without the stand-in: PAD's probability is tiny
    logits_norm_only = tied_pad["head"](final_norm(embed_tokens(tied_pad["embed"], tokens_in)))  # (B, T_tgt, V)
    p_pad_norm_only = torch.softmax(logits_norm_only, dim=-1)[..., PAD][graded].mean().item()
    own_logit = logits_norm_only.gather(-1, tokens_in.unsqueeze(-1)).squeeze(-1)[graded].mean().item()
x_tied = final_norm(stand_in(embed_tokens(tied_pad["embed"], tokens_in)))  # (B, T_tgt, d)
tied_logits = tied_pad["head"](x_tied)  # (B, T_tgt, V)
F.cross_entropy(tied_logits.reshape(-1, V), pad_targets.reshape(-1), ignore_index=PAD).backward()
p_pad = torch.softmax(tied_logits.detach(), dim=-1)[..., PAD]  # (B, T_tgt): PAD's probability
pad_grad_by_hand = (p_pad[graded].unsqueeze(-1) * x_tied.detach()[graded]).sum(dim=0) / graded.sum()  # (d,)
assert_close(tied_pad["embed"].weight.grad[PAD], pad_grad_by_hand)
torch.optim.SGD(tied_pad.parameters(), lr=0.1).step()
with torch.no_grad():
    pad_vectors = embed_tokens(tied_pad["embed"], tokens_in)[tokens_in == PAD]  # (number of PADs, d)
assert (pad_vectors != 0).any(dim=1).all()  # every padded position now has a non-zero token vector
assert p_pad_norm_only < 1e-3 < p_pad[graded].mean().item()  # why the stand-in is needed
print(f"with the norm alone: each position's own input token has a mean logit of {own_logit:.0f},"
      f" and PAD's mean probability is {p_pad_norm_only:.0e}")
print(f"PAD's probability at the {int(graded.sum())} graded positions: mean {p_pad[graded].mean().item():.3f};"
      f" the PAD row's gradient has norm {pad_grad_by_hand.norm().item():.3f};"
      f" after one SGD step (lr 0.1) the row has norm {tied_pad['embed'].weight[PAD].norm().item():.4f}")

tied_masked = tied_pair()  # the same fresh pair, with PAD's logit masked out of every softmax
stand_in_masked = nn.Linear(d_model, d_model).to(device)  # the same draw as stand_in
x_masked = final_norm(stand_in_masked(embed_tokens(tied_masked["embed"], tokens_in)))
pad_column = torch.arange(V, device=device) == PAD  # (V,)
masked_logits = tied_masked["head"](x_masked).masked_fill(pad_column, -math.inf)  # (B, T_tgt, V)
F.cross_entropy(masked_logits.reshape(-1, V), pad_targets.reshape(-1), ignore_index=PAD).backward()
assert torch.count_nonzero(tied_masked["embed"].weight.grad[PAD]) == 0
assert torch.count_nonzero(tied_masked["embed"].weight.grad[3:]) > 0  # the symbols' rows still learn
print("with PAD's logit at -inf, the PAD row's gradient is exactly zero")

# %% [markdown]
# Tying is where the first point of the $\sqrt{d_\text{model}}$ section comes from. The output
# layer sees $h_t$ from a `LayerNorm`, with unit-variance entries and $\|h_t\| \approx \sqrt{d}$.
# With rows $E_v \sim \mathcal{N}(0, 1/d)$ the logits $z_{t,v} = h_t \cdot E_v$ have variance
# $\approx 1$: a softmax that starts neither flat nor saturated. With rows from
# $\mathcal{N}(0, 1)$ they would have standard deviation $\sqrt{d}$, about 11 at $d = 128$. The
# $\sqrt d$ multiply then brings the same small rows back to unit-variance entries at the input.
#
# **Check:** the initial logits of a tied head have standard deviation $\approx 1$ with the
# tensor2tensor's scale and $\approx \sqrt d$ with PyTorch's default, whose softmax is saturated before
# training starts. The logits are $h_t \cdot E_v$ for the 11 tokens other than `PAD`, without the
# head's bias (its own parameter, whatever the table; at initialisation, when the `PAD` row is
# still zero, the `PAD` logit is that bias alone). Averaged over 4,096 draws of $h_t$, the
# largest of their 11 probabilities is above 0.8 with the default (0.90 below) and below 0.5
# with tensor2tensor's scale (0.32), where a uniform guess would give $1/11 \approx 0.09$.

# %%
set_seed(0)  # inputs, then weights, from one stream: this cell alone fixes them
h_samples = final_norm(torch.randn(4096, d_model).to(device))  # (N, d), |h| ~ sqrt(d), drawn on the CPU
candidate_tables = {"N(0, 1/d_model) (tensor2tensor)": init_token_embedding(nn.Embedding(V, d_model, padding_idx=PAD)),
                    "N(0, 1) (nn.Embedding default)": nn.Embedding(V, d_model, padding_idx=PAD)}
initial_logits = {  # (N, d) @ (d, V - 1) -> (N, V - 1): every row but PAD's
    name: (h_samples @ table.weight[1:].to(device).T).detach() for name, table in candidate_tables.items()
}
stds = {name: zs.std().item() for name, zs in initial_logits.items()}
top_p = {name: torch.softmax(zs, dim=-1).max(dim=-1).values.mean().item() for name, zs in initial_logits.items()}
assert 0.8 < stds["N(0, 1/d_model) (tensor2tensor)"] < 1.25
assert 0.8 < stds["N(0, 1) (nn.Embedding default)"] / math.sqrt(d_model) < 1.25
assert top_p["N(0, 1/d_model) (tensor2tensor)"] < 0.5
assert top_p["N(0, 1) (nn.Embedding default)"] > 0.8
for name in candidate_tables:
    print(f"{name:>31}: logit std {stds[name]:5.2f}, mean largest softmax probability {top_p[name]:.2f}")

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
largest_logit = max(zs.abs().max().item() for zs in initial_logits.values())
edge = 5 * math.ceil(largest_logit / 5)  # the bins cover every logit, in steps of 0.5
bins = np.linspace(-edge, edge, 4 * edge + 1)
for name, color in (("N(0, 1) (nn.Embedding default)", COLORS["torch"]),
                    ("N(0, 1/d_model) (tensor2tensor)", COLORS["ours"])):
    ax.hist(initial_logits[name].flatten().cpu().numpy(), bins=bins, density=True, histtype="step", lw=2,
            color=color, label=f"rows from {name}: std {stds[name]:.2f}")
ax.set(xlabel=r"initial logit $z_{t,v} = h_t \cdot E_v$ (tied head, $\|h_t\| \approx \sqrt{128}$)",
       ylabel="density (log scale)", yscale="log", title=r"Initial logits of a tied output head, $d_\mathrm{model}$ = 128")
ax.set_ylim(1e-5, 5)  # headroom above the narrow peak for the legend
ax.legend(fontsize=9, loc="upper left")
save_figure(fig, "embeddings_weight_tying")
plt.show()

# %% [markdown]
# **Tying shares one $(V, d)$ matrix between the input and the output; with tensor2tensor's
# $\mathcal{N}(0, 1/d)$ rows it gives unit-scale logits at the top and, times $\sqrt d$,
# unit-scale token vectors at the bottom.** The course's model keeps its three matrices
# separate, as the tutorial does (its source and target vocabularies need not be the same); its
# 930,828 parameters in notebook 10 count them separately.
#
# ## Recap
#
# | piece | code | shape |
# |---|---|---|
# | reserved ids | `PAD, BOS, EOS = 0, 1, 2`; `UNK = 3` in notebook 13's vocabulary only (a symbol in the reversal task) | — |
# | teacher forcing | `tgt_in = [BOS, y...]`, `tgt_out = [y..., EOS]`, both PAD-padded | $(B, T+1)$ each |
# | embedding table | `nn.Embedding(V, d_model, padding_idx=PAD)`; PAD row zero, no gradient | weight $(V, d)$ |
# | its initialisation | `init_token_embedding(emb)`: $\mathcal{N}(0, 1/d)$, PAD row zeroed again | row norm $\approx 1$ |
# | why $\sqrt d$ | with $\mathcal{N}(0, 1/d)$: the same input as $\mathcal{N}(0, 1)$ without the multiply, unit-scale logits when tied, Adam moves $x_t$ $\sqrt d$ times further; with $\mathcal{N}(0, 1)$: tokens $\sqrt{2d}$ times the positional encoding | entries of variance 1 |
# | lookup and scale | `embed_tokens(emb, tokens)` $= \sqrt{d}\, E_{w_t}$, ids checked first | $(B, T) \to (B, T, d)$ |
# | positional encoding | notebook 04, $\|\mathrm{PE}_t\| = \sqrt{d/2}$ | $(1, T, d)$ added |
# | output head | `nn.Linear(d_model, V)` returns logits | $(B, T, d) \to (B, T, V)$ |
# | loss | `F.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)`: fused, never `log(softmax)` | scalar |
# | decoding | `logits.argmax(-1)`: no softmax needed | $(B, T)$ |
# | weight tying (optional) | `head.weight = embed.weight`; the head then trains the PAD row (`padding_idx` masks only the lookup) | saves $V d$ parameters |
#
# ## Exercises
#
# 1. **Equal footing.** Which standard deviation $\sigma$ makes the scaled token vector exactly as
#    long as the positional encoding, $\mathbb{E}\,\|\sqrt d\,E_v\|^2 = \|\mathrm{PE}_t\|^2$?
#    Check it with a table at $d_\text{model} = 256$.
# 2. **The first loss.** A freshly initialised model should start at a loss of about $\log V$,
#    the cross-entropy of a uniform guess. Show that the head of this notebook, fed `LayerNorm`
#    outputs, starts close to $\log 12$ (notebook 11's first logged loss should be close to it),
#    explain why PyTorch's `nn.Linear` initialisation makes that so, and predict how far above.
# 3. **Log-sum-exp by hand.** Write `log_softmax` with the max-shift of the formula above and
#    check it against `F.log_softmax` on random logits, on the margin-120 example and on the
#    same margin shifted up, logits $(1000, 880)$, in float32 and float16.
#
# **Solutions.**
#
# 1. $\mathbb{E}\,\|\sqrt d\,E_v\|^2 = d \cdot d\,\sigma^2$ and $\|\mathrm{PE}_t\|^2 = d/2$, so
#    $\sigma = 1/\sqrt{2d}$, a factor $\sqrt 2$ below tensor2tensor's $d^{-1/2}$.

# %%
d = 256
sigma = 1 / math.sqrt(2 * d)
E = torch.randn(20_000, d, generator=generator).to(device) * sigma  # (V, d)
mean_sq = (E * math.sqrt(d)).pow(2).sum(dim=1).mean().item()  # E |sqrt(d) E_v|^2
pe_sq = sinusoidal_table(512, d).pow(2).sum(dim=1)  # (max_len,): d/2 everywhere
print(f"E|sqrt(d) E_v|^2 = {mean_sq:.2f}, |PE_t|^2 = {pe_sq.mean().item():.2f}")
assert abs(mean_sq / (d / 2) - 1) < 0.01
assert_close(pe_sq, torch.full_like(pe_sq, d / 2))

# %% [markdown]
# 2. In three steps.
#
#    *Why near $\log V$.* `nn.Linear(d, V)` draws its weights from
#    $\mathcal{U}(-1/\sqrt d, 1/\sqrt d)$, variance $1/(3d)$, and its bias likewise. With
#    $\|h_t\|^2 \approx d$ the logits have variance $\approx 1/3 + 1/(3d)$: small, so the softmax
#    is close to uniform and the loss close to $\log V$.
#
#    *How far above.* At one position, let the logits $z_1, \dots, z_V$ have mean $\bar z$ and
#    variance $s^2 = \frac1V \sum_v (z_v - \bar z)^2$ across the vocabulary. A second-order
#    expansion gives $\log \sum_v e^{z_v} \approx \log V + \bar z + s^2/2$. The loss is that minus
#    $z_y$, and the cell draws each target $y$ uniformly from the nine symbols $3, \dots, 11$, so
#    on average $z_y$ is close to $\bar z$ (every class's weights and bias are drawn alike). The
#    expected loss is then about $\log V + s^2/2$, with $s^2$ near
#    $\frac{V-1}{V}\bigl(\frac13 + \frac1{3d}\bigr) \approx 0.31$. Take $s^2$ per position, as the
#    cell does: the variance of *all* the logits also counts the spread of the positions' means,
#    about $1/(3V) \approx 0.03$ more, which would bias the estimate by 0.015.
#
#    *How close.* The cell compares the measured excess with $s^2/2$ and allows 0.07. The 1,280
#    random targets make the measured loss noisy: each position's loss varies with its target by
#    about $s \approx 0.6$, so the mean has a standard error of about $0.6/\sqrt{1280} \approx
#    0.017$; and for one head the nine symbols' mean logit differs a little from $\bar z$.
#
#    *(A note on the margin: over seeds 0 to 999 of this cell, excess $- s^2/2$ has mean $-0.002$
#    and standard deviation $0.018$, and its largest size is 0.060, below the 0.07 allowed.)*

# %%
set_seed(0)  # the seed that "seeds 0 to 999" varies; weights, then inputs, from one stream
head = nn.Linear(d_model, V).to(device)
h_ex = LayerNorm(d_model).to(device)(torch.randn(64, 20, d_model).to(device))  # (B, T, d), drawn on the CPU
y = torch.randint(3, V, (64, 20)).to(device)  # random targets
first_loss = F.cross_entropy(head(h_ex).reshape(-1, V), y.reshape(-1)).item()
logit_var = head(h_ex).var(dim=-1, unbiased=False).mean().item()  # s^2: across the vocabulary, per position
excess = first_loss - math.log(V)
print(f"first loss {first_loss:.3f}, log V = {math.log(V):.3f}: excess {excess:.3f};"
      f" logit variance s^2 = {logit_var:.3f}, s^2/2 = {logit_var / 2:.3f}")
assert logit_var < 0.5 and abs(excess - logit_var / 2) < 0.07  # small logits; the estimate holds


# %% [markdown]
# 3. Subtract the row maximum before exponentiating: the largest exponent is then $e^0 = 1$, so
#    the sum is at least 1 and its log is finite, and every $z_v - m$ is kept as it is rather
#    than passed through $\exp$ and $\log$. The margin-120 example $(0, -120)$ cannot tell
#    whether the shift is there, since its maximum is already 0; nor can the float32 random logits
#    (ten times a standard normal, so a few tens at most), whose exponentials stay far below
#    float32's largest number, about $e^{88}$. The float16 random logits can: float16's largest
#    number is 65,504, about $e^{11.1}$, and among 192 draws of ten times a standard normal some
#    exceed 11.1, so without the shift their rows overflow. So can the shifted example
#    $(1000, 880)$: without the shift, $e^{1000}$ overflows to $\infty$ in both formats and the
#    result is $-\infty$. The cell shows the unshifted formula passing on the float32 random
#    logits and failing on the other two.

# %%
def my_log_softmax(z: torch.Tensor) -> torch.Tensor:
    m = z.max(dim=-1, keepdim=True).values  # (..., 1)
    return z - m - torch.log(torch.exp(z - m).sum(dim=-1, keepdim=True))  # (..., V)


def unshifted_log_softmax(z: torch.Tensor) -> torch.Tensor:
    """The mistake: the formula without the max-shift."""
    return z - torch.log(torch.exp(z).sum(dim=-1, keepdim=True))  # (..., V)


for dtype in (torch.float32, torch.float16):
    z_rand = (10 * torch.randn(16, V, generator=generator)).to(device, dtype)  # (16, V)
    tol = dict(rtol=1e-3, atol=1e-2) if dtype == torch.float16 else {}
    assert_close(my_log_softmax(z_rand), F.log_softmax(z_rand, dim=-1), **tol)
    if dtype == torch.float32:  # too small to overflow: the unshifted formula passes too
        assert_close(unshifted_log_softmax(z_rand), F.log_softmax(z_rand, dim=-1), rtol=1e-5, atol=1e-4)
    else:  # some logit above 11.1: e^z overflows float16, and the unshifted formula with it
        assert z_rand.max().item() > math.log(torch.finfo(torch.float16).max)
        assert not torch.isfinite(unshifted_log_softmax(z_rand)).all()
    extreme = torch.tensor([[0.0, -120.0]], device=device, dtype=dtype)
    assert my_log_softmax(extreme)[0, 1].item() == -120.0
    shifted = torch.tensor([[1000.0, 880.0]], device=device, dtype=dtype)  # the same margin, shifted up
    assert my_log_softmax(shifted).tolist() == [[0.0, -120.0]]
    assert unshifted_log_softmax(shifted).tolist() == [[-math.inf, -math.inf]]  # the mistake, caught
print("my_log_softmax matches F.log_softmax, and gives (0, -120) at (0, -120) and at (1000, 880);"
      " without the shift, float16's random logits overflow and (1000, 880) gives (-inf, -inf)")

# %% [markdown]
# ## Appendix: how many digits softmax-then-log loses
#
# The section *Where softmax-then-log breaks* found where the naive route's gradient, and later
# its loss, become infinite; before its loss does, it loses digits. **Check.** Errors are measured in *units in the last place*
# (ULPs) of the exact loss: the spacing of the format's numbers at that size,
# $2^{\lfloor \log_2 x \rfloor}$ times $2^{-23}$ in float32 and $2^{-10}$ in float16 (which keep
# 24 and 11 significant bits). A correctly rounded result is within half an ULP; `log_softmax`
# rounds a few intermediate results on the way, so the check allows it two ULPs, and it stays
# within them at every margin. The naive route rounds an exponential, a division and a log, and
# PyTorch does not promise a correctly rounded `exp` (its vectorised CPU kernels approximate
# it), so the check allows it four while $e^{-m}$ is a normal number; on the machine that built
# this page it stays within one. Some
# way into the subnormal range, as the bits run out, it leaves that band: on the machine that
# built this page (printed below), its loss first comes out worse than the fused one at $m = 92$
# in float32 and $m = 12.5$ in float16, and it leaves the band of two ULPs around the exact loss
# at 95.5 and 14.5, after its gradient has already broken (from 88.7 and 11.1). And once the term
# $\log(1 + e^{-m})$ is below half an ULP of $m$, the exact loss rounds to $m$ itself, and the
# fused route returns exactly $m$: its error is then the term, a vanishing fraction of an ULP.
# Where that starts is computed from the float64 reference.

# %%
errors_in_ulps, exact_from = {}, {}
for dtype in limits:
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(true_loss))  # (M,): one ULP of the loss
    errors_in_ulps[dtype] = {route: (stability[dtype][route].double() - true_loss).abs() / ulp
                             for route in ("fused", "naive")}
    rounds_to_m = (true_loss - margins.double()) < ulp / 2  # the term is below half an ULP
    exact_from[dtype] = margins[~rounds_to_m][-1].item() + 0.5  # from here on, on the grid of 0.5
    print(f"{str(dtype):>14}: the exact loss rounds to m from m = {exact_from[dtype]}")

# %% tags=["nbval-ignore-output"]
for dtype, (subnormal_from, _, _) in limits.items():
    fused_err, naive_err = errors_in_ulps[dtype]["fused"], errors_in_ulps[dtype]["naive"]
    leaves = margins[naive_err > 2][0].item()
    worse = margins[(margins > subnormal_from) & (naive_err > fused_err)][0].item()
    equals_m = margins[stability[dtype]["fused"].double() == margins.double()][0].item()
    print(f"{str(dtype):>14}: fused error at most {fused_err.max().item():.2f} ULP;"
          f" naive at most {naive_err[margins < subnormal_from].max().item():.2f} ULP while e^-m is normal"
          f" (subnormal from {subnormal_from:.1f}), first worse than fused at m = {worse},"
          f" beyond 2 ULP from m = {leaves}; fused returns m from m = {equals_m}")

# %%
for dtype, (subnormal_from, _, zero_from) in limits.items():
    fused_err, naive_err = errors_in_ulps[dtype]["fused"], errors_in_ulps[dtype]["naive"]
    assert (fused_err <= 2).all()  # every margin, up to 130
    assert (naive_err[margins < subnormal_from] <= 4).all()  # about as good while e^-m is normal
    assert (naive_err[(margins > subnormal_from) & (margins < zero_from)] > 4).any()  # digits lost
    beyond = margins >= exact_from[dtype]
    assert torch.equal(stability[dtype]["fused"][beyond].double(), margins[beyond].double())

# %% [markdown]
# The picture: the two losses (top, the smaller row, since the two curves coincide wherever both
# are finite), and the error of each in ULPs of the exact loss (bottom), with the check's two-ULP
# band for the fused route in grey. The light red region is where softmax-then-log's gradient is
# infinite and NaN while its loss is finite, the darker one where its loss is $+\infty$ too. The error axis is linear from 0 to
# 1 ULP and logarithmic above, so a correctly rounded result sits near the bottom and the
# naive route's lost digits, tens of thousands of ULPs in float32, fit on the same axis. While
# $e^{-m}$ is a normal number the two routes stay within one ULP on the machine that built this
# page (the check allows the naive route four) and mostly coincide: the fused route's thick line
# shows under the naive route's dashes. Past that point the naive route's gradient breaks first,
# at the light red region, while its loss is still close; the loss climbs out of the band only
# later, inside that region, and its curve stops where the loss is infinite.

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(2, 2, figsize=(12, 7.6), sharex="col", layout="constrained", height_ratios=[1.2, 1.6])
for col, (dtype, curves) in enumerate(stability.items()):
    subnormal_from, overflow_from, zero_from = limits[dtype]
    end = 130 if dtype == torch.float32 else 25
    shown = margins <= end
    m_shown = margins[shown]
    naive = curves["naive"][shown].clone()
    naive[torch.isinf(naive)] = float("nan")  # matplotlib cannot draw inf: leave a gap
    m_inf = margins[torch.isinf(curves["naive"])][0].item()
    m_bad_grad = margins[~grad_finite[dtype]["naive"]][0].item()
    for ax in axes[:, col]:  # the naive route's two failures, shaded in both rows
        ax.axvspan(overflow_from, zero_from, color=COLORS["accent"], alpha=0.08, lw=0,
                   label=f"softmax-then-log: gradient inf/NaN, loss finite (m > {overflow_from:.1f})")
        ax.axvspan(zero_from, end, color=COLORS["accent"], alpha=0.22, lw=0,
                   label=rf"softmax-then-log: loss $+\infty$ too (m > {zero_from:.1f})")

    ax = axes[0, col]
    ax.plot(m_shown, curves["fused"][shown], color=COLORS["torch"], lw=3, label="F.log_softmax / F.cross_entropy")
    ax.plot(m_shown, naive, color=COLORS["accent"], lw=1.5, ls="--", label="-log(softmax(z))")
    ax.plot([m_bad_grad], [m_bad_grad], "o", color=COLORS["accent"], ms=7, zorder=5)
    ax.plot([m_inf], [m_inf], "X", color=COLORS["accent"], ms=10, zorder=5)
    ax.annotate(f"softmax-then-log: gradient NaN from $m$ = {m_bad_grad:g}", xy=(m_bad_grad, m_bad_grad),
                xytext=(0.03 * end, 0.62 * end), fontsize=9, color=COLORS["accent"],
                arrowprops=dict(arrowstyle="->", color=COLORS["accent"]))
    ax.annotate(f"softmax-then-log: loss $+\\infty$ from $m$ = {m_inf:g}", xy=(m_inf, m_inf),
                xytext=(0.03 * end, 0.9 * end), fontsize=9, color=COLORS["accent"],
                arrowprops=dict(arrowstyle="->", color=COLORS["accent"]))
    ax.set(ylabel=r"loss $-\log p_2$ (nats)", title=str(dtype).replace("torch.", ""), xlim=(0, end),
           ylim=(0, end * 1.05))
    ax.legend(fontsize=7.5, loc="lower right")

    ax = axes[1, col]
    ax.axhspan(0, 2, color="#d9d9d9", label="within 2 ULP (the check's band for the fused route)")
    fused_err = errors_in_ulps[dtype]["fused"][shown]
    naive_err = errors_in_ulps[dtype]["naive"][shown].clone()
    naive_err[torch.isinf(naive_err)] = float("nan")  # the loss is infinite: leave a gap
    ax.plot(m_shown, fused_err, color=COLORS["torch"], lw=4, label="F.log_softmax")
    ax.plot(m_shown, naive_err, color=COLORS["accent"], lw=1.5, ls="--", label="-log(softmax(z))")
    ax.axvline(subnormal_from, color="#525252", lw=1.2, ls=":")
    ax.text(subnormal_from, 3e4, r"$e^{-m}$ subnormal" + "\n" + f"from {subnormal_from:.1f} ", fontsize=8,
            color="#525252", va="top", ha="right")
    ax.set_yscale("symlog", linthresh=1, linscale=1.5)  # linear from 0 to 1 ULP, logarithmic above
    ax.set(ylim=(0, 1e5), xlabel="margin $m$ (logits $(0, -m)$, target: the second class)",
           ylabel="error in ULPs of the exact loss\n(linear up to 1, logarithmic above)")
    ax.legend(handles=ax.get_legend_handles_labels()[0][2:], fontsize=8, loc="center left")  # the shading: above
fig.suptitle("Cross-entropy of a confidently wrong prediction: fused log-softmax against softmax-then-log")
save_figure(fig, "embeddings_logit_stability")
plt.show()

# %% [markdown]
# Next: notebook 10, *The full model*, which puts the embeddings, the positional encoding, the
# encoder and decoder stacks of notebook 08's blocks and this output head together, and counts
# its 930,828 parameters.
