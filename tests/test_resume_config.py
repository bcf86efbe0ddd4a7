"""A resume follows the composed config: what it changes is applied and written in the logbook (issue 16)."""

from __future__ import annotations

import math

from lmtrain.formats import logbook
from lmtrain.formats.metrics import by_step
from lmtrain.nn.optim import WarmupDecay
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg

BASE = TINY + [
    "callbacks=default", "trainer.enable_progress_bar=false", "callbacks.disk_guard.margin_gb=0", "logger=csv",
    "scheduler.warmup_steps=2", "trainer.val_check_interval=100", "callbacks.checkpoint.every_n_steps=10",
]  # fmt: skip


def test_a_resume_follows_the_configs_schedule_and_says_what_changed(tmp_path, dataset_dir):
    """Started for a 100-step schedule, stopped at step 10, re-run with trainer.max_steps=20 (so total_steps=20) and a
    new peak learning rate: from step 10 on the rate is the 20-step schedule of the new peak (LambdaLR alone kept the
    old one), and the logbook says so."""
    first = make_cfg(BASE + ["trainer.max_steps=10", "scheduler.total_steps=100"], tmp_path, dataset_dir)
    train(first)
    second = make_cfg(BASE + ["trainer.max_steps=20", "optimizer.lr=2e-3"], tmp_path, dataset_dir)
    train(second)
    run = tmp_path / "run"
    lr = {s - 1: float(r["train/lr"]) for s, r in by_step(run).items() if "train/lr" in r}  # by steps done, as schedules
    old, new = WarmupDecay(2, 100), WarmupDecay(2, 20)
    for s in range(10):
        assert math.isclose(lr[s], float(first.optimizer.lr) * old(s), rel_tol=1e-6), s
    for s in range(10, 20):
        assert math.isclose(lr[s], 2e-3 * new(s), rel_tol=1e-6), s
    (entry,) = [e for e in logbook.read(run) if e["kind"] == "schedule_change"]
    assert "total_steps 100 -> 20" in entry["message"] and "peak lr" in entry["message"] and entry["step"] == 10
    (change,) = [e for e in logbook.read(run) if e["kind"] == "config_change"]  # every accepted change, old -> new
    assert change["step"] == 10 and change["changes"] == {
        "optimizer/lr": [float(first.optimizer.lr), 2e-3], "scheduler/total_steps": [100, 20], "trainer/max_steps": [10, 20],
    }, change  # fmt: skip


def test_a_resume_of_a_default_mlflow_run_lists_only_what_the_user_changed(tmp_path, dataset_dir, monkeypatch):
    """The default store, ``sqlite:///mlflow.db`` in the working directory: config.yaml records it resolved, so a resume
    (which continues the MLflow run in the store its checkpoint records, an absolute path) lists only the user's change;
    a config.yaml written before that, with the relative form, is read as the same store. Every resume of a default
    MLflow run used to report "config changed: tracking_uri sqlite:///mlflow.db -> sqlite:////abs/mlflow.db"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store (MLflow exports the URI it was given)
    args = [a for a in BASE if a != "logger=csv"] + ["logger=mlflow"]
    train(make_cfg(args + ["trainer.max_steps=4"], tmp_path, dataset_dir))
    run = tmp_path / "run"
    config = (run / "config.yaml").read_text()
    assert f"tracking_uri: sqlite:///{tmp_path / 'mlflow.db'}" in config
    (run / "config.yaml").write_text(config.replace(f"sqlite:///{tmp_path / 'mlflow.db'}", "sqlite:///mlflow.db"))  # as before
    train(make_cfg(args + ["trainer.max_steps=6"], tmp_path, dataset_dir))
    train(make_cfg(args + ["trainer.max_steps=8"], tmp_path, dataset_dir))
    changes = [e["changes"] for e in logbook.read(run) if e["kind"] == "config_change"]
    assert changes == [{"scheduler/total_steps": [4, 6], "trainer/max_steps": [4, 6]},
                       {"scheduler/total_steps": [6, 8], "trainer/max_steps": [6, 8]}], changes  # fmt: skip


def test_a_refused_attempt_leaves_the_run_directory_as_it_was(tmp_path, dataset_dir):
    """Re-running run_name=mine with another model, or another data stream, is refused before anything of the run
    changes, naming the two ways out; the run's files (train.log included) are byte-for-byte what they were."""
    from tests.conftest import run_train_cli

    args = [a for a in TINY if not a.startswith("model=")] + [
        f"paths.runs={tmp_path / 'runs'}", "run_name=mine", f"data.path={dataset_dir}", "data.prepare=null", "callbacks=checkpoint",
        "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2",
    ]  # fmt: skip
    first = run_train_cli(args + ["model=tiny"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert (run / "overrides.yaml").is_file() and not (run / ".hydra").exists()
    again = run_train_cli(args + ["model=tiny-llama"], tmp_path)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "choose another run_name=..., or pass resume=false overwrite=true" in again.stderr
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
    # another data stream: refused from the checkpoint's meta.json before the attempt is accepted (it used to be found
    # while the checkpoint loaded, after config.yaml had been rewritten)
    stream = run_train_cli(args + ["model=tiny", "data.seq_len=32", "trainer.max_steps=4"], tmp_path)
    assert stream.returncode == 2 and "belongs to another data stream (data.seq_len: 64 -> 32)" in stream.stderr, stream.stderr[-3000:]
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_lmtrain_classes_moved_between_versions_are_not_listed_as_config_changes(tmp_path, dataset_dir, caplog):
    """A run started under an older lmtrain, whose config.yaml names the same classes under the old module paths
    (lmtrain.model.Decoder, callbacks.checkpoint....), resumed now: the moves are said once, apart, and the config
    changes are only the real ones: another value, and a class swapped for another of another name or package."""
    import logging

    from omegaconf import OmegaConf

    from lmtrain.training.run import _config_changes

    cfg = make_cfg(BASE, tmp_path, dataset_dir)
    now = OmegaConf.to_yaml(cfg)
    assert "lmtrain.nn.model.Decoder" in now and "lmtrain.callbacks.checkpoint." in now and "torch.optim.AdamW" in now
    then = (
        now.replace("lmtrain.nn.model.Decoder", "lmtrain.model.Decoder")
        .replace("lmtrain.callbacks.checkpoint.", "callbacks.checkpoint.")
        .replace("torch.optim.AdamW", "lmtrain.nn.optim.AdamW")  # ours then, torch's now: another package, a real change
        .replace("lmtrain.callbacks.divergence.", "lmtrain.callbacks.divergence_old.")
    )
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(then.replace(f"lr: {cfg.optimizer.lr}", "lr: 0.5"))
    with caplog.at_level(logging.INFO):
        changes = _config_changes(run, cfg)
    assert changes == {"optimizer/_target_": ["lmtrain.nn.optim.AdamW", "torch.optim.AdamW"], "optimizer/lr": [0.5, cfg.optimizer.lr]}
    (said,) = [r.getMessage() for r in caplog.records if "lmtrain moved" in r.getMessage()]
    assert said.startswith("lmtrain moved 3 classes between versions (the same classes; not config changes): ")
    assert "model/_target_" in said and "callbacks/checkpoint/_target_" in said and "callbacks/divergence/_target_" in said


def test_options_a_newer_lmtrain_added_at_their_defaults_are_not_listed_as_config_changes(tmp_path, dataset_dir, caplog):
    """A run started before lmtrain had ``module.fp8.fused_mlp``, ``callbacks.checkpoint.keep_last`` and a few more (their
    keys missing from its config.yaml), resumed now: the keys at their defaults are said once, apart, as options
    lmtrain added; a new key set to another value than lmtrain's default (``module.head.chunk_tokens=64``,
    ``callbacks.checkpoint.every_n_steps=10``), and a key the previous attempt had with another value, stay changes."""
    import logging

    from omegaconf import OmegaConf

    from lmtrain.training.run import _config_changes

    cfg = make_cfg([*BASE, "module.fp8.fast_accum=false", "module.head.chunk_tokens=64"], tmp_path, dataset_dir)
    then = OmegaConf.to_container(cfg)
    for key in ("fused_mlp", "fast_accum"):
        del then["module"]["fp8"][key]
    del then["module"]["head"]["chunk_tokens"]
    for key in ("keep_last", "every_n_steps"):
        del then["callbacks"]["checkpoint"][key]
    then["module"]["grad_clip"] = 0.5
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(then)))
    with caplog.at_level(logging.INFO):
        changes = _config_changes(run, cfg)
    assert changes == {
        "module/grad_clip": [0.5, cfg.module.grad_clip],
        "module/head/chunk_tokens": ["(unset)", 64],
        "callbacks/checkpoint/every_n_steps": ["(unset)", 10],
    }
    (said,) = [r.getMessage() for r in caplog.records if "lmtrain added" in r.getMessage()]
    assert said.startswith("lmtrain added 3 options since the run's previous attempt, at their defaults")
    assert all(k in said for k in ("module/fp8/fused_mlp", "module/fp8/fast_accum", "callbacks/checkpoint/keep_last"))


def test_a_mixture_recorded_in_part_by_an_older_lmtrain_is_compared_as_it_trained(tmp_path, dataset_dir, caplog):
    """A run whose config.yaml an older lmtrain wrote with ``model.moe`` as given (three keys), resumed now that every
    key is recorded (lmtrain.training.config.complete_moe): the keys it left at their defaults are not changes, and
    ``norm_topk``, false by default then and true now, is the one change when the resume takes the new default."""
    from omegaconf import OmegaConf

    from lmtrain.training.config import complete_moe
    from lmtrain.training.run import _config_changes

    given = "{experts: 4, top_k: 2, expert_ffn_dim: 16}"
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(make_cfg([*BASE, "model=tiny-llama", f"model.moe={given}"], tmp_path, dataset_dir)))
    for node, want in ((given, {"model/moe/norm_topk": [False, True]}), (given[:-1] + ", norm_topk: false}", {})):
        cfg = make_cfg([*BASE, "model=tiny-llama", f"model.moe={node}"], tmp_path, dataset_dir)
        complete_moe(cfg)
        assert _config_changes(run, cfg) == want
    assert not [r for r in caplog.records if "lmtrain added" in r.getMessage()]


def test_another_strategy_is_one_change_naming_both(tmp_path, dataset_dir):
    """A resume under ``fsdp`` of a run saved under ``ddp``: one change, ``strategy: DDPStrategy -> FSDP2Strategy``,
    not a line per key of the two strategy nodes (about ten: their targets, compile and checkpointing options, ...);
    a key changed within one strategy stays itself."""
    from omegaconf import OmegaConf

    from lmtrain.training.run import _config_changes

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(make_cfg([*BASE, "strategy=ddp", "trainer.devices=2"], tmp_path, dataset_dir)))
    fsdp = make_cfg([*BASE, "strategy=fsdp", "trainer.devices=2", "optimizer.lr=0.5"], tmp_path, dataset_dir)
    changes = _config_changes(run, fsdp)
    assert changes["strategy"][1] == "FSDP2Strategy" and changes["strategy"][0].startswith("DDP"), changes
    assert [k for k in changes if k.startswith("strategy/")] == [] and "optimizer/lr" in changes
    (run / "config.yaml").write_text(OmegaConf.to_yaml(fsdp))
    ac = make_cfg([*BASE, "strategy=fsdp", "trainer.devices=2", "optimizer.lr=0.5", "strategy.activation_checkpointing=full"],
                  tmp_path, dataset_dir)  # fmt: skip
    assert list(_config_changes(run, ac)) == ["strategy/activation_checkpointing"]
