"""Profile a window of training steps with ``torch.profiler``: a trace for a viewer and a kernel summary.

Enable with ``callbacks=[default,profiler]`` (or add it to an experiment). Steps ``start_step`` to
``start_step + steps - 1`` are recorded on rank zero (or every rank with ``all_ranks``); at the end of the window it
writes ``RUN_DIR/profile/trace_rankN.json`` (chrome://tracing or Perfetto) and ``summary_rankN.txt``: the operators
and kernels by device time, and how busy the device was: the union of its kernel intervals over the window's wall
time. A device idle for a large share of the window means the host, not the GPU, sets the pace.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch

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


def summarize(prof, wall_us: float, steps: int, cuda: bool, label: str, row_limit: int = 30) -> tuple[str, str]:
    """(one line: time per step and, on a GPU, how busy the device was; the operators/kernels table) of a profile."""
    head = f"{label}: {wall_us / steps / 1e3:.2f} ms per step"
    if cuda:
        busy, frac = busy_fraction(prof.events(), wall_us)
        head += f"; device busy {busy / steps / 1e3:.2f} ms per step ({frac:.1%} of the wall time)"
    table = prof.key_averages().table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=row_limit)
    return head, table


class StepProfiler(L.Callback):
    """Args:
    start_step: first optimizer step recorded (after compilation and warm-up).
    steps: how many steps.
    row_limit: rows of the summary table.
    all_ranks: record on every rank, not only rank zero.
    python: also profile the host's Python code over the window with cProfile (``python_rankN.txt``, by own time):
        where a host-bound step spends its time.
    """

    def __init__(self, start_step: int = 20, steps: int = 5, row_limit: int = 30, all_ranks: bool = False, python: bool = False) -> None:
        if start_step < 0 or steps < 1:
            from lmtrain.errors import InputError

            raise InputError(f"callbacks.profiler: start_step={start_step} must be >= 0 and steps={steps} >= 1")
        self.start_step, self.steps, self.row_limit, self.all_ranks = start_step, steps, row_limit, all_ranks
        self.python = python
        self._prof = None
        self._py = None
        self._t0 = 0.0
        self.summary_path: Path | None = None

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._prof is not None or trainer.global_step != self.start_step or not (self.all_ranks or trainer.is_global_zero):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._sync(pl_module)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self._prof.__enter__()
        if self.python:
            import cProfile

            self._py = cProfile.Profile()
            self._py.enable()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is None or trainer.global_step < self.start_step + self.steps:
            return
        self._sync(pl_module)
        wall_us = (time.perf_counter() - self._t0) * 1e6
        if self._py is not None:
            self._py.disable()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        rank = trainer.global_rank
        label = f"steps {self.start_step}..{self.start_step + self.steps - 1} on rank {rank}"
        head, table = summarize(prof, wall_us, self.steps, pl_module.device.type == "cuda", label, self.row_limit)
        py, self._py = self._py, None
        out = Path(trainer.default_root_dir) / "profile"  # the run directory
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
