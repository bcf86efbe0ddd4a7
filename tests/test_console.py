"""What a run tells its user: the run directory at the start, the summary at the end, RUN_DIR/train.log, a progress
bar that counts the run's steps across a resume, and a tokens/s figure that does not jump."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmtrain.formats.metrics import metric
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg


def test_summary_log_file_and_a_bar_that_counts_steps_across_a_resume(tmp_path, dataset_dir, capfd):
    args = [a for a in TINY if a not in ("callbacks=none", "trainer.enable_progress_bar=false", "logger=none")] + [
        "callbacks=[progress_bar,throughput,checkpoint]", "callbacks.progress_bar.mode=bar", "callbacks.progress_bar.line_every_n_steps=2",
        "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0", "logger=csv", "trainer.max_steps=6",
        "trainer.val_check_interval=2", "run_name=con",
    ]  # fmt: skip
    cfg = make_cfg(args, tmp_path, dataset_dir)
    run_dir = Path(cfg.run_dir).resolve()
    train(cfg)
    out, err = capfd.readouterr()
    said = [line for line in err.splitlines() if line.startswith("[lmtrain]")]
    assert said[0] == f"[lmtrain] run con: {run_dir}", said[:2]

    # the summary names the lowest validation loss of the run, its step and the checkpoint kept there
    val = metric(run_dir, "val/loss")
    assert len(val) == 3
    best = min(range(3), key=val.__getitem__)
    summary = "\n".join(said[said.index(next(s for s in said if "finished run con" in s)) :])
    assert ": 6 steps, 1,536 tokens; train loss" in summary and f"val loss {val[-1]:.4f}" in summary, summary
    best_line = (
        f"best val loss  {val[best]:.4f} at step {2 * (best + 1)} (checkpoint {run_dir / 'checkpoints' / f'step-{2 * (best + 1):07d}'})"
    )
    assert best_line in summary and f"checkpoint     {run_dir / 'checkpoints' / 'step-0000006'} (newest)" in summary, summary

    # a bar on the console (tqdm's redraws, on stdout), a line every 2 steps in the log file only
    assert not any(line.startswith("step ") for line in err.splitlines()) and "6/6" in out, repr(out)
    log = (run_dir / "train.log").read_text()
    assert re.findall(r"lmtrain.progress: step (\d+)/6", log) == ["2", "4", "6"], log
    assert "finished run con" in log and best_line in log

    # the bar's tokens/s is the rate of the last steps together: the harmonic mean of the per-step rates (equal tokens)
    raw, smooth = metric(run_dir, "perf/tokens_per_sec"), metric(run_dir, "perf/tokens_per_sec_smoothed")
    assert len(raw) == len(smooth) == 6
    for i in range(6):
        window = raw[max(0, i - 19) : i + 1]
        assert abs(smooth[i] - len(window) / sum(1 / r for r in window)) < 1e-6 * smooth[i]

    # resumed with a longer run: the bar starts at 6 of 8, not at 0 of an unknown total; the log file goes on
    cfg = make_cfg([*args, "trainer.max_steps=8"], tmp_path, dataset_dir)
    train(cfg)
    out, err = capfd.readouterr()
    assert f"[lmtrain] run con: {run_dir} (continuing from step 6)" in err
    draws = [(int(n), int(t)) for n, t in re.findall(r"(?:Training|Epoch \d+):[^\r\n]*?(\d+)/(\d+) \[", out) if t != "?"]
    moved = [n for n, t in draws if n]
    assert draws and {t for _, t in draws} == {8} and moved[0] == 6 and moved[-1] == 8, (draws, out)
    log = (run_dir / "train.log").read_text()
    assert log.count("==== run con") == 2 and re.findall(r"lmtrain.progress: step (\d+)/8", log) == ["8"], log[-2000:]

    # the finished run launched again trains nothing and says the same figures: they are the record's
    def figures(err: str) -> list[str]:
        lines = [line for line in err.splitlines() if line.startswith("[lmtrain]")]
        first = next(i for i, line in enumerate(lines) if "finished run con" in line)
        return [lines[first].split(": ", 1)[1]] + [line for line in lines[first:] if "best val loss" in line]

    before = figures(err)
    val = metric(run_dir, "val/loss")
    assert f"val loss {val[-1]:.4f} (step 8)" in before[0] and len(before) == 2, before
    train(make_cfg([*args, "trainer.max_steps=8"], tmp_path, dataset_dir))
    assert figures(capfd.readouterr().err) == before


def test_a_train_log_that_cannot_be_written_is_one_line_and_the_run_goes_on(capsys):
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    import logging
    from pathlib import Path

    from lmtrain.console import RunLogFile

    handler = RunLogFile()
    handler.open(Path("/dev/full"), "run x")
    for i in range(3):
        handler.emit(logging.LogRecord("lmtrain", logging.INFO, __file__, 1, f"message {i}", None, None))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write /dev/full: No space left on device; train.log stops here" in err, err
    assert handler.path is None  # closed: nothing more is tried


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_rank_run_says_each_line_once_and_no_library_banners(tmp_path, dataset_dir):
    """2 ranks (ddp, gloo, Lightning's launcher) logging to MLflow in a fresh SQLite store and to W&B offline: the
    console holds the run's own lines, once each (rank 1 shows warnings and errors only), and the progress lines; none
    of Lightning's, MLflow's or W&B's banners (accelerators, the distributed banner, mixed precision, "max_steps
    reached", MLflow creating its tables and experiment, W&B's offline notice), which train.log keeps. In bf16-mixed:
    Lightning's AMP line was the one library line left on an H200 run's console. W&B on rank zero only: its offline
    mode was once exported to the environment, where rank 1 read it as a bad ``logger.wandb.mode`` and refused."""
    from lmtrain.console import BANNERS
    from tests.conftest import TEST_DEPS, run_train_cli
    from tests.test_loggers import wandb_history

    args = [a for a in TINY if not a.startswith(("trainer.devices", "logger=", "callbacks="))] + [
        "strategy=ddp", "trainer.devices=2", "trainer.precision=bf16-mixed", "logger=[mlflow,wandb]", f"logger.mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
        f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}", "data.prepare=null", "run_name=quiet",
    ]  # fmt: skip
    done = run_train_cli(args, tmp_path, extra_path=[TEST_DEPS])
    assert done.returncode == 0, done.stderr[-3000:]
    (wandb_file,) = (tmp_path / "runs" / "quiet" / "wandb").glob("offline-run-*/run-*.wandb")  # one W&B run, rank zero's
    assert [s for s, _ in wandb_history(wandb_file, "train/loss")] == [1, 2, 3, 4]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    strangers = [line for line in lines if not line.startswith(("[lmtrain] ", "step "))]
    assert not strangers, strangers
    assert len(set(lines)) == len(lines), [line for line in lines if lines.count(line) > 1]
    assert sum(line.startswith("[lmtrain] run quiet: ") for line in lines) == 1
    kept = (tmp_path / "runs" / "quiet" / "train.log").read_text()
    assert "GPU available: False" in kept and "Using bfloat16 Automatic Mixed Precision" in kept  # on a GPU run's console too
    assert "Initializing distributed" not in done.stderr
    assert all(b not in done.stderr for b in BANNERS)


def test_a_line_said_while_a_bar_is_drawn_goes_above_the_bar_not_onto_it(monkeypatch):
    """On a terminal the bar (stdout) and the run's lines (stderr) share the screen: a line is written on a cleared
    bar line and the bar drawn again below it. Written straight, the line joined the bar's unfinished line and the bar
    went on one line lower, a stale bar left above it after every validation (seen in a pty: an eval's line)."""
    import io
    import logging
    import sys

    from tqdm import tqdm

    from lmtrain import console

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    handler = console._StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    bar = tqdm(total=10, file=sys.stdout, ncols=60, desc="Epoch 0", mininterval=0)
    bar.update(4)
    drawn = screen.getvalue()
    handler.emit(logging.LogRecord("lmtrain", logging.INFO, __file__, 1, "eval line-order at step 4", None, None))
    written = screen.getvalue()[len(drawn) :]
    bar.close()
    before, line, after = written.partition("eval line-order at step 4\n")
    assert line, written
    assert before.strip() == "" and "\r" in before, repr(before)  # the bar's line cleared first, nothing joined to it
    assert "Epoch 0" in after and "4/10" in after, repr(after)  # and the bar drawn again below the line
