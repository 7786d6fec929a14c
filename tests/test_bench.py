"""Unit tests of transformer_from_scratch.bench (notebook 02). No wall-clock assertions."""

import json
import math

import pytest
import torch

from transformer_from_scratch.bench import (
    attention_flops,
    attention_memory,
    fit_slope,
    format_suite,
    main,
    make_qkv,
    run_suite,
    time_attention,
)


def test_make_qkv_shapes_and_reproducibility():
    Q, K, V = make_qkv(8, d_k=4, batch=2, num_heads=3, device="cpu")
    assert Q.shape == K.shape == V.shape == (2, 3, 8, 4)
    assert not torch.equal(Q, K)
    assert torch.equal(make_qkv(8, d_k=4, device="cpu")[0], make_qkv(8, d_k=4, device="cpu")[0])


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_time_attention_returns_a_positive_time(impl):
    seconds = time_attention(16, d_k=8, impl=impl, repeats=2, min_time_s=0.0, device="cpu")
    assert 0 < seconds < math.inf


def test_time_attention_restores_the_thread_count():
    before = torch.get_num_threads()
    time_attention(16, d_k=8, repeats=1, min_time_s=0.0, threads=1, device="cpu")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("T", [8, 16, 33])
def test_attention_memory_weights_and_measured_peak(T):
    memory = attention_memory(T, d_k=4, batch=2, num_heads=3, device="cpu")
    assert memory["weights_bytes"] == 2 * 3 * T * T * 4  # float32
    # Scores and weights alive together, plus the context (d_v = d_k = 4).
    assert memory["peak_bytes"] == 2 * 3 * (2 * T * T + T * 4) * 4
    double = attention_memory(T, d_k=4, dtype=torch.float64, device="cpu")
    assert double["weights_bytes"] == T * T * 8
    assert double["peak_bytes"] == (2 * T * T + T * 4) * 8
    theirs = attention_memory(T, d_k=4, impl="torch", device="cpu")
    assert theirs == {"weights_bytes": None, "peak_bytes": None}  # no allocator stats on a CPU


def test_peak_memory_tracker_sees_frees_and_views():
    from transformer_from_scratch.bench import _PeakMemory

    x = torch.randn(64)  # 256 bytes, allocated outside: not counted
    with _PeakMemory() as tracker:
        y = x * 2  # +256
        z = y.view(8, 8)  # a view: +0
        del y, z  # freed: -256
        w = x + 1  # +256, peak still 256
        w.add_(1)  # in place: +0
    assert tracker.peak_bytes == 256
    assert tracker.live_bytes == 256
    del w
    assert tracker.live_bytes == 0


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_attention_flops_counts_both_matmuls(impl):
    assert attention_flops(16, d_k=8, batch=2, num_heads=3, impl=impl) == 2 * 2 * 3 * 16**2 * 16
    assert attention_flops(4096, impl=impl) == 4 * attention_flops(2048, impl=impl)  # meta device


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


def test_run_suite_rows_and_slopes():
    suite = run_suite((32, 8, 16), d_k=4, repeats=1, threads=1, device="cpu")
    rows = suite["rows"]
    assert [r["T"] for r in rows] == [8, 16, 32]  # sorted
    for r in rows:
        assert r["weights_bytes"] == r["T"] ** 2 * 4
        assert r["peak_bytes_ours"] == (2 * r["T"] ** 2 + r["T"] * 4) * 4
        assert r["peak_bytes_torch"] is None  # CUDA only
        assert r["flops"] == 2 * r["T"] ** 2 * 8
        assert r["ours_s"] > 0 and r["torch_s"] > 0
        assert math.isclose(r["ours_over_torch"], r["ours_s"] / r["torch_s"])
    assert math.isclose(suite["slopes"]["weights_bytes"], 2.0)
    assert math.isclose(suite["slopes"]["flops"], 2.0)
    assert suite["config"]["threads"] == 1 and suite["config"]["device"] == "cpu"
    text = format_suite(suite)
    assert "ours/torch" in text and "slope" in text and len(text.splitlines()) == 2 + 3 + 1


def test_main_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "--T",
            "8",
            "16",
            "--d-k",
            "4",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data) == {"config", "rows", "slopes", "slope_from_T"}
    assert [r["T"] for r in data["rows"]] == [8, 16]
    assert data["config"]["d_k"] == 4 and data["config"]["dtype"] == "float32"
    assert data["rows"][1]["weights_bytes"] == 4 * data["rows"][0]["weights_bytes"]
    printed = capsys.readouterr().out
    assert "ours/torch" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_qkv(0), "T must be a positive int"),
        (lambda: make_qkv(8, d_k=2.5), "d_k must be a positive int"),
        (lambda: make_qkv(8, batch=True), "batch must be a positive int"),
        (lambda: time_attention(8, impl="flash"), "impl must be one of"),
        (lambda: time_attention(8, repeats=0), "need repeats >= 1"),
        (lambda: time_attention(8, threads=0), "threads must be a positive int"),
        (lambda: attention_memory(8, impl="naive"), "impl must be one of"),
        (lambda: attention_flops(-1), "T must be a positive int"),
        (lambda: run_suite((8,)), "at least two different"),
        (lambda: run_suite((8, 8)), "at least two different"),
    ],
)
def test_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()
