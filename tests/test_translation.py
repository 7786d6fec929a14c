"""Unit tests of transformer_from_scratch.translation (notebook 13)."""

from importlib.metadata import version

import pytest
import torch

from transformer_from_scratch.bpe import BPETokenizer
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.translation import MAX_NUMBER
from transformer_from_scratch.translation import TokenBatchSampler
from transformer_from_scratch.translation import TranslationDataset
from transformer_from_scratch.translation import collate_translations
from transformer_from_scratch.translation import load_corpus
from transformer_from_scratch.translation import number_to_words
from transformer_from_scratch.translation import padding_fraction
from transformer_from_scratch.translation import score_translations
from transformer_from_scratch.translation import split_numbers
from transformer_from_scratch.translation import translate

NUMBERS = [0, 7, 13, 42, 71, 99, 100, 342, 1001, 20_005, 342_057, 999_999]
PAIRS = [(number_to_words(n, "en"), number_to_words(n, "de")) for n in NUMBERS]


@pytest.fixture(scope="module")
def tokenizers():
    src = BPETokenizer.train([en for en, _ in PAIRS], vocab_size=60)
    tgt = BPETokenizer.train([de for _, de in PAIRS], vocab_size=60)
    return src, tgt


def test_split_numbers_is_disjoint_complete_and_deterministic():
    splits = split_numbers(5000, seed=3)
    sets = {k: set(v) for k, v in splits.items()}
    assert [len(splits[k]) for k in ("train", "valid", "test")] == [4000, 500, 500]
    assert not (sets["train"] & sets["valid"] or sets["train"] & sets["test"])
    assert not sets["valid"] & sets["test"]
    assert set(range(1000)) <= sets["train"]  # the building blocks are all trained on
    assert min(sets["valid"] | sets["test"]) >= 1000  # held-out numbers are compositions
    assert max(max(v) for v in splits.values()) <= MAX_NUMBER
    assert split_numbers(5000, seed=3) == splits
    assert split_numbers(5000, seed=4) != splits


def test_split_numbers_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_numbers"):
        split_numbers(10)
    with pytest.raises(ValueError, match="more than"):
        split_numbers(MAX_NUMBER + 2)
    with pytest.raises(ValueError, match="leave room"):
        split_numbers(2000, valid=0.5, test=0.5)
    with pytest.raises(ValueError, match="no room"):
        split_numbers(1100)  # 110 + 110 held out, but only 100 numbers are 1000 or more
    with pytest.raises(TypeError):
        split_numbers(2000.0)


def test_number_to_words_spells_out_german_and_french():
    assert number_to_words(42, "de") == "zweiundvierzig"
    assert number_to_words(97, "fr") == "quatre-vingt-dix-sept"
    assert number_to_words(342_007, "en") == "three hundred and forty-two thousand and seven"
    with pytest.raises(ValueError, match="beyond"):
        number_to_words(MAX_NUMBER + 1, "de")
    with pytest.raises(ValueError, match="lang"):
        number_to_words(1, "xx")
    with pytest.raises(ValueError):
        number_to_words(-1, "de")


def test_number_to_words_corrects_num2words_einstausend():
    # num2words 0.5.14 writes 101,000 as "einhunderteinstausend"; German drops the "s" of "eins"
    # before "tausend", as in "eintausend" (1,000) and "einundzwanzigtausend" (21,000).
    assert number_to_words(101_000, "de") == "einhunderteintausend"
    assert number_to_words(901_001, "de") == "neunhunderteintausendeins"
    assert number_to_words(1_000, "de") == "eintausend"
    assert number_to_words(21_000, "de") == "einundzwanzigtausend"
    assert number_to_words(101, "de") == "einhunderteins"  # a final "eins" keeps its "s"
    assert number_to_words(101_000, "en") == "one hundred and one thousand"


def test_german_numbers_are_their_blocks_around_tausend():
    blocks = {n: number_to_words(n, "de") for n in range(1000)}

    def rule(n):
        head = blocks[n // 1000]
        head = head[:-1] if head.endswith("eins") else head
        return head + "tausend" + (blocks[n % 1000] if n % 1000 else "")

    numbers = [*range(1000, 1_000_000, 997), *(k * 1000 + 1 for k in range(101, 1000, 100))]
    assert [number_to_words(n, "de") for n in numbers] == [rule(n) for n in numbers]


def test_load_corpus_caches_and_reads_back(tmp_path):
    corpus = load_corpus(tmp_path, num_numbers=1500, seed=0, tgt_lang="de")
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    assert f"num2words{version('num2words')}" in files[0].name  # another version: another file
    again = load_corpus(tmp_path, num_numbers=1500, seed=0, tgt_lang="de")
    assert again == corpus
    n, en, de = corpus["test"][0]
    assert (en, de) == (number_to_words(n, "en"), number_to_words(n, "de"))
    with pytest.raises(ValueError, match="tgt_lang"):
        load_corpus(tmp_path, 1200, tgt_lang="en")


def test_load_corpus_puts_the_bytes_on_disk_before_the_rename(tmp_path, monkeypatch):
    import os

    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), replace(a, b))[1])
    load_corpus(tmp_path, num_numbers=1500, seed=0, tgt_lang="de")
    assert calls == ["fsync", "replace"]
    assert [f.name for f in tmp_path.iterdir() if f.suffix == ".tmp"] == []


def test_dataset_items_have_bos_and_eos(tokenizers):
    dataset = TranslationDataset(PAIRS, *tokenizers, max_len=40)
    src, tgt = dataset[3]
    assert len(dataset) == len(PAIRS)
    assert src[0] == BOS and src[-1] == EOS and tgt[0] == BOS and tgt[-1] == EOS
    assert tokenizers[1].decode(tgt.tolist()) == PAIRS[3][1]
    assert dataset.lengths[3] == max(len(src), len(tgt))
    assert (dataset.src_lengths[3], dataset.tgt_lengths[3]) == (len(src), len(tgt))


def test_dataset_rejects_long_pairs_unknown_characters_and_emptiness(tokenizers):
    with pytest.raises(ValueError, match="max_len=3"):
        TranslationDataset(PAIRS, *tokenizers, max_len=3)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TranslationDataset([("seven €", "sieben")], *tokenizers, max_len=40)
    with pytest.raises(ValueError, match="empty"):
        TranslationDataset([], *tokenizers, max_len=40)
    with pytest.raises(ValueError, match="empty"):
        TranslationDataset([("", "sieben")], *tokenizers, max_len=40)


def test_collate_pads_to_the_longest_and_shifts_the_target(tokenizers):
    dataset = TranslationDataset(PAIRS, *tokenizers, max_len=40)
    items = [dataset[0], dataset[11]]
    src, tgt_in, tgt_out, lengths = collate_translations(items)
    assert src.shape == (2, max(len(items[0][0]), len(items[1][0])))
    assert lengths.tolist() == [len(items[0][0]), len(items[1][0])]
    assert (src[0, lengths[0] :] == PAD).all()
    assert torch.equal(padding_mask(lengths, src.size(1))[:, 0, 0], src != PAD)
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1]) and (tgt_in[:, 0] == BOS).all()
    with pytest.raises(ValueError, match="empty"):
        collate_translations([])


@pytest.mark.parametrize("bucket", [True, False])
def test_sampler_respects_the_budget_covers_everything_and_is_reproducible(bucket):
    # Unsorted (bucket=False), a pair can be shorter than the batch's longest so far: the budget
    # must count the running longest, not the newest pair's length.
    lengths = [(i * 7919) % 23 + 3 for i in range(500)]
    sampler = TokenBatchSampler(lengths, max_tokens=128, bucket=bucket, seed=1)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 for b in batches)
    assert list(sampler) == batches and len(sampler) == len(batches)
    sampler.set_epoch(1)
    assert list(sampler) != batches  # a new order each epoch


def test_bucketing_wastes_less_padding_than_random_batches():
    lengths = [(i * 7919) % 23 + 3 for i in range(2000)]
    bucketed = TokenBatchSampler(lengths, 256, bucket=True).batches()
    random_batches = TokenBatchSampler(lengths, 256, bucket=False).batches()
    assert padding_fraction(bucketed, lengths) < padding_fraction(random_batches, lengths) / 2


def test_padding_fraction_counts_padded_positions():
    assert padding_fraction([[0, 1]], [2, 4]) == pytest.approx(0.25)  # 6 of 8 real
    assert padding_fraction([[0], [1]], [2, 4]) == 0.0
    with pytest.raises(ValueError, match="empty"):
        padding_fraction([[]], [1])
    with pytest.raises(ValueError, match="at least one"):
        padding_fraction([[0]])


def test_padding_fraction_pads_each_tensor_separately():
    # src lengths 2, 4 and tgt lengths 5, 1: each tensor padded to its own longest.
    # src: 6 real of 8, tgt: 6 real of 10; together 12 of 18, not max-side 9 of 10.
    assert padding_fraction([[0, 1]], [2, 4], [5, 1]) == pytest.approx(1 - 12 / 18)
    assert padding_fraction([[0, 1]], [2, 4], [5, 1]) > padding_fraction([[0, 1]], [5, 4])


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatchSampler([5, 10], max_tokens=8)  # the longest pair does not fit
    with pytest.raises(ValueError, match="empty"):
        TokenBatchSampler([], max_tokens=8)
    with pytest.raises(ValueError, match="length"):
        TokenBatchSampler([0, 3], max_tokens=8)


def test_score_translations_against_sacrebleu_by_hand():
    scores = score_translations(["zwei", "drei"], ["zwei", "vier"])
    assert scores["exact_match"] == 50.0
    perfect = score_translations(["zwei drei"], ["zwei drei"])
    assert perfect["bleu_char"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    assert 0 < scores["chrf"] < 100
    with pytest.raises(ValueError, match="as many"):
        score_translations(["a"], ["a", "b"])
    with pytest.raises(TypeError):
        score_translations([1], ["a"])


def test_translate_greedy_and_beam_return_text(tokenizers):
    src_tok, tgt_tok = tokenizers
    model = Transformer(src_tok.vocab_size, tgt_tok.vocab_size, d_model=16, num_heads=2, d_ff=32,
                        num_layers=1, max_len=24)  # fmt: skip
    texts = [en for en, _ in PAIRS[:5]]
    greedy = translate(model, src_tok, tgt_tok, texts, batch_size=2, max_new_tokens=6)
    beam = translate(model, src_tok, tgt_tok, texts, beam_size=2, max_new_tokens=6)
    assert len(greedy) == len(beam) == 5 and all(isinstance(t, str) for t in greedy + beam)
    with pytest.raises(ValueError, match="beam_size"):
        translate(model, src_tok, tgt_tok, texts, beam_size=0)
