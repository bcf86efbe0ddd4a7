"""Hostile files and names: a crafted pickle runs nothing (train, generate, export, a sharded checkpoint's
metadata), and names and paths stay inside the directories they belong to."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from lmtrain.formats import checkpoint as ck
from lmtrain.formats import untrusted
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg, run_train_cli


class _Payload:
    """Pickled, it asks the loader to call ``os.system``: what an attacker's checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _reseal(ckpt_dir: Path) -> None:
    """meta.json's sizes and CRC-32s made to match the files as they are now: the attacker edits those too."""
    meta = json.loads((ckpt_dir / ck.META).read_text())
    meta["files"] = ck.dir_files(ckpt_dir)
    meta["crc32"] = {rel: ck.file_crc32(ckpt_dir / rel) for rel in meta["files"]}
    meta.pop("meta_crc32", None)  # as a checkpoint from before meta.json's own CRC-32
    ck.write_json_atomic(ckpt_dir / ck.META, meta)


def _craft(path: Path, marker: Path) -> None:
    """A real checkpoint file with one more entry whose unpickling runs a shell command."""
    state = torch.load(path, weights_only=True)
    state["extra"] = _Payload(marker)
    torch.save(state, path)


@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory, dataset_dir):
    """A run with checkpoints at steps 2 and 4, the newest one's checkpoint.pt crafted (sealed with its new size and
    CRC-32), and a crafted plain Lightning ``.ckpt``."""
    tmp = tmp_path_factory.mktemp("crafted")
    args = [*TINY, "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0", "run_name=victim"]
    cfg = make_cfg([*args, f"paths.runs={tmp / 'runs'}"], tmp, dataset_dir)
    train(cfg)
    run = Path(cfg.run_dir)
    marker = tmp / "PWNED"
    newest = run / "checkpoints" / ck.step_name(4)
    shutil.copy(newest / ck.SINGLE_FILE, tmp / "evil.ckpt")
    _craft(newest / ck.SINGLE_FILE, marker)
    _reseal(newest)
    _craft(tmp / "evil.ckpt", marker)
    return tmp, run, marker, args


def test_a_crafted_checkpoint_runs_nothing_under_generate_and_export(crafted_run, capsys):
    from lmtrain import export, generate

    tmp, run, marker, _ = crafted_run
    for main, extra in ((generate.main, ["--prompt", "def "]), (export.main, ["--out", str(tmp / "out")])):
        assert main([str(run), "--checkpoint", ck.step_name(4), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is refused: its pickle asks for posix.system" in err[0] and "checkpoint.pt" in err[0], err
    # without --checkpoint: the crafted newest one is named and passed over, the one before used
    assert generate.main([str(run), "--prompt", "def ", "--max-new-tokens", "2"]) == 0
    assert "skipping damaged checkpoint" in capsys.readouterr().err
    assert not marker.exists()


def test_a_crafted_checkpoint_runs_nothing_under_train(crafted_run, dataset_dir):
    tmp, run, marker, args = crafted_run
    base = [*args, f"paths.runs={tmp / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null"]
    for path in (run / "checkpoints" / ck.step_name(4), tmp / "evil.ckpt"):
        res = run_train_cli([*base, "run_name=branch", f"ckpt_path={path}"], tmp)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert "is refused: its pickle asks for posix.system" in res.stderr.strip().splitlines()[-1], res.stderr[-1000:]
        assert not (tmp / "runs" / "branch" / "config.yaml").exists()
    # the run itself resumes from the checkpoint before the crafted one, which it names and moves aside
    res = run_train_cli([*base, f"run_dir={run}", "trainer.max_steps=6"], tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"skipping damaged checkpoint {run / 'checkpoints' / ck.step_name(4)}" in res.stderr
    assert "resuming from" in res.stderr and ck.step_name(2) in res.stderr
    assert not marker.exists()


def test_a_crafted_distributed_checkpoint_metadata_runs_nothing(tmp_path):
    """A real distributed checkpoint (written by torch.distributed.checkpoint in one process) reads through the safe
    reader; with its ``.metadata`` replaced by a crafted pickle it is refused, unrun, by the checkpoint check and by
    the reader."""
    import torch.distributed.checkpoint as dcp

    from lmtrain.training.compat import read_distributed_checkpoint

    partial = tmp_path / ck.partial_name(3)
    dcp.save({"state_dict": {"model.w": torch.arange(6.0)}}, storage_writer=dcp.FileSystemWriter(str(partial)), no_dist=True)
    torch.save({"global_step": 3}, partial / "meta.pt")
    ck.commit(partial, tmp_path / ck.step_name(3), {"step": 3, "format": "sharded"})
    good = tmp_path / ck.step_name(3)
    checkpoint, why = ck.verified(good)
    assert why is None and checkpoint is not None
    assert torch.equal(read_distributed_checkpoint(good)["state_dict"]["model.w"], torch.arange(6.0))

    marker = tmp_path / "PWNED"
    (good / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _reseal(good)
    checkpoint, why = ck.verified(good)
    assert checkpoint is None and "is refused: its pickle asks for posix.system" in why
    with pytest.raises(untrusted.RefusedFile, match="posix.system"):
        read_distributed_checkpoint(good)
    assert not marker.exists()


def test_a_checkpoint_file_without_crcs_whose_pickle_is_damaged_is_passed_over(tmp_path, dataset_dir):
    """Bytes damaged in a checkpoint that recorded no CRC-32 (checksums=false) are found when its pickle is read before
    the resume: the run continues from the checkpoint before instead of failing inside the load."""
    args = [*TINY, "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0",
            "callbacks.checkpoint.checksums=false"]  # fmt: skip
    cfg = make_cfg(args, tmp_path, dataset_dir)
    train(cfg)
    newest = Path(cfg.run_dir) / "checkpoints" / ck.step_name(4)
    path = newest / ck.SINGLE_FILE
    raw = bytearray(path.read_bytes())
    at = raw.find(b"data.pkl") + 40  # inside the pickle's zip member, the size kept
    raw[at : at + 16] = bytes(16)
    path.write_bytes(bytes(raw))
    assert ck.unreadable(ck.Checkpoint(4, newest, {"format": "single"})) is not None
    resumed = ck.newest_intact(ck.scan(newest.parent))
    assert resumed is not None and resumed.step == 2
    # bytes of a model weight turned into NaNs in place (0xFF...): the pickle reads, the weights do not pass
    older = newest.parent / ck.step_name(2) / ck.SINGLE_FILE
    with open(older, "r+b") as fh:
        fh.seek(older.stat().st_size // 10)
        fh.write(b"\xff" * 4096)
    why = ck.unreadable(ck.Checkpoint(2, older.parent, {"format": "single"}))
    assert why is not None and "holds non-finite model weights" in why, why


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "."])
def test_a_run_name_that_is_not_one_path_component_is_refused_before_anything_is_written(name, tmp_path, dataset_dir):
    from lmtrain.training.config import ConfigError

    runs = tmp_path / "deep" / "runs"
    args = [*TINY, f"paths.runs={runs}", f"run_name={name}", f"data.path={dataset_dir}", "data.prepare=null"]
    if name == "../x":  # as a user runs it: one line, exit 2, and not even Hydra's folder made
        res = run_train_cli(args, tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"run_name='{name}' is not a plain name" in res.stderr, res.stderr[-1000:]
    from hydra import compose, initialize_config_dir

    from tests.conftest import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=args)
    with pytest.raises(ConfigError, match="is not a plain name"):
        train(cfg)
    assert not (tmp_path / "deep").exists()  # nothing written, inside or outside the runs directory


@pytest.mark.parametrize("shard", ["../outside/secret.bin", "/etc/passwd", "sub/../../x.bin"])
def test_a_manifest_naming_a_shard_outside_its_directory_is_refused(shard, tmp_path, dataset_dir):
    from lmtrain.formats.manifest import PrepareError, read_manifest

    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["path"] = shard
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PrepareError, match="was changed after the dataset was prepared"):  # its checksum
        read_manifest(ds)
    del manifest["manifest_blake2b"]  # a crafted manifest without one, as a dataset prepared before there was one
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PrepareError, match=f"names the shard '{re.escape(shard)}', which is not a file inside the dataset directory"):
        read_manifest(ds)


def test_a_manifest_that_is_not_utf8_or_deleted_is_one_clear_message(tmp_path, dataset_dir):
    from lmtrain.formats.manifest import PrepareError, read_manifest

    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    (ds / "manifest.json").write_bytes(b'{"dtype": "\xff\xfe"}')
    with pytest.raises(PrepareError, match="corrupt dataset manifest .*UnicodeDecodeError"):
        read_manifest(ds)
    (ds / "manifest.json").unlink()
    with pytest.raises(PrepareError, match="has token shards but no manifest.json"):
        read_manifest(ds)


def test_every_control_request_is_checked_where_it_is_applied(tmp_path, dataset_dir, capsys):
    """Request files, whatever wrote them, waiting when the run starts: the bad ones (any bytes, any content, a factor
    out of bounds) are moved to control/rejected/ with their reason in the logbook and never stop training or drop the
    good ones of the same poll; ``--value`` sets the rate the run uses, whatever was in force. Then an operator's
    revocation, applied at the resume's first step, and ``status`` saying what is in force and what was revoked."""
    from lmtrain.control import main
    from lmtrain.formats import corrections, logbook

    run = tmp_path / "run"
    folder = run / "control"
    folder.mkdir(parents=True)
    bad = {
        "a-negative": b'{"scale": -1}', "b-zero": b'{"value": 0}', "c-bytes": b'{"scale": "\xff\xfe"}', "d-list": b"[1, 2]",
        "e-empty": b"{}", "f-text": b'{"scale": "abc"}', "g-huge": b'{"scale": 1e30}', "h-nan": b'{"scale": NaN}',
        "i-inf": b'{"value": 1e400}', "j-both": b'{"scale": 0.5, "value": 1e-4}', "k-bool": b'{"scale": true}',
        "l-decay": b'{"decay_steps": 2}',  # a cooldown for a run without scheduler=wsd
    }  # fmt: skip
    for name, body in bad.items():
        (folder / f"lr-{name}.json").write_bytes(body)
    # Files that are not plain files would block rank zero's poll in open() or read() (issue 57, 6): a named pipe with
    # no writer, a symbolic link to an endless device, a directory; and a file far larger than any request.
    os.mkfifo(folder / "lr-m-fifo.json")
    (folder / "lr-n-link.json").symlink_to("/dev/zero")
    (folder / "lr-o-dir.json").mkdir()
    (folder / "lr-p-large.json").write_bytes(b" " * (1 << 20) + b'{"scale": 0.5}')
    odd = {"m-fifo": "not a regular file (a named pipe)", "n-link": "not a regular file (a symbolic link)",
           "o-dir": "not a regular file (a directory)", "p-large": "larger than 65,536 bytes"}  # fmt: skip
    (folder / "lr-x-good.json").write_text(json.dumps({"scale": 0.5}))
    (folder / "lr-y-good.json").write_text(json.dumps({"value": 2e-4}))
    rec = ["+callbacks.rec._target_=tests.plugins.RecordLR", f"+callbacks.rec.path={tmp_path / 'lr'}"]
    args = [*TINY, "callbacks=[checkpoint,stability]", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=2", *rec]
    train(make_cfg(args, tmp_path, dataset_dir))  # trains to its end
    assert sorted(p.name for p in (folder / "rejected").iterdir()) == sorted(f"lr-{n}.json" for n in [*bad, *odd])
    assert sorted(p.name for p in (folder / "applied").iterdir()) == ["lr-x-good.json", "lr-y-good.json"]
    rejected = {e["file"]: e["message"] for e in logbook.read(run) if e["kind"] == "control_rejected"}
    assert "not a finite positive number" in rejected["lr-a-negative.json"] and "not UTF-8 text" in rejected["lr-c-bytes.json"]
    assert "not a JSON object but list" in rejected["lr-d-list.json"] and "exactly one of" in rejected["lr-e-empty.json"]
    assert "outside callbacks.lr_control.factor_bounds=[0.0001, 10]" in rejected["lr-g-huge.json"]
    assert "decay needs scheduler=wsd" in rejected["lr-l-decay.json"]
    assert all(why in rejected[f"lr-{n}.json"] for n, why in odd.items()), rejected
    lrs = {int(k): v for k, v in json.loads((tmp_path / "lr.rank0.json").read_text()).items()}
    assert lrs[0] == pytest.approx(2e-4, rel=1e-9)  # set to 2e-4, not 2e-4 x the 0.5 in force
    entries = corrections.load(run)
    assert [e["reason"] for e in entries] == ["operator", "operator"]

    capsys.readouterr()
    assert main([str(run), "revoke", "1"]) == 0
    assert main([str(run), "revoke", "7"]) == 2 and "7 is not the number of a correction" in capsys.readouterr().err
    train(make_cfg([*args, "trainer.max_steps=6", "scheduler.total_steps=4"], tmp_path, dataset_dir))
    entries = corrections.load(run)
    assert entries[2]["reason"] == "revoke" and entries[2]["revokes"] == [1] and entries[2]["from_step"] == 4
    lrs = {int(k): v for k, v in json.loads((tmp_path / "lr.rank0.json").read_text()).items()}
    assert corrections.multiplier(entries, 4) == 0.5
    assert lrs[4] == pytest.approx(1e-3 * 0.1 * 0.5, rel=1e-9) and lrs[5] == lrs[4]  # the schedule's floor x the 0.5 left
    capsys.readouterr()
    assert main([str(run), "status"]) == 0
    out = capsys.readouterr().out
    assert "  0  from step        0: x0.5  operator" in out and ": in force" in out.splitlines()[0]
    assert "REVOKED by 2 (revoke)" in out.splitlines()[1] and "rejected requests: 16" in out
    assert main([str(run), "lr", "--value", "inf"]) == 2 and "finite positive" in capsys.readouterr().err


def test_a_manifest_edited_under_a_run_is_refused_at_the_resume(tmp_path, dataset_dir):
    """The separator id edited in the dataset's manifest after the run saved (the fingerprint, of the inputs, unchanged):
    the resume is refused naming it, before anything of the run is written. Refused by the manifest's checksum; a
    manifest without one (prepared before there was one) by its tokenizer's separator."""
    from lmtrain.errors import InputError

    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    args = [*TINY, "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0"]
    train(make_cfg(args, tmp_path, ds))
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["eos_id"] = manifest["eos_id"] - 1
    (ds / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    before = (run / "config.yaml").read_bytes()
    with pytest.raises(InputError, match=r"manifest.json was changed after the dataset was prepared \(its manifest_blake2b"):
        train(make_cfg([*args, "trainer.max_steps=6"], tmp_path, ds))
    del manifest["manifest_blake2b"]
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"manifest.json says the document separator is token \d+, but its tokenizer"):
        train(make_cfg([*args, "trainer.max_steps=6"], tmp_path, ds))
    assert (run / "config.yaml").read_bytes() == before


def test_a_manifest_whose_separator_or_token_type_was_changed_is_refused(tmp_path, dataset_dir):
    """Issue 57, 8: ``eos_id`` or ``dtype: int16`` edited in a fresh dataset's manifest. With its checksum: refused
    naming the file. Without one (a dataset prepared before there was one): the token type against the vocabulary, the
    separator against the tokenizer; from the command line each is exit 2 with no run directory."""
    from lmtrain.formats.manifest import PrepareError, read_manifest
    from tests.conftest import run_train_cli

    for key, value, said in [
        ("dtype", "int16", "dtype 'int16', but a vocabulary of 1,024 tokens is stored as uint16"),
        ("eos_id", 5, "manifest.json says the document separator is token 5, but its tokenizer"),
        ("eos_id", 10**6, "eos_id 1000000 is not a token of the vocabulary of 1024"),
    ]:
        ds = tmp_path / f"ds-{key}-{value}"
        shutil.copytree(dataset_dir, ds)
        manifest = json.loads((ds / "manifest.json").read_text())
        assert manifest["vocab_size"] == 1024 and manifest["eos_id"] != 5
        manifest[key] = value
        (ds / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PrepareError, match=re.escape(f"dataset manifest {ds / 'manifest.json'} was changed after the dataset was prepared")):
            read_manifest(ds)
        del manifest["manifest_blake2b"]
        (ds / "manifest.json").write_text(json.dumps(manifest))
        run = tmp_path / f"run-{key}-{value}"
        res = run_train_cli([*TINY, f"data.path={ds}", "data.prepare=null", f"run_dir={run}"], tmp_path)
        assert res.returncode == 2 and said in res.stderr.strip().splitlines()[-1], res.stderr[-2000:]
        assert not run.exists()
