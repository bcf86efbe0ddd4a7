"""Data preparation speed: `data.prepare` end to end beside tiktoken's own `encode_ordinary_batch`, on one machine
and split into tasks.

    python bench/prepare_speed.py [--workers N] [--tasks T] [--max-mb MB] [--tokenizer-vocab V]

Corpus: every ``.py`` file of the Python standard library (site-packages excluded), one document per jsonl
line, up to ``--max-mb``. A BPE of ``--tokenizer-vocab`` tokens is trained once beforehand (not timed), so both
sides use the same ``.tiktoken`` ranks. Baseline: the texts already in memory, ``encode_ordinary_batch`` with
``num_threads=N``. Ours: ``prepare()`` with ``workers=N`` — reading the jsonl, tokenizing, splitting and
writing shards; and with ``--tasks T``, the same preparation as a plan, T task processes at once (N / T workers
each, chunks of a T-th of the corpus at most) and the merge, each a ``python -m lmtrain.data.prepare`` command, its
dataset checked byte for byte against the one-command one. Rows report MB/s of UTF-8 input and MB/s per core used;
the ratio is to tiktoken's (the target is >= 0.70).
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
    p.add_argument("--tasks", type=int, default=0, help="also prepare in this many task processes (0: not)")
    p.add_argument("--max-mb", type=float, default=60)
    p.add_argument("--tokenizer-vocab", type=int, default=4096)
    args = p.parse_args()
    texts = stdlib_texts(int(args.max_mb * 1e6))
    mb = sum(len(t.encode()) for t in texts) / 1e6
    rows = []
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
        rows.append((f"tiktoken encode_ordinary_batch, {args.workers} threads", args.workers, base))

        chunk = max(1 << 20, -(-corpus.stat().st_size // max(1, args.tasks) // 4))  # 4 chunks a task: all busy
        settings = dict(tokenizer=str(tmp / "tok.tiktoken"), val_fraction=0.01, chunk_bytes=chunk)
        t0 = time.perf_counter()
        m = prepare([corpus], tmp / "ds", workers=args.workers, progress=False, **settings)
        rows.append((f"data.prepare, one command, {args.workers} workers", args.workers, time.perf_counter() - t0))
        assert m["num_tokens"] == n_base + m["num_documents"]  # same tokens, plus one separator per document
        if args.tasks:
            rows.append(_in_tasks(corpus, tmp, settings, args.tasks, max(1, args.workers // args.tasks)))
            same = all((tmp / "ds" / f.name).read_bytes() == f.read_bytes() for f in (tmp / "tasks").iterdir())
            assert same and len(list((tmp / "ds").iterdir())) == len(list((tmp / "tasks").iterdir())), "the datasets differ"
    print(f"corpus: {mb:.1f} MB, {len(texts)} documents, {n_base:,} tokens; {os.cpu_count()} cores")
    print("| what | cores | MB/s | MB/s per core | against tiktoken |")
    print("|---|---|---|---|---|")
    for what, cores, seconds in rows:
        print(f"| {what} | {cores} | {mb / seconds:.1f} | {mb / seconds / cores:.2f} | {base / seconds:.2f} |")


def _in_tasks(corpus: Path, tmp: Path, settings: dict, tasks: int, workers: int) -> tuple[str, int, float]:
    """The plan, ``tasks`` task processes at once, and the merge, as commands, timed from the plan to the merge."""
    import subprocess

    run = [sys.executable, "-m", "lmtrain.data.prepare", "--output", str(tmp / "tasks")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plan = ["--input", str(corpus), "--tokenizer", settings["tokenizer"], "--val-fraction", "0.01", "--chunk-bytes",
            str(settings["chunk_bytes"]), "--plan"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run([*run, *plan], check=True, env=env, capture_output=True)
    procs = [subprocess.Popen([*run, "--task", str(i), "--tasks", str(tasks), "--workers", str(workers)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(tasks)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
    subprocess.run([*run, "--merge"], check=True, env=env, capture_output=True)
    return f"data.prepare in {tasks} tasks of {workers} workers (plan, tasks, merge)", tasks * workers, time.perf_counter() - t0


if __name__ == "__main__":
    main()
