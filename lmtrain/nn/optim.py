"""Optimizer parameter groups and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

DECAYS = ("cosine", "linear", "constant")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weight decay on matrices only; none on norms, biases and embeddings (tied ones too)."""
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(factory: Callable[..., torch.optim.Optimizer], model: nn.Module) -> torch.optim.Optimizer:
    """Finish a partial optimizer config (``_partial_: true``) on ``model``'s parameter groups.

    ``weight_decay`` from the config goes to the matrix group only. ``fused: null`` means fused when every
    parameter is on a CUDA device (the fast path for AdamW), the default implementation otherwise.
    """
    kwargs = dict(getattr(factory, "keywords", {}) or {})
    weight_decay = kwargs.pop("weight_decay", 0.0)
    if "fused" in kwargs and kwargs["fused"] is None:
        kwargs["fused"] = all(p.device.type == "cuda" for p in model.parameters()) or None
    func = getattr(factory, "func", factory)
    return func(param_groups(model, weight_decay), *getattr(factory, "args", ()), **kwargs)


class WarmupDecay:
    """LR multiplier: linear warmup to 1 over ``warmup_steps`` (step s gets (s+1)/warmup), then ``decay`` to ``min_lr_ratio``.

    A picklable callable (so ``LambdaLR`` checkpoints it) and a pure function of the step.
    After ``total_steps`` the multiplier stays at ``min_lr_ratio``.
    """

    def __init__(self, warmup_steps: int, total_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.1) -> None:
        self.warmup_steps, self.total_steps, self.decay, self.min_lr_ratio = warmup_steps, total_steps, decay, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


class ConfiguredLR(LambdaLR):
    """``LambdaLR`` whose schedule is the one it was built with, also after ``load_state_dict``.

    ``LambdaLR.load_state_dict`` restores a callable schedule's fields and the peak learning rates from the
    checkpoint, so a run resumed with a new ``trainer.max_steps`` or ``optimizer.lr`` silently kept the old schedule.
    Here a resume restores the position (steps taken) only; the schedule and the peak rates stay this run's (the
    composed config is the truth), the current rate is recomputed from them, and what differed from the
    checkpoint's is kept in :attr:`changes` (``{name: (saved, now)}``) for the run's logbook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float]) -> None:
        super().__init__(optimizer, schedule)
        self.changes: dict[str, tuple] = {}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("changes", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {k: v for k, v in state_dict.items() if k not in ("lr_lambdas", "changes")}
        schedule, peaks = dict(vars(self.lr_lambdas[0])), list(self.base_lrs)
        old_schedule = (state_dict.get("lr_lambdas") or [None])[0] or {}
        self.__dict__.update(saved)  # position: last_epoch, _step_count, ...
        self.base_lrs = peaks
        self.changes = {k: (old_schedule[k], v) for k, v in schedule.items() if k in old_schedule and old_schedule[k] != v}
        old_peaks = saved.get("base_lrs", peaks)
        if list(old_peaks) != peaks:
            self.changes["peak lr"] = (old_peaks[0], peaks[0])
        self._last_lr = [base * self.lr_lambdas[0](self.last_epoch) for base in self.base_lrs]
        for group, lr, base in zip(self.optimizer.param_groups, self._last_lr, self.base_lrs):
            group["lr"], group["initial_lr"] = lr, base  # the optimizer's restored groups carried the saved ones


def warmup_decay(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.1
) -> LambdaLR:
    """The scheduler of ``conf/scheduler/*.yaml`` (stepped once per optimizer step); a resume keeps this schedule."""
    return ConfiguredLR(optimizer, WarmupDecay(warmup_steps, total_steps, decay, min_lr_ratio))


# GPT-3's peak learning rates by total parameters (Brown et al. 2020, table 2.1), where most recipes start from; the
# OPT models used the same. A 7B model at the default 1e-3 (8x its row) diverged within two steps (docs/BENCHMARKS.md).
GPT3_PEAK_LR = ((125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4), (2.7e9, 1.6e-4), (6.7e9, 1.2e-4), (13e9, 1e-4), (175e9, 6e-5))
TOO_HIGH = 3.0


def published_lr(params: int) -> float | None:
    """GPT-3's peak learning rate for a model of ``params`` parameters, interpolated on log scales between its rows
    (the last row beyond 175B); None below 125M, smaller than any row."""
    rows = GPT3_PEAK_LR
    if params < rows[0][0]:
        return None
    for (n0, lr0), (n1, lr1) in zip(rows, rows[1:], strict=False):
        if params <= n1:
            t = math.log(params / n0) / math.log(n1 / n0)
            return math.exp(math.log(lr0) + t * math.log(lr1 / lr0))
    return rows[-1][1]


def lr_warning(lr: float, params: int) -> str | None:
    """What to tell a user whose peak learning rate is more than ``TOO_HIGH`` times GPT-3's for the model's size (the
    fat-fingered or forgotten one: a model preset chosen without its experiment's rate), or None."""
    if lr == 0:
        return "optimizer.lr=0: the weights do not change (the run measures its starting weights)"
    ref = published_lr(params)
    if ref is None or lr <= TOO_HIGH * ref:
        return None
    return (
        f"optimizer.lr={lr:g} is {lr / ref:.1f}x the peak rate GPT-3 used at this size ({ref:.2g} for {params / 1e9:.2f}B "
        "parameters); rates this far above it tend to diverge early (llama-7b at 1e-3 did within two steps, "
        "docs/BENCHMARKS.md). The experiment presets carry published rates (experiment=llama-7b: 3e-4)"
    )
