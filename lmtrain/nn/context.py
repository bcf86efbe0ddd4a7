"""Context parallel (``strategy.cp``, lmtrain.training.assemble): the sequence split over a group of ranks, attention
gathering the whole sequence's keys and values. Pure PyTorch (its functional collectives); imported by the model,
so it keeps to what every process loads anyway."""

from __future__ import annotations

import torch


class ContextParallel:
    """Context parallel (``strategy.cp``): each of ``size`` ranks computes a part of every sequence, and attention
    gathers the keys and values of the whole sequence from the group (all-gather, as Llama 3 was trained: any mask,
    the document mask included, stays exact, since each rank's queries see every key). The sequence is cut into
    ``2 x size`` chunks and rank ``r`` takes chunks ``r`` and ``2 size - 1 - r``, so that under the causal mask every
    rank has the same work (the head-tail balance of torchtitan's and Megatron's context parallel)."""

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def index(self, T: int, device, rank: int | None = None) -> torch.Tensor:
        """The positions of this rank's tokens (``rank``'s), in the order it holds them."""
        if T % (2 * self.size):
            chunks = 2 * self.size
            raise ValueError(f"context parallel over {self.size} ranks cuts a sequence into {chunks} chunks: {T} tokens do not divide")
        r, chunk = self.rank if rank is None else rank, T // (2 * self.size)
        first = torch.arange(r * chunk, (r + 1) * chunk, device=device)
        return torch.cat([first, torch.arange((2 * self.size - 1 - r) * chunk, (2 * self.size - r) * chunk, device=device)])

    def key_index(self, T: int, device) -> torch.Tensor:
        """The positions of the gathered keys: every rank's tokens, rank after rank."""
        return torch.cat([self.index(T, device, r) for r in range(self.size)])

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t`` of every rank of the group, concatenated along ``dim`` in rank order; its gradient goes back to each
        rank's part summed over the group (a reduce-scatter)."""
        moved = t.movedim(dim, 0).contiguous()  # the all-gather concatenates along the first dimension
        return _GatherSequence.apply(moved, self.group).movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the first dimension, its gradient the reduce-scatter (sum) of the incoming one, each collective
    complete before its result is handed on (PyTorch's functional collectives: traceable by torch.compile).

    Not PyTorch's ``all_gather_single_autograd``, which returns the output while the collective still writes it and
    attaches its autograd history meanwhile. Under gloo the group's worker thread writes that output by ``copy_``
    into views of it, racing the calling thread's autograd bookkeeping on the same tensor: it corrupted the heap
    (``malloc(): unaligned tcache chunk detected``, ``munmap_chunk(): invalid pointer``, SIGSEGV) in 2 of 8 CPU launches
    of 4 ranks at fsdp 2 x cp 2 for 60 steps; with the gather waited for here, none in 24 (CI had failed twice on it)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        ctx.group = group
        return funcol.wait_tensor(funcol.all_gather_tensor(t, 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, ctx.group)), None


class ContextSplit:
    """What attention receives in place of a mask under context parallel: the group whose keys and values it gathers
    and the mask of this rank's queries against every gathered key, (B or 1, 1, T / size, T) booleans."""

    def __init__(self, cp: ContextParallel, mask: torch.Tensor) -> None:
        self.cp, self.mask = cp, mask
