"""The output head and its cross-entropy in chunks of tokens, never holding a whole batch's logits.

The plain head computes every logit of the batch (tokens x vocabulary: 3.3 GB in bf16 for 32 x 1024 tokens and a
50k vocabulary), keeps them for the backward and writes a gradient of the same size. Here the forward walks the
tokens ``chunk`` at a time: the chunk's logits, its loss terms (fp32), and at once the gradients with respect to
the chunk's hidden states and its share of the weight's gradient (softmax minus one-hot, over the number of
counted tokens); the backward only scales them by the incoming gradient. The same FLOPs (the backward's two
matmuls move into the forward); the logits take one chunk's memory instead of the batch's. Enabled with
``module.head.kind=chunked`` (``module.head.chunk_tokens=N``; lmtrain.training.fastpaths). Under ``module.compile=true`` the saving is small, as the
compiled plain loss already holds far less than a whole fp32 copy of the logits (docs/BENCHMARKS.md).

With ``float8=True`` (``module.head.kind=float8``)
the chunk's three products run in float8 (``torch._scaled_mm``), as torchao's tensorwise recipe computes a float8
head's: the hidden states and the weight cast to e4m3 with one scale each from their largest magnitude, the logits'
gradient to e5m2. That gradient's largest magnitude needs no pass of its own: softmax minus one-hot lies in [-1, 1],
so its scale is fixed at e5m2's largest value, and the 1/count of the mean goes into the product's scale. The
chunk's gradient is written in e5m2 at once, in both layouts the two backward products read, so the only
vocabulary-sized tensors are one chunk's logits (bf16) and their float8 gradient (two bytes per logit of the chunk);
a whole-batch float8 head (torchao's ``Float8Linear``) would keep the batch's bf16 logits, their bf16 gradient and two float8 copies of it.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # as F.cross_entropy: targets with this value are not counted


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy of (..., V) logits against (...) targets, logits upcast to fp32 (the upcast is
    fused away when compiled). With ``z_loss`` > 0, the parts of :func:`with_z_loss` instead."""
    x, t = logits.flatten(0, -2).float(), targets.flatten()
    ce = F.cross_entropy(x, t)
    if not z_loss:
        return ce
    return with_z_loss(ce, mean_z(torch.logsumexp(x, dim=-1), t), z_loss)


def mean_z(lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The z term of :func:`with_z_loss`: the squared log-partition ``lse`` (one per token) averaged over the tokens
    whose ``targets`` are counted."""
    return summed_z(lse, targets) / (targets != IGNORE_INDEX).sum().clamp(min=1)


def summed_z(lse: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The squared log-partition summed over the tokens whose ``targets`` are counted (a chunk's share of :func:`mean_z`)."""
    return torch.where(targets != IGNORE_INDEX, lse.square(), 0.0).sum()


def with_z_loss(ce: torch.Tensor, z: torch.Tensor, coef: float) -> torch.Tensor:
    """The loss of a head with a z-loss (``module.z_loss``, PaLM's and OLMo 2's): ``(objective, cross-entropy, z)``
    stacked, where ``z`` is the mean over counted tokens of the squared log-partition ``logsumexp(logits)**2`` and the
    objective, the one entry gradients flow from, is ``ce + coef * z``. The penalty keeps the output logits from
    drifting (a softmax ignores a shift of them all; bf16 does not), one cause of late-training loss spikes."""
    return torch.stack([ce + coef * z, ce.detach(), z.detach()])


def z_loss_problem(value) -> str | None:
    """Why ``module.z_loss`` cannot be used, or None: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"module.z_loss={value!r} must be a finite number >= 0 (0: no z-loss; OLMo 2 uses 1e-5, PaLM 1e-4)"
    return None


def loss_parts(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what to minimise, (cross-entropy, z) detached or None) of a head's loss: a scalar, or :func:`with_z_loss`'s."""
    if loss.dim() == 0:
        return loss, None
    return loss[0], loss[1:]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _chunk_loss(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's fp32 logits ``x``: the sum of its loss terms, its log-sum-exp, which targets count, and the
    targets with ignored ones replaced by 0 (safe to index with)."""
    valid = targets != IGNORE_INDEX
    t = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    return torch.where(valid, lse - x.gather(1, t[:, None]).squeeze(1), 0.0).sum(), lse, valid, t


def _loss_and_logit_grad(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: the sum of its loss terms, the sum of its squared log-partitions (the z-loss's terms), the gradient
    of each token's ``ce + z_loss * lse**2`` with respect to the logits (softmax times ``1 + 2 z_loss lse`` minus
    one-hot; zero for ignored targets), all fp32, the gradient not yet divided by the count, and the log-partitions."""
    x = logits.float()
    loss, lse, valid, t = _chunk_loss(x, targets)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == t[:, None]
    soft = torch.exp(x - lse[:, None])
    if z_loss:
        soft = soft * (1.0 + 2.0 * z_loss * lse)[:, None]
    z = torch.where(valid, lse.square(), 0.0).sum()
    return loss, z, torch.where(valid[:, None], soft - onehot.float(), 0.0), lse


def _chunk_loss_and_grad(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: the sums of its loss and z terms (fp32) and their gradient with respect to the logits times
    ``scale``, in the logits' dtype. On a GPU this runs compiled (see ``_on``): one pass over the logits for the
    log-sum-exp, one that writes the gradient, no fp32 copy."""
    loss, z, grad, _ = _loss_and_logit_grad(logits, targets, z_loss)
    return loss, z, (grad * scale).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _on(device: torch.device, fn):
    """``fn`` for this device: compiled on CUDA (fused: a chunk's logits read once for the log-sum-exp and once to
    write the gradient; a float8 cast in one pass after its amax), eager elsewhere (CPU runs are tests and small
    models), and as it is inside code being compiled (lmtrain.nn.float8_mlp in a compiled model: traced with it)."""
    return _compiled(fn) if device.type == "cuda" and not torch.compiler.is_compiling() else fn


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_AMAX_FLOOR = 1e-12  # as torchao: an all-zero tensor still gets a finite scale
_ALIGN = 16  # float8 matmuls: every size a multiple of this


def _float8_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor (fp32) that maps ``x``'s largest magnitude to ``dtype``'s largest value: torchao's tensorwise one."""
    return torch.finfo(dtype).max / x.abs().amax().float().clamp(min=_AMAX_FLOOR)


def _cast_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def _to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` scaled by one factor so that its largest magnitude is ``dtype``'s largest value, cast: the float8 tensor
    and the inverse factor (fp32, the scale ``torch._scaled_mm`` takes)."""
    scale = _float8_scale(x, dtype)
    return _cast_float8(x, scale, dtype), scale.reciprocal()


def _float8_both_layouts(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (R, C) in ``dtype``, the same values transposed and contiguous (C, R), and the inverse scale: a tensor read
    by one product as it is and by another in the other layout (the hidden states and the weight here)."""
    x8, inv = _to_float8(x, dtype)
    return x8, x8.t().contiguous(), inv


def _chunk_loss_and_grad_float8(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk in float8: the sums of its loss and z terms (fp32), their gradient with respect to the logits (not
    yet divided by the count) cast to e5m2 as (chunk, vocab) and transposed (vocab, chunk), both contiguous, and the
    bound on that gradient's magnitude it was scaled by (to e5m2's largest value): 1 for softmax minus one-hot, and
    ``1 + 2 z_loss max|lse|`` with a z-loss, whose softmax term is scaled by ``1 + 2 z_loss lse``."""
    loss, z, grad, lse = _loss_and_logit_grad(logits, targets, z_loss)
    bound = 1.0 + 2.0 * z_loss * lse.abs().amax() if z_loss else torch.ones((), device=logits.device)
    grad = (grad * (torch.finfo(E5M2).max / bound)).to(E5M2)
    return loss, z, grad, grad.t().contiguous(), bound


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, fast_accum):
    """``a @ b`` of float8 tensors (``a`` row-major, ``b`` column-major) times both inverse scales."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _forward(hidden, weight, targets, chunk, need_grad, dtype, z_loss):
    """The chunk loop of :class:`_ChunkedLinearCrossEntropy` in ``dtype``: the loss sum, the z-term sum, the count,
    and the gradients (the hidden states' in their dtype, the weight's in fp32) of the mean objective (cross-entropy
    plus ``z_loss`` times the z-terms), or None without ``need_grad``."""
    fn = _on(hidden.device, _chunk_loss_and_grad)
    w = weight.to(dtype)
    count = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    scale = 1.0 / count
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk].to(dtype)
        t = targets[start : start + chunk]
        logits = h @ w.t()  # (chunk, vocab): the only vocabulary-sized tensors live here
        if not need_grad:  # validation: the loss alone
            loss, z = _chunk_loss_sums(logits, t)
            total += loss
            z_total += z
            continue
        loss, z, grad_logits = fn(logits, t, scale, z_loss)
        total += loss
        z_total += z
        grad_hidden[start : start + chunk] = grad_logits @ w
        grad_weight += grad_logits.t() @ h
    return total, z_total, count, grad_hidden, grad_weight


def _chunk_loss_sums(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's sums of loss terms and of squared log-partitions, without gradients (validation)."""
    loss, lse, valid, _ = _chunk_loss(logits.float(), targets)
    return loss, torch.where(valid, lse.square(), 0.0).sum()


def _float8_forward(hidden, weight, targets, chunk, need_grad, fast_accum, dtype, z_loss):
    """:func:`_forward` with the three products in float8 (the hidden states' gradient in ``dtype``). The forward product
    accumulates in Hopper's fast mode as torchao's recipes do; the two backward ones with ``fast_accum`` only.

    The float8 products need every size a multiple of 16, the chunk's too (the weight's gradient sums over it): the
    chunk is rounded up to one, and a token count that is not is padded with ignored targets (not counted, zero
    gradient)."""
    n = hidden.shape[0]
    if n % _ALIGN:
        hidden = F.pad(hidden, (0, 0, 0, -n % _ALIGN))
        targets = F.pad(targets, (0, -n % _ALIGN), value=IGNORE_INDEX)
    chunk = -(-chunk // _ALIGN) * _ALIGN
    count = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
    cast = _on(hidden.device, _float8_both_layouts)
    w8, w8t, w_inv = cast(weight.to(dtype))
    w8_columns = w8t.t()  # (V, E) column-major, for the hidden states' gradient
    h8, h8t, h_inv = cast(hidden.to(dtype))
    g_inv = (1.0 / torch.finfo(E5M2).max) / count  # the gradient's scale for a bound of 1, and the mean
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    z_total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
    step = _on(hidden.device, _chunk_loss_and_grad_float8)
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        t = targets[start:end]
        logits = _scaled_mm(h8[start:end], w8.t(), h_inv, w_inv, dtype, True)
        if not need_grad:  # validation: the loss alone
            loss, z = _chunk_loss_sums(logits, t)
            total += loss
            z_total += z
            continue
        loss, z, g8, g8t, bound = step(logits, t, z_loss)
        total += loss
        z_total += z
        g_chunk = g_inv * bound  # the chunk's gradient was scaled to its own bound
        grad_hidden[start:end] = _scaled_mm(g8, w8_columns, g_chunk, w_inv, dtype, fast_accum)
        h8_columns = h8t[:, start:end].contiguous().t()  # (chunk, E) column-major
        grad_weight += _scaled_mm(g8t, h8_columns, g_chunk, h_inv, torch.float32, fast_accum)
    return total, z_total, count, None if grad_hidden is None else grad_hidden[:n], grad_weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        need_grad: bool,
        float8: bool,
        fast_accum: bool,
        z_loss: float,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        ctx.weight_dtype = weight.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            if float8:
                total, z, count, grad_hidden, grad_weight = _float8_forward(
                    hidden, weight, targets, chunk, need_grad, fast_accum, dtype, z_loss
                )
            else:
                total, z, count, grad_hidden, grad_weight = _forward(hidden, weight, targets, chunk, need_grad, dtype, z_loss)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        if not z_loss:
            return total / count
        ce, z = total / count, z / count
        return torch.stack([ce + z_loss * z, ce, z])  # with_z_loss's parts: gradients flow from the first only

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_out.dim():  # with a z-loss: the objective's gradient (the other two entries are reported values)
            grad_out = grad_out[0]
        return (
            grad_hidden * grad_out.to(grad_hidden.dtype),
            (grad_weight * grad_out).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


@torch.compiler.disable
def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    float8: bool = False,
    fast_accum: bool = False,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (targets of -100 not counted), ``chunk``
    tokens at a time. ``hidden`` (N, E), ``weight`` (V, E), ``targets`` (N,). ``float8``: the products in float8
    (see the module docstring; a GPU of compute capability 8.9 or later, or the CPU), the backward ones accumulated in
    fast mode with ``fast_accum``. ``z_loss`` > 0: the parts of :func:`with_z_loss` instead of the mean.

    Never traced into a compiled model (the model's graph ends before it): traced, Inductor turns the running sum of
    the weight's gradient into one addition after the loop, which holds every chunk's (V, E) product until then
    (seen in its generated code); run as this loop, with the per-chunk step compiled on its own on a GPU, each
    product is added and freed in turn."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)  # validation: loss only
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, int(chunk), need_grad, bool(float8), bool(fast_accum), float(z_loss))
