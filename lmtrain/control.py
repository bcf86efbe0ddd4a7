"""Operator controls for a running job, without editing code or losing progress.

    python -m lmtrain.control RUN_DIR lr --scale 0.5      # multiply the learning rate by 0.5 from the next step boundary
    python -m lmtrain.control RUN_DIR lr --value 1e-4     # set it to 1e-4 (the schedule goes on, scaled)
    python -m lmtrain.control RUN_DIR decay --steps 500   # scheduler=wsd: start the cooldown now, over 500 steps
    python -m lmtrain.control RUN_DIR revoke 2            # take correction 2 back (its number in `status`)
    python -m lmtrain.control RUN_DIR status              # corrections in force and revoked, the newest checkpoint

A request is a file under ``RUN_DIR/control/``; the run's LRControl callback picks it up within
``callbacks.lr_control.poll_every`` steps, checks it (a finite positive number, and a learning rate within
``callbacks.lr_control.factor_bounds`` of the schedule), applies it on every rank from the same step, records it in
``RUN_DIR/lr_corrections.jsonl`` and the logbook, and moves the request to ``control/applied/``; a request it cannot
apply, whatever wrote it, goes to ``control/rejected/`` with the reason in the logbook, and training goes on. A
correction stays in force across resumes until revoked. Given while the run is stopped, a request is applied at the
restart's first step.

``decay`` (a run with ``scheduler=wsd``) starts the schedule's decay where the run picks the request up, over N steps
to ``scheduler.min_lr_ratio``, instead of at ``scheduler.decay_start``, and training ends where it ends (the steps
after it would train at the floor); recorded and revoked like a correction (a rollback to a checkpoint before it
revokes it; a revocation given once the run ended lets a restart train on to ``trainer.max_steps``). Refused at once when the run has no WSD schedule, a decay is under way
or pending, or N steps would end after ``trainer.max_steps``; the run checks it again when it applies it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from lmtrain.console import help_text
from lmtrain.errors import InputError
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import corrections
from lmtrain.formats.rundir import config_path


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.control") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    sub = p.add_subparsers(dest="command", required=True)
    lr = sub.add_parser("lr", help="correct the learning rate")
    group = lr.add_mutually_exclusive_group(required=True)
    group.add_argument("--scale", type=float, help="multiply the learning rate by this factor")
    group.add_argument("--value", type=float, help="set the learning rate to this value")
    lr.add_argument("--note", default="", help="why (recorded in the logbook)")
    decay = sub.add_parser("decay", help="scheduler=wsd: start the learning rate's decay now, over N steps")
    decay.add_argument("--steps", type=int, required=True, help="the decay's length in optimizer steps")
    decay.add_argument("--note", default="", help="why (recorded in the logbook)")
    revoke = sub.add_parser("revoke", help="take a correction back")
    revoke.add_argument("id", type=int, help="the correction's number, as `status` shows it")
    sub.add_parser("status", help="corrections in force and revoked, and the newest checkpoint")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        config_path(run_dir)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        _status(run_dir)
        return 0
    if args.command == "decay":
        if (problem := _decay_problem(run_dir, args.steps)) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        _request(run_dir, "decay", {"decay_steps": args.steps, "note": args.note, "time": time.time()}, f"decay over {args.steps} steps")
        return 0
    if args.command == "revoke":
        entries = corrections.load(run_dir)
        if not 0 <= args.id < len(entries) or entries[args.id].get("reason") == "revoke":
            print(f"error: {args.id} is not the number of a correction of {run_dir} (see: {prog} {run_dir} status)", file=sys.stderr)
            return 2
        _request(run_dir, "revoke", {"revoke": args.id, "time": time.time()}, f"revoke correction {args.id}")
        return 0
    value = args.scale if args.scale is not None else args.value
    if not (math.isfinite(value) and value > 0):
        kind = "factor" if args.scale is not None else "value"
        print(f"error: the learning rate {kind} must be a finite positive number, got {value}", file=sys.stderr)
        return 2
    if args.scale is not None and (problem := _scale_problem(run_dir, args.scale)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    request = {"scale": args.scale, "value": args.value, "note": args.note, "time": time.time()}
    _request(run_dir, "lr", request, f"learning rate {'x' + str(args.scale) if args.scale is not None else '= ' + str(args.value)}")
    return 0


def _request(run_dir: Path, kind: str, request: dict, what: str) -> None:
    folder = run_dir / "control"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{kind}-{time.time_ns()}.tmp"
    tmp.write_text(json.dumps(request))
    final = folder / f"{kind}-{time.time_ns()}.json"
    os.replace(tmp, final)  # the run never sees a half-written request
    print(f"requested: {what} ({final})")


def _steps_logged(run_dir: Path) -> int:
    """The steps the run has logged: it is at this step or later."""
    from lmtrain.formats import metrics

    return max(metrics.by_step(run_dir), default=0)


def _scale_problem(run_dir: Path, scale: float) -> str | None:
    """Why ``lr --scale F`` would be rejected by the run (callbacks.lr_control.factor_bounds, with the corrections in
    force at its last logged step), or None: the same rule as the run's (callbacks/lr_control.py)."""
    from lmtrain.formats.trained import read_config

    try:
        cfg = read_config(run_dir)
    except InputError as exc:
        return str(exc)
    control = ((cfg.get("callbacks") or {}).get("lr_control")) or {}
    low, high = (float(b) for b in control.get("factor_bounds", corrections.FACTOR_BOUNDS))
    total = corrections.multiplier(corrections.load(run_dir), _steps_logged(run_dir)) * scale
    if not low <= total <= high:
        return (
            f"--scale {scale:g} would make the learning rate x{total:.4g} of the schedule, outside the run's "
            f"callbacks.lr_control.factor_bounds=[{low:g}, {high:g}]: the run would reject it"
        )
    return None


def _decay_problem(run_dir: Path, steps: int) -> str | None:
    """Why ``decay --steps N`` cannot start a cooldown of the run (judged from its config, corrections, pending requests
    and the last step it logged), or None."""
    from lmtrain.formats.trained import read_config
    from lmtrain.nn.optim import WarmupStableDecay

    if steps < 1:
        return f"--steps {steps}: the decay's length must be a positive number of steps"
    try:
        cfg = read_config(run_dir)
    except InputError as exc:
        return str(exc)
    sched = cfg.get("scheduler") or {}
    if sched.get("_target_") != "lmtrain.nn.optim.wsd":
        return f"decay needs scheduler=wsd (warmup-stable-decay): {run_dir} runs {sched.get('_target_')} (decay {sched.get('decay')!r})"
    keys = ("warmup_steps", "total_steps", "decay_steps", "decay_start", "decay", "min_lr_ratio")
    schedule = WarmupStableDecay(**{k: sched[k] for k in keys if k in sched})
    pending = sorted((run_dir / "control").glob("decay-*.json")) if (run_dir / "control").is_dir() else []
    if pending:
        return f"a decay request is pending already ({pending[0]}): the run applies it within callbacks.lr_control.poll_every steps"
    steps_logged = _steps_logged(run_dir)
    max_steps = int((cfg.get("trainer") or {}).get("max_steps", schedule.total_steps))
    cooldown = corrections.cooldown(corrections.load(run_dir))
    if cooldown is not None and steps_logged >= sum(cooldown):
        return (
            f"{run_dir} ended at step {sum(cooldown)} with the operator's decay over {cooldown[1]} steps from step {cooldown[0]}: "
            "nothing is left to decay (revoke it to train on: lmtrain control RUN status)"
        )
    if steps_logged >= max_steps:
        return (
            f"{run_dir} has trained all its trainer.max_steps={max_steps} steps: nothing is left to decay (continued with a "
            "larger trainer.max_steps, it can be asked while it runs)"
        )
    if (under_way := schedule.under_way(corrections.cooldown(corrections.load(run_dir)), steps_logged)) is not None:
        return under_way
    if steps_logged + steps > max_steps:
        return (
            f"--steps {steps}: the run has logged step {steps_logged - 1}, so the decay would end after trainer.max_steps={max_steps}; "
            f"give at most --steps {max_steps - steps_logged}"
        )
    return None


def _status(run_dir: Path) -> None:
    """Every correction with its number, in force or revoked (and by what), the newest checkpoint, the requests."""
    entries = corrections.load(run_dir)
    by = {int(j): i for i, e in enumerate(entries) for j in e.get("revokes", ())}
    for i, e in enumerate(entries):
        if e.get("reason") == "revoke":
            state = f"revokes {', '.join(map(str, e.get('revokes', ())))}"
        elif i in by:
            state = f"REVOKED by {by[i]} ({entries[by[i]].get('reason')})"
        else:
            state = "in force"
        what = f"decay over {e.get('decay_steps')} steps" if e.get("reason") == "decay" else f"x{float(e['scale']):.4g}"
        print(f"{i:>3}  from step {e['from_step']:>8}: {what}  {e['reason']}, {e.get('time', '?')}: {state}")
    print(f"learning-rate factor in force now: x{corrections.multiplier(entries, 2**62):.4g} of the schedule")
    if (cd := corrections.cooldown(entries)) is not None:
        print(f"decay started by the operator: over {cd[1]} steps from step {cd[0]} (to step {cd[0] + cd[1]})")
    latest = ck.newest(run_dir / "checkpoints", quiet=True)
    print(f"newest complete checkpoint: {latest.path.name if latest else 'none'}")
    folder = run_dir / "control"
    for name in ("pending", "rejected"):
        where = folder if name == "pending" else folder / "rejected"
        print(f"{name} requests: {len(list(where.glob('*.json'))) if where.is_dir() else 0}")


if __name__ == "__main__":
    raise SystemExit(main())
