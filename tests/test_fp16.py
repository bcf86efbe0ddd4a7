"""fp16 with a real torch.amp.GradScaler on CPU (lmtrain.training.precision): overflows skipped and counted, the fp16 signals
and every action under the scaler, fp16 under FSDP2 on 2 ranks, and a real fp16 divergence."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmtrain.errors import RunStopped
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook
from lmtrain.training import precision
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg, run_train_cli
from tests.test_stability import STABLE, _kinds, _rows

FP16 = TINY + STABLE + ["trainer.precision=16-mixed"]


def _series(run, key: str) -> list[float]:
    rows = _rows(run)
    return [float(rows[s][key]) for s in sorted(rows) if key in rows[s]]


def test_the_scaler_fields_lmtrain_reads_exist():
    """lmtrain.training.precision reads two private GradScaler fields; a PyTorch that renames them fails here, not in a run."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((w * 2).sum()).backward()
    scaler.unscale_(opt)
    assert precision.loss_scale(scaler).item() == 1024.0 and precision.overflowed(scaler, opt).item() == 0.0
    assert torch.equal(w.grad, torch.full((3,), 2.0))  # unscaled
    scaler.step(opt)
    scaler.update()
    scaler.scale((w * 2).sum()).backward()
    w.grad[0] = math.inf
    scaler.unscale_(opt)
    assert precision.overflowed(scaler, opt).item() == 1.0
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0


def test_overflowing_steps_are_skipped_counted_and_training_goes_on(tmp_path, dataset_dir):
    """A backward pass that really overflows fp16 for 4 steps (fault grad_overflow): the scaler skips those updates
    and halves its scale each time; that is not divergence, and training goes on to the end with the loss falling."""
    cfg = make_cfg(FP16 + ["fault=grad_overflow", "callbacks.fault.step=6", "callbacks.fault.count=4",
                           "callbacks.divergence.skipped_steps={max_consecutive: 5}"], tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    run = tmp_path / "run"
    scale, skipped = _series(run, "train/loss_scale"), _series(run, "train/skipped_steps")
    assert scale == [65536.0] * 6 + [32768.0, 16384.0, 8192.0] + [4096.0] * 7  # steps 6-9 overflowed: the 6th-9th
    assert skipped == [0.0] * 5 + [1.0, 2.0, 3.0, 4.0] + [4.0] * 7
    assert all(math.isnan(g) or math.isinf(g) for g in _series(run, "train/grad_norm")[5:9])
    assert "divergence_signal" not in _kinds(run) and "stopped" not in _kinds(run)
    loss = _series(run, "train/loss")
    assert len(loss) == 16 and loss[-1] < loss[0] - 0.3 and all(math.isfinite(x) for x in loss)
    newest = ck.newest(run / "checkpoints")
    assert newest.step == 16 and newest.meta["health"]["healthy"] and newest.meta["health"]["skipped_steps"] == 4
    from tests.test_report import read_png

    assert read_png(run / "plots" / "loss_scale.png")[2] == {"train/loss_scale": 16, "train/skipped_steps": 16, "markers": 0}


@pytest.mark.slow
def test_fp16_trains_like_bf16(tmp_path, dataset_dir):
    """The GPU evidence at tiny scale: the same 20 steps in fp16 (real scaler) and in bf16 end within 2% in loss, and the
    fp16 run logs its scale and skipped updates every step."""
    common = TINY + STABLE + ["trainer.max_steps=20", "scheduler.total_steps=20", "scheduler.warmup_steps=4"]
    train(make_cfg(common + ["trainer.precision=16-mixed"], tmp_path / "fp16", dataset_dir))
    train(make_cfg(common + ["trainer.precision=bf16-mixed"], tmp_path / "bf16", dataset_dir))
    fp16, bf16 = (_series(tmp_path / p / "run", "train/loss") for p in ("fp16", "bf16"))
    assert len(fp16) == len(bf16) == 20 and fp16 != bf16  # really another precision
    end16, end_bf = sum(fp16[-5:]) / 5, sum(bf16[-5:]) / 5
    assert abs(end16 - end_bf) / end_bf < 0.02 and end16 < fp16[0] - 0.5, (end16, end_bf)
    assert len(_series(tmp_path / "fp16" / "run", "train/loss_scale")) == 20 and not _series(tmp_path / "bf16" / "run", "train/loss_scale")


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_a_scale_under_the_floor_fires_its_action(tmp_path, dataset_dir, action):
    """The scale starts under the floor (init_scale 0.25, floor 1). skip: those updates are dropped by the detector
    without lowering the scale, which grows (growth_interval 2) until it clears the floor, then training goes on.
    rollback: at step 1 there is no healthy checkpoint to return to: the run stops cleanly, saying so."""
    cfg = make_cfg(FP16 + ["grad_scaler.init_scale=0.25", "grad_scaler.growth_interval=2",
                           f"callbacks.divergence.loss_scale={{floor: 1.0, action: {action}}}"], tmp_path, dataset_dir)  # fmt: skip
    run = tmp_path / "run"
    if action == "rollback":
        with pytest.raises(RunStopped, match="no healthy checkpoint before step 1"):
            train(cfg)
        assert _kinds(run)[-2:] == ["stop", "stopped"] and not list((run / "checkpoints").glob("step-*"))
        return
    train(cfg)
    assert _series(run, "train/loss_scale")[:6] == [0.25, 0.25, 0.5, 0.5, 1.0, 1.0]
    assert set(_series(run, "train/skipped_steps")) == {0.0}  # the scaler skipped nothing: the detector did
    signals = [e for e in logbook.read(run) if e["kind"] == "divergence_signal"]
    assert [e["step"] for e in signals] == [1, 2, 3, 4] and {e["action"] for e in signals} == {"skip"}
    loss = _series(run, "train/loss")
    assert len(loss) == 16 and loss[-1] < loss[4]


def test_a_stop_under_the_scaler_exits_3_with_one_line(tmp_path, dataset_dir):
    """As a user runs it: the detector's stop ends the process with status 3 and one line, no traceback."""
    args = [a for a in FP16 if not a.startswith("logger")] + [
        "logger=csv", f"paths.runs={tmp_path / 'runs'}", "run_name=s", f"data.path={dataset_dir}", "data.prepare=null",
        "grad_scaler.init_scale=0.5", "callbacks.divergence.loss_scale={floor: 1.0, action: stop}",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 3, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: stopping at step 1 (loss_scale: fp16 loss scale 0.5 below the floor 1)"), last
    assert "Traceback" not in res.stderr
    log = (tmp_path / "runs" / "s" / "train.log").read_text().strip().splitlines()  # the run's log says how it ended
    assert "stopped: stopping at step 1 (loss_scale" in log[-1] and log[-1].endswith("(exit status 3)"), log[-3:]


@pytest.mark.slow
def test_a_real_fp16_divergence_fires_the_skipped_steps_signal(tmp_path, dataset_dir):
    """No fault: the tiny model at a peak learning rate of 1.0 in fp16 without clipping. Its backward overflows in
    consecutive steps (the scaler halving each time) before its forward does; with a limit of 1 consecutive skip and
    the other signals only warning, the skipped-steps signal stops the run."""
    quiet = ["loss_level", "loss_spike", "act_growth", "grad_spike"]
    cfg = make_cfg(FP16 + ["optimizer.lr=1.0", "scheduler.warmup_steps=5", "module.grad_clip=null", "trainer.max_steps=40",
                           "scheduler.total_steps=40", "callbacks.divergence.skipped_steps={max_consecutive: 1, action: stop}"]
                   + [f"callbacks.divergence.{s}.action=warn" for s in quiet], tmp_path, dataset_dir)  # fmt: skip
    with pytest.raises(RunStopped, match="updates in a row skipped by the fp16 gradient scaler"):
        train(cfg)
    run = tmp_path / "run"
    stop = [e for e in logbook.read(run) if e["kind"] == "divergence_signal" and e["action"] == "stop"]
    assert len(stop) == 1 and "skipped_steps" in stop[0]["signals"]
    skipped = _series(run, "train/skipped_steps")
    assert skipped[-1] >= 2 and all(math.isfinite(x) for x in _series(run, "train/loss")[: stop[0]["step"] + 1])


@pytest.mark.slow
@pytest.mark.distributed
def test_fp16_under_fsdp_on_two_ranks_skips_alike_and_rolls_back(tmp_path, dataset_dir):
    """2 processes (gloo), FSDP2, fp16: the backward overflows on rank 1 only in steps 4 and 5 (each rank holds different
    gradient shards); the overflow check is global, so both ranks skip those updates and keep equal scales. Then a
    NaN loss on rank 1 rolls both ranks back to the healthy checkpoint, and the run finishes (exit 0)."""
    args = [a for a in FP16 if not a.startswith(("trainer.devices", "logger"))] + [
        "strategy=fsdp", "trainer.devices=2", "logger=csv", f"paths.runs={tmp_path / 'runs'}", "run_name=f", f"data.path={dataset_dir}",
        "data.prepare=null", "fault=grad_overflow", "callbacks.fault.step=4", "callbacks.fault.count=2", "callbacks.fault.rank=1",
        "+callbacks.nan._target_=lmtrain.callbacks.fault.FaultInjector", "+callbacks.nan.kind=nan_loss", "+callbacks.nan.step=10",
        f"+callbacks.nan.run_dir={tmp_path / 'runs' / 'f'}", "+callbacks.nan.rank=1",
        "+callbacks.rec._target_=tests.plugins.RecordScale", f"+callbacks.rec.path={tmp_path / 'scale'}",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    scales = [json.loads((tmp_path / f"scale.rank{r}.json").read_text()) for r in (0, 1)]
    assert scales[0] == scales[1] and scales[0]["3"] == 65536.0 and scales[0]["5"] == 16384.0  # halved twice, on both ranks
    run = tmp_path / "runs" / "f"
    # the NaN of step 10 came out the same when computed again (the drill stands for the data or the model)
    assert [k for k in _kinds(run) if k != "lr_correction"] == ["start", "rerun", "divergence_signal", "rollback"]
    assert _series(run, "train/skipped_steps")[-1] == 2.0  # the replay restored the count of step 8: the NaN step was abandoned
    assert ck.newest(run / "checkpoints").step == 16
