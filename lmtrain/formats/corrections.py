"""Learning-rate corrections of a run: ``RUN_DIR/lr_corrections.jsonl``, one JSON object per correction.

A correction multiplies the learning rate from ``from_step`` on (``scale``); it comes from an automatic rollback
(``reason: rollback``, also recording the signal's step and the data batches skipped), from an operator
(``python -m lmtrain.control RUN_DIR lr ...``, ``reason: operator``), or from the config at a (re)start
(``reason: config``: ``callbacks.lr_control.scale``, the latest one in force, not compounded). A cooldown started by
an operator under ``scheduler=wsd`` (``python -m lmtrain.control RUN_DIR decay --steps N``) is an entry of its own
(``reason: decay``, ``decay_steps: N``, ``scale: 1``): the schedule's decay starts at its ``from_step``. The file is the
source of truth: every resume, automatic or not, re-reads it, so the schedule the run follows is the same timeline
whichever checkpoint it restarts from.

A rollback abandons a timeline: the operator, config and decay corrections issued at or after the checkpoint it
returns to belong to the steps that diverged, so the rollback's entry lists them (``revokes``: their line numbers in the file,
counted from 0) and they are no longer in force when the replay passes their steps. The rollbacks' own factors
stay: each further rollback lowers the rate again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lmtrain.formats.logbook import append_line, read_jsonl

FILE = "lr_corrections.jsonl"
FACTOR_BOUNDS = (1e-4, 10.0)  # callbacks.lr_control.factor_bounds by default: the factors of the schedule a request may bring


def load(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / FILE)


def add(run_dir: str | Path, entry: dict) -> dict:
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}
    append_line(Path(run_dir) / FILE, (json.dumps(entry) + "\n").encode("utf-8"), sync=True)
    return entry


def revoked(entries: list[dict]) -> set[int]:
    """Line numbers of the entries that a later rollback revoked."""
    return {int(i) for e in entries for i in e.get("revokes", ())}


def in_force(entries: list[dict]) -> list[dict]:
    """The entries not revoked by a rollback, in file order."""
    gone = revoked(entries)
    return [e for i, e in enumerate(entries) if i not in gone]


def abandoned(entries: list[dict], from_step: int) -> list[int]:
    """Line numbers of the operator, config and decay corrections in force from ``from_step`` on: the timeline a rollback
    to the checkpoint of ``from_step`` abandons (a checkpoint of step S is saved before step S's corrections apply)."""
    gone = revoked(entries)
    return [
        i
        for i, e in enumerate(entries)
        if i not in gone and e.get("reason") in ("operator", "config", "decay") and e["from_step"] >= from_step
    ]


def cooldown(entries: list[dict]) -> tuple[int, int] | None:
    """(first step, steps) of the operator's cooldown in force (``reason: decay``, not revoked), or None."""
    for e in in_force(entries):
        if e.get("reason") == "decay":
            return int(e["from_step"]), int(e["decay_steps"])
    return None


def describe(entry: dict) -> str:
    """One correction in words, for the logbook."""
    if entry.get("reason") == "revoke":
        return f"revocation of {', '.join(map(str, entry.get('revokes', ())))} from step {entry['from_step']}"
    if entry.get("reason") == "decay":
        return f"decay over {entry.get('decay_steps')} steps from step {entry['from_step']}"
    return f"{entry.get('reason')} x{float(entry['scale']):.4g} from step {entry['from_step']}"


def problems(entries: list[dict]) -> str | None:
    """The first entry that cannot be applied (a hand-edited or damaged line), in words naming its line; None when all
    can: a step >= 0, a finite positive factor, revocations of earlier lines."""
    import math

    for i, e in enumerate(entries):
        step, scale = e.get("from_step"), e.get("scale")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return f"line {i + 1}: from_step={step!r} is not a step"
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale) or not scale > 0:
            return f"line {i + 1}: scale={scale!r} is not a finite positive factor"
        if any(not isinstance(j, int) or not 0 <= j < len(entries) for j in e.get("revokes", ())):
            return f"line {i + 1}: revokes={e.get('revokes')!r} names no correction of the file"
        steps = e.get("decay_steps")
        if e.get("reason") == "decay" and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            return f"line {i + 1}: decay_steps={steps!r} is not a number of steps"
    return None


def multiplier(entries: list[dict], step: int) -> float:
    """The factor on the scheduled learning rate at ``step`` (revoked corrections left out)."""
    mult, config = 1.0, None
    for e in sorted(in_force(entries), key=lambda e: e["from_step"]):
        if e["from_step"] > step:
            break
        if e.get("reason") in ("revoke", "decay"):  # a decay moves the schedule's own decay (cooldown), no factor
            continue
        if e.get("reason") == "config":
            config = float(e["scale"])
        else:
            mult *= float(e["scale"])
    return mult * (config if config is not None else 1.0)


def config_scale(entries: list[dict]) -> float | None:
    cfg = [e for e in in_force(entries) if e.get("reason") == "config"]
    return float(cfg[-1]["scale"]) if cfg else None


def data_skip(entries: list[dict], step: int) -> int:
    """Batches to skip when resuming from the checkpoint of ``step`` (a rollback's skipped data window)."""
    return sum(int(e.get("skip_batches", 0)) for e in entries if e.get("reason") == "rollback" and e["from_step"] == step)
