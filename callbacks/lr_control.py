"""Mid-flight learning-rate corrections: applied at a step boundary on every rank, recorded, kept across resumes.

Sources (see lmtrain.formats.corrections): automatic rollbacks (the divergence detector), an operator
(``python -m lmtrain.control RUN_DIR lr --scale 0.5`` or ``--value 1e-4`` while the run runs), and the config
at a (re)start (``callbacks.lr_control.scale``). The learning rate used at each step is the scheduler's value
times the corrections in force at that step, so ``train/lr`` in MLflow shows the schedule the run really
followed (OPT's "empirical LR schedule"); the ``report`` callback plots it, corrections marked.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from lmtrain.console import log
from lmtrain.errors import InputError
from lmtrain.formats import corrections, logbook

REQUESTS = "control"


class LRControl(L.Callback):
    """Args:
    run_dir: the run directory (corrections file, operator requests under ``RUN_DIR/control/``).
    scale: a learning-rate factor given at (re)start; recorded when it differs from the one in force.
    poll_every: look for operator requests every this many optimizer steps.
    """

    def __init__(self, run_dir: str, scale: float | None = None, poll_every: int = 10) -> None:
        if scale is not None and not scale > 0:
            raise InputError(f"callbacks.lr_control.scale={scale}: must be a positive factor")
        if poll_every < 1:
            raise InputError(f"callbacks.lr_control.poll_every={poll_every}: must be >= 1")
        self.run_dir, self.scale, self.poll_every = Path(run_dir), scale, poll_every
        self.entries: list[dict] = []
        self._last_polled = -1

    def on_train_start(self, trainer, pl_module) -> None:
        # rank zero's reading, so that every rank applies the same corrections even while the file is being written
        self.entries = trainer.strategy.broadcast(corrections.load(self.run_dir) if trainer.is_global_zero else None, src=0)
        self._log_schedule_changes(trainer)
        if self.scale is not None and corrections.config_scale(self.entries) != self.scale:
            entry = {"from_step": trainer.global_step, "scale": self.scale, "reason": "config"}
            if trainer.is_global_zero:
                corrections.add(self.run_dir, entry)
                logbook.append(
                    self.run_dir,
                    "lr_correction",
                    f"config: learning rate x{self.scale} from step {trainer.global_step}",
                    step=trainer.global_step,
                )
            self.entries.append(entry)

    def _log_schedule_changes(self, trainer) -> None:
        """A resume follows the composed config's schedule (lmtrain.nn.optim.ConfiguredLR): say what changed."""
        for cfg in trainer.lr_scheduler_configs or []:
            changes = getattr(cfg.scheduler, "changes", None)
            if changes and trainer.is_global_zero:
                what = ", ".join(
                    f"{k} {old:g} -> {new:g}" if isinstance(old, float) else f"{k} {old} -> {new}" for k, (old, new) in changes.items()
                )
                message = f"schedule: {what} at step {trainer.global_step} (the config's schedule from here on)"
                logbook.append(self.run_dir, "schedule_change", message, step=trainer.global_step, changes=changes)
                log.info(message)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step != self._last_polled and step % self.poll_every == 0:
            self._last_polled = step
            self._poll(trainer, pl_module)
        mult = corrections.multiplier(self.entries, step)
        for cfg in trainer.lr_scheduler_configs or []:
            base = cfg.scheduler.get_last_lr()
            for group, lr in zip(cfg.scheduler.optimizer.param_groups, base):
                group["lr"] = lr * mult
        if not trainer.lr_scheduler_configs:
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group.setdefault("lmtrain_base_lr", group["lr"])
                    group["lr"] = group["lmtrain_base_lr"] * mult

    def _poll(self, trainer, pl_module) -> None:
        """Rank zero reads pending operator requests; every rank applies them from this same step."""
        requests = []
        if trainer.is_global_zero:
            folder = self.run_dir / REQUESTS
            for f in sorted(folder.glob("lr-*.json")) if folder.is_dir() else []:
                try:
                    requests.append(json.loads(f.read_text()))
                except (OSError, json.JSONDecodeError) as exc:
                    log.info(f"ignoring unreadable control request {f}: {exc}")
                done = folder / "applied"
                done.mkdir(exist_ok=True)
                f.rename(done / f.name)
        requests = trainer.strategy.broadcast(requests, src=0)
        step = trainer.global_step
        for req in requests:
            current = trainer.optimizers[0].param_groups[0]["lr"]
            scale = float(req["scale"]) if req.get("scale") is not None else float(req["value"]) / current
            entry = {"from_step": step, "scale": scale, "reason": "operator", "request": req}
            self.entries.append(entry)
            if trainer.is_global_zero:
                corrections.add(self.run_dir, entry)
                what = f"x{req['scale']}" if req.get("scale") is not None else f"set to {req['value']:g} (x{scale:.4g})"
                logbook.append(self.run_dir, "lr_correction", f"operator: learning rate {what} from step {step}", step=step)
                log.info(f"learning rate {what} from step {step} (operator request)")
