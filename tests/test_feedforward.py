"""Tests for the feed-forward networks of notebook 07 (transformer_from_scratch.layers)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.layers import GatedFeedForward
from transformer_from_scratch.layers import feed_forward
from transformer_from_scratch.layers import get_activation


# ---------------------------------------------------------------- get_activation
@pytest.mark.parametrize("name, cls", [("relu", nn.ReLU), ("gelu", nn.GELU), ("silu", nn.SiLU)])
def test_get_activation_types(name, cls):
    assert type(get_activation(name)) is cls


def test_get_activation_names_are_exact():
    with pytest.raises(ValueError, match="did you mean 'gelu'"):
        get_activation("GELU")
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        get_activation("tanh")


def test_get_activation_returns_new_modules():
    assert get_activation("relu") is not get_activation("relu")


def test_get_activation_values():
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    assert_close(get_activation("relu")(x), x.clamp(min=0))
    assert_close(get_activation("gelu")(x), x * 0.5 * (1 + torch.erf(x / 2**0.5)))
    assert_close(get_activation("silu")(x), x * torch.sigmoid(x))


def test_get_activation_unknown_name():
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        get_activation("tanh")


def test_get_activation_not_a_string():
    with pytest.raises(TypeError, match="activation must be a str"):
        get_activation(nn.ReLU)


# ---------------------------------------------------------------- feed_forward
@pytest.mark.parametrize("activation, cls", [("relu", nn.ReLU), ("gelu", nn.GELU)])
def test_feed_forward_layout(activation, cls):
    ffn = feed_forward(16, 64, activation=activation)
    assert isinstance(ffn, nn.Sequential) and len(ffn) == 3
    assert [type(m) for m in ffn] == [nn.Linear, cls, nn.Linear]
    assert (ffn[0].in_features, ffn[0].out_features) == (16, 64)
    assert (ffn[2].in_features, ffn[2].out_features) == (64, 16)


def test_feed_forward_dropout_is_appended_after_the_layout():
    ffn = feed_forward(16, 64, activation="gelu", dropout_p=0.25)
    assert [type(m) for m in ffn] == [nn.Linear, nn.GELU, nn.Linear, nn.Dropout]
    assert ffn[3].p == 0.25
    ffn.eval()
    x = torch.randn(2, 3, 16)
    assert_close(ffn(x), ffn[2](ffn[1](ffn[0](x))))


@pytest.mark.parametrize("shape", [(16,), (5, 16), (2, 7, 16), (2, 3, 4, 16)])
def test_feed_forward_shapes(shape):
    assert feed_forward(16, 64)(torch.randn(*shape)).shape == shape


def test_feed_forward_matches_the_paper_formula():
    ffn = feed_forward(16, 64)
    x = torch.randn(2, 5, 16)
    W_1, b_1, W_2, b_2 = ffn[0].weight.T, ffn[0].bias, ffn[2].weight.T, ffn[2].bias
    assert_close(ffn(x), torch.clamp(x @ W_1 + b_1, min=0) @ W_2 + b_2)


@pytest.mark.parametrize("bias", [True, False])
def test_feed_forward_bias(bias):
    ffn = feed_forward(16, 64, bias=bias)
    assert (ffn[0].bias is not None) is bias and (ffn[2].bias is not None) is bias


@pytest.mark.parametrize("d_model, d_ff", [(512, 2048), (128, 512), (16, 48)])
def test_feed_forward_parameter_count(d_model, d_ff, num_params):
    assert num_params(feed_forward(d_model, d_ff)) == 2 * d_model * d_ff + d_ff + d_model
    assert num_params(feed_forward(d_model, d_ff, bias=False)) == 2 * d_model * d_ff


def test_ffn_is_two_thirds_of_an_encoder_block(num_params):
    d_model, d_ff = 128, 512
    ffn = num_params(feed_forward(d_model, d_ff))
    attention = num_params(nn.MultiheadAttention(d_model, 4))
    assert attention == 4 * d_model**2 + 4 * d_model
    reference = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=d_ff, batch_first=True)
    assert num_params(reference) == ffn + attention + 2 * 2 * d_model
    assert abs(ffn / (ffn + attention) - 2 / 3) < 0.005


def test_feed_forward_is_position_wise():
    ffn = feed_forward(8, 32, activation="gelu")
    x = torch.randn(2, 6, 8)
    y = ffn(x)
    # Changing every other position leaves position t unchanged.
    t = 3
    x_other = x.clone()
    x_other[:, [s for s in range(6) if s != t]] += 5.0
    assert_close(ffn(x_other)[:, t], y[:, t])
    # Applying the FFN to one position at a time gives the same result.
    assert_close(torch.stack([ffn(x[:, s]) for s in range(6)], dim=1), y)
    # The Jacobian is block-diagonal across positions.
    J = torch.autograd.functional.jacobian(ffn, x[0])  # (T, d, T, d)
    blocks = J.permute(0, 2, 1, 3)  # (T, T, d, d)
    off_diagonal = ~torch.eye(6, dtype=torch.bool)
    assert torch.count_nonzero(blocks[off_diagonal]) == 0
    assert all(torch.count_nonzero(blocks[t, t]) > 0 for t in range(6))


def test_feed_forward_equals_1x1_convolutions():
    ffn = feed_forward(8, 32)
    conv = nn.Sequential(nn.Conv1d(8, 32, 1), nn.ReLU(), nn.Conv1d(32, 8, 1))
    with torch.no_grad():
        for c, lin in [(conv[0], ffn[0]), (conv[2], ffn[2])]:
            c.weight.copy_(lin.weight.unsqueeze(-1))  # (out, in) -> (out, in, 1)
            c.bias.copy_(lin.bias)
    x_a = torch.randn(3, 5, 8, requires_grad=True)
    x_b = x_a.detach().clone().requires_grad_(True)
    y_a = ffn(x_a)
    y_b = conv(x_b.transpose(1, 2)).transpose(1, 2)  # (B, T, d) -> (B, d, T) -> (B, T, d)
    assert_close(y_b, y_a)
    y_a.square().sum().backward()
    y_b.square().sum().backward()
    assert_close(x_b.grad, x_a.grad)


def test_feed_forward_matches_transformer_encoder_layer_ffn():
    # nn.TransformerEncoderLayer's FFN (in eval mode) is linear2(activation(linear1(x))).
    ffn = feed_forward(16, 64, activation="gelu")
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=64, activation="gelu").eval()
    with torch.no_grad():
        layer.linear1.weight.copy_(ffn[0].weight)
        layer.linear1.bias.copy_(ffn[0].bias)
        layer.linear2.weight.copy_(ffn[2].weight)
        layer.linear2.bias.copy_(ffn[2].bias)
    x = torch.randn(2, 5, 16)
    assert_close(ffn(x), layer.linear2(layer.dropout(layer.activation(layer.linear1(x)))))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=0, d_ff=8), "d_model must be at least 1, got 0"),
        (dict(d_model=-4, d_ff=8), "d_model must be at least 1, got -4"),
        (dict(d_model=8, d_ff=0), "d_ff must be at least 1, got 0"),
        (
            dict(d_model=8, d_ff=32, dropout_p=1.0),
            r"dropout_p must be in \[0, 1\), got 1.0",
        ),
        (
            dict(d_model=8, d_ff=32, dropout_p=-0.1),
            r"dropout_p must be (in \[0, 1\)|a finite number)",
        ),
        (dict(d_model=8, d_ff=32, activation="swish"), "unknown activation 'swish'"),
    ],
)
def test_feed_forward_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        feed_forward(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(d_model=8.0, d_ff=32), dict(d_model=8, d_ff=True)])
def test_feed_forward_type_errors(kwargs):
    with pytest.raises(TypeError, match="must be an int"):
        feed_forward(**kwargs)


# ---------------------------------------------------------------- GatedFeedForward
@pytest.mark.parametrize("activation, fn", [("silu", F.silu), ("gelu", F.gelu), ("relu", F.relu)])
def test_gated_matches_manual_computation(activation, fn):
    gated = GatedFeedForward(8, 24, activation=activation)
    x_a = torch.randn(2, 5, 8, requires_grad=True)
    x_b = x_a.detach().clone().requires_grad_(True)
    out = gated(x_a)
    W, V, W_2 = gated.W.weight.T, gated.V.weight.T, gated.W_2.weight.T
    manual = (fn(x_b @ W) * (x_b @ V)) @ W_2
    assert out.shape == (2, 5, 8)
    assert_close(out, manual)
    out.square().sum().backward()
    manual.square().sum().backward()
    assert_close(x_a.grad, x_b.grad)


def test_gated_with_bias_matches_manual_computation():
    gated = GatedFeedForward(8, 24, activation="gelu", bias=True)
    x = torch.randn(4, 8)
    hidden = F.gelu(x @ gated.W.weight.T + gated.W.bias) * (x @ gated.V.weight.T + gated.V.bias)
    assert_close(gated(x), hidden @ gated.W_2.weight.T + gated.W_2.bias)


def test_gated_defaults_are_swiglu_without_bias():
    gated = GatedFeedForward(8, 24)
    assert isinstance(gated.activation, nn.SiLU)
    assert gated.W.bias is None and gated.V.bias is None and gated.W_2.bias is None


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 5, 8)])
def test_gated_shapes(shape):
    assert GatedFeedForward(8, 24)(torch.randn(*shape)).shape == shape


def test_gated_parameter_count_and_matching_rule(num_params):
    assert num_params(GatedFeedForward(16, 40)) == 3 * 16 * 40
    assert num_params(GatedFeedForward(16, 40, bias=True)) == 3 * 16 * 40 + 2 * 40 + 16
    # Shazeer (2020): d_model 768, d_ff 3072 -> gated d_ff 2048 keeps the count equal.
    assert num_params(GatedFeedForward(768, 2048)) == num_params(
        feed_forward(768, 3072, bias=False)
    )


def test_gated_is_position_wise():
    gated = GatedFeedForward(8, 24)
    x = torch.randn(1, 4, 8)
    J = torch.autograd.functional.jacobian(gated, x[0]).permute(0, 2, 1, 3)  # (T, T, d, d)
    assert torch.count_nonzero(J[~torch.eye(4, dtype=torch.bool)]) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=0, d_ff=8), "d_model must be at least 1"),
        (dict(d_model=8, d_ff=-2), "d_ff must be at least 1, got -2"),
        (dict(d_model=8, d_ff=8, activation="sigmoid"), "unknown activation 'sigmoid'"),
    ],
)
def test_gated_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedFeedForward(**kwargs)


def test_gated_wrong_width():
    gated = GatedFeedForward(8, 24)
    message = r"GatedFeedForward\(8, 24\) expects x of shape \(\.\.\., 8\), got \(2, 5, 9\)"
    with pytest.raises(ValueError, match=message):
        gated(torch.randn(2, 5, 9))
    with pytest.raises(ValueError, match="got \\(\\)"):
        gated(torch.tensor(1.0))


@pytest.mark.parametrize(
    "x, match",
    [
        ([[0.0] * 8], "x must be a torch.Tensor, got list"),
        (
            torch.ones(2, 8, dtype=torch.int64),
            "x must be a floating-point tensor, got dtype torch.int64",
        ),
    ],
)
def test_gated_refuses_an_input_that_is_not_a_float_tensor(x, match):
    with pytest.raises(TypeError, match=match):
        GatedFeedForward(8, 24)(x)


def test_gated_skips_its_input_checks_inside_validated():
    from transformer_from_scratch.checks import validated

    gated = GatedFeedForward(8, 24)
    with validated(), pytest.raises(RuntimeError):  # torch's own error, not the course's
        gated(torch.randn(2, 9))


@pytest.mark.parametrize("bias", [1, 0, "False", None])
def test_gated_refuses_a_bias_that_is_not_a_bool(bias):
    with pytest.raises(TypeError, match="bias must be a bool"):
        GatedFeedForward(8, 24, bias=bias)
