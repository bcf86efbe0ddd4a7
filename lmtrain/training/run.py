"""One training run from a composed config: validate, prepare, instantiate, fit."""

from __future__ import annotations

import functools
import inspect
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate as _hydra_instantiate
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf, open_dict

from lmtrain import console
from lmtrain.console import log
from lmtrain.errors import InputError, Preempted, RunStopped
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import corrections, logbook, runlock
from lmtrain.formats import metrics as metrics_record
from lmtrain.formats.checkpoint import CheckpointError, check_compatible, config_hash
from lmtrain.formats.rundir import CONFIG, write_text_atomic
from lmtrain.training import batch, compat, init_from, restarts, speed
from lmtrain.training.checkpoint.resume import checked_here, resume_identity, resume_point, unfinished_saves
from lmtrain.training.config import (
    ConfigError,
    apply_global_batch_size,
    check_machine,
    complete_moe,
    schedule_notes,
    validate_config,
    validate_data,
)
from lmtrain.training.contracts import CheckpointStore, Preempts, RequestsRollback, SaveGuard, StopsTraining
from lmtrain.training.goodput import Goodput
from lmtrain.training.layout import Layout
from lmtrain.training.precision import build as build_precision

# Library warnings that are not the user's to act on, for every way in (train.py, the bench, the Python API)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning 2.6.6 on torch 2.13, harmless
warnings.filterwarnings("ignore", message=".*'set_vital' is deprecated.*")  # torchdata 0.11 on torch 2.13, harmless, every run
# fp16: when the gradient scaler skips an overflowing update, torch warns that the scheduler stepped before the optimizer;
# the schedule is a function of the step count (lmtrain.nn.optim), so nothing is skipped
warnings.filterwarnings("ignore", message=r".*lr_scheduler.step\(\)` before `optimizer.step\(\)`.*")
# val/loss is reduced over ranks by the module itself and logged from rank zero, with the step it belongs to
warnings.filterwarnings("ignore", message=r".*self.log\('(val/.*|step)', \.\.\., sync_dist=True.*")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}/" if not isinstance(v, dict) or v else f"{prefix}{k}"))
        return out
    out[prefix.rstrip("/")] = d
    return out


def flat_params(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as flat ``a/b/c -> value`` params (hydra internals dropped)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return {k: ("null" if v is None else v) for k, v in _flatten(container).items() if k}


def meta_model(model_factory) -> torch.nn.Module:
    """The model built on the meta device: shapes and counts without allocating memory."""
    with torch.device("meta"):
        return model_factory()


def describe_model(model: torch.nn.Module) -> str:
    """Parameter counts of a (meta-device) model."""
    from lmtrain.nn.model import Decoder, matmul_params, num_params

    total = num_params(model)
    if isinstance(model, Decoder):
        c = model.cfg
        return (
            f"model {c.name} ({c.family}): {total:,} parameters ({total / 1e6:.2f}M; {matmul_params(model):,} in matmuls), "
            f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads"
        )
    return f"model {type(model).__name__}: {total:,} parameters"


def model_identity(model: torch.nn.Module, cfg: DictConfig) -> dict:
    """What a checkpoint records about the model, and what a resume compares (lmtrain.formats.checkpoint.check_compatible)."""
    import dataclasses

    from lmtrain.formats.checkpoint import param_shapes

    mc = getattr(model, "cfg", None)
    return {
        "model_config": dataclasses.asdict(mc) if dataclasses.is_dataclass(mc) else None,
        "params": param_shapes(model),
        "optimizer": (cfg.get("optimizer") or {}).get("_target_"),
    }


def instantiate(config, *args, **kwargs):
    """Hydra's ``instantiate``, but a user error raised by a constructor (an ``InputError``: a bad option value
    checked in ``__init__``) stays that error instead of being wrapped in Hydra's InstantiationException, so it
    ends in one message with exit 2 like every other input error."""
    try:
        return _hydra_instantiate(config, *args, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, InputError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def instantiate_group(node: DictConfig | None) -> list:
    """Instantiate each entry of a dict of named configs (callbacks, loggers); null entries are skipped."""
    if not node:
        return []
    return [instantiate(v) for v in node.values() if v is not None]


def train(cfg: DictConfig) -> dict[str, float]:
    """Run training for ``cfg``; return the final logged metrics as floats.

    A rollback requested by the divergence detector ends the attempt; the next attempt resumes from the
    checkpoint it chose, with the learning-rate correction recorded (lmtrain.formats.corrections). A guard that stopped
    training (the detector's ``stop``, the disk guard) raises :class:`RunStopped`: the run did not finish.
    What the run says goes to the console and, once the attempt is accepted, to ``RUN_DIR/train.log``
    (lmtrain.console), with how it ended: the summary, the ``stopped:`` or ``error:`` line, or the traceback.
    """
    # PyTorch's caching allocator with expandable segments: blocks grow in place instead of fragmenting the card near its
    # limit (torchtitan's default too). It is read at the first CUDA allocation, which comes later; a user's own
    # setting (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF, its newer name) wins. callbacks.throughput logs the
    # allocator's retries (perf/alloc_retries). An empty variable counts as unset, as PyTorch reads it.
    if not os.environ.get("PYTORCH_ALLOC_CONF") and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    console.begin_run()
    clock = Goodput(time.monotonic())  # the run's start, and where its time goes across attempts (lmtrain.training.goodput)
    rollback = lock = None
    accepted: list = []  # the trainer of the attempt once it is accepted (_accept): its end goes in the logbook
    created: list[Path] = []  # the directories this run made (the run directory and any parent missing)
    said: list[str] = []  # what the run says after its first line (the speed preset's line)
    ran = False  # an attempt was accepted: what it wrote is the run's
    try:
        lock = _take_run(cfg, created, said)
        while True:
            accepted.clear()
            metrics, detector, stopped = _attempt(cfg, rollback, clock, accepted, said)
            ran = True
            if stopped is not None:
                raise stopped
            rollback = detector.rollback_request if detector is not None else None
            if rollback is None:
                return metrics
            run_dir = Path(cfg.run_dir)
            if console.launched_rank() == 0:
                _record_rollback(run_dir, rollback)
            log.info(f"rollback to {rollback['checkpoint']} (learning rate x{rollback['scale']})")
            with open_dict(cfg):
                cfg.ckpt_path = rollback["checkpoint"]
    except RunStopped as exc:
        console.file_only(f"stopped: {exc.reason} (exit status {exc.status})")
        raise
    except Preempted as exc:
        console.file_only(f"preempted: {exc.reason} (exit status 4)")
        raise
    except InputError as exc:
        console.file_only(f"error: {exc} (exit status 2)")
        _record_failure(cfg, accepted, "error", exc)
        raise
    except BaseException as exc:
        console.file_only(f"failed: {type(exc).__name__}", exc_info=True)
        _record_failure(cfg, accepted, "failed", exc)
        raise
    finally:
        if lock is not None:
            lock.release()
        console.end_file()
        if not ran and not accepted:  # refused: the directories it made go again (a refused attempt writes nothing)
            for d in reversed(created):
                try:
                    d.rmdir()
                except OSError:
                    break  # not empty (another process, or more than this run's files): kept


def _record_failure(cfg: DictConfig, accepted: list, kind: str, exc: BaseException) -> None:
    """An accepted attempt that ended in an error or a crash, in the logbook (rank zero), with the step it reached; a
    refused attempt writes nothing."""
    if not accepted or not accepted[0].is_global_zero:
        return
    step = accepted[0].global_step
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    what = "an error" if kind == "error" else "a crash"
    dead = "".join(f"; loader worker {w['worker']} (pid {w['pid']}) died: {_exit_words(w['exitcode'])}" for w in compat.dead_loader_workers(exc))
    logbook.append(cfg.run_dir, kind, f"the attempt ended in {what} at step {step}: {type(exc).__name__}: {first}{dead}", step=step)


def _exit_words(code: int) -> str:
    """A process's exit code in words: ``killed by signal SIGKILL``, or ``exit status 3``."""
    import signal

    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _take_run(cfg: DictConfig, created: list[Path], said: list[str]) -> runlock.RunLock | None:
    """The config checked, the run directory made and (global rank zero) its lock taken: once a run, before anything
    of it is read or changed (lmtrain.formats.runlock); a dead attempt's lock taken over is said in one line. The
    directories made here are added to ``created``, the outermost first; the speed preset's line to ``said``."""
    init_from.apply(cfg, _overrides())  # init_from=DIR: the model node is the directory's architecture, checked below
    turned_off = speed.adapt(cfg, _overrides())  # speed=fp8 fitted to this card and model, before the config is checked
    validate_config(cfg)
    complete_moe(cfg)  # every model.moe key spelt out in what the run records
    restarts.budget(cfg)
    check_machine(cfg)
    restarts.check_launcher()
    sized = batch.resolve(cfg)  # data.batch_size=auto: from this GPU's memory
    if sized:
        validate_config(cfg)  # the chosen size against global_batch_size and the rest
    apply_global_batch_size(cfg)
    batch.check_fits(cfg)  # the model's state against this card's (or host's) memory, before anything is written
    said.append(speed.describe(cfg, turned_off))
    said += [sized] if sized else []
    said += schedule_notes(cfg)
    run_dir = Path(cfg.run_dir)
    created += [d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the run directory {run_dir} (run_dir / paths.runs): {exc.strerror or exc}") from exc
    if console.launched_rank() != 0:
        return None
    try:
        lock = runlock.acquire(run_dir)
    except OSError as exc:
        raise InputError(f"cannot take the lock of {run_dir} ({runlock.FILE}): {exc.strerror or exc}") from exc
    if lock.took_over is not None:
        holder, why = lock.took_over
        log.warning(f"took over the lock of run directory {run_dir} from a dead attempt ({runlock.describe(holder)}): {why}")
        saved = logbook.saved_steps(run_dir)
        newest = f"; the newest checkpoint it recorded is step {max(saved)}" if saved else ""
        logbook.append(
            run_dir, "died", f"the attempt of {runlock.describe(holder)} ended without a word (killed, or its machine lost): {why}{newest}",
            step=max(saved) if saved else None, holder=holder,
        )  # fmt: skip
    try:
        restarts.check_budget(cfg, run_dir)  # rank zero decides: the others have not started, or end with it
    except RunStopped:
        lock.release()
        raise
    return lock


def _record_rollback(run_dir: Path, rollback: dict) -> None:
    """The rollback's correction, revoking the abandoned timeline's operator/config corrections, and its logbook entry."""
    entries = corrections.load(run_dir)
    revokes = corrections.abandoned(entries, rollback["from_step"])
    keys = ("from_step", "scale", "signal_step", "skip_batches", "checkpoint")
    corrections.add(run_dir, {**{k: rollback[k] for k in keys}, "reason": "rollback", "revokes": revokes})
    gone = f"; revoked {', '.join(corrections.describe(entries[i]) for i in revokes)}" if revokes else ""
    logbook.append(
        run_dir,
        "rollback",
        f"step {rollback['signal_step']}: rolling back to {Path(rollback['checkpoint']).name}, learning rate "
        f"x{rollback['scale']} from step {rollback['from_step']} on, skipping {rollback['skip_batches']} batch(es) of data{gone} "
        f"({rollback['why']})",
        step=rollback["signal_step"],
        revoked=[entries[i] for i in revokes],
    )


@dataclass
class _Attempt:
    """The parts of one attempt, built and wired here (nowhere else)."""

    cfg: DictConfig
    rollback: dict | None
    run_dir: Path
    callbacks: list
    checkpointer: CheckpointStore | None
    resume: ck.Checkpoint | None
    profiler: Any = None  # a Lightning profiler from the callbacks group: the Trainer's
    module: Any = None
    datamodule: Any = None
    trainer: Any = None
    identity: dict | None = None
    mirrors: list = field(default_factory=list)
    trackers: list = field(default_factory=list)  # (name, where) of each tracker's run (rank zero): said at the start and the end
    branch: dict | None = None  # started from another run's checkpoint: the parent (run, MLflow run id, step, checkpoint)
    weights: Any = None  # init_from=DIR on a fresh start: the directory's weights, checked (lmtrain.training.init_from.Loader)


def _attempt(cfg: DictConfig, rollback: dict | None, clock: Goodput, accepted: list, said: list[str] = ()):
    """One ``trainer.fit``; returns (final metrics, the divergence detector or None, the RunStopped of a guard that stopped it or None).
    In order: what is decided from the config alone (nothing written but the run directory), what is built and checked
    (data prepared, model identity and data stream against the checkpoint), the acceptance (only now is anything of the
    run written), the fit."""
    clock.begin_attempt()
    att = _decide(cfg, rollback, said)
    att.callbacks.insert(0, clock)  # first: its start hooks run before the other callbacks'
    att.callbacks.append(clock.step_end)  # last (Lightning puts the checkpointer after it): a step's end
    _build(att)
    _accept(att)
    accepted.append(att.trainer)
    return _fit(att, clock)


def _decide(cfg: DictConfig, rollback: dict | None, said: list[str] = ()) -> _Attempt:
    """The config checked, the callbacks built (cheap; their constructors check their options), the resume point."""
    import lightning as L

    run_dir = Path(cfg.run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    callbacks = instantiate_group(cfg.get("callbacks"))
    from lightning.pytorch.profilers import Profiler

    profilers = [c for c in callbacks if isinstance(c, Profiler)]  # a Lightning profiler chosen in the callbacks group
    if len(profilers) > 1 or (profilers and cfg.trainer.get("profiler")):
        raise ConfigError("more than one profiler: keep one of trainer.profiler and the callbacks group's profiler")
    callbacks = [c for c in callbacks if not isinstance(c, Profiler)]
    if cfg.get("preemption") and not any(isinstance(c, Preempts) for c in callbacks):  # every run, whatever its callbacks
        callbacks.append(instantiate(cfg.preemption))
    checkpointer = next((c for c in callbacks if isinstance(c, CheckpointStore)), None)  # lmtrain.callbacks.checkpoint.Checkpointer
    for c in callbacks if rollback is not None else ():
        if isinstance(c, RequestsRollback):
            c.carried(rollback.get("carry", {}))
    # a rollback's checkpoint was checked by the processes that chose it (lmtrain.callbacks.divergence): not read again
    check = checked_here(cfg) if rollback is None else (lambda c: False)
    resume = resume_point(cfg, checkpointer.root if checkpointer is not None else None, check)
    if rollback is None and resume is not None and resume.meta.get("crc32") and not check(resume):
        from lmtrain.training.checkpoint.intact import SpreadContentsCheck

        callbacks.append(SpreadContentsCheck(resume, move_aside=not cfg.get("ckpt_path")))
    if rollback is None:
        log.info(
            f"run {cfg.run_name}: {run_dir.resolve()}"
            + (f" (continuing from step {resume.step})" if resume is not None and resume.step >= 0 else "")
        )
        for line in said:
            log.info(line)
    return _Attempt(cfg, rollback, run_dir, callbacks, checkpointer, resume, profilers[0] if profilers else None)


def _build(att: _Attempt) -> None:
    """Strategy, module, data (prepared and checked), loggers and trainer; a checkpoint of another model or another data
    stream refused. Nothing of the run is written here."""
    cfg, resume, rollback = att.cfg, att.resume, att.rollback
    strategy = instantiate(cfg.strategy) if cfg.get("strategy") else "auto"
    model_factory = instantiate(cfg.model)  # a factory: the model itself is built in LMModule.configure_model
    att.module = instantiate(
        cfg.module,
        model=model_factory,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
    )
    att.datamodule = datamodule = instantiate(cfg.data)
    if hasattr(datamodule, "order_dir"):  # lmtrain's data module: each epoch's sample order stored in the run directory
        datamodule.order_dir = att.run_dir
    if getattr(datamodule, "decay_staged", False):  # a data stage begun by the operator's decay
        cooldown = corrections.cooldown(corrections.load(att.run_dir))  # the operator's, in force (lmtrain.callbacks.lr_control)
        datamodule.decay_from = cooldown[0] + 1 if cooldown is not None else None
    datamodule.prepare_data()
    src = init_from.read(cfg.init_from) if cfg.get("init_from") else None
    if src is not None:  # the dataset's tokenizer the model's, first: a vocabulary too large is its symptom
        init_from.check_tokenizer(src, datamodule.manifest, Path(datamodule.path))
    datamodule.setup("fit")
    validate_data(cfg, datamodule.manifest, len(datamodule.train_set))
    datamodule.tokenizer()  # loaded once before anything is written: its separator must be the manifest's eos_id

    shape = meta_model(model_factory)
    if rollback is None:  # said once a run, not again at each rollback's attempt
        log.info(describe_model(shape))
    if src is not None:  # a fresh start: every tensor checked against the model
        if resume is None:
            att.weights = att.module.init_weights_from = init_from.Loader(src, shape)
            if getattr(strategy, "init_device", None) == "cpu":
                strategy.init_device = "meta"  # each rank reads its own rows: no full copy of the model per rank
            if rollback is None:
                log.info(
                    f"weights: {src.path} ({src.architecture}, {att.weights.weights.nbytes() / 2**20:,.1f} MiB); the optimizer starts fresh"
                )
    if rollback is None and cfg.get("optimizer") and isinstance(cfg.optimizer.get("lr"), int | float):
        from lmtrain.nn.model import num_params
        from lmtrain.nn.optim import lr_warning

        if warning := lr_warning(float(cfg.optimizer.lr), num_params(shape)):
            log.warning(warning)
    if getattr(datamodule, "document_mask", False) and "doc" not in inspect.signature(shape.forward).parameters:
        raise ConfigError(
            f"data.document_mask=true: the model {type(shape).__name__} ({cfg.model.get('_target_')}) takes no document ids; "
            "lmtrain.nn.model.Decoder (every shipped model) does"
        )
    att.identity = model_identity(shape, cfg)
    if att.checkpointer is not None:  # a disk that cannot take a checkpoint: refused before anything is written
        estimate = _checkpoint_estimate(shape, cfg, resume)
        for guard in (c for c in att.callbacks if isinstance(c, SaveGuard)):
            guard.check_start(att.checkpointer.root, estimate)
    del shape
    if resume is not None:
        try:
            check_compatible(resume_identity(resume), att.identity, f"checkpoint {resume.path}")
        except CheckpointError as exc:
            if cfg.get("ckpt_path"):
                raise
            raise CheckpointError(
                f"{exc}\nrun '{cfg.run_name}' continues from its newest checkpoint; to train this config instead, choose another "
                f"run_name=..., or pass resume=false overwrite=true to delete run '{cfg.run_name}''s checkpoints"
            ) from None
        log.info(f"resuming from {resume.path} (step {resume.step})")
    if resume is not None and not _own_resume(att):  # another run's checkpoint (ckpt_path): a branch, whatever the loggers
        att.branch = {
            "lmtrain.parent_run": resume.meta.get("run_name"),
            "lmtrain.parent_mlflow_run_id": resume.meta.get("mlflow_run_id"),
            "lmtrain.parent_step": resume.step,
            "lmtrain.parent_checkpoint": str(resume.path.resolve()),
        }
    if (cfg.get("logger") or {}).get("mlflow"):
        _mlflow_lineage(att)
    if (cfg.get("logger") or {}).get("wandb") and _own_resume(att) and att.resume.meta.get("wandb_run_id"):
        with open_dict(cfg):  # the W&B run the checkpoint records goes on (a branch is a new one)
            cfg.logger.wandb.id = cfg.logger.wandb.get("id") or att.resume.meta["wandb_run_id"]
    callbacks = att.callbacks
    if not cfg.trainer.get("enable_progress_bar", True):  # `trainer.enable_progress_bar=false` wins over the bar callback
        from lightning.pytorch.callbacks import ProgressBar

        callbacks = att.callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    from lmtrain.training.loggers import RecordLogger

    # the run's own record of every logged value, whatever the loggers (lmtrain.formats.metrics)
    loggers = [RecordLogger(att.run_dir, max(resume.step, 0) if resume is not None else 0), *instantiate_group(cfg.get("logger"))]
    if resume is not None:
        for lg in loggers:
            if hasattr(lg, "resume_at"):
                lg.resume_at(resume.step, relog=rollback is not None)  # a rollback's new timeline is logged again
        skip = rollback["skip_batches"] if rollback is not None else corrections.data_skip(corrections.load(att.run_dir), resume.step)
        datamodule.skip_batches = skip
    extra = {"enable_checkpointing": True} if att.checkpointer is not None else {}  # ours replaces Lightning's ModelCheckpoint
    if att.profiler is not None:  # chosen in the callbacks group (callbacks/profiler.py), given to the Trainer
        extra["profiler"] = att.profiler
    precision, plugins = build_precision(
        cfg.trainer.precision, str(cfg.trainer.accelerator), instantiate(cfg.grad_scaler) if cfg.get("grad_scaler") else None
    )
    if plugins:  # ours (fp16) beside the user's own trainer.plugins
        extra.update(precision=precision, plugins=[*(instantiate(p) for p in cfg.trainer.get("plugins") or []), *plugins])
    extra.update(val_check_batches(cfg.trainer))
    att.trainer = trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, strategy=strategy, **extra)
    if resume is not None and "data_stream" in resume.meta and hasattr(datamodule, "check_stream"):
        later = datamodule.check_stream(resume.meta["data_stream"], resume.step)  # refused before anything is written
        if later:
            log.info(f"the data's later stages changed: {later}")
    if resume is not None and resume.meta.get("format") == "sharded" and not compat.saves_sharded(trainer.strategy):
        from lmtrain.training.checkpoint.reshard import ShardedCheckpointReader

        trainer.strategy.checkpoint_io = ShardedCheckpointReader()  # fsdp/hsdp -> single/ddp (lmtrain.training.checkpoint.reshard)


def _checkpoint_estimate(shape: torch.nn.Module, cfg: DictConfig, resume: ck.Checkpoint | None) -> int:
    """Bytes a checkpoint of this run will take, before the model is built: the resumed checkpoint's size, else the
    parameters and the optimizer's moments (Adam's two, one for the others) in fp32, counted as the checkpointer's own
    estimate counts them (lmtrain.training.checkpoint.writer.checkpoint_bytes)."""
    from lmtrain.training.checkpoint.writer import checkpoint_bytes

    files = (resume.meta.get("files") or {}) if resume is not None else {}
    if files:
        return int(sum(files.values()))
    params = sum(p.numel() for p in shape.parameters())
    moments = 2 if "adam" in str((cfg.get("optimizer") or {}).get("_target_", "")).lower() else 1
    return checkpoint_bytes(params * 4, params * 4 * moments)


# the user's MLFLOW_TRACKING_URI, read before any MLflow call: mlflow.set_tracking_uri (Lightning's logger) exports it
_USER_MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI")


def _mlflow_lineage(att: _Attempt) -> None:
    """Which MLflow run the attempt logs to, checked before anything is written. A resume of this run continues the
    MLflow run its checkpoint records, in the store it records (unless this launch gives ``logger.mlflow.tracking_uri``
    or ``MLFLOW_TRACKING_URI``); a run started from another run's checkpoint (``ckpt_path``: a branch) is a new MLflow
    run whose tags name its parent. A store that does not answer, or lacks the recorded run, is refused in one line."""
    from lmtrain.training.loggers import check_tracker

    cfg, resume, mlflow_cfg = att.cfg, att.resume, att.cfg.logger.mlflow
    if resume is not None and att.branch is None and resume.meta.get("mlflow_run_id"):
        given = _USER_MLFLOW_URI is not None or any(o.lstrip("+~").startswith("logger.mlflow.tracking_uri=") for o in _overrides())
        with open_dict(cfg):
            if resume.meta.get("mlflow_tracking_uri") and not given and not mlflow_cfg.get("run_id"):
                mlflow_cfg.tracking_uri = resume.meta["mlflow_tracking_uri"]
            mlflow_cfg.run_id = mlflow_cfg.get("run_id") or resume.meta["mlflow_run_id"]
    from lmtrain.training.loggers import resolved_uri

    with open_dict(cfg):  # the store as found from anywhere (config.yaml records it so; a resume from there: no change)
        mlflow_cfg.tracking_uri = resolved_uri(mlflow_cfg.get("tracking_uri"))
    if not cfg.trainer.get("fast_dev_run"):  # Lightning logs nothing under fast_dev_run
        check_tracker(mlflow_cfg.get("tracking_uri"), mlflow_cfg.get("run_id"))


def _own_resume(att: _Attempt) -> bool:
    """The attempt resumes a checkpoint of this run (not another run's, given by ``ckpt_path``: a branch)."""
    cfg, resume = att.cfg, att.resume
    homes = [Path(cfg.run_dir).resolve()] + ([att.checkpointer.root.resolve()] if att.checkpointer is not None else [])
    return resume is not None and (not cfg.get("ckpt_path") or any(h in resume.path.resolve().parents for h in homes))


def _accept(att: _Attempt) -> None:
    """The attempt is accepted: config.yaml, overrides.yaml and train.log written, the checkpointer and MLflow wired,
    the logbook told how the attempt starts."""
    cfg, run_dir, trainer, resume, rollback = att.cfg, att.run_dir, att.trainer, att.resume, att.rollback
    changes = _config_changes(run_dir, cfg) if trainer.is_global_zero and resume is not None and rollback is None else {}
    if trainer.is_global_zero:
        try:  # each replaced whole (a kill or a full disk leaves the previous one)
            write_text_atomic(run_dir / CONFIG, OmegaConf.to_yaml(cfg, resolve=True))
            write_text_atomic(run_dir / "overrides.yaml", OmegaConf.to_yaml(_overrides()))
        except OSError as exc:
            raise InputError(f"cannot write {run_dir / CONFIG}: {exc.strerror or exc}") from exc
        logbook.reserve(run_dir)  # room for the entries a full disk would refuse (how this attempt ends)
    console.start_file(run_dir, f"run {cfg.run_name}: {' '.join(_overrides()) or '(no overrides)'}", trainer.is_global_zero)
    att.trackers = _tracker_locations(trainer)
    if rollback is None:
        for name, where in att.trackers:
            log.info(f"{name}: {where}")
    tags = {**(att.branch or {}), **({"lmtrain.init_from": str(att.weights.src.path.resolve()), "lmtrain.init_from_config": att.weights.src.config_sha256}
                                      if att.weights is not None else {})}  # fmt: skip
    _log_config(trainer, cfg, run_dir, tags)
    if att.checkpointer is not None:
        info = {
            **att.identity,
            "run_name": cfg.run_name,
            "config_hash": config_hash(OmegaConf.to_container(cfg, resolve=True)),
            **_mlflow_record(trainer),
            **_wandb_record(trainer),
        }
        if hasattr(att.datamodule, "stream_identity"):
            info["data_stream"] = att.datamodule.stream_identity()
        att.checkpointer.describe_run(info)
    att.mirrors = [
        logbook.Mirror(send)
        for lg in trainer.loggers
        if isinstance(lg, MLFlowLogger) and trainer.is_global_zero
        for send in (_mlflow_logbook_mirror(lg), _mlflow_tagger(lg))
    ]
    for mirror in att.mirrors:
        logbook.events.addHandler(mirror)  # removed when the attempt's fit ends (_fit)
    if not trainer.is_global_zero or rollback is not None:
        return  # a rollback's own entry says where it went
    if (again := restarts.restart()) is not None:
        launcher, k = again
        logbook.append(run_dir, "restart", f"restart {k} ({launcher}) after {restarts.previous_end(run_dir)}", restart=k, launcher=launcher)
    if att.branch is not None:
        parent = att.branch
        mlflow = f", MLflow run {parent['lmtrain.parent_mlflow_run_id']}" if parent["lmtrain.parent_mlflow_run_id"] else ""
        logbook.append(
            run_dir, "branch", f"started from {parent['lmtrain.parent_checkpoint']} (run {parent['lmtrain.parent_run']}{mlflow}, "
            f"step {resume.step}){_layout_change(resume, trainer, cfg)}", step=resume.step, parent=parent,
        )  # fmt: skip
        return
    if resume is not None:
        logbook.append(run_dir, "resume", f"resumed from {resume.path.name}{_layout_change(resume, trainer, cfg)}", step=resume.step)
        if changes:
            shown = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())
            log.info(f"config changed since the last attempt (accepted): {shown}")
            logbook.append(run_dir, "config_change", f"config: {shown} at step {resume.step}", step=resume.step, changes=changes)
        return
    unfinished = unfinished_saves(att.checkpointer.root if att.checkpointer is not None else None)
    again = ""
    if unfinished:  # an earlier attempt died in the run's first save: nothing was saved, so the run starts again
        again = (
            f"; an earlier attempt's save of step {unfinished[-1]} did not finish, so nothing was saved: what it logged is kept "
            "in the record (metrics.jsonl), marked abandoned"
        )
        log.warning(f"starting run {cfg.run_name} from step 0{again}")
    mlflow = {k: v for k, v in _mlflow_record(trainer).items() if v}  # the dead attempts' MLflow runs: found here next time
    if unfinished:
        _end_dead_mlflow_runs(run_dir, mlflow.get("mlflow_run_id"))
    if att.weights is not None:
        try:
            att.weights.keep(run_dir)
        except OSError as exc:
            raise InputError(f"cannot write {run_dir / init_from.FOLDER}: {exc.strerror or exc}") from exc
        src = att.weights.src
        logbook.append(
            run_dir, "start", f"training from the weights of {src.path.resolve()} ({src.architecture}, config.json {src.config_sha256[:23]}), "
            f"run {cfg.run_name}{again}", init_from=src.record(), **mlflow,
        )  # fmt: skip
    else:
        logbook.append(run_dir, "start", f"training from scratch, run {cfg.run_name}{again}", **mlflow)


def _end_dead_mlflow_runs(run_dir: Path, current: str | None) -> None:
    """A run started again after an attempt that died before its first checkpoint: that attempt's MLflow run (its
    ``start`` entry's), still RUNNING since nothing ended it, is marked KILLED, as the tracking UI should show it; the
    new attempt logs to a run of its own. A store that does not answer leaves it as it is, with a line."""
    dead = [(e["mlflow_run_id"], e.get("mlflow_tracking_uri")) for e in logbook.read(run_dir) if e.get("kind") == "start" and e.get("mlflow_run_id")]
    dead = [(run_id, uri) for run_id, uri in dead if uri and run_id != current]
    if not dead:  # no MLflow run recorded: MLflow is not imported for nothing
        return
    from mlflow.tracking import MlflowClient

    for run_id, uri in dead:
        try:
            client = MlflowClient(tracking_uri=uri)
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status="KILLED")
                log.info(f"MLflow run {run_id} of the attempt that died before its first checkpoint: marked KILLED")
        except Exception as exc:  # noqa: BLE001 - MLflow's own errors: the run is still started
            log.warning(f"could not mark the dead attempt's MLflow run {run_id} KILLED in {uri}: {exc}")


def _fit(att: _Attempt, clock: Goodput):
    """``trainer.fit``, then how it ended: a guard's stop, a rollback request, or the end (logbook entry, summary)."""
    cfg, run_dir, trainer, module, resume = att.cfg, att.run_dir, att.trainer, att.module, att.resume
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        trainer.fit(module, datamodule=att.datamodule, ckpt_path=str(resume.load_path) if resume is not None else None, weights_only=True)
    except SIGTERMException:  # Lightning's own SIGTERM handling, before ours took over (the start): not finished
        for lg in trainer.loggers:
            _safe_finalize(lg, "killed")
        _preempted(att, {"signal": "SIGTERM", "step": trainer.global_step, "checkpoint": None})
    except BaseException:
        # Lightning marks loggers failed for exceptions inside fit; make sure of it for the rest too
        for lg in trainer.loggers:
            _safe_finalize(lg, "failed")
        raise
    else:
        preempted = next((c.preempted for c in trainer.callbacks if isinstance(c, Preempts) and c.preempted), None)
        if preempted is not None:
            _preempted(att, preempted)
        detector = next((c for c in att.callbacks if isinstance(c, RequestsRollback)), None)
        stopper = next((c for c in trainer.callbacks if isinstance(c, StopsTraining) and c.stop_reason), None)
        stopped = RunStopped(stopper.stop_reason, stopper.stop_status) if stopper is not None else None
        if trainer.is_global_zero and stopped:
            logbook.append(run_dir, "stopped", f"training stopped at step {trainer.global_step}: {stopped.reason}", step=trainer.global_step,
                           status=stopped.status)  # fmt: skip
        elif trainer.is_global_zero and (detector is None or detector.rollback_request is None):
            step = trainer.global_step
            tokens = getattr(module, "tokens_trained", 0)
            logbook.append(run_dir, "end", f"training ended at step {step} ({tokens:,} tokens)", step=step, tokens=tokens)
            _summary(cfg, trainer, module, att, tokens, clock)
    finally:
        for mirror in att.mirrors:
            logbook.events.removeHandler(mirror)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if getattr(module, "last_train_loss", None) is not None:
        metrics["train/loss"] = module.last_train_loss  # read from the step statistics, not self.log (lmtrain.training.module)
    return metrics, detector, stopped


def _preempted(att: _Attempt, what: dict) -> None:
    """The run was ended by a signal at ``what['step']``: the logbook says so (rank zero) and every rank raises
    :class:`Preempted` (exit status 4)."""
    saved = what["checkpoint"]
    kept = f"saved {Path(saved).name}" if saved else "no checkpoint of this step (the run resumes from the newest complete one)"
    reason = f"{what['signal']} at step {what['step']}: {kept}; run again to continue"
    if att.trainer.is_global_zero:
        logbook.append(att.run_dir, "preempted", reason, step=what["step"], signal=what["signal"], checkpoint=saved and str(saved))
    raise Preempted(reason)


def _layout_change(resume: ck.Checkpoint, trainer, cfg: DictConfig) -> str:
    """`` on M ranks, saved on N`` when the resumed checkpoint was saved on another number of ranks (and the global
    batch each step takes, when that changed too); empty otherwise."""
    saved_world, world = resume.meta.get("world_size"), trainer.world_size
    if saved_world is None or saved_world == world:
        return ""
    text = f" on {world} rank{'s' if world != 1 else ''}, saved on {saved_world}"
    batch = int(cfg.data.batch_size) * Layout.of(trainer).dp * int(trainer.accumulate_grad_batches)
    saved_batch = resume.meta.get("global_batch")
    if saved_batch and saved_batch != batch:
        text += f"; the global batch changes from {saved_batch} to {batch} sequences (set global_batch_size={saved_batch} to keep it)"
    elif saved_batch:
        text += f" (global batch {batch}: {trainer.accumulate_grad_batches} micro-batch(es) of {cfg.data.batch_size} per rank)"
    log.info(f"resuming{text}")
    return text


# keys that differ between attempts of one run by design: not a change of the run's config
_ATTEMPT_KEYS = ("ckpt_path", "resume", "overwrite", "logger/mlflow/run_id", "logger/wandb/id")


def _config_changes(run_dir: Path, cfg: DictConfig) -> dict[str, list]:
    """What the resumed config changes against the previous attempt's ``config.yaml`` (flat keys -> [old, new]).
    Everything here was accepted: what a resume cannot take (another model, another data stream) was refused."""
    import yaml

    from lmtrain.training.loggers import resolved_uri

    try:
        old = flat_params(_moe_as_trained(OmegaConf.load(run_dir / CONFIG)))
    except FileNotFoundError:  # no previous config (a checkpoint given by path)
        return {}
    except (OSError, ValueError, yaml.YAMLError) as exc:  # damaged: the resume goes on, without the list of changes
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        log.warning(f"{run_dir / CONFIG} of the previous attempt does not read ({type(exc).__name__}: {first}): the config changes "
                    "since then are not listed; this attempt writes it anew")  # fmt: skip
        return {}
    new = flat_params(cfg)
    uri = "logger/mlflow/tracking_uri"  # a run's config before 2026-12-04 kept a relative SQLite store as given
    if isinstance(old.get(uri), str) and resolved_uri(old[uri]) == new.get(uri):
        old[uri] = new[uri]
    keys = [k for k in sorted(old.keys() | new.keys()) if k not in _ATTEMPT_KEYS and old.get(k, "(unset)") != new.get(k, "(unset)")]
    changes = {k: [old.get(k, "(unset)"), new.get(k, "(unset)")] for k in keys}
    moved = [k for k, (was, now) in changes.items() if _moved_in_lmtrain(k, was, now)]
    if moved:
        log.info(f"lmtrain moved {len(moved)} classes between versions (the same classes; not config changes): {', '.join(moved)}")
    added = [k for k, (was, now) in changes.items() if was == "(unset)" and _added_by_lmtrain(k, now)]
    if added:
        log.info(
            f"lmtrain added {len(added)} options since the run's previous attempt, at their defaults (the old behaviour; "
            f"not config changes): {', '.join(added)}"
        )
    changes = {k: v for k, v in changes.items() if k not in moved and k not in added}
    if "strategy/_target_" in changes:  # another strategy: its name, not every key of the two nodes (the layout line says more)
        was, now = (str(t).rpartition(".")[2] for t in changes["strategy/_target_"])
        changes = {k: v for k, v in changes.items() if not k.startswith("strategy/")}
        changes["strategy"] = [was, now]
    return changes


def _moe_as_trained(cfg: DictConfig) -> DictConfig:
    """A previous attempt's config with its ``model.moe`` spelt out as it trained (lmtrain.nn.moe.as_trained)."""
    from lmtrain.nn.moe import as_trained

    model = cfg.get("model")
    if isinstance(model, DictConfig) and isinstance(model.get("moe"), DictConfig):
        model.moe = as_trained(OmegaConf.to_container(model.moe, resolve=True))
    return cfg


_OUR_PACKAGES = ("lmtrain.", "callbacks.", "data.")  # callbacks/ and data/ were top-level packages before lmtrain's layers


def _moved_in_lmtrain(key: str, was, now) -> bool:
    """Whether a ``_target_`` change is lmtrain's own class under a new module path (a newer lmtrain's layout), not the
    user's choice of another class."""
    if not key.endswith("_target_") or not (isinstance(was, str) and isinstance(now, str)):
        return False
    ours = was.startswith(_OUR_PACKAGES) and now.startswith(_OUR_PACKAGES)
    return ours and was.rpartition(".")[2] == now.rpartition(".")[2]


def _added_by_lmtrain(key: str, now) -> bool:
    """Whether ``key`` (flat ``a/b/c``), missing from the previous attempt's config, is an option a newer lmtrain added
    and this attempt leaves at its default: every one of lmtrain's config files that sets it (the root ``train.yaml``,
    the options of the group its first part names) sets it to ``now``, a plain value. A group swapped for another
    (``strategy=fsdp`` after ``ddp``) brings keys whose files differ, or a ``_target_`` change, and stays a change."""
    from lmtrain import config_dir

    root = config_dir()
    group = key.partition("/")[0]
    files = [(root / "train.yaml", "")]
    if (root / group).is_dir():
        files += [(path, group + "/") for path in sorted((root / group).glob("*.yaml"))]
    found = []
    for path, prefix in files:
        flat = _config_file_values(path) if key.startswith(prefix) else None
        if flat is not None and key[len(prefix) :] in flat:
            value = flat[key[len(prefix) :]]
            found.append("null" if value is None else value)
    return bool(found) and all(v == now and not (isinstance(v, str) and "${" in v) for v in found)


@functools.cache
def _config_file_values(path: Path) -> dict[str, Any] | None:
    """One of lmtrain's config files as flat ``a/b/c -> value`` (unresolved), read once per process; None for a file
    that overrides keys elsewhere (``# @package _global_``: experiment, debug, fault), where no option's default lives."""
    text = path.read_text()
    if "@package" in text.partition("\n")[0]:
        return None
    return _flatten(OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {})


def _overrides() -> list[str]:
    """The command line's overrides of this attempt (empty outside a Hydra app, e.g. in tests that compose)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def val_check_batches(trainer_cfg: DictConfig) -> dict:
    """``trainer.val_check_interval`` counts optimizer steps, as max_steps and the logs do (and as litgpt's and
    torchtitan's evaluation intervals); Lightning's counts micro-batches, so an integer interval is multiplied by
    ``trainer.accumulate_grad_batches`` (a float, a fraction of an epoch, is Lightning's own)."""
    interval, accum = trainer_cfg.get("val_check_interval"), int(trainer_cfg.get("accumulate_grad_batches") or 1)
    if isinstance(interval, int) and not isinstance(interval, bool) and accum > 1:
        return {"val_check_interval": interval * accum}
    return {}


def _tracker_locations(trainer) -> list[tuple[str, str]]:
    """Where each tracker's run of this attempt is, as (name, where) (rank zero; empty elsewhere)."""
    from lmtrain.training.loggers import WandbLogger

    return [("W&B" if isinstance(lg, WandbLogger) else "MLflow", lg.where()) for lg in trainer.loggers
            if hasattr(lg, "where") and trainer.is_global_zero]  # fmt: skip


def _summary(cfg: DictConfig, trainer, module, att: _Attempt, tokens: int, clock: Goodput) -> None:
    """The end-of-run summary (rank zero): steps, tokens, losses, checkpoints, wall time, where things are. The losses
    are the run's record's (lmtrain.formats.metrics.summary), whatever this attempt itself trained."""
    step, run_dir, checkpointer = trainer.global_step, att.run_dir, att.checkpointer
    figures = metrics_record.summary(run_dir)  # complete: fit's end finalized (flushed) every logger
    if figures["train_loss"] is None and getattr(module, "last_train_loss", None) is not None:  # no record (fast_dev_run)
        figures["train_loss"] = (step, module.last_train_loss)
    losses = []
    if figures["train_loss"] is not None:
        at, value = figures["train_loss"]
        losses.append(f"train loss {value:.4f} (step {at})")
    if figures["val_loss"] is not None:
        at, value = figures["val_loss"]
        losses.append(f"val loss {value:.4f} (step {at})")
    lines = [f"finished run {cfg.run_name} in {console.duration(time.monotonic() - clock.started)}: {step:,} step{'' if step == 1 else 's'}, {tokens:,} tokens"
             + (f"; {', '.join(losses)}" if losses else "")]  # fmt: skip
    lines.append(f"  goodput        {clock.line()}")
    lines.append(f"  run directory  {run_dir.resolve()} (train.log, logbook.jsonl, config.yaml)")
    if checkpointer is not None:
        checkpointer.wait()
        newest = ck.newest(checkpointer.root)
        if newest is not None:
            lines.append(f"  checkpoint     {newest.path.resolve()} (newest)")
        if figures["best_val"] is not None:
            at, value = figures["best_val"]
            kept = checkpointer.root / ck.step_name(at)
            where = f"checkpoint {kept.resolve()}" if kept.is_dir() else "no checkpoint kept at that step"
            lines.append(f"  best val loss  {value:.4f} at step {at} ({where})")
    for name, where in att.trackers:
        lines.append(f"  {name:<14} {where}")
    for line in lines:
        log.info(line)


def _mlflow_record(trainer) -> dict:
    """What each checkpoint records of the attempt's MLflow run (rank zero's logger; None elsewhere): its id and its
    store, a relative SQLite path made absolute (a resume finds it there: _mlflow_lineage)."""
    from lmtrain.training.loggers import resolved_uri

    lg = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None) if trainer.is_global_zero else None
    return {"mlflow_run_id": lg.run_id if lg else None, "mlflow_tracking_uri": resolved_uri(lg._tracking_uri) if lg else None}


def _wandb_record(trainer) -> dict:
    """What each checkpoint records of the attempt's W&B run (rank zero's; None elsewhere or without one): its id."""
    from lmtrain.training.loggers import WandbLogger

    lg = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None) if trainer.is_global_zero else None
    return {"wandb_run_id": lg.run_id} if lg is not None else {}


def _mlflow_logbook_mirror(lg):
    def mirror(run_dir: Path, entry: dict) -> None:
        lg.experiment.log_artifact(lg.run_id, str(run_dir / logbook.FILE))

    return mirror


def _mlflow_tagger(lg):
    """Each alert of the logbook (lmtrain.formats.logbook.alert) as the run's tag ``alert.KIND``."""

    def tag(run_dir: Path, entry: dict) -> None:
        if entry.get("alert"):
            lg.experiment.set_tag(lg.run_id, f"alert.{entry['kind']}", str(entry["message"])[:5000])

    return tag


def _safe_finalize(logger, status: str) -> None:
    try:
        logger.finalize(status)
    except Exception as exc:  # never hide the original error behind a logging one
        log.info(f"could not finalize {type(logger).__name__}: {exc}")


def _log_config(trainer, cfg: DictConfig, run_dir: Path, branch: dict | None = None) -> None:
    """Resolved config as MLflow params and as an artifact, and as the W&B run's config (rank zero only); ``branch``:
    tags naming where the run started (a parent run's checkpoint, a transformers directory)."""
    from lmtrain.training.loggers import WandbLogger

    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if isinstance(lg, MLFlowLogger):
            params = {k: (str(v)[:6000] if not isinstance(v, (int, float, bool)) else v) for k, v in flat_params(cfg).items()}
            lg.log_hyperparams(params)
            lg.experiment.log_artifact(lg.run_id, str(run_dir / CONFIG))
            lg.experiment.set_tag(lg.run_id, "run_dir", str(run_dir.resolve()))
            for key, value in (branch or {}).items():  # a branch names its parent
                lg.experiment.set_tag(lg.run_id, key, str(value))
        elif isinstance(lg, WandbLogger):  # the resolved config, nested as written, with where the run is and its parent
            lg.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True), "run_dir": str(run_dir.resolve()), **(branch or {})})
