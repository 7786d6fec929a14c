"""Unit tests of transformer_from_scratch.attention.scaled_dot_product_attention (notebook 02)."""

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_from_scratch.attention import scaled_dot_product_attention


def _inputs(shape_q, shape_k, shape_v, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = (shape_q, shape_k, shape_v)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _float_mask(T_q, T_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.randn(T_q, T_k, generator=gen, dtype=torch.float64)
    mask[torch.rand(T_q, T_k, generator=gen) < 0.4] = float("-inf")
    mask[:, 0] = 0.0  # every query keeps a key: PyTorch and we agree row for row
    return mask


CAUSAL = torch.ones(6, 6, dtype=torch.bool).tril()
CAUSAL_FLOAT = torch.zeros(6, 6).masked_fill(~CAUSAL, -math.inf)  # the same mask, additive
PADDING = torch.arange(6) < torch.tensor([6, 3]).view(2, 1, 1, 1)  # (B, 1, 1, T_k)
CASES = {
    "2d": ((6, 8), (6, 8), (6, 8), None),
    "3d-self": ((2, 6, 8), (2, 6, 8), (2, 6, 8), None),
    "3d-cross": ((2, 4, 8), (2, 9, 8), (2, 9, 5), None),
    "4d-heads": ((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 4), None),
    "5d": ((2, 2, 2, 5, 4), (2, 2, 2, 7, 4), (2, 2, 2, 7, 3), None),
    "causal-bool": ((2, 6, 8), (2, 6, 8), (2, 6, 8), CAUSAL),
    "causal-bool-4d": ((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8), CAUSAL),
    "padding-bool": ((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 4), PADDING),
    "float-cross": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), _float_mask(5, 7)),
    "float-causal": ((2, 6, 8), (2, 6, 8), (2, 6, 8), CAUSAL_FLOAT),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_values_and_grads_with_torch(name):
    shape_q, shape_k, shape_v, mask = CASES[name]
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    Q, K, V = _inputs(shape_q, shape_k, shape_v, seed=len(name))
    ours, attn = scaled_dot_product_attention(Q, K, V, mask=mask)
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    assert ours.shape == (*theirs.shape[:-1], shape_v[-1])
    assert attn.shape == (*ours.shape[:-1], shape_k[-2])
    torch.testing.assert_close(ours, theirs)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1), dtype=ours.dtype)
    for g_ours, g_theirs in zip(
        torch.autograd.grad(ours, (Q, K, V), upstream),
        torch.autograd.grad(theirs, (Q, K, V), upstream),
        strict=True,
    ):
        torch.testing.assert_close(g_ours, g_theirs)


def test_float32_parity():
    Q, K, V = _inputs((2, 4, 16, 32), (2, 4, 16, 32), (2, 4, 16, 32), dtype=torch.float32)
    torch.testing.assert_close(
        scaled_dot_product_attention(Q, K, V)[0], F.scaled_dot_product_attention(Q, K, V)
    )


def test_matches_the_formula_and_broadcasts_batch_dims():
    Q, K, V = _inputs((2, 3, 5, 8), (1, 3, 7, 8), (7, 4))  # K and V broadcast over the batch
    context, attn = scaled_dot_product_attention(Q, K, V)
    expected_attn = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(attn, expected_attn)
    torch.testing.assert_close(context, expected_attn @ V)
    assert context.shape == (2, 3, 5, 4) and attn.shape == (2, 3, 5, 7)


@pytest.mark.parametrize("mask", [None, CAUSAL, PADDING])
def test_rows_sum_to_one_and_masked_weights_are_zero(mask):
    Q, K, V = _inputs((2, 3, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8))
    _, attn = scaled_dot_product_attention(Q, K, V, mask=mask)
    torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1], dtype=attn.dtype))
    if mask is not None:
        assert torch.all(attn[~mask.expand_as(attn)] == 0)


def test_bool_and_additive_masks_agree():
    Q, K, V = _inputs((2, 6, 8), (2, 6, 8), (2, 6, 8))
    additive = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~CAUSAL, -math.inf)
    for a, b in zip(
        scaled_dot_product_attention(Q, K, V, mask=CAUSAL),
        scaled_dot_product_attention(Q, K, V, mask=additive),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_float32_mask_works_with_float64_inputs():
    Q, K, V = _inputs((6, 8), (6, 8), (6, 8))
    mask32 = torch.zeros(6, 6).masked_fill(~CAUSAL, -math.inf)  # float32
    torch.testing.assert_close(
        scaled_dot_product_attention(Q, K, V, mask=mask32)[0],
        scaled_dot_product_attention(Q, K, V, mask=CAUSAL)[0],
    )


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_row_gives_zeros_and_finite_grads(kind):
    Q, K, V = _inputs((2, 4, 8), (2, 5, 8), (2, 5, 3))
    allowed = torch.ones(2, 4, 5, dtype=torch.bool)
    allowed[0, 1] = False  # query 1 of sequence 0 may see no key
    allowed[1, :, 3:] = False  # an ordinary padding pattern elsewhere
    mask = allowed if kind == "bool" else torch.zeros(2, 4, 5).masked_fill(~allowed, -math.inf)
    context, attn = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert not torch.isnan(context).any() and not torch.isnan(attn).any()
    assert torch.all(attn[0, 1] == 0) and torch.all(context[0, 1] == 0)
    rows = attn.sum(-1)
    rows_expected = torch.ones_like(rows)
    rows_expected[0, 1] = 0
    torch.testing.assert_close(rows, rows_expected)
    # The other rows are exactly what PyTorch computes.
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed)
    torch.testing.assert_close(context[1], theirs[1])
    torch.testing.assert_close(context[0, [0, 2, 3]], theirs[0, [0, 2, 3]])
    (context.sum() + attn.sum()).backward()
    for t in (Q, K, V):
        assert torch.isfinite(t.grad).all()
    assert torch.all(Q.grad[0, 1] == 0)


def test_all_rows_masked():
    Q, K, V = _inputs((3, 4), (3, 4), (3, 2))
    context, attn = scaled_dot_product_attention(Q, K, V, mask=torch.zeros(3, 3, dtype=torch.bool))
    assert torch.equal(context, torch.zeros(3, 2, dtype=context.dtype))
    assert torch.equal(attn, torch.zeros(3, 3, dtype=attn.dtype))


def test_dropout_is_identity_in_eval_and_when_p_is_zero():
    Q, K, V = _inputs((2, 16, 8), (2, 16, 8), (2, 16, 8))
    plain = scaled_dot_product_attention(Q, K, V)
    for kwargs in ({"dropout_p": 0.5, "training": False}, {"dropout_p": 0.0, "training": True}):
        for a, b in zip(plain, scaled_dot_product_attention(Q, K, V, **kwargs), strict=True):
            assert torch.equal(a, b)


def test_dropout_in_training_zeroes_about_p_and_scales_survivors():
    Q, K, V = _inputs((4, 64, 16), (4, 64, 16), (4, 64, 16))
    p = 0.2
    _, plain = scaled_dot_product_attention(Q, K, V)
    torch.manual_seed(0)
    context, dropped = scaled_dot_product_attention(Q, K, V, dropout_p=p, training=True)
    kept = dropped != 0
    assert abs((1 - kept.double().mean().item()) - p) < 0.02  # 16,384 draws: 4 sigma is 0.012
    torch.testing.assert_close(dropped[kept], plain[kept] / (1 - p))
    assert abs(dropped.sum(-1).mean().item() - 1) < 0.02  # inverted dropout keeps the mean
    torch.testing.assert_close(context, dropped @ V)  # the context uses the dropped weights
    torch.manual_seed(0)
    again = scaled_dot_product_attention(Q, K, V, dropout_p=p, training=True)[1]
    assert torch.equal(dropped, again)  # seeded: reproducible


def test_gradcheck():
    Q, K, V = _inputs((2, 3, 4), (2, 5, 4), (2, 5, 2))
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(0)) < 0.7
    mask[:, 0] = True
    assert torch.autograd.gradcheck(
        lambda q, k, v: scaled_dot_product_attention(q, k, v, mask=mask)[0], (Q, K, V)
    )


BAD_INPUTS = {
    "Q not a tensor": ((lambda Q, K, V: ([[1.0]], K, V)), TypeError, "Q must be a torch.Tensor"),
    "Q rank 1": ((lambda Q, K, V: (Q[0, 0], K, V)), ValueError, r"at least 2 dims.*\(8,\)"),
    "K rank 1": ((lambda Q, K, V: (Q, K[0, 0], V)), ValueError, "K must have at least 2 dims"),
    "V rank 1": ((lambda Q, K, V: (Q, K, V[0, 0])), ValueError, "V must have at least 2 dims"),
    "integer Q": ((lambda Q, K, V: (Q.long(), K, V)), TypeError, "Q must be a floating-point"),
    "dtypes differ": ((lambda Q, K, V: (Q, K.float(), V)), TypeError, "share one dtype"),
    "d_k differs": (
        (lambda Q, K, V: (Q, K[..., :6], V)),
        ValueError,
        r"same last dim d_k.*Q \(2, 5, 8\), K \(2, 7, 6\)",
    ),
    "T_k differs": (
        (lambda Q, K, V: (Q, K, V[:, :6])),
        ValueError,
        r"same number of keys T_k.*K \(2, 7, 8\), V \(2, 6, 4\)",
    ),
    "batch does not broadcast": (
        (lambda Q, K, V: (Q, torch.cat([K, K, K]), torch.cat([V, V, V]))),
        ValueError,
        r"batch dims .* do not broadcast.*Q \(2, 5, 8\), K \(6, 7, 8\)",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise(name):
    change, error, message = BAD_INPUTS[name]
    Q, K, V = (t.detach() for t in _inputs((2, 5, 8), (2, 7, 8), (2, 7, 4)))
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(*change(Q, K, V))


@pytest.mark.parametrize(
    "mask, error, message",
    [
        (torch.ones(5, 5, dtype=torch.bool), ValueError, r"mask of shape \(5, 5\).*\(2, 5, 7\)"),
        (torch.ones(3, 5, 7, dtype=torch.bool), ValueError, r"mask of shape \(3, 5, 7\)"),
        (torch.ones(1, 2, 5, 7, dtype=torch.bool), ValueError, r"mask of shape \(1, 2, 5, 7\)"),
        (torch.ones(5, 7, dtype=torch.int64), TypeError, "mask must be bool.*torch.int64"),
        ([[True] * 7] * 5, TypeError, "mask must be a torch.Tensor or None, got list"),
    ],
)
def test_bad_masks_raise(mask, error, message):
    Q, K, V = (t.detach() for t in _inputs((2, 5, 8), (2, 7, 8), (2, 7, 4)))
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(Q, K, V, mask=mask)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_p_out_of_range_raises(p):
    Q, K, V = (t.detach() for t in _inputs((5, 8), (7, 8), (7, 4)))
    with pytest.raises(ValueError, match=r"dropout_p must be (in \[0, 1\)|a finite number)"):
        scaled_dot_product_attention(Q, K, V, dropout_p=p)


@pytest.mark.parametrize("p", ["0.1", None, True])
def test_dropout_p_of_wrong_type_raises(p):
    Q, K, V = (t.detach() for t in _inputs((5, 8), (7, 8), (7, 4)))
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        scaled_dot_product_attention(Q, K, V, dropout_p=p)


def test_check_attention_inputs_is_the_public_checker():
    from transformer_from_scratch.attention import check_attention_inputs

    Q = torch.randn(2, 3, 4)
    check_attention_inputs(Q, Q, Q, None, 0.0)  # fine: returns nothing
    with pytest.raises(ValueError, match="same last dim d_k"):
        check_attention_inputs(Q, torch.randn(2, 3, 5), Q, None, 0.0)
    with pytest.raises(ValueError, match="dropout_p"):
        check_attention_inputs(Q, Q, Q, None, 1.5)
    with pytest.raises(TypeError, match="mask must be bool"):
        check_attention_inputs(Q, Q, Q, torch.ones(3, 3, dtype=torch.long), 0.0)


def test_a_mask_in_pytorchs_padding_shape_is_caught_only_when_it_cannot_broadcast():
    """A (B, T_k) key-padding mask lines up with (T_q, T_k): a shape check stops it when
    B != T_q and cannot when B == T_q (notebook 03 shows the limit; padding_mask builds
    (B, 1, 1, T_k))."""
    Q, K, V = (t.detach() for t in _inputs((2, 5, 8), (2, 7, 8), (2, 7, 4)))
    keep = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])  # (B, T_k), lengths 7 and 3
    with pytest.raises(ValueError, match=r"mask of shape \(2, 7\).*\(2, 5, 7\)"):
        scaled_dot_product_attention(Q, K, V, mask=keep)
    _, attn = scaled_dot_product_attention(Q[:, :2], K, V, mask=keep)  # B == T_q == 2: accepted
    assert attn[1, 0, 3:].sum() > 0  # query 0 of sequence 1 got sequence 0's row: sees padding
    _, attn = scaled_dot_product_attention(Q[:, :2], K, V, mask=keep[:, None, :])  # (B, 1, T_k)
    assert torch.all(attn[1, :, 3:] == 0)


def test_a_wrong_mask_names_the_shape_it_must_broadcast_to_next_to_its_symbols():
    """The scores' shape follows "(..., T_q, T_k) =", and the inputs' shapes come after it."""
    Q, K, V = (t.detach() for t in _inputs((2, 5, 8), (2, 7, 8), (2, 7, 4)))
    expected = (
        r"^mask of shape \(5, 5\) does not broadcast to \(\.\.\., T_q, T_k\) = \(2, 5, 7\); "
        r"got Q \(2, 5, 8\), K \(2, 7, 8\), V \(2, 7, 4\)$"
    )
    with pytest.raises(ValueError, match=expected):
        scaled_dot_product_attention(Q, K, V, mask=torch.ones(5, 5, dtype=torch.bool))
