"""A tqdm progress bar showing the step's loss, learning rate and tokens/s (without Lightning's v_num); in a log file
(no terminal: SLURM, nohup, a pipe) one plain line every N steps instead, since tqdm's redraws there are carriage
returns that filled 100 KB of a SLURM log in a 250-step run."""

from __future__ import annotations

import sys

from lightning.pytorch.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, minus the logger version number, with short metric names.

    Args:
        refresh_rate: batches between redraws.
        line_every_n_steps: without a terminal, print ``step N/M  loss ... lr ... tok/s ...`` every this many steps.
    """

    SHORT = {"train/loss": "loss", "train/lr": "lr", "perf/tokens_per_sec": "tok/s", "val/loss": "val_loss"}

    def __init__(self, refresh_rate: int = 1, line_every_n_steps: int = 50) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.line_every_n_steps = max(1, int(line_every_n_steps))
        self.lines = not sys.stderr.isatty()

    @property
    def is_enabled(self) -> bool:
        return super().is_enabled and not self.lines  # lines mode: Lightning's bars are built disabled

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        if self.lines and trainer.is_global_zero and (step % self.line_every_n_steps == 0 or step == trainer.max_steps):
            shown = "  ".join(f"{k} {v}" for k, v in self.get_metrics(trainer, pl_module).items())
            print(f"step {step}/{trainer.max_steps}  {shown}", file=sys.stderr, flush=True)

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        # logged straight to the loggers (lmtrain.logs.log_direct), so read them at the source
        loss = getattr(pl_module, "last_train_loss", None)
        if loss is not None:
            metrics["train/loss"] = loss
        if trainer.optimizers:
            metrics["train/lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        rate = next((c.last_tokens_per_sec for c in trainer.callbacks if getattr(c, "last_tokens_per_sec", None)), None)
        if rate is not None:
            metrics["perf/tokens_per_sec"] = rate
        out = {}
        for key, value in metrics.items():
            name = self.SHORT.get(key, key)
            if name in ("loss", "val_loss") and isinstance(value, float):
                value = f"{value:.3f}"
            elif name == "lr" and isinstance(value, float):
                value = f"{value:.2e}"
            elif name == "tok/s" and isinstance(value, float):
                value = f"{value:,.0f}"
            out[name] = value
        return out
