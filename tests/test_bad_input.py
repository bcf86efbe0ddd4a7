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
    assert f"writing the dataset for {ds} failed (File too large)" in res.stderr
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
        (["fault=loss_spike", "callbacks.fault.count=0"], r"fault.count=0 must be a whole number of steps >= 1"),
        (["callbacks=default", "callbacks.divergence.loss_level.persist=0"], r"callbacks.divergence.loss_level.persist=0 must be a whole number of steps >= 1"),
        (["callbacks=default", "callbacks.divergence.loss_spike.persist=2.5"], r"callbacks.divergence.loss_spike.persist=2.5 must be a whole number"),
        (["callbacks=default", "callbacks.divergence.rerun=sometimes"], r"callbacks.divergence.rerun='sometimes' must be true or false"),
        (["module.sdpa_backend=fast"], r"module.sdpa_backend='fast': use one of"),
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
        (["restarts.max=0"], r"restarts: max=0 must be a whole number >= 1 and window_s=3600 seconds > 0"),
        (["+restarts.budget=3"], r"restarts: .*unknown key\(s\) \['budget'\]"),
        (["callbacks=[none,watchdog]", "callbacks.watchdog.timeout_s=0"], r"callbacks.watchdog: timeout_s=0 must be auto, null \(off\)"),
        (["callbacks=[none,watchdog]", "callbacks.watchdog.startup_s=soon"], r"callbacks.watchdog: .*startup_s='soon' seconds > 0"),
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
    assert not Path(cfg.run_dir).exists()  # a refused attempt writes nothing, not even an empty run directory


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.batch_size=100000"], r"fewer than one optimizer step across ranks \(data.batch_size=100000 x 1 rank = 100000 blocks\)"),
        (  # a micro-batch that fits, a global batch that does not (experiment=opt-125m on a small dataset)
            ["global_batch_size=400000"],
            r"fewer than one optimizer step across ranks \(data.batch_size=4 x 100000 micro-batches x 1 rank = 400000 blocks\)",
        ),
        (["callbacks.disk_guard.margin_gb=1e9"], r"not enough disk space for checkpoints at .* 1000000000.000 GB margin"),
        (
            ["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
            r"the MLflow tracking server http://127.0.0.1:9 does not answer",
        ),
    ],
)
def test_an_attempt_refused_after_the_data_and_model_are_read_writes_nothing(overrides, message, dataset_dir, tmp_path, monkeypatch):
    """Refusals that need the data, the model or the tracker (a dataset smaller than one step, a disk that cannot take
    a checkpoint, a tracking server that does not answer): a new run leaves no directory, no MLflow store; an existing
    run's directory is left byte for byte as it was."""
    monkeypatch.chdir(tmp_path)  # where the default MLflow store (./mlflow.db) would be made
    common = [*TINY, "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "logger=csv", f"paths.runs={tmp_path / 'runs'}"]
    fresh = make_cfg([*common, "run_name=new", f"run_dir={tmp_path / 'runs' / 'new'}", *overrides], tmp_path, dataset_dir)
    with pytest.raises(InputError, match=message):
        train(fresh)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    run = tmp_path / "runs" / "old"
    train(make_cfg([*common, "run_name=old", f"run_dir={run}"], tmp_path, dataset_dir))
    before = _tree(run)
    again = make_cfg([*common, "run_name=old", f"run_dir={run}", "trainer.max_steps=8", *overrides], tmp_path, dataset_dir)
    with pytest.raises(InputError, match=message):
        train(again)
    assert _tree(run) == before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_model_beyond_this_machines_memory_is_refused_with_the_planners_count(device, dataset_dir, tmp_path):
    """``model.n_layers=1000000`` (the tiny model's blocks, 50 billion parameters): refused in a second with exit 2 and
    the planner's count of the state per rank against the host's available memory, or on a GPU the card's, before
    anything is built or written (it used to allocate until the host ran out)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the card's memory: run on a GPU (docs/BENCHMARKS.md)")
    on = ["trainer.accelerator=gpu", "trainer.precision=bf16-mixed"] if device == "cuda" else []
    run = tmp_path / "runs" / "huge"
    args = [*TINY, *on, f"run_dir={run}", f"data.path={dataset_dir}", "data.prepare=null", "model.n_layers=1000000"]
    res = run_train_cli(args, tmp_path)
    last = res.stderr.strip().splitlines()[-1]
    where = r"this GPU's [\d.,]+ GiB \(.+\)" if device == "cuda" else r"this host's [\d.,]+ GiB available"
    assert res.returncode == 2 and re.fullmatch(
        r"error: model tiny: 49,984,270,464 parameters need 744\.8 GiB per rank for their state alone \(weights 186\.2, gradients "
        rf"186\.2, optimizer 372\.4 GiB: lmtrain\.plan's count, ddp on 1 rank\), more than {where}: nothing was started; .*",
        last,
    ), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()


def test_a_bad_option_value_from_the_command_line(dataset_dir, tmp_path):
    args = [*TINY, f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "run_name=bad",
            "callbacks=default", "callbacks.checkpoint.keep_last=1"]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: callbacks.checkpoint.keep_last=1: keep at least 2"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "InstantiationException" not in res.stderr


def test_head_and_fp8_options_given_to_the_module_are_checked_there(monkeypatch):
    """LMModule built from Python, without the config check: the same rules (lmtrain.training.fastpaths), a node
    with a misspelled key, and module.fp8.recipe on a machine without torchao (named with its install line), each
    refused by the constructor before any model is built."""
    import functools

    import torch

    from lmtrain.nn.model import Decoder
    from lmtrain.training.module import LMModule

    model, opt = (
        functools.partial(Decoder, name="t", vocab_size=64, d_model=16, n_layers=1, n_heads=2),
        functools.partial(torch.optim.AdamW),
    )
    with pytest.raises(InputError, match=r"module.fp8.fused_mlp=true scales per tensor"):
        LMModule(model, opt, fp8={"fused_mlp": True})
    with pytest.raises(InputError, match=r"unknown key 'module.head.chunk' \(did you mean 'module.head.chunk_tokens'\?\)"):
        LMModule(model, opt, head={"kind": "chunked", "chunk": 8})
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(InputError, match=r"module.fp8.recipe needs torchao \(.*\): pip install torchao==0.18.0 \(in requirements.txt\)"):
        LMModule(model, opt, fp8={"recipe": "tensorwise"})


@pytest.mark.slow
def test_a_read_only_runs_directory_is_one_line(tmp_path, dataset_dir):
    """The runs directory on a tmpfs of its own (``unshare -rm``) holding one run, then remounted read-only: a new run
    and the old run's resume each end in one line naming the read-only file system (exit 2), no traceback."""
    from tests.conftest import user_env

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare (a private mount namespace)")
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [*TINY, f"paths.runs={disk}", f"data.path={dataset_dir}", "data.prepare=null", "logger=csv"]
    py = " ".join([sys.executable, str(ROOT / "train.py"), *(f"'{a}'" for a in args)])
    script = f"""
set -u
mount -t tmpfs -o size=40m tmpfs {disk}
{py} run_name=old > /dev/null 2> {tmp_path}/first.err || exit 9
mount -o remount,ro {disk}
{py} run_name=new 2> {tmp_path}/new.err; echo $? > {tmp_path}/new.rc
{py} run_name=old trainer.max_steps=6 scheduler.total_steps=6 2> {tmp_path}/old.err; echo $? > {tmp_path}/old.rc
"""
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, (res.stderr + (tmp_path / "first.err").read_text())[-3000:]
    for name, said in [
        ("new", f"error: cannot create the run directory {disk / 'new'}"),
        ("old", f"error: cannot take the lock of {disk / 'old'}"),
    ]:
        err = (tmp_path / f"{name}.err").read_text()
        assert (tmp_path / f"{name}.rc").read_text().strip() == "2", err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert errors == [errors[0]] and errors[0].startswith(said) and errors[0].endswith("Read-only file system"), err[-3000:]
        assert "Traceback" not in err


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.embed_init_std=-1", "model.embed_init_std=-1 must be a standard deviation >= 0 or null"),
        ("model.embed_init_std=abc", "model.embed_init_std='abc' must be a standard deviation >= 0 or null"),
        ("model.init_std=-0.5", "model.init_std=-0.5 must be a standard deviation >= 0"),
    ],
)
def test_an_impossible_initialisation_scale_is_one_line_and_writes_nothing(override, message, dataset_dir, tmp_path):
    """Refused before the run directory exists (a negative or non-number scale reached torch's normal_ as a
    traceback, after the directory was made)."""
    run = tmp_path / "run"
    res = run_train_cli([*TINY, "model=tiny-llama", override, f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={run}"], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert message in res.stderr and not run.exists(), res.stderr[-1000:]
