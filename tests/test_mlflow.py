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
    assert [m.step for m in losses] == [0, 1, 2, 3, 4]
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "val/loss", "val/ppl"):
        assert client.get_metric_history(run.info.run_id, key), key
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
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "plots")) == ["plots/loss.png", "plots/lr.png"]
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
def test_a_resumed_run_continues_the_same_mlflow_run_without_duplicated_steps(mlflow_server, tmp_path, dataset_dir):
    """Killed (kill -9) at step 6 after a checkpoint at step 4, then re-run: one MLflow run, steps 0..13 once each."""
    from mlflow.tracking import MlflowClient

    from lmtrain.formats import checkpoint as ck
    from tests.conftest import TINY, run_train_cli
    from tests.test_checkpoint import CKPT

    args = TINY + CKPT + [
        "logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=resume",
        f"paths.runs={tmp_path / 'runs'}", "run_name=again", f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    first = run_train_cli(args + ["fault=crash", "callbacks.fault.step=6"], tmp_path)
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
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(14))  # 4 and 5 were logged before the kill and not again
    assert ck.newest(tmp_path / "runs" / "again" / "checkpoints").meta["mlflow_run_id"] == run.info.run_id


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
