"""Tests for the model module of notebooks 09 and 10 (transformer_from_scratch.model)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import transformer_from_scratch as tfs
from transformer_from_scratch.layers import Decoder
from transformer_from_scratch.layers import Encoder
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.model import TransformerConfig
from transformer_from_scratch.model import embed_tokens
from transformer_from_scratch.model import init_token_embedding
from transformer_from_scratch.model import make_masks
from transformer_from_scratch.positional import PositionalEncoding
from transformer_from_scratch.reference import TorchTransformer
from transformer_from_scratch.reference import torch_parameter
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.tokens import check_token_ids

V = 12


def small_model(dropout_p: float = 0.0, **kw) -> Transformer:
    cfg = dict(d_model=32, num_heads=4, d_ff=64, num_layers=2, dropout_p=dropout_p, max_len=64)
    cfg.update(kw)
    return Transformer(V, V + 3, **cfg)


def reversal_batch():
    """A padded batch: src (2, 7), tgt_in/tgt_out (2, 8), with their lengths and masks."""
    src = torch.tensor([[5, 9, 3, 11, 7, PAD, PAD], [8, 3, 6, 11, 9, 5, 10]])
    tgt_in = torch.tensor([[BOS, 7, 11, 3, 9, 5, PAD, PAD], [BOS, 10, 5, 9, 11, 6, 3, 8]])
    tgt_out = torch.tensor([[7, 11, 3, 9, 5, EOS, PAD, PAD], [10, 5, 9, 11, 6, 3, 8, EOS]])
    src_len, tgt_len = (src != PAD).sum(1), (tgt_in != PAD).sum(1)
    src_mask = padding_mask(src_len, src.shape[1])
    tgt_mask = causal_mask(tgt_in.shape[1]) & padding_mask(tgt_len, tgt_in.shape[1])
    return src, tgt_in, tgt_out, src_len, tgt_len, src_mask, tgt_mask


# ---------------------------------------------------------------- special tokens
def test_special_tokens():
    assert (PAD, BOS, EOS) == (0, 1, 2)
    assert (tfs.PAD, tfs.BOS, tfs.EOS) == (0, 1, 2)
    assert tfs.Transformer is Transformer and tfs.Encoder is Encoder and tfs.Decoder is Decoder


# ---------------------------------------------------------------- init_token_embedding
def test_init_token_embedding_scale_and_pad_row():
    emb = nn.Embedding(20_000, 128, padding_idx=PAD)
    out = init_token_embedding(emb)
    assert out is emb
    assert torch.count_nonzero(emb.weight[PAD]) == 0
    assert abs(emb.weight[1:].std().item() - 128**-0.5) < 0.002
    assert abs(emb.weight[1:].mean().item()) < 0.002


def test_init_token_embedding_keeps_pad_without_gradient():
    emb = init_token_embedding(nn.Embedding(V, 16, padding_idx=PAD))
    emb(torch.tensor([[PAD, 4, PAD, 4]])).sum().backward()
    assert torch.count_nonzero(emb.weight.grad[PAD]) == 0
    assert_close(emb.weight.grad[4], torch.full((16,), 2.0))


def test_init_token_embedding_without_padding_idx_zeroes_nothing():
    emb = init_token_embedding(nn.Embedding(V, 16))
    assert torch.count_nonzero(emb.weight[PAD]) == 16


def test_init_token_embedding_type_error():
    with pytest.raises(TypeError, match="nn.Embedding"):
        init_token_embedding(nn.Linear(4, 4))


def test_scaled_embedding_is_comparable_to_the_positional_encoding():
    for d in (64, 256):
        emb = init_token_embedding(nn.Embedding(2000, d, padding_idx=PAD))
        token = (emb.weight[1:] * math.sqrt(d)).norm(dim=1).mean().item()
        pe = PositionalEncoding(d, max_len=100).pe[0].norm(dim=1)
        assert_close(pe, torch.full_like(pe, math.sqrt(d / 2)))
        assert 1.2 < token / math.sqrt(d / 2) < 1.65  # about sqrt(2)


# ---------------------------------------------------------------- check_token_ids, embed_tokens
def test_embed_tokens_values_and_gradient():
    emb = init_token_embedding(nn.Embedding(V, 16, padding_idx=PAD))
    ids = torch.tensor([[3, 4, PAD], [11, 1, 2]])
    x = embed_tokens(emb, ids)
    assert x.shape == (2, 3, 16)
    assert_close(x, emb.weight[ids] * 4.0)
    assert (x[0, 2] == 0).all()
    x.sum().backward()
    assert torch.count_nonzero(emb.weight.grad[PAD]) == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_check_token_ids_accepts_embedding_index_dtypes(dtype):
    check_token_ids(torch.tensor([[0, 11]], dtype=dtype), V)
    emb = nn.Embedding(V, 4)
    assert embed_tokens(emb, torch.tensor([[0, 11]], dtype=dtype)).shape == (1, 2, 4)


def test_check_token_ids_allows_an_empty_batch():
    check_token_ids(torch.zeros(0, 5, dtype=torch.long), V)


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([[3, 12]]), r"token id 12 at position \(0, 1\), outside \[0, 12\)"),
        (torch.tensor([[-1, 4]]), r"token id -1 at position \(0, 0\)"),
        (torch.tensor([3, 4]), r"shape \(B, T\)"),
        (torch.tensor([[[3]]]), r"shape \(B, T\)"),
        (torch.zeros(2, 0, dtype=torch.long), r"T >= 1"),
    ],
)
def test_check_token_ids_value_errors(ids, match):
    with pytest.raises(ValueError, match=match):
        check_token_ids(ids, V, "src")


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([[3.0, 4.0]]),
        torch.tensor([[True]]),
        torch.tensor([[3]], dtype=torch.uint8),
        [[3]],
    ],
)
def test_check_token_ids_type_errors(bad):
    with pytest.raises(TypeError, match="src"):
        check_token_ids(bad, V, "src")


# ---------------------------------------------------------------- construction and counting
def part_formulas(d, d_ff, n, v_src, v_tgt) -> dict:
    attn, ffn, norm = 4 * d * d + 4 * d, 2 * d * d_ff + d_ff + d, 2 * d
    return {
        "src_embed": v_src * d,
        "tgt_embed": v_tgt * d,
        "pos": 0,
        "encoder": n * (attn + ffn + 2 * norm) + norm,
        "decoder": n * (2 * attn + ffn + 3 * norm) + norm,
        "out_proj": d * v_tgt + v_tgt,
    }


def test_tutorial_configuration_has_930828_parameters(num_params):
    model = Transformer(V, V)
    assert num_params(model) == 930_828
    expected = part_formulas(128, 512, 2, V, V)
    for name, value in expected.items():
        assert num_params(getattr(model, name)) == value, name
    assert sum(expected.values()) == 930_828
    assert expected["encoder"] == 396_800 and expected["decoder"] == 529_408


def test_parameter_breakdown_inside_the_stacks(num_params):
    model = Transformer(V, V)
    d, dff = 128, 512
    for block in model.encoder.layers:
        assert num_params(block.self_attn) == 4 * d * d + 4 * d
        assert num_params(block.ffn) == 2 * d * dff + dff + d
        assert num_params(block.norm1) + num_params(block.norm2) == 4 * d
    for block in model.decoder.layers:
        assert num_params(block.self_attn) == num_params(block.cross_attn) == 4 * d * d + 4 * d
        assert num_params(block.ffn) == 2 * d * dff + dff + d
    assert num_params(model.encoder.norm) == num_params(model.decoder.norm) == 2 * d


def test_other_configuration_counts(num_params):
    model = Transformer(30, 17, d_model=64, num_heads=8, d_ff=96, num_layers=3, max_len=40)
    assert num_params(model) == sum(part_formulas(64, 96, 3, 30, 17).values())


def test_attributes_defaults_and_config(num_params):
    model = Transformer(V, V + 5)
    assert isinstance(model.src_embed, nn.Embedding) and model.src_embed.padding_idx == PAD
    assert isinstance(model.tgt_embed, nn.Embedding) and model.tgt_embed.num_embeddings == V + 5
    assert isinstance(model.pos, PositionalEncoding) and model.pos.pe.shape == (1, 512, 128)
    assert isinstance(model.encoder, Encoder) and isinstance(model.decoder, Decoder)
    assert len(model.encoder.layers) == len(model.decoder.layers) == 2
    assert model.out_proj.in_features == 128 and model.out_proj.out_features == V + 5
    assert model.pos.dropout.p == 0.1 and model.encoder.layers[0].dropout1.p == 0.1
    assert type(model.encoder.layers[0].ffn[1]) is nn.ReLU
    assert isinstance(model.config, TransformerConfig) and model.config.tgt_vocab_size == V + 5
    rebuilt = Transformer.from_config(model.config)
    assert rebuilt.config == model.config
    assert rebuilt.load_state_dict(model.state_dict()) is not None
    assert Transformer(**dataclasses.asdict(model.config)).config == model.config
    assert num_params(rebuilt) == num_params(model)


def test_the_config_reaches_every_block():
    model = small_model(norm_first=False, activation="gelu", bias=False, dropout_p=0.2)
    blocks = [*model.encoder.layers, *model.decoder.layers]
    assert all(not b.norm_first and type(b.ffn[1]) is nn.GELU for b in blocks)
    assert all(b.ffn[0].bias is None and b.self_attn.W_o.bias is None for b in blocks)
    assert all(b.dropout1.p == 0.2 and b.self_attn.dropout_p == 0.2 for b in blocks)
    assert model.pos.dropout.p == 0.2
    assert TorchTransformer(model).transformer.encoder.layers[0].norm_first is False


def test_one_constructor_path_config_or_fields():
    config = TransformerConfig(V, V + 3, d_model=32, num_heads=4, d_ff=64, norm_first=False)
    torch.manual_seed(0)
    a = Transformer(config)
    torch.manual_seed(0)
    b = Transformer(V, V + 3, d_model=32, num_heads=4, d_ff=64, norm_first=False)
    torch.manual_seed(0)
    c = Transformer.from_config(config)
    assert a.config == b.config == c.config == config
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(),
                               c.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(x, y) and torch.equal(x, z), name
    # the sizes are read from the config, not kept a second time
    assert (a.d_model, a.num_heads, a.max_len) == (32, 4, 512)
    assert "d_model" not in vars(a) and "max_len" not in vars(a)
    with pytest.raises(TypeError, match="not both"):
        Transformer(config, V)
    with pytest.raises(TypeError, match="not both"):
        Transformer(config, d_model=64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'd_modle'"):
        Transformer(V, V, d_modle=64)
    with pytest.raises(TypeError, match="expected a TransformerConfig"):
        Transformer.from_config(dataclasses.asdict(config))


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("activation", "tanh", ValueError, "unknown activation 'tanh'"),
        ("activation", "ReLU", ValueError, "did you mean 'relu'"),
        ("norm_first", 1, TypeError, "norm_first must be a bool"),
        ("bias", "yes", TypeError, "bias must be a bool"),
    ],
)
def test_config_rejects_bad_block_settings(field, value, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(V, V, **{field: value})


def test_a_bad_config_is_refused_before_any_parameter_is_made():
    from torch.nn.modules.module import register_module_parameter_registration_hook

    created = []
    hook = register_module_parameter_registration_hook(lambda m, name, p: created.append(name))
    try:
        for kwargs in (dict(d_model=130, num_heads=4), dict(activation="tanh"), dict(d_modle=64)):
            with pytest.raises((ValueError, TypeError)):
                Transformer(V, V, **kwargs)
        assert created == []
        good = Transformer(V, V, d_model=32, num_heads=4, d_ff=64)
    finally:
        hook.remove()
    assert len(created) == len(list(good.parameters())) > 0


def test_the_config_routes_give_the_same_logits_and_the_settings_matter():
    fields = dict(d_model=32, num_heads=4, d_ff=64, activation="gelu", norm_first=False)
    torch.manual_seed(0)
    a = Transformer(V, V, **fields).eval()
    torch.manual_seed(0)
    b = Transformer.from_config(a.config).eval()
    defaults = Transformer(V, V, d_model=32, num_heads=4, d_ff=64).eval()  # relu, pre-norm
    defaults.load_state_dict(a.state_dict())
    src = torch.tensor([[5, 6, 7, 8]])
    tgt = torch.tensor([[BOS, 8, 7, 6, 5]])
    with torch.no_grad():
        logits_a = a(src, tgt, *make_masks(src, tgt))
        assert torch.equal(b(src, tgt, *make_masks(src, tgt)), logits_a)
        assert not torch.allclose(defaults(src, tgt, *make_masks(src, tgt)), logits_a, atol=1e-2)


def test_pe_is_a_buffer_not_a_parameter():
    model = Transformer(V, V)
    assert "pos.pe" in model.state_dict()
    assert all(p is not model.pos.pe for p in model.parameters())


def test_model_embeddings_are_initialised():
    model = Transformer(V, V)
    for emb in (model.src_embed, model.tgt_embed):
        assert torch.count_nonzero(emb.weight[PAD]) == 0
        assert 0.05 < emb.weight[1:].std().item() < 0.13  # 128^-0.5 = 0.088, 11 x 128 samples


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(src_vocab_size=2, tgt_vocab_size=V), ValueError, "src_vocab_size must be at least 4"),
        (dict(src_vocab_size=V, tgt_vocab_size=0), ValueError, "tgt_vocab_size must be at least 4"),
        (dict(src_vocab_size=12.0, tgt_vocab_size=V), TypeError, "src_vocab_size must be an int"),
        (dict(src_vocab_size=V, tgt_vocab_size=V, d_model=0), ValueError, "d_model"),
        (dict(src_vocab_size=V, tgt_vocab_size=V, max_len=0), ValueError, "max_len"),
        (dict(src_vocab_size=V, tgt_vocab_size=V, num_layers=0), ValueError, "num_layers"),
        (dict(src_vocab_size=V, tgt_vocab_size=V, num_heads=3), ValueError, "num_heads"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Transformer(**kwargs)


# ---------------------------------------------------------------- forward, encode, decode
def test_forward_shape_and_encode_decode_consistency():
    model = small_model().eval()
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    logits = model(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
    assert logits.shape == (2, 8, V + 3)
    enc_out = model.encode(src, src_mask)
    assert enc_out.shape == (2, 7, 32)
    dec_out = model.decode(tgt_in, enc_out, self_mask=tgt_mask, cross_mask=src_mask)
    assert dec_out.shape == (2, 8, 32)
    assert torch.equal(model.out_proj(dec_out), logits)


def test_encode_is_embed_scale_position_then_encoder():
    model = small_model().eval()
    src, *_, src_mask, _ = reversal_batch()
    x = model.src_embed(src) * math.sqrt(32) + model.pos.pe[:, : src.shape[1]]
    assert_close(model.encode(src, src_mask), model.encoder(x, mask=src_mask))


def test_dropout_only_in_training():
    model = small_model(dropout_p=0.2)
    src, tgt_in, *_ = reversal_batch()
    assert not torch.equal(model(src, tgt_in), model(src, tgt_in))
    model.eval()
    assert torch.equal(model(src, tgt_in), model(src, tgt_in))


def test_causal_and_padding_masks_hold_through_the_model():
    model = small_model().eval()
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    logits = model(src, tgt_in, src_mask, tgt_mask)
    future = tgt_in.clone()
    future[:, 4:] = 7
    assert_close(model(src, future, src_mask, tgt_mask)[:, :4], logits[:, :4])
    repadded = src.clone()
    repadded[0, 5:] = 9  # the padding of sequence 0, masked by src_mask
    assert_close(model(repadded, tgt_in, src_mask, tgt_mask), logits)
    # Without the causal mask, position 0 sees later target tokens.
    no_mask = model(src, tgt_in, src_mask, None)
    assert not torch.allclose(model(src, future, src_mask, None)[:, 0], no_mask[:, 0])


def test_loss_at_initialisation_is_about_log_v():
    model = Transformer(V, V).eval()
    src, tgt_in, tgt_out, _, _, src_mask, tgt_mask = reversal_batch()
    logits = model(src, tgt_in, src_mask, tgt_mask)
    loss = F.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)
    assert abs(loss.item() - math.log(V)) < 0.5


def test_double_moves_parameters_and_buffer():
    model = small_model().double().eval()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.pos.pe.dtype == torch.float64
    src, tgt_in, *_ = reversal_batch()
    assert model(src, tgt_in).dtype == torch.float64


def test_meta_device_construction(num_params):
    with torch.device("meta"):
        model = Transformer(V, V)
    assert model.out_proj.weight.is_meta and num_params(model) == 930_828


# ---------------------------------------------------------------- parity with nn.Transformer
@pytest.mark.parametrize(
    "make",
    [
        small_model,
        lambda: Transformer(V, V, dropout_p=0.0),
        lambda: small_model(norm_first=False),  # the paper's post-norm, built by the constructor
        lambda: small_model(norm_first=False, activation="gelu", bias=False),
    ],
    ids=["small", "course", "post-norm", "post-norm-gelu-no-bias"],
)
def test_parity_with_nn_transformer_values_and_gradients(make):
    ours = make().double()  # float64: the comparison is about the function, not rounding orders
    with torch.no_grad():
        for name, p in ours.named_parameters():
            # nn.Transformer(bias=False) has no LayerNorm shifts either: ours stay at 0 there
            if p.dim() == 1 and (ours.config.bias or "norm" not in name):
                p.normal_(std=0.3)
    theirs = TorchTransformer(ours)
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    upstream = torch.randn(2, 8, ours.out_proj.out_features, dtype=torch.float64)

    logits = ours(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
    expected = theirs(src, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
    assert_close(logits, expected)
    (logits * upstream).sum().backward()
    (expected * upstream).sum().backward()
    for name, p in ours.named_parameters():
        if not ours.config.bias and "norm" in name and name.endswith(".bias"):
            continue  # nn.Transformer(bias=False) has no LayerNorm shift to compare with
        if name.startswith(("encoder", "decoder")):
            param, rows = torch_parameter(theirs.transformer, name)
            assert_close(p.grad, param.grad[rows], msg=name)
        else:
            assert_close(p.grad, theirs.get_parameter(name).grad, msg=name)


def test_parity_in_eval_mode_with_dropout():
    ours = small_model(dropout_p=0.1).double().eval()
    theirs = TorchTransformer(ours).eval()
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    with torch.no_grad():
        assert_close(ours(src, tgt_in, src_mask, tgt_mask), theirs(src, tgt_in, src_mask, tgt_mask))


# ---------------------------------------------------------------- bad input
def test_batch_sizes_differ():
    model = small_model()
    src, tgt_in, *_ = reversal_batch()
    with pytest.raises(ValueError, match=r"src \(2, 7\) and tgt \(1, 8\) have different batch"):
        model(src, tgt_in[:1])


@pytest.mark.parametrize(
    "which, value, match",
    [
        ("src", V, r"src holds token id 12"),
        ("src", -1, r"src holds token id -1"),
        ("tgt", V + 3, r"tgt holds token id 15 .* outside \[0, 15\)"),
        ("tgt", -2, r"tgt holds token id -2"),
    ],
)
def test_token_ids_out_of_range(which, value, match):
    model = small_model()
    src, tgt_in, *_ = reversal_batch()
    if which == "src":
        src = src.clone()
        src[1, 3] = value
    else:
        tgt_in = tgt_in.clone()
        tgt_in[0, 2] = value
    with pytest.raises(ValueError, match=match):
        model(src, tgt_in)


def test_token_ids_type_and_shape():
    model = small_model()
    src, tgt_in, *_ = reversal_batch()
    with pytest.raises(TypeError, match="src must hold integers"):
        model(src.float(), tgt_in)
    with pytest.raises(ValueError, match=r"tgt must have shape \(B, T\)"):
        model(src, tgt_in[0])
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        model.encode([[3, 4]])


def test_sequences_longer_than_max_len():
    model = small_model()  # max_len 64
    src, tgt_in, *_ = reversal_batch()
    with pytest.raises(ValueError, match="src has length 65, beyond the model's max_len=64"):
        model(torch.full((2, 65), 5), tgt_in)
    with pytest.raises(ValueError, match="tgt has length 70, beyond the model's max_len=64"):
        model(src, torch.full((2, 70), 5))
    model(torch.full((2, 64), 5), torch.full((2, 64), 5))  # exactly max_len is fine


def test_length_is_checked_before_the_embedding_lookup():
    model = small_model()  # max_len 64
    src, *_ = reversal_batch()
    lookups = []
    for embedding in (model.src_embed, model.tgt_embed):
        embedding.register_forward_hook(lambda module, args, out: lookups.append(module))
    with pytest.raises(ValueError, match="src has length 65"):
        model.encode(torch.full((2, 65), 5))
    enc_out = torch.zeros(2, 7, 32)
    with pytest.raises(ValueError, match="tgt has length 65"):
        model.decode(torch.full((2, 65), 5), enc_out)
    assert lookups == []


def test_wrong_mask_shapes():
    model = small_model()
    src, tgt_in, _, src_len, _, src_mask, tgt_mask = reversal_batch()
    with pytest.raises(ValueError, match=r"src_mask of shape \(2, 1, 1, 8\) does not broadcast"):
        model(src, tgt_in, src_mask=padding_mask(src_len, 8))
    with pytest.raises(ValueError, match=r"src_mask .* \(B, h, 1, T_src\).*padding_mask"):
        model(src, tgt_in, src_mask=src_mask & causal_mask(7))
    with pytest.raises(ValueError, match=r"src_mask of shape \(3, 1, 1, 7\)"):
        model(src, tgt_in, src_mask=padding_mask(torch.tensor([7, 7, 7]), 7))
    with pytest.raises(ValueError, match=r"tgt_mask of shape \(1, 1, 7, 7\) .* \(B, h, T_tgt"):
        model(src, tgt_in, src_mask, causal_mask(7))
    with pytest.raises(ValueError, match=r"src_mask of shape \(2, 1, 1, 6\) .* \(B, h, T, T\)"):
        model.encode(src, padding_mask(src_len.clamp(max=6), 6))
    enc_out = model.encode(src, src_mask)
    with pytest.raises(ValueError, match=r"self_mask of shape \(1, 1, 9, 9\)"):
        model.decode(tgt_in, enc_out, self_mask=causal_mask(9))
    with pytest.raises(ValueError, match=r"cross_mask of shape \(2, 1, 1, 8\)"):
        model.decode(tgt_in, enc_out, cross_mask=padding_mask(src_len, 8))
    with pytest.raises(TypeError, match="src_mask must be a torch.Tensor or None"):
        model(src, tgt_in, src_mask=[[True]])


def test_decode_enc_out_errors():
    model = small_model()
    src, tgt_in, *_ = reversal_batch()
    enc_out = model.encode(src)
    with pytest.raises(ValueError, match=r"tgt \(2, 8\) and enc_out \(1, 7, 32\) have different"):
        model.decode(tgt_in, enc_out[:1])
    with pytest.raises(ValueError, match=r"enc_out must be 3-D"):
        model.decode(tgt_in, enc_out[0])
    with pytest.raises(TypeError, match="enc_out must be a torch.Tensor"):
        model.decode(tgt_in, None)


# ---------------------------------------------------------------- masks from ids, causal guard
def test_make_masks_shapes_and_values():
    src, tgt_in, _, src_len, tgt_len, src_mask, tgt_mask = reversal_batch()
    got_src, got_tgt = make_masks(src, tgt_in)
    assert got_src.shape == (2, 1, 1, 7) and got_tgt.shape == (2, 1, 8, 8)
    assert got_src.dtype == got_tgt.dtype == torch.bool
    assert torch.equal(got_src, src_mask) and torch.equal(got_tgt, tgt_mask)
    # padding anywhere, not only at the end; another pad id
    ids = torch.tensor([[4, 0, 5]])
    s, t = make_masks(ids, ids)
    assert s[0, 0, 0].tolist() == [True, False, True]
    assert t[0, 0].tolist() == [[True, False, False], [True, False, False], [True, False, True]]
    s, _ = make_masks(ids, ids, pad=4)
    assert s[0, 0, 0].tolist() == [False, True, True]
    model = small_model().eval()
    with torch.no_grad():
        expected = model(src, tgt_in, src_mask, tgt_mask)
        assert_close(model(src, tgt_in, *make_masks(src, tgt_in)), expected)


def test_make_masks_bad_input():
    src, tgt_in, *_ = reversal_batch()
    with pytest.raises(TypeError, match="src must hold integers"):
        make_masks(src.float(), tgt_in)
    with pytest.raises(TypeError, match="tgt_in must hold integers"):
        make_masks(src, tgt_in == PAD)
    with pytest.raises(TypeError, match="tgt_in must be a torch.Tensor"):
        make_masks(src, tgt_in.tolist())
    with pytest.raises(ValueError, match=r"src must be 2-D, got shape \(7,\)"):
        make_masks(src[0], tgt_in)
    with pytest.raises(ValueError, match="tgt_in must be 2-D"):
        make_masks(src, tgt_in[None])
    with pytest.raises(ValueError, match=r"src \(2, 7\) and tgt_in \(1, 8\) have different batch"):
        make_masks(src, tgt_in[:1])
    with pytest.raises(TypeError, match="pad"):
        make_masks(src, tgt_in, pad=0.5)


def test_forward_refuses_a_non_causal_tgt_mask():
    model = small_model().eval()
    src, tgt_in, _, _, tgt_len, src_mask, tgt_mask = reversal_batch()
    T = tgt_in.shape[1]
    ar, strictly_lower = torch.arange(T), causal_mask(T)[0, 0].tril(-1)  # (T,), (T, T)
    not_causal = {
        "padding only": padding_mask(tgt_len, T),  # (B, 1, 1, T): the forgotten causal part
        "all ones": torch.ones(T, T, dtype=torch.bool),
        "one entry above the diagonal": causal_mask(T) | (ar[:, None] == 2) & (ar == 5),
    }
    for mask in not_causal.values():
        with pytest.raises(ValueError, match="tgt_mask lets a target position attend to later"):
            model(src, tgt_in, src_mask, mask)
    causal_float = torch.zeros(T, T).masked_fill(~causal_mask(T)[0, 0], -math.inf)
    not_minus_inf = {  # a float mask must hold -inf above the diagonal, whatever else it holds
        "float zeros": torch.zeros(1, 1, T, T),
        "float, upper part finite": torch.zeros(T, T).masked_fill(strictly_lower, -math.inf),
        "float, -1e9 above": torch.where(causal_mask(T), 0.0, -1e9),
        "float, one NaN above": causal_float.masked_fill((ar[:, None] == 2) & (ar == 5), math.nan),
    }
    minus_inf_only = (
        "tgt_mask holds values other than -inf above the diagonal, where a float mask must hold "
        "-inf, the one value that blocks a later key in every dtype and at any size of the scores"
    )
    for mask in not_minus_inf.values():
        with pytest.raises(ValueError, match=minus_inf_only):
            model(src, tgt_in, src_mask, mask)
    with torch.no_grad():
        expected = model(src, tgt_in, src_mask, causal_mask(T))
        for mask in (causal_mask(T), causal_mask(T)[0, 0], causal_float, tgt_mask):
            model(src, tgt_in, src_mask, mask)  # accepted
        assert_close(model(src, tgt_in, src_mask, causal_float), expected)
        one = torch.ones(1, 1, dtype=torch.bool)
        model(src, tgt_in[:, :1], src_mask, one)  # T = 1: there is no later key
        model(src, tgt_in, src_mask, None)  # no mask given: nothing to check (as nn.Transformer)
        with tfs.checks.validated():  # the callers' escape hatch: checks off
            model(src, tgt_in, src_mask, padding_mask(tgt_len, T))
        # decode (also the cached path) checks its masks' shapes and dtypes, not their
        # causality: with a cache it sees partial masks
        enc_out = model.encode(src, src_mask)
        model.decode(tgt_in, enc_out, self_mask=padding_mask(tgt_len, T), cross_mask=src_mask)


def test_block_settings_are_what_every_block_is_built_with():
    config = TransformerConfig(
        12, 12, d_model=16, num_heads=2, d_ff=32, num_layers=2, dropout_p=0.2,
        activation="gelu", bias=False, norm_first=False,
    )  # fmt: skip
    assert config.block_settings == dict(
        dropout_p=0.2, activation="gelu", bias=False, norm_first=False, fast=False
    )
    model = Transformer(config)
    for block in (*model.encoder.layers, *model.decoder.layers):
        assert block.dropout1.p == 0.2 and type(block.ffn[1]) is nn.GELU
        assert block.ffn[0].bias is None and block.norm_first is False


def test_entry_points_refuse_integer_masks():
    """encode/decode/forward run their layers inside validated(), which switches the attention's
    own dtype check off: so they check a mask's dtype themselves (an integer 0/1 mask would be
    added to the scores and mask nothing), and an integer causal mask is a TypeError, not 'lets a
    target position attend to later positions'. A float tgt_mask must hold -inf above the
    diagonal: -1e9 is refused by the course's rule, not because it leaks in float32."""
    model = small_model().eval()
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    dtype = r"must be bool \(True = may attend\) or floating \(added to the scores\), got dtype "
    dtype += "torch.int64"
    with pytest.raises(TypeError, match="src_mask " + dtype):
        model(src, tgt_in, src_mask.long(), tgt_mask)
    with pytest.raises(TypeError, match="tgt_mask " + dtype):
        model(src, tgt_in, src_mask, tgt_mask.long())
    with pytest.raises(TypeError, match="src_mask " + dtype):
        model.encode(src, src_mask.long())
    enc_out = model.encode(src, src_mask)
    with pytest.raises(TypeError, match="cross_mask " + dtype):
        model.decode(tgt_in, enc_out, tgt_mask, src_mask.long())
    with pytest.raises(TypeError, match="self_mask " + dtype):
        model.decode(tgt_in, enc_out, tgt_mask.long(), src_mask)
    minus_1e9 = torch.where(tgt_mask, 0.0, -1e9)
    with pytest.raises(ValueError, match="tgt_mask holds values other than -inf above the diagon"):
        model(src, tgt_in, src_mask, minus_1e9)
    with torch.no_grad():  # the same masks as bool, or as 0/-inf floats, are accepted and agree
        as_float = torch.zeros(tgt_mask.shape).masked_fill(~tgt_mask, -math.inf)
        assert_close(model(src, tgt_in, src_mask, as_float), model(src, tgt_in, src_mask, tgt_mask))


def test_why_a_float_tgt_mask_must_hold_minus_inf():
    """The rule is the course's, not a claim that -1e9 leaks: with the checks off, -1e9 above the
    diagonal gives the bool mask's logits in float32, while -10 lets later tokens in. Whether a
    finite value blocks depends on the dtype and on the size of the scores; -inf always blocks."""
    model = small_model().eval()
    src, tgt_in, _, _, _, src_mask, tgt_mask = reversal_batch()
    changed = tgt_in.clone()
    changed[:, 3] = 4  # a later target token
    with torch.no_grad(), tfs.checks.validated():
        expected = model(src, tgt_in, src_mask, tgt_mask)
        leak = {}
        for fill in (-10.0, -1e9):
            finite = torch.where(tgt_mask, 0.0, fill)
            got = model(src, tgt_in, src_mask, finite)
            leak[fill] = (model(src, changed, src_mask, finite) - got)[:, 0].abs().max().item()
            if fill == -1e9:
                assert_close(got, expected)
    assert leak[-1e9] == 0 and leak[-10.0] > 1e-6

    def later_weight(fill, gap, dtype):  # a later key masked with fill, `gap` above the allowed one
        scores = torch.tensor([0.0, gap]).to(dtype) + torch.tensor([0.0, fill]).to(dtype)
        return torch.softmax(scores, dim=-1)[1].item()

    assert later_weight(-50.0, 0.0, torch.float16) == 0  # e^-50 underflows in float16
    assert 0 < later_weight(-50.0, 0.0, torch.float32) < 1e-20  # but not in float32
    assert later_weight(-50.0, 50.0, torch.float32) == 0.5  # and a larger score undoes it
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert later_weight(-math.inf, 1e4, dtype) == 0
