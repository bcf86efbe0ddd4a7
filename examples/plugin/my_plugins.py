"""A user's own pieces, plugged into lmtrain through `_target_` without editing the package."""

from __future__ import annotations

import lightning as L


class TokensSeen(L.Callback):
    """Logs the running count of training tokens as `data/tokens_seen` every optimizer step.

    Args:
        world_size_aware: multiply by the number of ranks (every rank reads a different slice).
    """

    def __init__(self, world_size_aware: bool = True) -> None:
        self.world_size_aware = world_size_aware
        self.tokens = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens += batch[0].numel() * (trainer.world_size if self.world_size_aware else 1)
        pl_module.log("data/tokens_seen", float(self.tokens), on_step=True, on_epoch=False)

    def state_dict(self) -> dict:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.tokens = state["tokens"]
