"""The chaos soak's driver (tests/test_run_dir.py runs it inside ``unshare -rm``, the run directory on a tmpfs of its
own): a 2-rank ``ddp`` run launched again and again, each launch hit at a random moment by one event, until it ends:

* ``kill``: ``kill -9`` of the launch's whole process group (rank zero and the rank it started: a node lost), at a
  random moment after the attempt was accepted (its logbook entry written);
* ``sigterm``: SIGTERM to the launch's first process while it trains (a scheduler's preemption);
* ``second``: a second launch of the same run while it trains (refused, exit 2; the first goes on);
* ``disk``: the disk filled up while a checkpoint is being written (a file written until ENOSPC); once the failed
  save is alerted, a SIGTERM (the job ended); the disk freed after the run stopped;
* ``kill_in_first_save``: ``kill -9`` of the launch while its first save is being written (its partial folder there;
  the run's first save when it has no checkpoint yet), first in the plan;
* ``kill_after_val_save``: ``kill -9`` of the launch as soon as the logbook has the checkpoint of a step that
  validated (a multiple of ``VAL_EVERY``, given as ``--val-every N``): its values must be in the record already.

    python -m tests.soak RUN_DIR OUT_JSON EVENTS SEED [--kinds K1,K2,...] [--val-every N] -- TRAIN_ARGS...

``--kinds`` (default ``kill,sigterm,second,disk``) are dealt in equal shares, shuffled, ``kill_in_first_save`` first.

Writes what each launch did to OUT_JSON. Arguments ``+callbacks.pace...`` (a pace that keeps the events inside
training) are left out of the last launch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISK_KINDS = ("checkpoint_failed", "disk_full", "disk_pruned")  # the logbook's word that the disk is full


def _logbook(run: Path) -> list[dict]:
    from lmtrain.formats import logbook

    return logbook.read(run)


def _env() -> dict[str, str]:
    """A user's shell: no rendezvous variables (tests.conftest.user_env, which this driver cannot import)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
    return {**env, "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
        env=_env(),
        start_new_session=True,
    )


def _until(condition, proc: subprocess.Popen, timeout: float = 180.0) -> bool:
    """Wait for ``condition()``; False when the launch ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise TimeoutError("the launch did not get there")
        time.sleep(0.02)
    return True


def _accepted(run: Path, entries_before: int):
    return lambda: any(e["kind"] in ("start", "resume") for e in _logbook(run)[entries_before:])


def _training(run: Path, entries_before: int):
    return lambda: any(e["kind"] == "checkpoint" for e in _logbook(run)[entries_before:])


def _saving(run: Path):
    root = run / "checkpoints"
    return lambda: root.is_dir() and any(p.name.endswith(".partial") for p in root.iterdir())


def _fill(path: Path) -> None:
    block = bytes(1 << 16)
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(block)
            except OSError:
                if len(block) == 1:
                    return
                block = bytes(len(block) // 2)


def _partials(run: Path) -> set[tuple[str, int, int]]:
    """The partial folders there now, each (name, inode, change time): a folder of the same name made again is new."""
    root, out = run / "checkpoints", set()
    try:
        for p in root.iterdir() if root.is_dir() else []:
            if p.name.endswith(".partial"):
                st = p.stat()
                out.add((p.name, st.st_ino, st.st_ctime_ns))
    except FileNotFoundError:  # a partial renamed or removed while looked at
        pass
    return out


def _new_save(run: Path, before: set):
    """A partial folder that was not there in ``before``: a save this attempt began."""
    return lambda: bool(_partials(run) - before)


def _val_saved(run: Path, entries_before: int, every: int):
    return lambda: any(
        e["kind"] == "checkpoint" and isinstance(e.get("step"), int) and e["step"] % every == 0 for e in _logbook(run)[entries_before:]
    )


def main(argv: list[str]) -> int:
    run, out, events, seed = Path(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    args = argv[argv.index("--") + 1 :]
    options = argv[4 : argv.index("--")]
    kinds = options[options.index("--kinds") + 1].split(",") if "--kinds" in options else ["kill", "sigterm", "second", "disk"]
    val_every = int(options[options.index("--val-every") + 1]) if "--val-every" in options else 100
    rng = random.Random(seed)
    plan = kinds * (events // len(kinds) + 1)
    rng.shuffle(plan)
    plan = plan[:events]
    plan.sort(key=lambda k: k != "kill_in_first_save")  # while the run may still have no checkpoint
    done: list[dict] = []
    filler = run.parent / "filler"
    attempt = 0
    proc = None
    while plan:
        if proc is None:
            attempt += 1
            before = len(_logbook(run))
            proc = _launch(args, out.parent / f"launch-{attempt}.err")
        event = plan.pop(0)
        record = {"event": event, "attempt": attempt}
        if event == "kill":
            if _until(_accepted(run, before), proc):
                time.sleep(rng.uniform(0.0, 3.0))
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            record["rc"] = proc.returncode
            proc = None
        elif event in ("kill_in_first_save", "kill_after_val_save"):
            if _until(_accepted(run, before), proc):  # the attempt is the run's (a dead one's partial is cleaned up now)
                hit = _new_save(run, _partials(run)) if event == "kill_in_first_save" else _val_saved(run, before, val_every)
                if _until(hit, proc, 300) and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            record["rc"] = proc.returncode
            proc = None
        elif event == "sigterm":
            if _until(_training(run, before), proc):
                time.sleep(rng.uniform(0.0, 1.0))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
            record["rc"] = proc.returncode
            proc = None
        elif event == "second":
            _until(_accepted(run, before), proc)
            second = subprocess.run(
                [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=300,
                env=_env(),
            )  # fmt: skip
            record["rc"] = second.returncode
            record["line"] = (second.stderr.strip().splitlines() or [""])[-1]
            record["first_still_running"] = proc.poll() is None
        elif event == "disk":
            if _until(_saving(run), proc):
                _fill(filler)
                # the save in flight fails, or the next one finds the disk full (the guard prunes or stops the run); then
                # the scheduler ends the job (its preemption save may fail too)
                _until(lambda n=before: any(e["kind"] in DISK_KINDS for e in _logbook(run)[n:]), proc, 120)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
            record["rc"] = proc.returncode
            filler.unlink(missing_ok=True)
            proc = None
        done.append(record)
        out.write_text(json.dumps(done, indent=1))
    if proc is None:  # the events are spent: a last launch runs to the end, at full speed
        attempt += 1
        proc = _launch([a for a in args if not a.startswith("+callbacks.pace")], out.parent / f"launch-{attempt}.err")
    proc.wait(timeout=600)
    done.append({"event": "end", "attempt": attempt, "rc": proc.returncode})
    out.write_text(json.dumps(done, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
