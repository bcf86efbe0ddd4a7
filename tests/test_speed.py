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


def test_fp8_on_a_hopper_card_at_1_3b_keeps_the_whole_set(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, line = _adapted(tmp_path, "speed=fp8", "model=opt-1.3b")
    assert off == [] and (cfg.module.fp8, cfg.module.fp8_layers, cfg.module.fp8_fused_mlp) == ("tensorwise", "all", True)
    assert line == (
        "speed fp8: compiled, float8 tensorwise with fast accumulation in the blocks and the output head, the fused float8 MLP, "
        "the output head chunked (8192 tokens)"
    )
    validate_config(cfg)


def test_fp8_below_the_width_where_it_pays_puts_the_head_alone_in_float8(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, line = _adapted(tmp_path, "speed=fp8", "model=opt-125m")
    assert (cfg.module.fp8, cfg.module.fp8_layers, cfg.module.fp8_fused_mlp) == ("tensorwise", "head", False)
    assert line.endswith("; not here: float8 in the blocks, as d_model 768 < 2048 (it did not pay there; the head alone is float8)")
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
    assert cfg.module.fp8 is None and cfg.module.fp8_fused_mlp is False and cfg.module.fp8_layers == "blocks"
    assert cfg.module.compile is True and cfg.module.loss_chunk_tokens == 8192  # what still pays
    assert f"; not here: float8, as {reason}" in line, line
    validate_config(cfg)


def test_a_key_the_command_line_gives_is_never_changed(tmp_path, monkeypatch):
    _gpu(monkeypatch)
    cfg, off, _ = _adapted(tmp_path, "speed=fp8", "model=opt-125m", "module.fp8_layers=all", "module.fp8_fused_mlp=true")
    assert off == [] and (cfg.module.fp8_layers, cfg.module.fp8_fused_mlp) == ("all", True)


def test_default_and_eager_describe_the_config_as_written(tmp_path):
    assert _adapted(tmp_path)[2] == "speed default: eager"
    assert _adapted(tmp_path, "module.compile=true")[2] == "speed default: compiled"
    assert (
        _adapted(tmp_path, "speed=eager", "module.loss_chunk_tokens=4096")[2] == "speed eager: eager, the output head chunked (4096 tokens)"
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
