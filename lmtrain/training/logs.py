"""Per-step diagnostics handed straight to the run's loggers (the cheap path beside ``LightningModule.log``)."""

from __future__ import annotations

from lmtrain.training import compat


def log_direct(trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Hand plain floats straight to the loggers, every ``trainer.log_every_n_steps`` steps, from rank zero.

    ``LightningModule.log`` costs about a millisecond of host time per call (tensor conversion, result collection),
    which on a fast GPU step is several percent of the step; per-step diagnostics that need neither the progress
    bar nor ``callback_metrics`` go this way. ``step`` defaults to the number of the step the current batch belongs
    to (:func:`lmtrain.training.compat.step_number`, counted from 1); like Lightning's own values, steps that are a
    multiple of ``log_every_n_steps`` are logged.
    """
    if not trainer.is_global_zero or not trainer.loggers:
        return
    if step is None:
        step = compat.step_number(trainer)
    if step % max(trainer.log_every_n_steps, 1):
        return
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)
