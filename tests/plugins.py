"""Small real callbacks that tests plug in through `_target_`, as a user would."""

from __future__ import annotations

import lightning as L
import torch

from lmtrain.callbacks.evals import DownstreamEvals
from lmtrain.training.contracts import SaveGuard


def damage_in_place(path) -> None:
    """Zero 64 bytes in the middle of the file at ``path`` in place: bit rot, the size kept (never truncated)."""
    from pathlib import Path

    path = Path(path)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(64))


class FailAtStep(L.Callback):
    """Raise at the start of optimizer step ``step`` (a crash inside training), on every rank or on ``rank`` only."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            raise RuntimeError(f"injected failure at step {self.step} on rank {trainer.global_rank}")


class DamageCheckpoint(L.Callback):
    """At the start of optimizer step ``at``, zero 64 bytes in the middle of checkpoint ``step``'s ``file`` in place
    (its size kept): bit rot between a save and its use."""

    def __init__(self, dirpath: str, step: int, at: int, file: str = "checkpoint.pt") -> None:
        self.dirpath, self.step, self.at, self.file = dirpath, step, at, file

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from pathlib import Path

        from lmtrain.callbacks.checkpoint import Checkpointer  # the class Hydra instantiates
        from lmtrain.formats import checkpoint as ck

        if trainer.global_step != self.at or not trainer.is_global_zero:
            return
        (saver,) = [cb for cb in trainer.callbacks if isinstance(cb, Checkpointer)]
        saver.wait()  # an asynchronous save of that checkpoint may still be writing, checksumming or reading it back
        damage_in_place(Path(self.dirpath) / ck.step_name(self.step) / self.file)


class RecordCudaContexts(L.Callback):
    """When fit ends (after the last save's write), write the GPUs on which this rank's process holds a CUDA context
    to ``dirpath/cuda-contexts-RANK.json``: its own GPU only, or it takes memory on another rank's."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def teardown(self, trainer, pl_module, stage) -> None:
        import json
        from pathlib import Path

        from lmtrain.callbacks.checkpoint import Checkpointer

        for cb in trainer.callbacks:
            if isinstance(cb, Checkpointer):
                cb.wait(raise_errors=False)
        opened = [i for i in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(i)]
        record = {"rank": trainer.global_rank, "device": torch.cuda.current_device(), "contexts": opened}
        Path(self.dirpath).mkdir(parents=True, exist_ok=True)
        (Path(self.dirpath) / f"cuda-contexts-{trainer.global_rank}.json").write_text(json.dumps(record))


class LimitHostMemory(L.Callback):
    """From the end of optimizer step ``step`` (before that step's checkpoint) to the start of the next, this process
    may map only ``margin_mb`` more memory than it has (RLIMIT_AS): an allocation beyond that fails, as on a host
    out of memory. On ``rank`` only, or every rank."""

    def __init__(self, step: int, margin_mb: int, rank: int | None = None) -> None:
        self.step, self.margin_mb, self.rank = step, margin_mb, rank
        self.saved = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import resource

        if trainer.global_step != self.step or self.rank not in (None, trainer.global_rank):
            return
        with open("/proc/self/status") as f:
            (vm_kb,) = [int(line.split()[1]) for line in f if line.startswith("VmSize:")]
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_kb * 1024 + self.margin_mb * 2**20, self.saved[1]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import resource

        if self.saved is not None:
            resource.setrlimit(resource.RLIMIT_AS, self.saved)
            self.saved = None


class RecordBatches(L.Callback):
    """Save every training step's input batch, keyed by global step, to ``path`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.batches: dict[int, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches[trainer.global_step] = batch[0].clone()

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        torch.save(self.batches, self.path)


class RecordLR(L.Callback):
    """Write every step's learning rate, as this rank's optimizer uses it (read as it steps), to ``{path}.rank{R}.json``
    at the end, merged over the attempts of a run (a rollback's replay overwrites the steps it repeats)."""

    def __init__(self, path: str) -> None:
        self.path, self.lrs = path, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs[str(trainer.global_step)] = optimizer.param_groups[0]["lr"]

    def on_train_end(self, trainer, pl_module) -> None:
        import json
        from pathlib import Path

        path = Path(f"{self.path}.rank{trainer.global_rank}.json")
        earlier = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**earlier, **self.lrs}))


class RecordOneDNN(L.Callback):
    """Whether oneDNN was enabled at every training step (``seen``), in this process."""

    seen: list[bool] = []

    def __init__(self) -> None:
        RecordOneDNN.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import torch

        RecordOneDNN.seen.append(torch.backends.mkldnn.enabled)


class OperatorAt(L.Callback):
    """Act as an operator: run ``python -m lmtrain.control RUN_DIR lr --scale S`` (or ``--value V``, or ``decay --steps
    N``) in-process when step ``step`` is done, once per run directory (a replay after a rollback does not ask again)."""

    def __init__(
        self, run_dir: str, step: int, scale: float | None = None, value: float | None = None, decay_steps: int | None = None
    ) -> None:
        self.run_dir, self.step, self.scale, self.value, self.decay_steps = run_dir, step, scale, value, decay_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from pathlib import Path

        marker = Path(self.run_dir) / f".operator-asked-{self.step}"
        if trainer.global_step == self.step and trainer.is_global_zero and not marker.exists():
            from lmtrain.control import main

            marker.touch()
            if self.decay_steps is not None:
                assert main([self.run_dir, "decay", "--steps", str(self.decay_steps)]) == 0
                return
            what = ["--scale", str(self.scale)] if self.scale is not None else ["--value", str(self.value)]
            assert main([self.run_dir, "lr", *what]) == 0


class RecordScale(L.Callback):
    """Write, per rank, the fp16 gradient scaler's scale after every optimizer step to ``{path}.rank{R}.json``
    (merged over the attempts of a run: a rollback's replay overwrites the steps it repeats)."""

    def __init__(self, path: str) -> None:
        self.path, self.scales = path, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales[trainer.global_step] = trainer.precision_plugin.scaler.get_scale()

    def on_train_end(self, trainer, pl_module) -> None:
        import json
        from pathlib import Path

        path = Path(f"{self.path}.rank{trainer.global_rank}.json")
        earlier = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**earlier, **{str(k): v for k, v in self.scales.items()}}))


class PendingStats(L.Callback):
    """Record, at the end of every batch, how many steps' statistics wait to be read by the host (``path``: JSON)."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(len(pl_module._pending_stats))

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        with open(self.path, "w") as fh:
            json.dump(self.seen, fh)


class GCState(L.Callback):
    """Record, at every training batch, whether Python's automatic garbage collection is on, and which
    generations the collector scanned at which step (``gc.callbacks``), into ``path`` as JSON at the end."""

    def __init__(self, path: str) -> None:
        self.path, self.enabled, self.events, self._trainer = path, [], [], None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.events.append([self._trainer.global_step, info["generation"]])

    def on_train_start(self, trainer, pl_module) -> None:
        import gc

        self._trainer = trainer
        gc.callbacks.append(self._on_gc)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import gc

        self.enabled.append(gc.isenabled())

    def teardown(self, trainer, pl_module, stage: str) -> None:
        import gc
        import json

        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        with open(self.path, "w") as fh:
            json.dump({"enabled": self.enabled, "events": self.events}, fh)


class GradientsAtBatchStart(L.Callback):
    """Record, at the start of every training batch, whether any parameter holds a gradient; written to ``path``
    (a JSON list) when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(any(p.grad is not None for p in pl_module.parameters()))

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        with open(self.path, "w") as f:
            json.dump(self.seen, f)


class SleepIn(L.Callback):
    """Sleeps ``seconds`` in one Lightning hook (``on_before_backward``: inside a step; ``on_validation_start``: in a
    validation), to check where the goodput clock puts known time."""

    def __init__(self, hook: str, seconds: float) -> None:
        import time

        setattr(self, hook, lambda *args, **kwargs: time.sleep(seconds))


class SlowSave(L.Callback, SaveGuard):
    """A save guard that takes ``seconds`` before every save: time training waits on the checkpointer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def before_save(self, trainer, checkpointer, estimate: int) -> bool:
        import time

        time.sleep(self.seconds)
        return True


class RecordSamples(L.Callback):
    """Write every micro-batch's input rows this rank trained on, with the optimizer step they went into, to
    ``{path}.rank{R}.pt`` when training ends: ``[(step, rows), ...]``."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rows.append((trainer.global_step, batch[0].clone()))

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        torch.save(self.rows, f"{self.path}.rank{trainer.global_rank}.pt")


class BagOfWords(torch.nn.Module):
    """A (B, T) -> (B, T, V) network that is not lmtrain's Decoder (no document ids, no positions)."""

    def __init__(self, vocab_size: int = 4096, width: int = 16) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(vocab_size, width), torch.nn.Linear(width, vocab_size)

    def forward(self, idx):
        return self.out(self.emb(idx))


class StallPreemptionSave(L.Callback):
    """Sleep a minute while a preemption's checkpoint is collected (Lightning's ``on_save_checkpoint``, once a signal
    was received): a second Ctrl-C then always arrives while the first one's save is still in progress."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        import time

        from lmtrain.training.contracts import Preempts

        if any(getattr(c, "requested", None) for c in trainer.callbacks if isinstance(c, Preempts)):
            time.sleep(60)


class FillDisk(L.Callback):
    """At the start of optimizer step ``step`` (rank zero, once per ``path``), write zeros to ``path`` until the
    filesystem is full (ENOSPC): a real full disk from that moment on, until the test removes the file."""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import errno
        import os

        if trainer.global_step != self.step or not trainer.is_global_zero or os.path.exists(self.path):
            return
        block = bytes(1 << 16)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(block) == 1:
                        break
                    block = bytes(len(block) // 2)
        finally:
            os.close(fd)


class SlowSaveStart(L.Callback, SaveGuard):
    """Each save waits ``seconds`` once its partial folder exists, before writing: a window in which the chaos soak
    (tests/soak.py) fills the disk during a save."""

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds

    def at_save_stage(self, stage: str, step: int, path) -> None:
        import time

        if stage == "save_start":
            time.sleep(self.seconds)


class SlowSteps(L.Callback):
    """Sleep ``seconds`` at the start of every optimizer step: a pace at which the chaos soak's events fall inside
    training (the numbers are those of a run without it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import time

        time.sleep(self.seconds)


class SlowWriteSteps(L.Callback, SaveGuard):
    """Each save's write (in its background thread, once its partial folder exists) takes ``steps`` times the mean
    training step this callback has timed so far: a write as slow against the steps whatever the machine's load."""

    def __init__(self, steps: float) -> None:
        self.steps, self._times, self._start = steps, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import time

        self._start = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        if self._start is not None and trainer.global_step > 1:
            self._times.append(time.monotonic() - self._start)

    def at_save_stage(self, stage: str, step: int, path) -> None:
        import time

        if stage == "save_start" and self._times:
            time.sleep(self.steps * sum(self._times) / len(self._times))


class SlowEvals(DownstreamEvals):
    """The downstream evals, each evaluation ``seconds`` longer: a known time for goodput's ``evals`` part."""

    def __init__(self, *args, seconds: float = 0.2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def _evaluate(self, trainer, pl_module):
        import time

        time.sleep(self.seconds)
        return super()._evaluate(trainer, pl_module)
