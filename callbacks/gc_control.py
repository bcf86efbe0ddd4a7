"""Python's garbage collector on a schedule, the same step on every rank.

Left to itself, the collector runs whenever enough objects have been allocated: a full (generation 2) collection
stopped a training process for 220-270 ms on the CPU machines (2-rank FSDP and single process, tiny model, once
in 60 steps), with the GPU idle behind it. Each rank collects at a different step, and under data parallelism
every rank waits for the slowest at the next collective: N ranks, N stalls for all of them. This callback turns
automatic collection off while training and collects itself:

* after ``freeze_after_steps`` steps (compilation and the first allocations done), one full collection, then
  ``gc.freeze()``: the model, compiled code and optimizer state are never scanned again;
* every ``every_n_steps`` steps, the young generations (``generation``, default 1: a few milliseconds);
* every ``full_every_n_steps`` steps, a full collection (cycles among long-lived objects), on every rank at once.

The time each collection took is logged as ``perf/gc_ms``; the collector's state is restored when training ends.
torchtitan does the same (its ``training.gc_freq``).
"""

from __future__ import annotations

import gc
import time

import lightning as L

from lmtrain.errors import InputError
from lmtrain.training.logs import log_direct


class GarbageCollection(L.Callback):
    def __init__(
        self, every_n_steps: int = 50, generation: int = 1, freeze_after_steps: int = 2, full_every_n_steps: int | None = 1000
    ) -> None:
        def whole(v, least: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= least

        full_ok = full_every_n_steps is None or whole(full_every_n_steps, 1)
        if not whole(every_n_steps, 1) or generation not in (0, 1, 2) or not whole(freeze_after_steps, 0) or not full_ok:
            raise InputError(
                f"callbacks.gc: every_n_steps={every_n_steps} and full_every_n_steps={full_every_n_steps} must be >= 1 "
                f"(null: no scheduled full collection), generation={generation} one of 0, 1, 2, "
                f"freeze_after_steps={freeze_after_steps} >= 0"
            )
        self.every_n_steps, self.generation = every_n_steps, generation
        self.freeze_after_steps, self.full_every_n_steps = freeze_after_steps, full_every_n_steps
        self._was_enabled: bool | None = None
        self._frozen = False
        self._last_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self._was_enabled = gc.isenabled()
        self._last_step = trainer.global_step
        gc.disable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimizer step yet
            return
        self._last_step = step
        if not self._frozen and step >= self.freeze_after_steps:
            self._collect(trainer, 2)
            gc.freeze()
            self._frozen = True
        elif self.full_every_n_steps and step % self.full_every_n_steps == 0:
            self._collect(trainer, 2)
        elif step % self.every_n_steps == 0:
            self._collect(trainer, self.generation)

    def _collect(self, trainer, generation: int) -> None:
        t0 = time.perf_counter()
        gc.collect(generation)
        log_direct(trainer, {"perf/gc_ms": (time.perf_counter() - t0) * 1e3})

    def _restore(self) -> None:
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()
