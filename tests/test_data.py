"""Unit tests of transformer_from_scratch.data (notebook 11): the reversal task."""

import pytest
import torch

from transformer_from_scratch.data import make_batch
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD


def batch(n=500, max_len=8, vocab_size=12, seed=0):
    return make_batch(n, max_len, vocab_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("B", "max_len", "V"), [(1, 3, 4), (7, 5, 12), (64, 8, 12), (3, 20, 50)])
def test_shapes_and_dtypes(B, max_len, V):
    src, tgt_in, tgt_out, lengths = make_batch(B, max_len, V)
    assert src.shape == (B, max_len)
    assert tgt_in.shape == tgt_out.shape == (B, max_len + 1)
    assert lengths.shape == (B,)
    for t in (src, tgt_in, tgt_out, lengths):
        assert t.dtype == torch.long and t.device.type == "cpu"


def test_rows_are_reversals_with_bos_eos_and_padding():
    src, tgt_in, tgt_out, lengths = batch()
    for b in range(src.size(0)):
        L = int(lengths[b])
        seq = src[b, :L]
        rev = torch.flip(seq, dims=[0])
        assert (src[b, L:] == PAD).all()
        assert torch.equal(tgt_in[b, : L + 1], torch.cat([torch.tensor([BOS]), rev]))
        assert torch.equal(tgt_out[b, : L + 1], torch.cat([rev, torch.tensor([EOS])]))
        assert (tgt_in[b, L + 1 :] == PAD).all() and (tgt_out[b, L + 1 :] == PAD).all()


def test_teacher_forcing_shift_and_one_eos_per_row():
    src, tgt_in, tgt_out, lengths = batch()
    assert (tgt_in[:, 0] == BOS).all()
    assert ((tgt_out == EOS).sum(dim=1) == 1).all() and ((tgt_in == EOS).sum() == 0)
    assert ((tgt_in == BOS).sum(dim=1) == 1).all() and ((tgt_out == BOS).sum() == 0)
    symbol = tgt_out[:, :-1] >= 3
    assert torch.equal(tgt_in[:, 1:][symbol], tgt_out[:, :-1][symbol])
    assert torch.equal((tgt_out != PAD).sum(dim=1), lengths + 1)
    assert torch.equal((src != PAD).sum(dim=1), lengths)


def test_symbols_and_lengths_cover_their_ranges():
    src, _, _, lengths = batch(n=2000, max_len=6, vocab_size=9)
    assert set(lengths.tolist()) == {3, 4, 5, 6}
    symbols = src[src != PAD]
    assert set(symbols.tolist()) == set(range(3, 9))  # never PAD, BOS or EOS inside a sequence


def test_lengths_roughly_uniform():
    _, _, _, lengths = batch(n=6000, max_len=8)
    counts = torch.bincount(lengths, minlength=9)[3:].float()  # six lengths, ~1000 each
    assert (counts > 850).all() and (counts < 1150).all()


def test_generator_determinism():
    a, b, c = batch(seed=3), batch(seed=3), batch(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_generator_stream_advances():
    g = torch.Generator().manual_seed(0)
    first, second = make_batch(32, 8, 12, g)[0], make_batch(32, 8, 12, g)[0]
    assert not torch.equal(first, second)


def test_global_rng_untouched_when_a_generator_is_given():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    make_batch(16, 8, 12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 8, 12), ValueError, "batch_size must be at least 1"),
        ((4, 2, 12), ValueError, "max_len must be at least 3"),
        ((4, 8, 3), ValueError, "vocab_size must be at least 4"),
        ((4.0, 8, 12), TypeError, "batch_size must be an int"),
        ((4, True, 12), TypeError, "max_len must be an int"),
    ],
)
def test_bad_sizes(args, error, match):
    with pytest.raises(error, match=match):
        make_batch(*args)


def test_bad_generator():
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        make_batch(4, 8, 12, generator=0)
