"""Data preparation speed: `data.prepare` end to end beside tiktoken's own `encode_ordinary_batch`.

    python bench/prepare_speed.py [--workers N] [--max-mb MB] [--tokenizer-vocab V]

Corpus: every ``.py`` file of the Python standard library (site-packages excluded), one document per jsonl
line, up to ``--max-mb``. A BPE of ``--tokenizer-vocab`` tokens is trained once beforehand (not timed), so both
sides use the same ``.tiktoken`` ranks. Baseline: the texts already in memory, ``encode_ordinary_batch`` with
``num_threads=N``. Ours: ``prepare()`` with ``workers=N`` — reading the jsonl, tokenizing, splitting and
writing shards. Both report MB/s of UTF-8 input; the row gives the ratio (the target is >= 0.70).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmtrain.data.prepare import prepare  # noqa: E402
from lmtrain.formats.tokenizer import encoding_from_ranks, save_ranks, train_bpe  # noqa: E402


def stdlib_texts(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t.encode())
        if total >= max_bytes:
            break
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-mb", type=float, default=60)
    p.add_argument("--tokenizer-vocab", type=int, default=4096)
    args = p.parse_args()
    texts = stdlib_texts(int(args.max_mb * 1e6))
    mb = sum(len(t.encode()) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as fh:
            for t in texts:
                fh.write(json.dumps({"text": t}) + "\n")
        ranks = train_bpe(texts[:2000], args.tokenizer_vocab)
        save_ranks(ranks, tmp / "tok.tiktoken")
        enc = encoding_from_ranks(ranks)

        t0 = time.perf_counter()
        n_base = sum(len(ids) for ids in enc.encode_ordinary_batch(texts, num_threads=args.workers))
        base = time.perf_counter() - t0

        t0 = time.perf_counter()
        m = prepare([corpus], tmp / "ds", tokenizer=str(tmp / "tok.tiktoken"), val_fraction=0.01, workers=args.workers, progress=False)
        ours = time.perf_counter() - t0
    assert m["num_tokens"] == n_base + m["num_documents"]  # same tokens, plus one separator per document
    print("| cores | workers | corpus | tokens | tiktoken encode_ordinary_batch MB/s | data.prepare end-to-end MB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {os.cpu_count()} | {args.workers} | {mb:.1f} MB, {len(texts)} docs | {n_base:,} | {mb / base:.1f} | {mb / ours:.1f} | {base / ours:.2f} |"
    )


if __name__ == "__main__":
    main()
