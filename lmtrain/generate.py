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

from lmtrain.errors import InputError
from lmtrain.formats.trained import load_run
from lmtrain.nn.sampling import sample


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.generate") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--checkpoint", default=None, help="a step-N directory name (default: the newest complete one)")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
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


if __name__ == "__main__":
    raise SystemExit(main())
