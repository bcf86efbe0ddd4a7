"""FP8 matmuls in the decoder's linear layers: torchao's float8 training, selected by ``module.fp8.recipe``
(the node and its rules: lmtrain.training.fastpaths).

    module.fp8.recipe=tensorwise    one scale per tensor (the fastest on Hopper; under fsdp/hsdp the weights are also
                                    all-gathered in float8, half the bytes of bf16)
    module.fp8.recipe=rowwise       one scale per row (finer, more robust to outliers, slower kernels)
    module.fp8.fast_accum=true      the backward float8 products also accumulate in Hopper's fast mode (torchao's
                                    recipes do so for the forward product only)
    module.fp8.fused_mlp=true       with tensorwise, a block's MLP (OPT: up, GELU or ReLU, down; Llama: gate_up,
                                    SwiGLU, down) as one float8 function of ours instead of two torchao layers
                                    (lmtrain.nn.float8_mlp): the activation and its float8 casts in two Triton passes
                                    each way (lmtrain.training.kernels), the same numbers as torchao's layers
                                    (tests/test_fp8.py); its weights all-gathered in float8 under fsdp/hsdp as theirs
    module.head.kind=float8         the output head in float8, chunked (lmtrain.nn.loss computes its three products
                                    with torch._scaled_mm, tensorwise, with or without float8 blocks)

Each converted ``nn.Linear`` of the blocks becomes torchao's ``Float8Linear``: the same parameters under the same
names (checkpoints load either way), its forward and backward matmuls in float8 with dynamic scales, as torchtitan's
and torchao's recipes leave the output layer out. The output head (at opt-125m's width a quarter of the model's FLOPs)
stays a plain layer tied to the embedding; in float8 its chunked loss casts the loss's gradient to e5m2 as every
other layer's output gradient is, without the whole batch's logits. Under FSDP the head's weight is never all-gathered
in float8 (the embedding lookup reads the same parameter). The optional embedding projections of OPT-350m stay in the
training precision. The master weights, optimizer state and every other op keep their precision: FP8 is a matmul
format here, not a storage format.

Where it runs: a GPU of compute capability 8.9 or later (Ada, Hopper: the float8 tensor cores), and the CPU, where
PyTorch's float8 matmul computes the same numbers with no speed-up (the tests check the numerics there; in fp32 the
run keeps it in PyTorch's emulation, :func:`emulate_cpu_matmuls`). Refused before any model is built: another GPU,
fp16, sizes not divisible by 16 and a missing ``torchao`` (lmtrain.training.fastpaths). Measured figures and where
FP8 pays: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import warnings

import torch
from torch import nn

from lmtrain.errors import InputError

_TORCHAO = "torchao==0.18.0"


# Loggers quieted while torchao is imported: torchao's own warns about each optional kernel library this machine
# cannot load (none is used here); torch's pytree warns that torchao 0.18 registers an Enum the way torch 2.13
# deprecates (a line per process that is not the user's to act on). Python 3.12 also compiles torchao 0.18's
# docstrings with SyntaxWarnings (invalid escape sequences; seen on the GPU machine's Python).
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def torchao_missing() -> str | None:
    logs = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"module.fp8.recipe needs torchao ({exc}): pip install {_TORCHAO} (in requirements.txt)"
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return None


def no_tensor_cores(device: torch.device) -> str | None:
    """Why the CUDA ``device`` has no float8 tensor cores (the GPUs before compute capability 8.9), or None."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no float8 tensor cores"
    return None


def device_problem(recipe: str | None, device: torch.device, float8_head: bool = False) -> str | None:
    """Why this device cannot run the float8 matmuls asked for (``recipe`` in the blocks, a float8 head), or None."""
    if (recipe is None and not float8_head) or device.type != "cuda":
        return None
    why = no_tensor_cores(device)
    if why is None:
        return None
    what, off = (
        (f"module.fp8.recipe={recipe}", "module.fp8.recipe=null") if recipe else ("module.head.kind=float8", "module.head.kind=chunked")
    )
    return f"{what}: {why}; FP8 needs 8.9 or later (Ada, Hopper): set {off}"


def gathers_in_float8(recipe: str | None, *, sharded: bool) -> bool:
    """Whether FSDP2 all-gathers the blocks' weights already cast to float8 (half of bf16's bytes; scales computed
    once per step): tensorwise scaling under fsdp/hsdp. On the CPU too, where gloo gathers the bytes as NCCL does: the
    tests run this path there. lmtrain.plan counts those weights at one byte gathered."""
    return recipe == "tensorwise" and sharded


def float8_config(recipe: str, *, sharded: bool, device: torch.device, fast_accum: bool = False):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import Float8GemmConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fast_accum:
        # torchao's recipes accumulate the forward product in Hopper's fast mode and the two backward products with
        # periodic promotion to fp32; this makes all three fast (module.fp8.fast_accum)
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_output=fast, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    if gathers_in_float8(recipe, sharded=sharded):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convert(
    model: nn.Module,
    recipe: str | None,
    *,
    sharded: bool,
    device: torch.device,
    fast_accum: bool = False,
    float8_head: bool = False,
    fused_mlp: bool = False,
) -> nn.Module:
    """Swap the linear layers inside ``model.blocks`` for torchao's float8 ones (``recipe``; None leaves them) in place,
    before sharding and compiling (works on the meta device); with ``float8_head`` the chunked head computes its
    products in float8 from the weight (``model.loss_float8``, lmtrain.nn.loss). Attributes our initialisation reads
    (``residual_out``) carry over. The config was checked by lmtrain.training.fastpaths (torchao's presence too)."""
    problem = device_problem(recipe, device, float8_head)
    if problem:
        raise InputError(problem)
    # every part checked before any is converted: a refused model is left as it was
    blocks = getattr(model, "blocks", None)
    if recipe is not None and blocks is None:
        raise InputError(f"module.fp8.recipe: the model {type(model).__name__} has no transformer blocks (lmtrain.nn.model.Decoder has)")
    if float8_head and not hasattr(model, "loss_float8"):
        raise InputError(f"module.head.kind=float8: the model {type(model).__name__} has no chunked head (lmtrain.nn.model.Decoder has)")
    mlps = _fusable_mlps(model, blocks) if fused_mlp else []
    if recipe is not None:
        from torchao.float8 import convert_to_float8_training

        config = float8_config(recipe, sharded=sharded, device=device, fast_accum=fast_accum)
        marked = {name for name, m in blocks.named_modules() if getattr(m, "residual_out", False)}
        fused = {id(m) for mlp in mlps for m in (mlp.first, mlp.down)}
        convert_to_float8_training(blocks, module_filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and id(m) not in fused
                                   and not getattr(m, "moe_router", False), config=config)  # a router's scores stay fp32
        for name, m in blocks.named_modules():
            if name in marked:
                m.residual_out = True
    if mlps:
        from lmtrain.nn import float8_mlp as fm
        from lmtrain.training.kernels import register_float8_mlp_passes

        register_float8_mlp_passes()  # its Triton passes on a GPU
        if config.enable_fsdp_float8_all_gather:  # what its two weights arrive as, gathered in float8 too
            from torchao.float8.float8_training_tensor import Float8TrainingTensor

            fm.GATHERED_FLOAT8 = (Float8TrainingTensor,)
        for mlp in mlps:
            mlp.float8, mlp.float8_fast_accum = fm.float8_mlp, fast_accum
            if config.enable_fsdp_float8_all_gather:
                for layer in (mlp.first, mlp.down):
                    layer.weight = _gathered_in_float8(layer.weight, config)
    if float8_head:
        model.loss_float8, model.loss_float8_fast_accum = True, fast_accum
    return model


def _gathered_in_float8(weight: nn.Parameter, config) -> nn.Parameter:
    """``weight`` as torchao's float8 layers hold theirs under FSDP's float8 all-gather: each rank casts its shard to
    e4m3 at one scale for the whole weight (the one :func:`precompute_scales` computes after each optimizer step), and
    the gathered weight arrives as torchao's ``Float8TrainingTensor``, which lmtrain.nn.float8_mlp reads as it is.

    The matmul settings it carries are the ones torchao's ``Float8Linear`` derives from the same ``config``: torchao
    asserts that every such weight in one operation carries equal ones, and a multi-tensor optimizer step (fused or
    foreach AdamW, the default on GPUs) takes them all in one operation."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    settings = LinearMMConfig(
        *(
            ScaledMMConfig(emulate=config.emulate, use_fast_accum=g.use_fast_accum, fp8_output=False, pad_inner_dim=config.pad_inner_dim)
            for g in gemms
        )
    )
    cast = WeightWithDynamicFloat8CastTensor(weight, settings, config.cast_config_weight.target_dtype)
    return nn.Parameter(cast, requires_grad=weight.requires_grad)


def _fusable_mlps(model: nn.Module, blocks) -> list[nn.Module]:
    """Every block's MLP, each an OPT one (linear ``up`` and ``down`` with biases, a GELU or ReLU) or a SwiGLU one
    (linear ``gate_up``, twice as wide as ``down``'s input, and ``down``, without biases), or a refusal naming what is
    not."""
    from lmtrain.nn.float8_mlp import ACTS
    from lmtrain.nn.model import ACTIVATIONS

    def linear(m, name, bias):
        layer = getattr(m, name, None)
        return type(layer) is nn.Linear and (layer.bias is not None) == bias

    def fusable(m):
        if m is None or not hasattr(m, "float8") or not hasattr(m, "first") or getattr(m, "act", None) not in ACTS:
            return False
        if m.act == "silu":
            return linear(m, "gate_up", False) and linear(m, "down", False) and m.gate_up.out_features == 2 * m.down.in_features
        return linear(m, "up", True) and linear(m, "down", True)

    mlps = [getattr(b, "mlp", None) for b in (blocks if blocks is not None else [])]
    if not mlps or not all(fusable(m) for m in mlps):
        raise InputError(
            f"module.fp8.fused_mlp=true: the model {type(model).__name__} has blocks without an MLP it fuses (an OPT one: "
            f"linear up and down with biases, activation one of {list(ACTIVATIONS['opt'])}; or a SwiGLU one: gate_up and down "
            "without biases; lmtrain.nn.model's opt and llama families have them): use module.fp8.fused_mlp=false"
        )
    return mlps


def describe(model: nn.Module) -> str:
    """What :func:`convert` made float8, for the console."""
    parts = []
    if "torchao.float8" in sys.modules:
        n = converted(model)
        parts += [f"{n} linear layers of the transformer blocks"] if n else []
    fused = sum(getattr(m, "float8", None) is not None for m in model.modules())
    if fused:
        parts.append(f"{fused} fused MLPs (lmtrain.nn.float8_mlp)")
    if getattr(model, "loss_float8", False):
        parts.append(f"the chunked output head ({model.loss_chunk_tokens} tokens at a time)")
    return " and ".join(parts) + (" computes" if len(parts) == 1 and parts[0].startswith("the ") else " compute")


# The width from which FP8 in the blocks paid on an H100 (bench/fast_paths_gpu.sh; the figures: docs/BENCHMARKS.md):
# below it the casts cost more than the faster matmuls save.
PAYS_FROM_D_MODEL = 2048


def width_warning(model: nn.Module, recipe: str | None) -> str | None:
    """What to tell a user whose model's blocks are too narrow for FP8 to be faster, or None."""
    d = getattr(getattr(model, "cfg", None), "d_model", None)
    if d is None or d >= PAYS_FROM_D_MODEL or recipe is None:
        return None
    return (
        f"module.fp8.recipe={recipe} at d_model={d}: FP8 in the blocks was slower than bf16 below d_model "
        f"{PAYS_FROM_D_MODEL} (docs/BENCHMARKS.md); it saves memory, not time, here. module.head.kind=float8 with "
        "module.fp8.recipe=null puts the output head alone in float8, which paid at opt-125m's width"
    )


def _float8_gathered(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that FSDP all-gathers in float8 (torchao's layers' weights and the fused MLPs'), as held: each
    a DTensor whose shard is torchao's ``WeightWithDynamicFloat8CastTensor``, or that tensor itself before sharding.
    Empty where torchao's module was never imported: a run without FP8 does not import torchao (which took 1.1 s and
    printed three lines about kernel libraries and the pytree in every run; tests/test_fp8.py)."""
    if "torchao.float8.fsdp_utils" not in sys.modules:
        return []
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [p for p in model.parameters() if isinstance(getattr(p, "_local_tensor", p), WeightWithDynamicFloat8CastTensor)]


def uses_float8_all_gather(model: nn.Module) -> bool:
    return bool(_float8_gathered(model))


def plain_state(state: dict) -> dict:
    """A sharded model state dict (``get_model_state_dict`` under fsdp/hsdp) with each float8-gathered weight's shard,
    torchao's ``WeightWithDynamicFloat8CastTensor``, replaced by the tensor it wraps (the same memory) in a ``DTensor``
    of the same layout. Saved as the wrapper, distributed checkpoint pickled each shard as an object: the run
    resumed on the same ranks, but the checkpoint could not be read without torchao's class allowed (generate,
    export), nor resharded. Saved plain, it loads back into the wrapped weights (tests/test_fsdp.py)."""
    if "torchao.float8.fsdp_utils" not in sys.modules:  # never imported: no weight of this run is one
        return state
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from lmtrain.training.compat import dtensor_around

    def plain(t):
        if isinstance(t, DTensor) and isinstance(t._local_tensor, WeightWithDynamicFloat8CastTensor):
            return dtensor_around(t._local_tensor._tensor, t)
        return t

    return {name: plain(t) for name, t in state.items()}


@torch.no_grad()
def precompute_scales(model: nn.Module) -> None:
    """After each optimizer step under FSDP's float8 all-gather: every gathered weight's scale (torchao's layers' and
    the fused MLPs') from one stacked amax and one all-reduce, instead of one of each per weight inside the next
    forward. The scale is torchao's tensorwise one, as torchao's precompute_float8_dynamic_scale_for_fsdp computes it
    for its own layers alone."""
    weights = _float8_gathered(model)
    if not weights:
        return
    from torch.distributed.tensor import DTensor

    from lmtrain.nn.loss import _AMAX_FLOOR

    shards = [getattr(p, "_local_tensor", p) for p in weights]  # torchao's WeightWithDynamicFloat8CastTensor each
    (dtype,) = {t._dtype for t in shards}  # e4m3, one recipe for the model
    amax = torch.stack(torch._foreach_norm(weights, ord=math.inf))  # a partial DTensor: reduced across the shards
    amax = amax.clamp(min=_AMAX_FLOOR).to(torch.float64)
    scales = (torch.finfo(dtype).max / amax).to(torch.float32)
    scales = scales.full_tensor() if isinstance(scales, DTensor) else scales
    for shard, scale in zip(shards, scales):
        shard._precomputed_scale = scale


def emulate_cpu_matmuls(float8: bool, device: torch.device, precision) -> bool:
    """Turn oneDNN off for an FP8 run on the CPU in full precision, so that its float8 matmuls run in PyTorch's own
    emulation (both operands to fp32, one fp32 product: the same numbers); True if it was turned off (give it back
    with :func:`restore_onednn` when the run ends).

    On a CPU with AMX-INT8, ``torch._scaled_mm`` (2.13) sends a product of two e4m3 operands with one scale each (every
    forward product of the tensorwise recipe) to oneDNN's float8 GEMM instead, which took 1.15-1.31 s against 3.6 ms
    for the emulation on a (256, 512) x (512, 256) product on a 2-core CI-like machine (the results 8e-6 apart):
    an 8-step 2-rank FP8 tiny-llama run spent 37 s in its steps. Rowwise scales and mixed e4m3/e5m2 operands took
    2-6 ms either way (docs/BENCHMARKS.md).
    Not under bf16-mixed, where the CPU's bf16 matmuls need oneDNN (167 ms against 2.9 ms for a (4096, 512) layer
    without it); fp32 matmuls go to MKL either way (15-17 ms)."""
    if not float8 or device.type != "cpu" or str(precision) not in ("32", "32-true") or not torch.backends.mkldnn.enabled:
        return False
    torch.backends.mkldnn.enabled = False
    return True


def restore_onednn(turned_off: bool) -> None:
    """Undo :func:`emulate_cpu_matmuls`."""
    if turned_off:
        torch.backends.mkldnn.enabled = True


def converted(model: nn.Module) -> int:
    """How many float8 linear layers ``model`` has."""
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())
