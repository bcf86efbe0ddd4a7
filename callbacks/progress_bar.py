"""A tqdm progress bar showing the step's loss, learning rate and tokens/s (without Lightning's v_num)."""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, minus the logger version number, with short metric names.

    Args:
        refresh_rate: batches between redraws.
    """

    SHORT = {"train/loss": "loss", "train/lr": "lr", "perf/tokens_per_sec": "tok/s", "val/loss": "val_loss"}

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)

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
            if name == "loss" and isinstance(value, float):
                value = f"{value:.3f}"
            elif name == "lr" and isinstance(value, float):
                value = f"{value:.2e}"
            elif name == "tok/s" and isinstance(value, float):
                value = f"{value:,.0f}"
            out[name] = value
        return out
