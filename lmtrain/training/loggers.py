"""Lightning's CSV and MLflow loggers, made to continue a resumed run without duplicated steps.

``lmtrain.training.run`` calls ``resume_at(step)`` before training when it resumes from a checkpoint of optimizer step
``step``. Steps logged after that checkpoint by the interrupted process are logged again by the resumed one
(identically: the continuation is exact), so:

* :class:`CSVLogger` keeps the rows of ``metrics.csv`` below ``step`` and appends after them (Lightning's own
  would delete the file);
* :class:`MLFlowLogger` continues the same MLflow run (``run_id`` from the checkpoint), marks it running again,
  and drops values for steps the run already has (MLflow cannot delete logged values). Params already logged
  keep their values; ones that changed since are recorded as a ``config_changed_at_step_N`` tag.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import MLFlowLogger as _MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only


class CSVLogger(_CSVLogger):
    _keep_rows: list[dict] | None = None

    def resume_at(self, step: int, relog: bool = False) -> None:
        path = Path(self.log_dir) / "metrics.csv"
        rows: list[dict] = []
        if path.is_file():
            with open(path, newline="") as fh:
                for row in csv.DictReader(fh):
                    try:
                        if int(float(row.get("step") or "nan")) < step:
                            rows.append({k: v for k, v in row.items() if v not in ("", None)})
                    except ValueError:
                        continue
        self._keep_rows = rows

    @property
    def experiment(self):
        with warnings.catch_warnings():
            if self._keep_rows is not None:  # its "previous log files will be deleted" is not true here
                warnings.filterwarnings("ignore", message="Experiment logs directory")
            exp = super().experiment  # Lightning's writer removes an existing metrics.csv here
        if self._keep_rows is not None and rank_zero_only.rank == 0:
            rows, self._keep_rows = self._keep_rows, None
            if rows:
                exp.metrics = rows
                exp.save()
        return exp


class MLFlowLogger(_MLFlowLogger):
    _resume_step: int | None = None
    _logged_through: int | None = None

    _relog = False

    def where(self) -> str:
        """Where this run is, as a user finds it again: the experiment, the run id and the store (a relative SQLite
        file resolved against the working directory, where MLflow opened it)."""
        uri = self._tracking_uri or "MLflow's default store"
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
        artifacts = self.experiment.get_experiment(self.experiment_id).artifact_location
        return f"experiment '{self._experiment_name}', run {self.run_id} in {uri}, artifacts in {artifacts} (browse: mlflow ui --backend-store-uri {uri})"

    def resume_at(self, step: int, relog: bool = False) -> None:
        """``relog``: a rollback's new timeline; its steps are logged again (MLflow keeps both values)."""
        self._resume_step, self._relog = step, relog

    @property
    def experiment(self):
        first = not self._initialized
        client = super().experiment
        if first and self._resume_step is not None and self._run_id is not None and rank_zero_only.rank == 0:
            if not self._relog:
                run = client.get_run(self._run_id)
                steps = [m.step for key in run.data.metrics for m in client.get_metric_history(self._run_id, key)]
                self._logged_through = max(steps) if steps else None
            client.update_run(self._run_id, status="RUNNING")
        return client

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        _ = self.experiment
        if self._logged_through is not None and step is not None and step <= self._logged_through:
            return  # the interrupted process logged this step already (with the same value)
        super().log_metrics(metrics, step)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if self._resume_step is None:
            return super().log_hyperparams(params)
        client = self.experiment
        old = client.get_run(self.run_id).data.params
        new = {k: v for k, v in params.items() if k not in old}
        changed = sorted(k for k, v in params.items() if k in old and str(v)[:6000] != old[k])
        if new:
            super().log_hyperparams(new)
        if changed:
            client.set_tag(self.run_id, f"config_changed_at_step_{self._resume_step}", ", ".join(changed)[:5000])
