"""OLMo-core (ai2-olmo-core 3.0.0) training for the side-by-side rows of bench/peers: its own trainer, model, data
loader and settings, after its example ``src/examples/llama/train.py``, on lmtrain's prepared token shards.

    torchrun --nproc-per-node 1 bench/peers/olmo_train.py DATASET --model llama3_1B --batch 8 --steps 40 [--fp8]

OLMo-core reads token ids from raw numpy files itself (its ``NumpyFSLDatasetConfig``, fixed-length instances cut from
the concatenated documents), which is lmtrain's shard format: the train split's ``train_*.bin`` are given to it as
they are, with the separator as its end-of-document token. Its best one-GPU settings, as its example and docs give
them: the model compiled, the loss compiled-fused, bf16 parameters under its data-parallel wrapper (FSDP over one
rank), fused AdamW, no activation checkpointing unless it does not fit, its float8 config with ``--fp8``.
The figures are read from its own log lines (``throughput/*``, ``system/GPU*``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from olmo_core.config import DType
from olmo_core.data import NumpyDataLoaderConfig, NumpyDatasetDType, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.float8 import AOFloat8LinearConfig, Float8Config
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig, CosWithWarmup, OptimGroupOverride
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import GPUMemoryMonitorCallback, SpeedMonitorCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
from olmo_core.utils import get_default_device, seed_all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dataset", help="an lmtrain prepared dataset (python -m lmtrain.data.prepare)")
    p.add_argument("--model", default="llama3_1B", help="a TransformerConfig constructor (llama3_1B, ...), or llama_125M: "
                   "Llama-like, width 768, 12 layers, 12 heads, SwiGLU 2048")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-4, help="peak; cosine to a tenth of it at the last step, as lmtrain's default")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--wd", type=float, default=0.1, help="AdamW's weight decay (betas 0.9, 0.95), none on the embeddings")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--out", default="/tmp/olmo-peer")
    args = p.parse_args()

    ds = Path(args.dataset)
    manifest = json.loads((ds / "manifest.json").read_text())
    paths = [str(ds / s["path"]) for s in manifest["splits"]["train"]["shards"]]
    eos = int(manifest["eos_id"])
    tokenizer = TokenizerConfig(vocab_size=args.vocab, eos_token_id=eos, pad_token_id=eos)
    cuda = get_default_device().type == "cuda"

    if args.model == "llama_125M":
        model_config = TransformerConfig.llama_like(d_model=768, n_layers=12, n_heads=12, vocab_size=args.vocab)
    else:
        model_config = getattr(TransformerConfig, args.model)(vocab_size=args.vocab)
    dataset_config = NumpyFSLDatasetConfig(
        sequence_length=args.seq, tokenizer=tokenizer, paths=paths, dtype=NumpyDatasetDType(manifest["dtype"]),
        work_dir=f"{args.out}/dataset-cache",
    )  # fmt: skip
    loader_config = NumpyDataLoaderConfig(global_batch_size=args.batch * args.seq, seed=0, num_workers=4 if cuda else 0)
    train_module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=args.batch * args.seq,
        max_sequence_length=args.seq,
        optim=AdamWConfig(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.wd, fused=cuda or None,
                          group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))]),
        compile_model=cuda,
        float8_config=Float8Config(enabled=True, ao=AOFloat8LinearConfig.recommended()) if args.fp8 else None,  # its cookbook's
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp, param_dtype=DType.bfloat16, reduce_dtype=DType.float32) if cuda else None,
        max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup_steps=args.warmup, alpha_f=0.1),
    )  # fmt: skip
    trainer_config = TrainerConfig(
        save_folder=f"{args.out}/save", save_overwrite=True, max_duration=Duration.steps(args.steps),
    ).with_callback("speed_monitor", SpeedMonitorCallback())  # fmt: skip
    if cuda:  # its memory monitor asks the CUDA allocator
        trainer_config = trainer_config.with_callback("gpu_monitor", GPUMemoryMonitorCallback())

    seed_all(12536)
    model = model_config.build(init_device="meta")
    train_module = train_module_config.build(model)
    dataset = dataset_config.build()
    loader = loader_config.build(dataset, dp_process_group=train_module.dp_process_group)
    trainer = trainer_config.build(train_module, loader)
    trainer.fit()


if __name__ == "__main__":
    import torch

    prepare_training_environment(backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")  # gloo: a CPU check of this script
    try:
        main()
    finally:
        teardown_training_environment()
