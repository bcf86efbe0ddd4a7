"""Real multi-process runs on CPU (gloo): Lightning's launcher, one run directory, rank-agreed metrics."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_two_processes_share_one_run_directory(tmp_path, dataset_dir):
    """`strategy=ddp trainer.devices=2`: Lightning re-launches train.py; both ranks agree on the run name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    args = [a for a in TINY if not a.startswith("trainer.devices")] + [
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "logger=csv",
        f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}",
        "data.prepare=null",
    ]
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    runs = [p for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1, runs  # one directory for the whole launch, not one per rank
    with open(runs[0] / "csv" / "metrics.csv") as fh:
        losses = [r["train/loss"] for r in csv.DictReader(fh) if r.get("train/loss")]
    assert len(losses) == 3
