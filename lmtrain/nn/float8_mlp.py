"""The MLP of an OPT block, ``down(act(up(x)))`` with biases and a GELU or ReLU, in float8 as one autograd function.

torchao's float8 layers cast each product's inputs on their own: the compiler fuses the casts with the activation
around them, but on an H200 the kernels it makes for them ran at a third of the memory bandwidth or less (the
transposed one-byte stores the backward products need; docs/BENCHMARKS.md). Here the activation and its casts are
written once, as two Triton passes over the MLP's wide tensor (tokens x ffn):

* forward: one pass takes the activation of ``h = up(x)`` and its largest magnitude, the next writes it in e4m3 as
  the second product reads it and transposed, as that product's weight gradient reads it;
* backward: one pass takes the activation's gradient from ``h`` and the incoming gradient, its largest magnitude
  and its sum over the tokens (``up``'s bias gradient); the next writes it in e5m2 in both layouts.

Scales are torchao's tensorwise ones (the largest magnitude maps to the format's largest value), the forward products
accumulate in fast mode as torchao's recipes do, the four backward ones with ``fast_accum``. The narrow tensors
(x, the weights, the output's gradient) are cast by compiled PyTorch code, as in lmtrain.nn.loss. Saved for the
backward: ``x`` in e4m3 (transposed), ``h`` in bf16 and the activation in e4m3 (transposed).

The passes are the operator ``lmtrain::act_float8``: here as PyTorch code (:func:`act_float8_reference`, what runs on
the CPU), and on a GPU as Triton kernels that lmtrain.training.kernels registers for it (this layer imports PyTorch
alone), which match the PyTorch passes on a GPU (tests/test_fp8.py). Selected with ``module.fp8=tensorwise
module.fp8_fused_mlp=true`` (lmtrain.training.fp8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmtrain.nn.loss import _ALIGN, E4M3, E5M2, _compute_dtype, _float8_both_layouts, _on, _scaled_mm, _to_float8
from lmtrain.nn.model import opt_activation


def _activation_grad(dy: torch.Tensor, h: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return torch.ops.aten.threshold_backward(dy, h, 0)
    return torch.ops.aten.gelu_backward(dy, h, approximate="tanh" if act == "gelu_tanh" else "none")


def act_float8_reference(h: torch.Tensor, dy: torch.Tensor | None, act: str) -> tuple[torch.Tensor, ...]:
    """``act(h)`` (``dy`` None) in e4m3, or the gradient ``act'(h) * dy`` in e5m2: (float8 (M, N), the same transposed
    and contiguous (N, M), the inverse scale, and for the gradient its fp32 sum over the M rows, else an empty tensor).
    The value is computed in ``h``'s dtype, as the plain MLP computes it."""
    v = opt_activation(h, act) if dy is None else _activation_grad(dy, h, act)
    v8, inv = _to_float8(v, E4M3 if dy is None else E5M2)
    total = v.float().sum(0) if dy is not None else v.new_empty(0, dtype=torch.float32)
    return v8, v8.t().contiguous(), inv, total


@torch.library.custom_op(
    "lmtrain::act_float8", mutates_args=(), schema="(Tensor h, Tensor? dy, str act) -> (Tensor, Tensor, Tensor, Tensor)"
)
def act_float8(h: torch.Tensor, dy: torch.Tensor | None, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`act_float8_reference`'s results. An operator of its own, so that compiled code calls it as it is rather
    than splitting it into the kernels it replaces; on a GPU lmtrain.training.kernels registers two Triton passes as
    its CUDA implementation (:func:`lmtrain.training.kernels.register_float8_mlp_passes`)."""
    return act_float8_reference(h.contiguous(), None if dy is None else dy.contiguous(), act)


@act_float8.register_fake
def _(h, dy, act):
    M, N = h.shape
    dtype = E4M3 if dy is None else E5M2
    total = h.new_empty((N,) if dy is not None else (0,), dtype=torch.float32)
    return h.new_empty((M, N), dtype=dtype), h.new_empty((N, M), dtype=dtype), h.new_empty((), dtype=torch.float32), total


class _Float8MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_up, b_up, w_down, b_down, act: str, fast_accum: bool):
        dtype = _compute_dtype(x)
        shape, n = x.shape, x.shape[:-1].numel()
        ctx.x_dtype, ctx.w_dtypes, ctx.act, ctx.fast_accum, ctx.n = (
            x.dtype,
            (w_up.dtype, b_up.dtype, w_down.dtype, b_down.dtype),
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
            wu8, wu8t, wu_inv = cast(w_up.to(dtype))  # (F, d), (d, F)
            wd8, wd8t, wd_inv = cast(w_down.to(dtype))  # (d, F), (F, d)
            h = _scaled_mm(x8, wu8.t(), x_inv, wu_inv, dtype, True) + b_up.to(dtype)
            a8, a8t, a_inv, _ = act_float8(h, None, act)
            y = _scaled_mm(a8, wd8.t(), a_inv, wd_inv, dtype, True) + b_down.to(dtype)
        ctx.save_for_backward(x8t, x_inv, wu8t, wu_inv, wd8t, wd_inv, h, a8t, a_inv)
        return y[:n].reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        x8t, x_inv, wu8t, wu_inv, wd8t, wd_inv, h, a8t, a_inv = ctx.saved_tensors
        fast, n, dtype = ctx.fast_accum, ctx.n, h.dtype
        with torch.autocast(grad_y.device.type, enabled=False):
            dy = grad_y.reshape(n, grad_y.shape[-1]).to(dtype)
            if h.shape[0] != n:
                dy = F.pad(dy, (0, 0, 0, h.shape[0] - n))
            dy8, dy8t, dy_inv = _on(dy.device, _float8_both_layouts)(dy, E5M2)
            d_a = _scaled_mm(dy8, wd8t.t(), dy_inv, wd_inv, dtype, fast)  # (T, F)
            d_wd = _scaled_mm(dy8t, a8t.t(), dy_inv, a_inv, torch.float32, fast)  # (d, F)
            d_bd = dy.float().sum(0)
            g8, g8t, g_inv, d_bu = act_float8(h, d_a, ctx.act)
            d_x = _scaled_mm(g8, wu8t.t(), g_inv, wu_inv, dtype, fast)  # (T, d)
            d_wu = _scaled_mm(g8t, x8t.t(), g_inv, x_inv, torch.float32, fast)  # (F, d)
        d_x = d_x[:n].reshape(*grad_y.shape[:-1], d_x.shape[-1]).to(ctx.x_dtype)
        wu_t, bu_t, wd_t, bd_t = ctx.w_dtypes
        return d_x, d_wu.to(wu_t), d_bu.to(bu_t), d_wd.to(wd_t), d_bd.to(bd_t), None, None


def float8_mlp(x: torch.Tensor, up: torch.nn.Linear, down: torch.nn.Linear, act: str, fast_accum: bool = False) -> torch.Tensor:
    """``down(act(up(x)))`` with every product in float8 (see the module docstring); ``up`` and ``down`` with biases."""
    return _Float8MLP.apply(x, up.weight, up.bias, down.weight, down.bias, act, bool(fast_accum))
