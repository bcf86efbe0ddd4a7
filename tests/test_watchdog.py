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
    short = Watchdog(run_dir="/x", group_timeout_s=600)  # strategy.timeout_s=600: every limit under 500 s
    short._longest = {"train": 400.0}
    assert short.limit("train") == short.limit("val") == 500.0


def test_a_fixed_limit_the_process_groups_timeout_would_beat_is_refused():
    from lmtrain.callbacks.watchdog import Watchdog
    from lmtrain.errors import InputError

    with pytest.raises(InputError, match=r"timeout_s=1700 is too close to the process group's timeout \(1800 s"):
        Watchdog(run_dir="/x", timeout_s=1700)


def test_compilation_is_not_counted_against_a_fixed_limit():
    """A real ``torch.compile`` (dynamo, with a backend that takes 1.5 s) under a 1-s fixed limit: while it compiles
    the phase is ``compile`` with the start-up allowance, and when it ends the interrupted phase's clock starts again."""
    import time

    import torch

    from lmtrain.callbacks.watchdog import Watchdog
    from lmtrain.training import compat

    dog = Watchdog(run_dir="/x", timeout_s=1, startup_s=60)
    handler = compat.compile_callbacks()
    assert handler is not None, "torch.compile's compilation callbacks are gone: the watchdog would count compilation"
    seen = []

    def slow_backend(gm, inputs):
        time.sleep(1.5)
        seen.append((dog._phase, dog.limit(dog._phase), time.monotonic() - dog._last))
        return gm.forward

    torch._dynamo.reset()  # (which clears the callbacks too)
    dog.beat("train")
    handler.register_start_callback(dog._compile_start)
    handler.register_end_callback(dog._compile_end)
    try:
        torch.compile(lambda x: x * 2 + 1, backend=slow_backend)(torch.ones(3))
    finally:
        dog._end()
    # in the compile phase since before the backend's 1.5 s (dynamo's tracing before it counts too: not a fixed figure)
    assert [(phase, limit) for phase, limit, _ in seen] == [("compile", 60.0)] and seen[0][2] >= 1.5, seen
    assert dog._phase == "train" and time.monotonic() - dog._last < 1.0 and dog.limit("train") == 1.0
    assert dog._compile_start not in handler.start_callbacks and dog._compile_end not in handler.end_callbacks


@pytest.mark.slow
def test_a_paused_process_is_not_a_hang(tmp_path, dataset_dir):
    """A real run under a 4-s limit is stopped whole (SIGSTOP) for 10 s while it trains, then continued (SIGCONT): the
    watch, stopped with it, counts that time as a pause, not as a hang, and the run trains on; its logbook says
    `paused`. Ended by a SIGTERM once it has said so, it exits 4 (a signal), not 5 (a hang). (The run is open-ended: a
    bounded one can finish between the record's first flush, FLUSH_S after the start, and the SIGSTOP.)"""
    import os
    import signal
    import time

    base = [a for a in TINY if a != "callbacks=none"] + [
        "callbacks=[watchdog]", "callbacks.watchdog.timeout_s=4", "trainer.max_steps=100000", "scheduler.total_steps=100000",
        "trainer.val_check_interval=100000", "logger=csv", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}",
        "data.prepare=null", "run_name=paused",
    ]  # fmt: skip
    run = tmp_path / "runs" / "paused"
    proc, _ = _train_until_stepping(base, tmp_path, run, workers=False)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and '"paused"' not in (run / "logbook.jsonl").read_text():
            time.sleep(0.2)
        time.sleep(2)  # training goes on past the pause
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "paused.err").read_text()
    assert proc.returncode == 4, err[-3000:]
    entries = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in entries if e["kind"] in ("hang", "paused")] == ["paused"], entries
    (paused,) = [e for e in entries if e["kind"] == "paused"]
    assert 8 <= paused["seconds"] <= 14 and "not counted as a hang" in paused["message"], paused
    assert entries[-1]["step"] > paused["step"], entries
    assert "did not run for" in err and "HANG" not in err


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


class _Stuck(__import__("torch").utils.data.Dataset):
    """A dataset whose items never come: a read that hangs (a dead mount, a stalled network filesystem)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import time

        while True:  # noqa: ASYNC110 - the stall
            time.sleep(0.1)


def test_a_loader_worker_a_thread_waits_for_is_named_and_answers_with_its_stacks():
    """A real DataLoader worker stuck in its dataset's __getitem__: the waiting thread's loader names that worker and
    its pid, and the worker, asked by signal, writes where it stands (faulthandler, lmtrain.training.workers)."""
    import os
    import signal
    import threading

    from torch.utils.data import DataLoader

    from lmtrain.training import compat, workers

    # a worker started fresh (spawn), not forked from this test process, whose other tests' threads a fork copies
    loader = DataLoader(
        _Stuck(), batch_size=2, num_workers=1, worker_init_fn=workers.answer_stack_requests, multiprocessing_context="spawn"
    )
    failed, awaited = [], None
    # the iterator made in the waiting thread: PyTorch's SIGCHLD handler (a dead worker raises) is the main thread's only
    waiter = threading.Thread(target=lambda: failed.append(_next_or_error(iter(loader))), daemon=True)
    waiter.start()
    try:
        for _ in range(1200):  # a spawned worker imports torch first
            awaited = compat.awaited_loader_worker(waiter.ident)
            if awaited is not None and workers._answers_of(awaited["pid"]) is not None:
                break
            waiter.join(0.05)
        assert awaited is not None and awaited["worker"] == 0 and awaited["alive"] and awaited["batch"] == 0, awaited
        stacks = workers.worker_stacks(awaited["pid"], wait_s=5)
        assert "__getitem__" in stacks and "test_watchdog.py" in stacks, stacks
        assert workers.worker_stacks(os.getpid()) is None  # a process that does not listen is never signalled
    finally:
        if awaited is not None:
            os.kill(awaited["pid"], signal.SIGKILL)
        waiter.join(30)
    assert failed and "DataLoader worker" in failed[0], failed


def _next_or_error(it) -> str:
    try:
        next(it)
        return "a batch came"
    except RuntimeError as exc:
        return str(exc)


def _train_until_stepping(args, tmp_path, run, workers=True):
    """`train.py ARGS` started, returned once its record shows step 2 trained, with its loader workers' pids
    (``workers``: it has some). Its output goes to RUN.err (a pipe would stay open as long as the workers, which inherit
    it, live, and one not read would stop the run once full)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.conftest import ROOT, user_env

    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    with open(tmp_path / f"{run.name}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, stdout=err, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        record = run / "metrics.jsonl"
        if record.exists() and any('"step": 2,' in line or '"step": 3,' in line for line in record.read_text().splitlines()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / f"{run.name}.err").read_text()[-3000:]
    kids = [int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()]
    assert kids or not workers, "no loader worker processes"
    return proc, kids


@pytest.mark.slow
def test_a_stalled_loader_worker_is_named_by_the_watchdog_and_a_dead_one_by_the_error(tmp_path, dataset_dir):
    """The loader's workers of a real run are stopped (SIGSTOP: a worker that stalls): the watchdog's `hang` alert
    names the worker the main thread waits for, its pid and state, and the run exits 5. In a second run a worker is
    killed (SIGKILL): the run ends at once, exit 1, its logbook naming the worker's pid and the signal."""
    import os
    import signal

    base = [a for a in TINY if a != "callbacks=none"] + [
        "callbacks=[checkpoint,watchdog]", "callbacks.watchdog.timeout_s=4", "callbacks.checkpoint.every_n_steps=50",
        "callbacks.disk_guard.margin_gb=0", "data.num_workers=1", "trainer.max_steps=100000", "scheduler.total_steps=100000",
        "trainer.val_check_interval=1000", "logger=csv", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    run = tmp_path / "runs" / "stall"
    proc, kids = _train_until_stepping(base + ["run_name=stall"], tmp_path, run)
    try:
        for pid in kids:
            os.kill(pid, signal.SIGSTOP)
        proc.wait(timeout=120)
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 5, (tmp_path / "stall.err").read_text()[-3000:]
    (entry,) = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines() if '"hang"' in line]
    (worker,) = [r["loader_worker"] for r in entry["ranks"].values()]
    assert worker["worker"] == 0 and worker["pid"] in kids and worker["state"] == "stopped", worker
    assert f"waiting for loader worker 0 (pid {worker['pid']}, stopped)" in entry["message"], entry["message"]
    (folder,) = (run / "hangs").iterdir()
    assert f"pid {worker['pid']}: stopped: " in (folder / "rank-0.txt").read_text()

    run = tmp_path / "runs" / "dead"
    proc, kids = _train_until_stepping(base + ["run_name=dead"], tmp_path, run)
    try:
        os.kill(kids[0], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, (tmp_path / "dead.err").read_text()[-3000:]
    (entry,) = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines() if '"failed"' in line]
    # PyTorch says it one of three ways, whichever of its checks sees the death first: a killed-by-signal error (raised
    # wherever the main thread is), "exited unexpectedly", or the pipe's ConnectionResetError (CI, stop 66), which names
    # no worker; raised inside the loader, the logbook adds the worker, its pid and signal from the loader's own record
    said = (f"DataLoader worker (pid {kids[0]}) is killed by signal: Killed", f"DataLoader worker (pid(s) {kids[0]}) exited unexpectedly",
            f"; loader worker 0 (pid {kids[0]}) died: killed by signal SIGKILL")  # fmt: skip
    assert any(s in entry["message"] for s in said), entry
    if "ConnectionResetError" in entry["message"]:
        assert entry["message"].endswith(said[2]), entry


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="a hang in a GPU run: run on a GPU (docs/BENCHMARKS.md)")
def test_a_hang_in_a_gpu_run_is_reported_and_ends_it(tmp_path, dataset_dir):
    """One GPU, bf16: the rank stops at step 4 with its CUDA work queued (fault=hang); within the 10-s limit the
    watchdog writes its stacks and the `hang` alert, and the run exits 5."""
    gpu = [a for a in TINY if not a.startswith(("trainer.accelerator", "trainer.precision", "callbacks="))]
    args = gpu + [
        "trainer.accelerator=gpu", "trainer.precision=bf16-mixed", "callbacks=[checkpoint,watchdog]", "callbacks.watchdog.timeout_s=10",
        "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=8", "scheduler.total_steps=8", "fault=hang", "callbacks.fault.step=4",
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "run_name=gpuhang", "logger=csv",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 5, res.stderr[-3000:]
    run = tmp_path / "runs" / "gpuhang"
    (entry,) = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines() if '"hang"' in line]
    assert entry["step"] == 4 and "fault.py" in entry["message"], entry["message"]
    (folder,) = (run / "hangs").iterdir()
    assert "--- thread MainThread" in (folder / "rank-0.txt").read_text()
