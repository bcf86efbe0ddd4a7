"""Sample a continuation from a run's newest checkpoint, with the run's own tokenizer.

    python -m lmtrain.generate RUN_DIR --prompt "def main(" [--max-new-tokens 64] [--temperature 0.8] [--top-k 50]
                                       [--seed 0] [--device auto] [--checkpoint step-0000500]

The model is rebuilt from ``RUN_DIR/config.yaml`` and loaded from the newest complete checkpoint (single-file or
sharded: a sharded checkpoint is consolidated in memory, no distributed launch needed); the tokenizer is the one
the run's dataset was prepared with. ``--temperature 0`` is greedy decoding.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from lmtrain import checkpoint as ck
from lmtrain.errors import InputError


def load_model_state(ckpt: ck.Checkpoint) -> dict[str, torch.Tensor]:
    """The model's parameters (``model.`` prefix removed) from a single-file or sharded checkpoint, on the CPU."""
    if ckpt.meta.get("format") == "sharded":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt.path, Path(tmp) / "full.pt")
            state = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)
    else:
        state = torch.load(ckpt.load_path, map_location="cpu", mmap=True, weights_only=False)
    sd = state["state_dict"]
    return {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}


def load_run(run_dir: Path, checkpoint: str | None = None, device: str = "cpu"):
    """(model in eval mode, tiktoken encoding, eos id, the checkpoint used) for a run directory."""
    from omegaconf import OmegaConf

    from lmtrain.model import Decoder, ModelConfig
    from lmtrain.tokenizer import eos_id, load_tokenizer

    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    root = run_dir / "checkpoints"
    if checkpoint:
        meta, why = ck.verify(root / checkpoint)
        if meta is None:
            raise InputError(f"checkpoint {root / checkpoint} is not usable: {why}")
        ckpt = ck.Checkpoint(int(meta["step"]), root / checkpoint, meta)
    else:
        ckpt = ck.newest(root)
        if ckpt is None:
            raise InputError(f"{run_dir} has no complete checkpoint under {root}: train with callbacks.checkpoint on first")
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if not str(k).startswith("_")}
    model = Decoder(ModelConfig(**fields))
    missing, unexpected = model.load_state_dict(load_model_state(ckpt), strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]  # buffers recomputed by the model
    if missing or unexpected:
        raise InputError(f"checkpoint {ckpt.path} does not match the run's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    spec, data_path = run_tokenizer(cfg)
    enc = load_tokenizer(spec, data_path)
    return model.to(device).eval(), enc, eos_id(enc), ckpt


def run_tokenizer(cfg) -> tuple[str, Path]:
    """(tokenizer spec, the dataset folder it is relative to) of a run, from its config and dataset manifest."""
    from lmtrain.manifest import read_manifest

    data_path = Path(cfg.data.path) if cfg.data.get("path") else Path(cfg.data.sources[0]["path"])
    return str(read_manifest(data_path)["tokenizer"]), data_path


@torch.no_grad()
def sample(
    model, ids: list[int], max_new_tokens: int, temperature: float, top_k: int | None, eos: int | None, generator, vocab: int | None = None
) -> list[int]:
    """Autoregressive sampling; ``vocab`` limits it to the tokenizer's ids (the model's table may be larger)."""
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([out[-model.cfg.max_seq_len :]], device=device)
        logits = model(ctx)[0, -1].float()  # (V,)
        if vocab is not None:
            logits = logits[:vocab]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator))
        out.append(nxt)
        if eos is not None and nxt == eos:
            break
    return out[len(ids) :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lmtrain.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--checkpoint", default=None, help="a step-N directory name (default: the newest complete one)")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        model, enc, eos, ckpt = load_run(Path(args.run_dir), args.checkpoint, device)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ids = enc.encode_ordinary(args.prompt)
    if not ids:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    new = sample(model, ids, args.max_new_tokens, args.temperature, args.top_k, eos, gen, vocab=enc.n_vocab)
    print(f"[{ckpt.path.name}, step {ckpt.step}]", file=sys.stderr)
    print(args.prompt + enc.decode([t for t in new if t != eos]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
