"""Runs that restart themselves, through the launchers people already use: ``torchrun --max-restarts N`` (TorchElastic
starts every rank of the job again after any rank fails) and SLURM (``sbatch --requeue``, requeued by the batch script
on the exit statuses that mean "run again": 4 preempted, 5 hung). A restarted attempt resumes from the newest healthy
checkpoint like any resume; this module says which restart it is and after what, and stops a crash loop.

* :func:`restart` -- (launcher, K) when this process belongs to the K-th restart of its job.
* :func:`check_launcher` -- a launch whose restarts could not rendezvous is refused before anything is written.
* :func:`previous_end` -- how the previous attempt ended, from the run's logbook (a hang, a crash, an error, a
  preemption, a kill found at the lock's takeover).
* :func:`check_budget` -- more than ``restarts.max`` restarts within ``restarts.window_s`` seconds: one line, exit 3.
"""

from __future__ import annotations

import calendar
import os
import time
from pathlib import Path

from omegaconf import DictConfig

from lmtrain.errors import RunStopped
from lmtrain.formats import logbook
from lmtrain.training.config import ConfigError

ENDS = ("hang", "failed", "error", "preempted", "interrupted", "stopped", "died", "end")  # the logbook entries that end an attempt


def restart() -> tuple[str, int] | None:
    """(launcher, K) when this process is part of the K-th restart of its job (K >= 1), else None."""
    for launcher, var in (("torchrun", "TORCHELASTIC_RESTART_COUNT"), ("SLURM requeue", "SLURM_RESTART_COUNT")):
        try:
            k = int(os.environ.get(var, "0"))
        except ValueError:
            continue
        if k > 0:
            return launcher, k
    return None


def check_launcher() -> None:
    """torchrun with restarts and its rendezvous store shared with the job (its default since PyTorch 2.5): a restarted
    job reads the previous attempt's addresses from that store and cannot connect (pytorch/pytorch#135712; here: gloo's
    "connectFullMesh failed ... Connection refused" at every restart). Refused at the first attempt, in one line."""
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max-restarts={restarts} shares its rendezvous store with the job, and a restarted job then reads "
            "the previous attempt's addresses from it and cannot connect (pytorch/pytorch#135712): launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ... (docs/scale-out.md, runs that restart themselves)"
        )


def previous_end(run_dir: Path) -> str:
    """How the attempt before this one ended, in words, from the run's logbook."""
    entries = logbook.read(run_dir)
    last = next((e for e in reversed(entries) if e.get("kind") in ENDS), None)
    if last is None:
        return "an attempt that left no word (killed before it started training)"
    kind, step = last["kind"], last.get("step")
    at = f" at step {step}" if step is not None else ""
    if kind == "hang":
        ranks = last.get("ranks") or {}
        hosts = sorted({str(r.get("host")) for r in ranks.values() if isinstance(r, dict)})
        return f"a hang{at} (exit 5; ranks {', '.join(sorted(ranks)) or '?'} on {', '.join(hosts) or '?'} reported)"
    if kind == "died":
        return f"a kill{at}: {last.get('message', '')}"
    if kind == "preempted":
        return f"a preemption ({last.get('signal', 'a signal')}{at}, exit 4)"
    if kind == "interrupted":
        return f"a second Ctrl-C{at} (exit 130)"
    if kind == "stopped":
        return f"a guard's stop{at} (exit 3)"
    if kind in ("failed", "error"):
        status = 1 if kind == "failed" else 2
        return f"{'a crash' if kind == 'failed' else 'an error'}{at} (exit {status}): {last.get('message', '')}"
    return f"the end of training{at} (exit 0)"


def budget(cfg: DictConfig) -> tuple[int, float]:
    """(``restarts.max``, ``restarts.window_s``), checked."""
    node = dict(cfg.get("restarts") or {})
    unknown = sorted(set(node) - {"max", "window_s"})
    most, window = node.get("max", 10), node.get("window_s", 3600)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (most, window))
    if unknown or not numbers or int(most) != most or most < 1 or window <= 0:
        raise ConfigError(
            f"restarts: max={most!r} must be a whole number >= 1 and window_s={window!r} seconds > 0"
            + (f"; unknown key(s) {unknown}" if unknown else "")
        )
    return int(most), float(window)


def check_budget(cfg: DictConfig, run_dir: Path, now: float | None = None) -> None:
    """A restart when the run has restarted ``restarts.max`` times within the last ``restarts.window_s`` seconds
    already is stopped (RunStopped, exit 3) with one line naming the count, the window and the last cause: a crash
    loop, which a person must look at, not a launcher that tries again."""
    most, window = budget(cfg)
    if restart() is None:
        return
    now = time.time() if now is None else now
    recent = [e for e in logbook.read(run_dir) if e.get("kind") == "restart" and now - _when(e) <= window]
    if len(recent) >= most:
        raise RunStopped(
            f"restart budget spent: {len(recent)} restarts of run {cfg.run_name} within the last {window:.0f} s (restarts.max="
            f"{most}, restarts.window_s={window:.0f}), the last after {previous_end(run_dir)}; look at {run_dir}/logbook.jsonl, "
            "then launch it again (or raise restarts.max)"
        )


def _when(entry: dict) -> float:
    try:
        return float(calendar.timegm(time.strptime(str(entry.get("time")), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return 0.0
