"""Checkpoint stall: how long a save stops training, synchronous vs asynchronous, through the real trainer.

    python bench/checkpoint_stall.py [--steps 8] [--every 3] [HYDRA_OVERRIDES ...]
    python bench/checkpoint_stall.py model=opt-1.3b trainer=gpu data.seq_len=1024 data.batch_size=4   # one H100

Runs ``lmtrain.training.run.train`` twice with the given overrides, ``callbacks.checkpoint.async_save`` false then true,
saving every ``--every`` steps, and reads back what the checkpointer logged for each save: ``ckpt/stall_s``
(training stopped: state collection plus, synchronous, the whole write, or, asynchronous, the copy to pinned
host memory), ``ckpt/write_s`` (until the checkpoint was complete on disk) and ``ckpt/size_gb``. One table row per
mode: the median over the saves after the first (the first asynchronous save also allocates the pinned buffers).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import lmtrain.training.config  # noqa: E402,F401
from lmtrain.formats.metrics import metric  # noqa: E402
from lmtrain.training.run import train  # noqa: E402


def run(overrides: list[str], async_save: bool, steps: int, every: int, out: Path) -> dict[str, list[float]]:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
        cfg.run_dir = str(out)
        cfg.trainer.max_steps = steps
        cfg.trainer.val_check_interval = 10**9
        cfg.trainer.limit_val_batches = 0
        cfg.trainer.enable_progress_bar = False
        cfg.callbacks.checkpoint.every_n_steps = every
        cfg.callbacks.checkpoint.async_save = async_save
        cfg.callbacks.checkpoint.keep_last = 2
        cfg.callbacks.disk_guard.margin_gb = 0
        cfg.logger = {"csv": {"_target_": "lmtrain.training.loggers.CSVLogger", "save_dir": str(out), "name": "csv", "version": ""}}
    train(cfg)
    got = {k: metric(out, f"ckpt/{k}") for k in ("stall_s", "write_s", "size_gb")}
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # room for the next mode's checkpoints
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    args, overrides = p.parse_known_args()
    os.environ.setdefault("LMTRAIN_RUN_ID", "bench")
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mode in (m == "async" for m in args.modes):
            got = run(overrides, mode, args.steps, args.every, Path(tmp) / ("async" if mode else "sync"))
            later = slice(1, None) if len(got["stall_s"]) > 1 else slice(None)
            rows.append(
                (
                    "async" if mode else "sync",
                    len(got["stall_s"]),
                    statistics.median(got["size_gb"]),
                    statistics.median(got["stall_s"][later]),
                    statistics.median(got["write_s"][later]),
                    got["stall_s"],
                )
            )
    print(f"device: {card}; overrides: {' '.join(overrides)}")
    print("| mode | saves | size GB | stall s (median, saves after the first) | write s | every save's stall s |")
    print("|---|---|---|---|---|---|")
    for mode, n, size, stall, write, all_stalls in rows:
        print(f"| {mode} | {n} | {size:.2f} | {stall:.2f} | {write:.2f} | {', '.join(f'{x:.2f}' for x in all_stalls)} |")


if __name__ == "__main__":
    main()
