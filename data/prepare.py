"""Tokenize a corpus into flat token shards with exactly one separator after every document.

    python -m lmtrain.data.prepare --input PATH [PATH ...] --output DIR [--tokenizer SPEC] [--val-fraction F] [--workers N]

Output (``DIR/``): ``manifest.json``, the tokenizer's ranks file when it was trained here, and raw little-endian
token shards ``{split}_{NNNNN}.bin`` (uint16 when the vocabulary fits, else uint32; read them with
``numpy.memmap``). The separator invariant: in each split's stream (shards concatenated in manifest order),
every document is followed by exactly one ``eos_id`` and contains none itself; decoding the tokens between
separators gives back each document's text exactly. Empty documents are skipped and counted. A document goes to
the validation split by a hash of its place in its chunk (``--val-fraction`` of them).

Past one machine the same preparation splits into independent tasks (a SLURM array, torchrun, or processes):

    python -m lmtrain.data.prepare --input PATH ... --output DIR [settings] --plan   # once: DIR.prepare/plan.json
    python -m lmtrain.data.prepare --output DIR --task I --tasks N                     # for every I in 0..N-1
    python -m lmtrain.data.prepare --output DIR --merge                                # once all tasks are done

The corpus is cut into chunks of about ``--chunk-bytes`` of input (whole files, or line-aligned ranges of a large
plain ``.jsonl``), fixed by the inputs alone; task I of N prepares the chunks whose index is I modulo N, each into
its own folder, renamed into place when complete, so a killed task is rerun alone and redoes only its unfinished
chunk. The merge links the chunks' shards into ``DIR`` in chunk order and writes the manifest. A dataset is
byte-identical whatever the number of tasks: one command on one machine runs the same chunks and the same merge.
``--task`` and ``--tasks`` without a value are read from SLURM's array (``SLURM_ARRAY_TASK_ID``) or torchrun
(``RANK``, ``WORLD_SIZE``). The plan trains a ``bpe:`` tokenizer and checks the corpus once, before any task.

The dataset is written under a temporary name and renamed when complete, so a half-written dataset never
looks valid. A re-run over unchanged inputs with the same settings is skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmtrain.console import help_text
from lmtrain.data.corpus import expand_inputs, iter_documents, read_documents, read_range, splittable
from lmtrain.errors import InputError
from lmtrain.formats.manifest import CHECKSUM_KEY, PrepareError, manifest_checksum, read_manifest, token_dtype  # noqa: F401  (read_manifest: re-exported for data.datamodule and users)
from lmtrain.formats.tokenizer import JSON_CONFIG, TokenizerError, encoding_from_ranks, eos_id, load_tokenizer, save_ranks, train_bpe

FORMAT_VERSION = 2  # 2: chunked (shards never span a chunk, the split keyed by chunk); 1 is still read
CHUNK_BYTES = 1 << 30  # input bytes a chunk holds (at least: a file is never cut but a plain .jsonl, at a line)
WORK_SUFFIX = ".prepare"  # DIR.prepare/: the plan and the finished chunks of a preparation in tasks
PLAN_FILE = "plan.json"
KILL_DRILL = "LMTRAIN_DRILL_PREPARE_KILL_IN_CHUNK"  # tests: the task kills itself (SIGKILL) inside this chunk
CHUNK_FILE = "chunk.json"  # a finished chunk's record, written last: a chunk folder with it is complete
SPLITS = ("train", "val")
TOKENIZER_FILE = "tokenizer.tiktoken"
JSON_TOKENIZER_FILE = "tokenizer.json"
LOSSLESS_SAMPLE_BYTES = 1 << 20  # how much of the corpus check_lossless encodes and decodes before the real work


def check_lossless(enc, docs, budget: int = LOSSLESS_SAMPLE_BYTES) -> None:
    """Refuse a tokenizer that does not give back the corpus's text exactly, or that produces the separator from text,
    on the corpus's first documents (about ``budget`` bytes), naming the first document and where it differs. (A
    normalising tokenizer.json, lowercasing or rewriting spaces, is the usual cause.)"""
    sep, seen = eos_id(enc), 0
    for doc in docs:
        if seen >= budget:
            return
        seen += len(doc.text)
        where = f"{doc.source}" + (f" line {doc.line}" if doc.line else "")
        ids = enc.encode_ordinary(doc.text)
        back = enc.decode(ids)
        if back != doc.text:
            at = next((i for i, (a, b) in enumerate(zip(back, doc.text)) if a != b), min(len(back), len(doc.text)))
            raise PrepareError(
                f"the tokenizer does not give back the text of {where}: at character {at}, {doc.text[at : at + 20]!r} came "
                f"back as {back[at : at + 20]!r}. lmtrain keeps every document exactly; use a tokenizer without normalization"
            )
        if sep in ids:
            raise PrepareError(f"the tokenizer encodes text of {where} as the separator id {sep}: documents could not be told apart")


def fingerprint(files: list[Path], settings: dict) -> str:
    """Identity of a dataset: its input files (path, size, mtime) and every setting that changes the tokens."""
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def is_val(index: int, val_fraction: float, seed: int, chunk: int = 0) -> bool:
    """Whether the ``index``-th non-empty document of chunk ``chunk`` goes to the validation split: a hash of the seed,
    the chunk and the index below ``val_fraction``. The chunks are fixed by the inputs, so the split is the same
    whatever the number of tasks; a corpus of one chunk (up to --chunk-bytes) splits as before chunks (format 1), and
    each chunk's split is stable under appending documents to it."""
    if val_fraction <= 0:
        return False
    key = f"{seed}:{index}" if chunk == 0 else f"{seed}:{chunk}:{index}"
    return zlib.crc32(key.encode()) / 2**32 < val_fraction


# -- tokenising in worker processes -------------------------------------------------------------
_ENC = None
_EOS = 0


def _init_worker(tokenizer: str, base_dir: str) -> None:
    global _ENC, _EOS
    _ENC = load_tokenizer(tokenizer, base_dir)
    _EOS = eos_id(_ENC)


def _encode_batch(batch: tuple) -> tuple:
    """One batch of a chunk's documents, ``(chunk, texts, first, val_fraction, seed, end)`` (``first``: the first
    text's index among the chunk's non-empty documents): each document's tokens (its ids and one separator), whether
    it goes to the validation split, and the UTF-8 bytes read; ``end`` (the chunk's count of empty documents on its
    last batch, else None) passes through."""
    chunk, texts, first, val_fraction, seed, end = batch
    out = []
    for ids in _ENC.encode_ordinary_batch(texts, num_threads=1):
        arr = np.empty(len(ids) + 1, dtype=np.uint32)
        arr[:-1] = ids
        arr[-1] = _EOS
        out.append(arr)
    val = [is_val(first + i, val_fraction, seed, chunk) for i in range(len(texts))]
    return chunk, out, val, sum(len(t.encode("utf-8")) for t in texts), end


class _ShardWriter:
    """Appends token arrays to ``{split}_{NNNNN}.bin`` files, rolling over every ``shard_tokens`` tokens."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._fh = None
        self._hash = None

    def _open_new(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._fh = open(self.directory / name, "wb")
        self._hash = hashlib.blake2b(digest_size=16)
        self.shards.append({"path": name, "num_tokens": 0, "num_documents": 0})

    def write(self, tokens: np.ndarray) -> None:
        # documents never straddle shards, so each shard holds whole documents and ends with a separator
        if self._fh is None or (self.shards[-1]["num_tokens"] and self.shards[-1]["num_tokens"] + len(tokens) > self.shard_tokens):
            self._open_new()
        data = tokens.astype(self.dtype, copy=False).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._fh.write(data)
        self._hash.update(data)
        self.shards[-1]["num_tokens"] += len(tokens)
        self.shards[-1]["num_documents"] += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            self.shards[-1][CHECKSUM] = self._hash.hexdigest()


# -- checking a prepared dataset ------------------------------------------------------------------
CHECKSUM = "blake2b"  # per shard in the manifest: 128-bit BLAKE2b of the file's bytes (about 1 GB/s on one core)


def shard_checksum(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(directory: str | Path) -> list[str]:
    """Every shard of a prepared dataset against its manifest: size, checksum, token ids below the vocabulary.
    Returns the problems found (none: intact). Datasets prepared before checksums were recorded get the rest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    problems = []
    for info in manifest["splits"].values():
        for shard in info["shards"]:
            f = directory / shard["path"]
            expected = shard["num_tokens"] * dtype.itemsize
            if not f.is_file() or f.stat().st_size != expected:
                problems.append(f"{f}: expected {expected} bytes, found {f.stat().st_size if f.is_file() else 'no file'}")
                continue
            if CHECKSUM in shard and shard_checksum(f) != shard[CHECKSUM]:
                problems.append(f"{f}: checksum mismatch (the file changed after it was prepared)")
                continue
            ids = np.memmap(f, dtype=dtype, mode="r")
            bad = np.flatnonzero(ids >= manifest["vocab_size"]) if len(ids) else []
            if len(bad):
                problems.append(
                    f"{f}: token id {int(ids[bad[0]])} at token {int(bad[0])} is not below the vocabulary ({manifest['vocab_size']})"
                )
    return problems


def default_workers() -> int:
    """Tokenizing processes: the cores this process may use (a SLURM task's or a container's share, not the
    machine's), divided among the processes torchrun started on this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _check_output(output: Path, fp: str, force: bool, progress: bool) -> dict | None:
    """The manifest of ``output`` when it already holds this dataset (nothing to do, unless ``force``), None when it
    may be written; an output holding something else is refused unless ``force``."""
    if (output / "manifest.json").exists():
        try:
            old = read_manifest(output)
        except PrepareError:
            old = {}
        if old.get("fingerprint") == fp and not force:
            if progress:
                print(f"[prepare] {output} is up to date (fingerprint {fp}); --force to rebuild", file=sys.stderr)
            return old
        if not force and old.get("format_version", 1) < FORMAT_VERSION:
            raise PrepareError(
                f"output directory {output} holds a dataset prepared by an earlier lmtrain (format {old.get('format_version', 1)}, "
                f"this one writes {FORMAT_VERSION}): it still trains as it is; pass --force to prepare it again in format "
                f"{FORMAT_VERSION}, or choose another --output"
            )
        if not force:
            raise PrepareError(
                f"output directory {output} already holds a different dataset (fingerprint {old.get('fingerprint')} != {fp}); "
                "choose another --output or pass --force to replace it"
            )
    elif output.exists() and any(output.iterdir()) and not force:
        raise PrepareError(f"output directory {output} exists and is not a prepared dataset; choose another --output or --force")
    return None


def _settings(files: list[Path], tokenizer: str, val_fraction: float, text_key: str, seed: int) -> tuple[dict, str]:
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if not files:
        raise PrepareError("no input files")
    settings = {"tokenizer": str(tokenizer), "val_fraction": val_fraction, "text_key": text_key, "seed": seed}
    return settings, fingerprint(files, settings)


def prepare(
    inputs: list[str | Path],
    output: str | Path,
    tokenizer: str = "bpe:4096",
    val_fraction: float = 0.01,
    workers: int = 1,
    text_key: str = "text",
    seed: int = 0,
    shard_tokens: int = 2**28,
    bpe_sample_bytes: int = 200_000_000,
    force: bool = False,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict:
    """Prepare a dataset on this machine (see module docstring) and return its manifest: the plan, every chunk and
    the merge of a preparation in tasks, in one process and its ``workers``."""
    output = Path(output)
    files = expand_inputs(list(inputs))
    settings, fp = _settings(files, tokenizer, val_fraction, text_key, seed)
    old = _check_output(output, fp, force, progress)
    if old is not None:
        return old
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    work = tmp / WORK_SUFFIX
    try:
        with _writing(output):
            work.mkdir()
            plan = _plan(files, work, settings, fp, shard_tokens, chunk_bytes, bpe_sample_bytes)
            _prepare_chunks(work, plan, range(len(plan["chunks"])), workers, progress)
            manifest = _merge_into(work, plan, tmp)
            shutil.rmtree(work)
        _replace(output, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


@contextlib.contextmanager
def _writing(output: Path):
    """An OSError while writing (reading errors are CorpusErrors already) as one PrepareError naming the output."""
    try:
        yield
    except OSError as exc:
        raise PrepareError(
            f"writing the dataset for {output} failed ({exc.strerror or exc}); "
            f"the partial copy was removed and {output} was left as it was"
        ) from exc


def _replace(output: Path, tmp: Path) -> None:
    """``tmp`` renamed to ``output``, a dataset already there moved aside first and removed after."""
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


# -- the plan: tokenizer, checks and chunks, before any tokenizing -------------------------------------------------
def work_dir(output: str | Path) -> Path:
    """Where a preparation in tasks keeps its plan and finished chunks: ``DIR.prepare`` beside the dataset ``DIR``."""
    output = Path(output)
    return output.parent / f"{output.name}{WORK_SUFFIX}"


def chunks_of(files: list[Path], chunk_bytes: int) -> list[list[list]]:
    """The corpus cut into chunks, each a list of ``[path, start, end]`` pieces (``end`` None: the whole file): files
    in order, gathered until a chunk holds ``chunk_bytes``; a larger plain ``.jsonl`` cut into ranges of
    ``chunk_bytes`` (read at line starts, :func:`lmtrain.data.corpus.read_range`). Fixed by the files' sizes alone."""
    if chunk_bytes < 1:
        raise PrepareError(f"--chunk-bytes {chunk_bytes} must be at least 1")
    chunks, group, size = [], [], 0
    for f in files:
        n = f.stat().st_size
        if splittable(f) and n > chunk_bytes:
            if group:
                chunks.append(group)
                group, size = [], 0
            chunks.extend([[str(f), a, min(a + chunk_bytes, n)]] for a in range(0, n, chunk_bytes))
            continue
        group.append([str(f), 0, None])
        size += n
        if size >= chunk_bytes:
            chunks.append(group)
            group, size = [], 0
    if group:
        chunks.append(group)
    return chunks


def _plan(files: list[Path], work: Path, settings: dict, fp: str, shard_tokens: int, chunk_bytes: int, bpe_sample_bytes: int) -> dict:
    """Check the corpus, make the tokenizer (trained for ``bpe:``, copied for a file) in ``work``, cut the chunks,
    and write ``work/plan.json``: everything a task needs, so that tasks read the corpus's settings from one place."""
    text_key, spec = settings["text_key"], settings["tokenizer"]
    if next((d for d in iter_documents(files, text_key) if d.text != ""), None) is None:  # before a tokenizer is trained
        raise PrepareError(f"empty corpus: no non-empty documents in {len(files)} input file(s)")
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise PrepareError(f"--tokenizer {spec}: expected bpe:VOCAB with an integer VOCAB") from None

        def sample() -> Iterator[str]:
            seen = 0
            for doc in iter_documents(files, text_key):
                if seen >= bpe_sample_bytes:
                    return
                seen += len(doc.text)
                yield doc.text

        try:
            ranks = train_bpe(sample(), vocab)
        except TokenizerError as exc:
            raise PrepareError(str(exc)) from None
        save_ranks(ranks, work / TOKENIZER_FILE)
        enc = encoding_from_ranks(ranks, name=f"bpe{vocab}")
        if enc.n_vocab < vocab:
            print(
                f"note: --tokenizer {spec} trained {enc.n_vocab:,} tokens, fewer than the {vocab:,} asked: the corpus "
                f"has no more merges to learn. The model needs model.vocab_size >= {enc.n_vocab}.",
                file=sys.stderr,
            )
        tok_ref, local = TOKENIZER_FILE, True
    elif spec.endswith(".json"):  # a Hugging Face tokenizer.json: a copy (and its tokenizer_config.json) kept
        enc = load_tokenizer(spec)
        shutil.copyfile(Path(spec), work / JSON_TOKENIZER_FILE)
        if (Path(spec).parent / JSON_CONFIG).is_file():
            shutil.copyfile(Path(spec).parent / JSON_CONFIG, work / JSON_CONFIG)
        tok_ref, local = JSON_TOKENIZER_FILE, True
    else:
        enc = load_tokenizer(spec)
        tok_ref, local = spec, False
        if spec.endswith(".tiktoken") or "/" in spec:  # keep a copy so the dataset is self-contained
            shutil.copyfile(Path(spec), work / TOKENIZER_FILE)
            tok_ref, local = TOKENIZER_FILE, True
    check_lossless(enc, iter_documents(files, text_key))
    plan = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "settings": settings,
        "layout": {"chunk_bytes": chunk_bytes, "shard_tokens": shard_tokens},
        "tokenizer": tok_ref,
        "tokenizer_is_file": local,  # in the work folder (and the dataset), else a name tiktoken resolves
        "vocab_size": enc.n_vocab,
        "eos_id": eos_id(enc),
        "separator": enc.decode([eos_id(enc)]),
        "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "chunks": chunks_of([f.resolve() for f in files], chunk_bytes),  # absolute: a task may start elsewhere
    }
    _write_json(work / PLAN_FILE, plan)
    return plan


def _write_json(path: Path, obj: dict) -> None:
    """``obj`` as ``path``, complete or not at all (written aside, synced, renamed)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.rename(path)


class NothingToDo(Exception):
    """A task or merge of a preparation already merged: the dataset is there and its plan is gone."""


def read_plan(work: Path, output: Path) -> dict:
    """The plan of a preparation in tasks, its inputs checked unchanged since it was made (size and mtime)."""
    path = work / PLAN_FILE
    if not path.is_file():
        if (output / "manifest.json").is_file():
            raise NothingToDo(f"{output} is prepared and no plan is pending ({path} missing): nothing to do")
        raise PrepareError(
            f"no plan for {output} ({path} missing): make it first with `python -m lmtrain.data.prepare --input ... "
            f"--output {output} --plan`, then run the tasks and the merge"
        )
    try:
        plan = json.loads(path.read_text())
        plan["chunks"], plan["files"], plan["layout"], plan["fingerprint"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise PrepareError(f"corrupt plan {path} ({type(exc).__name__}: {exc}): make it again with --plan --force") from None
    if plan.get("format_version") != FORMAT_VERSION:
        raise PrepareError(f"plan {path} is of format {plan.get('format_version')}, this lmtrain writes {FORMAT_VERSION}: plan again with --force")
    for name, size, mtime in plan["files"]:
        f = Path(name)
        if not f.is_file() or (f.stat().st_size, f.stat().st_mtime_ns) != (size, mtime):
            raise PrepareError(
                f"input {name} changed (or went) since {output} was planned: its chunks would not be the plan's; "
                "plan again with --plan --force (finished chunks are discarded)"
            )
    return plan


# -- the chunks: each task's share, one folder each --------------------------------------------------------------
def _chunk_dir(work: Path, c: int) -> Path:
    return work / f"chunk-{c:05d}"


def chunk_done(work: Path, plan: dict, c: int) -> bool:
    """Whether chunk ``c`` of ``plan`` is complete in ``work``: its record is there and its shards have their sizes."""
    record = _chunk_dir(work, c) / CHUNK_FILE
    if not record.is_file():
        return False
    try:
        info = json.loads(record.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    itemsize = np.dtype(token_dtype(plan["vocab_size"])).itemsize
    return info.get("fingerprint") == plan["fingerprint"] and all(
        (f := _chunk_dir(work, c) / s["path"]).is_file() and f.stat().st_size == s["num_tokens"] * itemsize
        for split in info["splits"].values()
        for s in split["shards"]
    )


def _documents(piece: list, text_key: str) -> Iterator:
    path, start, end = piece
    return read_documents(Path(path), text_key) if end is None else read_range(Path(path), start, end, text_key)


def _chunk_batches(plan: dict, chunks: list[int], batch_chars: int = 1 << 20) -> Iterator[tuple]:
    """The documents of ``chunks`` in batches of about ``batch_chars`` for :func:`_encode_batch`, no batch spanning
    two chunks; each chunk's last batch (texts or none) carries its count of empty documents."""
    fraction, seed, text_key = plan["settings"]["val_fraction"], plan["settings"]["seed"], plan["settings"]["text_key"]
    for c in chunks:
        batch, size, empty, first = [], 0, 0, 0
        for piece in plan["chunks"][c]:
            for doc in _documents(piece, text_key):
                if doc.text == "":
                    empty += 1
                    continue
                batch.append(doc.text)
                size += len(doc.text)
                if size >= batch_chars:
                    yield c, batch, first, fraction, seed, None
                    first, batch, size = first + len(batch), [], 0
        yield c, batch, first, fraction, seed, empty


def _prepare_chunks(work: Path, plan: dict, chunks, workers: int, progress: bool) -> list[int]:
    """Tokenize the chunks of ``plan`` numbered ``chunks`` that are not complete yet, each into ``work/chunk-CCCCC``
    (written aside and renamed when complete); returns the chunks done here."""
    todo = [c for c in chunks if not chunk_done(work, plan, c)]
    if not todo:
        return []
    dtype = np.dtype(token_dtype(plan["vocab_size"]))
    base = str(work) if plan["tokenizer_is_file"] else str(Path.cwd())
    sizes = {c: sum(_piece_bytes(p) for p in plan["chunks"][c]) for c in todo}
    from tqdm import tqdm

    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, desc="tokenize", disable=not progress, file=sys.stderr)
    ctx = mp.get_context("spawn") if workers > 1 else None
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(plan["tokenizer"], base)) if ctx else None
    state: dict = {}
    counted: dict[int, int] = {}
    kill_in = int(os.environ.get(KILL_DRILL, "-1"))
    try:
        if pool is None:
            _init_worker(plan["tokenizer"], base)
            results = map(_encode_batch, _chunk_batches(plan, todo))
        else:
            results = pool.imap(_encode_batch, _chunk_batches(plan, todo))
        for c, arrays, val, nbytes, end in results:
            if c not in state:
                for stale in work.glob(f".chunk-{c:05d}.tmp-*"):  # left by a task killed inside this chunk
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = work / f".chunk-{c:05d}.tmp-{os.getpid()}"
                tmp.mkdir()
                state[c] = (tmp, {s: _ShardWriter(tmp, s, dtype, plan["layout"]["shard_tokens"]) for s in SPLITS})
            tmp, writers = state[c]
            for arr, v in zip(arrays, val):
                writers["val" if v else "train"].write(arr)
            if c == kill_in:  # the drill (tests): a real SIGKILL with this chunk half written
                for w in writers.values():
                    w._fh and w._fh.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            shown = min(nbytes, sizes[c] - counted.get(c, 0))
            counted[c] = counted.get(c, 0) + shown
            bar.update(shown)
            if end is not None:
                _finish_chunk(work, plan, c, tmp, writers, end)
                del state[c]  # renamed into place: nothing of it left to clean up
                bar.update(sizes[c] - counted[c])
    finally:
        if pool is not None:
            pool.terminate()
        for tmp, writers in state.values():
            for w in writers.values():
                w.close()
            shutil.rmtree(tmp, ignore_errors=True)
        bar.close()
    return todo


def _piece_bytes(piece: list) -> int:
    path, start, end = piece
    return (Path(path).stat().st_size if end is None else end) - start


def _finish_chunk(work: Path, plan: dict, c: int, tmp: Path, writers: dict, empty: int) -> None:
    """Close a chunk's shards, write its record, and rename its folder into place: from here it is complete."""
    splits = {}
    for s, w in writers.items():
        w.close()
        splits[s] = {"num_documents": sum(x["num_documents"] for x in w.shards), "num_tokens": sum(x["num_tokens"] for x in w.shards),
                     "shards": w.shards}  # fmt: skip
    _write_json(tmp / CHUNK_FILE, {"chunk": c, "fingerprint": plan["fingerprint"], "empty": empty, "splits": splits})
    final = _chunk_dir(work, c)
    shutil.rmtree(final, ignore_errors=True)  # an incomplete one from another plan
    tmp.rename(final)
    fd = os.open(work, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself on disk before the task says the chunk is done
    finally:
        os.close(fd)


# -- the merge: every chunk's shards into one dataset ------------------------------------------------------------
def _merge_into(work: Path, plan: dict, target: Path) -> dict:
    """Link every chunk's shards into ``target`` in chunk order, numbered per split, copy the tokenizer, and write
    the manifest (and return it). Every chunk must be complete: the missing ones are named."""
    n = len(plan["chunks"])
    missing = [c for c in range(n) if not chunk_done(work, plan, c)]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise PrepareError(
            f"{len(missing)} of {n} chunks are not prepared ({shown}): chunk C belongs to task C modulo the number of "
            "tasks; run those tasks again (each redoes only its unfinished chunks), then merge"
        )
    records = [json.loads((_chunk_dir(work, c) / CHUNK_FILE).read_text()) for c in range(n)]
    splits = {}
    for s in SPLITS:
        shards = []
        for c, record in enumerate(records):
            for shard in record["splits"][s]["shards"]:
                name = f"{s}_{len(shards):05d}.bin"
                _link(_chunk_dir(work, c) / shard["path"], target / name)
                shards.append({**shard, "path": name})
        splits[s] = {"num_documents": sum(x["num_documents"] for x in shards), "num_tokens": sum(x["num_tokens"] for x in shards),
                     "shards": shards}  # fmt: skip
    for name in (TOKENIZER_FILE, JSON_TOKENIZER_FILE, JSON_CONFIG):
        if (work / name).is_file():
            shutil.copyfile(work / name, target / name)
    n_docs = sum(x["num_documents"] for x in splits.values())
    empty = sum(r["empty"] for r in records)
    settings, fraction = plan["settings"], plan["settings"]["val_fraction"]
    if n_docs == 0:
        raise PrepareError(f"empty corpus: no non-empty documents in {len(plan['files'])} input file(s) ({empty} empty skipped)")
    if fraction > 0 and splits["val"]["num_documents"] == 0:
        fix = (
            "raise it, or give --val-fraction 0 for no validation split"
            if n_docs > 1
            else ("one document cannot be both: add documents, or give --val-fraction 0 for no validation split")
        )
        raise PrepareError(f"--val-fraction {fraction} selected no validation document out of {n_docs}: {fix}")
    if splits["train"]["num_documents"] == 0:
        raise PrepareError(f"--val-fraction {fraction} put all {n_docs} document(s) in the validation split: lower it")
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": plan["fingerprint"],
        "dtype": token_dtype(plan["vocab_size"]),
        "eos_id": plan["eos_id"],
        "separator": plan["separator"],
        "vocab_size": plan["vocab_size"],
        "tokenizer": plan["tokenizer"],
        "num_documents": n_docs,
        "num_empty_documents_skipped": empty,
        "num_tokens": sum(x["num_tokens"] for x in splits.values()),
        "settings": settings,
        "layout": {**plan["layout"], "chunks": n},
        "inputs": [f for f, _, _ in plan["files"]],
        "splits": splits,
    }
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    _write_json(target / "manifest.json", manifest)
    return manifest


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same file as ``src`` (a hard link: no copy, and the chunk keeps its own until the merge is done);
    a copy where the filesystem has no links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# -- the three steps of a preparation in tasks -------------------------------------------------------------------
def plan_tasks(inputs, output, tokenizer: str = "bpe:4096", val_fraction: float = 0.01, text_key: str = "text", seed: int = 0,
               shard_tokens: int = 2**28, bpe_sample_bytes: int = 200_000_000, force: bool = False,
               chunk_bytes: int = CHUNK_BYTES) -> dict | None:  # fmt: skip
    """Step 1: the plan in ``DIR.prepare`` (:func:`_plan`). A plan already there for the same inputs and settings is
    kept with its finished chunks (the same plan, whatever the number of tasks); one for others is refused unless
    ``force``, which starts afresh. None: ``output`` already holds this dataset (nothing to do)."""
    output = Path(output)
    files = expand_inputs(list(inputs))
    settings, fp = _settings(files, tokenizer, val_fraction, text_key, seed)
    if _check_output(output, fp, force, progress=True) is not None:
        return None  # already prepared: no plan, and its tasks and merge have nothing to do
    work = work_dir(output)
    if (work / PLAN_FILE).is_file() and not force:
        try:
            old = json.loads((work / PLAN_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = {}
        if old.get("fingerprint") == fp and old.get("layout") == {"chunk_bytes": chunk_bytes, "shard_tokens": shard_tokens}:
            return read_plan(work, output)
        raise PrepareError(
            f"{work} holds the plan of another preparation (fingerprint {old.get('fingerprint')}, this one {fp}): "
            "finish or remove it, or pass --force to plan afresh (its finished chunks are discarded)"
        )
    shutil.rmtree(work, ignore_errors=True)
    tmp = output.parent / f".{work.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with _writing(output):
            plan = _plan(files, tmp, settings, fp, shard_tokens, chunk_bytes, bpe_sample_bytes)
        tmp.rename(work)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return plan


def run_task(output, task: int, tasks: int, workers: int = 1, progress: bool = True) -> dict:
    """Step 2, task ``task`` of ``tasks``: its chunks (index modulo ``tasks``) not yet complete. Returns what it did."""
    output = Path(output)
    if not (tasks >= 1 and 0 <= task < tasks):
        raise PrepareError(f"--task {task} of --tasks {tasks}: a task is numbered 0 to tasks - 1")
    work = work_dir(output)
    plan = read_plan(work, output)
    mine = list(range(task, len(plan["chunks"]), tasks))
    with _writing(output):
        done = _prepare_chunks(work, plan, mine, workers, progress)
    return {"task": task, "tasks": tasks, "chunks": mine, "prepared": done, "of": len(plan["chunks"])}


def merge(output) -> dict:
    """Step 3: the dataset ``output`` from the finished chunks (:func:`_merge_into`), replacing what was there (the
    plan refused that unless forced), then the work folder removed."""
    output = Path(output)
    work = work_dir(output)
    plan = read_plan(work, output)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with _writing(output):
            manifest = _merge_into(work, plan, tmp)
        _replace(output, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _task_number(value: str | None, flag: str, slurm: str, torchrun: str) -> int:
    """``--task``/``--tasks`` given, or read from a SLURM array or torchrun's environment."""
    if value is not None:
        try:
            return int(value)
        except ValueError:
            raise PrepareError(f"{flag} {value!r}: expected a whole number") from None
    env = os.environ
    if slurm == "SLURM_ARRAY_TASK_ID" and slurm in env:
        return int(env[slurm]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
    for name in (slurm, torchrun):
        if name in env:
            return int(env[name])
    raise PrepareError(f"{flag} without a number needs a SLURM array ({slurm}) or torchrun ({torchrun}) to read it from; give {flag} N")


SETTING_FLAGS = ("input", "tokenizer", "val_fraction", "text_key", "seed", "shard_tokens", "chunk_bytes", "force")  # the plan's


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.data.prepare") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verify", metavar="DIR", help="check a prepared dataset (sizes, checksums, token ids) and exit")
    p.add_argument("--input", nargs="+", help="files, directories, or 'python-stdlib'")
    p.add_argument("--output", help="dataset directory to create")
    p.add_argument("--tokenizer", default="bpe:4096", help="tiktoken name, .tiktoken file, or bpe:VOCAB (default)")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the cores this task may use)")
    p.add_argument("--text-key", default="text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-tokens", type=int, default=2**28)
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="input bytes a chunk holds (default: 1 GiB)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date, replacing what is there")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--plan", action="store_true", help="in tasks, step 1: the plan in DIR.prepare (needs --input)")
    steps.add_argument("--task", nargs="?", const=None, default=False, metavar="I",
                       help="in tasks, step 2: task I's chunks (no I: SLURM_ARRAY_TASK_ID or torchrun's RANK)")  # fmt: skip
    steps.add_argument("--merge", action="store_true", help="in tasks, step 3: the dataset from every task's chunks")
    p.add_argument("--tasks", metavar="N", help="with --task: how many tasks (no N: SLURM_ARRAY_TASK_COUNT or torchrun's WORLD_SIZE)")
    args = p.parse_args(argv)
    if args.verify:
        return _verify_main(args.verify)
    if not args.output:
        p.error("--output is required (or --verify DIR)")
    if args.task is False and args.tasks is not None:
        p.error("--tasks goes with --task")
    given = [f"--{k.replace('_', '-')}" for k in SETTING_FLAGS if getattr(args, k) != p.get_default(k)]
    if (args.task is not False or args.merge) and given:
        p.error(f"--task and --merge read the inputs and settings from the plan: give --output only (not {', '.join(given)})")
    if args.task is False and not args.merge and not args.input:
        p.error("--input is required (or --task/--merge of a planned preparation, or --verify DIR)")
    workers = args.workers or default_workers()
    t0 = time.perf_counter()
    try:
        if args.plan:
            plan = plan_tasks(args.input, args.output, args.tokenizer, args.val_fraction, args.text_key, args.seed,
                              args.shard_tokens, force=args.force, chunk_bytes=args.chunk_bytes)  # fmt: skip
            if plan is not None:
                out = shlex.quote(args.output)
                print(
                    f"[prepare] planned {len(plan['chunks'])} chunk(s) in {work_dir(args.output)}; now run every task "
                    f"I of N (examples/slurm/prepare.sbatch runs a SLURM array of them):\n"
                    f"  python -m lmtrain.data.prepare --output {out} --task I --tasks N\n"
                    f"then, once all are done:\n  python -m lmtrain.data.prepare --output {out} --merge",
                    file=sys.stderr,
                )
                print(json.dumps({"chunks": len(plan["chunks"]), "plan": str(work_dir(args.output) / PLAN_FILE)}))
            return 0
        if args.task is not False:
            task = _task_number(args.task, "--task", "SLURM_ARRAY_TASK_ID", "RANK")
            tasks = _task_number(args.tasks, "--tasks", "SLURM_ARRAY_TASK_COUNT", "WORLD_SIZE")
            done = run_task(args.output, task, tasks, workers, progress=sys.stderr.isatty())
            print(json.dumps({**done, "seconds": round(time.perf_counter() - t0, 3)}))
            return 0
        if args.merge:
            m = merge(args.output)
        else:
            m = prepare(args.input, args.output, args.tokenizer, args.val_fraction, workers, args.text_key, args.seed,
                        args.shard_tokens, force=args.force, chunk_bytes=args.chunk_bytes)  # fmt: skip
    except NothingToDo as exc:
        print(f"[prepare] {exc}", file=sys.stderr)
        return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: m[k] for k in ("num_documents", "num_tokens", "vocab_size", "dtype", "eos_id", "tokenizer")}
    print(json.dumps({**summary, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


def _verify_main(directory: str) -> int:
    try:
        problems = verify(directory)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"damaged: {problem}", file=sys.stderr)
    if problems:
        print(
            f"error: {len(problems)} damaged shard(s) in {directory}: prepare it again (python -m lmtrain.data.prepare --force ...)",
            file=sys.stderr,
        )
        return 2
    print(f"ok: {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
