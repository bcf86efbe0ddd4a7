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
        + ["trainer.max_steps=8", "trainer.val_check_interval=4", "logger=csv", "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=4",
           "callbacks.disk_guard.margin_gb=0",
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
    parts = ("train_s", "first_steps_s", "startup_s", "validation_s", "checkpoint_s", "other_s")
    assert sum(g[k] for k in parts) == pytest.approx(g["wall_s"], rel=1e-9)
    assert g["fraction"] == pytest.approx(g["train_s"] / g["wall_s"])
    assert g["steady"] == pytest.approx(g["train_s"] / (g["wall_s"] - g["startup_s"] - g["first_steps_s"]))
    assert g["fraction"] < g["steady"] < 1
    line = next(r.getMessage() for r in caplog.records if r.getMessage().lstrip().startswith("goodput"))
    assert f"{g['fraction']:.1%} of {g['wall_s']:.1f} s in training steps" in line and "checkpoint saves" in line
    assert f"{g['steady']:.1%} after the first steps" in line
