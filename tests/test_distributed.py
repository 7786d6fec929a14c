"""Unit tests of transformer_from_scratch.distributed (notebook 15): two CPU processes under
torchrun, checked against one process on the concatenated batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from transformer_from_scratch.data import make_batch
from transformer_from_scratch.distributed import TORCHRUN_VARIABLES
from transformer_from_scratch.distributed import LaunchError
from transformer_from_scratch.distributed import data_parallel
from transformer_from_scratch.distributed import main
from transformer_from_scratch.distributed import parse_arguments
from transformer_from_scratch.distributed import process_group
from transformer_from_scratch.distributed import rank_batches
from transformer_from_scratch.distributed import torchrun_environment
from transformer_from_scratch.distributed import train_distributed
from transformer_from_scratch.train import accumulate_gradients
from transformer_from_scratch.train import load_checkpoint
from transformer_from_scratch.tuning import Recipe
from transformer_from_scratch.tuning import build_model
from transformer_from_scratch.tuning import lr_factor
from transformer_from_scratch.tuning import make_optimizer

SIZES = ["--d-model", "16", "--num-heads", "2", "--d-ff", "32", "--num-layers", "1"]
RECIPE = Recipe(d_model=16, num_heads=2, d_ff=32, num_layers=1, lr=1e-3, batch_size=16)


def launch(nproc, *args, env=None):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "transformer_from_scratch.distributed",
        *args,
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def one_process(recipe, data, world_size, steps):
    """The same updates in this process: each step, the ranks' shares concatenated. Returns
    the model and the gradients of the last update (before clipping), by parameter name."""
    model = build_model(recipe)
    optimizer = make_optimizer(model, recipe)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
    streams = [
        rank_batches(data, recipe.batch_size, world_size, r, seed=recipe.seed + 1)
        for r in range(world_size)
    ]
    model.train()
    for _ in range(steps):
        batch = tuple(torch.cat(parts) for parts in zip(*(next(s) for s in streams), strict=True))
        optimizer.zero_grad(set_to_none=True)
        accumulate_gradients(model, [batch])
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
        optimizer.step()
        scheduler.step()
    return model, grads


def test_two_processes_equal_one_on_the_concatenated_batch(tmp_path):
    steps = 3
    done = launch(
        2,
        *SIZES,
        "--batch-size",
        "16",
        "--lr",
        "1e-3",
        "--train-size",
        "64",
        "--steps",
        str(steps),
        "--accum-steps",
        "2",
        "--checkpoint",
        str(tmp_path / "ddp.pt"),
        "--gradients",
        str(tmp_path / "grads.pt"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["steps"] == steps
    ddp_model, meta = load_checkpoint(tmp_path / "ddp.pt")
    assert meta == {"steps": steps, "world_size": 2}
    data = make_batch(64, 8, 12, torch.Generator().manual_seed(0))
    recipe = RECIPE.replace(steps=steps, warmup=steps)  # main: warmup = min(50, steps)
    single, single_grads = one_process(recipe, data, 2, steps)
    # The gradients first: Adam's steps barely depend on the gradient's scale, so equal weights
    # alone would not catch a wrongly weighted gradient (x2, or 1/N per micro-batch).
    ddp_grads = torch.load(tmp_path / "grads.pt")
    assert set(ddp_grads) == set(single_grads)
    for name, grad in single_grads.items():
        torch.testing.assert_close(ddp_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not all(
        torch.allclose(2 * ddp_grads[k], g, rtol=1e-4, atol=1e-6) for k, g in single_grads.items()
    )
    for (name, p), q in zip(single.named_parameters(), ddp_model.parameters(), strict=True):
        if name.endswith("W_k.bias"):
            # The loss does not depend on the key bias (a softmax ignores a shift shared by all
            # of a query's scores): its gradient is rounding noise, which Adam scales to steps
            # of about lr. Bounded by that, not by float rounding.
            torch.testing.assert_close(q, p, rtol=0, atol=2 * steps * recipe.lr, msg=name)
        else:
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    start = build_model(recipe)
    assert (
        max(
            (p - p0).abs().max().item()
            for p, p0 in zip(single.parameters(), start.parameters(), strict=True)
        )
        > 1e-4
    )
    wrong, _ = one_process(recipe.replace(seed=1), data, 2, steps)  # the check can fail
    assert not all(
        torch.allclose(p, q, atol=1e-6)
        for p, q in zip(wrong.parameters(), ddp_model.parameters(), strict=True)
    )


def test_parse_arguments_builds_the_recipe_main_trains():
    recipe, args = parse_arguments([*SIZES, "--steps", "1", "--batch-size", "16", "--lr", "1e-3"])
    assert recipe == RECIPE.replace(steps=1, warmup=1)  # warm-up: min(50, steps)
    assert parse_arguments(["--steps", "200"])[0].warmup == 50
    assert args.train_size == 4096 and args.data_seed == 0 and args.gradients is None
    with pytest.raises(ValueError):
        parse_arguments(["--batch-size", "10", "--accum-steps", "3"])
    every = [
        "--steps", "7", "--batch-size", "12", "--accum-steps", "3", "--lr", "5e-4",
        "--d-model", "24", "--num-heads", "3", "--d-ff", "40", "--num-layers", "1",
        "--dropout", "0.25", "--seed", "9",
    ]  # fmt: skip
    recipe = parse_arguments(every)[0]  # each flag lands in the recipe field it names
    assert (recipe.steps, recipe.batch_size, recipe.accum_steps, recipe.lr) == (7, 12, 3, 5e-4)
    assert (recipe.d_model, recipe.num_heads, recipe.d_ff, recipe.num_layers) == (24, 3, 40, 1)
    assert (recipe.dropout_p, recipe.seed, recipe.warmup) == (0.25, 9, 7)
    with pytest.raises(SystemExit):
        parse_arguments(["--dropout-p", "0.1"])  # the flag is --dropout


def test_launched_without_torchrun_it_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    done = subprocess.run(
        [sys.executable, "-m", "transformer_from_scratch.distributed"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert "torchrun --standalone --nproc_per_node 2" in done.stderr
    assert "RANK" in done.stderr


def test_torchrun_environment_reads_and_checks_the_variables(monkeypatch):
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29500",
    }
    assert torchrun_environment(env) == {"rank": 1, "local_rank": 1, "world_size": 2}
    with pytest.raises(LaunchError, match="WORLD_SIZE"):
        torchrun_environment({k: v for k, v in env.items() if k != "WORLD_SIZE"})
    with pytest.raises(LaunchError, match="outside"):
        torchrun_environment({**env, "RANK": "2"})
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError):
        train_distributed(RECIPE, make_batch(32, 8, 12))
    assert main([]) == 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_process_group_joins_for_the_block_and_leaves_after_an_error(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="-m transformer_from_scratch.gpt"):
        with process_group(module="transformer_from_scratch.gpt"):
            pass
    assert not dist.is_initialized()
    # A group of one process, as torchrun would describe it.
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}
    for name, value in {**world, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with process_group() as (env, device):
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert env == {"rank": 0, "local_rank": 0, "world_size": 1} and device.type == "cpu"
        total = torch.tensor([2.0])
        dist.all_reduce(total)
        assert total.item() == 2.0
        wrapped = data_parallel(nn.Linear(3, 2), device)  # on a CPU: no device_ids
        assert isinstance(wrapped, DistributedDataParallel) and wrapped.device_ids is None
        assert wrapped(torch.ones(1, 3)).shape == (1, 2)
    assert not dist.is_initialized()  # left on the way out
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(RuntimeError, match="a rank fails"):
        with process_group():
            raise RuntimeError("a rank fails")
    assert not dist.is_initialized()  # left after the error too


def test_rank_batches_partition_each_epoch():
    data = make_batch(40, 8, 12, torch.Generator().manual_seed(0))
    ids = torch.arange(40)
    tagged = (*data[:3], ids)  # the last field carries the row index through the sampler
    world, per_epoch = 4, 40 // 8
    shares = [rank_batches(tagged, 8, world, r, seed=3) for r in range(world)]
    epoch = [[next(s)[3] for _ in range(per_epoch)] for s in shares]
    rows = torch.cat([torch.cat(e) for e in epoch])
    assert sorted(rows.tolist()) == list(range(40))  # disjoint and complete
    assert all(b.shape[0] == 2 for e in epoch for b in e)
    second = torch.cat([next(shares[0])[3] for _ in range(per_epoch)])
    assert not torch.equal(second, torch.cat(epoch[0]))  # a new shuffle each epoch
    again = rank_batches(tagged, 8, world, 0, seed=3)
    assert torch.equal(next(again)[3], epoch[0][0])


def test_rank_batches_reject_bad_input():
    data = make_batch(16, 8, 12)
    with pytest.raises(ValueError):
        next(rank_batches(data, 10, 4))  # 10 does not split over 4
    with pytest.raises(ValueError):
        next(rank_batches(data, 8, 2, rank=2))
    with pytest.raises(ValueError):
        next(rank_batches(data, 32, 2))  # fewer sequences than one batch
    with pytest.raises(TypeError):
        next(rank_batches(data, 8.0, 2))
