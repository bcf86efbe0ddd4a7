"""Checkpoints across layouts: a single-file checkpoint into a sharded run, and a sharded one into a single-file run.

Sharded to sharded on another number of ranks (``fsdp`` on N -> M, ``fsdp`` <-> ``hsdp``) needs nothing here: PyTorch
distributed checkpoint reshards on load (Lightning's ``ModelParallelStrategy.load_checkpoint``). The two crossings
between the formats are these:

* **single file -> sharded** (``single``/``ddp`` -> ``fsdp``/``hsdp``): every rank maps the file, and
  ``set_model_state_dict`` / ``set_optimizer_state_dict`` (full state, broadcast from rank 0) keep each rank's
  shard. The optimizer state of a plain ``torch.optim`` optimizer is keyed by each parameter's position in the
  optimizer's groups; it is re-keyed to parameter names through *this run's* optimizer, which
  ``lmtrain.nn.optim.build_optimizer`` builds in the same order from the same model. (Lightning's own re-keying
  assumes ``module.parameters()`` order, which our decay / no-decay groups do not follow.)
* **sharded -> single file** (``fsdp``/``hsdp`` -> ``single``/``ddp``): the distributed checkpoint is read whole in
  every process (no process group needed) and handed to Lightning as the dict a single-file checkpoint holds, its
  optimizer state re-keyed from names to positions by the saved groups' own order.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lmtrain.formats import untrusted
from lmtrain.training import compat

METADATA_FILE = "meta.pt"  # what Lightning's ModelParallelStrategy writes beside the shards (all but model and optimizer)


def by_name(state: dict, names: list[str]) -> dict:
    """A ``torch.optim`` state dict keyed by position -> keyed by parameter name (``names[i]`` is position ``i``)."""
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def by_position(state: dict) -> dict:
    """The reverse of :func:`by_name`, positions taken from the groups' order of names."""
    names = [n for g in state["param_groups"] for n in g["params"]]
    pos = {n: i for i, n in enumerate(names)}
    return {
        "state": {pos[n]: v for n, v in state["state"].items()},
        "param_groups": [{**g, "params": [pos[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def load_full_into_sharded(path: Path, module: torch.nn.Module, optimizers: list) -> dict:
    """Load a single-file Lightning checkpoint into a sharded (FSDP2) ``module`` and its ``optimizers``; returns the
    rest of the checkpoint (loops, callbacks, schedulers...) for Lightning to restore."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    checkpoint = untrusted.torch_load(path, mmap=True, map_location="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    names = {p: n for n, p in module.named_parameters()}
    saved = checkpoint.pop("optimizer_states", [])
    for optimizer, state in zip(optimizers, saved):
        order = [names[p] for g in optimizer.param_groups for p in g["params"]]
        set_optimizer_state_dict(module, optimizer, by_name(state, order), options=options)
    return checkpoint


def sharded_layout(checkpoint: dict) -> tuple[dict, dict]:
    """A Lightning checkpoint dict split as ``ModelParallelStrategy`` writes it: (the distributed part, ``state_dict``
    and ``optimizer_<i>``; the rest, saved by rank zero as ``meta.pt``). ``read_sharded`` and Lightning's
    ``load_checkpoint`` read it back."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    return tensors, rest


def read_sharded(path: Path) -> dict:
    """A sharded checkpoint directory as the dict a single-file Lightning checkpoint holds (in this process's memory)."""
    state = compat.read_distributed_checkpoint(path)
    checkpoint = untrusted.torch_load(path / METADATA_FILE, map_location="cpu")
    checkpoint["state_dict"] = state.pop("state_dict")
    keys = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.removeprefix("optimizer_")))
    checkpoint["optimizer_states"] = [by_position(state[k]) for k in keys]
    return checkpoint


class ShardedCheckpointReader(TorchCheckpointIO):
    """Lightning's checkpoint IO for single-file strategies, which also reads a sharded checkpoint directory
    (lmtrain.training.run installs it when a ``single``/``ddp`` run resumes from an ``fsdp``/``hsdp`` one)."""

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        if Path(path).is_dir():
            return read_sharded(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
