"""The run logbook: one JSON line per notable event (alerts, resumes, rollbacks), in ``RUN_DIR/logbook.jsonl``.

OPT-175B's team kept a logbook of every restart and intervention by hand; here the trainer writes it.
Read it with ``python -m lmtrain.logbook RUN_DIR``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

FILE = "logbook.jsonl"
# Every appended entry is also a record of this logger, with ``record.run_dir`` and ``record.entry``: a run mirrors
# its logbook by attaching a handler for the attempt (lmtrain.training.run: to MLflow), with logging's own registry of
# handlers instead of one of ours. Not propagated: the console says its own lines.
events = logging.getLogger("lmtrain.logbook")
events.propagate = False
events.setLevel(logging.INFO)


def append(run_dir: str | Path, kind: str, message: str, **fields) -> None:
    """Append an event; never raises (a full disk must not turn an alert into a crash). The mirrors hear of it even
    when the file could not take it (the disk-full alert)."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kind": kind, "message": message, **fields}
    try:
        with open(Path(run_dir) / FILE, "a") as fh:
            fh.write(json.dumps(entry, default=str) + "\n")
    except OSError as exc:
        print(f"[lmtrain] could not write the logbook in {run_dir}: {exc}", file=sys.stderr)
    events.info(message, extra={"run_dir": Path(run_dir), "entry": entry})


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
