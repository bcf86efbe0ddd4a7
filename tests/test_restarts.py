"""Runs that restart themselves under torchrun --max-restarts (lmtrain/training/restarts.py), real processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, run_train_cli, user_env

BASE = [a for a in TINY if not a.startswith("trainer.devices")] + [
    "callbacks=[checkpoint,watchdog]", "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0",
    "callbacks.watchdog.timeout_s=4", "model.dropout=0.1", "logger=csv", "strategy=ddp", "trainer.devices=2",
    "trainer.max_steps=12", "scheduler.total_steps=12", "trainer.val_check_interval=5",
]  # fmt: skip
KILL_AT_9 = ["+callbacks.kill._target_=lmtrain.callbacks.fault.FaultInjector", "+callbacks.kill.kind=crash", "+callbacks.kill.step=9",
             "+callbacks.kill.rank=0", "+callbacks.kill.run_dir=${run_dir}"]  # fmt: skip


def _torchrun(args: list[str], cwd, restarts: int, share_store: bool = False) -> subprocess.CompletedProcess:
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as docs/scale-out.md launches it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}",
           str(ROOT / "train.py"), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _entries(run) -> list[dict]:
    return [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_restarts_a_hung_and_a_killed_job_to_an_uninterrupted_runs_losses(tmp_path, dataset_dir):
    """torchrun --max-restarts 3, 2 ranks: rank 1 hangs at step 6 (the watchdog reports it, exit 5), rank 0 is killed
    (SIGKILL) at step 9; torchrun starts the job again each time, each attempt resumes from the newest checkpoint, and
    the run finishes on its own with an uninterrupted run's losses; the logbook tells both restarts and their causes."""
    from tests.test_checkpoint import _losses

    data = [f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null"]
    ref = run_train_cli(BASE + data + ["run_name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    res = _torchrun(BASE + data + ["run_name=elastic", "fault=hang", "callbacks.fault.step=6", "callbacks.fault.rank=1", *KILL_AT_9],
                    tmp_path, restarts=3)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "runs" / "elastic"
    entries = _entries(run)
    restarts = [e for e in entries if e["kind"] == "restart"]
    assert [e["restart"] for e in restarts] == [1, 2] and {e["launcher"] for e in restarts} == {"torchrun"}, restarts
    assert restarts[0]["message"].startswith("restart 1 (torchrun) after a hang at step 6 (exit 5; ranks 0, 1 on "), restarts[0]
    assert restarts[1]["message"].startswith("restart 2 (torchrun) after a kill at step 8: "), restarts[1]
    kinds = [e["kind"] for e in entries]
    assert kinds.count("resume") == 2 and kinds[-1] == "end" and kinds.index("hang") < kinds.index("died"), kinds
    assert _losses(run) == _losses(tmp_path / "runs" / "ref")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_crash_loop_is_stopped_by_the_restart_budget_and_a_shared_store_is_refused(tmp_path, dataset_dir):
    """restarts.max=1: the hang's restart is the budget, the kill's restart is stopped with one line (exit 3) instead
    of training again. torchrun with restarts and its store shared with the job (PyTorch's default) is refused before
    anything is written, naming the variable that fixes it."""
    data = [f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null"]
    res = _torchrun(BASE + data + ["run_name=loop", "restarts.max=1", "fault=hang", "callbacks.fault.step=6", "callbacks.fault.rank=1",
                                   *KILL_AT_9], tmp_path, restarts=2)  # fmt: skip
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if line.startswith("stopped: restart budget spent")]
    assert said and said[0].startswith("stopped: restart budget spent: 1 restarts of run loop within the last 3600 s (restarts.max=1"), (
        res.stderr[-4000:]
    )
    assert "the last after a kill at step 8" in said[0]
    assert [e["kind"] for e in _entries(tmp_path / "runs" / "loop")].count("restart") == 1

    shared = _torchrun(BASE + data + ["run_name=shared"], tmp_path, restarts=1, share_store=True)
    assert shared.returncode != 0 and not (tmp_path / "runs" / "shared").exists()
    errors = [line for line in shared.stderr.splitlines() if line.startswith("error: torchrun --max-restarts=1 shares its rendezvous")]
    assert errors and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun" in errors[0], shared.stderr[-3000:]
    assert os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") is None  # the test's own environment untouched
