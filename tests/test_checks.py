"""Unit tests of transformer_from_scratch.checks (notebook 00): one policy for bad input,
TypeError for a wrong type and ValueError for a wrong value, with the name in the message."""

import math

import numpy as np
import pytest
import torch

from transformer_from_scratch.checks import check_bool
from transformer_from_scratch.checks import check_broadcast
from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.checks import check_tensor
from transformer_from_scratch.checks import checking
from transformer_from_scratch.checks import validated


def test_check_int_accepts_integers_of_every_kind():
    assert check_int("n", 3) == 3
    assert check_int("n", np.int64(4)) == 4 and type(check_int("n", np.int64(4))) is int
    assert check_int("n", torch.tensor(5)) == 5
    assert check_int("n", 2, minimum=2) == 2


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (True, TypeError, "n must be an int, got the bool True"),
        (2.0, TypeError, "n must be an int, got float"),
        ("2", TypeError, "n must be an int"),
        (1, ValueError, "n must be at least 2, got 1"),
    ],
)
def test_check_int_rejects(value, error, match):
    with pytest.raises(error, match=match):
        check_int("n", value, minimum=2)


def test_check_float_intervals_open_and_closed():
    assert check_float("x", 1) == 1.0 and type(check_float("x", 1)) is float
    assert check_float("x", 0.0, 0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match=r"x must be in \(0, 1\]"):
        check_float("x", 0.0, 0.0, 1.0, low_open=True)
    with pytest.raises(ValueError, match="x must be < 1"):
        check_float("x", 1.0, high=1.0, high_open=True)
    with pytest.raises(ValueError, match="x must be >= 0"):
        check_float("x", -0.5, low=0.0)
    with pytest.raises(ValueError, match="finite"):
        check_float("x", math.nan)
    with pytest.raises(TypeError, match="x must be a number"):
        check_float("x", True)
    with pytest.raises(TypeError, match="x must be a number"):
        check_float("x", "0.5")


def test_check_probability_is_half_open():
    assert check_probability("p", 0.0) == 0.0 and check_probability("p", 0.999) == 0.999
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        check_probability("p", 1.0)
    with pytest.raises(ValueError, match="p must be in"):
        check_probability("p", -0.1)


def test_check_bool():
    assert check_bool("flag", False) is False
    with pytest.raises(TypeError, match="flag must be a bool, got int 1"):
        check_bool("flag", 1)


def test_check_choice_returns_the_value_as_given_and_matches_exactly():
    assert check_choice("optimizer", "adamw", ("adam", "adamw")) == "adamw"
    # Case matters: a value is stored as given and compared exactly later, so "Adam" must not
    # pass here (it once did, lower-cased in the return value but kept raw in the config).
    with pytest.raises(ValueError, match="did you mean 'adam'"):
        check_choice("optimizer", "Adam", ("adam", "adamw"))
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; expected one of \['adam'"):
        check_choice("optimizer", "sgd", ("adam", "adamw"))
    with pytest.raises(TypeError, match="optimizer must be a str"):
        check_choice("optimizer", None, ("adam", "adamw"))


def test_check_tensor_kinds_and_ranks():
    x = torch.zeros(2, 3)
    assert check_tensor("x", x, dim=2, kind="float") is x
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1.0])
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        check_tensor("x", torch.zeros(2, dtype=torch.long), kind="float")
    with pytest.raises(TypeError, match="x must hold integers"):
        check_tensor("x", torch.zeros(2, dtype=torch.bool), kind="int")
    with pytest.raises(ValueError, match=r"x must be 3-D, got shape \(2, 3\)"):
        check_tensor("x", x, dim=3)


def test_check_broadcast():
    check_broadcast("mask", None, (2, 4, 4), "(B, T, T)")
    check_broadcast("mask", torch.ones(1, 4, dtype=torch.bool), (2, 4, 4), "(B, T, T)")
    with pytest.raises(ValueError, match=r"mask of shape \(3, 4\) does not broadcast .*; try"):
        check_broadcast("mask", torch.ones(3, 4), (2, 4, 4), "(B, T, T)", hint="try")
    with pytest.raises(TypeError, match="mask must be a torch.Tensor or None"):
        check_broadcast("mask", [[True]], (2, 4, 4), "(B, T, T)")


def test_validated_switches_inner_checks_off_and_restores_them():
    assert checking()
    with validated():
        assert not checking()
        with validated():
            assert not checking()
        assert not checking()
    assert checking()
    with pytest.raises(RuntimeError), validated():
        raise RuntimeError("the flag is reset on the way out")
    assert checking()


def test_checks_and_validated_do_not_break_a_compiled_graph():
    """Under torch.compile, checking() is off and validated() sets nothing, so a model compiles to
    one graph; reading or setting the context variable there was a graph break in every attention
    call (15 graphs for a 2-layer Transformer before the fix)."""
    import torch._dynamo as dynamo

    from transformer_from_scratch import Transformer
    from transformer_from_scratch import TransformerConfig
    from transformer_from_scratch import causal_mask

    torch.manual_seed(0)
    config = TransformerConfig(11, 11, d_model=16, num_heads=2, d_ff=32, num_layers=2, max_len=16)
    model = Transformer(config).eval()
    src, tgt = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 6))
    explained = dynamo.explain(model)(src, tgt, None, causal_mask(6))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    def inner_check_runs() -> bool:  # eager: validated() still switches the checks off
        with validated():
            return checking()

    assert checking() and not inner_check_runs() and checking()
