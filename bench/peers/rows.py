"""One row per run of bench/peers/run.sh, every trainer measured the same way (issue 59, docs/BENCHMARKS.md).

    python3 bench/peers/rows.py OUT_DIR        # every run whose log is in OUT_DIR: NAME.log, NAME.launch (its start)

- tokens/s: the tokens of the steps after the warm-up (``WARM``, 10) over their wall time; the trainer's own record
  of each step's time (lmtrain: ``perf/tokens_per_sec`` per step, a harmonic mean; OLMo-core: its console line's
  time at the two ends, both steps where it collects its metrics, so the host has waited for the card there;
  torchtitan: its console lines' times at the two ends, steps where it reads the loss back; litgpt: its csv's loop
  time at the two ends);
- MFU: one formula for all, lmtrain's (``6 N + 12 L d T`` FLOPs per token, N the parameters in matrix products: the
  embedding lookup is not one, an untied head is), over the card's dense bf16 peak;
- peak memory: what the trainer reports as its peak, live tensors and (in brackets) what the allocator held from the
  card (lmtrain: ``perf/max_memory_gib``, ``perf/max_reserved_gib``; OLMo-core: its monitor's active and reserved
  memory; torchtitan: its console's reserved memory; litgpt: the live peak it prints at the end);
- time to the first step: from the launch (the harness's clock, before the interpreter starts) to the end of the
  first step (OLMo-core, torchtitan: the first step's console line, in the machine's local time as ``launch_local``;
  litgpt: that line's wall-clock stamp; lmtrain: the attempt's start in its record, plus its start-up and first step
  from its goodput figures);
- loss: the mean of the training losses logged in the last 5 steps (torchtitan logs only the last), at the tokens
  the row says.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from pathlib import Path

PEAKS = {"H200": 989.4e12, "H100": 989.4e12}  # dense bf16, SXM; FP8 rows are quoted against the same (as lmtrain's own)
SHAPES = {  # parameters in matmuls as lmtrain counts them (its norms' few included), layers, width: run.sh's shapes
    "1b": {"vocab": 128256, "d": 2048, "layers": 16, "matmul": 1_235_814_400},  # Llama 3.2 1B's body and an untied head
    "125m": {"vocab": 50304, "d": 768, "layers": 12, "matmul": 12 * (4 * 768 * 768 + 3 * 768 * 2048) + 768 * 50304 + 25 * 768},
}


def flops_per_token(shape: str, seq: int) -> float:
    s = SHAPES[shape]
    return 6.0 * s["matmul"] + 12.0 * s["layers"] * s["d"] * seq


def _olmo(log: str, warm: int, launch_local: str) -> dict:
    """OLMo-core's console: ``<date time>\\t...\\t[step=K/N,...]`` then indented ``name=value`` lines."""
    times, loss, mem, step = {}, {}, {}, None
    for line in log.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\s.*\[step=(\d+)/(\d+)", line)
        if m:
            step = int(m.group(2))
            times.setdefault(step, dt.datetime.fromisoformat(m.group(1)))  # the machine's local time, as launch_local
            continue
        m = re.match(r"\s+([\w/ ()%]+?)=([\d.,E+-]+)\s*$", line)
        if m and step is not None:
            name, value = m.group(1).strip(), float(m.group(2).replace(",", ""))
            if name == "train/CE loss":
                loss[step] = value
            elif name.startswith("gpu_memory/GPU") and name.endswith("(GiB)"):
                mem[name.split("GPU ")[1].split(" mem")[0]] = max(value, mem.get(name, 0.0))
    if not times:
        return {"timed": (None, None)}
    last = max(times)
    ends = [s for s in (warm, last) if s % 5 == 0] or [warm, last]  # its metrics are collected every 5 steps
    a, b = (warm, last) if len(ends) < 2 else ends
    first = (times[min(times)] - dt.datetime.fromisoformat(launch_local)).total_seconds()
    return {"first_s": first, "timed": (a, b), "seconds": (times[b] - times[a]).total_seconds(), "losses": loss,
            "peak": f"{mem.get('active', float('nan')):.1f} (reserved {mem.get('reserved', float('nan')):.1f})"}  # fmt: skip


def _titan(log: str, warm: int, launch_local: str) -> dict:
    """torchtitan's console: ``[titan] <date time,ms> - root - INFO - step: K  loss: ...  memory: R GiB(..%)  tps: ...``
    at step 1 and every ``metrics.log_freq`` (10) steps; R is the card memory reserved since its previous line."""
    times, loss, reserved = {}, {}, 0.0
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():
        m = re.match(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+) .* - step:\s*(\d+)\s+loss:\s*([\d.]+).*memory:\s*([\d.]+)GiB", line)
        if m:
            step = int(m.group(3))
            times[step] = dt.datetime.fromisoformat(f"{m.group(1)}.{m.group(2)}")
            loss[step], reserved = float(m.group(4)), max(reserved, float(m.group(5)))
    if not times:
        return {"timed": (None, None)}
    last = max(times)
    a = warm if warm in times else min(s for s in times if s >= warm)
    first = (times[min(times)] - dt.datetime.fromisoformat(launch_local)).total_seconds()
    return {"first_s": first, "timed": (a, last), "seconds": (times[last] - times[a]).total_seconds(), "losses": loss,
            "peak": f"- (reserved {reserved:.1f})"}  # fmt: skip


def _litgpt(log: str, run_dir: Path, warm: int, launch: float) -> dict:
    """litgpt's csv (``logs/csv/version_0/metrics.csv``: per step ``iter``, ``loss`` and ``time``, the seconds since its
    loop began, read after it waits for the loss every step) and its console, each line stamped with the wall clock
    by run.sh (the first step's line; the ``Memory Used`` it prints at the end, max_memory_allocated in GB)."""
    import csv

    (path,) = run_dir.glob("logs/csv/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("loss")]
    times = {int(r["iter"]): float(r["time"]) for r in rows}
    if not times:
        return {"timed": (None, None)}
    last = max(times)
    first = next((float(x.split()[0]) for x in log.splitlines() if re.search(r" \| iter 1 step ", x)), float("nan"))
    used = re.search(r"Memory Used\s*:\s*([\d.]+) GB", log)
    return {"first_s": first - launch, "timed": (warm, last), "seconds": times[last] - times[warm],
            "losses": {int(r["iter"]): float(r["loss"]) for r in rows},
            "peak": f"{float(used.group(1)) * 1e9 / 2**30:.1f}" if used else "-"}  # fmt: skip


def _lmtrain(run_dir: Path, warm: int, tokens_per_step: int, launch: float) -> dict:
    """lmtrain's run directory: metrics.jsonl (per-step ``perf/tokens_per_sec``, ``train/loss``; its first line the
    attempt's start, wall clock) and the goodput figures (start-up, the first step) logged at the end."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in rows if "time" in r)
    per: dict[int, dict] = {}
    for r in rows:
        if "m" in r:
            per.setdefault(r["step"], {}).update(r["m"])
    tps = {s: m["perf/tokens_per_sec"] for s, m in per.items() if "perf/tokens_per_sec" in m}
    last = max(tps)
    good = next(m for s, m in sorted(per.items(), reverse=True) if "goodput/startup_s" in m)
    peak = max((m["perf/max_memory_gib"] for m in per.values() if "perf/max_memory_gib" in m), default=float("nan"))
    held = max((m["perf/max_reserved_gib"] for m in per.values() if "perf/max_reserved_gib" in m), default=None)
    return {"first_s": start + good["goodput/startup_s"] + good["goodput/first_steps_s"] - launch, "timed": (warm, last),
            "seconds": sum(tokens_per_step / tps[s] for s in range(warm + 1, last + 1)),
            "losses": {s: m["train/loss"] for s, m in per.items() if "train/loss" in m},
            "peak": f"{peak:.1f}" + (f" (reserved {held:.1f})" if held is not None else "")}  # fmt: skip


def row(out: Path, name: str) -> str:
    meta = json.loads((out / f"{name}.launch").read_text())  # run.sh: trainer, shape, seq, batch, warm, launch, card
    log = (out / f"{name}.log").read_text(errors="replace")
    tokens_per_step = meta["batch"] * meta["seq"]
    if meta["trainer"] == "olmo-core":
        got = _olmo(log, meta["warm"], meta["launch_local"])
    elif meta["trainer"] == "torchtitan":
        got = _titan(log, meta["warm"], meta["launch_local"])
    elif meta["trainer"] == "litgpt":
        got = _litgpt(log, Path(meta["run_dir"]), meta["warm"], meta["launch"])
    else:
        got = _lmtrain(Path(meta["run_dir"]), meta["warm"], tokens_per_step, meta["launch"])
    a, b = got["timed"]
    if a is None:
        raise ValueError("no training step in its record")
    tokens_per_s = tokens_per_step * (b - a) / got["seconds"]
    peak = next((v for k, v in PEAKS.items() if k in meta["card"]), None)
    mfu = f"{100 * tokens_per_s * flops_per_token(meta['shape'], meta['seq']) / peak:.1f}%" if peak else "-"
    last = max(got["losses"], default=0)
    tail = [got["losses"][s] for s in sorted(got["losses"]) if s > last - 5]  # those logged in the last 5 steps
    loss = f"{sum(tail) / len(tail):.3f} at {tokens_per_step * max(got['losses']):,} tokens" if tail else "-"
    return (f"| {meta['card']} | {meta['trainer']} {meta.get('version', '')} | {meta['shape']}{' fp8' if meta.get('fp8') else ''} | "
            f"{meta['batch']} x {meta['seq']} | {a + 1}-{b} | {tokens_per_s:,.0f} | {mfu} | {got['peak']} | {got['first_s']:.0f} s | {loss} |")  # fmt: skip


HEADER = ("| card | trainer | model | batch x seq | steps timed | tokens/s | MFU | peak GiB | to the first step | loss (last 5 steps) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def main() -> int:
    out = Path(sys.argv[1])
    print(HEADER)
    for launch in sorted(out.glob("*.launch")):
        try:
            print(row(out, launch.stem))
        except Exception as exc:  # a run that failed: its row says so, the others are still printed
            print(f"| {launch.stem} | FAILED: {type(exc).__name__}: {exc} (see {launch.stem}.log) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
