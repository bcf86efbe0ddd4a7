"""The loggers people use beside the run's record: TensorBoard, several at once (lmtrain/training/loggers.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.conftest import TEST_DEPS, TINY, run_train_cli


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    """``tag``'s value per step as TensorBoard shows it: every event file in the order written, a session that starts
    at step S (a writer's ``purge_step``) dropping what earlier files held for steps S and later."""
    from tensorboardX.proto import event_pb2

    shown: dict[int, float] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                shown = {s: v for s, v in shown.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    shown[event.step] = value.simple_value
    return shown


@pytest.mark.slow
def test_tensorboard_and_mlflow_together_show_the_kept_timeline_across_a_kill(tmp_path, dataset_dir):
    """logger=[mlflow,tensorboard]: killed (SIGKILL) at step 6, resumed from the checkpoint of step 4, finished at 10.
    TensorBoard shows each step once, with the loss the run's record keeps (steps 4-5 of the killed attempt purged,
    those of the resumed one shown); MLflow has the same losses."""
    from mlflow.tracking import MlflowClient

    from lmtrain.formats import metrics

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    args = [a for a in TINY if not a.startswith(("logger=", "callbacks="))] + [
        "logger=[mlflow,tensorboard]", f"logger.mlflow.tracking_uri={uri}", "callbacks=[checkpoint]",
        "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=10",
        "scheduler.total_steps=10", "trainer.val_check_interval=5", f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}", "data.prepare=null", "run_name=tb",
    ]  # fmt: skip
    killed = run_train_cli([*args, "fault=crash", "callbacks.fault.step=6"], tmp_path, extra_path=[TEST_DEPS])
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = run_train_cli([*args, "fault=crash", "callbacks.fault.step=6"], tmp_path, extra_path=[TEST_DEPS])
    assert done.returncode == 0 and "step-0000004" in done.stderr, done.stderr[-3000:]
    run = tmp_path / "runs" / "tb"
    kept = {int(r["step"]): float(r["train/loss"]) for r in metrics.rows(run) if r.get("train/loss")}
    assert sorted(kept) == list(range(10))
    shown = tensorboard_scalars(run / "tensorboard", "train/loss")
    assert sorted(shown) == sorted(kept) and all(shown[s] == pytest.approx(kept[s], rel=1e-6) for s in kept), (shown, kept)
    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2  # one per attempt, in one folder
    client = MlflowClient(tracking_uri=uri)
    (mlflow_run,) = client.search_runs(client.get_experiment_by_name("lmtrain").experiment_id)
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")}
    assert sorted(history) == sorted(kept) and all(history[s] == pytest.approx(kept[s], rel=1e-6) for s in kept)


def test_tensorboard_without_a_writer_is_refused_in_one_line_before_anything_is_written(tmp_path, dataset_dir):
    args = [a for a in TINY if not a.startswith("logger=")] + ["logger=tensorboard", f"paths.runs={tmp_path / 'runs'}",
                                                             f"data.path={dataset_dir}", "data.prepare=null", "run_name=notb"]  # fmt: skip
    done = run_train_cli(args, tmp_path)  # the test dependencies (tensorboardX) not on its path
    assert done.returncode == 2, done.stderr[-2000:]
    assert "logger=tensorboard needs a TensorBoard writer" in done.stderr and "pip install tensorboardX==2.6.5" in done.stderr
    assert not (tmp_path / "runs" / "notb").exists()
