"""Small real callbacks that tests plug in through `_target_`, as a user would."""

from __future__ import annotations

import lightning as L


class FailAtStep(L.Callback):
    """Raise at the start of optimizer step ``step`` (a crash inside training)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")


class RecordBatches(L.Callback):
    """Save every training step's input batch, keyed by global step, to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batches: dict[int, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches[trainer.global_step] = batch[0].clone()

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        torch.save(self.batches, self.path)
