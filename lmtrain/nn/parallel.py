"""Tensor parallelism's pieces that PyTorch lacks, for lmtrain.nn.model.Decoder.tensor_parallel_plan: the modules
every tensor-parallel rank holds whole, the embedding and output head split by vocabulary with a tied weight kept one,
and the cross-entropy of logits split by vocabulary. Pure PyTorch (``torch.distributed.tensor``);
lmtrain.training.assemble applies the plan on the run's tensor-parallel mesh."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class Replicated(ParallelStyle):
    """A module whose parameters every tensor-parallel rank holds whole (the norms, the embeddings, the output head),
    as DTensors replicated over the mesh, so that every parameter of the model lives on one mesh (the optimizer's and
    the gradient norm's multi-tensor kernels take them together, and FSDP2 shards them all alike).

    ``input_layout``: what its tensor inputs are across the ranks: ``Replicate()``, the same on every rank (the
    residual stream between the column- and row-split products), or ``Shard(d)``, each rank its part (QK-norm on
    each rank's heads: the weights' gradients are then summed over the ranks). The outputs are plain tensors again.
    ``shared``: the parameters already distributed, by the id of the plain one, so that a parameter two modules share
    (tied embeddings) stays one."""

    def __init__(self, input_layout: Placement | None = None, shared: dict | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.shared = {} if shared is None else shared

    def _partition(self, name: str, module: nn.Module, mesh) -> None:
        _share(self.shared, module, mesh, Replicate())

    def _inputs(self, module: nn.Module, inputs: tuple, mesh) -> tuple:
        plain = [isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in inputs]
        return tuple(DTensor.from_local(a, mesh, [self.input_layout], run_check=False) if p else a for a, p in zip(inputs, plain, strict=True))

    @staticmethod
    def _outputs(module: nn.Module, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)



def _share(shared: dict, module: nn.Module, mesh, placement: Placement) -> None:
    """``module``'s own parameters as DTensors with ``placement``, the one already made for a parameter it shares."""
    for pname, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):  # distributed already
            continue
        if id(p) not in shared:
            shared[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, [placement]), requires_grad=p.requires_grad)
        module.register_parameter(pname, shared[id(p)])


class VocabRows(RowwiseParallel):
    """The token embedding split by vocabulary rows (each rank looks up the ids in its rows, the others' zero), its
    output summed over the ranks whole; a weight tied to the output head stays one parameter (``shared``)."""

    def __init__(self, shared: dict) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())
        self.shared = shared

    def _partition_embedding_fn(self, name, module, device_mesh):
        _share(self.shared, module, device_mesh, Shard(0))


class VocabColumns(ColwiseParallel):
    """The output head split by vocabulary: its input the sequence-split hidden states (gathered), its output the
    logits as a DTensor split by vocabulary, for :func:`vocab_parallel_cross_entropy`."""

    def __init__(self, shared: dict) -> None:
        super().__init__(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        self.shared = shared

    def _partition_linear_fn(self, name, module, device_mesh):
        _share(self.shared, module, device_mesh, Shard(0))


_LOSS_PARALLEL: list = []  # the entered loss_parallel() context, kept for the process


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor, z_loss: float = 0.0):
    """Mean next-token cross-entropy of logits split by vocabulary over the tensor-parallel ranks, without gathering
    them (PyTorch's ``loss_parallel``: each rank's log-softmax over its columns, one all-reduce of the maxima and one
    of the sums), returned as plain tensors, the same on every rank; with ``z_loss``, the parts of
    lmtrain.nn.loss.with_z_loss, the log-partition computed the same way.

    ``loss_parallel``'s operators must also be there when the backward pass runs, which the trainer starts outside
    any model code: they are registered once for the process, here, and stay (they apply only to the log-softmax and
    the negative log-likelihood of DTensors, which only this head computes)."""
    from lmtrain.nn.loss import mean_z, with_z_loss

    _enter_loss_parallel()
    x, t = logits.flatten(0, -2).float(), targets.flatten()
    ce = F.cross_entropy(x, t).to_local()
    if not z_loss:
        return ce
    return with_z_loss(ce, mean_z(_log_partition(x), t), z_loss)


def _log_partition(x: DTensor) -> torch.Tensor:
    """Each row's log-sum-exp of logits split by vocabulary, as a plain tensor (the same on every rank)."""
    m = x.detach().amax(-1, keepdim=True)  # the maxima, all-reduced: a shift for a stable sum
    return ((x - m).exp().sum(-1).log() + m.squeeze(-1)).to_local()


def _enter_loss_parallel() -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    if not _LOSS_PARALLEL:
        _LOSS_PARALLEL.append(loss_parallel())
        _LOSS_PARALLEL[0].__enter__()


def chunked_vocab_parallel_cross_entropy(hidden: torch.Tensor, weight: DTensor, targets: torch.Tensor, chunk_tokens: int, z_loss: float = 0.0):
    """:func:`vocab_parallel_cross_entropy` of the output head ``weight`` (split by vocabulary) applied to ``hidden``
    (this rank's part of each sequence, as the final norm gives it under sequence parallelism), ``chunk_tokens`` tokens
    at a time (``module.head.kind=chunked`` under tensor parallel): the hidden states are gathered once (batch x
    sequence x width, small beside the logits), then each chunk's logits (its tokens x this rank's vocabulary) are
    computed, reduced to sums of cross-entropy and squared log-partition, and dropped; the backward pass computes
    each chunk's again (activation checkpointing), so no more than one chunk's logits exist at a time. The mean over
    the counted tokens equals the unchunked head's to float rounding."""
    from torch.utils.checkpoint import checkpoint

    from lmtrain.nn.loss import IGNORE_INDEX, with_z_loss

    _enter_loss_parallel()
    mesh = weight.device_mesh
    whole = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    h, t = whole.flatten(0, 1), targets.flatten()
    ce = z = 0.0
    for at in range(0, t.numel(), chunk_tokens):
        part = checkpoint(_vocab_parallel_sums, h[at : at + chunk_tokens], weight, t[at : at + chunk_tokens], bool(z_loss), use_reentrant=False)
        ce, z = ce + part[0], z + part[1]
    counted = (t != IGNORE_INDEX).sum().clamp(min=1)
    return with_z_loss(ce / counted, z / counted, z_loss) if z_loss else ce / counted


def _vocab_parallel_sums(h: DTensor, weight: DTensor, t: torch.Tensor, with_z: bool) -> torch.Tensor:
    """(cross-entropy summed over the counted tokens, squared log-partition summed likewise or 0) of one chunk."""
    from lmtrain.nn.loss import summed_z

    x = F.linear(h, weight).float()  # this chunk's tokens x this rank's vocabulary
    ce = F.cross_entropy(x, t, reduction="sum").full_tensor()
    return torch.stack([ce, summed_z(_log_partition(x), t) if with_z else torch.zeros_like(ce)])
