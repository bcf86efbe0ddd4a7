"""The measurements behind ``lmtrain doctor`` (lmtrain.doctor) and its check at the start of training
(lmtrain.callbacks.doctor): per rank a matrix-product rate and a memory bandwidth beside the card's datasheet figures
(lmtrain.training.cards), across the ranks the all-reduce bus bandwidth within each node and across the nodes, the
figures out of bounds, and the table printed."""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lmtrain.training.cards import card_memory_bandwidth, detect_peak_flops
from lmtrain.training.stability import FAULTS_TO_STOP

GPU = {"matmul_n": 8192, "copy_bytes": 2**30, "allreduce_bytes": 2**28}
CPU = {"matmul_n": 1024, "copy_bytes": 2**26, "allreduce_bytes": 2**23}
DRILL_TIMES = 10  # --slow-rank: the rank does each measured operation this many times (a card at a tenth of its speed)
REPEATS = 3  # timed loops per figure; the best is kept (a loop disturbed by the host is not the card's rate)


def _timer(device: torch.device, own: bool = False):
    """(start, stop) of an interval on ``device``: CUDA events on a GPU (no host timing of queued work), the host clock
    on the CPU, or with ``own`` the calling thread's CPU time (work done on one core by this thread, which the other
    processes sharing the host's cores do not lengthen). stop() returns seconds."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return start.record, stop
    clock = time.thread_time if own else time.perf_counter
    t0 = []
    return (lambda: t0.append(clock())), (lambda: clock() - t0[-1])


def _best_rate(device: torch.device, op, work: float, seconds: float, drill: bool, repeats: int = REPEATS) -> float:
    """The best of ``repeats`` timed loops of ``op`` (``work`` units each: FLOPs, bytes), each loop about ``seconds``
    long; units per second. On the CPU, one core's rate: one thread, timed by its own CPU time, so that other work on
    the host's cores (another rank, another job) does not make this one look slow."""
    if device.type != "cuda":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _best_rate_timed(device, op, work, seconds, drill, repeats, own=True)
        finally:
            torch.set_num_threads(threads)
    return _best_rate_timed(device, op, work, seconds, drill, repeats)


def _best_rate_timed(device, op, work: float, seconds: float, drill: bool, repeats: int, own: bool = False) -> float:
    for _ in range(2):  # warm-up: kernels chosen, memory touched
        op()
    start, stop = _timer(device, own)
    start()
    op()
    once = max(stop(), 1e-6)
    iters = max(1, round(seconds / once))
    best = 0.0
    for _ in range(repeats):
        start()
        for _ in range(iters):
            for _ in range(DRILL_TIMES if drill else 1):
                op()
        best = max(best, work * iters / max(stop(), 1e-9))
    return best


def matmul_rate(device: torch.device, seconds: float = 1.0, drill: bool = False, repeats: int = REPEATS) -> float:
    """FLOP/s of square matrix products: bf16 of 8192 on a GPU, fp32 of 1024 on the CPU."""
    n = (GPU if device.type == "cuda" else CPU)["matmul_n"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _best_rate(device, lambda: torch.matmul(a, b, out=out), 2.0 * n**3, seconds, drill, repeats)


def memory_bandwidth(device: torch.device, seconds: float = 1.0, drill: bool = False, repeats: int = REPEATS) -> float:
    """Bytes/s of a device-to-device copy, the bytes read and written both counted."""
    size = (GPU if device.type == "cuda" else CPU)["copy_bytes"]
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_rate(device, lambda: dst.copy_(src), 2.0 * size, seconds, drill, repeats)


def allreduce_busbw(device: torch.device, group, seconds: float = 1.0) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce over ``group``: the slowest rank's time (the collective ends when its
    last rank does), algorithm bandwidth x 2(n-1)/n."""
    size = (GPU if device.type == "cuda" else CPU)["allreduce_bytes"]
    n = dist.get_world_size(group)
    x = torch.ones(size // 4, dtype=torch.float32, device=device)
    for _ in range(2):
        dist.all_reduce(x, group=group)
    start, stop = _timer(device)
    dist.barrier(group=group)
    start()
    dist.all_reduce(x, group=group)
    once = torch.tensor([stop()], dtype=torch.float64, device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)  # every rank loops as often
    iters = max(1, round(seconds / max(once.item(), 1e-6)))
    best = 0.0
    for _ in range(REPEATS):
        dist.barrier(group=group)
        start()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        took = torch.tensor([stop()], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        best = max(best, size * iters / max(took.item(), 1e-9) * 2 * (n - 1) / n)
    return best


def every_rank(obj) -> list:
    """``obj`` of every rank, by rank (a collective where the run has several processes; ``[obj]`` in one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def examine(
    device: torch.device,
    min_share: float = 0.8,
    min_card_share: float = 0.5,
    min_busbw: float | None = None,
    seconds: float = 1.0,
    slow_rank: int | None = None,
    node: int | None = None,
    run_dir: str | Path | None = None,
) -> dict:
    """Measure this rank and, with a process group, every rank of it; every rank returns the same result: ``ranks``
    (one dict per rank: host, device, figures, expected figures), ``allreduce`` (``within``: node -> bytes/s,
    ``across``: bytes/s or None), ``flags`` (one line per figure out of bounds). ``node``: this rank's node (the
    launcher's node rank); None: the ranks of one host are one node. ``run_dir``: a run whose logbook's hardware faults
    are counted against each rank's device (``faults``)."""
    grouped = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    host = socket.gethostname()
    me = {"rank": rank, "host": host, "device": str(device), "node": host if node is None else f"node {node} ({host})"}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        me |= {"device": f"{device} ({name})", "card_flops": detect_peak_flops("bf16-mixed"), "card_bytes": card_memory_bandwidth(name)}
    hosts = [r["node"] for r in every_rank(me)]

    drill = slow_rank == rank
    if device.type == "cuda" or world == 1:
        me["matmul_flops"] = matmul_rate(device, seconds, drill)
        me["memory_bytes"] = memory_bandwidth(device, seconds, drill)
    else:  # the ranks share the host's cores: one at a time, one loop per turn, the rounds spread over the whole check
        me["matmul_flops"] = me["memory_bytes"] = 0.0
        for _ in range(REPEATS):
            for turn in range(world):
                if turn == rank:
                    me["matmul_flops"] = max(me["matmul_flops"], matmul_rate(device, seconds, drill, repeats=1))
                    me["memory_bytes"] = max(me["memory_bytes"], memory_bandwidth(device, seconds, drill, repeats=1))
                dist.barrier()
    ranks = every_rank(me)

    within: dict[str, float] = {}
    across = None
    if world > 1:
        nodes = list(dict.fromkeys(hosts))
        groups = [dist.new_group([r for r in range(world) if hosts[r] == h]) for h in nodes]  # every rank makes each
        mine = groups[nodes.index(hosts[rank])]
        if dist.get_world_size(mine) > 1:
            bw = allreduce_busbw(device, mine, seconds)
        else:
            bw = None
        for h, bw_h in zip(hosts, every_rank(bw), strict=True):
            if bw_h is not None:
                within.setdefault(h, bw_h)
        if len(nodes) > 1:
            across = allreduce_busbw(device, None, seconds)
        for g in groups:
            dist.destroy_process_group(g)
    result = {"world": world, "nodes": len(dict.fromkeys(hosts)), "ranks": ranks, "allreduce": {"within": within, "across": across}}
    if run_dir is not None:  # what the run's training recorded of each device
        seen = recorded_faults(run_dir)
        result["run"] = str(run_dir)
        for r in ranks:
            r["faults"] = seen.get((r["host"], r["device"].split(" ")[0]), 0)
    result["flags"] = judge(result, min_share, min_card_share, min_busbw)
    return result


def _others_median(values: list[float], i: int) -> float:
    """The median of every value but the ``i``-th: with two ranks the other's, so that a slow one does not pull down
    the figure it is compared with."""
    return statistics.median(v for j, v in enumerate(values) if j != i)


def recorded_faults(run_dir: str | Path) -> dict[tuple[str, str], int]:
    """The training steps whose result did not repeat when computed again (``hardware_fault`` entries of the run's
    logbook, lmtrain.callbacks.divergence), by (host, device) of the rank that computed them."""
    from lmtrain.formats import logbook

    counts: dict[tuple[str, str], int] = {}
    for entry in logbook.read(run_dir):
        if entry.get("kind") == "hardware_fault":
            for w in entry.get("where") or []:
                if isinstance(w, dict) and isinstance(w.get("host"), str) and isinstance(w.get("device"), str):  # else not ours: passed over
                    counts[(w["host"], w["device"])] = counts.get((w["host"], w["device"]), 0) + 1
    return counts


def judge(result: dict, min_share: float, min_card_share: float, min_busbw: float | None) -> list[str]:
    """One line per figure out of bounds: below ``min_share`` of the other ranks' (nodes') median, below
    ``min_card_share`` of the card's datasheet figure, an all-reduce below ``min_busbw``; a device that computed
    FAULTS_TO_STOP or more training steps whose result did not repeat (``faults``, from a run's logbook)."""
    flags = []
    ranks = result["ranks"]
    for r in ranks:
        if r.get("faults", 0) >= FAULTS_TO_STOP:
            flags.append(
                f"rank {r['rank']} ({r['host']}, {r['device']}): {r['faults']} training steps whose result did not repeat when "
                f"computed again (hardware_fault in {result['run']}/logbook.jsonl): a fault of this card or its host"
            )
    for key, card, what, unit, scale in (
        ("matmul_flops", "card_flops", "matrix products", "TFLOP/s", 1e12),
        ("memory_bytes", "card_bytes", "memory bandwidth", "GB/s", 1e9),
    ):
        values = [r[key] for r in ranks]
        for i, r in enumerate(ranks):
            v = r[key]
            median = _others_median(values, i) if len(ranks) > 1 else None
            if median is not None and v < min_share * median:
                flags.append(
                    f"rank {r['rank']} ({r['host']}, {r['device']}): {what} {v / scale:.4g} {unit}, {v / median:.0%} of the "
                    f"other ranks' median {median / scale:.4g} (below {min_share:.0%})"
                )
            if r.get(card) and v < min_card_share * r[card]:
                flags.append(
                    f"rank {r['rank']} ({r['host']}, {r['device']}): {what} {v / scale:.4g} {unit}, {v / r[card]:.0%} of the "
                    f"card's {r[card] / scale:.4g} (below {min_card_share:.0%})"
                )
    within = result["allreduce"]["within"]
    if len(within) > 1:
        nodes, figures = list(within), list(within.values())
        for i, (h, bw) in enumerate(zip(nodes, figures, strict=True)):
            median = _others_median(figures, i)
            if bw < min_share * median:
                flags.append(
                    f"{h}: all-reduce within the node {bw / 1e9:.4g} GB/s, {bw / median:.0%} of the other nodes' median "
                    f"{median / 1e9:.4g} (below {min_share:.0%})"
                )
    if min_busbw is not None:
        figures = [(f"within {h}", bw) for h, bw in within.items()]
        if result["allreduce"]["across"] is not None:
            figures.append(("across the nodes", result["allreduce"]["across"]))
        flags += [
            f"all-reduce {where}: {bw / 1e9:.4g} GB/s, below --min-busbw {min_busbw / 1e9:.4g}" for where, bw in figures if bw < min_busbw
        ]
    return flags


def table(result: dict) -> str:
    """The result as the table the tool prints."""

    def share(v, card):
        return f"{v / card:.0%}" if card else "-"

    faults = "run" in result
    rows = [("rank", "host", "device", "matmul TFLOP/s", "of card", "memory GB/s", "of card", *(["faults in run"] if faults else []), "")]
    flagged = {int(f.split()[1]) for f in result["flags"] if f.startswith("rank ")}
    for r in result["ranks"]:
        rows.append((
            str(r["rank"]), r["host"], r["device"], f"{r['matmul_flops'] / 1e12:.4g}", share(r["matmul_flops"], r.get("card_flops")),
            f"{r['memory_bytes'] / 1e9:.4g}", share(r["memory_bytes"], r.get("card_bytes")), *([str(r["faults"])] if faults else []),
            "FLAGGED" if r["rank"] in flagged else "ok",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    within, across = result["allreduce"]["within"], result["allreduce"]["across"]
    if within or across is not None:
        parts = [f"within {h} {bw / 1e9:.4g} GB/s" for h, bw in within.items()]
        if across is not None:
            parts.append(f"across the nodes {across / 1e9:.4g} GB/s")
        lines.append(f"all-reduce bus bandwidth ({result['world']} ranks): " + "; ".join(parts))
    elif result["world"] > 1:
        lines.append("all-reduce: every rank on a node of its own (one rank per node): nothing within a node to measure")
    lines += [f"FLAGGED: {f}" for f in result["flags"]]
    verdict = "ok" if not result["flags"] else f"{len(result['flags'])} figure(s) flagged"
    lines.append(f"doctor: {result['world']} rank(s) on {result['nodes']} node(s): {verdict}")
    return "\n".join(lines)
