"""The checkpoint directory: layout, completeness, the ``latest`` pointer, retention, compatibility.

Layout under ``CKPT_ROOT`` (default ``RUN_DIR/checkpoints``)::

    step-0000500/            a complete checkpoint
        checkpoint.pt        single-process strategies: one file (Lightning's checkpoint dict)
        .metadata, __0_0.distcp, ...   sharded strategies: a PyTorch distributed checkpoint, one file per rank
        meta.json            written last: step, tokens, config hash, model config, world size, files, sizes, CRC-32s
    .step-0001000.partial/   being written (or left by a crash): never read
    latest                   text file naming the newest complete checkpoint, replaced atomically

A checkpoint is written into ``.step-N.partial/``, its ``meta.json`` last, then renamed to ``step-N/``; only then
is ``latest`` updated. A directory counts as complete when its name is ``step-N``, its ``meta.json`` parses and
every file it lists exists with the recorded size; anything else is skipped with a warning naming it.

Contents: ``commit`` also records each file's CRC-32 (read back once after writing; ``checksums=False`` skips it),
and :func:`verify_contents` compares them before a checkpoint is loaded (resume, rollback, the tools): bytes damaged
in place, which keep the size, are caught there. PyTorch's own loaders read such bytes without a word (``torch.load``
of a single file, with or without ``mmap``, and distributed checkpoints alike). Checkpoints from before the CRCs were
recorded are checked by size only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from lmtrain.errors import InputError
from lmtrain.formats.rundir import write_text_atomic

NAME_RE = re.compile(r"^step-(\d{7,})$")
PARTIAL_RE = re.compile(r"^\.step-(\d{7,})\.partial$")
META = "meta.json"
LATEST = "latest"
SINGLE_FILE = "checkpoint.pt"
FORMAT_VERSION = 1
# model fields a resumed run may change (learned position tables still refuse a new max_seq_len by shape)
RESUMABLE_MODEL_CHANGES = ("name", "dropout", "attention_dropout", "init_std", "embed_init_std", "max_seq_len")


class CheckpointError(InputError):
    """A checkpoint that cannot be used here (foreign model, corrupt, missing), naming the problem."""


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def partial_name(step: int) -> str:
    return f".{step_name(step)}.partial"


def warn(msg: str) -> None:
    from lmtrain.console import log

    log.warning(msg)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    meta: dict

    @property
    def load_path(self) -> Path:
        """What Lightning's ``ckpt_path`` takes: the single file, or the directory of a sharded checkpoint."""
        return self.path / SINGLE_FILE if self.meta.get("format") == "single" else self.path


def dir_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), ``meta.json`` excluded."""
    out = {}
    for root, _, names in os.walk(directory):
        for n in names:
            p = Path(root) / n
            rel = str(p.relative_to(directory))
            if rel != META:
                out[rel] = p.stat().st_size
    return out


def file_crc32(path: Path, chunk: int = 16 << 20) -> str:
    """The CRC-32 of a file as 8 hex digits, read in chunks (zlib releases the GIL on them: a writer thread computes it
    beside training)."""
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


SHARD_RE = re.compile(r"__(\d+)_\d+\.distcp")  # distributed checkpoint's data file of rank N


def crc_reader(rel: str, world_size: int, per_node: int) -> int:
    """The rank that reads back a sharded checkpoint's file ``rel`` for its CRC-32 once every rank has written: rank
    r's shards (``__r_k.distcp``) are read by rank (r + per_node) % world_size, a process on the next node where there
    is one (the CRC-32 is then of what the shared filesystem holds, not of the writer's own page cache; on one node,
    the writer itself); the files no single rank owns (``.metadata``, ``meta.pt``) by rank 0. Each process reads its
    share, none reads the whole checkpoint."""
    m = SHARD_RE.fullmatch(rel)
    if m is None or int(m.group(1)) >= world_size:
        return 0
    return (int(m.group(1)) + per_node) % world_size


def verify_contents(directory: Path, meta: dict) -> str | None:
    """None when every file's CRC-32 matches the one ``meta.json`` recorded (or none was recorded), else what differs."""
    for rel, want in (meta.get("crc32") or {}).items():
        try:
            got = file_crc32(directory / rel)
        except OSError as exc:
            return f"{rel} does not read ({exc.strerror or exc})"
        if got != want:
            return f"{rel} has CRC-32 {got}, {want} was recorded at save: its contents are damaged"
    return None


def unreadable(c: Checkpoint) -> str | None:
    """None when the checkpoint's pickled parts read with the safe loaders of :mod:`lmtrain.formats.untrusted`
    (cheap: the tensors' bytes are mapped, not read), else why not: a refused pickle, or bytes that do not read
    (a checkpoint without CRC-32s damaged in place). A single file without CRC-32s also has its model weights read:
    a NaN or an infinity there is damage (a healthy run's weights are finite)."""
    from lmtrain.formats import untrusted

    sharded = c.meta.get("format") == "sharded"
    name = ".metadata" if sharded else c.load_path.name
    try:
        if sharded:
            untrusted.dcp_metadata(c.path / ".metadata")
            name = "meta.pt"
            if (c.path / name).exists():
                untrusted.torch_load(c.path / name, map_location="cpu")
        else:
            state = untrusted.torch_load(c.load_path, map_location="cpu", mmap=True)
            if not c.meta.get("crc32"):  # nothing tells damaged bytes in the tensors: weights that are not finite do
                bad = _non_finite(state.get("state_dict", {}) if isinstance(state, dict) else {})
                if bad:
                    return f"{name} holds non-finite model weights ({bad}): damaged (it records no CRC-32s to tell)"
    except untrusted.RefusedFile as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises on bytes it cannot read
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{name} does not read ({type(exc).__name__}: {first})"
    return None


def _non_finite(state_dict: dict) -> str | None:
    """The first floating-point tensor of ``state_dict`` with a NaN or an infinity, named, or None."""
    import torch

    for key, t in state_dict.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return key
    return None


def damage(c: Checkpoint, crc: bool = True) -> str | None:
    """What makes ``c`` unusable: a file whose CRC-32 differs from the one recorded (``crc``: checked here; a sharded
    checkpoint resumed by several processes is checked spread over them, lmtrain.training.checkpoint.intact), or a pickle that
    does not read safely (:func:`unreadable`, always here); None when it is usable."""
    return (verify_contents(c.path, c.meta) if crc else None) or unreadable(c)


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def verify(directory: Path) -> tuple[dict | None, str | None]:
    """(metadata, None) for a complete checkpoint directory, else (None, why not)."""
    meta_path = directory / META
    if not meta_path.is_file():
        return None, f"{META} missing (the save did not finish)"
    try:
        meta = json.loads(meta_path.read_text())
        files, step = meta["files"], int(meta["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError) as exc:
        return None, f"{META} does not parse ({type(exc).__name__}: {exc})"
    if "meta_crc32" in meta and meta["meta_crc32"] != _meta_crc32(meta):
        return None, f"{META} is damaged: its own CRC-32 differs from the one recorded in it (edited or bit rot)"
    m = NAME_RE.match(directory.name)
    if m and int(m.group(1)) != step:
        return None, f"{META} says step {step}, the directory name says {int(m.group(1))}"
    if not files:
        return None, "it lists no files"
    for rel, size in files.items():
        f = directory / rel
        if not f.is_file():
            return None, f"{rel} is missing"
        if f.stat().st_size != size:
            return None, f"{rel} is {f.stat().st_size} bytes, {size} expected (truncated?)"
    return meta, None


def scan(root: Path, quiet: bool = False) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first; incomplete ones are skipped with a warning."""
    found: list[Checkpoint] = []
    if not root.is_dir():
        return found
    for d in sorted(root.iterdir()):
        m = NAME_RE.match(d.name)
        if not m or not d.is_dir():
            continue
        meta, why = verify(d)
        if meta is None:
            if not quiet:
                warn(f"skipping incomplete checkpoint {d}: {why}")
            continue
        found.append(Checkpoint(int(m.group(1)), d, meta))
    return sorted(found, key=lambda c: c.step)


def newest(root: Path, quiet: bool = False) -> Checkpoint | None:
    """The newest complete checkpoint (the ``latest`` pointer is a hint: a damaged target falls back)."""
    complete = scan(root, quiet=quiet)
    return complete[-1] if complete else None


def checked_by_each_process(c: Checkpoint, world_size: int) -> bool:
    """Whether each process of a run checks ``c``'s contents itself before loading it: any checkpoint of a one-process
    run, and every single file (each process reads it whole anyway). A sharded checkpoint that several processes load is
    checked spread over them instead, each reading every N-th file (lmtrain.training.checkpoint.intact)."""
    return world_size == 1 or c.meta.get("format") != "sharded"


def newest_intact(
    candidates: list[Checkpoint],
    move_aside: bool = False,
    skipping: str = "skipping damaged checkpoint",
    contents=damage,
) -> Checkpoint | None:
    """The newest of ``candidates`` (oldest first, as :func:`scan` gives them) whose contents match their recorded
    CRC-32s: a damaged one is passed over with a warning (``skipping`` and its path) naming the file and, with
    ``move_aside`` (one process of a run), moved aside (:func:`quarantine`). Every process reads the same bytes, so all
    of a run's processes settle on the same checkpoint. ``contents(c)``: None when intact (or left to a later check,
    lmtrain.training.checkpoint.intact), else what is damaged; a check spread over a run's processes is
    lmtrain.training.checkpoint.intact.spread_contents."""
    for c in reversed(candidates):
        why = contents(c)
        if why is None:
            return c
        where = f"; moved aside to {quarantine(c.path).name}" if move_aside else ""
        warn(f"{skipping} {c.path}: {why}{where}")
    return None


def verified(directory: Path, check=lambda c: True) -> tuple[Checkpoint | None, str | None]:
    """(the checkpoint, None) for a complete directory (:func:`verify`) whose contents match their CRC-32s (unless
    ``check(c)`` is False: checked later) and whose pickles read safely, else (None, why not)."""
    meta, why = verify(directory)
    if meta is None:
        return None, why
    c = Checkpoint(int(meta["step"]), directory, meta)
    if (why := damage(c, crc=check(c))) is not None:
        return None, why
    return c, None


def set_latest(root: Path, ckpt_dir: Path) -> None:
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(ckpt_dir.name + "\n")
    os.replace(tmp, root / LATEST)


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def _meta_crc32(meta: dict) -> str:
    """The CRC-32 of ``meta.json``'s own fields (``meta_crc32`` left out), canonical JSON: a field damaged or edited
    after the save (a model config that still parses) is caught like a damaged file."""
    body = json.dumps({k: v for k, v in meta.items() if k != "meta_crc32"}, sort_keys=True, default=str)
    return f"{zlib.crc32(body.encode()):08x}"


def commit(partial: Path, final: Path, meta: dict, checksums: bool = True, known_crc32: dict | None = None) -> None:
    """Write ``meta.json`` last into the partial directory (with each file's CRC-32 unless ``checksums=False``: those
    in ``known_crc32``, computed by the processes of a sharded save (:func:`crc_reader`), and the rest here), then
    rename it into place and publish ``latest``."""
    files = dir_files(partial)
    meta = {**meta, "files": files, "format_version": FORMAT_VERSION, "saved_at": time.time()}
    if checksums:
        known = known_crc32 or {}
        meta["crc32"] = {rel: known.get(rel) or file_crc32(partial / rel) for rel in sorted(files)}
    meta["meta_crc32"] = _meta_crc32(meta)
    write_json_atomic(partial / META, meta)
    fsync_dir(partial)
    if final.exists():  # a stale copy of the same step (an earlier attempt): replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_dir(final.parent)
    set_latest(final.parent, final)


def quarantine(directory: Path) -> Path:
    """Move a checkpoint that failed verification out of the way (kept for inspection) and re-point ``latest``."""
    target = directory.parent / f".{directory.name}.corrupt-{int(time.time())}"
    os.rename(directory, target)
    good = newest(directory.parent, quiet=True)
    if good is not None:
        set_latest(directory.parent, good.path)
    else:
        (directory.parent / LATEST).unlink(missing_ok=True)
    return target


def inventory(root: Path) -> list[tuple[str, str]]:
    """Every checkpoint folder under ``root``, complete or not, with why it is not usable (for a message naming them):
    an incomplete one's reason (:func:`verify`), one moved aside as damaged, a partial save."""
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if NAME_RE.match(d.name) and d.is_dir():
            meta, why = verify(d)
            out.append((d.name, why or "complete, but not usable (named above)"))
        elif d.name.startswith(".step-") and ".corrupt-" in d.name:
            out.append((d.name, "moved aside as damaged"))
        elif is_partial(d.name):
            out.append((d.name, "a save that did not finish"))
    return out


def is_partial(name: str) -> bool:
    """Whether a name of the checkpoint directory is a save that did not finish (``.step-N.partial``)."""
    return PARTIAL_RE.match(name) is not None


def retention_victims(steps: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` and the multiples of ``keep_every``."""
    steps = sorted(steps)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    if steps:
        keep.add(steps[-1])  # never the newest complete one
    return [s for s in steps if s not in keep]


def prune(root: Path, keep_last: int, keep_every: int | None, protect: set[int] = frozenset()) -> list[Path]:
    """Apply retention to the complete checkpoints under ``root``; returns what was deleted."""
    complete = {c.step: c for c in scan(root, quiet=True)}
    deleted = []
    for s in retention_victims(list(complete), keep_last, keep_every):
        if s in protect:
            continue
        path = complete[s].path
        trash = root / f".{path.name}.deleting"
        os.rename(path, trash)  # no longer looks complete before its files go
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(path)
    return deleted


def remove_partials(root: Path) -> list[Path]:
    """Delete what crashed saves left behind (``.step-N.partial``, ``.step-N.deleting``)."""
    removed = []
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".step-") and (d.name.endswith(".partial") or d.name.endswith(".deleting")):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def config_hash(cfg_container: dict) -> str:
    return hashlib.sha256(json.dumps(cfg_container, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- compatibility --------------------------------------------------------------------------------
def param_shapes(module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in module.state_dict().items()}


# model fields lmtrain added after checkpoints existed, with their defaults: an older checkpoint's config lacks them
ADDED_MODEL_FIELDS = {"rope_scaling": None, "qk_norm": False, "moe": None, "embed_init_std": None}


def check_compatible(saved: dict, current: dict, what: str) -> None:
    """Refuse a checkpoint whose model differs: config fields, then parameter names and shapes, both ways."""
    from lmtrain.nn.moe import as_trained

    problems = []
    s_cfg, c_cfg = saved.get("model_config") or {}, current.get("model_config") or {}
    for k in sorted(set(s_cfg) | set(c_cfg)) if s_cfg and c_cfg else ():
        if k in RESUMABLE_MODEL_CHANGES:
            continue
        was, now = s_cfg.get(k, ADDED_MODEL_FIELDS.get(k, "<absent>")), c_cfg.get(k, ADDED_MODEL_FIELDS.get(k, "<absent>"))
        if k == "moe" and isinstance(was, dict) and isinstance(now, dict):  # key by key, an older one's as it trained
            was, now = as_trained(was), as_trained(now)
            problems += [f"model.moe.{m}: checkpoint {was.get(m)!r}, this run {now.get(m)!r}" for m in sorted(was | now) if was.get(m) != now.get(m)]
        elif was != now:
            problems.append(f"model.{k}: checkpoint {was!r}, this run {now!r}")
    s_p, c_p = saved.get("params") or {}, current.get("params") or {}
    if s_p and c_p:
        missing, extra = sorted(set(c_p) - set(s_p)), sorted(set(s_p) - set(c_p))
        if missing:
            problems.append(f"parameters this model has and the checkpoint lacks: {_few(missing)}")
        if extra:
            problems.append(f"parameters in the checkpoint this model lacks: {_few(extra)}")
        shapes = [f"{k} {s_p[k]} vs {c_p[k]}" for k in sorted(set(s_p) & set(c_p)) if list(s_p[k]) != list(c_p[k])]
        if shapes:
            problems.append(f"shapes differ (checkpoint vs this run): {_few(shapes)}")
    s_opt, c_opt = saved.get("optimizer"), current.get("optimizer")
    if s_opt and c_opt and s_opt != c_opt:
        problems.append(f"optimizer: checkpoint {s_opt}, this run {c_opt}")
    if problems:
        raise CheckpointError(f"{what} was saved by a different model or config:\n  - " + "\n  - ".join(problems))


def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")
