"""A run's global sample order, stored: ``RUN/data_order/epoch-EEEEE-FINGERPRINT.npy``, one file an epoch.

The order of an epoch (lmtrain.data.datamodule.BlockSampler.epoch_order: every sample of the epoch as an index into
the run's sources end to end, all ranks' together) is a pure function of the data stream, recomputed wherever it is
needed; it is also written once into the run directory when a run first reads the epoch, so that what the run trained
on can be checked without the code that drew it (as OLMo-core keeps its global indices). The fingerprint in the name
is :func:`fingerprint` of the indices, the one every checkpoint carries with its data position; a file whose content no
longer has it is damaged, and :func:`load` refuses it, naming it. Indices are stored as little-endian uint32 where
they fit (int64 otherwise): 4 bytes a sample.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from lmtrain.errors import InputError

DIR = "data_order"


class OrderDamaged(InputError):
    """A stored order file whose content is not what its name records."""


def fingerprint(order: np.ndarray) -> str:
    """blake2b (16 bytes, hex) of the indices as little-endian int64: the order's fingerprint."""
    return hashlib.blake2b(np.ascontiguousarray(order, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def path_of(run_dir: str | Path, epoch: int) -> Path | None:
    """The stored order file of ``epoch``, or None when there is none."""
    found = sorted((Path(run_dir) / DIR).glob(f"epoch-{epoch:05d}-*.npy"))
    return found[0] if found else None


def store(run_dir: str | Path, epoch: int, order: np.ndarray, digest: str) -> Path:
    """Write ``epoch``'s ``order`` (whose fingerprint is ``digest``) unless it is there: written beside its name, synced
    and renamed, so a kill leaves either the whole file or none. A file of another order for the epoch (a run begun
    again from its first step on other data) is replaced: the file says what the run's current timeline read. Returns
    its path."""
    there = path_of(run_dir, epoch)
    if there is not None and there.stem.endswith(digest):
        return there
    folder = Path(run_dir) / DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"epoch-{epoch:05d}-{digest}.npy"
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    dtype = "<u4" if order.size == 0 or int(order.max()) < 2**32 else "<i8"
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(order, dtype=dtype), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if there is not None:
        there.unlink(missing_ok=True)
    return path


def load(run_dir: str | Path, epoch: int) -> tuple[np.ndarray, Path] | None:
    """``epoch``'s stored order and its file, checked against the fingerprint its name records; None when the run
    stored none (a run from before 2026-12-07). A damaged file is an InputError naming it."""
    path = path_of(run_dir, epoch)
    if path is None:
        return None
    named = path.stem.rsplit("-", 1)[-1]
    try:
        order = np.load(path, allow_pickle=False).astype(np.int64)
    except (OSError, ValueError) as exc:
        raise OrderDamaged(f"{path}: the stored sample order of epoch {epoch} cannot be read ({exc}): the file is damaged") from exc
    found = fingerprint(order)
    if found != named:
        raise OrderDamaged(
            f"{path}: the stored sample order of epoch {epoch} has fingerprint {found}, not the {named} its name records: "
            "the file was damaged or edited"
        )
    return order, path
