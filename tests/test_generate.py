"""`python -m lmtrain.generate`: a continuation from a run's newest checkpoint with the run's own tokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys

from lmtrain.run import train
from tests.conftest import ROOT, TINY, make_cfg


def _generate(run, *args):
    cmd = [sys.executable, "-m", "lmtrain.generate", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_generate_from_the_newest_checkpoint(tmp_path, dataset_dir):
    train(make_cfg(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=2",
                           "trainer.max_steps=3"], tmp_path, dataset_dir))  # fmt: skip
    run = tmp_path / "run"
    greedy = [_generate(run, "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "12") for _ in range(2)]
    assert all(g.returncode == 0 for g in greedy), greedy[0].stderr[-2000:]
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.startswith("def main(")
    assert "[step-0000003, step 3]" in greedy[0].stderr  # the newest complete checkpoint (2 and 3 exist)
    older = _generate(run, "--prompt", "x", "--checkpoint", "step-0000002", "--max-new-tokens", "4", "--seed", "3")
    assert older.returncode == 0 and "[step-0000002, step 2]" in older.stderr
    shutil.rmtree(run / "checkpoints")
    none = _generate(run, "--prompt", "x")
    assert none.returncode == 2 and "has no complete checkpoint" in none.stderr and "Traceback" not in none.stderr
