"""A mixture of experts' routing, step by step (lmtrain.nn.moe): what each MoE layer's router did in a training step,
summed over the step's micro-batches and every rank, logged as metrics and fed to the auxiliary-loss-free balancing.

Metrics, one value per step: ``moe/load_max_over_mean`` (the most loaded expert's tokens over the mean, in the worst
layer: 1 is perfect balance, ``experts / top_k`` is every token on the same experts), ``moe/load_min_over_mean``
(the least loaded expert's, in the worst layer: 0 is an expert that received nothing), ``moe/router_entropy`` (the
mean entropy of the tokens' affinities, natural log: ln(experts) is a router that has no preference, a fall towards 0
a router that has collapsed onto few experts), ``moe/collapse`` (in the worst layer, how far the load has moved from
every expert equally loaded, 0, towards every token on the same ``top_k`` experts, 1: ``(E - n) / (E - top_k)`` with
``n`` the effective number of experts in use, the exponential of the entropy of the load's shares; the divergence
detector's ``routing_collapse`` signal reads it), and per layer ``moe/layer{i}/load_max_over_mean``. Routing is dropless:
no token is ever dropped, so there is no dropped-token count.
"""

from __future__ import annotations

import torch
from torch import nn

from lmtrain.nn.moe import MoE, RouterProbe


class RoutingStats:
    """Hooks on a model's RouterProbes; ``layers``: the MoE layers' block indices, in order."""

    def __init__(self, model: nn.Module) -> None:
        self.moes: list[MoE] = []
        self.layers: list[int] = []
        for i, block in enumerate(getattr(model, "blocks", [])):
            mlp = getattr(block, "mlp", None)  # (a checkpointed block passes attributes through to the one it wraps)
            if isinstance(mlp, MoE):
                self.moes.append(mlp)
                self.layers.append(i)
        self._loads: list[list[torch.Tensor]] = [[] for _ in self.moes]
        self._entropy: list[torch.Tensor] = []
        self._global: torch.Tensor | None = None
        self._hooks = [moe.probe.register_forward_hook(self._hook(j)) for j, moe in enumerate(self.moes)]
        for m in model.modules():  # a probe outside a found layer would go unread: there is none in lmtrain's models
            assert not isinstance(m, RouterProbe) or any(m is moe.probe for moe in self.moes)
        # every MoE layer of a Decoder is built from its one model.moe: one (experts, top_k) for moe/collapse
        assert len({(moe.cfg.experts, moe.cfg.top_k) for moe in self.moes}) <= 1

    def __bool__(self) -> bool:
        return bool(self.moes)

    def _hook(self, j: int):
        def record(module: nn.Module, args: tuple, output) -> None:
            if not module.training:
                return
            # a checkpointed block computed again in the backward pass routes the same tokens again: counted once
            if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
                return
            load, _, entropy = args
            self._loads[j].append(load.float())
            self._entropy.append(entropy.float())

        return record

    def names(self) -> list[str]:
        return ["moe/load_max_over_mean", "moe/load_min_over_mean", "moe/router_entropy", "moe/collapse",
                *(f"moe/layer{i}/load_max_over_mean" for i in self.layers)]  # fmt: skip

    def step_values(self, strategy, device) -> torch.Tensor:
        """This step's values for :meth:`names`, every rank's tokens counted (a collective: every rank calls it)."""
        nan = torch.full((), float("nan"), device=device)
        if not all(self._loads):  # no training forward pass this step
            self._global = None
            return nan.expand(len(self.names())).clone()
        loads = torch.stack([torch.stack(per).sum(0) for per in self._loads])  # (layers, experts)
        loads = strategy.reduce(loads, reduce_op="sum")
        entropy = strategy.reduce(torch.stack(self._entropy).mean(), reduce_op="mean")
        for per in self._loads:
            per.clear()
        self._entropy.clear()
        self._global = loads
        mean = loads.mean(-1)
        high, low = loads.amax(-1) / mean, loads.amin(-1) / mean
        share = loads / loads.sum(-1, keepdim=True)
        in_use = torch.exp(-torch.special.xlogy(share, share).sum(-1))  # effective experts: E balanced, top_k collapsed
        experts, top_k = self.moes[0].cfg.experts, self.moes[0].cfg.top_k  # host numbers: nothing copied to the device
        collapse = ((experts - in_use) / max(experts - top_k, 1)).amax()
        return torch.cat([torch.stack([high.amax(), low.amin(), entropy, collapse]), high])

    def balance(self) -> None:
        """The auxiliary-loss-free update of each layer's selection bias from this step's global loads (every rank the
        same: the loads were summed over all of them)."""
        if self._global is not None:
            for moe, load in zip(self.moes, self._global, strict=True):
                moe.balance(load)
        self._global = None
