"""The run logbook: one JSON line per notable event (alerts, resumes, rollbacks), in ``RUN_DIR/logbook.jsonl``.

OPT-175B's team kept a logbook of every restart and intervention by hand; here the trainer writes it.
Read it with ``python -m lmtrain.logbook RUN_DIR``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
from pathlib import Path

FILE = "logbook.jsonl"
# Room kept for the logbook on the run's disk: a file of RESERVE_BYTES made when an attempt is accepted (reserve) and
# given up by the first entry the full disk refuses, so that the entries saying the disk filled and how the attempt
# ended are written (a few hundred bytes each; the checkpoints' saves fail first).
RESERVE = ".logbook.reserve"
RESERVE_BYTES = 1 << 18
# Every appended entry is also a record of this logger, with ``record.run_dir`` and ``record.entry``: a run mirrors
# its logbook by attaching a handler for the attempt (lmtrain.training.run: to MLflow), with logging's own registry of
# handlers instead of one of ours. Not propagated: the console says its own lines.
events = logging.getLogger("lmtrain.logbook")
events.propagate = False
events.setLevel(logging.INFO)


def append(run_dir: str | Path, kind: str, message: str, **fields) -> None:
    """Append an event; never raises (a full disk must not turn an alert into a crash). On a full disk the reserve is
    given up and the entry written into its room; the mirrors hear of it even when the file could not take it."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": kind, "message": message, **fields}
    line = (json.dumps(entry, default=str) + "\n").encode("utf-8")
    try:
        try:
            append_line(Path(run_dir) / FILE, line)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not _give_up_reserve(Path(run_dir)):
                raise
            append_line(Path(run_dir) / FILE, line)
    except OSError as exc:
        print(f"[lmtrain] could not write the logbook in {run_dir}: {exc}", file=sys.stderr)
    events.info(message, extra={"run_dir": Path(run_dir), "entry": entry})


def append_line(path: Path, line: bytes, sync: bool = False) -> None:
    """``line`` appended whole, or not at all: a write the disk cut short is taken back (a line fragment would join
    the next entry and hide it from :func:`read_jsonl`). ``sync``: on the disk when this returns."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)  # a failed write wrote nothing; a short one, its first bytes at the end
        if written != len(line):
            os.ftruncate(fd, os.fstat(fd).st_size - written)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def reserve(run_dir: str | Path) -> None:
    """Keep :data:`RESERVE_BYTES` of the run's disk for the logbook (a rank-zero attempt, once accepted); a disk too
    full for it leaves what it could take."""
    path = Path(run_dir) / RESERVE
    try:
        if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
            return
        with open(path, "wb") as fh:
            fh.write(os.urandom(RESERVE_BYTES))  # written, not sparse: the blocks are the room
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:
        pass


def _give_up_reserve(run_dir: Path) -> bool:
    """The reserve removed to make room on a full disk; False when there was none."""
    try:
        (run_dir / RESERVE).unlink()
    except OSError:
        return False
    print(f"[lmtrain] the disk of {run_dir} is full: the logbook's reserve ({RESERVE}) was given up to write it", file=sys.stderr)
    return True


def alert(run_dir: str | Path, kind: str, message: str, said: bool = False, **fields) -> None:
    """An event someone must look at (a failed save, a full disk, a divergence): said on the console at once (unless
    ``said``: the caller said it its own way) and appended with ``"alert": true``, which the run's MLflow mirror turns
    into the tag ``alert.KIND`` (lmtrain.training.run)."""
    if not said:
        from lmtrain.console import log

        log.info(f"ALERT: {message}")
    append(run_dir, kind, message, alert=True, **fields)


class Mirror(logging.Handler):
    """A handler of :data:`events` calling ``send(run_dir, entry)`` for each entry; a failure is reported, never raised
    (a mirror failing must not stop training)."""

    def __init__(self, send) -> None:
        super().__init__(logging.INFO)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.send(record.run_dir, record.entry)
        except Exception as exc:  # noqa: BLE001
            print(f"[lmtrain] could not mirror the logbook ({exc})", file=sys.stderr)


def read_jsonl(path: Path) -> list[dict]:
    """The objects of a JSON-lines file (none if it is missing); a line cut by a crash is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / FILE)


def saved_steps(run_dir: str | Path) -> list[int]:
    """The steps the logbook records checkpoints of (``checkpoint`` entries) since the run last started from scratch
    (``start``): what a restart should find in the checkpoint directory."""
    steps: list[int] = []
    for entry in read_jsonl(Path(run_dir) / FILE):
        if entry.get("kind") == "start":
            steps = []
        elif entry.get("kind") == "checkpoint" and isinstance(entry.get("step"), int):
            steps.append(entry["step"])
    return steps
