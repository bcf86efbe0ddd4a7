"""What the run (lmtrain.run) asks of the callbacks that can end an attempt early, declared as small base classes
that those callbacks inherit and the run finds by type (not by probing for attributes)."""

from __future__ import annotations


class StopsTraining:
    """A callback that may stop training before ``trainer.max_steps`` (the divergence detector's ``stop``, the disk
    guard). It sets ``stop_reason`` and ``trainer.should_stop``; the run then did not finish, and the entry point
    exits with status 3 (lmtrain.errors.RunStopped)."""

    stop_reason: str | None = None


class RequestsRollback:
    """A callback that may end the attempt asking for a rollback (the divergence detector). ``rollback_request``:
    ``checkpoint`` (the directory to return to), ``from_step``, ``scale`` (the learning-rate factor from there),
    ``signal_step``, ``skip_batches`` and ``why``; the run records it and starts the next attempt from there."""

    rollback_request: dict | None = None
