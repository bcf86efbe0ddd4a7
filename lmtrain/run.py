"""One training run from a composed config: validate, prepare, instantiate, fit."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lmtrain.config import apply_global_batch_size, validate_config, validate_data
from lmtrain.errors import InputError

log = logging.getLogger("lmtrain")


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


def describe_model(model_factory) -> str:
    """Parameter counts from a meta-device build (no memory allocated)."""
    from lmtrain.model import Decoder, matmul_params, num_params

    with torch.device("meta"):
        model = model_factory()
    total = num_params(model)
    if isinstance(model, Decoder):
        c = model.cfg
        return (
            f"model {c.name} ({c.family}): {total:,} parameters ({total / 1e6:.2f}M; {matmul_params(model):,} in matmuls), "
            f"{c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads"
        )
    return f"model {type(model).__name__}: {total:,} parameters"


def instantiate_group(node: DictConfig | None) -> list:
    """Instantiate each entry of a dict of named configs (callbacks, loggers); null entries are skipped."""
    if not node:
        return []
    return [instantiate(v) for v in node.values() if v is not None]


def train(cfg: DictConfig) -> dict[str, float]:
    """Run training for ``cfg``; return the final logged metrics as floats."""
    import lightning as L

    validate_config(cfg)
    apply_global_batch_size(cfg)
    run_dir = Path(cfg.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the run directory {run_dir} (run_dir / paths.runs): {exc.strerror or exc}") from exc
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    validate_data(cfg, datamodule.manifest, len(datamodule.train_set))

    model_factory = instantiate(cfg.model)
    print(describe_model(model_factory), file=sys.stderr)
    module = instantiate(
        cfg.module,
        model=model_factory,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
    )
    callbacks = instantiate_group(cfg.get("callbacks"))
    if not cfg.trainer.get("enable_progress_bar", True):  # `trainer.enable_progress_bar=false` wins over the bar callback
        from lightning.pytorch.callbacks import ProgressBar

        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    loggers = instantiate_group(cfg.get("logger"))
    strategy = instantiate(cfg.strategy) if cfg.get("strategy") else "auto"
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, strategy=strategy)

    if trainer.is_global_zero:
        try:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        except OSError as exc:
            raise InputError(f"cannot write {run_dir / 'config.yaml'}: {exc.strerror or exc} (disk full?)") from exc
    _log_config(trainer, cfg, run_dir)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except BaseException:
        # Lightning marks loggers failed for exceptions inside fit; make sure of it for the rest too
        for lg in trainer.loggers:
            _safe_finalize(lg, "failed")
        raise
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def _safe_finalize(logger, status: str) -> None:
    try:
        logger.finalize(status)
    except Exception as exc:  # never hide the original error behind a logging one
        print(f"[lmtrain] could not finalize {type(logger).__name__}: {exc}", file=sys.stderr)


def _log_config(trainer, cfg: DictConfig, run_dir: Path) -> None:
    """Resolved config as MLflow params and as an artifact (rank zero only)."""
    from lightning.pytorch.loggers import MLFlowLogger

    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if isinstance(lg, MLFlowLogger):
            params = {k: (str(v)[:6000] if not isinstance(v, (int, float, bool)) else v) for k, v in flat_params(cfg).items()}
            lg.log_hyperparams(params)
            lg.experiment.log_artifact(lg.run_id, str(run_dir / "config.yaml"))
            lg.experiment.set_tag(lg.run_id, "run_dir", str(run_dir.resolve()))
