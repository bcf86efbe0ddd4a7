"""The loggers people use beside the run's record: TensorBoard, Weights & Biases (offline), several at once
(lmtrain/training/loggers.py)."""

from __future__ import annotations

import json
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


def wandb_history(path: Path, key: str) -> list[tuple[int, float]]:
    """(trainer/global_step, value) of ``key`` in the order logged, read from an offline W&B run file (``run-ID.wandb``)
    without wandb's own code: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of records (a 7-byte header:
    CRC, length, kind FULL/FIRST/MIDDLE/LAST) whose payloads are wandb's ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, at, part, block = [], 7, b"", 32768
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a record header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, at)
        body, at = data[at + 7 : at + 7 + length], at + 7 + length
        if kind == 0:
            break
        part = body if kind in (1, 2) else part + body
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record.FromString(part)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if key in items:
                    out.append((int(items["trainer/global_step"]), float(items[key])))
    return out


@pytest.mark.slow
def test_mlflow_tensorboard_and_wandb_together_show_the_kept_timeline_across_a_kill(tmp_path, dataset_dir):
    """logger=[mlflow,tensorboard,wandb]: killed (SIGKILL) at step 6, resumed from the checkpoint of step 4, finished
    at 10. TensorBoard shows each step once, with the loss the run's record keeps (steps 4-5 of the killed attempt
    purged, those of the resumed one shown); MLflow has the same losses; W&B (offline, no network) has one run across
    both attempts, the one each checkpoint records, each step's loss as kept, the steps the record had from the killed
    attempt not logged again."""
    from mlflow.tracking import MlflowClient

    from lmtrain.formats import metrics

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    args = [a for a in TINY if not a.startswith(("logger=", "callbacks="))] + [
        "logger=[mlflow,tensorboard,wandb]", f"logger.mlflow.tracking_uri={uri}", "callbacks=[checkpoint]",
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
    assert sorted(kept) == list(range(1, 11))  # the 1st to the 10th step, each at its number
    shown = tensorboard_scalars(run / "tensorboard", "train/loss")
    assert sorted(shown) == sorted(kept) and all(shown[s] == pytest.approx(kept[s], rel=1e-6) for s in kept), (shown, kept)
    files = sorted((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2  # one per attempt, in one folder
    client = MlflowClient(tracking_uri=uri)
    (mlflow_run,) = client.search_runs(client.get_experiment_by_name("lmtrain").experiment_id)
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")}
    assert sorted(history) == sorted(kept) and all(history[s] == pytest.approx(kept[s], rel=1e-6) for s in kept)

    recorded = {json.loads(p.read_text())["wandb_run_id"] for p in (run / "checkpoints").glob("step-*/meta.json")}
    assert len(recorded) == 1, recorded
    (wandb_id,) = recorded
    attempts = sorted(p.parent for p in (run / "wandb").glob(f"offline-run-*/run-{wandb_id}.wandb"))
    assert len(attempts) == 2 and len(list((run / "wandb").glob("offline-run-*"))) == 2  # one W&B run, a folder per attempt
    first, second = (wandb_history(a / f"run-{wandb_id}.wandb", "train/loss") for a in attempts)
    # the killed attempt's file holds what W&B's writer had written when the kill came (here, in a run of seconds,
    # possibly nothing: it writes every 15 s); the resumed attempt logged, from the record, the kept steps before its
    # checkpoint that the file lacks, then its own: every step once, with the loss the record keeps
    steps = [s for s, _ in first + second]
    assert sorted(steps) == sorted(kept) and len(steps) == len(set(steps)), (first, second)
    assert all(v == pytest.approx(kept[s], rel=1e-6) for s, v in first + second), (first, second, kept)
    assert [s for s, _ in second][-4:] == [7, 8, 9, 10]  # what only the resumed attempt trained
    assert "W&B            offline run" in done.stderr


def test_tensorboard_without_a_writer_is_refused_in_one_line_before_anything_is_written(tmp_path, dataset_dir):
    args = [a for a in TINY if not a.startswith("logger=")] + ["logger=tensorboard", f"paths.runs={tmp_path / 'runs'}",
                                                             f"data.path={dataset_dir}", "data.prepare=null", "run_name=notb"]  # fmt: skip
    done = run_train_cli(args, tmp_path)  # the test dependencies (tensorboardX) not on its path
    assert done.returncode == 2, done.stderr[-2000:]
    assert "logger=tensorboard needs a TensorBoard writer" in done.stderr and "pip install tensorboardX==2.6.5" in done.stderr
    assert not (tmp_path / "runs" / "notb").exists()


@pytest.mark.parametrize(
    "extra, deps, needs",
    [
        ([], False, "logger=wandb needs wandb, which lmtrain does not install for every run: pip install wandb==0.31.0"),
        (["logger.wandb.mode=onlin"], True, "logger.wandb.mode=onlin must be one of: offline, online"),
        (["logger.wandb.mode=online"], True, "logger.wandb.mode=online needs W&B credentials for api.wandb.ai: run `wandb login`"),
    ],
    ids=["not-installed", "bad-mode", "online-without-credentials"],
)
def test_wandb_that_cannot_run_is_refused_in_one_line_before_anything_is_written(tmp_path, dataset_dir, monkeypatch, extra, deps, needs):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings of the machine's user
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    args = [a for a in TINY if not a.startswith("logger=")] + ["logger=wandb", f"paths.runs={tmp_path / 'runs'}",
                                                             f"data.path={dataset_dir}", "data.prepare=null", "run_name=nowb", *extra]  # fmt: skip
    done = run_train_cli(args, tmp_path, extra_path=[TEST_DEPS] if deps else [])
    assert done.returncode == 2, done.stderr[-2000:]
    assert needs in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "wandb").exists()


def _wandb_attempt(tmp_path: Path, code: str) -> str:
    """``code`` run in a process of its own (as each attempt of a run is), with ``WandbLogger``, ``metrics``, ``run``
    (the run directory) and ``loss`` defined; its stdout."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, user_env

    head = (
        "from pathlib import Path\nfrom lmtrain.formats import metrics\nfrom lmtrain.training.loggers import WandbLogger\n"
        f"run = Path({str(tmp_path)!r})\nloss = {{s: 10.0 - s * 0.5 for s in range(1, 13)}}\n"
    )
    env = {**user_env(), "PYTHONPATH": os.pathsep.join(map(str, [TEST_DEPS, ROOT]))}
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", head + code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("held", [5, 1], ids=["file-ahead-of-checkpoint", "file-behind-checkpoint"])
def test_a_resumed_offline_wandb_run_holds_each_value_once_whatever_the_kill_left(tmp_path, held):
    """The earlier attempt's W&B file holds steps 1..``held`` and then a record cut by the kill; the run's record holds
    steps 1-8 (it flushed later than W&B's writer). Resumed from the checkpoint of step 4, the logger first logs, from
    the record, the steps up to 4 that the file lacks (2-4 when it holds 1; the cut record is not read), then leaves
    out the steps the file holds (5 when it holds 1-5): W&B has every step once, with the record's values. Each
    attempt in a process of its own, as a run's attempts are."""
    from lmtrain.training.loggers import wandb_steps

    loss = {s: 10.0 - s * 0.5 for s in range(1, 13)}
    run_id = _wandb_attempt(tmp_path, (
        "first = WandbLogger(save_dir=str(run), name='t')\n"
        f"for s in range(1, {held + 1}):\n    first.log_metrics({{'train/loss': loss[s]}}, step=s)\n"
        "print(first.run_id)\nfirst.finalize('failed')\n"
        "rec = metrics.Record(run, 0)\nfor s in range(1, 9):\n    rec.add(s, {'train/loss': loss[s]})\nrec.flush()\n"
    )).strip().splitlines()[-1]  # fmt: skip
    (path,) = (tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
    with open(path, "ab") as fh:  # a record cut by the kill: its header says 200 bytes, 10 follow
        fh.write(struct.pack("<IHB", 0, 200, 1) + b"x" * 10)
    assert wandb_steps(tmp_path / "wandb", run_id) == {"train/loss": held}
    _wandb_attempt(tmp_path, (
        f"second = WandbLogger(save_dir=str(run), name='t', id={run_id!r})\nsecond.resume_at(4)\n"
        "rec = metrics.Record(run, 4)\nfor s in range(5, 13):\n    rec.add(s, {'train/loss': loss[s]})\n"
        "    second.log_metrics({'train/loss': loss[s]}, step=s)\nrec.flush()\nsecond.finalize('success')\n"
    ))  # fmt: skip
    files = sorted((tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    assert len(files) == 2
    logged = [pair for f in files for pair in wandb_history(f, "train/loss")]
    assert sorted(logged) == [(s, loss[s]) for s in range(1, 13)], logged
