"""Speed knobs and the step profiler: attention kernel choice, the profiler's files, per-step statistics handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtrain.errors import InputError
from lmtrain.logs import by_step
from lmtrain.module import sdpa_backends
from lmtrain.run import train
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
    summary = (out / "summary_rank0.txt").read_text()
    assert summary.startswith("steps 2..3 on rank 0:") and "ms per step" in summary and "Name" in summary
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
        assert sorted(rows) == [0, 1, 2, 3] and all(r["train/grad_norm"] for r in rows.values())


def test_device_busy_time_counts_kernels_not_annotation_ranges():
    """A record_function range shown on the GPU timeline (Lightning's `Optimizer.step` wraps the whole step) is not
    device work: counting it hid the idle gaps it spans."""
    from types import SimpleNamespace

    import torch

    from callbacks.profiler import busy_fraction

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
