"""A damaged shard of the right size is caught: checksums in the manifest, `python -m lmtrain.data.prepare --verify`, a check
on open for small datasets, and token ids checked per block in the loader (issue 16, item 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.conftest import ROOT, TINY, run_train_cli


def _copy(dataset_dir, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    return ds, json.loads((ds / "manifest.json").read_text())


def _train(ds, tmp_path):
    args = TINY + [f"paths.runs={tmp_path / 'runs'}", f"data.path={ds}", "data.prepare=null", "model.vocab_size=1024"]
    return run_train_cli(args, tmp_path)


def _verify(ds):
    return subprocess.run([sys.executable, "-m", "data.prepare", "--verify", str(ds)], capture_output=True, text=True, cwd=ROOT)


def test_overwritten_bytes_are_caught_by_verify_and_before_training(dataset_dir, tmp_path):
    ds, manifest = _copy(dataset_dir, tmp_path)
    assert all("blake2b" in s for split in manifest["splits"].values() for s in split["shards"])
    ok = _verify(ds)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stderr
    shard = ds / manifest["splits"]["train"]["shards"][0]["path"]
    with open(shard, "r+b") as fh:  # 4 KB of 0xFF in the middle: the size is unchanged
        fh.seek(shard.stat().st_size // 2)
        fh.write(b"\xff" * 4096)
    bad = _verify(ds)
    assert bad.returncode == 2 and f"damaged: {shard}: checksum mismatch" in bad.stderr, bad.stderr
    res = _train(ds, tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"dataset shard {shard} is damaged: its checksum does not match the manifest" in res.stderr
    assert "parameters" not in res.stderr  # refused before the model was built


def test_token_ids_beyond_the_vocabulary_name_shard_and_offset(dataset_dir, tmp_path):
    """A shard entirely of 0xFF in a dataset without checksums (prepared before they existed): the loader's per-block
    check names the shard and the offset instead of F.embedding's IndexError (a device-side assert on a GPU)."""
    ds, manifest = _copy(dataset_dir, tmp_path)
    for split in manifest["splits"].values():
        for s in split["shards"]:
            s.pop("blake2b")
    manifest.pop("manifest_blake2b")  # nor of the manifest
    (ds / "manifest.json").write_text(json.dumps(manifest))
    shard = ds / manifest["splits"]["train"]["shards"][0]["path"]
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    res = _train(ds, tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"dataset shard {shard} is damaged: token id 65535 at token" in res.stderr and "not below the vocabulary (1024)" in res.stderr
    bad = _verify(ds)
    assert bad.returncode == 2 and "token id 65535 at token 0 is not below the vocabulary (1024)" in bad.stderr
