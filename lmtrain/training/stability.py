"""The divergence detector's judgement as a function of per-step statistics, apart from any trainer, so that it can be
replayed offline over a recorded run (a *trace*) and judged on real events (docs/stability.md).

A trace is a list of steps, each ``{"step": N, "loss": ..., "grad_norm": ..., "act_rms": ..., "loss_scale": ...,
"overflow": ..., "lr": ...}`` (the last four may be None): what :class:`lmtrain.training.module.LMModule` hands the
detector every optimizer step. :func:`read_trace` reads one from a run's metrics record; :func:`replay` runs a
:class:`Judge` over it and returns every step a signal fired, with the action the detector would take.

:class:`lmtrain.callbacks.divergence.DivergenceDetector` is a :class:`Judge` that also acts (logs, skips, stops, rolls
back) inside a run; the decisions are the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from lmtrain.errors import InputError

ACTIONS = ("warn", "skip", "stop", "rollback")
SEVERITY = {a: i for i, a in enumerate(ACTIONS)}
DEFAULTS = {
    "nonfinite": {"action": "rollback"},
    "loss_spike": {"z": 6.0, "min_ratio": 1.1, "action": "rollback"},
    "grad_spike": {"z": 8.0, "min_ratio": 2.0, "action": "warn"},
    "act_growth": {"ratio": 3.0, "action": "warn"},
    "loss_level": {"ratio": 1.5, "action": "rollback"},
    "loss_scale": {"floor": 1.0, "action": "rollback"},
    "skipped_steps": {"max_consecutive": 10, "action": "rollback"},
}


class EMA:
    """Exponential moving average and variance."""

    def __init__(self, beta: float) -> None:
        self.beta, self.mean, self.var, self.n = beta, 0.0, 0.0, 0

    def update(self, x: float) -> None:
        if self.n == 0:
            self.mean, self.var = x, 0.0
        else:
            d = x - self.mean
            self.mean += (1 - self.beta) * d
            self.var = self.beta * (self.var + (1 - self.beta) * d * d)
        self.n += 1

    def z(self, x: float) -> float:
        return (x - self.mean) / math.sqrt(self.var + 1e-12 + (1e-3 * abs(self.mean)) ** 2)

    def state(self) -> dict:
        return {"mean": self.mean, "var": self.var, "n": self.n}

    def load(self, s: dict) -> None:
        self.mean, self.var, self.n = s["mean"], s["var"], s["n"]


def signal_specs(given: dict[str, dict | None]) -> dict[str, dict]:
    """Each signal's settings, the defaults filled in; an unknown key or action is an InputError naming it."""
    out = {}
    for name, spec in given.items():
        if spec is not None and not isinstance(spec, Mapping):
            raise InputError(f"callbacks.divergence.{name}={spec!r} must be a mapping of its settings, e.g. {name}.action=warn")
        spec = dict(spec or {})
        unknown = set(spec) - set(DEFAULTS[name])
        if unknown:
            raise InputError(f"callbacks.divergence.{name}: unknown key(s) {sorted(unknown)}; allowed: {sorted(DEFAULTS[name])}")
        spec = {**DEFAULTS[name], **spec}
        if spec["action"] not in ACTIONS:
            raise InputError(f"callbacks.divergence.{name}.action={spec['action']!r}: use one of {list(ACTIONS)}")
        for key, value in spec.items():
            if key != "action" and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise InputError(f"callbacks.divergence.{name}.{key}={value!r} must be a number")
        out[name] = spec
    return out


class Judge:
    """The running statistics and the signals they fire, step by step (see lmtrain.callbacks.divergence for each
    signal). Args: ``warmup_steps`` healthy steps observed before spikes are judged; ``ema_beta`` the smoothing of the
    running statistics; ``healthy_after`` signal-free steps after which the run counts as healthy again; one dict per
    signal (missing keys take :data:`DEFAULTS`)."""

    def __init__(
        self,
        warmup_steps: int = 20,
        ema_beta: float = 0.95,
        healthy_after: int = 10,
        nonfinite: dict | None = None,
        loss_spike: dict | None = None,
        grad_spike: dict | None = None,
        act_growth: dict | None = None,
        loss_level: dict | None = None,
        loss_scale: dict | None = None,
        skipped_steps: dict | None = None,
    ) -> None:
        self.signals = signal_specs({
            "nonfinite": nonfinite, "loss_spike": loss_spike, "grad_spike": grad_spike, "act_growth": act_growth,
            "loss_level": loss_level, "loss_scale": loss_scale, "skipped_steps": skipped_steps,
        })  # fmt: skip
        for key, value in (("warmup_steps", warmup_steps), ("healthy_after", healthy_after), ("ema_beta", ema_beta)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"callbacks.divergence.{key}={value!r} must be a number")
        if not 0 < ema_beta < 1:
            raise InputError(f"callbacks.divergence: ema_beta={ema_beta} must be in (0, 1)")
        self.warmup_steps, self.healthy_after = warmup_steps, healthy_after
        self.loss, self.grad, self.act = EMA(ema_beta), EMA(ema_beta), EMA(ema_beta)
        self.clean_streak = 0
        self.trouble_start: int | None = None
        self.first_loss: float | None = None  # the reference of ``loss_level``
        self.skip_streak = self.skipped_total = 0  # fp16: updates skipped by the gradient scaler

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "loss": self.loss.state(),
            "grad": self.grad.state(),
            "act": self.act.state(),
            "clean_streak": self.clean_streak,
            "trouble_start": self.trouble_start,
            "first_loss": self.first_loss,
            "skip_streak": self.skip_streak,
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.load(state["loss"])
        self.grad.load(state["grad"])
        self.act.load(state["act"])
        self.clean_streak, self.trouble_start = state["clean_streak"], state["trouble_start"]
        self.first_loss = state.get("first_loss")  # absent in checkpoints written before these fields existed
        self.skip_streak, self.skipped_total = state.get("skip_streak", 0), state.get("skipped_total", 0)

    # -- the judgement -------------------------------------------------------------------------
    def judge(self, stats: dict, step: int) -> tuple[list[tuple[str, str]], dict[str, float]]:
        """One step's statistics judged: the signals fired, as (name, why), and the figures logged every step. A step
        whose signals all only warn (or none) feeds the running statistics, unless the fp16 scaler skipped it."""
        metrics: dict[str, float] = {}
        fired = self._signals(stats, metrics)
        severe = [n for n, _ in fired if self.signals[n]["action"] != "warn"]  # warnings are reported, not acted on
        if severe:
            self.clean_streak = 0
            if self.trouble_start is None:
                self.trouble_start = step
        elif not stats.get("overflow"):  # a step the scaler skipped neither feeds the statistics nor clears trouble
            self._observe(stats)
        metrics["stability/healthy"] = float(self.trouble_start is None)
        for name in self.signals:
            metrics[f"stability/{name}"] = float(any(n == name for n, _ in fired))
        return fired, metrics

    def action(self, fired: list[tuple[str, str]]) -> str:
        """The most severe action among the signals fired."""
        return max((self.signals[n]["action"] for n, _ in fired), key=SEVERITY.get)

    def _signals(self, stats: dict, metrics: dict) -> list[tuple[str, str]]:
        """The signals this step fires, as (name, why); fills ``metrics`` with what is logged every step."""
        loss, grad, act = stats["loss"], stats["grad_norm"], stats.get("act_rms")
        overflow = stats.get("overflow")  # None: no gradient scaler (bf16, fp32)
        fired = self._scaler_signals(stats, metrics) if overflow is not None else []
        if not math.isfinite(loss) or (overflow is None and not math.isfinite(grad)):
            fired.append(("nonfinite", f"loss {loss}, gradient norm {grad}"))
            return fired
        if self.first_loss is None:
            self.first_loss = loss
        ratio = self.signals["loss_level"]["ratio"]
        metrics["stability/loss_level"] = loss / self.first_loss if self.first_loss > 0 else 0.0
        if self.first_loss > 0 and loss > ratio * self.first_loss:
            fired.append(("loss_level", f"loss {loss:.4f} above {ratio:g}x the run's first loss {self.first_loss:.4f}"))
        if overflow:  # the gradients are not finite: nothing more to judge on them
            return fired
        judging = self.loss.n >= max(self.warmup_steps, 2)  # never on statistics of nothing
        lz, gz = self.loss.z(loss), self.grad.z(grad)
        metrics.update({"stability/loss_z": lz if self.loss.n else 0.0, "stability/grad_z": gz if self.grad.n else 0.0})
        sp = self.signals["loss_spike"]
        if judging and lz > sp["z"] and loss > sp["min_ratio"] * self.loss.mean:
            fired.append(("loss_spike", f"loss {loss:.4f} vs average {self.loss.mean:.4f} (z={lz:.1f})"))
        sp = self.signals["grad_spike"]
        if judging and gz > sp["z"] and grad > sp["min_ratio"] * self.grad.mean:
            fired.append(("grad_spike", f"gradient norm {grad:.4g} vs average {self.grad.mean:.4g} (z={gz:.1f})"))
        if act is not None and math.isfinite(act):
            ratio = act / self.act.mean if self.act.n and self.act.mean > 0 else 1.0
            metrics["stability/act_ratio"] = ratio
            if judging and ratio > self.signals["act_growth"]["ratio"]:
                fired.append(("act_growth", f"final-layer activation RMS {act:.4g}, {ratio:.2f}x its average {self.act.mean:.4g}"))
        return fired

    def _scaler_signals(self, stats: dict, metrics: dict) -> list[tuple[str, str]]:
        """fp16: count the updates the gradient scaler skipped; judge the scale and the run of skips."""
        scale, fired = stats["loss_scale"], []
        self.skip_streak = self.skip_streak + 1 if stats["overflow"] else 0
        self.skipped_total += int(stats["overflow"])
        metrics.update({"train/loss_scale": scale, "train/skipped_steps": float(self.skipped_total)})
        floor = self.signals["loss_scale"]["floor"]
        if scale < floor:
            fired.append(("loss_scale", f"fp16 loss scale {scale:g} below the floor {floor:g}"))
        limit = self.signals["skipped_steps"]["max_consecutive"]
        if self.skip_streak > limit:
            fired.append(
                (
                    "skipped_steps",
                    f"{self.skip_streak} updates in a row skipped by the fp16 gradient scaler (more than {limit}; scale {scale:g})",
                )
            )
        return fired

    def _observe(self, stats: dict) -> None:
        """A healthy step: into the running statistics."""
        self.loss.update(stats["loss"])
        self.grad.update(stats["grad_norm"])
        act = stats.get("act_rms")
        if act is not None and math.isfinite(act):
            self.act.update(act)
        self.clean_streak += 1
        if self.clean_streak >= self.healthy_after:
            self.trouble_start = None


JUDGE_KEYS = ("warmup_steps", "ema_beta", "healthy_after", *DEFAULTS)  # what of callbacks.divergence a Judge takes


def replay(trace: list[dict], **settings) -> list[dict]:
    """The detector's judgement over ``trace`` (see the module), with ``settings`` (callbacks.divergence's keys; the
    others are ignored): for every step a signal fired, ``{"step", "signals", "action", "why"}``. Each step is judged
    as the run judged it, the running statistics carried on; nothing is acted on, so the steps after a first action
    say what the detector would go on to see if the run were let be."""
    judge = Judge(**{k: v for k, v in settings.items() if k in JUDGE_KEYS})
    out = []
    for stats in trace:
        fired, _ = judge.judge(stats, stats["step"])
        if fired:
            out.append({
                "step": stats["step"], "signals": [n for n, _ in fired], "action": judge.action(fired),
                "why": "; ".join(f"{n}: {why}" for n, why in fired),
            })  # fmt: skip
    return out


TRACE_KEYS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "act_rms": "train/act_rms", "lr": "train/lr",
              "loss_scale": "train/loss_scale"}  # fmt: skip


def read_trace(run_dir: str | Path) -> list[dict]:
    """A run's trace from its metrics record (lmtrain.formats.metrics): the current timeline, every step that logged
    ``train/loss``, in step order. ``overflow``: where the run logged ``train/skipped_steps`` (fp16), whether it grew
    at that step."""
    from lmtrain.formats.metrics import by_step

    out, skipped = [], None
    for step, row in sorted(by_step(run_dir).items()):
        if "train/loss" not in row:
            continue
        stats = {"step": step, **{k: float(row[key]) if key in row else None for k, key in TRACE_KEYS.items()}}
        stats["overflow"] = None
        if "train/skipped_steps" in row:
            now = float(row["train/skipped_steps"])
            stats["overflow"] = skipped is not None and now > skipped or (skipped is None and now > 0)
            skipped = now
        out.append(stats)
    return out
