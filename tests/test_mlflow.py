"""MLflow against a real tracking server on loopback: metrics, params, artifacts, run status."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmtrain.training.run import train
from tests.conftest import free_port

pytestmark = pytest.mark.xdist_group("mlflow")  # in one process: the module starts one server for all of them


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with a SQLite store, stopped after the module."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = open(root / "server.log", "w")
    # no job runner: the tracking tests start no jobs, and its queue would be left in /dev/shm after the server stops
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.mark.slow
def test_metrics_params_and_config_reach_the_server(mlflow_server, tiny_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=it", "run_name=roundtrip",
                   "trainer.max_steps=5", "callbacks=[default,samples]", "callbacks.throughput.peak_tflops=1.0", "trainer.enable_progress_bar=false",
                   "callbacks.samples.max_new_tokens=4")  # fmt: skip
    train(cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("it").experiment_id], "attributes.run_name = 'roundtrip'")
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5]  # the N-th step at N, as its checkpoint
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "val/loss", "val/ppl"):
        assert client.get_metric_history(run.info.run_id, key), key
    # the default downstream task at the start, beside each validation's values and at the end: the run's own record
    from lmtrain.formats.metrics import metric

    acc = client.get_metric_history(run.info.run_id, "eval/line-order/acc")
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")]
    assert len(val_steps) == 2 and [m.step for m in acc] == [0, *val_steps, 5] and [m.value for m in acc] == metric(cfg.run_dir, "eval/line-order/acc")
    (goodput,) = client.get_metric_history(run.info.run_id, "goodput/fraction")  # once, at the last step
    assert goodput.step == 5 and 0 < goodput.value < 1 and run.data.metrics["goodput/wall_s"] > 0
    assert run.data.params["model/d_model"] == "64"
    assert run.data.params["optimizer/lr"] == str(cfg.optimizer.lr)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    assert Path(client.download_artifacts(run.info.run_id, "config.yaml", tmp_path)).read_text().count("d_model: 64") == 1
    # the logbook is mirrored as the run goes: its last entry (the checkpoint saved at the end) is in the artifact
    assert "logbook.jsonl" in artifacts
    mirrored = Path(client.download_artifacts(run.info.run_id, "logbook.jsonl", tmp_path)).read_text().splitlines()
    assert mirrored == (Path(cfg.run_dir) / "logbook.jsonl").read_text().splitlines() and '"kind": "end"' in mirrored[-1]
    # the end-of-training plots and the validation-time samples are artifacts of the run
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "plots")) == ["plots/evals.png", "plots/loss.png", "plots/lr.png"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == ["samples/step-0000002.txt", "samples/step-0000004.txt"]
    assert "--- prompt: 'def main('" in Path(client.download_artifacts(run.info.run_id, "samples/step-0000004.txt", tmp_path)).read_text()
    # on demand, from the MLflow run (this run has no CSV log)
    rep = subprocess.run(
        [sys.executable, "-m", "lmtrain.report", cfg.run_dir, "--tracking-uri", mlflow_server], capture_output=True, text=True
    )
    assert rep.returncode == 0 and "points: train/loss 5, val/loss 2, train/lr 5" in rep.stdout, rep.stderr[-2000:]


@pytest.mark.slow
def test_a_run_that_raises_is_marked_failed(mlflow_server, tiny_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=it", "run_name=crash",
                   "trainer.max_steps=5", "+callbacks.boom._target_=tests.plugins.FailAtStep", "+callbacks.boom.step=2")  # fmt: skip
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        train(cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("it").experiment_id], "attributes.run_name = 'crash'")
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_mlflow_run_and_logs_what_an_uninterrupted_run_logs(mlflow_server, tmp_path, dataset_dir):
    """Killed (kill -9) at a random step after a checkpoint, then re-run: one MLflow run, and in it, as in the run's own
    record and its CSV view, every key at exactly the steps an uninterrupted run logged it, once each, with the same
    values (the training statistics, logged a step later than the rates, included at the killed step)."""
    import json
    import random

    from mlflow.tracking import MlflowClient

    from lmtrain.formats import checkpoint as ck
    from lmtrain.formats.metrics import read_metrics, record_rows
    from tests.conftest import TINY, run_train_cli
    from tests.test_checkpoint import CKPT

    kill = random.Random().randint(5, 13)  # steps 0..13; a checkpoint every 4
    args = TINY + CKPT + [
        "logger=[mlflow,csv]", f"logger.mlflow.tracking_uri={mlflow_server}", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}",
        "data.prepare=null",
    ]  # fmt: skip
    ref = run_train_cli(args + ["logger.mlflow.experiment_name=uninterrupted", "run_name=ref"], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    args += ["logger.mlflow.experiment_name=resume", "run_name=again"]
    first = run_train_cli(args + ["fault=crash", f"callbacks.fault.step={kill}"], tmp_path)
    assert first.returncode == -9, first.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("resume").experiment_id
    (run,) = client.search_runs([exp])
    assert run.info.status == "RUNNING"  # killed: nobody could mark it
    assert ck.newest(tmp_path / "runs" / "again" / "checkpoints").meta["mlflow_run_id"] == run.info.run_id
    second = run_train_cli(args, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    (run2,) = client.search_runs([exp])
    assert run2.info.run_id == run.info.run_id and run2.info.status == "FINISHED"
    assert ck.newest(tmp_path / "runs" / "again" / "checkpoints").meta["mlflow_run_id"] == run.info.run_id

    (want_run,) = client.search_runs([client.get_experiment_by_name("uninterrupted").experiment_id])
    same_value = ("train/", "val/", "stability/")  # the rest are timings and rates
    # the disk guard's check as an attempt starts, at its first step (there, free_gb was also logged after the save)
    per_attempt = ("ckpt/free_gb", "ckpt/estimate_gb")
    (resumed,) = [e["step"] for e in map(json.loads, (tmp_path / "runs" / "again" / "logbook.jsonl").read_text().splitlines())
                  if e["kind"] == "resume"]  # fmt: skip
    assert sorted(run2.data.metrics) == sorted(want_run.data.metrics)
    for key in want_run.data.metrics:
        want = [(m.step, m.value) for m in client.get_metric_history(want_run.info.run_id, key)]
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        steps = sorted({s for s, _ in want} | ({resumed} if key in per_attempt else set()))  # each once
        logged = sorted(s for s, _ in got)
        if key.startswith("ckpt/"):  # a save's figures, logged at the next step: the kill may take them with it
            assert len(set(logged)) == len(logged) and set(logged) <= set(steps), f"{key} (killed at {kill}, resumed from {resumed})"
        else:
            assert logged == steps, f"{key} (killed at step {kill}, resumed from {resumed})"
        if key.startswith(same_value):
            assert [v for _, v in sorted(got)] == pytest.approx([v for _, v in sorted(want)], rel=1e-6), f"{key} (killed at {kill})"

    def current(name):  # the record's current timeline: {(step, key): [values]}
        out: dict = {}
        for row in record_rows(tmp_path / "runs" / name):
            if not row["abandoned"]:
                for key, value in row["values"].items():
                    out.setdefault((row["step"], key), []).append(float(value))
        return out

    def csv_view(name):  # the CSV logger's file, the same way
        out: dict = {}
        for row in read_metrics(tmp_path / "runs" / name):
            for key, value in row.items():
                if key != "step" and value != "":
                    out.setdefault((int(row["step"]), key), []).append(float(value))
        return out

    for view in (current, csv_view):
        got, want = view("again"), view("ref")
        expected = set(want) | {(resumed, key) for key in per_attempt}
        assert {k for k in got if not k[1].startswith("ckpt/")} == {k for k in expected if not k[1].startswith("ckpt/")}, kill
        assert set(got) <= expected and all(len(values) == 1 for values in got.values()), f"{view.__name__}: killed at step {kill}"
        for (step, key), values in want.items():
            if key.startswith(same_value):
                assert got[step, key] == pytest.approx(values, rel=1e-6), (view.__name__, step, key, kill)


@pytest.mark.slow
def test_an_alert_is_a_tag_of_the_mlflow_run_and_marked_in_the_logbook(mlflow_server, tiny_cfg, tmp_path):
    """A save failing on ENOSPC (the real errno, raised where the checkpoint is written) is an alert: on the console, in
    the logbook with ``"alert": true``, and the MLflow run's tag ``alert.checkpoint_failed``; plain entries are not."""
    import json

    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=it", "run_name=alerted",
                   "trainer.max_steps=8", "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0", "fault=enospc", "callbacks.fault.step=4")  # fmt: skip
    train(cfg)
    entries = [json.loads(line) for line in (Path(cfg.run_dir) / "logbook.jsonl").read_text().splitlines()]
    alerts = [e for e in entries if e.get("alert")]
    assert [e["kind"] for e in alerts] == ["checkpoint_failed"], entries
    assert "checkpoint at step 4 FAILED (No space left on device (errno 28))" in alerts[0]["message"]
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("it").experiment_id], "attributes.run_name = 'alerted'")
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("alert.")}
    assert tags == {"alert.checkpoint_failed": alerts[0]["message"]}
    shown = subprocess.run([sys.executable, "-m", "lmtrain.logbook", cfg.run_dir], capture_output=True, text=True).stdout
    assert [line.split()[1:3] for line in shown.splitlines() if "FAILED" in line] == [["checkpoint_failed", "!"]], shown


@pytest.mark.slow
@pytest.mark.distributed
def test_the_rate_every_record_shows_is_the_rate_the_optimizer_used_through_corrections_and_a_rollback(
    mlflow_server, tmp_path, dataset_dir
):
    """Two ranks (ddp, gloo); an operator's ``lr --scale 0.5`` after step 3 and ``lr --value 2e-4`` after step 6, a loss
    spike at step 10 rolled back to step 8 at x0.5. At every step of the timeline kept, the rate each rank's optimizer
    used (its ``param_groups``, read as it steps) is the rate in the record, in MLflow, on the progress line and in the
    plot; it is the schedule's (an uncorrected run's) x0.5 from step 3, exactly 2e-4 at step 6 with the schedule going
    on from there, and half that from step 8; the logbook says each."""
    import json
    import re

    from mlflow.tracking import MlflowClient

    from lmtrain.formats.metrics import by_step
    from tests.conftest import TINY, run_train_cli
    from tests.test_report import read_png
    from tests.test_stability import STABLE

    run = tmp_path / "runs" / "lr"
    base = TINY + STABLE + [
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=rates", "strategy=ddp", "trainer.devices=2",
        "data.batch_size=2",
    ]  # fmt: skip
    ref = run_train_cli(base + ["run_name=ref", "+callbacks.rec._target_=tests.plugins.RecordLR", f"+callbacks.rec.path={tmp_path / 'ref'}"],
                        tmp_path)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    res = run_train_cli(base + [
        "run_name=lr", "trainer.enable_progress_bar=true", "callbacks.progress_bar.mode=lines", "callbacks.progress_bar.line_every_n_steps=1",
        "fault=loss_spike", "callbacks.fault.step=10",
        "+callbacks.rec._target_=tests.plugins.RecordLR", f"+callbacks.rec.path={tmp_path / 'lr'}",
        "+callbacks.half._target_=tests.plugins.OperatorAt", f"+callbacks.half.run_dir={run}", "+callbacks.half.step=3", "+callbacks.half.scale=0.5",
        "+callbacks.set._target_=tests.plugins.OperatorAt", f"+callbacks.set.run_dir={run}", "+callbacks.set.step=6", "+callbacks.set.value=2e-4",
    ], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]

    def used(name):
        ranks = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        assert ranks[0] == ranks[1]  # every rank steps with the same rate
        return {int(s): lr for s, lr in ranks[0].items()}

    got, schedule = used("lr"), used("ref")
    assert sorted(got) == sorted(schedule) == list(range(16))
    factor = {s: got[s] / schedule[s] for s in got}
    assert all(factor[s] == pytest.approx(1.0) for s in range(3))
    assert all(factor[s] == pytest.approx(0.5) for s in range(3, 6))
    assert got[6] == pytest.approx(2e-4, rel=1e-9)
    assert all(factor[s] == pytest.approx(factor[6]) for s in range(6, 8))
    assert all(factor[s] == pytest.approx(factor[6] * 0.5) for s in range(8, 16))

    record = {s: float(row["train/lr"]) for s, row in by_step(run).items() if "train/lr" in row}
    client = MlflowClient(tracking_uri=mlflow_server)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("rates").experiment_id], "attributes.run_name = 'lr'")
    mlflow_lr = {}
    for m in sorted(client.get_metric_history(mlrun.info.run_id, "train/lr"), key=lambda m: m.timestamp):
        mlflow_lr[m.step] = m.value  # the rollback's timeline is logged again over the abandoned one: the newest value
    lines = {}
    for n, lr in re.findall(r"lmtrain.progress: step (\d+)/16 .*?lr (\S+)", (run / "train.log").read_text()):
        lines[int(n)] = lr  # after the rollback the newest
    for s in range(16):  # got: keyed by the steps done before (RecordLR); the record, MLflow and the lines by the number
        n = s + 1
        assert record[n] == pytest.approx(got[s], rel=1e-6) and mlflow_lr[n] == pytest.approx(got[s], rel=1e-6), s
        assert lines[n] == f"{got[s]:.2e}", (n, lines[n], got[s])
    assert read_png(run / "plots" / "lr.png")[2]["train/lr"] == 16
    said = [
        e["message"]
        for e in map(json.loads, (run / "logbook.jsonl").read_text().splitlines())
        if e["kind"] in ("lr_correction", "rollback")
    ]
    assert said[0] == "operator: learning rate x0.5 from step 3"
    assert said[1].startswith("operator: learning rate set to 0.0002 (x") and said[1].endswith(") from step 6")
    assert "learning rate x0.5 from step 8 on" in said[2]


@pytest.mark.slow
def test_a_branch_from_another_runs_checkpoint_is_a_new_mlflow_run_naming_its_parent(mlflow_server, tiny_cfg, tmp_path):
    """``ckpt_path=`` another run's checkpoint: a new MLflow run tagged with its parent (run, MLflow run, step,
    checkpoint); the parent's MLflow run keeps its metrics and its ``run_dir`` tag, and its report still finds it."""
    import json

    from mlflow.tracking import MlflowClient

    from lmtrain.formats import checkpoint as ck

    common = ["logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=branch", "callbacks=checkpoint",
              "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0", f"paths.runs={tmp_path / 'runs'}"]  # fmt: skip
    parent_cfg = tiny_cfg(*common, "run_name=ck", "trainer.max_steps=8", f"run_dir={tmp_path / 'runs' / 'ck'}")
    train(parent_cfg)
    step8 = tmp_path / "runs" / "ck" / "checkpoints" / "step-0000008"
    train(tiny_cfg(*common, "run_name=fromck", "trainer.max_steps=12", f"ckpt_path={step8}", f"run_dir={tmp_path / 'runs' / 'fromck'}"))
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("branch").experiment_id])}
    parent, child = runs["ck"], runs["fromck"]
    assert parent.info.run_id != child.info.run_id
    assert parent.data.tags["run_dir"] == str((tmp_path / "runs" / "ck").resolve())
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "train/loss")] == list(range(1, 9))
    assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "train/loss")) == list(range(9, 13))
    assert {k: v for k, v in child.data.tags.items() if k.startswith("lmtrain.parent")} == {
        "lmtrain.parent_run": "ck", "lmtrain.parent_mlflow_run_id": parent.info.run_id, "lmtrain.parent_step": "8",
        "lmtrain.parent_checkpoint": str(step8.resolve()),
    }  # fmt: skip
    assert ck.newest(tmp_path / "runs" / "fromck" / "checkpoints").meta["mlflow_run_id"] == child.info.run_id
    first = json.loads((tmp_path / "runs" / "fromck" / "logbook.jsonl").read_text().splitlines()[0])
    assert first["kind"] == "branch" and first["message"].startswith(f"started from {step8.resolve()} (run ck, MLflow run ")
    rep = subprocess.run([sys.executable, "-m", "lmtrain.report", str(tmp_path / "runs" / "ck"), "--tracking-uri", mlflow_server],
                         capture_output=True, text=True)  # fmt: skip
    assert rep.returncode == 0 and "points: train/loss 8" in rep.stdout, rep.stdout + rep.stderr[-2000:]


@pytest.mark.slow
def test_a_resume_finds_its_mlflow_run_where_it_was_and_an_unreachable_store_is_one_line(mlflow_server, tmp_path, dataset_dir):
    """A run logged to a server, resumed without naming the server: it continues its MLflow run there (no local store
    made). Resumed naming a server that does not answer, or a SQLite store that does not exist: exit 2, one line,
    nothing of the run changed and no store created."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import TINY, free_port, run_train_cli
    from tests.test_checkpoint import CKPT

    run = tmp_path / "runs" / "far"
    args = TINY + CKPT + [f"paths.runs={tmp_path / 'runs'}", "run_name=far", f"data.path={dataset_dir}", "data.prepare=null", "logger=mlflow",
                          "logger.mlflow.experiment_name=far"]  # fmt: skip
    first = run_train_cli(args + [f"logger.mlflow.tracking_uri={mlflow_server}", "trainer.max_steps=4"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train_cli(args + ["trainer.max_steps=8"], tmp_path)  # the default store would be ./mlflow.db
    assert second.returncode == 0, second.stderr[-3000:]
    assert not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=mlflow_server)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("far").experiment_id])
    assert mlrun.info.status == "FINISHED" and sorted(m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")) == list(
        range(1, 9)
    )

    before = {name: (run / name).read_bytes() for name in ("config.yaml", "overrides.yaml", "logbook.jsonl", "metrics.jsonl")}
    dead, missing = f"http://127.0.0.1:{free_port()}", tmp_path / "nowhere.db"
    for uri, said in [(dead, f"the MLflow tracking server {dead} does not answer"), (f"sqlite:///{missing}", "that store does not exist")]:
        res = run_train_cli(args + [f"logger.mlflow.tracking_uri={uri}", "trainer.max_steps=12"], tmp_path)
        assert res.returncode == 2, res.stderr[-3000:]
        errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and said in errors[0] and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert {name: (run / name).read_bytes() for name in before} == before
    assert not missing.exists()
