"""Reading back what a run logged with ``logger=csv`` (``RUN_DIR/csv/metrics.csv``)."""

from __future__ import annotations

import csv
from pathlib import Path


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


def by_step(run_dir: str | Path) -> dict[int, dict[str, str]]:
    """Every logged value per step: Lightning's rows and the direct ones (``log_direct``) of a step merged."""
    merged: dict[int, dict[str, str]] = {}
    for row in read_metrics(run_dir):
        if row.get("step"):
            merged.setdefault(int(float(row["step"])), {}).update({k: v for k, v in row.items() if v not in ("", None)})
    return merged


def metric(run_dir: str | Path, key: str) -> list[float]:
    """One metric's logged values, in order."""
    return [float(r[key]) for r in read_metrics(run_dir) if r.get(key)]
