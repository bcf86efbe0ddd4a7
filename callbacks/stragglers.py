"""Stragglers named during the run: the rank that every other rank waits for, with its host and device.

In synchronous data-parallel training every rank's step takes as long as the slowest rank's: the others wait for it
in the gradient collectives. So a rank's step time does not say who is slow; what it did on its own before its
first collective does. Every ``every_n_steps`` optimizer steps each rank hands rank zero three means per step of
the window:

* ``forward``: the forward pass to the loss (``on_train_batch_start`` to ``on_before_backward``), which under ``ddp``
  and ``single`` holds no collective, and under ``fsdp``/``hsdp`` only the parameter all-gathers, which are
  prefetched on their own stream: a slow GPU or a busy host shows here. On a GPU it is measured on the device (CUDA
  events read at the window's end, no synchronization per step), on the CPU by the host's clock;
* ``data wait``: from the end of one micro-batch to the start of the next (the loader's fetch, and the callbacks
  between): a slow disk, a starved loader;
* ``step``: the micro-batches' own time, waits for the other ranks included (logged, not judged).

A rank whose forward pass is more than ``margin`` slower than the median of the other ranks', or whose data wait
exceeds theirs by more than ``margin`` of the median step, for ``windows`` windows in a row, gets one ``straggler``
alert in the logbook (rank, host, device, the figures); it is named again only after a window where it kept up.
Each window also logs the skew: ``perf/step_time_max_rank``, ``perf/step_time_max_s``, ``perf/step_time_median_s``
and the same for ``forward_time`` and ``data_wait``.
"""

from __future__ import annotations

import socket
import statistics
import time

import lightning as L
import torch

from lmtrain.errors import InputError
from lmtrain.training.contracts import CheckpointStore
from lmtrain.training.health import every_rank
from lmtrain.training.logs import log_direct

FIGURES = ("forward_time", "data_wait", "step_time")


class Stragglers(L.Callback):
    """Args:
    run_dir: the run directory (its logbook).
    every_n_steps: optimizer steps per window; null turns the check off.
    margin: how much slower than the other ranks' median counts as slow (0.2: 20%).
    windows: windows in a row a rank must be slow to be named.
    """

    def __init__(self, run_dir: str, every_n_steps: int | None = 50, margin: float = 0.2, windows: int = 3) -> None:
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        if (
            not (every_n_steps is None or whole(every_n_steps))
            or not whole(windows)
            or not (isinstance(margin, int | float) and not isinstance(margin, bool) and margin > 0)
        ):
            raise InputError(
                f"callbacks.stragglers: every_n_steps={every_n_steps!r} must be a whole number >= 1 or null (off), "
                f"windows={windows!r} a whole number >= 1 and margin={margin!r} a share > 0 (0.2: 20% slower)"
            )
        self.run_dir, self.every_n_steps, self.margin, self.windows = run_dir, every_n_steps, float(margin), windows
        self._ranks: list[dict] = []  # per rank: host, device (on_train_start)
        self._slow_for: dict[int, int] = {}  # rank -> windows in a row it was slow (rank zero)
        self.named: list[dict] = []  # the straggler entries written (rank zero; tests read them in-process)
        self.last_window: dict | None = None  # the last window's figures per rank (rank zero)
        self._batch_start: float | None = None
        self._batch_end: float | None = None  # the previous micro-batch's end (None: the first, or after validation)
        self._window_start_step: int | None = None  # None: the attempt's first step (compilation) is not measured
        self._checkpointer: CheckpointStore | None = None
        self._reset()

    def _reset(self) -> None:
        self._forward_s = self._data_s = self._step_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event | None]] = []
        self._saves_s = self._checkpointer.stall_seconds if self._checkpointer is not None else 0.0

    # -- measuring -------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if self.every_n_steps is None:
            return
        device = pl_module.device
        me = {"host": socket.gethostname(), "device": str(device)}
        if device.type == "cuda":
            me["device"] += f" ({torch.cuda.get_device_name(device)})"
        self._ranks = every_rank(me)
        self._checkpointer = next((c for c in trainer.callbacks if isinstance(c, CheckpointStore)), None)
        self._batch_start = self._batch_end = self._window_start_step = None
        self._initial_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.every_n_steps is None:
            return
        now = time.perf_counter()
        if self._batch_end is not None:
            self._data_s += now - self._batch_end
        self._batch_start = now
        if pl_module.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.every_n_steps is None or self._batch_start is None:
            return
        if self._events and self._events[-1][1] is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._forward_s += time.perf_counter() - self._batch_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps is None or self._batch_start is None:
            return
        now = time.perf_counter()
        self._step_s += now - self._batch_start
        self._batch_end, self._batch_start = now, None
        step = trainer.global_step
        if self._window_start_step is None:  # the attempt's first step: compilation, warm-up
            if step > self._initial_step:
                self._window_start_step = step
                self._reset()
            return
        if step == self._window_start_step or step % self.every_n_steps:  # accumulating, or inside the window
            return
        self._window(trainer, pl_module, step)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._batch_end = None  # validation is no data wait

    # -- the window ------------------------------------------------------------------------------
    def _window(self, trainer, pl_module, step: int) -> None:
        steps = max(step - self._window_start_step, 1)
        forward = self._forward_s
        timed = [(start, end) for start, end in self._events if end is not None]
        if timed:
            timed[-1][1].synchronize()  # the window's last forward pass has run on the device
            forward += sum(start.elapsed_time(end) / 1e3 for start, end in timed)
        # the time this rank waited on its own checkpoint saves (rank zero writes a single-file one alone) is no data wait
        saves = (self._checkpointer.stall_seconds if self._checkpointer is not None else 0.0) - self._saves_s
        mine = torch.tensor([forward / steps, max(self._data_s - saves, 0.0) / steps, self._step_s / steps], dtype=torch.float64)
        first_step = self._window_start_step + 1
        self._reset()
        self._window_start_step = step
        gathered = trainer.strategy.all_gather(mine.to(pl_module.device))  # (world, 3); (3,) on one device
        if not trainer.is_global_zero:
            return
        table = gathered.reshape(-1, len(FIGURES)).cpu().tolist()
        self.last_window = {"steps": (first_step, step), "ranks": table}
        metrics = {}
        for i, name in enumerate(FIGURES):
            column = [row[i] for row in table]
            worst = max(range(len(column)), key=column.__getitem__)
            metrics |= {
                f"perf/{name}_max_rank": worst,
                f"perf/{name}_max_s": column[worst],
                f"perf/{name}_median_s": statistics.median(column),
            }
        log_direct(trainer, metrics, step=step)
        if len(table) > 1:
            self._judge(table, first_step, step)

    def _judge(self, table: list[list[float]], first: int, last: int) -> None:
        step_median = statistics.median(row[2] for row in table)
        for rank, (forward, data, step_s) in enumerate(table):
            others = [row for r, row in enumerate(table) if r != rank]
            forward_m = statistics.median(row[0] for row in others)
            data_m = statistics.median(row[1] for row in others)
            why = []
            if forward > (1 + self.margin) * forward_m:
                why.append(f"forward {forward:.4g} s against {forward_m:.4g} s (x{forward / max(forward_m, 1e-12):.2f})")
            if data - data_m > self.margin * step_median:
                why.append(f"data wait {data:.4g} s against {data_m:.4g} s")
            if not why:
                self._slow_for.pop(rank, None)
                continue
            self._slow_for[rank] = self._slow_for.get(rank, 0) + 1
            if self._slow_for[rank] == self.windows:
                self._name(rank, why, step_s, step_median, first, last)

    def _name(self, rank: int, why: list[str], step_s: float, step_median: float, first: int, last: int) -> None:
        from lmtrain.formats import logbook

        where = self._ranks[rank] if rank < len(self._ranks) else {"host": "?", "device": "?"}
        message = (
            f"straggler: rank {rank} on {where['host']} ({where['device']}) was slower than the other ranks for "
            f"{self.windows} windows of {self.every_n_steps} steps in a row (to step {last}): {'; '.join(why)}, per step; "
            f"every rank's step took {step_median:.4g} s (the others wait for it in the collectives)"
        )
        entry = {"rank": rank, "host": where["host"], "device": where["device"], "step": last, "first_step": first}
        self.named.append(entry)
        logbook.alert(self.run_dir, "straggler", message, **entry)
