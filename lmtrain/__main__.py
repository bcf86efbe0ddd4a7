"""lmtrain COMMAND [ARGS] (or python -m lmtrain COMMAND): one entry point for every tool.

    lmtrain train [Hydra overrides]       train (the same as python train.py in a checkout)
    lmtrain prepare --input ... --output  tokenize and pack a corpus into a dataset
    lmtrain plan ...                      memory and throughput plan for a model on a cluster
    lmtrain report RUN_DIR                plots of a run's losses and learning rate (PNG), with its corrections marked
    lmtrain logbook RUN_DIR               the run's logbook as a timeline
    lmtrain audit RUN_DIR [--step N]      which samples each step trained on; any skipped or read twice is named
    lmtrain replay RUN_DIR [--set K=V]    the divergence detector replayed over a run's record: where it would act
    lmtrain control RUN_DIR lr|decay|revoke|status
                                          learning-rate corrections of a run, running or stopped (decay: start a WSD
                                          schedule's cooldown), and what is in force
    lmtrain generate RUN_DIR --prompt ..  sample from a run's newest checkpoint
    lmtrain export RUN_DIR --out DIR      a standalone model export (safetensors, config, tokenizer; --format hf)
    lmtrain doctor                        every GPU's matmul rate and memory bandwidth, the links' all-reduce bandwidth

lmtrain COMMAND --help describes each; lmtrain --version gives the version. python -m lmtrain.COMMAND runs the same
module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

COMMANDS = {
    "train": "lmtrain.train",
    "prepare": "lmtrain.data.prepare",
    "plan": "lmtrain.plan",
    "report": "lmtrain.report",
    "logbook": "lmtrain.logbook",
    "audit": "lmtrain.audit",
    "replay": "lmtrain.replay",
    "control": "lmtrain.control",
    "generate": "lmtrain.generate",
    "export": "lmtrain.export",
    "doctor": "lmtrain.doctor",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from lmtrain import __version__

        print(f"lmtrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        near = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        print(f"error: unknown command '{name}'{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name])
    if name == "train":
        # Hydra reads its overrides from sys.argv, and Lightning's launcher starts the other ranks of a multi-process
        # run with ``python -m <__main__'s module> sys.argv[1:]``: both must see ``python -m lmtrain.train ARGS``
        import __main__

        __main__.__spec__ = importlib.util.find_spec(COMMANDS[name])
        sys.argv = [module.__file__, *rest]
        module.cli()
        return 0
    return int(module.main(rest, prog=f"lmtrain {name}") or 0)  # usage lines name the tool as it was called


if __name__ == "__main__":
    raise SystemExit(main())
