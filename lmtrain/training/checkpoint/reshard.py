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
from lmtrain.nn.model import relayout_names
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


def load_full_into_sharded(path: Path, module: torch.nn.Module, optimizers: list, split: bool = False) -> dict:
    """Load a single-file Lightning checkpoint into a sharded (FSDP2) ``module`` and its ``optimizers``; returns the
    rest of the checkpoint (loops, callbacks, schedulers...) for Lightning to restore. ``split``: the module's
    attention and MLP products are split for tensor parallelism (:func:`relayout`), the file's fused."""
    checkpoint = untrusted.torch_load(path, mmap=True, map_location="cpu")
    names = {p: n for n, p in module.named_parameters()}
    for i, (optimizer, state) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
        order = [names[p] for g in optimizer.param_groups for p in g["params"]]
        checkpoint["optimizer_states"][i] = by_name(state, relayout_names(order, split=False) if split else order)
    if split:
        checkpoint = relayout(checkpoint, split=True, cfg=module.model.cfg)
    return load_named_into_sharded(checkpoint, module, optimizers)


def load_named_into_sharded(checkpoint: dict, module: torch.nn.Module, optimizers: list) -> dict:
    """A checkpoint dict of whole tensors, its optimizer states keyed by parameter name, into a sharded ``module``
    (full state, broadcast from rank 0: each rank keeps its shard); returns the rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
    for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        set_optimizer_state_dict(module, optimizer, state, options=options)
    return checkpoint


def relayout(checkpoint: dict, split: bool, cfg) -> dict:
    """A checkpoint dict of whole tensors (its optimizer states keyed by name) with the attention's and the MLP's
    products split for tensor parallelism (``split``) or fused as every other layout holds them
    (lmtrain.nn.model.split_state, fused_state): the model's tensors and, the same way, each optimizer state's
    tensors shaped like their parameter; a scalar (a step count) is its source parameter's."""
    from lmtrain.nn.model import fused_state, split_state

    def convert(tensors: dict) -> dict:
        return split_state(tensors, cfg) if split else fused_state(tensors)

    checkpoint["state_dict"] = convert(checkpoint["state_dict"])
    states = []
    for state in checkpoint.get("optimizer_states", []):
        per = state["state"]
        order = [n for g in state["param_groups"] for n in g["params"]]
        renamed = relayout_names(order, split)
        source = _sources(order, renamed, split)
        out: dict = {n: {} for n in renamed if source[n] in per}
        for field in {f for v in per.values() for f in v}:
            shaped = {n: v[field] for n, v in per.items() if field in v and torch.is_tensor(v[field]) and v[field].dim() > 0}
            for n, t in convert(shaped).items():
                out[n][field] = t
            for n in out:  # the rest (a step count): the source parameter's, a copy each (the optimizer adds to it in place)
                if field not in out[n] and field in per[source[n]]:
                    value = per[source[n]][field]
                    out[n][field] = value.clone() if torch.is_tensor(value) else value
        states.append({"state": out, "param_groups": [{**g, "params": relayout_names(g["params"], split)} for g in state["param_groups"]]})
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = states
    return checkpoint


def _sources(order: list[str], renamed: list[str], split: bool) -> dict[str, str]:
    """Each name of ``renamed`` -> the name of ``order`` it comes from (the first part, for a fused one)."""
    if split:
        return {new: old for old in order for new in relayout_names([old], split=True)}
    out = {}
    for new in renamed:
        first = new.replace(".attn.qkv.", ".attn.q.").replace(".mlp.gate_up.", ".mlp.gate.")
        out[new] = first if first in order else new
    return out


def sharded_layout(checkpoint: dict) -> tuple[dict, dict]:
    """A Lightning checkpoint dict split as ``ModelParallelStrategy`` writes it: (the distributed part, ``state_dict``
    and ``optimizer_<i>``; the rest, saved by rank zero as ``meta.pt``). ``read_sharded`` and Lightning's
    ``load_checkpoint`` read it back."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    return tensors, rest


def read_named(path: Path) -> dict:
    """A sharded checkpoint directory as a checkpoint dict of whole tensors (in this process's memory), its optimizer
    states keyed by parameter name, as the distributed checkpoint holds them."""
    state = compat.read_distributed_checkpoint(path)
    checkpoint = untrusted.torch_load(path / METADATA_FILE, map_location="cpu")
    checkpoint["state_dict"] = state.pop("state_dict")
    keys = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.removeprefix("optimizer_")))
    checkpoint["optimizer_states"] = [state[k] for k in keys]
    return checkpoint


def saved_split(path: Path) -> bool:
    """Whether a checkpoint directory's attention and MLP products are stored split (saved with ``strategy.tp`` > 1)."""
    import json

    from lmtrain.formats import checkpoint as ck

    try:
        return int(json.loads((path / ck.META).read_text()).get("tp", 1)) > 1
    except (OSError, ValueError, TypeError):
        return False


def read_sharded(path: Path) -> dict:
    """A sharded checkpoint directory as the dict a single-file Lightning checkpoint holds (in this process's memory),
    its products fused where tensor parallelism stored them split."""
    checkpoint = read_named(path)
    if saved_split(path):  # fusing needs no shape
        checkpoint = relayout(checkpoint, split=False, cfg=None)
    checkpoint["optimizer_states"] = [by_position(s) for s in checkpoint["optimizer_states"]]
    return checkpoint


class ShardedCheckpointReader(TorchCheckpointIO):
    """Lightning's checkpoint IO for single-file strategies, which also reads a sharded checkpoint directory
    (lmtrain.training.run installs it when a ``single``/``ddp`` run resumes from an ``fsdp``/``hsdp`` one)."""

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        if Path(path).is_dir():
            return read_sharded(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
