"""``lmtrain doctor`` at the start of training (``callbacks=[default,doctor]``): every rank's matrix-product rate and
memory bandwidth, and the all-reduce bus bandwidth within and across the nodes, measured once the process group is up
and before the model is built (lmtrain.training.health), and the run's own record of each device's hardware faults (a
restart on the card that stopped the run is stopped here). The table goes to the console and the logbook (a ``doctor`` entry); a
figure out of bounds stops the job before its expensive part, with the figures in one line and exit status 3."""

from __future__ import annotations

import lightning as L
import torch

from lmtrain.errors import InputError, RunStopped


class Doctor(L.Callback):
    """Args (as ``lmtrain doctor``'s options): min_share, min_card_share, min_busbw_gbps (null: no floor), seconds
    (of each timed loop)."""

    def __init__(
        self, run_dir: str, min_share: float = 0.8, min_card_share: float = 0.5, min_busbw_gbps: float | None = None, seconds: float = 1.0
    ) -> None:
        def share(v) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1

        positive = isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds > 0
        floor_ok = min_busbw_gbps is None or (
            isinstance(min_busbw_gbps, int | float) and not isinstance(min_busbw_gbps, bool) and min_busbw_gbps > 0
        )
        if not (share(min_share) and share(min_card_share) and positive and floor_ok):
            raise InputError(
                f"callbacks.doctor: min_share={min_share!r} and min_card_share={min_card_share!r} must be shares in (0, 1], "
                f"seconds={seconds!r} > 0 and min_busbw_gbps={min_busbw_gbps!r} null or GB/s > 0"
            )
        self.run_dir, self.min_share, self.min_card_share = run_dir, float(min_share), float(min_card_share)
        self.min_busbw = None if min_busbw_gbps is None else float(min_busbw_gbps) * 1e9
        self.seconds = float(seconds)
        self.result: dict | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.result is not None:  # once per run, not again after a rollback's new attempt
            return
        from lmtrain.console import log
        from lmtrain.formats import logbook
        from lmtrain.training import health

        device = trainer.strategy.root_device
        self.result = health.examine(
            device, self.min_share, self.min_card_share, self.min_busbw, self.seconds, node=trainer.node_rank, run_dir=self.run_dir
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        flags = self.result["flags"]
        if trainer.is_global_zero:
            text = health.table(self.result)
            log.info(f"doctor:\n{text}")
            figures = {"ranks": self.result["ranks"], "allreduce": self.result["allreduce"]}
            if flags:
                logbook.alert(self.run_dir, "doctor", f"doctor: {'; '.join(flags)}", said=True, **figures)
            else:
                logbook.append(self.run_dir, "doctor", text.splitlines()[-1], **figures)
        if flags:
            raise RunStopped(f"doctor: {'; '.join(flags)} (lmtrain doctor; the job did not start)")
