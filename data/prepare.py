"""Tokenize a corpus into flat token shards with exactly one separator after every document.

    python -m lmtrain.data.prepare --input PATH [PATH ...] --output DIR [--tokenizer SPEC] [--val-fraction F] [--workers N]

Output (``DIR/``): ``manifest.json``, the tokenizer's ranks file when it was trained here, and raw little-endian
token shards ``{split}_{NNNNN}.bin`` (uint16 when the vocabulary fits, else uint32; read them with
``numpy.memmap``). The separator invariant: in each split's stream (shards concatenated in manifest order),
every document is followed by exactly one ``eos_id`` and contains none itself; decoding the tokens between
separators gives back each document's text exactly. Empty documents are skipped and counted.

The dataset is written under a temporary name and renamed when complete, so a half-written dataset never
looks valid. A re-run over unchanged inputs with the same settings is skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmtrain.console import help_text
from lmtrain.data.corpus import expand_inputs, iter_documents
from lmtrain.errors import InputError
from lmtrain.formats.manifest import CHECKSUM_KEY, PrepareError, manifest_checksum, read_manifest, token_dtype  # noqa: F401  (read_manifest: re-exported for data.datamodule and users)
from lmtrain.formats.tokenizer import JSON_CONFIG, TokenizerError, encoding_from_ranks, eos_id, load_tokenizer, save_ranks, train_bpe

FORMAT_VERSION = 1
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


def is_val(index: int, val_fraction: float, seed: int) -> bool:
    """Deterministic split of the index-th non-empty document (stable under appending documents)."""
    if val_fraction <= 0:
        return False
    return zlib.crc32(f"{seed}:{index}".encode()) / 2**32 < val_fraction


# -- tokenising in worker processes -------------------------------------------------------------
_ENC = None
_EOS = 0


def _init_worker(tokenizer: str, base_dir: str) -> None:
    global _ENC, _EOS
    _ENC = load_tokenizer(tokenizer, base_dir)
    _EOS = eos_id(_ENC)


def _encode_batch(texts: list[str]) -> tuple[list[np.ndarray], int]:
    """Token arrays (document ids + one separator each) and the number of UTF-8 bytes read."""
    out = []
    for ids in _ENC.encode_ordinary_batch(texts, num_threads=1):
        arr = np.empty(len(ids) + 1, dtype=np.uint32)
        arr[:-1] = ids
        arr[-1] = _EOS
        out.append(arr)
    return out, sum(len(t.encode("utf-8")) for t in texts)


def _batches(docs: Iterator[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in docs:
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


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
) -> dict:
    """Prepare a dataset (see module docstring) and return its manifest."""
    output = Path(output)
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1)")
    files = expand_inputs(list(inputs))
    if not files:
        raise PrepareError("no input files")
    settings = {"tokenizer": str(tokenizer), "val_fraction": val_fraction, "text_key": text_key, "seed": seed}
    fp = fingerprint(files, settings)
    if (output / "manifest.json").exists():
        try:
            old = read_manifest(output)
        except PrepareError:
            old = {}
        if old.get("fingerprint") == fp and not force:
            if progress:
                print(f"[prepare] {output} is up to date (fingerprint {fp}); --force to rebuild", file=sys.stderr)
            return old
        if not force:
            raise PrepareError(
                f"output directory {output} already holds a different dataset (fingerprint {old.get('fingerprint')} != {fp}); "
                "choose another --output or pass --force to replace it"
            )
    elif output.exists() and any(output.iterdir()) and not force:
        raise PrepareError(f"output directory {output} exists and is not a prepared dataset; choose another --output or --force")

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        try:
            manifest = _build(files, tmp, settings, fp, workers, shard_tokens, bpe_sample_bytes, progress)
        except OSError as exc:  # reading errors are CorpusErrors already: this is the disk we write to
            raise PrepareError(
                f"writing the dataset for {output} failed ({exc.strerror or exc}); "
                f"the partial copy was removed and {output} was left as it was"
            ) from exc
        if output.exists():
            old = output.parent / f".{output.name}.old-{os.getpid()}"
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _build(files, tmp: Path, settings: dict, fp: str, workers: int, shard_tokens: int, bpe_sample_bytes: int, progress: bool) -> dict:
    text_key, val_fraction, seed = settings["text_key"], settings["val_fraction"], settings["seed"]
    spec = settings["tokenizer"]
    t0 = time.perf_counter()
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
        save_ranks(ranks, tmp / TOKENIZER_FILE)
        enc = encoding_from_ranks(ranks, name=f"bpe{vocab}")
        if enc.n_vocab < vocab:
            print(
                f"note: --tokenizer {spec} trained {enc.n_vocab:,} tokens, fewer than the {vocab:,} asked: the corpus "
                f"has no more merges to learn. The model needs model.vocab_size >= {enc.n_vocab}.",
                file=sys.stderr,
            )
        tok_ref, tok_base = TOKENIZER_FILE, str(tmp)
    elif spec.endswith(".json"):  # a Hugging Face tokenizer.json: a copy (and its tokenizer_config.json) kept
        enc = load_tokenizer(spec)
        shutil.copyfile(Path(spec), tmp / JSON_TOKENIZER_FILE)
        if (Path(spec).parent / JSON_CONFIG).is_file():
            shutil.copyfile(Path(spec).parent / JSON_CONFIG, tmp / JSON_CONFIG)
        tok_ref, tok_base = JSON_TOKENIZER_FILE, str(tmp)
    else:
        enc = load_tokenizer(spec)
        tok_ref, tok_base = spec, str(Path.cwd())
        if spec.endswith(".tiktoken") or "/" in spec:  # keep a copy so the dataset is self-contained
            shutil.copyfile(Path(spec), tmp / TOKENIZER_FILE)
            tok_ref, tok_base = TOKENIZER_FILE, str(tmp)
    check_lossless(enc, iter_documents(files, text_key))
    vocab_size = enc.n_vocab
    dtype = np.dtype(token_dtype(vocab_size))
    writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    counts = {s: {"num_documents": 0, "num_tokens": 0} for s in SPLITS}
    empty = 0
    index = itertools.count()
    total_bytes = sum(f.stat().st_size for f in files)

    def texts() -> Iterator[str]:
        nonlocal empty
        for doc in iter_documents(files, text_key):
            if doc.text == "":
                empty += 1
                continue
            yield doc.text

    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not progress, file=sys.stderr)
    ctx = mp.get_context("spawn") if workers > 1 else None
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok_ref, tok_base)) if ctx else None
    try:
        if pool is None:
            _init_worker(tok_ref, tok_base)
            results = map(_encode_batch, _batches(texts(), 1 << 20))
        else:
            results = pool.imap(_encode_batch, _batches(texts(), 1 << 20))
        for arrays, nbytes in results:
            for arr in arrays:
                split = "val" if is_val(next(index), val_fraction, seed) else "train"
                writers[split].write(arr)
                counts[split]["num_documents"] += 1
                counts[split]["num_tokens"] += len(arr)
            bar.update(nbytes)
    finally:
        if pool is not None:
            pool.terminate()
        for w in writers.values():
            w.close()
        bar.close()
    n_docs = sum(c["num_documents"] for c in counts.values())
    if n_docs == 0:
        raise PrepareError(f"empty corpus: no non-empty documents in {len(files)} input file(s) ({empty} empty skipped)")
    if val_fraction > 0 and counts["val"]["num_documents"] == 0:
        fix = (
            "raise it, or give --val-fraction 0 for no validation split"
            if n_docs > 1
            else ("one document cannot be both: add documents, or give --val-fraction 0 for no validation split")
        )
        raise PrepareError(f"--val-fraction {val_fraction} selected no validation document out of {n_docs}: {fix}")
    if counts["train"]["num_documents"] == 0:
        raise PrepareError(f"--val-fraction {val_fraction} put all {n_docs} document(s) in the validation split: lower it")
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "dtype": dtype.name,
        "eos_id": eos_id(enc),
        "separator": enc.decode([eos_id(enc)]),
        "vocab_size": vocab_size,
        "tokenizer": tok_ref,
        "num_documents": n_docs,
        "num_empty_documents_skipped": empty,
        "num_tokens": sum(c["num_tokens"] for c in counts.values()),
        "settings": settings,
        "inputs": [str(f) for f in files],
        "splits": {s: {**counts[s], "shards": writers[s].shards} for s in SPLITS},
        "seconds": round(time.perf_counter() - t0, 3),
    }
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.data.prepare") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verify", metavar="DIR", help="check a prepared dataset (sizes, checksums, token ids) and exit")
    p.add_argument("--input", nargs="+", help="files, directories, or 'python-stdlib'")
    p.add_argument("--output", help="dataset directory to create")
    p.add_argument("--tokenizer", default="bpe:4096", help="tiktoken name, .tiktoken file, or bpe:VOCAB (default)")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--text-key", default="text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-tokens", type=int, default=2**28)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date, replacing what is there")
    args = p.parse_args(argv)
    if args.verify:
        return _verify_main(args.verify)
    if not args.input or not args.output:
        p.error("--input and --output are required (or --verify DIR)")
    try:
        m = prepare(
            args.input,
            args.output,
            args.tokenizer,
            args.val_fraction,
            args.workers,
            args.text_key,
            args.seed,
            args.shard_tokens,
            force=args.force,
        )
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: m[k] for k in ("num_documents", "num_tokens", "vocab_size", "dtype", "eos_id", "tokenizer")}))
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
