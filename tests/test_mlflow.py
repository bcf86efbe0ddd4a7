"""MLflow against a real tracking server on loopback: metrics, params, artifacts, run status."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmtrain.run import train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with a SQLite store, stopped after the module."""
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
def test_metrics_params_and_config_reach_the_server(mlflow_server, tiny_cfg):
    from mlflow.tracking import MlflowClient

    cfg = tiny_cfg("logger=mlflow", f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=it", "run_name=roundtrip",
                   "trainer.max_steps=5", "callbacks=default", "callbacks.throughput.peak_tflops=1.0", "trainer.enable_progress_bar=false")  # fmt: skip
    train(cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("it").experiment_id], "attributes.run_name = 'roundtrip'")
    assert run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [0, 1, 2, 3, 4]
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "val/loss", "val/ppl"):
        assert client.get_metric_history(run.info.run_id, key), key
    assert run.data.params["model/d_model"] == "64"
    assert run.data.params["optimizer/lr"] == str(cfg.optimizer.lr)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    assert Path(client.download_artifacts(run.info.run_id, "config.yaml")).read_text().count("d_model: 64") == 1


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
