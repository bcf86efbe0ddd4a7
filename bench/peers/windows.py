"""lmtrain's training samples in its loader's order, for a peer trainer's own loader (bench/peers/titan_configs.py):
with the same dataset, sequence length, batch and seed, a peer then trains on the batches lmtrain trains on, in the
same order, and the rows' losses at equal tokens differ by the trainer alone.

The samples are lmtrain's (data.datamodule.TokenDataModule's train set: windows of ``seq_len + 1`` tokens at a stride
of ``seq_len``, the inputs and their next tokens) and so is the order (its BlockSampler: seeded epochs, each cut to
whole steps, every ``world``-th sample from ``rank``): nothing is re-implemented, so nothing can drift. Imports only
lmtrain (torch, numpy, lightning, torchdata), no peer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

SEED = 1234  # lmtrain's default ``seed`` (conf/train.yaml): what its loader's order is drawn from


class LmtrainOrder(IterableDataset):
    """``(input, target)`` pairs of ``seq_len`` tokens each, endlessly, epoch after epoch, in lmtrain's order for
    ``batch_size`` samples a step on data-parallel rank ``rank`` of ``world``."""

    def __init__(self, dataset: str, seq_len: int, batch_size: int, rank: int = 0, world: int = 1, seed: int = SEED) -> None:
        from lmtrain.data.datamodule import BlockSampler, TokenDataModule

        self.data = TokenDataModule(path=dataset, seq_len=seq_len, batch_size=batch_size, seed=seed)
        self.data.setup("fit")
        self.sampler = BlockSampler(self.data.train_set.sizes, world, rank, shuffle=True, seed=seed, batch_size=batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            for i in self.sampler:
                x, y = self.data.train_set[i][:2]
                yield x, y
            epoch += 1
