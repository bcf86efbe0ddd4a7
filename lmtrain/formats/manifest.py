"""Reading a prepared dataset's ``manifest.json`` (written by ``data.prepare``): the format the trainer, the tools
and the data pipeline share, kept here so that lmtrain reads it without importing the data package built on it."""

from __future__ import annotations

import json
from pathlib import Path

from lmtrain.errors import InputError


class PrepareError(InputError):
    """A dataset that cannot be prepared or read, with the reason."""


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise PrepareError(f"no prepared dataset at {directory} (manifest.json missing): run `python -m lmtrain.data.prepare`")
    try:
        manifest = json.loads(path.read_text())
        for key in ("dtype", "eos_id", "vocab_size", "tokenizer", "splits"):
            manifest[key]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PrepareError(f"corrupt dataset manifest {path}: {exc}") from None
    return manifest
