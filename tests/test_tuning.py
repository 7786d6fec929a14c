"""Unit tests of transformer_from_scratch.tuning (notebook 15)."""

import dataclasses
import math

import optuna
import pytest
import torch

from transformer_from_scratch.data import make_batch
from transformer_from_scratch.regularization import DropPath
from transformer_from_scratch.train import REVERSAL_RECIPE
from transformer_from_scratch.train import ReversalRecipe
from transformer_from_scratch.train import Trainer
from transformer_from_scratch.train import accumulate_gradients
from transformer_from_scratch.train import build_reversal_model
from transformer_from_scratch.train import lr_lambda
from transformer_from_scratch.train import num_tokens
from transformer_from_scratch.train import reversal_recipe
from transformer_from_scratch.train import sequence_loss
from transformer_from_scratch.tuning import TUNED_RECIPE
from transformer_from_scratch.tuning import TUTORIAL_RECIPE
from transformer_from_scratch.tuning import EarlyStoppingCallback
from transformer_from_scratch.tuning import Recipe
from transformer_from_scratch.tuning import batches
from transformer_from_scratch.tuning import build_model
from transformer_from_scratch.tuning import count_parameters
from transformer_from_scratch.tuning import dataset_loss
from transformer_from_scratch.tuning import fit
from transformer_from_scratch.tuning import lr_factor
from transformer_from_scratch.tuning import lr_range_test
from transformer_from_scratch.tuning import make_optimizer
from transformer_from_scratch.tuning import make_splits
from transformer_from_scratch.tuning import make_study
from transformer_from_scratch.tuning import recipe_trainer
from transformer_from_scratch.tuning import search_objective
from transformer_from_scratch.tuning import search_space
from transformer_from_scratch.tuning import split_batch
from transformer_from_scratch.tuning import suggest_lr
from transformer_from_scratch.tuning import train_until_solved
from transformer_from_scratch.tuning import width_for_budget

TINY = Recipe(d_model=16, num_heads=2, d_ff=32, num_layers=1, batch_size=8, steps=6, warmup=2)


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# ---------------------------------------------------------------- Recipe
def test_recipe_replace_and_checks():
    assert TINY.replace(lr=1e-3).lr == 1e-3 and TINY.lr == 2e-3  # a copy, frozen
    with pytest.raises(TypeError):
        TINY.replace(learning_rate=1.0)
    with pytest.raises(ValueError):
        Recipe(batch_size=10, accum_steps=4)
    with pytest.raises(ValueError):
        Recipe(optimizer="sgd")
    with pytest.raises(ValueError):
        Recipe(dropout_p=1.0)
    with pytest.raises(TypeError):
        Recipe(steps=1.5)
    with pytest.raises(ValueError):
        Recipe(betas=(0.9, 1.0))
    with pytest.raises(ValueError):
        Recipe(lr=0.0)
    with pytest.raises(ValueError, match="adamw"):
        Recipe(optimizer="adam", weight_decay=1.0)  # Adam would silently ignore the decay
    assert Recipe(optimizer="adam", weight_decay=0.0).weight_decay == 0.0
    assert Recipe(optimizer="adamw", weight_decay=1.0).weight_decay == 1.0


@pytest.mark.parametrize(("field", "value"), [("optimizer", "Adam"), ("schedule", "Paper")])
def test_recipe_choices_match_exactly(field, value):
    # Once, check_choice accepted "Adam" and the recipe kept it: make_optimizer, which compares
    # exactly, then built AdamW, and "Paper" ran the cosine schedule.
    with pytest.raises(ValueError, match=f"did you mean {value.lower()!r}"):
        Recipe(**{field: value})


def test_the_named_recipes():
    assert TUNED_RECIPE.optimizer == "adamw" and TUNED_RECIPE.steps == 600
    assert TUNED_RECIPE.dropout_p == 0.0 and TUNED_RECIPE.d_model == 128
    assert TUTORIAL_RECIPE.schedule == "paper" and TUTORIAL_RECIPE.steps == 6000
    assert TUTORIAL_RECIPE.dropout_p == 0.1


def test_build_model_is_seeded_and_adds_drop_path():
    a, b = build_model(TINY), build_model(TINY)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    c = build_model(TINY.replace(seed=1))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert any(
        isinstance(m, DropPath) for m in build_model(TINY.replace(drop_path_p=0.2)).modules()
    )
    assert not any(isinstance(m, DropPath) for m in a.modules())


# ---------------------------------------------------------------- schedule and optimiser
def test_lr_factor_paper_cosine_constant():
    paper = TUTORIAL_RECIPE.replace(warmup=10)
    for s in range(30):
        assert lr_factor(s, paper) == lr_lambda(s + 1, 128, 10)
    cos = Recipe(warmup=4, steps=20, schedule="cosine")
    assert [lr_factor(s, cos) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(19, cos) < 0.01 and lr_factor(100, cos) == 0.0
    const = cos.replace(schedule="constant")
    assert lr_factor(19, const) == 1.0
    with pytest.raises(ValueError):
        lr_factor(-1, cos)


def test_make_optimizer_decays_only_matrices():
    model = build_model(TINY)
    adamw = make_optimizer(model, TINY.replace(weight_decay=0.1))
    assert isinstance(adamw, torch.optim.AdamW)
    decayed, kept = adamw.param_groups
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in kept["params"])
    n = sum(1 for _ in model.parameters())
    assert len(decayed["params"]) + len(kept["params"]) == n
    adam = make_optimizer(model, TINY.replace(optimizer="adam"))
    assert type(adam) is torch.optim.Adam


# ---------------------------------------------------------------- batches and accumulation
def test_split_batch_and_num_tokens():
    batch = make_batch(12, 8, 12, torch.Generator().manual_seed(0))
    parts = split_batch(batch, 3)
    assert len(parts) == 3 and all(p[0].shape[0] == 4 for p in parts)
    assert sum(num_tokens(p) for p in parts) == num_tokens(batch)
    assert num_tokens(batch) == int(batch[3].sum()) + 12  # every symbol and EOS of each target
    with pytest.raises(ValueError):
        split_batch(batch, 5)


def test_accumulation_equals_one_batch_and_the_naive_average_does_not():
    batch = make_batch(32, 8, 12, torch.Generator().manual_seed(0))
    one = build_model(TINY).double()
    loss_one = accumulate_gradients(one, [batch])
    four = build_model(TINY).double()
    loss_four = accumulate_gradients(four, split_batch(batch, 4))
    torch.testing.assert_close(grads(four), grads(one), rtol=1e-10, atol=1e-12)
    assert math.isclose(loss_four, loss_one, rel_tol=1e-10)
    assert math.isclose(
        loss_one, sequence_loss(build_model(TINY).double(), batch).item(), rel_tol=1e-10
    )
    naive = build_model(TINY).double()
    for part in split_batch(batch, 4):
        (sequence_loss(naive, part) / 4).backward()
    assert not torch.allclose(grads(naive), grads(one), rtol=1e-6, atol=1e-9)


def test_batches_fresh_and_fixed():
    stream = batches(TINY)
    a, b = next(stream), next(stream)
    assert a[0].shape[0] == 8 and not torch.equal(a[0], b[0])
    data = make_batch(20, 8, 12, torch.Generator().manual_seed(0))
    rows = {tuple(r) for r in data[0].tolist()}
    fixed = batches(TINY, data)
    seen = [tuple(r) for _ in range(2) for r in next(fixed)[0].tolist()]
    assert set(seen) <= rows and len(seen) == 16


def test_evaluate_loss_is_the_token_mean_and_restores_the_mode():
    model = build_model(TINY.replace(dropout_p=0.2)).train()
    data = make_batch(50, 8, 12, torch.Generator().manual_seed(0))
    value = dataset_loss(model, data, batch_size=7)
    assert model.training
    expected = sequence_loss(model.eval(), data).item()
    assert math.isclose(value, expected, rel_tol=1e-5)


def test_make_splits_share_no_sequence():
    train, val = make_splits(TINY, 200, 300, seed=0)
    assert train[0].shape[0] == 200 and 0 < val[0].shape[0] <= 300
    assert not {tuple(r) for r in train[0].tolist()} & {tuple(r) for r in val[0].tolist()}
    with pytest.raises(ValueError):
        make_splits(TINY, 0, 10)


# ---------------------------------------------------------------- fit
def test_fit_history_callback_and_stop():
    data = make_batch(16, 8, 12, torch.Generator().manual_seed(0))
    model = build_model(TINY)
    history = fit(model, TINY, train_data=data, val_data=data, eval_every=2)
    assert len(history["loss"]) == len(history["lr"]) == 6
    assert history["eval_step"] == [2, 4, 6] and len(history["val_loss"]) == 3
    assert history["train_loss"] == history["val_loss"]  # the same set, both in eval mode
    assert history["lr"][0] == pytest.approx(TINY.lr / 2)
    calls = []

    def stop(step, model, history):
        calls.append(step)
        return step == 4

    history = fit(build_model(TINY), TINY, val_data=data, eval_every=2, callback=stop)
    assert calls == [2, 4] and len(history["loss"]) == 4
    with pytest.raises(ValueError):
        fit(model, TINY, eval_every=-1)


def test_fit_scores_the_training_loss_on_a_sample_when_asked():
    data = make_batch(16, 8, 12, torch.Generator().manual_seed(0))
    first = tuple(t[:4] for t in data)
    sampled = fit(
        build_model(TINY), TINY, train_data=data, val_data=first, eval_every=3, train_eval_size=4
    )
    whole = fit(build_model(TINY), TINY, train_data=data, val_data=data, eval_every=3)
    assert sampled["loss"] == whole["loss"]  # the sample changes the scoring, not the training
    assert sampled["train_loss"] == sampled["val_loss"]  # scored on the first 4 sequences
    assert whole["train_loss"] == whole["val_loss"]  # scored on all 16
    assert sampled["train_loss"] != whole["train_loss"]
    big = fit(
        build_model(TINY), TINY, train_data=data, val_data=data, eval_every=3, train_eval_size=100
    )  # more than there are: all of them
    assert big["train_loss"] == whole["train_loss"]
    with pytest.raises(ValueError):
        fit(build_model(TINY), TINY, train_data=data, eval_every=3, train_eval_size=0)


def test_fit_learns_and_is_reproducible():
    recipe = TINY.replace(steps=40, d_model=32, d_ff=64, lr=3e-3)
    val = make_batch(64, 8, 12, torch.Generator().manual_seed(5))
    first = fit(build_model(recipe), recipe, val_data=val, eval_every=40)
    again = fit(build_model(recipe), recipe, val_data=val, eval_every=40)
    assert first["loss"] == again["loss"]
    assert first["val_loss"][-1] < math.log(12) - 0.3


# ---------------------------------------------------------------- range test and budgets
def test_early_stopping_stops_after_patience_and_restores_the_best_weights():
    recipe = Recipe(d_model=16, num_heads=2, d_ff=32, num_layers=1, steps=40, warmup=2)
    model = build_model(recipe)
    scores = iter([3.0, 2.0, 2.5, 1.95, 2.6, 2.7, 1.0])  # best at the 2nd (1.95 is within 0.1)
    snapshots = {}

    def metric(m):
        snapshots[len(snapshots) + 1] = {k: v.clone() for k, v in m.state_dict().items()}
        return next(scores)

    stopper = EarlyStoppingCallback(metric, every=3, patience=4, min_delta=0.1)
    trainer = recipe_trainer(model, recipe).add_callback("after_update", stopper)
    trainer.fit(([b] for b in batches(recipe)), recipe.steps)
    assert stopper.scores == [(3, 3.0), (6, 2.0), (9, 2.5), (12, 1.95), (15, 2.6), (18, 2.7)]
    assert (stopper.best, stopper.best_step, stopper.stopped_step) == (2.0, 6, 18)
    assert trainer.step == 18  # the run stopped at the fourth evaluation without improvement
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in snapshots[2].items())  # step 6's weights
    assert not all(torch.equal(state[k], v) for k, v in snapshots[6].items())
    # A run that ends without stopping keeps its last weights until restore() is called.
    late = EarlyStoppingCallback(lambda m: float(m.training), every=5, patience=100)
    model2 = build_model(recipe)
    trainer2 = recipe_trainer(model2, recipe).add_callback("after_update", late)
    trainer2.fit(([b] for b in batches(recipe)), 10)
    assert late.stopped_step is None and late.best_step == 5 and trainer2.step == 10
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    assert late.restore() is model2
    assert not all(torch.equal(before[k], v) for k, v in model2.state_dict().items())
    with pytest.raises(RuntimeError, match="no best weights"):
        EarlyStoppingCallback(lambda m: 0.0).restore(model2)
    with pytest.raises(TypeError, match="callable"):
        EarlyStoppingCallback(0.5)
    with pytest.raises(ValueError):
        EarlyStoppingCallback(lambda m: 0.0, patience=0)
    with pytest.raises(ValueError):
        EarlyStoppingCallback(lambda m: 0.0, min_delta=-1.0)


def test_lr_range_test_and_suggest_lr():
    result = lr_range_test(TINY, lr_min=1e-4, lr_max=10.0, steps=40)
    lrs = result["lr"]
    assert lrs[0] == pytest.approx(1e-4) and all(a < b for a, b in zip(lrs, lrs[1:], strict=False))
    assert len(result["loss"]) == len(result["smoothed"]) == len(lrs) <= 40
    reading = suggest_lr(result)
    assert reading["suggested"] == pytest.approx(reading["min_loss"] / 10)
    assert reading["steepest"] <= reading["min_loss"]
    with pytest.raises(ValueError):
        suggest_lr({"lr": [1.0, 2.0], "smoothed": [1.0, 0.5]})
    with pytest.raises(ValueError):
        lr_range_test(TINY, lr_min=1.0, lr_max=0.1)


def test_count_parameters_matches_a_real_model_and_width_for_budget():
    assert count_parameters(TINY) == sum(p.numel() for p in build_model(TINY).parameters())
    budget = count_parameters(TINY.replace(d_model=64, d_ff=256, num_layers=2))
    deep = width_for_budget(TINY, 4, budget)
    assert deep.num_layers == 4 and deep.d_ff == 4 * deep.d_model and deep.d_model % 2 == 0
    assert abs(count_parameters(deep) / budget - 1) < 0.05
    assert count_parameters(width_for_budget(TINY, 1, budget)) > 0.95 * budget
    with pytest.raises(ValueError):
        width_for_budget(TINY, 0, budget)


def test_train_until_solved_records_exact_match():
    recipe = TINY.replace(steps=4)
    model, history = train_until_solved(recipe, eval_every=2, n=8)
    assert [step for step, _ in history["exact"]] == [2, 4]
    assert all(0 <= correct <= 8 for _, correct in history["exact"])
    assert history["solved_step"] is None or history["solved_step"] in (2, 4)
    assert not model.training


# ---------------------------------------------------------------- search
def test_search_space_objective_and_seeded_studies():
    study = make_study("tpe", seed=3, n_startup_trials=2)
    trial = study.ask()
    knobs = search_space(trial)
    assert set(knobs) == {"lr", "warmup", "dropout_p", "weight_decay"}
    TINY.replace(**knobs)  # every suggestion is a valid recipe
    assert search_space(make_study("tpe", seed=3, n_startup_trials=2).ask()) == knobs
    assert isinstance(make_study("random", seed=0).sampler, optuna.samplers.RandomSampler)
    val = make_batch(16, 8, 12, torch.Generator().manual_seed(1))
    study = make_study("random", seed=0, n_startup_trials=1)
    study.optimize(search_objective(TINY, val, eval_every=3), n_trials=3)
    assert len(study.trials) == 3
    assert all(len(t.intermediate_values) >= 1 for t in study.trials)
    assert math.isfinite(study.best_value)
    with pytest.raises(ValueError):
        make_study("grid")


def test_recipe_model_config_builds_the_models_of_build_model_and_count_parameters():
    recipe = Recipe(d_model=32, num_heads=2, d_ff=48, num_layers=1, dropout_p=0.1)
    assert recipe.model_config.d_ff == 48 and recipe.model_config.dropout_p == 0.1
    model = build_model(recipe)
    assert model.config == recipe.model_config
    assert count_parameters(recipe) == sum(p.numel() for p in model.parameters())


def test_recipe_extends_notebook_11s_recipe_and_draws_the_same_model():
    assert issubclass(Recipe, ReversalRecipe)
    shared = {f.name for f in dataclasses.fields(ReversalRecipe)}
    assert shared < {f.name for f in dataclasses.fields(Recipe)}  # one description, extended
    # The tutorial's recipe is notebook 11's, with the optimiser and schedule train_model fixes.
    for name in shared - {"steps"}:
        assert getattr(TUTORIAL_RECIPE, name) == getattr(REVERSAL_RECIPE, name), name
    small = dict(d_model=16, num_heads=2, d_ff=32, num_layers=1, seed=3)
    for init in ("paper", "default"):
        ours = build_model(Recipe(embedding_init=init, **small)).state_dict()
        nb11 = build_reversal_model(reversal_recipe(embedding_init=init, **small)).state_dict()
        assert ours.keys() == nb11.keys()
        assert all(torch.equal(ours[k], nb11[k]) for k in ours)
    # Notebook 11's recipe needs a warm-up for the paper's schedule; this one allows none.
    assert Recipe(warmup=0).warmup == 0
    with pytest.raises(ValueError, match="warmup"):
        ReversalRecipe(warmup=0)
    with pytest.raises(ValueError, match="max_len"):
        Recipe(max_len=2)  # the task needs room for BOS, a token and EOS
    with pytest.raises(ValueError, match="embedding_init"):
        Recipe(embedding_init="xavier")  # notebook 11's checks run too


def test_recipe_trainer_takes_the_recipes_optimizer_schedule_and_clipping():
    recipe = Recipe(d_model=16, num_heads=2, d_ff=32, num_layers=1, lr=1e-3, warmup=4,
                    steps=20, label_smoothing=0.1, clip_norm=0.5, weight_decay=0.1)  # fmt: skip
    model = build_model(recipe)
    trainer = recipe_trainer(model, recipe)
    assert isinstance(trainer, Trainer) and trainer.model is model
    assert (trainer.label_smoothing, trainer.clip_norm) == (0.1, 0.5)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]
    rates = []
    for _ in range(6):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.scheduler.step()
    assert rates == pytest.approx([1e-3 * lr_factor(s, recipe) for s in range(6)])

    class Recording(Trainer):
        pass

    assert type(recipe_trainer(model, recipe, Recording, no_sync=None)) is Recording
