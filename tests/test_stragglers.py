"""A rank slower than the others is named during the run, with its host and device (callbacks/stragglers.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, run_train_cli


def _judged(dog, tables):
    for i, table in enumerate(tables):
        dog._judge(table, first=10 * i + 1, last=10 * (i + 1))
    return [e["rank"] for e in dog.named]


def test_a_rank_is_named_once_after_the_windows_in_a_row_and_again_only_after_it_kept_up(tmp_path, monkeypatch):
    from lmtrain.callbacks.stragglers import Stragglers

    dog = Stragglers(run_dir=str(tmp_path), every_n_steps=10, margin=0.2, windows=2)
    dog._ranks = [{"host": f"h{r}", "device": f"cuda:{r}"} for r in range(4)]
    even = [[0.10, 0.01, 0.3]] * 4
    slow_fwd = [[0.10, 0.01, 0.3], [0.10, 0.01, 0.3], [0.13, 0.01, 0.3], [0.10, 0.01, 0.3]]  # rank 2: +30%
    slow_data = [[0.10, 0.01, 0.3], [0.10, 0.09, 0.3], [0.10, 0.01, 0.3], [0.10, 0.01, 0.3]]  # rank 1: +0.08 s > 0.2 x 0.3
    noise = [[0.10, 0.01, 0.3], [0.11, 0.05, 0.3], [0.10, 0.01, 0.3], [0.10, 0.01, 0.3]]  # +10%, +0.04 s: within margin
    assert _judged(dog, [slow_fwd, even, slow_fwd, noise]) == []  # never two windows in a row
    assert _judged(dog, [slow_fwd, slow_fwd, slow_fwd, slow_fwd]) == [2]  # named once, not every window
    assert _judged(dog, [even, slow_fwd, slow_fwd]) == [2, 2]  # kept up, then slow again: named again
    assert _judged(dog, [slow_data, slow_data]) == [2, 2, 1]
    entries = [json.loads(line) for line in (tmp_path / "logbook.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["alert"], e["rank"], e["host"], e["device"]) for e in entries][-1] == ("straggler", True, 1, "h1", "cuda:1")
    assert "data wait 0.09 s against 0.01 s" in entries[-1]["message"] and "x1.30" in entries[0]["message"]


@pytest.mark.parametrize(
    "bad",
    [{"every_n_steps": 0}, {"every_n_steps": 2.5}, {"margin": 0}, {"margin": "x"}, {"windows": 0}, {"windows": True}],
)
def test_bad_values_are_one_line(bad):
    from lmtrain.callbacks.stragglers import Stragglers
    from lmtrain.errors import InputError

    with pytest.raises(InputError, match="callbacks.stragglers: "):
        Stragglers(run_dir="/x", **bad)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_slow_rank_is_named_in_the_logbook_and_the_skew_is_logged(tmp_path, dataset_dir):
    """2 ranks (ddp, gloo): from step 2 rank 1's forward passes take 8 times as long (fault=slow_rank; a margin over
    the host's noise when other tests share its cores). Every rank's
    step takes as long (rank 0 waits for rank 1 in the all-reduce), yet after 2 windows (steps 2-3, 4-6) rank 1 is named,
    with its host and device, and rank 0 is not; every window logs rank 1 as the slowest forward pass."""
    from lmtrain.formats import metrics

    args = [a for a in TINY if not a.startswith("trainer.devices")] + [
        "callbacks=[stragglers]", "callbacks.stragglers.every_n_steps=3", "callbacks.stragglers.windows=2",
        "strategy=ddp", "trainer.devices=2", "trainer.max_steps=14", "scheduler.total_steps=14", "logger=csv",
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "run_name=slow",
        "fault=slow_rank", "callbacks.fault.step=2", "callbacks.fault.rank=1", "callbacks.fault.factor=8",
    ]  # fmt: skip
    done = run_train_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "slow"
    entries = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()]
    named = [e for e in entries if e["kind"] == "straggler"]
    assert [(e["rank"], e["device"], e["alert"]) for e in named] == [(1, "cpu", True)], named
    assert named[0]["step"] == 6 and named[0]["host"] and "rank 1 on " in named[0]["message"], named[0]
    assert "ALERT: straggler: rank 1" in done.stderr
    worst = metrics.metric(run, "perf/forward_time_max_rank")
    assert worst == [1.0, 1.0, 1.0, 1.0], worst  # the windows ending at steps 3, 6, 9, 12 (step 1 is not measured)
    fwd_max, fwd_median = metrics.metric(run, "perf/forward_time_max_s"), metrics.metric(run, "perf/forward_time_median_s")
    fwd_rank0 = [2 * med - m for m, med in zip(fwd_max, fwd_median, strict=True)]  # 2 ranks: the median is their mean
    assert all(m > 1.5 * r0 for m, r0 in zip(fwd_max, fwd_rank0, strict=True)), (fwd_max, fwd_rank0)
