"""Speed presets: speed=fp8 fitted to the card and the model, said in one line (lmtrain/training/speed.py)."""

from __future__ import annotations

import pytest
import torch

from lmtrain.training import speed
from lmtrain.training.config import validate_config
from tests.conftest import make_cfg


def _gpu(monkeypatch, capability=(9, 0), name="NVIDIA H200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def _adapted(tmp_path, *overrides):
    cfg = make_cfg(["trainer=gpu", *overrides], tmp_path)
    off = speed.adapt(cfg, list(overrides))
    return cfg, off, speed.describe(cfg, off)


def _float8(cfg):
    return cfg.module.fp8.recipe, cfg.module.fp8.fast_accum, cfg.module.fp8.fused_mlp, cfg.module.head.kind


def test_fp8_on_a_hopper_card_at_1_3b_keeps_the_whole_set(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, line = _adapted(tmp_path, "speed=fp8", "model=opt-1.3b")
    assert off == [] and _float8(cfg) == ("tensorwise", True, True, "float8")
    assert line == (
        "speed fp8: compiled, float8 tensorwise with fast accumulation in the blocks, the fused float8 MLP, "
        "the output head in float8, chunked (8192 tokens)"
    )
    validate_config(cfg)


def test_fp8_below_the_width_where_it_pays_puts_the_head_alone_in_float8(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, line = _adapted(tmp_path, "speed=fp8", "model=opt-125m")
    assert _float8(cfg) == (None, True, False, "float8")
    assert line == (
        "speed fp8: compiled, the output head in float8 with fast accumulation, chunked (16384 tokens); not here: float8 in "
        "the blocks, as d_model 768 < 2048 (it did not pay there; the head alone is float8)"
    )
    validate_config(cfg)


@pytest.mark.parametrize(
    "capability, extra, reason",
    [
        ((8, 0), [], "NVIDIA H200 (compute capability 8.0) has no float8 tensor cores"),
        ((9, 0), ["trainer.precision=16-mixed"], "the run trains in fp16"),
    ],
)
def test_fp8_where_float8_cannot_run_keeps_bf16_matmuls_and_says_why(tmp_path, monkeypatch, capability, extra, reason):
    _gpu(monkeypatch, capability)
    cfg, off, line = _adapted(tmp_path, "speed=fp8", "model=opt-1.3b", *extra)
    assert _float8(cfg) == (None, False, False, "chunked")
    assert cfg.module.compile is True and cfg.module.head.chunk_tokens == 8192  # what still pays
    assert f"; not here: float8, as {reason}" in line, line
    validate_config(cfg)


def test_a_key_the_command_line_gives_is_never_changed(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, _ = _adapted(tmp_path, "speed=fp8", "model=opt-125m", "module.fp8.recipe=tensorwise", "module.fp8.fused_mlp=true")
    assert off == [] and _float8(cfg) == ("tensorwise", True, True, "float8")
    cfg, off, _ = _adapted(tmp_path, "speed=fp8", "model=opt-1.3b", "module.head.kind=chunked")
    assert off == [] and _float8(cfg) == ("tensorwise", True, True, "chunked")
    cfg, off, _ = _adapted(tmp_path, "speed=fp8", "model=opt-125m", "module.head.chunk_tokens=4096")
    assert _float8(cfg) == (None, True, False, "float8") and cfg.module.head.chunk_tokens == 4096


def test_compile_auto_is_compiled_on_a_gpu_and_eager_on_the_cpu(tmp_path):
    """speed=default: module.compile=auto, resolved for the run's device; a value given on the command line stays."""
    assert _adapted(tmp_path)[2] == "speed default: compiled"  # trainer=gpu
    cpu = make_cfg([], tmp_path)
    assert speed.adapt(cpu, []) == [] and cpu.module.compile is False and speed.describe(cpu, []) == "speed default: eager"
    assert _adapted(tmp_path, "module.compile=false")[2] == "speed default: eager"
    assert (
        _adapted(tmp_path, "speed=eager", "module.head.kind=chunked", "module.head.chunk_tokens=4096")[2]
        == "speed eager: eager, the output head chunked (4096 tokens)"
    )


def test_fp8_on_the_cpu_trains_with_its_line_first(tmp_path, dataset_dir):
    """speed=fp8 in a real CPU run: float8 turned off with its reason in the line after the run's first, the run trains."""
    from tests.conftest import TINY, run_train_cli

    args = [a for a in TINY] + ["speed=fp8", "module.compile=false", f"paths.runs={tmp_path / 'runs'}", f"data.path={dataset_dir}",
                               "data.prepare=null", "run_name=sp"]  # fmt: skip
    done = run_train_cli(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stderr.splitlines()[:2]
    assert first.startswith("[lmtrain] run sp: ")
    assert second == (
        "[lmtrain] speed fp8: eager, the output head chunked (8192 tokens); not here: float8, as the CPU has no float8 "
        "tensor cores (its float8 products are emulated, slower than bf16's)"
    ), second
