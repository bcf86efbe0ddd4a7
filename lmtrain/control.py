"""Operator controls for a running job, without editing code or losing progress.

    python -m lmtrain.control RUN_DIR lr --scale 0.5      # multiply the learning rate by 0.5 from the next step boundary
    python -m lmtrain.control RUN_DIR lr --value 1e-4     # set it to 1e-4 (the schedule goes on, scaled)
    python -m lmtrain.control RUN_DIR status              # corrections in force and the newest checkpoint

A request is a file under ``RUN_DIR/control/``; the run's LRControl callback picks it up within
``callbacks.lr_control.poll_every`` steps, applies it on every rank from the same step, records it in
``RUN_DIR/lr_corrections.jsonl`` and the logbook, and moves the request to ``control/applied/``. It stays in
force across resumes. Given while the run is stopped, it is applied at the restart's first step boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from lmtrain.errors import InputError
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import corrections
from lmtrain.formats.rundir import config_path


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.control") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    sub = p.add_subparsers(dest="command", required=True)
    lr = sub.add_parser("lr", help="correct the learning rate")
    group = lr.add_mutually_exclusive_group(required=True)
    group.add_argument("--scale", type=float, help="multiply the learning rate by this factor")
    group.add_argument("--value", type=float, help="set the learning rate to this value")
    lr.add_argument("--note", default="", help="why (recorded in the logbook)")
    sub.add_parser("status", help="corrections in force and the newest checkpoint")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        config_path(run_dir)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "status":
        entries = corrections.load(run_dir)
        for e in entries:
            print(f"from step {e['from_step']:>8}: x{e['scale']:.4g}  ({e['reason']}, {e['time']})")
        latest = ck.newest(run_dir / "checkpoints", quiet=True)
        print(f"newest complete checkpoint: {latest.path.name if latest else 'none'}")
        pending = sorted((run_dir / "control").glob("lr-*.json")) if (run_dir / "control").is_dir() else []
        print(f"pending requests: {len(pending)}")
        return 0
    value = args.scale if args.scale is not None else args.value
    if not value > 0:
        print(f"error: the learning rate {'factor' if args.scale is not None else 'value'} must be positive, got {value}", file=sys.stderr)
        return 2
    folder = run_dir / "control"
    folder.mkdir(exist_ok=True)
    request = {"scale": args.scale, "value": args.value, "note": args.note, "time": time.time()}
    tmp = folder / f".lr-{time.time_ns()}.tmp"
    tmp.write_text(json.dumps(request))
    final = folder / f"lr-{time.time_ns()}.json"
    os.replace(tmp, final)  # the run never sees a half-written request
    print(f"requested: learning rate {'x' + str(args.scale) if args.scale is not None else '= ' + str(args.value)} ({final})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
