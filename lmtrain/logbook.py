"""``lmtrain logbook RUN_DIR``: print a run's logbook (``RUN_DIR/logbook.jsonl``) as a timeline."""

from __future__ import annotations

import sys
from pathlib import Path

from lmtrain.formats.logbook import FILE, read


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.logbook") -> int:
    import argparse

    p = argparse.ArgumentParser(prog=prog, description="Print a run's logbook (RUN_DIR/logbook.jsonl) as a timeline.")
    p.add_argument("run_dir", help="the run directory, e.g. runs/my-run")
    args = p.parse_args(argv)
    if not (Path(args.run_dir) / FILE).is_file():
        print(f"error: {args.run_dir} has no logbook ({FILE}): not a run directory, or a run that never started", file=sys.stderr)
        return 2
    for e in read(args.run_dir):
        extra = {k: v for k, v in e.items() if k not in ("time", "kind", "message", "alert")}
        kind = f"{e['kind']} !" if e.get("alert") else e["kind"]  # an alert (lmtrain.formats.logbook.alert)
        print(f"{e['time']}  {kind:<20} {e['message']}" + (f"  {extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
