"""fp16 mixed precision with dynamic loss scaling, on GPUs and on CPU alike.

Lightning's own ``16-mixed`` plugin has two gaps for a pretraining run:

* With a fused optimizer (our AdamW on CUDA) it leaves the gradients *scaled* until inside ``optimizer.step``,
  so the gradient norm that is clipped, logged and judged at ``on_before_optimizer_step`` is the scaled one
  (``inf`` whenever the scaler is about to skip), and a step whose gradients were all dropped before
  ``scaler.step`` made ``scaler.update()`` fail ("No inf checks were recorded prior to update": the first overflow
  of an fp16 run on an H100 ended in that traceback). Here the gradients are always unscaled first
  (``GradScaler.unscale_``, the documented way to clip with a scaler); the fused step is then told they are.
* On CPU Lightning silently trains in bf16 instead, so no test ever ran the scaler. Here ``16-mixed`` means fp16
  autocast and a real ``torch.amp.GradScaler`` on every device: CI exercises the same code as an H100.

An overflow step (non-finite gradients) is the scaler's business: it skips the update and lowers the scale.
:func:`overflowed` and :func:`loss_scale` expose that to the module's per-step statistics as device tensors (no
host sync); the divergence detector then treats an overflow as a skipped step, not as divergence.

Under FSDP2 the gradients are DTensors: ``GradScaler.unscale_`` reduces their overflow flag over the mesh
(PyTorch's DTensor rule for ``_amp_foreach_non_finite_check_and_unscale_``), so every rank skips alike.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lmtrain.training import compat


class Fp16MixedPrecision(MixedPrecision):
    """``16-mixed`` with a given ``torch.amp.GradScaler``; gradients are unscaled before ``on_before_optimizer_step``."""

    def __init__(self, device: str, scaler: torch.amp.GradScaler) -> None:
        super().__init__("16-mixed", device, scaler)

    def optimizer_step(self, optimizer, model, closure, **kwargs: Any) -> Any:
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            self.scaler.unscale_(optimizer)  # fused optimizers too: clipping and statistics need true gradients
        self._after_closure(model, optimizer)  # on_before_optimizer_step: clip, measure, judge
        if skipped_backward:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)  # skipped by the scaler when the gradients overflowed
        self.scaler.update()
        return out


def scaler_of(trainer) -> torch.amp.GradScaler | None:
    """The run's gradient scaler (fp16), or None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The scale this step's backward used, as a device tensor (``get_scale()`` would sync the host)."""
    return compat.scaler_scale(scaler).reshape(())


def overflowed(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1.0 if this step's unscaled gradients hold an inf/NaN (the scaler will skip the update), else 0.0."""
    found = compat.scaler_found_inf(scaler, optimizer)
    if not found:
        raise RuntimeError("overflowed(): the gradients of this step have not been unscaled yet (GradScaler.unscale_)")
    flags = [f.to(compat.scaler_scale(scaler).device, non_blocking=True) for f in found.values()]
    return torch.stack(flags).amax().clamp(max=1.0).float()


def build(precision: str, accelerator: str, scaler_factory) -> tuple[Any, list]:
    """``(precision, plugins)`` for the Trainer: ``16-mixed`` becomes :class:`Fp16MixedPrecision` with the
    configured scaler (``grad_scaler``); every other precision is passed to Lightning as it is."""
    if str(precision) not in ("16-mixed", "16"):
        return precision, []
    scaler_factory = scaler_factory or torch.amp.GradScaler
    from lmtrain.training.config import device_type

    device = device_type(accelerator)
    return None, [Fp16MixedPrecision(device, scaler_factory(device=device))]
