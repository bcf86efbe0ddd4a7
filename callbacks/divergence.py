"""Divergence detection and the actions taken on it: warn, skip the update, stop, or roll back.

OPT-175B's logbook: loss spikes and divergence came with growing final-layer activations and, under fp16, a
loss scale falling toward zero; each time the team restarted from an earlier healthy checkpoint with a lower
learning rate. This callback watches, every optimizer step, statistics that are the same on every rank (the
module all-reduces them), so every rank takes the same decision:

* ``nonfinite``: the loss is NaN or infinite, or (bf16/fp32) the gradient norm is;
* ``loss_spike``: the loss is ``z`` standard deviations above its exponential moving average (and at least
  ``min_ratio`` times it); it acts only when it *persists*: spikes spanning ``persist`` steps with fewer than
  ``healthy_after`` clean steps between them. A shorter one is a *blip* (one odd batch the run recovers from by
  itself): said (``warn``), kept out of the averages, never a rollback or a stop;
* ``grad_spike``: the same test on the gradient norm (before clipping);
* ``act_growth``: the RMS of the last block's output (``train/act_rms``) or the attention-logit bound
  (``train/attn_logit_bound``, lmtrain.training.module) above ``ratio`` times its average;
* ``loss_level``: the loss above ``ratio`` times the run's first loss (at initialisation about ln(vocabulary)):
  judged from the first step, so a run that diverges during the warm-up, before the spike statistics are
  trusted, is still caught;
* ``loss_trend``: the mean loss of the last 50 steps ``rise`` above its lowest since judging began (a ramp too slow
  for the spike test, which follows it); the trouble is dated from that lowest step, so no checkpoint saved on the
  ramp is returned to;
* ``stall``: the 50-step mean loss has not gained ``min_delta`` (relative) in ``window`` steps (or a quarter of the
  steps trained, if more), the learning rate not near zero (above a tenth of the run's highest): a warning; after
  twice as long, the signal's action (``stop``: exit status 6, not 3: the run stopped learning, it did not diverge);
* ``loss_scale``: fp16 only, the gradient scaler's scale below ``floor``;
* ``skipped_steps``: fp16 only, more than ``max_consecutive`` optimizer steps in a row skipped by the scaler;
* ``routing_collapse``: a mixture of experts only, its routing (``moe/collapse``) at or past ``level`` of the way from
  every expert equally loaded to every token on the same experts, ``persist`` steps in a row: said once a stretch.

Under fp16 an overflow (non-finite gradients) is the gradient scaler's business, not divergence: the scaler skips
that update and halves the scale; the step is counted (``train/skipped_steps``, with ``train/loss_scale``, logged
every step) and left out of the running statistics. Only a run of overflows, a collapsing scale or a non-finite
loss is a signal. Running averages are updated only by healthy steps and start judging after ``warmup_steps``. Each signal's
action is one of ``warn`` (metric, logbook, MLflow tag), ``skip`` (this step's update is dropped), ``stop``
(stop cleanly, no checkpoint of the bad state) or ``rollback``: stop this attempt, and ``lmtrain.training.run`` resumes from
the newest checkpoint marked healthy that predates the trouble, with the learning rate multiplied by
``rollback_lr_scale`` from there on (recorded in ``RUN_DIR/lr_corrections.jsonl``, so it holds across later
resumes) and, with ``skip_data``, past the data that was being read. At most ``max_rollbacks`` rollbacks within
``rollback_window`` steps; one more stops the run, saying so. The detector's state is saved in checkpoints, and
every checkpoint's ``meta.json`` carries its health fields. A rollback also revokes the operator and config
learning-rate corrections issued after its checkpoint (lmtrain.formats.corrections): they belong to the abandoned timeline.
A ``stop``, or a rollback that cannot happen, ends the run with :class:`lmtrain.errors.RunStopped` (exit status 3; a
stall's stop 6). The judgement itself is :class:`lmtrain.training.stability.Judge`, replayable offline.

With ``rerun`` (the default), a *suspect* step (a non-finite loss, or a loss spike, the first of a stretch) is computed
again on the same batches before its update (lmtrain.training.module.LMModule). Where a rank's second loss differs
from its first (beyond half the spike's height), that rank's hardware computed wrongly once (a flipped bit, a failing
card): its update is dropped, the rank and its host named in a ``hardware_fault`` entry and counted, the step judged
as nothing; a rank with ``FAULTS_TO_STOP`` such steps in the run stops it (exit status 3), for its node to be checked
(``lmtrain doctor``) and left out. The same result again is the data or the model, judged as always, the logbook saying
which evidence chose.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lmtrain.console import log
from lmtrain.errors import STALLED_EXIT, STOPPED_EXIT, InputError
from lmtrain.formats import corrections, logbook
from lmtrain.training import compat
from lmtrain.training.checkpoint.resume import rollback_target
from lmtrain.training.contracts import CheckpointStore, RequestsRollback, StepChecker, StopsTraining
from lmtrain.training.logs import log_direct
from lmtrain.training.stability import FAULTS_TO_STOP, WARMUP_STEPS, Judge


class DivergenceDetector(Judge, L.Callback, StopsTraining, RequestsRollback, StepChecker):
    """Args (each signal is a dict; missing keys take the defaults in ``lmtrain.training.stability.DEFAULTS``):
    warmup_steps: healthy steps observed before spikes are judged.
    ema_beta: smoothing of the running statistics.
    healthy_after: signal-free steps after which the run (and the checkpoints it saves) count as healthy again.
    rollback_lr_scale: learning-rate factor applied from the rollback's checkpoint on.
    skip_data: after a rollback, skip the batches read between that checkpoint and the signal.
    max_rollbacks, rollback_window: the cap.
    rerun: compute a suspect step again on its batches before its update, telling a hardware fault from the data.
    run_dir: where the logbook and the corrections are (the config's ``run_dir``); None: the checkpoints' parent.
    """

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
        rollback_lr_scale: float = 0.5,
        skip_data: bool = True,
        max_rollbacks: int = 3,
        rollback_window: int = 1000,
        rerun: bool = True,
        run_dir: str | None = None,
    ) -> None:
        super().__init__(
            warmup_steps=warmup_steps, ema_beta=ema_beta, healthy_after=healthy_after, nonfinite=nonfinite, loss_spike=loss_spike,
            grad_spike=grad_spike, act_growth=act_growth, loss_level=loss_level, loss_trend=loss_trend, stall=stall, loss_scale=loss_scale,
            skipped_steps=skipped_steps, routing_collapse=routing_collapse,
        )  # fmt: skip
        if not 0 < rollback_lr_scale <= 1 or max_rollbacks < 0:
            raise InputError(
                f"callbacks.divergence: rollback_lr_scale={rollback_lr_scale} must be in (0, 1], max_rollbacks={max_rollbacks} >= 0"
            )
        self.rollback_lr_scale, self.skip_data = rollback_lr_scale, skip_data
        self.max_rollbacks, self.rollback_window = max_rollbacks, rollback_window
        if not isinstance(rerun, bool):
            raise InputError(f"callbacks.divergence.rerun={rerun!r} must be true or false")
        self.reruns_suspects = rerun
        self.faults: dict[int, int] = {}  # rank -> steps whose result did not repeat there, in this run
        self._reproduced: int | None = None  # the last step of a stretch of suspect steps whose first one came out the same again
        self.rollback_request: dict | None = None
        self.stop_reason: str | None = None
        self.stopping = False
        self.given_run_dir = Path(run_dir) if run_dir else None
        self.run_dir = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.checkpointer = next((c for c in trainer.callbacks if isinstance(c, CheckpointStore)), None)
        # the logbook is the run directory's whether or not the run keeps checkpoints (a benchmark may not)
        self.run_dir = self.given_run_dir or (self.checkpointer.root.parent if self.checkpointer is not None else None)
        self.rollback_request = None
        self.stop_reason = None
        self.stop_status = STOPPED_EXIT
        self.stopping = False

    # -- the per-step check (called by LMModule.on_before_optimizer_step on every rank) --------
    @property
    def needs_same_step(self) -> bool:
        """A ``skip`` must act on the very update the statistics describe, so they are read at once (a device sync
        per step); every other action is taken one step later, when the device has long finished that step."""
        return any(spec["action"] == "skip" for spec in self.signals.values())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "faults": {str(r): n for r, n in self.faults.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # a fault is the hardware's, not the training's: a rollback to a checkpoint from before it does not undo it
        # (after a rollback the counts carried over are at least the checkpoint's; on a resume nothing is carried)
        for r, n in state.get("faults", {}).items():
            self.faults[int(r)] = max(self.faults.get(int(r), 0), int(n))

    def carried(self, carry: dict) -> None:
        self.faults = {int(r): int(n) for r, n in carry.get("faults", {}).items()}

    # -- a suspect step computed again (LMModule._rerun) -------------------------------------------
    def suspects(self, loss: float, step: int) -> tuple[str, float] | None:
        """A suspect step, unless it goes on a stretch whose first step came out the same again (a spike that persists
        is the run's own doing, not a fault at each step)."""
        suspect = None if self.stopping else self.suspect(loss)
        if suspect is not None and self._reproduced == step - 1:
            self._reproduced = step
            return None
        self._reproduced = None
        return suspect

    def on_rerun(self, trainer, pl_module, step: int, verdict: dict) -> bool:
        log_direct(trainer, {"stability/rerun_loss": verdict["again"]}, step=step)
        ranks = verdict["differs"]
        if not ranks:
            self._reproduced = step
            self._event(
                trainer,
                "rerun",
                f"step {step}: {verdict['why']}; computed again on the same batches before the update: {verdict['again']:.4f}, "
                "the same on every rank: the data or the model, not the hardware; judged as such",
                alert=False,
                step=step,
            )
            return False
        hosts = verdict["hosts"]
        named = {r: f"{hosts[r][0]} ({hosts[r][1]})" for r in ranks}
        for r in ranks:
            self.faults[r] = self.faults.get(r, 0) + 1
        where = "; ".join(
            f"rank {r} on {named[r]}: {verdict['results'][r][0]:.4g}, then {verdict['results'][r][1]:.4g} ({self.faults[r]} in this run)" for r in ranks
        )
        others = " (the other ranks' results repeated)" if len(ranks) < trainer.world_size else ""
        self._event(
            trainer,
            "hardware_fault",
            f"step {step}: {verdict['why']}; the same batches computed again before the update gave another loss: {where}{others}: "
            "a fault of that hardware, not the data or the model; the update is dropped",
            step=step,
            ranks=ranks,
            hosts=[named[r] for r in ranks],
            where=[{"rank": r, "host": hosts[r][0], "device": hosts[r][1]} for r in ranks],
            results=[verdict["results"][r] for r in ranks],
            faults={str(r): self.faults[r] for r in ranks},
        )
        worst = max(ranks, key=lambda r: self.faults[r])
        if self.faults[worst] >= FAULTS_TO_STOP:
            self._stop(
                trainer,
                f"step {step}: rank {worst} on {named[worst]} computed {self.faults[worst]} steps that did not repeat in this run: "
                "stopping so that its node is checked (lmtrain doctor) and left out of the job",
                step,
            )
        return True

    def check_step(self, trainer, pl_module, stats: dict) -> bool:
        """Judge one optimizer step's statistics (``step``: its number, counted from 1; defaults to now); True:
        drop this update (or the run is stopping)."""
        if self.stopping:  # a stop or rollback is under way: later steps are abandoned with it
            return True
        step = stats["step"] if "step" in stats else compat.step_number(trainer)
        fired, metrics = self.judge(stats, step)
        healthy = self.healthy
        log_direct(trainer, metrics, step=step)
        if self.checkpointer is not None:
            self.checkpointer.record_health({
                "healthy": healthy,
                "loss_ema": self.loss.mean,
                "grad_norm_ema": self.grad.mean,
                "act_rms_ema": self.act.mean,
                "loss_scale": stats.get("loss_scale"),
                "skipped_steps": self.skipped_total,
                "trouble_start": self.trouble_start,
            })  # fmt: skip
        return self._act(trainer, pl_module, step, fired) if fired else False

    def _act(self, trainer, pl_module, step: int, fired: list[tuple[str, str, str]]) -> bool:
        action = self.action(fired)
        text = "; ".join(f"{n}: {why}" for n, why, _ in fired)
        tokens = None  # trained through the step judged (it may be judged a step late: lmtrain.training.module)
        if hasattr(pl_module, "tokens_trained"):
            tokens = pl_module.tokens_trained + (step - trainer.global_step) * pl_module.tokens_per_step()
        signals = [n for n, _, _ in fired]
        self._event(
            trainer, "divergence_signal", f"step {step}: {text} -> {action}", step=step, tokens=tokens, signals=signals, action=action
        )
        if action == "warn":
            return False
        if action == "skip":
            return True
        if action == "stop":
            stall = any(n == "stall" and a == "stop" for n, _, a in fired)
            what = "stalled" if stall else "stopping"
            self._stop(trainer, f"{what} at step {step} ({text}); the newest complete checkpoint is the last good state", step)
            if stall:  # not a divergence: its own exit status, so a scheduler or a sweep tells them apart
                self.stop_status = STALLED_EXIT
            return True
        return self._rollback(trainer, step, text)

    # -- actions -------------------------------------------------------------------------------
    def _stop(self, trainer, message: str, step: int) -> None:
        self._event(trainer, "stop", message, step=step)
        self.stop_reason = message
        self.stopping = True
        trainer.should_stop = True
        compat.skip_validation_after_this_batch(trainer)  # the diverged state is not validated either
        if self.checkpointer is not None:
            self.checkpointer.discard_current_state()  # never save the diverged state as the newest checkpoint

    def _rollback(self, trainer, step: int, why: str) -> bool:
        if self.checkpointer is None:
            self._stop(trainer, f"step {step}: rollback needs callbacks.checkpoint; stopping instead", step)
            return True
        history = [e for e in corrections.load(self.run_dir) if e.get("reason") == "rollback"]
        recent = [e for e in history if e.get("signal_step", -1) >= step - self.rollback_window]
        if len(recent) >= self.max_rollbacks:
            self._stop(
                trainer,
                f"step {step}: divergence again after {len(recent)} rollback(s) within {self.rollback_window} steps "
                f"(callbacks.divergence.max_rollbacks={self.max_rollbacks}): stopping for a human to look ({why})",
                step,
            )
            return True
        before = self.trouble_start if self.trouble_start is not None else step
        # a save still being written in the background may be the checkpoint to return to: wait for it, on every rank
        # (here together: the statistics are reduced), and for rank zero's commit of it, then choose
        self.checkpointer.wait(raise_errors=False)
        trainer.strategy.barrier("lmtrain-rollback-choose")
        target, problem = rollback_target(trainer, self.checkpointer.root, before)
        if target is None:
            self._stop(trainer, f"step {step}: {problem}; stopping ({why})", step)
            return True
        batches = (step - target.step) * trainer.accumulate_grad_batches if self.skip_data else 0
        self.stopping = True
        self.rollback_request = {
            "checkpoint": str(target.path),
            "from_step": target.step,
            "signal_step": step,
            "scale": self.rollback_lr_scale,
            "skip_batches": batches,
            "why": why,
            "carry": {"faults": dict(self.faults)},
        }
        trainer.should_stop = True
        compat.skip_validation_after_this_batch(trainer)
        self.checkpointer.discard_current_state()
        return True

    def _event(self, trainer, kind: str, message: str, alert: bool = True, **fields) -> None:
        log.info(f"{kind}: {message}")
        if trainer.is_global_zero and self.run_dir is not None:
            if alert:
                logbook.alert(self.run_dir, kind, message, said=True, **fields)
            else:
                logbook.append(self.run_dir, kind, message, **fields)
