"""A tqdm progress bar of optimizer steps showing the step's loss, learning rate and tokens/s (without Lightning's
v_num); in a log file (no terminal: SLURM, nohup, a pipe) one plain line every N steps instead, since tqdm's redraws
there are carriage returns that filled 100 KB of a SLURM log in a 250-step run. The same lines go to the run's
``train.log`` in both cases (lmtrain.console)."""

from __future__ import annotations

import logging
import sys

from lightning.pytorch.callbacks import TQDMProgressBar

from lmtrain import console
from lmtrain.training.contracts import ReportsThroughput


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar counting optimizer steps of the whole run, with short metric names.

    Lightning's bar counts the batches of the current epoch: after a resume it had no total and its rate counted
    the resumed steps as done in no time. This one shows ``step/max_steps`` from the step training continues at,
    and its rate counts only the steps of this process.

    Args:
        refresh_rate: optimizer steps between redraws.
        line_every_n_steps: print ``step N/M  loss ... lr ... tok/s ...`` every this many steps (without a terminal:
            instead of the bar; always: into train.log).
        mode: ``auto`` (a bar on a terminal, lines otherwise), ``bar`` or ``lines``.
    """

    SHORT = {"train/loss": "loss", "train/lr": "lr", "perf/tokens_per_sec_smoothed": "tok/s", "val/loss": "val_loss"}

    def __init__(self, refresh_rate: int = 1, line_every_n_steps: int = 50, mode: str = "auto") -> None:
        super().__init__(refresh_rate=refresh_rate)
        if mode not in ("auto", "bar", "lines"):
            from lmtrain.training.config import ConfigError

            raise ConfigError(f"callbacks.progress_bar.mode={mode!r}: expected auto, bar or lines")
        self.line_every_n_steps = max(1, int(line_every_n_steps))
        self._line_step: int | None = None  # the step of the last progress line (a step ends once per optimizer step)
        self._line_due = False  # that line is still to be printed (after the step's validation)
        self.lines = mode == "lines" or (mode == "auto" and not sys.stdout.isatty())  # where tqdm draws

    @property
    def is_enabled(self) -> bool:
        return super().is_enabled and not self.lines  # lines mode: Lightning's bars are built disabled

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else super().total_train_batches

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._count_steps(trainer)  # a resume mid-epoch starts no epoch

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._count_steps(trainer)

    def _count_steps(self, trainer) -> None:
        if self.is_enabled and trainer.max_steps and trainer.max_steps > 0:
            bar = self.train_progress_bar
            bar.reset(total=trainer.max_steps)
            bar.n = bar.initial = trainer.global_step  # tqdm's rate is (n - initial) / the time since this reset
            bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.is_enabled and trainer.max_steps and trainer.max_steps > 0:
            bar = self.train_progress_bar
            if step != bar.n and (step % self.refresh_rate == 0 or step == trainer.max_steps):
                bar.n = step
                bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws
        else:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if (step % self.line_every_n_steps == 0 or step == trainer.max_steps) and step != self._line_step:
            self._line_step = step
            flush = getattr(pl_module, "flush_step_stats", None)  # on every rank: the checkers judge alike
            if flush is not None:  # this step's own loss and rate, not the previous step's (a device sync once per line)
                flush()
            self._line_due = trainer.is_global_zero

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._print_line(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._print_line(trainer, pl_module)
        super().on_train_end(trainer, pl_module)

    def _print_line(self, trainer, pl_module) -> None:
        """The line of step ``_line_step``, printed once that step's validation (if any) has run: at the next step's
        start or the end of training."""
        if not self._line_due:
            return
        self._line_due = False
        shown = "  ".join(f"{k} {v}" for k, v in self.get_metrics(trainer, pl_module).items())
        line = f"step {self._line_step}/{trainer.max_steps}  {shown}"
        if self.lines:
            logging.getLogger(console.PROGRESS).info(line)
        else:
            console.file_only(line, name=console.PROGRESS)

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        # logged straight to the loggers (lmtrain.training.logs.log_direct), so read them at the source
        # the loss and the rate the optimizer used at the newest step whose statistics were read (after corrections and
        # rollbacks; the optimizer's param_groups already hold the next step's scheduled rate here)
        loss, lr = getattr(pl_module, "last_train_loss", None), getattr(pl_module, "last_train_lr", None)
        if loss is not None:
            metrics["train/loss"] = loss
        if lr is not None:
            metrics["train/lr"] = lr
        rate = next((c.smoothed_tokens_per_sec for c in trainer.callbacks if isinstance(c, ReportsThroughput)), None)
        if rate is not None:
            metrics["perf/tokens_per_sec_smoothed"] = rate
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
