"""Where the GPU waits: idle gaps between kernels in a torch.profiler chrome trace, and what the host did meanwhile.

    python bench/trace_gaps.py RUN_DIR/profile/trace_rank0.json [--min-gap-us 20] [--top 25]
    python bench/trace_gaps.py RUN_DIR/profile/trace_rank0.json --kernels 40 --steps 3

Prints the device-busy share, the idle time in gaps of at least ``--min-gap-us``, and the host events (operators,
Python functions, CUDA runtime calls such as a synchronize) that overlap those gaps, by overlapped time: what the
device was waiting for. With ``--kernels N``, also the N kernels with the most device time, in ms and calls per step
over the ``--steps`` the trace holds (``callbacks.profiler.steps``): where a busy device spends its step. Made to
read traces written by callbacks/profiler.py.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def kernel_table(device: list[dict], top: int, steps: float, unit: str = "step") -> list[str]:
    """The ``top`` kernels (by name; each event a ``name`` and a ``dur`` in us) with the most device time: ms and calls
    per ``unit`` (``steps`` of them in the events), and their share of it all. bench/fp8_mlp.py reads its profile
    with it too."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in device:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    whole = sum(total.values())
    head = f"device time {whole / steps / 1e3:.2f} ms per {unit} in {len(device) / steps:.0f} kernels; the {top} longest (ms, calls per {unit}):"
    rows = [
        f"  {us / steps / 1e3:8.2f} {count[name] / steps:6.1f}x {us / whole:6.1%}  {name[:140]}"
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]
    ]
    return [head, *rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", type=int, default=0, help="also list this many kernels by device time")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace: the kernel table is per step")
    a = p.parse_args()
    with open(a.trace) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in device)
    if not kernels:
        print("no device kernels in the trace")
        return
    if a.kernels:
        print("\n".join(kernel_table(device, a.kernels, a.steps)))
    gaps, end = [], kernels[0][1]
    busy = kernels[0][1] - kernels[0][0]  # the first kernel, which the loop below starts after
    for start, stop in kernels:
        if start > end:
            if start - end >= a.min_gap_us:
                gaps.append((end, start))
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = kernels[-1][1] - kernels[0][0]
    idle = sum(b - a_ for a_, b in gaps)
    print(f"kernels {len(kernels)}, span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms ({busy / span:.1%}), "
          f"idle in {len(gaps)} gaps >= {a.min_gap_us:g} us: {idle / 1e3:.2f} ms")  # fmt: skip
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation")]
    overlap: dict[str, float] = defaultdict(float)
    for e in host:
        s, t = e["ts"], e["ts"] + e["dur"]
        for g0, g1 in gaps:
            if g1 <= s:
                continue
            if g0 >= t:
                continue
            overlap[f"[{e.get('cat')}] {e.get('name', '')[:90]}"] += min(t, g1) - max(s, g0)
    print(f"host events overlapping the gaps (top {a.top}, overlapped ms):")
    for name, us in sorted(overlap.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {us / 1e3:8.2f}  {name}")
    print("largest gaps (ms, at offset ms):")
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:10]:
        print(f"  {(g1 - g0) / 1e3:.3f} at {(g0 - kernels[0][0]) / 1e3:.2f}")


if __name__ == "__main__":
    main()
