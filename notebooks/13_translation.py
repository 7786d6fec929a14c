# %% [markdown]
# # 13 · A real translation task
#
# **What you will build:** everything it takes to train the Transformer on a real task, end to end, each piece checked: English number words translated into German ("three hundred and forty-two thousand and seven" → "dreihundertzweiundvierzigtausendsieben"), a corpus made offline with disjoint splits by number; byte-pair encoding written from scratch (`bpe`) beside the Hugging Face `tokenizers` library; a `Dataset`, dynamic padding and batches by tokens with length bucketing (`translation`); and the practice of training (`practice`): AdamW with decay on weight matrices only (not on norms and biases), warmup and cosine decay, gradient clipping, label smoothing, gradient accumulation checked against a larger batch, mixed precision, gradient checkpointing, early stopping and checkpoints that resume bit for bit (on the CPU). Last, the trained model is scored on numbers it never saw, with greedy and beam search, sacrebleu's BLEU and chrF and exact match; an early checkpoint and a split of round thousands show where it fails, its errors are sorted by kind, and, in the stored run, its cross-attention shows German putting units before tens.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/13_translation.ipynb) · Assumes: [10 · The full model](10_full_model.ipynb), [11 · Training](11_training.ipynb), [12 · Generation](12_generation.ipynb).
#
# The model translates into German only; French appears in exercise 1, as a tokenizer.
#
# The numbers in the prose are those of the stored run; the note at the end, after the
# exercises, says how the checks treat a run of yours that differs.

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
import dataclasses
import hashlib
import inspect
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.testing import assert_close
import tokenizers
from tokenizers import Tokenizer
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import trainers
from torch.utils.data import DataLoader

from transformer_from_scratch.decoding import cross_attention_weights
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.measure import peak_memory
from transformer_from_scratch.measure import time_call
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.utils import atomic_open
from transformer_from_scratch.train import accumulate_gradients
from transformer_from_scratch.train import num_tokens
from transformer_from_scratch.train import sequence_loss
from transformer_from_scratch.utils import COLORS
from transformer_from_scratch.utils import OTHER_COLORS
from transformer_from_scratch.utils import get_device
from transformer_from_scratch.utils import save_figure
from transformer_from_scratch.utils import set_seed

set_seed(0)
device = get_device()
DATA = Path("data")  # the corpus is cached here (gitignored), made again when missing

# %% [markdown]
# ## The task
#
# Notebooks 11 and 12 trained on a toy: reverse a random sequence. A real task has what the toy
# lacks: two languages with their own grammar, words that a fixed vocabulary cannot list, and
# a test on sentences the model has never seen. Translating numbers written in words keeps all
# three and still trains on a laptop:
#
# | English | German | what makes it hard |
# |---|---|---|
# | forty-two | zweiundvierzig | *two-and-forty*: units before tens, the alignment crosses |
# | three hundred and forty-two thousand and seven | dreihundertzweiundvierzigtausendsieben | one compound word, no spaces |
# | seventy-one | einundsiebzig | "sieben" shortened to "sieb", "eins" to "ein" |
#
# The sentences come from `num2words`, a library of spelling rules for dozens of languages, so
# nothing is downloaded and the corpus is the same on every machine that has the same version
# of the library (the cache's file name records it). A library is not ground truth, though: the
# check after the corpus finds one form that it gets wrong, which `number_to_words` corrects.
# The numbers are split **by number** into training, validation and test sets that share none.
# All 1000 numbers below 1000 go into the *training* set. Every larger number is written with
# them: its thousands block, "tausend", then its last block ("zweiundvierzig" is also the
# first half of "zweiundvierzigtausend…"). Only one form changes: a final "eins" drops its "s"
# before "tausend" ("eintausend", "einhunderteintausend"). The other 19,000 numbers are drawn
# at random from 1000 to 999,999; 2,000 of them validate, 2,000
# test and 15,000 train. Of the 20,000 numbers that is 80 / 10 / 10 %, a usual corpus's
# proportions, but the validation and test numbers are all 1000 or more: each is a
# combination the model never saw, of blocks it did. It must *compose* what it learnt.

# %%
#| default_exp translation

# %% [markdown]
# `#| default_exp translation` sends this notebook's export cells to
# `transformer_from_scratch/translation.py`; the tokenizer goes to `bpe` and the training
# practice to `practice` (`#| export bpe`, `#| export practice`), one idea per module.

# %%
#| export
"""A real task: English number words to German; disjoint splits, a Dataset, batches by tokens."""

import json
import os
import random
from collections.abc import Iterator
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import sacrebleu
import torch
from num2words import num2words
from torch.utils.data import Dataset
from torch.utils.data import Sampler

from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.decoding import beam_search
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.tokens import PAD

LANGUAGES = ("en", "de", "fr")  # the source is English; German (or French) is the target
MAX_NUMBER = 999_999


# %%
#| export
def split_numbers(
    num_numbers: int, seed: int = 0, valid: float = 0.1, test: float = 0.1
) -> dict[str, list[int]]:
    """Disjoint train/valid/test lists of distinct numbers up to MAX_NUMBER.

    Every number below 1000 (the building blocks) is in train; the others are distinct random
    numbers from 1000 up, cut into valid (a share `valid` of num_numbers), test and the rest of
    train. Validation and test numbers are therefore all >= 1000, made of seen blocks.
    """
    num_numbers = check_int("num_numbers", num_numbers, minimum=1000)
    if num_numbers > MAX_NUMBER + 1:
        raise ValueError(f"num_numbers={num_numbers} is more than the {MAX_NUMBER + 1} numbers")
    valid, test = check_probability("valid", valid), check_probability("test", test)
    if valid <= 0 or test <= 0 or valid + test >= 1.0:
        raise ValueError(f"valid={valid} and test={test} must be > 0 and leave room for training")
    n_valid, n_test = round(valid * num_numbers), round(test * num_numbers)
    if n_valid < 1 or n_test < 1 or n_valid + n_test > num_numbers - 1000:
        raise ValueError(
            f"num_numbers={num_numbers} leaves no room: the 1000 numbers below 1000 train, and "
            f"{n_valid} validation and {n_test} test numbers must come from the other "
            f"{num_numbers - 1000}"
        )
    rng = random.Random(seed)
    larger = rng.sample(range(1000, MAX_NUMBER + 1), num_numbers - 1000)  # in random order
    train = list(range(1000)) + larger[n_valid + n_test :]
    rng.shuffle(train)  # the building blocks mixed with the rest
    return {
        "train": train,
        "valid": larger[:n_valid],
        "test": larger[n_valid : n_valid + n_test],
    }


def number_to_words(n: int, lang: str) -> str:
    """A number written out in words: number_to_words(42, "de") == "zweiundvierzig".

    num2words (0.5.14) writes 101,000 as "einhunderteinstausend" (so for every number whose
    thousands block is 101, 201, ..., 901); German drops the "s" of "eins" before "tausend", as
    num2words itself does in "eintausend". The German is corrected here.
    """
    n = check_int("n", n, minimum=0)
    lang = check_choice("lang", lang, LANGUAGES)
    if n > MAX_NUMBER:
        raise ValueError(f"n={n} is beyond the task's range 0..{MAX_NUMBER}")
    words = num2words(n, lang=lang)
    if lang == "de":  # no German number word holds "einstausend"
        words = words.replace("einstausend", "eintausend")
    return words


def load_corpus(
    directory: str | os.PathLike, num_numbers: int, seed: int = 0, tgt_lang: str = "de"
) -> dict[str, list[tuple[int, str, str]]]:
    """(number, English, target) triples per split, made once and cached as JSON in directory."""
    tgt_lang = check_choice("tgt_lang", tgt_lang, LANGUAGES[1:])
    # v3: German "...einstausend" corrected (v2 kept num2words' form; v1 mixed 0..999 into every
    # split). The num2words version is in the name: another version's sentences are not reused.
    name = f"numbers_v3_num2words{version('num2words')}_en_{tgt_lang}_{num_numbers}_seed{seed}"
    path = Path(directory) / f"{name}.json"
    if path.exists():
        cached = json.loads(path.read_text(encoding="utf-8"))
        return {split: [tuple(row) for row in rows] for split, rows in cached.items()}
    corpus = {
        split: [(n, number_to_words(n, "en"), number_to_words(n, tgt_lang)) for n in numbers]
        for split, numbers in split_numbers(num_numbers, seed).items()
    }
    with atomic_open(path, "w", encoding="utf-8") as f:  # no file or the whole file, never half
        f.write(json.dumps(corpus, ensure_ascii=False))
    return corpus


# %% [markdown]
# 20,000 numbers: 16,000 to train on (the 1000 below 1000 among them), 2,000 to validate and
# 2,000 to test. The first run writes
# the corpus to `data/`; later runs read it back.

# %%
corpus = load_corpus(DATA, num_numbers=20_000, seed=0, tgt_lang="de")
for split, rows in corpus.items():
    print(
        f"{split:5s} {len(rows):6,d} pairs   e.g. {rows[0][0]:>7,d}: {rows[0][1]!r} -> {rows[0][2]!r}"
    )

# %%
numbers = {split: {n for n, _, _ in rows} for split, rows in corpus.items()}
assert not numbers["train"] & numbers["valid"]  # the splits share no number
assert not numbers["train"] & numbers["test"]
assert not numbers["valid"] & numbers["test"]
assert sum(map(len, numbers.values())) == 20_000  # and no number twice
assert all(n <= 999_999 for rows in numbers.values() for n in rows)
assert set(range(1000)) <= numbers["train"]  # every building block is trained on
assert min(numbers["valid"] | numbers["test"]) >= 1000  # held-out numbers are compositions
assert number_to_words(42, "de") == "zweiundvierzig"  # units before tens

# %% [markdown]
# ### Checking the data
#
# A model learns whatever its targets say, mistakes included, and a test scored against wrong
# targets calls a wrong output right. The rule above can be checked on every sentence: a German
# number from 1000 up must be its thousands block (a final "eins" shortened to "ein"), then
# "tausend", then its last block (nothing for 0), each block written as the corpus writes the
# numbers below 1000. The rule changes a block only when its German ends in "eins": that is
# 1, 101, 201, …, 901 (11 is "elf", 21 "einundzwanzig"; the cell lists them). The cell checks
# the corpus, and then `num2words`' own output on the 1,938 numbers of the corpus whose
# thousands block ends in the digit 1, a superset of those ten blocks.
#
# `num2words` 0.5.14 (the pinned version) breaks the rule there: it drops the "s" for 1,000
# (block "eins": "eintausend") but keeps it after a hundred (101,000 becomes
# "einhunderteinstausend", where German writes "einhunderteintausend"). 21,000 is printed as a
# contrast: its block ends in the digit 1 but is "einundzwanzig", which the rule leaves as it
# is, and so does `num2words`. That is 9,000 of the million numbers, every one whose
# thousands block is 101, 201, …, 901, and 157 of this corpus's 20,000 sentences (132 training,
# 13 validation and 12 test targets, printed below). Left in, the wrong form would be learnt
# from the training targets, and the validation and test sets would score it as right. `number_to_words` replaces
# "einstausend" by "eintausend" (no German number word contains "einstausend"), and the corrected
# corpus follows the rule in every sentence.

# %%
blocks_de = {n: de for n, _, de in corpus["train"] if n < 1000}  # all 1000 are in training


def thousands_rule(n: int) -> str:
    """German for n >= 1000, built from the blocks below 1000: "eins" + "tausend" -> "eintausend"."""
    head = blocks_de[n // 1000]
    head = head[:-1] if head.endswith("eins") else head
    return head + "tausend" + (blocks_de[n % 1000] if n % 1000 else "")


large = [(split, n, de) for split, rows in corpus.items() for n, _, de in rows if n >= 1000]
broken = [n for _, n, de in large if de != thousands_rule(n)]
ends_in_one = [(split, n) for split, n, _ in large if n // 1000 % 10 == 1]
raw_de = {n: num2words(n, lang="de") for _, n in ends_in_one}  # the library, not corrected
raw_broken = Counter(split for split, n in ends_in_one if raw_de[n] != thousands_rule(n))
shortened = [b for b in range(1, 1000) if blocks_de[b].endswith("eins")]  # what the rule changes
print(f"the blocks whose German ends in 'eins', the only ones the rule shortens: {shortened}")
print(f"the corpus: {len(broken)} of its {len(large):,d} German numbers from 1000 up break the rule")
print(f"num2words alone, on the {len(ends_in_one):,d} whose thousands block ends in 1: "
      f"{sum(raw_broken.values())} break it ({dict(raw_broken)})")  # fmt: skip
for n in (1_000, 21_000, 101_000, 901_001):
    print(f"{n:>7,d}  num2words: {num2words(n, lang='de'):26s} number_to_words: {number_to_words(n, 'de')}")

# %%
assert not broken  # every German target follows the rule: 342,057 and 101,000 alike
assert shortened == list(range(1, 1000, 100))  # 1, 101, ..., 901: "eins" ends no other block
assert set(shortened) < {n // 1000 for _, n in ends_in_one}  # the numbers checked: a superset
for _, n in ends_in_one:  # num2words' only wrong form, and the correction that fixes it
    assert raw_de[n] == thousands_rule(n) or ("einstausend" in raw_de[n] and n // 1000 > 100)
if version("num2words") == "0.5.14":  # the pinned version: wrong for blocks 101, 201, ..., 901
    wrong = {n for _, n in ends_in_one if raw_de[n] != thousands_rule(n)}
    assert wrong == {n for _, n in ends_in_one if n // 1000 in range(101, 1000, 100)}

# %% [markdown]
# ## Tokenization: byte-pair encoding from scratch
#
# The model reads token ids, so the text must be cut into pieces from a fixed vocabulary.
# Whole words fail here: every German number is its own word ("dreihundertzweiundvierzigtausendsieben"),
# so a word vocabulary would have to list a million of them, and a number from the test set
# would be unknown. Characters always work but make sequences long (the German above is 38
# characters). **Byte-pair encoding** (BPE; Sennrich et al., 2016) sits between the two: start
# from characters, then repeatedly *merge the most frequent adjacent pair* into a new token,
# until the vocabulary has the size you asked for. Frequent pieces ("hundert", "und", "zig")
# become single tokens; anything else still spells out from smaller pieces.
#
# Words are first split at spaces, each with a marker `▁` in front (SentencePiece's
# convention), so that decoding can put every space back: the round trip is exact.

# %%
#| export bpe
"""Byte-pair encoding from scratch: learn merges from a corpus, encode text to ids and back."""

import hashlib
import json
import os
from collections import Counter
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.tokens import UNK  # notebook 09 keeps every reserved id
from transformer_from_scratch.utils import atomic_open

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPACE = "\u2581"  # "▁" marks the start of a word, as in SentencePiece


# %%
#| export bpe
def split_words(text: str) -> list[str]:
    """Split text at spaces, each word with SPACE in front: decoding can put the spaces back."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("text is empty: there is nothing to tokenize")
    if SPACE in text:
        raise ValueError(f"text contains {SPACE!r}, the character that marks word starts")
    return [SPACE + word for word in text.split(" ")]


# %% [markdown]
# Training counts every word once per occurrence, then merges. The whole algorithm is two
# functions: `merge_pair` rewrites one word, `learn_merges` picks the pairs. Counting all pairs
# again after every merge would read the whole corpus once per merge; instead, `learn_merges`
# keeps the counts and an index from each pair to the words that contain it, so a merge only
# touches the words it changes.

# %%
#| export bpe
def merge_pair(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    """Replace every occurrence of the adjacent pair (a, b) in symbols by the symbol a + b."""
    a, b = pair
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
            merged.append(a + b)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def learn_merges(word_counts: dict[str, int], num_merges: int) -> list[tuple[str, str]]:
    """The num_merges most frequent adjacent pairs, merged one after the other (Sennrich, 2016)."""
    num_merges = check_int("num_merges", num_merges, minimum=0)
    words = [list(word) for word in word_counts]  # each word as a list of symbols
    counts = list(word_counts.values())
    pair_counts: Counter = Counter()
    where = defaultdict(set)  # pair -> indices of the words that contain it
    for i, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:], strict=False):
            pair_counts[pair] += counts[i]
            where[pair].add(i)
    merges = []
    for _ in range(num_merges):
        if not pair_counts:
            break  # every word is a single symbol: nothing left to merge
        # The most frequent pair; ties go to the alphabetically first, so training is deterministic.
        best, count = min(pair_counts.items(), key=lambda item: (-item[1], item[0]))
        if count < 2:
            break  # a pair seen once is a whole word, not a reusable piece
        merges.append(best)
        for i in where.pop(best):  # only the words that contain the pair change
            symbols, c = words[i], counts[i]
            for pair in zip(symbols, symbols[1:], strict=False):
                pair_counts[pair] -= c
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            words[i] = symbols = merge_pair(symbols, best)
            for pair in zip(symbols, symbols[1:], strict=False):
                pair_counts[pair] += c
                where[pair].add(i)
    return merges


# %% [markdown]
# Before the real corpus, a toy one: seven German number words, each once. The cell prints
# the first eight merges with the count of their pair at the moment it was merged, counted
# afresh over the words as they stand (not with `learn_merges`' running counts), and checks
# that each merged pair was the most frequent one then.

# %%
toy = ["zweiundzwanzig", "dreiundzwanzig", "vierundzwanzig", "zweiunddreißig",
       "vierunddreißig", "zweihundert", "dreihundert"]  # fmt: skip
toy_counts = Counter(word for text in toy for word in split_words(text))
toy_merges = learn_merges(toy_counts, num_merges=8)
toy_words = {tuple(word): count for word, count in toy_counts.items()}  # word as its symbols
for rank, pair in enumerate(toy_merges, 1):
    pair_counts = Counter()
    for symbols, count in toy_words.items():
        for adjacent in zip(symbols, symbols[1:], strict=False):
            pair_counts[adjacent] += count
    print(f"merge {rank}: {pair[0]!r} + {pair[1]!r} -> {pair[0] + pair[1]!r}, "
          f"seen {pair_counts[pair]} times")  # fmt: skip
    assert pair_counts[pair] == max(pair_counts.values())  # the most frequent pair, recounted
    toy_words = {tuple(merge_pair(list(s), pair)): c for s, c in toy_words.items()}
toy_pieces = {"".join(symbols)[1:]: list(symbols) for symbols in toy_words}
print(toy_pieces["zweihundert"], toy_pieces["vierundzwanzig"])
assert "und" in toy_pieces["zweihundert"]  # "und" inside "hundert": frequency, not grammar


# %% [markdown]
# The first merges are the most frequent pairs: "e" + "i", 7 times in six of the seven words
# (twice in "zweiunddreißig", never in "vierundzwanzig"), then "n" + "d" and "und", once in
# every word; ties go to the alphabetically first pair. The pieces follow frequency, not grammar:
# "zweihundert" is cut "zw" + "ei" + "h" + "und" + "er" + "t", the "und" of "hundert" taken for
# the "und" of "zweiundzwanzig". On a real corpus the counts are larger and the pieces longer.
#
# The tokenizer holds the alphabet and the merges. Its ids start with the library's reserved
# ones, `PAD, BOS, EOS = 0, 1, 2`, and `UNK = 3` for a character it never saw, all four from
# notebook 09's `tokens`. Encoding a word applies the learnt merges *in the order they were learnt*,
# which is what makes the result the same as during training.

# %%
#| export bpe
class BPETokenizer:
    """Byte-pair encoding: characters, then learnt merges; text <-> ids, PAD/BOS/EOS/UNK first."""

    def __init__(self, alphabet: Iterable[str], merges: Iterable[tuple[str, str]]):
        self.alphabet = sorted(set(alphabet) | {SPACE})
        self.merges = [tuple(pair) for pair in merges]
        tokens = list(SPECIAL_TOKENS) + self.alphabet + [a + b for a, b in self.merges]
        if len(set(tokens)) != len(tokens):
            raise ValueError("the alphabet and the merges give the same token twice")
        self.id_to_token = tokens
        self.token_to_id = {token: i for i, token in enumerate(tokens)}
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}  # earlier = first
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Learn merges from texts until there are vocab_size tokens (or no pair repeats)."""
        vocab_size = check_int("vocab_size", vocab_size, minimum=len(SPECIAL_TOKENS) + 2)
        word_counts: Counter = Counter()
        for text in texts:
            word_counts.update(split_words(text))
        if not word_counts:
            raise ValueError("texts is empty: BPE needs a corpus to learn from")
        alphabet = sorted({char for word in word_counts for char in word})
        num_merges = vocab_size - len(SPECIAL_TOKENS) - len(alphabet)
        if num_merges < 0:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the {len(SPECIAL_TOKENS)} special "
                f"tokens and the corpus's {len(alphabet)} characters"
            )
        return cls(alphabet, learn_merges(word_counts, num_merges))

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def _encode_word(self, word: str, unknown: str) -> list[int]:
        """One word's ids: apply the learnt merges in the order they were learnt."""
        if word in self._cache:
            return self._cache[word]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:], strict=False))
            pair = min(pairs, key=lambda p: self.ranks.get(p, len(self.ranks)))
            if pair not in self.ranks:
                break  # no learnt merge applies any more
            symbols = merge_pair(symbols, pair)
        ids = []
        for symbol in symbols:
            if symbol in self.token_to_id:
                ids.append(self.token_to_id[symbol])
            elif unknown == "error":
                raise ValueError(f"character {symbol!r} in {word[1:]!r} is not in the vocabulary")
            else:
                ids.append(UNK)
        if UNK not in ids:
            self._cache[word] = ids
        return ids

    def encode(self, text: str, add_special: bool = True, unknown: str = "unk") -> list[int]:
        """Text -> ids, BOS first and EOS last if add_special; unknown="error" refuses UNK."""
        unknown = check_choice("unknown", unknown, ("unk", "error"))
        try:
            ids = [i for word in split_words(text) for i in self._encode_word(word, unknown)]
        except ValueError as err:  # name the whole text too: a corpus has many sentences
            raise ValueError(f"{err}, in the text {text!r}") from None
        return [BOS, *ids, EOS] if add_special else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; PAD, BOS and EOS are dropped, UNK becomes "\ufffd"."""
        pieces = []
        for i in ids:
            i = check_int("token id", i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            if i in (PAD, BOS, EOS):
                continue
            pieces.append("\ufffd" if i == UNK else self.id_to_token[i])
        return "".join(pieces).replace(SPACE, " ").removeprefix(" ")

    def tokens(self, text: str) -> list[str]:
        """The pieces text is cut into (without BOS/EOS), to look at."""
        return [self.id_to_token[i] for i in self.encode(text, add_special=False)]

    def fingerprint(self) -> str:
        """A short hash of the vocabulary: two tokenizers with the same one give the same ids."""
        blob = json.dumps([self.id_to_token, self.merges], ensure_ascii=False).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer as JSON with atomic_open: a crash leaves the old file or the new."""
        path = Path(path)
        state = {
            "format": "transformer_from_scratch.bpe/1",
            "special_tokens": list(SPECIAL_TOKENS),
            "alphabet": self.alphabet,
            "merges": [list(pair) for pair in self.merges],
            "fingerprint": self.fingerprint(),
        }
        with atomic_open(path, "w", encoding="utf-8") as f:  # notebook 11's atomic write
            f.write(json.dumps(state, ensure_ascii=False, indent=0))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, fingerprint: str | None = None) -> "BPETokenizer":
        """Read a saved tokenizer; with fingerprint, refuse one with another vocabulary."""
        try:
            state = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a tokenizer file: {error}") from None
        if not isinstance(state, dict) or state.get("format") != "transformer_from_scratch.bpe/1":
            raise ValueError(f"{path} is not a tokenizer saved by BPETokenizer.save")
        if state["special_tokens"] != list(SPECIAL_TOKENS):
            raise ValueError(
                f"{path} has special tokens {state['special_tokens']}, but this library's ids "
                f"are {list(SPECIAL_TOKENS)}"
            )
        tokenizer = cls(state["alphabet"], [tuple(pair) for pair in state["merges"]])
        if tokenizer.fingerprint() != state["fingerprint"]:
            raise ValueError(f"{path} was edited: its merges do not match its fingerprint")
        if fingerprint is not None and tokenizer.fingerprint() != fingerprint:
            raise ValueError(
                f"{path} holds another vocabulary (fingerprint {tokenizer.fingerprint()}, "
                f"expected {fingerprint}): its ids would mean other tokens to the model"
            )
        return tokenizer


# %% [markdown]
# ### Training the two tokenizers
#
# One tokenizer per language, trained on the **training split only** (the validation and test
# sentences must not shape anything the model uses). 5,000 training sentences are plenty to find
# the frequent pieces and keep training short, but not any 5,000: a tokenizer can only
# write characters it has seen, and "zero" is the only English number word with a "z". A random
# sample without it gives a tokenizer that cannot encode the sentence "zero" (under another
# seed, a random sample of 5,000 did miss it). So the sample is the 1,000
# building blocks, every number below 1,000 (all in the training split), and 4,000 more
# training sentences from 1,000 up. The blocks
# hold every German character, but not every English one: the comma appears only from 1,000 up
# ("one thousand, two hundred"), and it is the larger sentences that bring it in. The cell
# prints what the blocks alone lack, and checks that the sample lacks nothing of the training
# split.
#
# The example is 342,057 rather than the introduction's 342,007, so that its English holds
# two hyphenated tens-and-units words; with these tokenizers one of them is a single token
# ("▁fifty-seven") and the other is not ("▁forty-t" + "wo").

# %%
blocks = [row for row in corpus["train"] if row[0] < 1000]  # (number, English, German)
sample = blocks + [row for row in corpus["train"] if row[0] >= 1000][:4000]
train_en = [en for _, en, _ in sample]
train_de = [de for _, _, de in sample]
chars_train = {lang: set("".join(row[k] for row in corpus["train"])) for lang, k in (("en", 1), ("de", 2))}
chars_blocks = {lang: set("".join(row[k] for row in blocks)) for lang, k in (("en", 1), ("de", 2))}
print("characters of the training split that the blocks lack:",
      {lang: sorted(chars_train[lang] - chars_blocks[lang]) for lang in ("en", "de")})  # fmt: skip
assert chars_train["en"] - chars_blocks["en"] == {","} and chars_train["de"] <= chars_blocks["de"]
assert len(blocks) == 1000 and set("".join(train_en)) == chars_train["en"]  # the sample: all
src_tokenizer = BPETokenizer.train(train_en, vocab_size=160)
tgt_tokenizer = BPETokenizer.train(train_de, vocab_size=90)
print("English:", src_tokenizer.vocab_size, "tokens, German:", tgt_tokenizer.vocab_size, "tokens")
example_n, example_en, example_de = (
    342_057,
    number_to_words(342_057, "en"),
    number_to_words(342_057, "de"),
)
print(src_tokenizer.tokens(example_en))
print(tgt_tokenizer.tokens(example_de))
print(tgt_tokenizer.encode(example_de))

# %% [markdown]
# The vocabulary sizes are chosen so that the pieces are the building blocks of numbers, though
# BPE's pieces follow frequency, not grammar. In English most number words are whole tokens
# ("▁hundred", "▁thousand", "▁fifty-seven"), but about two in five of the hyphenated
# tens-and-units are not (counted in the cell below, which prints two of them): BPE cut
# "forty-two" into "▁forty-t" + "wo" and "twenty-five" into "▁twen" + "ty-five".
#
# In German the pieces are the units with "und" ("zweiund"), the hundreds ("dreihundert") and
# bare digit stems: seven of the eight tens are *not* tokens of their own but a stem and a
# suffix, "vier" + "zig", or "vier" + "zigtausend" when "tausend" follows; the irregular one,
# "dreißig", is a whole token (the cell below prints how each tens word is cut).
#
# These pieces are findings of these tokenizers: another seed draws other training sentences
# and can learn other pieces. So the exact claims are asserted only for the stored run's
# tokenizers, recognised by their fingerprints (`STORED_TOKENIZERS`); for any tokenizers, only
# the share of split words, within a bound.

# %%
hyphenated = [number_to_words(n, "en") for n in range(21, 100) if n % 10]  # twenty-one ...
split_up = [w for w in hyphenated if len(src_tokenizer.tokens(w)) > 1]
print(f"{len(split_up)} of {len(hyphenated)} hyphenated English words are more than one token")
cut_examples = {w: src_tokenizer.tokens(w) for w in ("forty-two", "twenty-five")}
print("two of them:", cut_examples)
tens_de = {number_to_words(n, "de"): tgt_tokenizer.tokens(number_to_words(n, "de"))[1:] for n in range(20, 100, 10)}
print("German tens (after the lone '▁'):", tens_de)
assert 0.3 < len(split_up) / len(hyphenated) < 0.5  # "about two in five", for any tokenizers
STORED_TOKENIZERS = ("7952d9e6e6dce988", "4275138f112c7a25")  # English, German, the stored run
if (src_tokenizer.fingerprint(), tgt_tokenizer.fingerprint()) == STORED_TOKENIZERS:
    assert len(split_up) == 30 and tens_de["dreißig"] == ["dreißig"]  # the paragraph, exactly
    assert cut_examples == {"forty-two": ["▁forty-t", "wo"], "twenty-five": ["▁twen", "ty-five"]}
    assert all(pieces[-1] == "zig" and len(pieces) == 2 for word, pieces in tens_de.items() if word != "dreißig")

# %% [markdown]
# A German number is one word, so a sentence holds a single pair of "▁" and its first piece,
# while the pairs inside the word repeat many times. Such a pair is merged only when one first
# piece starts many sentences: in these tokenizers "▁" + "neunhundert" (a ninth of the numbers
# from 100,000 up start with it), and no other. So about nine in ten German sentences start with
# a lone "▁" token, the others with "▁neunhundert" (the lone "▁" share is printed below). In English, where every
# sentence has many words, pieces with the marker are frequent: "▁and", "▁hundred". Which
# first piece, if any, is merged with "▁" depends on the sentences the tokenizer learnt from:
# the list is asserted for the stored run's tokenizers, and for any tokenizers only that most
# sentences start with a lone "▁".

# %%
all_de = [de for rows in corpus.values() for _, _, de in rows]  # every German sentence
first_pieces = Counter(tgt_tokenizer.tokens(de)[0] for de in all_de)
marked = sorted(t for t in tgt_tokenizer.id_to_token if t.startswith(SPACE) and t != SPACE)
lone_share = first_pieces[SPACE] / len(all_de)
print(f"German sentences that start with a lone '▁': {lone_share:.1%}; "
      f"German tokens that start with '▁': {marked}")  # fmt: skip
assert lone_share > 0.7  # most sentences, for any tokenizers
if (src_tokenizer.fingerprint(), tgt_tokenizer.fingerprint()) == STORED_TOKENIZERS:
    assert marked == ["▁neunhundert"]  # the paragraph, exactly
    assert first_pieces["▁neunhundert"] == sum(de.startswith("neunhundert") for de in all_de)


# %% [markdown]
# `learn_merges` keeps running pair counts and an index of the words that hold each pair, and
# the toy corpus above checked its merges against a recount. On the real sample the same check
# is stronger: a plain version that counts every pair of every word again before each merge
# (slow, and plainly right) must learn the very same merges, in the same order, for both
# languages.

# %%
def recounted_merges(texts: list[str], num_merges: int) -> list[tuple[str, str]]:
    """BPE without bookkeeping: recount every pair of every word before each merge."""
    words = Counter(tuple(word) for text in texts for word in split_words(text))
    merges = []
    for _ in range(num_merges):
        pair_counts = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pair_counts[pair] += count
        if not pair_counts:
            break  # every word is one symbol
        best, count = min(pair_counts.items(), key=lambda item: (-item[1], item[0]))
        if count < 2:
            break  # as learn_merges: a pair seen once is not a reusable piece
        merges.append(best)
        words = Counter({tuple(merge_pair(list(s), best)): c for s, c in words.items()})
    return merges


for name, tokenizer, texts in (("English", src_tokenizer, train_en), ("German", tgt_tokenizer, train_de)):
    recounted = recounted_merges(texts, len(tokenizer.merges))
    print(f"{name}: {len(tokenizer.merges)} merges, recounted from scratch: the same {recounted == tokenizer.merges}")
    assert recounted == tokenizer.merges

# %% [markdown]
# The property a tokenizer needs: **decode(encode(s)) == s**. For a text whose characters are
# all in the alphabet it holds by construction: a merge only joins two symbols, so the pieces
# always concatenate back to the word, and the `▁` marks put back the spaces. What can break it
# is a character the tokenizer never saw: it becomes `UNK`, which decodes to "�". So the
# check that can fail is on the characters, and the round trip is run on every sentence of
# every split, including the ones the tokenizers were not trained on, and on a sentence with a
# character outside the alphabet, where it must fail.

# %%
for rows in corpus.values():
    for _, en, de in rows:
        assert set(en) <= set(src_tokenizer.alphabet) | {" "}, en  # no character unseen
        assert set(de) <= set(tgt_tokenizer.alphabet) | {" "}, de
        assert src_tokenizer.decode(src_tokenizer.encode(en)) == en, en
        assert tgt_tokenizer.decode(tgt_tokenizer.encode(de)) == de, de
unseen = "zweiundzwanzig €"  # "€" is not in the German alphabet
print(tgt_tokenizer.tokens(unseen), "->", repr(tgt_tokenizer.decode(tgt_tokenizer.encode(unseen))))
assert UNK in tgt_tokenizer.encode(unseen)
assert tgt_tokenizer.decode(tgt_tokenizer.encode(unseen)) != unseen  # the round trip fails here
assert tgt_tokenizer.encode(example_de)[0] == BOS and tgt_tokenizer.encode(example_de)[-1] == EOS
assert [tgt_tokenizer.token_to_id[t] for t in SPECIAL_TOKENS] == [PAD, BOS, EOS, UNK]  # the library's ids


# %% [markdown]
# Bad input gets a clear error, not a crash deep inside the model: an empty sentence, a
# character the tokenizer never saw (with `unknown="error"`; by default it becomes `UNK`), and
# a saved tokenizer that belongs to another vocabulary. The fingerprint, a hash of the
# vocabulary, is also what the training checkpoints below store (`train_translation(...,
# fingerprints=...)`), so that a run resumed with other tokenizers is refused.

# %%
def error_of(fn, *args, **kwargs) -> str:
    """The type and message of the exception fn raises."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError("no error raised")


print(error_of(tgt_tokenizer.encode, ""))
print(error_of(tgt_tokenizer.encode, "dreiunddreißig €", unknown="error"))
print(tgt_tokenizer.decode(tgt_tokenizer.encode("zwei€")), tgt_tokenizer.encode("zwei€")[-3:])
with tempfile.TemporaryDirectory() as tmp:
    saved = tgt_tokenizer.save(Path(tmp) / "de.json")
    assert BPETokenizer.load(saved).encode(example_de) == tgt_tokenizer.encode(example_de)
    message = error_of(BPETokenizer.load, saved, fingerprint=src_tokenizer.fingerprint())
    print(message.replace(tmp, "TMP"))  # the temporary folder's name changes every run


# %% [markdown]
# ### The same corpus through a tokenizer library
#
# In practice you would not write BPE yourself: Hugging Face's `tokenizers` (Rust, used by the
# `transformers` library) trains and encodes the same kind of model much faster. It is trained
# here offline, on the same sentences, with the same vocabulary size, the same special tokens
# and the same `▁` word marker, and compared side by side.

# %% tags=["nbval-ignore-output"]
def train_library_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A Hugging Face BPE tokenizer with our special tokens (ids 0-3) and word marker."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁")
    tokenizer.decoder = decoders.Metaspace(replacement="▁")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


hf_tokenizer = train_library_bpe(train_de[:5000], vocab_size=90)
print(f"tokenizers {tokenizers.__version__}:", hf_tokenizer.get_vocab_size(), "tokens;",
      hf_tokenizer.encode(example_de).tokens)  # fmt: skip

# %% tags=["nbval-ignore-output"]
hf_encoded = hf_tokenizer.encode_batch(all_de)
ours_lengths = [len(tgt_tokenizer.encode(s, add_special=False)) for s in all_de]
hf_lengths = [len(e.ids) for e in hf_encoded]
print(
    f"tokens per German sentence: ours {np.mean(ours_lengths):.2f}, library {np.mean(hf_lengths):.2f}"
)
print(f"longest:                    ours {max(ours_lengths)}, library {max(hf_lengths)}")
shared = set(tgt_tokenizer.id_to_token) & set(hf_tokenizer.get_vocab())
only_ours = sorted(set(tgt_tokenizer.id_to_token) - shared)
only_library = sorted(set(hf_tokenizer.get_vocab()) - shared)
print(f"tokens in both vocabularies: {len(shared)} of {tgt_tokenizer.vocab_size}")
print("only ours:", only_ours, " only the library's:", only_library)
ours_pieces = [[tgt_tokenizer.id_to_token[i] for i in tgt_tokenizer.encode(s, add_special=False)]
               for s in all_de]  # fmt: skip
same_pieces = sum(ours == e.tokens for ours, e in zip(ours_pieces, hf_encoded, strict=True))
print(f"sentences split into exactly the same pieces: {same_pieces:,} of {len(all_de):,}")

# %%
assert hf_tokenizer.get_vocab_size() == tgt_tokenizer.vocab_size == 90
assert [hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD, BOS, EOS, UNK]
assert all(hf_tokenizer.decode(e.ids) == s for e, s in zip(hf_encoded, all_de, strict=True))
assert same_pieces >= 0.99 * len(all_de)  # another version of the library may break a tie otherwise
if tokenizers.__version__ == "0.23.3" and tgt_tokenizer.fingerprint() == STORED_TOKENIZERS[1]:
    assert same_pieces == len(all_de) and "fün" in only_ours and "nf" in only_library  # the prose


# %% tags=["nbval-ignore-output"]
def encode_fresh() -> list[list[int]]:
    """Our tokenizer on 2,000 sentences, built anew: its word cache is empty on every call."""
    fresh = BPETokenizer(tgt_tokenizer.alphabet, tgt_tokenizer.merges)
    return [fresh.encode(s) for s in all_de[:2000]]


seconds_ours = time_call(encode_fresh, warmup=0, repeats=3)  # the median of 3 timings each
seconds_hf = time_call(lambda: hf_tokenizer.encode_batch(all_de[:2000]), warmup=1, repeats=3)
print(
    f"encoding 2,000 sentences: ours {1000 * seconds_ours:.0f} ms, library {1000 * seconds_hf:.0f} ms"
    f" (the library {seconds_ours / seconds_hf:.0f} times faster)"
)

# %%
assert encode_fresh() == [tgt_tokenizer.encode(s) for s in all_de[:2000]]  # what was timed


# %% [markdown]
# The two learn nearly the same vocabulary (the same counts drive both; they differ in how ties
# are broken and in what they count): the tokens that only one of them has are intermediate
# pieces, other routes to the same whole words (ours has `fün`, the library `nf`: two ways to
# `fünf`). In the end they split every one of the 20,000 German sentences into exactly the same
# pieces (the count above, with the pinned version 0.23.3 of `tokenizers`; for another version,
# which may break a tie otherwise, the assert asks for 99 % of them). The course's model trains on **our** tokenizer: it is the one you can read,
# its ids are the course's own `PAD, BOS, EOS` (from notebook 09's `tokens` module), and its
# round trip is checked above on every sentence. Its slowness is the price: the library,
# compiled and parallel, is many times faster (the timing cell prints both medians and their
# ratio on the machine that ran it; no assert rests on a time). For German, where every sentence is a different single word, our cache of
# encoded words never hits, so our time grows with the number of sentences.
#
# **BPE turns an open vocabulary into a closed one: a number never seen spells out from pieces
# that were.**

# %% [markdown]
# ## Data: a `Dataset`, dynamic padding and batches by tokens
#
# The sentences become token ids once, in a `Dataset`. It refuses what the model could not
# take: a sentence longer than the model's `max_len` (the rows of its positional table) would
# otherwise fail deep in the positional encoding, many steps into training.

# %%
#| export
class TranslationDataset(Dataset):
    """Sentence pairs as token ids: item i is (src_ids, tgt_ids), both with BOS and EOS."""

    def __init__(
        self,
        pairs: Sequence[tuple[str, str]],
        src_tokenizer: BPETokenizer,
        tgt_tokenizer: BPETokenizer,
        max_len: int,
    ):
        max_len = check_int("max_len", max_len, minimum=3)
        if len(pairs) == 0:
            raise ValueError("pairs is empty: a dataset needs at least one sentence pair")
        self.src, self.tgt = [], []
        for i, (src_text, tgt_text) in enumerate(pairs):
            src_ids = src_tokenizer.encode(src_text, unknown="error")
            tgt_ids = tgt_tokenizer.encode(tgt_text, unknown="error")
            if max(len(src_ids), len(tgt_ids)) > max_len:
                raise ValueError(
                    f"pair {i} has {len(src_ids)} source and {len(tgt_ids)} target tokens, "
                    f"more than max_len={max_len}: {src_text!r}"
                )
            self.src.append(torch.tensor(src_ids))
            self.tgt.append(torch.tensor(tgt_ids))
        self.src_lengths = [len(s) for s in self.src]
        self.tgt_lengths = [len(t) for t in self.tgt]
        # A pair's cost in a batch: its longer side (src and tgt are padded separately, each
        # tensor to its own longest, so the longer side bounds both tensors' widths).
        self.lengths = [max(s, t) for s, t in zip(self.src_lengths, self.tgt_lengths, strict=True)]

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.src[i], self.tgt[i]


# %% [markdown]
# A batch is a list of pairs of different lengths. **Dynamic padding** pads them only to the
# longest *in the batch*, not to a global maximum, and cuts the target into the decoder's input
# and the shifted output of teacher forcing (notebook 11): `tgt_in = [BOS, y]`,
# `tgt_out = [y, EOS]`. The returned tuple has the same shape as notebook 11's batches, and
# the source lengths give the padding mask.

# %%
#| export
def collate_translations(
    items: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a list of (src, tgt) to the longest in the batch: (src, tgt_in, tgt_out, src_lengths)."""
    if len(items) == 0:
        raise ValueError("cannot collate an empty batch")
    src = torch.nn.utils.rnn.pad_sequence(
        [s for s, _ in items], batch_first=True, padding_value=PAD
    )  # (B, T_src)
    tgt = torch.nn.utils.rnn.pad_sequence(
        [t for _, t in items], batch_first=True, padding_value=PAD
    )  # (B, T_tgt + 1)
    src_lengths = torch.tensor([len(s) for s, _ in items])  # (B,)
    return src, tgt[:, :-1], tgt[:, 1:], src_lengths  # teacher forcing: input and shifted target


# %% [markdown]
# Dynamic padding still wastes work when a batch mixes a short sentence with a long one.
# **Length bucketing** puts sentences of similar length together: take a pool of shuffled
# indices, sort the pool by length, cut it into batches, and shuffle the batches. And since the
# cost of a batch is its padded size, the batches are cut by a **token budget** (sentences ×
# longest length ≤ `max_tokens`) instead of a fixed number of sentences: short sentences come in
# bigger batches, every step does about the same work. The sampler is a `batch_sampler` for
# PyTorch's `DataLoader`; `set_epoch` gives each epoch its own order, the same on every run, as
# `DistributedSampler` does.

# %%
#| export
class TokenBatchSampler(Sampler):
    """Batches of dataset indices holding at most max_tokens (padded) tokens each.

    bucket=True sorts each pool of shuffled indices by length before cutting it into batches,
    so a batch holds sentences of similar length; bucket=False keeps the random order.
    Call set_epoch(e) before each epoch for a new, reproducible order.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        bucket: bool = True,
        shuffle: bool = True,
        pool_size: int = 4096,
        seed: int = 0,
    ):
        self.lengths = [check_int("length", n, minimum=1) for n in lengths]
        if not self.lengths:
            raise ValueError("lengths is empty: there is nothing to batch")
        self.max_tokens = check_int("max_tokens", max_tokens, minimum=max(self.lengths))
        self.pool_size = check_int("pool_size", pool_size, minimum=1)
        self.bucket, self.shuffle, self.seed, self.epoch = bucket, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int("epoch", epoch, minimum=0)

    def batches(self) -> list[list[int]]:
        """This epoch's batches (the same list every time for the same seed and epoch)."""
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)
        batches = []
        for start in range(0, len(order), self.pool_size):
            pool = order[start : start + self.pool_size]
            if self.bucket:
                pool.sort(key=lambda i: self.lengths[i])
            batch, longest = [], 0
            for i in pool:
                longest_if_added = max(longest, self.lengths[i])
                if batch and longest_if_added * (len(batch) + 1) > self.max_tokens:
                    batches.append(batch)
                    batch, longest_if_added = [], self.lengths[i]
                batch.append(i)
                longest = longest_if_added
            if batch:
                batches.append(batch)
        if self.shuffle:
            rng.shuffle(batches)  # long and short batches mixed through the epoch
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())


# %%
#| export
def padding_fraction(batches: Sequence[Sequence[int]], *lengths: Sequence[int]) -> float:
    """The share of padded positions that are padding, over all batches and all tensors.

    Pass one lengths list per tensor that is padded separately (e.g. the source and the
    target lengths): each tensor of a batch is padded to its own longest sequence.
    """
    if not lengths:
        raise ValueError("give at least one list of lengths, one per padded tensor")
    real = padded = 0
    for batch in batches:
        if len(batch) == 0:
            raise ValueError("a batch is empty")
        for tensor_lengths in lengths:
            real += sum(tensor_lengths[i] for i in batch)
            padded += max(tensor_lengths[i] for i in batch) * len(batch)
    return 1.0 - real / padded


# %%
MAX_LEN = 32  # positions of the model; the longest pair has far fewer tokens
datasets = {
    split: TranslationDataset(
        [(en, de) for _, en, de in rows], src_tokenizer, tgt_tokenizer, MAX_LEN
    )
    for split, rows in corpus.items()
}
src_ids, tgt_ids = datasets["train"][0]
print(src_ids.tolist(), tgt_ids.tolist(), sep="\n")
print("longest pair:", max(max(ds.lengths) for ds in datasets.values()), "tokens")
print(
    error_of(
        TranslationDataset, [(example_en, example_de)], src_tokenizer, tgt_tokenizer, max_len=8
    )
)

# %%
batch = collate_translations([datasets["train"][i] for i in range(3)])
for name, t in zip(("src", "tgt_in", "tgt_out", "src_lengths"), batch, strict=False):
    print(f"{name:12s} {tuple(t.shape)}")
src, tgt_in, tgt_out, src_lengths = batch
beyond = torch.arange(src.size(1)) >= src_lengths[:, None]  # (B, T_src): past each length
assert beyond.any() and not beyond.all(dim=0).any()  # some padding; no column of padding only
assert torch.equal(src == PAD, beyond)  # PAD exactly where the position is past the length
assert torch.equal(padding_mask(src_lengths, src.size(1))[:, 0, 0], ~beyond)  # the mask agrees
assert (tgt_in[:, 0] == BOS).all()
for row, (_, tgt_row) in enumerate(datasets["train"][i] for i in range(3)):
    n = len(tgt_row)  # BOS ... EOS
    assert torch.equal(tgt_in[row, : n - 1], tgt_row[:-1]) and torch.equal(
        tgt_out[row, : n - 1], tgt_row[1:]
    )
    assert (tgt_out[row, n - 1 :] == PAD).all()  # after EOS, only padding

# %% [markdown]
# How much padding does bucketing save? The same token budget, with and without sorting the
# pools, over one epoch of the training set. The source and the target are padded separately,
# each to its own longest in the batch, so the waste is counted over both tensors:

# %%
MAX_TOKENS = 2048
lengths = datasets["train"].lengths
bucketed = TokenBatchSampler(lengths, MAX_TOKENS, bucket=True, seed=0).batches()
random_batches = TokenBatchSampler(lengths, MAX_TOKENS, bucket=False, seed=0).batches()
src_lengths_train, tgt_lengths_train = datasets["train"].src_lengths, datasets["train"].tgt_lengths
waste_random = padding_fraction(random_batches, src_lengths_train, tgt_lengths_train)
waste_bucketed = padding_fraction(bucketed, src_lengths_train, tgt_lengths_train)
for name, batches_, waste_ in (
    ("random batches", random_batches, waste_random),
    ("length-bucketed", bucketed, waste_bucketed),
):
    print(
        f"{name:16s} {len(batches_):4d} batches of {np.mean([len(b) for b in batches_]):.0f} pairs on average, "
        f"{waste_:.1%} of src and tgt positions are padding"
    )

# %%
assert waste_bucketed <= waste_random / 2  # at most half the waste
assert sorted(i for b in bucketed for i in b) == list(range(len(lengths)))  # each pair once
for batches_ in (bucketed, random_batches):  # the same budget for both, or the comparison is unfair
    assert all(len(b) * max(lengths[i] for i in b) <= MAX_TOKENS for b in batches_)
pairs_random = np.mean([len(b) for b in random_batches])
pairs_bucketed = np.mean([len(b) for b in bucketed])
# The prose below, with bounds for any seed:
assert 0.15 < waste_random < 0.25  # "a fifth" of the positions of random batches are padding
assert waste_bucketed < 0.1  # bucketed batches: "more than nine tenths real tokens"
assert 130 < pairs_random < 165 and 165 < pairs_bucketed < 195  # "some 145", "about 180"

# %% jupyter={"source_hidden": true}
fig, (ax_len, ax_waste) = plt.subplots(1, 2, figsize=(10, 3.4))
ax_len.hist(  # rwidth < 1: a gap between neighbouring lengths
    lengths, bins=range(min(lengths), max(lengths) + 2), color=COLORS["ours"], align="left", rwidth=0.85
)
ax_len.set(
    xlim=(min(lengths) - 0.6, max(lengths) + 0.6),  # the shortest and longest pairs at the edges
    xlabel="tokens in the longer side of a pair",
    ylabel="pairs",
    title="Lengths in the training set",
)
waste_per_batch = [
    100 * np.array([padding_fraction([b], src_lengths_train, tgt_lengths_train) for b in batches])
    for batches in (random_batches, bucketed)
]
ax_waste.hist(  # two lists: their bars side by side in each bin, neither hides the other
    waste_per_batch, bins=np.linspace(0, 36, 19), color=[OTHER_COLORS[0], OTHER_COLORS[1]],
    label=["random", "bucketed"], edgecolor="white", linewidth=0.5,
)  # fmt: skip
ax_waste.set(
    xlabel="padding in a batch, src and tgt (%)",
    ylabel="batches",
    title="Padding per batch, same token budget",
)
ax_waste.legend()
fig.tight_layout()
save_figure(fig, "13_padding_waste")
plt.show()

# %% [markdown]
# Random batches pad each sentence to the longest of some 145 random ones, and about a fifth of
# their positions are padding; bucketed batches are more than nine tenths real tokens (both
# bounded by the asserts above). (The budget
# counts a pair by its longer side, so bucketed batches, with fewer wasted positions, also fit
# more pairs: about 180.) The loader is then ordinary PyTorch: the sampler decides which
# indices go together, the collate function pads them.
#
# **Pad to the longest in the batch, batch by tokens, and bucket by length: the model's time
# goes to real tokens.**

# %%
train_loader = DataLoader(
    datasets["train"],
    batch_sampler=TokenBatchSampler(datasets["train"].lengths, MAX_TOKENS, seed=0),
    collate_fn=collate_translations,
)
valid_loader = DataLoader(
    datasets["valid"],
    batch_sampler=TokenBatchSampler(datasets["valid"].lengths, 4096, shuffle=False),
    collate_fn=collate_translations,
)
print(len(train_loader), "training batches,", len(valid_loader), "validation batches")

# %% [markdown]
# ## Training practice
#
# Notebook 11's loop was the minimum: Adam, the paper's schedule, clipping. Practitioners add a
# handful of habits, each small, each with a reason. They go into the module `practice`, one
# subsection each:
#
# 1. **AdamW**, with weight decay on the weight matrices only;
# 2. **warmup, then cosine decay** of the learning rate;
# 3. **gradient accumulation**: several micro-batches, one update;
# 4. **mixed precision**: the matrix products in 16 bits;
# 5. **gradient checkpointing**: activations recomputed in the backward pass instead of stored;
# 6. **early stopping** on the validation loss;
# 7. **checkpoints that resume exactly**, and the gradient's norm per block, for a gradient-flow
#    plot.
#
# "The training loop" then puts them into one function and checks it (a resumed run against an
# uninterrupted one, early stopping on a run that overfits) before "Training the model" trains
# the real one.

# %%
#| export practice
"""Training practice: AdamW groups, warmup + cosine, accumulation, mixed precision,
gradient checkpointing, early stopping, exact-resume checkpoints, the training loop."""

import math
import os
import random
import types
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import asdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.decoding import eval_mode
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.train import Trainer
from transformer_from_scratch.train import atomic_save
from transformer_from_scratch.train import token_loss


# %% [markdown]
# ### AdamW, and what not to decay
#
# Weight decay pulls weights towards zero, a mild preference for small weights. Adam folds an
# L2 penalty into its adaptive step, where it is rescaled per parameter and stops meaning
# "decay"; **AdamW** (Loshchilov and Hutter, 2019) applies the decay *decoupled*, directly to the
# weights, $\theta \leftarrow \theta - \eta\lambda\theta$, beside the Adam step. Not every
# parameter should shrink: a LayerNorm gain of 1 is the identity, and a bias is an offset, which
# no weight decay was meant to pull towards zero. The rule the course uses, nanoGPT's
# (`configure_optimizers`: every parameter with two or more dimensions decays) and in effect
# Hugging Face's `Trainer`'s (everything but biases and norm weights): decay every matrix,
# embedding tables included, and nothing else. Some recipes exempt the embeddings too (an
# embedding row is updated only when its token appears, while AdamW's decay shrinks every row at
# every step); the course keeps one policy for all its optimizers (notebook 15's builds its
# AdamW with the same groups).

# %%
#| export practice
def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on every matrix (embeddings too); none on biases and norm gains."""
    weight_decay = check_float("weight_decay", weight_decay, 0.0)
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)  # matrices; vectors (gains, biases)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def check_adam_settings(betas: tuple[float, float], eps: float) -> None:
    """Adam's betas must be a pair in [0, 1) and eps positive: a ValueError names the bad one."""
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for beta in betas:
        check_float("betas", beta, 0.0, 1.0, high_open=True)
    check_float("eps", eps, 0.0, low_open=True)


def make_adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.98),
    eps: float = 1e-9,
) -> torch.optim.AdamW:
    """AdamW over param_groups(model, weight_decay): every AdamW of the course is built here."""
    check_adam_settings(betas, eps)
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps)


# %%
probe = Transformer(
    src_tokenizer.vocab_size,
    tgt_tokenizer.vocab_size,
    d_model=64,
    num_heads=4,
    d_ff=128,
    num_layers=2,
)
decay_group, no_decay_group = param_groups(probe, weight_decay=0.01)
print(
    f"decay:    {len(decay_group['params']):3d} tensors, {sum(p.numel() for p in decay_group['params']):7,d} weights"
)
print(
    f"no decay: {len(no_decay_group['params']):3d} tensors, {sum(p.numel() for p in no_decay_group['params']):7,d} weights"
)

# %%
no_decay_ids = {id(p) for p in no_decay_group["params"]}
for name, p in probe.named_parameters():
    is_norm_or_bias = "norm" in name or name.endswith("bias")  # embeddings and matrices decay
    assert (id(p) in no_decay_ids) == is_norm_or_bias, name


# %% [markdown]
# ### Warmup, then cosine decay
#
# Adam's moment estimates are poor in the first steps, and a full learning rate then can throw
# the weights far off; a linear **warmup** ramps the rate up. The paper's schedule, which the
# main source tutorial, "Deep Learning: Transformers", uses (notebook 11), then decays like $1/\sqrt{t}$: $\eta_t = \eta_\max \min\bigl(t/t_w, \sqrt{t_w/t}\bigr)$, which
# never reaches zero and needs no idea of how long training lasts. When the number of steps is
# known, most recipes today decay along a half cosine to a small floor instead:
#
# $$\eta_t = \eta_\max\Bigl(r + (1 - r)\,\tfrac12\bigl(1 + \cos \pi\,\tfrac{t - t_w}{T - t_w}\bigr)\Bigr), \quad t \ge t_w,$$
#
# so the last steps take small, careful steps near the minimum. The cell below checks
# `warmup_cosine` step by step against PyTorch's own schedulers, `LinearLR` for the warmup and
# `CosineAnnealingLR` for the decay.

# %%
#| export practice
def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak rate: linear warmup to 1, then a cosine down to min_ratio."""
    step = check_int("step", step, minimum=0)
    warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
    total_steps = check_int("total_steps", total_steps, minimum=warmup_steps + 1)
    min_ratio = check_float("min_ratio", min_ratio, 0.0, 1.0)
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # step 0 already gets a small, non-zero rate
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# %%
total_demo, warmup_demo = 1000, 100
cosine_curve = [
    warmup_cosine(s, warmup_demo, total_demo, min_ratio=0.05) for s in range(total_demo)
]
inverse_sqrt_curve = [
    min((s + 1) / warmup_demo, math.sqrt(warmup_demo / (s + 1))) for s in range(total_demo)
]
assert cosine_curve[warmup_demo - 1] == max(cosine_curve) == 1.0  # the peak ends the warmup
assert all(
    a >= b
    for a, b in zip(cosine_curve[warmup_demo:], cosine_curve[warmup_demo + 1 :], strict=False)
)


def builtin_rates(make_scheduler, steps: int) -> list[float]:
    """The learning rate (peak 1) at each step under one of PyTorch's own schedulers."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, rates = make_scheduler(optimizer), []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


# PyTorch's LinearLR for the warmup, then its CosineAnnealingLR down to the floor of 0.05.
builtin_curve = builtin_rates(
    lambda o: torch.optim.lr_scheduler.LinearLR(o, 1 / warmup_demo, 1.0, total_iters=warmup_demo - 1),
    warmup_demo,
) + builtin_rates(
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total_demo - warmup_demo, eta_min=0.05),
    total_demo - warmup_demo,
)  # fmt: skip
assert_close(cosine_curve, builtin_curve, rtol=0, atol=1e-9)  # the same schedule, step by step

# %% jupyter={"source_hidden": true}
fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.plot(cosine_curve, color=COLORS["ours"], label="warmup + cosine (used here)")
ax.plot(inverse_sqrt_curve, color=COLORS["torch"], label=r"warmup + $1/\sqrt{t}$ (the tutorial's)")
ax.axvline(warmup_demo, color="gray", lw=0.8, ls=":")
ax.set(
    xlabel="optimizer step",
    ylabel=r"learning rate / $\eta_{max}$",
    title="Learning-rate schedules, 100 warmup steps of 1000",
)
ax.legend()
fig.tight_layout()
save_figure(fig, "13_lr_schedule")
plt.show()


# %% [markdown]
# ### The loss, and gradient accumulation
#
# The loss is notebook 11's `sequence_loss`: cross-entropy over the real target tokens, PAD
# ignored, with label smoothing, on logits taken to float32 (which matters under mixed
# precision, below). With `reduction="sum"` it returns the *sum* instead of the mean, for the
# next idea, and notebook 11's `num_tokens` counts the tokens it graded.

# %% [markdown]
# A batch too big for memory can be split into $k$ **micro-batches** whose gradients add up
# before one optimizer step. The trap: averaging the $k$ mean losses is *not* the mean over the
# big batch when the micro-batches hold different numbers of real tokens (and sentences of
# different lengths make them do). The exact version sums each micro-batch's loss and divides by the tokens of all $k$:
#
# $$\nabla \frac{1}{N} \sum_{i \in \text{batch}} \ell_i = \sum_{j=1}^{k} \nabla \frac{1}{N} \sum_{i \in \text{micro}_j} \ell_i, \qquad N = \text{real tokens in all } k.$$
#
# The check: one batch of 48 pairs against 4 micro-batches of 12, dropout off so that both see
# the same network. The pairs are sorted by the length of their German side, so the four
# micro-batches are padded to different widths and hold different numbers of tokens (both
# printed): exactly the case where a plain average goes wrong. The exact sum is checked twice:
# written out here, and as notebook 11's `accumulate_gradients`, which the training loop below
# uses (it weights each micro-batch's *mean* by its share of the tokens, the same number).
#
# The tolerance is `assert_close`'s `rtol=1e-4, atol=1e-6`: each entry may differ by
# $10^{-6} + 10^{-4}\,|g|$, a few times $10^{-5}$ on this gradient's largest entries (the cell
# prints the most it allows, and the largest difference of each version). The exact versions
# must pass it, the naive mean of means must fail it.

# %% tags=["nbval-ignore-output"]
def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


set_seed(0)
accum_model = Transformer(
    src_tokenizer.vocab_size,
    tgt_tokenizer.vocab_size,
    d_model=64,
    num_heads=4,
    d_ff=128,
    num_layers=2,
    dropout_p=0.0,
).to(device)
pairs = sorted((datasets["train"][i] for i in range(48)), key=lambda pair: len(pair[1]))  # by length
big_batch = collate_translations(pairs)
micro = [collate_translations(pairs[j : j + 12]) for j in range(0, 48, 12)]

accum_model.zero_grad()
loss_big, tokens_big = sequence_loss(accum_model, big_batch, label_smoothing=0.1), num_tokens(big_batch)
loss_big.backward()
grads_big = gradients(accum_model)

accum_model.zero_grad()
tokens_all = sum(num_tokens(b) for b in micro)
for b in micro:
    loss_sum = sequence_loss(accum_model, b, label_smoothing=0.1, reduction="sum")
    (loss_sum / tokens_all).backward()  # gradients add up in .grad
grads_accumulated = gradients(accum_model)

accum_model.zero_grad()
accumulate_gradients(accum_model, micro, label_smoothing=0.1)  # the library's, for the loop
grads_library = gradients(accum_model)

accum_model.zero_grad()
for b in micro:  # the naive version: the mean of the k means
    (sequence_loss(accum_model, b, label_smoothing=0.1) / len(micro)).backward()
grads_naive = gradients(accum_model)
print("tokens per micro-batch:", [num_tokens(b) for b in micro], "total", tokens_big)
print("German widths:", [b[1].shape[1] for b in micro], "vs", big_batch[1].shape[1], "for all 48")
RTOL, ATOL = 1e-4, 1e-6  # assert_close's tolerance below: |a - b| <= ATOL + RTOL * |b|


def largest_difference(grads: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(grads, grads_big, strict=True))


naive_error = largest_difference(grads_naive)
exact_error = max(largest_difference(grads_accumulated), largest_difference(grads_library))
allowed = max(float((ATOL + RTOL * g.abs()).max()) for g in grads_big)
print(f"largest gradient difference: exact sums {exact_error:.0e}, mean of means {naive_error:.0e}; "
      f"the tolerance allows at most {allowed:.1e}")  # fmt: skip

# %%
assert len({b[1].shape[1] for b in micro}) > 1  # the micro-batches have different widths
assert len({num_tokens(b) for b in micro}) > 1  # and different token counts
for g_acc, g_lib, g_big in zip(grads_accumulated, grads_library, grads_big, strict=True):
    assert_close(g_acc, g_big, rtol=RTOL, atol=ATOL)  # the same update, to float tolerance
    assert_close(g_lib, g_big, rtol=RTOL, atol=ATOL)
naive_passes = all(
    torch.allclose(g_naive, g_big, rtol=RTOL, atol=ATOL)
    for g_naive, g_big in zip(grads_naive, grads_big, strict=True)
)
assert not naive_passes and naive_error > 10 * allowed  # the mean of means: another gradient


# %% [markdown]
# ### Mixed precision
#
# Most of a Transformer's time goes into matrix products, and those run faster in 16-bit
# floats on hardware built for them. `torch.amp.autocast` runs chosen operations (matmuls,
# linear layers) in a 16-bit type; the weights and the optimizer stay float32. Which
# operations it holds in float32 depends on the device: on a CUDA GPU the precision-sensitive
# ones (softmax, layer norm, the losses); on the CPU only the losses and a list of delicate ops,
# so there a softmax of bfloat16 scores runs in bfloat16 (try `F.softmax(x.bfloat16(), -1)`
# under `torch.autocast("cpu")`). In this course's model the norms see float32 all the same,
# because the residual stream stays float32 (a float32 tensor plus a bfloat16 sublayer output
# is float32), and the loss is computed on logits cast to float32. Two 16-bit formats:
#
# | | exponent bits | mantissa bits | range | needs loss scaling |
# |---|---|---|---|---|
# | float16 | 5 | 10 | up to 65,504; tiny gradients underflow to 0 | yes: `torch.amp.GradScaler` |
# | bfloat16 | 8 | 7 | float32's | no |
#
# float16 needs a **gradient scaler**: multiply the loss by a large factor so that small
# gradients stay representable, divide the gradients back before the step, and skip a step
# whose gradients overflowed. (The second source tutorial, "Building a Transformer from Scratch
# in PyTorch", imports these from `torch.cuda.amp`, which is deprecated; `torch.amp` is the current API, with the device type as first argument.) On
# the CPU autocast takes bfloat16 and, in recent PyTorch, float16 as well; few CPUs have
# float16 arithmetic (and some have bfloat16), so this notebook measures bfloat16 on the CPU,
# and `train_translation` below refuses float16 there. On a CUDA GPU the cell below also
# measures float16 with the scaler.

# %%
#| export practice
def amp_autocast(device: torch.device, amp_dtype: str | None):
    """torch.amp.autocast for the device in amp_dtype, or a no-op context for float32."""
    dtype = getattr(torch, amp_dtype) if amp_dtype else None
    return torch.amp.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# %% tags=["nbval-ignore-output"]
set_seed(0)
amp_model = Transformer(
    src_tokenizer.vocab_size,
    tgt_tokenizer.vocab_size,
    d_model=128,
    num_heads=4,
    d_ff=512,
    num_layers=2,
    dropout_p=0.0,
).to(device)
amp_batch = collate_translations([datasets["train"][i] for i in range(128)])
amp_dtypes = [None, "bfloat16"] + (["float16"] if device.type == "cuda" else [])


def train_step(amp_dtype):
    amp_model.zero_grad()
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == "float16")
    with amp_autocast(device, amp_dtype):
        loss = sequence_loss(amp_model, amp_batch)
    scaler.scale(loss).backward()
    return loss


amp_seconds = {
    name or "float32": time_call(lambda name=name: train_step(name), repeats=3)
    for name in amp_dtypes
}
for name, seconds in amp_seconds.items():
    print(
        f"{name:9s} forward + backward: {1000 * seconds:6.1f} ms  ({amp_seconds['float32'] / seconds:.2f}x)"
    )


# %% tags=["nbval-ignore-output"]
def step_gradient(amp_dtype) -> torch.Tensor:
    """The whole gradient of one step, flattened (its direction: float16's scaling cancels)."""
    train_step(amp_dtype)  # the loss is not needed: its gradients are in .grad
    return torch.cat([p.grad.float().flatten() for p in amp_model.parameters()])


grad_fp32 = step_gradient(None)
for name in amp_dtypes[1:]:
    with amp_autocast(device, name):  # proof that autocast really runs the products in 16 bits
        assert amp_model.out_proj(torch.ones(2, 128, device=device)).dtype == getattr(torch, name)
    grad_16 = step_gradient(name)
    # In float64: summed in float32, a million products can round the cosine to above 1.
    cosine = float(torch.nn.functional.cosine_similarity(grad_16.double(), grad_fp32.double(), dim=0))
    print(f"{name}: cosine between its gradient and float32's {cosine:.5f}")
    assert cosine > 0.99 and not torch.equal(grad_16, grad_fp32), (
        name,
        cosine,
    )  # same direction, other bits


# %% [markdown]
# The 16-bit step's gradient points the same way as float32's (cosine above 0.99) without being
# identical: the products really ran in 16 bits. This model is untrained, which is enough to show
# that autocast works, but not that it is accurate where it matters: an untrained model's
# outputs are nearly uniform whatever the arithmetic. The same comparison, and the loss and
# accuracy, are repeated on the trained model after training.
#
# The speed depends on the processor, and on how busy it is: CPUs with bfloat16 instructions
# (recent Intel Xeons with AMX or AVX-512 BF16, AMD Zen 4) run the products faster, others lose
# time converting every number and can be several times slower. The timing cell prints what the
# machine that ran it did; no assert rests on it. On a GPU the products run on tensor cores,
# which pays off for large matrices; steps as small as this notebook's (width 64 to 128, at most
# 2,048 tokens a batch) are bound by launching kernels more than by arithmetic, so 16 bits need
# not make them faster.
#
# The training below stays in float32 on the CPU: many CPUs have no bfloat16 instructions, and
# a float32 run is the reference the 16-bit results are compared with. On a GPU it uses
# bfloat16 autocast where the hardware has it (compute capability 8.0 and up), float16 with
# the gradient scaler otherwise. float32 does not make the numbers the same on every machine
# either (the order in which a matrix product adds its terms differs between libraries), which
# is why the trained model's scores below are printed and bounded, not asserted exactly.

# %% [markdown]
# ### Gradient checkpointing
#
# Backpropagation needs every block's intermediate activations, kept from the forward pass;
# for long sequences and deep stacks they dominate memory. **Gradient checkpointing** keeps only
# each block's *input* and runs the block's forward again during the backward pass: less
# memory, paid in time (roughly one more forward pass: about 1.3 times the step in arithmetic,
# and more where recomputing also repeats Python overheads). `torch.utils.checkpoint` does the
# work;
# the function below switches it on for every encoder and decoder block without changing the
# model's parameters or its `state_dict`.

# %%
#| export practice
def set_gradient_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Recompute each encoder and decoder block's activations in the backward pass (or stop)."""
    for block in [*model.encoder.layers, *model.decoder.layers]:
        if enabled:
            block.forward = types.MethodType(_checkpointed_forward, block)
        else:
            block.__dict__.pop("forward", None)  # the class's forward again
    return model


def _checkpointed_forward(block: nn.Module, *args, **kwargs):
    """The block's own forward under torch.utils.checkpoint: keep inputs, not activations."""
    if not (torch.is_grad_enabled() and block.training):
        return type(block).forward(block, *args, **kwargs)
    return checkpoint(
        lambda *a, **k: type(block).forward(block, *a, **k), *args, use_reentrant=False, **kwargs
    )


# %% tags=["nbval-ignore-output"]
def forward_backward():
    sequence_loss(amp_model, amp_batch).backward()


def measured_peak() -> int:
    """Peak memory of one forward + backward, gradients freed before (not during) it."""
    amp_model.zero_grad(set_to_none=True)
    return peak_memory(forward_backward, device if device.type == "cuda" else "cpu")


set_gradient_checkpointing(amp_model, False)
memory_plain = measured_peak()
grads_plain = gradients(amp_model)
set_gradient_checkpointing(amp_model, True)
memory_checkpointed = measured_peak()
grads_checkpointed = gradients(amp_model)
print(
    f"peak memory of forward + backward: {memory_plain / 2**20:.1f} MiB plain, "
    f"{memory_checkpointed / 2**20:.1f} MiB with checkpointing"
)

# %%
for g_ckpt, g_plain in zip(grads_checkpointed, grads_plain, strict=False):
    assert_close(g_ckpt, g_plain, rtol=1e-4, atol=1e-6)  # the same gradients
if device.type in ("cpu", "cuda"):  # on MPS the profiler sees the CPU, not the GPU's memory
    assert memory_checkpointed < 0.8 * memory_plain  # and less memory

# %% tags=["nbval-ignore-output"]
step_times = {True: [], False: []}  # checkpointing on, off
for _ in range(5):  # interleaved, so that a busy moment of the machine slows both alike
    for enabled in (True, False):
        set_gradient_checkpointing(amp_model, enabled)
        step_times[enabled].append(time_call(forward_backward, warmup=1, repeats=1))
seconds_checkpointed, seconds_plain = min(step_times[True]), min(step_times[False])  # the fastest
print(
    f"time: {1000 * seconds_plain:.0f} ms plain, {1000 * seconds_checkpointed:.0f} ms with checkpointing "
    f"({seconds_checkpointed / seconds_plain:.2f}x)"
)

# %%
amp_blocks = [*amp_model.encoder.layers, *amp_model.decoder.layers]
assert not any("forward" in vars(block) for block in amp_blocks)  # switched off by the loop's end
set_gradient_checkpointing(amp_model, True)
assert all(vars(block)["forward"].__func__ is _checkpointed_forward for block in amp_blocks)  # on
set_gradient_checkpointing(amp_model, False)
assert not any("forward" in vars(block) for block in amp_blocks)  # and off again


# %% [markdown]
# The printout is the machine's that ran the cell, each time the fastest of five steps, the two
# kinds taken in turn. On a quiet machine checkpointing costs time, as it should; a machine busy
# with other jobs can show anything. No assert rests on these times; the memory and the
# gradients are what is checked above.
#
# **Accumulation trades steps for memory, mixed precision trades bits for speed, and
# checkpointing trades time for memory; each is checked to change nothing else.**

# %% [markdown]
# ### Early stopping
#
# The validation loss says when more training stops helping: when it has not improved for
# `patience` epochs, stop, and keep the weights of the best epoch, not the last.

# %%
#| export practice
class EarlyStopping:
    """Stop when the validation loss has not improved for `patience` epochs in a row."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience = check_int("patience", patience, minimum=1)
        self.min_delta = check_float("min_delta", min_delta, 0.0)
        self.best, self.best_epoch, self.bad_epochs = math.inf, -1, 0

    def step(self, epoch: int, val_loss: float) -> bool:
        """Record an epoch's validation loss; True if it is the best so far."""
        if val_loss < self.best - self.min_delta:
            self.best, self.best_epoch, self.bad_epochs = float(val_loss), epoch, 0
            return True
        self.bad_epochs += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.bad_epochs >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.bad_epochs = state["bad_epochs"]


# %%
stopper = EarlyStopping(patience=2)
for epoch, val_loss in enumerate([2.0, 1.2, 0.9, 0.95, 0.91, 0.8]):
    improved = stopper.step(epoch, val_loss)
    print(
        f"epoch {epoch}: val loss {val_loss:.2f}  {'best so far' if improved else f'no better ({stopper.bad_epochs})'}"
    )
    if stopper.should_stop:
        print("stop; best epoch", stopper.best_epoch)
        break
assert (stopper.best_epoch, epoch) == (2, 4)


# %% [markdown]
# ### Checkpoints that resume exactly
#
# A long run gets interrupted: a preempted Colab session, a crash, a laptop lid. A checkpoint
# worth the name lets training continue as if nothing happened, and that needs more than the
# weights: the optimizer's moments, the scheduler's step, the early-stopping counters, the
# history, and the state of **every random generator** (dropout draws from torch's; data order
# from the sampler's seed and epoch). The file is written to a temporary name and renamed,
# so a crash during the write leaves the previous checkpoint whole; it is read back with
# `weights_only=True`, which loads tensors and plain Python values but never runs code from
# the file.

# %%
#| export practice
def rng_state() -> dict:
    """Every random generator training draws from: Python's, the CPU's and CUDA's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state saved. The generator states are byte tensors that must be on the
    CPU, wherever `load_training_state(..., map_location=...)` put them."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_training_state(path: str | os.PathLike, state: dict) -> Path:
    """Write a training state with notebook 11's atomic_save: old file or new, never half."""
    return atomic_save(state, path)


def load_training_state(path: str | os.PathLike, map_location=None) -> dict:
    """torch.load with weights_only=True: tensors and plain Python values, never code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=True)


# %% [markdown]
# The loop also records the gradient's norm per block at every step: a "gradient-flow" plot
# (the second source tutorial, "Building a Transformer from Scratch in PyTorch", recommends
# one), which shows whether any part's gradient vanishes or explodes. It does not show how fast a part learns: the norms are over groups of very
# different sizes (an embedding table against a block), and the step Adam takes is about the
# learning rate per weight whatever the gradient's size (notebook 09). The update relative to
# the weights, $\lVert \Delta W \rVert / \lVert W \rVert$ per step, would say that.

# %%
#| export practice
def layer_grad_norms(model: nn.Module) -> dict[str, float]:
    """The gradient's L2 norm per part of the model: embeddings, each block, the output head."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        parts = name.split(".")
        depth = 3 if parts[1:2] == ["layers"] else min(2, len(parts) - 1)  # encoder.layers.0
        key = ".".join(parts[:depth])
        groups.setdefault(key, []).append(p.grad.detach().float().norm())
    norms = torch.stack([torch.stack(g).norm() for g in groups.values()]).tolist()  # one sync
    return dict(zip(groups, norms, strict=True))


# %% [markdown]
# ## The training loop
#
# Everything above, in one function. Its settings live in a frozen dataclass, checked when it
# is made; one `update` takes $k$ micro-batches, scales, unscales, records and clips the
# gradients, and steps the optimizer, the scaler and the scheduler. Each epoch ends with a
# validation pass (mean loss per token and token accuracy), early stopping and the two
# checkpoints. One `tqdm.auto` progress bar over the whole run shows the steps in JupyterLab
# and Colab, redrawn at most every 2 seconds; a run that completes removes its bar
# (`leave=False`), and the cell that trains prints a line per epoch afterwards. A run that ends
# before its last step (the first training call below stops after epoch 1, and early stopping
# would too) leaves its bar where it stopped, drawn in red in JupyterLab: tqdm marks a loop that
# ended short of its total that way; it is not an error.

# %%
#| export practice
@dataclass(frozen=True)
class TrainConfig:
    """How to train: one place for every knob of train_translation."""

    epochs: int = 10
    lr: float = 2e-3  # the peak rate, reached after `warmup` updates
    weight_decay: float = 0.01
    warmup: int = 50  # updates of linear warm-up (notebook 15's Recipe names it alike)
    min_lr_ratio: float = 0.05
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    accum_steps: int = 1  # micro-batches per optimizer step
    betas: tuple[float, float] = (0.9, 0.98)  # the paper's Adam settings
    eps: float = 1e-9
    amp_dtype: str | None = None  # None (float32), "bfloat16" or "float16"
    gradient_checkpointing: bool = False
    patience: int = 3  # epochs without a better validation loss before stopping
    seed: int = 0

    def __post_init__(self):
        check_int("epochs", self.epochs, minimum=1)
        check_float("lr", self.lr, 0.0, low_open=True)
        check_float("weight_decay", self.weight_decay, 0.0)
        check_int("warmup", self.warmup, minimum=0)
        check_float("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_probability("label_smoothing", self.label_smoothing)
        check_float("clip_norm", self.clip_norm, 0.0, low_open=True)
        check_int("accum_steps", self.accum_steps, minimum=1)
        if self.amp_dtype is not None:
            check_choice("amp_dtype", self.amp_dtype, ("bfloat16", "float16"))
        check_adam_settings(self.betas, self.eps)
        check_int("patience", self.patience, minimum=1)


# %%
#| export practice
@torch.no_grad()
def evaluate_loss(
    model: nn.Module, loader, amp_dtype: str | None = None, label_smoothing: float = 0.0
) -> tuple[float, float]:
    """Mean cross-entropy per real target token and the share of tokens predicted right."""
    device = next(model.parameters()).device
    loss_sum, correct, tokens = 0.0, 0, 0
    with eval_mode(model):  # dropout off; the mode it came in is back afterwards, even on error
        for batch in loader:
            src, tgt_in, tgt_out, src_lengths = (t.to(device) for t in batch)
            with amp_autocast(device, amp_dtype):
                logits = model(
                    src, tgt_in,
                    src_mask=padding_mask(src_lengths, src.size(1)),
                    tgt_mask=causal_mask(tgt_in.size(1), device=device),
                )  # fmt: skip
            real = tgt_out != PAD  # (B, T)
            # the training loss's label smoothing, so that the curves compare
            loss_sum += token_loss(logits, tgt_out, label_smoothing, reduction="sum").item()
            correct += int(((logits.argmax(-1) == tgt_out) & real).sum())
            tokens += int(real.sum())
    return loss_sum / tokens, correct / tokens


# %% [markdown]
# The loop itself is notebook 11's `Trainer`, not a new one. What this notebook adds are its
# options: autocast and the scaler (mixed precision), a callback after the backward pass that
# records the gradient norms of every layer, and micro-batches grouped $k$ at a time from the
# loader (`micro_batch_groups`, the last group of an epoch shorter when $k$ does not divide the
# number of batches). Around it, `train_translation` keeps what is per epoch: the validation
# pass, early stopping, the checkpoints, and at the end the weights of the best epoch (from
# `best.pt`, or from memory when there is no folder). It is built below in four stages. The
# history it returns holds lists: per update, notebook 11's `loss`, `lr` and `grad_norm` (the
# total norm before clipping) and this notebook's `grad_norms` (a dict per part of the model);
# per epoch, `train_loss`, `val_loss` and `val_acc`.

# %%
#| export practice
def micro_batch_groups(loader: Iterable, k: int) -> Iterator[list]:
    """The batches of `loader` in lists of k (the micro-batches of one update); the last list
    holds what is left."""
    check_int("k", k, minimum=1)
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


# %% [markdown]
# **Stage 1, the configuration becomes a trainer.** AdamW with the groups above, the warmup and
# cosine schedule over the whole run, the scaler (active only for float16), and notebook 11's
# `Trainer` with the autocast context and the gradient-norm callback. The schedule's length is
# counted on epoch 0's batches, so that a resumed run gets the same schedule as an
# uninterrupted one.

# %%
#| export practice
def _make_trainer(model: nn.Module, train_loader, config: TrainConfig) -> tuple[Trainer, int]:
    """Notebook 11's Trainer with this notebook's optimizer, schedule, scaler and callback; and
    the number of updates per epoch."""
    device = next(model.parameters()).device
    optimizer = make_adamw(model, config.lr, config.weight_decay, config.betas, config.eps)
    sampler = getattr(train_loader, "batch_sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(0)  # count epoch 0's batches: a resumed run gets the same schedule
    steps_per_epoch = math.ceil(len(train_loader) / config.accum_steps)
    total_steps = max(config.epochs * steps_per_epoch, config.warmup + 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(s, config.warmup, total_steps, config.min_lr_ratio),
    )
    # Loss scaling keeps small float16 gradients from underflowing; bf16 and fp32 need none.
    scaler = torch.amp.GradScaler(device.type, enabled=config.amp_dtype == "float16")
    # Notebook 11's loop, extended: autocast around each forward pass, the scaler around each
    # backward, and the per-layer gradient norms measured where the gradients are complete.
    trainer = Trainer(
        model, optimizer, scheduler, label_smoothing=config.label_smoothing,
        clip_norm=config.clip_norm, autocast=partial(amp_autocast, device, config.amp_dtype),
        scaler=scaler,
    )  # fmt: skip
    trainer.add_callback(
        "after_backward", lambda t: t.history["grad_norms"].append(layer_grad_norms(t.model))
    )
    trainer.history.update(grad_norms=[], train_loss=[], val_loss=[], val_acc=[])
    return trainer, steps_per_epoch


# %% [markdown]
# **Stage 2, the end of an epoch.** The mean training loss of its updates, a validation pass
# (loss per token and token accuracy) into the history, and early stopping's verdict on it.

# %%
#| export practice
def _end_epoch(
    trainer: Trainer, valid_loader, config: TrainConfig, stopper: EarlyStopping, epoch: int,
    first_update: int,
) -> bool:  # fmt: skip
    """Validate, record the epoch in the history; True if its validation loss is the best yet."""
    history = trainer.history
    epoch_losses = history["loss"][first_update:]
    val_loss, val_acc = evaluate_loss(
        trainer.model, valid_loader, config.amp_dtype, config.label_smoothing
    )
    # The mean of the epoch's update losses (each its own token mean), a curve to watch.
    history["train_loss"].append(sum(epoch_losses) / len(epoch_losses))
    history["val_loss"].append(val_loss)
    history["val_acc"].append(val_acc)
    return stopper.step(epoch, val_loss)


# %% [markdown]
# **Stage 3, the checkpoints.** `last.pt` holds everything a resumed run needs; `best.pt` the
# weights of the best epoch so far. Both also hold the fingerprints of the tokenizers that made
# the ids (when the caller gives them): a resumed run with other tokenizers is refused, like one
# with another configuration (only `epochs` may differ, and a different number of epochs
# stretches or shrinks the schedule from the resume on), since the same ids would mean other
# pieces.

# %%
#| export practice
def _training_state(
    trainer: Trainer, stopper: EarlyStopping, epoch: int, config: TrainConfig,
    fingerprints: dict | None,
) -> dict:  # fmt: skip
    """Everything last.pt holds: what it takes to go on as if training had never stopped."""
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "early_stopping": stopper.state_dict(),
        "history": trainer.history,
        "rng": rng_state(),
        "epoch": epoch,
        "config": asdict(config),
        "fingerprints": fingerprints,
    }


def _resume(
    trainer: Trainer, stopper: EarlyStopping, state: dict, config: TrainConfig,
    fingerprints: dict | None,
) -> int:  # fmt: skip
    """Load last.pt's state into the run; refuse another configuration or other tokenizers.
    Return the epoch to continue with."""
    changed = {k: (v, getattr(config, k)) for k, v in state["config"].items()
               if k != "epochs" and getattr(config, k) != v}  # fmt: skip
    if changed:
        raise ValueError(
            f"the checkpoint was trained with another configuration: {changed} "
            "(stored, given); resuming would mix two runs"
        )
    if state.get("fingerprints") != fingerprints:
        raise ValueError(
            f"the checkpoint was trained with other tokenizers: fingerprints "
            f"{state.get('fingerprints')} stored, {fingerprints} given; their ids would mean "
            "other pieces to the model"
        )
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.scaler.load_state_dict(state["scaler"])
    stopper.load_state_dict(state["early_stopping"])
    trainer.history = state["history"]
    trainer.step = len(trainer.history["loss"])
    set_rng_state(state["rng"])
    return state["epoch"] + 1


# %% [markdown]
# **Stage 4, the run.** The arguments checked, a fresh start or a resume, then the epochs: one
# `fit` of the trainer over the epoch's groups of micro-batches, the end of the epoch, the
# checkpoints, and a stop when early stopping says so (or at `stop_after_epoch`, which simulates
# an interruption). A finished run ends with the weights of its best epoch.

# %%
#| export practice
def train_translation(
    model: nn.Module,
    train_loader,
    valid_loader,
    config: TrainConfig,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    stop_after_epoch: int | None = None,
    progress: bool = True,
    fingerprints: dict[str, str] | None = None,
) -> dict:
    """Train with everything in this notebook; return the history (losses, rates, grad norms).

    Each epoch ends with a validation pass, early stopping and, with checkpoint_dir, two
    checkpoints: last.pt (everything needed to resume exactly) and best.pt (the best weights,
    loaded back into the model at the end). stop_after_epoch simulates an interruption.
    fingerprints (e.g. {"src": ..., "tgt": ...}, the tokenizers' fingerprints) are stored in
    both; resuming with other ones is refused.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if fingerprints is not None and not (
        isinstance(fingerprints, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprints.items())
    ):
        raise TypeError(f"fingerprints must be a dict of str to str, got {fingerprints!r}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs the checkpoint_dir to resume from")
    device = next(model.parameters()).device
    if config.amp_dtype == "float16" and device.type == "cpu":
        raise ValueError(
            "float16 autocast is for GPUs here (few CPUs compute in float16, and its loss "
            "scaling buys nothing there); on the CPU use amp_dtype='bfloat16'"
        )
    set_gradient_checkpointing(model, config.gradient_checkpointing)
    trainer, steps_per_epoch = _make_trainer(model, train_loader, config)
    stopper = EarlyStopping(config.patience)
    start_epoch, best_state = 0, None
    directory = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if resume:
        state = load_training_state(directory / "last.pt", map_location=device)
        start_epoch = _resume(trainer, stopper, state, config, fingerprints)
    else:
        torch.manual_seed(config.seed)  # dropout draws the same masks on every run
    history = trainer.history
    sampler = getattr(train_loader, "batch_sampler", None)

    # One bar for the whole run (its total counts epoch 0's steps per epoch, an estimate), gone
    # when training ends. One redraw every 2 s at most: a bar that redraws every step floods
    # the notebook's message channel (and nbval, which reads it after the cell).
    bar = tqdm(
        total=(config.epochs - start_epoch) * steps_per_epoch,
        desc="training",
        leave=False,
        mininterval=2.0,
        disable=not progress,
    )
    for epoch in range(start_epoch, config.epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # a new order, the same on every run
        first = len(history["loss"])
        bar.set_description(f"epoch {epoch + 1}/{config.epochs}")
        trainer.fit(micro_batch_groups(train_loader, config.accum_steps), progress=bar)
        improved = _end_epoch(trainer, valid_loader, config, stopper, epoch, first)
        if improved and directory is None:  # no folder: the best weights are kept in memory
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if directory is not None:
            state = _training_state(trainer, stopper, epoch, config, fingerprints)
            if improved:
                best = {"model": state["model"], "epoch": epoch, "fingerprints": fingerprints}
                save_training_state(directory / "best.pt", best)
            save_training_state(directory / "last.pt", state)
        if stopper.should_stop or (stop_after_epoch is not None and epoch + 1 >= stop_after_epoch):
            break
    bar.close()
    model.eval()
    if stop_after_epoch is None:  # a finished run ends with the weights of its best epoch
        if directory is not None and (directory / "best.pt").exists():
            best_state = load_training_state(directory / "best.pt", map_location=device)["model"]
        if best_state is not None:
            model.load_state_dict(best_state)
    set_gradient_checkpointing(model, False)
    return history


# %% [markdown]
# With `accum_steps=4`, `micro_batch_groups` hands the trainer the epoch's batches four at
# a time; an epoch whose count is not a multiple of four ends with a smaller update. On this
# notebook's training batches (the sampler's batches of indices: the same grouping, no data
# loaded):

# %%
groups = [len(group) for group in micro_batch_groups(train_loader.batch_sampler, 4)]
assert sum(groups) == len(train_loader) and set(groups[:-1]) == {4} and 1 <= groups[-1] <= 4
print(f"{len(train_loader)} batches an epoch -> {len(groups)} updates of 4 micro-batches, "
      f"the last of {groups[-1]}")

# %% [markdown]
# **The check that matters for checkpoints:** train a small model for 3 epochs in one go; train
# the same model for 2 epochs, "crash", build a *new* model with other weights, resume it from
# the checkpoint and finish. Both must end with exactly the same weights: on the CPU
# `torch.equal` on every weight, not a tolerance. Dropout is on, so the random generators must
# really be restored. On a GPU, kernels that sum with atomic additions add in a varying order,
# so there the check allows float rounding, and leaves out the key projections' biases (the
# note after the check says why).
#
# And the negative controls, to show the check can fail: the same resume from a copy of the
# checkpoint that lacks one piece of the state, once with another random generator state
# (other dropout masks in epoch 3) and once with the optimizer's moments emptied (Adam starts
# its averages again). Each must end somewhere else: off by more than the tolerance the GPU
# branch allows (`assert_close(rtol=1e-3, atol=1e-4)`, asserted to fail for each). Last, the
# checkpoint holds the two tokenizers' fingerprints: resuming with another German tokenizer is
# refused before any step.

# %% tags=["nbval-ignore-output"]
small_pairs = torch.utils.data.Subset(datasets["train"], range(600))
small_lengths = [datasets["train"].lengths[i] for i in range(600)]
small_loader = DataLoader(
    small_pairs,
    batch_sampler=TokenBatchSampler(small_lengths, 1024, seed=1),
    collate_fn=collate_translations,
)
small_valid = DataLoader(
    datasets["valid"],
    batch_sampler=TokenBatchSampler(datasets["valid"].lengths[:200], 4096, shuffle=False),
    collate_fn=collate_translations,
)
small_config = TrainConfig(epochs=3, lr=1e-3, warmup=5, seed=1)
FINGERPRINTS = {"src": src_tokenizer.fingerprint(), "tgt": tgt_tokenizer.fingerprint()}


def compared(model: Transformer) -> list[torch.Tensor]:
    """The weights a GPU run can reproduce: all but the key projections' biases (see the note
    after the check)."""
    return [w for name, w in model.state_dict().items() if not name.endswith("W_k.bias")]


def small_model(seed: int) -> Transformer:
    set_seed(seed)
    return Transformer(
        src_tokenizer.vocab_size,
        tgt_tokenizer.vocab_size,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_layers=1,
        dropout_p=0.1,
        max_len=MAX_LEN,
    ).to(device)


with tempfile.TemporaryDirectory() as tmp:
    straight = small_model(seed=1)
    history_straight = train_translation(
        straight,
        small_loader,
        small_valid,
        small_config,
        checkpoint_dir=Path(tmp) / "a",
        progress=False,
    )
    interrupted = small_model(seed=1)
    train_translation(
        interrupted,
        small_loader,
        small_valid,
        small_config,
        checkpoint_dir=Path(tmp) / "b",
        stop_after_epoch=2,
        progress=False,
        fingerprints=FINGERPRINTS,
    )
    after_two = load_training_state(Path(tmp) / "b" / "last.pt")  # the state at the "crash"
    resumed = small_model(seed=2)  # other weights: all must come from the checkpoint
    history_resumed = train_translation(
        resumed,
        small_loader,
        small_valid,
        small_config,
        checkpoint_dir=Path(tmp) / "b",
        resume=True,
        progress=False,
        fingerprints=FINGERPRINTS,
    )
    checkpoint_keys = sorted(load_training_state(Path(tmp) / "b" / "last.pt"))
    other_tokenizers = error_of(
        train_translation, small_model(seed=2), small_loader, small_valid, small_config,
        checkpoint_dir=Path(tmp) / "b", resume=True, progress=False,
        fingerprints={**FINGERPRINTS, "tgt": src_tokenizer.fingerprint()},  # a wrong tokenizer
    )  # fmt: skip
    controls, controls_close = {}, {}
    for missing in ("another random generator state", "emptied optimizer moments"):
        state = dict(after_two)
        if missing == "another random generator state":
            torch.manual_seed(123)
            state["rng"] = rng_state()  # a valid state, but not the one of the crash
        else:
            state["optimizer"] = {**after_two["optimizer"], "state": {}}  # no moments, step 0
        folder = Path(tmp) / missing.replace(" ", "_")
        save_training_state(folder / "last.pt", state)
        control = small_model(seed=2)
        train_translation(control, small_loader, small_valid, small_config,
                          checkpoint_dir=folder, resume=True, progress=False,
                          fingerprints=FINGERPRINTS)  # fmt: skip
        pairs_of_weights = list(zip(compared(straight), compared(control), strict=True))
        controls[missing] = max(float((a - b).abs().max()) for a, b in pairs_of_weights)
        # Would the control pass the GPU branch's tolerance below? It must not.
        controls_close[missing] = all(torch.allclose(b, a, rtol=1e-3, atol=1e-4) for a, b in pairs_of_weights)
print("a checkpoint holds:", checkpoint_keys)
print("resumed with other tokenizers:", other_tokenizers[:90], "...")
print("validation loss per epoch:", [round(x, 3) for x in history_resumed["val_loss"]])
for missing, difference in controls.items():
    print(f"resumed with {missing}: largest weight difference {difference:.1e}")

# %%
if device.type == "cpu":  # CPU kernels are deterministic: the same bits
    assert all(
        torch.equal(a, b)
        for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True)
    )
    assert history_straight["val_loss"] == history_resumed["val_loss"]
    assert history_straight["loss"] == history_resumed["loss"]
else:  # GPU kernels with atomic adds may vary in the last bits from run to run
    for a, b in zip(compared(straight), compared(resumed), strict=True):
        assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert_close(history_straight["val_loss"], history_resumed["val_loss"], rtol=1e-3, atol=1e-4)
for missing, difference in controls.items():  # the negative controls end elsewhere:
    assert difference > 1e-4 and not controls_close[missing], missing  # they fail the GPU check
assert "fingerprints" in checkpoint_keys and "other tokenizers" in other_tokenizers  # refused

# %% [markdown]
# *Why the GPU branch leaves out `W_k.bias`.* A key bias $b$ adds the same $q \cdot b$ to every
# score of a query, which the softmax ignores, so its gradient is zero in exact arithmetic and
# rounding noise in floating point. Adam, which divides a gradient by its own running size,
# turns that noise into real steps: two runs with different noise walk those biases apart
# without changing any output.

# %% [markdown]
# ### Early stopping on a run that overfits
#
# None of the runs so far gets worse with training: the resume run above is too short, and the
# `EarlyStopping` demonstration has made-up losses and no weights. A run that must overfit shows
# "keep the weights of the best epoch" at work: the small model without dropout, on 64 training
# pairs in batches of at most 128 tokens, at a high peak rate ($10^{-2}$), for up to 20 epochs
# with a patience of 3. Its training loss keeps falling (in the stored run to 1.236 at the
# stop; still well above the floor of 0.77 that label smoothing sets, computed below, so it has
# not memorised the 64 pairs yet). Its validation loss, on the same 200 unseen numbers as
# above, falls until epoch 8 in the stored run, then rises. (Those two numbers are the stored
# run's, printed by the cell; another machine's run may differ. They are asserted further down,
# under this run's own weight fingerprint, where "Training the model" introduces
# fingerprints.) No checkpoint folder is given, so `train_translation` keeps the best weights
# in memory. The check, for any run: the returned model's validation loss, measured again, is
# the lowest in the history, and not the last epoch's.

# %% tags=["nbval-ignore-output"]
overfit_loader = DataLoader(
    torch.utils.data.Subset(datasets["train"], range(64)),
    batch_sampler=TokenBatchSampler(datasets["train"].lengths[:64], 128, seed=0),
    collate_fn=collate_translations,
)
overfit_config = TrainConfig(epochs=20, lr=1e-2, warmup=5, patience=3, seed=0)
set_seed(0)
overfit_model = Transformer(
    src_tokenizer.vocab_size, tgt_tokenizer.vocab_size,
    d_model=32, num_heads=2, d_ff=64, num_layers=1, dropout_p=0.0, max_len=MAX_LEN,
).to(device)  # fmt: skip
overfit_history = train_translation(
    overfit_model, overfit_loader, small_valid, overfit_config, progress=False
)
overfit_best = int(np.argmin(overfit_history["val_loss"]))
returned_loss, _ = evaluate_loss(
    overfit_model, small_valid, overfit_config.amp_dtype, overfit_config.label_smoothing
)
for epoch, (train_loss, val_loss) in enumerate(
    zip(overfit_history["train_loss"], overfit_history["val_loss"], strict=True)
):
    mark = "  best" if epoch == overfit_best else ""
    print(f"epoch {epoch + 1:2d}  train loss {train_loss:.3f}  val loss {val_loss:.3f}{mark}")
print(f"the returned model's val loss: {returned_loss:.4f} "
      f"(best epoch's {overfit_history['val_loss'][overfit_best]:.4f}, "
      f"last epoch's {overfit_history['val_loss'][-1]:.4f})")  # fmt: skip

# %%
overfit_epochs = len(overfit_history["val_loss"])
assert overfit_best < overfit_epochs - 1  # the best epoch is not the last one
assert overfit_epochs - 1 - overfit_best == overfit_config.patience  # early stopping ended it
assert overfit_history["train_loss"][-1] < overfit_history["train_loss"][overfit_best]  # overfit
assert math.isclose(returned_loss, min(overfit_history["val_loss"]), rel_tol=1e-5)  # the best
assert not math.isclose(returned_loss, overfit_history["val_loss"][-1], rel_tol=1e-5)  # not last


# %% [markdown]
# **Resuming through early stopping.** The resume check above ran 3 epochs, too few for early
# stopping to act, so it could not tell whether a resumed run remembers its best loss so far and
# how long it has waited since: a `load_state_dict` of `EarlyStopping` that did nothing would have
# passed it. This overfitting run can tell. Run it again with a checkpoint folder, "crash" it one
# epoch after its best epoch, before early stopping ends it, and resume with a model of other
# weights: it must stop after the same epoch and return the same weights, the best epoch's, as the
# run that went straight through (on the CPU `torch.equal` on every weight again). The negative control resumes
# from a copy of the checkpoint whose early-stopping state is a new one's: it has forgotten the
# best loss, takes the first epoch after the crash for a new best, waits `patience` epochs from
# there, and returns that later, worse epoch's weights. The printout measures the validation
# loss of the weights each run returned.

# %% tags=["nbval-ignore-output"]
def overfit_run(folder: Path, seed: int = 0, **options) -> tuple[Transformer, dict]:
    """The overfitting run above, with checkpoints in `folder` (options: a crash or a resume)."""
    set_seed(seed)
    run_model = Transformer(
        src_tokenizer.vocab_size, tgt_tokenizer.vocab_size,
        d_model=32, num_heads=2, d_ff=64, num_layers=1, dropout_p=0.0, max_len=MAX_LEN,
    ).to(device)  # fmt: skip
    run_history = train_translation(run_model, overfit_loader, small_valid, overfit_config,
                                    checkpoint_dir=folder, progress=False, **options)  # fmt: skip
    return run_model, run_history


crash_after = overfit_best + 2  # epochs run before the crash: the best one and one more
with tempfile.TemporaryDirectory() as tmp:
    through_model, through_history = overfit_run(Path(tmp) / "straight")
    overfit_run(Path(tmp) / "crash", stop_after_epoch=crash_after)
    at_crash = load_training_state(Path(tmp) / "crash" / "last.pt")
    resumed_model, resumed_history = overfit_run(Path(tmp) / "crash", seed=1, resume=True)
    forgetful = {**at_crash, "early_stopping": EarlyStopping(overfit_config.patience).state_dict()}
    save_training_state(Path(tmp) / "forgetful" / "last.pt", forgetful)
    forgetful_model, forgetful_history = overfit_run(Path(tmp) / "forgetful", seed=1, resume=True)
crash_state = at_crash["early_stopping"]  # EarlyStopping counts epochs from 0
print(f"at the crash (after epoch {crash_after}) the early-stopping state was {crash_state} "
      f"(best_epoch counts from 0: epoch {crash_state['best_epoch'] + 1} of the table above)")  # fmt: skip
returned_losses = {}
for name, run_model, run_history in (
    ("straight through", through_model, through_history),
    ("crashed, resumed", resumed_model, resumed_history),
    ("resumed, early stopping forgotten", forgetful_model, forgetful_history),
):
    returned_losses[name], _ = evaluate_loss(  # the weights it returned, measured again
        run_model, small_valid, overfit_config.amp_dtype, overfit_config.label_smoothing
    )
    print(f"{name:34s} stopped after epoch {len(run_history['val_loss']):2d}; the weights it "
          f"returned: val loss {returned_losses[name]:.4f}")
print("val loss per epoch (straight):", [round(x, 4) for x in through_history["val_loss"]])

# %%
assert crash_after < len(through_history["val_loss"])  # the crash came before the stop
assert at_crash["early_stopping"]["bad_epochs"] == 1  # one epoch past the best, waiting
assert len(resumed_history["val_loss"]) == len(through_history["val_loss"])  # stopped alike
if device.type == "cpu":
    assert through_history["val_loss"] == overfit_history["val_loss"]  # checkpoints change nothing
    assert resumed_history["val_loss"] == through_history["val_loss"]
    through_weights, resumed_weights = through_model.state_dict(), resumed_model.state_dict()
    assert all(torch.equal(w, resumed_weights[k]) for k, w in through_weights.items())  # every one
else:
    for a, b in zip(compared(through_model), compared(resumed_model), strict=True):
        assert_close(a, b, rtol=1e-3, atol=1e-4)
# The control: a new best right after the crash, so it runs on and returns a later epoch's weights.
assert len(forgetful_history["val_loss"]) > len(through_history["val_loss"])
assert returned_losses["resumed, early stopping forgotten"] > returned_losses["straight through"]
assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-4)
               for a, b in zip(compared(through_model), compared(forgetful_model), strict=True))  # fmt: skip

# %% [markdown]
# ## Training the model
#
# The model is notebook 10's `Transformer`, smaller than the default of the main source
# tutorial ("Deep Learning: Transformers") so that it trains in minutes on a CPU, even on one
# thread (every kernel that `make` starts has one, set in `tools/kernel.env`, and so had the
# stored run; the training cell prints its time):
# $d_\text{model} = 64$, 4 heads, $d_\text{ff} = 4 d_\text{model} = 256$ as in the paper, 2
# encoder and 2 decoder blocks, and no dropout: the validation loss reaches the floor that label
# smoothing sets (below), so there is no overfitting for dropout to prevent. On a GPU the same
# cell runs as it is, in bfloat16 autocast if the
# GPU has bfloat16 units (compute capability 8.0 and up), in float16 with the gradient scaler
# otherwise. The checkpoints go to `checkpoints/13_translation/` (gitignored).
#
# The training cell calls `train_translation` twice: once for epoch 1 (`stop_after_epoch=1`),
# after which it keeps a copy of the weights, the early checkpoint that "Where it fails" below
# evaluates; then with `resume=True`, which continues from `last.pt` through epoch 8. The
# resume check above showed the mechanism on a smaller model and less data: on the CPU, a run
# stopped and resumed was the same, bit for bit, as one call for all its epochs. The same code
# resumes here, and it saves training a second model for the early checkpoint. The cell prints
# its steps and the time they took on the machine that ran it (yours will differ); while it
# runs, a progress bar counts the steps (a viewer without Jupyter widgets, GitHub's for one,
# shows only the first state of each call's bar).

# %%
CHECKPOINTS = Path("checkpoints") / "13_translation"
set_seed(0)
model = Transformer(
    src_tokenizer.vocab_size, tgt_tokenizer.vocab_size,
    d_model=64, num_heads=4, d_ff=256, num_layers=2, dropout_p=0.0, max_len=MAX_LEN,
).to(device)  # fmt: skip


def cuda_has_bf16() -> bool:
    """bfloat16 in hardware, not emulated (the including_emulation argument came with torch 2.4)."""
    if device.type != "cuda":
        return False
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device)[0] >= 8


train_amp = ("bfloat16" if cuda_has_bf16() else "float16") if device.type == "cuda" else None
config = TrainConfig(
    epochs=8, lr=3e-3, warmup=60, min_lr_ratio=0.02, label_smoothing=0.1,
    patience=3, amp_dtype=train_amp, seed=0,
)  # fmt: skip
config_shown = ", ".join(  # all but amp_dtype: the device's, printed by the training cell
    f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config) if f.name != "amp_dtype"
)
print(f"{sum(p.numel() for p in model.parameters()):,d} parameters; TrainConfig({config_shown}); "
      "amp_dtype: the device's (None: float32 on the CPU)")  # fmt: skip

# %% tags=["nbval-ignore-output"]
start = time.perf_counter()
train_translation(  # epoch 1 ...
    model, train_loader, valid_loader, config, checkpoint_dir=CHECKPOINTS,
    fingerprints=FINGERPRINTS, stop_after_epoch=1,
)  # fmt: skip
early_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}  # for later
history = train_translation(  # ... then epochs 2 to 8, resumed from last.pt
    model, train_loader, valid_loader, config, checkpoint_dir=CHECKPOINTS,
    fingerprints=FINGERPRINTS, resume=True,
)  # fmt: skip
train_seconds = time.perf_counter() - start
for epoch, (train_loss, val_loss, val_acc) in enumerate(
    zip(history["train_loss"], history["val_loss"], history["val_acc"], strict=False), 1
):
    print(
        f"epoch {epoch:2d}  train loss {train_loss:.3f}  val loss {val_loss:.4f}  val token accuracy {val_acc:.2%}"
    )
print(f"{len(history['loss'])} steps in {train_seconds:.0f} s; amp_dtype={config.amp_dtype!r}")

# %% [markdown]
# Early stopping, checked against the history: the best epoch is the one of lowest validation
# loss, the run either used all its epochs or stopped exactly `patience` epochs after its best,
# the returned model holds `best.pt`'s weights, and the checkpoints name the tokenizers. In the
# stored run all 8 epochs ran and the best was the last (validation loss 0.7684), so `best.pt`
# is also the last epoch's weights: here the check would not notice a loop that forgot to load
# it back. The overfitting run above, whose best epoch came before its last, is the test of that.

# %%
last_state = load_training_state(CHECKPOINTS / "last.pt")
best_state = load_training_state(CHECKPOINTS / "best.pt")
best_epoch = int(np.argmin(history["val_loss"]))  # 0-based, as EarlyStopping counts
assert last_state["early_stopping"]["best_epoch"] == best_state["epoch"] == best_epoch
assert last_state["early_stopping"]["best"] == min(history["val_loss"])  # the same float, kept
epochs_run = len(history["val_loss"])
assert epochs_run == config.epochs or epochs_run - 1 - best_epoch == config.patience
# The returned weights are best.pt's (when best.pt is also the last epoch's, see above).
assert all(torch.equal(p, best_state["model"][k].to(p.device)) for k, p in model.state_dict().items())
assert last_state["fingerprints"] == best_state["fingerprints"] == FINGERPRINTS
assert max(history["val_acc"]) > 0.97  # next-token accuracy on unseen numbers


# %% [markdown]
# Some findings quoted below are this run's (the early model's error counts, the
# cross-attention). They are asserted only when the weights are the stored run's: `STORED_RUN`
# compares a hash of every weight's bits with the stored run's, as in notebook 12. The same
# hash of the overfitting run's returned weights checks the two numbers its section quoted
# (1.236, and the fall until epoch 8).

# %% tags=["nbval-ignore-output"]
def weights_fingerprint(m: nn.Module) -> str:
    """A short hash of every weight's bits: equal only for the very same trained run."""
    digest = hashlib.sha256()
    for name, tensor in m.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


STORED_RUN = weights_fingerprint(model) == "09aef082c23a41ce"  # the run whose outputs are stored
print(f"the weights are the stored run's: {STORED_RUN}"
      + ("" if STORED_RUN else "; the claims about the stored run below are not checked here"))  # fmt: skip
overfit_stored = weights_fingerprint(overfit_model) == "e26e5558cff024bf"  # its best epoch's weights
print(f"the overfitting run's weights are the stored run's: {overfit_stored}")
if overfit_stored:  # what "Early stopping on a run that overfits" quoted from the stored run
    assert f"{overfit_history['train_loss'][-1]:.3f}" == "1.236"  # the training loss at the stop
    overfit_val = overfit_history["val_loss"]
    assert overfit_best == 7  # the best epoch is epoch 8
    assert all(a > b for a, b in zip(overfit_val[:8], overfit_val[1:8], strict=False))  # falls until it
    assert all(overfit_val[7] < v for v in overfit_val[8:])  # then above its best

# %% [markdown]
# Why does the loss stop near 0.77 and not at 0? Label smoothing (notebook 11) trains towards
# the target $q$ = $1 - \varepsilon + \varepsilon/V$ on the right token and $\varepsilon/V$ on each of
# the others, and cross-entropy against $q$ is never below $q$'s own entropy
# $H(q) = -\sum_k q_k \log q_k$. With $\varepsilon = 0.1$ and $V = 90$ German tokens that floor is:

# %%
eps, V_tgt = config.label_smoothing, tgt_tokenizer.vocab_size
q_target = torch.full((V_tgt,), eps / V_tgt)
q_target[0] += 1 - eps
smoothing_floor = float(-(q_target * q_target.log()).sum())
print(f"floor H(q) = {smoothing_floor:.4f} nats per token")

# %%
# Cross-entropy against q is never below H(q) (Gibbs' inequality); the check is the upper bound.
assert min(history["val_loss"]) - smoothing_floor < 0.03  # within 0.03 nats of the floor

# %% [markdown]
# ### Mixed precision, checked on the trained model
#
# An untrained model predicts nearly uniform probabilities, and its loss is close to
# $\ln 90$ whatever the arithmetic; the trained model is where 16-bit errors would show. The
# same validation set through the same weights, in float32 and under autocast (the loss and
# accuracy over the whole set; the logits and top tokens over its first batch; the whole
# gradient of each batch). In the stored output bfloat16 moved the validation loss by
# $6.4 \times 10^{-6}$ (in its sixth significant figure), the logits by at most 0.066, and no
# predicted token (the digits depend a little on the processor, whose bfloat16 instructions
# oneDNN picks); the asserts fail if the loss moves by 0.01, the accuracy by half a point, or a
# top token in a hundred changes.
#
# The gradient agrees less than on the untrained model: the trained model's loss sits at its
# floor, so its gradient is small, and bfloat16's rounding is a larger share of it (cosines of
# 0.983 to 0.996 per batch in the stored output, against 0.99 and more untrained). It still points
# the same way: the asserts fail if a batch's cosine falls to 0.8 or their mean to 0.9.

# %% tags=["nbval-ignore-output"]
check_amp = "bfloat16" if device.type != "cuda" or cuda_has_bf16() else "float16"
loss_fp32, acc_fp32 = evaluate_loss(model, valid_loader, None, config.label_smoothing)
loss_16, acc_16 = evaluate_loss(model, valid_loader, check_amp, config.label_smoothing)
src_v, tgt_in_v, tgt_out_v, lengths_v = (t.to(device) for t in next(iter(valid_loader)))
model.eval()
with torch.no_grad():
    masks_v = {
        "src_mask": padding_mask(lengths_v, src_v.size(1)),
        "tgt_mask": causal_mask(tgt_in_v.size(1), device=device),
    }
    logits_fp32 = model(src_v, tgt_in_v, **masks_v)
    with amp_autocast(device, check_amp):
        logits_16 = model(src_v, tgt_in_v, **masks_v)
real_v = tgt_out_v != PAD
same_argmax = float((logits_16.argmax(-1) == logits_fp32.argmax(-1))[real_v].float().mean())
print(
    f"validation loss: float32 {loss_fp32:.6f}, {check_amp} {loss_16:.6f} (difference {loss_16 - loss_fp32:+.1e})"
)
print(f"token accuracy:  float32 {acc_fp32:.4%}, {check_amp} {acc_16:.4%}")


def batch_gradient(m: nn.Module, batch, amp_dtype) -> torch.Tensor:
    """One batch's whole gradient, flattened (float16's loss scaled first; the cosine ignores it)."""
    m.zero_grad(set_to_none=True)
    with amp_autocast(device, amp_dtype):
        loss = sequence_loss(m, batch, label_smoothing=config.label_smoothing)
    (loss * (2.0**12 if amp_dtype == "float16" else 1.0)).backward()
    flat = torch.cat([p.grad.float().flatten() for p in m.parameters()])
    m.zero_grad(set_to_none=True)
    return flat


trained_cosines = [
    float(torch.nn.functional.cosine_similarity(  # in float64, as for the untrained model
        batch_gradient(model, b, check_amp).double(), batch_gradient(model, b, None).double(), dim=0
    ))
    for b in valid_loader
]  # fmt: skip
print(f"gradient per validation batch, cosine of {check_amp} with float32: "
      f"{min(trained_cosines):.3f} to {max(trained_cosines):.3f}")  # fmt: skip
print(
    f"largest logit difference {float((logits_16.float() - logits_fp32).abs().max()):.3f} "
    f"(logits span {float(logits_fp32.min()):.1f} to {float(logits_fp32.max()):.1f}); same top token: {same_argmax:.2%}"
)

# %%
assert logits_16.dtype == getattr(torch, check_amp)  # autocast really ran in 16 bits
assert not torch.equal(logits_16.float(), logits_fp32)  # and it changed the numbers
assert abs(loss_16 - loss_fp32) < 0.01 and abs(acc_16 - acc_fp32) < 0.005
assert same_argmax > 0.99
assert min(trained_cosines) > 0.8 and np.mean(trained_cosines) > 0.9  # the same direction

# %% jupyter={"source_hidden": true}
fig, (ax_loss, ax_acc, ax_lr) = plt.subplots(1, 3, figsize=(13, 3.4))
epochs_axis = np.arange(1, len(history["val_loss"]) + 1)
steps_per_epoch_run = len(history["loss"]) / len(epochs_axis)
ax_loss.plot(
    np.arange(1, len(history["loss"]) + 1) / steps_per_epoch_run,
    history["loss"],
    color=COLORS["ours"],
    alpha=0.35,
    lw=0.8,
    label="train (per step)",
)
ax_loss.plot(  # a mean over the epoch's steps: drawn at the epoch's middle
    epochs_axis - 0.5, history["train_loss"], "o-", color=COLORS["ours"],
    label="train (epoch mean, at mid-epoch)",
)  # fmt: skip
ax_loss.plot(  # measured on the weights at the epoch's end
    epochs_axis, history["val_loss"], "o-", color=COLORS["accent"], label="validation (epoch end)"
)
ax_loss.set(
    xlabel="epoch",
    ylabel="cross-entropy per token (nats)",
    title="Loss, both with label smoothing 0.1",
    yscale="log",  # the first steps near ln V and the last near the floor, all on the axes
    ylim=(0.9 * smoothing_floor, 1.15 * max(history["loss"])),
)
ax_loss.set_yticks([0.8, 1, 1.5, 2, 3, 4], ["0.8", "1", "1.5", "2", "3", "4"])
ax_loss.minorticks_off()
ax_loss.axhline(smoothing_floor, color="black", lw=1.2, ls="--", zorder=3,
                label=f"floor: entropy of the target ({smoothing_floor:.3f})")  # fmt: skip
ax_loss.legend()
ax_acc.plot(epochs_axis, 100 * np.array(history["val_acc"]), "o-", color=COLORS["accent"])
ax_acc.set(
    xlabel="epoch",
    ylabel="next-token accuracy (%)",
    title="Validation token accuracy",
    ylim=(80, 100.5),
)
ax_lr.plot(history["lr"], color=COLORS["ours"])
ax_lr.set(xlabel="optimizer step", ylabel="learning rate", title="Warmup, then cosine")
fig.tight_layout()
save_figure(fig, "13_training_curves")
plt.show()

# %% [markdown]
# In the loss panel each epoch's mean training loss is drawn at the middle of its epoch, since
# it averages the losses of all the epoch's steps; the validation loss is measured on the
# weights at the epoch's end. So in epoch 1 the mean training loss lies well above the
# validation loss: most of its steps came from a worse model than the one validated (the
# per-step curve shows the fall within the epoch). The dashed black line is the floor that
# label smoothing sets.
#
# The gradient-flow plot: the norm of each part's gradient at every step (before clipping), on
# a log scale, smoothed by a running median over 15 steps (the raw norms spike from step to
# step). From the first steps to the last, the norms fall by two to three decades (a factor of
# several hundred, read off the figure), so a mean over the whole run would
# be mostly epoch 1's; the bars show two periods instead, epoch 1 and the second half of
# training. In each, the largest part's mean norm is about ten times the smallest's (printed
# after the figure: 11.1 and 10.4 here; the assert bounds each at 50). The largest is the output
# head's in epoch 1 and the first decoder block's in the second half; the smallest are always a
# final norm's, with few weights. None is starved (a vanishing gradient would sit decades lower
# than the others) and none explodes. (A statement about the gradients: how much each part's
# weights move is Adam's business, as said above.)
#
# Late in epoch 5 and early in epoch 6 (steps 390 to 480) the norms rise in a burst of spikes,
# then settle again. Measured on the total gradient norm (printed after the figure): its
# running median over 15 steps, the smoothing the figure applies to each part, peaks at step
# 423 at 0.1425, 9.0 times the median of the 90 steps before the burst (0.0159); the median
# step of the burst has 0.0548, and that of the 90 steps after it 0.0068. The largest spike,
# at step 418, takes the total gradient norm to 3.13 (clipping scales it down to 1) and that
# step's loss to 1.142, where the median step from step 270 on has 0.771. It leaves no lasting
# harm: epoch 5's validation loss is a hair above epoch 4's (0.7730 against 0.7727), and epoch
# 6's is below both (0.7694; all three printed by the training cell). These are the stored
# run's numbers, asserted under `STORED_RUN`.

# %% jupyter={"source_hidden": true}
grad_names = list(history["grad_norms"][0])
grad_table = np.array([[step[name] for name in grad_names] for step in history["grad_norms"]])
grad_clean = np.where(np.isfinite(grad_table), grad_table, np.nan)  # float16's skipped steps: gaps
steps_per_epoch_run = len(history["loss"]) / len(history["val_loss"])
grad_periods = {  # the norms fall by decades: a mean over the whole run would be epoch 1's
    "epoch 1": slice(0, round(steps_per_epoch_run)),
    "second half": slice(len(grad_table) // 2, None),
}
fig, (ax_lines, ax_bars) = plt.subplots(
    1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.5, 1]}
)
def part_style(name: str) -> dict:
    """One colour per place in a stack (embedding, block 0, block 1, final norm), the output head
    black; the encoder's side solid, the decoder's dashed."""
    place = name.split(".", 1)[-1] if "." in name else name
    color = {"src_embed": "#e7298a", "tgt_embed": "#e7298a", "layers.0": "#1b9e77",
             "layers.1": "#e6ab02", "norm": "#7570b3"}.get(place, "black")  # fmt: skip
    dashed = name.startswith(("decoder", "tgt"))
    return {"color": color, "ls": "--" if dashed else "-"}


WINDOW = 15  # a running median over 15 steps: the raw norms spike from step to step
for k, name in enumerate(grad_names):
    smooth = np.nanmedian(np.lib.stride_tricks.sliding_window_view(grad_clean[:, k], WINDOW), -1)
    ax_lines.plot(np.arange(WINDOW // 2, WINDOW // 2 + len(smooth)), smooth, lw=1.3,
                  label=name, **part_style(name))  # fmt: skip
ax_lines.set(
    yscale="log",
    xlabel="optimizer step",
    ylabel="gradient L2 norm (before clipping)",
    title=f"Gradient norm per part of the model (running median, {WINDOW} steps)",
)
ax_lines.legend(fontsize=10, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False,
                title="solid: encoder side, dashed: decoder side", title_fontsize=10)  # fmt: skip
bar_y = np.arange(len(grad_names))[::-1]  # the first part on top
for offset, ((period, rows), shade) in zip((0.2, -0.2), zip(grad_periods.items(), ("#4d4d4d", "#a6a6a6"), strict=True), strict=True):
    ax_bars.barh(bar_y + offset, np.nanmean(grad_clean[rows], axis=0), height=0.4, color=shade,
                 label=f"{period} (steps {rows.start}-{(rows.stop or len(grad_table)) - 1})")  # fmt: skip
ax_bars.set_yticks(bar_y, grad_names)
ax_bars.set(xscale="log", xlabel="mean gradient L2 norm (log scale)",
            title="Mean gradient norm per part, early and late")  # fmt: skip
ax_bars.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False, ncol=1)
fig.tight_layout()
save_figure(fig, "13_gradient_flow")
plt.show()

# %% tags=["nbval-ignore-output"]
grad_spreads = {}
for period, rows in {"whole run": slice(None), **grad_periods}.items():
    means = np.nanmean(grad_clean[rows], axis=0)
    grad_spreads[period] = means.max() / means.min()
    print(f"{period:11s}: largest mean norm {grad_names[means.argmax()]} {means.max():.4f}, smallest "
          f"{grad_names[means.argmin()]} {means.min():.4f}: ratio {grad_spreads[period]:.1f}")  # fmt: skip
from_epoch_4 = 3 * round(steps_per_epoch_run)  # epoch 4 on: the loss near its floor
step_loss = np.array(history["loss"][from_epoch_4:], dtype=float)
total_norm = np.array(history["grad_norm"][from_epoch_4:], dtype=float)
total_norm[~np.isfinite(total_norm)] = np.nan
late_peaks = (  # the step of the largest loss, that loss, the step of the largest norm, that norm
    from_epoch_4 + int(np.nanargmax(step_loss)), f"{np.nanmax(step_loss):.3f}",
    from_epoch_4 + int(np.nanargmax(total_norm)), f"{np.nanmax(total_norm):.2f}",
)  # fmt: skip
print(f"from step {from_epoch_4} on: the step loss peaks at step {late_peaks[0]} ({late_peaks[1]}; "
      f"median {np.nanmedian(step_loss):.3f}), the total gradient norm at step {late_peaks[2]} "
      f"({late_peaks[3]}; median {np.nanmedian(total_norm):.3f})")  # fmt: skip
all_norm = np.array(history["grad_norm"], dtype=float)  # every step's total norm
all_norm[~np.isfinite(all_norm)] = np.nan
burst_spans = {"300-389 (before)": (300, 390), "390-480 (the burst)": (390, 481), "481-570 (after)": (481, 571)}
burst_medians = {span: float(np.nanmedian(all_norm[a:b])) for span, (a, b) in burst_spans.items()}
smooth_total = np.nanmedian(np.lib.stride_tricks.sliding_window_view(all_norm, WINDOW), -1)
smooth_steps = np.arange(WINDOW // 2, WINDOW // 2 + len(smooth_total))  # centred, as in the figure
late_smooth = smooth_steps >= from_epoch_4
smooth_peak = (int(smooth_steps[late_smooth][np.nanargmax(smooth_total[late_smooth])]),
               float(np.nanmax(smooth_total[late_smooth])))  # fmt: skip
print("the total gradient norm's median over steps",
      ", ".join(f"{span} {m:.4f}" for span, m in burst_medians.items()))  # fmt: skip
print(f"its running median ({WINDOW} steps) from step {from_epoch_4} on peaks at step {smooth_peak[0]} "
      f"({smooth_peak[1]:.4f}), {smooth_peak[1] / burst_medians['300-389 (before)']:.1f} times the median before")  # fmt: skip

# %%
taken = np.isfinite(grad_table).all(axis=1)  # steps whose gradient norms are all finite
if config.amp_dtype == "float16":  # GradScaler skips a step that overflowed (its norms are inf)
    assert taken.mean() > 0.95
else:  # no scaler: a non-finite gradient would be a broken step
    assert taken.all()
# "None starved": a part whose gradient vanished would sit two decades or more below the largest
# (a ratio of 100 and up, infinite for a part with no gradient); the ratios printed are about 10.
assert all(np.isfinite(spread) and spread < 50 for spread in grad_spreads.values())
if STORED_RUN:  # the numbers the two paragraphs above quote
    assert [f"{grad_spreads[period]:.1f}" for period in grad_periods] == ["11.1", "10.4"]
    assert late_peaks == (418, "1.142", 418, "3.13")
    assert [f"{m:.4f}" for m in burst_medians.values()] == ["0.0159", "0.0548", "0.0068"]
    assert (smooth_peak[0], f"{smooth_peak[1]:.4f}") == (423, "0.1425")
    assert f"{smooth_peak[1] / burst_medians['300-389 (before)']:.1f}" == "9.0"
    assert [f"{x:.4f}" for x in history["val_loss"][3:6]] == ["0.7727", "0.7730", "0.7694"]


# %% [markdown]
# ## Evaluation on numbers the model never saw
#
# Teacher-forced token accuracy flatters: the model is handed the right prefix at every step.
# The real test is to generate. `translate` encodes, decodes greedily or with beam search
# (notebook 12), and turns the ids back into text; `score_translations` scores a list of
# translations against the references with three measures:
#
# - **exact match**: the share of numbers translated without a single wrong character; here
#   it is the measure that matters, since a number is right or wrong.
# - **chrF** (Popović, 2015): an F-score over character $n$-grams, 0-100. Partial credit for a
#   nearly right compound.
# - **BLEU** (Papineni et al., 2002): the machine-translation standard, a geometric mean of
#   word $n$-gram precisions, 0-100. Every German number here is *one* word, so there are no
#   2-, 3- or 4-grams to count, their precisions are zero, and the word BLEU below is
#   therefore **0**, right or wrong: the measure does not fit this task. It is reported on
#   characters too (`tokenize="char"`), where it does.
#
# The scores come from `sacrebleu`, the reference implementation, so they are computed the
# standard way (its defaults fix the tokenisation and the smoothing) and not by another
# home-made variant. That does not make them comparable with published translation results:
# a character BLEU on number words can only be compared with another run of this task.
#
# On the test split the trained model turns out perfect, which leaves the measures nothing to
# tell apart; "Where it fails", further below, evaluates an early checkpoint and a harder split.

# %%
#| export
@torch.no_grad()
def translate(
    model: torch.nn.Module,
    src_tokenizer: BPETokenizer,
    tgt_tokenizer: BPETokenizer,
    texts: Sequence[str],
    beam_size: int = 1,
    batch_size: int = 256,
    max_new_tokens: int | None = None,
) -> list[str]:
    """Translate texts: greedy decoding (beam_size=1) or beam search, batch by batch."""
    beam_size = check_int("beam_size", beam_size, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens or model.max_len, minimum=1)
    device = next(model.parameters()).device
    translations = []
    for start in range(0, len(texts), batch_size):
        ids = [
            torch.tensor(src_tokenizer.encode(text)) for text in texts[start : start + batch_size]
        ]
        lengths = torch.tensor([len(i) for i in ids], device=device)
        src = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=PAD).to(device)
        src_mask = padding_mask(lengths, src.size(1))  # (B, 1, 1, T_src)
        if beam_size == 1:
            out = greedy_decode(model, src, max_new_tokens=max_new_tokens, src_mask=src_mask)
        else:
            out = beam_search(
                model, src, max_new_tokens=max_new_tokens, src_mask=src_mask, beam_size=beam_size
            )
        for row in out.tokens.tolist():  # BOS first; cut at the first EOS
            translations.append(tgt_tokenizer.decode(row[: row.index(EOS)] if EOS in row else row))
    return translations


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Exact match (%), chrF, and BLEU on words and on characters, all 0-100, from sacrebleu."""
    if len(hypotheses) != len(references) or len(references) == 0:
        raise ValueError(
            f"need as many hypotheses as references, at least one: got {len(hypotheses)} "
            f"and {len(references)}"
        )
    if not all(isinstance(s, str) for s in [*hypotheses, *references]):
        raise TypeError("hypotheses and references must be strings")
    hypotheses, references = list(hypotheses), list(references)
    exact = sum(h == r for h, r in zip(hypotheses, references, strict=True))
    return {
        "exact_match": 100.0 * exact / len(references),
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "bleu_char": sacrebleu.corpus_bleu(hypotheses, [references], tokenize="char").score,
    }


# %% tags=["nbval-ignore-output"]
test_numbers = [n for n, _, _ in corpus["test"]]
test_en = [en for _, en, _ in corpus["test"]]
test_de = [de for _, _, de in corpus["test"]]
greedy_de = translate(model, src_tokenizer, tgt_tokenizer, test_en, beam_size=1)
beam_de = translate(model, src_tokenizer, tgt_tokenizer, test_en, beam_size=4)
scores = {
    "greedy": score_translations(greedy_de, test_de),
    "beam 4": score_translations(beam_de, test_de),
}
for name, s in scores.items():
    print(
        f"{name:7s} exact match {s['exact_match']:6.2f} %   chrF {s['chrf']:6.2f}   "
        f"BLEU {s['bleu']:5.1f} (words)  {s['bleu_char']:5.1f} (characters)"
    )
print(f"{len(test_en):,d} test numbers")

# %%
for s in scores.values():
    assert s["exact_match"] >= 97.0 and s["chrf"] >= 99.0  # the targets

# %% [markdown]
# ### Try it
#
# The trained model on a few numbers; add your own to `your_numbers` (0 to 999,999). `translate`
# takes English text in `num2words`' spelling, which `number_to_words` writes. Each line says
# which split the number is in ("none" for most of the million) and whether the German is right.
# In the stored run every example is right but the first: "zero" is one training sentence among
# 16,000, unlike any other, and the model writes "elf" (eleven) instead of "null".

# %% tags=["nbval-ignore-output"]
examples = [0, 42, 1_001, 12_345, 77_777, 500_005, 999_999]
your_numbers = []  # yours here, e.g. [2_024, 314_159]
split_of = {n: split for split, rows in corpus.items() for n, _, _ in rows}
tried = examples + your_numbers
tried_de = translate(model, src_tokenizer, tgt_tokenizer, [number_to_words(n, "en") for n in tried])
tried_right = [de == number_to_words(n, "de") for n, de in zip(tried, tried_de, strict=True)]
for n, de, right in zip(tried, tried_de, tried_right, strict=True):
    print(f"{n:>7,d} ({split_of.get(n, 'none')}): {number_to_words(n, 'en')}\n{'':9s}-> {de}  "
          + ("right" if right else f"wrong, the truth is {number_to_words(n, 'de')}"))

# %%
examples_right = tried_right[: len(examples)]
assert sum(examples_right[1:]) >= len(examples) - 2  # all but "zero": at most one wrong, any run
if STORED_RUN:
    assert examples_right == [False] + [True] * (len(examples) - 1)  # the paragraph above
    assert tried_de[0] == "elf"

# %% [markdown]
# ### Error analysis
#
# A score says how often the model is wrong; the errors say *how*. For each wrong translation,
# the cell below asks which number the model actually wrote: it spells out every number one
# digit away from the right one, and every number with two neighbouring digits swapped, and
# looks the translation up among them. A single wrong digit is a mistake in a word; two
# neighbouring digits swapped (24 for 42) is a mistake of order. One more kind is on the list because the errors of the
# next section showed it: the last block written as a copy of the thousands block
# (342,057 → "…tausenddreihundertzweiundvierzig", 342,342).
#
# Here there is nothing to sort: in the stored run the greedy decoder writes all 2,000 test
# numbers right (the cell prints the count; for another run the assert allows up to 3 % of
# them wrong). The splits put every building block (the numbers below 1000) in training, so
# what is left to test is composition, and in the stored run the model composed without a
# mistake. The checks below the cell still make sure the analysis would name a swapped unit and
# tens digit, or a wrong digit, if one came up.

# %% tags=["nbval-ignore-output"]
DIGIT_NAMES = ("units", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands")


def explain_error(n: int, hypothesis: str) -> str:
    """What went wrong, if the hypothesis is the spelling of a number close to n."""
    digits = f"{n:06d}"
    candidates = {}
    for i in range(6):
        for d in "0123456789":
            if d != digits[i]:
                candidates[int(digits[:i] + d + digits[i + 1 :])] = (
                    f"{DIGIT_NAMES[5 - i]} digit wrong"
                )
        if i < 5 and digits[i] != digits[i + 1]:
            swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :]
            candidates[int(swapped)] = f"{DIGIT_NAMES[5 - i - 1]} and {DIGIT_NAMES[5 - i]} swapped"
    if n >= 1000:  # the last block written as a copy of the thousands block: 342,057 -> 342,342
        candidates[(n // 1000) * 1001] = "thousands block repeated"
    for m, kind in candidates.items():
        if number_to_words(m, "de") == hypothesis:
            return kind
    return "not a number one digit away"


greedy_errors = [
    (n, hyp, ref)
    for n, hyp, ref in zip(test_numbers, greedy_de, test_de, strict=False)
    if hyp != ref
]
error_kinds = Counter(explain_error(n, hyp) for n, hyp, _ in greedy_errors)
print(f"{len(greedy_errors)} of {len(test_numbers)} greedy translations are wrong")
for kind, count in error_kinds.most_common():
    print(f"  {count:3d}  {kind}")
for n, hyp, ref in greedy_errors[:8]:
    print(f"{n:>7,d}  {explain_error(n, hyp):28s}  model: {hyp}\n{'':38s}  truth: {ref}")

# %%
assert len(greedy_errors) <= 0.03 * len(test_numbers)
if STORED_RUN:
    assert not greedy_errors  # the paragraph above
assert (
    explain_error(42, number_to_words(24, "de")) == "units and tens swapped"
)  # the analysis works
assert explain_error(342_057, number_to_words(342_058, "de")) == "units digit wrong"
assert explain_error(42, "dreihundert") == "not a number one digit away"
assert explain_error(29_000, number_to_words(29_029, "de")) == "thousands block repeated"

# %% [markdown]
# ### Where it fails: an early checkpoint and a harder split
#
# A model that makes no mistakes on the test set cannot show what the measures above are for:
# greedy and beam search agree, chrF and exact match are both 100, and there is no error to
# sort. Two evaluations where the model is not perfect:
#
# - **An early checkpoint**: the weights that the training cell kept after epoch 1, the first 90
#   updates of the run (its validation loss, measured again, is asserted to be epoch 1's). Its
#   token accuracy was 88 %, which leaves most numbers with at least one wrong token among
#   their ten or so.
# - **A harder split for the trained model**: every round thousand (1,000, 2,000, …, 999,000)
#   that is not in the training split. Its German ends on "tausend" with nothing after it, a
#   form that the random training numbers above 1,000 hold fewer than once in a thousand
#   (counted below): it tests whether the model composes a form it has hardly seen from
#   blocks it knows, not whether it remembers them. (In the stored run 10 of the 15,000
#   training numbers from 1,000 up are round thousands; the assert bounds the form's share
#   of the training split at half a per cent.)

# %% tags=["nbval-ignore-output"]
early_model = Transformer(
    src_tokenizer.vocab_size, tgt_tokenizer.vocab_size,
    d_model=64, num_heads=4, d_ff=256, num_layers=2, dropout_p=0.0, max_len=MAX_LEN,
).to(device)  # fmt: skip
early_model.load_state_dict(early_weights)  # the weights after epoch 1, kept by the training cell
early_model.eval()
early_val_loss, _ = evaluate_loss(early_model, valid_loader, config.amp_dtype, config.label_smoothing)
train_numbers = {n for n, _, _ in corpus["train"]}
round_numbers = [n for n in range(1000, 1_000_000, 1000) if n not in train_numbers]
round_in_train = sum(n >= 1000 and n % 1000 == 0 for n in train_numbers)
round_en = [number_to_words(n, "en") for n in round_numbers]
round_de = [number_to_words(n, "de") for n in round_numbers]
hard_cases = {  # name: (model, numbers, English, German)
    "trained, test split": (model, test_numbers, test_en, test_de),
    "epoch 1, test split": (early_model, test_numbers, test_en, test_de),
    "trained, round thousands": (model, round_numbers, round_en, round_de),
}
hard = {}
for name, (m, numbers, en, de) in hard_cases.items():
    if m is model and numbers is test_numbers:
        greedy, beam = greedy_de, beam_de  # translated above
    else:
        greedy = translate(m, src_tokenizer, tgt_tokenizer, en, beam_size=1)
        beam = translate(m, src_tokenizer, tgt_tokenizer, en, beam_size=4)
    errors = [(n, h, r) for n, h, r in zip(numbers, greedy, de, strict=True) if h != r]
    hard[name] = {
        "greedy": score_translations(greedy, de), "beam": score_translations(beam, de),
        "differ": sum(g != b for g, b in zip(greedy, beam, strict=True)), "n": len(numbers),
        "errors": errors, "kinds": Counter(explain_error(n, h) for n, h, _ in errors),
    }  # fmt: skip
print(f"the early checkpoint's validation loss, measured again: {early_val_loss:.4f} (epoch 1 of "
      f"the run: {history['val_loss'][0]:.4f}); round thousands in training: {round_in_train} of "
      f"{sum(n >= 1000 for n in train_numbers):,d} numbers >= 1000\n")  # fmt: skip
print(f"{'':26s} {'numbers':>7s}  exact match: greedy   beam   chrF: greedy   beam   greedy != beam")
for name, r in hard.items():
    g, b = r["greedy"], r["beam"]
    print(f"{name:26s} {r['n']:7,d}  {g['exact_match']:18.1f} % {b['exact_match']:5.1f} %"
          f"  {g['chrf']:12.1f} {b['chrf']:6.1f}  {r['differ']:8,d}")  # fmt: skip
for name in ("epoch 1, test split", "trained, round thousands"):
    print(f"\n{name}: {len(hard[name]['errors'])} greedy errors, by kind")
    for kind, count in hard[name]["kinds"].most_common():  # every kind, however rare
        print(f"  {count:5,d}  {kind}")
    for n, hyp, ref in hard[name]["errors"][:3]:
        print(f"  {n:>7,d}  model: {hyp}\n  {'':7s}  truth: {ref}")
# One wrong digit, by its place in its block of three: 42 and 42,000 have their tens in one place.
PLACES = {"tens": ("tens", "ten-thousands"), "units": ("units", "thousands"),
          "hundreds": ("hundreds", "hundred-thousands")}  # fmt: skip
early_kinds = hard["epoch 1, test split"]["kinds"]
early_places = {place: sum(early_kinds[f"{digit} digit wrong"] for digit in digits)
                for place, digits in PLACES.items()}  # fmt: skip
early_swaps = sum(count for kind, count in early_kinds.items() if kind.endswith("swapped"))
print(f"\nepoch 1, one digit wrong, by its place in the block: {early_places}; "
      f"two digits swapped: {early_swaps} of {len(hard['epoch 1, test split']['errors'])} errors")

# %%
trained, early, rounds = (hard[k] for k in hard_cases)  # in the order of the table
assert math.isclose(early_val_loss, history["val_loss"][0], rel_tol=1e-4)  # epoch 1's weights
assert round_in_train < 0.005 * len(train_numbers)  # the form is rare in training
# The early checkpoint is wrong on most numbers, and the measures now tell things apart:
assert early["greedy"]["exact_match"] < 75 < trained["greedy"]["exact_match"]
assert early["greedy"]["chrf"] > early["greedy"]["exact_match"] + 10  # partial credit
assert early["differ"] > 0.02 * early["n"]  # beam search changes many outputs
assert len(early["kinds"]) >= 3  # errors of several kinds, not one
# One digit wrong: nearly always the units or the tens, the two digits German reorders, hardly
# ever the hundreds; and mistakes of order (two digits swapped) are rare. Bounds for any run
# (which of units and tens leads is one run's count, and is not asserted).
assert early_places["tens"] + early_places["units"] > 5 * early_places["hundreds"]
assert early_swaps < 0.1 * len(early["errors"])
# The trained model on the harder split: mostly right, and no better than on the test split.
assert trained["greedy"]["exact_match"] >= rounds["greedy"]["exact_match"] > 50
if STORED_RUN:  # the stored run's counts, quoted below
    assert len(early["errors"]) == 1562 and early_kinds["not a number one digit away"] == 982
    assert early_places == {"tens": 424, "units": 110, "hundreds": 18} and early_swaps == 15
    assert rounds["kinds"].most_common(1)[0] == ("thousands block repeated", 29)
    assert len(rounds["errors"]) == 35


# %% [markdown]
# What the three rows show (the counts are this run's; another machine's run differs in the
# details):
#
# - **Exact match and chrF part ways.** The early checkpoint gets about a fifth of the numbers
#   exactly right (21.9 %) and still scores a chrF of 86.4: most of its characters are right
#   even where the number is wrong. Its wrong numbers are not mostly near misses (982 of the
#   1,562 are none of the near misses the analysis names); the credit comes from right pieces
#   inside wrong numbers, as in the first example printed, whose "sechshundert" and
#   "tausenddreihundert" are right. (The assert asks only that chrF exceed exact match by 10
#   points, and exact match stay below 75 %.) chrF measures how close a
#   translation is; exact match, whether it is usable. For numbers only the second matters,
#   which is why it is the target above; for sentences, where many translations are right,
#   chrF is the better guide.
# - **Beam search matters when the model is unsure.** On the trained model greedy and beam
#   agree almost everywhere: each step's most likely token is far ahead. On the early
#   checkpoint beam search changes 519 of the 2,000 outputs, about a quarter (the assert asks
#   for more than 2 %), and gets a few more numbers exactly right (26.1 % against 21.9 %),
#   because a more likely sequence is more often the right one; it cannot fix
#   what the model has not learned.
# - **The errors have a pattern.** The 552 errors of one wrong digit, sorted by the digit's
#   place in its block of three (the last line printed two cells up; the thousands digit is the
#   units of the thousands block, so it counts with the units): the tens go wrong 424 times, the
#   units 110, the hundreds 18. The units and the tens, the two digits German reorders
#   ("zwei-und-vierzig"), take nearly all of them; the hundreds, which both languages write
#   first, hardly any. The mistake of order, two digits swapped, is rare (15 of the 1,562
#   errors). Both are asserted with margins meant for any run (units and tens more than 5 times
#   the hundreds, swaps under 10 % of the errors); the lead of the tens over the units is this
#   run's count and is not. Nor can the counts say *why* the reordered pair goes wrong: their
#   words are also the most varied ("zweiund", "vier" + "zig", the teens), and counts cannot
#   tell the order's difficulty from the words'. The trained model has
#   learnt both; its remaining errors sit where training had little to say. On the round
#   thousands most of them are one kind (29 of 35 here): after "tausend" it writes the
#   thousands block a second time ("zehntausendzehn" for 10,000), where the German
#   should stop. A test set drawn like the training set hides this; a split built to probe one
#   form finds it.

# %% [markdown]
# ### Where the decoder looks
#
# Notebook 12 drew the cross-attention of the reversal model, an anti-diagonal. Here it shows
# the reordering: writing "…zweiundvierzig…" the decoder must read "two" *before* "forty" in
# the English, though it comes after. Each row below is one step of the decoder (the German
# piece it is about to write); each column an English piece; the weights are averaged over the
# heads of a layer.

# %% tags=["nbval-ignore-output"]
def is_reordered(n: int) -> bool:
    """Both halves end in tens and units that German reorders (42, not 40), and the English of
    both is in two pieces ("▁twen" + "ty-five"), so that the crossing can show."""
    halves = (n // 1000, n % 1000)
    return all(
        part % 100 > 20
        and part % 10 != 0
        and len(src_tokenizer.tokens(number_to_words(part % 100, "en"))) > 1
        for part in halves
    )


shown_n = next(
    n
    for n, hyp, ref in zip(test_numbers, greedy_de, test_de, strict=False)
    if is_reordered(n) and hyp == ref
)
shown_en, shown_de = number_to_words(shown_n, "en"), number_to_words(shown_n, "de")
shown_src = torch.tensor([src_tokenizer.encode(shown_en)], device=device)
shown_tgt = torch.tensor([tgt_tokenizer.encode(shown_de)], device=device)
layer_weights = cross_attention_weights(
    model, shown_src, shown_tgt[:, :-1]
)  # per layer (1, h, T_tgt, T_src)
src_labels = [src_tokenizer.id_to_token[i] for i in shown_src[0].tolist()]
tgt_labels = [
    tgt_tokenizer.id_to_token[i] for i in shown_tgt[0, 1:].tolist()
]  # what each step writes
print(shown_n, "|", shown_en, "|", shown_de)
print(len(layer_weights), "layers of", tuple(layer_weights[0].shape))
# German writes a unit ("zweiund"), then its tens ("vier" + "zig"): those pairs of rows.
unit_rows = [i for i in range(len(tgt_labels) - 1) if tgt_labels[i].endswith("und")]
for layer, w in enumerate(layer_weights, 1):
    peaks = w[0].mean(0).argmax(-1).tolist()  # the English piece each row looks at most
    print(
        f"layer {layer}:",
        ", ".join(f"{tgt_labels[r]}->{src_labels[peaks[r]]}" for r in range(len(tgt_labels))),
    )


# %% [markdown]
# One number is one example. The claim, "the alignment crosses", is about every number that
# German reorders, so it is measured on all of them: for each reordered test number that greedy
# decoding gets right, and for each unit row ("zweiund") in it, does some layer look further
# right in the English at the unit row than at the row after it, which writes the tens
# ("vier")? The special tokens are left out of the comparison: a row that parks its weight on
# `<eos>`, the last column, would otherwise count as "further right" for free. The unit rows are
# found by their pieces, a unit with "und" ("zweiund"), which this run's German tokenizer has;
# one learnt from another seed's sentences may cut "und" elsewhere, and then the cell says the
# measure does not apply instead of measuring something else. The comparison itself is one
# function, `crosses`, checked first on made-up peaks whose answer is worked out by hand.

# %% tags=["nbval-ignore-output"]
def row_peaks(n: int) -> tuple[torch.Tensor, list[int]]:
    """Per layer, the English piece each German row of n looks at most (special tokens left
    out), as a (layers, T_tgt) tensor; and the unit rows ("zweiund") of n's German."""
    src = torch.tensor([src_tokenizer.encode(number_to_words(n, "en"))], device=device)
    tgt = torch.tensor([tgt_tokenizer.encode(number_to_words(n, "de"))], device=device)
    weights = cross_attention_weights(model, src, tgt[:, :-1])  # per layer (1, h, T_tgt, T_src)
    labels = [tgt_tokenizer.id_to_token[i] for i in tgt[0, 1:].tolist()]
    special = src[0] < len(SPECIAL_TOKENS)  # (T_src,): <bos>, <eos> and the like
    peaks = torch.stack([w[0].mean(0).masked_fill(special, -1.0).argmax(-1) for w in weights])
    rows = [i for i in range(len(labels) - 1) if labels[i].endswith("und")]
    return peaks.cpu(), rows


def crosses(peaks: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """For each unit row r: does some layer peak further right at r than at the tens row r + 1?
    peaks (..., layers, T_tgt) -> (..., len(rows)) bool."""
    r = torch.tensor(rows, dtype=torch.long)
    return (peaks[..., r] > peaks[..., r + 1]).any(-2)


# Worked by hand on made-up peaks, two layers over eight rows, unit rows 1, 3 and 5: row 1
# crosses in layer 1 only (5 > 2); row 3 in neither layer (1 < 3, and a tie 3 = 3 is no
# crossing); row 5 in neither (ties 4 = 4 and 6 = 6). A comparison the wrong way round, with the
# row before, one row too far, ties counted, or every layer required: each answers otherwise.
made_up_peaks = torch.tensor([[0, 5, 2, 1, 3, 4, 4, 0], [0, 1, 2, 3, 3, 6, 6, 6]])
assert crosses(made_up_peaks, [1, 3, 5]).tolist() == [True, False, False]


def crossing_rows(n: int) -> list[bool]:
    """For each unit/tens pair of rows in n's German: does some layer's peak cross?"""
    peaks, rows = row_peaks(n)
    return crosses(peaks, rows).tolist()


reordered_right = [n for n, hyp, ref in zip(test_numbers, greedy_de, test_de, strict=False)
                   if is_reordered(n) and hyp == ref]
measured = [row_peaks(n) for n in reordered_right]  # (peaks, unit rows) of each number
crossings = [c for p, rows in measured for c in crosses(p, rows).tolist()]  # in either layer
if crossings:
    crossing_share = sum(crossings) / len(crossings)
    layer_crossing = [sum(int(crosses(p[k : k + 1], rows).sum()) for p, rows in measured)
                      / len(crossings) for k in range(measured[0][0].size(0))]  # fmt: skip
    print(f"{len(reordered_right)} reordered numbers, {len(crossings)} unit/tens pairs; the "
          f"alignment crosses at {', '.join(f'{x:.1%} in layer {k + 1}' for k, x in enumerate(layer_crossing))}"
          f", {crossing_share:.1%} in either layer")  # fmt: skip
    # A sanity bound for any run, not a test against chance (the shuffles below are that). Of
    # the slips the made-up peaks catch, it catches only a comparison the wrong way round, which
    # counts mostly the pairs that do not cross.
    assert len(crossings) > 100 and crossing_share > 0.6
    if STORED_RUN:
        assert f"{layer_crossing[1]:.1%} {crossing_share:.1%}" == "89.2% 89.4%"  # the stored run's
else:  # the rows are found by their pieces: a tokenizer without "...und" pieces has none
    print("no unit piece ending in 'und' in these tokenizers: the measure does not apply")
if (src_tokenizer.fingerprint(), tgt_tokenizer.fingerprint()) == STORED_TOKENIZERS:
    assert len(crossings) >= 2 * len(reordered_right) > 100  # the stored run's pieces have them


# %% [markdown]
# Is that high? Chance is measured, on the same numbers and the same peaks: each layer's peaks
# are shuffled among the rows of their number (1,000 random permutations of which row looks
# where, from fixed generators), and the share is counted again. A shuffle keeps which English
# pieces a layer looks at, and how often, and loses the order that ties each German row to its
# English piece. For one layer, chance is a little under one half (two rows that peak on the same
# piece do not cross). For "either layer" it is higher, since two layers, shuffled each on its
# own, are two chances to cross. The function is checked first on the unshuffled peaks, where it
# must give the shares above.

# %% tags=["nbval-ignore-output"]
def permuted_shares(measured: list, orders) -> torch.Tensor:
    """The crossing share with every number's peaks permuted along its rows by orders(shape),
    a (S, layers, T_tgt) tensor of row permutations: one share per permutation s."""
    hits, pairs = 0, 0
    for peaks, rows in measured:
        order = orders(peaks.shape)
        permuted = peaks.expand(order.size(0), -1, -1).gather(-1, order)  # (S, layers, T_tgt)
        hits = hits + crosses(permuted, rows).sum(-1)  # (S,): pairs that cross in some layer
        pairs += len(rows)
    return torch.as_tensor(hits, dtype=torch.float64) / pairs


SHUFFLES = 1000


def unshuffled(shape) -> torch.Tensor:
    return torch.arange(shape[-1]).expand(1, *shape)  # one permutation: the identity


def shuffled(seed: int):
    """SHUFFLES random row permutations per number, each layer its own, from a fixed generator."""
    generator = torch.Generator().manual_seed(seed)
    return lambda shape: torch.rand(SHUFFLES, *shape, generator=generator).argsort(-1)


if crossings:
    chance = {}  # name: (its crossing share, the shares of its shuffles)
    for k in range(measured[0][0].size(0)):  # the peaks are (layers, T_tgt)
        alone = [(peaks[k : k + 1], rows) for peaks, rows in measured]
        chance[f"layer {k + 1}"] = (float(permuted_shares(alone, unshuffled)[0]),
                                    permuted_shares(alone, shuffled(k + 1)))  # fmt: skip
    chance["either layer"] = (float(permuted_shares(measured, unshuffled)[0]),
                              permuted_shares(measured, shuffled(0)))  # fmt: skip
    for name, (share, shares) in chance.items():
        print(f"{name:12s} crosses at {share:.1%} of the pairs; {SHUFFLES} shuffles: "
              f"{shares.mean():.1%} on average, highest {shares.max():.1%}")
    assert math.isclose(chance["either layer"][0], crossing_share)  # the statistic, vectorised
    assert all(math.isclose(chance[f"layer {k + 1}"][0], x) for k, x in enumerate(layer_crossing))
    # For any run: some layer crosses well above its own shuffles' average. A model whose
    # attention ignored the order would sit at chance, within a few points (the shuffles' spread);
    # 10 points is below the smallest margin that the seeds of `make robust` gave.
    layer_margins = [share - float(shares.mean()) for name, (share, shares) in chance.items()
                     if name.startswith("layer")]  # fmt: skip
    print("crossing share above the shuffles' average:",
          ", ".join(f"layer {k + 1} {m:+.1%}" for k, m in enumerate(layer_margins)))  # fmt: skip
    assert max(layer_margins) > 0.10
    if STORED_RUN:  # findings of this run, not of every run (below)
        for name, margin in (("layer 2", 0.3), ("either layer", 0.05)):
            share, shares = chance[name]
            assert float((shares >= share).double().mean()) < 0.01  # chance seldom gets there
            assert share - float(shares.mean()) > margin  # and is far below on average
        assert {name: f"{s:.1%} {sh.mean():.1%} {sh.max():.1%}" for name, (s, sh) in chance.items()} == {
            "layer 1": "63.5% 47.4% 55.8%", "layer 2": "89.2% 48.2% 57.1%", "either layer": "89.4% 72.8% 80.7%"}  # fmt: skip

# %% jupyter={"source_hidden": true}
fig, axes = plt.subplots(1, len(layer_weights), figsize=(6.5 * len(layer_weights), 5.2), layout="constrained")
figure_peaks, figure_units = row_peaks(shown_n)  # what the measure compares: (layers, T_tgt)
compared_rows = [row for unit in figure_units for row in (unit, unit + 1)]  # unit, tens rows
for layer, (ax, w) in enumerate(zip(np.atleast_1d(axes), layer_weights, strict=False)):
    image = ax.imshow(w[0].mean(0).float().cpu().numpy(), cmap="Blues", vmin=0, vmax=1)
    compared_peaks = figure_peaks[layer, compared_rows].tolist()
    squares = ax.scatter(compared_peaks, compared_rows, s=170, marker="s", facecolors="none",
                         edgecolors=COLORS["accent"], linewidths=1.5)  # fmt: skip
    ax.set_xticks(range(len(src_labels)), src_labels, rotation=70, fontsize=10)
    ax.set_yticks(range(len(tgt_labels)), tgt_labels, fontsize=10)
    ax.set(
        xlabel="English piece (key)",
        ylabel="German piece being written (query)",
        title=f"Cross-attention, decoder layer {layer + 1}, mean of heads",
    )
    fig.colorbar(image, ax=ax, fraction=0.046, label="attention weight")
fig.legend([squares], ["the peaks the crossing measure compares: each unit row's and its tens row's "
                       "largest weight on an English piece (special tokens left out)"],
           loc="outside lower center", frameon=False)  # fmt: skip
fig.suptitle(f"{shown_n:,d}: {shown_en} -> {shown_de}\n(▁ marks the start of a word)", fontsize=12)
save_figure(fig, "13_cross_attention")
plt.show()

# %% [markdown]
# What the figure shows depends on the run: another run may draw another number and weigh it
# otherwise. The test is the statistic against its shuffles, and in the stored run it is
# clearest in layer 2: its 89.2 % of crossing pairs is above every one of its 1,000 shuffles
# (the highest is 57.1 %) and 41 points above their average (48.2 %). Layer 1 crosses less,
# 63.5 % against 47.4 % for its shuffles (highest 55.8 %). Counting a pair when either layer
# crosses gives 89.4 %, little more than layer 2 alone, against a higher chance level (72.8 %
# on average, highest 80.7 %).
#
# These are findings of the stored run: another seed's model need not align the same way, nor
# in the same layer, so these numbers, and the comparison with the highest shuffle, are
# asserted only under `STORED_RUN`. For any run the crossing cell checks the measure (`crosses`
# on the made-up peaks) and that its share is sane, more than 60 % of the pairs in either layer
# (a bound below chance, which catches a broken measure, not a missing crossing); and the
# shuffle cell checks the claim itself, more loosely: some layer crosses more than 10 points
# above its shuffles' average (the stored run's layer 2: 41.0 points, printed there). The
# observations below are the stored run's too, asserted under `STORED_RUN` in the cell after
# them.
#
# The stored run draws 936,072, whose English is cut into "▁thirty-s" + "ix" (36) and "▁seven" +
# "ty-two" (72). The measure compares, in each layer, the English piece that the unit row
# ("sechsund", "zweiund") and the tens row after it ("dreißig", "sieb") weigh most, special
# tokens left out: the red squares in the figure. Some of those peaks are close calls that the
# colours cannot tell apart, so the next cell prints, for those four rows, each layer's two
# largest weights on English pieces (with their columns, counted from `<bos>` = 0: "▁and" is
# both column 3 and column 7), the margin between them, and the weight on `<eos>`.

# %% tags=["nbval-ignore-output"]
shown_peaks, shown_rows = row_peaks(shown_n)  # the measure's peaks (layers, T_tgt); unit rows
english_cols = [c for c, i in enumerate(shown_src[0].tolist()) if i >= len(SPECIAL_TOKENS)]
eos_col = shown_src[0].tolist().index(EOS)
top_two = {}  # (layer, German row): the two English columns it weighs most, with their weights
for layer, w in enumerate(layer_weights, 1):
    mean_w = w[0].mean(0).float().cpu()  # (T_tgt, T_src), the mean of the heads
    for r in (row for unit in shown_rows for row in (unit, unit + 1)):  # a unit row, its tens row
        values, picks = mean_w[r, english_cols].topk(2)
        top_two[layer, tgt_labels[r]] = [(english_cols[p], v) for p, v in zip(picks.tolist(), values.tolist(), strict=True)]  # fmt: skip
        (c1, w1), (c2, w2) = top_two[layer, tgt_labels[r]]
        print(f"layer {layer}, {tgt_labels[r]:>8s}: {src_labels[c1]} [{c1}] {w1:.4f}, "
              f"{src_labels[c2]} [{c2}] {w2:.4f}, margin {w1 - w2:.4f}; <eos> {float(mean_w[r, eos_col]):.4f}")  # fmt: skip
        assert c1 == int(shown_peaks[layer - 1, r])  # the peak printed is the one the measure counts

# %% [markdown]
# The printout is the stored run's; another run prints its own number and weights. What holds
# on any run, and is asserted in the cell: the piece printed first is the peak that the measure
# counts. In the stored run the first half crosses, in both layers; the second does not, by
# this measure, and that verdict rests on two near ties:
#
# - "sechsund" peaks on "ix" in both layers, and "dreißig" to its left: on "▁thirty-s" in layer
#   1, on the "▁and" before it in layer 2 (which spreads its weight over "▁and", "▁thirty-s" and
#   "ix"). These four peaks are clear: each leads its runner-up by 0.07 or more;
# - "zweiund" peaks on "ty-two" in both layers (with most of its weight there in layer 2).
#   "sieb" puts the largest share of its weight on `<eos>` in both layers, and among the English
#   pieces, the ones the measure compares, it peaks on "ty-two" too, by a hair in both layers:
#   in layer 1 its weight on "ty-two" is 0.2451 against 0.2444 on the "▁and" before "▁seven" (a
#   margin of 0.0007), in layer 2 0.2652 against 0.2623 on "▁seven" (0.0029). Looking at
#   the same piece as "zweiund" is no crossing; had the runner-up won in either layer, the pair
#   would count as crossing, since both runners-up lie left of "ty-two" (asserted below, with
#   the margins).
#
# One number is one example, a clear crossing and a coin toss here; the claim rests on the
# statistic over all 378 pairs above. The other rows look where their piece comes from:
# "▁neunhundert" at "▁hundred" and "tausend" at "▁thousand", in both layers. The final "zig",
# which follows from "sieb" with nothing left to look up, parks most of its weight on `<eos>` in
# layer 2. Layer 1 is blurrier on average (the mean of its rows' largest weights is smaller,
# asserted below), though not in every row: "▁neunhundert" puts more of its weight on
# "▁hundred" in layer 1 than in layer 2.

# %%
peak_of = [  # per layer: the English piece each German row looks at most
    {tgt_labels[r]: src_labels[c] for r, c in enumerate(w[0].mean(0).argmax(-1).tolist())}
    for w in layer_weights
]
if STORED_RUN:  # the observations above, for the stored run's weights only
    assert shown_n == 936_072 and crossing_rows(shown_n) == [True, False]
    assert len(crossings) == 378
    for layer in (0, 1):
        assert peak_of[layer]["sechsund"] == "ix" and peak_of[layer]["zweiund"] == "ty-two"
        assert peak_of[layer]["▁neunhundert"] == "▁hundred" and peak_of[layer]["tausend"] == "▁thousand"
        assert peak_of[layer]["sieb"] == "<eos>"
    assert peak_of[0]["dreißig"] == "▁thirty-s" and peak_of[1]["dreißig"] == "▁and"
    assert peak_of[1]["zig"] == "<eos>"
    mean_weights = [w[0].mean(0) for w in layer_weights]  # per layer (T_tgt, T_src)
    assert float(mean_weights[1][tgt_labels.index("zweiund")].max()) > 0.5  # most of its weight
    for layer in (1, 2):  # the first half's peaks are clear
        for row in ("sechsund", "dreißig"):
            (_, w1), (_, w2) = top_two[layer, row]
            assert w1 - w2 >= 0.07
    ty_two, sieb_row = src_labels.index("ty-two"), tgt_labels.index("sieb")
    for layer, runner_up, margin in ((1, 7, 0.001), (2, 8, 0.01)):  # "▁and" [7], "▁seven" [8]
        (c1, w1), (c2, w2) = top_two[layer, "sieb"]
        assert (c1, c2) == (ty_two, runner_up) and w1 - w2 < margin  # "ty-two" by a hair
        flipped = shown_peaks.clone()
        flipped[layer - 1, sieb_row] = runner_up  # had the runner-up won in this layer ...
        assert crosses(flipped, shown_rows).tolist() == [True, True]  # ... the pair would cross
    assert float(mean_weights[0][0].max()) > float(mean_weights[1][0].max())  # ▁neunhundert
    row_maxima = [float(w.max(-1).values.mean()) for w in mean_weights]
    assert row_maxima[0] < row_maxima[1]  # layer 1 blurrier

# %% [markdown]
# **A real task needs the whole pipeline: disjoint splits, a tokenizer that round-trips, batches
# without waste, a loop that can be stopped and resumed exactly, and a test on what the model
# never saw.**
#
# ## Recap
#
# | piece | code | shape | checked by |
# |---|---|---|---|
# | corpus and splits | `split_numbers`, `number_to_words`, `load_corpus` | (number, English, German) triples per split | splits share no number; every German target follows the thousands rule (num2words' "einstausend" corrected) |
# | tokenizer | `BPETokenizer.train / encode / decode / save / load`, `UNK = 3` | text → `[BOS, …, EOS]` ids | round trip on every sentence, and its failure on an unseen character; vs Hugging Face `tokenizers` |
# | dataset | `TranslationDataset(pairs, src_tok, tgt_tok, max_len)` | item: `(src_ids, tgt_ids)`, each `(T,)` | too-long pairs refused |
# | dynamic padding | `collate_translations` | `src (B, T_src)`, `tgt_in, tgt_out (B, T_tgt)`, `src_lengths (B,)` | padded to the longest in the batch |
# | batches by tokens | `TokenBatchSampler(lengths, max_tokens, bucket=True)`, `padding_fraction` | lists of indices, B × longest ≤ `max_tokens` | the budget, with and without bucketing; at most half the padding of random batches |
# | AdamW groups | `param_groups(model, weight_decay)` | two groups: dim ≥ 2, and vectors | decay on matrices (embeddings too), none on norms and biases |
# | schedule | `warmup_cosine(step, warmup, total, min_ratio)` | step → multiplier: (0, 1] in the warmup, then from 1 down to `min_ratio` | peak at the end of warmup, then monotone; equal to PyTorch's `LinearLR` then `CosineAnnealingLR` |
# | accumulation | `accumulate_gradients(model, micro_batches)`, `micro_batch_groups(loader, k)` | k batches → one update | equals one big batch, micro-batches of different widths |
# | mixed precision | `amp_autocast(device, "bfloat16")`, `GradScaler` for float16 | logits `(B, T_tgt, V)` in 16 bits | same gradient direction, untrained and trained; trained model's loss and accuracy as float32's |
# | checkpointing | `set_gradient_checkpointing(model)` | shapes unchanged | same gradients, less memory |
# | early stopping, checkpoints | `EarlyStopping`, `save_training_state`, `load_training_state` | a dict of states (`last.pt`), weights (`best.pt`) | resumed = uninterrupted, `torch.equal` on the CPU; other tokenizers refused; an overfitting run returns its best epoch's weights, not the last's |
# | the loop | `train_translation(model, train, valid, TrainConfig(...))`, on notebook 11's `Trainer` | history: lists per update and per epoch | curves, gradient flow |
# | evaluation | `translate`, `score_translations` | texts → texts; scores 0-100 | exact match and chrF on unseen numbers |
#
# ## Exercises
#
# 1. French counts in twenties: 97 is "quatre-vingt-dix-sept" (four-twenty-ten-seven). Train a
#    French tokenizer on the training numbers and check its round trip. Which pieces does it
#    learn for 70, 71, 80 and 97?
# 2. The loop stops on the validation *loss*, but what we care about is exact match. Why not
#    stop on exact match, and what would it cost?
# 3. You want steps over 4 times more tokens without 4 times the memory. (a) Train with
#    `accum_steps=4` and the same `max_tokens=2048`: what happens to the number of
#    optimizer steps, to the learning-rate schedule (warmup and cosine) and to the memory a
#    step needs? (b) Compare it with `accum_steps=1` and `max_tokens=8192`: is it the
#    same run? If not, what differs?
#
# **Solutions.**
#
# 1. The same code, with `tgt_lang="fr"`:

# %%
corpus_fr = load_corpus(DATA, num_numbers=20_000, seed=0, tgt_lang="fr")
assert [n for n, _, _ in corpus_fr["test"]] == test_numbers  # the same split by number
fr_sample = [row for row in corpus_fr["train"] if row[0] < 1000]  # the blocks: every character
fr_sample += [row for row in corpus_fr["train"] if row[0] >= 1000][:4000]
fr_tokenizer = BPETokenizer.train([fr for _, _, fr in fr_sample], vocab_size=90)
assert all(
    fr_tokenizer.decode(fr_tokenizer.encode(fr)) == fr
    for rows in corpus_fr.values()
    for _, _, fr in rows
)
for n in (70, 71, 80, 97):
    print(n, number_to_words(n, "fr"), fr_tokenizer.tokens(number_to_words(n, "fr")))


def sentences_with(form: str) -> int:
    """Sentences of the sample that hold form as whole words ("soixante-dix", not "-dix-sept")."""
    return sum(f" {form} " in f" {fr} " for _, _, fr in fr_sample)


form_counts = {n: sentences_with(number_to_words(n, "fr")) for n in (70, 71, 97)}
print("sentences of the sample holding the form of", form_counts)


def pair_count(words: Counter, pair: tuple[str, str]) -> int:
    """How often pair is adjacent in words (each word a tuple of symbols, with its count)."""
    return sum(c * list(zip(w, w[1:], strict=False)).count(pair) for w, c in words.items())


fr_words = Counter(tuple(word) for _, _, fr in fr_sample for word in split_words(fr))
et_pairs = {pair: pair_count(fr_words, pair) for pair in ((SPACE, "e"), ("e", "t"))}
merged_counts = []  # each merge's pair count when it was merged, recounted
for pair in fr_tokenizer.merges:
    merged_counts.append(pair_count(fr_words, pair))
    fr_words = Counter({tuple(merge_pair(list(w), pair)): c for w, c in fr_words.items()})
print(f"{len(merged_counts)} merges, each of a pair seen at least {min(merged_counts)} times when "
      f"merged; the pairs of '▁et' are seen {sorted(set(et_pairs.values()))} times")  # fmt: skip
# 71 is not the rare one: every two-digit ending is about as likely (here 83 against 80 and 80;
# the corpora of other seeds gave between 75 and 114 each)
assert form_counts[71] > 0.5 * max(form_counts[70], form_counts[97])
assert max(et_pairs.values()) < min(merged_counts)  # "et" is too rare to get a merge

# %% [markdown]
# The frequent forms become pieces that follow the French arithmetic: 70 is
# "soixante-" + "dix" (sixty-ten) and 97 is "quatre-vingt-" + "dix-" + "sept"
# (four-twenty, ten, seven). 71 is not rarer than these (the counts printed: about as many
# sentences of the sample hold "soixante et onze" as hold 70 or 97), yet it is cut into eleven
# pieces. BPE merges only within a word, and 71 is three words (the "et" form occurs only for
# 21, 31, ..., 71). The pieces learnt for "soixante-", the start of 62 to 79 but 71, take in
# its hyphen ("▁soixante-" above), which the bare word "soixante" of 60, 61 and 71 does not
# have, so its end stays in small pieces ("a", "nt", "e"). And the word "et" never gets a
# merge: its two pairs are seen 553 times, while each of the 62 merges that 90 tokens leave
# room for had a pair seen at least 697 times when it was merged (both printed). A French
# model has to learn the twenties; the word order, unlike German's, stays that of the digits.
#
# 2. Exact match needs generation, one decoder pass per token, which costs several times
#    a teacher-forced validation pass. And it saturates: in the stored run the validation token
#    accuracy is 100.00 % from epoch 6 on, and already in epochs 3 and 4 (the training cell's
#    printout). With every next token right under teacher forcing, greedy decoding writes every
#    number right, so exact match is at its ceiling and can no longer tell the epochs apart,
#    while the loss still falls (0.7694, 0.7687, 0.7684 over epochs 6 to 8). The loss is cheap and keeps measuring; exact
#    match is the final test, computed once.
# 3. (a) Four micro-batches make one optimizer step: about a quarter as many steps per epoch
#    (23 instead of 90), so `total_steps` shrinks about four times. `warmup=60` is a
#    number of *steps* and does not shrink: the warmup now lasts over 2.5 epochs instead of
#    two thirds of one, and only the cosine part gets shorter (divide `warmup` by four
#    to keep the schedule's shape). The memory a step needs for activations stays that of one
#    2048-token micro-batch: each micro-batch's backward pass frees its activations before
#    the next one's forward pass, and only the gradients add up across the four (measured
#    below). (b) Not the same run. Each step's gradient is the exact token mean over its four
#    micro-batches (checked above against one big batch), but *which* pairs share a step
#    differs: with accumulation, a step takes four consecutive batches of the shuffled batch
#    list, drawn from anywhere in the epoch and of different lengths; with `max_tokens=8192`
#    the sampler cuts its sorted pools into batches of about four times as many pairs of
#    similar length. The order of the data, the padding and the number of steps per epoch
#    differ (the last two counted below), so the two runs take different steps.

# %%
batches_8192 = TokenBatchSampler(datasets["train"].lengths, 4 * MAX_TOKENS, seed=0).batches()
waste_8192 = padding_fraction(batches_8192, src_lengths_train, tgt_lengths_train)
print(f"accum_steps=4, max_tokens=2048: {len(groups)} steps an epoch, {waste_bucketed:.1%} padding")
print(f"accum_steps=1, max_tokens=8192: {len(batches_8192)} steps an epoch, {waste_8192:.1%} padding")


# %% tags=["nbval-ignore-output"]
def update_peak(micro_batches: list) -> int:
    """Peak memory of one update's forward and backward passes, the gradients freed before."""
    model.zero_grad(set_to_none=True)
    return peak_memory(
        lambda: accumulate_gradients(model, micro_batches, label_smoothing=config.label_smoothing),
        device if device.type == "cuda" else "cpu",
    )


update_batches = [collate_translations([datasets["train"][i] for i in b]) for b in bucketed[:4]]
peak_single = max(update_peak([b]) for b in update_batches)  # the largest of the four alone
peak_accumulated = update_peak(update_batches)  # accum_steps=4
peak_as_one = update_peak([collate_translations([datasets["train"][i] for b in bucketed[:4] for i in b])])
model.zero_grad(set_to_none=True)
print(f"peak memory of one update: the largest of 4 micro-batches alone {peak_single / 2**20:.1f} MiB, "
      f"the 4 accumulated {peak_accumulated / 2**20:.1f} MiB, the 4 as one batch {peak_as_one / 2**20:.1f} MiB")  # fmt: skip

# %%
if device.type in ("cpu", "cuda"):  # on MPS the profiler sees the CPU, not the GPU's memory
    assert peak_accumulated < 1.2 * peak_single  # accumulation: one micro-batch's activations
    assert peak_as_one > 2 * peak_accumulated  # one batch of all four: several times more

# %% [markdown]
# ## A note on the checks
#
# The numbers in the prose are those of the stored run. Some depend on the seed: the tokenizers
# learn from the sentences a seed draws, and the model from those tokenizers. Such findings are
# asserted exactly only when the tokenizers (`STORED_TOKENIZERS`) or the trained weights
# (`STORED_RUN`) are the stored ones, recognised by a hash; for any other run, only bounds are
# asserted. `make robust` runs the notebook under other seeds and PyTorch's other CPU kernels,
# and `tools/robust.md` records whether the bounds held.
