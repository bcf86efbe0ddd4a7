"""The divergence detector's judgement as a function of per-step statistics, apart from any trainer, so that it can be
replayed offline over a recorded run (a *trace*) and judged on real events (docs/stability.md).

A trace is a list of steps, each ``{"step": N, "loss": ..., "grad_norm": ..., "act_rms": ..., "attn_bound": ...,
"loss_scale": ..., "overflow": ..., "lr": ..., "rerun_differs": ...}`` (all but the first three may be None or absent): what :class:`lmtrain.training.module.LMModule` hands the
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
    "loss_spike": {"z": 6.0, "min_ratio": 1.1, "persist": 5, "action": "rollback"},
    "grad_spike": {"z": 8.0, "min_ratio": 2.0, "persist": 5, "action": "warn"},
    "act_growth": {"ratio": 3.0, "action": "warn"},
    "loss_level": {"ratio": 1.5, "persist": 5, "action": "rollback"},
    "loss_trend": {"rise": 0.05, "action": "rollback"},
    "stall": {"window": 200, "min_delta": 0.02, "action": "stop"},
    "loss_scale": {"floor": 1.0, "action": "rollback"},
    "skipped_steps": {"max_consecutive": 10, "action": "rollback"},
    "routing_collapse": {"level": 0.5, "persist": 10, "action": "warn"},
}
TREND_STEPS = 50  # ``loss_trend`` and ``stall`` follow the mean loss of this many steps (of those that were not spikes)
NOISE_Z = 5.0  # a rise must also exceed this many standard errors of the difference of two TREND_STEPS means
WARMUP_STEPS = 100  # healthy steps before spikes, trends and stalls are judged (conf/callbacks/stability.yaml's too)
LOW_LR = 0.1  # a learning rate below this fraction of the run's highest is "near zero": no stall is judged there
FAULTS_TO_STOP = 3  # steps of one rank whose result did not repeat (a hardware fault) before the run stops, and doctor flags it


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
        if "persist" in spec and (not isinstance(spec["persist"], int) or spec["persist"] < 1):
            raise InputError(f"callbacks.divergence.{name}.persist={spec['persist']!r} must be a whole number of steps >= 1")
        if "level" in spec and not 0 < spec["level"] <= 1:  # routing_collapse: a share of the way to total collapse
            raise InputError(f"callbacks.divergence.{name}.level={spec['level']!r} must be in (0, 1]: 0 is balanced routing, 1 total collapse")
        out[name] = spec
    return out


class Judge:
    """The running statistics and the signals they fire, step by step (see lmtrain.callbacks.divergence for each
    signal). Args: ``warmup_steps`` healthy steps observed before spikes, trends and stalls are judged; ``ema_beta``
    the smoothing of the spike statistics; ``healthy_after`` signal-free steps after which the run counts as healthy
    again (and a spike episode is over); one dict per signal (missing keys take :data:`DEFAULTS`).

    Each fired signal is ``(name, why, action)``. A spike (``loss_spike``, ``grad_spike``) takes its action only once
    it persists: spikes spanning ``persist`` steps or more with fewer than ``healthy_after`` clean steps between them;
    ``loss_level`` once the loss has stayed above its level ``persist`` steps in a row; a shorter one is a *blip*, whose action is ``warn`` (``skip`` where the signal's action is ``skip``): a batch the
    run recovers from by itself is not a divergence. ``loss_trend`` and ``stall`` fire once when their condition
    begins (and again only after it has ended): a rising or flat curve is one event, not one per step."""

    def __init__(
        self,
        warmup_steps: int = WARMUP_STEPS,
        ema_beta: float = 0.95,
        healthy_after: int = 10,
        nonfinite: dict | None = None,
        loss_spike: dict | None = None,
        grad_spike: dict | None = None,
        act_growth: dict | None = None,
        loss_level: dict | None = None,
        loss_trend: dict | None = None,
        stall: dict | None = None,
        loss_scale: dict | None = None,
        skipped_steps: dict | None = None,
        routing_collapse: dict | None = None,
    ) -> None:
        self.signals = signal_specs({
            "nonfinite": nonfinite, "loss_spike": loss_spike, "grad_spike": grad_spike, "act_growth": act_growth,
            "loss_level": loss_level, "loss_trend": loss_trend, "stall": stall, "loss_scale": loss_scale,
            "skipped_steps": skipped_steps, "routing_collapse": routing_collapse,
        })  # fmt: skip
        for key, value in (("warmup_steps", warmup_steps), ("healthy_after", healthy_after), ("ema_beta", ema_beta)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"callbacks.divergence.{key}={value!r} must be a number")
        if not 0 < ema_beta < 1:
            raise InputError(f"callbacks.divergence: ema_beta={ema_beta} must be in (0, 1)")
        self.warmup_steps, self.healthy_after = warmup_steps, healthy_after
        self.loss, self.grad, self.act, self.attn = EMA(ema_beta), EMA(ema_beta), EMA(ema_beta), EMA(ema_beta)
        self.recent: list[float] = []  # the last TREND_STEPS losses that were not spikes: ``loss_trend`` and ``stall``
        self.clean_streak = 0
        self.trouble_start: int | None = None  # the first step of the trouble a severe signal acts on
        self.episode_start: int | None = None  # the first spike of the spikes not yet followed by healthy_after clean steps
        self.first_loss: float | None = None  # the reference of ``loss_level``
        self.level_streak = 0  # ``loss_level``: consecutive steps above it
        self.best: float | None = None  # the smoothed loss's lowest since judging began, and its step
        self.best_step: int | None = None
        self.rising = False  # loss_trend fired and the smoothed loss has not come back since
        self.history: list[list] = []  # stall: [step, smoothed loss] every 10 steps, as far back as it looks
        self.stall_said = 0  # stall: 1 once warned of this flat stretch, 2 once acted on
        self.peak_lr = 0.0
        self.skip_streak = self.skipped_total = 0  # fp16: updates skipped by the gradient scaler
        # a mixture of experts: the last ``persist`` steps' routing collapse; whether a stretch of collapse was said and
        # has not ended; the steps its mean has since been under the level
        self.collapse_recent: list[float] = []
        self.collapse_said, self.collapse_below = False, 0

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "loss": self.loss.state(),
            "grad": self.grad.state(),
            "act": self.act.state(),
            "attn": self.attn.state(),
            "recent": list(self.recent),
            "clean_streak": self.clean_streak,
            "trouble_start": self.trouble_start,
            "episode_start": self.episode_start,
            "first_loss": self.first_loss,
            "level_streak": self.level_streak,
            "best": self.best,
            "best_step": self.best_step,
            "rising": self.rising,
            "history": self.history,
            "stall_said": self.stall_said,
            "peak_lr": self.peak_lr,
            "skip_streak": self.skip_streak,
            "skipped_total": self.skipped_total,
            "collapse_recent": list(self.collapse_recent),
            "collapse_said": self.collapse_said,
            "collapse_below": self.collapse_below,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.load(state["loss"])
        self.grad.load(state["grad"])
        self.act.load(state["act"])
        if "attn" in state:
            self.attn.load(state["attn"])
        self.clean_streak, self.trouble_start = state["clean_streak"], state["trouble_start"]
        # absent in checkpoints written before these fields existed: judging them starts afresh
        self.first_loss, self.level_streak = state.get("first_loss"), state.get("level_streak", 0)
        self.recent = list(state.get("recent", []))
        self.episode_start, self.best, self.best_step = state.get("episode_start"), state.get("best"), state.get("best_step")
        self.rising, self.history = state.get("rising", False), [list(h) for h in state.get("history", [])]
        self.stall_said, self.peak_lr = state.get("stall_said", 0), state.get("peak_lr", 0.0)
        self.skip_streak, self.skipped_total = state.get("skip_streak", 0), state.get("skipped_total", 0)
        self.collapse_recent = list(state.get("collapse_recent", []))
        self.collapse_said, self.collapse_below = state.get("collapse_said", False), state.get("collapse_below", 0)

    @property
    def healthy(self) -> bool:
        """No trouble acted on, no spike episode open, the loss not above its level, the smoothed loss not rising: a
        checkpoint saved now is one to return to."""
        return self.trouble_start is None and self.episode_start is None and not self.rising and not self.level_streak

    # -- the judgement -------------------------------------------------------------------------
    def suspect(self, loss: float) -> tuple[str, float] | None:
        """Whether a step whose loss is ``loss`` should be computed again on its batches before its update, to tell a
        hardware fault from the data or the model: a non-finite loss, or a loss spike by the running statistics (from
        the end of the warm-up). ``(why, tolerance)``: a rank's second result within ``tolerance`` of its first is the
        same (half the spike's height: a fault of one rank that spiked the mean moved that rank's loss by the whole
        height, and more); None: not suspect."""
        if not math.isfinite(loss):
            return f"a non-finite loss ({loss})", 0.0
        sp = self.signals["loss_spike"]
        z = self.loss.z(loss)
        if self.loss.n >= max(self.warmup_steps, 2) and z > sp["z"] and loss > sp["min_ratio"] * self.loss.mean:
            return f"loss {loss:.4f} vs average {self.loss.mean:.4f} (z={z:.1f})", (loss - self.loss.mean) / 2
        return None

    def judge(self, stats: dict, step: int) -> tuple[list[tuple[str, str, str]], dict[str, float]]:
        """One step's statistics judged: the signals fired, as (name, why, action), and the figures logged every
        step. A step that fires nothing feeds the running statistics, unless the fp16 scaler skipped it. A step
        computed again whose result differed on some rank (``rerun_differs``) was a fault of that rank's hardware,
        its update dropped: it fires nothing and feeds nothing."""
        metrics: dict[str, float] = {}
        if stats.get("rerun_differs") is not None:
            metrics["stability/rerun_differs"] = float(stats["rerun_differs"])
            if stats["rerun_differs"]:
                metrics["stability/healthy"] = float(self.healthy)
                metrics.update({f"stability/{name}": 0.0 for name in self.signals})
                return [], metrics
        fired, spike = self._signals(stats, step, metrics)
        severe = [a for _, _, a in fired if a != "warn"]
        if severe and self.trouble_start is None:
            # a ramp began at the middle of the window whose mean was lowest; spikes at the first of them
            onsets = [step] + [self.best_step - TREND_STEPS // 2 for n, _, _ in fired if n == "loss_trend" and self.best_step is not None]
            onsets += [self.episode_start] if self.episode_start is not None else []
            onsets += [step - self.level_streak + 1] if self.level_streak else []  # the loss above its level since then
            if any(n == "routing_collapse" for n, _, _ in fired):  # the collapse since the first step of its window
                onsets.append(step - len(self.collapse_recent) + 1)
            self.trouble_start = min(onsets)
        if severe or spike:
            self.clean_streak = 0
        elif not stats.get("overflow"):  # a step the scaler skipped neither feeds the statistics nor clears trouble
            self._observe(stats, step)
        metrics["stability/healthy"] = float(self.healthy)
        for name in self.signals:
            metrics[f"stability/{name}"] = float(any(n == name for n, _, _ in fired))
        return fired, metrics

    @staticmethod
    def action(fired: list[tuple[str, str, str]]) -> str:
        """The most severe action among the signals fired."""
        return max((a for _, _, a in fired), key=SEVERITY.get)

    def _signals(self, stats: dict, step: int, metrics: dict) -> tuple[list[tuple[str, str, str]], bool]:
        """The signals this step fires, and whether it is a spike (kept out of the statistics); fills ``metrics``."""
        loss, grad, act, lr = stats["loss"], stats["grad_norm"], stats.get("act_rms"), stats.get("lr")
        overflow = stats.get("overflow")  # None: no gradient scaler (bf16, fp32)
        fired = self._scaler_signals(stats, metrics) if overflow is not None else []
        if not math.isfinite(loss) or (overflow is None and not math.isfinite(grad)):
            fired.append(self._fire("nonfinite", f"loss {loss}, gradient norm {grad}"))
            return fired, True
        if lr is not None and math.isfinite(lr):
            self.peak_lr = max(self.peak_lr, lr)
        if self.first_loss is None:
            self.first_loss = loss
        ratio = self.signals["loss_level"]["ratio"]
        metrics["stability/loss_level"] = loss / self.first_loss if self.first_loss > 0 else 0.0
        self.level_streak = self.level_streak + 1 if self.first_loss > 0 and loss > ratio * self.first_loss else 0
        if self.level_streak:
            why, persist = f"loss {loss:.4f} above {ratio:g}x the run's first loss {self.first_loss:.4f}", self.signals["loss_level"]["persist"]
            if self.level_streak >= persist:
                fired.append(self._fire("loss_level", f"{why}, {self.level_streak} steps in a row"))
            else:  # the first steps' jolt (opt-1.3b at step 2: 1.56x, back under it at step 3): a blip
                fired.append(("loss_level", f"{why}; a blip unless it stays there {persist} steps", "skip" if self.signals["loss_level"]["action"] == "skip" else "warn"))
        if overflow:  # the gradients are not finite: nothing more to judge on them
            return fired, True
        judging = self.loss.n >= max(self.warmup_steps, 2)  # never on statistics of nothing
        lz, gz = self.loss.z(loss), self.grad.z(grad)
        metrics.update({"stability/loss_z": lz if self.loss.n else 0.0, "stability/grad_z": gz if self.grad.n else 0.0})
        spikes = []
        sp = self.signals["loss_spike"]
        if judging and lz > sp["z"] and loss > sp["min_ratio"] * self.loss.mean:
            spikes.append(("loss_spike", f"loss {loss:.4f} vs average {self.loss.mean:.4f} (z={lz:.1f})"))
        sp = self.signals["grad_spike"]
        if judging and gz > sp["z"] and grad > sp["min_ratio"] * self.grad.mean:
            spikes.append(("grad_spike", f"gradient norm {grad:.4g} vs average {self.grad.mean:.4g} (z={gz:.1f})"))
        if spikes:
            if self.episode_start is None:
                self.episode_start = step
            span = step - self.episode_start + 1
            for name, why in spikes:
                persist = self.signals[name]["persist"]
                if span >= persist:
                    fired.append(self._fire(name, f"{why}; spikes over {span} steps from step {self.episode_start}"))
                else:  # a blip: said, kept out of the statistics, not acted on
                    blip = "skip" if self.signals[name]["action"] == "skip" else "warn"
                    fired.append((name, f"{why}; a blip unless the spikes persist over {persist} steps", blip))
        grown = []  # act_growth: the last block's output, or the attention-logit bound, far above its average
        for value, ema, key, what in ((act, self.act, "act_ratio", "final-layer activation RMS"),
                                      (stats.get("attn_bound"), self.attn, "attn_ratio", "attention-logit bound")):  # fmt: skip
            if value is not None and math.isfinite(value):
                ratio = value / ema.mean if ema.n and ema.mean > 0 else 1.0
                metrics[f"stability/{key}"] = ratio
                if judging and ratio > self.signals["act_growth"]["ratio"]:
                    grown.append(f"{what} {value:.4g}, {ratio:.2f}x its average {ema.mean:.4g}")
        if grown:
            fired.append(self._fire("act_growth", "; ".join(grown)))
        fired += self._routing_signal(stats.get("routing_collapse"))
        if not spikes:
            fired += self._trend_signals(loss, lr, step, judging, metrics)
        return fired, bool(spikes)

    def _trend_signals(self, loss: float, lr: float | None, step: int, judging: bool, metrics: dict) -> list:
        """``loss_trend`` and ``stall``, on the smoothed loss: the mean of the last TREND_STEPS losses that were not
        spikes (a window's mean, not a moving average: it does not lag behind the steep fall of the first steps)."""
        self.recent = [*self.recent[1 - TREND_STEPS :], loss]
        smoothed, fired = sum(self.recent) / len(self.recent), []
        metrics["stability/loss_smoothed"] = smoothed
        if len(self.recent) < TREND_STEPS:
            return []
        if step % 10 == 0:  # the stall's history: the smoothed loss every 10 steps, as far back as it looks
            back = 2 * max(self.signals["stall"]["window"], step // 4) + 10
            self.history = [h for h in self.history if h[0] >= step - back] + [[step, smoothed]]
        if not judging:
            return []
        if self.best is None or smoothed < self.best:
            self.best, self.best_step = smoothed, step
        rise = self.signals["loss_trend"]["rise"]
        metrics["stability/loss_rise"] = smoothed / self.best - 1 if self.best > 0 else 0.0
        var = sum((x - smoothed) ** 2 for x in self.recent) / (len(self.recent) - 1)
        noise = NOISE_Z * math.sqrt(2 * var / len(self.recent))  # a small batch's loss wanders more: so may its mean
        if self.best > 0 and smoothed - self.best > max(rise * self.best, noise) and not self.rising:
            self.rising = True
            fired.append(self._fire("loss_trend", f"smoothed loss {smoothed:.4f}, {smoothed / self.best - 1:.1%} above its lowest "
                                                  f"{self.best:.4f} (steps {self.best_step - TREND_STEPS + 1}-{self.best_step}): rising since then"))  # fmt: skip
        elif self.rising and smoothed <= (1 + rise / 2) * self.best:
            self.rising = False
        st = self.signals["stall"]
        window = max(st["window"], step // 4)  # a long run's later progress is slower: its window grows with it
        gain = {w: self._gain(smoothed, step - w) for w in (window, 2 * window)}
        if gain[window] is not None and gain[window] >= 2 * st["min_delta"]:  # learning again, clearly: judged afresh
            self.stall_said = 0
        low_lr = lr is not None and self.peak_lr > 0 and lr < LOW_LR * self.peak_lr
        at = "" if lr is None else f" at learning rate {lr:g}"
        flat = f"the smoothed loss ({smoothed:.4f}) gained less than {st['min_delta']:.0%}"
        if low_lr or self.rising:  # near zero, or a ramp (loss_trend fired): no stall judged
            return fired
        near_best = smoothed <= (1 + st["min_delta"]) * self.best  # flat, not creeping up: a ramp is not stopped as a stall
        if self.stall_said == 1 and near_best and gain[2 * window] is not None and gain[2 * window] < st["min_delta"] / 2:
            self.stall_said = 2  # acted on only when twice as long a stretch gained less than half as much: surely flat
            flat = f"the smoothed loss ({smoothed:.4f}) gained less than {st['min_delta'] / 2:.0%}"
            fired.append(self._fire("stall", f"{flat} in {2 * window} steps (since step {step - 2 * window}){at}: the run has stopped learning"))
        elif self.stall_said == 0 and gain[window] is not None and gain[window] < st["min_delta"]:
            self.stall_said = 1
            then = st["action"]
            fired.append(("stall", f"{flat} in {window} steps (since step {step - window}){at}; {then} at step "
                                   f"{step + window} or later unless it gains {st['min_delta'] / 2:.0%} in {2 * window} steps", "warn"))  # fmt: skip
        return fired

    def _gain(self, smoothed: float, since: int) -> float | None:
        """The smoothed loss's relative gain since step ``since`` (None: no record that far back)."""
        then = [v for s, v in self.history if s <= since]
        return (then[-1] - smoothed) / then[-1] if then and then[-1] > 0 else None

    def _routing_signal(self, collapse: float | None) -> list[tuple[str, str, str]]:
        """``routing_collapse``: a mixture of experts' routing (``moe/collapse``, lmtrain.training.routing: 0 every
        expert equally loaded, 1 every token on the same top_k experts, in the worst layer), its mean over the last
        ``persist`` steps at or past ``level``. Said once a stretch, as the mean first reaches the level; the stretch
        ends once the mean has been under the level for ``persist`` steps, so a collapse wavering about the level is
        one stretch, and one step's dip (a batch the router spreads) neither hides it nor says it again."""
        if collapse is None or not math.isfinite(collapse):
            return []
        spec = self.signals["routing_collapse"]
        self.collapse_recent = [*self.collapse_recent, float(collapse)][-spec["persist"] :]
        if len(self.collapse_recent) < spec["persist"]:
            return []
        mean = sum(self.collapse_recent) / len(self.collapse_recent)
        if mean < spec["level"]:
            self.collapse_below += 1
            if self.collapse_below >= spec["persist"]:
                self.collapse_said = False
            return []
        self.collapse_below = 0
        if self.collapse_said:
            return []
        self.collapse_said = True
        return [self._fire("routing_collapse", (
            f"expert routing collapsed: {mean:.2f} of the way from balanced to every token on the same experts over the "
            f"last {len(self.collapse_recent)} steps (level {spec['level']:g}; {collapse:.2f} at this step)"
        ))]  # fmt: skip

    def _fire(self, name: str, why: str) -> tuple[str, str, str]:
        return name, why, self.signals[name]["action"]

    def _scaler_signals(self, stats: dict, metrics: dict) -> list[tuple[str, str, str]]:
        """fp16: count the updates the gradient scaler skipped; judge the scale and the run of skips."""
        scale, fired = stats["loss_scale"], []
        self.skip_streak = self.skip_streak + 1 if stats["overflow"] else 0
        self.skipped_total += int(stats["overflow"])
        metrics.update({"train/loss_scale": scale, "train/skipped_steps": float(self.skipped_total)})
        floor = self.signals["loss_scale"]["floor"]
        if scale < floor:
            fired.append(self._fire("loss_scale", f"fp16 loss scale {scale:g} below the floor {floor:g}"))
        limit = self.signals["skipped_steps"]["max_consecutive"]
        if self.skip_streak > limit:
            fired.append(self._fire(
                "skipped_steps", f"{self.skip_streak} updates in a row skipped by the fp16 gradient scaler (more than {limit}; scale {scale:g})"
            ))  # fmt: skip
        return fired

    def _observe(self, stats: dict, step: int) -> None:
        """A healthy step: into the running statistics."""
        self.loss.update(stats["loss"])
        self.grad.update(stats["grad_norm"])
        act = stats.get("act_rms")
        if act is not None and math.isfinite(act):
            self.act.update(act)
        attn = stats.get("attn_bound")
        if attn is not None and math.isfinite(attn):
            self.attn.update(attn)
        self.clean_streak += 1
        if self.clean_streak >= self.healthy_after:
            self.trouble_start = self.episode_start = None


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
                "step": stats["step"], "signals": [n for n, _, _ in fired], "action": judge.action(fired),
                "why": "; ".join(f"{n}: {why}" for n, why, _ in fired), "since": judge.trouble_start,
            })  # fmt: skip
    return out


# -- the labelled set: real events, what should happen, and what the judgement did (docs/stability.md) -------------
KINDS = {  # kind: what the person on call would have done
    "healthy": "no rollback or stop",
    "blip": "no rollback or stop (one odd stretch of batches the run recovers from)",
    "divergence": "a rollback or stop within 20 steps of the onset, none before",
    "ramp": "a rollback within 20 steps of the onset, to a checkpoint from before the ramp began",
    "stall": "flagged (a stall warning) within 200 steps of the onset, no rollback or stop on the way",
}
SEVERE = ("stop", "rollback")


def read_traces(path: str | Path) -> dict[str, list[dict]]:
    """Traces stored as JSON lines (gzip or not): a first line naming their source, then one line per step with its
    ``run`` (bench/stability_traces.py writes them)."""
    import gzip
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    runs: dict[str, list[dict]] = {}
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if "run" in row:
                runs.setdefault(row.pop("run"), []).append(row)
    return runs


def score(events: list[dict], traces: dict[tuple[str, str], list[dict]], **settings) -> list[dict]:
    """Each labelled event judged: ``events`` as in tests/data/stability/events.json (``trace`` file, ``run``,
    ``kind`` of :data:`KINDS`, ``onset``, ``start`` of a ramp, ``to`` the last step the event covers); ``traces`` by
    (file, run). Returns each event with ``correct``, ``false_action`` (a rollback or stop it should not have had),
    ``acted`` (the step of the action that answers it, or None) and ``steps_to_act``."""
    replays: dict[tuple[str, str], list[dict]] = {}
    out = []
    for ev in events:
        key = (ev["trace"], ev["run"])
        if key not in replays:
            replays[key] = replay(traces[key], **settings)
        lo, hi = ev.get("from", ev.get("onset", 0)), ev["to"]
        seen = [e for e in replays[key] if lo <= e["step"] <= hi]
        severe = [e for e in seen if e["action"] in SEVERE]
        kind, onset = ev["kind"], ev.get("onset")
        result = {**ev, "false_action": None, "acted": None, "steps_to_act": None, "stall_warned": any("stall" in e["signals"] for e in seen)}
        if kind in ("healthy", "blip"):
            result["false_action"] = severe[0]["step"] if severe else None
            result["correct"] = not severe
        elif kind == "stall":
            early = [e for e in severe if e["step"] < onset and "stall" not in e["signals"]]
            flag = next((e for e in seen if "stall" in e["signals"] and e["step"] >= onset), None)
            result["false_action"] = early[0]["step"] if early else None
            result["acted"] = flag["step"] if flag else None
            result["steps_to_act"] = flag["step"] - onset if flag else None
            result["correct"] = not early and flag is not None and flag["step"] - onset <= 200
        else:  # divergence, ramp: the first rollback or stop
            early = [e for e in severe if e["step"] < onset]
            first = next((e for e in severe if e["step"] >= onset), None)
            result["false_action"] = early[0]["step"] if early else None
            result["acted"] = first["step"] if first else None
            result["steps_to_act"] = first["step"] - onset if first else None
            ok = not early and first is not None and first["step"] - onset <= 20
            if kind == "ramp" and first is not None:
                result["returns_before"] = first["since"]
                ok = ok and first["since"] is not None and first["since"] <= ev["start"]
            result["correct"] = ok
        out.append(result)
    return out


def table(results: list[dict]) -> str:
    """The scores by kind, as the Markdown table of docs/stability.md."""
    import statistics

    rows = ["| kind | what should happen | events (GPU) | correct | false actions | missed or late | steps to act (median, max) | warned of a stall |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, should in KINDS.items():
        mine = [r for r in results if r["kind"] == kind]
        if not mine:
            continue
        gpu = sum(r["trace"].startswith(("h200", "h100")) for r in mine)
        false = sum(r["false_action"] is not None for r in mine)
        missed = sum(not r["correct"] and r["false_action"] is None for r in mine)
        steps = [r["steps_to_act"] for r in mine if r["steps_to_act"] is not None]
        when = f"{statistics.median(steps):g}, {max(steps)}" if steps else "-"
        warned = "-" if kind == "stall" else str(sum(r["stall_warned"] for r in mine))
        rows.append(f"| {kind} | {should} | {len(mine)} ({gpu}) | {sum(r['correct'] for r in mine)} | {false} | {missed} | {when} | {warned} |")
    return "\n".join(rows)


TRACE_KEYS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "act_rms": "train/act_rms",
              "attn_bound": "train/attn_logit_bound", "lr": "train/lr", "loss_scale": "train/loss_scale",
              "rerun_differs": "stability/rerun_differs", "routing_collapse": "moe/collapse"}  # fmt: skip


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
