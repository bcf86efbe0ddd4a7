"""When to save and what to keep: ``step-NNNNNNN`` checkpoints every N steps and at the end, with retention (the writing
itself is lmtrain.training.checkpoint.writer, the directory format lmtrain.formats.checkpoint).

Everything needed for an identical continuation goes in: model, optimizer, scheduler, loop counters, the
precision plugin (gradient scaler), callback states, the data stream position (the train loader's state), and
the RNG states of every rank, which Lightning itself does not save; they are restored at the first training
batch after a resume (restoring them earlier is undone by the loader's own setup). The next save (and the end of
training) waits for the previous one first, so the disk guard measures the disk with every earlier checkpoint fully
written.

``every_n_steps=auto`` (the default) spaces the saves by what they cost: the first at step 100, each next one at
least 100 steps on and, in hundreds of steps, far enough that the save's stall (its copy to host memory) is at most 1%
of the steps between saves and that the previous save's background write (1.25x its measured time) is done before
the next save starts, so that no save waits for the one before (once a write has been timed: the second save is
planned before the first write ends); a periodic save less than one interval before the
end of training (``max_steps``) is left to the end's save. The figures are the largest over the ranks, so every rank
saves at the same steps; a multiple of ``keep_every`` is always saved. An asynchronous save's host buffers are
pinned after the attempt's first step (with the first steps' compilation), not at its first save.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Checkpoint

from lmtrain.console import log
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.training import compat
from lmtrain.training.checkpoint.rng import every_rank_rng_state, set_rng_state
from lmtrain.training.checkpoint.writer import CheckpointWriter, SaveEvents, state_bytes
from lmtrain.training.contracts import CheckpointStore, SaveGuard, WatchesProgress
from lmtrain.training.layout import Layout

AUTO_STEPS = 100  # every_n_steps=auto: the first save's step, the shortest interval, and the unit of the others
AUTO_STALL_SHARE = 0.01  # every_n_steps=auto: a save's stall is at most this share of the steps between saves


class Checkpointer(Checkpoint, CheckpointStore, SaveEvents):
    """Save ``step-NNNNNNN`` checkpoints under ``dirpath`` every ``every_n_steps`` optimizer steps and at the end.

    Args:
        dirpath: the checkpoint root (default config: ``RUN_DIR/checkpoints``).
        every_n_steps: save interval in optimizer steps (0: only at the end; ``auto``: from the saves' measured cost,
            see the module).
        keep_last: complete checkpoints kept (at least 2: the newest may still be in flight).
        keep_every: also keep every checkpoint whose step is a multiple of this, permanently (None: none).
        async_save: ``auto`` (asynchronous when the host has at least twice the copy's size available, else
            synchronous, said once), ``true`` or ``false``.
        save_on_train_end: save when training ends (max_steps reached or a clean stop).
        max_consecutive_failures: stop the run with an error after this many failed saves in a row.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_steps: int | str = "auto",
        keep_last: int = 3,
        keep_every: int | None = None,
        async_save: bool | str = "auto",
        save_on_train_end: bool = True,
        max_consecutive_failures: int = 3,
        checksums: bool = True,
    ) -> None:
        if keep_last < 2:
            raise CheckpointError(f"callbacks.checkpoint.keep_last={keep_last}: keep at least 2 (the newest may be in flight)")
        auto = every_n_steps == "auto"
        numeric = isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool) and every_n_steps >= 0
        if not (auto or numeric) or (keep_every is not None and keep_every <= 0) or max_consecutive_failures < 1:
            raise CheckpointError(
                f"callbacks.checkpoint: every_n_steps={every_n_steps} must be auto or >= 0, keep_every={keep_every} null or > 0, "
                f"max_consecutive_failures={max_consecutive_failures} >= 1"
            )
        if async_save not in (True, False, "auto"):
            raise CheckpointError(f"callbacks.checkpoint.async_save={async_save!r}: use auto, true or false")
        self.root = Path(dirpath)
        self.auto = auto  # every_n_steps is then the current interval, from AUTO_STEPS on
        self.every_n_steps = AUTO_STEPS if auto else every_n_steps
        self.keep_last, self.keep_every = keep_last, keep_every
        self.next_auto_step = AUTO_STEPS  # auto: the step of the next periodic save
        self._since: tuple | None = None  # auto: (time.monotonic(), step, stall_seconds) after the last periodic save
        self._prepared = False
        self.save_on_train_end = save_on_train_end
        self.writer = CheckpointWriter(self.root, async_save, checksums, max_consecutive_failures, events=self)
        self._run_info: dict = {}  # describe_run (lmtrain.training.run): config hash, model config, parameter shapes, MLflow run id
        self._health: dict = {}  # record_health (the stability callbacks); stored in meta.json
        self.final_save_suppressed = False  # discard_current_state (a diverged state): never saved
        self._guards: list[SaveGuard] = []
        self._watchers: list[WatchesProgress] = []
        self.last_saved_step: int | None = None
        self.stall_seconds = 0.0
        self.prepare_seconds = 0.0  # the first step's host-buffer pinning (lmtrain.training.goodput: first steps)
        self._rng_to_restore: list | None = None
        self._after_validation: tuple[int, bool] | None = None  # (step, periodic): a save due after this step's validation
        self._wall_before = 0.0  # wall-clock seconds of earlier segments of this run
        self._t_start = time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self.final_save_suppressed = False
        self._guards = [c for c in trainer.callbacks if isinstance(c, SaveGuard)]
        self._watchers = [c for c in trainer.callbacks if isinstance(c, WatchesProgress)]
        self.writer.setup(trainer)
        if trainer.is_global_zero:
            self.root.mkdir(parents=True, exist_ok=True)
            removed = ck.remove_partials(self.root)
            for d in removed:
                ck.warn(f"removed {d.name}, left by a save that did not finish")
            if removed:
                names = ", ".join(d.name for d in removed)
                logbook.append(self.root.parent, "partial_removed", f"removed {names}, left by a save that did not finish")
        self._t_start = time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._rng_to_restore is not None:
            states, self._rng_to_restore = self._rng_to_restore, None
            rank = trainer.global_rank
            if rank < len(states):
                set_rng_state(states[rank])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning runs Checkpoint callbacks after all others, so a stop requested in this hook is seen here.
        # The final save happens here too, not in on_train_end: by then Lightning has marked the epoch finished,
        # and a run extended from that checkpoint would start a new epoch instead of continuing this one.
        # A step that validates is saved after its validation (on_validation_end), as Lightning's own ModelCheckpoint
        # does: the checkpoint then holds the state the next step starts from, and its values are in the record.
        step = trainer.global_step
        if not self._prepared and step > 0:  # the attempt's first step: an asynchronous save's host buffers pinned now
            self._prepared = True
            t0 = time.perf_counter()
            self.writer.prepare(trainer, self.estimate_bytes(trainer))
            self.prepare_seconds += time.perf_counter() - t0
            self._since = (time.monotonic(), step, self.stall_seconds)  # auto: steps are timed from here (compiled)
        if step == 0 or step == self.last_saved_step or self.final_save_suppressed:
            return
        if self.auto:
            periodic = step >= self.next_auto_step
            if periodic and self.save_on_train_end and 0 < trainer.max_steps - step < self.every_n_steps:
                periodic, self.next_auto_step = False, trainer.max_steps  # the end's save is nearer than one interval: it is the one
        else:
            periodic = bool(self.every_n_steps) and step % self.every_n_steps == 0
        periodic = periodic or bool(self.keep_every and step % self.keep_every == 0)
        last = self.save_on_train_end and (trainer.should_stop or (trainer.max_steps > 0 and step >= trainer.max_steps))
        if self._after_validation is not None:  # a save kept for a validation that did not come (not expected)
            log.warning(f"checkpoints: step {self._after_validation[0]}'s save waited for a validation that did not run; not saved")
            self._after_validation = None
        if not (periodic or last):
            return
        if compat.validates_after_this_batch(trainer):
            self._after_validation = (step, periodic)  # saved once this step's validation and evals are logged
            return
        self._save_step(trainer, periodic)

    def on_validation_end(self, trainer, pl_module) -> None:
        # Lightning runs this after the validation's values are logged and the other callbacks' hooks (the evals):
        # the record holds them, flushed, before this step's checkpoint counts, so a kill after it loses none of them.
        pending, self._after_validation = self._after_validation, None
        if pending is not None and not trainer.sanity_checking and pending[0] == trainer.global_step:
            self._save_step(trainer, pending[1])

    def _save_step(self, trainer, periodic: bool) -> None:
        self._judge_and_save(trainer)
        if periodic and self.auto:
            self._plan_next(trainer, trainer.global_step)

    def _plan_next(self, trainer, step: int) -> None:
        """``every_n_steps=auto``: the step of the next periodic save (see the module), the same on every rank."""
        now = time.monotonic()
        since, self._since = self._since, (now, step, self.stall_seconds)
        figures = self.writer.figures()  # this save's stall; the write time of the save before it (waited for)
        stall = max(figures["stall_s"] - self.writer.last_pin_s, 0.0)
        # a step's time: the wall time since, less what training waited on saves (a wait is not a step's cost)
        per_step = (now - since[0] - (self.stall_seconds - since[2])) / max(step - since[1], 1) if since is not None else None
        wanted = torch.tensor([stall, figures["write_s"], 1.0 / per_step if per_step else 0.0], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            wanted = wanted.to(trainer.strategy.root_device)
            torch.distributed.all_reduce(wanted, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's figures
        stall, write, rate = wanted.tolist()
        if rate <= 0:  # no step timed yet (a save at the attempt's first step): the shortest interval
            self.next_auto_step = step + AUTO_STEPS
            return
        per_step = 1.0 / rate  # the fastest rank's step: the fewest steps in which the write and the stall fit
        need = max(write * 1.25 / per_step, stall / (AUTO_STALL_SHARE * per_step), AUTO_STEPS)
        interval = AUTO_STEPS * math.ceil(need / AUTO_STEPS)
        if interval != self.every_n_steps and trainer.is_global_zero:
            log.info(
                f"checkpoints: every {interval:,} steps from step {step:,} (callbacks.checkpoint.every_n_steps=auto: a save "
                f"stalls training {stall:.1f} s, its background write takes {write:.1f} s, a step {per_step:.3f} s)"
            )
        self.every_n_steps, self.next_auto_step = interval, step + interval

    def _judge_and_save(self, trainer) -> None:
        flush = getattr(trainer.lightning_module, "flush_step_stats", None)
        if flush is not None:  # judge this step's statistics before its state is kept (and marked healthy)
            flush()
        if not self.final_save_suppressed:
            self.save(trainer)

    def save_now(self, trainer) -> Path | None:
        """Save the current step now, unless it is saved already or the state is not to be kept (a diverged one), and
        wait for the write: the complete checkpoint of this step, or None (the save failed or was skipped). Called by
        every rank at the same step (the preemption's agreed decision); rank zero's verdict, once every rank's write is
        done, is every rank's (another rank, looking before rank zero had finished, said "no checkpoint")."""
        step = trainer.global_step
        if step > 0 and step != self.last_saved_step:
            self._judge_and_save(trainer)
        self.wait(raise_errors=False)
        final = self.root / ck.step_name(step)
        several = trainer.world_size > 1
        if several:
            trainer.strategy.barrier("lmtrain_save_now")
        complete = trainer.is_global_zero and step == self.last_saved_step and ck.verify(final)[0] is not None
        if several:
            complete = trainer.strategy.broadcast(complete, src=0)
        return final if complete else None

    def on_train_end(self, trainer, pl_module) -> None:
        if (
            self.save_on_train_end
            and trainer.global_step > 0
            and trainer.global_step != self.last_saved_step
            and not self.final_save_suppressed
        ):
            self.save(trainer)  # training ended some other way (an epoch limit): still keep the final state
        self.wait()
        self.writer.settle(trainer)
        for guard in self._guards:
            guard.flush_metrics(trainer)  # the last save's figures, now that it is complete

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:  # an in-flight save of an earlier step is still a good checkpoint: let it finish
            self.wait(raise_errors=False)
        except Exception:
            pass

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.wait(raise_errors=False)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"rng": every_rank_rng_state(), "wall_time": self._wall_before + time.time() - self._t_start}
        if self.auto:  # a resume keeps the plan (saved as the periodic save of the plan's step, so: the next one)
            state["auto_interval"] = self.every_n_steps
        return state

    def load_state_dict(self, state: dict) -> None:
        self._rng_to_restore = state.get("rng")
        self._wall_before = float(state.get("wall_time", 0.0))
        if self.auto and isinstance(state.get("auto_interval"), int):
            self.every_n_steps = state["auto_interval"]
        self._replan()

    def _replan(self) -> None:
        """auto, after a resume: the next save one interval (the plan the checkpoint kept) after the resumed step."""
        if self.auto and isinstance(self.last_saved_step, int):
            self.next_auto_step = self.last_saved_step + self.every_n_steps

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # the resumed step is saved already: with accumulation, the micro-batches of the next step end at that same
        # global step, and must not save it again (mid-accumulation, over the good checkpoint)
        self.last_saved_step = checkpoint.get("global_step")
        self._replan()

    # -- what other components ask (lmtrain.training.contracts.CheckpointStore) ---------------
    def describe_run(self, info: dict) -> None:
        self._run_info = dict(info)

    def record_health(self, health: dict) -> None:
        self._health = dict(health)

    def discard_current_state(self) -> None:
        self.final_save_suppressed = True

    def save_figures(self) -> dict[str, float]:
        return self.writer.figures()

    def prune(self, keep_last: int) -> list[Path]:
        return ck.prune(self.root, keep_last, self.keep_every)

    def estimate_bytes(self, trainer) -> int:
        """Bytes the next checkpoint will take: the last one's size, else parameters plus optimizer state."""
        if self.last_saved_step is not None:
            last = self.root / ck.step_name(self.last_saved_step)
            try:
                size = sum(ck.dir_files(last).values())
            except OSError:
                size = 0
            if size:  # (0: that checkpoint was pruned or moved aside)
                return size
        return state_bytes(trainer)

    # -- saving ------------------------------------------------------------------------------
    def _meta(self, trainer, step: int) -> dict:
        module, dm = trainer.lightning_module, trainer.datamodule
        counted = hasattr(module, "tokens_trained") and dm is not None and hasattr(dm, "seq_len")
        return {
            "step": step,
            "epoch": trainer.current_epoch,
            "tokens_seen": module.tokens_trained if counted else None,  # summed as trained (lmtrain.training.module)
            "samples_seen": module.samples_trained if counted else None,
            "world_size": trainer.world_size,
            "tp": Layout.of(trainer).tp,  # the ranks each layer was split over: its products stored split (resumed alike)
            "global_batch": module.samples_per_step() if counted else None,
            "format": "sharded" if self.writer.sharded else "single",
            "strategy": type(trainer.strategy).__name__,
            "wall_time": self._wall_before + time.time() - self._t_start,
            "health": dict(self._health),
            **self._run_info,
        }

    def save(self, trainer) -> bool:
        """Save a checkpoint of the current step; returns False if it was skipped or failed (training goes on). The time
        training waits here (a save still in flight, the guards, the copy or the whole write) adds to ``stall_seconds``."""
        t0 = time.perf_counter()
        self._beat()
        try:
            self.writer.wait()
            self.writer.settle(trainer)
            estimate = self.estimate_bytes(trainer)
            for guard in self._guards:
                if not guard.before_save(trainer, self, estimate):
                    return False
            step = trainer.global_step
            meta = self._meta(trainer, step)
            self.last_saved_step = step
            return self.writer.write(trainer, meta, estimate)
        finally:
            self.stall_seconds += time.perf_counter() - t0

    def wait(self, raise_errors: bool = True) -> None:
        """Block until an in-flight asynchronous save is done; count its failure."""
        self._beat()
        self.writer.wait(raise_errors)

    def _beat(self) -> None:
        for watcher in self._watchers:  # waiting on a save is progress (lmtrain.callbacks.watchdog)
            watcher.beat("save")

    # -- what the writer tells (lmtrain.training.checkpoint.writer.SaveEvents) ----------------
    def at_stage(self, stage: str, step: int, path: Path) -> None:
        for guard in self._guards:
            guard.at_save_stage(stage, step, path)

    def committed(self, trainer, final: Path, meta: dict) -> None:
        deleted = ck.prune(self.root, self.keep_last, self.keep_every, protect={meta["step"]})
        size = sum(ck.dir_files(final).values())
        for guard in self._guards:
            guard.after_save(trainer, self, final, size)
        if deleted:
            log.info(f"retention removed {', '.join(p.name for p in deleted)}")
        removed = f"; retention removed {', '.join(p.name for p in deleted)}" if deleted else ""
        logbook.append(
            self.root.parent, "checkpoint", f"saved and verified {final.name} ({size / 1e9:.3f} GB){removed}",
            step=meta["step"], tokens=meta.get("tokens_seen"), healthy=meta.get("health", {}).get("healthy"),
        )  # fmt: skip
