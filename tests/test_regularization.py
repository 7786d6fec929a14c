"""Unit tests of transformer_from_scratch.regularization (notebook 15): stochastic depth."""

import pytest
import torch
from torch import nn

from transformer_from_scratch.model import Transformer
from transformer_from_scratch.regularization import BranchDrop
from transformer_from_scratch.regularization import DropPath
from transformer_from_scratch.regularization import add_drop_path
from transformer_from_scratch.regularization import drop_path


def small_model(dropout_p=0.0):
    return Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, num_layers=2, dropout_p=dropout_p)


def test_drop_path_keeps_the_expectation_and_drops_whole_samples():
    x = torch.randn(40000, 3, 4)
    y = drop_path(x, 0.25, generator=torch.Generator().manual_seed(0))
    assert y.shape == x.shape
    kept = (y != 0).flatten(1).any(1)
    torch.testing.assert_close(y[kept], x[kept] / 0.75)  # kept samples scaled, whole
    assert bool((y[~kept] == 0).all())  # dropped samples entirely zero
    assert abs((~kept).float().mean().item() - 0.25) < 0.01
    assert (y.mean(0) - x.mean(0)).abs().max().item() < 0.03  # E[y] = x


def test_drop_path_is_the_identity_in_eval_and_at_p_zero():
    x = torch.randn(8, 5, 4)
    assert drop_path(x, 0.5, training=False) is x
    assert drop_path(x, 0.0) is x
    module = DropPath(0.5).eval()
    assert torch.equal(module(x), x)
    assert "p=0.5" in repr(module)


def test_drop_path_is_reproducible_with_a_generator_and_varies_without():
    x = torch.randn(64, 2)
    a = drop_path(x, 0.5, generator=torch.Generator().manual_seed(1))
    b = drop_path(x, 0.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert not torch.equal(DropPath(0.5).train()(x), x)


def test_drop_path_rejects_bad_input():
    with pytest.raises(ValueError):
        drop_path(torch.randn(2, 3), 1.0)
    with pytest.raises(ValueError):
        DropPath(-0.1)
    with pytest.raises(TypeError):
        drop_path(torch.arange(6).view(2, 3), 0.1)
    with pytest.raises(TypeError):
        drop_path([1.0, 2.0], 0.1)


def test_branch_drop_runs_the_dropout_then_drop_path():
    inner = nn.Dropout(0.3)
    branch = BranchDrop(inner, 0.2)
    assert branch.p == 0.3 and branch.drop_path.p == 0.2
    x = torch.randn(4, 3, 8)
    assert torch.equal(branch.eval()(x), x)


def test_add_drop_path_rates_grow_with_depth_and_keep_eval_outputs():
    torch.manual_seed(0)
    model = small_model().eval()
    src = torch.randint(3, 12, (2, 6))
    tgt = torch.randint(3, 12, (2, 5))
    before = model(src, tgt)
    add_drop_path(model, 0.4)
    rates = [m.p for m in model.modules() if isinstance(m, DropPath)]
    assert rates == [0.2, 0.2, 0.4, 0.4, 0.2, 0.2, 0.2, 0.4, 0.4, 0.4]
    torch.testing.assert_close(model.eval()(src, tgt), before)
    assert not torch.allclose(model.train()(src, tgt), before)
    add_drop_path(model, 0.0)  # again: new rates, no second wrapping
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, DropPath))
    assert sum(isinstance(m, BranchDrop) for m in model.modules()) == 10


def test_add_drop_path_rejects_a_model_without_stacks_and_bad_rates():
    with pytest.raises(ValueError, match="no Encoder or Decoder"):
        add_drop_path(nn.Linear(2, 2), 0.1)
    with pytest.raises(ValueError):
        add_drop_path(small_model(), 1.5)
    with pytest.raises(TypeError):
        add_drop_path(small_model(), "0.1")
