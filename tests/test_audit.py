"""``lmtrain audit RUN`` (lmtrain.audit): each step's samples from the run's own record, a real kill and resume read
once, a damaged record, an edited shard and a changed dataset named. The audit through five changes of layout and an
epoch's end is tests/test_reshard.py's six-layout run; through a rollback that skips data, tests/test_fsdp.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, TINY, run_train_cli, user_env

ARGS = [a for a in TINY if not a.startswith(("trainer.max_steps", "data.num_workers", "callbacks=", "logger="))] + [
    "trainer.max_steps=8", "scheduler.total_steps=8", "data.num_workers=2", "logger=csv", "callbacks=checkpoint",
    "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=3", "data.prepare=null",
]  # fmt: skip


def _audit(*args: str) -> subprocess.CompletedProcess:
    """``python -m lmtrain audit ARGS`` as a user types it."""
    env = {**user_env(), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lmtrain", "audit", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_killed_and_resumed_run_trained_every_sample_once_and_the_audit_names_what_changed(tmp_path, dataset_dir):
    """A real kill (SIGKILL at step 5, loader workers reading ahead) and a second launch that resumes from step 3: the
    audit finds every step's samples once and the resume, and the samples it names for steps 4-8 are the batches the
    resumed attempt took (recorded by a plugin); then a record shifted by one batch, an edited shard and a dataset
    whose shard changed under the run are each named, and the changed dataset's resume is refused, writing nothing."""
    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    base = [*ARGS, f"data.path={ds}", f"paths.runs={tmp_path / 'runs'}", "run_name=r"]
    run = tmp_path / "runs" / "r"
    killed = run_train_cli([*base, "fault=crash", "callbacks.fault.step=5"], tmp_path)
    assert killed.returncode != 0 and "crash at step 5" in killed.stderr, killed.stderr[-2000:]
    seen = tmp_path / "batches.pt"
    again = run_train_cli([*base, "+callbacks.rec._target_=tests.plugins.RecordBatches", f"+callbacks.rec.path={seen}"], tmp_path)
    assert again.returncode == 0 and "step-0000003" in again.stderr, again.stderr[-2000:]

    res = _audit(str(run))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("data: every step's samples once, steps 1-8 (8 recorded), epochs 0-0, 32 samples of 64 tokens")
    assert "  resumed at step 4\n" in res.stdout
    stored = sorted((run / "data_order").iterdir())  # written by the first attempt, kept by the second
    assert [p.name[:12] for p in stored] == ["epoch-00000-"] and f"order: epochs 0 read from {run / 'data_order'} (fingerprints checked)" in res.stdout
    from lmtrain import audit

    dm, order = audit.stream(run)
    steps, _ = audit.read_steps(run)
    taken = torch.load(seen)  # by global step: the resumed attempt's steps 4-8 (0-based 3-7)
    assert sorted(taken) == [3, 4, 5, 6, 7]
    for s in steps[3:]:
        named = torch.stack([dm.train_set[i][0] for i in order.epoch_order(s.epoch)[s.position : s.position + s.samples]])
        assert torch.equal(named, taken[s.step - 1]), f"step {s.step}"
    # the tokens read, taken up from the checkpoint of step 3 by the second attempt (4 samples of 64 tokens a step),
    # the same as the audit's count of the samples
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = {(r["a"], r["step"]): r["m"]["data/tokens/ds"] for r in rows if "data/tokens/ds" in r.get("m", {})}
    assert {s: tokens[2, s] for s in range(4, 9)} == {s: s * 4 * 64 for s in range(4, 9)}, tokens
    assert audit.per_source(dm, order, steps) == {str(ds): 32} and tokens[2, 8] == 32 * 64
    listed = _audit(str(run), "--step", "6")
    assert listed.returncode == 0 and listed.stdout.count(" block ") == 4 and f"{ds}  block " in listed.stdout, listed.stdout

    # the record damaged: step 6 said to begin one batch later
    record = run / "metrics.jsonl"
    kept = record.read_text()
    lines = [json.loads(line) for line in kept.splitlines()]
    hit = [x for x in lines if x.get("step") == 6 and "data/position" in x.get("m", {}) and x["a"] == 2]
    assert len(hit) == 1
    hit[0]["m"]["data/position"] += 4
    record.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = _audit(str(run))
    assert res.returncode == 1 and "step 6 (attempt 2) began at epoch 0 position 24; after step 5 (epoch 0 position 16, 4 samples a step) it should begin at epoch 0 position 20: samples skipped" in res.stdout, res.stdout
    # ... and step 6's row missing its sample count
    del hit[0]["m"]["data/position"], hit[0]["m"]["data/samples"]
    hit[0]["m"]["data/epoch"] = 0
    record.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = _audit(str(run))
    assert res.returncode == 2 and "step 6's data record lacks ['data/position', 'data/samples']: the record is damaged" in res.stderr, res.stderr
    record.write_text(kept)
    beyond = _audit(str(run), "--step", "9")  # a step the run did not reach: said, nothing listed
    assert beyond.returncode == 2 and beyond.stdout == "" and "step 9 is not in the run's record (steps 1-8)" in beyond.stderr, beyond

    # the stored order damaged: two samples swapped
    order_kept = stored[0].read_bytes()
    swapped = np.load(stored[0])
    swapped[[0, 1]] = swapped[[1, 0]]
    np.save(stored[0], swapped)
    res = _audit(str(run))
    assert res.returncode == 1 and res.stdout.startswith(f"order: {stored[0]}: the stored sample order of epoch 0 has fingerprint "), res.stdout
    assert f"not the {stored[0].stem[12:]} its name records: the file was damaged or edited" in res.stdout, res.stdout
    stored[0].write_bytes(order_kept)

    # a shard edited in place: its content no longer its manifest's hash
    shard = ds / "train_00000.bin"
    original = shard.read_bytes()
    ids = np.frombuffer(original, dtype=np.uint16).copy()
    ids[[10, 11]] = ids[[11, 10]] if ids[10] != ids[11] else (ids[10], (ids[11] + 1) % 1024)
    shard.write_bytes(ids.tobytes())
    res = _audit(str(run), "--verify-shards")
    assert res.returncode == 1 and f"shards: {shard}: checksum mismatch (the file changed after it was prepared)" in res.stdout, res.stdout

    # ... and the dataset re-made with that content (its manifest's hashes updated): the run's resume is refused
    from lmtrain.data.prepare import shard_checksum
    from lmtrain.formats.manifest import CHECKSUM_KEY, manifest_checksum

    manifest = json.loads((ds / "manifest.json").read_text())
    old = manifest["splits"]["train"]["shards"][0]["blake2b"]
    manifest["splits"]["train"]["shards"][0]["blake2b"] = new = shard_checksum(shard)
    manifest[CHECKSUM_KEY] = manifest_checksum(manifest)
    (ds / "manifest.json").write_text(json.dumps(manifest))
    logbook = (run / "logbook.jsonl").read_text()
    refused = run_train_cli([*base, "trainer.max_steps=10", "scheduler.total_steps=10"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"training shards changed: {shard} content {old} -> {new}" in refused.stderr, refused.stderr[-2000:]
    assert (run / "logbook.jsonl").read_text() == logbook and (run / "metrics.jsonl").read_text() == kept


def test_the_audit_refuses_what_is_not_a_run(tmp_path):
    res = _audit(str(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith(f"error: {tmp_path} has no metrics record"), res.stderr


def test_an_epochs_order_is_stored_once_read_back_exactly_and_a_damaged_file_is_named(tmp_path):
    """lmtrain.formats.order: 4 bytes a sample where the indices fit, read back equal with its fingerprint checked; a
    second store of the same order keeps the file, another order for the epoch replaces it; a truncated file is named."""
    from lmtrain.data.datamodule import BlockSampler
    from lmtrain.formats import order as order_file

    sampler = BlockSampler([700, 300], seed=5, weights=[2.0, 1.0])
    order, digest = sampler.epoch_order(3), sampler.order_digest(3)
    path = order_file.store(tmp_path, 3, order, digest)
    assert path.name == f"epoch-00003-{digest}.npy" and np.load(path).dtype == np.dtype("<u4")
    got, where = order_file.load(tmp_path, 3)
    assert where == path and np.array_equal(got, order) and order_file.fingerprint(got) == digest
    assert order_file.store(tmp_path, 3, order, digest) == path and path.stat().st_size < 1000 * 4 + 200
    assert order_file.load(tmp_path, 4) is None
    other = BlockSampler([700, 300], seed=6, weights=[2.0, 1.0])
    replaced = order_file.store(tmp_path, 3, other.epoch_order(3), other.order_digest(3))
    assert sorted((tmp_path / "data_order").iterdir()) == [replaced] and replaced != path
    replaced.write_bytes(replaced.read_bytes()[:-8])
    with pytest.raises(order_file.OrderDamaged, match=f"{replaced}: the stored sample order of epoch 3 cannot be read"):
        order_file.load(tmp_path, 3)
