"""Goodput: the share of this invocation's wall-clock time spent in training steps, and what took the rest.

The run adds one :class:`Goodput` to every attempt's Trainer, first among the callbacks (lmtrain.training.run). Host
wall-clock time, from the
start of ``lmtrain.training.run.train`` to the end of the last attempt's training:

* training steps: each micro-batch from its ``on_train_batch_start`` (this callback is first) to the end of the
  other callbacks' ``on_train_batch_end`` (:attr:`Goodput.step_end` is last but the checkpointer): forward, backward,
  optimizer step and the step's statistics, whose host syncs wait for the step's GPU work (where a step ends for the
  host: timed only to the first callback's hook, the GPU's remaining work showed as "other"); except each attempt's
  first, which is
* first steps: compilation and warm-up (a rollback's attempt builds and compiles again), and the checkpointer's
  pinning of its host buffers at that step (``CheckpointStore.prepare_seconds``);
* start-up: from each attempt's start to its ``on_train_start`` (config, data preparation, model, strategy,
  checkpoint restore);
* validation: ``on_validation_start`` to ``on_validation_end``;
* evals: the downstream evaluations (lmtrain.callbacks.evals: at the start, after each validation, at the end), as
  they time themselves (``Evaluates.eval_seconds``);
* checkpoint saves: the time training waited on the checkpointer (``CheckpointStore.stall_seconds``; an
  asynchronous save counts only its copy to host memory);
* other: the rest (waiting for data, logging, callbacks between steps, rollbacks' hand-over).

``steady`` is the training steps' share of the time after start-up and the first steps (the run as it goes on once
compiled: validation, saves and the rest still count against it), the figure a longer run approaches.

The figures end when the last callback's ``on_train_end`` has run (the final evals in them; the checkpointer's wait
for the end's background write, run after, not). At the end of training the figures are logged to the run's loggers (``goodput/*``, MLflow included) at the last step
and the end-of-run summary has one line of them.
"""

from __future__ import annotations

import time

import lightning as L

from lmtrain.training.contracts import CheckpointStore, Evaluates


class Goodput(L.Callback):
    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() at the start of the run
        self.train_s = self.first_s = self.startup_s = self.val_s = self.saves_s = self.evals_s = 0.0
        self._attempt_start: float | None = None
        self._batch_start: float | None = None
        self._val_start: float | None = None
        self._first_pending = True
        self._saves_before = 0.0  # earlier attempts' checkpointers
        self._checkpointer: CheckpointStore | None = None
        self.ended: float | None = None
        self.step_end = _StepEnd(self)  # placed last among the callbacks (the checkpointer still after it)

    def begin_attempt(self) -> None:
        """Called by the run as each attempt starts."""
        self._attempt_start = time.monotonic()
        self._first_pending = True

    def on_train_start(self, trainer, pl_module) -> None:
        if self._attempt_start is not None:
            self.startup_s += time.monotonic() - self._attempt_start
            self._attempt_start = None
        self._checkpointer = next((c for c in trainer.callbacks if isinstance(c, CheckpointStore)), None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_start = time.monotonic()

    def batch_ended(self) -> None:
        """The step's callbacks are done (:class:`_StepEnd`)."""
        if self._batch_start is None:
            return
        dt, self._batch_start = time.monotonic() - self._batch_start, None
        if self._first_pending:
            self.first_s += dt
            self._first_pending = False
        else:
            self.train_s += dt

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_start is not None:
            self.val_s += time.monotonic() - self._val_start
            self._val_start = None

    def train_ended(self, trainer) -> None:
        """The attempt's training ended, every callback's ``on_train_end`` run but the checkpointer's (:class:`_StepEnd`)."""
        self.ended = time.monotonic()
        self.evals_s += sum(c.eval_seconds for c in trainer.callbacks if isinstance(c, Evaluates))
        if self._checkpointer is not None:
            self._saves_before += self._checkpointer.stall_seconds
            self.first_s += self._checkpointer.prepare_seconds
            self._checkpointer = None
        self.saves_s = self._saves_before
        if trainer.is_global_zero:
            figures = {f"goodput/{k}": v for k, v in self.figures().items()}
            for lg in trainer.loggers:
                lg.log_metrics(figures, step=trainer.global_step)

    def figures(self) -> dict[str, float]:
        """Seconds per part, the wall time, ``fraction`` (training steps over the wall time) and ``steady`` (training
        steps over the wall time less start-up and the first steps)."""
        wall = (self.ended if self.ended is not None else time.monotonic()) - self.started
        parts = {
            "train_s": self.train_s,
            "first_steps_s": self.first_s,
            "startup_s": self.startup_s,
            "validation_s": self.val_s,
            "evals_s": self.evals_s,
            "checkpoint_s": self.saves_s,
        }
        steady = wall - self.startup_s - self.first_s
        return {
            "fraction": self.train_s / wall if wall > 0 else 0.0,
            "steady": self.train_s / steady if steady > 0 else 0.0,
            "wall_s": wall,
            **parts,
            "other_s": max(wall - sum(parts.values()), 0.0),
        }

    def line(self) -> str:
        f = self.figures()
        return (
            f"{f['fraction']:.1%} of {f['wall_s']:.1f} s in training steps ({f['train_s']:.1f} s), {f['steady']:.1%} after the first "
            f"steps; start-up {f['startup_s']:.1f} s, "
            f"first steps {f['first_steps_s']:.1f} s (compilation, warm-up), validation {f['validation_s']:.1f} s, "
            f"evals {f['evals_s']:.1f} s, checkpoint saves {f['checkpoint_s']:.1f} s, other {f['other_s']:.1f} s"
        )


class _StepEnd(L.Callback):
    """Where a training step, and training, end for :class:`Goodput`: after every other callback's
    ``on_train_batch_end`` and ``on_train_end`` (but the checkpointer's, which Lightning runs last)."""

    def __init__(self, clock: Goodput) -> None:
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.batch_ended()

    def on_train_end(self, trainer, pl_module) -> None:
        self.clock.train_ended(trainer)
