"""The output head and its cross-entropy in chunks of tokens, never holding a whole batch's logits.

The plain head computes every logit of the batch (tokens x vocabulary: 3.3 GB in bf16 for 32 x 1024 tokens and a
50k vocabulary), keeps them for the backward and writes a gradient of the same size. Here the forward walks the
tokens ``chunk`` at a time: the chunk's logits, its loss terms (fp32), and at once the gradients with respect to
the chunk's hidden states and its share of the weight's gradient (softmax minus one-hot, over the number of
counted tokens); the backward only scales them by the incoming gradient. The same FLOPs (the backward's two
matmuls move into the forward); the logits take one chunk's memory instead of the batch's. Enabled with
``module.loss_chunk_tokens=N`` (lmtrain.training.module). Measured under ``module.compile=true`` on an H100 the saving is
small (1.3B, batch 28: 71.6 GiB against 72.4), as the compiled plain loss already holds far less than a whole
fp32 copy of the logits (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # as F.cross_entropy: targets with this value are not counted


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (..., V) logits against (...) targets, logits upcast to fp32 (the upcast is
    fused away when compiled)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


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


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: the sum of its loss terms (fp32) and their gradient with respect to the logits times ``scale``
    (softmax minus one-hot; zero for ignored targets), in the logits' dtype. On a GPU this runs compiled (see
    ``_chunk_fn``): one pass over the logits for the log-sum-exp, one that writes the gradient, no fp32 copy."""
    x = logits.float()
    loss, lse, valid, t = _chunk_loss(x, targets)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == t[:, None]
    grad = torch.where(valid[:, None], (torch.exp(x - lse[:, None]) - onehot.float()) * scale, 0.0)
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_loss_and_grad():
    return torch.compile(_chunk_loss_and_grad, dynamic=False, fullgraph=True)


def _chunk_fn(device: torch.device):
    """The per-chunk function for this device: compiled on CUDA (fused, the chunk's logits read twice and the
    gradient written once), eager elsewhere (CPU runs are tests and small models)."""
    return _compiled_chunk_loss_and_grad() if device.type == "cuda" else _chunk_loss_and_grad


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, need_grad: bool) -> torch.Tensor:
        dtype = _compute_dtype(hidden)
        fn = _chunk_fn(hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            count = (targets != IGNORE_INDEX).sum().clamp(min=1).float()
            scale = 1.0 / count
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_grad else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start : start + chunk].to(dtype)
                t = targets[start : start + chunk]
                logits = h @ w.t()  # (chunk, vocab): the only vocabulary-sized tensors live here
                if not need_grad:  # validation: the loss alone
                    total += _chunk_loss(logits.float(), t)[0]
                    continue
                loss, grad_logits = fn(logits, t, scale)
                total += loss
                grad_hidden[start : start + chunk] = grad_logits @ w
                grad_weight += grad_logits.t() @ h
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out.to(grad_hidden.dtype), (grad_weight * grad_out).to(ctx.weight_dtype), None, None, None


@torch.compiler.disable
def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (targets of -100 not counted), ``chunk``
    tokens at a time. ``hidden`` (N, E), ``weight`` (V, E), ``targets`` (N,).

    Never traced into a compiled model (the model's graph ends before it): traced, Inductor turns the running sum of
    the weight's gradient into one addition after the loop, which holds every chunk's (V, E) product until then
    (seen in its generated code); run as this loop, with the per-chunk step compiled on its own on a GPU, each
    product is added and freed in turn."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)  # validation: loss only
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, int(chunk), need_grad)
