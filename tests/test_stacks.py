"""Tests for the Encoder and Decoder stacks of notebook 10 (transformer_from_scratch.layers)."""

import inspect

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.layers import Decoder
from transformer_from_scratch.layers import DecoderBlock
from transformer_from_scratch.layers import Encoder
from transformer_from_scratch.layers import EncoderBlock
from transformer_from_scratch.layers import LayerNorm
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.reference import copy_block_to_torch
from transformer_from_scratch.reference import torch_parameter

B, T_SRC, T_TGT, D, H, D_FF, N = 2, 7, 5, 32, 4, 64, 3


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("cls, block", [(Encoder, EncoderBlock), (Decoder, DecoderBlock)])
def test_layers_are_a_module_list_of_blocks_with_a_final_norm(cls, block, num_params):
    stack = cls(N, D, H, D_FF)
    assert isinstance(stack.layers, nn.ModuleList) and len(stack.layers) == N
    assert all(type(layer) is block for layer in stack.layers)
    assert isinstance(stack.norm, LayerNorm) and stack.norm.d_model == D
    assert len({id(layer) for layer in stack.layers}) == N  # separate blocks, separate weights
    assert num_params(stack) == N * num_params(block(D, H, D_FF)) + 2 * D


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_defaults_relu_and_no_dropout(cls):
    stack = cls(2, D, H, D_FF)
    for layer in stack.layers:
        assert type(layer.ffn[1]) is nn.ReLU
        assert layer.dropout1.p == 0.0 and layer.self_attn.dropout_p == 0.0
        assert layer.norm_first and layer.ffn[0].bias is not None
    gelu = cls(2, D, H, D_FF, dropout_p=0.1, activation="gelu")
    assert all(type(layer.ffn[1]) is nn.GELU and layer.dropout1.p == 0.1 for layer in gelu.layers)


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_a_stack_and_its_block_agree_on_defaults(cls):
    """Encoder(N, d, h, d_ff).layers[0] is EncoderBlock(d, h, d_ff): same settings, same repr.

    The stack declares no settings of its own (it passes **settings to its blocks), so the two
    cannot drift apart; a setting the block does not know is the block's TypeError."""
    stack_params = inspect.signature(cls.__init__).parameters
    settings = ("dropout_p", "activation", "bias", "norm_first", "fast")
    assert not set(settings) & set(stack_params)
    assert set(settings) <= set(inspect.signature(cls.block.__init__).parameters)
    assert repr(cls(1, D, H, D_FF).layers[0]) == repr(cls.block(D, H, D_FF))
    for fast in (False, True):  # the final norm follows the blocks' fast path
        assert cls(1, D, H, D_FF, fast=fast).norm.fast is fast
    with pytest.raises(TypeError, match="dropout"):
        cls(1, D, H, D_FF, dropout=0.1)  # a misspelt setting is not silently dropped


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_a_stack_passes_every_setting_to_its_blocks(cls):
    stack = cls(2, D, H, D_FF, dropout_p=0.2, activation="silu", bias=False, norm_first=False)
    for layer in stack.layers:
        assert layer.dropout1.p == 0.2 and layer.self_attn.dropout_p == 0.2
        assert type(layer.ffn[1]) is nn.SiLU and not layer.norm_first
        assert layer.ffn[0].bias is None and layer.self_attn.W_q.bias is None


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_state_dict_names_and_dtype_moves(cls):
    stack = cls(2, D, H, D_FF)
    keys = stack.state_dict().keys()
    assert "layers.0.self_attn.W_q.weight" in keys and "layers.1.ffn.2.bias" in keys
    assert "norm.weight" in keys and "norm.bias" in keys
    stack = stack.double()
    assert {p.dtype for p in stack.parameters()} == {torch.float64}


@pytest.mark.parametrize("cls", [Encoder, Decoder])
@pytest.mark.parametrize("bad", [0, -1])
def test_num_layers_must_be_positive(cls, bad):
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        cls(bad, D, H, D_FF)


@pytest.mark.parametrize("cls", [Encoder, Decoder])
@pytest.mark.parametrize("bad", [2.0, True, "2"])
def test_num_layers_must_be_an_int(cls, bad):
    with pytest.raises(TypeError, match="num_layers must be an int"):
        cls(bad, D, H, D_FF)


def test_block_arguments_are_checked_by_the_blocks():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        Encoder(2, 30, 4, D_FF)
    with pytest.raises(ValueError, match="unknown activation"):
        Decoder(2, D, H, D_FF, activation="tanh")


# ---------------------------------------------------------------- forward
def test_encoder_is_its_blocks_in_order_then_the_norm():
    enc = Encoder(N, D, H, D_FF, dropout_p=0.0)
    x = torch.randn(B, T_SRC, D)
    mask = padding_mask(torch.tensor([7, 4]), T_SRC)
    out = enc(x, mask=mask)
    assert out.shape == (B, T_SRC, D)
    h = x
    for layer in enc.layers:
        h = layer(h, mask=mask)
    assert_close(out, enc.norm(h))


def test_decoder_is_its_blocks_in_order_then_the_norm():
    dec = Decoder(N, D, H, D_FF, dropout_p=0.0)
    x, enc_out = torch.randn(B, T_TGT, D), torch.randn(B, T_SRC, D)
    self_mask, cross_mask = causal_mask(T_TGT), padding_mask(torch.tensor([7, 4]), T_SRC)
    out = dec(x, enc_out, self_mask=self_mask, cross_mask=cross_mask)
    assert out.shape == (B, T_TGT, D)
    h = x
    for layer in dec.layers:
        h = layer(h, enc_out, self_mask=self_mask, cross_mask=cross_mask)
    assert_close(out, dec.norm(h))


def test_every_decoder_block_reads_the_same_enc_out():
    dec = Decoder(N, D, H, D_FF, dropout_p=0.0)
    x, enc_out = torch.randn(B, T_TGT, D), torch.randn(B, T_SRC, D)
    seen = []
    hooks = [
        layer.cross_attn.register_forward_hook(lambda m, args, out: seen.append(args[1]))
        for layer in dec.layers
    ]
    dec(x, enc_out)
    for hook in hooks:
        hook.remove()
    assert len(seen) == N and all(s is enc_out for s in seen)


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_final_norm_normalises_the_output(cls):
    stack = cls(N, D, H, D_FF, dropout_p=0.0)
    x = 5 * torch.randn(B, T_TGT, D) + 3
    out = stack(x) if cls is Encoder else stack(x, torch.randn(B, T_SRC, D))
    assert_close(out.mean(-1), torch.zeros(B, T_TGT), atol=1e-5, rtol=0)
    assert_close(out.var(-1, unbiased=False), torch.ones(B, T_TGT), atol=1e-3, rtol=0)


def test_stack_masks_hide_padding_and_future():
    enc = Encoder(2, D, H, D_FF, dropout_p=0.0)
    x = torch.randn(B, T_SRC, D)
    mask = padding_mask(torch.tensor([7, 4]), T_SRC)
    changed = x.clone()
    changed[1, 4:] = torch.randn(3, D)
    assert_close(enc(x, mask)[1, :4], enc(changed, mask)[1, :4])

    dec = Decoder(2, D, H, D_FF, dropout_p=0.0)
    y, enc_out = torch.randn(B, T_TGT, D), torch.randn(B, T_SRC, D)
    future = y.clone()
    future[:, 3:] = torch.randn(B, T_TGT - 3, D)
    causal = causal_mask(T_TGT)
    assert_close(dec(y, enc_out, causal)[:, :3], dec(future, enc_out, causal)[:, :3])


def test_dropout_train_and_eval():
    enc = Encoder(2, D, H, D_FF, dropout_p=0.3)
    x = torch.randn(B, T_SRC, D)
    assert not torch.equal(enc(x), enc(x))
    enc.eval()
    assert torch.equal(enc(x), enc(x))


def test_gradients_reach_every_block():
    dec = Decoder(N, D, H, D_FF, dropout_p=0.0)
    x = torch.randn(B, T_TGT, D, requires_grad=True)
    enc_out = torch.randn(B, T_SRC, D, requires_grad=True)
    dec(x, enc_out, causal_mask(T_TGT)).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in dec.parameters())
    assert x.grad.abs().sum() > 0 and enc_out.grad.abs().sum() > 0


@pytest.mark.parametrize("cls", [Encoder, Decoder])
def test_bad_input_is_reported_by_the_first_block(cls):
    stack = cls(2, D, H, D_FF)
    with pytest.raises(ValueError, match="d_model=32"):
        if cls is Encoder:
            stack(torch.randn(B, T_SRC, D + 1))
        else:
            stack(torch.randn(B, T_TGT, D + 1), torch.randn(B, T_SRC, D))
    with pytest.raises(ValueError, match="does not broadcast"):
        if cls is Encoder:
            stack(torch.randn(B, T_SRC, D), padding_mask(torch.tensor([3, 3]), T_SRC - 1))
        else:
            stack(torch.randn(B, T_TGT, D), torch.randn(B, T_SRC, D), causal_mask(T_TGT + 1))


def test_decoder_batch_mismatch():
    dec = Decoder(2, D, H, D_FF)
    with pytest.raises(ValueError, match="different batch sizes"):
        dec(torch.randn(B, T_TGT, D), torch.randn(B + 1, T_SRC, D))


# ---------------------------------------------------------------- parity with PyTorch's stacks
def torch_gradient(theirs: nn.Module, name: str) -> torch.Tensor:
    """The gradient in PyTorch's stack of the rows that hold our parameter `name`."""
    param, rows = torch_parameter(theirs, name)
    return param.grad[rows]


def copy_stack(ours, theirs) -> None:
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        copy_block_to_torch(a, b)
    theirs.norm.load_state_dict(ours.norm.state_dict())


def config(activation="relu"):
    return dict(
        d_model=D,
        nhead=H,
        dim_feedforward=D_FF,
        dropout=0.0,
        activation=activation,
        batch_first=True,
        norm_first=True,
    )


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_parity_with_nn_transformer_encoder(activation, randomize_vectors):
    # float64 on both sides: the comparison is about the function, not about rounding orders
    ours = Encoder(N, D, H, D_FF, dropout_p=0.0, activation=activation).double()
    randomize_vectors(ours)
    theirs = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(**config(activation)),
        N,
        norm=nn.LayerNorm(D),
        enable_nested_tensor=False,
    ).double()
    copy_stack(ours, theirs)
    mask = padding_mask(torch.tensor([7, 3]), T_SRC)
    x = torch.randn(B, T_SRC, D, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(B, T_SRC, D, dtype=torch.float64)
    ya = ours(xa, mask=mask)
    yb = theirs(xb, src_key_padding_mask=~mask[:, 0, 0])
    assert_close(ya, yb)
    (ya * upstream).sum().backward()
    (yb * upstream).sum().backward()
    assert_close(xa.grad, xb.grad)
    for name, p in ours.named_parameters():
        assert_close(p.grad, torch_gradient(theirs, name), msg=name)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_parity_with_nn_transformer_decoder(
    activation, randomize_vectors, assert_decoder_parity
):
    ours = Decoder(N, D, H, D_FF, dropout_p=0.0, activation=activation).double()
    randomize_vectors(ours)
    theirs = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(**config(activation)), N, norm=nn.LayerNorm(D)
    ).double()
    copy_stack(ours, theirs)
    assert_decoder_parity(ours, theirs, [5, 3], [7, 4], D)


def test_parity_in_eval_mode_with_dropout():
    ours = Encoder(2, D, H, D_FF, dropout_p=0.2).double().eval()
    layer = nn.TransformerEncoderLayer(**{**config(), "dropout": 0.2})
    theirs = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D), enable_nested_tensor=False)
    theirs = theirs.double()
    copy_stack(ours, theirs)
    theirs.eval()
    x = torch.randn(B, T_SRC, D, dtype=torch.float64)
    with torch.no_grad():
        assert_close(ours(x), theirs(x))


def test_the_cache_protocols_describe_notebook_12s_caches():
    from transformer_from_scratch.attention import KeyValueCache
    from transformer_from_scratch.decoding import AttentionCache
    from transformer_from_scratch.decoding import KVCache
    from transformer_from_scratch.layers import BlockCache
    from transformer_from_scratch.layers import DecoderCache

    cache = KVCache()
    assert isinstance(cache, DecoderCache) and isinstance(cache.layer(0), BlockCache)
    assert isinstance(cache.layer(0).self_attn, KeyValueCache)
    assert isinstance(AttentionCache(grows=False), KeyValueCache)
    for not_a_cache in (object(), {"length": 0}, cache.layer(0)):
        assert not isinstance(not_a_cache, DecoderCache)
    assert not isinstance(object(), KeyValueCache) and not isinstance(cache, BlockCache)


def test_a_cache_written_to_the_protocol_decodes_like_kvcache():
    """Any object with the protocols' members serves: here a minimal, list-based one."""
    import torch

    from transformer_from_scratch.decoding import greedy_decode
    from transformer_from_scratch.model import Transformer

    class ListCache:  # KeyValueCache
        def __init__(self, frozen_after_first: bool):
            self.frozen_after_first, self.keys, self.values = frozen_after_first, None, None

        @property
        def frozen(self):
            return self.frozen_after_first and self.keys is not None

        def update(self, K, V):
            if self.keys is not None:
                K, V = torch.cat([self.keys, K], dim=2), torch.cat([self.values, V], dim=2)
            self.keys, self.values = K, V
            return K, V

    class Layer:  # BlockCache
        def __init__(self):
            self.self_attn, self.cross_attn = ListCache(False), ListCache(True)

    class Cache:  # DecoderCache
        def __init__(self):
            self.layers = {}

        @property
        def length(self):
            first = self.layers.get(0)
            return (
                0 if first is None or first.self_attn.keys is None else first.self_attn.keys.size(2)
            )

        def layer(self, i):
            return self.layers.setdefault(i, Layer())

    torch.manual_seed(0)
    model = Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, dropout_p=0.0).eval()
    src = torch.randint(3, 12, (3, 6), generator=torch.Generator().manual_seed(1))
    ours = greedy_decode(model, src, max_new_tokens=7, cache=Cache()).tokens
    assert torch.equal(ours, greedy_decode(model, src, max_new_tokens=7).tokens)
