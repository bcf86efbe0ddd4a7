"""Third-party kernels the model can be given (the pure PyTorch layer, lmtrain.nn, imports none of them)."""

from __future__ import annotations

import torch

from lmtrain.nn.loss import _compute_dtype

LOSS_KERNELS = ("liger",)


@torch.compiler.disable
def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` through liger-kernel's fused linear cross-entropy (Triton, GPU
    only; ``module.loss_kernel=liger``): like lmtrain.nn.loss's chunked loss, chunks of tokens whose logits and their
    gradient live only inside the kernel, the weight's gradient accumulated in fp32. Inputs are cast to the autocast
    dtype first (under bf16-mixed the final norm's output is fp32; the head's matmul runs in bf16 as the plain head's
    does). Kept out of compiled graphs: its own kernels are already fused."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = _compute_dtype(hidden)
    with torch.autocast(hidden.device.type, enabled=False):
        return liger_fused_linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, accum_dtype=torch.float32)


def loss_kernel(name: str):
    """The ``(hidden (N, E), weight (V, E), targets (N,)) -> mean loss`` function named by ``module.loss_kernel``."""
    return {"liger": liger_linear_cross_entropy}[name]
