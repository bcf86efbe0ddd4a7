"""Reading documents from corpus files, and the embedded quickstart corpus.

A document source is a path (file or directory) or the name of an embedded corpus:

* ``.txt`` -- one document per file;
* ``.jsonl`` -- one document per line, its text under ``text_key``;
* either of them gzip-compressed (``.txt.gz``, ``.jsonl.gz``);
* a directory -- every such file under it, in sorted order;
* ``python-stdlib`` -- the Python standard library's own top-level modules, one document per file: real,
  multi-document text that every Python installation carries, so the quickstart needs no download.
"""

from __future__ import annotations

import gzip
import io
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmtrain.errors import InputError

EMBEDDED = ("python-stdlib",)
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")


class CorpusError(InputError):
    """Bad corpus input, naming the file (and line) at fault."""


@dataclass(frozen=True)
class Document:
    source: str  # file the document came from
    line: int  # 1-based line for jsonl, 0 for whole-file documents
    text: str


def python_stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < 20:
        raise CorpusError(f"the embedded corpus 'python-stdlib' needs the standard library sources, found {len(files)} .py files in {root}")
    return files


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    """Resolve input specs to the ordered list of files to read."""
    files: list[Path] = []
    for spec in inputs:
        if str(spec) == "python-stdlib":
            files.extend(python_stdlib_files())
            continue
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p))
            if not found:
                raise CorpusError(f"input directory {path} holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if _suffix(path) is None:
                raise CorpusError(f"input {path}: unsupported file type (use {', '.join(SUFFIXES)})")
            files.append(path)
        else:
            raise CorpusError(f"input not found: {path}")
    return files


def _open_text(path: Path) -> io.TextIOBase:
    raw = gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")
    # strict UTF-8 so that a non-UTF-8 file fails loudly instead of being silently altered
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="")


def read_documents(path: Path, text_key: str = "text") -> Iterator[Document]:
    """Stream the documents of one file (never the whole file for jsonl)."""
    suffix = _suffix(path)
    try:
        with _open_text(path) as fh:
            if suffix is None or suffix.startswith(".txt"):  # whole-file documents (embedded .py too)
                yield Document(str(path), 0, fh.read())
                return
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                yield Document(str(path), lineno, _record_text(line, f"{path}:{lineno}", text_key))
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        if isinstance(exc, CorpusError):
            raise
        raise CorpusError(f"{path}: cannot read ({exc})") from None


def iter_documents(files: list[Path], text_key: str = "text") -> Iterator[Document]:
    for path in files:
        yield from read_documents(path, text_key)


def splittable(path: Path) -> bool:
    """Whether a file's documents can be read from any byte range (:func:`read_range`): plain ``.jsonl``, one
    document per line. A ``.txt`` is one document and a ``.gz`` cannot be entered in the middle: they are read whole."""
    return _suffix(path) == ".jsonl"


def read_range(path: Path, start: int, end: int, text_key: str = "text") -> Iterator[Document]:
    """The documents of the lines of a plain ``.jsonl`` file that begin at a byte in ``[start, end)``: ranges that
    tile a file read each of its lines once, wherever they cut it. ``Document.line`` counts lines from the range's
    first (the file's when ``start`` is 0); errors name the line's byte offset where the range starts later."""
    try:
        with open(path, "rb") as fh:
            if start > 0:
                fh.seek(start - 1)
                fh.readline()  # the rest of the line holding byte start - 1: it belongs to the range before
            lineno, at = 0, fh.tell()
            while at < end:
                raw = fh.readline()
                if not raw:
                    return
                lineno += 1
                where = f"{path}:{lineno}" if start == 0 else f"{path} (the line at byte {at})"
                at += len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{where}: not valid UTF-8 ({exc.reason} at byte {at - len(raw) + exc.start})") from None
                if not line.strip():
                    continue
                yield Document(str(path), lineno, _record_text(line, where, text_key))
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc})") from None


def _record_text(line: str, where: str, text_key: str) -> str:
    """The text of one jsonl record, or the error naming ``where`` it is bad."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: malformed JSON ({exc.msg})") from None
    if not isinstance(record, dict) or text_key not in record:
        raise CorpusError(f"{where}: no '{text_key}' field (set --text-key to the field holding the text)")
    text = record[text_key]
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field '{text_key}' is {type(text).__name__}, not a string")
    return text
