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


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """``optimizer=muon``'s three groups: the hidden matrices (Muon: every 2-D weight but the embeddings and the output
    head), the output head when it is not the embedding (AdamW with weight decay), and the rest (AdamW without: norms,
    biases, embeddings). Each carries ``muon: True/False``; groups left empty are dropped."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is None:
        raise ValueError(f"optimizer=muon needs to know the model's output head (lm_head.weight), which {type(model).__name__} lacks")
    matrices, rest = (g["params"] for g in param_groups(model, weight_decay))  # a tied head is the embedding: in rest
    hidden, head_group = [p for p in matrices if p is not head], [p for p in matrices if p is head]
    groups = [
        {"params": hidden, "weight_decay": weight_decay, "muon": True},
        {"params": head_group, "weight_decay": weight_decay, "muon": False},
        {"params": rest, "weight_decay": 0.0, "muon": False},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(factory: Callable[..., torch.optim.Optimizer], model: nn.Module) -> torch.optim.Optimizer:
    """Finish a partial optimizer config (``_partial_: true``) on ``model``'s parameter groups.

    ``weight_decay`` from the config goes to the matrix group only. ``fused: null`` means fused when every
    parameter is on a CUDA device (the fast path for AdamW), the default implementation otherwise.
    :class:`MuonWithAdamW` gets :func:`muon_param_groups`.
    """
    kwargs = dict(getattr(factory, "keywords", {}) or {})
    weight_decay = kwargs.pop("weight_decay", 0.0)
    if "fused" in kwargs and kwargs["fused"] is None:
        kwargs["fused"] = all(p.device.type == "cuda" for p in model.parameters()) or None
    func = getattr(factory, "func", factory)
    groups = muon_param_groups(model, weight_decay) if func is MuonWithAdamW else param_groups(model, weight_decay)
    return func(groups, *getattr(factory, "args", ()), **kwargs)


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """PyTorch's Muon orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``: the update in bf16 scaled to
    a Frobenius norm of 1, then ``steps`` quintic Newton-Schulz iterations on its wide orientation) of a stack of
    matrices of one shape, ``(N, A, B)``, at once: one batched product where PyTorch's Muon launches one per matrix."""
    a, b, c = coefficients
    x = updates.bfloat16()
    tall = updates.shape[-2] > updates.shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (its arguments, state, momentum, weight decay and learning-rate adjustment) whose
    orthogonalisation runs on all the matrices of one shape at once (:func:`newton_schulz`) and its momentum and update
    as foreach operations: PyTorch's runs matrix by matrix, a few dozen small kernels each, launch-bound on a GPU
    (docs/benchmarks/2026-12-03.md).

    Matrices sharded by FSDP2 (``DTensor``) are orthogonalised whole: each sharded update (momentum applied on the
    shards) is gathered on every rank, orthogonalised there with the others of its shape, and each rank keeps its own
    rows of the result. Every rank computes every matrix's orthogonalisation (one GPU's work, repeated) in exchange for
    one all-gather per matrix per step and results equal to one process's bit for bit, whatever the number of ranks;
    the momentum buffers stay sharded like the parameters, so checkpoints reshard as AdamW's do. (Letting DTensor run
    the iteration on the shards does not work: its products on sharded operands came out 1% of a step off one
    process's after three steps.)"""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            if not params:
                continue
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            # torch.optim._muon._single_tensor_muon's arithmetic, one foreach operation over the group or a shape
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else list(bufs)
            updates = [u.full_tensor() if isinstance(u, DTensor) else u for u in updates]
            by_shape: dict[tuple, list[int]] = {}
            for i, update in enumerate(updates):
                by_shape.setdefault((tuple(update.shape), update.dtype, update.device), []).append(i)
            for members in by_shape.values():
                ortho = newton_schulz(torch.stack([updates[i] for i in members]), group["ns_coefficients"], group["ns_steps"], group["eps"])
                mine = [params[i] for i in members]
                ortho = [
                    distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else o
                    for p, o in zip(mine, ortho, strict=True)
                ]  # a sharded matrix: this rank's rows of the whole result, no traffic
                torch._foreach_mul_(mine, 1 - lr * decay)
                torch._foreach_add_(mine, ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], mine[0].shape))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """``optimizer=muon``: :class:`Muon` on the hidden matrices and ``torch.optim.AdamW`` on the embeddings, the output
    head, norms and biases (:func:`muon_param_groups`), as one optimizer: one list of parameter groups, which the
    learning-rate schedule, the corrections and a rollback set for both, and one state (saved, resumed and resharded
    like AdamW's alone). Both take the same learning rate and weight decay: Muon's step is scaled per matrix to match
    AdamW's update size (``adjust_lr_fn: match_rms_adamw``, 0.2 x sqrt(max(rows, columns)): Moonshot's rule, Liu et
    al. 2025), so the rate tuned for AdamW serves."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: bool | None = None,
    ) -> None:
        self._muon_options = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                              "adjust_lr_fn": adjust_lr_fn}  # fmt: skip
        self._adamw_options = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps, "fused": fused}
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "muon": False})
        self._link()

    def _link(self) -> None:
        """The two optimizers over this one's groups (the same dicts) and state (the same mapping)."""
        muon_groups = [g for g in self.param_groups if g["muon"]]
        adamw_groups = [g for g in self.param_groups if not g["muon"]]
        self.muon = Muon(muon_groups, **self._muon_options) if muon_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **self._adamw_options) if adamw_groups else None
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts (their saved settings) and a new state mapping: link again
        self._link()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        return loss


MUON_ADJUSTMENTS = ("match_rms_adamw", "original")


def muon_problems(opt) -> list[str]:
    """``optimizer=muon``'s keys (a mapping), each bad one a line naming it (before any model is built)."""
    out = []
    m = opt.get("momentum")
    if not (isinstance(m, int | float) and not isinstance(m, bool) and 0.0 <= m < 1.0):
        out.append(f"optimizer.momentum={m!r} must be in [0, 1)")
    n = opt.get("ns_steps")
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n < 100):
        out.append(f"optimizer.ns_steps={n!r} must be a whole number of Newton-Schulz steps in 1..99 (5: Keller Jordan's)")
    if opt.get("adjust_lr_fn") not in MUON_ADJUSTMENTS:
        out.append(
            f"optimizer.adjust_lr_fn={opt.get('adjust_lr_fn')!r} is not one of {list(MUON_ADJUSTMENTS)} (match_rms_adamw: "
            "AdamW's learning rate serves both groups)"
        )
    betas = opt.get("betas")
    if not (isinstance(betas, list | tuple) and len(betas) == 2 and all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)):
        out.append(f"optimizer.betas={betas!r} must be two numbers in [0, 1) (AdamW's, for the embeddings, head, norms and biases)")
    wd = opt.get("weight_decay")
    if not (isinstance(wd, int | float) and not isinstance(wd, bool) and wd >= 0):
        out.append(f"optimizer.weight_decay={wd!r} must be a number >= 0")
    return out


def state_bytes_before_first_step(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state ``optimizer`` will hold once it has stepped (a disk-space estimate before its first step):
    AdamW's two fp32 moments per parameter; Muon's one momentum buffer per matrix (MuonWithAdamW: per group)."""
    name = type(optimizer).__name__
    if name not in ("AdamW", "Adam", "Muon", "MuonWithAdamW"):
        return 0
    return sum(p.numel() * (4 if name == "Muon" or g.get("muon") else 8) for g in optimizer.param_groups for p in g["params"])


SHAPES = ("linear", "cosine", "1-sqrt")  # scheduler=wsd's decay shapes
WSD_DEFAULT_DECAY_FRACTION = 0.2  # scheduler.decay_steps=null: the last fifth of the run (Haegele et al. 2024)


def default_decay_steps(total_steps: int) -> int:
    """``scheduler=wsd``'s decay length when ``decay_steps`` is null: a fifth of the run, at least one step."""
    return max(1, round(WSD_DEFAULT_DECAY_FRACTION * total_steps))


def decay_shape(shape: str, progress: float) -> float:
    """From 1 at ``progress`` 0 to 0 at 1: ``linear``, ``cosine`` (half a cosine) or ``1-sqrt`` (1 - sqrt(progress):
    most of the drop at the start, the shape Haegele et al. 2024 found best for a WSD cooldown). Both schedules'."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


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
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay_shape(self.decay, progress)


class WarmupStableDecay:
    """LR multiplier of ``scheduler=wsd``: linear warmup to 1 over ``warmup_steps`` (as :class:`WarmupDecay`'s), 1
    through the stable phase, then ``decay`` (a :data:`SHAPES` name) over ``decay_steps`` steps to ``min_lr_ratio``,
    which it keeps. The decay starts at ``decay_start`` (None: ``total_steps - decay_steps``, so that it ends with the
    run), or where an operator starts it (``lmtrain control RUN decay --steps N``): :attr:`cooldown` then holds that
    ``(start, steps)``, set from the run's corrections file at every step (callbacks/lr_control.py); it is not part
    of the schedule's saved state, the file is the truth.
    """

    def __init__(
        self,
        warmup_steps: int,
        total_steps: int,
        decay_steps: int | None = None,
        decay_start: int | None = None,
        decay: str = "1-sqrt",
        min_lr_ratio: float = 0.0,
    ) -> None:
        if decay_steps is None:
            decay_steps = default_decay_steps(total_steps)
        self.warmup_steps, self.total_steps, self.decay_steps = warmup_steps, total_steps, decay_steps
        self.decay_start = total_steps - decay_steps if decay_start is None else decay_start
        self.decay, self.min_lr_ratio = decay, min_lr_ratio
        self._cooldown: tuple[int, int] | None = None

    @property
    def cooldown(self) -> tuple[int, int] | None:
        return self._cooldown

    @cooldown.setter
    def cooldown(self, value: tuple[int, int] | None) -> None:
        self._cooldown = None if value is None else (int(value[0]), int(value[1]))

    def under_way(self, cooldown: tuple[int, int] | None, step: int) -> str | None:
        """Why an operator's cooldown cannot start at ``step`` (``cooldown``: one in force; or the configured decay
        has begun), or None."""
        if cooldown is not None:
            return f"a decay is under way already: the operator's, over {cooldown[1]} steps from step {cooldown[0]} (lmtrain control RUN status)"
        if step >= self.decay_start:
            return f"a decay is under way already: the configured one, over {self.decay_steps} steps from step {self.decay_start} (scheduler.decay_start)"
        return None

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        start, steps = self._cooldown or (self.decay_start, self.decay_steps)  # the operator's decay, else the configured one
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay_shape(self.decay, progress)


def wsd_problems(sched) -> list[str]:
    """``scheduler=wsd``'s keys (a mapping), each bad one a line naming it."""
    out = []
    total, warmup = sched.get("total_steps"), sched.get("warmup_steps")
    steps, start = sched.get("decay_steps"), sched.get("decay_start")

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if sched.get("decay") not in SHAPES:
        out.append(f"scheduler.decay={sched.get('decay')!r} is not one of {list(SHAPES)}")
    if not (whole(total) and total > 0):
        return out + [f"scheduler.total_steps={total!r} must be a positive integer"]
    if steps is not None and not (whole(steps) and 1 <= steps <= total):
        out.append(f"scheduler.decay_steps={steps!r} must be in 1..scheduler.total_steps={total} (or null: a fifth of the run)")
        return out
    length = steps if steps is not None else default_decay_steps(total)
    if not (whole(warmup) and 0 <= warmup <= total - length):
        out.append(
            f"scheduler.warmup_steps={warmup!r} must be in 0..{total - length} (the steps before a decay of {length} steps that ends the run)"
        )
    if start is not None and not (whole(start) and (whole(warmup) and warmup <= start) and start + length <= total):
        out.append(
            f"scheduler.decay_start={start!r} must be a step from scheduler.warmup_steps={warmup} to {total - length} (a decay of {length} "
            f"steps ending by scheduler.total_steps={total}), or null: the decay ends the run"
        )
    ratio = sched.get("min_lr_ratio")
    if not (isinstance(ratio, int | float) and not isinstance(ratio, bool) and 0.0 <= ratio <= 1.0):
        out.append(f"scheduler.min_lr_ratio={ratio!r} must be in [0, 1]")
    return out


def wsd(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int | None = None,
    decay_start: int | None = None,
    decay: str = "1-sqrt",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """The scheduler of ``conf/scheduler/wsd.yaml`` (:class:`WarmupStableDecay`); a resume keeps this schedule."""
    return ConfiguredLR(optimizer, WarmupStableDecay(warmup_steps, total_steps, decay_steps, decay_start, decay, min_lr_ratio))


def schedule_of(scheduler) -> object | None:
    """The multiplier function of a ``LambdaLR`` (its first group's), or None for another scheduler."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    return lambdas[0] if lambdas else None


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
        # a schedule's private fields (a WSD cooldown) come from the run's corrections file, not from checkpoints
        state["lr_lambdas"] = [None if f is None else {k: v for k, v in f.items() if not k.startswith("_")} for f in state["lr_lambdas"]]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {k: v for k, v in state_dict.items() if k not in ("lr_lambdas", "changes")}
        schedule = {k: v for k, v in vars(self.lr_lambdas[0]).items() if not k.startswith("_")}
        peaks = list(self.base_lrs)
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
