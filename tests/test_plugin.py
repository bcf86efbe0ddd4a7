"""The README's plugin example: a user's callback, optimizer and Lightning plugin from their own --config-dir."""

from __future__ import annotations

import pytest

from lmtrain.formats.metrics import metric
from tests.conftest import ROOT, run_train_cli

PLUGIN = ROOT / "examples" / "plugin"


@pytest.mark.slow
def test_user_config_dir_plugs_in_callback_optimizer_and_lightning_plugin(tmp_path, dataset_dir):
    args = [
        "--config-dir", str(PLUGIN / "conf"), "experiment=my_run",
        "trainer.enable_progress_bar=false", "trainer.max_steps=6", "trainer.val_check_interval=3", "scheduler.warmup_steps=2",
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path, extra_path=[PLUGIN])
    assert res.returncode == 0, res.stderr[-3000:]
    config = (tmp_path / "runs" / "my-run" / "config.yaml").read_text()
    assert "_target_: torch.optim.SGD" in config and "my_plugins.TokensSeen" in config and "TorchCheckpointIO" in config
    assert metric(tmp_path / "runs" / "my-run", "data/tokens_seen") == [512.0 * i for i in range(1, 7)]
