"""Every input a user can get wrong ends in one clear error naming it (exit 2, no traceback), nothing lost."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmtrain.data.prepare import read_manifest
from lmtrain.errors import InputError
from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli


def _broken_dataset(kind: str, good: Path, tmp_path: Path) -> Path:
    ds = tmp_path / f"ds-{kind}"
    if kind == "missing":
        return ds
    shutil.copytree(good, ds)
    if kind == "corrupt-manifest":
        (ds / "manifest.json").write_text("{not json")
    elif kind == "truncated-shard":
        shard = ds / read_manifest(ds)["splits"]["train"]["shards"][0]["path"]
        os.truncate(shard, shard.stat().st_size - 2)
    elif kind == "corrupt-tokenizer":
        (ds / "tokenizer.tiktoken").write_bytes(b"%%% not a ranks file\n")
    return ds


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", r"no prepared dataset at .*ds-missing \(manifest.json missing\)"),
        ("corrupt-manifest", r"corrupt dataset manifest .*ds-corrupt-manifest/manifest.json"),
        ("truncated-shard", r"dataset shard .*ds-truncated-shard/train_00000.bin is damaged"),
    ],
)
def test_bad_dataset_is_one_message(kind, message, dataset_dir, tmp_path):
    """In this process for each damage; the first also as a user runs it (exit 2, the line, no traceback)."""
    ds = _broken_dataset(kind, dataset_dir, tmp_path)
    before = {p.name: p.read_bytes() for p in ds.iterdir()} if ds.exists() else None
    args = [*TINY, f"paths.runs={tmp_path / 'runs'}", f"data.path={ds}", "data.prepare=null"]
    if kind == "missing":
        res = run_train_cli(args, tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert re.search(message, res.stderr.strip().splitlines()[-1]), res.stderr[-1000:]
    with pytest.raises(InputError, match=message):
        train(make_cfg(args, tmp_path))
    after = {p.name: p.read_bytes() for p in ds.iterdir()} if ds.exists() else None
    assert after == before  # the user's files are untouched


def test_corrupt_tokenizer_file_is_named(dataset_dir, tmp_path):
    ds = _broken_dataset("corrupt-tokenizer", dataset_dir, tmp_path)
    from lmtrain.data.datamodule import TokenDataModule

    with pytest.raises(InputError, match=r"corrupt tokenizer ranks file .*tokenizer.tiktoken at line 1"):
        TokenDataModule(str(ds)).tokenizer()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ckpt_path=/nonexistent/last.ckpt"], r"ckpt_path='/nonexistent/last.ckpt' does not exist"),
    ],
)
def test_bad_paths_are_one_message(overrides, message, dataset_dir, tmp_path):
    res = run_train_cli([*TINY, f"data.path={dataset_dir}", "data.prepare=null", *overrides], tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    import re

    assert re.search(message, res.stderr), res.stderr[-1000:]


def test_run_directory_that_cannot_be_created(tiny_cfg, tmp_path):
    (tmp_path / "afile").write_text("")
    cfg = tiny_cfg(f"run_dir={tmp_path / 'afile' / 'run'}")
    with pytest.raises(InputError, match=r"cannot create the run directory .*afile/run"):
        train(cfg)


def _limit_file_size():  # a disk that fills up after 20 kB per file (EFBIG, as ENOSPC would)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_prepare_on_a_full_disk_fails_clearly_and_keeps_the_old_dataset(corpus_jsonl, dataset_dir, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(dataset_dir, ds)
    before = {p.name: p.read_bytes() for p in ds.iterdir()}
    cmd = [
        sys.executable,
        "-m",
        "data.prepare",
        "--input",
        str(corpus_jsonl),
        "--output",
        str(ds),
        "--tokenizer",
        "bpe:600",
        "--force",
        "--workers",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert f"writing the dataset for {ds} failed (File too large; disk full?)" in res.stderr
    assert {p.name: p.read_bytes() for p in ds.iterdir()} == before  # the dataset that was there is intact
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ds.")]  # no partial copy left


def test_resuming_with_another_data_seed_is_refused(tiny_cfg, tmp_path, dataset_dir):
    ckpt_args = [
        "trainer.enable_checkpointing=true", "+callbacks.ckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.ckpt.dirpath={tmp_path / 'ckpt'}", "+callbacks.ckpt.filename=last", "trainer.max_steps=2",
    ]  # fmt: skip
    train(tiny_cfg(*ckpt_args))
    cfg = make_cfg([*TINY, "seed=99", "trainer.max_steps=3", f"ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}"], tmp_path / "b", dataset_dir)
    with pytest.raises(InputError, match=r"another data stream \(data.seed: 1234 -> 99\)"):
        train(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["callbacks=default", "callbacks.checkpoint.keep_last=1"], r"callbacks.checkpoint.keep_last=1: keep at least 2"),
        (["callbacks=default", "callbacks.disk_guard.margin_gb=-1"], r"callbacks.disk_guard.margin_gb=-1 must be >= 0"),
        (["callbacks=default", "callbacks.lr_control.scale=0"], r"callbacks.lr_control.scale=0: must be a positive factor"),
        (["callbacks=default", "callbacks.divergence.loss_spike={action: explode}"], r"callbacks.divergence.loss_spike.action='explode'"),
        (["strategy=fsdp", "strategy.activation_checkpointing=some"], r"strategy.activation_checkpointing='some': use one of"),
        (["strategy=fsdp", "strategy.reduce_dtype=fp8"], r"strategy.reduce_dtype='fp8': use one of \['float32', 'bfloat16'\]"),
        (["fault=crash", "callbacks.fault.kind=boom"], r"fault.kind='boom': use one of"),
        (["module.sdpa_backend=fast"], r"module.sdpa_backend='fast': use one of"),
        (["module.loss_chunk_tokens=0"], r"module.loss_chunk_tokens=0: give a positive number of tokens, or null"),
        (["module.loss_kernel=cce"], r"module.loss_kernel='cce': use one of \['liger'\] or null"),
        (["module.loss_chunk_tokens=many"], r"module.loss_chunk_tokens='many': give a positive number of tokens, or null"),
        (["callbacks=[none,samples]", "callbacks.samples.prompts=[]"], r"callbacks.samples.prompts: give one or more non-empty prompts"),
        (
            ["callbacks=[none,progress_bar]", "callbacks.progress_bar.mode=fancy"],
            r"callbacks.progress_bar.mode='fancy': expected auto, bar or lines",
        ),
        (
            ["callbacks=[none,throughput]", "callbacks.throughput.smoothing_steps=0"],
            r"callbacks.throughput.smoothing_steps=0: give a whole number",
        ),
        (["callbacks=[none,profiler]", "callbacks.profiler.steps=0"], r"callbacks.profiler: start_step=20 must be >= 1 and steps=0 >= 1"),
        (
            ["callbacks=[none,gc]", "callbacks.gc.every_n_steps=0"],
            r"callbacks.gc: every_n_steps=0 and full_every_n_steps=1000 must be >= 1",
        ),
        (
            ["callbacks=[none,gc]", "callbacks.gc.every_n_steps=often"],
            r"callbacks.gc: every_n_steps=often and full_every_n_steps=1000 must be >= 1",
        ),
        (
            ["data=mixture", "data.sources=[{path: /x, weight: -1}]", "data.path=null"],
            r"data.sources\[0\].weight = -1: must be a positive number",
        ),
        (["preemption.signals=[SIGTERM,SIGFOO]"], r"preemption: signals=\['SIGTERM', 'SIGFOO'\] must name catchable signals .*not SIGFOO"),
        (["preemption.signals=[SIGKILL]"], r"preemption: signals=\['SIGKILL'\] must name catchable signals .*not SIGKILL"),
        (["preemption.grace_s=0"], r"preemption: .*grace_s=0 must be a number of seconds > 0"),
        (
            ["callbacks=[none,stability]", "callbacks.lr_control.factor_bounds=[2,1]"],
            r"callbacks.lr_control.factor_bounds=\[2, 1\]: must be \[low, high\] with 0 < low <= 1 <= high",
        ),
        (
            ["callbacks=[none,stability]", "callbacks.lr_control.factor_bounds=0.5"],
            r"callbacks.lr_control.factor_bounds=0.5: must be \[low, high\]",
        ),
    ],
)
def test_bad_option_values_checked_by_constructors_are_one_message(overrides, message, dataset_dir, tmp_path, capsys):
    """Options validated in a class's constructor end like every other input error (an InputError, which Hydra would
    have wrapped in its InstantiationException), before any data is prepared or anything is written in the run
    directory. In this process; the command line's exit 2 and one line: test_a_bad_option_value_from_the_command_line."""
    cfg = make_cfg([*TINY, f"paths.runs={tmp_path / 'runs'}", "run_name=bad", *overrides], tmp_path, dataset_dir)
    with pytest.raises(InputError, match=message):
        train(cfg)
    assert "model tiny" not in capsys.readouterr().err  # refused before the data and the model were looked at
    run = Path(cfg.run_dir)
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()


def test_a_bad_option_value_from_the_command_line(dataset_dir, tmp_path):
    args = [*TINY, f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "run_name=bad",
            "callbacks=default", "callbacks.checkpoint.keep_last=1"]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: callbacks.checkpoint.keep_last=1: keep at least 2"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "InstantiationException" not in res.stderr


def test_fused_head_and_fp8_options_that_cannot_run_are_one_message(monkeypatch):
    """What the config validation cannot see on its own: the liger head asked together with the chunked loss (two
    heads), and module.fp8 on a machine without torchao (named with its install line). Both refused by the module's
    constructor, before any model is built."""
    import functools

    import torch

    from lmtrain.nn.model import Decoder
    from lmtrain.training.module import LMModule

    model, opt = (
        functools.partial(Decoder, name="t", vocab_size=64, d_model=16, n_layers=1, n_heads=2),
        functools.partial(torch.optim.AdamW),
    )
    with pytest.raises(InputError, match=r"module.loss_kernel=liger and module.loss_chunk_tokens=8: choose one"):
        LMModule(model, opt, loss_kernel="liger", loss_chunk_tokens=8)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(InputError, match=r"module.fp8 needs torchao \(.*\): pip install torchao==0.18.0 \(in requirements.txt\)"):
        LMModule(model, opt, fp8="tensorwise")
