"""Is every GPU and link of the job as fast as it should be? Measured before the expensive job starts.

    lmtrain doctor                                            # this process: its GPU (or the CPU)
    torchrun --standalone --nproc_per_node=8 -m lmtrain doctor    # every GPU of a node, and the links between them
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 -m lmtrain doctor
    srun python -m lmtrain doctor                             # in a SLURM job, with MASTER_ADDR/PORT exported

Per rank: a matrix-product rate (bf16 products of 8192 x 8192 on a GPU, fp32 of 1024 x 1024 on the CPU) and a
memory bandwidth (a device-to-device copy of 1 GiB, 64 MiB on the CPU, counting the bytes read and written), each
the best of three timed loops, beside the card's datasheet figures (the table MFU uses: lmtrain.training.cards).
Across the job's ranks: the all-reduce bus bandwidth (NCCL on GPUs, gloo on the CPU; 256 MiB, 8 MiB on the CPU;
bus bandwidth as nccl-tests reports it, algorithm bandwidth x 2(n-1)/n) within each node, and across all ranks when
the job spans nodes. GPUs are measured all at once, as they train; CPU ranks share the host's cores, so they take turns, and each
CPU figure is one core's, timed by the measuring thread's own CPU time (other work on the host does not lower it).

One table comes out, with every figure below ``--min-share`` of the other ranks' (or nodes') median, below
``--min-card-share`` of the card's datasheet figure, or an all-reduce below ``--min-busbw``, flagged. The exit status
is 0 when nothing is flagged, 1 when something is (a batch script stops there: ``lmtrain doctor || exit 1``), 2 for
bad options. ``--run RUN_DIR`` also counts, per device, the training steps of that run whose result did not repeat
when computed again (the divergence detector's ``hardware_fault`` entries), and flags a device with 3 or more.
``--json FILE`` writes the figures. ``--slow-rank R`` rehearses a slow card: rank R does each measured
operation ten times. The same check runs at the start of training with ``callbacks=[default,doctor]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lmtrain.console import help_text
from lmtrain.errors import InputError
from lmtrain.training.health import examine, table


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None


def _share(text: str) -> float:
    v = _number(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a share between 0 and 1 (0.8: 80%)")
    return v


def _positive(text: str) -> float:
    v = _number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a number > 0")
    return v


def parser(prog: str = "python -m lmtrain.doctor") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-share", type=_share, default=0.8, help="flag a figure below this share of the other ranks' median (0.8)")
    p.add_argument("--min-card-share", type=_share, default=0.5, help="flag a figure below this share of the card's datasheet figure (0.5)")
    p.add_argument(
        "--min-busbw", type=_positive, default=None, metavar="GBPS", help="flag an all-reduce bus bandwidth below this many GB/s"
    )
    p.add_argument("--seconds", type=_positive, default=1.0, help="length of each timed loop (1.0)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures to FILE (rank 0)")
    p.add_argument(
        "--run", type=Path, default=None, metavar="RUN_DIR",
        help="count, per device, the training steps of this run whose result did not repeat (its logbook's hardware faults); flag 3 or more",
    )  # fmt: skip
    p.add_argument("--slow-rank", type=int, default=None, metavar="R", help="rehearsal: rank R does each measured operation ten times")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.doctor") -> int:
    args = parser(prog).parse_args(argv)
    if "WORLD_SIZE" not in os.environ and "SLURM_PROCID" in os.environ:  # started by srun, one task per GPU
        os.environ.update(
            WORLD_SIZE=os.environ.get("SLURM_NTASKS", "1"), RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0")
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        print(
            "error: a job of several ranks needs MASTER_ADDR and MASTER_PORT: torchrun sets them; under srun the batch "
            "script exports them (examples/slurm/train.sbatch)",
            file=sys.stderr,
        )
        return 2
    if args.slow_rank is not None and not 0 <= args.slow_rank < world:
        print(f"error: --slow-rank {args.slow_rank}: the job has ranks 0 to {world - 1}", file=sys.stderr)
        return 2
    if args.run is not None and not (args.run / "logbook.jsonl").is_file():
        print(f"error: --run {args.run}: no run directory there (no logbook.jsonl)", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"error: --json {args.json}: no folder {args.json.parent}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=10), device_id=device if device.type == "cuda" else None)
    try:
        node = next((int(os.environ[v]) for v in ("GROUP_RANK", "SLURM_NODEID") if os.environ.get(v, "").isdigit()), None)
        busbw = args.min_busbw and args.min_busbw * 1e9
        result = examine(device, args.min_share, args.min_card_share, busbw, args.seconds, args.slow_rank, node, args.run)
    except (InputError, RuntimeError) as exc:
        print(f"error: doctor: {exc}", file=sys.stderr)
        return 1
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(table(result), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
    return 1 if result["flags"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
