"""A hang is caught, reported and ended (exit 5) by the watchdog, and the run resumes (callbacks/watchdog.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, run_train_cli


def test_the_limits_grow_from_the_measured_intervals_within_floor_and_ceiling():
    from lmtrain.callbacks.watchdog import CEILING_S, FLOOR_S, Watchdog

    dog = Watchdog(run_dir="/nonexistent", startup_s=900)
    assert dog.limit("train") == dog.limit("val") == dog.limit("save") == 900  # nothing measured: start-up allowance
    dog._longest = {"train": 0.5, "val": 30.0, "save": 400.0}
    assert (dog.limit("train"), dog.limit("val"), dog.limit("save")) == (FLOOR_S, 300.0, CEILING_S)
    assert Watchdog(run_dir="/x", timeout_s=7).limit("train") == 7.0


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_hangs_is_reported_on_every_rank_and_the_run_resumes_exactly(tmp_path, dataset_dir):
    """2 ranks (gloo): rank 1 stops at the start of step 6 (fault=hang), rank 0 waits for it in the gradient
    all-reduce. Within the watchdog's limit (4 s here) each rank writes its stacks, rank 0 a `hang` alert naming the
    step and both ranks' places, and the launch exits 5 (not after the 30-minute collective timeout). Run again, it
    resumes from step 4 and logs exactly the losses of an uninterrupted run."""
    import time

    from tests.test_checkpoint import CKPT, _losses

    base = [a for a in TINY if not a.startswith("trainer.devices")] + CKPT + [
        "callbacks=[checkpoint,watchdog]", "callbacks.watchdog.timeout_s=4", "strategy=ddp", "trainer.devices=2",
        "trainer.max_steps=10", "scheduler.total_steps=10", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}",
        "data.prepare=null",
    ]  # fmt: skip
    ref = run_train_cli(base + ["run_name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "runs" / "hung"
    t0 = time.monotonic()
    hung = run_train_cli(base + ["run_name=hung", "fault=hang", "callbacks.fault.step=6", "callbacks.fault.rank=1"], tmp_path)
    assert hung.returncode == 5, hung.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    (folder,) = (run / "hangs").iterdir()
    stacks = {r: (folder / f"rank-{r}.txt").read_text() for r in (0, 1)}
    assert "fault.py" in stacks[1] and "--- thread MainThread" in stacks[0] and "--- thread lmtrain-watchdog" in stacks[0]
    (entry,) = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines() if '"hang"' in line]
    assert entry["alert"] and entry["step"] == 6 and sorted(entry["ranks"]) == ["0", "1"], entry
    assert "rank 1 (" in entry["message"] and ") at step 6 in on_train_batch_start (fault.py:" in entry["message"], entry["message"]
    assert entry["message"].startswith("no progress for ") and f"Stacks in {folder}" in entry["message"]
    assert "HANG: rank 0: no progress for" in hung.stderr and not (run / ".lock").exists()

    again = run_train_cli(base + ["run_name=hung"], tmp_path)
    assert again.returncode == 0 and "step-0000004" in again.stderr, again.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (run / "logbook.jsonl").read_text().splitlines()]
    assert kinds.index("hang") < kinds.index("resume") and "died" not in kinds, kinds
    assert _losses(run) == _losses(tmp_path / "runs" / "ref")
