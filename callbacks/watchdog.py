"""A hang is a report and an exit, not a job that waits for NCCL's timeout (or forever, on gloo).

A thread on every rank watches for signs of progress: a training micro-batch starting or ending, a validation batch
ending, a checkpoint save beginning (lmtrain.callbacks.checkpoint says so). When none comes within the current
phase's limit, the rank writes the stacks of all its threads, what its child processes (the loader's workers) are
doing, with their own stacks (lmtrain.training.workers), and where its main thread stands, naming the loader worker
it waits for when it waits for a batch to ``RUN_DIR/hangs/attempt-T/rank-R.txt`` (``T``: when the attempt took the
run's lock); rank zero waits for the other ranks' reports, writes a ``hang`` alert to the logbook naming the step and
each rank's place (or that a rank never reported), releases the run's lock, and every rank exits with status 5
(lmtrain.errors.HUNG_EXIT). A launcher that restarts failed jobs (``torchrun --max-restarts``, ``sbatch --requeue``)
then resumes the run from its newest checkpoint like any resume.

The limits (``timeout_s: auto``): an attempt's first interval of each phase (start-up and the first training steps,
the first validation, the first save: warm-up, pinning host memory) gets ``startup_s``; after that a phase gets ten
times the longest interval measured in it, at least :data:`FLOOR_S`, at most :data:`CEILING_S`. No limit is above
:data:`GROUP_SHARE` of the process group's timeout (``strategy.timeout_s``), so that a hung collective is reported here
before the communication library aborts without a word. A number instead of ``auto`` is the limit of every phase
(refused when it is too close to that timeout); ``null`` turns the watchdog off.

Two kinds of time are not counted against a phase:

- **compilation**: while ``torch.compile`` compiles (a new frame, a backward compiled at its first call, CUDA graphs
  recorded: PyTorch's compilation callbacks say when) the limit is ``startup_s``, fixed limit or not (a 7B model's
  float8 compile takes minutes), and the phase's clock starts again when it ends;
- **a pause of the whole process**: SIGSTOP and SIGCONT, a VM paused, a debugger stopping every thread stop the
  watch too. A wake-up of the watch more than :data:`MISSED_S` late is time in which nothing ran; it is added to the
  phase's allowance, said on the console and in the logbook (``paused``), not called a hang.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import lightning as L

from lmtrain.errors import HUNG_EXIT, InputError
from lmtrain.training import compat, workers
from lmtrain.training.contracts import WatchesProgress
from lmtrain.training.loggers import flush as flush_loggers

FLOOR_S = 120.0  # auto: the least a phase is given once measured (host noise, a slow filesystem, a garbage collection)
CEILING_S = 1500.0  # auto: the most
FACTOR = 10.0  # auto: a phase's limit over the longest interval measured in it
REPORT_WAIT_S = 20.0  # rank zero waits this long for the other ranks' reports; they wait for its entry twice as long
GROUP_SHARE = 5 / 6  # every limit at most this share of the process group's timeout (1800 s: 1500), time for the reports
POLL_S = 0.5  # the watch's interval
MISSED_S = 2.0  # a wake-up later than this beyond POLL_S: the whole process did not run (SIGSTOP, a VM pause, a debugger)


class Watchdog(L.Callback, WatchesProgress):
    """Args:
    run_dir: the run directory (``RUN_DIR/hangs/`` and the logbook).
    timeout_s: ``auto``, seconds without progress in any phase, or null (off).
    startup_s: with ``auto``: the limit of each phase's first interval in an attempt (start-up, first validation,
        first save).
    group_timeout_s: the process group's timeout (``strategy.timeout_s``); no limit is above :data:`GROUP_SHARE` of it.
    """

    def __init__(
        self, run_dir: str, timeout_s: float | str | None = "auto", startup_s: float = 900.0, group_timeout_s: float = 1800.0
    ) -> None:
        fixed = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if not (timeout_s is None or timeout_s == "auto" or (fixed and timeout_s > 0)) or not (
            isinstance(startup_s, int | float) and not isinstance(startup_s, bool) and startup_s > 0
        ):
            raise InputError(
                f"callbacks.watchdog: timeout_s={timeout_s!r} must be auto, null (off) or seconds > 0, and "
                f"startup_s={startup_s!r} seconds > 0"
            )
        # every limit under the process group's timeout, by the time the reports take: a hung collective is reported
        # here before the communication library aborts it without a word
        self.ceiling_s = min(CEILING_S, GROUP_SHARE * float(group_timeout_s))
        if fixed and timeout_s > self.ceiling_s:
            raise InputError(
                f"callbacks.watchdog.timeout_s={timeout_s} is too close to the process group's timeout ({group_timeout_s:g} s, "
                "strategy.timeout_s): a hung collective would be aborted first, without a report; give at most "
                f"{self.ceiling_s:g}, or raise strategy.timeout_s"
            )
        self.run_dir = Path(run_dir)
        self.timeout_s, self.startup_s = (float(timeout_s) if fixed else timeout_s), float(startup_s)
        self._longest: dict[str, float] = {}  # per phase: the longest interval measured
        self._phase, self._last = "start", time.monotonic()
        self._resume = "start"  # the phase a compilation interrupted
        self._paused: list[float] = []  # pauses of the whole process not yet said (the main thread says them)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer = None
        self._attempt = ""  # the attempt's name under hangs/ (on_train_start)
        self.fired: dict | None = None  # what the watchdog reported (tests read it in-process)

    # -- limits ----------------------------------------------------------------------------------
    def limit(self, phase: str) -> float:
        """Seconds a sign of progress may take in ``phase`` now."""
        if phase == "compile":
            return min(self.startup_s, self.ceiling_s)
        if self.timeout_s != "auto":
            return float(self.timeout_s)
        longest = self._longest.get(phase)
        if longest is None:
            return min(self.startup_s, self.ceiling_s)
        return min(self.ceiling_s, max(FLOOR_S, FACTOR * longest))

    def beat(self, phase: str) -> None:
        """A sign of progress; ``phase`` is what the process does from now until the next one (``train``, ``val``,
        ``save``)."""
        now = time.monotonic()
        with self._lock:
            if self._phase == "compile":  # a beat from inside a compilation: the phase to resume when it ends
                self._resume = phase
            else:
                if self._phase != "start":  # the start-up interval is no measure of a step
                    self._longest[self._phase] = max(self._longest.get(self._phase, 0.0), now - self._last)
                self._phase, self._last = phase, now
            paused, self._paused = self._paused, []
        if paused:
            self._say_paused(paused)

    def _compile_start(self, args) -> None:
        with self._lock:
            if self._phase != "compile":
                self._resume, self._phase, self._last = self._phase, "compile", time.monotonic()

    def _compile_end(self, args) -> None:
        with self._lock:
            if self._phase == "compile":  # the phase's clock starts again: compilation is not counted against it
                self._phase, self._last = self._resume, time.monotonic()

    def _say_paused(self, paused: list[float]) -> None:
        """The main thread says the pauses the watch saw (on the console; on rank zero in the logbook too)."""
        from lmtrain.formats import logbook

        trainer = self._trainer
        message = (
            f"this process did not run for {sum(paused):.0f} s at step {compat.step_number(trainer)} (stopped by a signal, a paused "
            "machine or a debugger): not counted as a hang"
        )
        print(f"[lmtrain] rank {trainer.global_rank}: {message}", file=sys.stderr, flush=True)
        if trainer.is_global_zero:
            logbook.append(self.run_dir, "paused", message, step=compat.step_number(trainer), seconds=round(sum(paused), 1))

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self.timeout_s is None:
            return
        self._trainer = trainer
        self._phase, self._last = "start", time.monotonic()
        self._attempt = _attempt_id(self.run_dir)
        self._stop.clear()
        callbacks = compat.compile_callbacks()
        if callbacks is not None:
            callbacks.register_start_callback(self._compile_start)
            callbacks.register_end_callback(self._compile_end)
        self._thread = threading.Thread(target=self._watch, name="lmtrain-watchdog", daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.beat("train")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.beat("train")

    def on_validation_start(self, trainer, pl_module) -> None:
        self.beat("val")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.beat("val")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.beat("train")

    def on_train_end(self, trainer, pl_module) -> None:
        self._end()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._end()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._end()

    def _end(self) -> None:
        self._stop.set()
        callbacks = compat.compile_callbacks()
        if callbacks is not None:
            for remove, fn in ((callbacks.remove_start_callback, self._compile_start), (callbacks.remove_end_callback, self._compile_end)):
                try:
                    remove(fn)
                except ValueError:  # not registered (the watchdog is off, or already ended)
                    pass

    # -- the watch -------------------------------------------------------------------------------
    def _watch(self) -> None:
        tick = time.monotonic()
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            missed, tick = now - tick - POLL_S, now
            with self._lock:
                if missed > MISSED_S:  # the whole process stood still, this thread too: that time judges nothing
                    self._last += missed
                    self._paused.append(missed)
                phase, waited = self._phase, now - self._last
            if waited > self.limit(phase):
                self._fire(phase, waited)
                return

    def _fire(self, phase: str, waited: float) -> None:
        trainer = self._trainer
        rank, step = trainer.global_rank, compat.step_number(trainer)  # the step it was working on: the N-th is N
        folder = self.run_dir / "hangs" / f"attempt-{self._attempt}"
        where = _main_thread_place()
        loader = compat.awaited_loader_worker(threading.main_thread().ident)
        if loader is not None:
            loader["state"] = _process_state(loader["pid"]) if loader["alive"] else "dead"
            where += f", waiting for loader worker {loader['worker']} (pid {loader['pid']}, {loader['state']})"
        report = {
            "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "step": step, "phase": phase,
            "waited_s": round(waited, 1), "limit_s": round(self.limit(phase), 1), "where": where, "time": time.time(),
            "loader_worker": loader,
        }  # fmt: skip
        self.fired = report
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank-{rank}.txt").write_text(_stacks(report))
            (folder / f"rank-{rank}.json").write_text(json.dumps(report))
        except OSError as exc:
            print(f"[lmtrain] watchdog: could not write the hang report under {folder}: {exc}", file=sys.stderr)
        print(
            f"[lmtrain] HANG: rank {rank}: no progress for {waited:.0f} s ({phase}, limit {self.limit(phase):.0f} s) at step "
            f"{step}, in {where}; stacks in {folder / f'rank-{rank}.txt'}",
            file=sys.stderr,
            flush=True,
        )
        if rank == 0:
            self._record(folder, report, trainer.world_size)
        else:
            deadline = time.monotonic() + 2 * REPORT_WAIT_S
            while time.monotonic() < deadline and not (folder / "recorded").exists():
                time.sleep(0.2)
        flush_loggers(trainer.loggers, best_effort=True)  # what the record holds in memory (the main thread is stuck)
        sys.stderr.flush()
        os._exit(HUNG_EXIT)

    def _record(self, folder: Path, mine: dict, world: int) -> None:
        """Rank zero: the other ranks' reports (waited for), the logbook's ``hang`` alert, the run's lock released."""
        from lmtrain.formats import logbook, runlock

        reports = {0: mine}
        deadline = time.monotonic() + REPORT_WAIT_S
        while len(reports) < world and time.monotonic() < deadline:
            for r in range(1, world):
                if r not in reports:
                    try:
                        reports[r] = json.loads((folder / f"rank-{r}.json").read_text())
                    except (OSError, ValueError):
                        pass
            time.sleep(0.2)
        places = [
            f"rank {r} ({reports[r]['host']}) at step {reports[r]['step']} in {reports[r]['where']}" if r in reports
            else f"rank {r}: no report within {REPORT_WAIT_S:.0f} s (dead, or stuck outside Python)"
            for r in range(world)
        ]  # fmt: skip
        message = (
            f"no progress for {mine['waited_s']:.0f} s ({mine['phase']}, limit {mine['limit_s']:.0f} s) at step {mine['step']}: "
            f"{'; '.join(places)}. Stacks in {folder}; exiting with status {HUNG_EXIT} (run again, or let the launcher "
            "restart it, to resume)"
        )
        logbook.alert(self.run_dir, "hang", message, said=True, step=mine["step"], ranks=reports, folder=str(folder))
        try:
            (folder / "recorded").touch()
        except OSError:
            pass
        runlock.release_mine(self.run_dir)


def _attempt_id(run_dir: Path) -> str:
    """The attempt every rank shares: when its lock was taken (lmtrain.formats.runlock), read from the run directory."""
    from lmtrain.formats import runlock

    holder = runlock.read(run_dir) or {}
    started = holder.get("started")
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started)) if isinstance(started, int | float) else f"pid-{os.getpid()}"


def _main_thread_place() -> str:
    """Where the main thread stands: its innermost frame, and the innermost one of lmtrain's or of the user's code."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(no main thread)"
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if "/lmtrain/" in f.filename or "/callbacks/" in f.filename or "/tests/" in f.filename), None)
    text = f"{inner.name} ({Path(inner.filename).name}:{inner.lineno})"
    if ours is not None and ours is not inner:
        text += f", called from {ours.name} ({Path(ours.filename).name}:{ours.lineno})"
    return text


def _stacks(report: dict) -> str:
    """Every thread's Python stack, and this process's children (the loader's workers) with their state."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [json.dumps(report), ""]
    main = threading.main_thread().ident
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: item[0] != main):  # the main thread first
        lines.append(f"--- thread {names.get(ident, '?')} ({ident})")
        lines.extend(line.rstrip() for line in traceback.format_stack(frame))
    lines.append("--- child processes (the data loader's workers, among others)")
    lines.extend(_children() or ["(none)"])
    return "\n".join(lines) + "\n"


def _process_state(pid: int) -> str:
    """A process's state in words, from ``/proc/PID/stat``."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "gone"
    meaning = {
        "R": "running",
        "S": "sleeping",
        "D": "in an uninterruptible wait (I/O)",
        "Z": "dead (zombie)",
        "T": "stopped",
        "t": "stopped",
    }
    return meaning.get(state, state)


def _children() -> list[str]:
    """Each child process with its state and command, and the Python stacks of those that answer a request for them
    (the data module's loader workers: lmtrain.training.workers)."""
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                out.append(f"pid {pid}: gone")
                continue
            out.append(f"pid {pid}: {_process_state(int(pid))}: {cmd[:200]}")
            stacks = workers.worker_stacks(int(pid))
            if stacks is not None:
                out.extend(["  " + line for line in stacks.splitlines()])
    return out
