"""Every private PyTorch and Lightning attribute lmtrain reads or writes on objects it does not own, in one place.

Each function says what it touches and why no public API does the job. ``tests/test_compat.py`` exercises each one
on real objects of the pinned versions (torch 2.13.0, lightning 2.6.6), and checks the private members that our
subclasses of Lightning classes build on (:data:`SUBCLASS_PRIVATES`): an upgrade that renames one fails there, by
name, rather than somewhere inside a run.
"""

from __future__ import annotations

import gc
import logging

import torch

from lmtrain.formats import untrusted

# Private members of Lightning classes that lmtrain's subclasses use (class -> members), checked by tests/test_compat.py.
SUBCLASS_PRIVATES = {
    "lightning.pytorch.strategies.ModelParallelStrategy": ("_setup_distributed", "_device_mesh"),  # lmtrain.training.strategies
    "lightning.pytorch.loggers.MLFlowLogger": ("_tracking_uri", "_experiment_name", "_initialized", "_run_id"),  # lmtrain.training.loggers
    "lightning.pytorch.profilers.PyTorchProfiler": ("_recording_map", "_delete_profilers"),  # lmtrain.callbacks.profiler
}


def step_number(trainer) -> int:
    """The number of the optimizer step the current training batch belongs to, counted from 1 as checkpoints, the
    console and the logbook count them (the 250th step is step 250): ``fit_loop.epoch_loop._batches_that_stepped``,
    the steps completed before this batch, plus one. ``global_step`` cannot say it from a batch's hooks: it counts the
    step only once the optimizer has run, and an accumulating micro-batch has none."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped + 1


def ends_optimizer_step(trainer) -> bool:
    """Whether the current training micro-batch is the last of its optimizer step (its backward pass is followed by the
    optimizer's step): ``fit_loop.epoch_loop._should_accumulate()``, which Lightning asks there itself; no public API
    says it before the step."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def validates_after_this_batch(trainer) -> bool:
    """Whether Lightning will run its scheduled validation right after the current training batch's end hooks: its own
    decision (``fit_loop.epoch_loop._should_check_val_fx`` and ``_skip_next_val``), asked with ``should_stop`` cleared,
    because a stop requested at this step adds a validation of its own that lmtrain does not run
    (:func:`skip_validation_after_this_batch`). No public API says whether a validation follows."""
    loop = trainer.fit_loop.epoch_loop
    if loop._skip_next_val or not trainer.training:
        return False
    stop, trainer.should_stop = trainer.should_stop, False
    try:
        return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    finally:
        trainer.should_stop = stop


def skip_validation_after_this_batch(trainer) -> None:
    """No validation after the current training batch (``fit_loop.epoch_loop._skip_next_val``, which Lightning itself
    sets when a resume lands after a validation): a stop requested at a step runs none (Lightning would run one)."""
    trainer.fit_loop.epoch_loop._skip_next_val = True


def dump_checkpoint(trainer) -> dict:
    """The full training state as Lightning would save it (``trainer._checkpoint_connector.dump_checkpoint``): our
    checkpointer writes it itself (atomic directories, verification, async, sharded layouts), and
    ``trainer.save_checkpoint`` would also write the file. A collective under sharded strategies: every rank calls it."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The loss scale as a device tensor (``GradScaler._scale``): ``get_scale()`` syncs the host every step."""
    return scaler._scale


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict:
    """``{device: flag}`` recorded by ``unscale_`` for this optimizer's step (``GradScaler._per_optimizer_states``):
    whether the scaler will skip the update, without a host sync; empty before ``unscale_``."""
    return scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})


def set_module_device_mesh(lightning_module, mesh) -> None:
    """Give the LightningModule our 2-D HSDP mesh (``LightningModule._device_mesh``, what its public ``device_mesh``
    returns; Lightning's ModelParallelStrategy sets it only for the mesh it builds itself)."""
    lightning_module._device_mesh = mesh


def config_node(cfg, key):
    """A child of an OmegaConf node as a node, without resolving its interpolations (``DictConfig._get_node``):
    walking a config for unknown keys must not fail on a ``${...}`` that only resolves later (``???`` values, the
    run-name resolver)."""
    return cfg._get_node(key)


def forget_mesh_groups() -> int:
    """Drop every live ``DeviceMesh``'s references to its process groups (``DeviceMesh._pg_registry``), after
    ``destroy_process_group``: DTensor's caches keep meshes alive until the interpreter finalizes, and a gloo group
    freed there aborts the process (train.py's ``_close_process_group``). Returns how many meshes held groups."""
    from torch.distributed.device_mesh import DeviceMesh

    held = 0
    for mesh in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:  # isinstance warns on torch's opaque objects
        if mesh._pg_registry:
            held += 1
            mesh._pg_registry.clear()
    return held


def saves_sharded(strategy) -> bool:
    """Whether the strategy writes a sharded (distributed) checkpoint: the ``save_distributed_checkpoint`` argument of
    ``ModelParallelStrategy`` and the ``state_dict_type`` of ``FSDPStrategy``, kept only in private fields
    (``_save_distributed_checkpoint``, ``_state_dict_type``)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return bool(strategy._save_distributed_checkpoint)
    if isinstance(strategy, FSDPStrategy):
        return strategy._state_dict_type == "sharded"
    return False


def checkpoint_wrapper(module: torch.nn.Module, keep_products: bool = False) -> torch.nn.Module:
    """Activation checkpointing of one block, as FSDP2 composes with it: ``checkpoint_wrapper`` lives in the private
    module ``torch.distributed.algorithms._checkpoint`` (torchtitan uses it the same way); the RNG state is kept so
    that dropout replays identically. ``keep_products``: selective checkpointing by operator (PyTorch's public
    ``create_selective_checkpoint_contexts``): the outputs of the matrix products and of attention are kept, the
    rest of the block (norms, activation functions, rotary embedding, dropout, residual adds) is recomputed in the
    backward pass (lmtrain.training.strategies, ``activation_checkpointing=op``)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if not keep_products:
        return wrap(module, preserve_rng_state=True)
    logging.getLogger("torch._higher_order_ops.wrap").addFilter(_drop_in_place_advice)  # once: a filter is added once
    return wrap(module, preserve_rng_state=True, context_fn=partial(create_selective_checkpoint_contexts, keep_products_policy))


IN_PLACE_ADVICE = "context_fn is passed to torch.utils.checkpoint under torch.compile"


def _drop_in_place_advice(record: logging.LogRecord) -> bool:
    """Drops the warning torch logs, once per process and so once per rank, when a compiled block is checkpointed with
    a policy: "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile. Please make sure the
    checkpointed region does not contain in-place ops". Our blocks write into nothing the policy keeps and into none
    of their inputs (tests/test_compat.py checks both block families, with dropout and float8), so it is not the
    user's to act on."""
    return IN_PLACE_ADVICE not in record.getMessage()


def _kept_ops() -> frozenset:
    aten = torch.ops.aten
    names = (
        "mm", "addmm", "bmm", "_scaled_mm",  # the linear layers (bf16 and torchao's float8) and batched products
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )  # fmt: skip
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return frozenset(ops | ({flex} if flex is not None else set()))


def keep_products_policy(ctx, op, *args, **kwargs):
    """The selective checkpointing policy of ``checkpoint_wrapper(keep_products=True)``: keep what the products and
    attention computed, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _KEPT:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_KEPT = _kept_ops()


def loader_states(checkpoint: dict) -> list:
    """The train loaders' saved states in a Lightning checkpoint (``loops.fit_loop.state_dict.combined_loader``: the
    fit loop keeps them in its private state), one per loader; empty when there are none."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    return list((fit.get("state_dict") or {}).get("combined_loader") or [])


def sampler_state(loader_state: dict) -> dict | None:
    """The sampler's own state inside a torchdata ``StatefulDataLoader`` state: at ``_sampler_iter_state.sampler_state``
    without loader workers, under ``_snapshot._main_snapshot`` with them (torchdata's private layout)."""
    if not isinstance(loader_state, dict):
        return None
    main = (loader_state.get("_snapshot") or {}).get("_main_snapshot") or loader_state
    it = main.get("_sampler_iter_state") if isinstance(main, dict) else None
    return it.get("sampler_state") if isinstance(it, dict) else None


def set_epoch_progress(checkpoint: dict, in_epoch: int, total: int, last: bool) -> None:
    """Set the fit loop's saved batch counters (``epoch_loop.batch_progress``: micro-batches of this rank in the current
    epoch and since the start) to ``in_epoch`` and ``total``, keeping each field's offset from ``ready`` (a checkpoint
    taken at a batch's end has ``completed`` one behind). Lightning derives accumulation boundaries, the epoch's end and
    validation from them; a resume on another number of ranks sets them to that layout's (data.datamodule)."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for key, value in (("current", in_epoch), ("total", total)):
        fields = progress[key]
        ready = fields["ready"]
        for name in fields:
            fields[name] = max(0, value - (ready - fields[name]))
    progress["is_last_batch"] = bool(last)


def read_distributed_checkpoint(path) -> dict:
    """A whole distributed checkpoint read into this process, without a process group or a model to load into: the
    state rebuilt from the checkpoint's own metadata (``_EmptyStateDictLoadPlanner`` and ``_load_state_dict`` of
    ``torch.distributed.checkpoint``, what torch's public ``dcp_to_torch_save`` does before writing a file; the public
    ``load`` fills a copy of the dict it is given, so an empty dict stays empty)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=untrusted.safe_reader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def dtensor_around(local: torch.Tensor, like):
    """A ``DTensor`` of ``like``'s layout (mesh, placements, global shape) whose local tensor is ``local``, wherever
    ``local`` is: the DTensor constructor with ``like._spec``. ``DTensor.from_local`` moves ``local`` to the mesh's
    device, which for an asynchronous save's host copy put the whole state back on the GPU (callbacks.checkpoint)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the tensor this rank holds, the first and end row of it in the whole one): a ``DTensor`` sharded on its
    first dimension (FSDP2's layout) by ``compute_local_shape_and_global_offset``, the private function DTensor itself
    uses (no public API tells a shard's place); a plain tensor is all its rows."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, 0, tensor.shape[0] if tensor.dim() else 1
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(f"a DTensor sharded on more than its first dimension ({tensor.placements})")
    return local, offset[0] if offset else 0, (offset[0] if offset else 0) + (shape[0] if shape else 1)


def awaited_loader_worker(thread_id: int) -> dict | None:
    """The loader worker process that thread ``thread_id`` waits for a batch from, or None when it waits for none: the
    thread's frames searched for a multi-process loader iterator (torch's ``_MultiProcessingDataLoaderIter``, torchdata's
    ``_StatefulMultiProcessingDataLoaderIter``), whose private bookkeeping says which task comes next (``_rcvd_idx``),
    which worker has it while it has not arrived (``_task_info[idx] == (worker_id,)``) and the worker processes
    (``_workers``). No public API names the worker a loader waits on."""
    import sys

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        it = frame.f_locals.get("self")
        if type(it).__name__.endswith("MultiProcessingDataLoaderIter"):
            tasks = getattr(it, "_task_info", None)  # None while the iterator is being built
            info = tasks.get(it._rcvd_idx) if tasks is not None else None
            if info is None or len(info) != 1:  # no task sent, or it arrived and waits to be yielded
                return None
            worker = info[0]
            process = it._workers[worker]
            return {"worker": worker, "pid": process.pid, "alive": process.is_alive(), "batch": it._rcvd_idx}
        frame = frame.f_back
    return None


def dead_loader_workers(exc: BaseException) -> list[dict]:
    """The loader worker processes found dead from the frames of ``exc``'s traceback (a multi-process loader iterator's
    ``_workers``, as in :func:`awaited_loader_worker`), each ``{"worker", "pid", "exitcode"}``: PyTorch reports a
    worker's death one of several ways depending on which of its checks sees it first (a killed-by-signal error, an
    "exited unexpectedly" error, or the pipe's ``ConnectionResetError``). Workers ended by the loader's own shutdown
    (SIGTERM) are left out while another died otherwise."""
    import signal

    found: list[dict] = []
    tb = exc.__traceback__
    while tb is not None:
        it = tb.tb_frame.f_locals.get("self")
        if type(it).__name__.endswith("MultiProcessingDataLoaderIter"):
            for i, w in enumerate(getattr(it, "_workers", None) or []):
                code = w.exitcode
                if code is not None and code != 0:
                    found.append({"worker": i, "pid": w.pid, "exitcode": code})
            break
        tb = tb.tb_next
    others = [f for f in found if f["exitcode"] != -signal.SIGTERM]
    return others or found


def compile_callbacks():
    """``torch.compile``'s compilation callbacks (``torch._dynamo.callback.callback_handler``: its start callbacks run
    when a compilation begins, a backward compiled at its first call and CUDA graph recording included, its end
    callbacks when it ends), or None on a PyTorch without them. No public API says when compilation happens."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    return callback_handler if hasattr(callback_handler, "register_start_callback") else None
