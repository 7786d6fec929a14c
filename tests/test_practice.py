"""Unit tests of transformer_from_scratch.practice (notebook 13)."""

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader

from transformer_from_scratch.model import Transformer
from transformer_from_scratch.practice import EarlyStopping
from transformer_from_scratch.practice import TrainConfig
from transformer_from_scratch.practice import amp_autocast
from transformer_from_scratch.practice import check_adam_settings
from transformer_from_scratch.practice import evaluate_loss
from transformer_from_scratch.practice import layer_grad_norms
from transformer_from_scratch.practice import load_training_state
from transformer_from_scratch.practice import make_adamw
from transformer_from_scratch.practice import micro_batch_groups
from transformer_from_scratch.practice import param_groups
from transformer_from_scratch.practice import rng_state
from transformer_from_scratch.practice import save_training_state
from transformer_from_scratch.practice import set_gradient_checkpointing
from transformer_from_scratch.practice import set_rng_state
from transformer_from_scratch.practice import train_translation
from transformer_from_scratch.practice import warmup_cosine
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD
from transformer_from_scratch.train import num_tokens
from transformer_from_scratch.train import sequence_loss
from transformer_from_scratch.translation import TokenBatchSampler
from transformer_from_scratch.translation import collate_translations

V = 12


def tiny_model(seed=0, dropout_p=0.0):
    torch.manual_seed(seed)
    return Transformer(V, V, d_model=16, num_heads=2, d_ff=32, num_layers=1, dropout_p=dropout_p)


def make_items(n=40, seed=0):
    """Random (src, tgt) id pairs of varied lengths, BOS first and EOS last: a toy dataset."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        length = int(torch.randint(2, 8, (), generator=g))
        body = torch.randint(4, V, (length,), generator=g)
        ids = torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])
        items.append((ids, torch.cat([ids[:1], body.flip(0), ids[-1:]])))
    return items


def loaders(items, max_tokens=40):
    lengths = [max(len(s), len(t)) for s, t in items]
    train = DataLoader(items, batch_sampler=TokenBatchSampler(lengths, max_tokens, seed=0),
                       collate_fn=collate_translations)  # fmt: skip
    valid = DataLoader(items[:10], batch_size=5, collate_fn=collate_translations)
    return train, valid


def test_param_groups_decay_every_matrix_and_no_norm_or_bias():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert not any("norm" in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    # embeddings decay, as in nanoGPT and Hugging Face's Trainer; the one policy of the course
    assert {"src_embed.weight", "tgt_embed.weight"} <= {names[id(p)] for p in decay["params"]}
    with pytest.raises(ValueError):
        param_groups(model, -1.0)


def test_adamw_with_the_groups_leaves_norm_gains_undecayed():
    model = tiny_model()
    optimizer = torch.optim.AdamW(param_groups(model, 0.5), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only weight decay could move a weight
    optimizer.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(before[name], p)
        assert moved == (p.dim() == 2), name  # embeddings too


def test_make_adamw_is_adamw_over_the_groups_with_the_given_settings():
    model = tiny_model()
    optimizer = make_adamw(model, 3e-4, 0.1, betas=(0.8, 0.9), eps=1e-7)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-7 for g in optimizer.param_groups)
    assert all(g["lr"] == 3e-4 for g in optimizer.param_groups)
    groups = param_groups(model, 0.1)
    for mine, theirs in zip(optimizer.param_groups, groups, strict=True):
        assert [id(p) for p in mine["params"]] == [id(p) for p in theirs["params"]]


@pytest.mark.parametrize(
    "betas, eps, match",
    [((0.9,), 1e-8, "pair"), ((0.9, 1.0), 1e-8, "betas"), ((-0.1, 0.9), 1e-8, "betas"),
     ((0.9, 0.98), 0.0, "eps"), ("ab", 1e-8, "pair")],
)  # fmt: skip
def test_adam_settings_are_checked_by_the_optimizer_and_both_configs(betas, eps, match):
    with pytest.raises(ValueError, match=match):
        check_adam_settings(betas, eps)
    with pytest.raises(ValueError, match=match):
        make_adamw(tiny_model(), 1e-3, 0.0, betas=betas, eps=eps)
    with pytest.raises(ValueError, match=match):
        TrainConfig(betas=betas, eps=eps)


def test_train_config_names_its_knobs_as_the_recipe_does():
    from transformer_from_scratch.tuning import Recipe

    shared = {"lr", "weight_decay", "warmup", "label_smoothing", "clip_norm", "accum_steps"}
    shared |= {"betas", "eps", "seed"}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
    assert shared <= train_fields & recipe_fields
    with pytest.raises(TypeError):
        TrainConfig(warmup_steps=5)  # the old name: warmup
    with pytest.raises(TypeError):
        TrainConfig(accumulation_steps=2)  # the old name: accum_steps


def test_warmup_cosine_shape():
    values = [warmup_cosine(s, 10, 100, 0.1) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == 1.0
    assert values[-1] == pytest.approx(0.1, abs=1e-3)
    assert values[55] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down the cosine
    assert warmup_cosine(500, 10, 100, 0.1) == pytest.approx(0.1)  # stays at the floor
    assert warmup_cosine(0, 0, 10) == 1.0  # no warmup
    with pytest.raises(ValueError):
        warmup_cosine(0, 10, 10)
    with pytest.raises(ValueError):
        warmup_cosine(-1, 1, 10)
    with pytest.raises(ValueError):
        warmup_cosine(0, 1, 10, min_ratio=2.0)


def test_sequence_loss_matches_cross_entropy_and_counts_tokens():
    model = tiny_model()
    batch = collate_translations(make_items(6))
    loss, tokens = sequence_loss(model, batch, label_smoothing=0.1), num_tokens(batch)
    loss_sum = sequence_loss(model, batch, label_smoothing=0.1, reduction="sum")
    assert tokens == int((batch[2] != PAD).sum())
    assert_close(loss_sum / tokens, loss)
    with pytest.raises(ValueError, match="reduction"):
        sequence_loss(model, batch, reduction="none")


def test_accumulated_micro_batches_equal_one_big_batch():
    model = tiny_model()
    items = make_items(16)
    model.zero_grad()
    sequence_loss(model, collate_translations(items)).backward()
    big = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    micro = [collate_translations(items[i : i + 4]) for i in range(0, 16, 4)]
    total = sum(int((b[2] != PAD).sum()) for b in micro)
    for b in micro:
        (sequence_loss(model, b, reduction="sum") / total).backward()
    for p, g in zip(model.parameters(), big, strict=True):
        assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients_and_can_be_undone():
    model = tiny_model()
    batch = collate_translations(make_items(8))
    sequence_loss(model, batch).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    set_gradient_checkpointing(model, True)
    assert "forward" in vars(model.encoder.layers[0])
    sequence_loss(model, batch).backward()
    for p, g in zip(model.parameters(), plain, strict=True):
        assert_close(p.grad, g)
    keys = set(model.state_dict())
    set_gradient_checkpointing(model, False)
    assert "forward" not in vars(model.encoder.layers[0])
    assert set(model.state_dict()) == keys


def test_amp_autocast_bfloat16_on_cpu_and_float32_noop():
    x = torch.randn(4, 4)
    with amp_autocast(torch.device("cpu"), "bfloat16"):
        assert (x @ x).dtype == torch.bfloat16
    with amp_autocast(torch.device("cpu"), None):
        assert (x @ x).dtype == torch.float32


def test_early_stopping_counts_epochs_without_improvement():
    stopper = EarlyStopping(patience=2)
    assert stopper.step(0, 1.0) and not stopper.step(1, 1.5) and not stopper.should_stop
    assert not stopper.step(2, 1.2) and stopper.should_stop and stopper.best_epoch == 0
    again = EarlyStopping(patience=2)
    again.load_state_dict(stopper.state_dict())
    assert again.should_stop and again.best == 1.0
    with pytest.raises(ValueError):
        EarlyStopping(patience=0)


def test_checkpoints_round_trip_with_weights_only(tmp_path):
    state = {"model": tiny_model().state_dict(), "rng": rng_state(), "epoch": 3}
    path = save_training_state(tmp_path / "ck" / "last.pt", state)
    loaded = load_training_state(path)
    assert loaded["epoch"] == 3
    assert [f.name for f in (tmp_path / "ck").iterdir()] == ["last.pt"]  # no temporary left
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    with pytest.raises(FileNotFoundError):
        load_training_state(tmp_path / "missing.pt")
    torch.save({"code": nn.Linear(2, 2)}, tmp_path / "module.pt")  # a pickled module, not weights
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_training_state(tmp_path / "module.pt")


def test_rng_state_restores_every_generator():
    state = rng_state()
    first = torch.rand(3), math.floor(1e9 * __import__("random").random())
    set_rng_state(state)
    assert torch.equal(torch.rand(3), first[0])
    assert math.floor(1e9 * __import__("random").random()) == first[1]


def test_set_rng_state_takes_generator_states_mapped_to_another_device():
    """load_training_state(map_location="cuda") moves the CPU generator's byte tensor to the GPU;
    torch.set_rng_state wants it on the CPU (a TypeError on a GPU before the fix)."""

    class Mapped:  # stands in for a byte tensor on another device: usable only after .cpu()
        def __init__(self, tensor):
            self.tensor = tensor

        def cpu(self):
            return self.tensor

    state = rng_state()
    first = torch.rand(3)
    set_rng_state({**state, "torch": Mapped(state["torch"])})
    assert torch.equal(torch.rand(3), first)


def test_layer_grad_norms_groups_by_block():
    model = tiny_model()
    sequence_loss(model, collate_translations(make_items(4))).backward()
    norms = layer_grad_norms(model)
    assert {"encoder.layers.0", "decoder.layers.0", "out_proj", "src_embed"} <= set(norms)
    total = math.sqrt(sum(v**2 for v in norms.values()))
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert total == pytest.approx(float(expected), rel=1e-4)


def test_a_step_that_the_grad_scaler_skips_leaves_the_weights_and_logs_an_inf_row():
    """A float16 overflow on a GPU, made on the CPU: a hook turns one gradient into inf once.

    The scaler then skips the optimizer step and backs off; the gradient log (notebook 13)
    records the step's unscaled norms, which are not finite, so "steps taken" = the rows that
    are all finite.
    """
    from transformer_from_scratch.train import Trainer

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer = Trainer(model, opt, scaler=scaler)
    overflows = [True]  # the first backward overflows, the second does not
    model.out_proj.weight.register_hook(
        lambda g: g * float("inf") if overflows and overflows.pop() else g
    )
    trainer.history["grad_norms"] = []
    trainer.add_callback(
        "after_backward", lambda t: t.history["grad_norms"].append(layer_grad_norms(t.model))
    )
    batch = collate_translations(make_items(4))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.update([batch])  # an inf gradient: the step is skipped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**15  # backed off by half
    trainer.update([batch])  # a finite scale: this step is taken
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    rows = [list(norms.values()) for norms in trainer.history["grad_norms"]]
    taken = [all(math.isfinite(v) for v in row) for row in rows]
    assert taken == [False, True]


def test_resume_restores_the_grad_scaler(tmp_path):
    """float16's loss scale is part of last.pt: a resumed run goes on with the scale it had
    backed off to, not the initial one. (The loop takes float16 only on a GPU, so the trainer
    is built directly here, with the CPU's GradScaler.)"""
    from transformer_from_scratch.practice import _make_trainer
    from transformer_from_scratch.practice import _resume
    from transformer_from_scratch.practice import _training_state

    train, _ = loaders(make_items(8))
    config = TrainConfig(amp_dtype="float16")
    trainer, _ = _make_trainer(tiny_model(), train, config)
    assert trainer.scaler.is_enabled()
    trainer.scaler.scale(torch.ones(()))  # the scale is made on first use
    trainer.scaler.update(new_scale=2.0**7)  # as after overflows backed it off
    state = _training_state(trainer, EarlyStopping(3), 0, config, None)
    save_training_state(tmp_path / "last.pt", state)
    fresh, _ = _make_trainer(tiny_model(seed=5), train, config)
    assert fresh.scaler.get_scale() != 2.0**7
    _resume(fresh, EarlyStopping(3), load_training_state(tmp_path / "last.pt"), config, None)
    assert fresh.scaler.get_scale() == 2.0**7


def test_train_config_validates():
    with pytest.raises(ValueError):
        TrainConfig(epochs=0)
    with pytest.raises(ValueError):
        TrainConfig(amp_dtype="float8")
    with pytest.raises(ValueError, match="did you mean 'bfloat16'"):
        TrainConfig(amp_dtype="BFloat16")  # once accepted here, then an AttributeError in the loop
    with pytest.raises(ValueError):
        TrainConfig(label_smoothing=1.0)


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path):
    train, valid = loaders(make_items(24))
    config = TrainConfig(epochs=2, lr=3e-3, warmup=2, patience=5)
    straight = tiny_model(dropout_p=0.1)
    history = train_translation(straight, train, valid, config, tmp_path / "a", progress=False)
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert len(history["grad_norms"]) == len(history["lr"]) == len(history["loss"])
    interrupted = tiny_model(dropout_p=0.1)
    train_translation(interrupted, train, valid, config, tmp_path / "b", stop_after_epoch=1,
                      progress=False)  # fmt: skip
    resumed = tiny_model(seed=5, dropout_p=0.1)
    train_translation(resumed, train, valid, config, tmp_path / "b", resume=True, progress=False)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_accumulation_in_the_loop_takes_fewer_steps():
    train, valid = loaders(make_items(40))
    config = TrainConfig(epochs=1, accum_steps=2)
    history = train_translation(tiny_model(), train, valid, config, progress=False)
    assert len(history["lr"]) == math.ceil(len(train) / 2)


def test_evaluate_loss_reports_loss_and_accuracy():
    _, valid = loaders(make_items(20))
    loss, accuracy = evaluate_loss(tiny_model(), valid)
    assert loss > 0 and 0 <= accuracy <= 1


def test_train_translation_rejects_bad_arguments():
    train, valid = loaders(make_items(10))
    with pytest.raises(TypeError, match="TrainConfig"):
        train_translation(tiny_model(), train, valid, {"epochs": 1})
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_translation(tiny_model(), train, valid, TrainConfig(), resume=True)
    with pytest.raises(ValueError, match="bfloat16"):
        train_translation(tiny_model(), train, valid, TrainConfig(amp_dtype="float16"))


class EpochDependentSampler:
    """A batch sampler whose epoch 0 has 4 batches and every later epoch 2."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        k = 4 if self.epoch == 0 else 2
        return iter([list(range(i, self.n, k)) for i in range(k)])

    def __len__(self):
        return 4 if self.epoch == 0 else 2


def test_schedule_does_not_depend_on_where_the_sampler_was_left():
    items = make_items(24)
    _, valid = loaders(items)
    config = TrainConfig(epochs=2, lr=1e-3, warmup=0, min_lr_ratio=0.0)
    rates = []
    for left_at_epoch in (0, 3):  # a sampler reused after an earlier run was left at epoch 3
        sampler = EpochDependentSampler(len(items))
        sampler.set_epoch(left_at_epoch)
        train = DataLoader(items, batch_sampler=sampler, collate_fn=collate_translations)
        rates.append(train_translation(tiny_model(), train, valid, config, progress=False)["lr"])
    assert len(rates[0]) == 4 + 2
    assert rates[0] == rates[1]  # the schedule's length is counted on epoch 0 both times


def test_micro_batch_groups_cut_the_loader_in_lists_of_k():
    assert list(micro_batch_groups(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(micro_batch_groups(range(4), 1)) == [[0], [1], [2], [3]]
    assert list(micro_batch_groups([], 2)) == []
    with pytest.raises(ValueError, match="k"):
        list(micro_batch_groups(range(3), 0))


def test_without_a_folder_the_best_epoch_is_kept_in_memory():
    train, valid = loaders(make_items(24))
    # A rate this high makes the last epoch worse than the one before it.
    config = TrainConfig(epochs=6, lr=0.1, warmup=0, patience=10, min_lr_ratio=1.0)
    model = tiny_model()
    history = train_translation(model, train, valid, config, progress=False)
    best = min(range(config.epochs), key=history["val_loss"].__getitem__)
    assert best != config.epochs - 1  # else this test would not tell best from last
    loss, _ = evaluate_loss(model, valid, config.amp_dtype, config.label_smoothing)
    assert loss == pytest.approx(history["val_loss"][best], rel=1e-5)
    assert not model.training


def test_resume_refuses_another_configuration(tmp_path):
    train, valid = loaders(make_items(24))
    config = TrainConfig(epochs=3, lr=3e-3, warmup=2)
    train_translation(tiny_model(), train, valid, config, tmp_path, stop_after_epoch=1,
                      progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="another configuration.*'lr'"):
        train_translation(tiny_model(), train, valid, dataclasses.replace(config, lr=1e-2),
                          tmp_path, resume=True, progress=False)  # fmt: skip
    longer = dataclasses.replace(config, epochs=4)  # more epochs is the one change allowed
    history = train_translation(tiny_model(), train, valid, longer, tmp_path, resume=True,
                                progress=False)  # fmt: skip
    assert len(history["val_loss"]) == 4


def test_checkpoints_store_the_tokenizers_and_resume_refuses_others(tmp_path):
    train, valid = loaders(make_items(24))
    config = TrainConfig(epochs=2, lr=3e-3, warmup=2)
    fingerprints = {"src": "aaaa", "tgt": "bbbb"}
    train_translation(tiny_model(), train, valid, config, tmp_path, stop_after_epoch=1,
                      progress=False, fingerprints=fingerprints)  # fmt: skip
    assert load_training_state(tmp_path / "last.pt")["fingerprints"] == fingerprints
    assert load_training_state(tmp_path / "best.pt")["fingerprints"] == fingerprints
    for other in ({"src": "aaaa", "tgt": "cccc"}, None):
        with pytest.raises(ValueError, match="other tokenizers"):
            train_translation(tiny_model(), train, valid, config, tmp_path, resume=True,
                              progress=False, fingerprints=other)  # fmt: skip
    with pytest.raises(TypeError, match="fingerprints"):
        train_translation(tiny_model(), train, valid, config, fingerprints=["aaaa"])
    history = train_translation(tiny_model(), train, valid, config, tmp_path, resume=True,
                                progress=False, fingerprints=dict(fingerprints))  # fmt: skip
    assert len(history["val_loss"]) == 2
