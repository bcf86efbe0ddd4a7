"""Reading a prepared dataset's ``manifest.json`` (written by ``data.prepare``): the format the trainer, the tools
and the data pipeline share, kept here so that lmtrain reads it without importing the data package built on it."""

from __future__ import annotations

import json
from pathlib import Path

from lmtrain.errors import InputError


class PrepareError(InputError):
    """A dataset that cannot be prepared or read, with the reason."""


def read_manifest(directory: str | Path) -> dict:
    """The manifest of the dataset at ``directory``, its keys there and every shard path inside the directory."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        if any(Path(directory).glob("*.bin")):
            raise PrepareError(
                f"dataset {directory} has token shards but no manifest.json (deleted or moved?): restore it, or prepare the "
                "dataset again (python -m lmtrain.data.prepare --force ...)"
            )
        raise PrepareError(f"no prepared dataset at {directory} (manifest.json missing): run `python -m lmtrain.data.prepare`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        for key in ("dtype", "eos_id", "vocab_size", "tokenizer", "splits"):
            manifest[key]
        shards = [(split, s["path"]) for split, info in manifest["splits"].items() for s in info["shards"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise PrepareError(f"corrupt dataset manifest {path}: {type(exc).__name__}: {exc}") from None
    for split, rel in shards:
        if _outside(Path(directory), rel):
            raise PrepareError(
                f"corrupt dataset manifest {path}: split '{split}' names the shard {rel!r}, which is not a file inside the "
                "dataset directory (a manifest names its shards by their paths relative to it)"
            )
    return manifest


def _outside(directory: Path, rel) -> bool:
    """Whether a manifest's shard path ``rel`` is absolute or leads out of ``directory`` (``..``, a symbolic link)."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
        return True
    root = directory.resolve()
    return not (root / rel).resolve().is_relative_to(root)
