"""`python -m lmtrain.generate`: a continuation from a run's newest checkpoint with the run's own tokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys

from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli


def _generate(run, *args):
    cmd = [sys.executable, "-m", "lmtrain.generate", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_generate_from_the_newest_checkpoint(tmp_path, dataset_dir, capsys):
    """The first call as a user types it (a process); the others through the same main() in this process."""
    from lmtrain.generate import main

    train(make_cfg(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=2",
                           "trainer.max_steps=3"], tmp_path, dataset_dir))  # fmt: skip
    run = tmp_path / "run"
    greedy = _generate(run, "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "12")
    assert greedy.returncode == 0, greedy.stderr[-2000:]
    assert greedy.stdout.startswith("def main(") and "[step-0000003, step 3]" in greedy.stderr  # the newest (2 and 3 exist)
    capsys.readouterr()
    assert main([str(run), "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == greedy.stdout  # greedy decoding is deterministic
    assert main([str(run), "--prompt", "x", "--checkpoint", "step-0000002", "--max-new-tokens", "4", "--seed", "3"]) == 0
    assert "[step-0000002, step 2]" in capsys.readouterr().err
    import torch

    root = run / "checkpoints"
    bad = [
        (
            ["--checkpoint", "step-0000999"],
            f"--checkpoint step-0000999: no such checkpoint in {root} (the complete ones are step-0000002, step-0000003)",
        ),
        (["--checkpoint", "../run"], f"--checkpoint ../run: no such checkpoint in {root}"),
        (["--temperature", "-1"], "--temperature -1 must be >= 0 (0: greedy decoding)"),
        (["--top-k", "-5", "--max-new-tokens", "0"], "--top-k -5 must be >= 0 (0: no top-k); --max-new-tokens 0 must be >= 1"),
        (["--device", "tpu"], "--device tpu: not a device (auto, cpu, cuda or cuda:N)"),
    ]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "--device cuda: this machine has no usable GPU (torch.cuda.is_available() is false)"))
    for extra, said in bad:
        code, err = main([str(run), "--prompt", "x", *extra]), capsys.readouterr().err
        assert code == 2 and err.startswith(f"error: {said}") and len(err.strip().splitlines()) == 1, (extra, err)
    shutil.rmtree(run / "checkpoints")
    code, err = main([str(run), "--prompt", "x"]), capsys.readouterr().err
    assert code == 2 and "has no complete checkpoint" in err and "Traceback" not in err


def test_a_checkpoint_whose_contents_are_damaged_is_one_error_naming_it(tmp_path, dataset_dir, capsys):
    """Sizes intact, contents not (a sharded checkpoint's metadata zeroed in place). The CRC-32 recorded at save
    catches it: picked as the newest, it is skipped with a warning naming the file (no other checkpoint: exit 2);
    named with --checkpoint, it is refused. In a checkpoint from before the CRCs (none in meta.json), its metadata's
    pickle, read when the checkpoint is chosen, names it. Never a traceback, and the file is left as it was. The sharded run trains in its
    own process: in this one, Lightning would leave MASTER_PORT set and its gloo store listening on it."""
    import json

    from lmtrain.generate import main

    run = tmp_path / "run"
    res = run_train_cli(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=2",
                                "trainer.max_steps=2", "strategy=fsdp", f"data.path={dataset_dir}", "data.prepare=null",
                                f"run_dir={run}"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-0000002"
    metadata = ckpt / ".metadata"
    damaged = bytearray(metadata.read_bytes())
    damaged[10:60] = bytes(50)
    metadata.write_bytes(bytes(damaged))
    code, err = main([str(run), "--prompt", "x"]), capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"skipping damaged checkpoint {ckpt}: .metadata has CRC-32 " in err and "its contents are damaged" in err
    assert "has no complete checkpoint" in err
    code, err = main([str(run), "--prompt", "x", "--checkpoint", ckpt.name]), capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"error: checkpoint {ckpt} is not usable: .metadata has CRC-32 " in err, err
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["crc32"], meta["meta_crc32"]  # as saved before the CRCs
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, err = main([str(run), "--prompt", "x"]), capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    # its metadata's pickle is read (safely) when the checkpoint is chosen: the damage is named there
    assert f"skipping damaged checkpoint {ckpt}: .metadata does not read (UnpicklingError" in err, err
    assert "has no complete checkpoint" in err
    assert metadata.read_bytes() == bytes(damaged)
