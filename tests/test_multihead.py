"""Unit tests of transformer_from_scratch.attention.MultiHeadAttention (notebook 03)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.attention import scaled_dot_product_attention

D_MODEL, NUM_HEADS = 16, 4


def make_pair(
    d_model: int = D_MODEL, num_heads: int = NUM_HEADS, bias: bool = True, seed: int = 0
) -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    """Our module (with random, non-zero biases) and nn.MultiheadAttention holding its weights."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(d_model, num_heads, bias=bias)
    theirs = nn.MultiheadAttention(d_model, num_heads, bias=bias, batch_first=True)
    with torch.no_grad():
        if bias:
            for proj in (ours.W_q, ours.W_k, ours.W_v, ours.W_o):
                proj.bias.normal_(0.0, 0.1)  # Xavier leaves zeros, which would test nothing
            theirs.in_proj_bias.copy_(torch.cat([ours.W_q.bias, ours.W_k.bias, ours.W_v.bias]))
            theirs.out_proj.bias.copy_(ours.W_o.bias)
        theirs.in_proj_weight.copy_(torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight]))
        theirs.out_proj.weight.copy_(ours.W_o.weight)
    return ours, theirs


def randn(*shape: int, seed: int = 1, grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(grad)


def assert_param_grads_match(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    d = ours.d_model
    for i, proj in enumerate((ours.W_q, ours.W_k, ours.W_v)):
        torch.testing.assert_close(
            proj.weight.grad, theirs.in_proj_weight.grad[i * d : (i + 1) * d]
        )
        if proj.bias is not None:
            torch.testing.assert_close(
                proj.bias.grad, theirs.in_proj_bias.grad[i * d : (i + 1) * d]
            )
    torch.testing.assert_close(ours.W_o.weight.grad, theirs.out_proj.weight.grad)
    if ours.W_o.bias is not None:
        torch.testing.assert_close(ours.W_o.bias.grad, theirs.out_proj.bias.grad)


def check_parity(ours, theirs, x_q, x_k, x_v, mask=None, key_padding_mask=None):
    """Outputs, per-head weights, input gradients and parameter gradients all match."""
    y_ours, a_ours = ours(x_q, x_k, x_v, mask=mask, return_attn=True)
    y_theirs, a_theirs = theirs(
        x_q,
        x_k,
        x_v,
        key_padding_mask=key_padding_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    torch.testing.assert_close(y_ours, y_theirs)
    torch.testing.assert_close(a_ours, a_theirs)
    g = randn(*y_ours.shape, seed=99)
    inputs = [t for t in dict.fromkeys((x_q, x_k, x_v)) if t.requires_grad]
    grads_ours = torch.autograd.grad((y_ours * g).sum(), inputs, retain_graph=True)
    grads_theirs = torch.autograd.grad((y_theirs * g).sum(), inputs, retain_graph=True)
    for a, b in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(a, b)
    (y_ours * g).sum().backward()
    (y_theirs * g).sum().backward()
    assert_param_grads_match(ours, theirs)
    return a_ours


# ---------------------------------------------------------------- construction and shapes


def test_attributes_and_projections():
    mha = MultiHeadAttention(32, 8, dropout_p=0.1)
    assert (mha.d_model, mha.num_heads, mha.d_k, mha.dropout_p) == (32, 8, 4, 0.1)
    for proj in (mha.W_q, mha.W_k, mha.W_v, mha.W_o):
        assert isinstance(proj, nn.Linear)
        assert proj.weight.shape == (32, 32) and proj.bias.shape == (32,)


def test_xavier_init_and_zero_bias():
    torch.manual_seed(0)
    d = 256
    mha = MultiHeadAttention(d, 8)
    bound = math.sqrt(6 / (2 * d))
    for proj in (mha.W_q, mha.W_k, mha.W_v, mha.W_o):
        assert proj.weight.abs().max() <= bound
        assert abs(proj.weight.var().item() * d - 1.0) < 0.05  # Var(W) = 1 / d_model
        assert torch.all(proj.bias == 0)


@pytest.mark.parametrize("d_model", [8, 512])
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_count(d_model, bias):
    expected = 4 * d_model**2 + (4 * d_model if bias else 0)
    for h in (1, 2, 8):
        mha = MultiHeadAttention(d_model, h, bias=bias)
        assert sum(p.numel() for p in mha.parameters()) == expected
    torch_mha = nn.MultiheadAttention(d_model, 8, bias=bias)
    assert sum(p.numel() for p in torch_mha.parameters()) == expected


def test_split_combine_round_trip():
    mha = MultiHeadAttention(12, 3)
    x = randn(2, 5, 12)
    split = mha.split_heads(x)
    assert split.shape == (2, 3, 5, 4)
    for i in range(3):
        assert torch.equal(split[:, i], x[..., 4 * i : 4 * (i + 1)])
    assert torch.equal(mha.combine_heads(split), x)


@pytest.mark.parametrize("T_q, T_k", [(5, 5), (3, 7), (1, 4)])
def test_output_and_attention_shapes(T_q, T_k):
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS)
    x_q, x_kv = randn(2, T_q, D_MODEL), randn(2, T_k, D_MODEL, seed=2)
    assert mha(x_q, x_kv).shape == (2, T_q, D_MODEL)
    out, attn = mha(x_q, x_kv, return_attn=True)
    assert out.shape == (2, T_q, D_MODEL)
    assert attn.shape == (2, NUM_HEADS, T_q, T_k)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, NUM_HEADS, T_q))


def test_defaults_x_k_to_x_q_and_x_v_to_x_k():
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS)
    x, m = randn(2, 5, D_MODEL), randn(2, 7, D_MODEL, seed=2)
    torch.testing.assert_close(mha(x), mha(x, x, x))
    torch.testing.assert_close(mha(x, m), mha(x, m, m))


@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 1, 5, 7), (2, 1, 1, 7), (2, 4, 5, 7)])
def test_broadcastable_masks_are_accepted(mask_shape):
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    x, m = randn(2, 5, D_MODEL), randn(2, 7, D_MODEL, seed=2)
    torch.testing.assert_close(mha(x, m, mask=mask), mha(x, m))


def test_padding_mask_zeroes_weights_of_hidden_keys():
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS)
    keep = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])[:, None, None, :]  # (B,1,1,T_k)
    _, attn = mha(randn(2, 5, D_MODEL), randn(2, 7, D_MODEL, seed=2), mask=keep, return_attn=True)
    assert torch.all(attn[1, ..., 3:] == 0)


# ---------------------------------------------------------------- parity with PyTorch


@pytest.mark.parametrize("bias", [True, False])
def test_parity_self_attention(bias):
    ours, theirs = make_pair(bias=bias)
    x = randn(3, 6, D_MODEL, grad=True)
    check_parity(ours, theirs, x, x, x)


def test_parity_cross_attention_with_distinct_keys_and_values():
    ours, theirs = make_pair()
    x_q = randn(3, 4, D_MODEL, seed=1, grad=True)
    x_k = randn(3, 9, D_MODEL, seed=2, grad=True)
    x_v = randn(3, 9, D_MODEL, seed=3, grad=True)
    check_parity(ours, theirs, x_q, x_k, x_v)


def test_parity_key_padding_mask_has_the_opposite_convention():
    ours, theirs = make_pair()
    x_q = randn(3, 4, D_MODEL, seed=1, grad=True)
    x_kv = randn(3, 9, D_MODEL, seed=2, grad=True)
    lengths = torch.tensor([9, 5, 1])
    key_padding_mask = torch.arange(9)[None, :] >= lengths[:, None]  # (B, T_k), True = ignore
    mask = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k), True = attend
    attn = check_parity(ours, theirs, x_q, x_kv, x_kv, mask=mask, key_padding_mask=key_padding_mask)
    assert torch.all(attn.masked_select(key_padding_mask[:, None, None, :]) == 0)


def test_parity_per_head_with_f_scaled_dot_product_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS)
    x, m = randn(2, 5, D_MODEL), randn(2, 7, D_MODEL, seed=2)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 4])[:, None])[:, None, None, :]
    with torch.no_grad():
        Q, K, V = (
            mha.split_heads(mha.W_q(x)),
            mha.split_heads(mha.W_k(m)),
            mha.split_heads(mha.W_v(m)),
        )
    Q, K, V = (t.clone().requires_grad_() for t in (Q, K, V))
    ctx_ours, _ = scaled_dot_product_attention(Q, K, V, mask=mask)
    ctx_torch = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    torch.testing.assert_close(ctx_ours, ctx_torch)
    g = randn(*ctx_ours.shape, seed=5)
    for a, b in zip(
        torch.autograd.grad((ctx_ours * g).sum(), (Q, K, V)),
        torch.autograd.grad((ctx_torch * g).sum(), (Q, K, V)),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(mha.W_o(mha.combine_heads(ctx_torch)), mha(x, m, mask=mask))


# ---------------------------------------------------------------- dropout


def test_dropout_is_identity_in_eval_mode():
    torch.manual_seed(0)
    with_dropout = MultiHeadAttention(D_MODEL, NUM_HEADS, dropout_p=0.5).eval()
    without = MultiHeadAttention(D_MODEL, NUM_HEADS)
    without.load_state_dict(with_dropout.state_dict())
    x = randn(2, 5, D_MODEL)
    assert torch.equal(with_dropout(x), without(x))


def test_dropout_acts_on_attention_weights_in_training():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, NUM_HEADS, dropout_p=0.5)
    x = randn(2, 8, D_MODEL)
    _, attn_eval = mha.eval()(x, return_attn=True)
    _, attn_train = mha.train()(x, return_attn=True)
    assert torch.all((attn_train == 0) | torch.isclose(attn_train, 2 * attn_eval))
    assert 0.3 < (attn_train == 0).float().mean().item() < 0.7


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "args, match",
    [
        ((10, 3), "not divisible by num_heads"),
        ((0, 1), "d_model must be at least 1"),
        ((8, 0), "num_heads must be at least 1"),
        ((8, 2, 1.0), r"dropout_p must be (in \[0, 1\)|a finite number)"),
        ((8, 2, -0.1), r"dropout_p must be (in \[0, 1\)|a finite number)"),
    ],
)
def test_bad_constructor_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(*args)


@pytest.mark.parametrize(
    "args, match",
    [((8.0, 2), "d_model must be an int"), ((8, "2"), "num_heads must be an int"),
     ((8, 2, 0.1, 1), "bias must be a bool")],
)  # fmt: skip
def test_constructor_arguments_of_the_wrong_type(args, match):
    with pytest.raises(TypeError, match=match):
        MultiHeadAttention(*args)


@pytest.fixture
def mha():
    return MultiHeadAttention(D_MODEL, NUM_HEADS)


@pytest.mark.parametrize("shape", [(5, D_MODEL), (1, 2, 5, D_MODEL), (D_MODEL,)])
def test_wrong_rank(mha, shape):
    with pytest.raises(ValueError, match=r"x_q must be 3-D"):
        mha(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"x_k must be 3-D"):
        mha(torch.zeros(2, 5, D_MODEL), torch.zeros(shape))


def test_wrong_d_model(mha):
    x = torch.zeros(2, 5, D_MODEL)
    with pytest.raises(
        ValueError, match=r"x_q has shape \(2, 5, 8\): last dimension 8 != d_model=16"
    ):
        mha(torch.zeros(2, 5, 8))
    with pytest.raises(ValueError, match=r"x_k has shape .* != d_model=16"):
        mha(x, torch.zeros(2, 7, 8))
    with pytest.raises(ValueError, match=r"x_v has shape .* != d_model=16"):
        mha(x, torch.zeros(2, 7, D_MODEL), torch.zeros(2, 7, 8))


def test_mismatched_batch_sizes(mha):
    with pytest.raises(ValueError, match=r"batch sizes differ: x_q \(2, 5, 16\), x_k \(3, 7, 16\)"):
        mha(torch.zeros(2, 5, D_MODEL), torch.zeros(3, 7, D_MODEL))


def test_mismatched_key_and_value_lengths(mha):
    with pytest.raises(ValueError, match="must have the same length T_k"):
        mha(torch.zeros(2, 5, D_MODEL), torch.zeros(2, 7, D_MODEL), torch.zeros(2, 6, D_MODEL))


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 5), (3, 1, 1, 7), (2, 3, 5, 7), (1, 2, 1, 5, 7)])
def test_mask_that_does_not_broadcast(mha, mask_shape):
    x, m = torch.zeros(2, 5, D_MODEL), torch.zeros(2, 7, D_MODEL)
    with pytest.raises(
        ValueError, match=r"does not broadcast to \(B, h, T_q, T_k\) = \(2, 4, 5, 7\)"
    ):
        mha(x, m, mask=torch.ones(mask_shape, dtype=torch.bool))


def test_non_tensor_inputs(mha):
    with pytest.raises(TypeError, match="x_q must be a torch.Tensor"):
        mha([[0.0] * D_MODEL])
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        mha(torch.zeros(1, 2, D_MODEL), mask=[[True, True]])


# --- reference.copy_attention_to_torch and torch_attention_like (notebook 03's parity tools) ---


@pytest.mark.parametrize("bias", [True, False])
def test_torch_attention_like_matches_ours_with_biases_and_padding(bias):
    from transformer_from_scratch.reference import torch_attention_like

    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4, bias=bias).double().eval()
    if bias:  # non-zero biases, so that a forgotten bias copy shows
        with torch.no_grad():
            for proj in (ours.W_q, ours.W_k, ours.W_v, ours.W_o):
                proj.bias.normal_(std=0.1)
    theirs = torch_attention_like(ours).double().eval()
    assert theirs.batch_first and (theirs.in_proj_bias is not None) == bias
    x, kv = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 4:] = False  # the second sequence has 4 real keys
    ours_out = ours(x, kv, mask=keep[:, None, None, :])
    theirs_out, _ = theirs(x, kv, kv, key_padding_mask=~keep)  # PyTorch: True = ignore
    torch.testing.assert_close(ours_out, theirs_out)


def test_copy_attention_to_torch_copies_every_projection():
    from transformer_from_scratch.reference import copy_attention_to_torch

    torch.manual_seed(1)
    ours = MultiHeadAttention(8, 2)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    copy_attention_to_torch(ours, theirs)
    W_q, W_k, W_v = theirs.in_proj_weight.detach().chunk(3)
    assert torch.equal(W_q, ours.W_q.weight) and torch.equal(W_k, ours.W_k.weight)
    assert torch.equal(W_v, ours.W_v.weight)
    assert torch.equal(theirs.out_proj.weight, ours.W_o.weight)


def test_copy_attention_to_torch_refuses_other_sizes():
    from transformer_from_scratch.reference import copy_attention_to_torch

    with pytest.raises(RuntimeError):
        copy_attention_to_torch(MultiHeadAttention(8, 2), torch.nn.MultiheadAttention(16, 2))
