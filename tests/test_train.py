"""Unit tests of transformer_from_scratch.train (notebook 11)."""

import collections
import contextlib
import dataclasses
import enum
import math
import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_from_scratch.data import make_batch
from transformer_from_scratch.decoding import greedy_decode
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.model import TransformerConfig
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.train import EVAL_SEED
from transformer_from_scratch.train import REVERSAL_RECIPE
from transformer_from_scratch.train import CheckpointError
from transformer_from_scratch.train import ReversalRecipe
from transformer_from_scratch.train import Trainer
from transformer_from_scratch.train import accumulate_gradients
from transformer_from_scratch.train import build_reversal_model
from transformer_from_scratch.train import exact_match
from transformer_from_scratch.train import get_reversal_model
from transformer_from_scratch.train import load_checkpoint
from transformer_from_scratch.train import lr_lambda
from transformer_from_scratch.train import num_tokens
from transformer_from_scratch.train import reversal_correct
from transformer_from_scratch.train import reversal_recipe
from transformer_from_scratch.train import save_checkpoint
from transformer_from_scratch.train import sequence_loss
from transformer_from_scratch.train import train_model
from transformer_from_scratch.train import train_reversal

TINY = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 1, "steps": 6, "batch_size": 8}


def tiny_model(seed=0, V=12, dropout_p=0.0):
    torch.manual_seed(seed)
    return Transformer(V, V, d_model=32, num_heads=2, d_ff=64, num_layers=1, dropout_p=dropout_p)


# ---------------------------------------------------------------- lr_lambda


def test_lr_lambda_formula_values():
    assert lr_lambda(1, 128, 400) == pytest.approx(128**-0.5 * 400**-1.5, rel=1e-12)
    assert lr_lambda(1000, 128, 400) == pytest.approx(128**-0.5 * 1000**-0.5, rel=1e-12)
    assert lr_lambda(200, 512, 4000) == pytest.approx(512**-0.5 * 200 * 4000**-1.5, rel=1e-12)
    # The tutorial's printed rate at step 1000 (after sched.step()): 2.80e-03.
    assert f"{lr_lambda(1000, 128, 400):.2e}" == "2.80e-03"


def test_lr_lambda_step_zero_is_clamped():
    assert lr_lambda(0, 128, 400) == lr_lambda(1, 128, 400) > 0


@pytest.mark.parametrize(("d_model", "warmup"), [(128, 400), (512, 4000), (64, 7)])
def test_lr_lambda_peak_at_warmup(d_model, warmup):
    rates = [lr_lambda(s, d_model, warmup) for s in range(0, 5 * warmup)]
    assert max(range(len(rates)), key=rates.__getitem__) == warmup
    assert max(rates) == pytest.approx((d_model * warmup) ** -0.5, rel=1e-12)
    assert rates[4 * warmup] == pytest.approx(max(rates) / 2, rel=1e-12)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((-1, 128, 400), ValueError, "step must be at least 0"),
        ((1.5, 128, 400), TypeError, "step must be an int"),
        ((True, 128, 400), TypeError, "step must be an int"),
        ((1, 0, 400), ValueError, "d_model must be > 0"),
        ((1, 128, -4), ValueError, "warmup must be > 0"),
        ((1, "128", 400), TypeError, "d_model must be a number"),
    ],
)
def test_lr_lambda_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        lr_lambda(*args)


# ---------------------------------------------------------------- the loss and the loop


def test_sequence_loss_ignores_pad_and_matches_manual():
    model = tiny_model().eval()
    batch = make_batch(16, 8, 12, torch.Generator().manual_seed(0))
    src, tgt_in, tgt_out, lengths = batch
    loss = sequence_loss(model, batch)
    logits = model(
        src,
        tgt_in,
        src_mask=padding_mask(lengths, 8),
        tgt_mask=torch.ones(9, 9, dtype=torch.bool).tril(),
    )
    log_p = logits.log_softmax(-1).gather(-1, tgt_out[..., None])[..., 0]
    torch.testing.assert_close(loss, -log_p[tgt_out != PAD].mean())
    smoothed = sequence_loss(model, batch, label_smoothing=0.1)
    expected = F.cross_entropy(
        logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, label_smoothing=0.1
    )
    torch.testing.assert_close(smoothed, expected)


def test_sequence_loss_gradient_reaches_every_used_parameter():
    model = tiny_model()
    sequence_loss(model, make_batch(16, 8, 12, torch.Generator().manual_seed(0))).backward()
    assert model.out_proj.weight.grad.abs().sum() > 0
    assert model.src_embed.weight.grad.abs().sum() > 0
    assert (model.src_embed.weight.grad[PAD] == 0).all()  # padding_idx


def test_train_model_lowers_the_loss_and_records_the_schedule():
    model = tiny_model()
    history = train_model(
        model, 30, batch_size=32, warmup=10, generator=torch.Generator().manual_seed(1)
    )
    assert len(history["loss"]) == len(history["lr"]) == 30
    assert history["lr"] == pytest.approx([lr_lambda(s, 32, 10) for s in range(1, 31)], rel=1e-12)
    first, last = sum(history["loss"][:5]) / 5, sum(history["loss"][-5:]) / 5
    assert last < 0.9 * first and last < math.log(9)  # better than a uniform guess of a symbol
    assert all(math.isfinite(x) for x in history["loss"])
    assert model.training


def test_train_model_is_deterministic_on_the_cpu():
    runs = []
    for _ in range(2):
        model = tiny_model(dropout_p=0.1)
        torch.manual_seed(5)  # dropout masks
        runs.append(
            train_model(model, 8, batch_size=16, generator=torch.Generator().manual_seed(2))
        )
    assert runs[0] == runs[1]


def test_callback_runs_every_step_and_does_not_change_the_run():
    seen = []

    def evaluate(step, model):
        seen.append(step)
        exact_match(model, n=4)  # switches to eval mode and back; draws from its own generator

    plain, _ = train_reversal(**TINY)
    watched, history = train_reversal(callback=evaluate, **{**TINY, "dropout_p": 0.1})
    again, history_again = train_reversal(**{**TINY, "dropout_p": 0.1})
    assert seen == list(range(1, TINY["steps"] + 1))
    assert history == history_again
    assert all(
        torch.equal(a, b)
        for a, b in zip(watched.state_dict().values(), again.state_dict().values(), strict=True)
    )


def test_train_model_follows_a_given_schedule():
    flat = 3e-3
    history = train_model(
        tiny_model(),
        5,
        batch_size=4,
        schedule=lambda s: flat / s,
        generator=torch.Generator().manual_seed(0),
    )
    assert history["lr"] == pytest.approx([flat / s for s in range(1, 6)], rel=1e-12)
    with pytest.raises(TypeError, match="schedule must be callable"):
        train_model(tiny_model(), 2, schedule=0.1)


def test_progress_bar_does_not_change_the_run(capsys):
    runs = [
        train_reversal(progress=progress, **{**TINY, "dropout_p": 0.1})[1]
        for progress in (False, True)
    ]
    assert runs[0] == runs[1]
    err = capsys.readouterr().err  # outside Jupyter, tqdm draws a text bar on stderr
    assert "training" in err and f"{TINY['steps']}/{TINY['steps']}" in err


def test_train_model_prints_when_asked(capsys):
    train_model(
        tiny_model(), 4, batch_size=4, log_every=2, generator=torch.Generator().manual_seed(0)
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("step     2  loss ")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"steps": 2.5}, TypeError, "steps must be an int"),
        ({"steps": 3, "label_smoothing": 1.0}, ValueError, r"label_smoothing must be in \[0, 1\)"),
        ({"steps": 3, "label_smoothing": "0.1"}, TypeError, "label_smoothing must be a number"),
        ({"steps": 3, "clip_norm": 0.0}, ValueError, "clip_norm must be > 0"),
    ],
)
def test_train_model_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        train_model(tiny_model(), **kwargs)


# ---------------------------------------------------------------- greedy decoding, exact match


class ReverseOracle(nn.Module):
    """A 'model' that reverses perfectly (one wrong first token for sequences of length `bad`)."""

    def __init__(self, vocab_size=12, bad=None):
        super().__init__()
        self.tgt_embed = nn.Embedding(vocab_size, 1)  # for vocab_size and the device
        self.out_proj = nn.Identity()
        self.vocab_size, self.bad = vocab_size, bad

    def encode(self, src, src_mask=None):
        return F.one_hot(src, self.vocab_size).float()  # (B, T_src, V)

    def decode(self, ys, enc_out, self_mask=None, cross_mask=None):
        src = enc_out.argmax(-1)  # (B, T_src)
        L = (src != PAD).sum(1, keepdim=True)  # (B, 1)
        t = torch.arange(ys.size(1))[None]  # (1, T)
        nxt = src.gather(1, (L - 1 - t).clamp(min=0, max=src.size(1) - 1))  # reversed
        nxt = torch.where(t == L, EOS, torch.where(t > L, PAD, nxt))  # (B, T)
        if self.bad is not None:
            nxt[:, 0] = torch.where(L[:, 0] == self.bad, 3 + (nxt[:, 0] == 3), nxt[:, 0])
        return F.one_hot(nxt, self.vocab_size).float()  # logits: (B, T, V)


def test_exact_match_counts_exactly():
    n, g = 100, torch.Generator().manual_seed(EVAL_SEED)
    lengths = make_batch(n, 8, 12, generator=g)[3]
    assert exact_match(ReverseOracle(), n=n) == n
    assert exact_match(ReverseOracle(bad=5), n=n) == n - int((lengths == 5).sum())


class NoEosOracle(ReverseOracle):
    """Reverses perfectly, then writes `after` where EOS belongs (and PAD from there on)."""

    def __init__(self, after, vocab_size=12):
        super().__init__(vocab_size)
        self.after = after

    def decode(self, ys, enc_out, self_mask=None, cross_mask=None):
        logits = super().decode(ys, enc_out, self_mask, cross_mask)  # (B, T, V) one-hot
        nxt = logits.argmax(-1)
        return F.one_hot(torch.where(nxt == EOS, self.after, nxt), self.vocab_size).float()


def test_exact_match_needs_eos_right_after_the_reversal():
    """A correct answer is the reversal, EOS, then nothing: a model that gets every symbol right but
    never ends its output (PAD in place of EOS), or writes one symbol too many, scores 0."""
    assert exact_match(NoEosOracle(after=PAD), n=64) == 0
    assert exact_match(NoEosOracle(after=5), n=64) == 0  # one more symbol, then PAD: still wrong


def test_reversal_correct_per_row():
    src, _, tgt_out, lengths = make_batch(20, 6, 12, torch.Generator().manual_seed(0))
    correct = reversal_correct(ReverseOracle(bad=4), src, tgt_out, lengths)
    assert correct.shape == (20,) and correct.dtype == torch.bool
    assert torch.equal(correct, lengths != 4)


def test_exact_match_uses_greedy_decoding_of_a_real_model():
    model = tiny_model()
    g = torch.Generator().manual_seed(EVAL_SEED)
    src, _, tgt_out, lengths = make_batch(16, 8, 12, generator=g)
    decoded = greedy_decode(model, src, max_new_tokens=9, src_mask=padding_mask(lengths, 8))
    decoded = decoded.tokens[:, 1:]
    expected = (F.pad(decoded, (0, 9 - decoded.size(1)), value=PAD) == tgt_out).all(dim=1)
    assert exact_match(model, n=16) == int(expected.sum())
    assert model.training  # handed back in the mode it came in


def test_exact_match_bad_n():
    with pytest.raises(ValueError, match="n must be at least 1"):
        exact_match(ReverseOracle(), n=0)


# ---------------------------------------------------------------- recipes


def test_reversal_recipe_is_a_frozen_dataclass_with_the_tutorial_defaults():
    assert isinstance(REVERSAL_RECIPE, ReversalRecipe) and REVERSAL_RECIPE == ReversalRecipe()
    assert dataclasses.asdict(REVERSAL_RECIPE) == {
        "vocab_size": 12, "max_len": 8, "d_model": 128, "num_heads": 4, "d_ff": 512,
        "num_layers": 2, "dropout_p": 0.1, "batch_size": 64, "steps": 2500, "warmup": 400,
        "label_smoothing": 0.0, "embedding_init": "paper", "seed": 0,
    }  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        REVERSAL_RECIPE.steps = 7


def test_reversal_recipe_replaces_fields_and_leaves_the_default_alone():
    recipe = reversal_recipe(steps=7, embedding_init="default")
    assert isinstance(recipe, ReversalRecipe)
    assert recipe.steps == 7 and recipe.embedding_init == "default" and recipe.seed == 0
    assert REVERSAL_RECIPE.steps == 2500 and reversal_recipe() == REVERSAL_RECIPE
    assert recipe == dataclasses.replace(REVERSAL_RECIPE, steps=7, embedding_init="default")


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"stpes": 7}, ValueError, r"unknown recipe keys \['stpes'\]; known: \['vocab_size'"),
        ({"embedding_init": "xavier"}, ValueError, "embedding_init"),
        ({"embedding_init": "Paper"}, ValueError, "did you mean .paper."),
        ({"embedding_init": 1}, TypeError, "embedding_init must be a str"),
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"steps": 2.0}, TypeError, "steps must be an int"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p must be in"),
        ({"label_smoothing": -0.1}, ValueError, "label_smoothing must be in"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
    ],
)
def test_reversal_recipe_errors(changes, error, match):
    with pytest.raises(error, match=match):
        reversal_recipe(**changes)
    with pytest.raises(error, match=match):
        train_reversal(**changes)  # the keyword API checks the same way


def test_train_reversal_is_bit_reproducible_and_default_init_changes_only_embeddings():
    a, history_a = train_reversal(**TINY)
    b, history_b = train_reversal(**TINY)
    assert history_a == history_b
    assert all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not a.training
    c, _ = train_reversal(**{**TINY, "steps": 1, "embedding_init": "default"})
    assert c.src_embed.weight[3:].std() > 0.5  # N(0, 1), not N(0, 1/d)
    assert (c.src_embed.weight[PAD] == 0).all()


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_through_weights_only_load(tmp_path):
    model = tiny_model()
    path = save_checkpoint(tmp_path / "sub" / "m.pt", model, recipe={"steps": 3}, losses=[1.0, 0.5])
    raw = torch.load(path, weights_only=True)
    assert raw["config"] == dataclasses.asdict(model.config) and raw["meta"]["losses"] == [1.0, 0.5]
    restored, meta = load_checkpoint(path)
    assert meta == {"recipe": {"steps": 3}, "losses": [1.0, 0.5]} and not restored.training
    for (k, v), (k2, v2) in zip(
        model.state_dict().items(), restored.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(v, v2)


def test_load_checkpoint_map_location_and_config(tmp_path):
    model = Transformer(7, 9, d_model=8, num_heads=2, d_ff=16, num_layers=1, max_len=20)
    restored, meta = load_checkpoint(save_checkpoint(tmp_path / "m.pt", model), map_location="cpu")
    assert meta == {} and restored.config == model.config
    assert restored.out_proj.weight.device.type == "cpu"
    assert restored.src_embed.num_embeddings == 7 and restored.tgt_embed.num_embeddings == 9


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "m.pt"
    save_checkpoint(path, tiny_model())
    save_checkpoint(path, tiny_model(seed=1))  # replaces the file in one step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    assert torch.equal(load_checkpoint(path)[0].out_proj.weight, tiny_model(seed=1).out_proj.weight)


def test_failed_save_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.pt"
    save_checkpoint(path, tiny_model())
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, tiny_model(seed=1))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]


def test_unsafe_metadata_is_refused_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"meta\['when'\] is a object"):
        save_checkpoint(tmp_path / "m.pt", tiny_model(), when=object())
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize("damage", ["truncated", "random", "empty", "not ours"])
def test_corrupt_checkpoints_give_a_clear_value_error(tmp_path, damage):
    good = save_checkpoint(tmp_path / "good.pt", tiny_model())
    bad = tmp_path / "bad.pt"
    if damage == "truncated":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif damage == "random":
        bad.write_bytes(bytes(range(256)) * 8)
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        torch.save({"weights": torch.zeros(3)}, bad)
    with pytest.raises(ValueError, match=str(bad)) as info:
        load_checkpoint(bad)
    assert isinstance(info.value, CheckpointError)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint file at .*missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_get_reversal_model_trains_saves_then_loads(tmp_path, capsys):
    path = tmp_path / "checkpoints" / "reversal.pt"
    first = get_reversal_model(path, device="cpu", **TINY)
    assert "trained" in capsys.readouterr().out and path.is_file()
    second = get_reversal_model(path, device="cpu", **TINY)
    assert "loaded" in capsys.readouterr().out
    trained, _ = train_reversal(device="cpu", **TINY)
    meta = load_checkpoint(path)[1]
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__
    for a, b, c in zip(
        first.state_dict().values(),
        second.state_dict().values(),
        trained.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not second.training


def test_get_reversal_model_retrains_on_a_corrupt_file_or_another_recipe(tmp_path, capsys):
    path = tmp_path / "reversal.pt"
    path.write_bytes(b"garbage")
    get_reversal_model(path, device="cpu", **TINY)
    out = capsys.readouterr().out
    assert "cannot read the checkpoint" in out and "trained" in out
    get_reversal_model(path, device="cpu", **{**TINY, "steps": 2})
    assert "another recipe" in capsys.readouterr().out
    assert load_checkpoint(path)[1]["recipe"]["steps"] == 2


def test_the_checkpoint_stores_the_recipe_as_plain_data(tmp_path, capsys):
    path = tmp_path / "reversal.pt"
    get_reversal_model(path, device="cpu", verbose=False, **TINY)
    raw = torch.load(path, weights_only=True)  # plain data only: no ReversalRecipe to unpickle
    recipe = raw["meta"]["recipe"]
    assert type(recipe) is dict and recipe == dataclasses.asdict(reversal_recipe(**TINY))
    assert ReversalRecipe(**recipe) == reversal_recipe(**TINY)  # and it rebuilds the recipe
    get_reversal_model(path, device="cpu", **TINY)
    assert "loaded" in capsys.readouterr().out  # the stored dict matches the recipe asked for


def test_token_loss_mean_sum_smoothing_and_float32():
    from transformer_from_scratch.train import token_loss

    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    tgt = torch.tensor([[4, 5, PAD], [6, PAD, PAD]])
    real = tgt != PAD
    by_hand = -F.log_softmax(logits, dim=-1).gather(-1, tgt[..., None])[..., 0][real]
    assert torch.allclose(token_loss(logits, tgt), by_hand.mean())
    assert torch.allclose(token_loss(logits, tgt, reduction="sum"), by_hand.sum())
    assert token_loss(logits, tgt, 0.1) > token_loss(logits, tgt)  # smoothing costs here
    half = token_loss(logits.bfloat16(), tgt)
    assert half.dtype == torch.float32  # the loss is taken in float32 even from bf16 logits
    with pytest.raises(ValueError, match="reduction"):
        token_loss(logits, tgt, reduction="none")


def test_token_loss_smoothing_spreads_over_every_class_and_drops_padded_positions():
    from transformer_from_scratch.train import token_loss

    V, eps = 7, 0.1
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(1))
    tgt = torch.tensor([[4, 5, 3, PAD], [6, PAD, PAD, PAD], [3, 3, 4, 5]])
    real = tgt != PAD
    log_p = F.log_softmax(logits, dim=-1)[real]  # (N, V): the graded positions only
    q = torch.full_like(log_p, eps / V)  # the uniform part over all V classes, PAD included
    q[torch.arange(len(q)), tgt[real]] += 1 - eps
    by_hand = -(q * log_p).sum(dim=-1)  # (N,)
    torch.testing.assert_close(token_loss(logits, tgt, eps), by_hand.mean())
    torch.testing.assert_close(token_loss(logits, tgt, eps, reduction="sum"), by_hand.sum())
    q_no_pad = torch.full_like(q, eps / (V - 1))  # the other reading: PAD left out of it
    q_no_pad[:, PAD] = 0.0
    q_no_pad[torch.arange(len(q)), tgt[real]] += 1 - eps
    other = -(q_no_pad * log_p).sum(dim=-1).mean()
    assert not torch.isclose(token_loss(logits, tgt, eps), other, rtol=1e-4)  # told apart


def test_num_tokens_counts_what_the_loss_grades():
    from transformer_from_scratch.train import num_tokens

    batch = make_batch(16, 8, 12, torch.Generator().manual_seed(0))
    assert num_tokens(batch) == int((batch[2] != PAD).sum()) == int(batch[3].sum()) + 16
    # A language model's (inputs, targets): a TypeError that names the way out, not an IndexError.
    with pytest.raises(TypeError, match=r"num_tokens .*got 2 items.*count_fn"):
        num_tokens(batch[:2])
    with pytest.raises(TypeError, match=r"sequence_loss .*got Tensor"):
        sequence_loss(tiny_model(), batch[0])


def test_atomic_save_leaves_the_old_file_whole_when_a_write_fails(tmp_path, monkeypatch):
    from transformer_from_scratch import train as train_module
    from transformer_from_scratch.train import atomic_save

    path = atomic_save({"version": 1}, tmp_path / "sub" / "state.pt")
    assert torch.load(path, weights_only=True) == {"version": 1}

    def broken_save(obj, f):  # writes some bytes, then fails, as a full disk would
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(train_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"version": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"version": 1}  # the old one, whole
    assert [f.name for f in path.parent.iterdir()] == ["state.pt"]  # no temporary left behind
    atomic_save({"version": 3}, path)
    assert torch.load(path, weights_only=True) == {"version": 3}


def test_token_loss_keeps_float64():
    from transformer_from_scratch.train import token_loss

    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    assert token_loss(logits, torch.tensor([[4, 5, 6], [6, PAD, 3]])).dtype == torch.float64


def padded_pair(seed=0):
    """Two micro-batches of different widths and token counts, as notebook 13's loaders give."""
    g = torch.Generator().manual_seed(seed)
    short = make_batch(6, 4, 12, g)
    long = make_batch(3, 8, 12, g)
    assert short[2].shape[1] != long[2].shape[1] and num_tokens(short) != num_tokens(long)
    return short, long


def concatenated(a, b):
    """One batch holding both, padded to the wider."""
    width_src = max(a[0].shape[1], b[0].shape[1])
    width_tgt = max(a[1].shape[1], b[1].shape[1])

    def pad(t, width):
        return F.pad(t, (0, width - t.shape[1]), value=PAD)

    return (torch.cat([pad(a[0], width_src), pad(b[0], width_src)]),
            torch.cat([pad(a[1], width_tgt), pad(b[1], width_tgt)]),
            torch.cat([pad(a[2], width_tgt), pad(b[2], width_tgt)]),
            torch.cat([a[3], b[3]]))  # fmt: skip


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_accumulate_gradients_equals_one_big_batch_and_a_plain_mean_does_not():
    short, long = padded_pair()
    one, two, naive = (tiny_model().double() for _ in range(3))
    loss_one = accumulate_gradients(one, [concatenated(short, long)])
    loss_two = accumulate_gradients(two, [short, long])
    torch.testing.assert_close(flat_grad(two), flat_grad(one), rtol=1e-10, atol=1e-12)
    assert loss_two == pytest.approx(loss_one, rel=1e-10)
    for part in (short, long):
        (sequence_loss(naive, part) / 2).backward()
    assert (flat_grad(naive) - flat_grad(one)).norm() > 1e-3 * flat_grad(one).norm()


def test_accumulate_gradients_uses_its_hooks():
    short, long = padded_pair()
    entered = []

    @contextlib.contextmanager
    def context(name):
        entered.append(name)
        yield

    model = tiny_model()
    accumulate_gradients(model, [short, long, short], autocast=lambda: context("autocast"),
                         no_sync=lambda: context("no_sync"))  # fmt: skip
    assert entered.count("autocast") == 3 and entered.count("no_sync") == 2  # not for the last
    reference, scaled = tiny_model(), tiny_model()
    accumulate_gradients(reference, [short])
    loss = accumulate_gradients(scaled, [short], total_tokens=2 * num_tokens(short), scale=4.0)
    torch.testing.assert_close(flat_grad(scaled), 2 * flat_grad(reference))  # 4 x half the tokens
    assert loss == pytest.approx(accumulate_gradients(tiny_model(), [short]) / 2, rel=1e-5)


def test_accumulate_gradients_rejects_empty_input():
    with pytest.raises(ValueError, match="at least one"):
        accumulate_gradients(tiny_model(), [])
    src, tgt_in, tgt_out, lengths = make_batch(2, 4, 12, torch.Generator().manual_seed(0))
    all_pad = (src, tgt_in, torch.full_like(tgt_out, PAD), lengths)
    with pytest.raises(ValueError, match="no graded token"):
        accumulate_gradients(tiny_model(), [all_pad])


def test_accumulate_gradients_takes_another_tasks_loss_and_count():
    """A task of its own: a micro-batch is (x, y) for a linear model, the loss a mean squared
    error per row, every row graded; weighted by rows, two unequal pieces equal the whole."""
    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7, 1)
    seen = []

    def loss_fn(model, batch):
        seen.append(len(batch[0]))
        return F.mse_loss(model(batch[0]), batch[1])

    def count_fn(batch):
        return len(batch[0])

    whole, split = nn.Linear(3, 1), nn.Linear(3, 1)
    split.load_state_dict(whole.state_dict())
    loss_whole = accumulate_gradients(whole, [(x, y)], loss_fn=loss_fn, count_fn=count_fn)
    loss_split = accumulate_gradients(split, [(x[:2], y[:2]), (x[2:], y[2:])], loss_fn=loss_fn,
                                      count_fn=count_fn)  # fmt: skip
    assert seen == [7, 2, 5]
    assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    torch.testing.assert_close(flat_grad(split), flat_grad(whole))
    with pytest.raises(ValueError, match="label_smoothing is sequence_loss's"):
        accumulate_gradients(whole, [(x, y)], label_smoothing=0.1, loss_fn=loss_fn)
    trainer = Trainer(split, torch.optim.SGD(split.parameters(), lr=0.1), loss_fn=loss_fn,
                      count_fn=count_fn)  # fmt: skip
    assert trainer.count_tokens([(x[:2], y[:2]), (x[2:], y[2:])]) == 7
    assert trainer.update([(x, y)]) == pytest.approx(F.mse_loss(whole(x), y).item(), rel=1e-6)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        Trainer(split, torch.optim.SGD(split.parameters(), lr=0.1), loss_fn="mse")
    with pytest.raises(ValueError, match="label_smoothing is sequence_loss's"):
        Trainer(split, torch.optim.SGD(split.parameters(), lr=0.1), loss_fn=loss_fn,
                label_smoothing=0.1)  # fmt: skip


def make_trainer(model=None, **options):
    model = model if model is not None else tiny_model()
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


def fresh_batches(n=100, size=8):
    return ([make_batch(size, 6, 12, torch.Generator().manual_seed(i))] for i in range(n))


def test_trainer_runs_the_events_in_order_and_clips_between_them():
    trainer = make_trainer(clip_norm=1e-3)
    log = []

    def record(event):
        def callback(t):
            log.append((t.step, event, flat_grad(t.model).norm().item() if t.step else None))

        return callback

    for event in Trainer.EVENTS:
        assert trainer.add_callback(event, record(event)) is trainer  # chainable
    history = trainer.fit(fresh_batches(), steps=2)
    assert [(s, e) for s, e, _ in log] == [
        (0, "before_update"), (1, "after_backward"), (1, "after_update"),
        (1, "before_update"), (2, "after_backward"), (2, "after_update"),
    ]  # fmt: skip
    assert log[1][2] > 100 * 1e-3 and log[2][2] == pytest.approx(1e-3, rel=1e-3)  # clipped between
    assert trainer.step == 2 and len(history["loss"]) == len(history["lr"]) == 2
    # the recorded gradient norm is the one before clipping (what after_backward saw)
    assert history["grad_norm"] == pytest.approx([log[1][2], log[4][2]], rel=1e-5)
    assert all(norm > trainer.clip_norm for norm in history["grad_norm"])  # both were clipped
    assert trainer.seconds > 0 and trainer.cpu_seconds > 0


def test_trainer_stops_when_an_after_update_callback_says_so():
    trainer = make_trainer()
    trainer.add_callback("after_update", lambda t: t.step == 4)
    trainer.add_callback("after_update", lambda t: None)  # a later None does not cancel the stop
    trainer.fit(fresh_batches(), steps=50)
    assert trainer.step == 4 and trainer.should_stop
    trainer.fit(fresh_batches(), steps=3)  # fit is called again: it goes on from step 4
    assert trainer.step == 7 and len(trainer.history["loss"]) == 7


def test_trainer_fit_takes_at_most_steps_and_ends_with_the_iterator():
    trainer = make_trainer()
    trainer.fit(fresh_batches(n=3), steps=10)
    assert trainer.step == 3
    trainer.fit(fresh_batches(n=100), steps=2)
    assert trainer.step == 5


def test_trainer_equals_the_loop_it_replaces():
    """One plain loop, written out: the trainer's weights are equal to it, bit for bit."""
    plain, trained = tiny_model(), tiny_model()
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    for [batch] in fresh_batches(n=5):
        optimizer.zero_grad()
        sequence_loss(plain, batch).backward()
        nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        optimizer.step()
    Trainer(trained, torch.optim.Adam(trained.parameters(), lr=1e-3)).fit(fresh_batches(n=5))
    for a, b in zip(plain.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)


def test_trainer_advances_a_bar_it_is_given():
    class Bar:
        def __init__(self):
            self.n, self.closed = 0, False

        def update(self, k):
            self.n += k

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.closed = True

    bar = Bar()
    trainer = make_trainer()
    trainer.fit(fresh_batches(), steps=3, progress=bar)
    trainer.fit(fresh_batches(), steps=2, progress=bar)
    assert bar.n == 5 and not bar.closed  # the caller's bar, left open for the next call


def test_trainer_rejects_bad_arguments():
    model = tiny_model()
    with pytest.raises(TypeError, match="nn.Module"):
        Trainer("model", torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="Optimizer"):
        Trainer(model, "adam")
    with pytest.raises(ValueError, match="clip_norm"):
        make_trainer(clip_norm=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        make_trainer(label_smoothing=1.5)
    trainer = make_trainer()
    with pytest.raises(ValueError, match="after_step"):
        trainer.add_callback("after_step", print)
    with pytest.raises(TypeError, match="callable"):
        trainer.add_callback("after_update", 3)
    with pytest.raises(ValueError, match="steps"):
        trainer.fit(fresh_batches(), steps=0)


def test_a_recipe_hands_its_model_over_as_a_transformer_config():
    recipe = reversal_recipe(d_model=16, num_heads=2, d_ff=24, num_layers=3, dropout_p=0.2)
    config = recipe.model_config
    assert isinstance(config, TransformerConfig) and build_reversal_model(recipe).config == config
    assert (config.src_vocab_size, config.tgt_vocab_size) == (recipe.vocab_size,) * 2
    assert (config.d_model, config.num_heads, config.d_ff, config.num_layers, config.dropout_p) == (
        16,
        2,
        24,
        3,
        0.2,
    )
    torch.manual_seed(0)
    built = Transformer(config)
    torch.manual_seed(0)
    by_hand = Transformer(12, 12, d_model=16, num_heads=2, d_ff=24, num_layers=3, dropout_p=0.2)
    for a, b in zip(built.state_dict().values(), by_hand.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the same draws: stored runs rebuild bit for bit
    with pytest.raises(ValueError, match="divisible"):
        Transformer(reversal_recipe(d_model=10, num_heads=4).model_config)


Pair = collections.namedtuple("Pair", "a b")  # module level: torch.save must find the classes


class Size(enum.IntEnum):
    SMALL = 1


class Name(str):
    pass


@pytest.mark.parametrize(
    "value",
    [Pair(1, 2), collections.defaultdict(int, a=1), Size.SMALL, Name("x"), {Size.SMALL: 1}],
    ids=["namedtuple", "defaultdict", "IntEnum", "str subclass", "IntEnum key"],
)
def test_checkpoint_metadata_refuses_subclasses_that_would_not_load(tmp_path, value):
    """Each of these saves with torch.save and is then refused by the weights-only loader."""
    path = tmp_path / "raw.pt"
    torch.save({"meta": value}, path)
    with pytest.raises(pickle.UnpicklingError):  # what save_checkpoint must prevent
        torch.load(path, weights_only=True)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "m.pt", tiny_model(), when=value)


def test_checkpoint_metadata_of_plain_types_round_trips(tmp_path, capsys):
    meta = {"steps": 3, "loss": 0.5, "ok": True, "name": "x", "none": None,
            "pairs": [(1, 2.0), ("a", torch.ones(2))], "nested": {1: [torch.zeros(1)]},
            "ordered": collections.OrderedDict(a=torch.ones(1))}  # fmt: skip
    save_checkpoint(tmp_path / "m.pt", tiny_model(), **meta)
    _, loaded = load_checkpoint(tmp_path / "m.pt")
    assert loaded["pairs"][0] == (1, 2.0) and loaded["nested"][1][0].shape == (1,)
    assert torch.equal(loaded["ordered"]["a"], torch.ones(1))
