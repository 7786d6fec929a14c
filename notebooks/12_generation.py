# %% [markdown]
# # 12 · Generation
#
# **What you will build:** the rest of the `decoding` module, which turns a trained
# encoder–decoder into a generator. Notebook 11 wrote greedy decoding; this notebook adds a
# key–value cache that makes every step cost one position instead of the whole prefix (with
# exactly the same tokens), beam search with length normalisation, and sampling with a
# temperature and top-$k$. On the way you will look inside the trained reversal
# model, find the anti-diagonal its cross-attention learnt and switch its heads off one at a
# time, time the cache, and check beam search against an exhaustive search.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/12_generation.ipynb) · Assumes: [10 · The full model](10_full_model.ipynb), [11 · Training](11_training.ipynb).

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
import hashlib
import inspect
import itertools
import math
import statistics
import time
from contextlib import ExitStack
from contextlib import contextmanager

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.ticker import NullFormatter, NullLocator
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from transformer_from_scratch.attention import KeyValueCache, MultiHeadAttention
from transformer_from_scratch.data import make_batch
from transformer_from_scratch.layers import Decoder, DecoderBlock
from transformer_from_scratch.masks import causal_mask, padding_mask
from transformer_from_scratch.measure import fit_slope, time_call
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS, EOS, PAD
from transformer_from_scratch.train import get_reversal_model, reversal_recipe
from transformer_from_scratch.utils import COLORS, add_to_class, get_device, save_figure, set_seed
from transformer_from_scratch.viz import plot_attention

set_seed(0)
device = get_device()

# %% [markdown]
# ## From a model to a sequence
#
# The decoder never outputs a sequence. It outputs, for every prefix $y_{<t}$ of the target and
# the source $x$, a distribution over the next token, and the chain rule of probability turns
# those into a distribution over whole sequences:
#
# $$p(y \mid x) \;=\; \prod_{t=1}^{n} p\bigl(y_t \mid y_{<t},\, x\bigr),
# \qquad y_n = \texttt{EOS}.$$
#
# *Decoding* is the choice of one $y$ from that distribution. The most likely sequence,
# $\arg\max_y p(y\mid x)$, is out of reach: there are $V^n$ candidates of length $n$ over a
# vocabulary of $V$ tokens. This notebook builds the three usual answers:
#
# | strategy | what it does at each step | gives |
# |---|---|---|
# | greedy | takes the single most likely token | one sequence, fast, deterministic |
# | beam search | keeps the $k$ most likely prefixes | a sequence with a higher $p(y\mid x)$ |
# | sampling | draws a token from $p$, reshaped by a temperature and top-$k$ | varied sequences |
#
# All three run the same loop: encode the source once, then call the decoder once per new token.
# That loop is also where the time goes, and the key–value cache below makes it cheap.
#
# ### The trained model
#
# Notebook 11 trained the model of the course's main source, the blog tutorial "Deep Learning:
# Transformers" ("the tutorial" from here on; README, "Where it comes from"): 930,828
# parameters, trained to reverse sequences of 3 to 8 symbols. `get_reversal_model` loads its
# checkpoint or, where there is none (on Colab, where every notebook opens in a fresh runtime, or
# if you skipped notebook 11), trains it again with the same recipe and seed and saves it, with a
# progress bar: a few minutes on a CPU, about a minute and a half on a GPU.
#
# The numbers quoted in the text are those of the run stored here. Yours may be another run (the
# note below says when), so the third cell below prints `STORED_RUN`: where it says `False`,
# your numbers differ from the text's, and the checks assert only bounds that held for every
# seed of notebook 11's seed study.
#
# > **Reproducibility.** Retraining on a CPU gives notebook 11's weights bit for bit with this
# > PyTorch, one thread and PyTorch's AVX2 CPU kernel, which `make execute` selects
# > (`ATEN_CPU_CAPABILITY=avx2`; notebook 11's appendix "Reproducing the stored run: CPU
# > kernels" says how to set it for `make lab`). The kernel decides, not the machine: on a CPU
# > with AVX-512, PyTorch's own choice of kernel trains another run of the same recipe, and so
# > does a GPU or another PyTorch. So instead of guessing from the device, the notebook asks the
# > weights: `STORED_RUN` is true only when a hash of every weight's bits equals the stored
# > run's, and the few findings of that one run (not bounds) are asserted only then. Retraining
# > takes a few minutes on a free CPU thread and several times that on a busy one (notebook 11
# > prints its times); with both checkpoints in place (this one and the early model's, below)
# > this notebook runs in about two minutes on a quiet CPU thread (107 s in one such run), and
# > longer on a busy machine (the run stored here: 174 s on two cores shared with other jobs;
# > `make execute` prints the time).

# %% tags=["nbval-ignore-output"]
model = get_reversal_model(device=device, progress=True)


# %%
def weights_fingerprint(m: torch.nn.Module) -> str:
    """A short hash of every weight's bits: equal only for the very same trained run."""
    digest = hashlib.sha256()
    for name, tensor in m.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


STORED_RUN = weights_fingerprint(model) == "d86ebe302c3322b7"  # the run stored below

# %% tags=["nbval-ignore-output"]
which = ("the stored run: the numbers quoted in the text are this run's" if STORED_RUN else
         "another run: the numbers quoted in the text are the stored run's, yours are printed")
print(f"weights fingerprint {weights_fingerprint(model)}, STORED_RUN = {STORED_RUN}: {which}")

# %%
VOCAB, MAX_LEN = model.out_proj.out_features, 8  # 12 token ids; sources of 3..8 symbols
assert sum(p.numel() for p in model.parameters()) == 930_828
print(f"vocabulary {VOCAB}, positions up to {model.pos.pe.size(1)}, d_model {model.d_model}")

# %% [markdown]
# Everything this notebook exports goes into the `decoding` module, beside notebook 11's
# `greedy_decode`:

# %%
#| default_exp decoding

# %%
#| export
"""Generate with a trained encoder-decoder: greedy, a key-value cache, beam search, sampling."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_from_scratch.checks import check_float, check_int, validated
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.tokens import BOS, EOS, PAD

# %% [markdown]
# ## Greedy decoding
#
# Notebook 11 wrote `greedy_decode` to test its model: it encodes the source once, takes the
# most likely token at every step, gives a finished row `PAD` after its `EOS`, and returns a
# `Generation`: `.tokens`, `(B, ≤ max_new_tokens + 1)` ids with `BOS` first, and `.log_probs`,
# the total log-probability `(B,)` the model gives each row. Its loop, `generate`, takes the
# rule that picks each token (`choose`) and an optional cache (`use_cache=True`), which this
# notebook builds below. Beam search and sampling below reuse its input checks
# (`check_generation_inputs`), its decoder step (`next_token_logits`), its loop and its
# `eval_mode`, and take the same arguments: everything after `src` is keyword-only, so a call
# says what each number is (`beam_search(model, src, beam_size=20, max_new_tokens=5)` cannot be
# read the wrong way round), and the three strategies share the names `max_new_tokens`,
# `src_mask`, `use_cache` and `cache` and the result type, whatever knobs each adds. The last
# import, `DecoderCache`, is notebook 10's description of what a decoder's cache must offer; the
# type hints below use it, and it is used and explained only in the section "The KV cache" below:
# until then, ignore it.

# %%
from transformer_from_scratch.decoding import Generation
from transformer_from_scratch.decoding import check_generation_inputs
from transformer_from_scratch.decoding import eval_mode
from transformer_from_scratch.decoding import generate
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.decoding import next_token_logits
from transformer_from_scratch.layers import DecoderCache

# %% [markdown]
# Let us reverse 256 test sequences. `make_batch` (notebook 11) draws them from the same
# distribution as the training batches, with a generator of its own seed, so they are new draws;
# that does not make every one of them new to the model (short sequences are few, so training
# drew many of them too: counted below). Sources shorter than 8 are padded, so the padding mask
# goes to the encoder and to every cross-attention.

# %%
test_gen = torch.Generator().manual_seed(2024)
src, tgt_in, tgt_out, lengths = make_batch(256, MAX_LEN, VOCAB, generator=test_gen)
src, tgt_out = src.to(device), tgt_out.to(device)
src_mask = padding_mask(lengths, MAX_LEN).to(device)  # (B, 1, 1, T_src)

greedy = greedy_decode(model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask)
decoded = greedy.tokens  # (B, T): BOS, L symbols, then EOS


def pad_right(tokens: torch.Tensor, T: int) -> torch.Tensor:
    """Append PAD columns to (B, T0) tokens until they are (B, T)."""
    return F.pad(tokens, (0, T - tokens.size(1)), value=PAD)


def outputs_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B,) bool: do two batches of decoded tokens differ? (PAD-padded to the wider one)"""
    T_max = max(a.size(1), b.size(1))
    return (pad_right(a, T_max) != pad_right(b, T_max)).any(dim=1)


def reversed_correctly(tokens: torch.Tensor) -> torch.Tensor:
    """(B,) bool: is the decoded output the reversal, then EOS (the whole of tgt_out)?"""
    return (pad_right(tokens[:, 1:], MAX_LEN + 1) == tgt_out).all(dim=1)


def show(tokens: torch.Tensor) -> str:
    """Token ids as a short string: symbols as numbers, special tokens by name."""
    names = {PAD: "·", BOS: "<s>", EOS: "</s>"}
    return " ".join(names.get(t, str(t)) for t in tokens.tolist())


correct = reversed_correctly(decoded)  # (B,)

# %% tags=["nbval-ignore-output"]
print("decoded shape:", tuple(decoded.shape))
for i in range(4):
    print(f"source   {show(src[i])}")
    print(f"reversal {show(tgt_out[i])}")
    print(f"decoded  {show(decoded[i, 1:])}\n")
print(f"exact match: {int(correct.sum())}/{len(correct)}")
for i in (~correct).nonzero()[:, 0].tolist():  # the outputs it gets wrong
    print(f"wrong, row {i:3d}: source {show(src[i])}  decoded {show(decoded[i, 1:])}  "
          f"(reversal {show(tgt_out[i])})")

# %% [markdown]
# (The stored run decodes 254 of the 256 exactly. The two it gets wrong, printed last, 8 6 6 4
# and 11 6 6 3, both hold a doubled 6, and in both the model emits a third 6: in the first in
# place of the 8, in the second as one 6 too many. The output is not compared, because a model
# trained under another CPU kernel, on a GPU or with another PyTorch is another run.)
#
# **Check.** Nearly every output is exact: 250 or more of 256 (the four seeds of notebook 11's
# study decoded 255 or 256 of these sources, the stored run one fewer; the bound leaves room for
# another PyTorch or device). Every output, right or wrong, is well formed: `BOS` first and
# nowhere else, symbols only until its first `EOS`, nothing but `PAD` after it (so at most one
# `EOS`). (That a correct output ends with `EOS` after exactly $L$ symbols needs no check of its
# own: `reversed_correctly` compares the whole of `tgt_out`, `EOS` included.) Last, a check of
# the loop's bookkeeping rather than of the model: greedy decoding is a fixed point of teacher
# forcing. Feeding its own output back as `tgt_in` in *one* parallel forward pass, the argmax at
# every position must reproduce the next decoded token; an off-by-one in the loop's positions or
# masks would break it. This holds for any weights up to ties within rounding: the loop's passes
# over each prefix and the one pass over the whole output are matrix products of other shapes,
# so their logits differ in the last bits, and a model whose top two logits were that close
# could flip an argmax. The trained model's smallest gap is far larger (in the stored run 0.20,
# against logit differences of the order of $10^{-5}$ between such passes: the KV cache section
# measures both).

# %%
assert int(correct.sum()) >= 250
is_eos = (decoded == EOS).int()
eos_at = torch.where(is_eos.any(1), is_eos.argmax(dim=1), decoded.size(1))  # (B,): first EOS
after_eos = torch.arange(decoded.size(1), device=device) > eos_at[:, None]  # (B, T)
assert (decoded[:, 0] == BOS).all()  # every row: BOS first,
before_eos = ~after_eos[:, 1:] & (decoded[:, 1:] != EOS)  # (B, T - 1): the generated symbols
assert (decoded[:, 1:][before_eos] >= 3).all()  # then symbols only (ids 0-2 are PAD, BOS, EOS),
assert (decoded[after_eos] == PAD).all()  # nothing but PAD after its first EOS,
assert ((decoded == EOS).sum(dim=1) <= 1).all()  # hence at most one EOS

with torch.no_grad():
    model.eval()
    T = decoded.size(1) - 1
    logits = model(src, decoded[:, :-1], src_mask=src_mask, tgt_mask=causal_mask(T, device=device))
rows_alive = ~after_eos[:, 1:]  # positions up to and including EOS
assert torch.equal(logits.argmax(-1)[rows_alive], decoded[:, 1:][rows_alive])

# %% [markdown]
# **How new are the test sources?** A source of $L$ symbols is one of $9^L$: 729 of length 3,
# 6,561 of length 4, against 160,000 training sources (2,500 steps of 64). So training has drawn
# most short sequences, test ones included. The training batches come from their own generator
# (the recipe's seed + 1, as `train_reversal` draws them, notebook 11), so we can draw them again
# and count which test sources training saw, and when (the model after 100 steps, used below, saw
# only the first 100 batches):

# %%
recipe = reversal_recipe()  # notebook 11's recipe: its batches, in order
train_gen = torch.Generator().manual_seed(recipe.seed + 1)
first_seen = {}  # a training source's symbols -> the first step that drew it
for step in range(recipe.steps):
    batch_src, _, _, batch_lengths = make_batch(recipe.batch_size, recipe.max_len,
                                                recipe.vocab_size, generator=train_gen)
    for row, n in zip(batch_src.tolist(), batch_lengths.tolist(), strict=True):
        first_seen.setdefault(tuple(row[:n]), step)
seen_at = torch.tensor([first_seen.get(tuple(row[:n]), recipe.steps)  # steps: never drawn
                        for row, n in zip(src.tolist(), lengths.tolist(), strict=True)])
in_training = seen_at < recipe.steps  # (B,): drawn by the full run's training
print("test sources drawn in training, by length:")
for n in range(3, MAX_LEN + 1):
    of_n = lengths == n
    print(f"  length {n}: {int(in_training[of_n].sum()):2d} of {int(of_n.sum()):2d} "
          f"({int((seen_at[of_n] < 100).sum()):2d} in the first 100 steps)")
print(f"  all: {int(in_training.sum())} of {len(src)}")
# Short sources are nearly all drawn in training (each length-4 one with probability ~0.98: all 43
# of them here is this draw's luck); one of 7 symbols with probability ~0.006 (26,700 draws of
# that length among 9^7 = 4.8 M sources), one of 8 with ~0.0006: about 0.3 of the 79 long test
# sources expected, none in this draw; 4 or more would happen in 1 draw of 5,000.
# The data come from CPU generators, so the assert below gives the same answer on any machine;
# what it guards is the replay's bookkeeping, the premise of the next cells: keys that kept the
# padding on one side would match nothing (0 of 256 drawn) and fail it. It does not check that
# the replayed stream is training's (another seed passes too): notebook 11 checks that against
# train_reversal, and nbval compares the counts printed above.
assert in_training[lengths <= 4].float().mean() > 0.9 and int(in_training[lengths >= 7].sum()) <= 3

# %% tags=["nbval-ignore-output"]
unseen = ~in_training.to(device)
print(f"exact match on the {int(unseen.sum())} sources training never drew: "
      f"{int(correct[unseen].sum())}; on the {int(in_training.sum())} it drew: "
      f"{int(correct[~unseen].sum())}")

# %% [markdown]
# So 105 of the 256 test sources are training sequences, among them every one of length 3 or 4
# (88); only those of 5 symbols or more are mostly new. That every short one was drawn is this
# test set's luck: training draws a given source of length 4 with probability about 0.98, so
# another test seed may well hold a length-4 source it never saw. Exact match on the short ones
# could come from memory. The 151 never seen are the test of generalisation: in the stored run all 151 come out exact (the
# two wrong outputs above, both of length 4, are on sources training drew). Asserted with the
# bound of the check above (the study's seeds got at most one of 256 wrong):

# %%
assert correct[unseen].float().mean() >= 0.97

# %% [markdown]
# **Picture.** What the model believes at each step, for one source of full length: the
# next-token distribution, and how much more likely the chosen token is than the runner-up.

# %%
b = int((lengths == MAX_LEN).nonzero()[0])  # the first source of full length
with torch.no_grad():
    probs = F.softmax(logits[b, : lengths[b] + 1].float(), dim=-1).cpu()  # (L + 1, V)
chosen = decoded[b, 1 : lengths[b] + 2].cpu()  # (L + 1,): L symbols and EOS
top2 = probs.topk(2, dim=-1)  # values and indices (L + 1, 2)
margin = top2.values[:, 0] / top2.values[:, 1]  # (L + 1,): chosen over runner-up
runner_up = top2.indices[:, 1]  # (L + 1,)

# %% tags=["nbval-ignore-output"]
print(f"source {show(src[b])}")
for step in range(len(chosen)):
    print(f"step {step + 1}: {show(chosen[step : step + 1]):>4s} p = {top2.values[step, 0]:.5f}, "
          f"runner-up {show(runner_up[step : step + 1]):>4s} p = {top2.values[step, 1]:.1e}: "
          f"{margin[step]:9.0f} times less")
with torch.no_grad():
    all_top2 = F.softmax(logits.float(), dim=-1).topk(2, dim=-1).values  # (B, T, 2)
all_margin = (all_top2[..., 0] / all_top2[..., 1]).masked_fill(~rows_alive, math.inf)  # (B, T)
closest_row = int(all_margin.min(dim=1).values.argmin())
print(f"closest call over the steps of all 256 outputs: {all_margin.min():.2f} times, on row "
      f"{closest_row}, an output it gets {'right' if correct[closest_row] else 'wrong'}")

# %% [markdown]
# **Check.** Greedy's choice wins every step by a margin: the runner-up is at least 5 times less
# likely (the stored run's exact numbers are above, not compared: its closest call on this source
# is 1,002 times; the study's four seeds had 12, 4,123, 1,669 and 6,259). That bound is asserted
# for the stored run only (`STORED_RUN`); for any other run, only a margin of 1.5, on this
# source's steps (the bound is per this source: the study's closest call on it was 12, while over
# *all* sources it was 1.3; the stored run's is 1.2, on an output it gets wrong, printed above).

# %%
assert margin.min() >= (5 if STORED_RUN else 1.5)  # another run: a bound of the seed study

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(6.4, 3.8))
image = ax.imshow(probs.clamp_min(1e-12).log10(), cmap="viridis", aspect="auto", vmin=-10, vmax=0)
ax.scatter(chosen, range(len(chosen)), marker="o", s=40, facecolors="none",
           edgecolors=COLORS["accent"], linewidths=1.5)
ax.set_xticks(range(VOCAB), ["PAD", "BOS", "EOS", *[str(i) for i in range(3, VOCAB)]], rotation=45)
ax.set_yticks(range(len(chosen)), [f"step {t + 1}" for t in range(len(chosen))])
ax.set_xlabel("next token (red circle: greedy's choice)")
ax.set_ylabel("decoding step")
ax.set_title(f"Next-token distributions, source {show(src[b])}")
fig.colorbar(image, ax=ax, label="log10 probability")
save_figure(fig, "generation_next_token")
plt.show()


# %% [markdown]
# In the stored run every one of the nine steps puts at least 99.7 % on its token, with the
# runner-up at least a thousand times less likely (1,002 times at step 7, the closest call).
# Another run prints other numbers, and the check asserts only the bound that held for every
# seed: in the study's seed 0 (the same recipe and seed, trained under PyTorch's AVX-512
# kernel, which rounds some operations differently and so trains another run), step 8 was a
# close call, the 6 it must emit at $p = 0.92$ against $0.08$ for 4, the symbol the decoder had just read, only 12
# times less. The colour scale shows the stored run's confidence: one bright cell per row,
# every other cell dark, the lightest of them (around $10^{-3}$) at steps 6 to 8.
# Near-certainty at every step is what exact match needs, since one wrong token spoils an output
# (notebook 11 showed how).
#
# **Greedy decoding encodes once, then calls the decoder once per token; on the trained reversal
# model it is already nearly exact.**
#
# ## Where the decoder looks: cross-attention
#
# Reversal was chosen (in the tutorial behind notebook 11) because it cannot be solved without
# alignment: to emit its $t$-th symbol (counting from 0), the decoder must read source position
# $L-1-t$, which moves with the length $L$ of each source. The only place where the decoder reads
# the source is cross-attention, so the alignment must show up in its weights as an
# *anti-diagonal*.
#
# The decoder blocks do not hand those weights out: `DecoderBlock.forward` returns its output
# only. `MultiHeadAttention` can (`return_attn=True`, notebook 03), so we capture them with a
# **forward hook** on each block's `cross_attn`: PyTorch calls the hook with the sub-layer's
# inputs right after it runs, and the hook runs the same sub-layer once more with
# `return_attn=True`. Nothing in the model changes, and the hooks are removed afterwards.

# %%
#| export
def cross_attention_weights(
    model: nn.Module, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None
) -> list[Tensor]:
    """Every decoder layer's cross-attention weights (B, h, T_tgt, T_src), teacher-forced on tgt."""
    weights: list[Tensor] = []

    def keep_weights(module, args, kwargs, output):
        # module.forward, not module(...): calling the module would run this hook again.
        _, attn = module.forward(*args, **{**kwargs, "return_attn": True})
        weights.append(attn)  # (B, h, T_tgt, T_src)

    handles = [
        block.cross_attn.register_forward_hook(keep_weights, with_kwargs=True)
        for block in model.decoder.layers
    ]
    try:
        with torch.no_grad(), eval_mode(model):
            tgt_mask = causal_mask(tgt.size(1), device=tgt.device)
            model(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask)
    finally:
        for handle in handles:
            handle.remove()
    return weights


# %%
attn = cross_attention_weights(model, src, decoded[:, :-1], src_mask=src_mask)
num_layers, (B, h, T_tgt, T_src) = len(attn), attn[0].shape
print(f"{num_layers} layers, each (B, h, T_tgt, T_src) = {(B, h, T_tgt, T_src)}")

# %% [markdown]
# **Check.** The weights are real attention rows: each sums to 1 and gives padded source
# positions exactly 0, the mask's job. Then the alignment itself: for every target position
# $t < L$, which source position gets the most weight? We count how often it is $L-1-t$, for each
# layer and head, over all 256 sequences.

# %%
for layer_attn in attn:
    assert_close(layer_attn.sum(-1), torch.ones_like(layer_attn.sum(-1)))
    assert (layer_attn.masked_select(~src_mask[:, :, :, :]) == 0).all()  # PAD keys: exactly 0

L = lengths.to(device)[:, None]  # (B, 1) source lengths
t = torch.arange(T_tgt, device=device)[None, :]  # (1, T_tgt) target positions
symbol_steps = t < L  # (B, T_tgt): the L steps that emit a symbol (not EOS)


def aligned_fraction(weights: torch.Tensor, shift: int = 0, steps=symbol_steps) -> float:
    """Share of `steps` at which weights (B, T_tgt, T_src) peak at source position L-1-t+shift."""
    target = L - 1 - t + shift  # (B, T_tgt)
    hits = weights.argmax(dim=-1) == target  # (B, T_tgt): the argmax over source positions
    return hits[steps].float().mean().item()


fractions = torch.tensor([[aligned_fraction(a[:, head]) for head in range(h)] for a in attn])
averaged = [aligned_fraction(a.mean(dim=1)) for a in attn]  # heads averaged first

# %% tags=["nbval-ignore-output"]
for layer in range(num_layers):
    row = "  ".join(f"{x:.3f}" for x in fractions[layer].tolist())
    print(f"layer {layer}: heads {row}   head-average {averaged[layer]:.3f}")

# %% [markdown]
# In the stored run both layers align: every head of the last layer, three of the four heads of
# the first, and the head-averaged weights of each layer point at $L-1-t$ for 95 % of the
# positions or more. The odd one out, head 0 of layer 0, aligns at only 18 % of the steps. A head
# can be useful without aligning: it may look one position to the right, at $L-t$, the source
# position of the symbol the decoder has just read as its input ($\hat y_{t-1} = x_{L-t}$), a
# landmark as good as the target itself; or two positions to the right, at $L+1-t$, the symbol
# it emitted two steps before ($\hat y_{t-2}$, its input at the previous step).
#
# To compare the three targets, each head's shares must count the *same* steps: $L-t$ lies
# inside the source only from the second step on ($t \ge 1$), $L+1-t$ only from the third
# ($t \ge 2$). So the table below counts, for all three, the symbol steps from the third on
# ($2 \le t \le L-1$, 878 steps of the 256 sources). There the three positions are different
# ones, a head's argmax is at most one of them, and its three shares and "elsewhere" add up to
# 100 %. (The 18 % above counts all $L$ symbol steps, the first two included: another set.)
#
# For one row: a source of $L = 5$ symbols $x_0 \dots x_4$, whose reversal is
# $y = x_4\, x_3\, x_2\, x_1\, x_0$, at step $t = 2$ (the third symbol step, which emits $y_2$):
#
# | target | source position | symbol there | what it is at step $t = 2$ |
# |---|---|---|---|
# | $L-1-t$ | 2 | $x_2$ | the symbol to emit now, $y_2$ |
# | $L-t$ | 3 | $x_3$ | the decoder's input at this step, $\hat y_1$ |
# | $L+1-t$ | 4 | $x_4$ | the symbol emitted two steps before, $\hat y_0$ (the input one step before) |
#
# At $t = 0$ only $L-1-t = 4$ is inside the source; at $t = 1$, $L-t = 4$ joins it.

# %%
from_third = (t >= 2) & (t < L)  # (B, T_tgt): L-1-t, L-t and L+1-t all in the source
shares = torch.tensor([[[aligned_fraction(a[:, head], shift, from_third) for shift in (0, 1, 2)]
                        for head in range(h)] for a in attn])  # (layers, h, 3)
head_00_by_step = [aligned_fraction(attn[0][:, 0], 0, (t == k) & (t < L)) for k in (0, 1, 2)]

# %% tags=["nbval-ignore-output"]
print(f"share of the {int(from_third.sum())} symbol steps from the third on whose weights peak at:")
print("                 L-1-t    L-t  L+1-t  elsewhere")
for layer, head in itertools.product(range(num_layers), range(h)):
    at = shares[layer, head].tolist()
    print(f"layer {layer} head {head}:  " + "  ".join(f"{x:5.1%}" for x in at)
          + f"  {max(0.0, 1 - sum(at)):8.1%}")
print("layer 0 head 0, share of steps t = 0, 1, 2 that peak at L-1-t: "
      + ", ".join(f"{x:.1%}" for x in head_00_by_step))

# %% [markdown]
# In the stored run no head looks at $L-t$, the symbol just read (none at more than 8 % of these
# steps); head 0 of layer 0 looks one position further, at $L+1-t$, the symbol emitted two steps
# before, at 97 % of them, and never at $L-1-t$: the 18 % it aligns over all symbol steps are
# the first step alone ($t = 0$: all 256 aligned; $t = 1$ and $t = 2$: none), one of the two
# steps where $L+1-t$ is not yet in the source. (In the picture below: from the third row on,
# its weight sits two cells right of the anti-diagonal.)
#
# **Check.** Which head does what is a finding of one run (the note below), so the check asserts
# only what held for every seed of notebook 11's study, with room to spare: the last layer's
# head average aligns at 90 % of the steps or more, and so does at least one head. The stored
# run's odd head is asserted for that run only.
#
# > **Other runs.** Another seed, the same seed on a GPU (another random generator), with
# > another PyTorch (the CPU's dropout stream changed in 2.7), or under another CPU kernel,
# > lands on another division of labour. In notebook 11's seed study (which counted each shift
# > over the steps where its position exists, $1 \le t \le L$ for $L-t$), seeds 0 and 3 grew a
# > shifted head (head 0 of layer 0 in both, peaking at $L-t$ at 99.9 % and 99.1 % of the
# > steps), seed 1 none (no head above 22 % at $L-t$), and seed 2 a head that splits its steps
# > between the two (42 % aligned, 46 % shifted). The study's seed 0 is this notebook's recipe
# > and seed, trained under the AVX-512 kernel, whose rounding makes it another run: there head
# > 0 of layer 0 looks at $L-t$, here at $L+1-t$. (The study did not measure the shift of two.) Every seed
# > aligned its last layer, though: the head-averaged weights of layer 1 peak at $L-1-t$ at
# > 99.9 % of the steps or more (the stored run: 99.6 %), and at least one head at 95 % or more.

# %%
assert averaged[-1] >= 0.9 and fractions.max() >= 0.9
if STORED_RUN:  # the stored run's division of labour, as described (not a general rule)
    assert fractions[0, 0] < 0.2 and shares[..., 1].max() < 0.1
    assert shares[0, 0, 2] > 0.9 and shares[0, 0, 0] == 0
    assert head_00_by_step == [1.0, 0.0, 0.0]  # its 18 %: exactly the first steps

# %% [markdown]
# **Picture.** Every head of both decoder layers for one full-length source: source positions
# and their symbols across (`2:10` is the symbol 10 at position 2), the decoder's positions $t$
# and input tokens down (the row `0:<s>` is the step that emits the first symbol). The
# anti-diagonal runs from position $L-1 = 7$ in row 0 to position 0 in row 7. The last row is
# the step that emits `EOS`: there $L-1-t = -1$, no source position is the target, and the
# heads put their weight on different source positions from one head to the next, which no
# alignment explains and none has to. Each panel's title gives that head's
# share of aligned steps over all 256 sources, the table above.

# %% jupyter={"source_hidden": true}
x_labels = [f"{i}:{show(s)}" for i, s in enumerate(src[b].split(1))]  # position:symbol
y_labels = [f"{i}:{show(s)}" for i, s in enumerate(decoded[b, :-1].split(1))]
fig, axes = plt.subplots(num_layers, h, figsize=(3.3 * h, 3.1 * num_layers), squeeze=False,
                         layout="constrained")
for layer in range(num_layers):
    for head in range(h):
        plot_attention(attn[layer][b, head, : lengths[b] + 1], x_labels, y_labels[: lengths[b] + 1],
                       ax=axes[layer, head], vmin=0, vmax=1, colorbar=False,
                       title=f"layer {layer}, head {head}\n{fractions[layer, head]:.1%} aligned")
        axes[layer, head].set(xlabel="", ylabel="")  # one label for all panels, below
        axes[layer, head].tick_params(labelsize=10)
        axes[layer, head].tick_params(axis="x", labelrotation=90)
fig.supxlabel("source position:symbol (key)")
fig.supylabel("decoder position t:input (query)")
fig.colorbar(axes[0, 0].images[0], ax=axes, label="attention weight", shrink=0.8)
fig.suptitle("Cross-attention of the trained reversal model on one source: the anti-diagonal is "
             "the alignment\n(% aligned: the head's share of the symbol steps of all 256 test "
             "sources whose weights peak at L-1-t)")
save_figure(fig, "generation_cross_attention")
plt.show()


# %% [markdown]
# (Where the model is least sure of a token it gets right, and what its cross-attention does
# there, is the subject of the appendix "Where the model hesitates": a negative result in the
# stored run.)
#
# ### Which heads matter: switching them off
#
# Attention weights show where a head looks, not whether the model needs what it finds there.
# An **ablation** answers that: switch one head off and measure what the model can still do.
# Every `MultiHeadAttention` concatenates its heads' outputs, head $i$ in channels
# $i\,d_k \dots (i+1)\,d_k - 1$, and mixes them with `W_o` (notebook 03's `combine_heads`). A
# **forward pre-hook** on `W_o`, which PyTorch calls with `W_o`'s input before it runs, can zero
# one head's channels, so that the head adds nothing; the hook is removed afterwards. We do that
# for each of the 24 heads (2 layers, 4 heads, in the encoder's self-attention, the decoder's
# self-attention and the cross-attention), and for each layer's four heads at once, and count
# the test sources still reversed exactly by greedy decoding.

# %%
def attentions(m: Transformer) -> dict[str, list]:
    """Every MultiHeadAttention of the model, by kind, one per layer."""
    return {"encoder self-attention": [block.self_attn for block in m.encoder.layers],
            "decoder self-attention": [block.self_attn for block in m.decoder.layers],
            "cross-attention": [block.cross_attn for block in m.decoder.layers]}


@contextmanager
def heads_off(attention: torch.nn.Module, heads):
    """Zero the outputs of `heads` of one MultiHeadAttention: their channels of W_o's input."""
    keep = torch.ones(attention.num_heads, attention.d_k, device=attention.W_o.weight.device)
    keep[list(heads)] = 0.0
    keep = keep.flatten()  # (d_model,): 0 on the channels of the heads switched off

    def zero_heads(module, args):
        return (args[0] * keep,)  # (B, T, d_model): the heads concatenated

    handle = attention.W_o.register_forward_pre_hook(zero_heads)
    try:
        yield
    finally:
        handle.remove()


def exact_match_count(m: Transformer) -> int:
    """Test sources the model reverses exactly by greedy decoding (of 256)."""
    out = greedy_decode(m, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask).tokens
    return int(reversed_correctly(out).sum())


# %% [markdown]
# **Check.** The hook does what it says: with all four heads of an attention off, its output is
# `W_o`'s bias at every position, whatever the input. And with every cross-attention head off,
# the decoder sees nothing of the source: fed the same decoder input, all 256 sources must give
# the same logits (up to rounding).

# %%
probe = torch.randn(2, 5, model.d_model, device=device)
cross_0 = model.decoder.layers[0].cross_attn
with torch.no_grad(), heads_off(cross_0, range(h)):
    assert_close(cross_0(probe), cross_0.W_o.bias.expand(2, 5, -1))
assert not cross_0.W_o._forward_pre_hooks  # removed again
with torch.no_grad(), ExitStack() as stack:
    for attention in attentions(model)["cross-attention"]:
        stack.enter_context(heads_off(attention, range(h)))
    same_input = decoded[:1, :-1].expand(len(src), -1)  # one decoder input for every source
    blind = model(src, same_input, src_mask=src_mask,
                  tgt_mask=causal_mask(same_input.size(1), device=device))  # (B, T, V)
assert_close(blind, blind[:1].expand_as(blind), atol=1e-4, rtol=0)  # no trace of the source

# %% tags=["nbval-ignore-output"]
ablation = {}  # kind -> (layers, h + 1) exact-match counts: each head off, then all four
with tqdm(total=3 * num_layers * (h + 1), desc="ablations") as bar:
    for kind, layers in attentions(model).items():
        ablation[kind] = torch.zeros(num_layers, h + 1, dtype=torch.long)
        for layer, attention in enumerate(layers):
            for column, heads in enumerate([[head] for head in range(h)] + [range(h)]):
                with heads_off(attention, heads):
                    ablation[kind][layer, column] = exact_match_count(model)
                bar.update()
    with ExitStack() as stack:
        for attention in attentions(model)["cross-attention"]:
            stack.enter_context(heads_off(attention, range(h)))
        no_cross = exact_match_count(model)
unablated = int(correct.sum())
for kind, counts in ablation.items():
    for layer in range(num_layers):
        print(f"{kind:23s} layer {layer}: one head off " + " ".join(
            f"{c:3d}" for c in counts[layer, :h].tolist()) + f", all four off {counts[layer, h]:3d}")
print(f"every cross-attention head off: {no_cross}/256 (nothing off: {unablated}/256)")

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(13, 3.2), layout="constrained")
for ax, (kind, counts) in zip(axes, ablation.items(), strict=True):
    image = ax.imshow(counts, cmap="viridis", vmin=0, vmax=256)
    for (layer, column), c in np.ndenumerate(counts.numpy()):
        ax.text(column, layer, str(c), ha="center", va="center", fontsize=9,
                color="black" if c > 160 else "white")
    ax.set_xticks(range(h + 1), [*[f"head {i}" for i in range(h)], "all 4"])
    ax.set_yticks(range(num_layers), [f"layer {i}" for i in range(num_layers)])
    ax.set_xlabel("head switched off")
    ax.set_title(kind)
axes[0].set_ylabel("layer")
fig.colorbar(image, ax=axes, label="exact match (of 256 test sources)", shrink=0.9)
fig.suptitle(f"Head ablation of the trained model: exact match with heads switched off "
             f"(none off: {unablated})")
save_figure(fig, "generation_head_ablation")
plt.show()

# %% [markdown]
# In the stored run no single head is needed: with any one of the 24 off, 250 or more of the 256
# sources still come out exact (254 with none off). The heads of a layer back each other up. For
# cross-attention the alignment table suggested it (three or four heads per layer align); for
# the self-attention heads, which that table does not cover, this ablation is the only
# evidence. Whole layers do matter,
# most of all the first ones: with the four heads of the decoder's first self-attention off, 52
# sources are exact; of the encoder's first, 120; of the first cross-attention, 177; of the last
# layers, 211, 253 and 249. With every cross-attention head off, none is. That last number is no
# finding of this run: the decoder then sees nothing of the source (the check above), so it
# writes one output for every source, the reversal of at most as many sources as share one
# reversal (in this test set, at most 2 sources are the same: printed below, a property of the
# test set, drawn on the CPU from a fixed seed, not of the run). So that is asserted for any run;
# which heads the model can spare, for the stored run only, and with room: the stored minimum is
# exactly 250, the same under PyTorch's AVX2 and default CPU kernels, while on a GPU the same
# weights, rounded otherwise, might flip a sequence, so the assert asks for 245.

# %%
most_shared = int(tgt_out.unique(dim=0, return_counts=True)[1].max())  # sources sharing a reversal
print(f"test sources that share one reversal: at most {most_shared}")  # the test set's draw
assert no_cross <= most_shared  # a guard: holds for any weights once the hook works (blind to
# the source, one output for all); it fails only if the hook does not
if STORED_RUN:  # the stored run's redundancy, as described (not a general rule)
    assert min(counts[:, :h].min() for counts in ablation.values()) >= 245  # stored: 250
    assert ablation["decoder self-attention"][0, h] < 128


# %% [markdown]
# **The decoder learnt to look up source position $L-1-t$ at step $t$: cross-attention *is* the
# alignment, and we can read it off the weights. Switched off one at a time, no head is needed;
# switched off layer by layer, the first layers are.**
#
# ## The KV cache
#
# Look at what the loop above recomputes. At step $t$ the decoder receives the whole prefix
# $\hat y_0, \dots, \hat y_{t-1}$ and, in every layer, projects all $t$ positions to queries,
# keys and values, runs all of them through the feed-forward network, and projects the
# encoder's output to cross-attention keys and values again. Then it throws away everything but
# the last position's logits.
#
# The causal mask is why most of that is wasted. Position $i$ only ever attends to positions
# $\le i$, so its hidden state in every layer, and hence its keys and values, depends on tokens
# that do not change when the prefix grows. They can be computed once and **kept**:
#
# - per decoder layer, the self-attention keys and values of every position so far,
#   two tensors $(B, h, t, d_k)$ that grow by one position per step;
# - per decoder layer, the cross-attention keys and values $W_K\,\mathrm{enc\_out}$ and
#   $W_V\,\mathrm{enc\_out}$, $(B, h, T_\text{src}, d_k)$, computed once.
#
# A step then runs only the newest token through the decoder. With $n$ new tokens, $N$ layers
# and width $d$, count the multiply–adds per sequence, up to constant factors: $c\,d^2$ per
# position per layer for the projections and the FFN ($c = 14$ here: six $d \times d$
# projections, four in self-attention and two in cross-attention, and $8d^2$ for the FFN with
# $d_\text{ff} = 4d$), plus the attention itself, $d$ per query–key pair:
#
# $$\underbrace{\sum_{t=1}^{n} N\bigl(c\,t\,d^2 + t^2 d\bigr)}_{\text{without cache}}
# \approx N\Bigl(\tfrac{c}{2}\,n^2 d^2 + \tfrac{1}{3}\,n^3 d\Bigr)
# \qquad\text{vs}\qquad
# \underbrace{\sum_{t=1}^{n} N\bigl(c\,d^2 + t\,d\bigr)}_{\text{with cache}}
# \approx N\Bigl(c\,n\,d^2 + \tfrac{1}{2}\,n^2 d\Bigr),$$
#
# a factor of about $n/2$ less. The price is memory: $2\,N\,B\,n\,d$ cached numbers for
# self-attention. Nothing in the mathematics changes: the logits agree up to rounding, and the
# tokens must come out identical wherever no two tokens are closer than that rounding (checked
# below).
#
# The modules already know what to do with a cache. Notebook 03 gave `MultiHeadAttention.forward`
# a `cache` argument: a *frozen* cache hands back its keys and values, any other stores this
# call's keys and values and returns all it holds. Notebook 08's decoder block hands
# `cache.self_attn` and `cache.cross_attn` to its two attentions, notebook 10's decoder stack
# hands `cache.layer(i)` to block $i$, and `Transformer.decode` places the new tokens at
# positions `cache.length`, `cache.length + 1`, .... So the full pass and the cached step run the
# same code; all that is left to write is the cache itself, one small class per level.
#
# **One attention's keys and values.** Self-attention's cache grows by one position per step.
# Concatenating the new keys to the old ones would copy all $t$ kept positions at step $t$, a
# quadratic amount of copying over a long output. Instead the cache keeps a buffer with room to
# spare, writes each call's positions into it, and when it is full makes a new one with room for
# twice the positions needed (Python's lists over-allocate in the same spirit, by about an eighth),
# so that a position is copied a constant number of times on average. `keys` and `values`
# are views of the filled part. Cross-attention's cache is filled once, from `enc_out`, and is
# frozen from then on.

# %%
#| export
class AttentionCache:
    """One attention's keys and values (B, h, T_kept, d_k): grown step by step, or fixed once."""

    def __init__(self, grows: bool = True):
        self.grows = grows  # True: self-attention (append); False: cross-attention (store once)
        self.keys: Tensor | None = None  # (B, h, T_kept, d_k), a view of the buffer
        self.values: Tensor | None = None
        self._buffers: tuple[Tensor, Tensor] | None = None  # (B, h, capacity, d_k) each

    @property
    def frozen(self) -> bool:
        """Is this a filled cross-attention cache (MultiHeadAttention then reuses keys, values)?"""
        return not self.grows and self.keys is not None

    @property
    def length(self) -> int:
        """Positions kept."""
        return 0 if self.keys is None else self.keys.size(2)

    @property
    def capacity(self) -> int:
        """Positions there is room for: a growing cache's buffer, else the positions kept."""
        return self.length if self._buffers is None else self._buffers[0].size(2)

    def num_bytes(self) -> int:
        """Bytes of the keys and values kept (not counting a growing buffer's spare room)."""
        if self.keys is None:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()

    def allocated_bytes(self) -> int:
        """Bytes the cache holds in memory: what it keeps plus a growing buffer's spare room."""
        held = self._buffers or (() if self.keys is None else (self.keys, self.values))
        return sum(tensor.numel() * tensor.element_size() for tensor in held)


# %% [markdown]
# `update` is what `MultiHeadAttention.forward` calls with the keys and values it has just
# projected, `(B, h, T_new, d_k)` each; it returns everything kept, new positions included.

# %%
#| export
@add_to_class(AttentionCache)
def update(self, K: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
    """Keep K, V (B, h, T_new, d_k); return all keys and values kept (B, h, T_kept, d_k)."""
    if not self.grows:  # cross-attention: keep them as they are; frozen from now on
        if self.keys is not None:
            raise RuntimeError("a cross-attention cache is filled once (it is frozen)")
        self.keys, self.values = K, V
        return K, V
    start, end = self.length, self.length + K.size(2)
    if self._buffers is None or end > self._buffers[0].size(2):  # no room left: double it
        capacity = max(2 * end, 16)
        buffers = tuple(K.new_empty(*K.shape[:2], capacity, K.size(3)) for _ in range(2))
        if self._buffers is not None:
            for buffer, old in zip(buffers, self._buffers, strict=True):
                buffer[:, :, :start] = old[:, :, :start]
        self._buffers = buffers
    self._buffers[0][:, :, start:end] = K
    self._buffers[1][:, :, start:end] = V
    self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
    return self.keys, self.values


# %% [markdown]
# **Check.** Filled in chunks of 3, 1 and 20 positions, the cache holds exactly what one
# concatenation would (the buffer, made with room for 16 positions, grew once, to 48); a
# cross-attention cache keeps its first keys and refuses a second fill.

# %%
chunks = [torch.randn(2, 4, T_new, 8) for T_new in (3, 1, 20)]  # (B, h, T_new, d_k)
grown = AttentionCache()
for chunk in chunks:
    K_all, V_all = grown.update(chunk, 2 * chunk)
assert torch.equal(K_all, torch.cat(chunks, dim=2)) and torch.equal(V_all, 2 * K_all)
assert grown.length == 24 and grown.capacity == 48
assert grown.allocated_bytes() == 2 * grown.num_bytes()  # room for 48, 24 kept
fixed = AttentionCache(grows=False)
fixed.update(chunks[0], chunks[0])
assert fixed.frozen and not grown.frozen
try:
    fixed.update(chunks[1], chunks[1])
    raise AssertionError("a second fill must fail")
except RuntimeError as err:
    print(f"RuntimeError: {err}")


# %% [markdown]
# **How the modules use it.** These are the lines of notebooks 03, 08 and 10 that touch a cache,
# printed from the installed package with their line numbers there (not compared: they move
# whenever those notebooks change). `MultiHeadAttention.forward` reuses a frozen cache's keys and
# values as they are, and otherwise projects this call's and hands them to `update`, then
# attends to everything it returns; a decoder block passes its two parts on; the decoder stack
# asks for `cache.layer(i)`; `Transformer.decode` reads `cache.length` as the position of the
# first new token.

# %% tags=["nbval-ignore-output"]
def cache_lines(function) -> None:
    """Print the lines of a function's source that mention a cache, with their line numbers."""
    lines, first = inspect.getsourcelines(function)
    print(f"{function.__qualname__} ({inspect.getsourcefile(function).rsplit('/', 1)[-1]}):")
    for number, line in enumerate(lines, start=first):
        if "cache" in line and not line.strip().startswith(('"""', "#")):
            print(f"  {number:4d}  {line.strip()}")


for function in (MultiHeadAttention.forward, DecoderBlock.forward, Decoder.forward,
                 Transformer.decode):
    cache_lines(function)

# %% [markdown]
# **Check.** The same contract, by behaviour, on the first decoder block of the trained model. A
# cross-attention cache, once filled, is used as it is: called again with other key and value
# inputs, the attention gives the output of the first ones. A growing cache, fed one position
# per call, gives each position the output of one causal pass over all of them. And this
# notebook's `AttentionCache` has what notebook 03's `KeyValueCache` protocol asks of a cache
# (`frozen`, `keys`, `values`, `update`). That last check, `isinstance` with a runtime-checkable
# protocol, only sees that the names exist; what they do is what the asserts before it test.

# %%
contract_gen = torch.Generator().manual_seed(3)
queries, memory, other_memory = (torch.randn(2, T_x, model.d_model, generator=contract_gen)
                                 .to(device) for T_x in (3, 5, 5))  # (B, T, d_model)
block_0 = model.decoder.layers[0]
with torch.no_grad(), eval_mode(model):
    cross_cache = AttentionCache(grows=False)
    filled_once = block_0.cross_attn(queries, memory, cache=cross_cache)  # fills the cache
    assert cross_cache.frozen and cross_cache.length == 5
    reused = block_0.cross_attn(queries, other_memory, cache=cross_cache)  # not projected
    assert_close(reused, filled_once)
    assert_close(filled_once, block_0.cross_attn(queries, memory))  # as without a cache
    self_cache = AttentionCache()
    one_by_one = [block_0.self_attn(queries[:, i : i + 1], cache=self_cache) for i in range(3)]
    assert self_cache.length == 3
    one_pass = block_0.self_attn(queries, mask=causal_mask(3, device=device))  # (B, 3, d_model)
    assert_close(torch.cat(one_by_one, dim=1), one_pass, atol=1e-5, rtol=1e-5)
assert isinstance(AttentionCache(), KeyValueCache)


# %% [markdown]
# **The decoder's cache.** A decoder block has two attentions, so its part of the cache is a
# pair; the whole cache is a list of pairs, one per block, made as the decoder asks for them.
# `length` is the number of target positions kept, which `Transformer.decode` reads as the
# position of the next token; `num_bytes` adds up every attention's (beam search adds a
# `reorder` that passes down the same way). `length`
# and `layer(i)` are all that notebook 10's `DecoderCache` protocol (imported above) asks of a
# decoder's cache, so the decoders' `cache=` argument takes a `KVCache` (checked below) or any
# other object that has them.

# %%
#| export
class LayerCache:
    """One decoder block's keys and values: self-attention grows, cross-attention is fixed."""

    def __init__(self):
        self.self_attn = AttentionCache(grows=True)
        self.cross_attn = AttentionCache(grows=False)


class KVCache:
    """Every decoder block's keys and values, for Transformer.decode(..., cache=KVCache())."""

    def __init__(self):
        self.layers: list[LayerCache] = []

    def layer(self, i: int) -> LayerCache:
        """Block i's part (made empty the first time the decoder asks for it)."""
        while len(self.layers) <= i:
            self.layers.append(LayerCache())
        return self.layers[i]

    @property
    def length(self) -> int:
        """Target positions kept: where the next token goes."""
        return self.layers[0].self_attn.length if self.layers else 0

    def num_bytes(self) -> int:
        """Bytes of all keys and values kept."""
        return sum(a.num_bytes() for layer in self.layers for a in (layer.self_attn, layer.cross_attn))


# %% [markdown]
# A cached step is then an ordinary call: `model.decode` with only the newest token and the
# cache. No mask is needed for one new token (the cache holds no future positions to hide);
# several new tokens at once (a prompt, say) need the causal mask, offset by the positions kept.
#
# **Check 1: the same logits.** Run the first three decoder inputs of the decoded batch in one
# cached call (with the causal mask), then the rest one token at a time, and compare every
# step's logits with the teacher-forced forward pass (float tolerance: the same numbers, summed
# in a different order by matrix products of different shapes, so the last bits differ by an
# amount that depends on the machine; the largest difference is printed, not compared).

# %%
T = decoded.size(1) - 1  # decoder inputs: BOS and all but the last token
with torch.no_grad():
    model.eval()
    enc_out = model.encode(src, src_mask=src_mask)
    cache = KVCache()
    dec_first = model.decode(decoded[:, :3], enc_out, self_mask=causal_mask(3, device=device),
                             cross_mask=src_mask, cache=cache)  # (B, 3, d_model), positions 0..2
    dec_steps = [model.decode(decoded[:, t : t + 1], enc_out, cross_mask=src_mask, cache=cache)
                 for t in range(3, T)]  # each (B, 1, d_model), at position cache.length
    stepped = model.out_proj(torch.cat([dec_first, *dec_steps], dim=1))  # (B, T, V)
assert cache.length == T and len(cache.layers) == len(model.decoder.layers)
# What Transformer.decode asks of a cache. A runtime-checkable protocol sees only that the names
# exist; what they do is what checks 1 and 2 test.
assert isinstance(cache, DecoderCache)
cache_gap = (stepped - logits).abs().max().item()

# %% tags=["nbval-ignore-output"]
print(f"largest logit difference: {cache_gap:.1e}")

# %%
tolerance = 1e-4 if device.type == "cpu" else 1e-3  # a GPU sums in other orders
assert_close(stepped, logits, atol=tolerance, rtol=tolerance)
assert cache_gap < tolerance


# %% [markdown]
# The decoders take the cache as a switch: `use_cache=True` makes a new `KVCache` for the call;
# an empty cache of your own, `cache=KVCache()`, does the same and lets you look at it afterwards
# (exercise 2 does). The checks below pass `cache=KVCache()`, the class this notebook has just
# defined: `use_cache=True` would build the installed package's copy, written from these cells by
# `make export`, so an edit to them would not be tested until the next export.
#
# **Check 2: the same tokens, exactly** (with this notebook's `KVCache`). On the trained model
# and on random models, batch sizes from 1 to 64, padded sources of mixed lengths, and outputs
# far longer than the sources.
# A random model never says `EOS` on purpose, so it also exercises rows that finish at different
# steps. The logits are not bit-identical (check 1: they differ in the last bits, on a CPU too),
# but the tokens are the argmax, and an argmax cannot change as long as every logit moves by less
# than half the gap between the top two. So for each model we measure both, along the tokens it
# decodes: the smallest gap between the top two logits over all steps taken, and the largest
# difference between the logits of the two loops compared here, the cached one and the plain one
# that reruns the decoder on the whole prefix at each step (and, for reference, between the
# cached loop and a single teacher-forced pass over the whole output).
#
# A GPU's kernels sum in other orders and differ more. (They would differ more still with TF32,
# which rounds the inputs of matrix products to 10 bits of mantissa; PyTorch leaves it off for
# matrix products by default since version 1.12, `torch.backends.cuda.matmul.allow_tf32 = False`,
# and this course does not switch it on.) A random model has near-ties, so there a row may flip
# (on a GPU one row, or a tenth of the batch, may differ; the printout says which); the trained
# model, whose choices are clear, must still match exactly.

# %%
@torch.no_grad()
def gap_and_drift(m: Transformer, ids: torch.Tensor, mask: torch.Tensor,
                  tokens: torch.Tensor) -> tuple[float, float, float]:
    """Along decoded tokens (B, T), over the steps taken: the smallest top-1 minus top-2 logit,
    the largest |cached - plain loop| logit difference, and the largest |cached - full pass|."""
    with eval_mode(m):
        T = tokens.size(1) - 1
        full = m(ids, tokens[:, :-1], src_mask=mask, tgt_mask=causal_mask(T, device=ids.device))
        enc_out, step_cache = m.encode(ids, src_mask=mask), KVCache()
        stepped = torch.stack([next_token_logits(m, tokens[:, i : i + 1], enc_out, cross_mask=mask,
                                                 cache=step_cache) for i in range(T)], dim=1)
        plain = torch.stack([next_token_logits(m, tokens[:, : i + 1], enc_out, cross_mask=mask)
                             for i in range(T)], dim=1)  # (B, T, V): the whole prefix each step
    is_eos = (tokens[:, 1:] == EOS).long()
    taken = (is_eos.cumsum(dim=1) - is_eos) == 0  # (B, T): the steps up to and including EOS
    top2_logits = plain.topk(2, dim=-1).values  # (B, T, 2)
    gaps = (top2_logits[..., 0] - top2_logits[..., 1])[taken]
    return (gaps.min().item(), (stepped - plain)[taken].abs().max().item(),
            (stepped - full)[taken].abs().max().item())


cached = greedy_decode(model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                       cache=KVCache())  # this notebook's class
assert torch.equal(cached.tokens, decoded)
margins = {"trained": gap_and_drift(model, src, src_mask, decoded)}
assert margins["trained"][0] > 2 * tolerance  # no near-tie: the tokens cannot flip on any device

check_gen = torch.Generator().manual_seed(7)
random_runs = {}  # (B, T_src) -> (shape of the cached output, rows that differ, rows ended with EOS)
for B, T_src, new_tokens, seed in [(1, 5, 40, 1), (3, 7, 64, 2), (16, 12, 100, 3), (64, 8, 24, 4)]:
    torch.manual_seed(seed)
    random_model = Transformer(VOCAB, VOCAB, d_model=64, num_heads=4, d_ff=128, num_layers=3)
    random_model = random_model.to(device)
    lens = torch.randint(1, T_src + 1, (B,), generator=check_gen)
    ids = torch.randint(3, VOCAB, (B, T_src), generator=check_gen)
    ids = ids.masked_fill(torch.arange(T_src) >= lens[:, None], PAD).to(device)  # padded sources
    mask = padding_mask(lens, T_src).to(device)
    plain = greedy_decode(random_model, ids, max_new_tokens=new_tokens, src_mask=mask).tokens
    cached = greedy_decode(random_model, ids, max_new_tokens=new_tokens, src_mask=mask,
                           cache=KVCache()).tokens
    rows_differ = int(outputs_differ(plain, cached).sum())
    if device.type == "cpu":
        assert rows_differ == 0, (B, T_src, new_tokens)
    else:  # other kernels for the two shapes of matmul: a near-tie may flip a token on a GPU
        assert rows_differ <= max(1, B // 10), (B, T_src, new_tokens)  # a row, or 10 % of them
    margins[f"random, B={B}"] = gap_and_drift(random_model, ids, mask, plain)
    random_runs[B, T_src] = tuple(cached.shape), rows_differ, int((cached == EOS).any(1).sum())
# Rows that finish at different steps: some batch has rows that end with EOS and rows that do not.
assert any(0 < ended < B for (B, _), (_, _, ended) in random_runs.items()), random_runs

# %% tags=["nbval-ignore-output"]
for (B, T_src), (shape, rows_differ, ended) in random_runs.items():
    print(f"B={B:2d} T_src={T_src:2d}: {shape}, "
          + ("tokens identical" if rows_differ == 0 else f"{rows_differ} rows differ")
          + f", {ended} of {B} rows ended with EOS")
for name, (gap, drift, full_drift) in margins.items():
    print(f"{name:13s}: smallest top-1 - top-2 gap {gap:.3e}; largest difference, cached - plain "
          f"{drift:.1e}, cached - one full pass {full_drift:.1e}")

# %% [markdown]
# The printout is this machine's and is not compared: on a GPU a random model's row may flip at a
# near-tie (the asserts above allow it), and the gaps and differences depend on the kernels. In
# every random batch of the stored run the tokens are identical, and the batches of 3, 16 and 64
# hold rows that end with `EOS` and rows that run to the cap (asserted for at least one batch, on
# any device). In the stored run the trained
# model's smallest gap over its 256 outputs is 0.1997 (the step where it is least sure, an output
# it gets wrong), and the random models come within $6 \times 10^{-5}$ of a tie, while the
# logits of the cached loop and of the plain one, the two loops check 2 compares, differ by at
# most $5.7 \times 10^{-6}$ (the trained model, whose logits are larger) and $4 \times 10^{-7}$ to
# $1.1 \times 10^{-6}$ (the random ones); one teacher-forced full pass is as far from the cached
# loop. On a CPU every gap is asserted to be more than twice the cached-plain difference, the
# reason the tokens could not differ; the trained model's gap must also exceed twice the
# tolerance of check 1, on any device.

# %%
if device.type == "cpu":
    assert all(gap > 2 * drift for gap, drift, _ in margins.values()), margins

# %% [markdown]
# **Check 3: the work.** Timings depend on the machine; the amount of arithmetic does not.
# PyTorch's `FlopCounterMode` counts the floating-point operations of every matrix product, so we
# can count what the cache saves on a random model of the tutorial's size (made to never stop
# early, so that both runs decode exactly $n$ tokens).

# %%
torch.manual_seed(0)
timing_model = Transformer(VOCAB, VOCAB).to(device)
with torch.no_grad():
    timing_model.out_proj.bias[EOS] = -math.inf  # EOS can never win: always n tokens
one_src = torch.randint(3, VOCAB, (1, MAX_LEN), generator=check_gen).to(device)


def decoding_flops(n: int, use_cache: bool) -> int:
    """Floating-point operations of greedy decoding of n tokens, counted by PyTorch."""
    with FlopCounterMode(display=False) as counter:
        greedy_decode(timing_model, one_src, max_new_tokens=n, use_cache=use_cache)
    return counter.get_total_flops()


flop_lengths = [8, 16, 32, 64, 128]
flops = {c: [decoding_flops(n, c) for n in flop_lengths] for c in (False, True)}
for n, plain, cached in zip(flop_lengths, flops[False], flops[True], strict=True):
    print(f"n = {n:3d}: {plain / 1e9:6.2f} GFLOP without cache, {cached / 1e9:6.3f} GFLOP with, "
          f"ratio {plain / cached:5.1f}")
slopes = {c: fit_slope(flop_lengths, flops[c]) for c in (False, True)}
print(f"log-log slope: {slopes[False]:.2f} without cache, {slopes[True]:.2f} with")

# %%
assert all(c < p for p, c in zip(flops[False], flops[True], strict=True))
assert slopes[False] > 1.7 and slopes[True] < 1.1  # ~ n^2 against ~ n
for n, plain, cached in zip(flop_lengths[2:], flops[False][2:], flops[True][2:], strict=True):
    assert 0.4 * n < plain / cached < 0.55 * n, n  # "about n / 2", from n = 32 on

# %% [markdown]
# **Check 4: the time.** Less arithmetic need not mean less time, so we measure, with notebook
# 02's `time_call`: one untimed warm-up run, then three timed runs, of which it keeps the median
# (a stray slow run does not move it, and it does not flatter like the minimum); on a GPU it waits
# for the queued kernels before reading the clock. A busy machine can still slow a whole
# `time_call` down, so we time in three rounds, each over every length, uncached and cached in
# turns: a slow spell then hits one round, not one length. The table and the figure give the
# median of the three rounds and, for the cached time per token and the speed-up, their range
# (lowest to highest round). One CPU thread; the cell prints how long it took:

# %% tags=["nbval-ignore-output"]
timing_lengths, rounds = [16, 32, 64, 128, 256], 3
timing_start = time.perf_counter()
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    per_round = {(n, c): [] for n in timing_lengths for c in (False, True)}  # seconds, per round
    cpu_round = {(n, c): [] for n in timing_lengths for c in (False, True)}  # CPU seconds, likewise
    for _ in tqdm(range(rounds), desc="timing rounds"):
        for n in timing_lengths:
            for c in (False, True):
                cpu_start = time.process_time()  # the whole time_call: warm-up and 3 runs
                per_round[n, c].append(time_call(lambda n=n, c=c: greedy_decode(
                    timing_model, one_src, max_new_tokens=n, use_cache=c), repeats=3))
                cpu_round[n, c].append(time.process_time() - cpu_start)
finally:
    torch.set_num_threads(threads)
timings = {n: {c: statistics.median(per_round[n, c]) for c in (False, True)}
           for n in timing_lengths}
round_speedups = {n: [plain / cached for plain, cached in zip(
    per_round[n, False], per_round[n, True], strict=True)] for n in timing_lengths}
speedups = [statistics.median(round_speedups[n]) for n in timing_lengths]
flop_ratio = [decoding_flops(n, False) / decoding_flops(n, True) for n in timing_lengths]
print(f"{'n':>4} {'no cache ms':>12} {'cache ms':>9} {'cache ms/token (range)':>23} "
      f"{'speed-up (range)':>18} {'FLOP ratio':>11}")
for n, speedup, ratio in zip(timing_lengths, speedups, flop_ratio, strict=True):
    per_token = [1e3 * x / n for x in per_round[n, True]]
    print(f"{n:4d} {1e3 * timings[n][False]:12.1f} {1e3 * timings[n][True]:9.1f} "
          f"{1e3 * timings[n][True] / n:9.2f} ({min(per_token):.2f}-{max(per_token):.2f}) "
          f"{speedup:6.1f}x ({min(round_speedups[n]):.1f}-{max(round_speedups[n]):.1f}) "
          f"{ratio:10.1f}x")
n_last = timing_lengths[-1]
cpu_speedups = [plain / cached for plain, cached in zip(
    cpu_round[n_last, False], cpu_round[n_last, True], strict=True)]
cpu_speedup = statistics.median(cpu_speedups)
print(f"speed-up at {n_last} tokens in CPU time: {cpu_speedup:.1f}x (rounds "
      f"{min(cpu_speedups):.1f}-{max(cpu_speedups):.1f})")
print(f"(timed in {time.perf_counter() - timing_start:.0f} s)")

# %% [markdown]
# **Check.** The times are this machine's and are not compared. What is asserted, on a CPU, has
# a wide margin and no wall clock in it: the cache wins at the longest output by more than 1.5×
# in CPU time (`time.process_time`, the time this process ran on a core, which waiting for a core
# on a busy machine does not inflate as it inflates the wall-clock times of the table; the median
# of the rounds, the last line printed above). A comparison between lengths is not asserted: the
# short timings are the noisiest. Both loops decode exactly $n$ tokens: the timing model's `EOS`
# bias is $-\infty$, so no row can stop early. On a GPU nothing is asserted: there both loops are
# bound by kernel launches rather than arithmetic, and the process's CPU time does not measure
# the device's work.

# %%
if device.type == "cpu":
    assert cpu_speedup > 1.5, cpu_speedups

# %% jupyter={"source_hidden": true}
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 3.8), layout="constrained")
for c, color, label in ((False, "#7f7f7f", "without cache"), (True, "#9467bd", "with KV cache")):
    middle = np.array([timings[n][c] for n in timing_lengths])
    spread = np.array([[middle[i] - min(per_round[n, c]), max(per_round[n, c]) - middle[i]]
                       for i, n in enumerate(timing_lengths)]).T  # (2, lengths): down, up
    ax.errorbar(timing_lengths, middle, yerr=spread, marker="o", capsize=3, color=color,
                label=label)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xticks(timing_lengths, [str(n) for n in timing_lengths])
ax.xaxis.set_minor_locator(NullLocator())  # only the measured lengths as ticks
ax.set_xlabel("new tokens n")
ax.set_ylabel("time to decode (s)\nmedian of 3 rounds, bars: range")
ax.set_title("Greedy decoding of one source, 1 CPU thread" if device.type == "cpu"
             else f"Greedy decoding of one source on {device.type}")
ax.legend()
ax2.loglog(timing_lengths, flop_ratio, ls="--", marker="s", color="#7f7f7f",
           label="arithmetic saved (FLOP ratio)")
speedup_spread = np.array([[s - min(round_speedups[n]), max(round_speedups[n]) - s]
                           for s, n in zip(speedups, timing_lengths, strict=True)]).T
ax2.errorbar(timing_lengths, speedups, yerr=speedup_spread, marker="o", capsize=3,
             color="#9467bd", label="time saved (speed-up; bars: range of 3 rounds)")
for n, ratio, speedup in zip(timing_lengths, flop_ratio, speedups, strict=True):  # the values
    for value, color, text in ((ratio, "#7f7f7f", f"{ratio:.0f}×"),
                               (speedup, "#9467bd", f"{speedup:.1f}×")):
        ax2.annotate(text, (n, value), textcoords="offset points", xytext=(0, 8), ha="center",
                     fontsize=8, color=color)
ax2.axhline(1, color="black", lw=0.8, ls=":", label="no saving (ratio 1)")
ax2.set_yticks([0.5, 1, 2, 5, 10, 20, 50, 100], ["0.5", "1", "2", "5", "10", "20", "50", "100"])
ax2.yaxis.set_minor_formatter(NullFormatter())
lowest_speedup = min(min(r) for r in round_speedups.values())
ax2.set_ylim(0.7 * min(1.0, lowest_speedup), 2 * max(flop_ratio))  # below 1 only if it is slower
ax2.set_xticks(timing_lengths, [str(n) for n in timing_lengths])
ax2.xaxis.set_minor_locator(NullLocator())
ax2.set_xlabel("new tokens n")
ax2.set_ylabel("ratio, uncached / cached (log scale)")
ax2.set_title("The cache saves far more arithmetic than time")
ax2.legend(fontsize=8, loc="upper left")
save_figure(fig, "generation_cache_time")
plt.show()

# %% [markdown]
# How many operations a step runs: PyTorch's dispatcher sees every ATen operation (a matrix
# product, an addition, a softmax, a copy, ...), and a `TorchDispatchMode` can count them. The
# difference between decoding 32 and 16 tokens, divided by 16, is the count per step, the
# encoder's one pass taken out (the operations differ in version and build, so the counts are
# not compared):

# %% tags=["nbval-ignore-output"]
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Count the ATen operations that run inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_of(n: int, use_cache: bool) -> int:
    with CountOps() as counter:
        greedy_decode(timing_model, one_src, max_new_tokens=n, use_cache=use_cache)
    return counter.count


ops_per_step = {c: (ops_of(32, c) - ops_of(16, c)) / 16 for c in (False, True)}
print(f"ATen operations per decoding step: {ops_per_step[True]:.0f} with the cache, "
      f"{ops_per_step[False]:.0f} without")

# %%
assert 100 < ops_per_step[True] < 1000  # a few hundred small operations a step
assert ops_per_step[True] <= ops_per_step[False]  # the cache adds no operations to a step


# %% [markdown]
# The two panels tell different stories. The arithmetic saved grows like $n/2$ (131× at 256
# tokens), but the time saved is far smaller: in the stored run 1.6× to 2.4× up to 128 tokens
# and 3.9× at 256 (medians of the rounds). Step-by-step decoding of this small model is not
# limited by arithmetic at all: each step runs the same small operations, about 250 of them with
# the cache and 280 without (the count printed above), whether they cover one position or
# sixteen, so the fixed cost per operation dominates, and the cache cannot remove it. The stored
# table's cached column shows it: 6.3 to 7.2 ms per token at every length (medians), within
# 15 % of each other while $n$ grows sixteenfold, though the FLOPs per token are tiny. Only as the prefix
# grows does the uncached loop's quadratic work show. On a larger model the per-call overhead
# matters less, but a cached step is still not bound by FLOPs: it does little arithmetic on a
# lot of memory (every weight, and the whole cache, read to produce one token per sequence), so
# it is bound by memory bandwidth. Either way the FLOP ratio is what the cache saves in
# arithmetic, not a speed-up to expect.
#
# How far to trust such a table? The times are wall-clock times, and on a machine shared with
# other jobs a slow spell inflates whatever is being timed. The stored table was timed on two
# cores shared with other jobs, and its rounds disagree: the cached time per token at 32 tokens
# went from 5.62 to 8.88 ms, one round 58 % slower than another, and the speed-up at 32 tokens
# from 1.2× to 1.9× (the ranges in the table). The short timings are the most exposed, since a few
# milliseconds spent waiting for a core are a large share of them. That is why the check
# asserts only the speed-up at the longest output, in CPU time and with a wide margin (the
# stored run: 4.2×, rounds 4.0× to 4.2×), and leaves the claim about the work to the FLOP count
# of check 3.
#
# **The KV cache turns each step from a pass over the whole prefix into a pass over one
# position: the same tokens, about $n/2$ times less arithmetic.**
#
# ## Beam search
#
# Greedy decoding commits to each token for good. A token that looks best now can lead into a
# continuation that is poor overall, while the second-best token would have led to a better
# sequence. **Beam search** keeps the $k$ best prefixes (the *beam*) instead of one. At each step
# it scores every one-token extension of every prefix by its total log-probability,
#
# $$s(y_{\le t}) = \sum_{i=1}^{t} \log p\bigl(y_i \mid y_{<i},\, x\bigr),$$
#
# and keeps the $k$ best of the $k V$ candidates. A candidate that ends with `EOS` leaves the beam
# as a finished *hypothesis*. With $k = 1$ this is greedy decoding exactly.
#
# Summing log-probabilities favours short outputs, since every extra token adds a negative term.
# Finished hypotheses of different lengths are therefore compared after a **length
# normalisation**; we use Wu et al. (2016, Google's NMT system, eq. 14):
#
# $$\mathrm{score}(y) = \frac{s(y)}{\mathrm{lp}(y)},\qquad
# \mathrm{lp}(y) = \left(\frac{5 + |y|}{6}\right)^{\alpha},$$
#
# where $|y|$ counts the generated tokens including `EOS`. $\alpha = 0$ switches it off;
# Vaswani et al. (2017, §6.1) used a beam of $k = 4$ and $\alpha = 0.6$. The `length_penalty`
# argument below defaults to their $0.6$; `beam_size` has no default: you choose $k$.
#
# **Early stopping.** A source is done once $k$ hypotheses have finished and the best live beam,
# scored as if it ended now, does not beat the $k$-th best of them. For $\alpha = 0$ that is
# exact: a beam's log-probability can only fall as it grows, so nothing better can come. For
# $\alpha > 0$ it is the usual heuristic (Hugging Face's default rule). At `max_new_tokens` the
# live beams are finished as they are.
#
# The bookkeeping runs all beams of all sources as one batch of $B k$ rows through the cached
# decoder (`model.decode` with a `KVCache`, as above). When beam $j$ of the next step continues
# beam $i$ of this one, its cached keys and values must be beam $i$'s. So the cache gets one more
# method at each level, `reorder(index)`: an attention's cache keeps rows `index` of its keys and
# values (of its whole buffer, spare room included), and the decoder's cache hands the index to
# every attention.

# %%
#| export
@add_to_class(AttentionCache)
def reorder(self, index: Tensor) -> None:
    """Keep rows `index` (B_new,) of the batch: in beam search, each new beam's parent."""
    if self.keys is None:
        return
    if self._buffers is not None:
        self._buffers = tuple(buffer.index_select(0, index) for buffer in self._buffers)
        self.keys, self.values = (buffer[:, :, : self.length] for buffer in self._buffers)
    else:
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)


@add_to_class(KVCache)
def reorder(self, index: Tensor) -> None:
    """Keep rows `index` of the batch in every block (beam search: each beam's parent)."""
    for layer in self.layers:
        layer.self_attn.reorder(index)
        layer.cross_attn.reorder(index)


# %% [markdown]
# **Check.** On the cache of 24 positions grown in chunks above, `reorder` picks rows (one of
# them twice), keeps every position, and keeps the spare room; a frozen cross-attention cache is
# reordered too.

# %%
grown.reorder(torch.tensor([1, 1, 0]))
assert torch.equal(grown.keys, K_all[[1, 1, 0]]) and torch.equal(grown.values, V_all[[1, 1, 0]])
assert grown.length == 24 and grown.capacity == 48
fixed.reorder(torch.tensor([1, 0]))
assert torch.equal(fixed.keys, chunks[0][[1, 0]])


# %%
#| export
def length_penalty_wu(length: int, alpha: float) -> float:
    """Wu et al. (2016)'s length penalty lp = ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


Hypothesis = tuple[float, float, list[int]]  # (normalised score, total log-prob, ids from BOS)


def _advance_beams(
    candidates: Tensor,  # (B, k, V): total log-prob of every one-token extension of every beam
    tokens: Tensor,  # (B * k, t + 1): the beams so far, BOS first
    finished: list[list[Hypothesis]],
    done: list[bool],
    alpha: float,
    last_step: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Set candidates that end with EOS aside as hypotheses; keep the k best others as beams."""
    B, k, V = candidates.shape
    # 2k candidates suffice: even if k of them end with EOS, k others remain to go on with.
    top_scores, top_index = candidates.view(B, k * V).topk(min(2 * k, k * V), dim=-1)  # (B, 2k)
    parent = list(range(B * k))  # the row of `tokens` that each new beam extends
    token = [PAD] * (B * k)
    scores = [[-math.inf] * k for _ in range(B)]
    lp = length_penalty_wu(tokens.size(1), alpha)  # generated tokens, counting the new one
    beams = tokens.tolist()
    for b in range(B):
        if done[b]:
            continue
        live = 0
        for rank, (score, index) in enumerate(
            zip(top_scores[b].tolist(), top_index[b].tolist(), strict=True)
        ):
            if score == -math.inf or live == k:
                break
            row, new = b * k + index // V, index % V
            if new == EOS:
                if rank < k:  # an ending counts only while it is among the k best
                    finished[b].append((score / lp, score, [*beams[row], EOS]))
                continue
            parent[b * k + live], token[b * k + live], scores[b][live] = row, new, score
            live += 1
        if last_step:  # out of room: the live beams end here, without EOS
            for j in range(live):
                ids = [*beams[parent[b * k + j]], token[b * k + j]]
                finished[b].append((scores[b][j] / lp, scores[b][j], ids))
        if last_step or live == 0:
            done[b] = True
        elif len(finished[b]) >= k:  # early stopping, once no live beam can catch up
            kth_best = sorted(hyp[0] for hyp in finished[b])[-k]
            # Exact for alpha = 0 (a log-prob only falls as a beam grows); a heuristic otherwise.
            done[b] = scores[b][0] / lp <= kth_best
    device = tokens.device
    return (
        torch.tensor(parent, device=device),
        torch.tensor(token, device=device),
        torch.tensor(scores, device=device),
    )


def _best_hypotheses(finished: list[list[Hypothesis]], device) -> Generation:
    """Each source's best hypothesis by normalised score: ids (B, T) PAD-padded, log p (B,)."""
    best = [max(hypotheses, key=lambda hyp: hyp[0]) for hypotheses in finished]
    length = max(len(ids) for _, _, ids in best)
    tokens = torch.full((len(best), length), PAD, dtype=torch.long)
    for b, (_, _, ids) in enumerate(best):
        tokens[b, : len(ids)] = torch.tensor(ids)
    log_probs = torch.tensor([log_p for _, log_p, _ in best], device=device)  # before lp
    return Generation(tokens=tokens.to(device), log_probs=log_probs)


# %% [markdown]
# The search itself is short: encode once and give each source $k$ rows, then per step one
# cached decoder call for all beams, the selection above, and the reordering. It returns a
# `Generation` like greedy decoding: the best hypothesis of each source and its total
# log-probability, before the length penalty. Unlike greedy decoding and sampling, beam search
# caches by default (`use_cache=True`); with `use_cache=False` each step runs the decoder over
# every beam's whole prefix instead (`next_token_logits` does either), and the beams are the
# same, only slower to find.

# %%
#| export
@torch.no_grad()
def beam_search(
    model: nn.Module,
    src: Tensor,
    *,
    max_new_tokens: int,
    src_mask: Tensor | None = None,
    use_cache: bool = True,
    cache: DecoderCache | None = None,
    beam_size: int,
    length_penalty: float = 0.6,
) -> Generation:
    """Best of beam_size hypotheses by log p / lp (Wu et al., 2016); log_probs: log p, before lp.

    The B * beam_size beams run as one batch; a given `cache` (empty) must have `reorder`.
    """
    cache = check_generation_inputs(
        model, src, max_new_tokens=max_new_tokens, src_mask=src_mask, use_cache=use_cache, cache=cache
    )
    if cache is not None and not callable(getattr(cache, "reorder", None)):
        raise TypeError(f"beam search needs a cache with reorder(index), got {type(cache).__name__}")
    k = check_int("beam_size", beam_size, minimum=1)
    length_penalty = check_float("length_penalty", length_penalty, low=0.0)
    B = src.size(0)
    with eval_mode(model):
        # 1) Encode once; each source gets k rows, one per beam: (B, ...) -> (B * k, ...).
        enc_out = model.encode(src, src_mask=src_mask).repeat_interleave(k, dim=0)
        cross_mask = None
        if src_mask is not None:
            cross_mask = src_mask.expand(B, 1, 1, src.size(1)).repeat_interleave(k, dim=0)
        tokens = torch.full((B * k, 1), BOS, dtype=torch.long, device=src.device)
        scores = torch.full((B, k), -math.inf, device=src.device)
        scores[:, 0] = 0.0  # one live beam to start with: k copies would fill the beam with twins
        finished: list[list[Hypothesis]] = [[] for _ in range(B)]
        done = [False] * B
        with validated():  # encode checked the ids; the loop's own tokens need no checks
            for step in range(max_new_tokens):
                # 2) One decoder step for all B * k beams (cached: the newest token of each).
                logits = next_token_logits(model, tokens, enc_out, cross_mask, cache)  # (B*k, V)
                log_probs = F.log_softmax(logits.float(), dim=-1).view(B, k, -1)  # (B, k, V)
                # 3) Score every extension by its total log-prob and select.
                candidates = scores[:, :, None] + log_probs  # (B, k, 1) + (B, k, V)
                last_step = step == max_new_tokens - 1
                parent, token, scores = _advance_beams(
                    candidates, tokens, finished, done, length_penalty, last_step
                )
                if all(done):
                    break
                # 4) Each new beam takes over its parent's tokens and cached keys and values.
                if cache is not None:
                    cache.reorder(parent)
                tokens = torch.cat([tokens[parent], token[:, None]], dim=1)  # (B * k, t + 2)
    return _best_hypotheses(finished, src.device)


# %% [markdown]
# To compare decoders we need the log-probability a model gives *any* output, whoever produced
# it. One teacher-forced forward pass gives it, independently of the cache and of the search:

# %%
#| export
@torch.no_grad()
def sequence_log_prob(
    model: nn.Module, src: Tensor, tokens: Tensor, src_mask: Tensor | None = None
) -> Tensor:
    """Total log-probability (B,) of decoded tokens (BOS first; anything after EOS ignored)."""
    if tokens.dim() != 2 or tokens.size(0) != src.size(0) or tokens.size(1) < 2:
        raise ValueError(
            f"tokens must be (B, T) with B={src.size(0)} as in src and T >= 2 (BOS and one "
            f"more), got {tuple(tokens.shape)}"
        )
    with eval_mode(model):
        T = tokens.size(1) - 1
        tgt_mask = causal_mask(T, device=tokens.device)
        logits = model(src, tokens[:, :-1], src_mask=src_mask, tgt_mask=tgt_mask)  # (B, T, V)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        target = tokens[:, 1:]  # (B, T): the token each position predicts
        picked = log_probs.gather(-1, target[..., None])[..., 0]  # (B, T)
        is_eos = (target == EOS).long()
        after_eos = (is_eos.cumsum(dim=-1) - is_eos) > 0  # (B, T): the padding after an EOS
        return picked.masked_fill(after_eos, 0.0).sum(dim=-1)


# %% [markdown]
# **Check.** With one beam, beam search is greedy decoding: the same tokens, and a score equal to
# the independent `sequence_log_prob` and to the log-probability greedy decoding added up as it
# went (facts). Here and below, beam search gets this notebook's `KVCache` (`cache=KVCache()`),
# so its `reorder` is what the checks test. On the trained model a wider beam finds nothing
# better: the reversal is near certain at every step, so beam and greedy agree (in the stored
# run on all 256 sources; the bound is the study's).

# %%
beam_1 = beam_search(model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask, beam_size=1,
                     cache=KVCache())
beam_1, log_p_1 = beam_1.tokens, beam_1.log_probs
assert torch.equal(beam_1, decoded)
assert_close(log_p_1, sequence_log_prob(model, src, decoded, src_mask), atol=1e-4, rtol=1e-4)
assert_close(greedy.log_probs, log_p_1, atol=1e-4, rtol=1e-4)  # greedy's own running sum

beam_4 = beam_search(model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask, beam_size=4,
                     cache=KVCache())
beam_4, log_p_4 = beam_4.tokens, beam_4.log_probs
same = ~outputs_differ(beam_4, decoded)  # (B,)
assert int(same.sum()) >= 250 and log_p_4.mean() >= log_p_1.mean() - 1e-4

# %% tags=["nbval-ignore-output"]
print(f"trained model: beam of 4 equals greedy on {int(same.sum())}/{len(same)} sources; "
      f"mean log p {log_p_1.mean().item():.4f} (greedy) vs {log_p_4.mean().item():.4f} (beam)")

# %% [markdown]
# Where the model is unsure, the beam earns its keep. A model early in training is a good
# example: it has the rough shape of the task but spreads its probability. We take notebook
# 11's recipe and stop after only 100 steps (checkpointed like the full model, so only the
# first run trains it: about 8 seconds at the roughly 80 ms a step that notebook 11 quotes for a
# quiet machine, several times that on a busy one).

# %% tags=["nbval-ignore-output"]
early_model = get_reversal_model(checkpoint="checkpoints/reversal_100_steps.pt", device=device,
                                 progress=True, steps=100)

# %%
greedy_early = greedy_decode(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask)
greedy_early = greedy_early.tokens
log_p_greedy = sequence_log_prob(early_model, src, greedy_early, src_mask)
beam_sizes = [1, 2, 4, 8]
beam_out, beam_log_p, beam_match = {}, {}, {}
for k in beam_sizes:
    beam = beam_search(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                       beam_size=k, length_penalty=0.0, cache=KVCache())  # this notebook's
    beam_out[k], beam_log_p[k] = beam.tokens, beam.log_probs
    beam_match[k] = reversed_correctly(beam_out[k])
better = {k: int((beam_log_p[k] > log_p_greedy + 1e-4).sum()) for k in beam_sizes}
worse = {k: int((beam_log_p[k] < log_p_greedy - 1e-4).sum()) for k in beam_sizes}

# %% tags=["nbval-ignore-output"]
for k in beam_sizes:
    print(f"beam {k}: mean log p {beam_log_p[k].mean().item():7.4f}, better than greedy on "
          f"{better[k]:3d}/256, worse on {worse[k]}, exact match {int(beam_match[k].sum())}/256")

# %% [markdown]
# **Check.** Each beam's score is the log-probability of its output, recomputed independently
# (this is the check that tests `KVCache.reorder`: a beam that kept another beam's keys and
# values would score its tokens with the wrong prefix; shown failing below); beam 1 is greedy on
# this model too (facts). With $\alpha = 0$ (pure log-probability), every
# wider beam finds a more likely output than greedy on 20 or more sources and a less likely one
# on at most 5, and is better on average (the study's four seeds: 38 to 54 sources better, none
# worse). And without the cache (`use_cache=False`) the beam of 4 finds the same outputs with
# the same scores, up to rounding (on a CPU every output; on a GPU, whose kernels round the two
# paths differently, near-ties may flip some: the check allows up to a tenth of the sources, 25).
# Worse is possible: beam search is not exhaustive, and the greedy path can fall out of a beam
# when $k$ other prefixes look better at some step. (With $\alpha = 0$, as here, the early-stopping
# rule above at least never gives up while a live beam could still win; for $\alpha > 0$ it is a
# heuristic and may stop too early.)

# %%
for k in beam_sizes:
    assert_close(beam_log_p[k], sequence_log_prob(early_model, src, beam_out[k], src_mask),
                 atol=1e-4, rtol=1e-4)
assert torch.equal(beam_out[1], greedy_early)
assert_close(beam_log_p[1], log_p_greedy, atol=1e-4, rtol=1e-4)
for k in beam_sizes[1:]:
    assert better[k] >= 20 and worse[k] <= 5, k
    assert beam_log_p[k].mean() > log_p_greedy.mean()
uncached_4 = beam_search(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                         beam_size=4, length_penalty=0.0, use_cache=False)  # the whole prefix
beam_differ = outputs_differ(uncached_4.tokens, beam_out[4])  # (B,)
if device.type == "cpu":
    assert not beam_differ.any()
else:  # other kernels for the two paths: a near-tie may flip a row on a GPU
    assert int(beam_differ.sum()) <= 25  # a tenth of the sources at most
assert_close(uncached_4.log_probs[~beam_differ], beam_log_p[4][~beam_differ], atol=1e-4, rtol=1e-4)


# %% [markdown]
# The first assert fails on a broken cache. A `KVCache` whose `reorder` does nothing leaves every
# beam with the keys and values of the beam that sat in its row before, whatever its parent (in
# the stored run the scores then miss the recomputed log-probabilities on 60 of the 256 sources,
# by up to 22.8 nats, where the check allows $10^{-4}$):

# %% tags=["nbval-ignore-output"]
class KVCacheWithoutReorder(KVCache):
    """A deliberately broken cache: every beam keeps its row's keys and values."""

    def reorder(self, index: torch.Tensor) -> None:
        pass


broken = beam_search(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                     beam_size=4, length_penalty=0.0, cache=KVCacheWithoutReorder())
broken_gap = (broken.log_probs - sequence_log_prob(early_model, src, broken.tokens, src_mask)).abs()
print(f"without reorder: score and recomputed log p differ on {int((broken_gap > 1e-4).sum())} of "
      f"256 sources, by up to {broken_gap.max().item():.1f} nats")
assert broken_gap.max() > 1e-2  # the check above would fail (its tolerance: 1e-4)


# %% [markdown]
# **A worked trace.** How `_advance_beams` decides is easiest to see on one source, with $k = 2$
# and $\alpha = 0$. Below, beam search is written out plainly for a single source (no batch, no
# cache: each step runs the decoder over every live beam's whole prefix), and it prints every
# candidate it looks at. At each step it scores every one-token extension of every live beam by
# its total log-probability, sorts them, and walks down the best $2k$: a candidate that ends with
# `EOS` becomes a finished hypothesis if it ranks among the best $k$ (and is dropped otherwise);
# any other candidate becomes a live beam, until there are $k$ of them. The search ends when $k$
# hypotheses have finished and the best live beam scores no better than the $k$-th of them, or
# when it runs out of room. The source is the first one on which a beam of 2 beats greedy.

# %%
@torch.no_grad()
def beam_trace(m: Transformer, source: torch.Tensor, source_mask: torch.Tensor, k: int = 2,
               max_new_tokens: int = MAX_LEN + 1) -> tuple[float, list[int]]:
    """Beam search (alpha = 0) for one source (1, S), written out plainly, printing each step."""
    beams = [(0.0, [BOS])]  # live beams: (total log p, tokens from BOS)
    finished = []  # hypotheses: (total log p, tokens ending with EOS, or cut at the last step)
    for step in range(1, max_new_tokens + 1):
        prefixes = torch.tensor([ids for _, ids in beams], device=source.device)  # (live, t)
        logits = m(source.expand(len(beams), -1), prefixes, src_mask=source_mask,
                   tgt_mask=causal_mask(prefixes.size(1), device=source.device))[:, -1]
        log_p = F.log_softmax(logits.float(), dim=-1).cpu()  # (live, V)
        candidates = sorted(((score + log_p[i, v].item(), [*ids, v])
                             for i, (score, ids) in enumerate(beams) for v in range(VOCAB)),
                            key=lambda candidate: -candidate[0])[: 2 * k]
        print(f"step {step}: {len(beams)} live beam(s), best {2 * k} of {len(beams) * VOCAB} "
              "candidates:")
        beams = []
        for rank, (score, ids) in enumerate(candidates):
            if len(beams) == k:
                verdict = "not needed: the beam is full"
            elif ids[-1] == EOS:
                verdict = "finished" if rank < k else "ends with EOS outside the best k: dropped"
                if rank < k:
                    finished.append((score, ids))
            else:
                beams.append((score, ids))
                verdict = f"live beam {len(beams)}"
            print(f"   {score:8.3f}  {show(torch.tensor(ids[1:])):26s} {verdict}")
        if step == max_new_tokens:  # out of room: the live beams end as they are
            finished += beams
            break
        kth_best = sorted(score for score, _ in finished)[-k] if len(finished) >= k else -math.inf
        if not beams or beams[0][0] <= kth_best:
            print(f"stop: {len(finished)} finished, and no live beam can beat the k-th of them")
            break
    score, ids = max(finished)
    print(f"best: {show(torch.tensor(ids[1:]))}  log p {score:.3f}")
    return score, ids


traced = int((beam_log_p[2] > log_p_greedy + 1e-4).nonzero()[0])  # beam 2 beats greedy here

# %% tags=["nbval-ignore-output"]
print(f"source {show(src[traced])}; greedy gives {show(greedy_early[traced, 1:])}, "
      f"log p {log_p_greedy[traced].item():.3f}\n")
trace_score, trace_ids = beam_trace(early_model, src[traced : traced + 1],
                                    src_mask[traced : traced + 1])

# %% [markdown]
# **Check.** The plain version finds the same output, with the same score, as the batched,
# cached `beam_search` with `beam_size=2`.

# %%
found = beam_out[2][traced]
assert trace_ids == found[: len(trace_ids)].tolist() and (found[len(trace_ids) :] == PAD).all()
assert math.isclose(trace_score, beam_log_p[2][traced].item(), abs_tol=1e-4)

# %% [markdown]
# Read the trace step by step. At step 1 there is a single live beam (`BOS`), so the candidates
# are its 12 continuations, and the best two become the beams. From then on each step looks at
# $2 \times 12 = 24$ candidates, the continuations of both beams, and keeps the best two that do
# not end with `EOS`; the rest, even good ones, are not needed. In the stored run (source
# 8 10 9 3 11 11 3) beam 1 follows greedy's path, 3 11 11 9 8 10, at every step, while beam 2
# changes from one runner-up to the next; from step 5 on it holds 3 11 11 9 10, with the last two
# symbols in the other order. At step 7 the best continuation of each beam ends with `EOS` and
# both rank in the top two, so both finish: beam 2's output scores $-2.69$, greedy's $-2.85$. With
# two hypotheses finished and the best live beam at $-3.74$, a score that can only fall as the
# beam grows, the search stops and returns the more likely one. Both are wrong (the reversal is
# 3 11 11 3 9 10 8): beam search finds what the *model* rates likely, and this half-trained model
# is wrong about the source either way.
#
# **Picture.** Each source's total log-probability under greedy decoding against beam search of
# width 4 (points above the diagonal: the beam found a more likely output); then what wider beams
# do on average: how much more likely their outputs are than greedy's (a mean gain in nats, small
# against the spread of the first panel, most sources gaining nothing), and how many of them are
# exact reversals.

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), layout="constrained")
ax = axes[0]
lo = min(log_p_greedy.min().item(), beam_log_p[4].min().item()) - 0.2
ax.plot([lo, 0], [lo, 0], color="grey", lw=1, ls="--", label="equal")
beam_better = beam_log_p[4] > log_p_greedy + 1e-4
ax.scatter(log_p_greedy[~beam_better].cpu(), beam_log_p[4][~beam_better].cpu(), s=14,
           color="#7f7f7f", alpha=0.6, label="same output (or no better)")
ax.scatter(log_p_greedy[beam_better].cpu(), beam_log_p[4][beam_better].cpu(), s=22,
           color=COLORS["accent"], label="beam found a more likely output")
ax.set_xlabel("greedy: total log-probability (nats)")
ax.set_ylabel("beam of 4: total log-probability (nats)")
ax.set_title("Per source, after 100 training steps")
ax.legend(fontsize=8)
gains = [(beam_log_p[k] - log_p_greedy).mean().item() for k in beam_sizes]  # nats, >= 0
for ax, values, label, ylim, fmt in (
    (axes[1], gains, "mean gain in total log-probability\nover greedy (nats)",
     (0, max(0.1, 1.3 * max(gains))), ".3f"),
    (axes[2], [int(beam_match[k].sum()) for k in beam_sizes],
     "exact match (of 256 sources)", (0, 256), "d"),
):
    ax.plot(beam_sizes, values, marker="o", color="#404040")
    for k, value in zip(beam_sizes, values, strict=True):
        ax.annotate(f"{value:{fmt}}".replace("-0.000", "0.000"), (k, value), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(beam_sizes, [str(k) for k in beam_sizes])
    ax.set_xlabel("beam size k (1 = greedy)")
    ax.set_ylabel(label)
    ax.set_ylim(*ylim)
axes[1].set_title("Wider beams: more likely outputs, on average")
axes[2].set_title("… and a few more exact reversals")
save_figure(fig, "generation_beam_search")
plt.show()

# %% [markdown]
# ### Search errors and model errors: an exhaustive baseline
#
# A wider beam finds outputs the model rates as more likely than greedy's, but is it the *most*
# likely one? And when an output is wrong, whose fault is it: the search's, which missed a better
# output, or the model's, whose best output is wrong? Only the true $\arg\max_y p(y \mid x)$ can
# tell, and for short sources we can afford it. For each of the 45 test sources of length 3 (all
# of them training sequences too, as counted at the start, 35 of them in the early model's first
# 100 steps: this measures the search, not generalisation) we score every output of **0 to 3
# symbols followed by `EOS`**: $1 + 9 + 81 + 729 = 820$ outputs. One teacher-forced pass over
# the 729 decoder inputs `BOS` $y_1 y_2 y_3$ gives them all, since
# the distribution at position $j$ is $p(\cdot \mid y_{\le j}, x)$: it holds
# $p(\texttt{EOS} \mid y_{\le j}, x)$, which ends an output of $j$ symbols, and
# $p(y_{j+1} \mid y_{\le j}, x)$, which extends it. The same pass gives the log-probability of
# every prefix that leaves the enumerated set, a fourth token other than `EOS` or a `PAD` or
# `BOS` among the first four, and the best of those bounds every output not enumerated, longer
# ones and ones cut off without `EOS` included (a log-probability only falls as an output grows).
# When the best enumerated output beats that bound, it is the model's best output of *any*
# length: we call the source **certified**. Then, per source and per model:
#
# - **model error**: the model's best output is not the reversal (no search can fix that);
# - **search error** of a strategy: it returns an output less likely than the model's best.
#
# The strategies are greedy decoding and beams of 2 and 4 with $\alpha = 0$ (each aims at the
# largest raw log-probability), with `max_new_tokens` $= 9$ as above.

# %%
symbols = torch.arange(3, VOCAB)  # the 9 symbol ids
outputs_3 = torch.cartesian_prod(symbols, symbols, symbols).to(device)  # (729, 3): every y1 y2 y3
enumerated_inputs = F.pad(outputs_3, (1, 0), value=BOS)  # (729, 4): BOS y1 y2 y3


@torch.no_grad()
def enumerate_outputs(m: Transformer, source: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Log p of every output of j <= 3 symbols then EOS, (729, 4): row y1 y2 y3, column j (an
    output of j < 3 symbols fills the rows that start with it); and the best log p of a prefix
    that leaves that set, a bound on every other output. source (1, S), mask (1, 1, 1, S)."""
    with eval_mode(m):
        enc_out = m.encode(source, src_mask=mask).expand(729, -1, -1)  # encode once
        dec_out = m.decode(enumerated_inputs, enc_out, self_mask=causal_mask(4, device=device),
                           cross_mask=mask)  # (729, 4, d_model)
        log_p = F.log_softmax(m.out_proj(dec_out).float(), dim=-1)  # (729, 4, V)
    symbol_log_p = log_p[:, :3].gather(-1, outputs_3[..., None])[..., 0]  # (729, 3)
    prefix = F.pad(symbol_log_p.cumsum(dim=1), (1, 0))  # (729, 4): log p(y_1..y_j), j = 0..3
    ends = prefix + log_p[..., EOS]  # (729, 4): y_1..y_j, then EOS
    fourth = prefix[:, 3:] + torch.cat([log_p[:, 3, :EOS], log_p[:, 3, EOS + 1 :]], dim=-1)
    strays = prefix + log_p[..., [PAD, BOS]].amax(dim=-1)  # a PAD or BOS after y_1..y_j
    return ends, max(fourth.max().item(), strays.max().item())


def table_entry(tokens: torch.Tensor) -> tuple[int, int] | None:
    """Where decoded tokens (BOS first) sit in the table: (row, j), or None if not enumerated."""
    ids = tokens.tolist()
    body = ids[1 : ids.index(EOS)] if EOS in ids else ids[1:]
    if EOS not in ids or len(body) > 3 or any(y < 3 for y in body):
        return None
    row = sum((y - 3) * 9 ** (2 - i) for i, y in enumerate(body))  # the first row starting so
    return row, len(body)


three = (lengths == 3).nonzero()[:, 0].tolist()  # the test sources of length 3
strategies = ["greedy", "beam 2", "beam 4"]

# %% tags=["nbval-ignore-output"]
errors = {}  # model -> counts: certified sources, model errors, each strategy's search errors
lowest_best = {}  # model -> the smallest probability of the best output over the sources
with tqdm(total=2 * len(three), desc="exhaustive search") as bar:
    for name, m in (("trained", model), ("100 steps", early_model)):
        found = {"greedy": greedy_decode(m, src[three], max_new_tokens=MAX_LEN + 1,
                                         src_mask=src_mask[three])}
        for k in (2, 4):
            found[f"beam {k}"] = beam_search(m, src[three], max_new_tokens=MAX_LEN + 1,
                                             src_mask=src_mask[three], beam_size=k,
                                             length_penalty=0.0, cache=KVCache())
        counts = {"certified": 0, "model": 0, **{s: 0 for s in strategies}}
        lowest_best[name] = 1.0
        for i, b in enumerate(three):
            ends, rest = enumerate_outputs(m, src[b : b + 1], src_mask[b : b + 1])
            best = ends.max().item()
            lowest_best[name] = min(lowest_best[name], math.exp(best))
            row, j = divmod(int(ends.argmax()), 4)
            counts["certified"] += best > rest
            counts["model"] += not (j == 3 and torch.equal(outputs_3[row], src[b, :3].flip(0)))
            for s in strategies:
                score = found[s].log_probs[i].item()  # the strategy's own sum, its own pass
                assert score <= max(best, rest) + 1e-4, (name, s, b)  # nothing beats the search
                entry = table_entry(found[s].tokens[i])
                if entry is None:  # not enumerated: at most `rest`
                    counts[s] += score < best
                else:  # enumerated: the table must agree with the strategy's own sum
                    assert abs(ends[entry].item() - score) < 1e-4, (name, s, b)
                    counts[s] += ends[entry].item() < best  # one pass: compared exactly
            bar.update()
        errors[name] = counts
print(f"{'model':10s} {'sources':>7s} {'certified':>9s} {'model errors':>12s}   search errors: "
      + "  ".join(strategies))
for name, counts in errors.items():
    print(f"{name:10s} {len(three):7d} {counts['certified']:9d} {counts['model']:12d}   "
          f"{'':15s}" + "  ".join(f"{counts[s]:{len(s)}d}" for s in strategies))
print("smallest probability of a source's best output: "
      + ", ".join(f"{name} {p:.3f}" for name, p in lowest_best.items()))

# %% [markdown]
# **Check.** Two independent computations must agree (asserted in the loop): each strategy's own
# total log-probability, summed as it decoded, is never above the exhaustive best (up to
# rounding, $10^{-4}$), and where its output is among the enumerated ones it equals the table's
# entry for it (a wrong index or an off-by-one in the enumeration would break both). The trained
# model must be certified on every source, with at most 2 model errors and 2 search errors per
# strategy. These bounds are not all from the seed study, which measured greedy exact match
# only (every seed reversed 255 or 256 of the 256 test sources). A source whose most likely
# output is wrong is decoded wrongly unless greedy misses that output, so the study bounds the
# model errors (one at most) only where greedy makes no search error; certification and search
# errors it did not measure. Those bounds rest on the stored run (all 45 certified, no error of
# either kind) and, for certification, on a margin: a source is certified whenever its best
# output gets more than half the probability, since every prefix that leaves the table holds
# only outputs outside it, less than the other half; in the stored run the trained model gives
# each best output more than 0.99 (0.999, the last line printed above). The early model's
# counts are a finding of this run, so only one fact that held in the study is asserted for it
# (there, no beam was less likely than greedy on any source): a beam of 4 makes no more search
# errors than greedy decoding.

# %%
trained_errors, early_errors = errors["trained"], errors["100 steps"]
assert trained_errors["certified"] == len(three) and trained_errors["model"] <= 2
assert all(trained_errors[s] <= 2 for s in strategies)
assert early_errors["beam 4"] <= early_errors["greedy"]

# %% [markdown]
# In the stored run the early model is wrong *as a model* on 8 of the 45 sources: its most likely
# output (certified on all 45) is not the reversal, and no search can fix that. Greedy decoding
# misses the model's best output once; a beam of 2 or 4 never does. So on these short sources
# beam search closes the search gap, and what is left is the model's own error. (Longer sources
# leave more room for search errors, and there exhaustive search is out of reach: $9^L$ outputs.)
#
# ### The length penalty, and the search errors it cannot fix
#
# **In short:** on nearly flat (untrained) models, many outputs run to the cap because of the
# search, not the penalty: an ending is set aside only while it ranks among the $k$ best
# candidates by raw log-probability, whatever $\alpha$. The penalty only chooses among the
# endings set aside, where a large $\alpha$ can make a long one win. On a first pass, read this
# and go on to "On the trained model" below: the rest is the evidence, on eight untrained models.
#
# The bias towards short outputs that length normalisation corrects shows on an *untrained*
# model, whose next-token distributions are nearly flat: every token, `EOS` included, has a
# probability not far from $1/V$ ($\log V \approx 2.5$ nats). We take eight of them (seeds 1 to
# 8, two layers of width 64) and decode the first 64 test sources with beams of 4 and at most 20
# new tokens, for $\alpha = 0$, $0.6$, $1$ and $2$. Every extra token costs log-probability, so
# in raw terms a short output is hard to beat; dividing by $\mathrm{lp}$ removes part of the cost
# of a long one, and $\alpha$ sets how much.
#
# Two different things set the lengths that come out, and only one of them is the penalty:
#
# - **The penalty** acts on *finished* hypotheses only: it decides which of them wins (and when
#   the search may stop early). It can make a long hypothesis beat a short one; it cannot bring
#   back an ending that was never set aside.
# - **The search** decides which endings are set aside at all. `_advance_beams` ranks the
#   candidates of a step by raw log-probability, whatever $\alpha$, and an `EOS` candidate
#   becomes a hypothesis only if it ranks among the $k$ best. Where `EOS` is not among the $k$
#   most likely *first* tokens, the empty output (`EOS` at once) is lost for good; if no later
#   `EOS` makes the $k$ best either, the beams run to the cap and are returned as they are,
#   however unlikely. That is a search error, at any $\alpha$.
#
# To tell the two apart, the cell also records, for each source, the log-probability of stopping
# at once and the place of `EOS` among the most likely first tokens (1 = the most likely).

# %%
length_alphas, length_seeds, length_k = (0.0, 0.6, 1.0, 2.0), range(1, 9), 4
few_src, few_mask = src[:64], src_mask[:64]


def length_study(seed: int) -> dict:
    """An untrained model (seed): the log p of stopping at once and the place of EOS among the
    first tokens, (64,) each; per alpha, the beams' (log p, length with EOS, ended with EOS)."""
    torch.manual_seed(seed)
    m = Transformer(VOCAB, VOCAB, d_model=64, num_heads=4, d_ff=128).to(device)
    with torch.no_grad(), eval_mode(m):
        bos = torch.full((len(few_src), 1), BOS, device=device)
        first = next_token_logits(m, bos, m.encode(few_src, src_mask=few_mask), few_mask)
        first = F.log_softmax(first.float(), dim=-1)  # (64, V): the first token
    study = {"eos_first": first[:, EOS],  # (64,) log p of the empty output
             "eos_place": (first > first[:, EOS : EOS + 1]).sum(dim=1) + 1}  # (64,) 1 = top
    for alpha in length_alphas:
        out = beam_search(m, few_src, max_new_tokens=20, src_mask=few_mask, beam_size=length_k,
                          length_penalty=alpha, cache=KVCache())
        is_eos = (out.tokens == EOS).int()
        ended = is_eos.any(1)  # (64,): False where the output was cut off at the cap
        length = torch.where(ended, is_eos.argmax(1), out.tokens.size(1) - 1)  # EOS included
        study[alpha] = out.log_probs, length, ended
    return study


length_studies = {seed: length_study(seed) for seed in length_seeds}
length_spread = {seed: {alpha: (int((study[alpha][1] == 1).sum()),  # stop at once
                                int((study[alpha][2] & (study[alpha][1] > 1)).sum()),  # later
                                int((~study[alpha][2]).sum()))  # cut off at 20
                        for alpha in length_alphas} for seed, study in length_studies.items()}
seed_1 = length_studies[1]  # seed 1, looked at closely
eos_set_aside = seed_1["eos_place"] <= length_k  # (64,): the empty output became a hypothesis
log_p_2, length_2, ended_2 = seed_1[2.0]
by_penalty = ~ended_2 & eos_set_aside  # cut off at alpha = 2, though EOS at once was set aside
lp_20 = length_penalty_wu(20, 2.0)

# %% tags=["nbval-ignore-output"]
print("seed 1:")
for alpha in length_alphas:
    n_at_once, n_later, n_cut_off = length_spread[1][alpha]
    print(f"  alpha = {alpha}: mean length {seed_1[alpha][1].float().mean().item():5.2f} tokens; "
          f"{n_at_once:2d} stop at once, {n_later:2d} later, {n_cut_off:2d} cut off at 20")
print(f"  EOS among the {length_k} most likely first tokens on {int(eos_set_aside.sum())} of 64 "
      f"sources; stopping at once has log p {seed_1['eos_first'].min():.2f} to "
      f"{seed_1['eos_first'].max():.2f} (mean {seed_1['eos_first'].mean():.2f})")
log_p_0, length_0, ended_0 = seed_1[0.0]
for i in (length_0 > 1).nonzero()[:, 0].tolist():
    print(f"  alpha = 0, source {i:2d}: {int(length_0[i]):2d} tokens"
          f"{'' if ended_0[i] else ' (cut off)':10s} log p {log_p_0[i]:6.2f}; stopping at once "
          f"{seed_1['eos_first'][i]:5.2f}; EOS the no. {int(seed_1['eos_place'][i])} first token")
per_token = -log_p_2[by_penalty] / 20
print(f"  alpha = 2: {int(by_penalty.sum())} of the {int(eos_set_aside.sum())} sources whose "
      f"empty output was set aside return 20 tokens instead, at {per_token.min():.2f} to "
      f"{per_token.max():.2f} nats a token (log p {log_p_2[by_penalty].mean():.1f} on average): "
      f"score log p / {lp_20:.1f} = {(log_p_2[by_penalty] / lp_20).mean():.2f} on average, "
      f"against {seed_1['eos_first'][by_penalty].mean():.2f} for stopping at once")
print("\nseeds 1-8: stop at once / later / cut off at 20, of 64; last column: by how much (at "
      "least) stopping at once is more likely than each alpha = 0 output that does not")
print("seed  EOS in top 4 " + "".join(f"{f'alpha = {alpha}':>15s}" for alpha in length_alphas)
      + "  margin (nats)")
for seed, study in length_studies.items():
    study_log_p, study_length, _ = study[0.0]
    others = study_length > 1  # the alpha = 0 outputs that do not stop at once
    margin = (f"{(study['eos_first'] - study_log_p)[others].min():.2f}" if others.any() else "-")
    print(f"{seed:4d} {int((study['eos_place'] <= length_k).sum()):13d} "
          + "".join(f"{' / '.join(f'{c:2d}' for c in length_spread[seed][alpha]):>15s}"
                    for alpha in length_alphas)
          + f"  {margin:>13s}")
cut_margins = torch.cat([(study["eos_first"] - study[0.0][0])[~study[0.0][2]]
                         for study in length_studies.values()])  # the alpha = 0 cut-offs
print(f"alpha = 0, seeds 1-8: {len(cut_margins)} outputs cut off at 20, each less likely than "
      f"stopping at once by {cut_margins.min():.1f} nats or more")

# %% [markdown]
# For seed 1, at $\alpha = 0$, 60 outputs stop at once, one stops after 2 tokens, and 3 are cut
# off at the cap. At $\alpha = 0$ there is no penalty at all, so the cut-offs are no preference for
# length: each is $e^{27}$ to $e^{33}$ times less likely than stopping at once (log p $-29.9$,
# $-30.6$ and $-35.0$ against $-2.4$, $-2.4$ and $-2.3$). They are search errors: on those three
# sources `EOS` is only the 7th, 6th and 5th most likely first token, outside the beam's 4, and no
# later `EOS` gets in either. The output of 2 tokens is one too ($-3.69$ against $-2.39$; `EOS`
# 6th). The empty output comes out on exactly the 60 sources where `EOS` is among the 4 most
# likely first tokens.
#
# $\alpha = 0.6$ and $1$ give the same counts. Where the empty output was set aside it still
# wins: a 20-token output at about 1.6 nats a token has $s \approx -32$, and
# $\mathrm{lp}(20)$ is only $2.36$ at $\alpha = 0.6$ and $4.17$ at $\alpha = 1$, scores of
# about $-14$ and $-8$ against about $-2$. Where it was not set aside, no $\alpha$ brings it back.
#
# At $\alpha = 2$ the penalty itself acts: $\mathrm{lp}(20) = (25/6)^2 \approx 17.4$. On 36 of the
# 60 sources whose empty output was set aside, a 20-token output now wins. These outputs cost
# 1.35 to 1.82 nats a token (log p $-32.5$ on average, some $e^{30}$ times less likely than
# stopping at once), but divided by 17.4 they score $-1.87$ on average, against $-2.09$ for
# stopping at once. Where stopping at once is cheaper, or the 20 tokens dearer, the empty output
# holds (24 sources): a near-tie that goes one way or the other with the source, hence the split
# between 1 and 20 tokens and a mean of about 13, an average of 1s and 20s. The 4 sources whose
# empty output was never set aside are cut off at $\alpha = 2$ as well. (A flat cost of
# $\log V \approx 2.5$ nats a token would predict no long outputs at all: the score would fall to
# $-4.5$ at 5 tokens and climb back only to $-2.9$ at 20, below the $-2.5$ of stopping at once.)
# So $\alpha$ changes which lengths can win, and which ones do depends on the costs of the tokens
# the beam finds. Wu et al. tuned $\alpha$ on a development set; so should you.
#
# The eight seeds differ mostly in the search, not in the penalty. At $\alpha = 0$ the number of
# outputs that stop at once equals, seed by seed, the number of sources on which `EOS` is among
# the 4 most likely first tokens: all 64 for seed 4, none for seeds 3 and 5, where every output
# runs to the cap. Every other output at $\alpha = 0$, cut off or not, is less likely than
# stopping at once, by at least 1.18 nats (seed 2; the last column), and the 253 cut-offs among
# them by at least 18 nats (the last line printed): search errors, every one. The
# penalty then only chooses among the hypotheses the search sets aside (and may let it run
# longer before it stops): $\alpha = 0$, $0.6$ and $1$ gave the same counts but for one output
# (seed 2), and a larger $\alpha$ never sent fewer outputs to the cap, which is what one
# expects, since for a fixed set of finished hypotheses a larger $\alpha$ can only move the
# winner to a longer one. The printout is not compared: its counts hang on near-ties (those at
# $\alpha = 2$ above all), which the rounding of other kernels, a GPU's say, may tip the other
# way.
#
# **Check**, for each of the eight seeds: a larger $\alpha$ never sends fewer outputs to the cap;
# at $\alpha = 0$ the empty output comes out exactly where `EOS` is among the 4 most likely first
# tokens (one half of that holds by construction: otherwise the empty output is never set aside;
# the other half, that once set aside it wins, is the flat models' doing); and every $\alpha = 0$
# output that does not stop at once is less likely than stopping at once, a search error. For
# seed 1, the penalty's own doing: at $\alpha = 2$ some outputs are cut off although the empty
# output was set aside, each less likely than stopping at once. There the $\alpha = 0$ test fails,
# as it should: it tells the two causes apart.

# %%
for seed, study in length_studies.items():
    cut_offs = [length_spread[seed][alpha][2] for alpha in length_alphas]
    assert cut_offs == sorted(cut_offs), seed  # a larger alpha never sends fewer to the cap
    study_log_p, study_length, _ = study[0.0]
    empty = study_length == 1  # (64,): stops at once
    assert torch.equal(empty, study["eos_place"] <= length_k), seed  # empty iff set aside
    assert (study_log_p[~empty] < study["eos_first"][~empty]).all(), seed  # others: search errors
assert by_penalty.any() and (log_p_2[by_penalty] < seed_1["eos_first"][by_penalty]).all()
assert not torch.equal(length_2 == 1, eos_set_aside)  # the alpha = 0 test fails at alpha = 2


# %% [markdown]
# **On the trained model.** Does length normalisation ever change what the trained reversal
# model outputs? We search for a case: beams of 4 with $\alpha = 0$ and with $\alpha = 0.6$, on
# the 256 test sources, of 3 to 8 symbols like the training sources, where the model is sure of
# itself; and, to look where it may be less sure, on 512 sources of lengths it was never trained
# on: 256 of 1 to 2 symbols and 256 of 9 to 16. For comparison, the same on
# the model after 100 steps, and on a case constructed for the purpose: a copy of the trained
# model whose logits are divided by 5 (its `out_proj` scaled down), as unsure as sampling at
# $\tau = 5$, a model nobody trained.

# %%
def generated(tokens: torch.Tensor) -> torch.Tensor:
    """(B,) tokens generated after BOS, EOS included: |y| of the length penalty."""
    return ((tokens != PAD) & (tokens != BOS)).sum(dim=1)


perturb_gen = torch.Generator().manual_seed(5)


def sources_of_lengths(low: int, high: int, n: int = 256) -> tuple:
    """n random sources of low..high symbols, their mask and max_new_tokens."""
    lens = torch.randint(low, high + 1, (n,), generator=perturb_gen)
    ids = torch.randint(3, VOCAB, (n, high), generator=perturb_gen)
    ids = ids.masked_fill(torch.arange(high) >= lens[:, None], PAD)
    return ids.to(device), padding_mask(lens, high).to(device), high + 1


softened = copy.deepcopy(model)  # constructed: every logit divided by 5
with torch.no_grad():
    softened.out_proj.weight /= 5
    softened.out_proj.bias /= 5
lp_cases = {
    "trained, test sources": (model, src, src_mask, MAX_LEN + 1),
    "trained, lengths 1-2": (model, *sources_of_lengths(1, 2)),
    "trained, lengths 9-16": (model, *sources_of_lengths(9, 16)),
    "100 steps, test sources": (early_model, src, src_mask, MAX_LEN + 1),
    "constructed (logits / 5)": (softened, src, src_mask, MAX_LEN + 1),
}

# %% tags=["nbval-ignore-output"]
lp_results = {}  # case -> (beam without lp, beam with lp, which outputs differ)
for case, (m, ids, mask, n) in tqdm(lp_cases.items(), desc="beams with and without lp"):
    raw, normalised = (beam_search(m, ids, max_new_tokens=n, src_mask=mask, beam_size=4,
                                   length_penalty=alpha, cache=KVCache()) for alpha in (0.0, 0.6))
    lp_results[case] = raw, normalised, outputs_differ(raw.tokens, normalised.tokens)
for case, (raw, normalised, changed) in lp_results.items():
    exact = ""
    if lp_cases[case][1] is src:
        exact = (f"; exact {int(reversed_correctly(raw.tokens).sum())} without lp, "
                 f"{int(reversed_correctly(normalised.tokens).sum())} with")
    empty = [int((generated(gen.tokens) == 1).sum()) for gen in (raw, normalised)]  # EOS at once
    print(f"{case:25s}: {int(changed.sum()):3d} of {len(changed)} outputs change{exact}; "
          f"empty outputs {empty[0]} without lp, {empty[1]} with")
for case in ("100 steps, test sources", "constructed (logits / 5)"):
    raw, normalised, changed = lp_results[case]
    i = int(changed.nonzero()[0])  # the first source whose output changes
    print(f"\n{case}, source {show(lp_cases[case][1][i])}:")
    for alpha, gen in ((0.0, raw), (0.6, normalised)):
        size = int(generated(gen.tokens[i : i + 1]))
        lp = length_penalty_wu(size, 0.6)
        print(f"  alpha = {alpha} returns {show(gen.tokens[i, 1 : size + 1]):24s} "
              f"{size} tokens, log p {gen.log_probs[i]:7.3f}, lp {lp:.3f}, "
              f"log p / lp {gen.log_probs[i] / lp:7.3f}")

# %% [markdown]
# In the stored run no output of the trained model changes, on the test sources or on the
# perturbed ones. The reason is its confidence, and a bound shows how far from a change it is.
# Let $y^*$ be the best output without normalisation, $s^* = \log p(y^* \mid x)$. A rival $y$
# wins after normalisation only if $s(y)/\mathrm{lp}(y) > s^*/\mathrm{lp}(y^*)$, which needs
# $s(y) > r\,s^*$ with $r = \mathrm{lp}(9)/\mathrm{lp}(1) \approx 1.66$, the largest ratio of two
# penalties here (outputs of 1 to 9 tokens; $s^* \le 0$). But probabilities add up to at most
# 1, so $s(y) \le \log(1 - e^{s^*})$. Where $\log(1 - e^{s^*}) \le r\,s^*$, no rival can win.
# One assumption: that the search with $\alpha = 0.6$ sets $y^*$ aside too. It ranks candidates
# by $s$ whatever $\alpha$, so its beams are those of $\alpha = 0$ at every step; only its early
# stop depends on $\alpha$, and had it stopped before the step at which $y^*$ finishes, it would
# return a shorter output whatever the bound says. The check below would catch that.

# %% tags=["nbval-ignore-output"]
s_star = lp_results["trained, test sources"][0].log_probs  # (256,) log p of y*
r = length_penalty_wu(MAX_LEN + 1, 0.6) / length_penalty_wu(1, 0.6)
could_change = torch.log1p(-s_star.exp()) > r * s_star  # (256,)
print(f"r = {r:.3f}; a change is ruled out on {int((~could_change).sum())} of 256 test sources, "
      f"possible on {int(could_change.sum())} (s* = "
      f"{', '.join(f'{x:.3f}' for x in s_star[could_change].tolist())})")

# %% [markdown]
# In the stored run the bound rules a change out on 255 of the 256 sources, and the one left, the
# least likely output ($s^* = -0.74$, one the model gets wrong), does not change either. The
# model after 100 steps is unsure enough: 9 of its 256 outputs change, each to a longer one. The
# constructed model shows the bias that normalisation corrects in full: without it, the beam
# returns the empty output (`EOS` at once, $\mathrm{lp} = 1$) for 102 of the 256 sources, since
# stopping at once costs less than the reversal's six unsure tokens ($-2.93$ against $-3.33$ for
# the first source); with it, for 36, and the reversal wins back: 196 exact against 114.
#
# **Check.** Normalisation can only help a longer output: a rival shorter than $y^*$ has a smaller
# $\mathrm{lp}$ and an $s$ no higher than $s^*$ (which is the largest), so its score falls
# further than that of $y^*$. So, where the search with $\alpha = 0.6$ sets $y^*$ aside (the
# assumption above), every output that changes must grow; asserted in every case, which also
# tests the assumption; and on the trained model's test sources, changes can only occur where the
# bound allows them. For the constructed model, normalisation gives more exact reversals. Last,
# what $|y|$ counts: a hypothesis that `_advance_beams` sets aside is scored $s/\mathrm{lp}(|y|)$
# with $|y|$ its generated tokens, `EOS` included. One step on made-up candidates, five symbols
# generated and `EOS` the best next token, must give a hypothesis of $|y| = 6$ scored
# $s / (11/6)^{0.6} = s / 1.439$, the worked example's penalty above. (Without this check,
# nothing here pins $|y|$: counted without `EOS`, it would only change the printed table.)

# %%
for case, (raw, normalised, changed) in lp_results.items():
    assert (generated(normalised.tokens)[changed] > generated(raw.tokens)[changed]).all(), case
assert not (lp_results["trained, test sources"][2] & ~could_change).any()  # only where allowed
raw, normalised, _ = lp_results["constructed (logits / 5)"]
assert int(reversed_correctly(normalised.tokens).sum()) > int(reversed_correctly(raw.tokens).sum())

five_generated = torch.tensor([[BOS, 3, 4, 5, 6, 7]] * 2)  # k = 2 beams, 5 symbols each
made_up = torch.full((1, 2, VOCAB), -50.0)  # (B, k, V) total log p of each extension
made_up[0, 0, EOS], made_up[0, 0, 3], made_up[0, 1, 4] = -1.0, -2.0, -3.0
hypotheses = [[]]
_advance_beams(made_up, five_generated, hypotheses, [False], alpha=0.6, last_step=False)
(normalised_score, log_p, ids), = hypotheses[0]  # exactly one: the EOS candidate
assert len(ids) - 1 == 6 and log_p == -1.0  # |y|: 5 symbols and EOS, after BOS
assert math.isclose(normalised_score, -1.0 / (11 / 6) ** 0.6, rel_tol=1e-9)


# %% [markdown]
# **Beam search keeps the $k$ most likely prefixes instead of one; with $k = 1$ it is greedy, with
# larger $k$ it finds outputs the model itself rates as more likely.**
#
# ## Sampling: temperature and top-$k$
#
# Greedy and beam search look for *the* most likely output. For a translation or a reversal that
# is what we want; for open-ended generation it gives bland, repetitive text, and we would rather
# draw from the model's distribution. Two knobs reshape the distribution before drawing:
#
# - **temperature** $\tau > 0$ divides the logits: $p_\tau(v) \propto \exp(z_v / \tau)$. With
#   $\tau < 1$ the distribution sharpens and as $\tau \to 0$ it becomes the one-hot of the argmax
#   (greedy); with $\tau > 1$ it flattens towards uniform.
# - **top-$k$** keeps only the $k$ largest logits and renormalises (Fan et al., 2018), so that
#   the long tail of unlikely tokens can never be drawn. $k = 1$ is greedy again.

# %%
#| export
def next_token_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
    """softmax(logits / temperature) over the top_k largest logits (the others get 0)."""
    temperature = check_float("temperature", temperature, low=0.0, low_open=True)
    if top_k is not None:
        top_k = check_int("top_k", top_k, minimum=1)
    logits = logits / temperature  # (..., V)
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth_largest, -math.inf)  # ties at the k-th stay
    return F.softmax(logits, dim=-1)


# %% [markdown]
# **Check.** Rows sum to 1; top-$k$ leaves exactly $k$ non-zero probabilities (no ties here) in
# the same ratios as before; a tiny temperature gives the one-hot of the argmax, a huge one the
# uniform distribution.

# %% tags=["nbval-ignore-output"]
with torch.no_grad():
    z = early_model(src[:1], decoded[:1, :3], src_mask=src_mask[:1],
                    tgt_mask=causal_mask(3, device=device))[0, -1].float()  # (V,), one position
print("logits:", [round(x, 2) for x in z.tolist()])
p = next_token_probs(z)
assert_close(p, F.softmax(z, dim=-1))  # the defaults (tau = 1, no top-k): a smoke test
p3 = next_token_probs(z, top_k=3)
assert int((p3 > 0).sum()) == 3 and math.isclose(p3.sum().item(), 1.0, rel_tol=1e-6)
kept = p3 > 0
assert_close(p3[kept], p[kept] / p[kept].sum())  # the survivors keep their ratios
assert_close(next_token_probs(z, temperature=1e-4), F.one_hot(z.argmax(), VOCAB).float())
assert_close(next_token_probs(z, temperature=1e6), torch.full_like(z, 1 / VOCAB), atol=1e-4, rtol=0)

# %% [markdown]
# **Picture.** One next-token distribution of the early model (the third output symbol of the
# first test source), reshaped by three temperatures and by top-3.

# %% jupyter={"source_hidden": true}
temperatures = [0.5, 1.0, 2.0]
names = ["PAD", "BOS", "EOS", *[str(i) for i in range(3, VOCAB)]]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained", sharey=True)
width = 0.27
tau_colors = plt.cm.plasma([0.15, 0.5, 0.8])  # a sequential colour map: dark = cold, light = hot
for i, (tau, color) in enumerate(zip(temperatures, tau_colors, strict=True)):
    axes[0].bar(np.arange(VOCAB) + (i - 1) * width, next_token_probs(z, tau).cpu(), width,
                color=color, label=f"τ = {tau}")
axes[0].set_title("Temperature: τ < 1 sharpens, τ > 1 flattens")
axes[1].bar(np.arange(VOCAB) - width / 2, p.cpu(), width, color="#7f7f7f", label="all tokens")
axes[1].bar(np.arange(VOCAB) + width / 2, p3.cpu(), width, color=COLORS["accent"], label="top-3")
axes[1].set_title("Top-k: the tail is cut and the rest renormalised")
for ax in axes:
    ax.set_xticks(range(VOCAB), names, rotation=45)
    ax.set_xlabel("next token")
    ax.legend(fontsize=8)
axes[0].set_ylabel("probability")
save_figure(fig, "generation_temperature_top_k")
plt.show()


# %% [markdown]
# Sampling plugs `next_token_probs` into the same loop as greedy decoding. The draws come from a
# `torch.Generator` when one is given, on the generator's device: a CPU generator gives the same
# random numbers whatever device the model is on, so a run on the GPU and one on the CPU of the
# same machine draw from the same stream. Not on every machine, though: `torch.multinomial`
# draws through `exponential_`, which x86 builds of PyTorch compute with Intel's MKL and ARM
# builds (Apple silicon, say) without it, so their streams differ (pytorch/pytorch#148247), and
# PyTorch 2.7 changed the stream (pytorch/pytorch#154031), as it changed dropout's. On another
# build or another kind of CPU the samples below differ, and the checks there assert bounds,
# not tokens. Where the streams agree, the same *tokens* follow only where the probabilities
# agree too: a GPU computes them with other kernels, different in the last bits, and a draw that
# falls right at the border between two tokens can go the other way.

# %%
#| export
def sample(
    model: nn.Module,
    src: Tensor,
    *,
    max_new_tokens: int,
    src_mask: Tensor | None = None,
    use_cache: bool = False,
    cache: DecoderCache | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Draw each token from next_token_probs: tokens (B, <= max_new_tokens + 1), BOS first.

    `.log_probs` is the model's own total log p of the drawn tokens, at temperature 1 and over
    the whole vocabulary (as for greedy and beam search), not that of the reshaped distribution.
    """
    next_token_probs(torch.zeros(1), temperature, top_k)  # bad knobs fail before any work
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")

    def draw(logits: Tensor) -> Tensor:
        where = logits.device if generator is None else generator.device  # where to draw
        probs = next_token_probs(logits.float(), temperature, top_k).to(where)  # (B, V)
        return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)  # (B,)

    return generate(
        model,
        src,
        max_new_tokens=max_new_tokens,
        src_mask=src_mask,
        use_cache=use_cache,
        cache=cache,
        choose=draw,
    )


# %% [markdown]
# **Check.** Top-1 sampling and sampling at a tiny temperature are greedy decoding (the latter on
# the trained model, whose top two logits are at least 0.199 apart at every step of the test
# sources in the stored run (printed in check 2 above), so that at $\tau = 10^{-3}$ the runner-up
# is at least $e^{199}$ times less likely; on a model with near-ties a temperature of $10^{-3}$
# is not yet an argmax); the same seed gives the same draws, with or without the cache (this
# notebook's `KVCache`); another seed gives other draws. And `sample` draws with the right
# frequencies: 20,000 copies of one source, one token each at $\tau = 2$ and top-3, against
# `next_token_probs` of that step: each token's frequency must lie within four of its standard
# deviations, $\sqrt{p(1-p)/20000}$, of its probability $p$ (a chance failure of one of the three
# has odds of about $2 \times 10^{-4}$). For the stored early model that allows 0.006 to 0.009:
# tight enough that a sampler at a temperature 5 % off fails, which the cell after the check
# shows. Last, `.log_probs` of a sample is what its docstring promises: the model's own total
# log-probability of the drawn tokens at $\tau = 1$ over the whole vocabulary, equal to
# `sequence_log_prob` of them, not the log-probability under the reshaped distribution the
# tokens were drawn from (at $\tau = 2$ and top-3, far from it).

# %%
def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


top_1 = sample(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask, top_k=1)
assert torch.equal(top_1.tokens, greedy_early)
cold = sample(model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask, temperature=1e-3,
              generator=seeded(0)).tokens
assert torch.equal(cold, decoded)

draws = [sample(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                cache=KVCache() if c else None, generator=seeded(s)).tokens  # this notebook's
         for s, c in [(0, True), (0, False), (1, True)]]
assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])

copies = 20_000
first_tokens = sample(early_model, src[:1].expand(copies, -1), max_new_tokens=1,
                      src_mask=src_mask[:1].expand(copies, -1, -1, -1), temperature=2.0, top_k=3,
                      generator=seeded(0)).tokens[:, 1]
with torch.no_grad():
    z_first = early_model(src[:1], decoded[:1, :1], src_mask=src_mask[:1],
                          tgt_mask=causal_mask(1, device=device))[0, -1].float()  # (V,)
expected = next_token_probs(z_first, temperature=2.0, top_k=3).cpu()
frequencies = first_tokens.cpu().bincount(minlength=VOCAB) / copies
sigma = (expected * (1 - expected) / copies).sqrt()  # (V,) each frequency's standard deviation
assert ((frequencies - expected).abs() <= 4 * sigma).all(), (frequencies, expected)
assert (frequencies[expected == 0] == 0).all()  # outside the top 3: never drawn

hot = sample(early_model, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask, temperature=2.0,
             top_k=3, generator=seeded(0))
assert_close(hot.log_probs, sequence_log_prob(early_model, src, hot.tokens, src_mask),
             atol=1e-4, rtol=1e-4)  # the model's log p at tau = 1, whatever drew the tokens

# %% [markdown]
# The control: the same test, the frequencies drawn at $\tau = 1.9$, $2$ and $2.1$, each against
# `next_token_probs` at $\tau = 2$, in standard deviations (the check allows 4). The test must
# reject the two wrong temperatures (asserted for the stored run, whose early model the 5 %
# claim is about; another run's early model is another distribution):

# %% tags=["nbval-ignore-output"]
off_by = {}  # temperature -> the largest |frequency - p| / sigma over the top 3
for tau in (1.9, 2.0, 2.1):
    drawn = sample(early_model, src[:1].expand(copies, -1), max_new_tokens=1,
                   src_mask=src_mask[:1].expand(copies, -1, -1, -1), temperature=tau, top_k=3,
                   generator=seeded(0)).tokens[:, 1]
    tau_frequencies = drawn.cpu().bincount(minlength=VOCAB) / copies
    off_by[tau] = ((tau_frequencies - expected).abs()[expected > 0] / sigma[expected > 0]).max().item()
    print(f"drawn at tau = {tau}: largest deviation from the tau = 2 probabilities "
          f"{off_by[tau]:.2f} standard deviations")

# %%
assert off_by[2.0] <= 4  # the check above, again
if STORED_RUN:  # the stored run's early model: a temperature 5 % off is caught
    assert off_by[1.9] > 4 and off_by[2.1] > 4

# %% tags=["nbval-ignore-output"]
for i in range(3):
    print(f"early model, sample {i}: {show(draws[0][i, 1:])}    (reversal: {show(tgt_out[i])})")

# %% [markdown]
# **Picture.** What temperature does to whole outputs: the exact-match rate of sampled reversals
# for the trained and the early model, against the temperature, with and without top-3.

# %%
sweep = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0]
sampled_rates = {}  # (model name, top_k) -> exact-match rate at each temperature
for name, m in (("trained", model), ("100 steps", early_model)):
    for top_k in (None, 3):
        sampled_rates[name, top_k] = [
            reversed_correctly(sample(m, src, max_new_tokens=MAX_LEN + 1, src_mask=src_mask,
                                      temperature=tau, top_k=top_k,
                                      generator=seeded(0)).tokens).float().mean().item()
            for tau in sweep
        ]

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(6.4, 3.8))
model_colors = {"trained": "#404040", "100 steps": "#e377c2"}
for (name, top_k), rates in sampled_rates.items():
    ax.plot(sweep, rates, "-" if top_k is None else ":", marker="o", color=model_colors[name],
            label=f"{name}, {'all tokens' if top_k is None else 'top-3'}")
greedy_rates = {"trained": correct.float().mean().item(),
                "100 steps": reversed_correctly(greedy_early).float().mean().item()}
for name, rate in greedy_rates.items():
    ax.axhline(rate, color=model_colors[name], ls="--", lw=1, alpha=0.7,
               label=f"{name}, greedy ({rate:.1%})")
ax.set_xlabel("temperature τ")
ax.set_ylabel("exact match (fraction of 256)")
ax.set_ylim(0, 1.02)
ax.set_title("Sampled reversals: higher temperature, more mistakes")
ax.legend(fontsize=8)
save_figure(fig, "generation_sampling_temperature")
plt.show()

# %% tags=["nbval-ignore-output"]
print("exact match of sampled reversals (of 256), by temperature:")
print(f"{'':27s}" + "".join(f"{f'τ = {tau}':>10s}" for tau in sweep))
for (name, top_k), rates in sampled_rates.items():
    label = f"{name}, {'all tokens' if top_k is None else 'top-3'}"
    print(f"{label:27s}" + "".join(f"{rate:10.1%}" for rate in rates))

# %% [markdown]
# On the trained model, sampling at $\tau \le 1$ gives as many exact reversals as greedy
# decoding (the dashed lines; in the stored run 99.2 %, its 254 of 256): the top token is so far ahead that even
# $\tau = 1$ hardly ever draws another. From $\tau = 1.5$ on, the hotter the distribution, the
# more often a wrong symbol is drawn somewhere in the output, and one is enough to spoil it:
# 95.3 %, 82.8 % and 36.7 % at $\tau = 1.5$, 2 and 3. Top-3 keeps the tail out of reach, so it
# degrades more slowly (64.5 % at $\tau = 3$). The model after 100 steps is unsure at every
# temperature: even at $\tau = 0.25$ it samples fewer exact reversals (37.5 %) than its greedy
# outputs (104 of 256, 40.6 %), and at $\tau = 3$ almost none (0.4 %; 2.7 % with top-3).
#
# **Check** (bounds from notebook 11's seed study, which ran the same sweep for four seeds): at
# $\tau = 0.25$ the trained model samples 97 % exact reversals or more (the study: 99.6 % to
# 100 %; the stored run: 99.2 %, as many as its greedy outputs), and at $\tau = 3$ top-3 keeps
# more of them than sampling from all tokens (the study: 64.5 % to 78.5 % against 34.8 % to
# 43.0 %; the stored run: 64.5 % against 36.7 %, the top-3 rate equal to the study's lowest,
# seed 1's, 165 of 256).

# %%
trained_all, trained_top3 = sampled_rates["trained", None], sampled_rates["trained", 3]
assert trained_all[0] >= 0.97 and trained_top3[-1] > trained_all[-1]


# %% [markdown]
# **Temperature and top-$k$ reshape the next-token distribution before each draw; $\tau \to 0$ and
# $k = 1$ both give back greedy decoding.**
#
# ## Recap
#
# | idea | code | shapes |
# |---|---|---|
# | encode once, decode step by step | `greedy_decode(model, src, max_new_tokens=n, src_mask=m)` → `Generation` | `src (B, S)` → `.tokens (B, ≤ n+1)`, `BOS` first, `PAD` after `EOS`; `.log_probs (B,)` |
# | cross-attention as alignment | `cross_attention_weights(model, src, tgt, src_mask)` | per layer `(B, h, T, S)` |
# | one attention's cache | `AttentionCache(grows)`, `.update(K, V)`, `.reorder(index)` | keys, values `(B, h, T_kept, d_k)` |
# | the decoder's cache | `KVCache()`, `.layer(i)`, `.length`; `model.decode(new, enc_out, cache=cache)` | per block `(B, h, t, d_k)` and `(B, h, S, d_k)`; new `(B, 1)` → `(B, 1, d)` |
# | cached decoding | `greedy_decode(..., use_cache=True)` (or `cache=KVCache()`, to keep it) | same tokens, $\approx n/2$ less arithmetic |
# | beam search | `beam_search(model, src, max_new_tokens=n, beam_size=k, length_penalty=α)` | `Generation`: `(B, T)` ids and `(B,)` log p; $k$ beams as `B·k` rows |
# | length normalisation | `length_penalty_wu(length, alpha)` | $\mathrm{lp} = ((5+\lvert y\rvert)/6)^\alpha$ |
# | scoring any output | `sequence_log_prob(model, src, tokens)` | `(B,)` |
# | temperature, top-$k$ | `next_token_probs(logits, temperature, top_k)` | `(..., V)` → `(..., V)` |
# | sampling | `sample(model, src, max_new_tokens=n, temperature=τ, top_k=k, generator=g)` | `Generation`: `(B, ≤ n+1)` ids, their log p at $\tau = 1$ |
# | timing the cache | `time_call(fn, repeats=3)` (notebook 02): warm-up, then `repeats` timed runs (default 5; 3 here), median | seconds; speed-up vs FLOP ratio |
# | head ablation (not exported) | `heads_off(attention, heads)`: a pre-hook on `W_o` zeros those heads | exact match per head, per layer |
# | search vs model errors (not exported) | `enumerate_outputs(model, source, mask)`: every output of $\le 3$ symbols, one pass | `(729, 4)` log p, and a bound on the rest |
#
# ## Exercises
#
# 1. **Nucleus sampling.** Top-$k$ keeps a fixed number of tokens. *Top-$p$* (Holtzman et al.,
#    2020) keeps the smallest set of most likely tokens whose probabilities add up to at least
#    $p$. Write `top_p_probs(logits, p)`; check that a tiny $p$ gives the greedy one-hot and
#    $p = 1$ the plain softmax.
# 2. **The size of the cache.** How many bytes does a `KVCache` hold for a batch of $B$ sources of
#    length $S$, decoding $n$ tokens with $N$ decoder layers of width $d$ in float32? Check your
#    formula against `num_bytes()`, and compute it for the reversal model at $B = 64$,
#    $n = 512$.
# 3. **Why the padding mask matters when decoding.** Pad the test batch with 8 more `PAD` columns
#    and decode it with and without `src_mask`. How many outputs change, and how many are still
#    correct reversals?
#
# **Solutions.**
#
# 1. Sort the probabilities, keep a token while the mass *before* it is still below $p$ (so the
#    token that crosses $p$ is kept), and renormalise. The test uses the early model's logits `z`
#    from above; how many tokens $p = 0.9$ keeps depends on that model's run (in the stored run
#    4, whose first three hold 0.894, just short of 0.9), so the count is printed, not compared.
#    What is asserted holds for any logits: the two limits, the kept set is the smallest whose
#    mass reaches $p$, and the result equals top-$k$ with $k$ the size of that set.

# %% tags=["nbval-ignore-output"]
def top_p_probs(logits: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(logits) over the smallest set of top tokens with total probability >= p."""
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got {p}")
    probs = F.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (..., V)
    keep_sorted = mass_before < p  # the first token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to vocab order
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


assert_close(top_p_probs(z, 1e-6), F.one_hot(z.argmax(), VOCAB).float())
assert_close(top_p_probs(z, 1.0), F.softmax(z, dim=-1))
nucleus = top_p_probs(z, 0.9)
nucleus_size = int((nucleus > 0).sum())
print(f"top-p 0.9 keeps {nucleus_size} of {VOCAB} tokens")  # the early model's: run-dependent
kept_mass = F.softmax(z, dim=-1)[nucleus > 0]  # the original probabilities of the kept tokens
assert kept_mass.sum() >= 0.9 and kept_mass.sum() - kept_mass.min() < 0.9  # smallest such set
assert_close(nucleus, next_token_probs(z, top_k=nucleus_size))  # = top-k with k its size


# %% [markdown]
# 2. Self-attention keeps a key and a value per layer, head and position, $h \cdot d_k = d$
#    numbers each: $2 N B n d$; cross-attention the same over the source: $2 N B S d$; at 4 bytes
#    a number, $8 N B d\,(n + S)$ bytes.

# %%
def cache_bytes(N: int, B: int, n: int, S: int, d: int, bytes_per_number: int = 4) -> int:
    return 2 * N * B * d * (n + S) * bytes_per_number


filled = KVCache()
greedy_decode(timing_model, src[:5], max_new_tokens=30, cache=filled)  # all 30 steps: no EOS
assert filled.length == 30
assert filled.num_bytes() == cache_bytes(2, 5, 30, 8, 128)
print(f"reversal model, B=64, n=512: {cache_bytes(2, 64, 512, 8, 128) / 2**20:.1f} MiB")

# %% [markdown]
#    About 65 MiB for this tiny model; for a large model the cache, not the weights, is often what
#    limits the batch size.
#
# 3. With the mask, the padded keys get weight exactly 0 in the encoder and in every
#    cross-attention, so extra padding changes nothing. Without it, the `PAD` positions (a zero
#    embedding plus a positional vector) become part of the source, something the model never saw
#    in training:

# %% tags=["nbval-ignore-output"]
wider = F.pad(src, (0, 8), value=PAD)  # (256, 8) -> (256, 16)
wider_mask = padding_mask(lengths, wider.size(1)).to(device)
with_mask = greedy_decode(model, wider, max_new_tokens=MAX_LEN + 1, src_mask=wider_mask,
                          use_cache=True).tokens
without_mask = greedy_decode(model, wider, max_new_tokens=MAX_LEN + 1, use_cache=True).tokens
changed = outputs_differ(without_mask, with_mask)
print(f"with the mask: identical to the unpadded batch: {torch.equal(with_mask, decoded)}")
print(f"without it: {int(changed.sum())}/256 outputs change, "
      f"{int(reversed_correctly(without_mask).sum())}/256 still correct")
assert torch.equal(with_mask, decoded) and changed.sum() > 128

# %% [markdown]
# ## Appendix · Where the model hesitates
#
# The next-token heatmap of the section "Greedy decoding" showed a model near-certain at every
# step of one source. Over all 256 sources, where is it *least* sure of a token it gets right,
# and what is the runner-up there? The margin is the ratio of the top probability to the
# runner-up's, at every step of every correct output, teacher-forced on it as in that section's
# check:

# %%
with torch.no_grad():
    step_probs = F.softmax(logits.float(), dim=-1)  # (B, T, V): every step of every source
step_top2 = step_probs.topk(2, dim=-1)
step_margin = step_top2.values[..., 0] / step_top2.values[..., 1]  # (B, T)
emits_symbol = (t < L) & correct[:, None]  # symbol steps of correct outputs
least = int(step_margin.masked_fill(~emits_symbol, math.inf).flatten().argmin())
hb, ht = divmod(least, T_tgt)  # the source and the step
hL = int(lengths[hb])
runner = int(step_top2.indices[hb, ht, 1])
right_pos = hL - 1 - ht  # the source position this step must read
runner_pos = [i for i in range(hL) if int(src[hb, i]) == runner]  # where the runner-up sits

# %% tags=["nbval-ignore-output"]
print(f"source {show(src[hb, :hL])}, step {ht + 1} of {hL + 1}: emits {show(src[hb, right_pos : right_pos + 1])} "
      f"(source position {right_pos}) with p = {step_top2.values[hb, ht, 0]:.3f}; runner-up "
      f"{show(step_top2.indices[hb, ht, 1:2])} with p = {step_top2.values[hb, ht, 1]:.3f} "
      f"({step_margin[hb, ht]:.1f} times less), found at source position(s) {runner_pos}")
print("cross-attention weight on the right position / on the runner-up's position(s):")
for layer in range(num_layers):
    cells = [f"{attn[layer][hb, head, ht, right_pos]:.2f} / "
             f"{attn[layer][hb, head, ht, runner_pos].sum():.2f}" for head in range(h)]
    print(f"  layer {layer}: " + "   ".join(f"head {head}: {c}" for head, c in enumerate(cells)))
print("layer 0, head 0, weight by source position: "
      + " ".join(f"{x:.2f}" for x in attn[0][hb, 0, ht, :hL].tolist()))

# %% [markdown]
# In the stored run the least sure step is the fourth output symbol for the source 7 9 5 8 5 10
# (step 4 of 7), which must emit the 5 at source position 2: it does, with $p = 0.82$, against
# $0.18$ for 8, 4.6 times less likely. The 8 sits at position 3, one to the right, and is the symbol the
# decoder has just emitted and read back. The cross-attention shows the same hesitation, in the
# last layer. In layer 0, heads 1, 2 and 3 put all their weight on the 5 at position 2, and head 0
# looks further right: its usual target, $L+1-t$, is position 4 here, but it puts only 0.24 there
# and 0.76 on position 5. Layer 1 strays: head 0 puts
# 0.90 on the 5, but heads 1 and 2 put 0.99 and 0.96 on the 8, and head 3 0.67. The output's
# runner-up is the symbol where the attention strays, one position off.
#
# That is one step of one run, and one step proves no rule. Take every symbol step whose two
# neighbouring source positions hold two symbols different from each other and from the right
# one, and count how often the runner-up is one of those two neighbours' symbols, over all 256
# sources. Against what? A runner-up drawn uniformly from the 11 tokens other than the chosen one
# would be a neighbour's symbol $2/11 \approx 18\,\%$ of the time, but runner-ups are not
# uniform (some symbols are runner-up far more often than others), so that yardstick is only
# rough. A measured one: the same count for the two symbols *two* positions away, $L+1-t$ and
# $L-3-t$, on the steps where all four positions lie in the source ($2 \le t \le L-3$) and the
# five symbols all differ. If the runner-up tends towards the neighbours, they should beat that
# control on the same steps.

# %%
src_at = lambda i: src.gather(1, i.clamp(0, MAX_LEN - 1))  # noqa: E731  (B, T_tgt) symbols
right_sym, just_read, next_up = src_at(L - 1 - t), src_at(L - t), src_at(L - 2 - t)
distinct = (just_read != right_sym) & (next_up != right_sym) & (just_read != next_up)
inner = (t >= 1) & (t <= L - 2) & distinct  # both neighbours exist and differ
runner_up_all = step_top2.indices[..., 1]  # (B, T_tgt)
is_neighbour = (runner_up_all == just_read) | (runner_up_all == next_up)  # (B, T_tgt)
neighbour_share = is_neighbour[inner].float().mean()
two_back, two_ahead = src_at(L + 1 - t), src_at(L - 3 - t)  # the control: two positions away
five = torch.stack([right_sym, just_read, next_up, two_back, two_ahead], dim=-1)  # (B, T_tgt, 5)
all_differ = (five[..., :, None] != five[..., None, :]).sum((-1, -2)) == 20  # 5 distinct symbols
paired = (t >= 2) & (t <= L - 3) & all_differ  # steps with both pairs in the source, all distinct
is_two_away = (runner_up_all == two_back) | (runner_up_all == two_ahead)
paired_shares = is_neighbour[paired].float().mean(), is_two_away[paired].float().mean()

# %% tags=["nbval-ignore-output"]
print(f"runner-up is a neighbour's symbol at {neighbour_share:.1%} of {int(inner.sum())} steps "
      f"(a uniform runner-up: 2/11 = {2 / 11:.1%})")
print(f"on the {int(paired.sum())} steps with both pairs: a neighbour's symbol at "
      f"{paired_shares[0]:.1%}, a symbol two positions away at {paired_shares[1]:.1%}")

# %% [markdown]
# In the stored run, 17.7 % of 640 steps, about the uniform 2/11; and on the 123 steps of the
# control the neighbours come out *below* the symbols two positions away (16.3 % against
# 26.8 %): no tendency towards the neighbours in this run. Its least sure step, above, does
# hesitate between neighbours, but that one step proves no rule. So nothing about it is asserted
# in general; the assert below pins only that example and this run's shares, as described.
#
# > **Other runs.** Notebook 11's seed study (`tools/seed_study.md`, the first measure only)
# > found the runner-up to be a neighbour's symbol (the symbol just read, or the next one to
# > emit) at 20 %, 53 %, 46 % and 36 % of the steps for seeds 0 to 3 (seed 0 trained under
# > another CPU kernel, so another run than the stored one): well above the uniform 18 % and the stored run's
# > control (27 %) for seeds 1 and 2, less clearly for seed 3, not at all for seed 0. The study
# > measured no control of its own, so for those seeds the yardstick is the rough one. The
# > hesitation between neighbours is at most a tendency of some runs, not a law.

# %%
if STORED_RUN:  # the stored run's least sure step and share, as described (not a general rule)
    assert (ht, right_pos, runner_pos) == (3, 2, [3]), (ht, right_pos, runner_pos)
    assert abs(neighbour_share - 2 / 11) < 0.03 and paired_shares[0] < paired_shares[1]

# %% [markdown]
# Next: later notebooks take the same decoders to a real translation task, where the alignment
# is not a clean anti-diagonal.
