"""Speed presets (the ``speed`` config group, conf/speed/), adapted to this card and model, said in one line.

    speed=default   compiled on a GPU (per block under fsdp/hsdp), eager on the CPU (``module.compile=auto``); the
                    plain compiled output head; attention by PyTorch's own choice (cuDNN's fused kernel on Hopper)
    speed=eager     nothing compiled (module.compile=false): for debugging
    speed=fp8       compiled; tensorwise float8 with fast accumulation in the blocks, the fused float8 MLP, the output
                    head in float8 and chunked: the set that measured fastest at 1.3B (docs/BENCHMARKS.md)

:func:`adapt` runs before the config is checked. ``module.compile=auto`` becomes true on a GPU and false on the CPU
(where compiling a small model cost more than it saved). What ``speed=fp8`` turned on that this machine or model
cannot use to advantage is turned off again, with the reason: a device without float8 tensor cores (the CPU, a GPU
before compute capability 8.9), an fp16 run or a missing torchao keeps bf16 matmuls (the head chunked); blocks
narrower than d_model 2048 (lmtrain.training.fp8's ``PAYS_FROM_D_MODEL``: float8 did not pay there) stay in bf16
and only the output head is float8, in chunks of 16,384 tokens. A key the command line gives is never changed. :func:`describe` is the line said
after the run's first: what the run's config turns on, whatever the preset.
"""

from __future__ import annotations

from omegaconf import DictConfig

from lmtrain.training import fastpaths

# the keys speed=fp8 sets and may take back, with the values that take them back
PLAIN = {"fp8.recipe": None, "fp8.fast_accum": False, "fp8.fused_mlp": False, "head.kind": "chunked"}
# the head alone in float8 (narrow blocks) measured fastest in chunks of this many tokens, the whole set at 1.3B in
# the preset's 8,192 (docs/BENCHMARKS.md)
HEAD_ALONE_CHUNK = 16384


def _float8_device_problem(cfg: DictConfig) -> str | None:
    """Why this run's device has no float8 tensor cores, or None."""
    import torch

    from lmtrain.training import fp8
    from lmtrain.training.config import device_type

    if device_type(str(cfg.trainer.get("accelerator", "auto"))) != "cuda" or not torch.cuda.is_available():
        return "the CPU has no float8 tensor cores (its float8 products are emulated, slower than bf16's)"
    return fp8.no_tensor_cores(torch.device("cuda"))


def _given(key: str, given: list[str]) -> bool:
    """Whether the command line sets ``module.<key>`` (or the node above it)."""
    path = f"module.{key}"
    return any(o.lstrip("+~").split("=", 1)[0] in (path, path.rsplit(".", 1)[0]) for o in given)


def _set(module: DictConfig, key: str, value) -> None:
    node, _, leaf = key.rpartition(".")
    module[node][leaf] = value


def adapt(cfg: DictConfig, given: list[str]) -> list[str]:
    """The preset fitted to this machine and model, in place; ``given``: the command line's overrides (their keys are
    left as given). Returns what was turned off, each with its reason."""
    module = cfg.get("module")
    if not module:
        return []
    if module.get("compile") == "auto":
        from lmtrain.training.config import device_type

        module.compile = device_type(str(cfg.trainer.get("accelerator", "auto"))) == "cuda"
    if cfg.get("speed") != "fp8" or not isinstance(module.get("fp8"), DictConfig) or not isinstance(module.get("head"), DictConfig):
        return []
    from lmtrain.training import fp8

    mine = [k for k in PLAIN if not _given(k, given)]  # the preset's to change
    problem = _float8_device_problem(cfg)
    if problem is None and str(cfg.trainer.get("precision", "")).startswith("16"):
        problem = "the run trains in fp16 (float8 scales from bf16 or fp32)"
    if problem is None:
        problem = fp8.torchao_missing()
    if problem is not None:
        if "fp8.recipe" not in mine and "head.kind" not in mine:
            return []
        for key in mine:
            _set(module, key, PLAIN[key])
        return [f"float8, as {problem}"]
    d_model = (cfg.get("model") or {}).get("d_model")
    if isinstance(d_model, int) and d_model < fp8.PAYS_FROM_D_MODEL and {"fp8.recipe", "fp8.fused_mlp"} <= set(mine):
        module.fp8.recipe, module.fp8.fused_mlp = None, False
        if not _given("head.chunk_tokens", given):
            module.head.chunk_tokens = HEAD_ALONE_CHUNK
        off = f"float8 in the blocks, as d_model {d_model} < {fp8.PAYS_FROM_D_MODEL} (it did not pay there; the head alone is float8)"
        return [off]
    return []


def describe(cfg: DictConfig, off: list[str]) -> str:
    """The start line: the preset, what the config turns on, and what was turned off and why."""
    module = cfg.get("module") or {}
    head, fp8, _ = fastpaths.read(module.get("head"), module.get("fp8"))
    on = ["compiled" if module.get("compile") else "eager", *fastpaths.describe(head, fp8)]
    text = f"speed {cfg.get('speed', 'default')}: {', '.join(on)}"
    return text + (f"; not here: {'; '.join(off)}" if off else "")
