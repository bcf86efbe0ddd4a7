"""Mid-flight learning-rate corrections: applied at a step boundary on every rank, recorded, kept across resumes.

Sources (see lmtrain.formats.corrections): automatic rollbacks (the divergence detector), an operator
(``python -m lmtrain.control RUN_DIR lr --scale 0.5`` or ``--value 1e-4`` while the run runs; under
``scheduler=wsd`` also ``decay --steps N``: the schedule's cooldown starts now and lasts N steps, and training ends
with it, since what follows would train at the floor's learning rate), and the config
at a (re)start (``callbacks.lr_control.scale``). The learning rate used at each step is the scheduler's value
times the corrections in force at that step, so ``train/lr`` in MLflow shows the schedule the run really
followed (OPT's "empirical LR schedule"); the ``report`` callback plots it, corrections marked.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import lightning as L

from lmtrain.console import log
from lmtrain.errors import InputError
from lmtrain.formats import corrections, logbook
from lmtrain.nn.optim import WarmupStableDecay, schedule_of

REQUESTS = "control"


class LRControl(L.Callback):
    """Args:
    run_dir: the run directory (corrections file, operator requests under ``RUN_DIR/control/``).
    scale: a learning-rate factor given at (re)start; recorded when it differs from the one in force.
    poll_every: look for operator requests every this many optimizer steps (and at each attempt's first step).
    factor_bounds: ``[low, high]``: the factor on the scheduled learning rate that a request may bring about (all
        corrections in force together); a request outside is rejected.
    """

    def __init__(self, run_dir: str, scale: float | None = None, poll_every: int = 10, factor_bounds=corrections.FACTOR_BOUNDS) -> None:
        try:
            low, high = factor_bounds
        except (TypeError, ValueError):
            low = high = None
        if scale is not None and not (_number(scale) and scale > 0):
            raise InputError(f"callbacks.lr_control.scale={scale}: must be a positive factor")
        if not (isinstance(poll_every, int) and poll_every >= 1):
            raise InputError(f"callbacks.lr_control.poll_every={poll_every}: must be >= 1")
        if not (_number(low) and _number(high) and 0 < low <= 1 <= high):
            raise InputError(f"callbacks.lr_control.factor_bounds={factor_bounds}: must be [low, high] with 0 < low <= 1 <= high")
        self.run_dir, self.scale, self.poll_every = Path(run_dir), scale, poll_every
        self.bounds = (float(low), float(high))
        self.entries: list[dict] = []
        self._last_polled = -1
        self._schedule: WarmupStableDecay | None = None
        self._max_steps = 0  # trainer.max_steps as configured (an operator's decay ends training sooner: _end_with_decay)
        self._data_lead = 0  # steps a decay starts after its request is read: the loader's read-ahead, with a decay data stage

    def on_train_start(self, trainer, pl_module) -> None:
        # rank zero's reading, so that every rank applies the same corrections even while the file is being written
        self.entries = trainer.strategy.broadcast(corrections.load(self.run_dir) if trainer.is_global_zero else None, src=0)
        if bad := corrections.problems(self.entries):
            raise InputError(f"{self.run_dir / corrections.FILE}: {bad}; fix or remove that line (lmtrain's own record of the corrections)")
        self._max_steps = trainer.max_steps
        self._log_schedule_changes(trainer)
        if self.scale is not None and corrections.config_scale(self.entries) != self.scale:
            entry = {"from_step": trainer.global_step, "scale": self.scale, "reason": "config"}
            if trainer.is_global_zero:
                corrections.add(self.run_dir, entry)
                logbook.append(
                    self.run_dir,
                    "lr_correction",
                    f"config: learning rate x{self.scale} from step {trainer.global_step}",
                    step=trainer.global_step,
                )
            self.entries.append(entry)
        # the requests given while the run was stopped, judged before its first step (a decay's end, or its revocation,
        # decides whether there is a step to take)
        self._last_polled = trainer.global_step
        applied = self._poll(trainer)
        if (end := self._end_with_decay(trainer)) is not None and trainer.is_global_zero and not applied:
            log.info(f"training ends at step {end}, where the operator's decay ends (trainer.max_steps={self._max_steps})")

    def _log_schedule_changes(self, trainer) -> None:
        """A resume follows the composed config's schedule (lmtrain.nn.optim.ConfiguredLR): say what changed."""
        for cfg in trainer.lr_scheduler_configs or []:
            changes = getattr(cfg.scheduler, "changes", None)
            if changes and trainer.is_global_zero:
                what = ", ".join(
                    f"{k} {old:g} -> {new:g}" if isinstance(old, float) else f"{k} {old} -> {new}" for k, (old, new) in changes.items()
                )
                message = f"schedule: {what} at step {trainer.global_step} (the config's schedule from here on)"
                logbook.append(self.run_dir, "schedule_change", message, step=trainer.global_step, changes=changes)
                log.info(message)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step != self._last_polled and (step % self.poll_every == 0 or self._last_polled < 0):
            self._last_polled = step
            self._poll(trainer)
        mult = corrections.multiplier(self.entries, step)
        for cfg in trainer.lr_scheduler_configs or []:
            for group, lr in zip(cfg.scheduler.optimizer.param_groups, self._scheduled(cfg.scheduler)):
                group["lr"] = lr * mult
        if not trainer.lr_scheduler_configs:
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group.setdefault("lmtrain_base_lr", group["lr"])
                    group["lr"] = group["lmtrain_base_lr"] * mult

    def _scheduled(self, scheduler) -> list[float]:
        """Each group's learning rate at the scheduler's position before any correction factor: under
        ``scheduler=wsd`` with the operator's cooldown in force (the corrections file's) moved into the schedule."""
        schedule = schedule_of(scheduler)
        if not isinstance(schedule, WarmupStableDecay):
            return scheduler.get_last_lr()
        schedule.cooldown = corrections.cooldown(self.entries)
        return [base * schedule(scheduler.last_epoch) for base in scheduler.base_lrs]

    def _wsd(self, trainer) -> WarmupStableDecay | None:
        for cfg in trainer.lr_scheduler_configs or []:
            schedule = schedule_of(cfg.scheduler)
            return schedule if isinstance(schedule, WarmupStableDecay) else None
        return None

    def _scheduled_lr(self, trainer) -> float:
        """This step's learning rate before any correction (the first parameter group's)."""
        for cfg in trainer.lr_scheduler_configs or []:
            return float(self._scheduled(cfg.scheduler)[0])
        group = trainer.optimizers[0].param_groups[0]
        return float(group.get("lmtrain_base_lr", group["lr"]))

    def _poll(self, trainer) -> int:
        """Rank zero reads and checks the pending requests; every rank applies the accepted ones from this same step.
        Returns how many were."""
        step = trainer.global_step
        self._schedule = self._wsd(trainer)
        sampler = _decay_stage_sampler(trainer)
        # with data.stages' last stage begun by the decay: the decay (and the stage) start after every step whose samples
        # the loader may have drawn already: its workers' prefetch (2 batches each) and the batch the loop holds, + 1
        self._data_lead = 0 if sampler is None else 1 + -(-(2 * trainer.datamodule.num_workers + 2) // sampler.accumulate)
        accepted = self._read_requests(step, self._scheduled_lr(trainer)) if trainer.is_global_zero else None
        accepted = trainer.strategy.broadcast(accepted, src=0)
        for entry, what in accepted:
            self.entries.append(entry)
            if trainer.is_global_zero:  # from the step it applies from (a decay with a data stage: after a lead)
                corrections.add(self.run_dir, entry)
                logbook.append(self.run_dir, "lr_correction", f"operator: {what} from step {entry['from_step']}", step=step)
                log.info(f"{what} from step {entry['from_step']} (operator request)")
            if sampler is not None and entry["reason"] == "decay":  # the data's last stage with the cooldown's first step
                sampler.begin_decay(entry["from_step"] + 1)
                if trainer.is_global_zero:
                    log.info(f"data.stages: the decay's stage begins at step {entry['from_step'] + 1}")
        if accepted:
            self._end_with_decay(trainer)
        return len(accepted)

    def _end_with_decay(self, trainer) -> int | None:
        """The last step: where the operator's decay in force ends (the learning rate at its floor from there), else
        trainer.max_steps as configured (a revoked decay gives it back). The step, when a decay ends training sooner."""
        cooldown = corrections.cooldown(self.entries)
        end = min(self._max_steps, cooldown[0] + cooldown[1]) if cooldown is not None else self._max_steps
        trainer.fit_loop.epoch_loop.max_steps = end  # what trainer.max_steps reads
        return end if end < self._max_steps else None

    def _read_requests(self, step: int, scheduled: float) -> list[tuple[dict, str]]:
        """Each request file under ``control/`` judged (any bytes, any content): the accepted ones as (correction,
        words), moved to ``control/applied/``; a rejected one moved to ``control/rejected/`` with its reason in the
        logbook. Nothing here stops training."""
        folder = self.run_dir / REQUESTS
        out: list[tuple[dict, str]] = []
        entries = list(self.entries)  # with each accepted request in force, to judge the next one of this look
        for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                entry, what = self._judge(f, step, scheduled, entries)
            except _Rejected as exc:
                self._move(f, "rejected")
                message = f"operator request {f.name} rejected: {exc}"
                log.warning(message)
                logbook.append(self.run_dir, "control_rejected", message, step=step, file=f.name)
                continue
            self._move(f, "applied")
            entries.append(entry)
            out.append((entry, what))
        return out  # applied (and recorded) by _poll on every rank

    @staticmethod
    def _move(f: Path, where: str) -> None:
        try:
            (f.parent / where).mkdir(exist_ok=True)
            f.rename(f.parent / where / f.name)
        except OSError as exc:  # a full disk's rename: the file would be judged again; say so once
            log.warning(f"could not move control request {f} to {where}/: {exc}")

    def _judge(self, f: Path, step: int, scheduled: float, entries: list[dict]) -> tuple[dict, str]:
        try:
            req = json.loads(read_request(f).decode("utf-8"))
        except UnicodeDecodeError:
            raise _Rejected("not UTF-8 text") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise _Rejected(f"not a JSON object ({type(exc).__name__}: {exc})") from None
        if not isinstance(req, dict):
            raise _Rejected(f"not a JSON object but {type(req).__name__}")
        if req.get("revoke") is not None:
            return self._revoke(req, step, entries)
        if "decay_steps" in req:
            return self._decay(req, step, entries)
        given = [k for k in ("scale", "value") if req.get(k) is not None]
        if len(given) != 1:
            raise _Rejected("it must give exactly one of 'scale' and 'value' (python -m lmtrain.control RUN lr --scale F | --value LR)")
        number = req[given[0]]
        if not _number(number) or not math.isfinite(number) or not number > 0:
            raise _Rejected(f"{given[0]}={number!r} is not a finite positive number")
        if given[0] == "value" and not scheduled > 0:
            raise _Rejected(
                f"the schedule's learning rate at step {step} is {scheduled:g}: a value cannot be a factor of it (give a scale)"
            )
        in_force = corrections.multiplier(entries, step)
        total = in_force * number if given[0] == "scale" else number / scheduled
        low, high = self.bounds
        if not low <= total <= high:
            raise _Rejected(
                f"{given[0]}={number:g} would make the learning rate x{total:.4g} of the schedule ({scheduled * total:.4g} at step "
                f"{step}), outside callbacks.lr_control.factor_bounds=[{low:g}, {high:g}]"
            )
        scale = total / in_force
        what = f"learning rate x{number:g}" if given[0] == "scale" else f"learning rate set to {number:g} (x{scale:.4g})"
        return {"from_step": step, "scale": scale, "reason": "operator", "request": req}, what

    def _decay(self, req: dict, step: int, entries: list[dict]) -> tuple[dict, str]:
        """``decay --steps N``: the WSD schedule's cooldown from this step over N steps, if the run has one to start."""
        schedule, n = self._schedule, req["decay_steps"]
        if schedule is None:
            raise _Rejected("decay needs scheduler=wsd (warmup-stable-decay); this run's schedule has no decay to start")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _Rejected(f"decay_steps={n!r} is not a positive number of steps")
        step += self._data_lead  # data.stages' decay stage begins with it: after the steps the loader has drawn
        if (under_way := schedule.under_way(corrections.cooldown(entries), step)) is not None:
            raise _Rejected(under_way)
        if step + n > self._max_steps:
            raise _Rejected(
                f"a decay of {n} steps from step {step} would end at step {step + n}, after trainer.max_steps={self._max_steps}: "
                f"give at most --steps {self._max_steps - step}"
            )
        floor = schedule.min_lr_ratio
        entry = {"from_step": step, "scale": 1.0, "reason": "decay", "decay_steps": n, "request": req}
        ends = f"; training ends there, not at trainer.max_steps={self._max_steps}" if step + n < self._max_steps else ""
        return entry, f"decay over {n} steps ({schedule.decay}, to x{floor:g} of the peak at step {step + n}{ends})"

    def _revoke(self, req: dict, step: int, entries: list[dict]) -> tuple[dict, str]:
        target = req["revoke"]
        if not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < len(entries):
            raise _Rejected(
                f"revoke={target!r} is not the number of a correction (0..{len(entries) - 1}: python -m lmtrain.control RUN status)"
            )
        if target in corrections.revoked(entries):
            raise _Rejected(f"correction {target} ({corrections.describe(entries[target])}) is revoked already")
        if entries[target].get("reason") == "revoke":
            raise _Rejected(f"correction {target} is itself a revocation")
        if entries[target].get("reason") == "decay" and self._data_lead:
            raise _Rejected(
                f"correction {target} ({corrections.describe(entries[target])}) begins data.stages' last stage at step "
                f"{entries[target]['from_step'] + 1}: the data read from there cannot be taken back"
            )
        entry = {"from_step": step, "scale": 1.0, "reason": "revoke", "revokes": [target], "request": req}
        return entry, f"revoked correction {target} ({corrections.describe(entries[target])})"


def _decay_stage_sampler(trainer):
    """The training sampler when data.stages' last stage begins with the operator's decay, else None."""
    from lmtrain.data.datamodule import decay_stage

    sampler = getattr(getattr(trainer, "datamodule", None), "sampler_in_use", None)
    return sampler if sampler is not None and decay_stage(getattr(sampler, "stages", [])) else None


REQUEST_MAX_BYTES = 64 << 10  # a request is a few dozen bytes; more is not one


def read_request(f: Path) -> bytes:
    """A request file's bytes, read without ever blocking the training process: only a regular file (not a named
    pipe, a device, a socket, a directory or a symbolic link, any of which could stall rank zero's poll in ``open`` or
    ``read``), opened non-blocking, at most :data:`REQUEST_MAX_BYTES`; anything else is :class:`_Rejected`."""
    try:
        st = os.lstat(f)
    except OSError as exc:
        raise _Rejected(f"cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Rejected(f"not a regular file ({_file_kind(st.st_mode)})")
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise _Rejected(f"cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # what was opened: replaced after the lstat, it is judged again here
        if not stat.S_ISREG(st.st_mode):
            raise _Rejected(f"not a regular file ({_file_kind(st.st_mode)})")
        data = os.read(fd, REQUEST_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > REQUEST_MAX_BYTES:
        raise _Rejected(f"larger than {REQUEST_MAX_BYTES:,} bytes: not a request")
    return data


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a plain file")


class _Rejected(Exception):
    """A control request that is not applied, with the reason."""


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
