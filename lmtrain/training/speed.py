"""Speed presets (the ``speed`` config group, conf/speed/), adapted to this card and model, said in one line.

    speed=default   the config as written
    speed=eager     nothing compiled (module.compile=false): for debugging
    speed=fp8       compiled; tensorwise float8 with fast accumulation in the blocks and the output head, the head
                    chunked, the fused float8 MLP: the set that measured fastest at 1.3B (docs/BENCHMARKS.md)

:func:`adapt` runs before the config is checked. What ``speed=fp8`` turned on that this machine or model cannot use to
advantage is turned off again, with the reason: a device without float8 tensor cores (the CPU, a GPU before compute
capability 8.9) or an fp16 run keeps bf16 matmuls; blocks narrower than d_model 2048 (lmtrain.training.fp8's
``PAYS_FROM_D_MODEL``: float8 did not pay there) stay in bf16 and only the output head is float8. A key the command
line gives is never changed. :func:`describe` is the line said after the run's first: what the run's config turns on,
whatever the preset.
"""

from __future__ import annotations

from omegaconf import DictConfig

FP8_KEYS = ("fp8", "fp8_fast_accum", "fp8_layers", "fp8_fused_mlp")
PLAIN = {"fp8": None, "fp8_fast_accum": False, "fp8_layers": "blocks", "fp8_fused_mlp": False}


def _float8_device_problem(cfg: DictConfig) -> str | None:
    """Why this run's device has no float8 tensor cores, or None."""
    import torch

    from lmtrain.training.config import device_type

    if device_type(str(cfg.trainer.get("accelerator", "auto"))) != "cuda" or not torch.cuda.is_available():
        return "the CPU has no float8 tensor cores (its float8 products are emulated, slower than bf16's)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no float8 tensor cores"
    return None


def adapt(cfg: DictConfig, given: list[str]) -> list[str]:
    """``speed=fp8`` fitted to this machine and model, in place; ``given``: the command line's overrides (their keys
    are left as given). Returns what was turned off, each with its reason."""
    if cfg.get("speed") != "fp8" or not cfg.get("module"):
        return []
    from lmtrain.training import fp8

    module = cfg.module
    mine = {k for k in FP8_KEYS if not any(o.lstrip("+~").startswith(f"module.{k}=") for o in given)}  # the preset's to change
    off = []
    problem = _float8_device_problem(cfg)
    if problem is None and str(cfg.trainer.get("precision", "")).startswith("16"):
        problem = "the run trains in fp16 (float8 scales from bf16 or fp32)"
    if problem is None:
        problem = fp8._torchao_missing()
    if problem is not None and "fp8" in mine:
        for key in mine:
            module[key] = PLAIN[key]
        return [f"float8, as {problem}"]
    d_model = (cfg.get("model") or {}).get("d_model")
    if isinstance(d_model, int) and d_model < fp8.PAYS_FROM_D_MODEL and {"fp8_layers", "fp8_fused_mlp"} <= mine:
        module.fp8_layers, module.fp8_fused_mlp = "head", False
        off.append(f"float8 in the blocks, as d_model {d_model} < {fp8.PAYS_FROM_D_MODEL} (it did not pay there; the head alone is float8)")
    return off


def describe(cfg: DictConfig, off: list[str]) -> str:
    """The start line: the preset, what the config turns on, and what was turned off and why."""
    module = cfg.get("module") or {}
    on = ["compiled" if module.get("compile") else "eager"]
    if module.get("fp8"):
        where = {"blocks": "the blocks", "all": "the blocks and the output head", "head": "the output head"}[
            module.get("fp8_layers", "blocks")
        ]
        fast = " with fast accumulation" if module.get("fp8_fast_accum") else ""
        on.append(f"float8 {module.fp8}{fast} in {where}")
        if module.get("fp8_fused_mlp"):
            on.append("the fused float8 MLP")
    if module.get("loss_chunk_tokens"):
        on.append(f"the output head chunked ({module.loss_chunk_tokens} tokens)")
    if module.get("loss_kernel"):
        on.append(f"the {module.loss_kernel} output head")
    text = f"speed {cfg.get('speed', 'default')}: {', '.join(on)}"
    return text + (f"; not here: {'; '.join(off)}" if off else "")
