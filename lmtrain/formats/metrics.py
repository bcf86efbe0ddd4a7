"""What a run logged: the record ``RUN_DIR/metrics.jsonl``, lmtrain's own, and its CSV view ``RUN_DIR/csv/metrics.csv``.

The record is append-only, one JSON line per line written:

* ``{"attempt": N, "from_step": S, "time": T, "steps": "number"}``: attempt N of the run starts, its timeline from
  step S (0: from scratch; else the step of the checkpoint it resumed from);
* ``{"a": N, "step": s, "m": {name: value, ...}}``: values attempt N logged for step s.

Steps are numbered as checkpoints, the console and the logbook number them: the values of the 250th optimizer step,
its validation and its evals are at step 250; step 0 holds what is measured before any training (the first evals).
Attempts written before 2026-12-04 (no ``steps`` in their first line) logged the 250th step at 249: their rows are
read one step later, so a run continued across that change keeps one numbering.

A row of attempt N at step s belongs to an **abandoned timeline** when a later attempt started from a step before s (a
resume from an older checkpoint, a rollback), or from scratch: kept, marked, and left out of the current view
(:func:`current_rows`), where every step appears once per line it was logged with, from the attempt that went on from
there. Nothing is ever deleted or rewritten: a kill, a full disk or a crash costs at most the lines not flushed yet
(:class:`Record` flushes at least every :data:`FLUSH_S` seconds and before every checkpoint), and a line cut by a kill
is skipped when read.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path

RECORD = "metrics.jsonl"
NUMBERING = "number"  # the first line's "steps": rows at the step's number, counted from 1 (the module's docstring)
FLUSH_S = 5.0  # the record's lines reach the file at least this often (and before every checkpoint, and at the end)


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, float | int) and not isinstance(v, bool) else v


class Record:
    """The writer of ``RUN_DIR/metrics.jsonl`` for one attempt (rank zero). Lines are kept in memory and written by
    :meth:`flush`: with ``os.write`` on an ``O_APPEND`` file, continuing exactly where a failed write (a full disk)
    stopped, so no line is torn or written twice; what could not be written stays pending, and is written when there
    is space again."""

    def __init__(self, run_dir: str | Path, from_step: int) -> None:
        self.path = Path(run_dir) / RECORD
        data = self.path.read_bytes() if self.path.is_file() else b""
        self.attempt = 1 + sum(1 for line in _parse(data) if "attempt" in line)
        self._last_flush = time.monotonic()
        self._warned = False
        torn = bool(data) and not data.endswith(b"\n")
        head = {"attempt": self.attempt, "from_step": int(from_step), "time": time.time(), "steps": NUMBERING}
        self._pending = (b"\n" if torn else b"") + (json.dumps(head) + "\n").encode()  # a kill's cut line stays alone
        self.flush()

    def add(self, step: int, metrics: dict) -> None:
        line = {"a": self.attempt, "step": int(step), "m": {k: _jsonable(v) for k, v in metrics.items()}}
        self._pending += (json.dumps(line) + "\n").encode()
        if time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> bool:
        """Write what is pending; True when nothing is left pending."""
        self._last_flush = time.monotonic()
        if not self._pending:
            return True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while self._pending:
                    n = os.write(fd, self._pending)
                    self._pending = self._pending[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._warned:
                from lmtrain.console import log

                log.warning(
                    f"could not write the metrics record {self.path} ({exc.strerror or exc}): kept in memory, written when it can be"
                )
                self._warned = True
            return False
        self._warned = False
        return True


def read_lines(path: Path) -> list[dict]:
    """The record's lines (a line cut by a kill, or not JSON, is skipped)."""
    return _parse(path.read_bytes()) if path.is_file() else []


def _parse(data: bytes) -> list[dict]:
    out = []
    for raw in data.split(b"\n"):
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(line, dict):
            out.append(line)
    return out


def record_rows(run_dir: str | Path) -> list[dict]:
    """Every logged line of the record in order, each ``{"attempt", "step", "values", "abandoned"}``."""
    lines = read_lines(Path(run_dir) / RECORD)
    heads = [line for line in lines if isinstance(line.get("attempt"), int)]
    starts = {int(line["attempt"]): int(line.get("from_step", 0)) for line in heads}
    shift = {int(line["attempt"]): int(line.get("steps") != NUMBERING) for line in heads}  # older attempts: from 0
    rows = []
    for line in lines:
        if not isinstance(line.get("a"), int) or not isinstance(line.get("step"), int) or not isinstance(line.get("m"), dict):
            continue
        a = line["a"]
        step = line["step"] + shift.get(a, 0)
        abandoned = any(b > a and (start < step or start == 0) for b, start in starts.items())
        rows.append({"attempt": a, "step": step, "values": line["m"], "abandoned": abandoned})
    return rows


def current_rows(run_dir: str | Path) -> list[dict[str, str]]:
    """The current timeline's lines as CSV-like rows (``step`` and each value as text, as Lightning's CSV wrote them)."""
    out = []
    for row in record_rows(run_dir):
        if not row["abandoned"]:
            out.append({"step": str(row["step"]), **{k: str(v) for k, v in row["values"].items()}})
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """Rows of a run's CSV log, as written by Lightning's CSVLogger (which rewrites the whole file with one header
    when a new column appears). A row with another number of fields than the header is damage: ValueError."""
    with open(Path(run_dir) / "csv" / "metrics.csv", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            return []
        rows = []
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"line {reader.line_num} has {len(row)} fields, the header {len(header)}")
            rows.append(dict(zip(header, row)))
        return rows


def rows(run_dir: str | Path) -> list[dict[str, str]]:
    """The run's logged rows: the record's current timeline, or a run's CSV log where it has no record (runs before
    2026-12-01, which logged the 250th step at 249: read one step later, as the record's older attempts are)."""
    if (Path(run_dir) / RECORD).is_file():
        return current_rows(run_dir)
    if not (Path(run_dir) / "csv" / "metrics.csv").is_file():
        return []  # nothing logged yet
    return [{**r, "step": str(int(float(r["step"])) + 1)} if r.get("step") else r for r in read_metrics(run_dir)]


def by_step(run_dir: str | Path) -> dict[int, dict[str, str]]:
    """Every logged value per step: Lightning's rows and the direct ones (``log_direct``) of a step merged."""
    merged: dict[int, dict[str, str]] = {}
    for row in rows(run_dir):
        if row.get("step"):
            merged.setdefault(int(float(row["step"])), {}).update({k: v for k, v in row.items() if v not in ("", None)})
    return merged


def metric(run_dir: str | Path, key: str) -> list[float]:
    """One metric's logged values, in order."""
    return [float(r[key]) for r in rows(run_dir) if r.get(key)]


def summary(run_dir: str | Path) -> dict[str, tuple[int, float] | None]:
    """The figures of a run's end-of-run summary, from its current timeline (so a re-run, a resume or a rollback
    cannot change them): ``train_loss`` and ``val_loss`` (the last logged, each ``(step, value)``) and ``best_val``
    (the lowest finite ``val/loss``, the earliest of a tie); None where nothing was logged. Each step is counted as
    the checkpoints count them (the record's step)."""
    steps = by_step(run_dir)

    def series(key: str) -> list[tuple[int, float]]:
        out = []
        for step, values in sorted(steps.items()):
            try:
                out.append((step, float(values[key])))
            except (KeyError, ValueError):
                continue
        return out

    train, val = series("train/loss"), series("val/loss")
    finite = [(s, v) for s, v in val if math.isfinite(v)]
    return {
        "train_loss": train[-1] if train else None,
        "val_loss": val[-1] if val else None,
        "best_val": min(finite, key=lambda sv: (sv[1], sv[0])) if finite else None,
    }
