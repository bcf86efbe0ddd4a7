"""Pickled files read without running what they name: every checkpoint file lmtrain opens is read through here.

A PyTorch checkpoint is a pickle, and a pickle may call any function it names: loaded with ``weights_only=False``
(or with plain ``pickle.load``, as ``torch.distributed.checkpoint`` reads its ``.metadata``), a crafted
``checkpoint.pt`` runs a shell command. lmtrain's checkpoints hold tensors, numbers, strings, bytes and containers,
which PyTorch's weights-only loader reads (:func:`torch_load`); a distributed checkpoint's ``.metadata`` holds the
few classes of ``torch.distributed.checkpoint`` in :data:`DCP_METADATA_GLOBALS` (:func:`dcp_metadata`,
:class:`SafeReader`). Anything else is refused with one line naming the file and what its pickle asked for, before
any of it runs.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from lmtrain.errors import InputError

# What a distributed checkpoint's .metadata names (torch 2.11-2.13): the planner's dataclasses, dtypes, sizes, the
# layout by name, and the path it was written to.
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and every dtype (below)
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}  # fmt: skip


class RefusedFile(InputError):
    """A file whose pickle names something a checkpoint never holds (crafted, or not ours): refused unread."""


def _refusal(path: Path, what: str) -> RefusedFile:
    return RefusedFile(
        f"{path} is refused: its pickle asks for {what}, which no lmtrain checkpoint holds (a crafted or foreign file); "
        "nothing of it was run"
    )


def torch_load(path: Path, **kwargs):
    """``torch.load`` with PyTorch's weights-only unpickler (tensors, numbers, strings, containers): a file naming any
    other global raises :class:`RefusedFile`; a file that does not read otherwise raises PyTorch's own error."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if named is None:  # damaged bytes ("invalid load key") rather than a refused global
            raise
        raise _refusal(Path(path), named.group(1)) from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, fh, path: Path) -> None:
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self.path, f"{module}.{name}")


def dcp_metadata(path: Path):
    """A distributed checkpoint's ``.metadata`` read with only :data:`DCP_METADATA_GLOBALS` allowed."""
    with open(path, "rb") as fh:
        return _MetadataUnpickler(fh, Path(path)).load()


def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """``torch.distributed.checkpoint``'s file reader whose ``.metadata`` is read by :func:`dcp_metadata`."""

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            metadata = dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def safe_reader(path: Path):
    """A ``FileSystemReader`` for the distributed checkpoint at ``path`` that reads its ``.metadata`` safely; a refused
    one raises :class:`RefusedFile` here (inside a load, torch.distributed.checkpoint would wrap it in its own error)."""
    dcp_metadata(Path(path) / ".metadata")
    return _safe_reader_class()(str(path))
