"""Tokens per second and model FLOPs utilisation, logged every optimizer step."""

from __future__ import annotations

import time
from collections import deque

import lightning as L
import torch

from lmtrain.errors import InputError
from lmtrain.training.cards import detect_peak_flops
from lmtrain.training.contracts import ReportsThroughput
from lmtrain.training.layout import Layout
from lmtrain.training.logs import log_direct


def alloc_retry_warning(retries: int, step: int) -> str | None:
    """What to say when PyTorch's CUDA caching allocator has had to free its cache and retry an allocation
    (``num_alloc_retries`` of ``torch.cuda.memory_stats``): memory is at the card's limit, and every retry
    synchronizes the device and stalls the step. None when there were none."""
    if retries <= 0:
        return None
    return (
        f"step {step}: the CUDA allocator freed its cache and retried {retries} allocation(s) so far: memory is at the "
        "card's limit and each retry stalls the step (perf/alloc_retries); a smaller data.batch_size or more activation "
        "checkpointing may train faster"
    )


class Throughput(L.Callback, ReportsThroughput):
    """Logs ``perf/tokens_per_sec`` (all ranks together) and ``perf/mfu`` each optimizer step.

    One step's rate jumps with host noise (measured on 2 CPU cores: 464 to 1,517 tokens/s between neighbouring
    steps); the progress bar shows ``smoothed_tokens_per_sec``, the tokens of the last ``smoothing_steps`` steps
    over their time, also logged as ``perf/tokens_per_sec_smoothed``.

    MFU = achieved FLOP/s per device / peak FLOP/s, with ``6N + 12 * L * d * T`` FLOPs per token
    (``lmtrain.nn.model.flops_per_token``). It is logged when the peak is known: detected for common GPUs
    under 16-bit precision, or given as ``peak_tflops`` (e.g. for a CPU or an unlisted card).

    Args:
        peak_tflops: peak TFLOP/s of one device; None to detect it.
        log_mfu: log ``perf/mfu`` when the peak is known.
        smoothing_steps: steps in the smoothed rate's window.
    """

    def __init__(self, peak_tflops: float | None = None, log_mfu: bool = True, smoothing_steps: int = 20) -> None:
        if isinstance(smoothing_steps, bool) or not isinstance(smoothing_steps, int) or smoothing_steps < 1:
            raise InputError(f"callbacks.throughput.smoothing_steps={smoothing_steps!r}: give a whole number of steps >= 1")
        self.peak_tflops = peak_tflops
        self.log_mfu = log_mfu
        self._flops_per_token: float | None = None
        self._peak: float | None = None
        self._tokens = 0
        self._t_last: float | None = None
        self._last_step = -1
        self.last_tokens_per_sec: float | None = None
        self.smoothed_tokens_per_sec: float | None = None
        self._window: deque[tuple[float, float]] = deque(maxlen=smoothing_steps)  # (tokens, seconds) per step
        self._retries_warned = 0  # the allocator retries already warned about (alloc_retry_warning)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._peak = self.peak_tflops * 1e12 if self.peak_tflops else detect_peak_flops(trainer.precision)
        self._t_last = time.perf_counter()
        self._last_step = trainer.global_step
        self._tokens = 0
        self._window.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        inputs = batch[0]
        self._tokens += inputs.numel()
        if self._flops_per_token is None:
            from lmtrain.nn.model import Decoder, flops_per_token

            model = getattr(pl_module, "model", None)
            self._flops_per_token = flops_per_token(model, inputs.shape[1]) if isinstance(model, Decoder) else 0.0
        if trainer.global_step == self._last_step:  # still accumulating gradients
            return
        now = time.perf_counter()
        dt = max(now - self._t_last, 1e-9)
        per_device = self._tokens / dt
        dp = Layout.of(trainer).dp  # the ranks that read different tokens
        self.last_tokens_per_sec = per_device * dp
        self._window.append((self._tokens, dt))
        self.smoothed_tokens_per_sec = sum(t for t, _ in self._window) / sum(s for _, s in self._window) * dp
        metrics = {
            "perf/tokens_per_sec": self.last_tokens_per_sec,
            "perf/tokens_per_sec_smoothed": self.smoothed_tokens_per_sec,
            "perf/tokens_per_sec_per_device": per_device,
        }
        if self.log_mfu and self._peak and self._flops_per_token:
            metrics["perf/mfu"] = per_device * self._flops_per_token / self._peak
        if pl_module.device.type == "cuda":
            # one read of the allocator's statistics (max_memory_allocated would read them all again for its one entry)
            stats = torch.cuda.memory_stats(pl_module.device)
            metrics["perf/max_memory_gib"] = stats.get("allocated_bytes.all.peak", 0) / 2**30
            metrics["perf/max_reserved_gib"] = stats.get("reserved_bytes.all.peak", 0) / 2**30  # what the process holds
            retries = int(stats.get("num_alloc_retries", 0))
            metrics["perf/alloc_retries"] = retries
            if retries > self._retries_warned:
                self._retries_warned = retries * 10  # again only if they grow tenfold
                from lmtrain.console import log

                log.warning(f"rank {trainer.global_rank}: {alloc_retry_warning(retries, trainer.global_step)}")
        log_direct(trainer, metrics)  # cheaper than self.log for what the progress bar does not show
        self._t_last, self._tokens, self._last_step = now, 0, trainer.global_step

    def on_validation_end(self, trainer, pl_module) -> None:
        # validation time is not training time
        self._t_last = time.perf_counter()
