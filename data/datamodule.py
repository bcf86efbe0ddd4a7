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
import gc
from collections import deque
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lmtrain.data.prepare import CHECKSUM, PrepareError, prepare, read_manifest, shard_checksum
from lmtrain.errors import InputError
from lmtrain.formats import order as order_file
from lmtrain.formats.tokenizer import load_tokenizer, tokenizer_identity
from lmtrain.nn.model import document_ids
from lmtrain.training.workers import answer_stack_requests

VERIFY_ON_OPEN_BYTES = 1 << 30  # a split this small has its shard checksums checked when opened; larger: --verify


_ADDED_STREAM_KEYS = ("format", "shards")  # parts of the stream identity that older checkpoints did not record


def _stream_change(key: str, saved, now, paths: list[Path]) -> str:
    """One changed part of the stream identity, said: the shards by source and name, the rest as saved -> now."""
    if key != "shards" or not isinstance(saved, list) or len(saved) != len(now):
        return f"{key}: {saved!r} -> {now!r}"
    said = []
    for path, old, new in zip(paths, saved, now, strict=True):
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                what = "added" if name not in old else "removed" if name not in new else f"content {old[name]} -> {new[name]}"
                said.append(f"{path / name} {what}")
    return "training shards changed: " + ", ".join(said)


class PackedBlocks(Dataset):
    """Blocks of ``seq_len + 1`` tokens over one split's shards, read through ``numpy.memmap``."""

    def __init__(self, directory: str | Path, split: str, seq_len: int, document_mask: bool = False) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        self.separator = int(manifest["eos_id"]) if document_mask else None  # set: each block also gives its document ids
        if split not in manifest["splits"]:
            raise PrepareError(f"dataset {directory} has no '{split}' split")
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.shards = manifest["splits"][split]["shards"]
        self.seq_len = seq_len
        sizes = [s["num_tokens"] for s in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # start of each shard
        self.num_tokens = int(self.offsets[-1])
        self.vocab_size = int(manifest["vocab_size"])
        small = self.num_tokens * self.dtype.itemsize <= VERIFY_ON_OPEN_BYTES  # checksums too: about a second
        for s in self.shards:
            f = self.directory / s["path"]
            expected = s["num_tokens"] * self.dtype.itemsize
            if not f.is_file() or f.stat().st_size != expected:
                got = f.stat().st_size if f.is_file() else "missing"
                raise PrepareError(f"dataset shard {f} is damaged: expected {expected} bytes, found {got}")
            if small and CHECKSUM in s and shard_checksum(f) != s[CHECKSUM]:
                raise PrepareError(
                    f"dataset shard {f} is damaged: its checksum does not match the manifest (the file changed after it was "
                    f"prepared); prepare the dataset again (python -m lmtrain.data.prepare --force ...)"
                )
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

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        ids = self._read(i * self.seq_len, self.seq_len + 1)
        if ids.max(initial=0) >= self.vocab_size:  # a damaged shard: on a GPU the embedding would die in a device assert
            raise PrepareError(self._bad_id(i * self.seq_len, ids))
        block = torch.from_numpy(ids)
        if self.separator is None:
            return block[:-1], block[1:]  # (T,), (T,)
        return block[:-1], block[1:], document_ids(block[:-1], self.separator)  # and each input token's document (T,)

    def _bad_id(self, start: int, ids: np.ndarray) -> str:
        pos = start + int(np.argmax(ids >= self.vocab_size))
        shard = int(np.searchsorted(self.offsets, pos, side="right") - 1)
        return (
            f"dataset shard {self.directory / self.shards[shard]['path']} is damaged: token id {int(ids[pos - start])} at token "
            f"{pos - int(self.offsets[shard])} of the shard is not below the vocabulary ({self.vocab_size}); check it with "
            f"python -m lmtrain.data.prepare --verify {self.directory}"
        )

    def __getstate__(self) -> dict:  # never pickle open memmaps into loader workers
        state = self.__dict__.copy()
        state["_maps"] = None
        return state


class MixedBlocks(Dataset):
    """Several sources' blocks end to end: index ``offsets[k] + b`` is block ``b`` of source ``k``."""

    def __init__(self, parts: list[PackedBlocks]) -> None:
        self.parts = parts
        self.sizes = [len(p) for p in parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        k, b = self.locate(i)
        return self.parts[k][int(b)]

    def locate(self, i):
        """(source, block in that source) of index ``i``, or of each of an array of indices."""
        k = np.searchsorted(self.offsets, i, side="right") - 1
        return (int(k), i - int(self.offsets[k])) if np.ndim(k) == 0 else (k, i - self.offsets[k])


def mixture_counts(total: int, weights: list[float]) -> np.ndarray:
    """``total`` split in proportion to ``weights`` by largest remainder: exact, sums to ``total``."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    exact = w * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class BlockSampler(Sampler[int]):
    """Seeded, per-epoch shuffled block order over one or several sources, cut into equal disjoint parts per rank.

    ``sizes`` are the sources' block counts (an int for one source); indices refer to their concatenation
    (:class:`MixedBlocks`). An epoch has ``sum(sizes)`` samples; source ``k`` contributes exactly its share
    ``weights[k]`` of them (largest remainder), interleaved in a seeded random order. Each source is read in
    passes: a seeded permutation of all its blocks per pass, continued across epochs, so within a pass no block
    repeats and a source with a large weight is simply read more often. Unweighted (one source), an epoch is one
    pass over a fresh permutation.

    The epoch's order is one global sequence that depends only on (seed, epoch, sizes, weights), never on the
    number of ranks. Rank ``r`` of ``W`` reads its elements ``r, r+W, r+2W, ...``, so the ranks together consume
    the sequence front to back, ``W`` samples at a time, and one optimizer step (``W`` ranks x ``accumulate``
    micro-batches of ``batch_size``) always takes the next ``global batch`` samples of it, whatever ``W`` is. The
    position saved with a checkpoint is therefore global (samples of the sequence consumed so far), and a run
    resumed on another number of ranks continues from it: every sample not yet read in the epoch is read once.

    Every rank gets the same number of samples, rounded down to whole optimizer steps (``batch_size x accumulate``
    per rank), so an epoch never ends inside an accumulation and ranks never wait for each other at its end;
    "all indices handed out" means "epoch finished". ``shuffle=False`` gives the sources' blocks in order
    (validation).
    """

    def __init__(
        self,
        sizes: int | list[int],
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
        weights: list[float] | None = None,
        accumulate: int = 1,
        stages: list[tuple[int, list[float]]] | None = None,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} not in [0, {num_replicas})")
        self.sizes = [int(sizes)] if isinstance(sizes, (int, np.integer)) else [int(s) for s in sizes]
        self.weights = [float(w) for w in weights] if weights is not None else [float(max(s, 1)) for s in self.sizes]
        # stages: the mixture's later stages, (first step, weights), in step order; stage 0 is ``weights`` from step 1.
        # The last may begin with the operator's decay (first step None: decay_from once the decay is given)
        self.stages = [(None if first is None else int(first), [float(w) for w in ws]) for first, ws in stages or []]
        for ws in [self.weights, *(ws for _, ws in self.stages)]:
            if len(ws) != len(self.sizes) or any(not w >= 0 for w in ws) or not sum(ws) > 0:
                raise ValueError(f"weights {ws} must be >= 0, not all 0, one per source {self.sizes}")
        fixed = [f for f, _ in self.stages if f is not None]
        if any(f is None for f, _ in self.stages[:-1]) or any(not 1 < a < b for a, b in zip(fixed, fixed[1:] + [float("inf")])):
            raise ValueError(f"stages must begin at increasing steps after step 1, the decay's last: {[f for f, _ in self.stages]}")
        self.decay_from: int | None = None  # the first step of the decay's stage, once the operator's decay is given
        self.num_blocks = sum(self.sizes)
        self.num_replicas, self.rank, self.batch_size, self.accumulate = num_replicas, rank, batch_size, max(int(accumulate), 1)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.stage_counts = [mixture_counts(self.num_blocks, ws) for ws in [self.weights, *(ws for _, ws in self.stages)]]
        self.stage = 0  # the stage being read, and the epoch each stage so far began with
        self.stage_epochs = [0]
        self.steps_done = None  # a callable: optimizer steps trained so far (the trainer's global step), with stages
        self._iter_step: int | None = None  # the step the current iteration's first batch is for
        self.start = 0  # global position where this epoch's iteration started (non-zero after a resume)
        self.yielded = 0  # indices this rank handed out since ``start``
        self._resume: tuple[int, int] | None = None  # (epoch, start) set by load_state_dict for the next iteration
        self.skip_on_load = 0  # samples per rank to skip past a restored position (a rollback's skipped data window)
        self._drawn: tuple[int, np.ndarray] | None = None  # (epoch, its global order): order_of's cache
        self._digest: tuple[int, str] | None = None  # (epoch, its order's fingerprint): order_digest's cache
        self.handed_out: deque[tuple[int, int]] = deque()  # (epoch, global position) of each batch started, not yet trained
        self.order_dir: Path | None = None  # a run directory: each epoch's order stored there as it is first read

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def unit(self) -> int:
        """Samples per rank per optimizer step: the epoch is cut into whole steps."""
        return self.batch_size * self.accumulate

    def _remaining(self, start: int) -> int:
        """Samples per rank from global position ``start`` to the epoch's end (whole steps, equal on every rank)."""
        return max(0, self.num_blocks - start) // (self.num_replicas * self.unit) * self.unit

    def __len__(self) -> int:
        return self._remaining(0)

    @property
    def position(self) -> int:
        """Samples of the epoch's global order consumed by all ranks together."""
        return self.start + self.yielded * self.num_replicas

    def done_in_epoch(self) -> int:
        """Samples per rank that count as read in the current epoch (``len(self)`` minus what is left from ``start``):
        what a run on this many ranks would have read at this point, for the training loop's counters."""
        return len(self) - self._remaining(self.start)

    def _permutation(self, n: int, *key: int) -> np.ndarray:
        return np.random.default_rng([self.seed, *key]).permutation(n)

    def _source_blocks(self, k: int, start: int, count: int) -> np.ndarray:
        """Blocks ``start .. start+count`` of source ``k``'s endless stream of seeded passes."""
        n = self.sizes[k]
        out = np.empty(count, dtype=np.int64)
        pos = 0
        while pos < count:
            p, r = divmod(start + pos, n)
            take = min(count - pos, n - r)
            out[pos : pos + take] = self._permutation(n, 1, k, p)[r : r + take]
            pos += take
        return out

    @property
    def counts(self) -> np.ndarray:
        """Samples per source per epoch in the stage being read."""
        return self.stage_counts[self.stage]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Every sample of ``epoch`` as an index into the concatenated sources (all ranks' together), in the stage
        being read."""
        return self.staged_order(epoch, self.stage, self.stage_epochs)

    def staged_order(self, epoch: int, stage: int, stage_epochs: list[int]) -> np.ndarray:
        """``epoch``'s order in ``stage``, the stages so far having begun with ``stage_epochs``. Each source is read
        on from where the stages before left its stream: a stage's epochs take up each source's passes after the
        epochs of the stages before (an epoch cut short by a stage's end counts whole), so no block repeats within a
        pass across a stage change either. Stage 0's orders are the unstaged mixture's."""
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        if not self.shuffle:
            return np.arange(self.num_blocks, dtype=np.int64)
        counts = self.stage_counts[stage]
        first = np.zeros(len(self.sizes), dtype=np.int64)  # each source's stream position at the stage's first epoch
        for j in range(stage):
            first += (stage_epochs[j + 1] - stage_epochs[j]) * self.stage_counts[j]
        at = first + (epoch - stage_epochs[stage]) * counts
        if len(self.sizes) == 1:
            return self._source_blocks(0, int(at[0]), self.num_blocks)
        key = (0, epoch) if stage == 0 else (0, epoch, stage)
        source = np.repeat(np.arange(len(self.sizes)), counts)[self._permutation(self.num_blocks, *key)]
        order = np.empty(self.num_blocks, dtype=np.int64)
        for k, c in enumerate(counts):
            if c:
                order[source == k] = offsets[k] + self._source_blocks(k, int(at[k]), int(c))
        return order

    def _first(self, stage: int) -> int | None:
        """The first step of later stage ``stage`` (1..), None while it has none (a decay's stage not yet given)."""
        first = self.stages[stage - 1][0]
        return self.decay_from if first is None else first

    def stage_at(self, step: int) -> int:
        """The stage training step ``step`` (counted from 1) reads."""
        return sum((f := self._first(i)) is not None and f <= step for i in range(1, len(self.stages) + 1))

    def stage_end(self, stage: int) -> int | None:
        """The last step of ``stage``; None for the last stage, or while the next one has no first step."""
        first = self._first(stage + 1) if stage < len(self.stages) else None
        return None if first is None else first - 1

    def begin_decay(self, first: int) -> None:
        """The decay's stage begins at step ``first`` (lmtrain.callbacks.lr_control, when the operator's decay is
        given). The loader must not have drawn that step's samples yet: lr_control gives the decay enough steps of lead
        for the loader's read-ahead; a step drawn already is an error, not a silent mix of two stages."""
        drawn = (self._iter_step - 1 + -(-self.yielded // self.unit)) if self._iter_step is not None else 0
        if drawn >= first:
            raise RuntimeError(f"the data of step {drawn} is drawn already: the decay's stage cannot begin at step {first}")
        self.decay_from = first

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's sample order for ``epoch`` from global position ``start``."""
        n, w = self._remaining(start), self.num_replicas
        return self.order_of(epoch)[start + self.rank : start + n * w : w]

    def order_of(self, epoch: int) -> np.ndarray:
        """``epoch_order(epoch)``, drawn once an epoch for the iteration and its fingerprint (order_digest) alike."""
        if self._drawn is None or self._drawn[0] != (epoch, self.stage):
            self._drawn = ((epoch, self.stage), self.epoch_order(epoch))
        return self._drawn[1]

    def __iter__(self):
        if self._resume is not None:
            (self.epoch, self.start), self._resume = self._resume, None
        else:
            self.start = 0
        self.yielded = 0
        self.handed_out.clear()
        step = None  # with stages: the step the next batch is for
        if self.stages:
            step = self._iter_step = (self.steps_done() if self.steps_done is not None else 0) + 1
            want = self.stage_at(step)
            if want != self.stage:
                if self.start:  # resumed inside the epoch the last stage ended in: it ends here, unread
                    return
                self.stage_epochs = [*self.stage_epochs[: self.stage + 1], *[self.epoch] * (want - self.stage)]
                self.stage = want  # the new stage begins with this epoch
        if self.order_dir is not None:
            self._store_order(self.epoch)
        for idx in self.indices(self.epoch, self.start):
            if step is not None and self.yielded % self.unit == 0:  # a step begins: past its stage's last? (the
                end = self.stage_end(self.stage)  # decay's stage may have been given a first step since)
                if end is not None and step + self.yielded // self.unit > end:
                    return  # the stage's last step drawn: this epoch ends here
            if self.yielded % self.batch_size == 0:  # a batch begins: where in the epoch's global order (the audit's record)
                self.handed_out.append((self.epoch, self.position))
            self.yielded += 1
            yield int(idx)

    def _store_order(self, epoch: int) -> None:
        """The epoch's order written to ``order_dir`` (lmtrain.formats.order) unless it is there; a disk that cannot
        take it is said and the run goes on (the audit then recomputes the order, as for a run from before the files)."""
        try:
            order_file.store(self.order_dir, epoch, self.order_of(epoch), self.order_digest(epoch))
        except OSError as exc:
            import logging

            logging.getLogger("lmtrain").warning(f"the sample order of epoch {epoch} was not stored in {self.order_dir}: {exc}")

    def trained(self) -> tuple[int, int] | None:
        """(epoch, global position) of the oldest batch handed out and not yet claimed: the loader hands batches to the
        training loop in the order their indices were drawn, so the training step claims its own batch's here, however
        far the loader's workers have read ahead. None when no batch was drawn from this sampler."""
        return self.handed_out.popleft() if self.handed_out else None

    # Stateful (torchdata calls these): the epoch and position travel with the loader's state. Lightning creates
    # the resumed iterator before it calls set_epoch, so the epoch must come from here.
    def _identity(self) -> dict:
        """What a saved position means something for (the stages apart: :meth:`resume_point` compares those begun)."""
        return {"seed": self.seed, "sizes": self.sizes, "weights": self.weights}

    def order_digest(self, epoch: int) -> str:
        """The fingerprint of ``epoch``'s global sample order (blake2b of its indices), computed once an epoch: saved with
        the position, so a resume whose order would differ (another numpy, another lmtrain) is refused, not trained."""
        if self._digest is None or self._digest[0] != (epoch, self.stage):
            self._digest = ((epoch, self.stage), order_file.fingerprint(self.order_of(epoch)))
        return self._digest[1]

    def state_dict(self) -> dict:
        geometry = {"num_replicas": self.num_replicas, "batch_size": self.batch_size, "accumulate": self.accumulate}
        order = {"order": self.order_digest(self.epoch)}
        staged = {"stages": stages_identity(self.stages), "stage": self.stage, "stage_epochs": list(self.stage_epochs)} if self.stages else {}
        return {"epoch": self.epoch, "position": self.position, **geometry, **self._identity(), **order, **staged}

    def resume_point(self, state: dict) -> tuple[int, int]:
        """(epoch, global start) at which a run with this sampler's ranks continues from a saved ``state``: the saved
        position (older checkpoints kept a per-rank count) plus a rollback's skip, moved to the next epoch when this
        many ranks have no whole step left in the saved one."""
        mine = self._identity()
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            raise InputError(
                f"the checkpoint's data stream was {theirs}, this run's is {mine}: the dataset, data.seq_len, data.seed "
                "or the mixture weights changed, so the saved position means nothing here"
            )
        saved_stage = int(state.get("stage", 0))  # the stages begun must be the saved ones; those to come may change
        begun, saved_begun = stages_identity(self.stages)[:saved_stage], (state.get("stages") or [])[:saved_stage]
        if begun != saved_begun:
            raise InputError(
                f"the checkpoint's data was read in stage {saved_stage} of data.stages {state.get('stages')}, this run's "
                f"stages are {stages_identity(self.stages)}: a stage begun cannot change, only those still to come"
            )
        position = state["position"] if "position" in state else state["yielded"] * state["num_replicas"]
        epoch, start = int(state["epoch"]), int(position)
        if self.stages:  # the stage the position is in (its order is that stage's)
            self.stage, self.stage_epochs = saved_stage, [int(e) for e in state.get("stage_epochs", [0])]
        if "order" in state and state["order"] != self.order_digest(epoch):  # checkpoints from before 2026-12-07 lack it
            raise InputError(
                f"the checkpoint's sample order of epoch {epoch} (fingerprint {state['order']}) is not the one this run draws "
                f"({self.order_digest(epoch)}) from the same data, seed and weights: the numpy or lmtrain that draws it changed, "
                "so the saved position would read other samples; resume with the versions it was saved with"
            )
        if self._remaining(start) == 0:  # saved at this many ranks' end of the epoch (what is left is no whole step)
            epoch, start = epoch + 1, 0
        start += self.skip_on_load * self.num_replicas
        while self._remaining(start) == 0 and len(self) > 0:  # past the epoch's last step (saved there, or skipped past it)
            epoch, start = epoch + 1, max(0, start - len(self) * self.num_replicas)
        return epoch, start

    def load_state_dict(self, state: dict) -> None:
        self._resume = self.resume_point(state)
        self.epoch, self.start, self.yielded = *self._resume, 0


class TokenDataModule(L.LightningDataModule):
    """Train / validation loaders over one prepared dataset, or a weighted mixture of several.

    Args:
        path: prepared dataset directory (``manifest.json`` + shards).
        sources: instead of ``path``, a mixture: ``[{path: A, weight: 0.7}, {path: B, weight: 0.3}]``. Every
            source must use the same tokenizer (prepare the others with ``--tokenizer A/tokenizer.tiktoken``).
            Each epoch draws exactly ``weight / sum(weights)`` of its samples from each source, in a seeded
            order (see :class:`BlockSampler`). Validation runs over each source's validation split on its own,
            reported as ``val/loss/<name>`` (``name:`` in the entry, else the dataset folder's name), and over all
            of them together as ``val/loss``.
        seq_len: tokens per training example (blocks hold ``seq_len + 1``).
        batch_size: micro-batch size per device.
        num_workers: loader worker processes per rank.
        seed: shuffling and mixing seed (the order is fixed by seed, epoch, world size and the sources).
        prepare: if set and ``path`` holds no dataset, build it first with ``data.prepare.prepare(**prepare)``
            (how the quickstart makes its data on first use).
        val_batch_size: micro-batch size for validation (default: ``batch_size``).
        extra_val: further held-out datasets, ``[{name: N, path: DIR}, ...]``, prepared with the training data's
            tokenizer: each validated on its own (its ``val`` split, or its ``train`` split where it has no validation
            tokens) and reported as ``val/loss/N``, outside the combined ``val/loss``.
        document_mask: batches also carry each token's document within its sequence (the separator counts with the
            document it ends), and the model keeps attention inside each document and restarts positions at each
            document's start (lmtrain.nn.model.document_mask); training and validation alike.
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        prepare: dict | None = None,
        val_batch_size: int | None = None,
        pin_memory: bool = True,
        sources: list[dict] | None = None,
        document_mask: bool = False,
        extra_val: list[dict] | None = None,
        stages: list[dict] | None = None,
    ) -> None:
        super().__init__()
        self.document_mask = bool(document_mask)
        self.paths, self.weights, names = _resolve_sources(path, sources, staged=bool(stages))
        self.stages = _resolve_stages(stages, names, self.weights)
        extra_paths, extra_names = _resolve_extra_val(extra_val, names)
        self.val_paths = self.paths + extra_paths
        self.val_names = names + extra_names  # one validation loader each (when more than one): val/loss/<name>
        self.val_combined = [True] * len(self.paths) + [False] * len(extra_paths)  # which make up val/loss
        self.path = self.paths[0]
        self.seq_len, self.batch_size, self.num_workers, self.seed = seq_len, batch_size, num_workers, seed
        self.prepare_args = dict(prepare) if prepare else None
        if self.prepare_args and len(self.paths) > 1:
            raise PrepareError("data.prepare builds one dataset: prepare each mixture source with `python -m lmtrain.data.prepare`")
        self.val_batch_size = val_batch_size or batch_size
        self.pin_memory = pin_memory
        self.train_set: MixedBlocks | None = None
        self.val_set: MixedBlocks | None = None
        self.skip_batches = 0  # set by lmtrain.training.run after a rollback: batches to skip past the restored position
        self.sampler_in_use: BlockSampler | None = None
        self.order_dir: Path | None = None  # set by lmtrain.training.run: the run directory the order files go to
        self.decay_from: int | None = None  # set by lmtrain.training.run: the decay stage's first step, once given
        self.tokens_read = np.zeros(len(self.paths), dtype=np.int64)  # training tokens read from each source (count_read)

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
        """The (first) dataset's manifest; with a mixture, every source shares its tokenizer."""
        return read_manifest(self.path)

    def tokenizer(self):
        """The dataset's tokenizer, whose document separator must be the manifest's ``eos_id``."""
        from lmtrain.formats.tokenizer import eos_id

        manifest = self.manifest
        enc = load_tokenizer(manifest["tokenizer"], self.path)
        if eos_id(enc) != manifest["eos_id"]:
            raise PrepareError(
                f"dataset {self.path}: manifest.json says the document separator is token {manifest['eos_id']}, but its "
                f"tokenizer ({manifest['tokenizer']}) separates documents with {eos_id(enc)}: prepare the dataset again"
            )
        return enc

    def _check_sources_agree(self) -> None:
        if len(self.val_paths) == 1:
            return
        first = None
        for p in self.val_paths:
            m = read_manifest(p)
            ident = {"vocab_size": m["vocab_size"], "eos_id": m["eos_id"], "tokenizer": tokenizer_identity(m["tokenizer"], p)}
            if first is None:
                first = (p, ident)
            elif ident != first[1]:
                diff = [f"{k}: {first[1][k]} vs {ident[k]}" for k in ident if ident[k] != first[1][k]]
                raise PrepareError(
                    f"datasets {first[0]} and {p} (data.sources / data.extra_val) use different tokenizers ({'; '.join(diff)}): prepare every "
                    f"source with the same one, e.g. `python -m lmtrain.data.prepare ... --tokenizer {first[0] / 'tokenizer.tiktoken'}`"
                )

    # -- checkpointed identity of the stream ----------------------------------------------------
    def stream_identity(self) -> dict:
        """What a saved data position means something for: the dataset(s), seq_len, seed and mixture weights (not the
        number of ranks: the position is global, see BlockSampler). Saved in the checkpoint (the loader state, and
        meta.json through lmtrain.training.run) and compared on resume."""
        manifests = [read_manifest(p) for p in self.paths]
        fps = [m.get("fingerprint") for m in manifests]
        ident = {"dataset": fps[0] if len(fps) == 1 else fps, "data.seq_len": self.seq_len, "data.seed": self.seed}
        if len(fps) > 1:
            ident["weights"] = self.weights
        if self.stages:
            ident["stages"] = stages_identity(self.stages)
        # what the tokens mean, as the manifests say now (the fingerprint is of the inputs: an edited manifest keeps it)
        formats = [{k: m[k] for k in ("dtype", "eos_id", "vocab_size")} for m in manifests]
        ident["format"] = formats[0] if len(formats) == 1 else formats
        # what the tokens are: each training shard's content hash as its manifest records it (prepare writes them;
        # `lmtrain audit RUN --verify-shards` checks the files against them)
        ident["shards"] = [{sh["path"]: sh.get("blake2b") for sh in m["splits"]["train"]["shards"]} for m in manifests]
        return ident

    def check_stream(self, saved: dict, step: int | None = None) -> str | None:
        """Refuse a checkpoint whose saved data position belongs to another stream, naming what changed (a
        ``world_size`` that older checkpoints recorded here is no longer part of it). ``data.stages`` may differ from
        the saved ones in the stages still to come after ``step``, the checkpoint's (none known: in none); returns
        that change, said, or None."""
        mine = self.stream_identity()
        recorded = [k for k in mine if k in saved or k not in _ADDED_STREAM_KEYS]  # checkpoints from before a key was added lack it
        changed = [_stream_change(k, saved.get(k), mine[k], self.paths) for k in recorded if k != "stages" and saved.get(k) != mine[k]]
        later = None
        if saved.get("stages") != mine.get("stages"):
            later = f"data.stages {saved.get('stages') or []} -> {mine.get('stages') or []} from step {step + 1}" if step is not None else None
            begun = stages_begun(saved.get("stages"), mine.get("stages"), step, self.decay_from)
            if begun is not None:
                changed.append(begun)
        if changed:
            raise InputError(
                "the checkpoint's data position belongs to another data stream (" + "; ".join(changed) + "): "
                "resume with the settings it was saved with"
            )
        return later

    def state_dict(self) -> dict:
        step = getattr(getattr(self, "trainer", None), "global_step", None)
        return {"stream": self.stream_identity(), "tokens_read": [int(t) for t in self.tokens_read], "step": step}

    def load_state_dict(self, state: dict) -> None:
        """Refuse, before any training, a checkpoint whose saved data position belongs to another stream (lmtrain.training.run
        already compared the one in meta.json before the attempt was accepted; older checkpoints lack it); take up the
        tokens read from each source where the checkpoint left them (checkpoints from before 2026-12-07: from zero)."""
        self.check_stream(state.get("stream", {}), state.get("step"))
        if len(state.get("tokens_read", ())) == len(self.paths):
            self.tokens_read = np.asarray(state["tokens_read"], dtype=np.int64)

    @property
    def decay_staged(self) -> bool:
        """Whether data.stages' last stage begins with the operator's decay (lmtrain.training.run gives it its start)."""
        return decay_stage(self.stages)

    @property
    def source_names(self) -> list[str]:
        """The training sources' names (``name:`` in ``data.sources``, else the dataset folder's name)."""
        return self.val_names[: len(self.paths)]

    def count_read(self, epoch: int, position: int, samples: int) -> dict[str, int]:
        """Add a training step's samples, ``samples`` of ``epoch``'s global order from ``position`` (every rank's), to
        the tokens read from each source (``data.seq_len`` a sample), and return the totals as metrics:
        ``data/tokens/<name>``. Every rank counts the same, since the order is global."""
        order = self.sampler_in_use.order_of(epoch)[position : position + samples]
        source, _ = self.train_set.locate(order)
        self.tokens_read += np.bincount(source, minlength=len(self.paths)) * self.seq_len
        return {f"data/tokens/{name}": int(t) for name, t in zip(self.source_names, self.tokens_read, strict=True)}

    # -- loaders ------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self._check_sources_agree()
            train = [PackedBlocks(p, "train", self.seq_len, self.document_mask) for p in self.paths]
            for p, part in zip(self.paths, train):
                if len(part) == 0:
                    raise PrepareError(f"dataset {p} has {part.num_tokens} train tokens: not one block of data.seq_len={self.seq_len}")
            self.train_set = MixedBlocks(train)
            self.val_sets = [PackedBlocks(p, "val", self.seq_len, self.document_mask) for p in self.paths]
            for p in self.val_paths[len(self.paths) :]:  # a held-out set: its validation split, else all of it
                held = PackedBlocks(p, "val", self.seq_len, self.document_mask) if _has_tokens(p, "val") else None
                self.val_sets.append(held if held is not None and len(held) else PackedBlocks(p, "train", self.seq_len, self.document_mask))
            self.val_set = MixedBlocks(self.val_sets[: len(self.paths)])

    def _world(self) -> tuple[int, int]:
        """(data-parallel ranks, this one's): the replicas of the sampler (lmtrain.training.layout)."""
        from lmtrain.training.layout import Layout

        trainer = self.trainer
        if trainer is None:
            return 1, 0
        layout = Layout.of(trainer)
        return layout.dp, layout.dp_rank(trainer.global_rank)

    def train_sampler(self) -> BlockSampler:
        """The training stream's sampler for this rank (a resume moves its position to this layout:
        lmtrain.training.checkpoint.position)."""
        world, rank = self._world()
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1) if self.trainer is not None else 1
        sampler = BlockSampler(
            self.train_set.sizes, world, rank, shuffle=True, seed=self.seed, batch_size=self.batch_size, weights=self.weights,
            accumulate=accumulate, stages=self.stages,
        )  # fmt: skip
        if self.trainer is not None:
            sampler.steps_done = lambda: self.trainer.global_step  # where a stage's steps end (data.stages)
        sampler.decay_from = self.decay_from
        sampler.skip_on_load = self.skip_batches * self.batch_size
        sampler.order_dir = self.order_dir if rank == 0 else None  # one writer per data-parallel layout
        if len(sampler) == 0:
            raise PrepareError(
                f"dataset {self.path} has {len(self.train_set)} train blocks of seq_len={self.seq_len}: fewer than one "
                f"optimizer step (data.batch_size={self.batch_size} x {accumulate} micro-batch(es)) per rank across {world} rank(s)"
            )
        return sampler

    def train_dataloader(self) -> DataLoader:
        self.sampler_in_use = self.train_sampler()  # the training step claims each batch's position from it (the audit)
        return self._loader(self.train_set, self.sampler_in_use, self.batch_size, drop_last=True, stateful=True)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """One loader over the validation blocks, or one per named set (each source of a mixture, each extra held-out
        set; lmtrain.training.module reports each). Fixed and identical across runs: in order, the same blocks for
        the same world size."""
        world, rank = self._world()
        loaders = [
            self._loader(part, BlockSampler(len(part), world, rank, shuffle=False), self.val_batch_size, drop_last=False)
            for part in self.val_sets
        ]
        return loaders[0] if len(loaders) == 1 else loaders

    def _loader(self, dataset, sampler, batch_size: int, drop_last: bool, stateful: bool = False) -> DataLoader:
        cls = ResumableLoader if stateful else HeldOutLoader
        return cls(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=drop_last,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            worker_init_fn=answer_stack_requests if self.num_workers > 0 else None,  # the hang watchdog's report
        )


class _FrozenFork:
    """A loader whose worker processes are forked with this process's objects frozen (``gc.freeze``), so that a
    worker's garbage collections never visit what it inherited.

    A forked worker holds a copy of every object of the training process, garbage not yet collected included. A
    collection in the worker that frees such an object runs its destructor there, in a process where none of the
    threads it may own exist: a gloo process group left to the collector after ``destroy_process_group`` stops
    threads that were not forked, and the worker aborts ("terminate called after throwing std::system_error") or
    hangs (both reproduced; tests/test_tokenizer_and_data.py checks a loader's workers through such a group). Frozen,
    those objects stay out of every collection in the worker, and the worker's collections cost nothing for them
    (nor copy their pages: CPython's advice for fork without exec). The freeze is lifted here as soon as the
    workers are started."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        gc.freeze()
        try:
            return super()._get_iterator()
        finally:
            gc.unfreeze()


class HeldOutLoader(_FrozenFork, DataLoader):
    """PyTorch's ``DataLoader`` with its workers forked frozen (:class:`_FrozenFork`): the validation sets'."""


class ResumableLoader(_FrozenFork, StatefulDataLoader):
    """torchdata's ``StatefulDataLoader``, restored from the :class:`BlockSampler` position alone.

    The sampler's saved state says everything about where the stream stands (epoch, global position), so a
    restored loader starts a fresh iteration at that position instead of replaying torchdata's own iterator state,
    which is tied to the saved number of loader workers. A checkpoint therefore resumes with any ``num_workers``
    and any number of ranks.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        from lmtrain.training import compat

        saved = compat.sampler_state(state_dict)
        if saved is None or not isinstance(self.sampler, BlockSampler):
            super().load_state_dict(state_dict)
            return
        self.sampler.load_state_dict(saved)
        super().load_state_dict({})  # a fresh iterator, which starts where the sampler now stands


def _resolve_sources(path: str | None, sources, staged: bool = False) -> tuple[list[Path], list[float] | None, list[str]]:
    """(paths, weights, names) from ``data.path`` or ``data.sources``; weights is None for a single dataset. With
    ``staged`` (data.stages given), a source's weight may be 0: one that only a later stage reads."""
    if (path is None) == (sources is None or len(sources) == 0):
        raise PrepareError("give exactly one of data.path=DIR and data.sources=[{path: DIR, weight: W}, ...]")
    if path is not None:
        return [Path(path)], None, [Path(path).name]
    paths, weights, names = [], [], []
    for i, s in enumerate(sources):
        if not hasattr(s, "keys") or set(s.keys()) - {"path", "weight", "name"} or "path" not in s:
            raise PrepareError(f"data.sources[{i}] = {s!r}: expected {{path: DIR, weight: W}} (and optionally name: N)")
        w = s.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w >= 0 if staged else w > 0):
            raise PrepareError(f"data.sources[{i}].weight = {w!r}: must be a {'number >= 0' if staged else 'positive number'}")
        paths.append(Path(s["path"]))
        weights.append(float(w))
        names.append(_val_name(s.get("name"), Path(s["path"]), f"data.sources[{i}]"))
    if len(set(paths)) != len(paths):
        raise PrepareError(f"data.sources lists a dataset twice: {[str(p) for p in paths]} (raise its weight instead)")
    if len(set(names)) != len(names):
        raise PrepareError(f"data.sources: two sources are named alike ({names}): give each a distinct name: N")
    if not sum(weights) > 0:
        raise PrepareError(f"data.sources: every weight is 0 ({weights}): the first stage must read some source")
    return paths, weights, names


def _resolve_stages(stages, names: list[str], weights: list[float] | None) -> list[tuple[int, list[float]]]:
    """``data.stages``: the mixture's later stages, ``[{from_step: N, weights: {SOURCE: W, ...}}, ...]``, as (first
    step, weight per source in data.sources' order; a source not named: 0), each error naming its key."""
    if not stages:
        return []
    if weights is None or len(weights) < 2:
        raise PrepareError("data.stages needs a mixture: data.sources with two or more sources (every stage weighs them)")
    out, last = [], 1
    for i, st in enumerate(stages):
        if not hasattr(st, "keys") or set(st.keys()) != {"from_step", "weights"}:
            raise PrepareError(
                f"data.stages[{i}] = {st!r}: expected {{from_step: STEP, weights: {{SOURCE: W, ...}}}} (or from_tokens: N "
                "with global_batch_size set, the run's config turns it into the step)"
            )
        first, ws = st["from_step"], st["weights"]
        if first == "decay":
            if i != len(stages) - 1:
                raise PrepareError(f"data.stages[{i}].from_step = decay: only the last stage may begin with the operator's decay")
            first = None
        elif isinstance(first, bool) or not isinstance(first, int) or first <= last:
            raise PrepareError(
                f"data.stages[{i}].from_step = {first!r}: must be a step after {last} (stages begin at increasing steps), "
                "or decay (the last stage: with the operator's `lmtrain control RUN decay`)"
            )
        if not hasattr(ws, "keys") or not ws:
            raise PrepareError(f"data.stages[{i}].weights = {ws!r}: expected {{SOURCE: W, ...}} naming sources of data.sources")
        unknown = sorted(str(k) for k in ws if str(k) not in names)
        if unknown:
            raise PrepareError(f"data.stages[{i}].weights names {unknown}: not sources of data.sources ({names})")
        row = [ws.get(n, 0.0) for n in names]
        bad = [f"{n}: {w!r}" for n, w in zip(names, row) if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0]
        if bad or not sum(row) > 0:
            raise PrepareError(f"data.stages[{i}].weights: {'; '.join(bad) or 'every weight is 0'}: weights are numbers >= 0, some > 0")
        out.append((first, [float(w) for w in row]))
        last = first
    return out


def decay_stage(stages: list[tuple[int | None, list[float]]]) -> bool:
    """Whether the last of ``data.stages`` (resolved: :func:`_resolve_stages`) begins with the operator's decay."""
    return bool(stages) and stages[-1][0] is None


def stages_begun(saved: list | None, now: list | None, step: int | None, decay_from: int | None = None) -> str | None:
    """None when the stages ``now`` (:func:`stages_identity`'s form) differ from the ``saved`` ones only in stages
    that begin after ``step``, the steps still to come; else the change, said, naming the stage begun that changed
    or the one that would begin at or before ``step`` (where the saved run read other data). The decay's stage has
    begun when the decay was given (``decay_from``, its first step) at or before ``step``."""
    saved, now = saved or [], now or []
    if step is None:
        return f"data.stages: {saved} -> {now}"

    def begun(first) -> bool:
        return (decay_from is not None and decay_from <= step) if first == "decay" else first <= step

    k = sum(begun(first) for first, _ in saved)  # the saved stages begun (in order: stages begin at increasing steps)
    if now[:k] != saved[:k]:
        return f"data.stages: {saved} -> {now}: a stage begun by step {step} (the checkpoint's) cannot change"
    early = [first for first, _ in now[k:] if begun(first)]
    if early:
        return (f"data.stages: {saved} -> {now}: a stage from step {early[0]} would begin at or before step {step} (the "
                "checkpoint's), whose data was read otherwise; a changed stage can begin after it")  # fmt: skip
    return None


def stages_identity(stages: list[tuple[int | None, list[float]]]) -> list:
    """Resolved ``data.stages`` as the saved stream identity records them (the decay's stage: ``"decay"``)."""
    return [["decay" if first is None else first, ws] for first, ws in stages]


def _resolve_extra_val(extra, taken: list[str]) -> tuple[list[Path], list[str]]:
    """(paths, names) of ``data.extra_val``: held-out sets, each named (default: its folder's name), names unique."""
    paths, names = [], []
    for i, s in enumerate(extra or []):
        if not hasattr(s, "keys") or set(s.keys()) - {"path", "name"} or "path" not in s:
            raise PrepareError(f"data.extra_val[{i}] = {s!r}: expected {{name: N, path: DIR}}")
        paths.append(Path(s["path"]))
        names.append(_val_name(s.get("name"), Path(s["path"]), f"data.extra_val[{i}]"))
    clash = sorted({n for n in names if names.count(n) > 1 or n in taken})
    if clash:
        raise PrepareError(f"data.extra_val: the name(s) {clash} are taken (by a source or another set): give each set a distinct name: N")
    return paths, names


def _val_name(name, path: Path, where: str) -> str:
    name = str(name) if name is not None else path.name
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise PrepareError(f"{where}.name = {name!r}: use letters, digits, '-', '_' or '.' (it becomes the metric val/loss/<name>)")
    return name


def _has_tokens(directory: Path, split: str) -> bool:
    split_info = read_manifest(directory)["splits"].get(split)
    return bool(split_info) and sum(s["num_tokens"] for s in split_info["shards"]) > 0
