"""Tensor parallel (``strategy=fsdp strategy.tp=N``, issue 60) on CPU with gloo, real launches through train.py: each
block's products split over the ranks of a tensor-parallel group, the groups sharded by FSDP2 on a 2-D mesh. The
per-step losses equal one process's to float rounding; a checkpoint resumes exactly on any other layout, with tensor
parallel or without, and serves the tools; what tensor parallel cannot split, or cannot do yet, is refused before any
process starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lmtrain.training import memory
from lmtrain.training.config import ConfigError, validate_config
from tests.conftest import TINY, make_cfg
from tests.test_fsdp import _one_process, _run

LLAMA = ["model.family=llama", "model.n_kv_heads=2", "model.qk_norm=true", "model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def one(tmp_path_factory, dataset_dir) -> tuple[dict[int, float], Path]:
    """One process at global batch 8, trained once for the module: its losses and its run directory (checkpoints at
    steps 3, 6 and 8)."""
    folder = tmp_path_factory.mktemp("one")
    return _one_process(folder, dataset_dir), folder / "run"


def _floats(run_dir: Path) -> dict[int, float]:
    from tests.test_checkpoint import _losses

    return {s: float(v) for s, v in _losses(run_dir).items()}


def _close(got: dict[int, float], want: dict[int, float], what: str = "") -> None:
    assert sorted(got) == sorted(want), (what, got, want)
    assert all(abs(got[s] - want[s]) < 1e-5 for s in want), (what, got, want)


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_2_x_tensor_parallel_2_trains_as_one_process_and_resumes_on_any_layout(tmp_path, dataset_dir, one):
    """4 ranks (fsdp 2 x tp 2) at global batch 8: the losses of one process. Its step-3 checkpoint (products stored
    split) continues them under fsdp on 2 ranks without tensor parallel and in one process; one process's single-file
    checkpoint (fused) continues them under tp 2; its step-6 checkpoint under tp 4 (DCP reshards the split products).
    generate and export read it, its products fused again."""
    want, one_run = one
    ref = _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=4", "data.batch_size=4")
    assert "tensor parallel: each block's products split over 2 ranks" in ref.stderr
    # a rank's parameters before sharding, as the planner counts them under tp (lmtrain.training.memory)
    local = int(re.search(r"split over 2 ranks \(mesh .*?\): ([\d,]+) parameters a rank", ref.stderr)[1].replace(",", ""))
    counted = memory.counted(make_cfg([*TINY, "strategy=fsdp", "strategy.tp=2", "trainer.devices=4", "data.batch_size=4"], tmp_path), 4, 4)
    nums = counted["nums"]
    assert counted["tp"] == 2 and local == nums["params"] - nums["tp_split_params"] // 2, (local, nums)
    weights = memory.breakdown(counted, "fsdp", 4, 4, "none")["weights"]
    assert weights == 4 * local / 2  # fp32, sharded over the 2 data-parallel ranks
    assert "fully_shard per block on mesh (2,) ('data_parallel',)" in ref.stderr
    # the tokens trained are the data-parallel ranks' (2 x 4 sequences of 64 a step), not the 4 processes': one process's
    assert "finished run tp in " in ref.stderr and ": 8 steps, 4,096 tokens;" in ref.stderr, ref.stderr[-2000:]
    _close(_floats(tmp_path / "runs" / "tp"), want)

    ckpts = tmp_path / "runs" / "tp" / "checkpoints"
    layouts = {
        "fsdp2": (ckpts / "step-0000003", ["strategy=fsdp", "trainer.devices=2", "data.batch_size=4"]),
        "single": (ckpts / "step-0000003", ["trainer.devices=1", "data.batch_size=8"]),
        "from-one": (one_run / "checkpoints" / "step-0000003", ["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=4", "global_batch_size=8"]),
        "tp4": (ckpts / "step-0000006", ["strategy=fsdp", "strategy.tp=4", "trainer.devices=4", "data.batch_size=4", "global_batch_size=8"]),
    }  # fmt: skip
    for name, (ckpt, layout) in layouts.items():
        res = _run(tmp_path, dataset_dir, name, *layout, f"ckpt_path={ckpt}")
        assert f"resuming from {ckpt}" in res.stderr, res.stderr[-3000:]
        step = int(ckpt.name.removeprefix("step-"))
        _close(_floats(tmp_path / "runs" / name), {s: v for s, v in want.items() if s > step}, name)

    from lmtrain.formats.trained import load_run

    model, enc, _, ckpt = load_run(tmp_path / "runs" / "tp4")
    single, _, _, _ = load_run(one_run)  # the one process's own step 8
    assert ckpt.step == 8 and ckpt.meta["tp"] == 4
    ids = torch.tensor([enc.encode_ordinary("import os")])
    torch.testing.assert_close(model(ids), single(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_grouped_query_attention_and_qk_norm_split_over_two_ranks_train_as_one_process(tmp_path, dataset_dir):
    """The llama family with 2 key-value heads for 4 query heads and QK-norm (whose weights see each rank's own heads:
    their gradients summed over the ranks), an untied head split by vocabulary and a z-loss (its log-partition over
    the split logits), split over 2 ranks: one process's losses."""
    z = "module.z_loss=1e-3"
    want = _one_process(tmp_path / "one", dataset_dir, *LLAMA, z)
    _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8", *LLAMA, z)
    _close(_floats(tmp_path / "runs" / "tp"), want)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_on_a_three_dimensional_mesh_trains_as_one_process(tmp_path, dataset_dir, one):
    """hsdp with tensor parallel: 2 replicas x 1 shard x tp 2 (a (replicate, shard, tensor_parallel) mesh, FSDP2 on
    its outer two dimensions), global batch 8: one process's losses."""
    want = one[0]
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
