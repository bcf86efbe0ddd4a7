"""torchtitan (0.2.2) for the side-by-side rows of bench/peers/run.sh: its own trainer, model, parallelize function,
optimizer, schedule, loss and float8 converter, registered as a train spec with the rows' two shapes and fed lmtrain's
prepared token shards so that every trainer sees the same tokens.

    torchrun --nproc_per_node 1 -m torchtitan.train --experimental.custom_import bench.peers.titan_configs \
        --model.name peers_llama3 --model.flavor 1b --training.dataset_path DATASET --training.local_batch_size 8 ...

0.2.2, not the newest 0.3.0: 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``, which the GPU image's
torch 2.11 lacks (0.3.0 is built against a nightly); 0.2.2 runs on it. 0.2.2 is configured by its command line (the
JobConfig flags run.sh passes), with the model registered here through its ``--experimental.custom_import`` hook.

The one piece of ours is the data: ``_Windows`` gives torchtitan's loader lmtrain's own training samples of
``DATASET`` in lmtrain's order (bench/peers/windows.py), so both trainers see the same batches in the same order and
their losses at equal tokens differ by the trainer alone. torchtitan's own loader tokenizes text with a
Hugging Face tokenizer on the fly; the token stream is what a side-by-side needs equal, so it is the one we give it.
Its attention is its default, SDPA with the causal mask, as lmtrain (``data.document_mask=false``, its default) and
OLMo-core (no document lengths) attend in these rows, so no tokenizer is needed to find document ends.
"""

from __future__ import annotations

from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec


class _Windows(IterableDataset):
    """lmtrain's training samples in its loader's order (bench/peers/windows.py), as torchtitan's loader wants them."""

    def __init__(self, dataset: str, seq_len: int, batch_size: int, rank: int, world: int) -> None:
        from bench.peers.windows import LmtrainOrder  # the repository root is on PYTHONPATH (run.sh)

        self.samples = LmtrainOrder(dataset, seq_len, batch_size, rank, world)

    def __iter__(self):
        for x, y in self.samples:
            yield {"input": x}, y


def build_token_shards(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs) -> ParallelAwareDataloader:
    t = job_config.training
    return ParallelAwareDataloader(_Windows(t.dataset_path, t.seq_len, t.local_batch_size, dp_rank, dp_world_size), dp_rank=dp_rank,
                                   dp_world_size=dp_world_size, batch_size=t.local_batch_size)  # fmt: skip


_PLAIN_ROPE = RoPEScalingArgs(scaling_factor=1.0)  # a factor of 1 leaves every frequency as it is: plain RoPE

# bench/peers/run.sh's two shapes, in torchtitan's Llama 3 arguments as its 8B flavour is written (an untied head, its
# depth-scaled initialisation, RoPE base 500,000). 1b: Llama 3.2 1B's body, whose SwiGLU width 8192 torchtitan derives
# from 4 x 2048 x 2/3 x 1.5 rounded to 256; 125m: width 768, 12 layers, 12 heads, SwiGLU 4 x 768 x 2/3 = 2048.
SHAPES = {
    "1b": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000, rope_scaling_args=_PLAIN_ROPE),
    "125m": TransformerModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=50304,
                                 multiple_of=256, rope_theta=500000, rope_scaling_args=_PLAIN_ROPE),
}  # fmt: skip

register_train_spec(
    "peers_llama3",
    TrainSpec(
        model_cls=Transformer,
        model_args=SHAPES,
        parallelize_fn=parallelize_llama,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_token_shards,
        build_tokenizer_fn=None,
        build_loss_fn=build_cross_entropy_loss,
    ),
)
