"""Saving and resuming, in one room of the Lightning layer (the directory format itself, which the tools read without
Lightning, is lmtrain.formats.checkpoint; when to save and what to keep is the callback, lmtrain.callbacks.checkpoint):

* :mod:`~lmtrain.training.checkpoint.writer`: writing one checkpoint (single file or sharded, synchronous or in the
  background), its commit and read-back, and counting failed saves;
* :mod:`~lmtrain.training.checkpoint.resume`: choosing and opening the checkpoint an attempt resumes from, or a
  rollback returns to; the refusal of a silent fresh start;
* :mod:`~lmtrain.training.checkpoint.intact`: a sharded checkpoint's contents check, spread over the processes;
* :mod:`~lmtrain.training.checkpoint.reshard`: a checkpoint of one layout loaded into another;
* :mod:`~lmtrain.training.checkpoint.position`: the loop's position moved to another layout of ranks and batches;
* :mod:`~lmtrain.training.checkpoint.host`: the host copy of an asynchronous save;
* :mod:`~lmtrain.training.checkpoint.rng`: the RNG states a checkpoint keeps.
"""
