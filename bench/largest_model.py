"""The largest model preset that trains with a strategy on this machine's GPUs, found by measurement.

    python bench/largest_model.py --nproc 4 --strategy fsdp [--shard-size 2] [--seq 2048] [--batch 1] [--timeout 150]
                                  [--family opt] [--start opt-13b] [HYDRA_OVERRIDES ...]

Starts from the planner's prediction (``lmtrain.plan.memory`` with this GPU's memory; full activation checkpointing
for fsdp/hsdp, none for ddp) and trains three steps of each candidate with ``torchrun --standalone`` and the
trainer's real code path (bf16-mixed, AdamW, meta-device init for fsdp/hsdp): a fit moves up to the next larger
preset, an out-of-memory moves down, until the largest preset that fits and the smallest one that does not are
both measured. Prints one table row per try: the preset, its parameters, fits / out of memory / other failure,
the measured peak (``torch.cuda.max_memory_allocated`` on rank 0) and the planner's figure. docs/BENCHMARKS.md
has the figures measured so far.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmtrain.formats.presets import available_presets, preset  # noqa: E402
from lmtrain.plan import memory, model_numbers  # noqa: E402

GIB = 2**30


def candidates(family: str, seq: int) -> list[tuple[str, int, object]]:
    """(preset, parameters, ModelConfig) of one family, smallest first, those whose positions reach ``seq``."""
    out = []
    for name in available_presets():
        mcfg = preset(name)
        if mcfg.family == family and mcfg.max_seq_len >= seq and mcfg.n_layers > 2:
            out.append((name, model_numbers(mcfg, seq)["params"], mcfg))
    return sorted(out, key=lambda c: c[1])


def predicted_bytes(mcfg, params: int, seq: int, batch: int, strategy: str, nproc: int, shard: int) -> float:
    ac = "none" if strategy == "ddp" else "full"
    return memory(mcfg, params, seq, batch, strategy, nproc, shard if strategy == "hsdp" else nproc, ac)["total"]


def start_index(cands, seq: int, batch: int, strategy: str, nproc: int, shard: int, mem_bytes: float) -> int:
    """The largest candidate the planner says fits (the smallest if none does)."""
    fits = [i for i, (_, n, m) in enumerate(cands) if predicted_bytes(m, n, seq, batch, strategy, nproc, shard) <= mem_bytes]
    return fits[-1] if fits else 0


def search(try_fn, n: int, start: int) -> dict[int, bool]:
    """Measured fits by index: up from a fit, down from a failure, until the boundary is measured on both sides."""
    results: dict[int, bool] = {}
    i = start
    while 0 <= i < n:
        results[i] = try_fn(i)
        if results[i] and i + 1 < n and (i + 1) not in results:
            i += 1
        elif not results[i] and i - 1 >= 0 and (i - 1) not in results:
            i -= 1
        else:
            break
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp"), default="fsdp")
    p.add_argument("--shard-size", type=int, default=None, help="hsdp: ranks per shard group (default: nproc / 2)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--timeout", type=int, default=150, help="seconds per try")
    p.add_argument("--family", default="opt")
    p.add_argument("--start", default=None, help="first preset to try (default: the planner's largest that fits)")
    args, overrides = p.parse_known_args()
    import torch

    mem = torch.cuda.get_device_properties(0).total_memory
    shard = args.shard_size or max(args.nproc // 2, 1)
    cands = candidates(args.family, args.seq)
    names = [c[0] for c in cands]
    if args.start is not None and args.start not in names:
        p.error(f"--start {args.start}: not a {args.family} preset with positions up to {args.seq}; choose from {names}")
    start = names.index(args.start) if args.start else start_index(cands, args.seq, args.batch, args.strategy, args.nproc, shard, mem)
    strat = [f"strategy={args.strategy}", f"trainer.devices={args.nproc}"]
    if args.strategy != "ddp":
        strat += ["strategy.activation_checkpointing=full", "strategy.init_device=meta"]
    if args.strategy == "hsdp":
        strat.append(f"strategy.shard_size={shard}")
    base = ["trainer=gpu", "logger=csv", "callbacks=[throughput]", "model.dropout=0", f"data.seq_len={args.seq}",
            f"data.batch_size={args.batch}", "trainer.max_steps=3", "scheduler.warmup_steps=1", "trainer.limit_val_batches=0",
            "trainer.enable_progress_bar=false"]  # fmt: skip
    rows = []
    runs = Path(tempfile.mkdtemp(prefix="largest-"))
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

    def try_fn(i: int) -> bool:
        from lmtrain.formats.metrics import metric

        name, n, mcfg = cands[i]
        run_name = f"{args.strategy}-{name}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", str(ROOT / "train.py"),
               *base, *strat, f"model={name}", f"paths.runs={runs}", f"run_name={run_name}", *overrides]  # fmt: skip
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
            text, rc = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = f"{exc.stdout or ''}{exc.stderr or ''}", "timeout"
        text = text if isinstance(text, str) else text.decode(errors="replace")
        try:
            peaks = metric(runs / run_name, "perf/max_memory_gib")
        except OSError:
            peaks = []
        ok = rc == 0 and len(peaks) == 3
        oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
        result = "fits" if ok else ("out of memory" if oom else f"failed (rc {rc})")
        planned = predicted_bytes(mcfg, n, args.seq, args.batch, args.strategy, args.nproc, shard) / GIB
        rows.append((name, n, result, f"{max(peaks):.1f}" if peaks else "", f"{planned:.1f}"))
        print(f"[largest_model] {name}: {result}", file=sys.stderr, flush=True)
        if not ok and not oom:
            print(text[-3000:], file=sys.stderr)
        return ok

    results = search(try_fn, len(cands), start)
    best = max((i for i, ok in results.items() if ok), default=None)
    layout = f"{args.strategy} x {args.nproc}" + (f" (shard groups of {shard})" if args.strategy == "hsdp" else "")
    print(f"device: {torch.cuda.get_device_name()} ({mem / GIB:.1f} GiB), {layout}, micro-batch {args.batch} x {args.seq}")
    print("| strategy | model | parameters | result | measured peak GiB | planner GiB |")
    print("|---|---|---|---|---|---|")
    for name, n, result, peak, planned in rows:
        print(f"| {layout} | {name} | {n / 1e9:.2f}B | {result} | {peak} | {planned} |")
    print(f"largest that trains: {cands[best][0] if best is not None else 'none'}")


if __name__ == "__main__":
    main()
