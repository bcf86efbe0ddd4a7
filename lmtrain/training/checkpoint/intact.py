"""The contents check of a sharded checkpoint that several processes resume from, spread over them.

One process resuming checks every file's CRC-32 before the load (lmtrain.training.run.resume_point), and so does each
process of a run resuming from a single file, which each of them reads whole anyway. A sharded checkpoint resumed by
N processes would be read N times over that way; instead each process checks every N-th file once the process group
is up (Lightning's ``setup`` hook comes before the checkpoint is restored), and they agree. On damage, every process
that found it names the file, rank zero moves the checkpoint aside (lmtrain.formats.checkpoint.quarantine) when the
run picked it itself, and every process raises the same error: the next start resumes from the checkpoint before.
A rollback's choice among a run's checkpoints (lmtrain.callbacks.divergence) uses the same check, passing over a
damaged one to the one before.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lmtrain.console import log
from lmtrain.formats import checkpoint as ck


def spread_contents(trainer, c: ck.Checkpoint) -> str | None:
    """The contents check of ``c`` spread over the run's processes, a collective (every process calls it together):
    each reads every N-th file, names what it finds damaged, and they agree. None when every file is intact."""
    crcs = c.meta.get("crc32") or {}
    mine = sorted(crcs)[trainer.global_rank :: trainer.world_size]
    why = ck.verify_contents(c.path, {"crc32": {f: crcs[f] for f in mine}})
    if why is not None:
        log.warning(f"rank {trainer.global_rank}: checkpoint {c.path}: {why}")
    if trainer.strategy.reduce_boolean_decision(why is None, all=True):
        return None
    return why or "its contents are damaged (the file is named by the rank that read it)"


class SpreadContentsCheck(Callback):
    def __init__(self, resume: ck.Checkpoint, move_aside: bool) -> None:
        self.resume, self.move_aside = resume, move_aside

    def setup(self, trainer, pl_module, stage: str) -> None:
        if spread_contents(trainer, self.resume) is None:
            return
        where = ""
        if self.move_aside:
            if trainer.is_global_zero:
                ck.quarantine(self.resume.path)
            where = "; moved aside: the next start resumes from the checkpoint before it"
        raise ck.CheckpointError(f"checkpoint {self.resume.path} is damaged (the file is named above by the rank that read it){where}")
