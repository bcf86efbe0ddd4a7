"""Third-party kernels the model can be given (the pure PyTorch layer, lmtrain.nn, imports none of them)."""

from __future__ import annotations

import torch

from lmtrain.nn.loss import _compute_dtype

LOSS_KERNELS = ("liger",)


@torch.compiler.disable
def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` through liger-kernel's fused linear cross-entropy (Triton, GPU
    only; ``module.head.kind=liger``): like lmtrain.nn.loss's chunked loss, chunks of tokens whose logits and their
    gradient live only inside the kernel, the weight's gradient accumulated in fp32. Inputs are cast to the autocast
    dtype first (under bf16-mixed the final norm's output is fp32; the head's matmul runs in bf16 as the plain head's
    does). Kept out of compiled graphs: its own kernels are already fused. ``z_loss`` > 0: liger's own z-loss
    (``lse_square_scale``, added to the loss it returns), as lmtrain.nn.loss.with_z_loss's parts."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        if not z_loss:
            return liger_fused_linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, accum_dtype=torch.float32)
        out = liger_fused_linear_cross_entropy(
            hidden.to(dtype), weight.to(dtype), targets, lse_square_scale=z_loss, return_z_loss=True, accum_dtype=torch.float32
        )  # loss: cross-entropy + z_term, z_term = z_loss * mean(lse**2), as (loss, z_term) or, in later releases, an object
    loss, z_term = (out.loss, out.z_loss) if hasattr(out, "z_loss") else out
    z_term = z_term.detach().float()
    return torch.stack([loss.float(), loss.detach().float() - z_term, z_term / z_loss])


def loss_kernel(name: str):
    """The ``(hidden (N, E), weight (V, E), targets (N,)) -> mean loss`` function of ``module.head.kind=liger``."""
    return {"liger": liger_linear_cross_entropy}[name]


# -- module.fp8.fused_mlp: the Triton passes of lmtrain.nn.float8_mlp's operator on a GPU -----------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the operator keeps its PyTorch passes
    triton = None

if triton is not None:

    @triton.jit
    def _values(h_ptr, dy_ptr, rows, cols, mask, N, ACT: tl.constexpr, GRAD: tl.constexpr):
        """At ``rows`` x ``cols`` of the activation (M, N): the activation, and (GRAD) its gradient with respect to
        ``h``, each in fp32 after rounding to bf16 where the plain MLP's bf16 tensors hold them; 0 outside ``mask``.
        ACT: 0 gelu, 1 gelu_tanh, 2 relu (lmtrain.nn.float8_mlp.ACTS), ``h`` (M, N); 3 SwiGLU, ``h`` (M, 2N) the
        gate then the value, whose gradient has two parts (gate, value). Returns (activation, gradient, the value's
        gradient under SwiGLU, else the gradient again)."""
        if ACT == 3:
            at = rows * 2 * N + cols
            x = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + at + N, mask=mask, other=0.0).to(tl.float32)
            e = 1.0 + tl.exp(-x)
            s = 1.0 / e
            silu = (x / e).to(tl.bfloat16).to(tl.float32)  # as PyTorch's kernel computes it
            v = tl.where(mask, (silu * u).to(tl.bfloat16).to(tl.float32), 0.0)
            g, g2 = v, v
            if GRAD:  # as autograd: d value = dy * silu(gate); d gate = silu_backward(dy * value, gate)
                dy = tl.load(dy_ptr + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
                g2 = tl.where(mask, (dy * silu).to(tl.bfloat16).to(tl.float32), 0.0)
                t = (dy * u).to(tl.bfloat16).to(tl.float32)
                g = tl.where(mask, (t * s * (1.0 + x * (1.0 - s))).to(tl.bfloat16).to(tl.float32), 0.0)
        else:
            x = tl.load(h_ptr + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
            if ACT == 2:  # its gradient below is a mask, no derivative
                v = tl.maximum(x, 0.0)
            elif ACT == 1:
                x2 = x * x
                t = 2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x2 * x)) - 1.0
                v = 0.5 * x * (1.0 + t)
                d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x2)
            else:
                cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
                v = x * cdf
                d = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
            v = tl.where(mask, v.to(tl.bfloat16).to(tl.float32), 0.0)
            g = v
            if GRAD:
                dy = tl.load(dy_ptr + rows * N + cols, mask=mask, other=0.0).to(tl.float32)
                if ACT == 2:
                    g = tl.where(x > 0.0, dy, 0.0)
                else:
                    g = dy * d
                g = tl.where(mask, g.to(tl.bfloat16).to(tl.float32), 0.0)
            g2 = g
        return v, g, g2

    @triton.jit
    def _amax_pass(h_ptr, dy_ptr, amax_ptr, sum_ptr, M, N, ACT: tl.constexpr, GRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)[:, None]  # 64-bit offsets: tokens x ffn may pass 2**31
        cols = (pn * BN + tl.arange(0, BN)).to(tl.int64)[None, :]
        mask = (rows < M) & (cols < N)
        v, g, g2 = _values(h_ptr, dy_ptr, rows, cols, mask, N, ACT, GRAD)
        if GRAD:
            v = g
        top = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
        if GRAD and ACT == 3:
            top = tl.maximum(top, tl.max(tl.max(tl.abs(g2), axis=1), axis=0))
        tl.store(amax_ptr + pm * tl.num_programs(1) + pn, top)
        if GRAD and ACT != 3:  # this block of rows' share of the sum over tokens (the bias gradient); summed after
            c = pn * BN + tl.arange(0, BN)
            tl.store(sum_ptr + pm * N + c, tl.sum(g, axis=0), mask=c < N)

    @triton.jit
    def _cast_pass(
        h_ptr,
        dy_ptr,
        scale_ptr,
        act_scale_ptr,
        out_ptr,
        out_t_ptr,
        act_t_ptr,
        M,
        N,
        ACT: tl.constexpr,
        GRAD: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        """Forward: the activation in e4m3 (M, N). Backward (GRAD): its gradient in e5m2, as ``h`` is laid out and
        transposed, and the activation again in e4m3 at the forward's scale, transposed (N, M)."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)[:, None]
        cols = (pn * BN + tl.arange(0, BN)).to(tl.int64)[None, :]
        mask = (rows < M) & (cols < N)
        a, g, g2 = _values(h_ptr, dy_ptr, rows, cols, mask, N, ACT, GRAD)
        if GRAD:
            width = 2 * N if ACT == 3 else N  # h's, and so the gradient's
            scale = tl.load(scale_ptr)
            g = tl.clamp(g * scale, -57344.0, 57344.0).to(tl.float8e5)
            tl.store(out_ptr + rows * width + cols, g, mask=mask)
            tl.store(out_t_ptr + cols * M + rows, g, mask=mask)  # transposed: the compiler stages it for coalesced stores
            if ACT == 3:  # the value's part, right of the gate's (below it transposed)
                g2 = tl.clamp(g2 * scale, -57344.0, 57344.0).to(tl.float8e5)
                tl.store(out_ptr + rows * width + N + cols, g2, mask=mask)
                tl.store(out_t_ptr + (N + cols) * M + rows, g2, mask=mask)
            a = tl.clamp(a * tl.load(act_scale_ptr), -448.0, 448.0).to(tl.float8e4nv)
            tl.store(act_t_ptr + cols * M + rows, a, mask=mask)
        else:
            a = tl.clamp(a * tl.load(scale_ptr), -448.0, 448.0).to(tl.float8e4nv)
            tl.store(out_ptr + rows * N + cols, a, mask=mask)


# blocks: the fastest measured on an H200 (docs/BENCHMARKS.md, the fused float8 MLP)
_AMAX_BLOCK, _CAST_BLOCK, _WARPS = (64, 128), (64, 128), 8


def act_float8_triton(
    h: torch.Tensor, dy: torch.Tensor | None, act: str, act_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """lmtrain.nn.float8_mlp's passes for a bf16 ``h`` on a GPU, in two Triton passes: the value's amax (and the
    gradient's partial sums over the rows), then the casts. ``dy`` None: act_float8_reference's results; else
    act_grad_float8_reference's (``act_scale`` the forward's scale)."""
    from lmtrain.nn.float8_mlp import ACTS, _width
    from lmtrain.nn.loss import _AMAX_FLOOR, E4M3, E5M2

    code = ACTS.index(act)
    glu = act == "silu"
    M, H = h.shape
    N = _width(h, act)  # the activation's
    grad = dy is not None
    grid = (triton.cdiv(M, _AMAX_BLOCK[0]), triton.cdiv(N, _AMAX_BLOCK[1]))
    amax = torch.empty(grid[0] * grid[1], device=h.device, dtype=torch.float32)
    sums = torch.empty((grid[0], N) if grad and not glu else (1,), device=h.device, dtype=torch.float32)  # a pointer either way
    dy_arg = dy if grad else h  # not read without GRAD
    _amax_pass[grid](h, dy_arg, amax, sums, M, N, ACT=code, GRAD=grad, BM=_AMAX_BLOCK[0], BN=_AMAX_BLOCK[1], num_warps=_WARPS)
    dtype = E5M2 if grad else E4M3
    scale = torch.finfo(dtype).max / amax.max().clamp(min=_AMAX_FLOOR)  # as lmtrain.nn.loss._float8_scale
    out = torch.empty(M, H if grad else N, device=h.device, dtype=dtype)
    out_t = torch.empty(H, M, device=h.device, dtype=dtype) if grad else out  # not written without GRAD
    act_t = torch.empty(N, M, device=h.device, dtype=E4M3) if grad else out
    act_scale = act_scale.reshape(1) if grad else scale.reshape(1)
    grid = (triton.cdiv(M, _CAST_BLOCK[0]), triton.cdiv(N, _CAST_BLOCK[1]))
    _cast_pass[grid](
        h,
        dy_arg,
        scale.reshape(1),
        act_scale,
        out,
        out_t,
        act_t,
        M,
        N,
        ACT=code,
        GRAD=grad,
        BM=_CAST_BLOCK[0],
        BN=_CAST_BLOCK[1],
        num_warps=_WARPS,
    )
    if not grad:
        return out, scale
    total = sums[:0] if glu else sums.sum(0)
    return out, out_t, scale.reciprocal(), total, act_t


def compile_float8_mlp_passes(capability: int = 90) -> list[str]:
    """Compile every variant of the passes (each activation, forward and backward) for a GPU of this compute
    capability, through Triton's ahead-of-time path down to the GPU's binary, with the argument types
    :func:`act_float8_triton` launches them with: no GPU needed, so CI checks on a CPU machine that the kernels
    compile (tests/test_fp8.py). Returns the variants compiled; raises Triton's CompilationError naming the line."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lmtrain.nn.float8_mlp import ACTS

    target, done = GPUTarget("cuda", capability, 32), []
    for code, act in enumerate(ACTS):
        for grad in (False, True):
            f8 = "*fp8e5" if grad else "*fp8e4nv"
            consts = {"ACT": code, "GRAD": grad, "BM": _AMAX_BLOCK[0], "BN": _AMAX_BLOCK[1]}
            ints = {"M": "i32", "N": "i32"} | {k: "constexpr" for k in consts}
            amax = {"h_ptr": "*bf16", "dy_ptr": "*bf16", "amax_ptr": "*fp32", "sum_ptr": "*fp32"} | ints
            cast = {"h_ptr": "*bf16", "dy_ptr": "*bf16", "scale_ptr": "*fp32", "act_scale_ptr": "*fp32"}
            cast |= {"out_ptr": f8, "out_t_ptr": f8, "act_t_ptr": "*fp8e4nv"} | ints
            for fn, signature, block in ((_amax_pass, amax, _AMAX_BLOCK), (_cast_pass, cast, _CAST_BLOCK)):
                compiled = triton.compile(ASTSource(fn, signature, consts | {"BM": block[0], "BN": block[1]}), target=target)
                assert "cubin" in compiled.asm, sorted(compiled.asm)
                done.append(f"{fn.__name__}[{act}, {'backward' if grad else 'forward'}]")
    return done


_registered = False


def register_float8_mlp_passes() -> bool:
    """Make the Triton passes the CUDA implementations of ``lmtrain::act_float8`` and ``lmtrain::act_grad_float8``
    (once; bf16 inputs, else their PyTorch passes). False where Triton is missing: the PyTorch passes run everywhere."""
    global _registered
    if triton is None:
        return False
    if not _registered:
        from lmtrain.nn import float8_mlp as fm

        @fm.act_float8.register_kernel("cuda")
        def _(h, act):
            if h.dtype == torch.bfloat16:
                return act_float8_triton(h.contiguous(), None, act)
            return fm.act_float8_reference(h, act)

        @fm.act_grad_float8.register_kernel("cuda")
        def _(h, dy, act, act_scale):
            if h.dtype == torch.bfloat16 and dy.dtype == torch.bfloat16:
                return act_float8_triton(h.contiguous(), dy.contiguous(), act, act_scale)
            return fm.act_grad_float8_reference(h, dy, act, act_scale)

        _registered = True
    return True
