"""End-to-end runs composed from the real Hydra config: the CLI, every experiment, sweeps, precision."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from lmtrain.formats.metrics import by_step, metric
from lmtrain.nn.model import num_params
from lmtrain.training.config import validate_config
from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.slow
def test_cli_fast_dev_run_on_the_embedded_corpus_from_another_directory(tmp_path):
    """`python train.py debug=fdr` run from a directory that is not the checkout: the default config end to end. The
    embedded corpus is prepared under the checkout (not into the working directory), the run directory is named at
    the start, the run ends with a summary, and the console's lines are in RUN_DIR/train.log."""
    res = run_train_cli(["debug=fdr", "trainer.enable_progress_bar=false", "run_name=fdr"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = (tmp_path / "runs" / "fdr").resolve()
    lines = [line for line in res.stderr.splitlines() if line.startswith("[lmtrain]")]
    assert lines[0] == f"[lmtrain] run fdr: {run_dir}", lines[:3]
    assert "model mini (opt): 4,273,664 parameters" in res.stderr
    assert (ROOT / "data" / "cache" / "python-stdlib" / "manifest.json").is_file() and not (tmp_path / "data").exists()
    assert (run_dir / "config.yaml").is_file()
    summary = next(line for line in lines if "finished run fdr" in line)
    assert ": 1 step, " in summary and "train loss" in summary and f"run directory  {run_dir}" in res.stderr, summary
    log = (run_dir / "train.log").read_text()
    assert "model mini (opt): 4,273,664 parameters" in log and "finished run fdr" in log
    assert "litlogger" not in res.stderr and "set_vital" not in res.stderr  # third-party noise kept off the console


def test_cli_config_error_exits_2_with_one_message(tmp_path):
    res = run_train_cli(["data.seq_len=100000", f"paths.runs={tmp_path / 'runs'}"], tmp_path)
    assert res.returncode == 2
    assert "data.seq_len=100000 exceeds model.max_seq_len=256" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.ckpt"))


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_loss_falls(tiny_cfg, model):
    cfg = tiny_cfg(f"model={model}", "trainer.max_steps=40", "optimizer.lr=3e-3", "logger=csv", "trainer.val_check_interval=20")
    metrics = train(cfg)
    losses = metric(Path(cfg.run_dir), "train/loss")
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    assert "val/loss" in metrics and "val/ppl" in metrics
    assert metrics["val/ppl"] == pytest.approx(torch.tensor(metrics["val/loss"]).exp().item(), rel=1e-4)


def test_logged_metrics_every_step(tiny_cfg):
    cfg = tiny_cfg("trainer.max_steps=3", "logger=csv", "callbacks=default", "callbacks.throughput.peak_tflops=1.0")
    train(cfg)
    steps = [r for r in by_step(Path(cfg.run_dir)).values() if r.get("train/loss")]
    assert len(steps) == 3
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu"):
        assert all(r[key] for r in steps), key
    assert 0 < float(steps[-1]["perf/mfu"]) < 1


def test_gradient_accumulation_and_bf16(tiny_cfg):
    """Two micro-batches per step in bf16; ``trainer.val_check_interval=2`` counts optimizer steps, so validation
    runs after steps 2 and 4, not after every second micro-batch."""
    cfg = tiny_cfg("trainer.accumulate_grad_batches=2", "trainer.precision=bf16-mixed", "trainer.max_steps=4", "logger=csv")
    train(cfg)
    rows = sorted(by_step(Path(cfg.run_dir)).items())
    train_steps, val_steps = ([s for s, row in rows if key in row] for key in ("train/loss", "val/loss"))
    assert len(train_steps) == 4 and val_steps == [train_steps[1], train_steps[3]]  # before the fix: all four


def test_gradients_freed_after_each_step_and_accumulation_unchanged(tiny_cfg, tmp_path):
    """Gradients are freed right after each optimizer step (not after the next batch's forward, as Lightning would:
    they would hold 4 bytes per parameter through it) and kept between the micro-batches of an accumulation window;
    4 steps of 2 x 4 accumulated sequences give the losses of 4 steps of 8."""
    import json

    seen, losses = {}, {}
    for name, extra in (("acc", ["trainer.accumulate_grad_batches=2", "data.batch_size=4"]), ("whole", ["data.batch_size=8"])):
        probe = tmp_path / f"{name}.json"
        cfg = tiny_cfg(
            *extra, "logger=csv", "trainer.limit_val_batches=0", f"run_name={name}",
            "+callbacks.probe._target_=tests.plugins.GradientsAtBatchStart", f"+callbacks.probe.path={probe}",
        )  # fmt: skip
        train(cfg)
        seen[name], losses[name] = json.loads(probe.read_text()), metric(Path(cfg.run_dir), "train/loss")
    assert seen["acc"] == [False, True] * 4  # a window's second micro-batch finds the first one's gradients
    assert seen["whole"] == [False] * 4  # each step's gradients are gone before the next batch
    assert len(losses["acc"]) == 4 and losses["acc"] == pytest.approx(losses["whole"], rel=1e-5)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment(experiment, tmp_path, dataset_dir):
    """Every experiment composes and validates at full size (meta device), then runs shrunk on CPU."""
    cfg = make_cfg([f"experiment={experiment}"], tmp_path, dataset_dir)
    os.environ["WORLD_SIZE"] = "8"  # validated as launched on one 8-GPU node: the global batch must divide
    try:
        validate_config(cfg)
    finally:
        del os.environ["WORLD_SIZE"]
    from hydra.utils import instantiate

    with torch.device("meta"):
        full = instantiate(cfg.model)()
    assert num_params(full) > 100e6
    shrink = [
        f"experiment={experiment}",
        *TINY[1:],
        "model.n_layers=1",
        "model.d_model=64",
        "model.n_heads=4",
        "model.vocab_size=1024",
        "model.embed_dim=null",
        "++model.ffn_dim=128",
        "model.max_seq_len=64",
        "global_batch_size=null",
        "scheduler.total_steps=4",
        "debug=fdr",
    ]
    if cfg.module.get("compile") is True:  # compiled blocks run in the FSDP options test (tests/test_fsdp.py); here they cost 24 s
        shrink.append("module.compile=false")
    train(make_cfg(shrink, tmp_path, dataset_dir))


@pytest.mark.slow
def test_multirun_sweep_gives_one_directory_per_job(tmp_path, dataset_dir):
    args = [
        "-m",
        "optimizer.lr=1e-3,5e-4",
        "run_name=sweep",
        f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}",
        "data.prepare=null",
    ]
    res = run_train_cli(args + [a for a in TINY if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=2"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "runs" / "sweep").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert jobs == ["0", "1"]
    lrs = [(tmp_path / "runs" / "sweep" / j / "config.yaml").read_text() for j in jobs]
    assert "lr: 0.001" in lrs[0] and "lr: 0.0005" in lrs[1]


def test_document_masked_training_and_validation(tmp_path, corpus_jsonl, model="tiny-llama"):
    """data.document_mask=true trains and validates through the real data module (batches carry document ids) on
    short documents (several per block): from the same start, its first loss differs from the unmasked run's. (Both
    families' masking: tests/test_model.py; the OPT family trains masked in tests/test_reshard.py.)"""
    import json

    from lmtrain.data.prepare import prepare

    docs = [json.loads(line)["text"][:150] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()]
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if d), encoding="utf-8")
    prepare([tmp_path / "short.jsonl"], tmp_path / "ds", tokenizer="bpe:300", val_fraction=0.2, progress=False)
    got = {}
    for mask in (True, False):
        run = tmp_path / f"mask-{mask}"
        cfg = make_cfg(TINY + [f"model={model}", f"data.document_mask={mask}", "logger=csv", f"run_dir={run}"], tmp_path, tmp_path / "ds")
        out = train(cfg)
        assert math.isfinite(out["val/loss"])
        got[mask] = metric(run, "train/loss")
    assert len(got[True]) == 4 and got[True][0] != got[False][0]


def test_document_masking_is_refused_for_a_model_without_document_ids(tmp_path, dataset_dir):
    from lmtrain.training.config import ConfigError

    cfg = make_cfg(TINY + ["~model", "+model._target_=tests.plugins.BagOfWords", "+model._partial_=true", "data.document_mask=true"],
                   tmp_path, dataset_dir)  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"data.document_mask=true: the model BagOfWords \(tests.plugins.BagOfWords\) takes no document ids"
    ):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything of the run is written


@pytest.mark.slow
@pytest.mark.skipif(
    not any(Path(d, "cc").exists() for d in os.environ.get("PATH", "").split(os.pathsep)), reason="torch.compile on CPU needs a C compiler"
)
def test_a_compiled_run_validates_without_compiling_again(tmp_path, dataset_dir, monkeypatch):
    """module.compile=true with a validation every 2 steps: PyTorch's recompile log stays empty (validation runs
    eagerly where the training graphs do not fit, instead of compiling for a few batches), and the validation losses
    are the eager run's."""
    args = [a for a in TINY if not a.startswith(("logger=", "callbacks="))] + [
        "logger=csv", "callbacks=none", "trainer.max_steps=6", "scheduler.total_steps=6", f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # run_train_cli passes this process's environment on
    compiled = run_train_cli([*args, "module.compile=true", "run_name=compiled"], tmp_path)
    monkeypatch.delenv("TORCH_LOGS")
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "Recompiling function" not in compiled.stderr, compiled.stderr[-3000:]
    eager = run_train_cli([*args, "run_name=eager"], tmp_path)
    assert eager.returncode == 0, eager.stderr[-3000:]
    got, want = (metric(tmp_path / "runs" / name, "val/loss") for name in ("compiled", "eager"))
    assert len(got) == len(want) == 3 and got == pytest.approx(want, rel=1e-5)
