"""The README's plugin example: a user's callback, optimizer and Lightning plugin from their own --config-dir."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_user_config_dir_plugs_in_callback_optimizer_and_lightning_plugin(tmp_path, dataset_dir):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'examples' / 'plugin'}:{ROOT}", "LMTRAIN_RUN_ID": ""}
    cmd = [
        sys.executable, str(ROOT / "train.py"), "--config-dir", str(ROOT / "examples" / "plugin" / "conf"), "experiment=my_run",
        "trainer.enable_progress_bar=false", "trainer.max_steps=6", "trainer.val_check_interval=3", "scheduler.warmup_steps=2",
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    config = (tmp_path / "runs" / "my-run" / "config.yaml").read_text()
    assert "_target_: torch.optim.SGD" in config and "my_plugins.TokensSeen" in config and "TorchCheckpointIO" in config
    with open(tmp_path / "runs" / "my-run" / "csv" / "metrics.csv") as fh:
        seen = [float(r["data/tokens_seen"]) for r in csv.DictReader(fh) if r.get("data/tokens_seen")]
    assert seen == [512.0 * i for i in range(1, 7)]
