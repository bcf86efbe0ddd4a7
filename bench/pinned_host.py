"""Pinned host buffers for an asynchronous save: PyTorch's caching host allocator against exact-size registered memory.

    python bench/pinned_host.py [--model llama-7b] [--shards 2] [--threads 8]     # one GPU

An asynchronous save copies each rank's shards (a parameter and AdamW's two moments, fp32) into pinned host buffers
(``lmtrain.callbacks.checkpoint.HostCopy``). This builds the preset on the meta device, takes each parameter's shard on rank 0
of ``--shards`` (FSDP2 shards dim 0), and allocates one host buffer per shard, each way in a fresh process:

- ``allocator``: ``torch.empty(..., pin_memory=True)``, PyTorch's caching host allocator (``cudaHostAlloc``), which
  rounds every block up to a power of two;
- ``register``: ``torch.empty`` (pageable, exact size), then ``cudaHostRegister``;
- ``touch-register``: the same with the pages first written by ``--threads`` threads, then registered;
- ``register-portable``, ``mmap-register``, ``mmap-register-portable``, ``mmap-touch-register``: the same with
  ``cudaHostRegisterPortable`` and/or HostCopy's memory (``host_pages``: a private anonymous ``mmap`` per buffer), to tell apart what
  makes HostCopy's pinning slower than ``register``; the rows report writing the pages and registering apart;
- ``register-threads``: exact-size memory registered from ``--threads`` threads, a buffer each at a time;
- ``hostcopy``: ``lmtrain.callbacks.checkpoint.HostCopy`` itself, copying GPU tensors of the shards' sizes (allocation and copy).

For each it prints the seconds to allocate, the bytes asked for and the bytes held (for the caching allocator, the
sum of the power-of-two blocks it rounds each request up to), and the device-to-host copy rate into the buffers. ``--interference`` also times a loop of GPU matrix products alone and while a background
thread registers buffers, to see whether pinning off the training thread slows training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lmtrain.callbacks.checkpoint import HostCopy, host_pages  # noqa: E402
from lmtrain.formats.presets import preset  # noqa: E402
from lmtrain.nn.model import Decoder  # noqa: E402


def shard_sizes(model: str, shards: int) -> list[int]:
    """Bytes of each fp32 shard on rank 0: parameter, exp_avg, exp_avg_sq per parameter (dim 0 split, ceil)."""
    with torch.device("meta"):
        m = Decoder(preset(model))
    sizes = []
    for p in m.parameters():
        rows = -(-p.shape[0] // shards)
        n = rows * (p.numel() // p.shape[0]) * 4
        sizes += [n, n, n]
    return sizes


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def register(t: torch.Tensor, flags: int = 0) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")


def touch(t: torch.Tensor, threads: int) -> None:
    flat = t.view(-1)
    step = -(-flat.numel() // threads)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda i: flat[i : i + step].zero_(), range(0, flat.numel(), step)))


# method -> (memory, cudaHostRegister flags, pages written first): the variants of plain registration, to tell apart
# what makes HostCopy's pinning slower than torch.empty + cudaHostRegister (call 4-5 of docs/BENCHMARKS.md's session 30)
REGISTER = {
    "register": ("torch", 0, False),
    "register-portable": ("torch", 1, False),
    "mmap-register": ("mmap", 0, False),
    "mmap-register-portable": ("mmap", 1, False),
    "touch-register": ("torch", 0, True),
    "mmap-touch-register": ("mmap", 1, True),
    "mmap-touch": ("mmap", None, True),  # pages written, never registered: what a thread could do before the first save
}


def allocate(method: str, sizes: list[int], threads: int, phases: dict | None = None) -> list[torch.Tensor]:
    """The buffers, the given way; ``phases`` gets the seconds spent writing pages first and registering."""
    phases = {} if phases is None else phases
    if method == "allocator":
        return [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    if method == "register-threads":
        bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(register, bufs))
        return bufs
    memory, flags, first = REGISTER[method]
    bufs = [host_pages(n) if memory == "mmap" else torch.empty(n, dtype=torch.uint8) for n in sizes]
    t0 = time.perf_counter()
    if first:
        for t in bufs:
            touch(t, threads)
    t1 = time.perf_counter()
    for t in bufs if flags is not None else ():
        register(t, flags)
    phases.update(touch_s=round(t1 - t0, 2), register_s=round(time.perf_counter() - t1, 2))
    return bufs


def one(method: str, sizes: list[int], threads: int) -> dict:
    torch.cuda.init()
    src = torch.empty(max(sizes) + len(sizes), dtype=torch.uint8, device="cuda")
    if method == "hostcopy":  # allocation and copy together, as a first asynchronous save does
        state = [src[i : i + n] for i, n in enumerate(sizes)]  # views of one GPU buffer, each at its own address
        t0 = time.perf_counter()
        copy = HostCopy()  # kept: dropping it unregisters the buffers
        bufs = copy(state)
        s = time.perf_counter() - t0
        asked = sum(sizes)
        return {
            "method": method,
            "buffers": len(bufs),
            "asked_gb": asked / 1e9,
            "alloc_and_copy_s": round(s, 2),
            "pin_s": round(copy.last_pin_s, 2),
            "pinned_gb": copy.last_pinned_bytes / 1e9,
            "all_pinned": all(b.is_pinned() for b in bufs),
        }
    torch.cuda.synchronize()
    phases: dict = {}
    t0 = time.perf_counter()
    bufs = allocate(method, sizes, threads, phases)
    alloc_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in bufs:
        b.copy_(src[: b.numel()], non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    asked = sum(sizes)
    held = sum(map(pow2, sizes)) if method == "allocator" else asked
    return {
        "method": method,
        "buffers": len(sizes),
        "asked_gb": asked / 1e9,
        "held_gb": held / 1e9,
        "alloc_s": round(alloc_s, 2),
        "alloc_gb_per_s": round(asked / 1e9 / alloc_s, 2),
        **phases,
        "copy_gb_per_s": round(asked / 1e9 / copy_s, 2),
        "all_pinned": all(b.is_pinned() for b in bufs),
    }


def interference(sizes: list[int], threads: int, method: str) -> dict:
    """ms per eight 4096^3 bf16 products and a host sync, alone and while a thread allocates the buffers."""
    torch.cuda.init()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def loop(seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):
                b = a @ a
            b.sum().item()  # a host sync each iteration, as a training step's loss logging makes
            n += 1
        return (time.perf_counter() - t0) / n * 1e3

    loop(2.0)
    alone = loop(5.0)
    done = threading.Event()
    box = {}

    def bg():
        t0 = time.perf_counter()
        box["bufs"] = allocate(method, sizes, threads)
        box["s"] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=bg)
    th.start()
    ms = []
    while not done.is_set():
        ms.append(loop(1.0))
    th.join()
    return {
        "method": method,
        "alone_ms": round(alone, 3),
        "during_ms": round(sum(ms) / max(len(ms), 1), 3),
        "worst_1s_ms": round(max(ms, default=0.0), 3),
        "background_alloc_s": round(box["s"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument(
        "--methods",
        nargs="+",
        default=["allocator", "register", "touch-register"],
        choices=["allocator", "register-threads", "hostcopy", *REGISTER],
    )
    p.add_argument(
        "--interference",
        nargs="*",
        default=None,
        choices=["allocator", "register-threads", *REGISTER],
        help="methods to run in a background thread",
    )
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bg", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = shard_sizes(a.model, a.shards)
    if a.one:
        print(json.dumps(one(a.one, sizes, a.threads)), flush=True)
        return
    if a.bg:
        print(json.dumps(interference(sizes, a.threads, a.bg)), flush=True)
        return
    print(
        f"# {a.model}, rank 0 of {a.shards}: {len(sizes)} fp32 shards, {sum(sizes) / 1e9:.2f} GB asked, "
        f"{sum(map(pow2, sizes)) / 1e9:.2f} GB in power-of-two blocks; {torch.cuda.get_device_name()}",
        flush=True,
    )
    base = [sys.executable, __file__, "--model", a.model, "--shards", str(a.shards), "--threads", str(a.threads)]
    for m in a.methods:
        subprocess.run([*base, "--one", m], check=True, env=os.environ)
    for m in a.interference or []:
        subprocess.run([*base, "--bg", m], check=True, env=os.environ)


if __name__ == "__main__":
    main()
