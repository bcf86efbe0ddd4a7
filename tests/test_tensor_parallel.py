"""Tensor parallel (``strategy=fsdp strategy.tp=N``, issue 60) on CPU with gloo, real launches through train.py: each
block's products split over the ranks of a tensor-parallel group, the groups sharded by FSDP2 on a 2-D mesh. The
per-step losses equal one process's to float rounding; a checkpoint resumes exactly on another number of
data-parallel ranks and serves the tools; what tensor parallel cannot split, or cannot do yet, is refused before any
process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtrain.training.config import ConfigError, validate_config
from tests.conftest import TINY, make_cfg, run_train_cli
from tests.test_fsdp import BASE, _one_process, _run

LLAMA = ["model.family=llama", "model.n_kv_heads=2", "model.qk_norm=true", "model.tie_embeddings=false"]


def _floats(run_dir: Path) -> dict[int, float]:
    from tests.test_checkpoint import _losses

    return {s: float(v) for s, v in _losses(run_dir).items()}


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want), (got, want)
    assert all(abs(got[s] - want[s]) < 1e-5 for s in want), (got, want)


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_2_x_tensor_parallel_2_trains_as_one_process_resumes_and_serves_the_tools(tmp_path, dataset_dir):
    """4 ranks (fsdp 2 x tp 2) at global batch 8: the losses of one process; its step-3 checkpoint resumed on 2 ranks
    (fsdp 1 x tp 2, 2 micro-batches each) continues them; resumed with another tensor-parallel size it is refused
    naming both, before anything is written; generate and export read it (its split products fused again)."""
    want = _one_process(tmp_path / "one", dataset_dir)
    ref = _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=4", "data.batch_size=4")
    assert "tensor parallel: each block's products split over 2 ranks" in ref.stderr
    assert "fully_shard per block on mesh (2,) ('data_parallel',)" in ref.stderr
    _close(_floats(tmp_path / "runs" / "tp"), want)

    step3 = tmp_path / "runs" / "tp" / "checkpoints" / "step-0000003"
    _run(tmp_path, dataset_dir, "cut", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=4", "global_batch_size=8",
         f"ckpt_path={step3}")  # fmt: skip
    _close(_floats(tmp_path / "runs" / "cut"), {s: v for s, v in want.items() if s > 3})

    args = BASE + [f"paths.runs={tmp_path / 'runs'}", "run_name=other", f"data.path={dataset_dir}", "data.prepare=null",
                   "strategy=fsdp", "trainer.devices=2", "data.batch_size=4", f"ckpt_path={step3}"]  # fmt: skip
    refused = run_train_cli(args, tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "was saved with strategy.tp=2 and this run has strategy.tp=1" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "runs" / "other" / "checkpoints").exists() or not list((tmp_path / "runs" / "other" / "checkpoints").iterdir())

    from lmtrain.formats.trained import load_run

    model, enc, _, ckpt = load_run(tmp_path / "runs" / "cut")
    one, _, _, _ = load_run(tmp_path / "one" / "run")  # the one process's own step 8
    assert ckpt.step == 8 and ckpt.meta["tp"] == 2
    ids = torch.tensor([enc.encode_ordinary("import os")])
    torch.testing.assert_close(model(ids), one(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_grouped_query_attention_and_qk_norm_split_over_two_ranks_train_as_one_process(tmp_path, dataset_dir):
    """The llama family with 2 key-value heads for 4 query heads and QK-norm (whose weights see each rank's own heads:
    their gradients summed over the ranks), split over 2 ranks: one process's losses."""
    want = _one_process(tmp_path / "one", dataset_dir, *LLAMA)
    _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8", *LLAMA)
    _close(_floats(tmp_path / "runs" / "tp"), want)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_on_a_three_dimensional_mesh_trains_as_one_process(tmp_path, dataset_dir):
    """hsdp with tensor parallel: 2 replicas x 1 shard x tp 2 (a (replicate, shard, tensor_parallel) mesh, FSDP2 on
    its outer two dimensions), global batch 8: one process's losses."""
    want = _one_process(tmp_path / "one", dataset_dir)
    res = _run(tmp_path, dataset_dir, "hsdp", "strategy=hsdp", "strategy.tp=2", "strategy.shard_size=1", "trainer.devices=4", "data.batch_size=4")
    assert "HSDPStrategy: fully_shard per block on mesh (2, 1) ('replicate', 'shard')" in res.stderr, res.stderr[-3000:]
    _close(_floats(tmp_path / "runs" / "hsdp"), want)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy=fsdp", "strategy.tp=3", "trainer.devices=4"], "strategy.tp=3 does not divide the world size 4"),
        (["strategy=fsdp", "strategy.tp=0"], "strategy.tp=0 must be a positive number of ranks"),
        (["strategy=fsdp", "strategy.tp=8", "trainer.devices=8"], "over 8 ranks: it does not divide model.n_heads=4"),
        (["strategy=hsdp", "strategy.tp=2", "trainer.devices=4", "strategy.shard_size=3"], "shard_size=3 x strategy.tp=2 does not divide the world size 4"),
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "module.head.kind=chunked"], "module.head.kind=chunked with strategy.tp=2"),
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "module.fp8.recipe=tensorwise"], "module.fp8 with strategy.tp=2"),
    ],
)
def test_what_tensor_parallel_cannot_split_is_refused_before_launch(tmp_path, monkeypatch, overrides, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = make_cfg([a for a in TINY if not a.startswith("trainer.devices")] + overrides, tmp_path)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)
