"""litgpt (0.5.13) for the side-by-side rows of bench/peers/run.sh: its own ``litgpt pretrain`` (Fabric, its GPT model
compiled, bf16-mixed, fused AdamW, its warm-up and cosine schedule, its chunked cross-entropy), with the shapes in
bench/peers/litgpt_1b.yaml and litgpt_125m.yaml, fed lmtrain's prepared token shards so that every trainer sees the
same tokens:

    python3 -m litgpt pretrain --config bench/peers/litgpt_1b.yaml --data bench.peers.litgpt_data.LmtrainTokens \
        --data.path DATASET --train.micro_batch_size 8 --train.global_batch_size 8 ...

The one piece of ours is the data, as for torchtitan (bench/peers/titan_configs.py): litgpt's loader is given
lmtrain's own training samples of DATASET in lmtrain's order (bench/peers/windows.py), each as the ``seq_len + 1``
tokens litgpt's pretraining loop cuts into inputs and targets, so the losses at equal tokens differ by the trainer
alone. Its validation batches are lmtrain's validation windows (its start-up runs two of them as a check).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, IterableDataset


class _InOrder:
    """A dataset's ``(input, target)`` pairs in index order, anew at each pass (litgpt validates more than once)."""

    def __init__(self, blocks) -> None:
        self.blocks = blocks

    def __iter__(self):
        for i in range(len(self.blocks)):
            yield self.blocks[i][:2]


class _Whole(IterableDataset):
    """Each ``(input, target)`` pair as the window it was cut from: the input and the target's last token."""

    def __init__(self, pairs) -> None:
        self.pairs = pairs

    def __iter__(self):
        for x, y in self.pairs:
            yield torch.cat([x, y[-1:]])


@dataclass
class LmtrainTokens(DataModule):
    """An lmtrain prepared dataset (``python -m lmtrain.data.prepare``) as litgpt's pretraining data."""

    path: str = ""
    """The dataset's folder."""
    seed: int = 1234
    """lmtrain's default seed, from which its loader's order is drawn."""
    batch_size: int = field(init=False, repr=False, default=1)
    seq_length: int = field(init=False, repr=False, default=2048)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size, self.seq_length = batch_size, max_seq_length or self.seq_length

    def train_dataloader(self) -> DataLoader:
        from bench.peers.windows import LmtrainOrder  # the repository root is on PYTHONPATH (run.sh)

        order = LmtrainOrder(self.path, self.seq_length, self.batch_size, seed=self.seed)
        return DataLoader(_Whole(order), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        from lmtrain.data.datamodule import TokenDataModule

        data = TokenDataModule(path=self.path, seq_len=self.seq_length, batch_size=self.batch_size, seed=self.seed)
        data.setup("fit")
        return DataLoader(_Whole(_InOrder(data.val_set)), batch_size=self.batch_size)
