"""Preemption is a save: SIGTERM (what SLURM, Kubernetes and torchrun's agent send before they end a job), SIGUSR1
(what ``sbatch --signal=USR1@90`` sends before the time limit) and a first Ctrl-C end the current optimizer step,
save a checkpoint of it, and end the run with exit status 4 (lmtrain.errors.PREEMPTED_EXIT): run again, or let the
scheduler requeue it, and it continues from there. A second Ctrl-C exits at once (status 130), the logbook saying
so (``interrupted``) and the run's lock released, so that the next start needs no takeover.

Every rank takes the same decision at the same step: the signal may reach one rank only (a ``kill`` of Lightning's
first process), so the ranks agree at each step's end whether any of them was asked to stop (one boolean reduction
per step, only when there are several ranks). The checkpoint is written by the run's checkpointer
(lmtrain.callbacks.checkpoint), waited for, and said in the logbook (``preempted``). When it cannot be complete
within ``grace_s`` seconds of the signal (a long step, a validation in progress, a slow disk), a line says so at that
moment; the save goes on until the scheduler's own kill. Lightning's own SIGTERM handling (which exits 0 without a
checkpoint) is replaced while training; the handlers in place before are restored at the end.

A run always has this callback: it is the root config's ``preemption`` node (conf/train.yaml), not one of the
callbacks group, so that ``callbacks=none`` keeps it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import lightning as L

from pathlib import Path

from lmtrain import console
from lmtrain.console import log
from lmtrain.formats import logbook, runlock
from lmtrain.errors import InputError
from lmtrain.training.contracts import CheckpointStore, Preempts


class Preemption(L.Callback, Preempts):
    def __init__(
        self, signals: list[str] | tuple[str, ...] = ("SIGTERM", "SIGUSR1"), grace_s: float = 60.0, run_dir: str | None = None
    ) -> None:
        names = [str(s).upper() for s in signals]
        unknown = [s for s in names if s in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, s, None), signal.Signals)]
        if unknown or not isinstance(grace_s, int | float) or isinstance(grace_s, bool) or not grace_s > 0:
            raise InputError(
                f"preemption: signals={list(signals)} must name catchable signals (e.g. SIGTERM, SIGUSR1, SIGUSR2; "
                f"not {', '.join(unknown) or '-'}) and grace_s={grace_s} must be a number of seconds > 0"
            )
        self.signals = [getattr(signal, s) for s in names]
        self.run_dir = Path(run_dir) if run_dir else None  # its logbook and lock, for the second Ctrl-C's exit
        self.grace_s = float(grace_s)
        self.requested: str | None = None  # the signal this rank received
        self.preempted: dict | None = None  # signal, step, checkpoint (None: none saved): read by lmtrain.training.run
        self._previous: dict = {}
        self._interrupts = 0
        self._last_step = -1
        self._timer: threading.Timer | None = None

    # -- signals -------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._install()  # a signal during the start (restore, compilation) is taken at the first step's end

    def on_train_start(self, trainer, pl_module) -> None:
        self._install()  # again, over Lightning's own (registered just before training starts)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in [*self.signals, signal.SIGINT]:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                print("\n[lmtrain] second interrupt: exiting at once, without a checkpoint (status 130)", file=sys.stderr, flush=True)
                self._leave_at_once()
        if self.requested is None:
            self.requested = name
            again = "; press Ctrl-C again to exit at once" if signum == signal.SIGINT else ""
            print(f"\n[lmtrain] {name}: finishing this step, then saving a checkpoint and exiting{again}", file=sys.stderr, flush=True)
            self._timer = threading.Timer(self.grace_s, self._late, args=(name,))
            self._timer.daemon = True
            self._timer.start()

    def _leave_at_once(self) -> None:
        """The second Ctrl-C: the logbook says so and the lock goes (rank zero, which holds it), then exit 130 without
        waiting for anything (a save or a collective may be what is stuck)."""
        if self.run_dir is not None and console.launched_rank() == 0:
            step = max(self._last_step, 0)
            logbook.append(
                self.run_dir, "interrupted", f"a second Ctrl-C at step {step}: exited at once without a checkpoint (status 130); "
                "the run resumes from the newest complete checkpoint", step=step,
            )  # fmt: skip
            runlock.release_mine(self.run_dir)
        os._exit(130)

    def _late(self, name: str) -> None:
        if self.preempted is None or self.preempted.get("checkpoint") is None:
            log.warning(
                f"{name}: no complete checkpoint within callbacks.preemption.grace_s={self.grace_s:g} s of the signal (a long step, "
                "validation or a slow save); still trying: the run resumes from the newest complete checkpoint"
            )

    def _restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    # -- the decision ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or self.preempted is not None:  # mid-accumulation: the step has not ended
            return
        self._last_step = step
        asked = self.requested is not None
        if trainer.world_size > 1:
            asked = trainer.strategy.reduce_boolean_decision(asked, all=False)
        if not asked:
            return
        name = self.requested or "a signal to another rank"
        store = next((c for c in trainer.callbacks if isinstance(c, CheckpointStore)), None)
        saved = store.save_now(trainer) if store is not None else None
        self.preempted = {"signal": name, "step": step, "checkpoint": saved}
        trainer.should_stop = True
