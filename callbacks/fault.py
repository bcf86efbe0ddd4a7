"""Fault injection for tests and drills (the ``fault`` config group; real runs leave it off).

Kinds, each firing once per run directory (a marker under ``RUN_DIR/.faults/`` is written first, so the
resumed run goes on):

Steps are numbered as checkpoints number them: step 5 is the 5th optimizer step (4 done before it).

* ``crash``: the process is killed (SIGKILL, as by a node failure) at the start of optimizer step ``step``, once
  the checkpoint writes in flight are complete: a crash between saves, the same whatever the machine's load (an
  asynchronous save still being written when the kill came left the test's expected checkpoint incomplete under
  the full suite's load); a crash during a save is ``crash_mid_save``;
* ``crash_mid_save``: killed while writing the first checkpoint at or after ``step``, after its files and
  before its completion (``meta.json``, rename);
* ``crash_after_save``: killed right after the first checkpoint at or after ``step`` is complete (renamed into
  place), before anything else of that step (its logbook entry, retention, the step's later values);
* ``enospc``: the first save at or after ``step`` fails with ENOSPC (no space left on device);
* ``truncate``: the first checkpoint at or after ``step`` has its largest file cut in half right after it is
  written (the post-save verification must catch it);
* ``loss_spike``: the loss of each of ``count`` steps from ``step`` on is multiplied by ``factor`` (a real spike:
  the gradients follow; the same batch computed again in that step spikes again, as the data or the model would make
  it); the preset's ``count`` of 5 persists long enough for the detector to act, ``count=1`` is a blip it lets pass;
* ``nan_loss``: the loss of step ``step`` becomes NaN on rank ``rank`` only (again if that step is computed again: the
  data or the model's doing);
* ``sdc``: silent data corruption, a hardware fault: in rank ``rank``'s first forward pass of each of ``count`` steps from
  ``step`` on, one value
  of the last block's output has its exponent's bits all set (a non-finite number, as a flipped bit on a failing card
  makes); the same batch computed again is right (the divergence detector's rerun names the rank);
* ``act_growth``: from step ``step`` on, the last block's output is multiplied by ``factor`` ** (steps since);
* ``hang``: rank ``rank`` stops at the start of optimizer step ``step`` and never goes on (a rank stuck outside any
  collective: the others wait for it in the next one), for the watchdog (lmtrain.callbacks.watchdog) to catch;
* ``slow_rank``: from optimizer step ``step`` on, rank ``rank``'s forward passes take ``factor`` times as long (it
  waits out the difference after each, on a GPU after the device has run it): a slow GPU or a busy host, for the
  straggler check (lmtrain.callbacks.stragglers) to name;
* ``grad_overflow``: for ``count`` steps from ``step`` on, the gradient flowing back into the final norm is
  multiplied by ``factor`` (the forward pass and the loss are untouched): under fp16 the backward pass really
  overflows, as it does when the loss scale is too high for the gradients, and the gradient scaler answers;
* ``bad_data``: for ``count`` steps from ``step`` on, every micro-batch is the same tokens shuffled into a random
  order (a corrupt stretch of data: real tokens of the corpus, no text): the model really sees it, and its loss and
  gradients answer as they would (the detector's events of a data-driven blip, docs/stability.md).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch

from lmtrain.console import log
from lmtrain.errors import InputError
from lmtrain.training import compat
from lmtrain.training.contracts import CheckpointStore, SaveGuard

KINDS = (
    "crash", "crash_mid_save", "crash_after_save", "enospc", "truncate", "loss_spike", "nan_loss", "sdc", "act_growth", "grad_overflow",
    "hang", "slow_rank", "bad_data",
)  # fmt: skip


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` on the way back."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _scale_losses(trainer, pl_module, factor: float) -> None:
    """Every loss the module computes in the current optimizer step (its micro-batches, and the same batches computed
    again before its update) multiplied by ``factor``: the module's ``loss`` wrapped on the instance until the step
    is over, so the gradients follow; nothing of the drill lives in LMModule."""
    step = compat.step_number(trainer)

    def scaled(*args):
        if compat.step_number(trainer) != step:  # the step is over: the class's method again
            del pl_module.loss
            return pl_module.loss(*args)
        return type(pl_module).loss(pl_module, *args) * factor

    pl_module.loss = scaled


def _flip_one_value(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first value's exponent bits all set (infinite or NaN), as a flipped bit on a failing card leaves
    it; the gradient flows to the others as if they had been computed so."""
    as_int, mask = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00)}[x.dtype]
    bad = (x.detach().reshape(-1)[:1].clone().view(as_int) | mask).view(x.dtype)
    where = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    where.view(-1)[0] = True
    return torch.where(where, bad, x)


def _shuffle_tokens(batch) -> None:
    """The micro-batch's tokens in a random order, in place: inputs and their next-token targets stay aligned, so the
    loss is that of a corrupt stretch of text (the document ids of ``data.document_mask``, if any, are left as they were)."""
    inputs, targets = batch[0], batch[1]
    stream = torch.cat([inputs, targets[:, -1:]], dim=1)  # each row's T + 1 tokens
    shuffled = stream.flatten()[torch.randperm(stream.numel(), device=stream.device)].view_as(stream)
    inputs.copy_(shuffled[:, :-1])
    targets.copy_(shuffled[:, 1:])


class FaultInjector(L.Callback, SaveGuard):
    def __init__(self, kind: str, step: int, run_dir: str, rank: int | None = 0, factor: float = 20.0, count: int = 1) -> None:
        if kind not in KINDS:
            raise InputError(f"fault.kind={kind!r}: use one of {list(KINDS)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InputError(f"fault.count={count!r} must be a whole number of steps >= 1")
        self.kind, self.step, self.rank, self.factor, self.count = kind, int(step), rank, float(factor), count
        self._growth_from: int | None = None
        self._sdc_step: int | None = None
        self._sdc_on = False
        self._sdc_hook = None
        self._batch_started: float | None = None
        self.marker = Path(run_dir) / ".faults" / f"{kind}-{self.step}"

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._global_rank = trainer.global_rank

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.kind == "sdc" and self._sdc_hook is None:
            # one hook for the run, there before anything is compiled, switched on for a step's first forward pass:
            # a hook prepended and removed mid-run broke torch 2.11's compiled-graph guards (on the GPU)
            self._sdc_hook = pl_module.model.norm.register_forward_pre_hook(
                lambda module, args: (_flip_one_value(args[0]), *args[1:]) if self._sdc_on and module.training else None
            )

    def _arm(self) -> bool:
        """True (once per run directory, on the chosen rank) when the fault should fire now."""
        if self.marker.exists() or (self.rank is not None and self._global_rank != self.rank):
            return False
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        with open(self.marker, "w") as fh:
            fh.write("fired\n")
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def _kill(self, what: str) -> None:
        log.info(f"FAULT: killing the process ({what})")
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = compat.step_number(trainer)  # the step this batch starts: the N-th is step N, as checkpoints count
        self._batch_started = time.perf_counter()
        if self.kind == "crash" and step >= self.step and self._arm():
            for store in (cb for cb in trainer.callbacks if isinstance(cb, CheckpointStore)):
                store.wait(raise_errors=False)  # between saves: the one in flight finished first
            self._kill(f"crash at step {step}")
        if self.kind == "hang" and step >= self.step and self._arm():
            log.info(f"FAULT: rank {trainer.global_rank} hangs at step {step}")
            while True:  # noqa: ASYNC110 - the drill: a rank that never goes on
                time.sleep(1.0)
        if self.kind == "nan_loss" and step == self.step and self._arm():
            _scale_losses(trainer, pl_module, float("nan"))
            log.info(f"FAULT: nan_loss at step {step} on rank {trainer.global_rank}")
        if self.kind == "loss_spike" and self._in_stretch(step, f"loss_spike x{self.factor:g} on rank {trainer.global_rank}"):
            _scale_losses(trainer, pl_module, self.factor)
        if self.kind == "sdc" and self._sdc_step != step and self._in_stretch(step, f"silent data corruption on rank {trainer.global_rank}"):
            self._sdc_step = step  # the step's first forward pass only: switched off before its backward pass (on_before_backward)
            self._sdc_on = True
        if self.kind == "act_growth" and step == self.step and self._growth_from is None and self._arm():
            self._growth_from = step
            pl_module.model.norm.register_forward_pre_hook(
                lambda module, args: (args[0] * self.factor ** (compat.step_number(trainer) - self._growth_from + 1),), prepend=True
            )
            log.info(f"FAULT: activations growing x{self.factor} per step from step {step}")

        if self.kind == "slow_rank" and step >= self.step and self._growth_from is None and self._arm():
            self._growth_from = step
            self._slow_down(pl_module.model)
            log.info(f"FAULT: rank {trainer.global_rank}'s forward passes x{self.factor:g} as long from step {step}")

        if self.kind == "grad_overflow" and step == self.step and self._arm():
            end = step + self.count
            pl_module.model.norm.register_forward_pre_hook(
                lambda module, args: (_ScaleGrad.apply(args[0], self.factor),) if compat.step_number(trainer) < end and module.training else None
            )
            log.info(f"FAULT: gradients x{self.factor:g} in steps {step}..{end - 1}")

        if self.kind == "bad_data" and self._in_stretch(step, "bad data (shuffled tokens)"):  # every micro-batch
            _shuffle_tokens(batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._sdc_on = False  # once: the same batch computed again (before the update) is right

    def _in_stretch(self, step: int, what: str) -> bool:
        """Whether ``step`` is one of the ``count`` steps from ``step`` on that the drill acts in: from the one that
        armed it (once per run directory, said there) to the stretch's end."""
        if not self.step <= step < self.step + self.count:
            return False
        if self._growth_from is None and self._arm():
            self._growth_from = step
            log.info(f"FAULT: {what} in steps {step}..{self.step + self.count - 1}")
        return self._growth_from is not None

    def _slow_down(self, model: torch.nn.Module) -> None:
        """The forward pass (this micro-batch's start to the final norm) held back to ``factor`` times its time."""

        def after(module, args, output):
            if module.training and self._batch_started is not None:
                if output.is_cuda:
                    torch.cuda.synchronize(output.device)
                time.sleep((self.factor - 1) * (time.perf_counter() - self._batch_started))

        model.norm.register_forward_hook(after)

    def at_save_stage(self, point: str, step: int, path: Path) -> None:
        if step < self.step:
            return
        if self.kind == "enospc" and point == "save_start" and self._arm():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if self.kind == "crash_mid_save" and point == "before_commit" and self._arm():
            self._kill(f"crash while saving step {step}")
        if self.kind == "crash_after_save" and point == "after_commit" and self._arm():
            self._kill(f"crash right after saving step {step}")
        if self.kind == "truncate" and point == "after_commit" and self._arm():
            files = [p for p in path.rglob("*") if p.is_file() and p.name != "meta.json"]
            victim = max(files, key=lambda p: p.stat().st_size)
            os.truncate(victim, victim.stat().st_size // 2)
            log.info(f"FAULT: truncated {victim}")
