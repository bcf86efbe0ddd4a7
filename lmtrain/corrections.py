"""Learning-rate corrections of a run: ``RUN_DIR/lr_corrections.jsonl``, one JSON object per correction.

A correction multiplies the learning rate from ``from_step`` on (``scale``); it comes from an automatic rollback
(``reason: rollback``, also recording the signal's step and the data batches skipped), from an operator
(``python -m lmtrain.control RUN_DIR lr ...``, ``reason: operator``), or from the config at a (re)start
(``reason: config``: ``callbacks.lr_control.scale``, the latest one in force, not compounded). The file is the
source of truth: every resume, automatic or not, re-reads it, so the schedule the run follows is the same timeline
whichever checkpoint it restarts from.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lmtrain.logbook import read_jsonl

FILE = "lr_corrections.jsonl"


def load(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / FILE)


def add(run_dir: str | Path, entry: dict) -> dict:
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}
    with open(Path(run_dir) / FILE, "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return entry


def multiplier(entries: list[dict], step: int) -> float:
    """The factor on the scheduled learning rate at ``step``."""
    mult, config = 1.0, None
    for e in sorted(entries, key=lambda e: e["from_step"]):
        if e["from_step"] > step:
            break
        if e.get("reason") == "config":
            config = float(e["scale"])
        else:
            mult *= float(e["scale"])
    return mult * (config if config is not None else 1.0)


def config_scale(entries: list[dict]) -> float | None:
    cfg = [e for e in entries if e.get("reason") == "config"]
    return float(cfg[-1]["scale"]) if cfg else None


def data_skip(entries: list[dict], step: int) -> int:
    """Batches to skip when resuming from the checkpoint of ``step`` (a rollback's skipped data window)."""
    return sum(int(e.get("skip_batches", 0)) for e in entries if e.get("reason") == "rollback" and e["from_step"] == step)
