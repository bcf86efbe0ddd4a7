"""A trained run directory read back: its config, a checkpoint's model weights, and the run's tokenizer (used by
``lmtrain.generate`` and ``lmtrain.export``). ``config.yaml`` is written resolved, so plain YAML reads it."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import yaml

from lmtrain.errors import InputError
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import untrusted
from lmtrain.formats.manifest import read_manifest
from lmtrain.formats.rundir import config_path
from lmtrain.formats.tokenizer import eos_id, load_tokenizer
from lmtrain.nn.model import Decoder, ModelConfig


def read_config(run_dir: Path) -> dict:
    """The run's resolved config (``RUN_DIR/config.yaml``) as plain data."""
    path = config_path(run_dir)
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:  # one line: the problem and where (PyYAML's own text spans several)
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InputError(f"{path} is not readable YAML: {getattr(exc, 'problem', None) or type(exc).__name__}{where}") from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict) or not isinstance(cfg.get("data"), dict):
        raise InputError(f"{path} is not a run's config (no model and data sections)")
    return cfg


def load_model_state(ckpt: ck.Checkpoint) -> dict[str, torch.Tensor]:
    """The model's parameters (``model.`` prefix removed) from a single-file or sharded checkpoint, on the CPU.

    From a sharded (distributed checkpoint) one only the model's tensors are read, assembled from every rank's file
    in this one process: not the optimizer state (twice the model again), and nothing written to disk. Its contents
    are checked against their CRC-32s where it is chosen (:func:`load_run`); a file that does not read all the same
    (a checkpoint from before the CRCs) is one InputError naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: caught by name

    try:
        if ckpt.meta.get("format") == "sharded":
            sd = _sharded_model_tensors(ckpt.path)
        else:
            sd = untrusted.torch_load(ckpt.load_path, map_location="cpu", mmap=True)["state_dict"]
    except untrusted.RefusedFile:
        raise
    except (Exception, CheckpointException) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise InputError(f"checkpoint {ckpt.path} does not read (damaged?): {type(exc).__name__}: {first}") from exc
    from lmtrain.nn.model import fused_state

    return fused_state({k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")})  # tensor parallel's split too


def _sharded_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """``state_dict.model.*`` of a distributed checkpoint, whole tensors on the CPU, without a process group."""
    return {k.removeprefix("state_dict."): v for k, v in sharded_tensors(path, "state_dict.model.").items()}


def sharded_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a distributed checkpoint whose names start with ``prefix`` (every one by default: the model's
    and the optimizer's), each whole on the CPU under its name in the checkpoint, read in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = untrusted.safe_reader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in entries.items()
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        dcp.load(state, storage_reader=reader, no_dist=True)  # the keys asked for, each assembled from its shards
    return state


def load_run(run_dir: Path, checkpoint: str | None = None, device: str = "cpu"):
    """(model in eval mode, tiktoken encoding, eos id, the checkpoint used) for a run directory."""
    cfg = read_config(run_dir)
    root = run_dir / "checkpoints"
    if checkpoint:
        if not ck.NAME_RE.match(checkpoint) or not (root / checkpoint).is_dir():
            names = [c.path.name for c in ck.scan(root, quiet=True)]
            have = f"the complete ones are {', '.join(names)}" if names else "it holds no complete checkpoint"
            raise InputError(f"--checkpoint {checkpoint}: no such checkpoint in {root} ({have})")
        ckpt, why = ck.verified(root / checkpoint)  # complete, and its contents those saved
        if ckpt is None:
            raise InputError(f"checkpoint {root / checkpoint} is not usable: {why}")
    else:
        ckpt = ck.newest_intact(ck.scan(root))  # a damaged newest one is named and skipped, and left as it is
        if ckpt is None:
            raise InputError(f"{run_dir} has no complete checkpoint under {root}: train with callbacks.checkpoint on first")
    model = Decoder(ModelConfig.as_trained(cfg["model"]))
    missing, unexpected = model.load_state_dict(load_model_state(ckpt), strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]  # buffers recomputed by the model
    if missing or unexpected:
        raise InputError(f"checkpoint {ckpt.path} does not match the run's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    spec, data_path = run_tokenizer(cfg)
    enc = load_tokenizer(spec, data_path)
    return model.to(device).eval(), enc, eos_id(enc), ckpt


def run_tokenizer(cfg: dict) -> tuple[str, Path]:
    """(tokenizer spec, the dataset folder it is relative to) of a run, from its config and dataset manifest."""
    data = cfg["data"]
    data_path = Path(data["path"]) if data.get("path") else Path(data["sources"][0]["path"])
    return str(read_manifest(data_path)["tokenizer"]), data_path
