"""The run's metrics record, its CSV view, and Lightning's MLflow logger made to continue a resumed run.

* :class:`RecordLogger`, in every run (lmtrain.training.run adds it): the append-only record ``RUN_DIR/metrics.jsonl``
  (lmtrain.formats.metrics), the source of truth that ``lmtrain report`` and the tools read.
* :class:`CSVLogger` (``logger=csv``): ``RUN_DIR/csv/metrics.csv``, a view of the record's current timeline. It is
  rewritten only by writing a new file beside it and renaming it over the old one (a kill or a full disk leaves the
  old file whole; Lightning's CSV logger deleted it on resume and rewrote it in place when a column was added).
* :class:`TensorBoardLogger` (``logger=tensorboard``): ``RUN_DIR/tensorboard``, one folder across attempts; an attempt
  that resumes from step S purges the events after step S that an earlier attempt wrote (TensorBoard's
  ``purge_step``), so the board shows the timeline the run kept.
* :class:`WandbLogger` (``logger=wandb``): one Weights & Biases run across the attempts of a run (its id is in every
  checkpoint), files in ``RUN_DIR/wandb``; offline unless ``mode=online`` (``wandb sync`` uploads an offline run).
* :class:`MLFlowLogger` continues the same MLflow run (``run_id`` from the checkpoint), marks it running again,
  and drops each value whose key the run already has at that step (MLflow cannot delete logged values). Params already logged
  keep their values; ones that changed since are recorded as a ``config_changed_at_step_N`` tag.

``lmtrain.training.run`` calls ``resume_at(step)`` before training when it resumes from a checkpoint of optimizer step
``step``: steps logged after that checkpoint by the interrupted process are logged again by the resumed one.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers import MLFlowLogger as _MLFlowLogger
from lightning.pytorch.loggers import TensorBoardLogger as _TensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as _WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from lmtrain.formats import metrics as record


class RecordLogger(Logger):
    """Every logged value into the run's record (rank zero), flushed at least every ``FLUSH_S`` seconds, before every
    checkpoint (:meth:`flush`, called by the checkpointer) and at the end. Its first line is written at the first
    value: a refused attempt writes nothing."""

    def __init__(self, run_dir: str | Path, from_step: int = 0) -> None:
        super().__init__()
        self.run_dir, self.from_step = Path(run_dir), from_step
        self._record: record.Record | None = None

    @property
    def name(self) -> str:
        return "record"

    @property
    def version(self) -> str:
        return ""

    @property
    @rank_zero_experiment
    def experiment(self) -> record.Record:
        if self._record is None:  # rank zero only: the other ranks get Lightning's dummy (they log nothing)
            self._record = record.Record(self.run_dir, self.from_step)
        return self._record

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.experiment.add(step if step is not None else 0, metrics)

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # the config is RUN_DIR/config.yaml

    @rank_zero_only
    def save(self) -> None:
        pass  # Lightning calls it after every log_metrics: the record writes on its own interval (Record.add)

    @rank_zero_only
    def flush(self) -> None:
        if self._record is not None:
            self._record.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.flush()


class TensorBoardLogger(_TensorBoardLogger):
    """Lightning's TensorBoard logger (tensorboardX or tensorboard writes the events) in one folder across attempts,
    without its ``hp_metric`` placeholder; a resumed attempt purges the later steps an earlier attempt logged."""

    def __init__(self, save_dir: str, name: str = "tensorboard", version: str = "", **kwargs: Any) -> None:
        super().__init__(save_dir=save_dir, name=name, version=version, default_hp_metric=False, **kwargs)

    def resume_at(self, step: int, relog: bool = False) -> None:
        """This attempt continues from ``step``: events after ``step``, from earlier attempts, are dropped."""
        self._kwargs["purge_step"] = step + 1

    @rank_zero_only
    def flush(self) -> None:
        """The events written out (before every checkpoint: the writer's own interval is 2 minutes)."""
        if self._experiment is not None:
            self._experiment.flush()


WANDB_MODES = ("offline", "online")
WANDB_ALIASES = {"dryrun": "offline"}  # W&B's older name, still read from WANDB_MODE


class WandbLogger(_WandbLogger):
    """Lightning's Weights & Biases logger, one W&B run per lmtrain run: the first attempt creates it, each checkpoint
    records its id (``wandb_run_id``) and a resume continues it (``id``, set by lmtrain.training.run). Files go to
    ``save_dir/wandb`` (the run directory). ``mode=offline`` (the default) needs no account and no network; each attempt
    writes a folder ``offline-run-DATE-ID`` (``-N`` added when one of that name exists) that ``wandb sync`` uploads into the one run. Values are plotted against
    ``trainer/global_step``.

    A kill loses what W&B's writer had not yet put in its file (it writes every 15 s, or when a 32 KiB block fills). So a
    resumed offline attempt reads what the earlier attempts' files hold (:func:`wandb_steps`) and logs, from the run's
    record, each value of the kept timeline before the checkpoint that they lack; after that it leaves out the values
    they hold (the resume is exact: the same values). Each value of the run is then in W&B once. A rollback's new
    timeline is logged again, as MLflow's is; an online attempt logs again from its checkpoint's step."""

    def __init__(self, save_dir: str, project: str = "lmtrain", name: str | None = None, id: str | None = None,
                 mode: str = "offline", **kwargs: Any) -> None:  # fmt: skip
        import wandb

        mode = WANDB_ALIASES.get(mode, mode)
        if mode not in WANDB_MODES:  # checked before the run starts (check_machine); this is for Python construction
            raise ValueError(f"logger.wandb.mode={mode!r} must be one of {', '.join(WANDB_MODES)}")
        kwargs.setdefault("settings", wandb.Settings(silent=True))  # the run's own lines say where it is (where())
        # offline=False: Lightning would export WANDB_MODE=dryrun to this process's environment, which the ranks it
        # starts read as their logger.wandb.mode; the mode goes to wandb.init itself
        super().__init__(name=name, save_dir=save_dir, id=id, project=project, offline=False, **kwargs)
        self._wandb_init.pop("anonymous", None)  # wandb 0.31 warns on it, set or not
        self._wandb_init["mode"] = mode
        self._run_dir = Path(save_dir)
        self._held: dict[str, int] = {}  # per key, the last step the run's earlier files hold
        self._backfill: list[tuple[int, dict]] = []  # (step, values) the earlier files lack, logged first
        self._finished = False

    def resume_at(self, step: int, relog: bool = False) -> None:
        """This attempt continues from ``step`` (see the class): what to log first, and what not to log again."""
        self._held, self._backfill = {}, []
        if relog or self._wandb_init["mode"] != "offline" or not self._id:
            return
        self._held = wandb_steps(self._run_dir / "wandb", self._id)
        for row in record.record_rows(self._run_dir):
            if not row["abandoned"] and row["step"] <= step:
                lacking = {k: v for k, v in row["values"].items() if row["step"] > self._held.get(k, -1)}
                if lacking:
                    self._backfill.append((row["step"], lacking))

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._finished:  # a value after finalize would start a new W&B run
            return
        backfill, self._backfill = self._backfill, []
        for at, values in backfill:
            super().log_metrics(values, at)
        if step is not None and self._held:
            metrics = {k: v for k, v in metrics.items() if step > self._held.get(k, -1)}
            if not metrics:
                return
        super().log_metrics(metrics, step)

    @property
    def run_id(self) -> str | None:
        return self.experiment.id if rank_zero_only.rank == 0 else None

    def where(self) -> str:
        """Where this run is, as a user finds it again."""
        run = self.experiment
        if self._wandb_init["mode"] == "offline":
            home = self._run_dir.resolve() / "wandb"
            return f"offline run {run.id} in {home} (upload: wandb sync {home}/offline-run-*-{run.id}*)"
        return f"run {run.id}: {run.url}"

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """The W&B run marked finished (exit code 0) or failed (1) and its files written out."""
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment, self._finished = None, True


def wandb_steps(folder: Path, run_id: str) -> dict[str, int]:
    """Per key, the last ``trainer/global_step`` that the offline files of W&B run ``run_id`` in ``folder`` hold (every
    attempt's ``offline-run-DATE-ID[-N]/run-ID.wandb``). The file: a 7-byte header (``:W&B``, magic, version), then 32 KiB
    blocks of records, each a 7-byte header (CRC-32 of kind and payload, length, kind: full, first, middle, last) and
    a payload, wandb's ``Record`` message. A record cut by a kill, or one whose CRC does not match, ends the file."""
    import json
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    held: dict[str, int] = {}
    block = 32768
    for path in sorted(folder.glob(f"offline-run-*/run-{run_id}.wandb")):
        data = path.read_bytes()
        at, part = 7, b""
        while data[:4] == b":W&B" and at + 7 <= len(data):
            if block - at % block < 7:  # a block's tail too short for a record header is padding
                at += block - at % block
                continue
            crc, length, kind = struct.unpack_from("<IHB", data, at)
            body = data[at + 7 : at + 7 + length]
            if kind not in (1, 2, 3, 4) or len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
                break
            at += 7 + length
            part = body if kind in (1, 2) else part + body
            if kind not in (1, 4):
                continue
            rec = wandb_internal_pb2.Record.FromString(part)
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
            if "trainer/global_step" in items:
                step = int(json.loads(items["trainer/global_step"]))
                for key in items:
                    if not key.startswith("_") and key != "trainer/global_step":
                        held[key] = max(held.get(key, -1), step)
    return held


def check_wandb(mode: str) -> str | None:
    """What stops ``logger=wandb`` in ``mode`` on this machine, in one line (None: nothing): wandb not installed, an
    unknown mode, online without credentials (an API key, an identity token file, or a netrc entry for the host)."""
    import importlib.util
    import netrc
    from urllib.parse import urlparse

    if importlib.util.find_spec("wandb") is None:
        return "logger=wandb needs wandb, which lmtrain does not install for every run: pip install wandb==0.31.0"
    if WANDB_ALIASES.get(mode, mode) not in WANDB_MODES:
        return f"logger.wandb.mode={mode} must be one of: {', '.join(WANDB_MODES)}"
    if mode == "online" and not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")):
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
        try:
            known = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            known = False
        if not known:
            return (f"logger.wandb.mode=online needs W&B credentials for {host}: run `wandb login` or set WANDB_API_KEY; "
                    "logger.wandb.mode=offline (the default) needs none and `wandb sync` uploads the run later")  # fmt: skip
    return None


class CSVLogger(Logger):
    """``save_dir/name/metrics.csv``: one row per logged line of the current timeline (the rows of earlier attempts
    up to the resumed step, from the record, then this attempt's), one header. Rows are appended; a new column, or the
    first write of an attempt, writes the whole file anew beside it and renames it over the old one."""

    def __init__(self, save_dir: str, name: str = "csv", version: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__()
        self._save_dir, self._name, self._version = str(save_dir), name, str(version)
        self.flush_every = max(1, int(flush_logs_every_n_steps))
        self._rows: list[dict] = []  # every row of the view (kept for a rewrite)
        self._written = 0  # rows of _rows already in the file
        self._header: list[str] | None = None  # the file's header, None before this attempt's first write
        self._keep: list[dict] = []  # earlier attempts' rows, from the record (resume_at)

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return self._version

    @property
    def log_dir(self) -> str:
        return os.path.join(self._save_dir, self._name, self._version) if self._version else os.path.join(self._save_dir, self._name)

    @property
    def path(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    @property
    def experiment(self):
        return self

    def resume_at(self, step: int, relog: bool = False) -> None:
        """This attempt continues from ``step``: the view keeps the record's current rows up to it."""
        run_dir = Path(self._save_dir)
        self._keep = [r for r in record.rows(run_dir) if int(r["step"]) <= step] if (run_dir / record.RECORD).is_file() else []

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._header is None and not self._rows:
            self._rows = list(self._keep)
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        row["step"] = step if step is not None else len(self._rows)
        self._rows.append(row)
        if step is not None and step % self.flush_every == 0:
            self.save()

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @rank_zero_only
    def save(self) -> None:
        new = self._rows[self._written :]
        if not new:
            return
        keys = sorted({k for r in self._rows for k in r} - {"step"}) + ["step"]
        try:
            if self._header is None or set(keys) != set(self._header):
                self._rewrite(keys)
            else:
                with open(self.path, "a", newline="") as fh:
                    csv.DictWriter(fh, fieldnames=self._header).writerows(new)
        except OSError as exc:  # a full disk: the view catches up at the next save; the record is what counts
            rank_zero_only(print)(
                f"[lmtrain] could not write {self.path} ({exc.strerror or exc}); the record metrics.jsonl keeps the values"
            )
            return
        self._written = len(self._rows)

    def _rewrite(self, keys: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".metrics.csv.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=keys)
                writer.writeheader()
                writer.writerows(self._rows)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self._header = keys

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()


def flush(loggers, best_effort: bool = False) -> None:
    """What each logger holds in memory written out: ours by ``flush`` (the record whatever its interval, the CSV
    view), Lightning's by ``save``. ``best_effort``: a logger that fails is passed over (a process about to exit)."""
    for lg in loggers:
        try:
            getattr(lg, "flush", lg.save)()
        except Exception:  # noqa: BLE001
            if not best_effort:
                raise


def resolved_uri(uri: str | None) -> str | None:
    """A tracking URI as it is found again from another directory: a relative SQLite file resolved against the working
    directory, where MLflow opens it; others as given."""
    if uri and uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    return uri


def check_tracker(uri: str | None, run_id: str | None) -> None:
    """Refuse, in one line (InputError), a tracking store that does not answer, or that does not hold ``run_id`` (the
    MLflow run a resumed checkpoint records): before the attempt writes anything. A SQLite store is not created here
    when its file is missing."""
    from lmtrain.errors import InputError

    if not uri:
        return
    where = f"logger.mlflow.tracking_uri={uri}"
    if uri.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10) as reply:
                ok = reply.status == 200
        except (OSError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(
                f"the MLflow tracking server {uri} does not answer ({reason}): start it, or give "
                "logger.mlflow.tracking_uri=URI where it is (logger=csv trains without MLflow)"
            ) from None
        if not ok:
            raise InputError(f"the MLflow tracking server {uri} answers /health with status {reply.status}: is it an MLflow server?")
    elif uri.startswith("sqlite:///") and run_id:
        if not Path(uri.removeprefix("sqlite:///")).is_file():
            raise InputError(
                f"MLflow run {run_id}, which the checkpoint records, cannot be in {where}: that store does not exist; give "
                "logger.mlflow.tracking_uri=URI of the store it is in"
            )
    else:
        return
    if run_id:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(tracking_uri=uri).get_run(run_id)
        except MlflowException as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise InputError(
                f"MLflow run {run_id}, which the checkpoint records, is not in {where} ({first}): give "
                "logger.mlflow.tracking_uri=URI of the store it is in"
            ) from None


class MLFlowLogger(_MLFlowLogger):
    _resume_step: int | None = None
    _logged_through: dict[str, int] = {}  # per key: the last step the interrupted process logged (read at the start)

    _relog = False

    def where(self) -> str:
        """Where this run is, as a user finds it again: the experiment, the run id and the store (a relative SQLite
        file resolved against the working directory, where MLflow opened it)."""
        uri = resolved_uri(self._tracking_uri) or "MLflow's default store"
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
            if not self._relog:  # per key: the train statistics are logged a step later than the rates (lmtrain.training.module)
                run = client.get_run(self._run_id)
                self._logged_through = {key: max(m.step for m in client.get_metric_history(self._run_id, key)) for key in run.data.metrics}
            client.update_run(self._run_id, status="RUNNING")
        return client

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        _ = self.experiment
        if step is not None and self._logged_through:  # what the interrupted process logged already (the same values)
            metrics = {k: v for k, v in metrics.items() if step > self._logged_through.get(k, -1)}
            if not metrics:
                return
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
