"""Disk guard: never train on with nothing being saved.

The FSDP report's job trained for weeks while every checkpoint failed on a full disk. This callback compares
the next checkpoint's estimated size (parameters and optimizer state, or the last checkpoint's real size) plus
a margin with the free space at the checkpoint root:

* at the start (before the attempt writes anything, then again with the trainer's figures): not enough -> refuse
  to start, saying how much is needed and free;
* before every save: not enough -> delete older checkpoints (never the newest complete one, never the
  permanent ``keep_every`` ones) and check again; still not enough -> alert (stderr, run logbook, MLflow tag)
  and stop training cleanly: the newest complete checkpoint is the last good state;
* after every save: log ``ckpt/size_gb``, ``ckpt/free_gb``, ``ckpt/write_s``, ``ckpt/stall_s`` and ``ckpt/collect_s``
  (gathering the state, part of the stall).

Failed saves (ENOSPC and the like) are alerted by the checkpointer itself, which stops the run after
``max_consecutive_failures``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L

from lmtrain.errors import InputError
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook
from lmtrain.training.contracts import CheckpointStore, SaveGuard, StopsTraining

GB = 1e9


class DiskSpaceError(InputError):
    """Not enough free disk space for a checkpoint, with the numbers."""


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


class DiskGuard(L.Callback, StopsTraining, SaveGuard):
    """Args:
    margin_gb: free space to keep beyond one checkpoint (GB, 1e9 bytes).
    """

    def __init__(self, margin_gb: float = 1.0) -> None:
        if margin_gb < 0:
            raise DiskSpaceError(f"callbacks.disk_guard.margin_gb={margin_gb} must be >= 0")
        self.margin = int(margin_gb * GB)
        self._pending: list[tuple[int, dict[str, float]]] = []  # (step, figures), logged from the main thread
        self.stop_reason: str | None = None  # set when it stopped training: the run did not finish (exit status 3)

    @staticmethod
    def _checkpointer(trainer) -> CheckpointStore | None:
        return next((c for c in trainer.callbacks if isinstance(c, CheckpointStore)), None)

    def on_train_start(self, trainer, pl_module) -> None:
        ckptr = self._checkpointer(trainer)
        if ckptr is None:
            return
        estimate = ckptr.estimate_bytes(trainer)
        free = trainer.strategy.broadcast(free_bytes(ckptr.root), src=0)  # rank zero's disk decides, for every rank
        self._refuse_if_short(ckptr.root, estimate, free)
        self._pending.append((trainer.global_step, {"ckpt/free_gb": free / GB, "ckpt/estimate_gb": estimate / GB}))

    def check_start(self, root: Path, estimate: int) -> None:
        """Refuse to start (DiskSpaceError) where ``root``'s disk cannot take one checkpoint of ``estimate`` bytes and the
        margin: called by lmtrain.training.run before the attempt writes anything, with an estimate from the model's
        shape (at the start of training the same check runs again with the trainer's estimate and rank zero's disk)."""
        self._refuse_if_short(root, estimate, free_bytes(root))

    def _refuse_if_short(self, root: Path, estimate: int, free: int) -> None:
        if free < estimate + self.margin:
            raise DiskSpaceError(
                f"not enough disk space for checkpoints at {root}: one checkpoint needs about {estimate / GB:.3f} GB plus "
                f"the {self.margin / GB:.3f} GB margin (callbacks.disk_guard.margin_gb), {free / GB:.3f} GB is free. Free "
                "some space, point callbacks.checkpoint.dirpath at a larger disk, or lower the margin."
            )

    def before_save(self, trainer, ckptr, estimate: int) -> bool:
        """Called by the checkpointer on every rank before a save; False means: do not save, stop training."""
        if self.stop_reason is not None:  # stopping already (the end-of-training save comes here again): said once
            return False
        ok = True
        if trainer.is_global_zero:
            need = estimate + self.margin
            free = free_bytes(ckptr.root)
            if free < need:
                deleted = ckptr.prune(keep_last=1)
                if deleted:
                    logbook.alert(
                        ckptr.root.parent,
                        "disk_pruned",
                        f"low disk space ({free / GB:.3f} GB free, {need / GB:.3f} GB needed): deleted {', '.join(p.name for p in deleted)}",
                    )
                free = free_bytes(ckptr.root)
            if free < need:
                latest = ck.newest(ckptr.root, quiet=True)
                logbook.alert(
                    ckptr.root.parent,
                    "disk_full",
                    f"not enough disk space to save step {trainer.global_step} at {ckptr.root}: {free / GB:.3f} GB free, "
                    f"{need / GB:.3f} GB needed (checkpoint about {estimate / GB:.3f} GB + margin). Stopping training; "
                    f"the newest complete checkpoint is {latest.path.name if latest else 'none'}.",
                )
                ok = False
        ok = trainer.strategy.broadcast(ok, src=0)
        if not ok:
            trainer.should_stop = True
            self.stop_reason = f"not enough disk space at {ckptr.root} to save step {trainer.global_step}"
        return ok

    def after_save(self, trainer, ckptr, final: Path, size: int) -> None:
        figures = {
            "ckpt/size_gb": size / GB,
            "ckpt/free_gb": free_bytes(ckptr.root) / GB,
            **{f"ckpt/{k}": v for k, v in ckptr.save_figures().items()},
        }
        self._pending.append((int(ck.NAME_RE.match(final.name).group(1)), figures))  # may run in the saving thread

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.flush_metrics(trainer)

    def flush_metrics(self, trainer) -> None:
        """Log the figures of the saves completed since the last call (also called by the checkpointer at the end)."""
        while self._pending and trainer.is_global_zero:
            step, metrics = self._pending.pop(0)
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)
