"""Data loader speed: tokens/s the training loader delivers, against what a 1.3B model consumes on one H100.

    python bench/loader_speed.py [--seq-len 2048] [--batch-size 8] [--workers 0 2] [--batches 400] [--device cuda]

Dataset: the embedded corpus (``python-stdlib``) prepared with a 4096-token BPE into a temporary folder (not
timed), used once as a single dataset and once as a 0.7 / 0.3 mixture with a second preparation of the same
text. Each row times ``--batches`` batches from ``TokenDataModule.train_dataloader()`` (the loader training
uses: memory-mapped shards, seeded sampler, StatefulDataLoader), after 20 warm-up batches, cycling epochs as
needed. With ``--device cuda`` each batch is also copied to the GPU (pinned memory, ``non_blocking``), as
Lightning does. The target: at least 50 x the 1.3B model's consumption, 50 x 61,000 = 3.05M tokens/s
(FINDINGS.md: raw PyTorch 1.3B on one H100 is about 61k tokens/s).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lmtrain.data.datamodule import TokenDataModule  # noqa: E402
from lmtrain.data.prepare import prepare  # noqa: E402

CONSUMPTION_1P3B_H100 = 61_000  # tokens/s, raw PyTorch, FINDINGS.md
TARGET = 50 * CONSUMPTION_1P3B_H100


def time_loader(dm: TokenDataModule, batches: int, device: str, warmup: int = 20) -> float:
    loader = dm.train_dataloader()
    n, epoch, t0 = 0, 0, None
    while True:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if device != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            n += 1
            if n == warmup:
                if device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            if n == warmup + batches:
                if device != "cpu":
                    torch.cuda.synchronize()
                return batches * x.numel() / (time.perf_counter() - t0)
        epoch += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        prepare(["python-stdlib"], a, tokenizer="bpe:4096", val_fraction=0.01, workers=2, progress=False)
        prepare(["python-stdlib"], b, tokenizer=str(a / "tokenizer.tiktoken"), val_fraction=0.01, seed=1, workers=2, progress=False)
        print(f"cores: {os.cpu_count()}, device: {args.device}, batch {args.batch_size} x {args.seq_len}, target {TARGET:,} tokens/s")
        print("| dataset | workers | tokens/s | x 1.3B-on-H100 consumption |")
        print("|---|---|---|---|")
        for name, kw in (
            ("single", {"path": str(a)}),
            ("mixture 0.7/0.3", {"sources": [{"path": str(a), "weight": 0.7}, {"path": str(b), "weight": 0.3}]}),
        ):
            for w in args.workers:
                dm = TokenDataModule(seq_len=args.seq_len, batch_size=args.batch_size, num_workers=w, seed=0, **kw)
                dm.setup("fit")
                tps = time_loader(dm, args.batches, args.device)
                print(f"| {name} | {w} | {tps:,.0f} | {tps / CONSUMPTION_1P3B_H100:.0f} |", flush=True)


if __name__ == "__main__":
    main()
