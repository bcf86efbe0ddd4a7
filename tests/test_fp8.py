"""FP8 training (module.fp8, torchao's float8 linear layers) on the CPU, where PyTorch's float8 matmul computes the
same numbers a Hopper GPU does without its speed: the conversion, the losses against full precision, checkpoints and
resume. The GPU's speed and its 1,000-step loss: docs/BENCHMARKS.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtrain.formats import checkpoint as ck
from lmtrain.formats.trained import load_model_state
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg
from tests.test_checkpoint import _losses

pytest.importorskip("torchao.float8")  # in requirements.txt: installed wherever the suite runs

CKPT = ["callbacks=[none,checkpoint]", "callbacks.checkpoint.every_n_steps=3", "logger=csv", "trainer.limit_val_batches=2"]


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_fp8_trains_like_full_precision_keeps_parameter_names_and_resumes_exactly(tmp_path, dataset_dir, model, capsys):
    """Six steps: FP8 (tensorwise; rowwise with every product in fast accumulation for Llama) within 1% of the fp32
    run at every step, not equal to it (the matmuls did run in float8); the checkpoint holds the same parameter names
    and shapes as the fp32 run's; a run stopped at step 3 and resumed ends with the uninterrupted run's losses
    exactly."""
    recipe = "tensorwise" if model == "tiny" else "rowwise"
    fast = model != "tiny"
    base = [*TINY, f"model={model}", "trainer.max_steps=6", "scheduler.total_steps=6", *CKPT]
    fp8_args = [f"module.fp8={recipe}", f"module.fp8_fast_accum={str(fast).lower()}"]
    runs = {}
    for name, extra in (("fp32", []), ("fp8", fp8_args)):
        cfg = make_cfg([*base, *extra], tmp_path / name, dataset_dir)
        train(cfg)
        runs[name] = cfg.run_dir
    said = capsys.readouterr().out
    assert f"module.fp8={recipe}: 8 linear layers of the transformer blocks compute in float8" in said
    assert ("every product accumulated in fast mode" in said) == fast
    full, low = ([float(v) for v in _losses(Path(runs[k])).values()] for k in ("fp32", "fp8"))
    assert len(low) == 6 and low != full
    assert low == pytest.approx(full, rel=1e-2)
    states = {k: load_model_state(ck.newest(Path(v) / "checkpoints")) for k, v in runs.items()}
    assert {k: t.shape for k, t in states["fp8"].items()} == {k: t.shape for k, t in states["fp32"].items()}

    cut = make_cfg([*base, *fp8_args, "trainer.max_steps=3"], tmp_path / "cut", dataset_dir)
    train(cut)
    resumed = make_cfg([*base, *fp8_args], tmp_path / "cut", dataset_dir)
    train(resumed)
    uninterrupted = _losses(Path(runs["fp8"]))
    assert _losses(Path(resumed.run_dir)) == uninterrupted  # steps 3-5 resumed: the same printed values, 0 tolerance


def test_fast_accumulation_reaches_every_float8_product_and_only_with_the_option():
    """module.fp8_fast_accum: torchao's recipes accumulate only the forward product in fast mode; the option makes the
    two backward ones fast too, in every converted layer, for both recipes, and leaves the recipe otherwise alone."""
    from torchao.float8.float8_linear import Float8Linear

    from lmtrain.formats.presets import preset
    from lmtrain.nn.model import Decoder
    from lmtrain.training.fp8 import convert

    def accum(recipe, fast):
        with torch.device("meta"):
            model = convert(Decoder(preset("tiny")), recipe, sharded=False, device=torch.device("cpu"), fast_accum=fast)
        layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(layers) == 8
        configs = {(c.gemm_config_output.use_fast_accum, c.gemm_config_grad_input.use_fast_accum, c.gemm_config_grad_weight.use_fast_accum,
                    c.cast_config_input.scaling_granularity.value) for c in (m.config for m in layers)}  # fmt: skip
        assert len(configs) == 1
        return configs.pop()

    assert accum("tensorwise", False) == (True, False, False, "tensorwise")
    assert accum("tensorwise", True) == (True, True, True, "tensorwise")
    assert accum("rowwise", False) == (True, False, False, "axiswise")
    assert accum("rowwise", True) == (True, True, True, "axiswise")


def test_a_model_too_narrow_for_fp8_to_pay_is_told_so():
    """The measured crossover (docs/BENCHMARKS.md): below d_model 2048 the trainer warns that FP8 saves memory, not time."""
    from lmtrain.formats.presets import preset
    from lmtrain.nn.model import Decoder
    from lmtrain.training.fp8 import width_warning

    with torch.device("meta"):
        narrow, wide = Decoder(preset("opt-125m")), Decoder(preset("opt-1.3b"))
    assert "module.fp8=rowwise at d_model=768: on an H100, FP8 was slower than bf16 below d_model 2048" in width_warning(narrow, "rowwise")
    assert width_warning(wide, "tensorwise") is None


def test_checking_for_torchao_prints_nothing(tmp_path):
    """The config check imports torchao (module.fp8 set): in a fresh process it says nothing on the console. torchao
    0.18 under torch 2.13 made torch's pytree log a deprecation line per process, and torchao warns about each
    optional kernel library it cannot load: neither is the user's to act on."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = "from lmtrain.training.fp8 import config_problems; print(config_problems('tensorwise'))"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr[-2000:]
    assert res.stderr == "", res.stderr[-2000:]
