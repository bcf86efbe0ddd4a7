"""torchtitan (0.3.0) configs for the side-by-side rows of bench/peers/run.sh: its own trainer, model flavours and
settings, fed lmtrain's prepared token shards so that every trainer sees the same tokens.

    PEER_DATASET=DATASET torchrun --nproc_per_node 1 -m torchtitan.train --module bench.peers.titan_configs \
        --config llama_1b --training.local_batch_size 8 --training.steps 40 --dump_folder DIR

The one piece of ours is the data: ``TokenShards`` reads ``DATASET/train_*.bin`` (lmtrain.data.prepare's format: the
corpus's documents, each followed by one separator) as contiguous windows of ``seq_len + 1`` tokens, the inputs and
their next tokens, in the order lmtrain's loader reads them unshuffled. torchtitan's own loader tokenizes text with a
Hugging Face tokenizer on the fly; the token stream is what a side-by-side needs equal, so it is the one we give it.
Everything else is torchtitan's: its Llama 3 model (the ``1B`` flavour is Llama 3.2 1B's shape), its AdamW, its
warm-up and decay, its compile and float8 converters, its loss.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
import torchtitan.models.llama3 as _llama3
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer


def _shards(dataset: str) -> tuple[np.ndarray, int]:
    """The train split's tokens in manifest order, and the separator's id."""
    manifest = json.loads((Path(dataset) / "manifest.json").read_text())
    files = [Path(dataset) / s["path"] for s in manifest["splits"]["train"]["shards"]]
    return np.concatenate([np.fromfile(f, dtype=manifest["dtype"]) for f in files]), int(manifest["eos_id"])


class _Windows(IterableDataset):
    """Windows of ``seq_len + 1`` tokens, one after the other: the inputs and their next tokens. The positions given
    with them count from 0 to ``seq_len - 1`` in every window, so torchtitan's block-causal mask is plain causal, as
    lmtrain (``data.document_mask=false``, its default) and OLMo-core (no document lengths) attend in these rows."""

    def __init__(self, dataset: str, seq_len: int, rank: int, world: int) -> None:
        (self.tokens, self.eos), self.seq_len, self.rank, self.world = _shards(dataset), seq_len, rank, world

    def __iter__(self):
        n, positions = (len(self.tokens) - 1) // self.seq_len, torch.arange(self.seq_len)
        while True:  # epochs over the stream
            for i in range(self.rank, n, self.world):
                w = torch.from_numpy(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].astype(np.int64))
                yield {"input": w[:-1], "positions": positions}, w[1:]


class TokenShards(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset_path: str | None = None

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int, local_batch_size: int, **kwargs):
        path = config.dataset_path or os.environ.get("PEER_DATASET")
        super().__init__(
            _Windows(path, seq_len, dp_rank, dp_world_size), dp_rank=dp_rank, dp_world_size=dp_world_size,
            batch_size=local_batch_size, num_workers=config.num_workers, pin_memory=config.pin_memory,
        )  # fmt: skip


class NoTokenizer(BaseTokenizer):
    """The tokens are prepared already: nothing to encode."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 128256

    def __init__(self, config: Config | None = None, tokenizer_path: str = "", **kwargs) -> None:
        super().__init__()
        self.vocab = (config.vocab_size if config else 128256)

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("bench/peers: the dataset is tokenized already")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("bench/peers: the dataset is tokenized already")

    def get_vocab_size(self) -> int:
        return self.vocab


def _shape(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int, vocab: int) -> Llama3Model.Config:
    """torchtitan's Llama 3 config built as its ``8B`` flavour is (an untied head, its initialisations), at the rows'
    shape: its ``1B`` flavour is Llama 3.2 1B's body with a tied head and Llama 3's RoPE scaling, and the side-by-side
    uses an untied head of 128,256 and plain RoPE (base 500,000) in every trainer, as OLMo-core's ``llama3_1B``."""
    L = _llama3
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=L.Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=L.RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=L.Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=hidden,
            rope=L.ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000),
            attn_backend="flex",  # its registry's default; the windows' positions make its block-causal mask causal
        ),
    )  # fmt: skip


SHAPES = {  # bench/peers/run.sh's two shapes
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden=8192, vocab=128256),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden=2048, vocab=50304),
}


def _config(shape: str, fp8: bool) -> Trainer.Config:
    model = _shape(**SHAPES[shape])
    if fp8:  # its float8 how-to: the converter, with the compiled model
        for c in [Float8LinearConverter.Config(model_compile_enabled=True)]:
            model = c.build().convert(model)
    spec = ModelSpec(name="llama3", flavor=f"peers-{shape}", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=pipeline_llm, post_optimizer_build_fn=None, state_dict_adapter=Llama3StateDictAdapter)
    adamw = dict(lr=float(os.environ.get("PEER_LR", "3e-4")), betas=(0.9, 0.95), eps=1e-8)  # run.sh's LR
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path="",
        tokenizer=NoTokenizer.Config(vocab_size=SHAPES[shape]["vocab"]),
        model_spec=spec,
        optimizer=OptimizersContainer.Config(param_groups=[  # the rows' recipe: no decay on the embeddings
            ParamGroupConfig(pattern=r"tok_embeddings\..*", optimizer_name="AdamW", optimizer_kwargs={**adamw, "weight_decay": 0.0}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**adamw, "weight_decay": 0.1}),
        ]),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=20, decay_ratio=None, decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=4, seq_len=2048, steps=30, max_norm=1.0),
        dataloader=TokenShards.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=True),
        validator=Validator.Config(enable=False),
    )  # fmt: skip


def llama_1b() -> Trainer.Config:
    return _config("1b", fp8=False)


def llama_1b_fp8() -> Trainer.Config:
    return _config("1b", fp8=True)


def llama_125m() -> Trainer.Config:
    return _config("125m", fp8=False)


def llama_125m_fp8() -> Trainer.Config:
    return _config("125m", fp8=True)
