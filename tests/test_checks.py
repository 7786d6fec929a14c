"""Unit tests of transformer_from_scratch.checks (notebook 00): one policy for bad input,
TypeError for a wrong type and ValueError for a wrong value, with the name in the message."""

import math

import numpy as np
import pytest
import torch

from transformer_from_scratch.checks import check_bool
from transformer_from_scratch.checks import check_choice
from transformer_from_scratch.checks import check_float
from transformer_from_scratch.checks import check_int
from transformer_from_scratch.checks import check_mask
from transformer_from_scratch.checks import check_probability
from transformer_from_scratch.checks import check_tensor
from transformer_from_scratch.checks import checking
from transformer_from_scratch.checks import validated

# torch.compile's graph counts below were measured with torch 2.13. torch 2.5.1, the oldest the
# course supports, does not trace into validated() (a contextlib wrapper, which its Dynamo skips):
# there the model of _explain_small_transformer falls into 21 graphs.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
SKIP_BEFORE_2_13 = pytest.mark.skipif(
    TORCH_VERSION < (2, 13),
    reason="graph counts measured from torch 2.13 on; torch 2.5.1's Dynamo skips validated() "
    "(21 graphs)",
)


def test_check_int_accepts_integers_of_every_kind():
    assert check_int("n", 3) == 3
    assert check_int("n", np.int64(4)) == 4 and type(check_int("n", np.int64(4))) is int
    assert check_int("n", torch.tensor(5)) == 5 and type(check_int("n", torch.tensor(5))) is int
    assert check_int("n", torch.tensor(5, dtype=torch.int32)) == 5
    assert check_int("n", 2, minimum=2) == 2


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (True, TypeError, "n must be an int, got the bool True"),
        # NumPy's bool by name: under NumPy 1, operator.index(np.True_) is 1 (a hidden warning),
        # and the message must not depend on NumPy's repr (np.True_ in 2, True in 1)
        (np.True_, TypeError, "^n must be an int, got the bool True$"),
        (np.False_, TypeError, "^n must be an int, got the bool False$"),
        (torch.tensor(True), TypeError, r"n must be an int, got the bool tensor\(True\)"),
        (torch.tensor([True]), TypeError, "n must be an int, got the bool"),
        (torch.tensor([7]), TypeError, r"n must be an int, got a tensor of shape \(1,\)"),
        (torch.tensor(7.0), TypeError, "n must be an int, got Tensor"),
        (np.float64(2.0), TypeError, "n must be an int, got float64"),
        (2.0, TypeError, "n must be an int, got float"),
        ("2", TypeError, "n must be an int"),
        (1, ValueError, "n must be at least 2, got 1"),
        (torch.tensor(1), ValueError, "n must be at least 2, got 1"),
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


@pytest.mark.parametrize(
    "value",
    [
        0.25,
        np.float32(0.25),
        np.float64(0.25),
        np.float16(0.25),
        torch.tensor(0.25),
        torch.tensor(0.25, dtype=torch.float64),
        torch.tensor(0.25, dtype=torch.bfloat16),
    ],
)
def test_check_float_accepts_floating_numbers_of_every_kind(value):
    # the same kinds as check_int: Python, NumPy scalar, 0-d tensor; returned as a Python float
    checked = check_float("x", value, 0.0, 1.0)
    assert checked == 0.25 and type(checked) is float


@pytest.mark.parametrize("value", [3, np.int64(3), torch.tensor(3)])
def test_check_float_accepts_what_check_int_accepts(value):
    assert check_float("x", value) == 3.0 and type(check_float("x", value)) is float


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.True_, "^x must be a number, got the bool True$"),
        (True, "^x must be a number, got the bool True$"),
        (torch.tensor(True), r"got a tensor of dtype torch.bool and shape \(\)"),
        (torch.tensor([0.5]), r"got a tensor of dtype torch.float32 and shape \(1,\)"),
        (torch.tensor(0.5 + 0j), "x must be a number, got a tensor of dtype torch.complex"),
        (np.complex64(0.5), "x must be a number, got complex64"),
        (np.array([0.5]), "x must be a number, got ndarray"),
    ],
)
def test_check_float_rejects_bools_and_non_scalars(value, match):
    with pytest.raises(TypeError, match=match):
        check_float("x", value)


def test_check_float_checks_the_value_of_numpy_and_tensor_numbers():
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.5"):
        check_probability("p", np.float32(1.5))
    with pytest.raises(ValueError, match="finite"):
        check_float("x", torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="finite"):
        check_float("x", np.float32("nan"))


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
    with pytest.raises(TypeError, match="flag must be a bool"):  # a NumPy bool is not a bool
        check_bool("flag", np.True_)


def test_check_choice_returns_the_value_as_given_and_matches_exactly():
    assert check_choice("optimizer", "adamw", ("adam", "adamw")) == "adamw"
    # Case matters: a value is stored as given and compared exactly later, so "Adam" must not
    # pass here (it once did, lower-cased in the return value but kept raw in the config).
    with pytest.raises(ValueError, match="did you mean 'adam'"):
        check_choice("optimizer", "Adam", ("adam", "adamw"))
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; expected one of \['adam'"):
        check_choice("optimizer", "sgd", ("adam", "adamw"))
    with pytest.raises(TypeError, match=r"optimizer must be a str, one of \[.*\], got NoneType$"):
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
    with pytest.raises(ValueError, match="kind must be 'float', 'int' or None, got 'floats'"):
        check_tensor("x", x, kind="floats")  # a misspelt kind would otherwise check nothing


def test_check_mask_shape_and_type():
    check_mask("mask", None, (2, 4, 4), "(B, T, T)")
    check_mask("mask", torch.ones(1, 4, dtype=torch.bool), (2, 4, 4), "(B, T, T)")
    check_mask("mask", torch.zeros(4, 4), (2, 4, 4), "(B, T, T)")  # floating: added
    with pytest.raises(ValueError, match=r"mask of shape \(3, 4\) does not broadcast .*; try"):
        check_mask("mask", torch.ones(3, 4), (2, 4, 4), "(B, T, T)", hint="try")
    with pytest.raises(TypeError, match="mask must be a torch.Tensor or None"):
        check_mask("mask", [[True]], (2, 4, 4), "(B, T, T)")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.complex64])
def test_check_mask_refuses_masks_that_are_neither_bool_nor_floating(dtype):
    mask = torch.ones(4, 4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"src_mask must be bool .* floating .* got dtype {dtype}"):
        check_mask("src_mask", mask, (2, 4, 4), "(B, T, T)")
    with pytest.raises(TypeError, match="src_mask must be bool"):  # shape=None: the dtype only
        check_mask("src_mask", mask)
    check_mask("src_mask", torch.ones(9, 9, dtype=torch.bool))  # no shape to broadcast to


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


def _explain_small_transformer():
    """torch._dynamo.explain of a 2-layer Transformer's forward pass (graphs, breaks)."""
    import torch._dynamo as dynamo

    from transformer_from_scratch import Transformer
    from transformer_from_scratch import TransformerConfig
    from transformer_from_scratch import causal_mask

    torch.manual_seed(0)
    config = TransformerConfig(11, 11, d_model=16, num_heads=2, d_ff=32, num_layers=2, max_len=16)
    model = Transformer(config).eval()
    src, tgt = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 6))
    dynamo.reset()
    return dynamo.explain(model)(src, tgt, None, causal_mask(6))


@SKIP_BEFORE_2_13
@pytest.mark.parametrize("method", ["get", "set", "reset"])
def test_dynamo_cannot_trace_a_context_variable(method):
    """The reason checking() and validated() leave the variable alone under torch.compile: each
    of get, set and reset is a graph break (torch 2.13). The tensor work before the call makes
    the break visible to explain(): a break before any graph is not counted."""
    import contextvars

    import torch._dynamo as dynamo

    flag = contextvars.ContextVar("flag", default=False)
    token = flag.set(False)

    def uses_the_variable(x):
        y = x * 2
        if method == "get":
            y = y + flag.get()
        elif method == "set":
            flag.set(True)
        else:
            flag.reset(token)
        return y + 1

    dynamo.reset()
    explained = dynamo.explain(uses_the_variable)(torch.ones(3))
    assert explained.graph_break_count == 1 and explained.graph_count == 2
    assert f"method `{method}` of class `ContextVar`" in str(explained.break_reasons[0].reason)


@SKIP_BEFORE_2_13
def test_checks_and_validated_do_not_break_a_compiled_graph():
    """Under torch.compile, checking() is off and validated() sets nothing, so a model compiles to
    one graph from torch 2.13 on (older releases break it elsewhere, see SKIP_BEFORE_2_13)."""
    explained = _explain_small_transformer()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons

    def inner_check_runs() -> bool:  # eager: validated() still switches the checks off
        with validated():
            return checking()

    assert checking() and not inner_check_runs() and checking()


@SKIP_BEFORE_2_13
def test_a_checking_that_reads_the_variable_under_compile_breaks_the_graph(monkeypatch):
    """The count above can fail: with a checking() that reads the variable and a validated() that
    sets it under the compiler too, the same model falls into more than 20 graphs (torch 2.13)."""
    import contextlib
    import sys

    from transformer_from_scratch import checks

    def naive_checking() -> bool:
        return not checks._VALIDATED.get()

    @contextlib.contextmanager
    def naive_validated():
        token = checks._VALIDATED.set(True)
        try:
            yield
        finally:
            checks._VALIDATED.reset(token)

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("transformer_from_scratch."):
            continue
        if module is checks:
            continue
        if getattr(module, "checking", None) is checks.checking:
            monkeypatch.setattr(module, "checking", naive_checking)
        if getattr(module, "validated", None) is checks.validated:
            monkeypatch.setattr(module, "validated", naive_validated)
    explained = _explain_small_transformer()
    assert explained.graph_count > 20
    reasons = " ".join(str(r.reason) for r in explained.break_reasons)
    assert "of class `ContextVar`" in reasons
