"""What components ask of each other, declared as small base classes that the callbacks inherit and the others find
by type (``isinstance``), not by probing for attributes: the run asks who may stop training or request a rollback,
LMModule who judges a step, the checkpointer who guards a save, the detector where the checkpoints are, the progress
bar who measures speed."""

from __future__ import annotations

from pathlib import Path


class StopsTraining:
    """A callback that may stop training before ``trainer.max_steps`` (the divergence detector's ``stop``, the disk
    guard). It sets ``stop_reason`` and ``trainer.should_stop``; the run then did not finish, and the entry point
    exits with ``stop_status`` (3; 6 for a stall: lmtrain.errors.RunStopped)."""

    stop_reason: str | None = None
    stop_status: int = 3


class Preempts:
    """The callback that ends training on a signal after saving the step (lmtrain.callbacks.preemption): its
    ``preempted`` (``signal``, ``step``, ``checkpoint``: the saved one or None) is set when it did; the run then did
    not finish, and the entry point exits with status 4 (lmtrain.errors.Preempted)."""

    preempted: dict | None = None


class Evaluates:
    """A callback that scores downstream tasks outside the training steps (lmtrain.callbacks.evals): ``eval_seconds``,
    the wall time its evaluations took in this attempt, which goodput counts apart."""

    eval_seconds: float = 0.0


class RequestsRollback:
    """A callback that may end the attempt asking for a rollback (the divergence detector). ``rollback_request``:
    ``checkpoint`` (the directory to return to), ``from_step``, ``scale`` (the learning-rate factor from there),
    ``signal_step``, ``skip_batches``, ``why`` and ``carry``; the run records it and starts the next attempt from there,
    handing ``carry`` to that attempt's instance (:meth:`carried`)."""

    rollback_request: dict | None = None

    def carried(self, carry: dict) -> None:
        """The ``carry`` of the rollback this attempt follows, given before its checkpoint is loaded: what returning to
        an earlier checkpoint does not undo (the hardware faults counted since)."""


class StepChecker:
    """A callback that judges every optimizer step's statistics (the divergence detector). LMModule calls
    :meth:`check_step` on every rank, with the same (reduced) statistics, one step late unless ``needs_same_step``."""

    needs_same_step: bool = False  # True: the statistics of this very update are needed now (a device sync per step)
    reruns_suspects: bool = False  # True: each step's loss is read before its update, for :meth:`suspects`

    def check_step(self, trainer, pl_module, stats: dict) -> bool:
        """``stats``: step (its number, from 1), loss, grad_norm, act_rms, loss_scale, overflow; for a step computed
        again (:meth:`on_rerun`) ``rerun_differs`` (how many ranks' results differed) and ``rerun_loss``. True: drop this update."""
        raise NotImplementedError

    def suspects(self, loss: float, step: int) -> tuple[str, float] | None:
        """With ``reruns_suspects``: step ``step``'s loss (all ranks' mean), read as its forward passes ended. ``(why,
        tolerance)``: compute the step again on the same batches before its update, a rank's two losses counting as the
        same within ``tolerance``; None: go on."""
        return None

    def on_rerun(self, trainer, pl_module, step: int, verdict: dict) -> bool:
        """A suspect step computed again: ``verdict`` has ``why`` (:meth:`suspects`'), ``again`` (the ranks' mean of the
        second results), ``differs`` (the ranks whose results differed), ``results`` (each rank's [first, second]) and
        ``hosts`` (each rank's (host, device), where some differed). True: drop this update."""
        return False


class SaveGuard:
    """A callback consulted around every checkpoint save (the disk guard)."""

    def check_start(self, root, estimate: int) -> None:
        """Before the attempt writes anything: raise InputError if checkpoints of ``estimate`` bytes cannot be saved
        under ``root``."""

    def before_save(self, trainer, checkpointer, estimate: int) -> bool:
        """``estimate``: the bytes the save will write. False: skip this save (training goes on)."""
        return True

    def after_save(self, trainer, checkpointer, final, size: int) -> None:
        """A save completed into ``final`` (``size`` bytes); may run in the saving thread."""

    def flush_metrics(self, trainer) -> None:
        """Log what the completed saves measured (called at each step and by the checkpointer at the end)."""

    def at_save_stage(self, stage: str, step: int, path) -> None:
        """A stage of the save protocol: ``save_start`` (the partial directory exists, nothing written),
        ``before_commit`` (every file written, not yet committed) or ``after_commit`` (committed as ``path``, not yet
        verified). Raising ``OSError`` fails the save as the filesystem would. The fault drills use it."""


class CheckpointStore:
    """What the run and the other callbacks may ask of the run's checkpointer (lmtrain.callbacks.checkpoint.Checkpointer):
    where the checkpoints are, the time training waited on saves so far (``stall_seconds``: lmtrain.training.goodput),
    and the methods below; its state is its own."""

    root: Path
    stall_seconds: float = 0.0
    prepare_seconds: float = 0.0  # set up at an attempt's first step (pinned host buffers): counted with the first steps

    def describe_run(self, info: dict) -> None:
        """What every checkpoint records about the run from now on (lmtrain.training.run: the model's identity, config
        hash, data stream, MLflow run id)."""

    def record_health(self, health: dict) -> None:
        """The health fields saved with the next checkpoint (the divergence detector's judgement of the newest step)."""

    def discard_current_state(self) -> None:
        """The state training is in must never be saved (a diverged one): no final save of this attempt."""

    def estimate_bytes(self, trainer) -> int:
        """Bytes the next checkpoint will take."""
        raise NotImplementedError

    def prune(self, keep_last: int) -> list:
        """Delete all but the newest ``keep_last`` complete checkpoints (and those retention keeps for good)."""
        raise NotImplementedError

    def save_figures(self) -> dict[str, float]:
        """Seconds the newest save took (``write_s``, ``stall_s``, ``collect_s``)."""
        return {}

    def wait(self, raise_errors: bool = True) -> None:
        """Return once no save is in flight (``raise_errors``: raise CheckpointError when too many saves in a row
        failed)."""

    def save_now(self, trainer) -> Path | None:
        """Save the current step (a preemption), wait for it; the complete checkpoint, or None."""


class WatchesProgress:
    """The callback that watches for progress (lmtrain.callbacks.watchdog); others tell it of work that is progress
    but no training batch (the checkpointer: a save begins)."""

    def beat(self, phase: str) -> None:
        """A sign of progress; ``phase`` is what the process does until the next one (``train``, ``val``, ``save``)."""


class ReportsThroughput:
    """A callback that measures training speed; the progress bar shows ``smoothed_tokens_per_sec``."""

    smoothed_tokens_per_sec: float | None = None
