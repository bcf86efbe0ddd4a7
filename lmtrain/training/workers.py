"""The stacks of a loader worker process, on request: each worker the data module starts listens for
:data:`STACKS_SIGNAL` and answers with Python's ``faulthandler`` (which writes from its C signal handler, whatever the
worker's Python code is doing) into an in-memory file of its own; the hang watchdog (lmtrain.callbacks.watchdog)
finds that file among the worker's open files, signals the worker and reads what it wrote. A process that does not
hold such a file is never signalled (the signal's default action would end it)."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

STACKS_SIGNAL = signal.SIGRTMIN + 4  # a real-time signal nothing else here uses (preemption: SIGTERM, SIGUSR1, ...)
NAME = "lmtrain-stacks"
_answers = None  # the worker's in-memory file, kept open for its life


def answer_stack_requests(worker_id: int = 0) -> None:
    """In a loader worker (the DataLoader's ``worker_init_fn``): dump every thread's stack on :data:`STACKS_SIGNAL`."""
    global _answers
    if not hasattr(os, "memfd_create"):
        return
    _answers = os.fdopen(os.memfd_create(NAME), "w+")
    faulthandler.register(STACKS_SIGNAL, file=_answers, all_threads=True)


def _answers_of(pid: int) -> Path | None:
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).startswith(f"/memfd:{NAME}"):
                    return fd
            except OSError:
                continue
    except OSError:
        return None
    return None


def worker_stacks(pid: int, wait_s: float = 1.0) -> str | None:
    """The Python stacks of worker ``pid``, asked for and read back; None when it does not listen for the request; a
    line saying so when it did not answer within ``wait_s`` (stopped, or stuck in the kernel)."""
    answers = _answers_of(pid)
    if answers is None:
        return None
    try:
        before = len(answers.read_text(errors="replace"))
        os.kill(pid, STACKS_SIGNAL)
    except OSError as exc:
        return f"(could not ask: {exc})"
    deadline, seen = time.monotonic() + wait_s, ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            text = answers.read_text(errors="replace")[before:]
        except OSError:
            return "(gone)"
        if text and text == seen:  # written, and no longer growing
            return text.rstrip()
        seen = text
    return seen.rstrip() or f"(no answer within {wait_s:.0f} s: stopped, or stuck in the kernel)"
