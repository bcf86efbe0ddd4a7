"""``lmtrain replay RUN_DIR``: the divergence detector's judgement replayed over a run's metrics record, offline.

Every step a signal fires, the signals and the action the detector takes with the run's own settings
(``callbacks.divergence`` in ``RUN_DIR/config.yaml``), or with others given as ``--set KEY=VALUE`` (``loss_spike.z=8``,
``warmup_steps=50``): what a threshold would have done on a real run, without training it again. The judgement is the
code the run uses (lmtrain.training.stability); nothing is acted on, so the steps after a first action say what the
detector would go on to see if the run were let be.

``lmtrain replay --events FILE`` judges a labelled set of real events instead (tests/data/stability/events.json: each
event a run's trace, its kind and the step it began) and prints, per kind, the events, the correct and false actions
and the steps to act: the table of docs/stability.md, for the default settings or those given with ``--set``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmtrain.errors import InputError


def settings(run_dir: Path, sets: list[str]) -> dict:
    """The run's callbacks.divergence settings (none where the run had no detector) with ``sets`` applied."""
    from omegaconf import OmegaConf

    from lmtrain.training.stability import JUDGE_KEYS

    config = run_dir / "config.yaml"
    base = {}
    if config.is_file():
        node = OmegaConf.select(OmegaConf.load(config), "callbacks.divergence")
        base = OmegaConf.to_container(node) if node is not None else {}
    merged = OmegaConf.create({k: v for k, v in base.items() if k in JUDGE_KEYS})
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or key.split(".")[0] not in JUDGE_KEYS:
            raise InputError(f"--set {item}: give KEY=VALUE with KEY one of {', '.join(JUDGE_KEYS)} (a signal's own key after a dot)")
        OmegaConf.update(merged, key, _value(value), force_add=True)
    return OmegaConf.to_container(merged)


def _events(path: Path, sets: list[str], as_json: bool) -> int:
    """The labelled set judged with the default settings and ``sets``: a table by kind, then each event."""
    from lmtrain.training.stability import read_traces, score, table

    try:
        if not path.is_file():
            raise InputError(f"--events {path}: no such file")
        labels = json.loads(path.read_text(encoding="utf-8"))
        events = labels["events"] if isinstance(labels, dict) else labels
        traces = {}
        for name in sorted({e["trace"] for e in events}):
            if not (path.parent / name).is_file():
                raise InputError(f"--events {path}: its trace file {name} is not beside it")
            traces.update({(name, run): trace for run, trace in read_traces(path.parent / name).items()})
        missing = sorted({f"{e['trace']}:{e['run']}" for e in events} - {f"{t}:{r}" for t, r in traces})
        if missing:
            raise InputError(f"--events {path}: no trace of {', '.join(missing)}")
        results = score(events, traces, **settings(Path("/nonexistent"), sets))
    except (InputError, KeyError, ValueError) as exc:
        print(f"error: {exc if isinstance(exc, InputError) else f'--events {path}: not a labelled set ({exc!r})'}", file=sys.stderr)
        return 2
    if as_json:
        for r in results:
            print(json.dumps(r))
        return 0
    print(table(results))
    for r in results:
        verdict = "ok   " if r["correct"] else "WRONG"
        what = f"acted at {r['acted']} ({r['steps_to_act']:+d})" if r["acted"] is not None else "no action"
        false = f", false action at {r['false_action']}" if r["false_action"] is not None else ""
        print(f"{verdict} {r['kind']:<10} {r['run']:<28} onset {r.get('onset', '-')!s:>5}: {what}{false}")
    return 0


def _value(text: str):
    """A number where the text is one (``1e6`` too, which YAML reads as text), else what YAML makes of it."""
    import yaml

    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.replay") -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog=prog,
        description="The divergence detector's judgement replayed over a run's metrics record: every step a signal "
        "fires and the action taken, with the run's own callbacks.divergence settings or those given with --set.",
    )
    p.add_argument("run_dir", type=Path, nargs="?", help="the run directory, e.g. runs/my-run")
    p.add_argument("--events", type=Path, metavar="FILE", help="a labelled set of events (its traces beside it) instead of a run")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a detector setting instead of the run's (repeatable), e.g. loss_spike.z=8")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON line per step a signal fired")
    args = p.parse_args(argv)
    if (args.run_dir is None) == (args.events is None):
        p.error("give a run directory or --events FILE, one of them")
    if args.events is not None:
        return _events(args.events, args.sets, args.json)
    from lmtrain.formats.metrics import RECORD
    from lmtrain.training.stability import read_trace, replay

    try:
        if not (args.run_dir / RECORD).is_file():
            raise InputError(f"{args.run_dir} has no metrics record ({RECORD}): not a run directory, or a run that logged nothing")
        chosen = settings(args.run_dir, args.sets)
        trace = read_trace(args.run_dir)
        events = replay(trace, **chosen)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for e in events:
            print(json.dumps(e))
        return 0
    acted = [e for e in events if e["action"] != "warn"]
    print(f"{args.run_dir}: {len(trace)} steps replayed, {len(events)} with a signal, {len(acted)} acted on")
    for e in events:
        print(f"step {e['step']:>7}  {e['action']:<8}  {e['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
