"""Profile a window of training steps: Lightning's ``PyTorchProfiler`` (``torch.profiler`` under a schedule, with
Lightning's hooks as named ranges), plus what it lacks: how busy the device was, and the host's Python over the
same window.

Enable with ``callbacks=[default,profiler]`` (or add it to an experiment): the run hands it to the Trainer as its
``profiler`` (lmtrain.training.run; a Lightning profiler, not a callback). Training steps ``start_step`` to
``start_step + steps - 1`` (counted in optimizer steps) are recorded on rank zero (or every rank with
``all_ranks``); at the end of the window it writes ``RUN_DIR/profile/trace_rankN.json`` (chrome://tracing or
Perfetto) and ``summary_rankN.txt``: the time per step, the operators and kernels by device time, and how busy the
device was: the union of its kernel intervals over the window. A device idle for a large share of the window means
the host, not the GPU, sets the pace. With ``python`` the host's Python is profiled with cProfile over the window
(``python_rankN.txt``); Lightning's ``AdvancedProfiler`` profiles every hook for the whole run instead.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.profilers import PyTorchProfiler
from torch.profiler import ProfilerAction

from lmtrain.console import log


def busy_fraction(events, wall_us: float) -> tuple[float, float]:
    """(device-busy microseconds, fraction of ``wall_us``): the union of the device kernels' time intervals."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)  # a record_function range drawn on the GPU timeline: not work
        and e.time_range.end > e.time_range.start
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy, (busy / wall_us if wall_us > 0 else 0.0)


def window_wall_us(events) -> float:
    """The recorded window's wall time, from the profile itself: the first ``ProfilerStep#`` range's start to the end
    of the last range or of the last device kernel (the device may finish after the host). The profiler's own start
    and stop, and writing its trace, fall outside it."""
    steps = [e for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep*" in the event list
    if not steps:
        return 0.0
    kernels = [e.time_range.end for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return max([e.time_range.end for e in steps] + kernels) - min(e.time_range.start for e in steps)


def summarize(prof, wall_us: float, steps: int, cuda: bool, label: str, row_limit: int = 30) -> tuple[str, str]:
    """(one line: time per step and, on a GPU, how busy the device was; the operators/kernels table) of a profile."""
    head = f"{label}: {wall_us / steps / 1e3:.2f} ms per step"
    if cuda:
        busy, frac = busy_fraction(prof.events(), wall_us)
        head += f"; device busy {busy / steps / 1e3:.2f} ms per step ({frac:.1%} of the wall time)"
    table = prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=row_limit)
    return head, table


class StepProfiler(PyTorchProfiler):
    """Args:
    start_step: first optimizer step recorded (after compilation and warm-up).
    steps: how many steps.
    row_limit: rows of the summary table.
    all_ranks: record on every rank, not only rank zero.
    python: also profile the host's Python code over the window with cProfile (``python_rankN.txt``, by own time):
        where a host-bound step spends its time.
    """

    def __init__(self, start_step: int = 20, steps: int = 5, row_limit: int = 30, all_ranks: bool = False, python: bool = False) -> None:
        # no per-module ranges: forward hooks on every module would slow every step of the run, not only the window
        # (built before the check below: Lightning's __del__ tears down whatever was constructed, even a refused one)
        super().__init__(row_limit=row_limit, record_module_names=False, schedule=self._window, on_trace_ready=self._write)
        if start_step < 1 or steps < 1:  # the profiler starts with the first step: it can record from the second
            from lmtrain.errors import InputError

            raise InputError(f"callbacks.profiler: start_step={start_step} must be >= 1 and steps={steps} >= 1")
        self.start_step, self.steps, self.all_ranks, self.python, self.row_limit = start_step, steps, all_ranks, python, row_limit
        self._py = None
        self._done = False  # its last interval has begun
        self._written = False  # its trace is written
        self._micro_steps = 0  # training steps ended so far
        self.summary_path: Path | None = None

    # -- the window -----------------------------------------------------------------------------------
    def _trainer(self):
        return self._lightning_module.trainer if self._lightning_module is not None else None

    def _bounds(self) -> tuple[int, int] | None:
        """(first, last) training step of the window, counted as Lightning's profiler counts them (micro-batches),
        or None where this rank records nothing."""
        trainer = self._trainer()
        if trainer is None or not (self.all_ranks or trainer.is_global_zero):
            return None
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        return self.start_step * accumulate, (self.start_step + self.steps) * accumulate - 1

    def _near(self) -> bool:
        """Lightning's profiler runs only around the window: left open for the whole run (ranges around every hook) it
        slowed the steps outside the window measurably on a host-bound run (docs/BENCHMARKS.md)."""
        if self._written:  # every hook of the rest of the run asks: answered without looking at the trainer
            return False
        bounds = self._bounds()
        return bounds is not None and self._micro_steps >= bounds[0] - 2

    def start(self, action_name: str) -> None:
        if self._near():
            super().start(action_name)

    def stop(self, action_name: str) -> None:
        """Lightning stops a step's range here, then steps the profiler, which asks the window (``_window``) what to do
        next. Training steps are counted here; the Python profile ends with the window's last step, before the
        profiler stops and writes its trace; once written, the profiler is closed for the rest of the run."""
        if action_name.endswith("training_step"):
            self._micro_steps += 1
            if self._py is not None and self._done:
                self._py.disable()
        elif any(action_name.endswith(f) for f in self.STEP_FUNCTIONS):
            # a validation (test, predict) step only closes its range: it does not step the window, which it falls in
            rec = self._recording_map.pop(action_name, None)  # the ranges Lightning's profiler keeps open (compat)
            if rec is not None:
                rec.__exit__(None, None, None)
            return
        if self.profiler is None:
            return
        super().stop(action_name)
        if self._written:
            for name in list(self._recording_map):  # the window's ranges still open (the hooks around this step)
                self._recording_map.pop(name).__exit__(None, None, None)
            self._delete_profilers()

    def _window(self, _num_step: int) -> ProfilerAction:
        """What the interval about to run is: the window counts optimizer steps, on the ranks asked for; a validation
        inside the window is recorded with it."""
        bounds = self._bounds()
        if bounds is None or self._micro_steps == 0:
            return ProfilerAction.NONE  # also the constructor's probe call
        first, last = bounds
        step = self._micro_steps  # the interval about to run follows this many training steps
        if self._done or step < first - 1 or (step == first - 1 and first < 2):
            return ProfilerAction.NONE
        if step == first - 1:
            return ProfilerAction.WARMUP  # the tracer starts up outside the window
        if self.python and self._py is None:
            import cProfile

            self._py = cProfile.Profile()
            self._py.enable()
        if step < last:
            return ProfilerAction.RECORD
        self._done = True  # the last interval: recorded, then saved at the next step
        return ProfilerAction.RECORD_AND_SAVE

    def _device_type(self) -> str:
        return self._lightning_module.device.type if self._lightning_module is not None else "cpu"

    # -- what Lightning's profiler lacks: device-busy time, the Python profile, one summary file per rank --
    def _write(self, prof) -> None:
        self._written = True
        cuda = self._device_type() == "cuda"
        wall_us = window_wall_us(prof.events())
        py, self._py = self._py, None
        if py is not None:
            py.disable()
        trainer = self._trainer()
        rank = trainer.global_rank if trainer is not None else 0
        label = f"steps {self.start_step}..{self.start_step + self.steps - 1} on rank {rank}"
        head, table = summarize(prof, wall_us, self.steps, cuda, label, self.row_limit)
        out = Path(trainer.default_root_dir if trainer is not None else ".") / "profile"  # the run directory
        try:
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
            self.summary_path = out / f"summary_rank{rank}.txt"
            self.summary_path.write_text(head + "\n\n" + table + "\n")
            if py is not None:
                import io
                import pstats

                buf = io.StringIO()
                stats = pstats.Stats(py, stream=buf)
                stats.sort_stats("tottime").print_stats(self.row_limit)
                stats.sort_stats("cumulative").print_stats(self.row_limit)
                (out / f"python_rank{rank}.txt").write_text(buf.getvalue())
        except OSError as exc:  # a profile is not worth the run (a full disk is the disk guard's business)
            log.info(f"profile: {head}; could not write it to {out}: {exc.strerror or exc}")
            return
        log.info(f"profile: {head}; written to {out}")

    def summary(self) -> str:
        """Nothing more at the end of fit: the window's table is in ``summary_rankN.txt`` already."""
        self._delete_profilers()
        return ""
