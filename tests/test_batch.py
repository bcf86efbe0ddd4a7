"""``data.batch_size=auto`` (lmtrain/training/batch.py): the largest micro-batch whose counted peak fits the card."""

from __future__ import annotations

import pytest
import torch

from lmtrain.errors import InputError
from lmtrain.training import batch, memory
from tests.conftest import make_cfg

H200 = 150_121_545_728  # torch.cuda.get_device_properties(0).total_memory on the H200 of the benchmarks


@pytest.mark.parametrize(
    "overrides, world",
    [
        (["model=opt-1.3b", "data.seq_len=1024"], 1),
        (["model=opt-1.3b", "data.seq_len=1024", "speed=fp8"], 1),
        (["model=opt-125m", "data.seq_len=1024", "model.max_seq_len=1024"], 1),
        (["model=opt-1.3b", "data.seq_len=2048", "strategy=fsdp", "strategy.activation_checkpointing=full"], 8),
    ],
    ids=["1.3b", "1.3b-fp8", "125m", "1.3b-fsdp-full"],
)
def test_auto_takes_the_largest_size_whose_counted_peak_fits(tmp_path, overrides, world):
    cfg = make_cfg(["trainer=gpu", *overrides], tmp_path)
    cfg.module.compile = True  # what speed.adapt makes of auto on a GPU
    size, peak = batch.largest(cfg, memory_bytes=H200, world=world, node=world)
    strategy, ac = batch.planner_strategy(cfg)

    def counted(b):
        trial = cfg.copy()
        trial.data.batch_size = b
        return memory.peak(trial, world, world, strategy, ac)

    assert peak == counted(size) <= memory.MARGIN * H200 < counted(size + 1)
    assert size > 1


def test_auto_keeps_the_global_batch_by_choosing_a_size_that_divides_it(tmp_path):
    cfg = make_cfg(["trainer=gpu", "model=opt-1.3b", "data.seq_len=1024", "global_batch_size=96"], tmp_path)
    cfg.module.compile = True
    size, _ = batch.largest(cfg, memory_bytes=H200, world=2, node=2)
    free, _ = batch.largest(make_cfg(["trainer=gpu", "model=opt-1.3b", "data.seq_len=1024"], tmp_path), memory_bytes=H200, world=2, node=2)
    assert 48 % size == 0 and size <= free
    assert not any(48 % b == 0 for b in range(size + 1, free + 1))  # no larger divisor of 96 / 2 ranks fits


def test_the_line_says_the_size_set_and_the_peak_counted_for_it(tmp_path, monkeypatch):
    """resolve() on a GPU (its memory faked as the H200's): the size in the line is the one the config now holds, the
    GiB counted is memory.peak at that size, and the card's total and the margin are the ones searched with."""
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=H200))
    cfg = make_cfg(["trainer=gpu", "trainer.devices=1", "model=opt-1.3b", "data.seq_len=1024", "global_batch_size=96"], tmp_path)
    cfg.module.compile = True
    line = batch.resolve(cfg)
    size = cfg.data.batch_size
    counted = memory.peak(cfg, 1, 1, "ddp", "none")
    assert isinstance(size, int) and 96 % size == 0
    assert line == (
        f"data.batch_size=auto: {size} sequences of 1024 tokens per GPU, {counted / 2**30:.1f} GiB counted of "
        f"{H200 / 2**30:.1f} (lmtrain.plan, {1 - memory.MARGIN:.0%} kept free); {96 // size} micro-batch(es) per step "
        "for global_batch_size=96"
    )
    assert batch.resolve(cfg) is None  # a number now: nothing more to choose


def test_a_global_batch_that_does_not_divide_over_the_ranks_is_one_line(tmp_path):
    cfg = make_cfg(["trainer=gpu", "model=opt-125m", "data.seq_len=1024", "model.max_seq_len=1024", "global_batch_size=12"], tmp_path)
    with pytest.raises(
        InputError, match=r"data.batch_size=auto with global_batch_size=12: the global batch does not divide over the world size 8"
    ):
        batch.largest(cfg, memory_bytes=H200, world=8, node=8)


def test_a_model_that_fits_no_sequence_is_one_line(tmp_path):
    cfg = make_cfg(["trainer=gpu", "model=opt-175b", "data.seq_len=2048"], tmp_path)
    with pytest.raises(
        InputError, match=r"data.batch_size=auto: not even one sequence of data.seq_len=2048 fits 74.5 GiB .*\(strategy=fsdp\)"
    ):
        batch.largest(cfg, memory_bytes=80e9, world=8, node=8)


def test_auto_on_the_cpu_and_in_the_planner_asks_for_a_number(tmp_path, dataset_dir):
    """On the CPU there is no card to fill: the run refuses auto in one line (exit 2) and writes nothing; the planner,
    which counts a given size, asks for one too."""
    from lmtrain.plan import main
    from tests.conftest import TINY, run_train_cli

    args = [*TINY, "data.batch_size=auto", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null"]
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "error: data.batch_size=auto sizes the micro-batch to a GPU's memory, and this run trains on the CPU: give a number "
        "(data.batch_size=8, the quickstart's)"
    ), res.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
    assert main(["model=opt-125m", "data.batch_size=auto"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_on_a_gpu_trains_at_the_size_it_said_within_the_card(tmp_path, dataset_dir):
    """trainer=gpu gives data.batch_size=auto: a real 125M run says the size it chose, trains at it, and its measured
    peak stays below the card's memory."""
    from lmtrain.formats.metrics import by_step
    from tests.conftest import run_train_cli

    args = ["trainer=gpu", "logger=csv", "model=opt-125m", "model.max_seq_len=1024", "data.seq_len=1024", "trainer.max_steps=4",
            "scheduler.warmup_steps=1", "trainer.val_check_interval=100", "callbacks=[none,throughput]", f"paths.runs={tmp_path / 'runs'}",
            "run_name=auto"]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stderr.splitlines() if "data.batch_size=auto:" in ln]
    size = int(line.split("data.batch_size=auto: ")[1].split()[0])
    rows = by_step(tmp_path / "runs" / "auto")
    peak = max(float(r["perf/max_memory_gib"]) for r in rows.values() if "perf/max_memory_gib" in r)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(line, f"measured peak {peak:.1f} GiB of {total:.1f}")
    assert size > 8 and peak < total
