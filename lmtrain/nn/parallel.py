"""Tensor parallelism's one piece that PyTorch lacks, for lmtrain.nn.model.Decoder.tensor_parallel_plan: the modules
every tensor-parallel rank holds whole. Pure PyTorch (``torch.distributed.tensor``); lmtrain.training.assemble
applies the plan on the run's tensor-parallel mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


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
        for pname, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            if id(p) not in self.shared:
                self.shared[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]), requires_grad=p.requires_grad)
            module.register_parameter(pname, self.shared[id(p)])

    def _inputs(self, module: nn.Module, inputs: tuple, mesh) -> tuple:
        plain = [isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in inputs]
        return tuple(DTensor.from_local(a, mesh, [self.input_layout], run_check=False) if p else a for a, p in zip(inputs, plain, strict=True))

    @staticmethod
    def _outputs(module: nn.Module, outputs, mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._inputs, self._outputs)

