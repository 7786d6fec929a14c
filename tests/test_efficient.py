"""Unit tests of transformer_from_scratch.efficient (notebook 14): tiled attention, fast path."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.attention import _attention_with_dropout
from transformer_from_scratch.attention import fast_dropout
from transformer_from_scratch.attention import fused_attention
from transformer_from_scratch.attention import fused_attention_mask
from transformer_from_scratch.attention import scaled_dot_product_attention
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.efficient import TiledAttention
from transformer_from_scratch.efficient import tiled_attention
from transformer_from_scratch.efficient import tiled_attention_backward
from transformer_from_scratch.efficient import tiled_attention_forward
from transformer_from_scratch.efficient import use_fast_path
from transformer_from_scratch.layers import DecoderBlock
from transformer_from_scratch.layers import EncoderBlock
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.reference import TorchTransformer
from transformer_from_scratch.reference import torch_attention_like
from transformer_from_scratch.reference import torch_transformer_masks


def qkv(B=2, h=3, T_q=13, T_k=13, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, h, T_q, d), (B, h, T_k, d), (B, h, T_k, d))
    return tuple(torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


# ---------------------------------------------------------------- tiled attention


MASKS = ["none", "causal", "padding", "causal+padding", "float", "per-query"]


def make_mask(kind, B, T_q, T_k, dtype=torch.float64):
    gen = torch.Generator().manual_seed(5)
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "padding":  # the second sequence is fully padded: its rows attend to nothing
        return padding_mask([T_k] + [0] * (B - 1), T_k), False
    if kind == "causal+padding":
        return causal_mask(T_q) & padding_mask([T_k, 4][:B], T_k), False
    if kind == "float":
        return torch.randn(1, 1, T_q, T_k, generator=gen, dtype=dtype), False
    return torch.rand(B, 1, T_q, T_k, generator=gen) > 0.5, False  # some rows empty


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("blocks", [(4, 5), (1, 13), (64, 64)])
def test_tiled_attention_equals_naive_values_and_gradients(kind, blocks):
    Q, K, V = qkv()
    mask, causal = make_mask(kind, 2, 13, 13)
    naive_mask = causal_mask(13) if causal else mask
    expected, _ = scaled_dot_product_attention(Q, K, V, mask=naive_mask)
    out = tiled_attention(Q, K, V, mask=mask, causal=causal, block_q=blocks[0], block_k=blocks[1])
    assert out.shape == (2, 3, 13, 8)
    assert_close(out, expected, atol=1e-12, rtol=1e-10)
    for g_out, g_exp in zip(grads(out, (Q, K, V)), grads(expected, (Q, K, V)), strict=True):
        assert_close(g_out, g_exp, atol=1e-12, rtol=1e-10)


def test_tiled_attention_fully_masked_rows_are_zero_with_zero_gradients():
    Q, K, V = qkv(B=2)
    mask = padding_mask([13, 0], 13)
    out = tiled_attention(Q, K, V, mask=mask, block_q=4, block_k=4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    dQ, dK, dV = grads(out, (Q, K, V))
    assert torch.equal(dQ[1], torch.zeros_like(dQ[1])) and torch.isfinite(dQ).all()
    assert torch.equal(dV[1], torch.zeros_like(dV[1]))


def test_tiled_attention_rectangular_and_broadcast_batch():
    gen = torch.Generator().manual_seed(0)
    Q = torch.randn(2, 4, 7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    K = torch.randn(1, 4, 11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    V = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)  # no batch
    expected, _ = scaled_dot_product_attention(Q, K, V)
    out = tiled_attention(Q, K, V, block_q=3, block_k=4)
    assert out.shape == (2, 4, 7, 5)
    assert_close(out, expected)
    for g_out, g_exp in zip(grads(out, (Q, K, V)), grads(expected, (Q, K, V)), strict=True):
        assert g_out.shape == g_exp.shape
        assert_close(g_out, g_exp)


def test_tiled_attention_causal_rectangular_matches_sdpa_top_left():
    Q, K, V = qkv(T_q=5, T_k=9, dtype=torch.float32)
    out = tiled_attention(Q, K, V, causal=True, block_q=2, block_k=3)
    expected = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["none", "causal", "padding"])
def test_tiled_attention_matches_torch_sdpa_float32(kind):
    Q, K, V = qkv(B=2, h=2, T_q=40, T_k=40, d=16, dtype=torch.float32)
    mask, causal = make_mask(kind, 2, 40, 40)
    out = tiled_attention(Q, K, V, mask=mask, causal=causal, block_q=16, block_k=16)
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, is_causal=causal)
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for g_out, g_exp in zip(grads(out, (Q, K, V)), grads(expected, (Q, K, V)), strict=True):
        assert_close(g_out, g_exp, atol=1e-5, rtol=1e-4)


def test_tiled_attention_gradcheck():
    Q, K, V = qkv(B=1, h=1, T_q=6, T_k=7, d=3)
    mask = torch.rand(1, 1, 6, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    assert torch.autograd.gradcheck(
        lambda q, k, v: tiled_attention(q, k, v, mask=mask, block_q=4, block_k=3), (Q, K, V)
    )


def test_forward_returns_logsumexp_and_backward_pieces_match_autograd():
    Q, K, V = qkv(B=1, h=2, T_q=9, T_k=9)
    O, L = tiled_attention_forward(Q.detach(), K.detach(), V.detach(), block_q=4, block_k=2)
    scores = Q.detach() @ K.detach().transpose(-2, -1) / 8**0.5
    assert_close(L, torch.logsumexp(scores, dim=-1, keepdim=True))
    dO = torch.randn_like(O)
    manual = tiled_attention_backward(
        dO, Q.detach(), K.detach(), V.detach(), O, L, None, False, 4, 2
    )
    expected, _ = scaled_dot_product_attention(Q, K, V)
    for a, b in zip(manual, torch.autograd.grad(expected, (Q, K, V), dO), strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tiled_attention_accumulates_16_bit_inputs_in_float32(dtype):
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 2, 512, 32, generator=gen).to(dtype) for _ in range(3))
    truth = F.scaled_dot_product_attention(Q.double(), K.double(), V.double())
    O, L = tiled_attention_forward(Q, K, V, block_q=64, block_k=64)
    O_16, L_16 = tiled_attention_forward(Q, K, V, block_q=64, block_k=64, acc_dtype=dtype)
    assert O.dtype == dtype and L.dtype == torch.float32 and L_16.dtype == dtype
    err, err_16 = ((o.double() - truth).abs().max().item() for o in (O, O_16))
    assert err < err_16 / 2  # float32 accumulators: less error than 16-bit ones
    eps = torch.finfo(dtype).eps  # the output's own rounding: at most one unit in the last place
    assert err <= eps * truth.abs().max().item()
    Qg, Kg, Vg = (t.detach()[:, :, :100].clone().requires_grad_() for t in (Q, K, V))
    out = tiled_attention(Qg, Kg, Vg, causal=True, block_q=16, block_k=32)
    dO = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (Qg, Kg, Vg), dO)
    Q64, K64, V64 = (t.detach().double().requires_grad_() for t in (Qg, Kg, Vg))
    ref = F.scaled_dot_product_attention(Q64, K64, V64, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (Q64, K64, V64), dO.double())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g.double(), r, atol=4 * eps, rtol=4 * eps)


def test_tiled_attention_empty_rows_have_infinite_logsumexp():
    Q, K, V = (t.detach() for t in qkv(B=2, h=1, T_q=4, T_k=4))
    mask = padding_mask([4, 0], 4).expand(2, 1, 4, 4)
    _, L = tiled_attention_forward(Q, K, V, mask)
    assert torch.isinf(L[1]).all() and torch.isfinite(L[0]).all()


def test_tiled_attention_saves_no_square_matrix():
    Q, K, V = qkv(B=1, h=1, T_q=64, T_k=64, dtype=torch.float32)
    out = tiled_attention(Q, K, V, block_q=8, block_k=8)
    assert out.grad_fn.name().endswith("TiledAttentionBackward")
    saved = out.grad_fn.saved_tensors
    assert all(t is None or 64 * 64 not in (t.numel(), t.shape[-1] * t.shape[-2]) for t in saved)
    assert issubclass(TiledAttention, torch.autograd.Function)


def test_tiled_attention_bad_inputs():
    Q, K, V = qkv()
    with pytest.raises(TypeError, match="Q"):
        tiled_attention(Q.tolist(), K, V)
    with pytest.raises(ValueError, match="last dim"):
        tiled_attention(Q, K[..., :4], V)
    with pytest.raises(ValueError, match="mask"):
        tiled_attention(Q, K, V, mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        tiled_attention(Q, K, V, mask=torch.ones(13, 13, dtype=torch.long))
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(Q, K, V, block_q=0)
    with pytest.raises(TypeError, match="block_k"):
        tiled_attention(Q, K, V, block_k=2.5)
    with pytest.raises(TypeError, match="causal"):
        tiled_attention(Q, K, V, causal=1)


# ---------------------------------------------------------------- the pieces of the fast path


def test_fused_attention_mask_translates_our_masks():
    assert fused_attention_mask(None, 4, 4) == (None, False)
    assert fused_attention_mask(causal_mask(5), 5, 5) == (None, True)
    assert fused_attention_mask(causal_mask(5)[0, 0], 5, 5) == (None, True)
    pad = padding_mask([3, 5], 5)
    assert fused_attention_mask(pad, 5, 5)[0] is pad
    other = ~causal_mask(5)
    assert fused_attention_mask(other, 5, 5) == (other, False)
    per_sequence = causal_mask(5).expand(2, 1, 5, 5).clone()  # causal, but one per sequence
    assert fused_attention_mask(per_sequence, 5, 5)[1] is False
    additive = torch.zeros(5, 5)
    assert fused_attention_mask(additive, 5, 5) == (additive, False)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_fused_attention_mask_takes_no_length_sorted_padding_batch_for_causal(T):
    # B == T sequences of lengths 1 .. T: a padding mask (T, 1, 1, T) whose T * T elements, read
    # in order, are the causal pattern. Only one (T, T) pattern shared by every sequence and head
    # is the causal mask (for T = 1 the two are the same one-element mask, and either is right).
    sorted_batch = padding_mask(list(range(1, T + 1)), T)
    assert torch.equal(sorted_batch.reshape(T, T), causal_mask(T)[0, 0])  # it looks causal
    per_head = sorted_batch.reshape(1, T, 1, T)  # the same elements as T heads' rows
    for mask in (sorted_batch, per_head):
        attn_mask, is_causal = fused_attention_mask(mask, T, T)
        assert (attn_mask is mask and is_causal is False) or T == 1
    torch.manual_seed(0)
    scratch = MultiHeadAttention(8, 2).eval()
    fast = fast_copy(scratch)
    x = torch.randn(T, T, 8)  # (B, T, d) with B == T
    assert_close(fast(x, mask=sorted_batch), scratch(x, mask=sorted_batch))
    Q, K, V = qkv(B=T, h=2, T_q=T, T_k=T)
    expected, _ = scaled_dot_product_attention(Q, K, V, mask=sorted_batch)
    assert_close(fused_attention(Q, K, V, *fused_attention_mask(sorted_batch, T, T)), expected)
    if T > 1:  # read as the causal mask, the same call computes something else
        assert not torch.allclose(fused_attention(Q, K, V, None, True), expected)


def test_fast_dropout_keeps_one_minus_p_and_scales():
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) + 0.5
    torch.manual_seed(0)
    y = fast_dropout(x, 0.25)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    assert_close(y[kept], x[kept] / 0.75)
    assert fast_dropout(x, 0.25, training=False) is x
    assert fast_dropout(x, 0.0) is x


def test_fast_dropout_gradient_is_the_mask():
    x = torch.ones(1000, requires_grad=True)
    torch.manual_seed(0)
    y = fast_dropout(x, 0.5)
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # ones through the same mask and scale


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "float", "per-query"])
def test_fused_attention_equals_ours_values_and_gradients(kind):
    Q, K, V = qkv()
    mask, causal = make_mask(kind, 2, 13, 13)
    out = fused_attention(Q, K, V, mask, causal)
    expected, _ = scaled_dot_product_attention(Q, K, V, mask=causal_mask(13) if causal else mask)
    assert_close(out, expected)
    for g_out, g_exp in zip(grads(out, (Q, K, V)), grads(expected, (Q, K, V)), strict=True):
        assert_close(g_out, g_exp)


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "float", "per-query"])
def test_attention_with_dropout_without_dropout_is_attention(kind):
    Q, K, V = qkv()
    mask, causal = make_mask(kind, 2, 13, 13)
    out = _attention_with_dropout(Q, K, V, mask, causal, 0.0)
    expected, _ = scaled_dot_product_attention(Q, K, V, mask=causal_mask(13) if causal else mask)
    assert_close(out, expected)
    for g_out, g_exp in zip(grads(out, (Q, K, V)), grads(expected, (Q, K, V)), strict=True):
        assert_close(g_out, g_exp)


def test_fast_layer_norm_equals_ours_and_torch():
    norm = LayerNorm(6)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    fast = copy.deepcopy(norm)
    fast.fast = True
    assert "fast=True" in repr(fast) and "fast" not in repr(norm)
    x = torch.randn(3, 4, 6, requires_grad=True)
    assert_close(fast(x), norm(x), atol=1e-6, rtol=1e-5)
    assert_close(fast(x), F.layer_norm(x, (6,), norm.weight, norm.bias, 1e-5))
    with pytest.raises(ValueError, match="LayerNorm"):
        fast(torch.randn(3, 5))
    with pytest.raises(TypeError, match="floating"):
        fast(torch.ones(3, 6, dtype=torch.long))


# ---------------------------------------------------------------- multi-head attention


def fast_copy(module):
    return use_fast_path(copy.deepcopy(module))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "float"])
def test_fast_multi_head_attention_equals_scratch(kind, bias):
    torch.manual_seed(0)
    scratch = MultiHeadAttention(16, 4, bias=bias).double()
    fast = fast_copy(scratch)
    assert type(fast) is MultiHeadAttention and fast.fast and not scratch.fast
    x = torch.randn(2, 13, 16, dtype=torch.float64, requires_grad=True)
    mask, causal = make_mask(kind, 2, 13, 13)
    mask = causal_mask(13) if causal else mask
    out_f, out_s = fast(x, mask=mask), scratch(x, mask=mask)
    assert_close(out_f, out_s)
    params_f, params_s = list(fast.parameters()), list(scratch.parameters())
    for g_f, g_s in zip(grads(out_f, [x, *params_f]), grads(out_s, [x, *params_s]), strict=True):
        assert_close(g_f, g_s)


def test_fast_cross_attention_equals_scratch_and_torch():
    torch.manual_seed(0)
    scratch = MultiHeadAttention(16, 2).eval()
    fast = fast_copy(scratch)
    x, memory = torch.randn(3, 5, 16), torch.randn(3, 9, 16)
    mask = padding_mask([9, 4, 0], 9)
    assert_close(fast(x, memory, mask=mask), scratch(x, memory, mask=mask))
    theirs = torch_attention_like(scratch).eval()
    expected, _ = theirs(x, memory, memory, key_padding_mask=~padding_mask([9, 4, 1], 9)[:, 0, 0])
    got = fast(x, memory, mask=padding_mask([9, 4, 1], 9))
    assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fast_multi_head_attention_falls_back_for_weights_and_separate_values(monkeypatch):
    torch.manual_seed(0)
    scratch = MultiHeadAttention(8, 2)
    fast = fast_copy(scratch)
    calls = []
    fast_forward = MultiHeadAttention.fast_forward
    monkeypatch.setattr(
        MultiHeadAttention,
        "fast_forward",
        lambda self, *a: calls.append(1) or fast_forward(self, *a),
    )
    fast(torch.randn(2, 3, 8))
    assert calls == [1]  # the fast path runs when it can
    x, k, v = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    out_f, attn_f = fast(x, return_attn=True)
    out_s, attn_s = scratch(x, return_attn=True)
    assert torch.equal(out_f, out_s) and torch.equal(attn_f, attn_s)
    assert torch.equal(fast(x, k, v), scratch(x, k, v))
    assert calls == [1]  # and not for the weights or separate values


def test_fast_multi_head_attention_bad_inputs():
    fast = fast_copy(MultiHeadAttention(8, 2))
    with pytest.raises(ValueError, match="d_model"):
        fast(torch.randn(2, 3, 6))
    with pytest.raises(TypeError, match="floating"):
        fast(torch.ones(2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="mask"):
        fast(torch.randn(2, 3, 8), mask=torch.ones(2, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch"):
        fast(torch.randn(2, 3, 8), torch.randn(3, 3, 8))


def test_fast_attention_trains_with_dropout_on_the_cpu():
    torch.manual_seed(0)
    fast = fast_copy(MultiHeadAttention(8, 2, dropout_p=0.5)).train()
    x = torch.randn(4, 6, 8, requires_grad=True)
    out = fast(x, mask=causal_mask(6))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert not torch.allclose(out, fast.eval()(x, mask=causal_mask(6)))  # dropout was on


# ---------------------------------------------------------------- blocks and the model


@pytest.mark.parametrize("norm_first", [True, False])
def test_fast_encoder_block_equals_scratch(norm_first):
    torch.manual_seed(0)
    scratch = EncoderBlock(16, 4, 32, activation="relu", norm_first=norm_first).double()
    fast = fast_copy(scratch)
    assert type(fast) is EncoderBlock and fast.self_attn.fast and fast.norm1.fast
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    mask = padding_mask([7, 0], 7)
    out_f, out_s = fast(x, mask), scratch(x, mask)
    assert_close(out_f, out_s)
    params_f, params_s = list(fast.parameters()), list(scratch.parameters())
    for g_f, g_s in zip(grads(out_f, [x, *params_f]), grads(out_s, [x, *params_s]), strict=True):
        assert_close(g_f, g_s)


@pytest.mark.parametrize("norm_first", [True, False])
def test_fast_decoder_block_equals_scratch(norm_first):
    torch.manual_seed(0)
    scratch = DecoderBlock(16, 4, 32, activation="gelu", norm_first=norm_first).double()
    fast = DecoderBlock(16, 4, 32, activation="gelu", norm_first=norm_first, fast=True).double()
    fast.load_state_dict(scratch.state_dict())  # built fast: the same parameters
    assert fast.cross_attn.fast and fast.norm3.fast
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    self_mask, cross_mask = causal_mask(6), padding_mask([5, 2], 5)
    out_f = fast(x, memory, self_mask, cross_mask)
    out_s = scratch(x, memory, self_mask, cross_mask)
    assert_close(out_f, out_s)
    inputs_f, inputs_s = [x, memory, *fast.parameters()], [x, memory, *scratch.parameters()]
    for g_f, g_s in zip(grads(out_f, inputs_f), grads(out_s, inputs_s), strict=True):
        assert_close(g_f, g_s)


def test_fast_blocks_bad_inputs():
    enc = fast_copy(EncoderBlock(8, 2, 16))
    dec = fast_copy(DecoderBlock(8, 2, 16))
    with pytest.raises(ValueError, match="d_model"):
        enc(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match="mask"):
        enc(torch.randn(2, 3, 8), torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch sizes"):
        dec(torch.randn(2, 3, 8), torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="mask"):
        dec(torch.randn(2, 3, 8), torch.randn(2, 4, 8), cross_mask=torch.ones(2, 1, 1, 5).bool())
    with pytest.raises(TypeError, match="fast must be a bool"):
        EncoderBlock(8, 2, 16, fast=1)


def small_model():
    torch.manual_seed(0)
    return Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, num_layers=2, dropout_p=0.1)


def test_use_fast_path_keeps_state_dict_and_switches_back():
    scratch = small_model()
    fast = use_fast_path(copy.deepcopy(scratch))
    state_s, state_f = scratch.state_dict(), fast.state_dict()
    assert list(state_s) == list(state_f)
    assert all(torch.equal(state_s[k], state_f[k]) for k in state_s)
    assert [type(m) for m in fast.modules()] == [type(m) for m in scratch.modules()]  # no twins
    switches = [m for m in fast.modules() if isinstance(m, (MultiHeadAttention, LayerNorm))]
    assert len(switches) == 2 * 1 + 2 * 2 + 2 * 2 + 2 * 3 + 2  # attention layers and norms
    assert all(m.fast for m in switches) and fast.config.fast and not scratch.config.fast
    rebuilt = Transformer(fast.config)  # the config records the choice
    assert all(m.fast for m in rebuilt.modules() if isinstance(m, (MultiHeadAttention, LayerNorm)))
    back = use_fast_path(fast, enabled=False)
    assert back is fast and not fast.config.fast
    assert not any(m.fast for m in switches)
    fresh = small_model()
    fresh.load_state_dict(use_fast_path(copy.deepcopy(scratch)).state_dict())  # loads both ways


def test_use_fast_path_switches_any_model_and_keeps_classes():
    class MyAttention(MultiHeadAttention):
        pass

    module = nn.ModuleList([MyAttention(8, 2), MultiHeadAttention(8, 2), LayerNorm(8)])
    use_fast_path(module)  # no config: only the modules' switches
    assert type(module[0]) is MyAttention and all(m.fast for m in module)


def test_use_fast_path_bad_inputs():
    with pytest.raises(TypeError, match="nn.Module"):
        use_fast_path("model")
    with pytest.raises(TypeError, match="enabled"):
        use_fast_path(nn.Linear(2, 2), enabled="yes")


def scratch_and_fast_batch():
    """A small model in eval mode, its fast-path copy, and a batch with a fully padded source."""
    scratch = small_model().eval()
    fast = use_fast_path(copy.deepcopy(scratch)).eval()
    gen = torch.Generator().manual_seed(0)
    src, tgt = (
        torch.randint(3, 12, (4, 7), generator=gen),
        torch.randint(3, 12, (4, 6), generator=gen),
    )
    return scratch, fast, (src, tgt, padding_mask([7, 5, 0, 2], 7), causal_mask(6))


def test_fast_model_equals_scratch_model_outputs_and_gradients():
    scratch, fast, (src, tgt, src_mask, tgt_mask) = scratch_and_fast_batch()
    out_s, out_f = scratch(src, tgt, src_mask, tgt_mask), fast(src, tgt, src_mask, tgt_mask)
    assert_close(out_f, out_s, atol=1e-5, rtol=1e-5)
    out_s.square().mean().backward()
    out_f.square().mean().backward()
    fast_params = dict(fast.named_parameters())
    for name, p in scratch.named_parameters():
        assert_close(fast_params[name].grad, p.grad, atol=1e-5, rtol=1e-4)


def compiled_with_recording_backend(model):
    """model under torch.compile with a backend that records TorchDynamo's graphs and runs them
    with PyTorch's own kernels (no code generated: seconds, not Inductor's minutes)."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend), graphs


def test_compiled_fast_model_equals_scratch_and_eager_models():
    # Under compilation the fast path takes its traced branches (no causal-mask detection, every
    # mask's empty rows opened and zeroed, the CPU dropout branch without its data-dependent test)
    scratch, fast, (src, tgt, src_mask, tgt_mask) = scratch_and_fast_batch()
    compiled, graphs = compiled_with_recording_backend(fast)
    out_s, out_c = scratch(src, tgt, src_mask, tgt_mask), compiled(src, tgt, src_mask, tgt_mask)
    assert graphs  # it was traced
    assert_close(out_c, out_s, atol=1e-5, rtol=1e-5)
    out_s.square().mean().backward()
    out_c.square().mean().backward()
    fast_params = dict(fast.named_parameters())
    for name, p in scratch.named_parameters():
        assert_close(fast_params[name].grad, p.grad, atol=1e-5, rtol=1e-4)
    # training mode, dropout on: the same random draws in the same order as the eager fast path
    fast.train()
    torch.manual_seed(5)
    eager = fast(src, tgt, src_mask, tgt_mask)
    compiled, graphs = compiled_with_recording_backend(fast)
    torch.manual_seed(5)
    assert torch.equal(compiled(src, tgt, src_mask, tgt_mask), eager) and graphs
    torch._dynamo.reset()


def test_fast_model_equals_scratch_model_on_a_length_sorted_batch_with_b_equal_to_s():
    # lengths 1 .. S for B == S sources: the source padding mask holds the causal pattern's
    # elements; the fast encoder must still run padding attention, not causal attention
    scratch = small_model().eval()
    fast = use_fast_path(copy.deepcopy(scratch)).eval()
    S = 7
    gen = torch.Generator().manual_seed(4)
    src, tgt = (
        torch.randint(3, 12, (S, S), generator=gen),
        torch.randint(3, 12, (S, 5), generator=gen),
    )
    src_mask, tgt_mask = padding_mask(list(range(1, S + 1)), S), causal_mask(5)
    assert torch.equal(src_mask.reshape(S, S), causal_mask(S)[0, 0])
    out_s, out_f = scratch(src, tgt, src_mask, tgt_mask), fast(src, tgt, src_mask, tgt_mask)
    assert_close(out_f, out_s, atol=1e-5, rtol=1e-5)


def test_fast_model_equals_nn_transformer():
    scratch = small_model().eval()
    fast = use_fast_path(copy.deepcopy(scratch)).eval()
    theirs = TorchTransformer(scratch).eval()
    gen = torch.Generator().manual_seed(1)
    src, tgt = (
        torch.randint(3, 12, (3, 5), generator=gen),
        torch.randint(3, 12, (3, 4), generator=gen),
    )
    src_mask, tgt_mask = padding_mask([5, 3, 1], 5), causal_mask(4)
    expected = theirs(src, tgt, src_mask, tgt_mask)
    assert_close(fast(src, tgt, src_mask, tgt_mask), expected, atol=1e-5, rtol=1e-5)
    assert torch_transformer_masks(src_mask, tgt_mask, 2)  # the same call, PyTorch's convention


def test_fast_model_decodes_the_same_tokens_and_trains():
    scratch = small_model()
    fast = use_fast_path(copy.deepcopy(scratch))
    src = torch.randint(3, 12, (3, 6), generator=torch.Generator().manual_seed(2))
    for cached in (False, True):
        assert torch.equal(
            greedy_decode(fast, src, max_new_tokens=8, use_cache=cached).tokens,
            greedy_decode(scratch, src, max_new_tokens=8, use_cache=cached).tokens,
        )
    optimizer = torch.optim.Adam(fast.parameters(), lr=1e-2)
    tgt = torch.randint(3, 12, (3, 5), generator=torch.Generator().manual_seed(3))
    losses = []
    fast.train()
    for _ in range(5):
        optimizer.zero_grad()
        logits = fast(src, tgt[:, :-1], tgt_mask=causal_mask(4))
        loss = F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def wrong_empty_rows_kernel(fill):
    """A stand-in for F.scaled_dot_product_attention that gets rows with no allowed key wrong:
    fill=-inf gives NaN there (as some GPU kernels have); a large finite fill gives the mean of
    the values, finite and non-zero (as cuDNN's kernel gave on an H200, torch 2.11, float16)."""

    def kernel(Q, K, V, attn_mask=None, dropout_p=0.0, is_causal=False):
        scores = (Q @ K.transpose(-2, -1)) / Q.size(-1) ** 0.5
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, fill)
        return torch.softmax(scores, dim=-1) @ V

    return kernel


@pytest.mark.parametrize("fill", [float("-inf"), -1e9], ids=["nan", "finite"])
def test_fast_attention_zeroes_empty_rows_whatever_the_kernel_returns_there(monkeypatch, fill):
    torch.manual_seed(0)
    scratch = MultiHeadAttention(8, 2).eval()
    fast = fast_copy(scratch)
    x = torch.randn(2, 4, 8, requires_grad=True)
    mask = padding_mask([4, 0], 4)
    expected = scratch(x, mask=mask)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    kernel = wrong_empty_rows_kernel(fill)
    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)
    Q, K, V = qkv(B=2, h=2, T_q=4, T_k=4, dtype=torch.float32)
    empty = kernel(Q, K, V, attn_mask=mask)[1]  # the stand-in gets the empty rows wrong:
    if fill == float("-inf"):
        assert empty.isnan().all()
    else:  # finite and non-zero
        assert empty.isfinite().all() and empty.abs().max() > 0
    out = fast(x, mask=mask)
    assert torch.isfinite(out).all()
    assert_close(out, expected)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert_close(grad, expected_grad)


def test_fast_dropout_with_p_one_drops_everything_like_f_dropout():
    x = torch.randn(4, 5, requires_grad=True)
    out = fast_dropout(x, 1.0)  # once a ZeroDivisionError (the scale 1 / (1 - p))
    assert torch.equal(out, F.dropout(x, 1.0, True)) and torch.equal(out, torch.zeros(4, 5))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(4, 5))


@pytest.mark.parametrize("norm_first", [True, False])
def test_the_fast_path_keeps_drop_path_in_training(norm_first):
    # Once, the fast blocks read dropout1.p and applied their own dropout, so DropPath (which
    # replaces the block's dropout modules by BranchDrop) was silently skipped: in training
    # mode the fast model then gave exactly the eval-mode output.
    from transformer_from_scratch.regularization import add_drop_path

    torch.manual_seed(0)
    model = Transformer(
        11, 11, d_model=16, num_heads=2, d_ff=32, dropout_p=0.0, norm_first=norm_first
    )
    add_drop_path(model, 0.9)
    src, tgt = torch.randint(3, 11, (8, 5)), torch.randint(3, 11, (8, 6))
    mask = causal_mask(6)
    fast = use_fast_path(copy.deepcopy(model))
    with torch.no_grad():
        eval_out = fast.eval()(src, tgt, tgt_mask=mask)
        torch.manual_seed(1)
        scratch_train = model.train()(src, tgt, tgt_mask=mask)
        torch.manual_seed(1)
        fast_train = fast.train()(src, tgt, tgt_mask=mask)
    assert not torch.allclose(fast_train, eval_out, atol=1e-3)  # some branches were dropped
    assert_close(fast_train, scratch_train)  # DropPath draws the same way on both paths


def test_the_fast_switch_is_checked_and_reaches_every_module():
    with pytest.raises(TypeError, match="fast must be a bool"):
        MultiHeadAttention(8, 2, fast="yes")
    with pytest.raises(TypeError, match="fast must be a bool"):
        LayerNorm(8, fast=0)
    model = Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, fast=True)
    switches = [m for m in model.modules() if isinstance(m, (MultiHeadAttention, LayerNorm))]
    assert switches and all(m.fast for m in switches)
    assert "fast=True" in repr(model.encoder.layers[0].self_attn)
