"""The training loop's position in a checkpoint, moved to this run's layout of ranks, micro-batch size and
accumulation: a resume on another number of GPUs continues the same global data stream (lmtrain.data.datamodule's
BlockSampler knows where a global position falls in any layout)."""

from __future__ import annotations

from lmtrain.training import compat


def adapt_to_layout(checkpoint: dict, datamodule) -> dict | None:
    """Before Lightning restores its loops: when ``checkpoint`` was saved with another number of ranks, micro-batch
    size or accumulation, set the training loop's batch counters to what a run of this layout would have at the saved
    global data position, so that accumulation boundaries, the epoch's end and validation fall where they would in such
    a run. ``datamodule``: one with a ``train_sampler()`` (lmtrain.data.datamodule). Returns the saved layout when it
    changed (None otherwise)."""
    loaders = compat.loader_states(checkpoint)
    saved = compat.sampler_state(loaders[0]) if loaders else None
    if saved is None or getattr(datamodule, "train_set", None) is None:
        return None
    sampler = datamodule.train_sampler()
    mine = {"num_replicas": sampler.num_replicas, "batch_size": sampler.batch_size, "accumulate": sampler.accumulate}
    theirs = {k: saved.get(k, v) for k, v in mine.items()}  # older checkpoints: ranks only
    if theirs == mine:
        return None
    epoch, sampler.start = sampler.resume_point(saved)
    moved_on = epoch > int(saved["epoch"])  # this layout has no whole step left in the saved epoch: it ends there
    in_epoch = len(sampler) if moved_on else sampler.done_in_epoch()
    compat.set_epoch_progress(
        checkpoint, in_epoch // sampler.batch_size, int(checkpoint.get("global_step", 0)) * sampler.accumulate, last=moved_on
    )
    return theirs
