"""At the end of training: PNG plots of the loss and of the learning rate applied, in ``RUN_DIR/plots/`` and in MLflow.

The plots are those of ``python -m lmtrain.report RUN_DIR`` (lmtrain/training/plots.py), made from what this run logged
(its CSV log or its MLflow run), with rollbacks, learning-rate corrections and divergence signals marked. A plot
that cannot be made is reported and skipped: it never fails a finished training run.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lmtrain.console import log
from lmtrain.training.loggers import flush as flush_loggers


class Report(L.Callback):
    """Args:
    run_dir: the run directory.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = Path(run_dir)
        self.files: list[Path] = []

    def on_train_end(self, trainer, pl_module) -> None:
        flush = getattr(pl_module, "flush_step_stats", None)
        if flush is not None:  # the last step's statistics are read one step late (lmtrain.training.module): log them first
            flush()
        if not trainer.is_global_zero:
            return
        from lmtrain.training import plots as report

        try:
            metrics = None
            mlflow = [lg for lg in trainer.loggers if type(lg).__name__ == "MLFlowLogger"]
            flush_loggers(trainer.loggers)  # rows still in memory (the metrics record's, the CSV view's)
            metrics = report.from_record(self.run_dir)
            if metrics is None and mlflow:
                metrics = report.from_mlflow(self.run_dir, client=mlflow[0].experiment, run_id=mlflow[0].run_id)
            if not metrics or not any(metrics.values()):
                return  # nothing logged (logger=none)
            self.files = report.write_plots(self.run_dir, metrics)
            for lg in mlflow:
                for f in self.files:
                    lg.experiment.log_artifact(lg.run_id, str(f), artifact_path="plots")
        except Exception as exc:  # noqa: BLE001 - plots are a convenience; training has finished
            log.info(f"could not write the plots in {self.run_dir / 'plots'}: {exc}")
