"""Unit tests of benchmarks/attention.py (not part of the package). No wall-clock assertions."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "attention.py"
spec = importlib.util.spec_from_file_location("benchmarks_attention", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_make_qkv_shapes_and_reproducibility():
    Q, K, V = bench.make_qkv(8, d_k=4, batch=2, num_heads=3)
    assert Q.shape == K.shape == V.shape == (2, 3, 8, 4)
    assert not torch.equal(Q, K)
    assert torch.equal(bench.make_qkv(8, d_k=4)[0], bench.make_qkv(8, d_k=4)[0])


def test_run_suite_counts_memory_and_flops():
    suite = bench.run_suite(
        (32, 8, 16), d_k=4, batch=2, num_heads=3, repeats=1, threads=1, device="cpu"
    )
    rows = suite["rows"]
    assert [r["T"] for r in rows] == [8, 16, 32]  # sorted
    for r in rows:
        T = r["T"]
        assert r["weights_bytes"] == 2 * 3 * T * T * 4
        # Our function holds the scores, the weights and the context at its peak.
        assert r["peak_bytes_ours"] == 2 * 3 * (2 * T * T + T * 4) * 4
        assert 0 < r["peak_bytes_torch"]  # measured on the CPU as well
        assert r["flops"] == 2 * 3 * 2 * T**2 * (4 + 4)
        assert math.isclose(r["ours_over_torch"], r["ours_s"] / r["torch_s"])
    assert math.isclose(suite["slopes"]["weights_bytes"], 2.0)
    assert math.isclose(suite["slopes"]["flops"], 2.0)
    assert suite["config"]["threads"] == 1 and suite["config"]["device"] == "cpu"
    text = bench.format_suite(suite)
    assert "ours/torch" in text and "slope" in text and len(text.splitlines()) == 2 + 3 + 1


def test_run_suite_restores_the_thread_count():
    before = torch.get_num_threads()
    bench.run_suite((8, 16), d_k=4, repeats=1, threads=1, device="cpu")
    assert torch.get_num_threads() == before


def test_main_writes_the_json_of_make_bench(tmp_path, capsys):
    out = tmp_path / "bench-attention.json"
    argv = [
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
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"config", "rows", "slopes", "slope_from_T"}
    assert set(data["config"]) == {
        "d_k",
        "batch",
        "num_heads",
        "dtype",
        "device",
        "threads",
        "repeats",
        "torch",
    }
    row_keys = {
        "T",
        "ours_s",
        "torch_s",
        "ours_over_torch",
        "weights_bytes",
        "peak_bytes_ours",
        "peak_bytes_torch",
        "flops",
    }
    assert all(set(row) == row_keys for row in data["rows"])
    assert set(data["slopes"]) == {"ours_s", "torch_s", "weights_bytes", "peak_bytes_ours", "flops"}
    assert [r["T"] for r in data["rows"]] == [8, 16]
    assert data["config"]["d_k"] == 4 and data["config"]["dtype"] == "float32"
    assert data["rows"][1]["weights_bytes"] == 4 * data["rows"][0]["weights_bytes"]
    printed = capsys.readouterr().out
    assert "ours/torch" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bench.make_qkv(0), "T must be a positive int"),
        (lambda: bench.make_qkv(8, d_k=2.5), "d_k must be a positive int"),
        (lambda: bench.make_qkv(8, batch=True), "batch must be a positive int"),
        (lambda: bench.run_suite((8,)), "at least two different"),
        (lambda: bench.run_suite((8, 8)), "at least two different"),
        (lambda: bench.run_suite((8, 16), repeats=0), "repeats must be a positive int"),
        (lambda: bench.run_suite((8, 16), threads=0), "threads must be a positive int"),
    ],
)
def test_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()
