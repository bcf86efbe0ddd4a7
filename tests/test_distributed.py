"""Real multi-process runs on CPU (gloo): Lightning's launcher, one run directory, rank-agreed metrics."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, run_train_cli


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_one_run_directory_a_failing_rank_ends_the_launch_and_the_resume_is_identical(tmp_path, dataset_dir):
    """2 ranks (gloo, Lightning re-launching train.py), dropout on, one launch serving three claims:
    1. without run_name both ranks agree on one run directory (not one per rank);
    2. rank 1 raises at step 5 while rank 0 goes on into the gradient all-reduce: the launch exits non-zero within
       seconds, naming the failure, instead of rank 0 waiting out the collective timeout; the checkpoint of step 4
       saved before the failure is intact;
    3. the same command resumes from it, every rank's RNG state and the data position restored, and logs exactly the
       per-step losses of an uninterrupted run."""
    import time

    from lmtrain.formats import checkpoint as ck
    from tests.test_checkpoint import CKPT, _losses

    base = [a for a in TINY if not a.startswith("trainer.devices")] + CKPT + [
        "strategy=ddp", "trainer.devices=2", "trainer.max_steps=8", "scheduler.total_steps=8", f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    ref = run_train_cli(base, tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    (ref_dir,) = (tmp_path / "runs").iterdir()  # one directory for the whole launch
    assert sorted(_losses(ref_dir)) == list(range(1, 9))

    t0 = time.monotonic()
    boom = ["+callbacks.boom._target_=tests.plugins.FailAtStep", "+callbacks.boom.step=5", "+callbacks.boom.rank=1"]
    fail = run_train_cli(base + ["run_name=cut", *boom], tmp_path, timeout=240)
    assert fail.returncode != 0 and "injected failure at step 5 on rank 1" in fail.stderr, fail.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    assert ck.newest(tmp_path / "runs" / "cut" / "checkpoints").step == 4

    rest = run_train_cli(base + ["run_name=cut"], tmp_path)
    assert rest.returncode == 0 and "resuming from" in rest.stderr and "step-0000004" in rest.stderr, rest.stderr[-3000:]
    assert _losses(tmp_path / "runs" / "cut") == _losses(ref_dir)


@pytest.mark.distributed
def test_closing_frees_every_gloo_group_before_the_interpreter_exits(tmp_path):
    """The cause of a rare 'terminate called without an active exception' after a successful 2-rank run: gloo
    groups outliving destroy_process_group (held by FSDP state cycles and by DeviceMeshes that DTensor's caches keep)
    were torn down during the interpreter's finalization. train.py's _close_process_group leaves no gloo thread."""
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port, torchrun_env

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(ROOT / "tests" / "close_groups_probe.py"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=torchrun_env(tmp_path, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        before, after = (int(part.split("=")[1]) for part in line.split())
        assert before > 0 and after == 0, f"rank {rank}: {line}"
