"""Unit tests of transformer_from_scratch.measure (notebook 02). No wall-clock assertions."""

import math
import os

import pytest
import torch

from transformer_from_scratch import measure
from transformer_from_scratch.measure import count_flops
from transformer_from_scratch.measure import fit_slope
from transformer_from_scratch.measure import operator_times
from transformer_from_scratch.measure import peak_memory
from transformer_from_scratch.measure import stderr_silenced
from transformer_from_scratch.measure import time_call


@pytest.mark.parametrize("T", [16, 100, 256])
def test_peak_memory_of_a_known_allocation(T):
    assert peak_memory(lambda: torch.empty(T, T)) == T * T * 4  # float32
    assert peak_memory(lambda: torch.empty(T, T, dtype=torch.float64), "cpu") == T * T * 8


def test_peak_memory_sees_frees_and_ignores_what_existed_before():
    outside = torch.empty(10_000)  # allocated before the call: not counted

    def fn():
        a = torch.empty(1000)  # +4000
        view = a.view(10, 100)  # a view: +0
        del a, view  # freed: -4000
        b = outside.clone()  # +40000: the peak
        b.add_(outside)  # in place: +0
        del b
        return torch.empty(500)  # +2000, after the peak

    assert peak_memory(fn) == 40_000


def test_peak_memory_of_our_attention_is_scores_weights_and_context():
    from transformer_from_scratch.attention import scaled_dot_product_attention

    T, d = 64, 8
    Q, K, V = (torch.randn(2, 3, T, d) for _ in range(3))
    with torch.no_grad():
        peak = peak_memory(lambda: scaled_dot_product_attention(Q, K, V))
    assert peak == 2 * 3 * (2 * T * T + T * d) * 4


def test_peak_memory_leaves_stderr_usable(capfd):
    peak_memory(lambda: torch.empty(8))
    import sys

    print("still here", file=sys.stderr)
    assert "still here" in capfd.readouterr().err


def test_peak_memory_rejects_other_devices():
    with pytest.raises(ValueError, match="'cpu' or a 'cuda' device"):
        peak_memory(lambda: None, "meta")


def test_count_flops_of_a_matmul_and_attention():
    a, b = torch.empty(3, 5, device="meta"), torch.empty(5, 7, device="meta")
    assert count_flops(lambda: a @ b) == 2 * 3 * 5 * 7
    Q = torch.empty(2, 4, 16, 8, device="meta")
    flops = count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(Q, Q, Q))
    assert flops == 2 * 2 * 4 * 16**2 * (8 + 8)
    assert count_flops(lambda: torch.ones(3) + 1) == 0  # only matrix products are counted


def test_time_call_returns_the_median_of_the_timed_calls(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 14.0, 20.0, 22.0])  # three calls: 1, 4 and 2 seconds
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    calls = []
    # The median, 2: not the mean (7/3) nor the longest call (4).
    assert time_call(lambda: calls.append(1), warmup=2, repeats=3) == 2.0
    assert len(calls) == 2 + 3  # warm-up calls are made, not timed


def test_time_call_waits_for_queued_work_after_the_warmup_and_each_call(monkeypatch):
    # Each call queues work, as a GPU's asynchronous kernels do; the fake clock moves only when
    # _synchronize waits for the queue.
    work = iter([5.0, 1.0, 4.0, 2.0])  # the warm-up call, then three timed calls
    fake = {"now": 0.0, "queued": 0.0}

    def queue_work():
        fake["queued"] += next(work)

    def synchronize():
        fake["now"] += fake["queued"]
        fake["queued"] = 0.0

    monkeypatch.setattr(measure.time, "perf_counter", lambda: fake["now"])
    monkeypatch.setattr(measure, "_synchronize", synchronize)
    # Without the wait after the warm-up the first call would take 6 s (median 4); without the
    # wait after each call every call would take 0 s.
    assert time_call(queue_work, warmup=1, repeats=3) == 2.0


def test_time_call_measures_real_time():
    seconds = time_call(lambda: sum(range(1000)), warmup=0, repeats=1)
    assert 0 < seconds < math.inf


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"repeats": 0}, ValueError, "repeats must be at least 1"),
        ({"warmup": -1}, ValueError, "warmup must be at least 0"),
        ({"repeats": 2.5}, TypeError, "repeats must be an int"),
        ({"warmup": True}, TypeError, "warmup must be an int"),
    ],
)
def test_time_call_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        time_call(lambda: None, **kwargs)


def test_fit_slope_recovers_exponents():
    xs = [64, 128, 256, 512]
    assert math.isclose(fit_slope(xs, [3 * x**2 for x in xs]), 2.0)
    assert math.isclose(fit_slope(xs, [x**1.5 for x in xs]), 1.5)
    assert math.isclose(fit_slope([1, 2], [5, 5]), 0.0, abs_tol=1e-12)


@pytest.mark.parametrize(
    "xs, ys, message",
    [
        ([1], [1], "length >= 2"),
        ([1, 2], [1, 2, 3], "got 2 and 3"),
        ([0, 2], [1, 2], "positive"),
        ([1, 2], [1, -2], "positive"),
        ([2, 2], [1, 2], "two different x"),
    ],
)
def test_fit_slope_bad_input(xs, ys, message):
    with pytest.raises(ValueError, match=message):
        fit_slope(xs, ys)


def test_operator_times_finds_the_matmul_and_counts_per_call():
    a = torch.randn(256, 256)
    calls = []
    times = operator_times(lambda: calls.append(a @ a), repeats=3, warmup=1)
    assert len(calls) == 4  # one warm-up and three profiled calls
    assert times["aten::mm"] > 0
    assert max(times, key=times.get) == "aten::mm"  # the matmul is what this function does
    assert all(ms >= 0 for ms in times.values())


def test_operator_times_prints_nothing_to_stderr(capfd):
    operator_times(lambda: torch.randn(8) @ torch.randn(8), repeats=1)
    assert capfd.readouterr().err == ""


def test_operator_times_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        operator_times(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        operator_times(lambda: None, warmup=-1)
    with pytest.raises(TypeError, match="repeats"):
        operator_times(lambda: None, repeats=2.0)


def test_stderr_silenced_drops_what_the_process_writes_to_descriptor_2(capfd):
    with stderr_silenced():
        os.write(2, b"from C++ code\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_dropout_sites_counts_dropout_modules_and_attention_weights():
    from torch import nn

    from transformer_from_scratch.measure import dropout_sites
    from transformer_from_scratch.model import Transformer
    from transformer_from_scratch.regularization import add_drop_path

    model = Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, num_layers=2, dropout_p=0.1)
    # pos: 1; encoder blocks: 2 x (2 residual + 1 attention); decoder: 2 x (3 + 2)
    assert dropout_sites(model) == 1 + 2 * 3 + 2 * 5
    assert dropout_sites(Transformer(12, 12, d_model=16, num_heads=2, d_ff=32, dropout_p=0.0)) == 0
    theirs = nn.MultiheadAttention(16, 2, dropout=0.2)
    assert dropout_sites(nn.ModuleList([theirs, nn.Dropout(0.0), nn.Dropout(0.5)])) == 2
    assert dropout_sites(add_drop_path(model, 0.5)) == dropout_sites(model)  # BranchDrop wraps
