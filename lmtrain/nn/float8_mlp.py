"""A block's MLP in float8 as one autograd function: OPT's, ``down(act(up(x)))`` with biases and a GELU or ReLU, or
Llama's, ``down(silu(gate) * value)`` without biases, ``gate`` and ``value`` the two halves of one product
(lmtrain.nn.model.MLP's ``gate_up``).

torchao's float8 layers cast each product's inputs on their own: the compiler fuses the casts with the activation
around them, but on an H200 the kernels it makes for them ran far below the memory bandwidth (the transposed
one-byte stores the backward products need; docs/BENCHMARKS.md). Here the activation and its casts are
written once, as two Triton passes over the MLP's wide tensor (tokens x ffn):

* forward: one pass takes the activation of ``h = up(x)`` and its largest magnitude, the next writes it in e4m3 as
  the second product reads it;
* backward: one pass takes the activation's gradient from ``h`` and the incoming gradient, its largest magnitude
  and its sum over the tokens (``up``'s bias gradient, OPT's only); the next writes it in e5m2 in both layouts (for
  SwiGLU the gate's and the value's gradients side by side, as ``h``, under one scale, as torchao's layer for
  ``gate_up`` casts them), and the activation again in e4m3 at the forward's scale, transposed, as ``down``'s weight
  gradient reads it.

Scales are torchao's tensorwise ones (the largest magnitude maps to the format's largest value), the forward products
accumulate in fast mode as torchao's recipes do, the four backward ones with ``fast_accum``. The narrow tensors
(x, the weights, the output's gradient) are cast by compiled PyTorch code, as in lmtrain.nn.loss. Saved for the
backward: ``x`` in e4m3 (transposed) and ``h`` in bf16, as torchao's layers under the compiler save them; the
activation is recomputed from ``h`` (saving it too took 9 GiB more at opt-1.3b, batch 48; docs/BENCHMARKS.md).

The passes are the operators ``lmtrain::act_float8`` and ``lmtrain::act_grad_float8``: here as PyTorch code
(:func:`act_float8_reference`, :func:`act_grad_float8_reference`, what runs on the CPU), and on a GPU as Triton
kernels that lmtrain.training.kernels registers for them (this layer imports PyTorch alone), which match the PyTorch
passes on a GPU (tests/test_fp8.py). Selected with ``module.fp8.recipe=tensorwise module.fp8.fused_mlp=true``
(lmtrain.training.fp8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmtrain.nn.loss import (
    _ALIGN,
    E4M3,
    E5M2,
    _cast_float8,
    _compute_dtype,
    _float8_both_layouts,
    _float8_scale,
    _on,
    _scaled_mm,
    _to_float8,
)
from lmtrain.nn.model import ACTIVATIONS, mlp_activation

# the activations it fuses: the opt family's, and the llama family's SwiGLU ("silu": up's output is the gate and the
# value side by side, (M, 2F), as lmtrain.nn.model.MLP's gate_up computes them)
ACTS = (*ACTIVATIONS["opt"], *ACTIVATIONS["llama"])


def _activation_grad(dy: torch.Tensor, h: torch.Tensor, act: str) -> torch.Tensor:
    """The gradient with respect to ``h`` that autograd computes for :func:`lmtrain.nn.model.mlp_activation` (in ``h``'s dtype)."""
    if act == "silu":
        gate, up = h.chunk(2, dim=-1)
        return torch.cat([torch.ops.aten.silu_backward(dy * up, gate), dy * F.silu(gate)], dim=-1)
    if act == "relu":
        return torch.ops.aten.threshold_backward(dy, h, 0)
    return torch.ops.aten.gelu_backward(dy, h, approximate="tanh" if act == "gelu_tanh" else "none")


def act_float8_reference(h: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(h)`` in e4m3 (M, N) and its scale (fp32; the product takes its inverse). The value is computed in ``h``'s
    dtype, as the plain MLP computes it."""
    v = mlp_activation(h, act)
    scale = _float8_scale(v, E4M3)
    return _cast_float8(v, scale, E4M3), scale


def act_grad_float8_reference(h: torch.Tensor, dy: torch.Tensor, act: str, act_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The activation's gradient with respect to ``h`` in e5m2 (the shape of ``h``), the same transposed and
    contiguous, its inverse scale and its fp32 sum over the rows (``up``'s bias gradient; empty for SwiGLU, whose
    layers have no biases); and the activation again in e4m3 at the forward's ``act_scale``, transposed, as ``down``'s
    weight gradient reads it: recomputed from ``h``, which the backward reads here anyway, rather than saved (a byte
    per element of the widest tensor in every block)."""
    g = _activation_grad(dy, h, act)
    g8, inv = _to_float8(g, E5M2)
    total = g.new_empty(0, dtype=torch.float32) if act == "silu" else g.float().sum(0)
    return g8, g8.t().contiguous(), inv, total, _cast_float8(mlp_activation(h, act), act_scale, E4M3).t().contiguous()


# Operators of their own, so that compiled code calls them as they are rather than splitting them into the kernels
# they replace; on a GPU lmtrain.training.kernels registers Triton passes as their CUDA implementations
# (lmtrain.training.kernels.register_float8_mlp_passes).
@torch.library.custom_op("lmtrain::act_float8", mutates_args=())
def act_float8(h: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`act_float8_reference`'s results."""
    return act_float8_reference(h.contiguous(), act)


def _width(h: torch.Tensor, act: str) -> int:
    """The activation's width for ``h`` (M, H): H, or for SwiGLU H / 2."""
    return h.shape[1] // 2 if act == "silu" else h.shape[1]


@act_float8.register_fake
def _(h, act):
    return h.new_empty((h.shape[0], _width(h, act)), dtype=E4M3), h.new_empty((), dtype=torch.float32)


@torch.library.custom_op("lmtrain::act_grad_float8", mutates_args=())
def act_grad_float8(
    h: torch.Tensor, dy: torch.Tensor, act: str, act_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`act_grad_float8_reference`'s results."""
    return act_grad_float8_reference(h.contiguous(), dy.contiguous(), act, act_scale)


@act_grad_float8.register_fake
def _(h, dy, act, act_scale):
    M, N = h.shape
    return (
        h.new_empty((M, N), dtype=E5M2),
        h.new_empty((N, M), dtype=E5M2),
        h.new_empty((), dtype=torch.float32),
        h.new_empty((0 if act == "silu" else N,), dtype=torch.float32),
        h.new_empty((_width(h, act), M), dtype=E4M3),
    )


# What FSDP's float8 all-gather hands a weight over as: torchao's Float8TrainingTensor, which lmtrain.training.fp8
# puts here when it has the fused MLPs' weights gathered in float8 (this layer imports PyTorch alone)
GATHERED_FLOAT8: tuple[type, ...] = ()


def _weight_float8(w: torch.Tensor, cast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight in e4m3 in both layouts and its inverse scale: as FSDP gathered it in float8 (each rank cast its shard
    at the scale computed for the whole weight), or cast here. Either way from the weight's own precision (fp32 master
    weights under autocast), as torchao's layers cast theirs, not rounded to bf16 first."""
    if isinstance(w, GATHERED_FLOAT8):
        return w._data, w._data.t().contiguous(), w._scale.reciprocal()
    return cast(w)


class _Float8MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_up, b_up, w_down, b_down, act: str, fast_accum: bool):
        dtype = _compute_dtype(x)
        shape, n = x.shape, x.shape[:-1].numel()
        ctx.x_dtype, ctx.w_dtypes, ctx.act, ctx.fast_accum, ctx.n = (
            x.dtype,
            tuple(None if t is None else t.dtype for t in (w_up, b_up, w_down, b_down)),
            act,
            fast_accum,
            n,
        )
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(n, shape[-1]).to(dtype)
            if n % _ALIGN:  # padded tokens (the weight gradients sum over them): zero rows, output dropped, gradient zero
                x2 = F.pad(x2, (0, 0, 0, -n % _ALIGN))
            cast = _on(x.device, _float8_both_layouts)  # the narrow tensors
            x8, x8t, x_inv = cast(x2)
            wu8, wu8t, wu_inv = _weight_float8(w_up, cast)  # (F, d), (d, F); SwiGLU: 2F, gate then value
            wd8, wd8t, wd_inv = _weight_float8(w_down, cast)  # (d, F), (F, d)
            h = _scaled_mm(x8, wu8.t(), x_inv, wu_inv, dtype, True)
            if b_up is not None:
                h = h + b_up.to(dtype)
            a8, a_scale = act_float8(h, act)
            y = _scaled_mm(a8, wd8.t(), a_scale.reciprocal(), wd_inv, dtype, True)
            if b_down is not None:
                y = y + b_down.to(dtype)
        ctx.save_for_backward(x8t, x_inv, wu8t, wu_inv, wd8t, wd_inv, h, a_scale)
        return y[:n].reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x8t, x_inv, wu8t, wu_inv, wd8t, wd_inv, h, a_scale = ctx.saved_tensors
        fast, n, dtype = ctx.fast_accum, ctx.n, h.dtype
        with torch.autocast(grad_y.device.type, enabled=False):
            dy = grad_y.reshape(n, grad_y.shape[-1]).to(dtype)
            if h.shape[0] != n:
                dy = F.pad(dy, (0, 0, 0, h.shape[0] - n))
            dy8, dy8t, dy_inv = _on(dy.device, _float8_both_layouts)(dy, E5M2)
            d_a = _scaled_mm(dy8, wd8t.t(), dy_inv, wd_inv, dtype, fast)  # (T, F)
            g8, g8t, g_inv, d_bu, a8t = act_grad_float8(h, d_a, ctx.act, a_scale)
            d_wd = _scaled_mm(dy8t, a8t.t(), dy_inv, a_scale.reciprocal(), torch.float32, fast)  # (d, F)
            d_x = _scaled_mm(g8, wu8t.t(), g_inv, wu_inv, dtype, fast)  # (T, d)
            d_wu = _scaled_mm(g8t, x8t.t(), g_inv, x_inv, torch.float32, fast)  # (F, d)
        d_x = d_x[:n].reshape(*grad_y.shape[:-1], d_x.shape[-1]).to(ctx.x_dtype)
        wu_t, bu_t, wd_t, bd_t = ctx.w_dtypes
        d_bu = None if bu_t is None else d_bu.to(bu_t)
        d_bd = None if bd_t is None else dy.float().sum(0).to(bd_t)
        return d_x, d_wu.to(wu_t), d_bu, d_wd.to(wd_t), d_bd, None, None


def float8_mlp(x: torch.Tensor, up: torch.nn.Linear, down: torch.nn.Linear, act: str, fast_accum: bool = False) -> torch.Tensor:
    """``down(act(up(x)))`` with every product in float8 (see the module docstring): an OPT MLP (``act`` one of
    ACTIVATIONS["opt"], layers with biases) or a SwiGLU one (``act`` "silu": ``up`` the gate and value projections
    stacked, as lmtrain.nn.model.MLP's ``gate_up``; no biases)."""
    return _Float8MLP.apply(x, up.weight, up.bias, down.weight, down.bias, act, bool(fast_accum))
