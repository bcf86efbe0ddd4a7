"""Writing one checkpoint: atomic, verified, optionally asynchronous (the directory format is lmtrain.formats.checkpoint;
when to save and what to keep is the callback, lmtrain.callbacks.checkpoint, which tells the writer's ``events`` what
it needs to hear).

Single-process and DDP runs write one file from rank zero; sharded strategies (FSDP2 through
``ModelParallelStrategy``) write a PyTorch distributed checkpoint, every rank its own part. Asynchronous saves copy the
state to host memory (the only stall: pinned buffers kept from one save to the next, :class:`HostCopy`), then write it
in the background: a single file from rank zero's thread, or every rank's shards through distributed checkpoint from a
thread on each rank, put on that rank's GPU (its collectives on a gloo group of their own, so they never interleave with
training's). Rank zero commits, verifies and reads back when the write is done, as a synchronous save does; the next
save (and the end of training) waits for the previous one first (:meth:`CheckpointWriter.wait`, then
:meth:`CheckpointWriter.settle`), so every rank learns there whether it succeeded.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import torch

from lmtrain.console import log
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.nn.optim import state_bytes_before_first_step
from lmtrain.training import compat
from lmtrain.training.checkpoint.host import HostCopy
from lmtrain.training.loggers import flush as flush_loggers


class SaveEvents:
    """What a :class:`CheckpointWriter` tells the component that asked for the save."""

    def at_stage(self, stage: str, step: int, path: Path) -> None:
        """A stage of the save protocol (lmtrain.training.contracts.SaveGuard.at_save_stage)."""

    def committed(self, trainer, final: Path, meta: dict) -> None:
        """The checkpoint is complete and verified as ``final`` (rank zero; may run in the writer's thread)."""


class CheckpointWriter:
    """Writes the checkpoints of one run under ``root``, one at a time.

    Args:
        root: the checkpoint root.
        async_save: ``auto`` (asynchronous when the host has at least twice the copy's size available, else
            synchronous, said once), ``True`` or ``False``.
        checksums: record each file's CRC-32 in ``meta.json`` (checked before a resume loads it).
        max_consecutive_failures: raise CheckpointError at this many failed saves in a row.
        events: told of each stage and of each committed checkpoint.
    """

    def __init__(self, root: Path, async_save: bool | str, checksums: bool, max_consecutive_failures: int, events: SaveEvents) -> None:
        self.root, self.async_save, self.checksums = Path(root), async_save, checksums
        self.max_consecutive_failures, self.events = max_consecutive_failures, events
        self.failures = 0
        self.last_stall_s = self.last_write_s = self.last_collect_s = 0.0  # the figures of the newest save
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._sharded = False
        self._host_copy = HostCopy()
        self._async: bool | None = None  # decided at the first save (``auto`` needs the checkpoint's size)
        self._group = None  # the gloo group of asynchronous sharded saves
        self._unsettled = False  # an asynchronous sharded save whose outcome the ranks have not yet agreed on
        self._async_ok = False

    @property
    def sharded(self) -> bool:
        return self._sharded

    def setup(self, trainer) -> None:
        """At the start of fit, on every rank (a collective for a sharded run's asynchronous saves)."""
        self._sharded = compat.saves_sharded(trainer.strategy)
        if self._sharded and self.async_save is not False and self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")  # collective: every rank builds it, here

    def figures(self) -> dict[str, float]:
        """Seconds the newest save took: ``write_s`` (to committed), ``stall_s`` (training waited), ``collect_s`` (the
        state gathered)."""
        return {"write_s": self.last_write_s, "stall_s": self.last_stall_s, "collect_s": self.last_collect_s}

    # -- one save ----------------------------------------------------------------------------
    @property
    def last_pin_s(self) -> float:
        """Seconds the newest host copy spent pinning new buffers (0 when it reused the kept ones)."""
        return self._host_copy.last_pin_s

    def prepare(self, trainer, estimate: int) -> None:
        """Every rank, at an attempt's first step: where saves are asynchronous, the host buffers of the copy are
        allocated and pinned now (seconds for tens of GB), beside the first steps' compilation, rather than at the
        first save; the copy itself is the first save's again. Nothing is written."""
        if not self._asynchronous(trainer, estimate):
            return
        checkpoint = compat.dump_checkpoint(trainer)  # collective: every rank
        if self._sharded:
            from lmtrain.training.checkpoint.reshard import sharded_layout

            staged = self._copy_to_host(sharded_layout(checkpoint)[0])
            if not trainer.strategy.reduce_boolean_decision(staged is not None, all=True):  # as at a save: all or none
                self._async = False
                self._host_copy.release()
                if trainer.is_global_zero:
                    log.warning("checkpoints: saves are synchronous on every rank (a rank could not copy its shards)")
        elif trainer.is_global_zero:
            self._copy_to_host(checkpoint)

    def write(self, trainer, meta: dict, estimate: int) -> bool:
        """Save the current state as ``meta["step"]`` (every rank; after :meth:`wait` and :meth:`settle`); False when
        it failed (training goes on; too many failures in a row raise CheckpointError). ``estimate``: the bytes it
        will take (``auto`` decides from it at the first save)."""
        step = meta["step"]
        asynchronous = self._asynchronous(trainer, estimate)
        t0 = time.perf_counter()
        if trainer.is_global_zero:
            flush_loggers(trainer.loggers)  # rows up to this step are on disk whenever this checkpoint is
        partial, final = self.root / ck.partial_name(step), self.root / ck.step_name(step)
        t_collect = time.perf_counter()
        checkpoint = compat.dump_checkpoint(trainer)  # collective: every rank
        self.last_collect_s = time.perf_counter() - t_collect
        if self._sharded:
            if asynchronous:
                return self._save_sharded_async(trainer, checkpoint, partial, final, meta, t0)
            return self._save_sharded(trainer, checkpoint, partial, final, meta, t0)
        if not trainer.is_global_zero:
            return True
        snapshot = self._copy_to_host(checkpoint) if asynchronous else None
        if snapshot is not None:
            self.last_stall_s = time.perf_counter() - t0
            write = _on_device(trainer.strategy.root_device, self._write_single)
            self._thread = threading.Thread(
                target=write, args=(trainer, snapshot, partial, final, meta, t0), name=f"lmtrain-save-{step}", daemon=True
            )
            self._thread.start()
            return True
        ok = self._write_single(trainer, checkpoint, partial, final, meta, t0)
        self.last_stall_s = time.perf_counter() - t0
        if not ok:
            self._raise_if_too_many()
        return ok

    def wait(self, raise_errors: bool = True) -> None:
        """Block until an in-flight asynchronous save is done; count its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thread_error is not None:
            self._thread_error = None
            if raise_errors:
                self._raise_if_too_many()

    def settle(self, trainer) -> None:
        """After :meth:`wait`, at a point every rank reaches together: whether the last asynchronous sharded save was
        committed, as rank zero saw it, counted the same on every rank."""
        if not self._unsettled:
            return
        self._unsettled = False
        ok = trainer.strategy.broadcast(self._async_ok, src=0)
        if not trainer.is_global_zero:
            self.failures = 0 if ok else self.failures + 1
        self._raise_if_too_many()

    # -- the parts ---------------------------------------------------------------------------
    def _write_single(self, trainer, checkpoint: dict, partial: Path, final: Path, meta: dict, t0: float) -> bool:
        try:
            partial.mkdir(parents=True, exist_ok=True)
            self.events.at_stage("save_start", meta["step"], partial)
            path = partial / ck.SINGLE_FILE
            io = trainer.strategy.checkpoint_io
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            if type(io).save_checkpoint is TorchCheckpointIO.save_checkpoint:  # stream straight to the file (Lightning's buffers it)
                with open(path, "wb") as fh:
                    torch.save(checkpoint, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            else:  # a user's CheckpointIO plugin decides how bytes are written
                io.save_checkpoint(checkpoint, path)
            self.events.at_stage("before_commit", meta["step"], partial)
            self._commit(partial, final, meta)
            if threading.current_thread() is threading.main_thread():
                self.last_stall_s = time.perf_counter() - t0  # synchronous: the whole save stalled training
        except BaseException as exc:  # noqa: BLE001 - a failed save must never pass silently
            self._failed(meta["step"], partial, exc)
            if threading.current_thread() is not threading.main_thread():
                self._thread_error = exc
            return False
        self.last_write_s = time.perf_counter() - t0
        self._succeeded(trainer, final, meta)
        return True

    def _open_partial(self, trainer, partial: Path, step: int) -> None:
        """The partial directory of a sharded save, made by rank zero before any rank writes into it."""
        if trainer.is_global_zero:
            partial.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier("lmtrain-ckpt-mkdir")
        self.events.at_stage("save_start", step, partial)

    def _save_sharded(self, trainer, checkpoint: dict, partial: Path, final: Path, meta: dict, t0: float, opened: bool = False) -> bool:
        """Every rank writes its shards now; ``opened``: the partial directory is already made (an asynchronous save
        that fell back to this one)."""
        error = None
        try:
            if not opened:
                self._open_partial(trainer, partial, meta["step"])
            trainer.strategy.save_checkpoint(checkpoint, partial)  # every rank writes its shards
        except OSError as exc:
            error = exc
        ok = trainer.strategy.reduce_boolean_decision(error is None, all=True)
        crcs = None
        if ok:
            try:
                share = self.read_back(trainer, partial)
            except OSError:
                share = None  # rank zero reads this rank's share itself (and meets the error, if it is the file's)
            crcs = self._gather_crcs(trainer, share, group=None)
        if ok and trainer.is_global_zero:
            try:
                self.events.at_stage("before_commit", meta["step"], partial)
                self._commit(partial, final, meta, crcs)
            except OSError as exc:
                error = exc
        ok = trainer.strategy.broadcast(ok and error is None, src=0)
        self.last_stall_s = self.last_write_s = time.perf_counter() - t0
        if not ok:
            if trainer.is_global_zero:
                self._failed(meta["step"], partial, error or OSError("another rank failed to write its shards"))
            else:
                self.failures += 1
            self._raise_if_too_many()
            return False
        if trainer.is_global_zero:
            self._succeeded(trainer, final, meta)
        else:
            self.failures = 0
        return True

    def _asynchronous(self, trainer, estimate: int) -> bool:
        """Whether saves are asynchronous: ``async_save``, with ``auto`` decided at the first save from this host's
        available memory and the size of the copy its ranks would hold (said once, on rank zero). Called by every
        rank at every save (a collective the first time, for a sharded save)."""
        if self._async is None:
            if self.async_save != "auto":
                self._async = bool(self.async_save)
            else:
                local = max(1, trainer.world_size // max(1, trainer.num_nodes)) if self._sharded else 1
                copy = estimate * local // (trainer.world_size if self._sharded else 1)
                available = host_available_bytes()
                fits = available is not None and available >= 2 * copy
                # sharded: every rank saves, so all decide together; single file: only rank zero gets here
                self._async = bool(trainer.strategy.reduce_boolean_decision(fits, all=True)) if self._sharded else fits
                if trainer.is_global_zero:
                    how = "asynchronous" if self._async else "synchronous"
                    log.info(
                        f"checkpoints: {how} (callbacks.checkpoint.async_save=auto; a host copy of {_size(copy)} per node, "
                        f"{_size(available or 0)} available)"
                    )
        return self._async

    def _copy_to_host(self, state):
        """``state`` copied to host memory for an asynchronous save, or None where this host cannot hold the copy (the
        allocation failed: host memory, pinned memory). Then the buffers are given back and this save and every later
        one are synchronous, said once: a run forced to ``async_save=true`` on a host short of memory keeps its
        checkpoints instead of stopping at its first save."""
        try:
            copy = self._host_copy(state)
            if self._host_copy.last_pinned_bytes:
                dist = torch.distributed
                who = f"rank {dist.get_rank()} " if self._sharded and dist.is_initialized() else ""  # each pins its shards
                log.info(
                    f"checkpoints: {who}pinned {self._host_copy.last_pinned_bytes / 1e9:.2f} GB of host memory for "
                    f"asynchronous saves in {self._host_copy.last_pin_s:.1f} s (kept: later saves reuse it)"
                )
            return copy
        except (RuntimeError, MemoryError, OSError) as exc:  # mmap: OSError; cudaHostRegister, torch: RuntimeError
            self._host_copy.release()
            self._async = False
            log.warning(
                f"checkpoints: an asynchronous save needs a copy of the state in host memory, and this host could not "
                f"allocate it ({failure_reason(exc)}); saving synchronously instead (callbacks.checkpoint.async_save)"
            )
            return None

    def _save_sharded_async(self, trainer, checkpoint: dict, partial: Path, final: Path, meta: dict, t0: float) -> bool:
        """Every rank copies its shards to host memory and writes them from a thread of its own (distributed
        checkpoint's ``save`` on the saves' gloo group); rank zero commits when the write is complete. Failures are
        settled across ranks at the next save or the end of training (:meth:`settle`).

        The thread is ours, not distributed checkpoint's ``async_save`` executor, so that it can be put on this rank's
        GPU first: a new thread starts on GPU 0, and the file writer's loader asks for the current CUDA stream, which
        on every other rank opened a CUDA context (about half a GB) on GPU 0. With a 7B model filling GPU 0 that
        failed ("CUDA error: out of memory", rank 1, docs/BENCHMARKS.md); elsewhere it took rank zero's memory unseen.
        The writer is also told to copy nothing ahead (``per_thread_copy_ahead=0``): its tensors are in host memory."""
        import torch.distributed.checkpoint as dcp

        from lmtrain.training.checkpoint.reshard import METADATA_FILE, sharded_layout

        step = meta["step"]
        self._unsettled, self._async_ok = True, False
        error = None
        try:
            self._open_partial(trainer, partial, step)
            tensors, rest = sharded_layout(checkpoint)
            if trainer.is_global_zero:
                torch.save(rest, partial / METADATA_FILE)
        except OSError as exc:
            error = exc
        if not trainer.strategy.reduce_boolean_decision(error is None, all=True):  # all ranks write, or none
            if trainer.is_global_zero:
                self._failed(step, partial, error or OSError("another rank could not start its save"))
            return False
        staged = self._copy_to_host(tensors)  # this rank's shards into pinned buffers kept between saves
        if not trainer.strategy.reduce_boolean_decision(staged is not None, all=True):  # a rank had no memory for it:
            self._unsettled, self._async, staged = False, False, None  # every rank saves synchronously, now and later
            self._host_copy.release()
            if trainer.is_global_zero:
                log.warning(f"checkpoints: step {step} and later saves are synchronous on every rank (a rank could not copy its shards)")
            return self._save_sharded(trainer, checkpoint, partial, final, meta, t0, opened=True)
        self.last_stall_s = time.perf_counter() - t0
        rank_zero = trainer.is_global_zero

        def finish() -> None:
            crcs = None
            try:
                writer = dcp.FileSystemWriter(partial, per_thread_copy_ahead=0)
                dcp.save(staged, storage_writer=writer, process_group=self._group)  # every rank's shards and .metadata
                crcs = self.read_back(trainer, partial)
            except BaseException as exc:  # noqa: BLE001
                if rank_zero:
                    self._failed(step, partial, exc)
            # every rank gets here, failed or not (its share is None then): the gather is on the save's own group
            gathered = self._gather_crcs(trainer, crcs, group=self._group)
            if crcs is None:
                return
            try:
                if rank_zero:
                    self.events.at_stage("before_commit", step, partial)
                    self._commit(partial, final, meta, gathered)
            except BaseException as exc:  # noqa: BLE001
                if rank_zero:
                    self._failed(step, partial, exc)
                return
            self.last_write_s = time.perf_counter() - t0
            self._async_ok = True
            if rank_zero:
                self._succeeded(trainer, final, meta)

        self._thread = threading.Thread(target=_on_device(trainer.strategy.root_device, finish), name=f"lmtrain-save-{step}", daemon=True)
        self._thread.start()
        return True

    def read_back(self, trainer, partial: Path) -> dict[str, str]:
        """This rank's share of a sharded checkpoint's CRC-32s (lmtrain.formats.checkpoint.crc_reader), once every rank
        has written; raises OSError when a file does not read."""
        if not self.checksums:
            return {}
        per_node = max(1, trainer.world_size // max(1, trainer.num_nodes))
        mine = [rel for rel in ck.dir_files(partial) if ck.crc_reader(rel, trainer.world_size, per_node) == trainer.global_rank]
        return {rel: ck.file_crc32(partial / rel) for rel in mine}

    @staticmethod
    def _gather_crcs(trainer, crcs: dict | None, group) -> dict | None:
        """Every rank's share of the CRC-32s, merged on rank zero; a rank that could not read its share sends None and
        rank zero reads those files itself at the commit. A collective of ``group``; None on the other ranks."""
        import torch.distributed as dist

        parts = [None] * trainer.world_size if trainer.is_global_zero else None
        dist.gather_object(crcs, parts, dst=0, group=group)
        return None if parts is None else {rel: crc for part in parts if part for rel, crc in part.items()}

    def _commit(self, partial: Path, final: Path, meta: dict, crcs: dict | None = None) -> None:
        ck.commit(partial, final, meta, checksums=self.checksums, known_crc32=crcs)
        self.events.at_stage("after_commit", meta["step"], final)
        got, why = ck.verify(final)  # read back what the filesystem holds now
        if got is None:
            ck.quarantine(final)
            raise CheckpointError(f"checkpoint {final.name} failed verification after saving ({why}); moved aside")

    def _succeeded(self, trainer, final: Path, meta: dict) -> None:
        self.failures = 0
        self.events.committed(trainer, final, meta)

    def _failed(self, step: int, partial: Path, exc: BaseException) -> None:
        self.failures += 1
        shutil.rmtree(partial, ignore_errors=True)
        logbook.alert(
            self.root.parent,
            "checkpoint_failed",
            f"checkpoint at step {step} FAILED ({failure_reason(exc)}); {self.failures} consecutive failure(s), "
            f"the run stops at {self.max_consecutive_failures}",
        )

    def _raise_if_too_many(self) -> None:
        if self.failures >= self.max_consecutive_failures:
            raise CheckpointError(
                f"{self.failures} consecutive checkpoint saves failed under {self.root}: stopping rather than training on "
                f"with nothing saved. The newest complete checkpoint is {ck.read_latest(self.root) or 'none'}."
            )


def checkpoint_bytes(param_bytes: int, optimizer_bytes: int) -> int:
    """Bytes a checkpoint of parameters and optimizer state of these sizes takes, with a little for the rest (loop
    state, RNG states, metadata)."""
    return int((param_bytes + optimizer_bytes) * 1.02) + (1 << 16)


def state_bytes(trainer) -> int:
    """Bytes a checkpoint of this trainer's state takes (:func:`checkpoint_bytes`): parameters plus optimizer state
    (where the optimizer has not stepped yet, what it will hold: lmtrain.nn.optim.state_bytes_before_first_step)."""
    params = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
    opt_state = 0
    for opt in trainer.optimizers:
        for st in opt.state.values():
            opt_state += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        if not opt.state:
            opt_state += state_bytes_before_first_step(opt)
    return checkpoint_bytes(params, opt_state)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.1f} MB"


def host_available_bytes() -> int | None:
    """Memory this host can still give (``MemAvailable`` of /proc/meminfo), None where that is not known."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _on_device(device: torch.device, fn):
    """``fn`` for a save's thread, run with ``device`` as the thread's CUDA device: a new thread starts on GPU 0, and a
    CUDA call there from any other rank's process opens a context (about half a GB) on GPU 0."""

    def run(*args):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return fn(*args)

    return run


def failure_reason(exc: BaseException) -> str:
    """Why a save failed, on one line. Distributed checkpoint's ``CheckpointException`` carries each failed rank's
    exception with its whole remote traceback in its text: named here by rank and root cause alone. torch.save's zip
    writer answers a failed write (a full disk, a file-size limit) with ``RuntimeError: [enforce fail at
    inline_container.cc:...] . unexpected pos 704 vs 598``, raised while handling the write's OSError: that OSError
    is the reason given. Writing its own file (distributed checkpoint's shards) it keeps no OSError: the short write
    is said in words."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException: rank -> (exception, stack)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {failure_reason(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
            for rank, wrapped in sorted(failures.items())
        )
    os_error = _os_error(exc)
    if os_error is not None:
        return f"{os_error.strerror or os_error} (errno {os_error.errno})"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else "(no message)"
    if "inline_container.cc" in first and "unexpected pos" in first:  # the zip writer's own file (distributed checkpoint): no errno kept
        return f"a file's write stopped short, as on a full disk or past a file-size limit ({type(exc).__name__}: {first})"
    return f"{type(exc).__name__}: {first}"


def _os_error(exc: BaseException | None) -> OSError | None:
    """``exc`` itself when it is an OSError, else the OSError it was raised from or while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
