"""Reading back what a run logged with ``logger=csv`` (``RUN_DIR/csv/metrics.csv``)."""

from __future__ import annotations

import csv
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """Rows of a run's CSV log, as written by Lightning's CSVLogger."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def metric(run_dir: str | Path, key: str) -> list[float]:
    """One metric's logged values, in order."""
    return [float(r[key]) for r in read_metrics(run_dir) if r.get(key)]
