"""The data stream is exactly resumable: after a resume the next batches are those of an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from lmtrain.data.datamodule import TokenDataModule
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg, short_dataset

SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory, corpus_jsonl):
    return short_dataset(tmp_path_factory, corpus_jsonl, 1500)


def _loader(path, workers):
    dm = TokenDataModule(str(path), seq_len=SEQ, batch_size=BATCH, num_workers=workers, seed=7)
    dm.setup("fit")
    return dm.train_dataloader()


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_state_resumes_exactly_twice(small_dataset, workers):
    ref_loader = _loader(small_dataset, workers)
    ref = [b[0] for b in ref_loader]
    assert len(ref) >= 12
    loader = _loader(small_dataset, workers)
    it = iter(loader)
    got = [next(it)[0] for _ in range(3)]
    state = loader.state_dict()
    del it, loader
    loader = _loader(small_dataset, workers)  # a new process would build a new loader
    loader.load_state_dict(state)
    it = iter(loader)
    got += [next(it)[0] for _ in range(4)]
    state = loader.state_dict()
    del it, loader
    loader = _loader(small_dataset, workers)
    loader.load_state_dict(state)
    got += [b[0] for b in loader]
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("workers", [0, 2])
def test_state_saved_at_an_epochs_end_resumes_at_the_next_epoch(small_dataset, workers):
    ref_loader = _loader(small_dataset, workers)
    ref_loader.sampler.set_epoch(1)
    ref = [b[0] for b in ref_loader]
    loader = _loader(small_dataset, workers)
    for _ in loader:  # the whole of epoch 0
        pass
    state = loader.state_dict()
    loader = _loader(small_dataset, workers)
    loader.load_state_dict(state)
    got = [b[0] for b in loader]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_two_ranks_two_workers_cover_an_epoch_disjointly(small_dataset):
    seen = []
    for rank in range(2):
        dm = TokenDataModule(str(small_dataset), seq_len=SEQ, batch_size=BATCH, num_workers=2, seed=7)
        dm.setup("fit")

        class _T:  # the facts the data module reads from its trainer (a strategy of Lightning's: data parallel over all)
            world_size, global_rank, strategy = 2, rank, None

        dm.trainer = _T()
        for x, _ in dm.train_dataloader():
            seen += [tuple(row.tolist()) for row in x]
    n_blocks = len(dm.train_set)
    per_rank_batches = (n_blocks // 2) // BATCH
    assert len(seen) == 2 * per_rank_batches * BATCH
    assert len(set(seen)) == len(seen)  # no block served twice (blocks of real text are distinct)
    every = {tuple(dm.train_set[i][0].tolist()) for i in range(n_blocks)}
    assert set(seen) <= every


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2])  # (without workers: tests/test_reshard.py's run through six layouts)
def test_resume_through_lightning_mid_epoch_and_across_epoch_boundary(small_dataset, tmp_path, workers):
    steps_per_epoch = len(_loader(small_dataset, 0))
    total = steps_per_epoch + 6
    cuts = [steps_per_epoch - 3, steps_per_epoch, steps_per_epoch + 2]  # mid-epoch, then just after the epoch boundary

    def cfg(name, max_steps, ckpt=None):
        overrides = TINY + [
            f"data.seq_len={SEQ}", f"data.batch_size={BATCH}", f"data.num_workers={workers}", "seed=7",
            f"trainer.max_steps={max_steps}", f"scheduler.total_steps={total}", "trainer.val_check_interval=1000",
            "trainer.enable_checkpointing=true",
            "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
            f"+callbacks.ckpt.dirpath={tmp_path / 'ckpt'}", "+callbacks.ckpt.every_n_train_steps=1",
            "+callbacks.ckpt.save_top_k=-1", "+callbacks.ckpt.filename='{step}'",
            "+callbacks.rec._target_=tests.plugins.RecordBatches", f"+callbacks.rec.path={tmp_path / name}.pt",
        ]  # fmt: skip
        if ckpt:
            overrides.append(f"ckpt_path='{ckpt}'")
        return make_cfg(overrides, tmp_path / name, small_dataset)

    train(cfg("ref", total))
    ref = torch.load(tmp_path / "ref.pt")
    assert sorted(ref) == list(range(total))
    assert not torch.equal(ref[steps_per_epoch], ref[0])  # the second epoch is reshuffled
    # interrupted twice: stop at each cut, resume from its checkpoint, finish
    import shutil

    shutil.rmtree(tmp_path / "ckpt")
    got = {}
    for i, end in enumerate(cuts + [total]):
        ckpt = tmp_path / "ckpt" / f"step={cuts[i - 1]}.ckpt" if i else None
        train(cfg(f"part{i}", end, ckpt))
        got.update(torch.load(tmp_path / f"part{i}.pt"))
    assert sorted(got) == list(range(total))
    for step in range(total):
        assert torch.equal(got[step], ref[step]), f"batch at step {step} differs after resume"
