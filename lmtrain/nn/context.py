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
        from torch.distributed._functional_collectives import all_gather_single_autograd

        moved = t.movedim(dim, 0).contiguous()  # PyTorch's autograd all-gather concatenates along the first dimension
        return all_gather_single_autograd(moved, 0, self.group).movedim(0, dim)


class ContextSplit:
    """What attention receives in place of a mask under context parallel: the group whose keys and values it gathers
    and the mask of this rank's queries against every gathered key, (B or 1, 1, T / size, T) booleans."""

    def __init__(self, cp: ContextParallel, mask: torch.Tensor) -> None:
        self.cp, self.mask = cp, mask
