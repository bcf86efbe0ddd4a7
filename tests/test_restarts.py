"""Runs that restart themselves under torchrun --max-restarts (lmtrain/training/restarts.py), real processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, free_port, run_train_cli, user_env

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


SRUN = """#!{python}
# srun for one node, as SLURM runs a job step: SLURM_NTASKS tasks of the command, each with its SLURM_PROCID and
# SLURM_LOCALID; --kill-on-bad-exit=1: the first task to fail ends the others; the status is the highest task status.
import os, subprocess, sys, time
args = sys.argv[1:]
kill = "--kill-on-bad-exit=1" in args
while args and args[0].startswith("--"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
if args[-2:] == ["lmtrain", "doctor"]:  # both tasks share this host's cores (and a busy test machine's): the doctor's
    args += ["--min-share", "0.3"]      # 80% between them measures that contention; its thresholds: tests/test_doctor.py
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NODEID": "0"}})
         for i in range(n)]
while any(t.poll() is None for t in tasks):
    if kill and any(t.returncode not in (None, 0) for t in tasks):
        for t in tasks:
            if t.poll() is None:
                t.kill()
    time.sleep(0.1)
sys.exit(max(t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks))
"""
SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: one host a line; scontrol requeue ID: written to $SCONTROL_LOG (the requeue itself is
# the test running the script again, as SLURM does, with SLURM_RESTART_COUNT set)
case "$1" in
  show) echo "$3" | tr , '\\n' ;;
  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;
esac
"""


def _slurm_job(args: list[str], tmp_path, restart: int) -> subprocess.CompletedProcess:
    """examples/slurm/train.sbatch run as SLURM runs a batch script on a 1-node, 2-task allocation (job 4242), with
    srun and scontrol (no SLURM here) doing what they do there."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        (bin_dir / "srun").write_text(SRUN.format(python=sys.executable))
        (bin_dir / "scontrol").write_text(SCONTROL)
        (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # the environment's python
        for tool in ("srun", "scontrol", "python"):
            (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in user_env().items() if not k.startswith(("SLURM_", "LMTRAIN_RUN_ID"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT), SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="train.sbatch", SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost",
               SLURM_NNODES="1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", MASTER_PORT=str(free_port()))  # fmt: skip
    if restart:
        env["SLURM_RESTART_COUNT"] = str(restart)
    script = ROOT / "examples" / "slurm" / "train.sbatch"
    return subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _entries(run) -> list[dict]:
    return [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_and_a_slurm_requeue_restart_a_hung_job_to_an_uninterrupted_runs_losses(tmp_path, dataset_dir):
    """torchrun --max-restarts 3, 2 ranks: rank 1 hangs at step 6 (the watchdog reports it, exit 5), rank 0 is killed
    (SIGKILL) at step 9; torchrun starts the job again each time, each attempt resumes from the newest checkpoint, and
    the run finishes on its own with an uninterrupted run's losses; the logbook tells both restarts and their causes.
    The shipped SLURM batch script, on 2 tasks: lmtrain doctor passes, rank 1 hangs at step 6, the script requeues the
    job (exit 5, or 137 where srun ended rank 0 first); run again as SLURM runs a requeued job (same job id, SLURM_RESTART_COUNT=1) it resumes, finishes
    with the same losses and does not requeue; the logbook names the restart."""
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

    job = BASE + data + ["fault=hang", "callbacks.fault.step=6", "callbacks.fault.rank=1"]
    first = _slurm_job(job, tmp_path, restart=0)
    # 5, or 137: srun's status is its tasks' highest, and a task it ended with SIGKILL (--kill-on-bad-exit) counts 128 + 9
    assert first.returncode in (5, 137), first.stdout[-2000:] + first.stderr[-4000:]
    assert "doctor: 2 rank(s) on 1 node(s): ok" in first.stdout, first.stdout[-2000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    again = _slurm_job(job, tmp_path, restart=1)  # the requeued job: same script, same arguments, same job id
    assert again.returncode == 0, again.stderr[-4000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # finished: not requeued again
    run = tmp_path / "runs" / "slurm-4242"
    assert [e["step"] for e in _entries(run) if e["kind"] == "hang"] == [6]
    (restart,) = [e for e in _entries(run) if e["kind"] == "restart"]
    assert restart["launcher"] == "SLURM requeue" and restart["message"].startswith("restart 1 (SLURM requeue) after a hang at step 6"), (
        restart
    )
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
