"""Context parallel (``strategy=fsdp strategy.cp=N``, issue 60) on CPU with gloo, real launches through train.py: each
sequence split over the ranks of a context-parallel group, attention gathering the keys and values of the whole
sequence, the data-parallel and context-parallel ranks sharding together. The per-step losses equal one process's with
the document mask on (positions restarting per document, attention kept inside each) and off, alone and with tensor parallel;
a checkpoint continues exactly on another layout; what it cannot split is refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtrain.nn.context import ContextParallel
from lmtrain.training.config import ConfigError, validate_config
from tests.conftest import TINY, make_cfg
from tests.test_fsdp import _one_process, _run
from tests.test_tensor_parallel import _close, _floats

# the llama family (rotary positions read per token), grouped keys and values, the document mask
DOCS = ["model.family=llama", "model.n_kv_heads=2", "model.tie_embeddings=false", "data.document_mask=true"]


def test_each_rank_takes_a_chunk_from_the_front_and_one_from_the_back():
    """2 x cp chunks, rank r the r-th and the r-th from the end: under the causal mask every rank attends to as many
    keys (the head-tail balance); the gathered keys are every rank's tokens in rank order."""
    cp = ContextParallel(group=None, size=2, rank=1)
    assert cp.index(8, "cpu").tolist() == [2, 3, 4, 5]
    assert ContextParallel(None, 2, 0).index(8, "cpu").tolist() == [0, 1, 6, 7]
    assert cp.key_index(8, "cpu").tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    four = [ContextParallel(None, 4, r).index(64, "cpu") for r in range(4)]
    assert sorted(torch.cat(four).tolist()) == list(range(64))
    assert len({int((i + 1).sum()) for i in four}) == 1  # the keys each rank's queries see under the causal mask: equal
    with pytest.raises(ValueError, match="cuts a sequence into 4 chunks: 6 tokens do not divide"):
        cp.index(6, "cpu")


def test_the_gathered_keys_are_complete_when_attention_gets_them(tmp_path):
    """The gather hands attention a finished tensor, not one a collective still writes (PyTorch's autograd all-gather
    returns that, and under gloo its worker thread's writes raced autograd's bookkeeping: heap corruption in CI); its
    gradient is the reduce-scatter of the incoming one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    k = torch.randn(2, 4, 8, 16, requires_grad=True)
    out = ContextParallel(dist.group.WORLD, 1, 0).gather(k, 2)
    assert type(out) is torch.Tensor and torch.equal(out, k), type(out)  # not an AsyncCollectiveTensor
    (out * 3).sum().backward()
    assert torch.equal(k.grad, torch.full_like(k, 3.0))


@pytest.fixture(scope="module")
def one(tmp_path_factory, dataset_dir) -> tuple[dict[int, float], Path]:
    """One process at global batch 8 with the document mask, trained once for the module (checkpoints at steps 3, 6
    and 8)."""
    folder = tmp_path_factory.mktemp("one")
    return _one_process(folder, dataset_dir, *DOCS), folder / "run"


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_2_x_context_parallel_2_trains_as_one_process_and_resumes_in_one(tmp_path, dataset_dir, one):
    """4 ranks (fsdp 2 x cp 2) at global batch 8, each sequence's 64 tokens split in two: one process's losses (to
    1e-5) and tokens; its step-3 checkpoint continues them in one process."""
    want, _ = one
    ref = _run(tmp_path, dataset_dir, "cp", "strategy=fsdp", "strategy.cp=2", "trainer.devices=4", "data.batch_size=4", *DOCS)
    assert "context parallel: each sequence split over 2 ranks (mesh ('context_parallel',))" in ref.stderr, ref.stderr[-3000:]
    assert "fully_shard per block on mesh (4,) ('data_context_parallel',)" in ref.stderr
    assert ": 8 steps, 4,096 tokens;" in ref.stderr  # the data-parallel ranks' sequences (2 x 4 x 64 a step), not 4 ranks'
    _close(_floats(tmp_path / "runs" / "cp"), want)
    step3 = tmp_path / "runs" / "cp" / "checkpoints" / "step-0000003"
    res = _run(tmp_path, dataset_dir, "one-after-cp", "trainer.devices=1", "data.batch_size=8", f"ckpt_path={step3}", *DOCS)
    assert f"resuming from {step3}" in res.stderr, res.stderr[-3000:]
    _close(_floats(tmp_path / "runs" / "one-after-cp"), {s: v for s, v in want.items() if s > 3}, "one process after cp")


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_2_x_context_parallel_2_continues_one_process_exactly(tmp_path, dataset_dir, one):
    """4 ranks splitting each layer in two (tp 2) and each sequence in two (cp 2) on a (data, context, tensor) mesh,
    all reading the same samples: they continue one process's step-3 checkpoint with its losses."""
    want, one_run = one
    ckpt = one_run / "checkpoints" / "step-0000003"
    res = _run(tmp_path, dataset_dir, "tpcp", "strategy=fsdp", "strategy.tp=2", "strategy.cp=2", "trainer.devices=4",
               "data.batch_size=8", f"ckpt_path={ckpt}", *DOCS)  # fmt: skip
    assert "tensor parallel: each block's products split over 2 ranks" in res.stderr and "context parallel" in res.stderr
    _close(_floats(tmp_path / "runs" / "tpcp"), {s: v for s, v in want.items() if s > 3}, "tp 2 x cp 2")


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_2_replicas_x_context_parallel_2_trains_as_one_process(tmp_path, dataset_dir, one):
    """hsdp with context parallel: 2 replicas of 1 shard, each of 2 ranks splitting every sequence, on a (replicate,
    shard, context_parallel) mesh, FSDP2 replicating over the first and sharding over the other two flattened; and
    with tensor parallel too, on the 4-D mesh: one process's losses."""
    want, _ = one
    res = _run(tmp_path, dataset_dir, "hsdp-cp", "strategy=hsdp", "strategy.cp=2", "strategy.shard_size=1", "trainer.devices=4",
               "data.batch_size=4", *DOCS)  # fmt: skip
    assert "HSDPStrategy: fully_shard per block on mesh (2, 2) ('replicate', 'shard_context_parallel')" in res.stderr, res.stderr[-3000:]
    assert ": 8 steps, 4,096 tokens;" in res.stderr  # 2 data-parallel ranks x 4 sequences of 64 a step
    _close(_floats(tmp_path / "runs" / "hsdp-cp"), want)
    # the 4-D mesh: (replicate 1, shard 1, context 2, tensor 2), every rank reading the same samples
    res = _run(tmp_path, dataset_dir, "hsdp-cp-tp", "strategy=hsdp", "strategy.cp=2", "strategy.tp=2", "strategy.shard_size=1",
               "trainer.devices=4", "data.batch_size=8", *DOCS)  # fmt: skip
    assert "fully_shard per block on mesh (1, 2) ('replicate', 'shard_context_parallel')" in res.stderr, res.stderr[-3000:]
    _close(_floats(tmp_path / "runs" / "hsdp-cp-tp"), want, "hsdp x cp 2 x tp 2")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy=fsdp", "strategy.cp=3", "trainer.devices=4"], "strategy.cp=3 x strategy.tp=1 does not divide the world size 4"),
        (["strategy=fsdp", "strategy.cp=0"], "strategy.cp=0 must be a positive number of ranks"),
        (["strategy=fsdp", "strategy.cp=2", "trainer.devices=2", "data.seq_len=30"], "data.seq_len=30 does not divide by 4"),
        (["strategy=hsdp", "strategy.cp=2", "trainer.devices=4", "strategy.shard_size=3"],
         "strategy.shard_size=3 x strategy.cp=2 does not divide the world size 4"),
    ],
)
def test_what_context_parallel_cannot_split_is_refused_before_launch(tmp_path, monkeypatch, overrides, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = make_cfg([a for a in TINY if not a.startswith("trainer.devices")] + overrides, tmp_path)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(cfg)


@pytest.mark.slow
@pytest.mark.distributed
def test_context_parallel_without_the_document_mask_trains_as_one_process(tmp_path, dataset_dir):
    """The OPT family (learned positions, tied head), plain causal attention over the packed sequence: 2 ranks each
    taking half of every sequence give one process's losses."""
    want = _one_process(tmp_path / "one", dataset_dir)
    _run(tmp_path, dataset_dir, "cp", "strategy=fsdp", "strategy.cp=2", "trainer.devices=2", "data.batch_size=8")
    _close(_floats(tmp_path / "runs" / "cp"), want)
