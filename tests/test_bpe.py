"""Unit tests of transformer_from_scratch.bpe (notebook 13)."""

import json
from collections import Counter

import pytest

from transformer_from_scratch.bpe import SPACE
from transformer_from_scratch.bpe import SPECIAL_TOKENS
from transformer_from_scratch.bpe import UNK
from transformer_from_scratch.bpe import BPETokenizer
from transformer_from_scratch.bpe import learn_merges
from transformer_from_scratch.bpe import merge_pair
from transformer_from_scratch.bpe import split_words
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD

CORPUS = [
    "zweiundvierzig",
    "dreiundvierzig",
    "zweiundzwanzig",
    "vierhundert",
    "dreihundertzweiundvierzig",
    "low lower lowest",
    "new newer newest",
]


@pytest.fixture(scope="module")
def tokenizer():
    return BPETokenizer.train(CORPUS, vocab_size=40)


def naive_merges(word_counts, num_merges):
    """Recount every pair after every merge: slow, obviously right."""
    words = {tuple(w): c for w, c in word_counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for symbols, c in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                pairs[pair] += c
        if not pairs:
            break
        best, count = min(pairs.items(), key=lambda item: (-item[1], item[0]))
        if count < 2:
            break
        merges.append(best)
        words = {tuple(merge_pair(list(s), best)): c for s, c in words.items()}
    return merges


def test_split_words_marks_every_word_and_keeps_spaces():
    assert split_words("a bc") == [SPACE + "a", SPACE + "bc"]
    assert split_words("a  b") == [SPACE + "a", SPACE, SPACE + "b"]  # double space kept


def test_split_words_rejects_bad_text():
    with pytest.raises(ValueError, match="empty"):
        split_words("")
    with pytest.raises(TypeError, match="str"):
        split_words(42)
    with pytest.raises(ValueError, match="marks word starts"):
        split_words(f"a{SPACE}b")


def test_merge_pair_merges_every_occurrence_left_to_right():
    assert merge_pair(list("abab"), ("a", "b")) == ["ab", "ab"]
    assert merge_pair(list("aaa"), ("a", "a")) == ["aa", "a"]
    assert merge_pair(list("xyz"), ("a", "b")) == list("xyz")


def test_learn_merges_matches_the_naive_algorithm():
    counts = Counter(w for text in CORPUS for w in split_words(text))
    assert learn_merges(counts, 40) == naive_merges(counts, 40)
    assert learn_merges(counts, 0) == []


def test_learn_merges_takes_the_most_frequent_pair_first():
    assert learn_merges({"ab": 5, "cd": 3, "abcd": 1}, 1) == [("a", "b")]
    with pytest.raises(ValueError, match="num_merges"):
        learn_merges({"ab": 1}, -1)


def test_special_ids_agree_with_the_library(tokenizer):
    assert tokenizer.id_to_token[:4] == list(SPECIAL_TOKENS)
    assert (PAD, BOS, EOS, UNK) == (0, 1, 2, 3)
    ids = tokenizer.encode("zweiundvierzig")
    assert ids[0] == BOS and ids[-1] == EOS
    assert BOS not in tokenizer.encode("zweiundvierzig", add_special=False)


def test_round_trip_is_exact_on_seen_and_unseen_text(tokenizer):
    for text in [*CORPUS, "vierundzwanzig", "zwei  drei", " lead", "newest low"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_vocab_size_is_reached_and_frequent_pieces_are_single_tokens(tokenizer):
    assert tokenizer.vocab_size == 40
    # Asked for more than the corpus repeats, training stops when no pair occurs twice.
    assert BPETokenizer.train(CORPUS, vocab_size=500).vocab_size < 500
    assert "und" in "".join(tokenizer.tokens("zweiundvierzig"))
    assert len(tokenizer.tokens("zweiundvierzig")) < len("zweiundvierzig")


def test_unknown_characters_become_unk_or_raise(tokenizer):
    ids = tokenizer.encode("zwei€", add_special=False)
    assert ids[-1] == UNK
    assert tokenizer.decode(ids) == "zwei\ufffd"
    with pytest.raises(ValueError, match="'€'"):
        tokenizer.encode("zwei€", unknown="error")
    # the message names the character, its word and the whole text (a corpus has many sentences)
    with pytest.raises(ValueError, match=r"'€' in 'zwei€' is not .*, in the text 'drei und zwei€'"):
        tokenizer.encode("drei und zwei€", unknown="error")
    with pytest.raises(ValueError, match="unknown"):
        tokenizer.encode("zwei", unknown="ignore")


def test_decode_rejects_ids_outside_the_vocabulary(tokenizer):
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([tokenizer.vocab_size])
    with pytest.raises(TypeError):
        tokenizer.decode([1.5])


def test_train_rejects_bad_corpora():
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer.train([], vocab_size=20)
    with pytest.raises(ValueError, match="empty"):
        BPETokenizer.train(["ab", ""], vocab_size=20)
    with pytest.raises(ValueError, match="smaller"):
        BPETokenizer.train(["abcdefghij"], vocab_size=8)
    with pytest.raises(TypeError):
        BPETokenizer.train(["ab"], vocab_size="20")


def test_save_and_load_round_trip(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "tok.json")
    loaded = BPETokenizer.load(path, fingerprint=tokenizer.fingerprint())
    assert loaded.id_to_token == tokenizer.id_to_token
    assert loaded.encode("dreiundzwanzig") == tokenizer.encode("dreiundzwanzig")
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]  # no temporary file left


def test_save_puts_the_bytes_on_disk_before_the_rename(tokenizer, tmp_path, monkeypatch):
    import os

    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), replace(a, b))[1])
    tokenizer.save(tmp_path / "tok.json")
    assert calls == ["fsync", "replace"]


def test_load_refuses_another_vocabulary_and_bad_files(tokenizer, tmp_path):
    other = BPETokenizer.train(["abc abd"], vocab_size=12)
    path = other.save(tmp_path / "other.json")
    with pytest.raises(ValueError, match="another vocabulary"):
        BPETokenizer.load(path, fingerprint=tokenizer.fingerprint())
    state = json.loads(path.read_text(encoding="utf-8"))
    state["merges"] = state["merges"][:-1]
    (tmp_path / "edited.json").write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(ValueError, match="edited"):
        BPETokenizer.load(tmp_path / "edited.json")
    state["special_tokens"] = ["<s>", "</s>", "<pad>", "<unk>"]
    (tmp_path / "specials.json").write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(ValueError, match="special tokens"):
        BPETokenizer.load(tmp_path / "specials.json")
    (tmp_path / "junk.json").write_text("not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not a tokenizer"):
        BPETokenizer.load(tmp_path / "junk.json")


def test_parity_with_hugging_face_tokenizers_on_vocabulary_size():
    from tokenizers import Tokenizer
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE)
    trainer = trainers.BpeTrainer(
        vocab_size=40, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    hf.train_from_iterator(CORPUS, trainer=trainer)
    ours = BPETokenizer.train(CORPUS, vocab_size=40)
    assert ours.vocab_size == hf.get_vocab_size() == 40
    # Both learn the most frequent pieces: the first merges agree.
    hf_tokens = set(hf.get_vocab())
    assert {a + b for a, b in ours.merges[:3]} <= hf_tokens


def test_every_reserved_id_lives_in_tokens():
    from transformer_from_scratch import bpe
    from transformer_from_scratch import tokens

    assert (tokens.PAD, tokens.BOS, tokens.EOS, tokens.UNK) == (0, 1, 2, 3)
    assert bpe.UNK == tokens.UNK and "UNK" not in bpe.__all__ and "UNK" in tokens.__all__
    assert len(bpe.SPECIAL_TOKENS) == tokens.UNK + 1  # one name per reserved id
