"""Tensor parallel (``strategy=fsdp strategy.tp=N``, issue 60) on CPU with gloo, real launches through train.py: each
block's products split over the ranks of a tensor-parallel group, the groups sharded by FSDP2 on a 2-D mesh. The
per-step losses equal one process's to float rounding; a checkpoint resumes exactly on any other layout, with tensor
parallel or without, and serves the tools; what tensor parallel cannot split, or cannot do yet, is refused before any
process starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtrain.training import memory
from lmtrain.training.config import ConfigError, validate_config
from tests.conftest import ROOT, TINY, make_cfg
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
    the split logits), split over 2 ranks: one process's losses. The same with the chunked head (chunks of 100 of the
    512 tokens a step, the last one short), which computes each chunk's split logits twice and keeps none."""
    z = "module.z_loss=1e-3"
    want = _one_process(tmp_path / "one", dataset_dir, *LLAMA, z)
    _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8", *LLAMA, z)
    _close(_floats(tmp_path / "runs" / "tp"), want)
    chunked = ["module.head.kind=chunked", "module.head.chunk_tokens=100"]
    _run(tmp_path, dataset_dir, "chunked", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8", *LLAMA, z, *chunked)
    _close(_floats(tmp_path / "runs" / "chunked"), want)


@pytest.mark.slow
@pytest.mark.distributed
def test_float8_blocks_split_over_two_ranks_train_as_one_float8_process(tmp_path, dataset_dir):
    """Float8 (tensorwise) under tp 2: the plan is made first, so the split query, key, value and SwiGLU products
    are the ones converted, then split as the linear layers they are (their scales over the whole weight and input,
    as DTensors). The losses are one float8 process's at the same batch to 1e-3 (2e-5 apart at step 1, 4e-4 at
    most), not to float rounding: one process scales the fused qkv and gate_up weights as one tensor each, tensor parallel the
    split ones apart; and they are not full precision's (its step-1 loss 3e-4 away). Built in one process and split
    the same way, the two give equal losses and gradients to 1e-5 (SPLIT_FLOAT8, in two processes over gloo)."""
    toy = [*LLAMA, "model.embed_init_std=0.02"]  # N(0, 1) embeddings leave a 2-layer toy's first losses near uniform
    fp8 = [*toy, "module.fp8.recipe=tensorwise"]  # in both, float8 or not (differences under 1e-4): the toy's 0.02
    want = _one_process(tmp_path / "one", dataset_dir, *fp8)
    plain = _one_process(tmp_path / "plain", dataset_dir, *toy)
    res = _run(tmp_path, dataset_dir, "tp", "strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8", *fp8)
    assert "float8: 14 linear layers of the transformer blocks" in res.stdout + res.stderr  # 2 blocks: q, k, v, proj, gate, up, down, (res.stdout + res.stderr)[-3000:]
    got = _floats(tmp_path / "runs" / "tp")
    assert sorted(got) == sorted(want) and got == pytest.approx(want, rel=1e-3), (got, want)
    assert any(abs(got[s] - plain[s]) > 1e-4 for s in plain), (got, plain)
    # exactly, where both scale the same tensors: one process with its products split too, against tp 2
    script = tmp_path / "split_float8.py"
    script.write_text(SPLIT_FLOAT8)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0 and "equal" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_logits_of_any_length_under_tensor_parallel_are_one_process_s(tmp_path):
    """Evaluations and generation ask for logits of any length: under tp 2 (sequences split in equal parts between
    the branches) a length that does not divide is padded and cut back, with and without the document mask: one
    process's logits."""
    script = tmp_path / "lengths.py"
    script.write_text(LENGTHS)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0 and "equal 1 7 16" in res.stdout, res.stderr[-3000:]


LENGTHS = """
import os
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from lmtrain.nn.model import Decoder
from lmtrain.train import _close_process_group


def gloo_threads():
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))


def check():
    kw = dict(vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, family="llama", n_kv_heads=2,
              qk_norm=True, tie_embeddings=False)
    torch.manual_seed(0)
    one, split = Decoder(**kw), Decoder(**kw)
    split.load_state_dict(one.state_dict())
    parallelize_module(split, init_device_mesh("cpu", (2,)), split.tensor_parallel_plan(2))
    for T in (1, 7, 16):
        idx = torch.randint(96, (2, T), generator=torch.Generator().manual_seed(T))
        doc = (torch.arange(T) >= T // 2).long().expand(2, -1)
        torch.testing.assert_close(split(idx), one(idx), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(split(idx, doc=doc), one(idx, doc=doc), atol=1e-5, rtol=1e-5)


dist.init_process_group("gloo")
check()  # the split model, its mesh and DTensors freed on return, then the groups closed as train.py closes
_close_process_group()
assert gloo_threads() == 0, gloo_threads()  # else a gloo group freed in the interpreter's finalization can abort the exit
print("equal 1 7 16")
"""


SPLIT_FLOAT8 = """
import os
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from lmtrain.nn.model import Decoder
from lmtrain.training.fp8 import convert
from lmtrain.train import _close_process_group


def gloo_threads():
    return sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pt_gloo_runloop" for t in os.listdir("/proc/self/task"))


def check():
    mesh = init_device_mesh("cpu", (2,))
    kw = dict(vocab_size=96, max_seq_len=32, d_model=64, n_layers=2, n_heads=4, ffn_dim=128, family="llama", n_kv_heads=2,
              tie_embeddings=False, qk_norm=True)
    torch.manual_seed(0)
    one, split = Decoder(**kw), Decoder(**kw)
    split.load_state_dict(one.state_dict())
    for b in one.blocks:
        b.attn.unfuse(), b.mlp.unfuse()
    plan = split.tensor_parallel_plan(2)
    for m in (one, split):
        convert(m, "tensorwise", sharded=False, device=torch.device("cpu"))
    parallelize_module(split, mesh, plan)
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(96, (2, 16), generator=g), torch.randint(96, (2, 16), generator=g)
    a, b = one(idx, tgt), split(idx, tgt)
    a.backward(), b.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in split.named_parameters()}
    worst = max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in one.named_parameters())
    assert type(split.blocks[0].attn.q).__name__ == "Float8Linear", type(split.blocks[0].attn.q)
    a, b = float(a.detach()), float(b.detach())
    assert a == b and worst < 1e-5, (a, b, worst)
    return a, worst


dist.init_process_group("gloo")
loss, worst = check()  # the split model, its mesh and DTensors freed on return, then the groups closed as train.py closes
_close_process_group()
assert gloo_threads() == 0, gloo_threads()  # else a gloo group freed in the interpreter's finalization can abort the exit ("terminate called")
print("equal", loss, worst)
"""


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
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "module.head.kind=float8"], "module.head.kind=float8 with strategy.tp=2"),
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "data.seq_len=63"], "data.seq_len=63 does not divide by 2"),
        (["strategy=fsdp", "strategy.tp=4", "strategy.cp=2", "trainer.devices=8", "data.seq_len=36"],
         "data.seq_len=36 over strategy.cp=2 (18) does not divide by 4"),
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "model.max_seq_len=65", "data.seq_len=64"], "model.max_seq_len=65 does not divide by 2"),
        (["strategy=fsdp", "strategy.tp=2", "trainer.devices=2", "module.fp8.recipe=tensorwise", "module.fp8.fused_mlp=true"],
         "module.fp8.fused_mlp=true with strategy.tp=2"),
    ],
)
def test_what_tensor_parallel_cannot_split_is_refused_before_launch(tmp_path, monkeypatch, overrides, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = make_cfg([a for a in TINY if not a.startswith("trainer.devices")] + overrides, tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg)
