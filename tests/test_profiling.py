"""Speed knobs and the step profiler: attention kernel choice, the profiler's files, per-step statistics handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtrain.errors import InputError
from lmtrain.formats.metrics import by_step
from lmtrain.training.module import sdpa_backends
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg


def test_sdpa_backend_names():
    from torch.nn.attention import SDPBackend

    assert sdpa_backends(None) is None
    assert sdpa_backends("cudnn") == [SDPBackend.CUDNN_ATTENTION]
    assert sdpa_backends(["flash", "math"]) == [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with pytest.raises(InputError, match="module.sdpa_backend='fast'"):
        sdpa_backends("fast")


def test_math_attention_trains_like_the_default(tmp_path, dataset_dir):
    runs = {}
    for name, extra in (("default", []), ("math", ["module.sdpa_backend=math"])):
        cfg = make_cfg(TINY + ["logger=csv", "trainer.max_steps=3", *extra], tmp_path / name, dataset_dir)
        train(cfg)
        runs[name] = [float(r["train/loss"]) for r in by_step(Path(cfg.run_dir)).values() if "train/loss" in r]
    assert len(runs["math"]) == 3
    assert runs["math"] == pytest.approx(runs["default"], rel=1e-4)


def test_chunked_loss_trains_like_the_default(tmp_path, dataset_dir):
    """module.head.kind=chunked: the same per-step training losses and validation loss, in chunks that do not
    divide the batch's 256 tokens."""
    runs, vals = {}, {}
    for name, extra in (("default", []), ("chunked", ["module.head.kind=chunked", "module.head.chunk_tokens=37"])):
        cfg = make_cfg(TINY + ["logger=csv", "trainer.max_steps=4", *extra], tmp_path / name, dataset_dir)
        metrics = train(cfg)
        runs[name] = [float(r["train/loss"]) for r in by_step(Path(cfg.run_dir)).values() if "train/loss" in r]
        vals[name] = metrics["val/loss"]
    assert len(runs["chunked"]) == 4
    assert runs["chunked"] == pytest.approx(runs["default"], rel=1e-5)
    assert vals["chunked"] == pytest.approx(vals["default"], rel=1e-5)


def test_step_profiler_writes_a_trace_a_kernel_table_and_a_python_profile(tmp_path, dataset_dir):
    cfg = make_cfg(
        TINY + ["logger=csv", "trainer.max_steps=5", "callbacks=[none,profiler]", "callbacks.profiler.start_step=2",
                "callbacks.profiler.steps=2", "callbacks.profiler.python=true"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    train(cfg)
    out = Path(cfg.run_dir) / "profile"
    trace = json.loads((out / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the model's matmuls were recorded
    assert "[pl][profile][Strategy]SingleDeviceStrategy.training_step" in names  # by Lightning's PyTorchProfiler
    summary = (out / "summary_rank0.txt").read_text()
    assert summary.startswith("steps 2..3 on rank 0:") and "ms per step" in summary and "Name" in summary
    assert float(summary.split(": ")[1].split(" ms per step")[0]) > 0  # the window's wall time, from the trace itself
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # exactly the window's two steps
    assert "function calls" in (out / "python_rank0.txt").read_text()
    rows = [r for r in by_step(Path(cfg.run_dir)).values() if "train/loss" in r]
    assert len(rows) == 5  # every step logged once: the lagged statistics of the last step are flushed at the end


def test_step_statistics_are_read_one_step_late_unless_a_skip_needs_them_now(tmp_path, dataset_dir):
    """The host reads a step's loss and gradient norm at the next step (no device sync), except where a `skip`
    action must act on that very update; either way every step is logged once, at its own step."""
    for action, pending in (("warn", 1), ("skip", 0)):
        probe = tmp_path / f"{action}.json"
        cfg = make_cfg(
            TINY + ["logger=csv", "trainer.max_steps=4", "callbacks=stability", "callbacks.lr_control.poll_every=100",
                    f"callbacks.divergence.grad_spike.action={action}", "+callbacks.probe._target_=tests.plugins.PendingStats",
                    f"+callbacks.probe.path={probe}"],
            tmp_path / action, dataset_dir,
        )  # fmt: skip
        train(cfg)
        assert json.loads(probe.read_text()) == [pending] * 4, action
        rows = {s: r for s, r in by_step(Path(cfg.run_dir)).items() if "train/loss" in r}
        assert sorted(rows) == [1, 2, 3, 4] and all(r["train/grad_norm"] for r in rows.values())


def test_device_busy_time_counts_kernels_not_annotation_ranges():
    """A record_function range shown on the GPU timeline (Lightning's `Optimizer.step` wraps the whole step) is not
    device work: counting it hid the idle gaps it spans."""
    from types import SimpleNamespace

    import torch

    from lmtrain.callbacks.profiler import busy_fraction

    def ev(start, end, annotation=False, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device, is_user_annotation=annotation)

    events = [ev(0, 100, annotation=True), ev(0, 10), ev(5, 20), ev(50, 60), ev(0, 100, device=torch.autograd.DeviceType.CPU)]
    assert busy_fraction(events, 100.0) == (30.0, 0.3)  # [0, 20] and [50, 60]


def test_a_profile_that_cannot_be_written_does_not_stop_training(tmp_path, dataset_dir, capsys):
    cfg = make_cfg(
        TINY + ["logger=csv", "trainer.max_steps=4", "callbacks=[none,profiler]", "callbacks.profiler.start_step=1", "callbacks.profiler.steps=1"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    Path(cfg.run_dir).mkdir(parents=True)
    (Path(cfg.run_dir) / "profile").write_text("a file where the profile folder should go\n")
    train(cfg)
    assert "could not write it to" in capsys.readouterr().err
    assert len([r for r in by_step(Path(cfg.run_dir)).values() if "train/loss" in r]) == 4  # the run went on to the end
    assert (Path(cfg.run_dir) / "profile").read_text().startswith("a file")  # and nothing of the user's was replaced


def test_garbage_collection_runs_on_schedule_and_is_restored(tmp_path, dataset_dir):
    """callbacks/gc_control.py: no automatic collection while training; one full collection and a freeze after
    `freeze_after_steps`, the young generations every `every_n_steps`, a full one every `full_every_n_steps`, each
    logged as perf/gc_ms; the collector is on again afterwards."""
    import gc

    probe = tmp_path / "gc.json"
    cfg = make_cfg(
        TINY + ["logger=csv", "trainer.max_steps=8", "callbacks=[none,gc]", "callbacks.gc.every_n_steps=2",
                "callbacks.gc.freeze_after_steps=1", "callbacks.gc.full_every_n_steps=5",
                "+callbacks.probe._target_=tests.plugins.GCState", f"+callbacks.probe.path={probe}"],
        tmp_path, dataset_dir,
    )  # fmt: skip
    assert gc.isenabled()
    train(cfg)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    got = json.loads(probe.read_text())
    assert got["enabled"] == [False] * 8
    scheduled = {1: 2, 2: 1, 4: 1, 5: 2, 6: 1, 8: 1}  # step -> generation
    during = [(s, g) for s, g in got["events"] if 0 <= s <= 8]
    assert sorted(set(during)) == sorted(scheduled.items()), during
    logged = {s: r["perf/gc_ms"] for s, r in by_step(Path(cfg.run_dir)).items() if "perf/gc_ms" in r}
    assert len(logged) == len(scheduled) and all(float(v) >= 0 for v in logged.values()), logged


def test_garbage_collection_options_are_checked():
    from lmtrain.callbacks.gc_control import GarbageCollection

    for bad in ({"every_n_steps": 0}, {"generation": 3}, {"full_every_n_steps": 0}, {"freeze_after_steps": -1},
                {"every_n_steps": "often"}, {"full_every_n_steps": 2.5}, {"freeze_after_steps": "x"}):  # fmt: skip
        with pytest.raises(InputError, match="callbacks.gc"):
            GarbageCollection(**bad)


def test_throughput_bench_prints_its_table_row(tmp_path):
    """bench/throughput.py on the CPU: the trainer's window figure beside the bare loop's, one table row."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    res = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "throughput.py"), "--steps", "8", "--warmup", "3", "model=tiny", "trainer.accelerator=cpu",
         "trainer.precision=32-true", "data.seq_len=64", "data.batch_size=4", "scheduler.warmup_steps=1", "callbacks.throughput.peak_tflops=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LeafSpec" not in res.stderr  # the library warnings train.py's runs hide, hidden on this way in too
    row = [c.strip() for c in res.stdout.strip().splitlines()[-1].strip("|").split("|")]
    assert len(row) == 20 and row[1] == "1" and row[6:10] == ["default", "-", "plain", "False"], row  # speed=default: eager on the CPU
    assert row[11] == "-" and row[12] == "4 x 64" and row[13] == "8 (5)", row  # no document mask
    trainer, raw, ratio = (float(row[i].replace(",", "")) for i in (14, 16, 17))
    assert trainer > 0 and raw > 0 and ratio == pytest.approx(trainer / raw, abs=2e-3)
    series = next(line for line in res.stdout.splitlines() if line.startswith("trainer per-step tokens/s (thousands) from step 3:"))
    assert len(series.split(":")[1].split()) == 5, series  # one rate per timed step, in order


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12),  # Lightning's table (H100 SXM, dense)
        ("NVIDIA H200", "bf16-mixed", 989.4e12),  # ours: Lightning's table has no such name
        ("NVIDIA A100-SXM4-80GB", "16-mixed", 312e12),  # Lightning's table
        ("NVIDIA H100 80GB HBM3", "32-true", None),  # MFU is quoted for 16-bit training only
        ("Some Future GPU", "bf16-mixed", None),  # nobody lists it: pass callbacks.throughput.peak_tflops
    ],
)
def test_peak_flops_come_from_lightnings_table_except_where_it_is_silent(monkeypatch, name, precision, peak):
    """The device name is what torch would report on that card (this machine has none): the lookup is what is tested."""
    import torch

    from lmtrain.training.cards import detect_peak_flops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    got = detect_peak_flops(precision)
    assert (got is None and peak is None) or got == pytest.approx(peak), (name, got)


def test_the_step_profiler_beside_a_trainer_profiler_is_refused_before_anything_is_written(tmp_path, dataset_dir):
    from lmtrain.errors import InputError

    cfg = make_cfg(TINY + ["callbacks=[none,profiler]", "+trainer.profiler=simple"], tmp_path, dataset_dir)
    with pytest.raises(InputError, match="more than one profiler"):
        train(cfg)
    assert not Path(cfg.run_dir).exists()  # refused: the run directory it made is gone again


def test_allocator_retries_are_named_and_the_run_sets_expandable_segments(tiny_cfg, tmp_path, monkeypatch):
    """callbacks.throughput's warning for the CUDA allocator's retries (none: nothing to say), and the allocator setting
    a run makes unless the user made one (read from the environment at the first CUDA allocation)."""
    import os

    from lmtrain.callbacks.throughput import alloc_retry_warning

    assert alloc_retry_warning(0, 10) is None
    assert alloc_retry_warning(3, 10).startswith("step 10: the CUDA allocator freed its cache and retried 3 allocation(s)")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # empty is unset, as PyTorch reads it
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    train(tiny_cfg("trainer.max_steps=1", "trainer.limit_val_batches=0"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    train(tiny_cfg("trainer.max_steps=1", "trainer.limit_val_batches=0", f"run_dir={tmp_path / 'again'}"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
