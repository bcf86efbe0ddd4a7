"""``init_from=DIR``: a run that starts from the weights of a Hugging Face ``transformers`` model directory
(``OPTForCausalLM`` or ``LlamaForCausalLM``: ``config.json`` and safetensors weights, one file or a sharded index).

The architecture comes from the directory (lmtrain.formats.hf.model_fields): it replaces the ``model`` node before the
config is checked, and a ``model=``/``model.KEY=``/``experiment=`` on the command line that says otherwise is one
error naming the difference (``model.dropout`` and ``model.attention_dropout``, training settings, may be changed).
Everything about the directory is checked before anything of the run is written: its config, every tensor's name,
shape and type (file headers only), that every value is finite (one read of the weights), and that the dataset was
prepared with the directory's ``tokenizer.json``. The weights are read into the model once it is built: into the
shards of each rank under fsdp/hsdp (each rank reads only its own rows, from memory-mapped files, onto a model built on
the meta device), whole under single/ddp. The optimizer starts fresh. A resumed run reads its checkpoint, not the directory.

What the run started from is kept in the run directory (``init_from/``: the directory's path, its config.json and
that file's hash, and OPT's two rows of position offset, which OPT never reads and ``lmtrain export --format hf``
writes back), in the logbook and as MLflow tags.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from lmtrain.console import log
from lmtrain.errors import InputError
from lmtrain.formats import hf
from lmtrain.formats.rundir import write_text_atomic

FOLDER = "init_from"  # in the run directory
OFFSET_FILE = "position_offset.safetensors"
TRAINING_FIELDS = ("dropout", "attention_dropout")  # the directory's values, unless the command line changes them
DECODER = "lmtrain.nn.model.Decoder"


@dataclass
class Source:
    path: Path
    config: dict  # its config.json
    fields: dict  # lmtrain's model fields
    config_sha256: str

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or [f"model_type {self.config.get('model_type')}"])[0]

    def record(self) -> dict:
        return {"path": str(self.path.resolve()), "architecture": self.architecture, "config_sha256": self.config_sha256}


def read(path: str | Path) -> Source:
    """The directory's config.json as lmtrain model fields; a directory or file missing or unreadable, or an
    architecture lmtrain cannot express, is one error naming it."""
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise InputError(f"init_from={path}: no such directory (a transformers model folder: config.json and model.safetensors)")
    config_file = folder / "config.json"
    try:
        raw = config_file.read_bytes()
        config = json.loads(raw)
    except FileNotFoundError:
        raise InputError(f"init_from={path}: {config_file} is missing (a transformers model folder has one)") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"init_from={path}: {config_file} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise InputError(f"init_from={path}: {config_file} is not a transformers config (not a JSON object)")
    fields = hf.model_fields(config, str(config_file))
    return Source(folder, config, fields, "sha256:" + hashlib.sha256(raw).hexdigest())


def check_counts(src: Source) -> None:
    """config.json's layer count and embedding size against the weights' own tensors (file headers only), before
    anything is built: a config that claims more (``num_hidden_layers: 1000000`` over the weights of 2 layers) would
    build a model without end. The full check of every tensor follows once the model's shape is known (:class:`Loader`)."""
    import re

    weights = hf.Weights(src.path)
    layers = {int(m.group(1)) for name in weights.shapes if (m := re.search(r"\.layers\.(\d+)\.", name))}
    want = int(src.fields.get("n_layers") or 0)
    if layers != set(range(want)):
        held = f"layers 0..{max(layers)} ({len(layers)})" if layers else "no layers"
        raise InputError(
            f"init_from={src.path}: config.json says {want} layers (num_hidden_layers) but the weights hold {held}: "
            "the config and the weights are of different models"
        )
    root = hf.decoder_root(src.fields.get("family"))
    emb = weights.shapes.get(f"{root}embed_tokens.weight")
    dim = src.fields.get("embed_dim") or src.fields.get("d_model")
    if emb is not None and tuple(emb) != (src.fields.get("vocab_size"), dim):
        raise InputError(
            f"init_from={src.path}: tensor {root}embed_tokens.weight has shape {list(emb)}; config.json's model needs "
            f"[{src.fields.get('vocab_size')}, {dim}]"
        )


def _architecture(fields: dict) -> dict:
    """What makes two lmtrain models the same network (the defaults resolved: n_kv_heads null is n_heads, ...)."""
    from lmtrain.nn.model import ModelConfig

    c = ModelConfig(**{k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__})
    out = {
        "family": c.family, "vocab_size": c.vocab_size, "max_seq_len": c.max_seq_len, "d_model": c.d_model, "n_layers": c.n_layers,
        "n_heads": c.n_heads, "n_kv_heads": c.kv_heads, "ffn_dim": c.hidden_dim, "embed_dim": c.emb_dim,
        "tie_embeddings": c.tie_embeddings, "norm_eps": c.norm_eps, "activation": c.act, "qk_norm": c.qk_norm,
    }  # fmt: skip
    if c.family == "llama":
        out.update(rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
    return out


def apply(cfg: DictConfig, overrides: list[str]) -> Source | None:
    """``init_from=DIR``: the ``model`` node made the directory's architecture (before the config is checked)."""
    if not cfg.get("init_from"):
        return None
    model = cfg.get("model")
    if model is None or str(model.get("_target_", "")) != DECODER:
        raise InputError(
            f"init_from={cfg.init_from} builds {DECODER}; model._target_={model and model.get('_target_')!r} is another network"
        )
    src = read(cfg.init_from)
    check_counts(src)
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    chose = [
        o for o, k in zip(overrides, keys) if k in ("model", "experiment") or (k.startswith("model.") and k[6:] not in TRAINING_FIELDS)
    ]
    if chose:
        try:
            composed = _architecture(dict(model))
        except (ValueError, TypeError):
            composed = None
        theirs = _architecture(src.fields)
        differ = sorted((k for k in theirs if composed is None or composed[k] != theirs[k]), key=lambda k: f"model.{k}" not in keys)
        if differ:
            k = differ[0]
            said = f"{k} {composed[k]} there, {theirs[k]} in {src.path / 'config.json'}" if composed is not None else "an invalid model"
            raise InputError(
                f"init_from={cfg.init_from}: the architecture comes from the directory, and {' '.join(chose)} on the command line "
                f"says otherwise ({said}): drop it"
            )
    from lmtrain.nn.model import ModelConfig

    kept = {k for k in keys if k.startswith("model.") and k[6:] in TRAINING_FIELDS}
    with open_dict(cfg):
        for key, default in ModelConfig.__dataclass_fields__.items():
            if f"model.{key}" in kept:
                continue
            value = src.fields.get(key, default.default)
            cfg.model[key] = value
        cfg.model.name = src.path.resolve().name
    return src


def check_tokenizer(src: Source, manifest: dict, data_path: Path) -> None:
    """The dataset was prepared with the directory's tokenizer: the same tokenizer by what it does (a ranks file
    holding the BPE of the directory's ``tokenizer.json`` is), not the same file; a directory without one is taken at
    its word (the vocabulary's size is still checked against the model's)."""
    from lmtrain.formats.tokenizer import tokenizer_identity

    theirs = src.path / "tokenizer.json"
    if not theirs.is_file():
        return
    want, have = tokenizer_identity(str(theirs.resolve())), tokenizer_identity(str(manifest["tokenizer"]), data_path)
    if want != have:
        raise InputError(
            f"init_from={src.path}: the dataset {data_path} was prepared with another tokenizer ({manifest['tokenizer']}, {have}) than "
            f"the model's {theirs} ({want}): prepare it with `lmtrain prepare --tokenizer {theirs} ...`"
        )


class Loader:
    """The directory's weights, checked against the model (before anything is written) and read into it once built
    (LMModule.configure_model, after sharding): each parameter's rows, or under fsdp/hsdp each rank's own rows."""

    def __init__(self, src: Source, shape: torch.nn.Module) -> None:
        self.src = src
        self.weights = hf.Weights(src.path)
        self.cfg = shape.cfg
        try:
            self.layout = self.weights.check(shape.cfg, shape.state_dict())
        except InputError as exc:
            raise InputError(f"init_from={src.path}: {exc}") from None
        self.check_finite()

    def check_finite(self) -> None:
        """Every value the model will read is a number: a NaN or an infinity (weights saved after a divergence, a
        damaged file) would otherwise train as a divergence at step 0. Read once here, before anything is written; the
        model's own read follows from the page cache."""
        import time

        start = time.perf_counter()
        used = sorted({name for parts in self.layout.values() for name, _ in parts})
        bad = self.weights.first_non_finite(used)
        if bad:
            raise InputError(f"init_from={self.src.path}: {bad}: the weights are damaged (saved after a divergence?); nothing was started")
        log.info(f"weights checked finite: {len(used)} tensors in {time.perf_counter() - start:.1f} s")

    def load_into(self, model: torch.nn.Module) -> None:
        import time

        from lmtrain.training.compat import local_rows

        start, read = time.perf_counter(), 0
        names = {**dict(model.named_parameters()), **{k: v for k, v in model.named_buffers() if not k.split(".")[-1].startswith("rope_")}}
        with torch.no_grad():
            for name, tensor in names.items():
                key = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                if key.endswith(".mlp.expert_bias"):  # a mixture of experts' selection bias: transformers has none (zero)
                    continue
                if key not in self.layout:
                    raise InputError(f"init_from={self.src.path}: nothing in the weights for the model's {key}")
                local, first, last = local_rows(tensor)
                if last > first:
                    rows = hf.read_ours(self.layout[key], tensor.shape, first, last, self.weights)
                    read += rows.numel() * rows.element_size()
                    local.copy_(rows.to(local.dtype))
        self.read_bytes = read
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            total = sum(self.weights.nbytes(name) for name in self.weights.shapes)
            log.info(f"weights read on this rank: {read / 2**20:,.1f} MiB, {100 * read / max(total, 1):.1f}% of the model's in {self.src.path}, "
                     f"in {time.perf_counter() - start:.1f} s")  # fmt: skip

    def offset_rows(self) -> torch.Tensor | None:
        """OPT's two rows of position offset (which our model has no use for), or None."""
        name = "model.decoder.embed_positions.weight"
        return self.weights(name, 0, 2) if self.cfg.family == "opt" and name in self.weights.shapes else None

    def keep(self, run_dir: Path) -> None:
        """``RUN/init_from/``: where the weights came from (source.json), the directory's config.json, OPT's offset rows."""
        from safetensors.torch import save_file

        folder = run_dir / FOLDER
        folder.mkdir(exist_ok=True)
        write_text_atomic(folder / "config.json", json.dumps(self.src.config, indent=2) + "\n")
        files = {f: (self.src.path / f).stat().st_size for f in sorted(self.weights.handles)}
        write_text_atomic(folder / "source.json", json.dumps({**self.src.record(), "weights": files}, indent=2) + "\n")
        rows = self.offset_rows()
        if rows is not None:
            tmp = folder / f".{OFFSET_FILE}.tmp-{os.getpid()}"
            save_file({"rows": rows.contiguous()}, str(tmp))
            os.replace(tmp, folder / OFFSET_FILE)


def kept_offset_rows(run_dir: Path) -> torch.Tensor | None:
    """The OPT offset rows a run started with ``init_from`` kept (None: the run has none)."""
    path = Path(run_dir) / FOLDER / OFFSET_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))["rows"]
