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
