"""Activation offloading (``strategy.activation_checkpointing=offload``): every block checkpointed, as ``full`` does,
and the one tensor each block then keeps for its backward pass, its input (the residual stream, batch x sequence x
width), held in host memory instead of the card's until the backward pass reaches that block. With full checkpointing
the card holds one such input per block (2 x seq x batch x d_model bytes each, in bf16), which is what bounds the
longest context at 1B-class widths; offloaded, it holds one block's full set and the inputs in flight.

How: PyTorch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, what its ``save_on_cpu`` uses)
around the model's forward pass and loss. They see every tensor the forward pass saves; the ones moved are the
residual stream's (floating point, three dimensions, the model's width last), never a weight or a buffer (the
weights each block saves for its backward pass stay on the card: FSDP has gathered them for it), nor the RNG states
checkpointing keeps. On a GPU the copy to pinned host memory runs on a side stream, so the next block computes
while its predecessor's input leaves; the copy back is on the compute stream, after that side stream's copy, when
the backward pass asks for it. On a CPU (tests) the tensor is copied to new host memory, which moves nothing but
runs the same path. torchtune's ``OffloadActivations`` does this for whole models; here only the block inputs that
full checkpointing keeps are moved, so the transfer per step is n_layers x 2 x seq x batch x d_model bytes each way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class BlockInputsToHost:
    """The saved-tensor hooks, entered around each forward pass of a model ``width`` wide with ``blocks`` blocks;
    ``moved`` counts the bytes its last forward pass sent to host memory (what the tests read)."""

    def __init__(self, width: int, blocks: int) -> None:
        self.width, self.blocks = width, blocks
        self.moved = 0
        self._stream = None
        self._packed: dict[int, tuple] = {}  # this forward pass's moved tensors: id -> (weak reference, packed)

    def _moves(self, t: torch.Tensor) -> bool:
        """A block's input: a plain floating-point tensor, batch x sequence x width, among the first ``blocks`` such
        tensors saved (fully checkpointed, each block saves its input and nothing else of that shape; the final norm
        and the head save theirs after the last block, and keep them on the card: the backward pass starts there).
        Weights and the rotary tables have two dimensions, RNG states are bytes, and DTensors (the eager head's, under
        tensor parallel) stay."""
        return (type(t) is torch.Tensor and t.dim() == 3 and t.shape[-1] == self.width and t.is_floating_point()
                and len(self._packed) < self.blocks)  # fmt: skip

    def pack(self, t: torch.Tensor):
        seen = self._packed.get(id(t))
        if seen is not None and seen[0]() is t:  # the same tensor saved twice: one copy (an id alone may be reused)
            return seen[1]
        if not self._moves(t):
            return t
        self.moved += t.numel() * t.element_size()
        if t.device.type != "cuda":
            packed = (t.device, t.to("cpu", copy=True))
            self._packed[id(t)] = (weakref.ref(t), packed)
            return packed
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self._stream)  # the card's memory is reused only after the copy has read it
        packed = (t.device, host)
        self._packed[id(t)] = (weakref.ref(t), packed)
        return packed

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        if device.type != "cuda":
            return host.to(device, copy=True)
        torch.cuda.current_stream(device).wait_stream(self._stream)  # the copy to host is done
        return host.to(device, non_blocking=True)

    def __call__(self, fn: Callable) -> Callable:
        def offloaded(*args, **kwargs):
            self.moved = 0
            try:
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    return fn(*args, **kwargs)
            finally:
                self._packed.clear()  # the graph holds what it needs

        return offloaded
