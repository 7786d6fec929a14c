"""Unit tests of transformer_from_scratch.bench_model (notebook 12). No wall-clock assertions."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

from transformer_from_scratch.bench_model import TorchReference
from transformer_from_scratch.bench_model import best_time
from transformer_from_scratch.bench_model import compare_decoding
from transformer_from_scratch.bench_model import compare_train_step
from transformer_from_scratch.bench_model import format_model_suite
from transformer_from_scratch.bench_model import main
from transformer_from_scratch.bench_model import make_train_step
from transformer_from_scratch.bench_model import never_ending
from transformer_from_scratch.bench_model import reversal_batch
from transformer_from_scratch.bench_model import run_model_suite
from transformer_from_scratch.masks import causal_mask
from transformer_from_scratch.masks import padding_mask
from transformer_from_scratch.model import Transformer
from transformer_from_scratch.tokens import BOS
from transformer_from_scratch.tokens import EOS
from transformer_from_scratch.tokens import PAD

TINY = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 2, "max_len": 32}


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(12, 12, **TINY)


def test_reference_computes_our_function_values_and_gradients():
    ours = tiny_model().eval()
    theirs = TorchReference(ours).eval()
    src, tgt_in, tgt_out = reversal_batch(4, 6, 12, seed=1)
    src[1:, 4:] = PAD  # padded sources, masked
    src_mask = padding_mask(torch.tensor([6, 4, 4, 4]), 6)
    tgt_mask = causal_mask(tgt_in.size(1))
    out_ours = ours(src, tgt_in, src_mask, tgt_mask)
    out_theirs = theirs(src, tgt_in, src_mask, tgt_mask)
    assert_close(out_theirs, out_ours, atol=1e-5, rtol=1e-5)
    out_ours.square().sum().backward()
    out_theirs.square().sum().backward()
    for name in ("src_embed", "tgt_embed", "out_proj"):  # the modules both models share
        assert_close(
            getattr(theirs, name).weight.grad, getattr(ours, name).weight.grad, atol=1e-4, rtol=1e-4
        )
    assert_close(  # the first encoder block's feed-forward, through all of both stacks
        theirs.transformer.encoder.layers[0].linear1.weight.grad,
        ours.encoder.layers[0].ffn[0].weight.grad,
        atol=1e-4,
        rtol=1e-4,
    )


def test_reversal_batch():
    src, tgt_in, tgt_out = reversal_batch(3, 5, 10, seed=2)
    assert src.shape == (3, 5) and tgt_in.shape == tgt_out.shape == (3, 6)
    assert (src >= EOS + 1).all() and (src < 10).all()
    assert (tgt_in[:, 0] == BOS).all() and (tgt_out[:, -1] == EOS).all()
    assert torch.equal(tgt_in[:, 1:], src.flip(1)) and torch.equal(tgt_out[:, :-1], src.flip(1))
    assert torch.equal(reversal_batch(3, 5, 10, seed=2)[0], src)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"batch": 0}, "batch"), ({"src_len": -1}, "src_len"), ({"vocab_size": 3}, "vocab_size")],
)
def test_reversal_batch_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        reversal_batch(**{"batch": 2, "src_len": 4, "vocab_size": 10, **kwargs})


def test_best_time():
    calls = []
    seconds = best_time(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2)
    assert len(calls) == 5 and 0 <= seconds < math.inf
    with pytest.raises(ValueError, match="repeats"):
        best_time(lambda: None, torch.device("cpu"), repeats=0, warmup=0)


def test_train_step_trains():
    model = tiny_model(3)
    src, tgt_in, tgt_out = reversal_batch(8, 5, 12)
    step = make_train_step(model, src, tgt_in, tgt_out)
    before = model.out_proj.weight.detach().clone()
    losses = [step().item() for _ in range(5)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert not torch.equal(before, model.out_proj.weight)


def test_never_ending_is_a_copy_that_never_says_eos():
    model = tiny_model()
    copied = never_ending(model)
    assert copied.out_proj.bias[EOS].item() == -math.inf
    assert math.isfinite(model.out_proj.bias[EOS].item())


def test_compare_functions_on_tiny_configs():
    row = compare_train_step(4, 5, repeats=1, warmup=0, device="cpu", model_kwargs=TINY)
    assert {"ours_s", "torch_s", "ours_over_torch"} <= set(row)
    assert math.isclose(row["ours_over_torch"], row["ours_s"] / row["torch_s"])
    rows = compare_decoding((8, 4), repeats=1, device="cpu", model_kwargs=TINY)
    assert [r["new_tokens"] for r in rows] == [4, 8]
    assert all(r["cached_s"] > 0 and r["uncached_s"] > 0 for r in rows)


def test_run_model_suite_and_format_restore_threads():
    before = torch.get_num_threads()
    suite = run_model_suite((4,), ((2, 3),), repeats=1, threads=1, device="cpu", model_kwargs=TINY)
    assert torch.get_num_threads() == before
    assert suite["config"]["threads"] == 1 and suite["config"]["model"]["d_model"] == 16
    text = format_model_suite(suite)
    assert "ours/torch" in text and "speed-up" in text
    with pytest.raises(ValueError, match="threads"):
        run_model_suite((4,), ((2, 3),), threads=0, device="cpu", model_kwargs=TINY)


def test_main_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--lengths", "2", "3", "--train-shapes", "2x3", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--device", "cpu", "--out", str(out)]) == 0
    suite = json.loads(out.read_text())
    assert [r["new_tokens"] for r in suite["decode"]] == [2, 3]
    assert [(r["batch"], r["src_len"]) for r in suite["train_step"]] == [(2, 3)]
    assert "wrote" in capsys.readouterr().out


def test_main_rejects_bad_train_shapes(tmp_path):
    with pytest.raises(SystemExit):
        main(["--train-shapes", "2by3", "--out", str(tmp_path / "x.json")])
