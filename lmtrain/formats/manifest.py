"""Reading a prepared dataset's ``manifest.json`` (written by ``data.prepare``): the format the trainer, the tools
and the data pipeline share, kept here so that lmtrain reads it without importing the data package built on it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lmtrain.errors import InputError


class PrepareError(InputError):
    """A dataset that cannot be prepared or read, with the reason."""


CHECKSUM_KEY = "manifest_blake2b"  # the manifest's own checksum: 128-bit BLAKE2b of its other keys (manifest_checksum)


def manifest_checksum(manifest: dict) -> str:
    """BLAKE2b (128 bits) of the manifest's keys but its own checksum, as canonical JSON (sorted keys, no spaces):
    what ``data.prepare`` writes under :data:`CHECKSUM_KEY` and every reader checks."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def token_dtype(vocab_size: int) -> str:
    """The shards' token type for a vocabulary: what ``data.prepare`` writes (uint16 up to 65,536 tokens)."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def read_manifest(directory: str | Path) -> dict:
    """The manifest of the dataset at ``directory``, its keys there and every shard path inside the directory. A
    manifest changed after it was prepared (its checksum, :data:`CHECKSUM_KEY`) is refused; one without a checksum
    (prepared before there was one) has its fields checked against each other: the token type the vocabulary needs,
    a separator inside the vocabulary."""
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
    again = "prepare the dataset again (python -m lmtrain.data.prepare --force ...) or restore the file"
    if CHECKSUM_KEY in manifest and manifest[CHECKSUM_KEY] != manifest_checksum(manifest):
        raise PrepareError(
            f"dataset manifest {path} was changed after the dataset was prepared (its {CHECKSUM_KEY} does not match its "
            f"content): an edited eos_id, dtype or shard list would read the tokens wrongly; {again}"
        )
    vocab, eos, dtype = manifest["vocab_size"], manifest["eos_id"], manifest["dtype"]
    if not (isinstance(vocab, int) and vocab > 0 and isinstance(eos, int) and 0 <= eos < vocab):
        raise PrepareError(f"corrupt dataset manifest {path}: eos_id {eos!r} is not a token of the vocabulary of {vocab!r}; {again}")
    if dtype != token_dtype(vocab):
        raise PrepareError(
            f"corrupt dataset manifest {path}: dtype {dtype!r}, but a vocabulary of {vocab:,} tokens is stored as "
            f"{token_dtype(vocab)}; {again}"
        )
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
