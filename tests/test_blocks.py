"""Tests for the encoder and decoder blocks of notebook 08 (transformer_from_scratch.layers)."""

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.attention import MultiHeadAttention
from transformer_from_scratch.layers import DecoderBlock
from transformer_from_scratch.layers import EncoderBlock
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.layers import sublayer_connection
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.reference import copy_block_to_torch
from transformer_from_scratch.reference import copy_norm_to_torch
from transformer_from_scratch.reference import torch_parameter

B, T, T_SRC, D, H, D_FF = 2, 5, 7, 16, 4, 32


def torch_layer(ours, **overrides):
    """The PyTorch layer with our block's configuration, float64, weights copied from ours."""
    cls = (
        nn.TransformerEncoderLayer if isinstance(ours, EncoderBlock) else nn.TransformerDecoderLayer
    )
    config = dict(
        d_model=ours.d_model,
        nhead=ours.num_heads,
        dim_feedforward=ours.d_ff,
        dropout=0.0,
        activation="gelu" if isinstance(ours.ffn[1], nn.GELU) else "relu",
        batch_first=True,
        norm_first=ours.norm_first,
    )
    config.update(overrides)
    theirs = cls(**config).double()
    copy_block_to_torch(ours, theirs)
    return theirs


def matching_params(ours, theirs):
    """(our parameter, their parameter, rows of theirs that hold ours) for every parameter."""
    return [(p, *torch_parameter(theirs, name)) for name, p in ours.named_parameters()]


def data(*shape):
    return torch.randn(*shape, dtype=torch.float64)


# ---------------------------------------------------------------- sublayer_connection
def test_sublayer_connection_formulas():
    x = data(B, T, D)
    norm, linear, drop = LayerNorm(D).double(), nn.Linear(D, D).double(), nn.Dropout(0.0)
    assert_close(sublayer_connection(x, linear, norm, drop), x + linear(norm(x)))
    assert_close(sublayer_connection(x, linear, norm, drop, norm_first=False), norm(x + linear(x)))


def test_sublayer_connection_pre_norm_identity_path():
    x = 3 * data(B, T, D) + 1
    norm, drop = LayerNorm(D).double(), nn.Dropout(0.0)
    silent = lambda h: torch.zeros_like(h)  # noqa: E731
    assert torch.equal(sublayer_connection(x, silent, norm, drop, norm_first=True), x)
    assert_close(sublayer_connection(x, silent, norm, drop, norm_first=False), norm(x))


# ---------------------------------------------------------------- construction
def test_encoder_block_layout():
    block = EncoderBlock(D, H, D_FF)
    assert isinstance(block.self_attn, MultiHeadAttention) and block.self_attn.num_heads == H
    assert isinstance(block.norm1, LayerNorm) and isinstance(block.norm2, LayerNorm)
    assert isinstance(block.ffn, nn.Sequential)
    assert [type(m) for m in block.ffn] == [nn.Linear, nn.ReLU, nn.Linear]  # ReLU by default
    assert (block.ffn[0].in_features, block.ffn[0].out_features) == (D, D_FF)
    assert block.norm_first is True
    assert "norm_first=True" in repr(block)


def test_decoder_block_layout():
    block = DecoderBlock(D, H, D_FF, activation="relu", norm_first=False)
    assert isinstance(block.self_attn, MultiHeadAttention)
    assert isinstance(block.cross_attn, MultiHeadAttention)
    assert block.self_attn is not block.cross_attn
    for name in ("norm1", "norm2", "norm3"):
        assert isinstance(getattr(block, name), LayerNorm)
    assert [type(m) for m in block.ffn] == [nn.Linear, nn.ReLU, nn.Linear]
    assert block.norm_first is False


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_dropout_p_reaches_attention_and_residuals(cls):
    block = cls(D, H, D_FF, dropout_p=0.2)
    assert block.self_attn.dropout_p == 0.2
    dropouts = [m for m in block.modules() if isinstance(m, nn.Dropout)]
    assert len(dropouts) == (2 if cls is EncoderBlock else 3)
    assert all(m.p == 0.2 for m in dropouts)
    assert len(block.ffn) == 3  # no dropout inside the FFN


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_no_bias(cls):
    block = cls(D, H, D_FF, bias=False)
    assert all(m.bias is None for m in block.modules() if isinstance(m, nn.Linear))


def test_parameter_counts_match_formula_and_torch(num_params):
    for d, h, d_ff in [(16, 4, 32), (128, 4, 512), (512, 8, 2048)]:
        enc, dec = EncoderBlock(d, h, d_ff), DecoderBlock(d, h, d_ff)
        assert num_params(enc) == 4 * d**2 + 2 * d * d_ff + d_ff + 9 * d
        assert num_params(dec) == 8 * d**2 + 2 * d * d_ff + d_ff + 15 * d
        assert num_params(enc) == num_params(nn.TransformerEncoderLayer(d, h, d_ff))
        assert num_params(dec) == num_params(nn.TransformerDecoderLayer(d, h, d_ff))
    assert num_params(EncoderBlock(128, 4, 512)) == 198_272
    assert num_params(DecoderBlock(128, 4, 512)) == 264_576


# ---------------------------------------------------------------- shapes and masks
@pytest.mark.parametrize("norm_first", [True, False])
def test_shapes(norm_first):
    x, enc_out = torch.randn(B, T, D), torch.randn(B, T_SRC, D)
    enc = EncoderBlock(D, H, D_FF, norm_first=norm_first)
    dec = DecoderBlock(D, H, D_FF, norm_first=norm_first)
    assert enc(x).shape == (B, T, D)
    assert enc(x, mask=padding_mask([5, 2], T)).shape == (B, T, D)
    y = dec(x, enc_out, self_mask=causal_mask(T), cross_mask=padding_mask([7, 3], T_SRC))
    assert y.shape == (B, T, D)
    assert dec(torch.randn(1, 1, D), torch.randn(1, T_SRC, D)).shape == (1, 1, D)


@pytest.mark.parametrize("norm_first", [True, False])
def test_causal_self_mask_hides_the_future(norm_first):
    dec = DecoderBlock(D, H, D_FF, norm_first=norm_first).double()
    x, enc_out = data(B, T, D), data(B, T_SRC, D)
    y = dec(x, enc_out, self_mask=causal_mask(T))
    x2 = x.clone()
    x2[:, 3:] = data(B, T - 3, D)
    assert_close(dec(x2, enc_out, self_mask=causal_mask(T))[:, :3], y[:, :3])


def test_padding_masks_hide_padded_keys():
    enc = EncoderBlock(D, H, D_FF).double()
    x = data(B, T, D)
    pad = padding_mask([T, 2], T)
    x2 = x.clone()
    x2[1, 2:] = 50 * data(T - 2, D)
    assert_close(enc(x2, mask=pad)[1, :2], enc(x, mask=pad)[1, :2])

    dec = DecoderBlock(D, H, D_FF).double()
    x_tgt, enc_out = data(B, T, D), data(B, T_SRC, D)
    src_pad = padding_mask([T_SRC, 3], T_SRC)
    enc_out2 = enc_out.clone()
    enc_out2[1, 3:] = 50 * data(T_SRC - 3, D)
    assert_close(dec(x_tgt, enc_out2, cross_mask=src_pad), dec(x_tgt, enc_out, cross_mask=src_pad))


def test_float_masks_equal_bool_masks():
    dec = DecoderBlock(D, H, D_FF).double()
    x, enc_out = data(B, T, D), data(B, T_SRC, D)
    self_mask = causal_mask(T) & padding_mask([T, 3], T)
    cross_mask = padding_mask([T_SRC, 4], T_SRC)
    additive = lambda m: torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, float("-inf"))  # noqa: E731
    assert_close(
        dec(x, enc_out, self_mask=additive(self_mask), cross_mask=additive(cross_mask)),
        dec(x, enc_out, self_mask=self_mask, cross_mask=cross_mask),
    )


# ---------------------------------------------------------------- parity with PyTorch
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "causal+padding"])
def test_encoder_parity_values_and_grads(norm_first, activation, masks, randomize_vectors):
    ours = EncoderBlock(D, H, D_FF, activation=activation, norm_first=norm_first).double()
    randomize_vectors(ours)
    theirs = torch_layer(ours)
    pad, causal = padding_mask([T, 3], T), causal_mask(T)
    our_mask, their_kwargs = None, {}
    if "padding" in masks:
        our_mask = pad
        their_kwargs["src_key_padding_mask"] = ~pad[:, 0, 0]  # (B, T), True = blocked
    if "causal" in masks:
        our_mask = causal if our_mask is None else causal & our_mask
        their_kwargs["src_mask"] = ~causal[0, 0]  # (T, T), True = blocked
    x = data(B, T, D)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, mask=our_mask), theirs(xb, **their_kwargs)
    assert_close(ya, yb)
    upstream = data(B, T, D)
    (ya * upstream).sum().backward()
    (yb * upstream).sum().backward()
    assert_close(xa.grad, xb.grad)
    for p, q, rows in matching_params(ours, theirs):
        assert_close(p.grad, q.grad[rows])


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_parity_values_and_grads(
    norm_first, activation, randomize_vectors, assert_decoder_parity
):
    ours = DecoderBlock(D, H, D_FF, activation=activation, norm_first=norm_first).double()
    randomize_vectors(ours)
    assert_decoder_parity(ours, torch_layer(ours), [T, 2], [T_SRC, 4], D)


def test_decoder_parity_with_float_masks(randomize_vectors):
    ours = DecoderBlock(D, H, D_FF, activation="relu").double()
    randomize_vectors(ours)
    theirs = torch_layer(ours)
    x, enc_out = data(B, T, D), data(B, T_SRC, D)
    causal = causal_mask(T)
    float_causal = torch.zeros(T, T, dtype=torch.float64).masked_fill(~causal[0, 0], float("-inf"))
    assert_close(
        ours(x, enc_out, self_mask=causal),
        theirs(x, enc_out, tgt_mask=float_causal),
    )


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_parity_without_bias(cls):
    ours = cls(D, H, D_FF, bias=False, norm_first=False).double()
    theirs = torch_layer(ours, bias=False)
    x, enc_out = data(B, T, D), data(B, T_SRC, D)
    args = (x,) if cls is EncoderBlock else (x, enc_out)
    assert_close(ours(*args), theirs(*args))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # nn.Transformer, norm_first
def test_copy_into_nn_transformer_layers():
    model = nn.Transformer(
        d_model=D,
        nhead=H,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=D_FF,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    ).double()
    enc = EncoderBlock(D, H, D_FF, activation="relu").double()
    dec = DecoderBlock(D, H, D_FF, activation="relu").double()
    copy_block_to_torch(enc, model.encoder.layers[0])
    copy_block_to_torch(dec, model.decoder.layers[0])
    src, tgt = data(B, T_SRC, D), data(B, T, D)
    assert_close(model.encoder.layers[0](src), enc(src))
    assert_close(model.decoder.layers[0](tgt, src), dec(tgt, src))


# ---------------------------------------------------------------- dropout
@pytest.mark.parametrize("norm_first", [True, False])
def test_dropout_random_in_training_deterministic_in_eval(norm_first):
    noisy = DecoderBlock(D, H, D_FF, dropout_p=0.3, norm_first=norm_first)
    clean = DecoderBlock(D, H, D_FF, dropout_p=0.0, norm_first=norm_first)
    clean.load_state_dict(noisy.state_dict())
    x, enc_out = torch.randn(B, T, D), torch.randn(B, T_SRC, D)
    noisy.train()
    assert not torch.equal(noisy(x, enc_out), noisy(x, enc_out))
    noisy.eval()
    assert torch.equal(noisy(x, enc_out), noisy(x, enc_out))
    assert_close(noisy(x, enc_out), clean(x, enc_out))


def test_eval_mode_parity_with_dropout():
    ours = EncoderBlock(D, H, D_FF, dropout_p=0.1, activation="relu").double().eval()
    theirs = torch_layer(ours, dropout=0.1).eval()
    x, pad = data(B, T, D), padding_mask([T, 3], T)
    with torch.no_grad():
        assert_close(ours(x, mask=pad), theirs(x, src_key_padding_mask=~pad[:, 0, 0]))


# ---------------------------------------------------------------- copy_block_to_torch errors
def test_copy_rejects_wrong_pairs():
    with pytest.raises(TypeError, match="expected"):
        copy_block_to_torch(EncoderBlock(D, H, D_FF), nn.TransformerDecoderLayer(D, H, D_FF))
    with pytest.raises(TypeError, match="expected"):
        copy_block_to_torch(nn.Linear(D, D), nn.TransformerEncoderLayer(D, H, D_FF))


@pytest.mark.parametrize(
    "theirs, match",
    [
        (
            dict(d_model=2 * D, nhead=H, dim_feedforward=D_FF),
            r"\(d_model, num_heads, d_ff\) differ",
        ),
        (dict(d_model=D, nhead=2, dim_feedforward=D_FF), r"differ: ours \(16, 4, 32\)"),
        (dict(d_model=D, nhead=H, dim_feedforward=D_FF, norm_first=False), "arrangements differ"),
        (dict(d_model=D, nhead=H, dim_feedforward=D_FF, activation="relu"), "activations differ"),
        (dict(d_model=D, nhead=H, dim_feedforward=D_FF, bias=False), "biases"),
        (dict(d_model=D, nhead=H, dim_feedforward=D_FF, layer_norm_eps=1e-6), "eps differs"),
    ],
)
def test_copy_rejects_mismatched_configurations(theirs, match):
    ours = EncoderBlock(D, H, D_FF, activation="gelu", norm_first=True)
    config = dict(activation="gelu", norm_first=True, batch_first=True) | theirs
    with pytest.raises(ValueError, match=match):
        copy_block_to_torch(ours, nn.TransformerEncoderLayer(**config))


def test_copy_rejects_approximate_gelu_against_exact():
    ours = EncoderBlock(D, H, D_FF, activation="gelu")
    theirs = nn.TransformerEncoderLayer(
        D, H, D_FF, activation=nn.GELU(approximate="tanh"), norm_first=True
    )
    with pytest.raises(ValueError, match="activations differ"):
        copy_block_to_torch(ours, theirs)
    ours.ffn[1] = nn.GELU(approximate="tanh")
    copy_block_to_torch(ours, theirs)  # same module type and variant: accepted


def test_copy_accepts_silu_as_the_function_and_matches():
    torch.manual_seed(0)
    ours = EncoderBlock(D, H, D_FF, activation="silu").double()
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.normal_(std=0.3)
    theirs = torch_layer(ours, activation=torch.nn.functional.silu)  # PyTorch keeps the function
    x = data(B, T, D)
    assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match="activations differ"):  # SiLU is not ReLU
        torch_layer(ours, activation=torch.nn.functional.relu)


def test_copy_names_a_function_activation_without_its_address():
    ours = EncoderBlock(D, H, D_FF, activation="gelu")
    theirs = nn.TransformerEncoderLayer(D, H, D_FF, activation="relu", norm_first=True)
    with pytest.raises(ValueError, match="theirs the function relu") as caught:
        copy_block_to_torch(ours, theirs)
    assert "0x" not in str(caught.value)


def test_copy_rejects_nonzero_norm_bias_into_biasless_norm():
    ours = EncoderBlock(D, H, D_FF, bias=False)
    theirs = nn.TransformerEncoderLayer(D, H, D_FF, norm_first=True, bias=False)
    copy_block_to_torch(ours, theirs)  # zero norm biases: fine
    with torch.no_grad():
        ours.norm1.bias.fill_(0.5)
    with torch.no_grad():
        theirs.self_attn.out_proj.weight.fill_(7.0)
    with pytest.raises(ValueError, match="norm1: theirs has no bias"):
        copy_block_to_torch(ours, theirs)
    assert (theirs.self_attn.out_proj.weight == 7.0).all()  # nothing was copied


def test_copy_norm_to_torch_values_and_refusals():
    ours = LayerNorm(D)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
    theirs = nn.LayerNorm(D)
    copy_norm_to_torch(ours, theirs)
    x = torch.randn(3, D)
    assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match="final norm: theirs has no bias"):
        copy_norm_to_torch(ours, nn.LayerNorm(D, bias=False), "final norm")
    with pytest.raises(ValueError, match="eps differs"):
        copy_norm_to_torch(ours, nn.LayerNorm(D, eps=1e-6))


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("shape", [(T, D), (B, T, D, 1), (D,), (B, T, D + 1)])
def test_encoder_bad_shapes(shape):
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model\) with d_model=16"):
        EncoderBlock(D, H, D_FF)(torch.randn(*shape))


def test_encoder_bad_types():
    block = EncoderBlock(D, H, D_FF)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        block([[0.0] * D])
    with pytest.raises(TypeError, match="floating-point"):
        block(torch.zeros(B, T, D, dtype=torch.long))


def test_encoder_mask_that_does_not_broadcast():
    block = EncoderBlock(D, H, D_FF)
    with pytest.raises(ValueError, match="does not broadcast"):
        block(torch.randn(B, T, D), mask=padding_mask([3, 3, 3], T))  # batch 3 vs 2
    with pytest.raises(ValueError, match="does not broadcast"):
        block(torch.randn(B, T, D), mask=causal_mask(T + 1))


@pytest.mark.parametrize(
    "x_shape, enc_shape, match",
    [
        ((T, D), (B, T_SRC, D), r"x must have shape"),
        ((B, T, D), (T_SRC, D), r"enc_out must have shape"),
        ((B, T, D), (B, T_SRC, 2 * D), r"enc_out must have shape .* got \(2, 7, 32\)"),
        ((B, T, D), (B + 1, T_SRC, D), "different batch sizes"),
    ],
)
def test_decoder_bad_shapes(x_shape, enc_shape, match):
    with pytest.raises(ValueError, match=match):
        DecoderBlock(D, H, D_FF)(torch.randn(*x_shape), torch.randn(*enc_shape))


def test_decoder_masks_that_do_not_broadcast():
    block = DecoderBlock(D, H, D_FF)
    x, enc_out = torch.randn(B, T, D), torch.randn(B, T_SRC, D)
    with pytest.raises(ValueError, match="does not broadcast"):
        block(x, enc_out, self_mask=causal_mask(T_SRC))
    with pytest.raises(ValueError, match="does not broadcast"):
        block(x, enc_out, cross_mask=padding_mask([2, 2], T))  # built for the target length


@pytest.mark.parametrize("cls", [EncoderBlock, DecoderBlock])
def test_bad_constructor_arguments(cls):
    with pytest.raises(TypeError, match="norm_first must be a bool"):
        cls(D, H, D_FF, norm_first="yes")
    with pytest.raises(ValueError, match="not divisible"):
        cls(D, 3, D_FF)
    with pytest.raises(ValueError, match="d_ff must be at least 1"):
        cls(D, H, 0)
    with pytest.raises(ValueError, match="unknown activation"):
        cls(D, H, D_FF, activation="tanh")
    with pytest.raises(ValueError, match="dropout_p"):
        cls(D, H, D_FF, dropout_p=1.0)
