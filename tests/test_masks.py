"""Unit tests of transformer_from_scratch.masks (notebook 05)."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask

# ---------------------------------------------------------------- causal_mask


@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_causal_mask_shape_dtype_values(T):
    mask = causal_mask(T)
    assert mask.shape == (1, 1, T, T)
    assert mask.dtype == torch.bool
    i = torch.arange(T).view(T, 1)
    j = torch.arange(T).view(1, T)
    assert torch.equal(mask[0, 0], j <= i)


def test_causal_mask_small_case_by_hand():
    rows = [[True, False, False], [True, True, False], [True, True, True]]
    assert torch.equal(causal_mask(3), torch.tensor(rows).view(1, 1, 3, 3))


def test_causal_mask_matches_nn_transformer():
    builtin = nn.Transformer.generate_square_subsequent_mask(6)  # float: 0 keep, -inf block
    assert torch.equal(causal_mask(6)[0, 0], builtin == 0)


def test_causal_mask_matches_sdpa_is_causal():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, 5, 4, generator=g)  # each (B, h, T, d_k)
    with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(5))
    torch.testing.assert_close(with_mask, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_causal_mask_device(device):
    mask = causal_mask(4, device=device)
    expected = torch.device("cpu") if device is None else torch.device(device)
    assert mask.device == expected
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool


def test_causal_mask_is_built_on_the_requested_device():
    # The meta device stands in for a GPU: placement is checked without one.
    mask = causal_mask(4, device="meta")
    assert mask.device.type == "meta" and mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool


def test_causal_mask_accepts_integer_like_T():
    assert causal_mask(np.int64(3)).shape == (1, 1, 3, 3)
    assert causal_mask(torch.tensor(3)).shape == (1, 1, 3, 3)


@pytest.mark.parametrize("T", [0, -1])
def test_causal_mask_rejects_T_below_one(T):
    with pytest.raises(ValueError, match=rf"T must be at least 1, got {T}"):
        causal_mask(T)


@pytest.mark.parametrize("T", [3.0, "3", None, True, torch.tensor(3.0)])
def test_causal_mask_rejects_non_int_T(T):
    with pytest.raises(TypeError, match=r"T must be an int"):
        causal_mask(T)


# ---------------------------------------------------------------- padding_mask


def test_padding_mask_shape_dtype_values():
    mask = padding_mask(torch.tensor([3, 1, 4, 0]), T_k=4)
    assert mask.shape == (4, 1, 1, 4)
    assert mask.dtype == torch.bool
    expected = torch.tensor(
        [
            [True, True, True, False],
            [True, False, False, False],
            [True, True, True, True],
            [False, False, False, False],
        ]
    )
    assert torch.equal(mask[:, 0, 0], expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_padding_mask_integer_dtypes(dtype):
    mask = padding_mask(torch.tensor([2, 5], dtype=dtype), T_k=5)
    assert torch.equal(mask.sum(dim=-1).flatten(), torch.tensor([2, 5]))


def test_padding_mask_accepts_a_list():
    assert torch.equal(padding_mask([2, 3], 3), padding_mask(torch.tensor([2, 3]), 3))


def test_padding_mask_empty_batch():
    assert padding_mask(torch.zeros(0, dtype=torch.long), 3).shape == (0, 1, 1, 3)


def test_padding_mask_follows_the_device_of_lengths():
    lengths = torch.tensor([1, 2], device="cpu")
    assert padding_mask(lengths, 2).device == lengths.device


def test_padding_mask_matches_key_padding_mask_of_multihead_attention():
    """Ours, flipped, is nn.MultiheadAttention's key_padding_mask (True = padding)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g)
    lengths = torch.tensor([5, 3])
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, num_heads=2, batch_first=True)
    ours = padding_mask(lengths, 5)  # (B, 1, 1, T_k)
    out_kpm, w_kpm = mha(x, x, x, key_padding_mask=~ours[:, 0, 0], average_attn_weights=False)
    mha_mask = ~ours.expand(2, 2, 5, 5).reshape(4, 5, 5)  # (B*h, T_q, T_k), True = blocked
    out_am, w_am = mha(x, x, x, attn_mask=mha_mask, average_attn_weights=False)
    torch.testing.assert_close(out_kpm, out_am)
    torch.testing.assert_close(w_kpm, w_am)
    assert (w_kpm[1, :, :, 3:] == 0).all()


def test_padding_mask_rejects_float_lengths():
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype torch.float32"):
        padding_mask(torch.tensor([2.0, 3.0]), 4)
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype torch.float32"):
        padding_mask([2.0, 3.0], 4)


def test_padding_mask_rejects_bool_lengths():
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype torch.bool"):
        padding_mask(torch.tensor([True, False]), 4)


@pytest.mark.parametrize("shape", [(), (2, 1), (1, 2, 3)])
def test_padding_mask_rejects_lengths_that_are_not_1d(shape):
    lengths = torch.ones(shape, dtype=torch.long)
    message = rf"lengths must be 1-D, got shape {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=message):
        padding_mask(lengths, 4)


@pytest.mark.parametrize(
    "lengths, message",
    [
        ([2, 5], r"between 0 and T_k=4, got lengths\[1\]=5"),
        ([-1, 2], r"between 0 and T_k=4, got lengths\[0\]=-1"),
        ([4, 4, 9, -3], r"between 0 and T_k=4, got lengths\[2\]=9"),
    ],
)
def test_padding_mask_rejects_lengths_out_of_range(lengths, message):
    with pytest.raises(ValueError, match=message):
        padding_mask(torch.tensor(lengths), 4)


@pytest.mark.parametrize("T_k", [0, -2])
def test_padding_mask_rejects_T_k_below_one(T_k):
    with pytest.raises(ValueError, match=rf"T_k must be at least 1, got {T_k}"):
        padding_mask(torch.tensor([0]), T_k)


def test_padding_mask_rejects_non_int_T_k():
    with pytest.raises(TypeError, match=r"T_k must be an int"):
        padding_mask(torch.tensor([1]), 4.0)


# ---------------------------------------------------------------- combined, with attention shapes


def test_combined_mask_broadcasts_to_b_1_t_t():
    lengths = torch.tensor([5, 2, 4])
    combined = causal_mask(5) & padding_mask(lengths, 5)
    assert combined.shape == (3, 1, 5, 5) and combined.dtype == torch.bool
    i = torch.arange(5).view(1, 5, 1)
    j = torch.arange(5).view(1, 1, 5)
    expected = (j <= i) & (j < lengths.view(3, 1, 1))  # (B, T, T)
    assert torch.equal(combined[:, 0], expected)
    assert combined.any(dim=-1).all()  # right padding leaves every query a key


def test_masks_broadcast_against_multi_head_scores():
    B, h, T_q, T_k, d_k = 2, 3, 4, 6, 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, h, T_q, d_k, generator=g)
    k, v = torch.randn(2, B, h, T_k, d_k, generator=g)
    pad = padding_mask(torch.tensor([6, 3]), T_k)  # (B, 1, 1, T_k)
    scores = q @ k.transpose(-2, -1)  # (B, h, T_q, T_k)
    assert torch.broadcast_shapes(pad.shape, scores.shape) == scores.shape
    assert torch.broadcast_shapes(causal_mask(T_k).shape, (B, h, T_k, T_k)) == (B, h, T_k, T_k)
    # Cross-attention with a padding mask: blocked keys get exactly zero weight.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    ref = torch.softmax(scores.masked_fill(~pad, float("-inf")) / d_k**0.5, dim=-1) @ v
    torch.testing.assert_close(out, ref)


def test_masked_attention_gradients_match_builtin():
    """Masks from this module give the same values and gradients in ours-style and built-in."""
    T = 5
    mask = causal_mask(T) & padding_mask(torch.tensor([5, 3]), T)  # (B, 1, T, T)
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, 2, T, 4, generator=g))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1) / 2.0).masked_fill(~mask, float("-inf"))
    ours = torch.softmax(scores, dim=-1) @ v
    builtin = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    torch.testing.assert_close(ours, builtin)
    upstream = torch.randn(ours.shape, generator=g)
    (ours * upstream).sum().backward()
    (builtin * upstream).sum().backward()
    for a, b in [(q, q2), (k, k2), (v, v2)]:
        torch.testing.assert_close(a.grad, b.grad)
    assert (k.grad[1, :, 3:] == 0).all() and (v.grad[1, :, 3:] == 0).all()  # padded keys


def test_masks_with_the_package_attention_and_empty_rows():
    """Our attention with these masks: zeros (not NaN) on empty rows, built-in parity elsewhere.

    What the built-in returns on an empty row depends on the torch version (NaN before 2.5), so
    it is compared on the other rows only, and for the gradients it gets the empty rows opened to
    every key with no upstream gradient there: its answer on those rows cannot enter.
    """
    from transformer_from_scratch.attention import scaled_dot_product_attention

    T = 5
    pad = padding_mask(torch.tensor([5, 3]), T)  # (B, 1, 1, T)
    square = causal_mask(T) & pad & pad.transpose(-1, -2)  # padded queries masked too
    empty = ~square.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    assert empty.sum().item() == 2  # queries 3 and 4 of sequence 1
    g = torch.Generator().manual_seed(4)
    q, k, v = (t.requires_grad_() for t in torch.randn(3, 2, 1, T, 4, generator=g))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    context, attn = scaled_dot_product_attention(q, k, v, mask=square)
    assert not context.isnan().any() and not attn.isnan().any()
    assert (attn.masked_select(empty) == 0).all() and (context.masked_select(empty) == 0).all()
    builtin = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=square | empty)
    keep = ~empty.expand_as(context)
    torch.testing.assert_close(context[keep], builtin[keep])
    upstream = torch.randn(context.shape, generator=g)
    (context * upstream).sum().backward()
    (builtin * upstream.masked_fill(~keep, 0.0)).sum().backward()
    for a, b in [(q, q2), (k, k2), (v, v2)]:
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, b.grad)
