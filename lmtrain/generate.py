"""Sample a continuation from a run's newest checkpoint, with the run's own tokenizer.

    python -m lmtrain.generate RUN_DIR --prompt "def main(" [--max-new-tokens 64] [--temperature 0.8] [--top-k 50]
                                       [--seed 0] [--device auto] [--checkpoint step-0000500]

The model is rebuilt from ``RUN_DIR/config.yaml`` and loaded from the newest complete checkpoint (single-file or
sharded: a sharded checkpoint is consolidated in memory, no distributed launch needed); the tokenizer is the one
the run's dataset was prepared with. ``--temperature 0`` is greedy decoding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lmtrain.console import help_text
from lmtrain.errors import InputError
from lmtrain.formats.trained import load_run
from lmtrain.nn.sampling import sample


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.generate") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--checkpoint", default=None, help="a step-N directory name (default: the newest complete one)")
    args = p.parse_args(argv)
    try:
        device = _device(args.device)
        bad = [
            f"--{name} {value:g} must be {rule}"
            for name, value, ok, rule in [
                ("temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy decoding)"),
                ("top-k", args.top_k, args.top_k >= 0, ">= 0 (0: no top-k)"),
                ("max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ]
            if not ok
        ]
        if bad:
            raise InputError("; ".join(bad))
        model, enc, eos, ckpt = load_run(Path(args.run_dir), args.checkpoint, device)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ids = enc.encode_ordinary(args.prompt)
    if not ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    new = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k, eos, gen, vocab=enc.n_vocab)
    print(f"[{ckpt.path.name}, step {ckpt.step}]", file=sys.stderr)
    print(args.prompt + enc.decode([t for t in new if t != eos]))
    return 0


def _device(name: str) -> str:
    """The torch device ``--device`` names, checked here: one line instead of torch's traceback."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name}: not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: this machine has no usable GPU (torch.cuda.is_available() is false): use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(
                f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type != "cpu":
        raise InputError(f"--device {name}: use auto, cpu, cuda or cuda:N")
    return name


if __name__ == "__main__":
    raise SystemExit(main())
