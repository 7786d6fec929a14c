"""Tests for transformer_from_scratch.layers.LayerNorm (notebook 06)."""

import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.layers import LayerNorm


def randomised(d_model: int, eps: float = 1e-5, seed: int = 0) -> tuple[LayerNorm, nn.LayerNorm]:
    """Our LayerNorm with random gamma/beta, and nn.LayerNorm loaded with the same weights."""
    g = torch.Generator().manual_seed(seed)
    ours = LayerNorm(d_model, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(d_model, generator=g))
        ours.bias.copy_(torch.randn(d_model, generator=g))
    reference = nn.LayerNorm(d_model, eps=eps)
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def forward_backward(norm: nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_(True)
    norm.zero_grad()
    y = norm(x)
    y.backward(upstream)
    return y.detach(), x.grad, norm.weight.grad, norm.bias.grad


@pytest.mark.parametrize(
    "shape",
    [(8,), (5, 8), (2, 3, 16), (2, 3, 4, 32)],
    ids=["1d", "2d", "3d", "4d"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_values_and_gradients(shape, dtype):
    g = torch.Generator().manual_seed(1)
    d_model = shape[-1]
    ours, reference = randomised(d_model)
    ours, reference = ours.to(dtype), reference.to(dtype)
    x = (3 * torch.randn(shape, generator=g) + 2).to(dtype)
    upstream = torch.randn(shape, generator=g).to(dtype)
    got = forward_backward(ours, x, upstream)
    expected = forward_backward(reference, x, upstream)
    assert got[0].shape == x.shape and got[0].dtype == dtype
    for name, a, b in zip(("y", "dx", "dweight", "dbias"), got, expected, strict=True):
        assert a is not None, name
        assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_width_one_gives_the_bias():
    # a single feature always equals its own mean: the output is beta, the input gradient zero
    ours, reference = randomised(1)
    x = torch.tensor([[[3.0]], [[-2.0]]]).requires_grad_(True)  # (2, 1, 1)
    y = ours(x)
    assert_close(y, reference(x))
    assert_close(y.detach(), ours.bias.detach().expand(2, 1, 1))
    y.sum().backward()
    # cancellation of two gradients of size 1/sqrt(eps) leaves float32 rounding only
    assert_close(x.grad, torch.zeros(2, 1, 1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("eps", [1e-12, 1e-5, 1e-2, 1.0])
def test_parity_for_several_eps(eps):
    g = torch.Generator().manual_seed(2)
    ours, reference = randomised(12, eps=eps)
    x = 0.1 * torch.randn(4, 7, 12, generator=g)  # small variance, so eps matters
    upstream = torch.randn(4, 7, 12, generator=g)
    for a, b in zip(
        forward_backward(ours, x, upstream), forward_backward(reference, x, upstream), strict=True
    ):
        assert_close(a, b)


def test_parameters_and_defaults_match_nn_layernorm():
    ours, reference = LayerNorm(10), nn.LayerNorm(10)
    assert ours.eps == reference.eps == 1e-5
    assert dict(ours.named_parameters()).keys() == dict(reference.named_parameters()).keys()
    assert torch.equal(ours.weight.detach(), torch.ones(10))
    assert torch.equal(ours.bias.detach(), torch.zeros(10))
    assert ours.weight.shape == ours.bias.shape == (10,)
    assert repr(ours) == "LayerNorm(10, eps=1e-05)"


def test_state_dict_interchange_both_ways():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 6, generator=g)

    ours, _ = randomised(6, seed=4)
    reference = nn.LayerNorm(6)
    reference.load_state_dict(ours.state_dict())  # strict by default: the keys must match
    assert_close(reference(x), ours(x))

    reference = nn.LayerNorm(6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(6, generator=g))
        reference.bias.copy_(torch.randn(6, generator=g))
    ours = LayerNorm(6)
    ours.load_state_dict(reference.state_dict())
    assert_close(ours(x), reference(x))


def test_reset_parameters_restores_identity_affine():
    ours, _ = randomised(7)
    ours.reset_parameters()
    assert torch.equal(ours.weight.detach(), torch.ones(7))
    assert torch.equal(ours.bias.detach(), torch.zeros(7))


def test_normalised_output_statistics():
    g = torch.Generator().manual_seed(5)
    # tokens at very different offsets and scales
    x = torch.randn(6, 9, 64, generator=g) * torch.linspace(0.5, 50, 9)[:, None] + 100.0
    y = LayerNorm(64)(x).detach()
    assert_close(y.mean(dim=-1), torch.zeros(6, 9), atol=1e-4, rtol=0)  # float32, offset 100
    var_in = x.var(dim=-1, unbiased=False)
    assert_close(y.var(dim=-1, unbiased=False), var_in / (var_in + 1e-5), atol=1e-4, rtol=0)


def test_each_position_is_independent_of_the_others():
    g = torch.Generator().manual_seed(6)
    norm, _ = randomised(16)
    x = torch.randn(4, 5, 16, generator=g)
    y = norm(x).detach()
    x_changed = x.clone()
    x_changed[1:] = 100 * torch.randn(3, 5, 16, generator=g)  # change every other sequence
    x_changed[0, 1:] = -7.0  # and every other token of sequence 0
    assert torch.equal(norm(x_changed)[0, 0].detach(), y[0, 0])


def test_eps_guards_constant_input():
    norm, _ = randomised(8)
    y = norm(torch.full((2, 3, 8), 4.5))
    assert torch.isfinite(y).all()
    assert_close(y, norm.bias.detach().expand(2, 3, 8))


def test_larger_eps_shrinks_low_variance_tokens():
    g = torch.Generator().manual_seed(7)
    x = 0.01 * torch.randn(3, 32, generator=g)  # variance ~1e-4
    small, large = LayerNorm(32, eps=1e-8)(x), LayerNorm(32, eps=1e-2)(x)
    assert (large.detach().std(dim=-1) < 0.2 * small.detach().std(dim=-1)).all()


def test_unbiased_variance_would_not_pass():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 16, generator=g)
    unbiased = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
    assert not torch.allclose(LayerNorm(16)(x).detach(), unbiased, rtol=1.3e-6, atol=1e-5)


def test_module_moves_with_to():
    norm = LayerNorm(4).to(torch.float64)
    assert norm.weight.dtype == norm.bias.dtype == torch.float64
    assert norm(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("d_model", [0, -3])
def test_bad_d_model(d_model):
    with pytest.raises(ValueError, match=f"d_model must be at least 1, got {d_model}"):
        LayerNorm(d_model)


@pytest.mark.parametrize("d_model", [4.0, "4", True, None])
def test_d_model_must_be_int(d_model):
    with pytest.raises(TypeError, match="d_model must be an int"):
        LayerNorm(d_model)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("inf"), float("nan")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be (> 0|a finite number)"):
        LayerNorm(8, eps=eps)


@pytest.mark.parametrize("eps", ["1e-5", None, True])
def test_eps_must_be_a_number(eps):
    with pytest.raises(TypeError, match="eps must be a number"):
        LayerNorm(8, eps=eps)


def test_eps_may_be_an_int():
    assert LayerNorm(8, eps=1).eps == 1.0


@pytest.mark.parametrize("shape", [(2, 3, 7), (9,), (8, 2)])
def test_wrong_last_dim(shape):
    expected = f"LayerNorm(8) expects input of shape (..., 8), got {shape}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        LayerNorm(8)(torch.randn(shape))


def test_zero_dim_input():
    with pytest.raises(ValueError, match=r"expects input of shape \(\.\.\., 1\), got \(\)"):
        LayerNorm(1)(torch.tensor(1.0))


def test_integer_input():
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        LayerNorm(3)(torch.arange(6).reshape(2, 3))


def test_non_tensor_input():
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        LayerNorm(3)([1.0, 2.0, 3.0])
