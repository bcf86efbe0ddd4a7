"""The host copy of an asynchronous save: the state in host memory, in buffers kept from one save to the next (pinned
on a GPU machine: each one registered with CUDA, exactly the tensor's size, kept out of forked children)."""

from __future__ import annotations

import mmap
import time
import weakref

import torch
from torch.distributed.tensor import DTensor

from lmtrain.training import compat


def _pin(t: torch.Tensor) -> None:
    """Page-lock ``t``'s memory for CUDA (``cudaHostRegister``), so copies from the GPU into it run asynchronously."""
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 1))  # 1: cudaHostRegisterPortable
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {t.nbytes / 1e9:.2f} GB of host memory failed (cudaError {rc})")


def _unpin(pointers: list[int]) -> None:
    while pointers:
        torch.cuda.cudart().cudaHostUnregister(pointers.pop())


def host_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` (> 0) of anonymous private memory in pages of its own, as uint8, never in a process forked later (a data
    loader's worker): registered with CUDA, Linux copies such pages into the child at fork, or, where it does not,
    the parent's next write moves its page copy-on-write away from the one the GPU copies into (``MADV_DONTFORK``,
    as RDMA libraries do it)."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_DONTFORK)
    return torch.frombuffer(pages, dtype=torch.uint8)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a shard), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _memory(t: torch.Tensor) -> tuple:
    """What identifies the memory ``t`` shows: two tensors with equal keys are one (a tied weight). A wrapper
    subclass holds no storage of its own (its ``data_ptr()`` is 0 for every instance): it is keyed by the tensors it
    wraps. Keyed by 0, torchao's float8-gathered weights (fsdp/hsdp with ``module.fp8.recipe=tensorwise``) of one shape were
    all saved with the first one's values (an asynchronous fp8 save under fsdp that did not resume exactly). The
    strategy now hands those weights over as the plain tensors they wrap (lmtrain.training.fp8.plain_state), so the
    trainer's states hold no wrapper today; this keeps the copy right for any state that does
    (tests/test_checkpoint.py)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return (type(t), *(_memory(getattr(t, n)) for n in names))
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class HostCopy:
    """Copies of a checkpoint's tensors in host memory, into buffers kept from one save to the next.

    Training changes the originals in place, so an asynchronous save writes from copies. Pinning memory is slow
    (seconds for tens of GB), so the buffers are allocated once and reused while the checkpoint's tensors keep
    their shapes and dtypes (they do, step after step).

    Each buffer is anonymous memory of exactly its tensor's size in pages of its own (``mmap``), registered with
    CUDA (``cudaHostRegister``) where its original is on the GPU. PyTorch's pinned allocator (``pin_memory=True``)
    rounds every block up to a power of two: for a 7B model's shards on one of two ranks it held 56.37 GB for
    40.43 GB of shards and took 32-37 s; this holds 40.43 GB and pinned them in 13.7-25.3 s (bench/pinned_host.py on
    three H200 hosts, where a plain ``cudaHostRegister`` of ``torch.empty`` took 11.3-13.7 s; why two hosts took about
    twice that and the third did not was not found, docs/BENCHMARKS.md). Pages of its own: two registrations may not share a page, which two small heap
    blocks of ``torch.empty`` can, and a process forked later does not inherit them (``MADV_DONTFORK``). Buffers are
    unregistered when dropped, and when this object is.

    A shard of a sharded state (a ``DTensor``) is copied into a ``DTensor`` of the same layout whose local tensor is
    in host memory. ``DTensor.from_local`` cannot build one: it moves a host tensor to the mesh's device, which made
    every asynchronous sharded save hold a second copy of the state on the GPU while the background thread wrote it
    (found by tests/test_fsdp.py's two-GPU test, whose asynchronous case failed with it: docs/BENCHMARKS.md).
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.pinned: list[int] = []  # addresses registered with CUDA, of buffers still held
        weakref.finalize(self, _unpin, self.pinned).atexit = False  # never after CUDA is torn down at exit
        self.last_pinned_bytes, self.last_pin_s = 0, 0.0  # newly pinned by the last call (0: every buffer reused)

    def __call__(self, obj):
        self._i, self._copies, self._to_pin = 0, [], []
        self._seen: dict = {}  # one copy per original (tied weights stay tied, as torch.save would keep them)
        out = self._copy(obj)
        self._drop(self.buffers[self._i :])
        del self.buffers[self._i :]
        t0 = time.perf_counter()
        for t in self._to_pin:  # one at a time: from 8 threads it took no less (bench/pinned_host.py)
            _pin(t)
            self.pinned.append(t.data_ptr())  # only once registered: release() unregisters exactly these
        self.last_pinned_bytes, self.last_pin_s = sum(t.nbytes for t in self._to_pin), time.perf_counter() - t0
        for target, source in self._copies:
            target.copy_(source, non_blocking=source.device.type == "cuda")
        if any(source.device.type == "cuda" for _, source in self._copies):
            torch.cuda.synchronize()
        self._copies, self._to_pin = [], []
        return out

    def release(self) -> None:
        """Give the buffers back (after a copy that failed part of the way: what it did allocate is freed)."""
        self._drop(self.buffers)
        self.buffers.clear()
        self._seen, self._copies, self._to_pin = {}, [], []

    def _drop(self, buffers: list[torch.Tensor]) -> None:
        gone = {_local(b).data_ptr() for b in buffers}
        _unpin([p for p in self.pinned if p in gone])
        self.pinned[:] = [p for p in self.pinned if p not in gone]

    def _buffer(self, t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Buffer ``i`` for ``t`` (``local``: its local part): kept from the last save when it matches (for a DTensor,
        its layout too), else new."""
        i, self._i = self._i, self._i + 1
        old = self.buffers[i] if i < len(self.buffers) else None
        if old is not None and type(old) is type(t) and old.shape == t.shape and old.dtype == t.dtype:
            if not isinstance(t, DTensor) or (old.placements == t.placements and old.device_mesh == t.device_mesh):
                return old
        nbytes = local.numel() * local.element_size()
        if nbytes:  # exact size, pages of its own
            buf = host_pages(nbytes).view(local.dtype).view(local.shape)
            if local.device.type == "cuda":
                self._to_pin.append(buf)
        else:
            buf = torch.empty(local.shape, dtype=local.dtype)
        if isinstance(t, DTensor):  # the same layout around the host tensor
            buf = compat.dtensor_around(buf, t)
        if old is not None:
            self._drop([old])
            self.buffers[i] = buf
        else:
            self.buffers.append(buf)
        return buf

    def _copy(self, obj):
        if isinstance(obj, torch.Tensor):  # a DTensor (a shard of a sharded state) is copied as its local part
            t = obj.detach()
            local = _local(t)
            key = (_memory(local), isinstance(t, DTensor))
            if key not in self._seen:
                buf = self._buffer(t, local)
                self._copies.append((_local(buf), local))
                self._seen[key] = buf
            return self._seen[key]
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._copy(v) for v in obj)
        return obj
