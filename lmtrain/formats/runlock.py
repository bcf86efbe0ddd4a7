"""One live attempt per run directory: ``RUN_DIR/.lock``.

The lock names its holder, ``{"host", "pid", "started", "proc_start"}``, and is created atomically
(``O_CREAT | O_EXCL``) by the process of global rank zero before the attempt reads or changes anything of the run;
the other ranks of the launch never take it (one lock per run, however many ranks and nodes). The holder renews it
(the file's modification time) every :data:`RENEW_S` seconds from a daemon thread, and removes it when the run ends,
however it ends, short of being killed.

A second launch finds it held and is refused (:class:`RunLocked`, exit 2) before it writes anything, naming the
holder. A lock left by an attempt that died is taken over, with one line saying whose it was: on the same host, when
its process is gone (or the pid now belongs to a process that started later); on another host, when it was not renewed
for :data:`LEASE_S` seconds.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from lmtrain.errors import InputError

FILE = ".lock"
RENEW_S = 15.0  # the holder touches the lock this often
LEASE_S = 120.0  # a lock of another host not renewed for this long is a dead attempt's


class RunLocked(InputError):
    """The run directory is held by another live attempt."""


def _proc_start(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot, /proc/PID/stat field 22), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int, proc_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    now = _proc_start(pid)
    return proc_start is None or now is None or now == proc_start


def describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "?"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {when}"


def read(run_dir: Path) -> dict | None:
    """The holder recorded in ``run_dir``'s lock, None when there is none; {} for a lock that does not parse (a crash
    in the middle of its creation)."""
    try:
        text = (Path(run_dir) / FILE).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


def stale_reason(run_dir: Path, holder: dict) -> str | None:
    """Why the lock of ``holder`` is a dead attempt's (and may be taken over), None while its holder may be alive."""
    if not holder:
        return "the lock does not parse (its writer died while creating it)"
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _alive(pid, holder.get("proc_start")):
            return f"its process (pid {pid}) is gone"
        return None
    try:
        age = time.time() - (Path(run_dir) / FILE).stat().st_mtime
    except FileNotFoundError:
        return "it was released"
    return f"it was not renewed for {age:.0f} s (lease {LEASE_S:.0f} s)" if age > LEASE_S else None


class RunLock:
    """The lock of one run directory held by this process (:func:`acquire`); :meth:`release` gives it back."""

    def __init__(self, run_dir: Path, holder: dict, took_over: tuple[dict, str] | None) -> None:
        self.run_dir, self.holder, self.took_over = Path(run_dir), holder, took_over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="lmtrain-run-lock", daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path:
        return self.run_dir / FILE

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                os.utime(self.path)
            except OSError:  # removed under us, or a full disk's metadata error: the next start decides
                pass

    def ours(self) -> bool:
        return read(self.run_dir) == self.holder

    def release(self) -> None:
        self._stop.set()
        if self.ours():
            self.path.unlink(missing_ok=True)


def release_mine(run_dir: Path) -> None:
    """Remove ``run_dir``'s lock when this process holds it: for a process about to end without returning (the
    watchdog's exit after a hang), so that the next start needs no takeover."""
    holder = read(run_dir) or {}
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        (Path(run_dir) / FILE).unlink(missing_ok=True)


def acquire(run_dir: Path) -> RunLock:
    """Take ``run_dir``'s lock for this process, or raise :class:`RunLocked` naming the live holder. A dead attempt's
    lock is taken over (``RunLock.took_over``: its holder and why it counts as dead)."""
    run_dir = Path(run_dir)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "proc_start": _proc_start(os.getpid())}
    took_over = None
    for _ in range(3):
        try:
            fd = os.open(run_dir / FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = read(run_dir)
            if holder is None:
                continue  # released in between: try again
            why = stale_reason(run_dir, holder)
            if why is None:
                raise RunLocked(
                    f"run directory {run_dir} is in use by another attempt ({describe(holder)}): one live attempt per run. "
                    f"Wait for it to end, stop it, or choose another run_name; a lock left by a dead attempt is taken over "
                    f"by itself (same host: once its process is gone; another host: after {LEASE_S:.0f} s without renewal)"
                ) from None
            took_over = (holder, why)
            _remove_if_unchanged(run_dir, holder)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(me) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return RunLock(run_dir, me, took_over)
    raise RunLocked(f"run directory {run_dir}: could not take its lock ({FILE} keeps changing: another launch is starting)")


def _remove_if_unchanged(run_dir: Path, holder: dict) -> None:
    """Remove a dead attempt's lock, unless another process replaced it meanwhile (then the loop reads it again)."""
    path = run_dir / FILE
    aside = path.with_name(f"{FILE}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        gone = json.loads(aside.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError:
        gone = {}
    if gone != holder and not os.path.exists(path):  # another taker's fresh lock: put it back
        os.rename(aside, path)
        return
    aside.unlink(missing_ok=True)
