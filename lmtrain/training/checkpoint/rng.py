"""The RNG states a checkpoint keeps for an identical continuation (Lightning saves none): Python's, NumPy's, the
CPU's and this rank's own GPU's. Restored at the first training batch after a resume (the loader's set-up draws from
them before)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """This process's RNG states as plain Python values (bytes, ints), which every collective can pickle."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's GPU only (see _set_rng_state)
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def every_rank_rng_state() -> list[dict]:
    """Every rank's :func:`rng_state`, by rank (a collective where the run has several processes)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [rng_state()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def set_rng_state(state: dict) -> None:
    def as_tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    torch.set_rng_state(as_tensor(state["torch"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, list):
            # Saved before 2026-11-28: the state of every GPU the saving process saw. Setting them all broke a resume
            # where fewer GPUs are visible (CUDA_VISIBLE_DEVICES of a smaller node: no such device); this rank's own
            # device's state is the one its kernels drew from.
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(as_tensor(cuda))
