"""What each card should do: the datasheet figures MFU (lmtrain.callbacks.throughput) and ``lmtrain doctor``
(lmtrain.training.health) compare against."""

from __future__ import annotations

import torch

# Dense bf16/fp16 tensor-core peaks (no sparsity) of the cards where Lightning's table
# (lightning.fabric.utilities.throughput.get_available_flops, used for every other card) is silent or not dense: it
# knows no card named plainly "NVIDIA H200" (the name torch reports on the H200s measured in docs/BENCHMARKS.md), and
# lists the H200 SXM1 at 2.0e15, its 2:4-sparse figure (twice the dense rate that MFU is quoted against).
DENSE_16BIT_PEAKS = {"H200": 989.4e12}
# Memory bandwidth of each card's datasheet, bytes/s (lmtrain doctor's expected figure), the most specific name first.
MEMORY_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12),
)  # fmt: skip


def card_memory_bandwidth(name: str) -> float | None:
    """The datasheet memory bandwidth (bytes/s) of the card torch names ``name``; None when it is not listed."""
    return next((v for k, v in MEMORY_BANDWIDTH if k in name), None)


def detect_peak_flops(precision: str) -> float | None:
    """The card's dense peak for the training precision, or None when unknown (CPU, fp32, a card nobody lists)."""
    if not torch.cuda.is_available() or not any(p in str(precision) for p in ("16", "bf16")):
        return None
    name = torch.cuda.get_device_name()
    ours = next((v for k, v in DENSE_16BIT_PEAKS.items() if k in name), None)
    if ours is not None:
        return ours
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.float16 if str(precision).startswith("16") else torch.bfloat16
    flops = get_available_flops(torch.device("cuda", torch.cuda.current_device()), dtype)
    return float(flops) if flops else None
