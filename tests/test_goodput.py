"""Goodput (lmtrain/training/goodput.py): known time put into a step, a validation and a save lands in its part, the
parts add up to the wall time, and the figures reach the summary and the loggers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmtrain.formats.metrics import by_step
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg


def test_goodput_puts_known_time_in_its_part_and_the_parts_add_up(tmp_path, dataset_dir, caplog):
    cfg = make_cfg(
        [a for a in TINY if a != "callbacks=none"]
        + ["trainer.max_steps=8", "trainer.val_check_interval=4", "logger=csv", "callbacks=[checkpoint,evals]",
           "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0", "callbacks.evals._target_=tests.plugins.SlowEvals",
           "+callbacks.evals.seconds=0.2", "callbacks.evals.max_items=8",
           "+callbacks.step_sleep._target_=tests.plugins.SleepIn", "+callbacks.step_sleep.hook=on_before_backward", "+callbacks.step_sleep.seconds=0.05",
           "+callbacks.val_sleep._target_=tests.plugins.SleepIn", "+callbacks.val_sleep.hook=on_validation_batch_start", "+callbacks.val_sleep.seconds=0.15",
           "+callbacks.slow_save._target_=tests.plugins.SlowSave", "+callbacks.slow_save.seconds=0.3"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lmtrain"):
        train(cfg)
    rows = by_step(Path(cfg.run_dir))
    (g,) = [
        {k.removeprefix("goodput/"): float(v) for k, v in r.items() if k.startswith("goodput/")}
        for r in rows.values()
        if "goodput/fraction" in r
    ]
    assert g["first_steps_s"] >= 0.05 and g["train_s"] >= 7 * 0.05  # 8 steps: the first apart, the other 7 slept in
    assert g["validation_s"] >= 4 * 0.15 and g["checkpoint_s"] >= 2 * 0.3  # 2 validations of 2 batches, 2 saves (steps 4, 8)
    assert g["validation_s"] < 4 * 0.15 + 1.0 and g["checkpoint_s"] < 2 * 0.3 + 1.0  # and not the others' time
    assert 3 * 0.2 <= g["evals_s"] < 3 * 0.2 + 1.0  # evaluated at the start and after both validations: not "other"
    parts = ("train_s", "first_steps_s", "startup_s", "validation_s", "evals_s", "checkpoint_s", "other_s")
    assert sum(g[k] for k in parts) == pytest.approx(g["wall_s"], rel=1e-9)
    assert g["fraction"] == pytest.approx(g["train_s"] / g["wall_s"])
    assert g["steady"] == pytest.approx(g["train_s"] / (g["wall_s"] - g["startup_s"] - g["first_steps_s"]))
    assert g["fraction"] < g["steady"] < 1
    line = next(r.getMessage() for r in caplog.records if r.getMessage().lstrip().startswith("goodput"))
    assert f"{g['fraction']:.1%} of {g['wall_s']:.1f} s in training steps" in line and f"evals {g['evals_s']:.1f} s" in line
    assert f"{g['steady']:.1%} after the first steps" in line


def test_after_a_resume_the_periodic_save_due_near_the_end_is_left_to_the_ends(tmp_path, dataset_dir):
    """``every_n_steps=auto`` (the default) resumed: the plan the checkpoint kept (every 100 steps) continues from the
    resumed step, and the save it would make less than one interval before the end is left to the end's save, as in
    an uninterrupted run (a run resumed at step 200 and extended to 350 saved at 300 and again at 350)."""
    import re

    args = [a for a in TINY if a != "callbacks=none"] + ["logger=csv", "callbacks=checkpoint", "callbacks.checkpoint.keep_last=10",
                                                         "callbacks.disk_guard.margin_gb=0", "trainer.val_check_interval=1000"]  # fmt: skip
    first = make_cfg([*args, "trainer.max_steps=200"], tmp_path, dataset_dir)
    train(first)
    train(make_cfg([*args, "trainer.max_steps=350"], tmp_path, dataset_dir))
    saved = [int(m) for m in re.findall(r"saved and verified step-(\d+)", (Path(first.run_dir) / "logbook.jsonl").read_text())]
    assert saved == [100, 200, 350], saved


def test_a_steps_statistics_count_in_the_step_and_auto_checkpoints_follow_their_measured_cost(tmp_path, dataset_dir, caplog):
    """Time another callback spends at a step's end (its statistics: on a GPU, host syncs that wait for the step) is
    training-step time, not "other". With ``callbacks.checkpoint.every_n_steps=auto`` (the default) and a background
    write made as slow as 150 steps, the interval printed is the rule applied to the figures printed with it (the write at most
    4/5 of the steps between saves, the stall at most 1% of them, in hundreds of steps), the saves fall where the plan
    says, the periodic save due less than one interval before the end is left to the end's save, and only the save
    planned before the first write's time was known waits for a write."""
    import math
    import re

    cfg = make_cfg(
        [a for a in TINY if a != "callbacks=none"]
        + ["trainer.max_steps=450", "trainer.val_check_interval=225", "logger=csv", "callbacks=checkpoint",
           "callbacks.checkpoint.keep_last=10", "callbacks.disk_guard.margin_gb=0",
           "+callbacks.step_end_sleep._target_=tests.plugins.SleepIn", "+callbacks.step_end_sleep.hook=on_train_batch_end",
           "+callbacks.step_end_sleep.seconds=0.01",
           "+callbacks.slow_write._target_=tests.plugins.SlowWriteSteps", "+callbacks.slow_write.steps=150"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lmtrain"):
        train(cfg)
    (g,) = [{k.removeprefix("goodput/"): float(v) for k, v in r.items() if k.startswith("goodput/")}
            for r in by_step(Path(cfg.run_dir)).values() if "goodput/fraction" in r]  # fmt: skip
    assert g["train_s"] >= 449 * 0.01 and g["other_s"] < 449 * 0.01  # the sleep at each step's end: in the steps

    said = [r.getMessage() for r in caplog.records]
    plans = [re.search(r"checkpoints: every ([\d,]+) steps from step ([\d,]+) .*stalls training ([\d.]+) s, its background "
                       r"write takes ([\d.]+) s, a step ([\d.]+) s\)", m) for m in said]  # fmt: skip
    plans = [p for p in plans if p]
    assert plans and any(int(p[1].replace(",", "")) > 100 for p in plans), said
    for p in plans:  # the rule, over the range the printed figures' rounding leaves
        n, stall, write, step = int(p[1].replace(",", "")), float(p[3]), float(p[4]), float(p[5])
        bounds = []
        for dw, ds in ((0.05, -0.0005), (-0.05, 0.0005)):
            need = max((write + dw) * 1.25 / (step + ds), (stall + dw) / (0.01 * (step + ds)), 100)
            bounds.append(100 * math.ceil(need / 100))
        assert min(bounds) <= n <= max(bounds), (p[0], bounds)
    expected, at, interval = [100], 100, 100
    plan_at = {int(p[2].replace(",", "")): int(p[1].replace(",", "")) for p in plans}
    while at < 450:
        interval = plan_at.get(at, interval)
        at = at + interval if 450 - (at + interval) >= interval else 450
        expected.append(at)
    saved = [int(m) for m in re.findall(r"saved and verified step-(\d+)", (Path(cfg.run_dir) / "logbook.jsonl").read_text())]
    assert saved == expected, (saved, expected, said)
    # the save at step 200 waited for the first write (not measured yet when it was planned); none after it did
    first_write = float(by_step(Path(cfg.run_dir))[100]["ckpt/write_s"])
    assert g["checkpoint_s"] < first_write + 1.0
