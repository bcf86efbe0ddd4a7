"""Plots of a run: training and validation loss, and the learning rate actually applied, as PNG files.

    python -m lmtrain.report RUN_DIR [--tracking-uri URI]

Writes ``RUN_DIR/plots/loss.png`` and ``RUN_DIR/plots/lr.png``. The values come from the run's metrics record
(``RUN_DIR/metrics.jsonl``: its current timeline), or, for a run without one, its CSV log or its MLflow run (the
tracking URI in ``RUN_DIR/config.yaml`` unless ``--tracking-uri``, the run found by its ``run_dir`` tag; given
``--tracking-uri``, MLflow is read). Where a rollback rewound steps, the last value logged for a step is the one
plotted (the timeline the run kept). Rollbacks, learning-rate corrections (operator, config) and
divergence signals from ``lr_corrections.jsonl`` and ``logbook.jsonl`` are marked on both plots. Each PNG carries
its plotted point counts as PNG text (key ``lmtrain``, JSON). At the end of training the ``report`` callback
(``callbacks/report.py``) writes the same files and logs them to MLflow as artifacts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmtrain.console import help_text
from lmtrain.errors import InputError
from lmtrain.training.plots import report


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.report") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--tracking-uri", default=None, help="read the metrics from this MLflow store")
    args = p.parse_args(argv)
    try:
        files, metrics = report(Path(args.run_dir), args.tracking_uri)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{k} {len(v)}" for k, v in metrics.items())
    print(f"points: {counts}")
    for f in files:
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
