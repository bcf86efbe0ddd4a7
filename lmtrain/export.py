"""Export a run's checkpoint as one consolidated safetensors file with its model config and tokenizer.

    python -m lmtrain.export RUN_DIR --out DIR [--format lmtrain|hf] [--checkpoint step-0000500] [--dtype float32|bfloat16|float16] [--force]

Reads the newest complete checkpoint (or the named one), single-file or sharded (a sharded checkpoint is
consolidated in memory: no distributed launch), and writes

* ``DIR/model.safetensors``: the decoder's weights, names as in :class:`lmtrain.nn.model.Decoder` (a tied output
  head is stored once, as ``tok_emb.weight``);
* ``DIR/config.json``: the model config, the tokenizer, the separator id, the dtype and where the weights came from;
* ``DIR/tokenizer.tiktoken``: the run's ranks file, when the run used one (named tiktoken encodings are recorded by
  name).

:func:`load` rebuilds the model from these with PyTorch, safetensors and tiktoken alone (no Lightning, no Hydra).

``--format hf`` writes what Hugging Face ``transformers`` loads instead (lmtrain.formats.hf):
``AutoModelForCausalLM.from_pretrained(DIR)`` gives ``OPTForCausalLM`` or ``LlamaForCausalLM`` computing the same
logits, ``AutoTokenizer.from_pretrained(DIR)`` the same token ids (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``).
An existing non-empty ``DIR`` is refused unless ``--force``; the files appear together (written to a temporary
folder beside ``DIR``, then renamed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from lmtrain.console import help_text
from lmtrain.errors import InputError

FORMAT = "lmtrain-export/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = ("lmtrain", "hf")


def export(
    run_dir: Path, out: Path, checkpoint: str | None = None, dtype: str = "float32", force: bool = False, fmt: str = "lmtrain"
) -> dict:
    """Write the export (see the module docstring); returns its config.json content."""
    from safetensors.torch import save_file

    from lmtrain.formats import hf
    from lmtrain.formats.trained import load_run, read_config, run_tokenizer

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: use one of {list(DTYPES)}")
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: use one of {list(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise InputError(f"{out} exists and is not empty: choose another --out or pass --force to replace it")
    model, enc, eos, ckpt = load_run(Path(run_dir), checkpoint, "cpu")  # a bad run directory: refused before writing
    if fmt == "hf":
        bos_text = getattr(enc, "bos", None)  # a tokenizer.json's own (lmtrain.formats.tokenizer.JsonTokenizer)
        bos = enc.encode_single_token(bos_text) if bos_text else None
        hf_config = hf.config(model.cfg, eos, dtype, bos)  # what transformers cannot express: refused before writing
    try:  # where the files go: checked before the weights are converted
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise InputError(f"cannot write the export to {out}: {exc.strerror or exc}") from exc
    cfg = read_config(Path(run_dir))
    state = {}
    seen: dict[int, str] = {}
    tied = {}
    for name, tensor in model.state_dict(keep_vars=False).items():
        if name.startswith("rope_"):
            continue  # recomputed from the config
        key = tensor.untyped_storage().data_ptr()
        if key in seen:  # a tied weight: stored once
            tied[name] = seen[key]
            continue
        seen[key] = name
        state[name] = tensor.detach().to(DTYPES[dtype]).contiguous()
    spec, data_path = run_tokenizer(cfg)
    ranks = Path(spec) if Path(spec).is_absolute() else data_path / spec
    meta = {
        "format": FORMAT,
        "model": model.cfg.to_dict(),
        "tokenizer": Path(spec).name if spec.endswith((".tiktoken", ".json")) else spec,
        "eos_id": eos,
        "n_vocab": enc.n_vocab,
        "dtype": dtype,
        "tied": tied,
        "source": {
            "run_dir": str(Path(run_dir).resolve()),
            "run_name": str(cfg.get("run_name", "")),
            "checkpoint": ckpt.path.name,
            "step": ckpt.step,
            "tokens_seen": ckpt.meta.get("tokens_seen"),
            "format": ckpt.meta.get("format"),
        },
    }
    old = None
    try:
        tmp.chmod(0o755)
        if fmt == "hf":
            _write_hf(tmp, model, ranks if spec.endswith((".tiktoken", ".json")) else None, enc, eos, dtype, hf_config, meta)
        else:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT, "step": str(ckpt.step)})
            if spec.endswith(".tiktoken"):
                shutil.copyfile(ranks, tmp / "tokenizer.tiktoken")
            elif spec.endswith(".json"):  # a tokenizer.json and the config naming its separator
                _copy_json_tokenizer(ranks, tmp)
            (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():  # --force: the previous export is set aside until the new one is in place
            old = out.parent / f".{out.name}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not out.exists():
            old.rename(out)
        raise InputError(f"cannot write the export to {out}: {exc.strerror or exc}; nothing there was changed") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    return meta


def _copy_json_tokenizer(path: Path, tmp: Path) -> None:
    from lmtrain.formats.tokenizer import JSON_CONFIG

    shutil.copyfile(path, tmp / "tokenizer.json")
    if (path.parent / JSON_CONFIG).is_file():
        shutil.copyfile(path.parent / JSON_CONFIG, tmp / JSON_CONFIG)


def _write_hf(tmp: Path, model, ranks_file: Path | None, enc, eos: int, dtype: str, hf_config: dict, meta: dict) -> None:
    """The Hugging Face files (lmtrain.formats.hf) into ``tmp``; ``meta`` (where the weights came from) is kept as
    ``lmtrain.json`` beside them."""
    from safetensors.torch import save_file

    from lmtrain.formats import hf
    from lmtrain.formats.tokenizer import EOS_TEXT, GPT2_PATTERN, load_ranks
    from lmtrain.training.init_from import kept_offset_rows

    if ranks_file is None:
        raise InputError(
            f"--format hf: the run's tokenizer is the named encoding {meta['tokenizer']!r}; only a ranks file (bpe:N, .tiktoken) "
            "or a tokenizer.json converts yet"
        )

    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("rope_")}
    rows = kept_offset_rows(meta["source"]["run_dir"])  # a run started with init_from: its directory's OPT offset rows
    weights = {k: v.to(DTYPES[dtype]) for k, v in hf.state_dict(state, model.cfg, rows).items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(hf.dumps(hf_config))
    generation = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": eos, "pad_token_id": eos}
    (tmp / "generation_config.json").write_text(hf.dumps(generation))
    if ranks_file.suffix == ".json":  # already Hugging Face's: as it is, with a config naming its separator
        shutil.copyfile(ranks_file, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(hf.dumps(hf.tokenizer_config(enc.separator, enc.bos)))
    else:
        (tmp / "tokenizer.json").write_text(hf.tokenizer_json(load_ranks(ranks_file), GPT2_PATTERN, {EOS_TEXT: eos}))
        (tmp / "tokenizer_config.json").write_text(hf.dumps(hf.tokenizer_config(EOS_TEXT)))
    (tmp / "lmtrain.json").write_text(hf.dumps({**meta, "format": "hf"}))


def load(export_dir: str | Path, device: str = "cpu", dtype: str | None = None):
    """(model in eval mode, tiktoken encoding, config dict) from an export: PyTorch, safetensors and tiktoken only.

    ``dtype``: the model's parameter dtype (``float32``, ``bfloat16``, ``float16``); None: the stored one."""
    from safetensors.torch import load_file

    from lmtrain.formats.tokenizer import load_tokenizer
    from lmtrain.nn.model import Decoder, ModelConfig

    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise InputError(f"{export_dir} is not an lmtrain export (no config.json)")
    meta = json.loads((export_dir / "config.json").read_text())
    if meta.get("format") != FORMAT:
        raise InputError(f"{export_dir}/config.json: format {meta.get('format')!r}, expected {FORMAT!r}")
    with torch.device("meta"):
        model = Decoder(ModelConfig.as_trained(meta["model"]))
    model.to_empty(device=device)
    if model.cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie the output head again
        model.lm_head.weight = model.tok_emb.weight
    model.init_weights()  # buffers (rotary tables); every parameter is overwritten below
    state = load_file(str(export_dir / "model.safetensors"), device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_") and k not in meta.get("tied", {})]
    if missing or unexpected:
        raise InputError(f"{export_dir}/model.safetensors does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    enc = load_tokenizer(meta["tokenizer"], export_dir)
    return model.to(DTYPES[dtype or meta["dtype"]]).eval(), enc, meta


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.export") -> int:
    p = argparse.ArgumentParser(prog=prog, description=help_text(__doc__, prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--checkpoint", default=None, help="a step-N directory name (default: the newest complete one)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--format", default="lmtrain", choices=list(FORMATS), help="lmtrain (default) or hf (Hugging Face transformers)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)
    try:
        meta = export(Path(args.run_dir), Path(args.out), args.checkpoint, args.dtype, args.force, args.format)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = stored_params(Path(args.out) / "model.safetensors")
    src = meta["source"]
    print(
        f"exported {src['checkpoint']} (step {src['step']}, {src['format']}) of {args.run_dir}: {n:,} parameters, {args.dtype}, to {args.out}"
    )
    return 0


def stored_params(path: Path) -> int:
    """Numbers stored in a safetensors file (read from its header)."""
    import math

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return sum(math.prod(fh.get_slice(key).get_shape()) for key in fh.keys())


if __name__ == "__main__":
    raise SystemExit(main())
