"""Divergence detection and its actions, rollback with a lowered learning rate, operator LR corrections, logbook."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lmtrain.callbacks.divergence import DivergenceDetector
from lmtrain.errors import InputError, RunStopped
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import corrections, logbook
from lmtrain.formats.metrics import by_step
from lmtrain.training.run import train
from lmtrain.training.stability import EMA, Judge, read_trace, read_traces, replay
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli

STABLE = [
    "callbacks=default", "trainer.enable_progress_bar=false", "callbacks.checkpoint.every_n_steps=4",
    "callbacks.disk_guard.margin_gb=0", "callbacks.divergence.warmup_steps=5", "callbacks.lr_control.poll_every=1",
    "callbacks.divergence.act_growth={ratio: 10.0, action: warn}",  # the first steps of training grow activations 4x
    "logger=csv", "trainer.max_steps=16", "scheduler.total_steps=16", "scheduler.warmup_steps=2", "trainer.val_check_interval=100",
]  # fmt: skip


def _rows(run_dir: Path) -> dict[int, dict]:
    """Every logged value per step, for the steps that logged a loss."""
    return {s: r for s, r in by_step(run_dir).items() if "train/loss" in r}


def _kinds(run_dir: Path) -> list[str]:
    # "paused": the watchdog saw the whole process not run for over 2 s (callbacks/watchdog.py), which a machine loaded
    # beyond its cores does to a test's run (seen in CI with other suites beside it): not what these tests judge
    return [e["kind"] for e in logbook.read(run_dir) if e["kind"] not in ("checkpoint", "end", "paused")]


def test_running_statistics_and_corrections_arithmetic():
    ema = EMA(0.9)
    for x in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95] * 5:
        ema.update(x)
    assert abs(ema.mean - 1.0) < 0.05 and ema.z(3.0) > 10 and abs(ema.z(1.0)) < 1
    entries = [
        {"from_step": 10, "scale": 0.5, "reason": "rollback", "skip_batches": 6},
        {"from_step": 20, "scale": 0.5, "reason": "operator"},
        {"from_step": 5, "scale": 2.0, "reason": "config"},
        {"from_step": 25, "scale": 1.0, "reason": "config"},
    ]
    assert [corrections.multiplier(entries, s) for s in (0, 5, 10, 20, 25)] == [1.0, 2.0, 1.0, 0.5, 0.25]
    assert corrections.data_skip(entries, 10) == 6 and corrections.data_skip(entries, 8) == 0
    with pytest.raises(InputError, match="action='explode'"):
        DivergenceDetector(loss_spike={"action": "explode"})
    with pytest.raises(InputError, match=r"unknown key\(s\) \['zz'\]"):
        DivergenceDetector(loss_spike={"zz": 1})
    for level in (0, 1.5):  # routing_collapse.level is a share of the way from balanced routing to total collapse
        with pytest.raises(InputError, match=rf"routing_collapse.level={level} must be in \(0, 1\]"):
            DivergenceDetector(routing_collapse={"level": level})


def test_loss_spike_rolls_back_to_a_healthy_checkpoint_with_a_lower_learning_rate(tmp_path, dataset_dir):
    ref = make_cfg(TINY + STABLE, tmp_path / "ref", dataset_dir)
    train(ref)
    cfg = make_cfg(TINY + STABLE + ["fault=loss_spike", "callbacks.fault.step=10"], tmp_path / "spike", dataset_dir)
    train(cfg)
    run = tmp_path / "spike" / "run"
    # the spike of steps 10..14 (the drill's count: 5) acts once it persists, at step 14; the step-12 checkpoint,
    # saved inside the spike, is no place to return to: back to step 8, skipping the data of steps 9..14
    (entry,) = corrections.load(run)
    assert entry["reason"] == "rollback" and entry["signal_step"] == 14 and entry["from_step"] == 8 and entry["scale"] == 0.5
    assert entry["skip_batches"] == 6
    signals = [e for e in logbook.read(run) if e["kind"] == "divergence_signal"]
    assert [(e["step"], e["action"]) for e in signals] == [(10, "warn"), (11, "warn"), (12, "warn"), (13, "warn"), (14, "rollback")]
    assert "loss_spike" in signals[-1]["signals"] and signals[-1]["tokens"] > 0 and "spikes over 5 steps from step 10" in signals[-1]["message"]
    # its first step was computed again before its update, the same: the data or the model, said so
    assert _kinds(run) == ["start", "rerun", *["divergence_signal"] * 5, "rollback"]
    rerun = next(e for e in logbook.read(run) if e["kind"] == "rerun")
    assert rerun["step"] == 10 and "the same on every rank: the data or the model, not the hardware" in rerun["message"], rerun
    rows, ref_rows = _rows(run), _rows(tmp_path / "ref" / "run")
    assert sorted(rows) == list(range(1, 17))  # the abandoned steps 9..14 were replaced by the new timeline
    for s in range(1, 9):  # up to the rollback's checkpoint: the reference run exactly
        assert rows[s]["train/loss"] == ref_rows[s]["train/loss"] and rows[s]["train/lr"] == ref_rows[s]["train/lr"]
    for s in range(9, 17):  # after it: half the scheduled learning rate
        assert math.isclose(float(rows[s]["train/lr"]), 0.5 * float(ref_rows[s]["train/lr"]), rel_tol=1e-5)
    assert all(float(rows[s]["train/loss"]) < 20 for s in rows)  # the spike is gone from the logged timeline
    healthy = {c.step: c.meta["health"]["healthy"] for c in ck.scan(run / "checkpoints")}
    assert healthy and all(healthy.values())
    from tests.test_report import read_png

    lr = read_png(run / "plots" / "lr.png")[2]  # the rollback's correction and the five signals are marked
    assert lr == {"train/lr": 16, "markers": 6} and read_png(run / "plots" / "loss.png")[2]["train/loss"] == 16
    out = subprocess.run([sys.executable, "-m", "lmtrain.logbook", str(run)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "rolling back to step-0000008" in out.stdout


def test_a_rollback_waits_for_the_save_still_being_written_and_returns_to_it(tmp_path, dataset_dir):
    """The step-8 checkpoint is still being written in the background (its writer held 3 s) when the one-step spike at
    step 9 is judged (loss_spike.persist=1: it acts at once): the rollback waits for it and returns to step 8, not to
    the older step 4 (what it found on disk while the save was in flight: the cause of a test that failed under load)."""
    cfg = make_cfg(TINY + STABLE + ["fault=loss_spike", "callbacks.fault.step=9", "callbacks.fault.count=1", "callbacks.divergence.loss_spike.persist=1",
                                    "callbacks.divergence.loss_level.persist=1", "callbacks.checkpoint.async_save=true",
                                    "+callbacks.slow._target_=tests.plugins.SlowSaveStart", "+callbacks.slow.seconds=3"],
                   tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    (entry,) = corrections.load(tmp_path / "run")
    assert entry["reason"] == "rollback" and entry["signal_step"] == 9 and entry["from_step"] == 8, entry


def test_a_rollback_passes_over_a_checkpoint_damaged_since_its_save(tmp_path, dataset_dir, capsys, monkeypatch):
    """The healthy step-8 checkpoint is damaged in place at step 9 (its size kept); the spike of steps 10..14 rolls back
    past it, naming it, and past step 12's (saved inside the spike), to step 4, and the run finishes. Each checkpoint's contents are read once, where the rollback
    chooses it, not again by the attempt that loads it."""
    ckpts = tmp_path / "run" / "checkpoints"
    read = []
    verify_contents = ck.verify_contents
    monkeypatch.setattr(ck, "verify_contents", lambda directory, meta: read.append(directory.name) or verify_contents(directory, meta))
    cfg = make_cfg(
        TINY + STABLE + ["fault=loss_spike", "callbacks.fault.step=10", "+callbacks.damage._target_=tests.plugins.DamageCheckpoint",
                         f"+callbacks.damage.dirpath={ckpts}", "+callbacks.damage.step=8", "+callbacks.damage.at=9"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    train(cfg)
    (entry,) = corrections.load(tmp_path / "run")
    assert entry["reason"] == "rollback" and entry["signal_step"] == 14 and entry["from_step"] == 4, entry
    err = capsys.readouterr().err
    assert "rollback: passing over damaged checkpoint" in err
    assert err.count("model tiny (opt): ") == 1, err  # said once a run, not again at the rollback's attempt
    assert max(c.step for c in ck.scan(ckpts)) == 16
    assert read == ["step-0000008", "step-0000004"], read


def test_a_result_that_does_not_repeat_is_the_hardware_named_with_its_update_dropped(tmp_path, dataset_dir):
    """fault=sdc (silent data corruption): one value of the forward pass of steps 10, 11 and 12 made non-finite, as a
    failing card does. Each step's loss is NaN; computed again on the same batch before the update it is finite: the
    hardware, not the data or the model. The rank and its host are named, the update dropped (else the weights would
    be NaN and the next step's second result too), the step judged as nothing (no `nonfinite`, no rollback), and at
    the third such step the run stops for the node to be checked."""
    cfg = make_cfg(TINY + STABLE + ["fault=sdc", "callbacks.fault.step=10", "callbacks.fault.count=3"], tmp_path, dataset_dir)
    with pytest.raises(RunStopped, match=r"rank 0 on \S+ \(cpu\) computed 3 steps that did not repeat in this run"):
        train(cfg)
    run = tmp_path / "run"
    entries = logbook.read(run)
    faults = [e for e in entries if e["kind"] == "hardware_fault"]
    assert [e["step"] for e in faults] == [10, 11, 12] and all(e["ranks"] == [0] and e["alert"] for e in faults), faults
    assert [e["faults"] for e in faults] == [{"0": 1}, {"0": 2}, {"0": 3}]
    first, again = faults[0]["results"][0]
    assert math.isnan(first) and math.isfinite(again) and "the update is dropped" in faults[0]["message"]
    assert not [e for e in entries if e["kind"] == "divergence_signal" and "nonfinite" in e["signals"]] and not corrections.load(run)
    assert [e["kind"] for e in entries][-2:] == ["stop", "stopped"]
    rows = _rows(run)
    assert [float(rows[s]["stability/rerun_differs"]) for s in (10, 11)] == [1.0, 1.0] and math.isnan(float(rows[10]["train/loss"]))
    assert 7 < float(rows[10]["stability/rerun_loss"]) < 9  # ln(vocabulary) is 8.3
    # replayed offline, the steps a rank computed wrongly fire nothing, as in the run
    assert not [e for e in replay(read_trace(run), warmup_steps=5) if e["step"] in (10, 11)]
    # counted for doctor: `lmtrain doctor --run RUN` flags the device (exit 1), as the start of a restart would
    from tests.test_doctor import _doctor

    done = _doctor(["--seconds", "0.05", "--run", str(run)], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 training steps whose result did not repeat when computed again" in done.stdout and "faults in run" in done.stdout, done.stdout


def test_a_rollback_does_not_forget_the_faults_counted_after_its_checkpoint(tmp_path, dataset_dir):
    """A fault at step 9 (counted once), a spike persisting from step 11 rolled back to the checkpoint of step 8
    (saved before the fault), then two more faults at steps 18 and 19: the rank has computed 3 steps that did not
    repeat in this run, and the run stops at the third, as it would with no rollback between them."""
    spike = ["+callbacks.spike._target_=lmtrain.callbacks.fault.FaultInjector", "+callbacks.spike.kind=loss_spike", "+callbacks.spike.step=11",
             "+callbacks.spike.count=5", "+callbacks.spike.run_dir=${run_dir}"]  # fmt: skip
    cfg = make_cfg(
        TINY + STABLE + ["trainer.max_steps=24", "scheduler.total_steps=24", "fault=sdc", "callbacks.fault.step=9", *spike,
                         "+callbacks.sdc2._target_=lmtrain.callbacks.fault.FaultInjector", "+callbacks.sdc2.kind=sdc", "+callbacks.sdc2.step=18",
                         "+callbacks.sdc2.count=2", "+callbacks.sdc2.run_dir=${run_dir}"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    with pytest.raises(RunStopped, match=r"computed 3 steps that did not repeat in this run"):
        train(cfg)
    run = tmp_path / "run"
    (rollback,) = corrections.load(run)
    assert rollback["from_step"] == 8 and rollback["signal_step"] > 11, rollback
    faults = [e for e in logbook.read(run) if e["kind"] == "hardware_fault"]
    assert [(e["step"], e["faults"]) for e in faults] == [(9, {"0": 1}), (18, {"0": 2}), (19, {"0": 3})], faults


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="a compiled bf16 step computed again on a GPU: run on a GPU")
def test_on_a_gpu_a_corrupted_value_is_named_and_a_spike_is_not(tmp_path, dataset_dir):
    """One GPU, bf16, the training step compiled (module.compile=auto): the loss is read from the device as the
    forward pass ends, and a suspect step computed again eagerly. A value corrupted once at step 10 (fault sdc) is a
    hardware fault, its update dropped; a spike of the data or the model at step 13 (fault loss_spike, one step) comes
    out the same again and is a blip. The run finishes, exit 0."""
    gpu = [a for a in TINY if not a.startswith(("trainer.accelerator", "trainer.precision"))]
    args = gpu + STABLE + [
        "trainer.accelerator=gpu", "trainer.precision=bf16-mixed", "fault=sdc", "callbacks.fault.step=10",
        "+callbacks.spike._target_=lmtrain.callbacks.fault.FaultInjector", "+callbacks.spike.kind=loss_spike", "+callbacks.spike.step=13",
        f"+callbacks.spike.run_dir={tmp_path / 'runs' / 'gpu'}", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}",
        "data.prepare=null", "run_name=gpu",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "runs" / "gpu"
    entries = logbook.read(run)
    (fault,) = [e for e in entries if e["kind"] == "hardware_fault"]
    assert fault["step"] == 10 and fault["ranks"] == [0] and "(cuda:0)" in fault["hosts"][0], fault
    (rerun,) = [e for e in entries if e["kind"] == "rerun"]
    assert rerun["step"] == 13 and "the data or the model" in rerun["message"], rerun
    rows = _rows(run)
    assert float(rows[13]["stability/rerun_loss"]) > 10 * float(rows[12]["train/loss"])  # the spike again: x20
    assert all(math.isfinite(float(rows[s]["train/loss"])) for s in rows if s != 10) and not corrections.load(run)


def test_growing_activations_stop_the_run_without_saving_the_bad_state(tmp_path, dataset_dir):
    cfg = make_cfg(
        TINY + STABLE + ["fault=act_growth", "callbacks.fault.step=9", "callbacks.divergence.act_growth={ratio: 10.0, action: stop}"],
        tmp_path,
        dataset_dir,
    )
    with pytest.raises(RunStopped, match="act_growth"):
        train(cfg)
    run = tmp_path / "run"
    kinds = _kinds(run)
    assert kinds[:1] == ["start"] and kinds[-2:] == ["stop", "stopped"] and "divergence_signal" in kinds
    stopped_at = max(_rows(run))
    assert 9 < stopped_at < 16
    assert [c.step for c in ck.scan(run / "checkpoints")] == [4, 8]  # nothing saved after the signal


def test_warn_and_skip_actions(tmp_path, dataset_dir):
    """A one-step spike with action skip: the step's update is dropped (parameters and optimizer state untouched)."""
    cfg = make_cfg(
        TINY + STABLE + ["fault=loss_spike", "callbacks.fault.step=10", "callbacks.fault.count=1", "callbacks.divergence.loss_spike={action: skip}",
                         "callbacks.divergence.grad_spike={action: warn}", "callbacks.divergence.loss_level={action: warn}", "+callbacks.rec._target_=tests.plugins.RecordLR",
                         f"+callbacks.rec.path={tmp_path / 'lr'}"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    train(cfg)
    run = tmp_path / "run"
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 17)) and float(rows[10]["stability/loss_spike"]) == 1.0
    assert float(rows[10]["stability/grad_spike"]) == 1.0  # warned and logged
    assert float(rows[11]["train/loss"]) < 10  # the 20x loss of step 10 never reached the weights
    sig = next(e for e in logbook.read(run) if e["kind"] == "divergence_signal")
    assert sig["action"] == "skip" and not corrections.load(run)
    # offline, the judgement replayed over the run's own record fires what the run fired, at the same steps
    from omegaconf import OmegaConf

    from lmtrain.training.stability import DEFAULTS

    settings = OmegaConf.to_container(OmegaConf.load(run / "config.yaml").callbacks.divergence)
    fired_in_run = {
        s: sorted(k.removeprefix("stability/") for k, v in r.items() if k.removeprefix("stability/") in DEFAULTS and float(v) == 1.0)
        for s, r in rows.items()
    }  # fmt: skip
    replayed = {e["step"]: sorted(e["signals"]) for e in replay(read_trace(run), **settings)}
    assert replayed == {s: v for s, v in fired_in_run.items() if v} and replayed[10] == ["grad_spike", "loss_level", "loss_spike"], replayed
    assert [e["action"] for e in replay(read_trace(run), **settings) if e["step"] == 10] == ["skip"]
    # as a user runs it: another threshold tried on the same record; a setting that does not exist is one line
    out = subprocess.run([sys.executable, "-m", "lmtrain", "replay", str(run), "--set", "loss_spike.z=1e6", "--json"],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    tried = {e["step"]: e["signals"] for e in map(json.loads, out.stdout.splitlines())}
    assert "loss_spike" not in tried[10] and "grad_spike" in tried[10], tried
    bad = subprocess.run([sys.executable, "-m", "lmtrain", "replay", str(run), "--set", "los_spike.z=8"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--set los_spike.z=8" in bad.stderr, bad.stderr
    for wrong, said in (("loss_spike=8", "loss_spike=8 must be a mapping"), ("warmup_steps=abc", "warmup_steps='abc' must be a number"),
                        ("loss_spike.zz=1", "unknown key(s) ['zz']")):  # fmt: skip
        bad = subprocess.run([sys.executable, "-m", "lmtrain", "replay", str(run), "--set", wrong], capture_output=True, text=True, cwd=ROOT)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and said in bad.stderr, (wrong, bad.stderr)


@pytest.mark.slow
def test_real_divergence_is_caught_rolled_back_and_capped(tmp_path, dataset_dir):
    """No injected fault: the tiny model with a peak learning rate of 0.5 diverges; the detector rolls back once with a
    lower rate, diverges again and, at the cap (max_rollbacks=1), stops and says so."""
    cfg = make_cfg(
        TINY + STABLE + ["optimizer.lr=0.5", "scheduler.warmup_steps=10", "callbacks.divergence.max_rollbacks=1",
                         "callbacks.divergence.warmup_steps=2", "callbacks.checkpoint.every_n_steps=2", "trainer.max_steps=40",
                         "scheduler.total_steps=40"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    with pytest.raises(RunStopped, match=r"after 1 rollback\(s\)"):
        train(cfg)
    run = tmp_path / "run"
    kinds = _kinds(run)
    assert kinds.count("rollback") == 1 and kinds[-2:] == ["stop", "stopped"], kinds
    assert "after 1 rollback(s)" in [e for e in logbook.read(run) if e["kind"] == "stop"][-1]["message"]
    assert max(_rows(run)) < 40


@pytest.mark.slow
@pytest.mark.distributed
def test_nan_on_one_rank_and_an_operator_lr_change_apply_on_both_ranks(tmp_path, dataset_dir):
    """2 processes (gloo): a NaN loss on rank 1 only is seen by both ranks, which skip the same step; a value of rank
    1's forward pass corrupted once is told from it and rank 1 named; an operator's
    `python -m lmtrain.control RUN_DIR lr --scale 0.25` issued when step 5 is done is applied by both ranks from the next."""
    run_dir = tmp_path / "runs" / "two"
    args = [a for a in TINY if not a.startswith("trainer.devices")] + STABLE + [
        "strategy=ddp", "trainer.devices=2", f"paths.runs={tmp_path / 'runs'}", "run_name=two", f"data.path={dataset_dir}",
        "data.prepare=null", "trainer.max_steps=10", "fault=nan_loss", "callbacks.fault.step=7", "callbacks.fault.rank=1",
        "callbacks.divergence.nonfinite={action: skip}", "+callbacks.rec._target_=tests.plugins.RecordLR",
        f"+callbacks.rec.path={tmp_path / 'lr'}", "+callbacks.op._target_=tests.plugins.OperatorAt", f"+callbacks.op.run_dir={run_dir}",
        "+callbacks.op.step=5", "+callbacks.op.scale=0.25", "+callbacks.sdc._target_=lmtrain.callbacks.fault.FaultInjector",
        "+callbacks.sdc.kind=sdc", "+callbacks.sdc.step=9", "+callbacks.sdc.rank=1", f"+callbacks.sdc.run_dir={run_dir}",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    lrs = [json.loads((tmp_path / f"lr.rank{r}.json").read_text()) for r in (0, 1)]
    assert lrs[0] == lrs[1]
    ref = json.loads((tmp_path / "lr.rank0.json").read_text())
    (op,) = [e for e in corrections.load(run_dir) if e["reason"] == "operator"]
    assert op["from_step"] == 5 and op["scale"] == 0.25  # requested when step 5 was done: in force from the next one
    sig = [e for e in logbook.read(run_dir) if e["kind"] == "divergence_signal"]
    assert len(sig) == 1 and sig[0]["signals"] == ["nonfinite"] and sig[0]["step"] == 7
    assert "lr_correction" in _kinds(run_dir)
    # step 7's NaN came again when computed again (the drill stands for the data or the model); step 9's, a value of
    # rank 1's forward pass corrupted once (fault sdc), did not: rank 1 is named, the update dropped on both ranks
    (rerun,) = [e for e in logbook.read(run_dir) if e["kind"] == "rerun"]
    assert rerun["step"] == 7 and "the data or the model" in rerun["message"]
    (fault,) = [e for e in logbook.read(run_dir) if e["kind"] == "hardware_fault"]
    assert fault["step"] == 9 and fault["ranks"] == [1] and "the other ranks' results repeated" in fault["message"], fault
    assert fault["hosts"][0].endswith("(cpu)") and "rank 1 on " in fault["message"]
    rows = _rows(run_dir)
    assert all(math.isnan(float(rows[s]["train/loss"])) for s in (7, 9))
    assert all(math.isfinite(float(rows[s]["train/loss"])) for s in rows if s not in (7, 9))
    assert float(rows[9]["stability/rerun_differs"]) == 1.0 and float(rows[7]["stability/rerun_differs"]) == 0.0
    assert float(ref["5"]) < 0.3 * float(ref["4"])  # x0.25 on top of the (slowly decaying) schedule


def test_operator_command_line(tmp_path, capsys):
    """The first call as a user types it (a process); the others through the same main() in this process."""
    from lmtrain.control import main

    run = tmp_path / "run"
    run.mkdir()
    bad = subprocess.run(
        [sys.executable, "-m", "lmtrain.control", str(run), "lr", "--scale", "0.5"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
    (run / "config.yaml").write_text("x: 1\n")
    assert main([str(run), "lr", "--value", "1e-4"]) == 0
    (req,) = list((run / "control").glob("lr-*.json"))
    assert json.loads(req.read_text())["value"] == 1e-4
    capsys.readouterr()
    assert main([str(run), "lr", "--scale", "-1"]) == 2 and "must be a finite positive number" in capsys.readouterr().err


def test_detector_state_survives_a_resume(tmp_path, dataset_dir):
    """Stopped after step 9 and resumed: the detector's running statistics continue as if never interrupted."""
    train(make_cfg(TINY + STABLE, tmp_path / "ref", dataset_dir))
    train(make_cfg(TINY + STABLE + ["trainer.max_steps=9"], tmp_path / "cut", dataset_dir))
    train(make_cfg(TINY + STABLE, tmp_path / "cut", dataset_dir))  # the same run directory: resumes from step 9
    assert _kinds(tmp_path / "cut" / "run") == ["start", "resume", "config_change"]  # no schedule_change: the schedule's
    (change,) = [e for e in logbook.read(tmp_path / "cut" / "run") if e["kind"] == "config_change"]  # length is fixed
    assert change["changes"] == {"trainer/max_steps": [9, 16]}
    ref, got = _rows(tmp_path / "ref" / "run"), _rows(tmp_path / "cut" / "run")
    assert sorted(got) == list(range(1, 17))
    for s in range(1, 17):
        for key in ("train/loss", "stability/loss_z", "stability/grad_z", "stability/act_ratio"):
            assert got[s][key] == ref[s][key], (s, key)


def test_fp16_overflow_is_the_scalers_business_not_divergence():
    """The decisions alone, on the statistics the module hands over (tests/test_fp16.py runs the real scaler): an
    overflow step is counted, not judged and not fed to the averages; a run of them, a scale under the floor and a
    non-finite loss are signals; under bf16/fp32 (no scaler) a non-finite gradient norm still is."""
    from types import SimpleNamespace

    logged = {}
    trainer = SimpleNamespace(
        global_step=3, is_global_zero=True, accumulate_grad_batches=1, log_every_n_steps=1,
        loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.update(m))],
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3)),
    )  # fmt: skip
    det = DivergenceDetector(warmup_steps=0, skipped_steps={"max_consecutive": 2, "action": "skip"}, loss_scale={"action": "skip"})
    det.checkpointer, det.run_dir = None, None

    def step(loss=2.0, grad=1.0, scale=65536.0, overflow=False):
        return det.check_step(
            trainer, SimpleNamespace(), {"loss": loss, "grad_norm": grad, "act_rms": 1.0, "loss_scale": scale, "overflow": overflow}
        )

    assert step() is False and logged["train/loss_scale"] == 65536.0 and logged["train/skipped_steps"] == 0.0
    assert step(grad=math.inf, overflow=True) is False and step(grad=math.nan, scale=32768.0, overflow=True) is False
    assert logged["train/skipped_steps"] == 2.0 and logged["stability/nonfinite"] == 0.0 and det.loss.n == 1
    assert step(grad=math.inf, scale=16384.0, overflow=True) is True and logged["stability/skipped_steps"] == 1.0  # 3 > 2
    assert step(scale=8192.0) is False and det.skip_streak == 0 and logged["train/skipped_steps"] == 3.0
    assert step(scale=0.5) is True and logged["stability/loss_scale"] == 1.0 and logged["stability/healthy"] == 0.0
    assert step(loss=math.nan, grad=math.nan, overflow=True) is True and logged["stability/nonfinite"] == 1.0
    bf16 = DivergenceDetector(warmup_steps=0, nonfinite={"action": "skip"})
    bf16.checkpointer, bf16.run_dir = None, None
    assert bf16.check_step(trainer, SimpleNamespace(), {"loss": 2.0, "grad_norm": math.inf, "act_rms": 1.0}) is True
    assert logged["stability/nonfinite"] == 1.0 and "train/loss_scale" not in {k for k in logged if k.startswith("stability")}


def test_a_loss_far_above_its_start_is_a_signal_during_the_warmup():
    """The spike statistics are not trusted in the warm-up, but a loss 1.5x the first step's is divergence."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        global_step=3, is_global_zero=True, accumulate_grad_batches=1, log_every_n_steps=1, loggers=[],
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=3)),
    )  # fmt: skip
    det = DivergenceDetector(warmup_steps=100, loss_level={"ratio": 1.5, "action": "skip"})
    det.checkpointer, det.run_dir = None, None
    losses = [11.0, 10.5, 12.0, 15.0, 17.0]
    dropped = [det.check_step(trainer, SimpleNamespace(), {"loss": x, "grad_norm": 1.0}) for x in losses]
    assert dropped == [False, False, False, False, True] and det.first_loss == 11.0 and det.trouble_start == 4  # the 4th step
    again = DivergenceDetector()
    again.load_state_dict(det.state_dict())
    assert again.first_loss == 11.0
    # with the shipped settings one step above the level is a blip (a real opt-1.3b run: 11.3, 17.7, 13.8, then
    # healthy); five in a row act, the trouble dated from the first of them, no step of it healthy
    jolt = replay(_steps([11.33, 17.67, 13.83, 10.82, 10.1]), warmup_steps=100)
    assert [(e["step"], e["action"]) for e in jolt] == [(2, "warn")] and "a blip unless it stays there 5 steps" in jolt[0]["why"]
    judge, healthy = Judge(warmup_steps=100), []
    for stats in _steps([11.0, 10.5, 12.0, 17.0, 18.0, 19.0, 21.0, 24.0]):
        fired, metrics = judge.judge(stats, stats["step"])
        healthy.append(metrics["stability/healthy"])
    assert judge.action(fired) == "rollback" and judge.trouble_start == 4 and "5 steps in a row" in fired[0][1]
    assert healthy == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.slow
def test_an_operators_absurd_learning_rate_is_rolled_back_and_revoked(tmp_path, dataset_dir):
    """No fault group, bf16: a healthy run; when step 9 is done an operator sets the learning rate to 5.0
    (`python -m lmtrain.control RUN lr --value 5.0`). The run diverges, the detector rolls back to the checkpoint
    of step 8, which predates the correction, revokes it (the replay passes step 9 without it) and ends healthy. The
    divergence is said from step 11 and acted on at step 15, once it has lasted 5 steps; the checkpoint of step 12,
    saved inside it, is passed over."""
    run = tmp_path / "run"
    cfg = make_cfg(
        TINY + STABLE + ["trainer.precision=bf16-mixed", "callbacks.lr_control.factor_bounds=[1e-4,1e5]",  # absurd, not rejected
                         "+callbacks.op._target_=tests.plugins.OperatorAt", f"+callbacks.op.run_dir={run}",
                         "+callbacks.op.step=9", "+callbacks.op.value=5.0", "+callbacks.rec._target_=tests.plugins.RecordLR",
                         f"+callbacks.rec.path={tmp_path / 'lr'}"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    train(cfg)  # returns: the run finished
    entries = corrections.load(run)
    assert [e["reason"] for e in entries] == ["operator", "rollback"] and entries[1]["revokes"] == [0]
    assert entries[0]["from_step"] == 9 and entries[1]["from_step"] == 8 and corrections.in_force(entries) == [entries[1]]
    kinds = _kinds(run)
    assert kinds[:4] == ["start", "lr_correction", "rerun", "divergence_signal"] and kinds.count("rollback") == 1
    signals = [(e["step"], e["action"]) for e in logbook.read(run) if e["kind"] == "divergence_signal"]
    assert signals == [(11, "warn"), (12, "warn"), (13, "warn"), (14, "warn"), (15, "rollback")], signals
    rollback = next(e for e in logbook.read(run) if e["kind"] == "rollback")
    assert "revoked operator x" in rollback["message"] and rollback["revoked"][0]["reason"] == "operator"
    lrs = json.loads((tmp_path / "lr.rank0.json").read_text())  # the replay's learning rates (the last attempt's record)
    assert max(float(v) for v in lrs.values()) < 0.01  # 5.0 never came back
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 17)) and all(math.isfinite(float(rows[s]["train/loss"])) for s in rows)
    assert float(rows[16]["train/loss"]) < float(rows[1]["train/loss"])
    assert ck.newest(run / "checkpoints").meta["health"]["healthy"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_action_ends_cleanly_under_every_precision(tmp_path, dataset_dir, precision):
    """A NaN loss at step 5 (fault nan_loss), with each acting action in turn (warn acts on nothing): skip trains to
    the end, rollback returns to the checkpoint of step 4 and finishes, stop raises RunStopped (exit status 3); never
    a traceback. (ddp and fsdp: the 2-rank tests here and in tests/test_fp16.py; every pair on 2 GPUs:
    docs/BENCHMARKS.md.)"""
    for action in ("skip", "rollback", "stop"):
        cfg = make_cfg(
            TINY + STABLE + [f"trainer.precision={precision}", "trainer.max_steps=8", "scheduler.total_steps=8", "fault=nan_loss",
                             "callbacks.fault.step=5", "callbacks.fault.rank=0", f"callbacks.divergence.nonfinite={{action: {action}}}"],
            tmp_path / action, dataset_dir,
        )  # fmt: skip
        run = tmp_path / action / "run"
        if action == "stop":
            with pytest.raises(RunStopped, match="stopping at step 5"):
                train(cfg)
            assert _kinds(run)[-2:] == ["stop", "stopped"] and ck.newest(run / "checkpoints").step == 4
            continue
        train(cfg)
        signal = next(e for e in logbook.read(run) if e["kind"] == "divergence_signal")
        assert signal["step"] == 5 and "nonfinite" in signal["signals"] and signal["action"] == action, (action, signal)
        assert ck.newest(run / "checkpoints").step == 8, action
        assert [e["reason"] for e in corrections.load(run)] == (["rollback"] if action == "rollback" else []), action
        rows = _rows(run)
        finite = [s for s in rows if math.isfinite(float(rows[s]["train/loss"]))]
        assert sorted(finite) == [s for s in range(1, 9) if s != 5 or action == "rollback"], (action, finite)


def _shipped() -> dict:
    """The detector's settings as a run gets them (conf/callbacks/stability.yaml), its judgement's keys."""
    from omegaconf import OmegaConf

    from lmtrain.training.stability import JUDGE_KEYS

    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "callbacks" / "stability.yaml").divergence)
    return {k: v for k, v in node.items() if k in JUDGE_KEYS}


def test_the_labelled_real_events_meet_the_targets_with_the_shipped_settings():
    """The labelled set (tests/data/stability/events.json: real runs, labelled from their curves) judged with the
    settings a run gets: no rollback or stop on a healthy run or a blip, every divergence and ramp acted on within 20
    steps of its onset (a ramp back to before it began), every stall flagged within 200 steps. The command of
    docs/stability.md prints the table the page shows."""
    from lmtrain.training.stability import DEFAULTS, WARMUP_STEPS, read_traces, score

    shipped = _shipped()  # what `lmtrain replay --events` judges with (the code's defaults) is what a run gets
    assert shipped["warmup_steps"] == WARMUP_STEPS and {k: shipped[k] for k in DEFAULTS} == DEFAULTS
    folder = ROOT / "tests" / "data" / "stability"
    events = json.loads((folder / "events.json").read_text())["events"]
    traces = {(f, r): t for f in {e["trace"] for e in events} for r, t in read_traces(folder / f).items()}
    results = score(events, traces, **shipped)
    false = [(r["kind"], r["run"], r["false_action"]) for r in results if r["false_action"] is not None]
    assert not false, false  # never a rollback or stop on a healthy run or a blip, nor before an event began
    wrong = [(r["kind"], r["run"], r.get("onset"), r["acted"]) for r in results if not r["correct"]]
    # the misses, said in docs/stability.md: the slow ramp is rolled back 60 steps after its onset (target 20), to a
    # checkpoint from before it began; two opt-1.3b stalls recorded after the settings were fixed (2026-12-06, on an
    # H100) are flagged 235 steps after their onset and not within the run's 400 steps
    stalls = [("stall", "1.3b-adamw-lr0.01-detector", 200, None), ("stall", "1.3b-adamw-lr0.03", 75, 310)]
    assert wrong == [("ramp", "adamw-lr0.003", 600, 660), *stalls], wrong
    assert next(r for r in results if r["kind"] == "ramp")["returns_before"] <= 450
    assert {r["kind"] for r in results} == {"healthy", "blip", "divergence", "ramp", "stall"}
    out = subprocess.run([sys.executable, "-m", "lmtrain", "replay", "--events", "tests/data/stability/events.json"],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    printed = [line for line in out.stdout.splitlines() if line.startswith("|")]
    page = (ROOT / "docs" / "stability.md").read_text()
    assert len(printed) >= 7 and "\n".join(printed) in page, "docs/stability.md's table is not what the command prints now"
    # the labels are judged, not assumed: the detector of before this set (every spike acts, no trend, no stall) fails it
    before = {**shipped, "loss_spike": {"persist": 1}, "loss_trend": {"action": "warn"}, "stall": {"action": "warn", "window": 10**9}}
    assert not all(r["correct"] for r in score(events, traces, **before))
    # the traces recorded after the settings were chosen (2026-12-05): all right; with the loss level acting on one
    # step, as before they were seen, 4 wrong, all opt-1.3b's jolt at step 2 (docs/stability.md)
    later = [e for e in events if "2026-12-05" in e["trace"]]  # and the 5 recorded after the change (05b)
    assert len(later) == 28 and all(r["correct"] for r in score(later, traces, **shipped))
    one_step = {**shipped, "loss_level": {"ratio": 1.5, "persist": 1, "action": "rollback"}}
    wrong = [(r["run"], r["kind"], r["false_action"]) for r in score(later, traces, **one_step) if not r["correct"]]
    assert sorted(wrong) == [(f"1.3b-{run}-lr0.003", kind, 2) for run in ("adamw", "qknorm-zloss") for kind in ("blip", "healthy")], wrong
    held_out = score([e for e in events if "2026-12-06" in e["trace"]], traces, **shipped)  # the opt-1.3b blips are right
    assert sorted((r["kind"], r["correct"]) for r in held_out) == [("blip", True), ("blip", True), ("stall", False), ("stall", False)]
    assert len(events) >= 40 and 2 * sum("h200" in e["trace"] for e in events) >= len(events)


def _steps(losses, lr=1.0, first=1):
    return [{"step": first + i, "loss": x, "grad_norm": 1.0, "act_rms": None, "lr": lr, "loss_scale": None, "overflow": None}
            for i, x in enumerate(losses)]  # fmt: skip


def test_a_blip_is_said_and_a_persisting_spike_acts_dated_from_its_first_step():
    import random

    rng = random.Random(0)
    base = [6.0 - 0.002 * i + rng.gauss(0, 0.05) for i in range(300)]  # learning; the first loss 6: a 1.5x level is 9
    blip = base[:200] + [8.0] + base[201:]
    events = replay(_steps(blip), warmup_steps=20)
    assert [(e["step"], e["action"]) for e in events] == [(201, "warn")] and "a blip" in events[0]["why"]
    persisting = base[:200] + [8.0] * 10 + base[210:]
    acted = [e for e in replay(_steps(persisting), warmup_steps=20) if e["action"] != "warn"]
    assert acted[0]["step"] == 205 and acted[0]["since"] == 201 and acted[0]["signals"] == ["loss_spike"], acted[0]
    # a blip's action where the signal skips: the update dropped, nothing more
    assert [e["action"] for e in replay(_steps(blip), warmup_steps=20, loss_spike={"action": "skip"})] == ["skip"]


def test_the_attention_logit_bound_growing_is_an_early_sign_said_with_the_activations():
    """``act_growth`` judges the attention-logit bound (train/attn_logit_bound) as it judges the last block's RMS:
    past ``ratio`` times its average of healthy steps, a warning naming it (the default action), the loss still flat;
    the bound's average is in the judgement's saved state."""
    steps = _steps([5.0] * 160)
    for i, s in enumerate(steps):
        s["attn_bound"] = 20.0 if i < 150 else 20.0 * 1.5 ** (i - 149)  # from step 151 it grows 1.5x a step
    said = replay(steps)
    assert said[0]["step"] == 153 and said[0]["signals"] == ["act_growth"] and said[0]["action"] == "warn", said[0]
    assert "attention-logit bound 67.5, 3.11x its average 21.73" in said[0]["why"], said[0]["why"]  # 30 and 45 were healthy
    judge = Judge()
    for s in steps[:150]:
        judge.judge(s, s["step"])
    again = Judge()
    again.load_state_dict(judge.state_dict())
    assert again.attn.mean == pytest.approx(20.0) and again.attn.n == judge.attn.n > 0


def test_a_ramp_rolls_back_to_before_it_and_a_stall_warns_then_stops_unless_the_rate_is_near_zero():
    import random

    rng = random.Random(1)
    noise = [rng.gauss(0, 0.05) for _ in range(2000)]
    falling = [6.0 - 0.004 * i + noise[i] for i in range(300)]  # 4.8 at step 300
    ramp = falling + [4.8 + 0.01 * i + noise[300 + i] for i in range(200)]  # then up 0.01 a step, far below a spike
    acted = [e for e in replay(_steps(ramp), warmup_steps=20) if e["action"] != "warn"]
    assert acted and acted[0]["signals"] == ["loss_trend"] and acted[0]["action"] == "rollback", acted[:1]
    assert 300 < acted[0]["step"] <= 360 and acted[0]["since"] <= 300, acted[0]  # dated from the floor, not the signal
    flat = falling + [4.8 + noise[300 + i] for i in range(900)]
    events = [e for e in replay(_steps(flat), warmup_steps=20) if "stall" in e["signals"]]
    assert [e["action"] for e in events] == ["warn", "stop"], events
    assert 300 < events[0]["step"] <= 560 and events[1]["step"] - events[0]["step"] >= 200, events  # a window and its mean's
    # the same flat curve in a schedule's tail (the rate a twentieth of its peak): no stall is judged
    tail = _steps(falling, lr=1.0) + _steps(flat[300:], lr=0.05, first=301)
    assert not [e for e in replay(tail, warmup_steps=20) if "stall" in e["signals"]]


def test_the_judgement_continues_exactly_across_a_resume():
    """A Judge restored from a state saved mid-stream decides what one that never stopped decides."""
    import random

    from lmtrain.training.stability import Judge

    rng = random.Random(2)
    trace = _steps([6.0 - 0.003 * i + rng.gauss(0, 0.1) for i in range(400)] + [4.8 + rng.gauss(0, 0.1) for _ in range(800)])
    whole, first = Judge(warmup_steps=20), Judge(warmup_steps=20)
    for s in trace[:537]:
        first.judge(s, s["step"])
    second = Judge(warmup_steps=20)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint's JSON carries it
    a = [whole.judge(s, s["step"])[0] for s in trace]
    b = [second.judge(s, s["step"])[0] for s in trace[537:]]
    assert a[537:] == b and any(b), "the resumed judgement differs"
    # a mixture's routing, cut inside a stretch of collapse already said, and where its mean has been under the level a while
    moe = read_traces(ROOT / "tests" / "data" / "stability" / "cpu_tiny_moe_2026-12-07.jsonl.gz")["unbalanced-lr0.003-seed2"]
    whole = Judge(warmup_steps=20)
    a = [[n for n, _, _ in whole.judge(s, s["step"])[0]] for s in moe]
    assert sum("routing_collapse" in f for f in a) >= 2, a
    for cut in (15, 255, 290):
        first, second = Judge(warmup_steps=20), Judge(warmup_steps=20)
        for s in moe[:cut]:
            first.judge(s, s["step"])
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert [[n for n, _, _ in second.judge(s, s["step"])[0]] for s in moe[cut:]] == a[cut:], cut


@pytest.mark.slow
def test_a_run_that_does_not_learn_is_warned_then_stopped_with_its_own_exit_status(tmp_path, dataset_dir):
    """A real run whose learning rate is too small to move the weights: the stall warning, then the stop, exit
    status 6 (not 3: nothing diverged), the logbook's entries naming it."""
    res = run_train_cli(
        TINY + ["callbacks=default", "callbacks.disk_guard.margin_gb=0", "logger=csv", "trainer.max_steps=200", "trainer.val_check_interval=1000",
                "optimizer.lr=1e-9", "scheduler=constant", "callbacks.divergence.warmup_steps=10", "callbacks.divergence.stall.window=30",
                f"run_dir={tmp_path / 'run'}", f"paths.data={tmp_path / 'data'}", f"data.path={dataset_dir}", "data.prepare=null"],  # fmt: skip
        tmp_path,
    )
    assert res.returncode == 6, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1].startswith("stopped: stalled at step"), res.stderr[-500:]
    entries = logbook.read(tmp_path / "run")
    said = [e for e in entries if e["kind"] == "divergence_signal"]
    assert [e["action"] for e in said] == ["warn", "stop"] and all(e["signals"] == ["stall"] for e in said), said
    stopped = next(e for e in entries if e["kind"] == "stopped")
    assert stopped["status"] == 6 and said[-1]["step"] <= stopped["step"] <= said[-1]["step"] + 1 < 200  # judged a step late


def test_a_real_one_step_spike_is_a_blip_the_run_finishes_with_no_rollback(tmp_path, dataset_dir):
    """Issue 58's first event as a drill: one step's loss 1.4x (its gradients with it, below the loss-level signal), no
    checkpoint yet to return to. Before, the detector rolled back or stopped the run (exit 3) on it; now it is said as
    a blip and the run trains to its end, every step logged once, nothing rolled back."""
    cfg = make_cfg(TINY + STABLE + ["fault=loss_spike", "callbacks.fault.step=10", "callbacks.fault.count=1", "callbacks.fault.factor=1.4",
                                    "callbacks.checkpoint.every_n_steps=100", "callbacks.divergence.healthy_after=3"], tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    run = tmp_path / "run"
    said = [e for e in logbook.read(run) if e["kind"] == "divergence_signal"]
    assert [(e["step"], e["action"]) for e in said] == [(10, "warn")] and "a blip unless the spikes persist" in said[0]["message"], said
    assert "loss_spike" in said[0]["signals"] and not corrections.load(run) and "stopped" not in _kinds(run)
    rows = _rows(run)
    assert sorted(rows) == list(range(1, 17)) and float(rows[10]["stability/loss_spike"]) == 1.0
    healthy = [float(rows[s]["stability/healthy"]) for s in range(9, 17)]
    assert healthy == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], healthy  # a spike episode, over after 3 clean steps


def test_a_stretch_of_bad_data_is_trained_on_in_its_steps_only_and_is_a_blip(tmp_path, dataset_dir):
    """fault=bad_data, 2 steps from step 400 (the labelled set's blips of bad data, at tiny scale): the batches of
    steps 400 and 401 are shuffled tokens, their losses far above their neighbours', the detector says a blip and
    acts on nothing, and the run trains to its end."""
    cfg = make_cfg(TINY + STABLE + ["fault=bad_data", "callbacks.fault.step=400", "callbacks.fault.count=2", "trainer.max_steps=410",
                                    "scheduler.total_steps=410", "callbacks.checkpoint.every_n_steps=1000"], tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    run = tmp_path / "run"
    rows = _rows(run)
    loss = {s: float(rows[s]["train/loss"]) for s in rows}
    assert sorted(loss) == list(range(1, 411)) and min(loss[400], loss[401]) > 1.1 * max(loss[399], loss[402]), loss
    said = [e for e in logbook.read(run) if e["kind"] == "divergence_signal"]
    assert said and all(e["action"] == "warn" and "a blip" in e["message"] for e in said), said
    assert not corrections.load(run) and "stopped" not in _kinds(run)
