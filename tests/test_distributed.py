"""Real multi-process runs on CPU (gloo): Lightning's launcher, one run directory, rank-agreed metrics."""

from __future__ import annotations

import pytest

from lmtrain.logs import metric
from tests.conftest import TINY, run_train_cli


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_share_one_run_directory(tmp_path, dataset_dir):
    """`strategy=ddp trainer.devices=2`: Lightning re-launches train.py; both ranks agree on the run name."""
    args = [a for a in TINY if not a.startswith("trainer.devices")] + [
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "logger=csv",
        f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}",
        "data.prepare=null",
    ]
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = [p for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1, runs  # one directory for the whole launch, not one per rank
    assert len(metric(runs[0], "train/loss")) == 3


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_resume_identically(tmp_path, dataset_dir):
    """2 ranks (gloo), dropout on: stopped after step 4 and re-run to 8, every rank's RNG state and the data
    position restored, the logged loss equals an uninterrupted 8-step run exactly."""
    from tests.test_checkpoint import CKPT, _losses

    base = [a for a in TINY if not a.startswith("trainer.devices")] + CKPT + [
        "strategy=ddp", "trainer.devices=2", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    ref = run_train_cli(base + ["run_name=ref", "trainer.max_steps=8"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    part = run_train_cli(base + ["run_name=cut", "trainer.max_steps=5"], tmp_path)
    assert part.returncode == 0, part.stderr[-3000:]
    rest = run_train_cli(base + ["run_name=cut", "trainer.max_steps=8"], tmp_path)
    assert rest.returncode == 0 and "step-0000005" in rest.stderr, rest.stderr[-3000:]
    assert _losses(tmp_path / "runs" / "cut") == _losses(tmp_path / "runs" / "ref")
    assert sorted(_losses(tmp_path / "runs" / "ref")) == list(range(8))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_on_one_rank_ends_every_rank(tmp_path, dataset_dir):
    """Rank 1 raises at step 5 while rank 0 goes on into the gradient all-reduce: the launch exits non-zero within
    seconds, naming the failure, instead of rank 0 waiting out the collective timeout; the checkpoint saved before
    the failure is intact and the run resumes from it."""
    import time

    from lmtrain import checkpoint as ck

    args = [a for a in TINY if not a.startswith(("trainer.devices", "callbacks"))] + [
        "strategy=ddp", "trainer.devices=2", "trainer.max_steps=8", "logger=csv", f"paths.runs={tmp_path / 'runs'}", "run_name=fail",
        f"data.path={dataset_dir}", "data.prepare=null", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0",
        "callbacks.checkpoint.every_n_steps=4",
    ]  # fmt: skip
    t0 = time.monotonic()
    res = run_train_cli(args + ["+callbacks.boom._target_=tests.plugins.FailAtStep", "+callbacks.boom.step=5", "+callbacks.boom.rank=1"],
                        tmp_path, timeout=240)  # fmt: skip
    assert res.returncode != 0 and "injected failure at step 5 on rank 1" in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    assert ck.newest(tmp_path / "runs" / "fail" / "checkpoints").step == 4
    again = run_train_cli(args, tmp_path)
    assert again.returncode == 0 and "resuming from" in again.stderr, again.stderr[-3000:]
    assert ck.newest(tmp_path / "runs" / "fail" / "checkpoints").step == 8


@pytest.mark.distributed
def test_closing_frees_every_gloo_group_before_the_interpreter_exits(tmp_path):
    """The cause of a rare 'terminate called without an active exception' after a successful 2-rank run: gloo
    groups outliving destroy_process_group (held by FSDP state cycles and by DeviceMeshes that DTensor's caches keep)
    were torn down during the interpreter's finalization. train.py's _close_process_group leaves no gloo thread."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29531", str(ROOT / "tests" / "close_groups_probe.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        before, after = (int(part.split("=")[1]) for part in line.split())
        assert before > 0 and after == 0, f"rank {rank}: {line}"
