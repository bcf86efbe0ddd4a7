"""The one base class of every error caused by what a user gave us (config, paths, files, disk)."""


class InputError(ValueError):
    """Bad input, with a message naming it and the way out. Entry points print it and exit with status 2."""


class RunStopped(Exception):
    """Training was stopped before its end by a guard (divergence, disk space): the run did not finish. Entry points
    print the reason and exit with ``status``: :data:`STOPPED_EXIT`, or :data:`STALLED_EXIT` for a run that stopped
    learning, so a scheduler that requeues failed jobs sees it."""

    def __init__(self, reason: str, status: int = 3) -> None:
        super().__init__(reason)
        self.reason, self.status = reason, status


class Preempted(Exception):
    """Training was ended by a signal (SIGTERM, SIGUSR1, Ctrl-C) after saving a checkpoint where it could
    (lmtrain.callbacks.preemption): the run did not finish, and continues when run again. Entry points exit with
    :data:`PREEMPTED_EXIT`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


STOPPED_EXIT = 3  # a run stopped by a guard; 2 is an input error, 1 a crash
PREEMPTED_EXIT = 4  # a run ended by a signal (preemption), its checkpoint saved: run it again to continue
STALLED_EXIT = 6  # a run stopped by the divergence detector's stall signal: it was not learning (lmtrain.training.stability)
HUNG_EXIT = 5  # a run that made no progress within the watchdog's limit (lmtrain.callbacks.watchdog): reported, ended
