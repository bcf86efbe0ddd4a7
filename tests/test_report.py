"""Plots (`python -m lmtrain.report` and the `report` callback) and text samples at validation time."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from PIL import Image

from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg

BLUE, GREEN = (0x1F, 0x77, 0xB4), (0x2C, 0xA0, 0x2C)  # matplotlib's tab:blue (train/loss, lr), tab:green (val/loss)


def read_png(path: Path) -> tuple[int, int, dict]:
    """(width, height, plotted point counts) of a PNG written by lmtrain.report, checking it is a well-formed PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert data[12:16] == b"IHDR" and data.rstrip(b"\x00")[-8:-4] == b"IEND"
    with Image.open(path) as img:
        img.load()  # decodes every pixel: a truncated or corrupt file fails here
        counts = json.loads(img.text["lmtrain"])
    return width, height, counts


def colours(path: Path) -> set:
    with Image.open(path) as img:
        return {c[:3] for _, c in img.convert("RGBA").getcolors(maxcolors=1 << 20)}


def _report(run, *args):
    return subprocess.run([sys.executable, "-m", "lmtrain.report", str(run), *args], capture_output=True, text=True, cwd=ROOT)


def test_plots_at_the_end_of_training_and_on_demand(tmp_path, dataset_dir):
    cfg = make_cfg(TINY + ["logger=csv", "callbacks=report", "trainer.max_steps=6", "trainer.val_check_interval=3"], tmp_path, dataset_dir)
    train(cfg)
    plots = Path(cfg.run_dir) / "plots"
    w, h, loss = read_png(plots / "loss.png")
    assert (w, h) == (800, 450) and loss == {"train/loss": 6, "val/loss": 2, "markers": 0}
    assert read_png(plots / "lr.png")[2] == {"train/lr": 6, "markers": 0}
    assert BLUE in colours(plots / "loss.png") and GREEN in colours(plots / "loss.png")  # both curves are drawn
    assert GREEN not in colours(plots / "lr.png")

    for f in plots.iterdir():
        f.unlink()
    res = _report(cfg.run_dir)
    assert res.returncode == 0 and "points: train/loss 6, val/loss 2, train/lr 6" in res.stdout, res.stderr[-2000:]
    assert read_png(plots / "loss.png")[2]["train/loss"] == 6
    bad = _report(tmp_path)
    assert bad.returncode == 2 and "is not a run directory" in bad.stderr and "Traceback" not in bad.stderr

    # the record's line cut by a kill is skipped: the same points
    record = Path(cfg.run_dir) / "metrics.jsonl"
    record.write_bytes(record.read_bytes() + b'{"a": 1, "step": 5, "m": {"train/lo')
    res = _report(cfg.run_dir)
    assert res.returncode == 0 and "points: train/loss 6, val/loss 2, train/lr 6" in res.stdout, res.stderr[-2000:]
    # a run from before the record, its CSV log damaged, and an MLflow store that cannot be read: one message each,
    # the plots already there kept
    record.rename(record.with_name("moved.jsonl"))
    before = (plots / "loss.png").read_bytes()
    log = Path(cfg.run_dir) / "csv" / "metrics.csv"
    log.write_text(log.read_text() + "\n" + "garbage," * 3 + "\n")
    damaged = _report(cfg.run_dir)
    assert damaged.returncode == 2 and f"{log} is not a readable metrics log" in damaged.stderr and "Traceback" not in damaged.stderr
    (tmp_path / "not-a.db").write_text("this is not an MLflow database\n" * 100)
    store = _report(cfg.run_dir, "--tracking-uri", f"sqlite:///{tmp_path / 'not-a.db'}")
    assert store.returncode == 2 and "cannot read the run's metrics from MLflow at sqlite:///" in store.stderr, store.stderr[-2000:]
    assert "Traceback" not in store.stderr and (plots / "loss.png").read_bytes() == before


def test_text_samples_after_each_validation(tmp_path, dataset_dir):
    cfg = make_cfg(
        TINY + ["logger=csv", "callbacks=[none,samples]", "trainer.max_steps=4", "trainer.val_check_interval=2",
                "callbacks.samples.prompts=[\"def main(\"]", "callbacks.samples.temperature=0", "callbacks.samples.max_new_tokens=8"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    train(cfg)
    samples = Path(cfg.run_dir) / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step-0000002.txt", "step-0000004.txt"]
    text = (samples / "step-0000004.txt").read_text()
    assert text.startswith("step 4, temperature 0,") and "--- prompt: 'def main('\ndef main(" in text
    assert len(text.split("def main(", 2)[-1]) > 0  # a continuation follows the prompt

    from lmtrain.callbacks.samples import SampleText
    from lmtrain.errors import InputError

    try:
        SampleText(run_dir=str(tmp_path), prompts=[])
    except InputError as exc:
        assert "callbacks.samples.prompts" in str(exc)
    else:
        raise AssertionError("no prompts accepted")
