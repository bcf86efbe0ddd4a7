"""Reading back what a run logged with ``logger=csv`` (``RUN_DIR/csv/metrics.csv``)."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """Rows of a run's CSV log, as written by Lightning's CSVLogger."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


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
