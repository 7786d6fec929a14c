"""Tests for the position encodings of notebook 04 (transformer_from_scratch.positional)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.positional import LearnedPositionalEmbedding
from transformer_from_scratch.positional import PositionalEncoding
from transformer_from_scratch.positional import RotaryEmbedding
from transformer_from_scratch.positional import sinusoidal_table


def rope_reference(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """RoPE as multiplication by e^{i m theta_j} on complex pairs (x_2j + i x_2j+1), float64."""
    T, d = x.shape[-2:]
    t = torch.arange(offset, offset + T, dtype=torch.float64)[:, None]
    angle = t * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (T, d/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    return rotated.to(x.dtype)


def shift_matrix(k: int, d_model: int) -> torch.Tensor:
    """Block-diagonal M_k with PE(t + k) = M_k PE(t)."""
    angle = k * 10000 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    blocks = [
        torch.tensor([[c, s], [-s, c]]) for c, s in zip(angle.cos(), angle.sin(), strict=True)
    ]
    return torch.block_diag(*blocks).float()


# ---------------------------------------------------------------- sinusoidal_table
def test_table_shape_dtype_and_hand_computed_entries():
    pe = sinusoidal_table(100, 8)
    assert pe.shape == (100, 8) and pe.dtype == torch.get_default_dtype()
    assert torch.equal(pe[0], torch.tensor([0.0, 1.0] * 4))
    assert pe[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)  # 0.8415
    assert pe[1, 1].item() == pytest.approx(math.cos(1.0), abs=1e-7)  # 0.5403
    # i = 1: omega = 10000^(-2/8) = 0.1, so PE(10, 2) = sin(1) and PE(10, 3) = cos(1).
    assert pe[10, 2].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert pe[10, 3].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    # i = 3: omega = 10000^(-6/8) = 0.001, so PE(50, 6) = sin(0.05).
    assert pe[50, 6].item() == pytest.approx(math.sin(0.05), abs=1e-7)
    assert pe.abs().max() <= 1.0


def test_table_is_accurate_at_large_positions():
    pe = sinusoidal_table(5000, 128)
    for t, i in [(4999, 1), (4321, 10), (3000, 63)]:
        omega = 10000 ** (-2 * i / 128)
        assert pe[t, 2 * i].item() == pytest.approx(math.sin(omega * t), abs=1e-6)
        assert pe[t, 2 * i + 1].item() == pytest.approx(math.cos(omega * t), abs=1e-6)


def test_table_prefix_does_not_depend_on_max_len():
    assert torch.equal(sinusoidal_table(10, 16), sinusoidal_table(500, 16)[:10])


def test_shift_by_k_is_a_fixed_rotation():
    pe = sinusoidal_table(2000, 64)
    for k in [1, 7, 300]:
        M_k = shift_matrix(k, 64)
        assert_close(pe[k:], pe[:-k] @ M_k.T)
        assert_close(M_k @ M_k.T, torch.eye(64), atol=1e-6, rtol=0)


def test_dot_product_depends_on_offset_only():
    pe = sinusoidal_table(300, 32).double()
    S = pe @ pe.T
    omega = 10000 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    for k in [0, 1, 9, 100]:
        diagonal = torch.diagonal(S, offset=k)
        assert_close(diagonal, torch.cos(k * omega).sum().expand_as(diagonal), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "max_len, d_model, error, match",
    [
        (10, 7, ValueError, "d_model must be even"),
        (10, 0, ValueError, "d_model must be at least 1"),
        (0, 8, ValueError, "max_len must be at least 1"),
        (10, 8.0, TypeError, "d_model must be an int"),
        (True, 8, TypeError, "max_len must be an int"),
    ],
)
def test_table_rejects_bad_sizes(max_len, d_model, error, match):
    with pytest.raises(error, match=match):
        sinusoidal_table(max_len, d_model)


def test_table_rejects_bad_base():
    with pytest.raises(ValueError, match="base must be > 1"):
        sinusoidal_table(10, 8, base=1.0)


# ---------------------------------------------------------------- PositionalEncoding
def test_pe_buffer_shape_and_values():
    module = PositionalEncoding(16, max_len=50)
    assert module.pe.shape == (1, 50, 16)
    assert torch.equal(module.pe[0], sinusoidal_table(50, 16))
    assert PositionalEncoding(16).pe.shape == (1, 5000, 16)  # default max_len


def test_pe_is_a_persistent_buffer_not_a_parameter():
    module = PositionalEncoding(16, max_len=50)
    assert "pe" in dict(module.named_buffers())
    assert list(module.state_dict()) == ["pe"]
    assert list(module.parameters()) == []
    # Loading a state_dict restores the table.
    other = PositionalEncoding(16, max_len=50)
    other.pe.zero_()
    other.load_state_dict(module.state_dict())
    assert torch.equal(other.pe, module.pe)


def test_pe_moves_with_to():
    module = PositionalEncoding(16, max_len=50).to(torch.float64)
    assert module.pe.dtype == torch.float64
    assert PositionalEncoding(16, max_len=50).to("meta").pe.device.type == "meta"
    if torch.cuda.is_available():
        assert PositionalEncoding(16, max_len=50).to("cuda").pe.device.type == "cuda"


def test_pe_forward_adds_the_first_T_rows():
    module = PositionalEncoding(16, max_len=50)
    x = torch.randn(3, 7, 16)
    out = module(x)
    assert out.shape == x.shape
    assert_close(out, x + sinusoidal_table(50, 16)[:7])
    assert_close(module(torch.zeros(1, 50, 16)), module.pe)  # T == max_len is allowed


def test_pe_forward_gradient_is_identity():
    module = PositionalEncoding(16, max_len=50)
    x = torch.randn(2, 5, 16, requires_grad=True)
    grad_out = torch.randn(2, 5, 16)
    module(x).backward(grad_out)
    assert_close(x.grad, grad_out)


def test_pe_forward_keeps_low_precision_dtypes():
    module = PositionalEncoding(16, max_len=50)
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    out = module(x)
    assert out.dtype == torch.bfloat16
    assert_close(out, x + module.pe[:, :5].to(torch.bfloat16))


def test_pe_dropout_in_training_and_identity_in_eval():
    module = PositionalEncoding(16, max_len=50, dropout_p=0.5)
    x = torch.randn(4, 10, 16)
    clean = x + module.pe[:, :10]
    noisy = module(x)
    kept = noisy != 0
    assert 0 < kept.float().mean() < 1
    assert_close(noisy[kept], 2 * clean[kept])  # inverted dropout scales by 1 / (1 - p)
    module.eval()
    assert torch.equal(module(x), clean)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 15}, "d_model must be even"),
        ({"d_model": 16, "max_len": 0}, "max_len must be at least 1"),
        ({"d_model": 16, "dropout_p": 1.0}, r"dropout_p must be (in \[0, 1\)|a finite number)"),
        ({"d_model": 16, "dropout_p": -0.1}, r"dropout_p must be (in \[0, 1\)|a finite number)"),
    ],
)
def test_pe_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PositionalEncoding(**kwargs)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((5, 16), r"shape \(B, T, d_model=16\), got \(5, 16\)"),
        ((1, 2, 5, 16), r"got \(1, 2, 5, 16\)"),
        ((2, 5, 12), r"d_model=16\), got \(2, 5, 12\)"),
        ((2, 51, 16), r"positions 0\.\.50 \(offset \+ T\) exceed max_len=50"),
    ],
)
def test_pe_forward_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        PositionalEncoding(16, max_len=50)(torch.zeros(shape))


def test_pe_forward_rejects_integer_input():
    with pytest.raises(TypeError, match="floating-point"):
        PositionalEncoding(16, max_len=50)(torch.zeros(2, 5, 16, dtype=torch.long))


# ---------------------------------------------------------------- LearnedPositionalEmbedding
def test_learned_shapes_and_parameters():
    module = LearnedPositionalEmbedding(max_len=20, d_model=8)
    assert isinstance(module.embedding, nn.Embedding)
    assert module.embedding.weight.shape == (20, 8)
    assert sum(p.numel() for p in module.parameters()) == 20 * 8
    assert 0.01 < module.embedding.weight.std().item() < 0.03  # N(0, 0.02^2) start
    x = torch.randn(3, 6, 8)
    out = module(x)
    assert out.shape == (3, 6, 8)
    assert_close(out, x + module.embedding.weight[:6])


def test_learned_takes_its_sizes_in_the_order_of_positional_encoding():
    """(d_model, max_len), as PositionalEncoding: one can replace the other, positionally too."""
    learned, fixed = LearnedPositionalEmbedding(8, 20), PositionalEncoding(8, 20)
    assert learned.embedding.weight.shape == fixed.pe.shape[1:] == (20, 8)
    x = torch.randn(2, 20, 8)
    assert learned(x).shape == fixed(x).shape == (2, 20, 8)


def test_learned_gradients_reach_only_the_used_rows():
    module = LearnedPositionalEmbedding(max_len=20, d_model=8)
    x = torch.randn(3, 6, 8, requires_grad=True)
    grad_out = torch.randn(3, 6, 8)
    module(x).backward(grad_out)
    assert_close(x.grad, grad_out)
    assert_close(module.embedding.weight.grad[:6], grad_out.sum(0))
    assert torch.equal(module.embedding.weight.grad[6:], torch.zeros(14, 8))


def test_learned_dropout_and_eval():
    module = LearnedPositionalEmbedding(max_len=20, d_model=8, dropout_p=0.5)
    x = torch.randn(4, 10, 8)
    assert (module(x) == 0).any()
    module.eval()
    assert torch.equal(module(x), x + module.embedding.weight[:10])


def test_learned_offset_selects_later_rows_and_matches_one_long_call():
    """A KV-cached decoder adds rows offset .. offset+T-1; token by token, the same as at once."""
    module = LearnedPositionalEmbedding(max_len=20, d_model=8)
    x = torch.randn(2, 5, 8)
    assert torch.equal(module(x, offset=7), x + module.embedding.weight[7:12])
    assert not torch.allclose(module(x, offset=7), module(x))  # the offset is not ignored
    steps = [module(x[:, t : t + 1], offset=t) for t in range(5)]
    assert torch.equal(torch.cat(steps, dim=1), module(x))
    module(torch.zeros(1, 1, 8), offset=19)  # the last row
    with pytest.raises(ValueError, match="exceed max_len=20"):
        module(torch.zeros(1, 2, 8), offset=19)


def test_learned_state_dict_and_to():
    module = LearnedPositionalEmbedding(max_len=20, d_model=8)
    assert list(module.state_dict()) == ["embedding.weight"]
    assert module.to(torch.float64).embedding.weight.dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_len": 0, "d_model": 8}, ValueError, "max_len must be at least 1"),
        ({"max_len": 20, "d_model": -1}, ValueError, "d_model must be at least 1"),
        ({"max_len": 20.5, "d_model": 8}, TypeError, "max_len must be an int"),
        ({"max_len": 20, "d_model": 8, "dropout_p": 1.5}, ValueError, "dropout_p"),
    ],
)
def test_learned_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearnedPositionalEmbedding(**kwargs)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((6, 8), r"got \(6, 8\)"),
        ((2, 6, 7), r"d_model=8\), got \(2, 6, 7\)"),
        ((2, 21, 8), r"positions 0\.\.20 \(offset \+ T\) exceed max_len=20"),
    ],
)
def test_learned_forward_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        LearnedPositionalEmbedding(max_len=20, d_model=8)(torch.zeros(shape))


# ---------------------------------------------------------------- RotaryEmbedding
def test_rope_matches_complex_multiplication():
    rope = RotaryEmbedding(32, max_len=256)
    x = torch.randn(2, 3, 10, 32)
    for offset in [0, 5, 200]:
        assert_close(rope.rotate(x, offset), rope_reference(x, offset), atol=1e-5, rtol=1e-5)


def test_rope_gradients_match_complex_multiplication():
    rope = RotaryEmbedding(16, max_len=64)
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, 7, 16, dtype=torch.float64)
    rope.to(torch.float64).rotate(x, offset=3).backward(grad_out)
    rope_reference(x_ref, offset=3).backward(grad_out)
    assert_close(x.grad, x_ref.grad)


def test_rope_position_zero_is_identity_and_shapes_are_kept():
    rope = RotaryEmbedding(8, max_len=16)
    x = torch.randn(4, 1, 8)
    assert torch.equal(rope.rotate(x), x)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    q_rot, k_rot = rope(q, k)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape
    assert_close(k_rot, rope.rotate(k))


def test_rope_score_depends_on_offset_only():
    rope = RotaryEmbedding(64, max_len=2048)
    q, k = torch.randn(1, 64), torch.randn(1, 64)

    def score(m: int, n: int) -> float:
        return (rope.rotate(q, m) @ rope.rotate(k, n).T).item()

    by_offset = []
    for delta in [0, 1, 4, 33]:
        scores = [score(n + delta, n) for n in [0, 11, 500, 1900]]
        assert scores == pytest.approx([scores[0]] * 4, abs=1e-4)
        by_offset.append(scores[0])
    diffs = [abs(a - b) for i, a in enumerate(by_offset) for b in by_offset[i + 1 :]]
    assert min(diffs) > 1e-2


def test_rope_scores_form_a_toeplitz_matrix():
    rope = RotaryEmbedding(32, max_len=128)
    q, k = torch.randn(32), torch.randn(32)
    S = rope.rotate(q.expand(128, 32)) @ rope.rotate(k.expand(128, 32)).T  # (128, 128)
    for offset in [-50, -1, 0, 3, 90]:
        diagonal = torch.diagonal(S, offset=offset)
        assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-4, rtol=1e-5)


def test_rope_preserves_norms():
    rope = RotaryEmbedding(32, max_len=128)
    x = torch.randn(3, 2, 40, 32)
    assert_close(rope.rotate(x, 77).norm(dim=-1), x.norm(dim=-1))


def test_rope_attention_is_shift_invariant():
    rope = RotaryEmbedding(16, max_len=128)
    q, k, v = (torch.randn(2, 3, 9, 16) for _ in range(3))
    out_0 = F.scaled_dot_product_attention(*rope(q, k), v)
    out_50 = F.scaled_dot_product_attention(*rope(q, k, offset=50), v)
    assert_close(out_0, out_50, atol=1e-5, rtol=1e-4)


def test_rope_buffers_are_not_persistent_but_move_with_to():
    rope = RotaryEmbedding(16, max_len=64)
    assert {name for name, _ in rope.named_buffers()} == {"cos", "sin"}
    assert rope.cos.shape == rope.sin.shape == (64, 8)
    assert rope.state_dict() == {}
    assert rope.to(torch.float64).cos.dtype == torch.float64
    assert RotaryEmbedding(16, max_len=64).to("meta").sin.device.type == "meta"


def test_rope_keeps_dtype():
    rope = RotaryEmbedding(16, max_len=64)
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    assert rope.rotate(x).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"d_head": 15}, ValueError, "d_head must be even"),
        ({"d_head": 0}, ValueError, "d_head must be at least 1"),
        ({"d_head": 16, "max_len": 0}, ValueError, "max_len must be at least 1"),
        ({"d_head": 16, "base": 0.5}, ValueError, "base must be > 1"),
        ({"d_head": "16"}, TypeError, "d_head must be an int"),
    ],
)
def test_rope_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        RotaryEmbedding(**kwargs)


@pytest.mark.parametrize(
    "shape, offset, error, match",
    [
        ((16,), 0, ValueError, r"shape \(\.\.\., T, d_head=16\), got \(16,\)"),
        ((2, 5, 12), 0, ValueError, r"d_head=16\), got \(2, 5, 12\)"),
        ((2, 65, 16), 0, ValueError, "offset\\+T=65 exceed max_len=64"),
        ((2, 5, 16), 60, ValueError, "offset\\+T=65 exceed max_len=64"),
        ((2, 5, 16), -1, ValueError, "offset must be at least 0"),
        ((2, 5, 16), 1.0, TypeError, "offset must be an int"),
    ],
)
def test_rope_rotate_errors(shape, offset, error, match):
    with pytest.raises(error, match=match):
        RotaryEmbedding(16, max_len=64).rotate(torch.zeros(shape), offset=offset)


def test_rope_rejects_integer_input():
    with pytest.raises(TypeError, match="floating-point"):
        RotaryEmbedding(16, max_len=64).rotate(torch.zeros(2, 5, 16, dtype=torch.long))
