"""Choosing and opening the checkpoint an attempt resumes from: ``ckpt_path``, else the newest usable one of the run
(damaged ones passed over and moved aside), never a silent fresh start of a run that saved steps before, and the
model identity a checkpoint recorded (compared by lmtrain.training.run before the attempt is accepted)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from lmtrain.console import launched_rank, log
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook, untrusted
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.training.config import ConfigError, world_size


def resume_point(cfg: DictConfig, root: Path | None, check=lambda c: True) -> ck.Checkpoint | None:
    """Where training continues from: ``ckpt_path``, else (``resume=true``) the newest complete checkpoint under
    ``root`` (the run's checkpoint directory; None: the run keeps no checkpoints) whose contents are those saved, read
    here where ``check(c)`` (:func:`checked_here`), else left to a later check.

    With ``resume=false`` a run whose checkpoint directory already holds checkpoints is refused unless
    ``overwrite=true``, which deletes them. Decided before any expensive work.
    """
    if cfg.get("ckpt_path"):
        return open_checkpoint(Path(cfg.ckpt_path), check=check)
    if root is None:
        return None
    if cfg.get("resume", True):
        found = ck.newest_intact(ck.scan(root), move_aside=launched_rank() == 0, contents=lambda c: ck.damage(c, crc=check(c)))
        if found is None:
            refuse_fresh_start(cfg, root)
        return found
    existing = [d for d in root.iterdir() if ck.NAME_RE.match(d.name)] if root.is_dir() else []
    if existing and not cfg.get("overwrite", False):
        raise ConfigError(
            f"resume=false but {root} already holds {len(existing)} checkpoint(s) of run '{cfg.run_name}' "
            f"(newest {max(existing).name}): pass resume=true to continue it, overwrite=true to delete them and start "
            "fresh, or choose another run_name"
        )
    if existing and launched_rank() == 0:
        import shutil

        log.info(f"overwrite=true: deleting {len(existing)} checkpoint(s) in {root}")
        for d in existing:
            shutil.rmtree(d, ignore_errors=True)
        (root / ck.LATEST).unlink(missing_ok=True)
    return None


def refuse_fresh_start(cfg: DictConfig, root: Path) -> None:
    """A run that saved steps before but has no usable checkpoint now is refused, naming each checkpoint and why it is
    not usable (or the logbook's saves, where the checkpoint directory is gone): training it from step 0 would discard
    its progress and, through the loggers, its metrics. A fresh start is asked for with ``resume=false overwrite=true``.
    A save that did not finish (``.step-N.partial``: killed during the run's first save) saved nothing: that run
    starts from step 0 (:func:`unfinished_saves` names it for the logbook; the checkpointer removes it)."""
    found = [(name, why) for name, why in ck.inventory(root) if not ck.is_partial(name)]
    saved = logbook.saved_steps(Path(cfg.run_dir))
    if not found and not saved:
        return  # nothing was ever saved (an unfinished save is not a checkpoint): the run starts from step 0
    lines = [f"{name}: {why}" for name, why in found]
    if saved and not any(ck.NAME_RE.match(name) for name, _ in found):
        where = "holds none" if root.is_dir() else "does not exist (moved or deleted?)"
        lines.append(f"the logbook records checkpoints saved up to step {max(saved)}, but {root} {where}")
    raise CheckpointError(
        f"run '{cfg.run_name}' saved steps before but has no usable checkpoint, so it was not started (nothing was changed "
        f"but damaged checkpoints moved aside):\n  - " + "\n  - ".join(lines) + f"\nrestore a checkpoint into {root} (or "
        "resume from one elsewhere with ckpt_path=...), or start the run again from step 0: resume=false overwrite=true"
    )


def unfinished_saves(root: Path | None) -> list[int]:
    """The steps of the saves under ``root`` that did not finish (``.step-N.partial``), oldest first."""
    if root is None or not root.is_dir():
        return []
    return sorted(int(m.group(1)) for d in root.iterdir() if (m := ck.PARTIAL_RE.match(d.name)))


def checked_here(cfg: DictConfig):
    """Whether this process checks a checkpoint's contents before the launch (a predicate on the checkpoint): all of
    them in a one-process run and every single file; a sharded one resumed by several processes is checked spread
    over them once their process group is up (lmtrain.training.checkpoint.intact)."""
    processes = world_size(cfg)
    return lambda c: ck.checked_by_each_process(c, processes)


def open_checkpoint(path: Path, check=lambda c: True) -> ck.Checkpoint:
    """A user-named checkpoint: a ``step-N`` directory (or its ``checkpoint.pt``), or a plain Lightning ``.ckpt``."""
    if path.is_file() and path.name == ck.SINGLE_FILE and (path.parent / ck.META).exists():
        path = path.parent
    if path.is_dir():
        checkpoint, why = ck.verified(path, check)
        if checkpoint is None:
            raise CheckpointError(f"ckpt_path={path} is not a usable checkpoint: {why}")
        return checkpoint
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={path} does not exist")
    return ck.Checkpoint(-1, path, {"format": "lightning-file"})


def resume_identity(resume: ck.Checkpoint) -> dict:
    """The saved model identity: from ``meta.json``, or read from a plain Lightning file's state dict."""
    if resume.meta.get("format") != "lightning-file":
        return resume.meta
    try:
        sd = untrusted.torch_load(resume.path, map_location="cpu", mmap=True)["state_dict"]
    except untrusted.RefusedFile:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise CheckpointError(f"ckpt_path={resume.path} is not a readable Lightning checkpoint ({type(exc).__name__}: {exc})") from None
    return {"params": {k.removeprefix("model."): list(v.shape) for k, v in sd.items() if hasattr(v, "shape")}}


def rollback_target(trainer, root: Path, before: int) -> tuple[ck.Checkpoint | None, str | None]:
    """(the checkpoint a rollback returns to, None): the newest healthy one of ``root`` saved before step ``before``
    whose contents are those saved (a damaged one passed over, naming it), or (None, why there is none). A collective
    where the checkpoints are sharded over several processes: each is checked spread over them (every process is
    here at the same step: the statistics that decided the rollback are reduced over the run), and the next attempt
    does not check it again."""
    from lmtrain.training.checkpoint.intact import spread_contents

    healthy = [c for c in ck.scan(root, quiet=True) if c.step < before and c.meta.get("health", {}).get("healthy", True)]
    if not healthy:
        return None, f"no healthy checkpoint before step {before} to roll back to"

    def contents(c: ck.Checkpoint) -> str | None:
        if ck.checked_by_each_process(c, trainer.world_size):
            return ck.damage(c)
        return spread_contents(trainer, c) or ck.unreadable(c)

    target = ck.newest_intact(healthy, contents=contents, skipping="rollback: passing over damaged checkpoint")
    return (target, None) if target is not None else (None, f"every healthy checkpoint before step {before} is damaged")
