"""Unit tests of benchmarks/model.py (not part of the package): structure only, never a time."""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from transformer_from_scratch.attention import MultiHeadAttention

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "model.py"
spec = importlib.util.spec_from_file_location("benchmarks_model", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 1}
TWO_LAYERS = {**TINY, "num_layers": 2}
CONTRACT = [
    "train_step_ratio_fast",
    "train_step_ratio_fast_vs_shipped",
    "train_step_ratio_scratch",
    "train_step_ratio_scratch_vs_shipped",
    "kv_cache_speedup_4",
    "tiled_memory_ratio_1024",
    "mfu",
    "mfu_measured_peak",
    "gpt_train_step_ratio_hf",
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
        gpt_shape=(2, 8),
    )
    for key in CONTRACT:
        assert positive_finite(result[key]), key
    assert result["device"] == "cpu" and result["torch"] == torch.__version__
    assert result["threads"] == [1]
    rows = result["train_step"]
    assert [(r["batch"], r["src_len"]) for r in rows] == [(2, 4), (3, 5)]
    assert result["train_step_ratio_fast"] == max(r["fast_over_torch"] for r in rows)
    assert result["train_step_ratio_fast_vs_shipped"] == max(
        r["fast_over_torch_shipped"] for r in rows
    )
    for r in rows:
        assert math.isclose(r["fast_over_torch"], r["fast_s"] / r["torch_s"])
        assert math.isclose(r["fast_over_torch_shipped"], r["fast_s"] / r["torch_shipped_s"])
        assert math.isclose(r["scratch_over_torch"], r["scratch_s"] / r["torch_s"])
        assert r["threads"] == 1
        sites = r["dropout_sites"]
        assert sites["fast"] == sites["scratch"] == sites["torch"] == sites["torch_shipped"] - 2
    assert result["tiled_memory"]["tiled_bytes"] < result["tiled_memory"]["naive_bytes"]
    (gpt,) = result["gpt_train_step"]
    assert (gpt["batch"], gpt["context"], gpt["dropout_sites"]) == (2, 8, 13)
    assert result["gpt_train_step_ratio_hf"] == gpt["gpt_over_hf"] == gpt["gpt_s"] / gpt["hf_s"]
    assert result["targets"]["gpt_train_step_ratio_hf"]["goal"] == 0.80
    u = result["mfu_detail"]
    assert u["flops_per_step"] > 0 and positive_finite(u["mfu_plain_adam"])
    measured = u["flops_per_step"] / u["step_s"] / u["peak_flops_measured"]
    assert math.isclose(u["mfu_measured_peak"], measured)
    assert u["mfu"] == u["mfu_measured_peak"] == result["mfu"] == result["mfu_measured_peak"]
    assert u["peak_flops"] == u["peak_flops_measured"]
    assert math.isclose(u["mfu"] / u["mfu_plain_adam"], u["step_s_plain_adam"] / u["step_s"])
    cpu = result["cpu"]
    assert set(cpu["flags"]) == {"avx2", "avx512f", "amx", "fma"}
    if cpu["peak_flops_per_thread"] is None:  # no /proc/cpuinfo here
        assert result["mfu_theoretical_peak"] is None
    else:
        assert u["peak_flops_theoretical"] == cpu["peak_flops_per_thread"] * u["threads"]
        theoretical = u["flops_per_step"] / u["step_s"] / u["peak_flops_theoretical"]
        assert math.isclose(result["mfu_theoretical_peak"], theoretical)
    targets = result["targets"]
    assert targets["train_step_ratio_fast"]["goal"] == 0.85
    assert targets["train_step_ratio_fast"]["met"] == all(
        r["fast_over_torch"] <= 0.85 for r in rows
    )  # the goal holds at every shape and thread count, against the equal-work reference
    assert "train_step_ratio_fast_vs_shipped" not in targets
    assert [r["T"] for r in result["attention"]["rows"]] == [8, 16]
    text = bench.format_results(result)
    assert "train_step_ratio_fast" in text and "bench.json" in text
    assert "train_step_ratio_fast_vs_shipped" in text and "mfu_theoretical_peak" in text
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
    models = bench.train_step_models(torch.device("cpu"), model_kwargs=TINY)
    assert set(models) == {"scratch", "fast", "torch", "torch_shipped"}
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
        model = bench.train_step_models(torch.device("cpu"), model_kwargs=TINY)["fast"]
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
    for key in ("train_step_ratio_fast", "train_step_ratio_fast_vs_shipped",
                "train_step_ratio_scratch", "train_step_ratio_scratch_vs_shipped",
                "kv_cache_speedup_2", "tiled_memory_ratio_64", "mfu", "mfu_measured_peak",
                "mfu_theoretical_peak", "device", "torch", "threads", "cpu",
                "targets"):  # fmt: skip
        assert key in data
    assert "wrote" in capsys.readouterr().out


def test_target_status_marks_met_and_missed():
    assert bench.target_status("train_step_ratio_fast", 0.80) == "target <= 0.85: met"
    assert bench.target_status("train_step_ratio_fast", 0.90) == "target <= 0.85: MISSED"
    assert bench.target_status("mfu", 0.60) == "target >= 0.55: met"
    assert bench.target_status("mfu", 0.50) == "target >= 0.55: MISSED"
    assert bench.target_status("mfu_measured_peak", 0.60) == "target >= 0.55: met"
    assert bench.target_status("train_step_ratio_fast_vs_shipped", 0.80) == ""
    assert bench.target_status("mfu_theoretical_peak", 0.30) == ""
    assert bench.target_status("tiled_memory_ratio_8192", 0.005) == "target <= 0.125: met"
    assert bench.target_status("kv_cache_speedup_512", 7.0) == ""


def _models(kwargs=TWO_LAYERS):
    return bench.train_step_models(torch.device("cpu"), model_kwargs=kwargs)


def test_equal_work_reference_drops_only_the_inner_ffn_dropout():
    models = _models()
    shipped, equal = models["torch_shipped"], models["torch"]
    for layer in bench._reference_layers(equal):
        assert isinstance(layer.dropout, nn.Identity)  # between linear1 and linear2
        for name in ("dropout1", "dropout2") + (
            ("dropout3",) if hasattr(layer, "dropout3") else ()
        ):
            assert isinstance(getattr(layer, name), nn.Dropout) and getattr(layer, name).p > 0
    for layer in bench._reference_layers(shipped):  # a copy was changed, not the shipped one
        assert isinstance(layer.dropout, nn.Dropout) and layer.dropout.p > 0
    for (name, a), b in zip(shipped.named_parameters(), equal.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr()  # its own parameters: separate optimizers


def test_equal_work_reference_computes_our_function():
    models = _models()
    src, tgt_in, _ = bench.reversal_batch(3, 5)
    mask = bench.causal_mask(tgt_in.size(1))
    with torch.no_grad():
        outs = {name: m.eval()(src, tgt_in, tgt_mask=mask) for name, m in models.items()}
    for name in ("scratch", "fast", "torch_shipped"):
        torch.testing.assert_close(outs[name], outs["torch"], atol=1e-5, rtol=1e-5)
    assert outs["torch"].abs().max() > 0.1  # not a trivial output


def test_dropout_sites_equal_ours_and_shipped_has_one_more_per_layer():
    for kwargs in (TINY, TWO_LAYERS):
        models = _models(kwargs)
        sites = {name: bench.dropout_sites(m) for name, m in models.items()}
        layers = 2 * kwargs["num_layers"]  # encoder and decoder layers
        # positional encoding 1; per encoder layer: attention weights, dropout1, dropout2;
        # per decoder layer: self- and cross-attention weights, dropout1, dropout2, dropout3
        assert sites["scratch"] == 1 + 3 * kwargs["num_layers"] + 5 * kwargs["num_layers"]
        assert sites["fast"] == sites["scratch"] == sites["torch"]
        assert sites["torch_shipped"] == sites["torch"] + layers
        assert bench.check_same_work(models, *bench.reversal_batch(2, 4)[:2]) == sites
    no_dropout = _models({**TINY, "dropout_p": 0.0})
    assert {bench.dropout_sites(m) for m in no_dropout.values()} == {0}


def test_dropout_calls_in_training_match_the_sites():
    """What runs: count the calls of dropout modules (p > 0) and of attention with dropout in a
    training forward; ours (from scratch) and the equal-work reference make as many."""
    models = _models()
    src, tgt_in, _ = bench.reversal_batch(2, 4)
    mask = bench.causal_mask(tgt_in.size(1))

    def calls(model: nn.Module) -> int:
        count = []
        handles = [
            m.register_forward_hook(lambda *_: count.append(1))
            for m in model.modules()
            if (isinstance(m, nn.Dropout) and m.p > 0)
            or (isinstance(m, MultiHeadAttention) and m.dropout_p > 0)
            or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
        ]
        try:
            model.train()(src, tgt_in, tgt_mask=mask)
        finally:
            for h in handles:
                h.remove()
        return len(count)

    ours, equal, shipped = (calls(models[k]) for k in ("scratch", "torch", "torch_shipped"))
    assert ours == equal == bench.dropout_sites(models["scratch"]) + 1  # pos runs on src and tgt
    assert shipped == equal + 4  # 2 encoder + 2 decoder layers


def test_check_same_work_fails_on_other_work_or_another_function():
    src, tgt_in, _ = bench.reversal_batch(2, 4)
    models = _models()
    models["torch"] = models["torch_shipped"]  # the shipped one has more dropout than ours
    with pytest.raises(RuntimeError, match="dropout sites differ"):
        bench.check_same_work(models, src, tgt_in)
    models = _models()
    with torch.no_grad():
        # one weight (a bias added to every feature alike would vanish in the post-norm)
        models["torch"].transformer.encoder.layers[0].linear2.weight[0, 0] += 0.5
    with pytest.raises(RuntimeError, match="different functions"):
        bench.check_same_work(models, src, tgt_in)
    models = _models()
    models["torch"].transformer.encoder.layers[0].dropout2 = nn.Identity()  # one site too few
    with pytest.raises(RuntimeError, match="dropout sites differ"):
        bench.check_same_work(models, src, tgt_in)
    models = _models()
    for m in models.values():
        m.train()
    bench.check_same_work(models, src, tgt_in)
    assert all(m.training for m in models.values())  # training mode restored


CPUINFO = """processor\t: 0
model name\t: Some CPU 9000
cpu MHz\t\t: 2400.000
flags\t\t: fpu sse2 fma avx2 {extra}

processor\t: 1
model name\t: Some CPU 9000
cpu MHz\t\t: 2600.500
flags\t\t: fpu sse2 fma avx2 {extra}
"""


def test_cpu_info_peak_per_thread():
    avx512 = bench.cpu_info(CPUINFO.format(extra="avx512f amx_tile amx_bf16"), lscpu="")
    assert avx512["model_name"] == "Some CPU 9000"
    assert avx512["flags"] == {"avx2": True, "avx512f": True, "amx": True, "fma": True}
    assert avx512["amx_flags"] == ["amx_bf16", "amx_tile"]
    assert avx512["mhz"] == 2600.5  # the highest cpu MHz
    assert avx512["fp32_lanes"] == 16 and avx512["fma_units_assumed"] == 2
    assert avx512["peak_flops_per_thread"] == pytest.approx(16 * 2 * 2 * 2600.5e6)
    avx2 = bench.cpu_info(CPUINFO.format(extra=""), lscpu="CPU max MHz:  3500.0000\n")
    assert avx2["flags"]["avx512f"] is False and avx2["flags"]["amx"] is False
    assert avx2["mhz"] == 3500.0 and "lscpu" in avx2["mhz_source"]  # lscpu's max comes first
    assert avx2["peak_flops_per_thread"] == pytest.approx(8 * 2 * 2 * 3500e6)
    unknown = bench.cpu_info("", lscpu="")
    assert unknown["model_name"] is None and unknown["peak_flops_per_thread"] is None
    json.dumps([avx512, avx2, unknown])


def test_mfu_theoretical_peak_uses_the_threads():
    u = bench.model_flops_utilisation(
        2, 3, repeats=1, device="cpu", model_kwargs=TINY, peak_size=32, peak_flops_per_thread=1e11
    )
    assert u["peak_flops_theoretical"] == 1e11 * u["threads"]
    assert math.isclose(
        u["mfu_theoretical_peak"], u["achieved_flops"] / u["peak_flops_theoretical"]
    )
    none = bench.model_flops_utilisation(2, 3, repeats=1, device="cpu", model_kwargs=TINY,
                                         peak_size=32)  # fmt: skip
    assert none["peak_flops_theoretical"] is None and none["mfu_theoretical_peak"] is None


def test_gpt_step_refuses_unequal_work(monkeypatch):
    """The GPT benchmark checks its reference's dropout sites before timing anything."""
    monkeypatch.setattr(bench, "hf_dropout_sites", lambda model: 12)
    with pytest.raises(AssertionError, match="dropout sites differ: ours 13, theirs 12"):
        bench.compare_gpt_train_step(2, 8, repeats=1, device="cpu")
