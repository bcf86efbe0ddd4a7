"""The run directory under an operator's bad week, on real events: a second launch, a dead attempt's lock, SIGTERM,
SIGUSR1 and Ctrl-C, checkpoints that are all unusable or gone, a damaged meta.json."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtrain.errors import PREEMPTED_EXIT
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook, runlock
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli, user_env
from tests.plugins import damage_in_place

CONFIG = "config.yaml"
SAVES = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0", "logger=csv"]


def _args(run: Path, dataset_dir: Path, *extra: str) -> list[str]:
    return [*TINY, *SAVES, "run_name=r", f"run_dir={run}", f"data.path={dataset_dir}", "data.prepare=null", *extra]


def _start(args: list[str], cwd: Path, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`python train.py ARGS` in the background, as a user starts it."""
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def _wait_training(run: Path, after: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until this attempt has saved a checkpoint past step ``after``: it is training (its signal handlers are in place)."""
    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "checkpoint" and e["step"] > after for e in logbook.read(run)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint saved"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_second_launch_is_refused_and_a_dead_attempts_lock_is_taken_over(tmp_path, dataset_dir):
    run = tmp_path / "run"
    first = _start(_args(run, dataset_dir, "trainer.max_steps=100000", "scheduler.total_steps=100000"), tmp_path)
    try:
        _wait_for(run / "checkpoints" / ck.step_name(2), first)
        config = (run / CONFIG).read_bytes()
        holder = runlock.read(run)
        assert holder["pid"] == first.pid
        second = run_train_cli(_args(run, dataset_dir, "trainer.max_steps=100000", "optimizer.lr=0.01"), tmp_path)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        line = second.stderr.strip().splitlines()[-1]
        assert f"run directory {run} is in use by another attempt (pid {first.pid} on " in line, line
        assert (run / CONFIG).read_bytes() == config  # the refused launch wrote nothing
        assert [e["kind"] for e in logbook.read(run) if e["kind"] != "checkpoint"] == ["start"]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
        first.communicate()
    newest = ck.newest(run / "checkpoints").step
    third = run_train_cli(_args(run, dataset_dir, f"trainer.max_steps={newest + 2}", "scheduler.total_steps=100000"), tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock of run directory {run} from a dead attempt (pid {first.pid} on " in third.stderr
    assert f"its process (pid {first.pid}) is gone" in third.stderr
    died = [e for e in logbook.read(run) if e["kind"] == "died"]
    assert len(died) == 1 and died[0]["holder"]["pid"] == first.pid and died[0]["step"] >= 2, died
    assert runlock.read(run) is None  # released at the end


@pytest.mark.slow
def test_sigterm_sigusr1_and_ctrl_c_save_the_step_and_exit_4_a_second_ctrl_c_at_once(tmp_path, dataset_dir):
    """A real signal to a real run, each at a moment training is under way: the step then in progress ends, its
    checkpoint is saved (complete, the logbook says which), the run exits with status 4, and the next start
    continues from exactly that step. Two Ctrl-Cs: status 130 at once."""
    run = tmp_path / "run"
    long = ["trainer.max_steps=100000", "scheduler.total_steps=100000", "callbacks.checkpoint.every_n_steps=50"]
    seen: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        proc = _start(_args(run, dataset_dir, *long), tmp_path)
        try:
            _wait_training(run, seen[-1] if seen else 0, proc)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
        entry = [e for e in logbook.read(run) if e["kind"] == "preempted"][-1]
        assert entry["signal"] == sig.name and entry["checkpoint"], entry
        saved = Path(entry["checkpoint"])
        assert saved.name == ck.step_name(entry["step"]) and ck.verify(saved)[0] is not None
        assert f"preempted: {sig.name} at step {entry['step']}: saved {saved.name}; run again to continue" in err
        seen.append(entry["step"])
        assert runlock.read(run) is None
    assert seen == sorted(set(seen)), seen  # each attempt continued from the last one's saved step
    resumes = [e for e in logbook.read(run) if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == seen[:-1]

    stall = ["+callbacks.stall._target_=tests.plugins.StallPreemptionSave"]  # the second Ctrl-C inside the first's save
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err_file:
        proc = _start(_args(run, dataset_dir, *long, *stall), tmp_path, stderr=err_file)
        try:
            _wait_training(run, seen[-1], proc)
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60
            while "SIGINT: finishing this step" not in log.read_text():  # the first one was taken: its save now stalls
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        finally:
            proc.kill()
            proc.communicate()
    err = log.read_text()
    assert proc.returncode == 130 and "second interrupt: exiting at once" in err, err[-3000:]


def _trained(tmp_path: Path, dataset_dir: Path, *extra: str):
    cfg = make_cfg([*TINY, *SAVES, "run_name=r", *extra], tmp_path, dataset_dir)
    train(cfg)
    return cfg, Path(cfg.run_dir)


def test_a_run_with_saved_steps_but_no_usable_checkpoint_is_refused_never_started_fresh(tmp_path, dataset_dir):
    cfg, run = _trained(tmp_path, dataset_dir)
    root = run / "checkpoints"
    assert [c.step for c in ck.scan(root)] == [2, 4]
    for c in ck.scan(root):
        damage_in_place(c.path / ck.SINGLE_FILE)
    metrics = (run / "csv" / "metrics.csv").read_bytes()
    again = make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir)
    with pytest.raises(CheckpointError, match="saved steps before but has no usable checkpoint") as err:
        train(again)
    text = str(err.value)
    assert ".step-0000002.corrupt-" in text and ".step-0000004.corrupt-" in text and "moved aside as damaged" in text, text
    assert "resume=false overwrite=true" in text
    assert (run / "csv" / "metrics.csv").read_bytes() == metrics  # nothing trained, nothing rewritten
    assert [e["kind"] for e in logbook.read(run) if e["kind"] != "checkpoint"] == ["start", "end"]

    shutil.rmtree(root)  # the checkpoint directory gone altogether (moved away): the logbook still knows
    with pytest.raises(CheckpointError, match=rf"the logbook records checkpoints saved up to step 4, but {root} does not exist"):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir))
    # a fresh start, asked for
    train(make_cfg([*TINY, *SAVES, "run_name=r", "resume=false", "overwrite=true"], tmp_path, dataset_dir))
    assert [c.step for c in ck.scan(root)] == [2, 4]


def test_a_damaged_meta_json_that_still_parses_falls_back_to_the_checkpoint_before(tmp_path, dataset_dir, caplog):
    """meta.json carries its own CRC-32: a model config damaged in place (still valid JSON) is a damaged checkpoint, passed
    over with a warning, not a "different model" refusal of the whole run."""
    import logging

    _, run = _trained(tmp_path, dataset_dir)
    meta_path = run / "checkpoints" / ck.step_name(4) / ck.META
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["d_model"] = 65
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir))
    assert "meta.json is damaged: its own CRC-32 differs" in caplog.text
    resumes = [e for e in logbook.read(run) if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == [2]


def test_an_attempt_that_fails_is_in_the_logbook_a_refused_one_writes_nothing(tmp_path, dataset_dir):
    from lmtrain.training.config import ConfigError

    _, run = _trained(tmp_path, dataset_dir)
    before = (run / logbook.FILE).read_bytes()
    with pytest.raises(ConfigError):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6", "data.batch_size=0"], tmp_path, dataset_dir))
    assert (run / logbook.FILE).read_bytes() == before
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=8", "+callbacks.crash._target_=tests.plugins.FailAtStep",
                        "+callbacks.crash.step=6"], tmp_path, dataset_dir))  # fmt: skip
    failed = [e for e in logbook.read(run) if e["kind"] == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 6 and "RuntimeError: injected failure at step 6" in failed[0]["message"], failed
