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
