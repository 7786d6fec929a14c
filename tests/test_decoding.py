"""Unit tests of transformer_from_scratch.decoding (greedy, the shared loop and checks: notebook 11;
the rest: notebook 12), on tiny random models."""

import dataclasses
import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from transformer_from_scratch.decoding import AttentionCache
from transformer_from_scratch.decoding import Generation
from transformer_from_scratch.decoding import KVCache
from transformer_from_scratch.decoding import beam_search
from transformer_from_scratch.decoding import check_generation_inputs
from transformer_from_scratch.decoding import cross_attention_weights
from transformer_from_scratch.decoding import eval_mode
from transformer_from_scratch.decoding import generate
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.decoding import length_penalty_wu
from transformer_from_scratch.decoding import next_token_logits
from transformer_from_scratch.decoding import next_token_probs
from transformer_from_scratch.decoding import sample
from transformer_from_scratch.decoding import sequence_log_prob
from transformer_from_scratch.layers import DecoderBlock
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD

VOCAB = 11


def tiny_model(seed: int = 0, num_layers: int = 2, max_len: int = 64) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(
        VOCAB, VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=num_layers, max_len=max_len
    )
    return model.eval()


def padded_batch(B: int, S: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of random lengths 1..S (the first of full length), PAD-padded, and their mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    lengths[0] = S
    src = torch.randint(3, VOCAB, (B, S), generator=gen)
    src = src.masked_fill(torch.arange(S) >= lengths[:, None], PAD)
    return src, padding_mask(lengths, S)


def set_eos_bias(model: Transformer, value: float) -> Transformer:
    with torch.no_grad():
        model.out_proj.bias[EOS] = value
    return model


def check_format(tokens: torch.Tensor, max_new_tokens: int) -> None:
    """BOS first, at most one EOS per row, only PAD after it, no longer than allowed."""
    assert tokens.dtype == torch.long and tokens.size(1) <= max_new_tokens + 1
    assert (tokens[:, 0] == BOS).all()
    is_eos = (tokens == EOS).long()
    assert (is_eos.sum(1) <= 1).all()
    after = (is_eos.cumsum(1) - is_eos) > 0
    assert (tokens[after] == PAD).all()


# ------------------------------------------------------------------ greedy decoding (notebook 11)
@torch.no_grad()
def greedy_reference(model, src, max_new_tokens, src_mask=None):
    """The simplest greedy loop: the whole prefix every step, and a check after every step."""
    was_training = model.training
    model.eval()
    enc_out = model.encode(src, src_mask=src_mask)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long)
    finished = torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(max_new_tokens):
        dec_out = model.decode(ys, enc_out, self_mask=causal_mask(ys.size(1)), cross_mask=src_mask)
        token = model.out_proj(dec_out[:, -1]).argmax(-1).masked_fill(finished, PAD)
        ys = torch.cat([ys, token[:, None]], dim=1)
        finished |= token == EOS
        if finished.all():
            break
    model.train(was_training)
    return ys


def eos_steps(tokens: torch.Tensor) -> list[int]:
    """The column of each row's EOS (None for a row without one)."""
    return [int(row.nonzero()[0]) if row.any() else None for row in tokens == EOS]


# (seed, EOS bias) that make rows end: never; all at the first step; all before the check at
# step 8 (the final cut matters); the last one exactly at step 8; some after it; some never.
# Each case asserts that it is what it says, so that it cannot pass vacuously.
GREEDY_CASES = [
    ("never ends", 0, -math.inf),
    ("never ends", 3, -math.inf),
    ("all end at once", 1, 1e4),
    ("all end before step 8", 0, 2.0),
    ("all end before step 8", 2, 1.5),
    ("the last ends at step 8", 1, 2.5),
    ("some end after step 8", 0, 1.5),
    ("some end after step 8", 2, 1.0),
    ("some end after step 8", 4, 2.0),
    ("some never end", 1, 1.5),
]


@pytest.mark.parametrize(("case", "seed", "bias"), GREEDY_CASES)
def test_greedy_equals_a_per_step_reference_loop(case, seed, bias):
    n = 40
    model = set_eos_bias(tiny_model(seed), bias)
    src, mask = padded_batch(12, 6, seed)
    out = greedy_decode(model, src, max_new_tokens=n, src_mask=mask).tokens
    reference = greedy_reference(model, src, n, src_mask=mask)
    assert out.shape == reference.shape and torch.equal(out, reference)
    check_format(out, n)
    ends = eos_steps(out)
    if case == "never ends":
        assert ends == [None] * 12 and out.shape == (12, n + 1)
    elif case == "some never end":
        assert None in ends and ends != [None] * 12 and out.shape == (12, n + 1)
    elif case == "all end at once":
        assert torch.equal(out, torch.tensor([[BOS, EOS]] * 12))
    else:
        assert None not in ends and out.size(1) == max(ends) + 1 < n + 1
        last = {"all end before step 8": max(ends) < 8, "the last ends at step 8": max(ends) == 8}
        assert last.get(case, max(ends) > 8)


def test_greedy_gives_pad_after_eos_and_each_row_what_it_gets_alone():
    model = set_eos_bias(tiny_model(11), 1.5)  # some rows end early, some never
    src, mask = padded_batch(12, 6, 11)
    out = greedy_decode(model, src, max_new_tokens=40, src_mask=mask).tokens
    ended = (out == EOS).any(1)
    assert 0 < int(ended.sum()) < 12, "the test needs rows that end and rows that do not"
    check_format(out, 40)
    for b in range(12):
        alone = greedy_decode(model, src[b : b + 1], max_new_tokens=40, src_mask=mask[b : b + 1])
        alone = alone.tokens
        width = alone.size(1)
        assert torch.equal(out[b, :width], alone[0])
        assert (out[b, width:] == PAD).all()


class CountingDecodes(nn.Module):
    """A model that counts its decoder calls (the steps greedy decoding ran)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model, self.calls = model, 0
        self.out_proj, self.max_len = model.out_proj, model.max_len

    def encode(self, *args, **kwargs):
        return self.model.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.calls += 1
        return self.model.decode(*args, **kwargs)


def test_greedy_stops_early_checking_every_8_steps():
    counting = CountingDecodes(set_eos_bias(tiny_model(), 1e4))  # every row ends at step 1
    src, mask = padded_batch(4, 5)
    out = greedy_decode(counting, src, max_new_tokens=50, src_mask=mask).tokens
    assert out.shape == (4, 2) and counting.calls == 8  # not 50: it stopped at the first check
    counting = CountingDecodes(set_eos_bias(tiny_model(), -math.inf))  # no row ever ends
    out = greedy_decode(counting, src, max_new_tokens=13, src_mask=mask).tokens
    assert out.shape == (4, 14) and counting.calls == 13


def test_greedy_restores_the_training_mode_and_ignores_dropout():
    model = tiny_model(3)
    model.train()
    src, mask = padded_batch(2, 5, 3)
    first = greedy_decode(model, src, max_new_tokens=12, src_mask=mask).tokens
    assert model.training
    again = greedy_decode(model.eval(), src, max_new_tokens=12, src_mask=mask).tokens
    assert torch.equal(first, again)
    assert not model.training


def test_greedy_allows_max_new_tokens_up_to_the_positional_table():
    model = set_eos_bias(tiny_model(max_len=10), -math.inf)
    src, mask = padded_batch(2, 4)
    out = greedy_decode(model, src, max_new_tokens=10, src_mask=mask)  # positions 0..9
    assert out.tokens.shape == (2, 11)
    with pytest.raises(ValueError, match="max_new_tokens=11 is more than the model's max_len=10"):
        greedy_decode(model, src, max_new_tokens=11, src_mask=mask)


class ListCache:
    """The smallest cache the modules accept (notebooks 03, 08, 10): keys and values in lists."""

    class Attention:
        def __init__(self, frozen_after_first: bool):
            self.frozen_after_first, self.frozen = frozen_after_first, False
            self.keys = self.values = None

        def update(self, K, V):
            if self.keys is not None:
                K, V = torch.cat([self.keys, K], dim=2), torch.cat([self.values, V], dim=2)
            self.keys, self.values = K, V
            self.frozen = self.frozen_after_first  # cross-attention: the source's keys, once
            return K, V

    class Block:
        def __init__(self):
            self.self_attn, self.cross_attn = ListCache.Attention(False), ListCache.Attention(True)

    def __init__(self, num_layers: int):
        self.blocks = [ListCache.Block() for _ in range(num_layers)]

    def layer(self, i: int):
        return self.blocks[i]

    @property
    def length(self) -> int:  # positions decoded so far
        keys = self.blocks[0].self_attn.keys
        return 0 if keys is None else keys.size(2)


@pytest.mark.parametrize("bias", [-math.inf, 1.5])
def test_greedy_with_a_cache_feeds_one_token_per_step_and_gives_the_same_tokens(bias):
    model = set_eos_bias(tiny_model(5, num_layers=2), bias)
    src, mask = padded_batch(6, 7, 5)
    cache = ListCache(num_layers=2)
    out = greedy_decode(model, src, max_new_tokens=20, src_mask=mask, cache=cache).tokens
    plain = greedy_decode(model, src, max_new_tokens=20, src_mask=mask).tokens  # the default
    assert torch.equal(out, plain)
    assert torch.equal(out, greedy_reference(model, src, 20, mask))
    steps = 20 if bias == -math.inf else 8 * math.ceil(max(eos_steps(out)) / 8)
    assert cache.length == min(steps, 20)  # one position per step, the newest token only
    with pytest.raises(ValueError, match="cache must be empty"):
        greedy_decode(model, src, max_new_tokens=20, src_mask=mask, cache=cache)  # a used one


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("model", "src", 5), TypeError, "model must be an nn.Module"),
        ((None, "list", 5), TypeError, "src must be a torch.Tensor"),
        ((None, "1-D", 5), ValueError, "src must be 2-D"),
        ((None, "float", 5), TypeError, "src must hold integers"),
        ((None, "src", 0), ValueError, "max_new_tokens must be at least 1"),
        ((None, "src", 2.0), TypeError, "max_new_tokens must be an int"),
        ((None, "src", True), TypeError, "max_new_tokens must be an int"),
        ((None, "src", 65), ValueError, "more than the model's max_len=64"),
        ((None, "src", 5, "wide mask"), ValueError, r"src_mask of shape \(2, 1, 1, 9\)"),
        ((None, "src", 5, "list mask"), TypeError, "src_mask must be a torch.Tensor"),
        ((None, "out of vocabulary", 5), ValueError, "src"),
    ],
)
def test_greedy_bad_input(args, error, match):
    model = tiny_model()
    src, mask = padded_batch(2, 4)
    inputs = {
        "src": src,
        "list": src.tolist(),
        "1-D": src[0],
        "float": src.float(),
        "out of vocabulary": torch.full_like(src, VOCAB + 3),
        "wide mask": padding_mask(torch.tensor([9, 9]), 9),
        "list mask": mask.tolist(),
    }
    m = model if args[0] is None else args[0]
    src_mask = inputs[args[3]] if len(args) > 3 else mask
    with pytest.raises(error, match=match):
        greedy_decode(m, inputs[args[1]], max_new_tokens=args[2], src_mask=src_mask)


# ------------------------------------------------------------------ the cache
@pytest.mark.parametrize(
    "B, S, n, seed, num_layers",
    [(1, 1, 1, 0, 1), (1, 5, 30, 1, 2), (3, 7, 40, 2, 3), (8, 6, 17, 3, 2), (32, 9, 25, 4, 1)],
)
def test_cache_gives_the_same_tokens(B, S, n, seed, num_layers):
    model = tiny_model(seed, num_layers)
    src, mask = padded_batch(B, S, seed)
    plain = greedy_decode(model, src, max_new_tokens=n, src_mask=mask)
    cached = greedy_decode(model, src, max_new_tokens=n, src_mask=mask, use_cache=True)
    assert torch.equal(plain.tokens, cached.tokens)
    assert_close(plain.log_probs, cached.log_probs, atol=1e-4, rtol=1e-4)
    check_format(plain.tokens, n)
    own = greedy_decode(model, src, max_new_tokens=n, src_mask=mask, cache=KVCache())
    assert torch.equal(own.tokens, plain.tokens)
    no_mask = greedy_decode(model, src, max_new_tokens=n, use_cache=True)  # without a mask, too
    assert torch.equal(no_mask.tokens, greedy_decode(model, src, max_new_tokens=n).tokens)


def test_cache_follows_post_norm_blocks_too():
    """The cached step wires the sub-layers through the blocks' own sublayer_connection."""
    model = tiny_model(12)
    torch.manual_seed(12)
    model.decoder.layers = nn.ModuleList(
        DecoderBlock(16, 2, 32, activation="relu", norm_first=False) for _ in range(2)
    )
    model.eval()
    src, mask = padded_batch(5, 6, 12)
    plain = greedy_decode(model, src, max_new_tokens=20, src_mask=mask)
    cached = greedy_decode(model, src, max_new_tokens=20, src_mask=mask, use_cache=True)
    assert torch.equal(plain.tokens, cached.tokens)


def test_cached_decode_logits_match_the_forward_pass():
    """Three positions in one cached call (causal mask), then one at a time: the same logits."""
    model = tiny_model(5)
    src, mask = padded_batch(4, 6, 5)
    tgt = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(0))
    tgt[:, 0] = BOS
    with torch.no_grad():
        full = model(src, tgt, src_mask=mask, tgt_mask=causal_mask(9))  # (B, T, V)
        enc_out = model.encode(src, src_mask=mask)
        cache = KVCache()
        parts = [model.decode(tgt[:, :3], enc_out, causal_mask(3), mask, cache=cache)]
        parts += [
            model.decode(tgt[:, t : t + 1], enc_out, None, mask, cache=cache) for t in range(3, 9)
        ]
        stepped = model.out_proj(torch.cat(parts, dim=1))
    assert cache.length == 9 and len(cache.layers) == 2
    assert_close(stepped, full, atol=1e-5, rtol=1e-5)


def test_cached_decode_past_max_len_and_without_a_mask_fail_clearly():
    model = tiny_model(5, max_len=8)
    src, mask = padded_batch(2, 4, 5)
    tgt = torch.full((2, 8), BOS)
    with torch.no_grad():
        enc_out = model.encode(src, src_mask=mask)
        cache = KVCache()
        model.decode(tgt[:, :1], enc_out, cross_mask=mask, cache=cache)
        with pytest.raises(ValueError, match="self_mask"):  # several new tokens, no causal mask
            model.decode(tgt[:, :3], enc_out, cross_mask=mask, cache=cache)
        after_one = torch.ones(7, 8, dtype=torch.bool).tril(diagonal=1)  # query i at position 1 + i
        model.decode(tgt[:, :7], enc_out, after_one, mask, cache=cache)
        assert cache.length == 8
        with pytest.raises(ValueError, match="max_len"):
            model.decode(tgt[:, :1], enc_out, cross_mask=mask, cache=cache)


def test_attention_cache_grows_in_place_and_equals_concatenation():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, t, 4, generator=gen) for t in (1, 5, 1, 30, 2)]
    cache = AttentionCache()
    assert cache.length == 0 and cache.keys is None and not cache.frozen
    capacities = []
    for chunk in chunks:
        K, V = cache.update(chunk, -chunk)
        capacities.append(cache.capacity)
    assert torch.equal(K, torch.cat(chunks, dim=2)) and torch.equal(V, -K)
    assert cache.length == 39 and cache.num_bytes() == 2 * 2 * 3 * 39 * 4 * 4
    assert capacities == [16, 16, 16, 74, 74]  # doubled (2 * 37) only when full
    assert cache.allocated_bytes() == 2 * 2 * 3 * 74 * 4 * 4  # the spare room counts here


def test_cross_attention_cache_is_filled_once():
    cache = AttentionCache(grows=False)
    K = torch.randn(2, 3, 5, 4)
    assert not cache.frozen and cache.capacity == 0 and cache.allocated_bytes() == 0
    assert cache.update(K, K + 1)[0] is K and cache.frozen
    assert cache.capacity == 5
    assert cache.allocated_bytes() == cache.num_bytes() == 2 * 2 * 3 * 5 * 4 * 4
    with pytest.raises(RuntimeError, match="filled once"):
        cache.update(K, K)


def test_kv_cache_layers_bytes_and_reorder():
    model = tiny_model(0, num_layers=3)
    src, mask = padded_batch(4, 5)
    cache = KVCache()
    assert cache.length == 0 and cache.num_bytes() == 0
    with torch.no_grad():
        enc_out = model.encode(src, src_mask=mask)
        model.decode(torch.full((4, 1), BOS), enc_out, cross_mask=mask, cache=cache)
        model.decode(torch.full((4, 1), 5), enc_out, cross_mask=mask, cache=cache)
    assert len(cache.layers) == 3 and cache.length == 2
    layer = cache.layer(1)
    assert layer.self_attn.keys.shape == (4, 2, 2, 8) and layer.cross_attn.keys.shape == (
        4,
        2,
        5,
        8,
    )
    assert cache.num_bytes() == 2 * 3 * 4 * 16 * (2 + 5) * 4  # float32
    self_before, cross_before = layer.self_attn.keys.clone(), layer.cross_attn.values.clone()
    cache.reorder(torch.tensor([3, 3, 0, 1]))
    assert torch.equal(layer.self_attn.keys, self_before[[3, 3, 0, 1]])
    assert torch.equal(layer.cross_attn.values, cross_before[[3, 3, 0, 1]])
    assert layer.cross_attn.frozen and cache.length == 2


def test_eos_at_the_first_step_and_never():
    src, mask = padded_batch(3, 4)
    always = set_eos_bias(tiny_model(), 1e4)
    out = greedy_decode(always, src, max_new_tokens=10, src_mask=mask).tokens
    assert torch.equal(out, torch.tensor([[BOS, EOS]] * 3))
    never = set_eos_bias(tiny_model(), -math.inf)
    out = greedy_decode(never, src, max_new_tokens=10, src_mask=mask, use_cache=True).tokens
    assert out.shape == (3, 11) and not (out == EOS).any()


# ------------------------------------------------------------------ beam search
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_of_one_is_greedy(seed, alpha):
    model = tiny_model(seed)
    src, mask = padded_batch(6, 7, seed)
    greedy = greedy_decode(model, src, max_new_tokens=20, src_mask=mask)
    beam = beam_search(
        model, src, max_new_tokens=20, src_mask=mask, beam_size=1, length_penalty=alpha
    )
    assert torch.equal(beam.tokens, greedy.tokens)
    log_p = sequence_log_prob(model, src, greedy.tokens, mask)
    assert_close(beam.log_probs, log_p, atol=1e-4, rtol=1e-4)
    assert_close(greedy.log_probs, log_p, atol=1e-4, rtol=1e-4)


def test_beam_scores_are_the_log_probs_of_its_outputs():
    model = tiny_model(4)
    src, mask = padded_batch(5, 6, 4)
    beam = beam_search(
        model, src, max_new_tokens=15, src_mask=mask, beam_size=3, length_penalty=0.6
    )
    check_format(beam.tokens, 15)
    log_p = sequence_log_prob(model, src, beam.tokens, mask)
    assert_close(beam.log_probs, log_p, atol=1e-4, rtol=1e-4)


def test_a_full_width_beam_finds_the_best_short_output():
    """With k = V and two steps the search is exhaustive: compare with brute force."""
    model = tiny_model(6)
    src, mask = padded_batch(3, 5, 6)
    beam = beam_search(
        model, src, max_new_tokens=2, src_mask=mask, beam_size=VOCAB, length_penalty=0
    )
    tokens, log_p = beam.tokens, beam.log_probs
    for b in range(3):
        candidates = [[BOS, EOS]]
        for y1, y2 in itertools.product(range(VOCAB), repeat=2):
            if y1 != EOS:
                candidates.append([BOS, y1, y2])
        ids = torch.tensor([c + [PAD] * (3 - len(c)) for c in candidates])  # (n, 3)
        scores = sequence_log_prob(
            model,
            src[b : b + 1].expand(len(ids), -1),
            ids,
            mask[b : b + 1].expand(len(ids), -1, -1, -1),
        )
        best = int(scores.argmax())
        assert_close(log_p[b], scores[best], atol=1e-4, rtol=1e-4)
        assert torch.equal(tokens[b, : len(candidates[best])], torch.tensor(candidates[best]))


def test_length_penalty_wu():
    assert length_penalty_wu(1, 0.6) == 1.0  # (5 + 1) / 6 = 1
    assert length_penalty_wu(7, 0.0) == 1.0
    assert math.isclose(length_penalty_wu(7, 0.6), 2.0**0.6)


# ------------------------------------------------------------------ sampling
def test_next_token_probs_temperature_and_top_k():
    logits = torch.tensor([[2.0, 0.5, -1.0, 3.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    assert_close(next_token_probs(logits), F.softmax(logits, -1))
    assert_close(next_token_probs(logits, 0.5), F.softmax(logits / 0.5, -1))
    top2 = next_token_probs(logits, top_k=2)
    assert ((top2 > 0).sum(-1) == 2).all()
    assert_close(top2.sum(-1), torch.ones(2))
    assert torch.equal(next_token_probs(logits, 1e-6).argmax(-1), logits.argmax(-1))
    assert_close(next_token_probs(logits, top_k=1), F.one_hot(logits.argmax(-1), 5).float())
    assert_close(next_token_probs(logits, top_k=99), F.softmax(logits, -1))  # k >= V: all kept


def test_top_1_and_cold_sampling_are_greedy():
    model = tiny_model(7)
    src, mask = padded_batch(5, 6, 7)
    greedy = greedy_decode(model, src, max_new_tokens=20, src_mask=mask)
    top_1 = sample(model, src, max_new_tokens=20, src_mask=mask, top_k=1)
    assert torch.equal(top_1.tokens, greedy.tokens)
    assert_close(top_1.log_probs, greedy.log_probs)  # the model's log p, not the top-1 one's (0)
    gen = torch.Generator().manual_seed(0)
    cold = sample(model, src, max_new_tokens=20, src_mask=mask, temperature=1e-4, generator=gen)
    assert torch.equal(cold.tokens, greedy.tokens)


def test_sampling_is_deterministic_with_a_generator():
    model = set_eos_bias(tiny_model(8), -5.0)  # long outputs, so that draws can differ
    src, mask = padded_batch(4, 6, 8)

    def draw(seed, use_cache=True, **kwargs):
        gen = torch.Generator().manual_seed(seed)
        return sample(
            model,
            src,
            max_new_tokens=30,
            src_mask=mask,
            use_cache=use_cache,
            generator=gen,
            **kwargs,
        ).tokens

    first = draw(0)
    check_format(first, 30)
    assert torch.equal(first, draw(0)) and torch.equal(first, draw(0, use_cache=False))
    assert not torch.equal(first, draw(1))
    assert torch.equal(draw(3, temperature=2.0, top_k=3), draw(3, temperature=2.0, top_k=3))


def test_sample_draws_with_the_frequencies_of_next_token_probs():
    model = tiny_model(9)
    src, mask = padded_batch(1, 6, 9)
    copies = 8000
    first = sample(
        model,
        src.expand(copies, -1),
        max_new_tokens=1,
        src_mask=mask.expand(copies, -1, -1, -1),
        temperature=2.0,
        top_k=4,
        generator=torch.Generator().manual_seed(0),
    ).tokens[:, 1]
    with torch.no_grad():
        logits = model(src, torch.full((1, 1), BOS), src_mask=mask)[0, -1]
    expected = next_token_probs(logits, temperature=2.0, top_k=4)
    frequencies = first.bincount(minlength=VOCAB) / copies
    assert_close(frequencies, expected, atol=0.025, rtol=0)  # > 4 standard deviations
    assert (frequencies[expected == 0] == 0).all()


# ------------------------------------------------------------------ cross-attention weights
def test_cross_attention_weights():
    model = tiny_model(9, num_layers=3)
    src, mask = padded_batch(4, 6, 9)
    tgt = greedy_decode(model, src, max_new_tokens=7, src_mask=mask, use_cache=True).tokens
    weights = cross_attention_weights(model, src, tgt, mask)
    assert len(weights) == 3
    for w in weights:
        assert w.shape == (4, 2, tgt.size(1), 6)
        assert_close(w.sum(-1), torch.ones(4, 2, tgt.size(1)))
        assert (w.masked_select(~mask) == 0).all()
    assert all(not block.cross_attn._forward_hooks for block in model.decoder.layers)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("n", [0, -1, 65])
def test_bad_max_new_tokens(n):
    model = tiny_model()  # max_len = 64
    src, mask = padded_batch(2, 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_decode(model, src, max_new_tokens=n, src_mask=mask)
    with pytest.raises(ValueError, match="max_new_tokens"):
        beam_search(model, src, max_new_tokens=n, src_mask=mask, beam_size=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample(model, src, max_new_tokens=n, src_mask=mask)


def test_bad_src():
    model = tiny_model()
    with pytest.raises(ValueError, match="src"):
        greedy_decode(model, torch.tensor([3, 4, 5]), max_new_tokens=5)  # (T,), not (B, T)
    with pytest.raises(ValueError, match="src"):
        beam_search(model, torch.ones(1, 2, 3, dtype=torch.long), max_new_tokens=5, beam_size=2)
    with pytest.raises(ValueError, match="src"):
        sample(model, torch.tensor([[3, 99]]), max_new_tokens=5)  # id outside the vocabulary
    with pytest.raises(TypeError, match="src"):
        sample(model, [[3, 4]], max_new_tokens=5)  # a list, not a tensor
    with pytest.raises(TypeError, match="src"):
        greedy_decode(model, torch.ones(2, 3), max_new_tokens=5)  # floats are not token ids
    with pytest.raises(ValueError, match="src_mask"):
        greedy_decode(
            model,
            torch.full((2, 3), 4),
            max_new_tokens=5,
            src_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool),
        )


@pytest.mark.parametrize(
    "k, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_bad_beam_size(k, error):
    with pytest.raises(error, match="beam_size"):
        beam_search(tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, beam_size=k)


def test_bad_length_penalty():
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(
            tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, beam_size=2, length_penalty=-0.5
        )
    with pytest.raises(TypeError, match="length_penalty"):
        beam_search(
            tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, beam_size=2, length_penalty="0.6"
        )


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.inf, math.nan])
def test_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sample(tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        next_token_probs(torch.zeros(3), temperature)
    with pytest.raises(TypeError, match="temperature"):
        next_token_probs(torch.zeros(3), "hot")


@pytest.mark.parametrize("top_k, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError)])
def test_bad_top_k(top_k, error):
    with pytest.raises(error, match="top_k"):
        sample(tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, top_k=top_k)


def test_bad_tokens_for_sequence_log_prob():
    model = tiny_model()
    src = torch.full((2, 3), 4)
    with pytest.raises(ValueError, match="tokens"):
        sequence_log_prob(model, src, torch.full((2, 1), BOS))  # BOS alone predicts nothing
    with pytest.raises(ValueError, match="tokens"):
        sequence_log_prob(model, src, torch.full((3, 4), 5))  # batch sizes differ


# ------------------------------------------------------------------ one shape for all strategies
STRATEGIES = {
    "greedy": (greedy_decode, {}),
    "beam": (beam_search, {"beam_size": 3}),
    "sample": (sample, {"generator": None, "temperature": 1.5, "top_k": 4}),
}


def run(name: str, model, src, **kwargs) -> Generation:
    strategy, knobs = STRATEGIES[name]
    seed = kwargs.pop("seed", 0)  # the sampling generator's
    if name == "sample":
        knobs = {**knobs, "generator": torch.Generator().manual_seed(seed)}
    return strategy(model, src, **knobs, **kwargs)


@pytest.mark.parametrize("name", STRATEGIES)
def test_everything_after_src_is_keyword_only(name):
    strategy, _ = STRATEGIES[name]
    params = list(inspect.signature(strategy).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "src"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:2])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:])
    shared = [(p.name, p.default) for p in params[2:6]]  # the same names, in the same order
    use_cache = name == "beam"  # beam search caches by default; greedy and sampling do not
    assert shared == [
        ("max_new_tokens", inspect.Parameter.empty),
        ("src_mask", None),
        ("use_cache", use_cache),
        ("cache", None),
    ]
    model, (src, mask) = tiny_model(), padded_batch(2, 4)
    with pytest.raises(TypeError, match="positional"):
        strategy(model, src, 5)  # max_new_tokens by position
    with pytest.raises(TypeError, match="positional"):
        strategy(model, src, 5, mask)
    if name == "beam":
        with pytest.raises(TypeError, match="positional"):
            beam_search(model, src, 20, 5)  # the old order: 20 beams for 5 tokens
        with pytest.raises(TypeError, match="beam_size"):
            beam_search(model, src, max_new_tokens=5)  # no default: you choose k


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("bias", [-math.inf, 1.5])  # rows never end; some end and get PAD
def test_every_strategy_returns_a_generation(name, bias):
    model = set_eos_bias(tiny_model(2), bias)
    src, mask = padded_batch(5, 6, 2)
    out = run(name, model, src, max_new_tokens=12, src_mask=mask)
    assert type(out) is Generation
    assert [f.name for f in dataclasses.fields(out)] == ["tokens", "log_probs"]
    check_format(out.tokens, 12)
    assert out.tokens.shape[0] == 5 and out.tokens.dtype == torch.long
    assert out.log_probs.shape == (5,) and out.log_probs.dtype == torch.float32
    assert (out.log_probs <= 0).all() and out.log_probs.isfinite().all()
    if bias == -math.inf:
        assert out.tokens.shape == (5, 13) and not (out.tokens == EOS).any()
    else:
        assert (out.tokens == EOS).any()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.tokens = out.tokens[:, :1]


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize(("seed", "bias"), [(0, -math.inf), (1, 1.5), (2, 1.0), (4, 2.0)])
def test_log_probs_are_the_models_log_probability_of_the_tokens(name, seed, bias):
    """Greedy's and sampling's running sums (at temperature 1, whatever the sampling knobs) and
    beam search's scores before the length penalty: what sequence_log_prob computes."""
    model = set_eos_bias(tiny_model(seed), bias)
    src, mask = padded_batch(8, 6, seed)
    out = run(name, model, src, max_new_tokens=20, src_mask=mask)
    expected = sequence_log_prob(model, src, out.tokens, mask)
    assert_close(out.log_probs, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out.log_probs, torch.zeros(8))  # not vacuous


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", STRATEGIES)
def test_use_cache_gives_exactly_the_same_tokens(name, seed):
    model = set_eos_bias(tiny_model(seed, num_layers=3), 0.5)
    src, mask = padded_batch(7, 6, seed)
    plain = run(name, model, src, max_new_tokens=25, src_mask=mask, use_cache=False, seed=seed)
    cached = run(name, model, src, max_new_tokens=25, src_mask=mask, use_cache=True, seed=seed)
    own = KVCache()
    given = run(name, model, src, max_new_tokens=25, src_mask=mask, cache=own, seed=seed)
    assert torch.equal(plain.tokens, cached.tokens) and torch.equal(plain.tokens, given.tokens)
    assert_close(plain.log_probs, cached.log_probs, atol=1e-5, rtol=1e-5)
    assert own.length > 0  # the cache that was passed is the one that was used
    if name == "sample":  # another seed draws other tokens: the comparison can fail
        other = run(name, model, src, max_new_tokens=25, src_mask=mask, seed=seed + 10)
        assert not torch.equal(other.tokens, plain.tokens)


def test_a_cache_implies_use_cache():
    """Passing a cache object is enough: it is used even with greedy's default use_cache=False."""
    model = set_eos_bias(tiny_model(3), -math.inf)
    src, mask = padded_batch(3, 4, 3)
    cache = KVCache()
    out = greedy_decode(model, src, max_new_tokens=6, src_mask=mask, use_cache=False, cache=cache)
    assert cache.length == 6 and out.tokens.shape == (3, 7)
    beam_cache = KVCache()
    beam_search(model, src, max_new_tokens=6, use_cache=False, cache=beam_cache, beam_size=2)
    assert beam_cache.length == 6


@pytest.mark.parametrize("name", STRATEGIES)
def test_cache_errors(name):
    model = tiny_model()
    src, mask = padded_batch(2, 4)
    used = KVCache()
    run(name, model, src, max_new_tokens=3, src_mask=mask, cache=used)
    with pytest.raises(ValueError, match="cache must be empty"):
        run(name, model, src, max_new_tokens=3, src_mask=mask, cache=used)
    with pytest.raises(TypeError, match="cache must be a decoding cache"):
        run(name, model, src, max_new_tokens=3, src_mask=mask, cache={"keys": None})
    with pytest.raises(TypeError, match="use_cache must be a bool"):
        run(name, model, src, max_new_tokens=3, src_mask=mask, use_cache="yes")


def test_beam_search_needs_a_cache_that_can_reorder():
    model = tiny_model()
    src, mask = padded_batch(2, 4)
    with pytest.raises(TypeError, match="reorder"):
        beam_search(model, src, max_new_tokens=3, cache=ListCache(num_layers=2), beam_size=2)


@pytest.mark.parametrize("generator", [0, "seed", torch.Generator().manual_seed(0).get_state()])
def test_sample_bad_generator(generator):
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sample(tiny_model(), torch.full((1, 3), 4), max_new_tokens=5, generator=generator)


# ------------------------------------------------------------------ the shared parts
def test_generate_runs_any_rule_and_counts_its_log_probability():
    model = set_eos_bias(tiny_model(5), -math.inf)
    src, mask = padded_batch(4, 5, 5)

    def third_best(logits):  # a rule no strategy uses: the third most likely token
        return logits.topk(3, dim=-1).indices[:, 2]

    out = generate(model, src, max_new_tokens=9, src_mask=mask, choose=third_best)
    assert out.tokens.shape == (4, 10)
    assert_close(out.log_probs, sequence_log_prob(model, src, out.tokens, mask))
    cached = generate(
        model, src, max_new_tokens=9, src_mask=mask, use_cache=True, choose=third_best
    )
    assert torch.equal(cached.tokens, out.tokens)
    with pytest.raises(TypeError, match="choose"):
        generate(model, src, max_new_tokens=9)  # a rule is required
    model.train()
    eos_at_once = generate(
        model,
        src,
        max_new_tokens=9,
        choose=lambda z: torch.full_like(z[:, 0], EOS, dtype=torch.long),
    )
    assert torch.equal(eos_at_once.tokens, torch.tensor([[BOS, EOS]] * 4)) and model.training


def test_next_token_logits_with_and_without_a_cache():
    model = tiny_model(6)
    src, mask = padded_batch(3, 5, 6)
    tgt = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = BOS
    with torch.no_grad():
        full = model(src, tgt, src_mask=mask, tgt_mask=causal_mask(6))  # (B, T, V)
        enc_out = model.encode(src, src_mask=mask)
        cache = KVCache()
        for t in range(1, 7):
            plain = next_token_logits(model, tgt[:, :t], enc_out, mask)
            stepped = next_token_logits(model, tgt[:, :t], enc_out, mask, cache=cache)
            assert_close(plain, full[:, t - 1], atol=1e-5, rtol=1e-5)
            assert_close(stepped, full[:, t - 1], atol=1e-5, rtol=1e-5)
    assert cache.length == 6


def test_check_generation_inputs_returns_the_cache_to_use():
    model, (src, mask) = tiny_model(), padded_batch(2, 4)
    kwargs = {"max_new_tokens": 4, "src_mask": mask}
    assert check_generation_inputs(model, src, **kwargs) is None
    made = check_generation_inputs(model, src, **kwargs, use_cache=True)
    assert isinstance(made, KVCache) and made.length == 0
    given = KVCache()
    assert check_generation_inputs(model, src, **kwargs, cache=given) is given
    with pytest.raises(TypeError, match="positional"):
        check_generation_inputs(model, src, 4)


class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.frozen = nn.Dropout(0.5), nn.Dropout(0.5)


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_restores_every_modules_mode_even_after_an_error(training):
    model = Flaky().train(training)
    model.frozen.eval()  # a submodule in another mode than its parent
    with eval_mode(model) as inside:
        assert inside is model and not any(m.training for m in model.modules())
    assert model.training == training and model.body.training == training
    assert not model.frozen.training
    with pytest.raises(RuntimeError, match="boom"), eval_mode(model):
        raise RuntimeError("boom")
    assert model.training == training and not model.frozen.training


class RecordingDecodes(CountingDecodes):
    """A model that records the width of every decoder input and whether a cache came with it."""

    def __init__(self, model: Transformer):
        super().__init__(model)
        self.inputs: list[tuple[int, bool]] = []

    def decode(self, tgt, *args, cache=None, **kwargs):
        self.inputs.append((tgt.size(1), cache is not None))
        return super().decode(tgt, *args, cache=cache, **kwargs)


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("use_cache", [True, False])
def test_use_cache_feeds_the_newest_token_only(name, use_cache):
    recording = RecordingDecodes(set_eos_bias(tiny_model(1), -math.inf))  # all 7 steps run
    src, mask = padded_batch(3, 4, 1)
    run(name, recording, src, max_new_tokens=7, src_mask=mask, use_cache=use_cache)
    if use_cache:
        assert recording.inputs == [(1, True)] * 7
    else:
        assert recording.inputs == [(t, False) for t in range(1, 8)]  # the whole prefix each time
