"""Unit tests of benchmarks/model.py (not part of the package): structure only, never a time."""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "model.py"
spec = importlib.util.spec_from_file_location("benchmarks_model", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 1}
CONTRACT = [
    "train_step_ratio_fast",
    "train_step_ratio_scratch",
    "kv_cache_speedup_4",
    "tiled_memory_ratio_1024",
    "mfu",
]


def positive_finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_run_all_has_the_contract_keys():
    result = bench.run_all(
        shapes=((2, 4), (3, 5)),
        threads=(1,),
        repeats=1,
        decode_tokens=4,
        decode_repeats=1,
        tiled_T=1024,
        attention_T=(8, 16),
        device="cpu",
        model_kwargs=TINY,
        peak_size=64,
    )
    for key in CONTRACT:
        assert positive_finite(result[key]), key
    assert result["device"] == "cpu" and result["torch"] == torch.__version__
    assert result["threads"] == [1]
    rows = result["train_step"]
    assert [(r["batch"], r["src_len"]) for r in rows] == [(2, 4), (3, 5)]
    assert result["train_step_ratio_fast"] == max(r["fast_over_torch"] for r in rows)
    for r in rows:
        assert math.isclose(r["fast_over_torch"], r["fast_s"] / r["torch_s"])
        assert r["threads"] == 1
    assert result["tiled_memory"]["tiled_bytes"] < result["tiled_memory"]["naive_bytes"]
    u = result["mfu_detail"]
    assert u["flops_per_step"] > 0 and positive_finite(u["mfu_plain_adam"])
    assert math.isclose(u["mfu"], u["flops_per_step"] / u["step_s"] / u["peak_flops"])
    assert math.isclose(u["mfu"] / u["mfu_plain_adam"], u["step_s_plain_adam"] / u["step_s"])
    assert [r["T"] for r in result["attention"]["rows"]] == [8, 16]
    text = bench.format_results(result)
    assert "train_step_ratio_fast" in text and "bench.json" in text
    json.dumps(result)  # everything is JSON


def test_worst_ratio_is_over_threads_as_well():
    previous = torch.get_num_threads()
    result = bench.run_all(
        shapes=((2, 3),), threads=(1, 2), repeats=1, decode_tokens=2, decode_repeats=1,
        tiled_T=64, attention_T=(), device="cpu", model_kwargs=TINY, peak_size=32,
    )  # fmt: skip
    assert [r["threads"] for r in result["train_step"]] == [1, 2]
    assert torch.get_num_threads() == previous  # restored
    assert "attention" not in result


def test_train_step_models_share_weights():
    models = bench.three_models(torch.device("cpu"), model_kwargs=TINY)
    src, tgt_in, tgt_out = bench.reversal_batch(2, 5)
    assert src.shape == (2, 5) and tgt_in.shape == tgt_out.shape == (2, 6)
    assert torch.equal(tgt_in[:, 1:], src.flip(1)) and torch.equal(tgt_out[:, :-1], src.flip(1))
    for m in models.values():
        m.eval()
    outs = [m(src, tgt_in) for m in models.values()]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    loss = bench.make_train_step(models["fast"].train(), src, tgt_in, tgt_out)()
    assert loss.dim() == 0 and math.isfinite(loss.item())


def test_fused_adam_step_is_the_plain_step():
    """The MFU's step uses fused Adam: the same update as the plain one, to rounding."""
    src, tgt_in, tgt_out = bench.reversal_batch(2, 5)
    before, after = [], []
    for fused in (False, True):
        model = bench.three_models(torch.device("cpu"), model_kwargs=TINY)["fast"]
        before.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        torch.manual_seed(3)  # the same dropout masks
        bench.make_train_step(model, src, tgt_in, tgt_out, fused=fused)()
        after.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(before[0], before[1])
    assert (after[0] - before[0]).abs().max() > 1e-5  # the step moved the weights
    torch.testing.assert_close(after[1], after[0], atol=1e-7, rtol=1e-6)


def test_compiled_row_structure(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model: model)  # structure only: no compiling
    row = bench.compare_compiled_step(2, 3, repeats=1, device="cpu", model_kwargs=TINY)
    for key in ("compiled_fast_over_compiled_torch", "compiled_fast_over_eager_torch"):
        assert positive_finite(row[key])
    assert row["fast_compile_s"] >= 0 and row["torch_compile_s"] >= 0


def test_interleaved_medians_and_bad_values():
    calls = []
    t = bench.interleaved_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        torch.device("cpu"), repeats=3, warmup=1,
    )  # fmt: skip
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())
    assert calls[2:] == ["a", "b"] * 3  # after the warm-ups, in turns
    with pytest.raises(ValueError, match="repeats"):
        bench.interleaved_medians({"a": lambda: None}, torch.device("cpu"), repeats=0)
    with pytest.raises(ValueError, match="batch"):
        bench.reversal_batch(0, 3)
    with pytest.raises(ValueError, match="threads"):
        bench.run_all(shapes=((2, 3),), threads=(0,), repeats=1, device="cpu", model_kwargs=TINY)
    with pytest.raises(ValueError, match="at least one"):
        bench.run_all(shapes=(), threads=(1,), device="cpu")


def test_shape_argument():
    assert bench._shape("64x8") == (64, 8)
    with pytest.raises(argparse.ArgumentTypeError):
        bench._shape("64-8")


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(
        ["--shapes", "2x3", "--threads", "1", "--repeats", "1", "--decode-tokens", "2",
         "--tiled-T", "64", "--no-attention", "--device", "cpu", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    for key in ("train_step_ratio_fast", "train_step_ratio_scratch", "kv_cache_speedup_2",
                "tiled_memory_ratio_64", "mfu", "device", "torch", "threads"):  # fmt: skip
        assert key in data
    assert "wrote" in capsys.readouterr().out


def test_target_status_marks_met_and_missed():
    assert bench.target_status("train_step_ratio_fast", 0.80) == "target <= 0.85: met"
    assert bench.target_status("train_step_ratio_fast", 0.90) == "target <= 0.85: MISSED"
    assert bench.target_status("mfu", 0.60) == "target >= 0.55: met"
    assert bench.target_status("mfu", 0.50) == "target >= 0.55: MISSED"
    assert bench.target_status("tiled_memory_ratio_8192", 0.005) == "target <= 0.125: met"
    assert bench.target_status("kv_cache_speedup_512", 7.0) == ""
