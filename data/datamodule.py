"""LightningDataModule over prepared token shards (see ``data.prepare``).

The train split's token stream (shards concatenated in manifest order) is cut into blocks of ``seq_len + 1``
tokens at a stride of ``seq_len``; each block gives ``input = block[:-1]`` and ``target = block[1:]``, packed
across document boundaries with the one separator kept in the stream. Shards are memory-mapped, never read
into RAM. Blocks are visited in a seeded, per-epoch shuffled order, split disjointly across ranks.

Resumable: the train loader is a ``StatefulDataLoader`` (torchdata), whose ``state_dict`` Lightning stores in
every checkpoint; with the sampler's order a pure function of (seed, epoch, world size), a resumed run sees
exactly the batches an uninterrupted one would, with or without loader workers.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from data.prepare import PrepareError, prepare, read_manifest
from lmtrain.errors import InputError
from lmtrain.tokenizer import load_tokenizer


class PackedBlocks(Dataset):
    """Blocks of ``seq_len + 1`` tokens over one split's shards, read through ``numpy.memmap``."""

    def __init__(self, directory: str | Path, split: str, seq_len: int) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if split not in manifest["splits"]:
            raise PrepareError(f"dataset {directory} has no '{split}' split")
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.shards = manifest["splits"][split]["shards"]
        self.seq_len = seq_len
        sizes = [s["num_tokens"] for s in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # start of each shard
        self.num_tokens = int(self.offsets[-1])
        for s in self.shards:
            f = self.directory / s["path"]
            expected = s["num_tokens"] * self.dtype.itemsize
            if not f.is_file() or f.stat().st_size != expected:
                got = f.stat().st_size if f.is_file() else "missing"
                raise PrepareError(f"dataset shard {f} is damaged: expected {expected} bytes, found {got}")
        self._maps: list[np.memmap] | None = None  # opened lazily, once per process

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def _read(self, start: int, length: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [np.memmap(self.directory / s["path"], dtype=self.dtype, mode="r") for s in self.shards]
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        shard = int(np.searchsorted(self.offsets, start, side="right") - 1)
        while filled < length:
            local = pos - self.offsets[shard]
            take = min(length - filled, int(self.offsets[shard + 1] - pos))
            out[filled : filled + take] = self._maps[shard][local : local + take]
            filled += take
            pos += take
            shard += 1
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = torch.from_numpy(self._read(i * self.seq_len, self.seq_len + 1))
        return block[:-1], block[1:]  # (T,), (T,)

    def __getstate__(self) -> dict:  # never pickle open memmaps into loader workers
        state = self.__dict__.copy()
        state["_maps"] = None
        return state


class BlockSampler(Sampler[int]):
    """Seeded, per-epoch shuffled block order, cut into equal disjoint parts, one per rank.

    Every rank gets the same number of blocks, ``len(dataset) // world_size`` rounded down to whole batches
    of ``batch_size`` (the remainder is dropped), so ranks never wait for each other at an epoch's end and
    "all indices handed out" means "epoch finished". The order depends only on (seed, epoch, world_size).
    """

    def __init__(
        self, num_blocks: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0, batch_size: int = 1
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.num_blocks, self.num_replicas, self.rank, self.batch_size = num_blocks, num_replicas, rank, batch_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.yielded = 0  # indices handed out in the current epoch
        self._resume_at = 0  # where the next iteration starts (non-zero only after load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_blocks // self.num_replicas // self.batch_size * self.batch_size

    def indices(self, epoch: int) -> list[int]:
        """This rank's block order for ``epoch``."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_blocks, generator=g)
        else:
            order = torch.arange(self.num_blocks)
        return order[self.rank : len(self) * self.num_replicas : self.num_replicas].tolist()

    def __iter__(self):
        order = self.indices(self.epoch)
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for idx in order[start:]:
            self.yielded += 1
            yield idx

    # Stateful (torchdata calls these): the epoch and position travel with the loader's state. Lightning creates
    # the resumed iterator before it calls set_epoch, so the epoch must come from here.
    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "yielded": self.yielded,
            "seed": self.seed,
            "num_blocks": self.num_blocks,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = {"seed": self.seed, "num_blocks": self.num_blocks, "num_replicas": self.num_replicas}
        theirs = {k: state[k] for k in mine}
        if mine != theirs:
            raise InputError(
                f"the checkpoint's data stream was {theirs}, this run's is {mine}: the dataset, data.seq_len, data.seed "
                "or the number of ranks changed, so the saved position means nothing here"
            )
        self.epoch, self._resume_at = state["epoch"], state["yielded"]
        if self._resume_at >= len(self):  # saved after the epoch's last batch: resume at the next epoch's start
            self.epoch, self._resume_at = self.epoch + 1, 0


class TokenDataModule(L.LightningDataModule):
    """Train / validation loaders over a prepared dataset.

    Args:
        path: prepared dataset directory (``manifest.json`` + shards).
        seq_len: tokens per training example (blocks hold ``seq_len + 1``).
        batch_size: micro-batch size per device.
        num_workers: loader worker processes per rank.
        seed: shuffling seed (the order is fixed by seed, epoch and world size).
        prepare: if set and ``path`` holds no dataset, build it first with ``data.prepare.prepare(**prepare)``
            (how the quickstart makes its data on first use).
        val_batch_size: micro-batch size for validation (default: ``batch_size``).
    """

    def __init__(
        self,
        path: str,
        seq_len: int = 1024,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        prepare: dict | None = None,
        val_batch_size: int | None = None,
        pin_memory: bool = True,
    ) -> None:
        super().__init__()
        self.path = Path(path)
        self.seq_len, self.batch_size, self.num_workers, self.seed = seq_len, batch_size, num_workers, seed
        self.prepare_args = dict(prepare) if prepare else None
        self.val_batch_size = val_batch_size or batch_size
        self.pin_memory = pin_memory
        self.train_set: PackedBlocks | None = None
        self.val_set: PackedBlocks | None = None

    # -- dataset on disk ----------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the dataset if it is missing and a recipe was given; safe to call from every rank at once."""
        if (self.path / "manifest.json").exists() or not self.prepare_args:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / f".{self.path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one preparer per filesystem; the others wait, then find it
            if not (self.path / "manifest.json").exists():
                prepare(output=self.path, **self.prepare_args)

    @property
    def manifest(self) -> dict:
        return read_manifest(self.path)

    def tokenizer(self):
        return load_tokenizer(self.manifest["tokenizer"], self.path)

    # -- checkpointed identity of the stream ----------------------------------------------------
    def _stream_identity(self) -> dict:
        world, _ = self._world()
        return {"dataset": self.manifest.get("fingerprint"), "data.seq_len": self.seq_len, "data.seed": self.seed, "world_size": world}

    def state_dict(self) -> dict:
        return {"stream": self._stream_identity()}

    def load_state_dict(self, state: dict) -> None:
        """Refuse, before any training, a checkpoint whose saved data position belongs to another stream."""
        saved, mine = state.get("stream", {}), self._stream_identity()
        changed = [f"{k}: {saved[k]!r} -> {mine[k]!r}" for k in mine if k in saved and saved[k] != mine[k]]
        if changed:
            raise InputError(
                "the checkpoint's data position belongs to another data stream (" + "; ".join(changed) + "): "
                "resume with the settings it was saved with"
            )

    # -- loaders ------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = PackedBlocks(self.path, "train", self.seq_len)
            self.val_set = PackedBlocks(self.path, "val", self.seq_len)

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def train_dataloader(self) -> DataLoader:
        world, rank = self._world()
        sampler = BlockSampler(len(self.train_set), world, rank, shuffle=True, seed=self.seed, batch_size=self.batch_size)
        if len(sampler) == 0:
            raise PrepareError(
                f"dataset {self.path} has {len(self.train_set)} train blocks of seq_len={self.seq_len}: fewer than "
                f"data.batch_size={self.batch_size} per rank across {world} rank(s)"
            )
        return self._loader(self.train_set, sampler, self.batch_size, drop_last=True, stateful=True)

    def val_dataloader(self) -> DataLoader:
        world, rank = self._world()
        # fixed and identical across runs: no shuffle, the same blocks for the same world size
        sampler = BlockSampler(len(self.val_set), world, rank, shuffle=False)
        return self._loader(self.val_set, sampler, self.val_batch_size, drop_last=False)

    def _loader(self, dataset, sampler, batch_size: int, drop_last: bool, stateful: bool = False) -> DataLoader:
        cls = StatefulDataLoader if stateful else DataLoader
        return cls(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=drop_last,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )
