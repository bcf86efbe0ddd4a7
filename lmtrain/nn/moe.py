"""Mixture of experts: the feed-forward layer of a block as many experts, each token sent to ``top_k`` of them.

``model.moe`` (a mapping, null for a dense model) switches a model's blocks to it; its keys are :class:`MoEConfig`'s.
Token-choice routing as OLMoE, Qwen3-MoE and DeepSeek-V3 route:

* the router, a linear layer from the width to ``experts`` scores, computed in fp32; ``score: softmax`` (OLMoE,
  Qwen3-MoE) or ``sigmoid`` (DeepSeek-V3) turns them into each token's affinities;
* each token goes to the ``top_k`` experts of highest affinity plus a per-expert selection bias (DeepSeek-V3's
  auxiliary-loss-free balancing: the bias takes part in choosing, never in weighting; lmtrain.training.module moves
  it after each optimizer step by ``bias_rate`` towards the experts that received fewer tokens than the mean);
* the expert outputs are summed weighted by the chosen affinities, renormalised to sum to one with ``norm_topk``
  (the default, as Qwen3-MoE, Mixtral and DeepSeek-V3 weight them; OLMoE does not, and its preset says so);
* dropless: every token is computed by every expert it chose, however unbalanced the load (no capacity factor);
* the experts' products are PyTorch's grouped matrix product (``grouped_mm``: one kernel for all experts on Hopper),
  the tokens sorted by expert with each expert's group padded to a multiple of 8 rows (its alignment on the GPU),
  static shapes throughout, so a compiled block does not recompile as the load moves; each token's rows are
  copied straight into those groups in the products' dtype, and its k outputs gathered back and summed in fp32, both
  ways without a scatter-add (no atomics: the same sums on every run);
* an optional shared expert (``shared_ffn_dim``) every token passes through (Qwen2-MoE's, DeepSeek's);
* the load-balancing loss (Switch Transformer's, OLMoE's 0.01): ``experts`` x the sum over experts of the fraction of
  routed tokens times the mean affinity, and the router z-loss (ST-MoE's, OLMoE's 0.001): the mean squared
  log-sum-exp of the router's scores. Both join the training objective through the block's output
  (:class:`_AddToObjective`: the output unchanged, their gradients added in the backward pass), so the block keeps its
  one input and one output for checkpointing, compiling and sharding, and the cross-entropy logged stays the
  cross-entropy.

The first ``dense_layers`` blocks keep a dense MLP (DeepSeek-V3's first 3). Each layer passes its routing
(tokens per expert, mean affinity, the mean entropy of the tokens' affinities) to a :class:`RouterProbe`, where
lmtrain.training.module reads it for the metrics and the bias update.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid")
ALIGN = 8  # rows each expert's group of tokens is padded to (grouped_mm's alignment for bf16 on the GPU)


@dataclass(frozen=True)
class MoEConfig:
    """``model.moe``: the experts of every block from the ``dense_layers``-th on."""

    experts: int = 8  # routed experts per layer
    top_k: int = 2  # experts each token is computed by
    expert_ffn_dim: int = 0  # each expert's hidden features (SwiGLU for llama, the activation MLP for opt)
    shared_ffn_dim: int = 0  # a shared expert's hidden features, every token through it; 0: none
    score: str = "softmax"  # softmax | sigmoid: the router's affinities
    norm_topk: bool = True  # renormalise the chosen affinities to sum 1 (sigmoid: always); false: OLMoE's weighting
    aux_loss: float = 0.01  # load-balancing loss coefficient; 0: none
    z_loss: float = 0.001  # router z-loss coefficient; 0: none
    bias_rate: float = 0.0  # auxiliary-loss-free balancing: the selection bias's step a training step; 0: off
    dense_layers: int = 0  # the first blocks keep a dense MLP

    @classmethod
    def of(cls, fields) -> MoEConfig:
        return cls(**{str(k): v for k, v in dict(fields).items()})

    def problems(self, n_layers: int) -> list[str]:
        out = []
        for key in ("experts", "top_k", "expert_ffn_dim"):
            if not _whole(getattr(self, key), 1):
                out.append(f"model.moe.{key}={getattr(self, key)!r} must be a positive integer")
        if not _whole(self.shared_ffn_dim, 0):
            out.append(f"model.moe.shared_ffn_dim={self.shared_ffn_dim!r} must be a whole number (0: no shared expert)")
        if not _whole(self.dense_layers, 0) or (isinstance(self.dense_layers, int) and self.dense_layers >= n_layers):
            out.append(f"model.moe.dense_layers={self.dense_layers!r} must be a whole number below model.n_layers={n_layers}")
        if not out and self.top_k > self.experts:
            out.append(f"model.moe.top_k={self.top_k} exceeds model.moe.experts={self.experts}")
        if self.score not in SCORES:
            out.append(f"model.moe.score={self.score!r}: use one of {list(SCORES)}")
        if not isinstance(self.norm_topk, bool):
            out.append(f"model.moe.norm_topk={self.norm_topk!r} must be true or false")
        for key in ("aux_loss", "z_loss", "bias_rate"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                out.append(f"model.moe.{key}={v!r} must be a finite number >= 0")
        return out


# model.moe keys whose default changed, with the default before: a model.moe stored before the change (a run's
# config.yaml, a checkpoint's or an export's model) that lacks the key was trained with the old value. Every model.moe
# stored since holds every key (lmtrain.nn.model.ModelConfig completes it), so only those older ones lack any.
EARLIER_DEFAULTS = {"norm_topk": False}  # true since 2026-12-08: the renormalised mixture trained lower (docs/configuration.md)


def as_trained(fields: dict | None) -> dict | None:
    """A ``model.moe`` read back from what a run stored (its config.yaml, a checkpoint's or an export's model) with
    every key: those one stored before lmtrain spelt them out lacks at the defaults it trained with. One with a key this
    lmtrain does not know stays as stored (the model refuses it, naming the key)."""
    if fields is None:
        return None
    fields = {**EARLIER_DEFAULTS, **fields}
    try:
        return complete(fields)
    except TypeError:
        return fields


def complete(fields) -> dict:
    """``model.moe`` with every key of :class:`MoEConfig`, the ones not given at their defaults (valid fields)."""
    return dataclasses.asdict(MoEConfig.of(fields))


def _whole(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def moe_problems(fields, n_layers: int) -> list[str]:
    """Why ``model.moe`` cannot build, naming each key; empty when it can."""
    if not hasattr(fields, "items"):
        return [f"model.moe={fields!r} must be a mapping of {[f.name for f in dataclasses.fields(MoEConfig)]} or null"]
    known = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(str(k) for k in fields if str(k) not in known)
    if unknown:
        return [f"model.moe has no key {k!r} (its keys: {sorted(known)})" for k in unknown]
    return MoEConfig.of(fields).problems(n_layers)


class RouterProbe(nn.Module):
    """Returns what it is given: each MoE layer's routing in a training forward pass (tokens per expert, the mean
    affinity per expert, the mean entropy of the tokens' affinities), the place lmtrain.training.module's hook reads
    it. Holds no state."""

    def forward(self, load: torch.Tensor, affinity: torch.Tensor, entropy: torch.Tensor):
        return load, affinity, entropy


class _AddToObjective(torch.autograd.Function):
    """``out`` unchanged; in the backward pass ``aux`` receives the gradient ``scale``, as if ``scale * aux`` had been
    added to the loss the backward pass started from (``scale``: the factor the trainer applied to that loss, 1 over
    the micro-batches a step accumulates; Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


@dataclass(frozen=True)
class ExpertParallel:
    """The ranks a layer's experts are split over (``strategy.ep``): the device ``mesh`` (1-D: every rank; 2-D: groups
    of ``size`` ranks, dim 1, replicated over dim 0), the process ``group`` of this rank's ``size`` ranks, the
    ``replicas`` group of the ranks holding the same experts (None: no other), and ``ranks``, every data-parallel
    rank, over which the experts' gradients are averaged."""

    mesh: object
    group: object
    size: int
    replicas: object
    ranks: int

    @classmethod
    def over(cls, mesh) -> ExpertParallel:
        """On a 1-D mesh (every rank holds a part) or a 2-D one (dim 1 splits, dim 0 replicates)."""
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(), mesh.size(), None, mesh.size())
        return cls(mesh, mesh.get_group(1), mesh.size(1), mesh.get_group(0), mesh.size())

    @property
    def placements(self) -> list:
        from torch.distributed.tensor import Replicate, Shard

        return [Shard(0)] if self.mesh.ndim == 1 else [Replicate(), Shard(0)]


class _ExpertGrad(torch.autograd.Function):
    """``w`` unchanged; its gradient times ``factor``, summed over the ``replicas`` group (if any) in the backward
    pass, so every copy of an expert gets the same gradient, each micro-batch's own (accumulation stays exact)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, factor: float, replicas) -> torch.Tensor:
        ctx.factor, ctx.replicas = factor, replicas
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad * ctx.factor
        if ctx.replicas is not None:
            from torch.distributed._functional_collectives import all_reduce, wait_tensor

            grad = wait_tensor(all_reduce(grad, "sum", ctx.replicas))
        return grad, None, None


def _autocast_on(kind: str) -> bool:
    """Autocast on for device type ``kind`` (the meta device has none)."""
    return kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind)


def _compute_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype products on device type ``kind`` compute in: autocast's when it is on, else ``dtype``."""
    return torch.get_autocast_dtype(kind) if _autocast_on(kind) else dtype


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` (M, K) times ``w[e]`` (K, N), for every expert e: PyTorch's grouped
    matrix product, in the autocast dtype when autocast is on (it is not an autocast operator). Its GPU kernel takes
    bf16 only: in fp32 on a GPU (``trainer.precision=32-true``) a loop over the experts computes it instead (one host
    read of the offsets a layer); on the meta device only the shape is made."""
    kind = x.device.type
    dtype = _compute_dtype(kind, x.dtype)
    x, w = x.to(dtype), w.to(dtype)
    if kind == "meta":
        return x.new_empty(x.shape[0], w.shape[-1])
    if kind == "cpu" or dtype == torch.bfloat16:
        fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
        return fn(x, w, offs=offsets)
    out, start = x.new_zeros(x.shape[0], w.shape[-1]), 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _padded_rows(load: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For ``m`` rows sorted by group, ``load[g]`` of them group g's: each row's place when every group is padded to a
    multiple of ALIGN rows (the grouped product's alignment), the groups' end offsets (int32), and the buffer's rows:
    the most the groups can take, a static shape, so a compiled block does not recompile as the load moves."""
    G = load.shape[0]
    padded = (load + ALIGN - 1) // ALIGN * ALIGN
    ends = padded.cumsum(0)
    group = torch.repeat_interleave(torch.arange(G, device=load.device), load, output_size=m)
    rows = (ends - padded)[group] + torch.arange(m, device=load.device) - (load.cumsum(0) - load)[group]
    return rows, ends.to(torch.int32), m + G * (ALIGN - 1)


class _Dispatch(torch.autograd.Function):
    """The experts' input: a buffer of ``size`` rows whose row ``slot[c]`` is row ``c // k`` of ``h`` (choice c is
    token c // k's); the rows no choice takes hold a copy of some row (padding: computed, never read, their gradient
    zero). Backward: each token's gradient the sum of its k rows', gathered and added in fp32 (no scatter: no atomics,
    the same sum on every run)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, slot: torch.Tensor, size: int, k: int) -> torch.Tensor:
        src = torch.zeros(size, dtype=slot.dtype, device=slot.device).index_copy_(
            0, slot, torch.arange(slot.shape[0], device=slot.device) // k)
        ctx.save_for_backward(slot)
        ctx.k, ctx.dtype = k, h.dtype
        return h.index_select(0, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot,) = ctx.saved_tensors
        per_choice = grad.index_select(0, slot).view(-1, ctx.k, grad.shape[-1])
        return per_choice.float().sum(1).to(ctx.dtype), None, None, None


class _Rows(torch.autograd.Function):
    """Rows ``slot`` of ``ys``, each taken once (``slot`` has no repeats): the gradient copied back to those rows,
    zero elsewhere (the index's own backward would add them, with atomics)."""

    @staticmethod
    def forward(ctx, ys: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot)
        ctx.rows = ys.shape[0]
        return ys.index_select(0, slot)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, grad.shape[-1]).index_copy_(0, slot, grad), None


class MoE(nn.Module):
    """The mixture-of-experts feed-forward layer of one block (see the module docstring)."""

    def __init__(self, cfg) -> None:
        """``cfg``: the model's ModelConfig (lmtrain.nn.model), whose ``moe`` is set."""
        super().__init__()
        from lmtrain.nn.model import MLP, mlp_activation

        moe = cfg.moe_config
        self.cfg, self.act, self._activation = moe, cfg.act, mlp_activation
        E, F_, d = moe.experts, moe.expert_ffn_dim, cfg.d_model
        self.swiglu = cfg.family == "llama"
        self.router = nn.Linear(d, E, bias=False)
        self.router.moe_router = True  # float8 leaves it alone (lmtrain.training.fp8)
        first = 2 * F_ if self.swiglu else F_
        self.w_in = nn.Parameter(torch.empty(E, first, d))  # each expert's first product, stored as nn.Linear stores it
        self.w_out = nn.Parameter(torch.empty(E, d, F_))
        self.b_in = nn.Parameter(torch.empty(E, first)) if not self.swiglu else None  # the opt family's biases
        self.b_out = nn.Parameter(torch.empty(E, d)) if not self.swiglu else None
        self.shared = MLP(dataclasses.replace(cfg, ffn_dim=moe.shared_ffn_dim, moe=None)) if moe.shared_ffn_dim else None
        self.register_buffer("expert_bias", torch.zeros(E))  # auxiliary-loss-free balancing; in checkpoints
        self.probe = RouterProbe()
        self.loss_scale = 1.0  # the trainer's factor on the loss (lmtrain.nn.model.Decoder.configure_head)
        self.ep: ExpertParallel | None = None  # strategy.ep: the experts split over ranks (set_expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, E, k = self.cfg, self.cfg.experts, self.cfg.top_k
        shape = x.shape
        h = x.reshape(-1, shape[-1])  # (N, d)
        N = h.shape[0]
        logits = self._router_logits(h)  # (N, E), fp32
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.expert_bias, k, dim=-1).indices  # (N, k): the bias chooses only
        weights = scores.gather(1, chosen)
        if cfg.norm_topk or cfg.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)

        # dispatch: the N x k choices sorted by expert (their experts' groups one after the other); slot[c]: the row
        # choice c (token c // k's) takes in the experts' input
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # choice index, grouped by expert
        load = torch.zeros(E, dtype=torch.long, device=h.device).scatter_add_(0, flat, torch.ones_like(flat))  # tokens per expert (static shape)
        hc = h.to(_compute_dtype(h.device.type, self.w_in.dtype))  # rows copied k times: in the dtype the products take them
        if self.ep is None:  # straight into the padded groups of the grouped products
            rows, offsets, size = _padded_rows(load, order.shape[0])
            slot = torch.empty_like(order).index_copy_(0, order, rows)
            ys = self._products(_Dispatch.apply(hc, slot, size, k), offsets, load)
        else:
            slot = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=h.device))
            ys = self._experts_elsewhere(_Dispatch.apply(hc, slot, order.shape[0], k), load)
        # combine: each token's k outputs weighted by their affinities, summed in fp32 (no scatter, no atomics)
        picked = _Rows.apply(ys, slot).view(N, k, -1)
        out = (picked.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(h)

        routed = load.float() / (N * k)  # the fraction of the choices each expert got
        p = scores if cfg.score == "softmax" else scores / scores.sum(-1, keepdim=True)  # each token's affinities, summing to 1
        mean_affinity = p.mean(0)
        entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()
        self.probe(load.detach(), mean_affinity.detach(), entropy.detach())
        if self.training and (cfg.aux_loss or cfg.z_loss):
            aux = cfg.aux_loss * E * (routed * mean_affinity).sum() if cfg.aux_loss else 0.0
            if cfg.z_loss:
                aux = aux + cfg.z_loss * torch.logsumexp(logits, -1).square().mean()
            out = _AddToObjective.apply(out, aux, self.loss_scale)
        return out.reshape(shape)

    def _router_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The router's scores in fp32 whatever autocast says (under bf16 autocast a linear layer would round them to
        bf16, and near-equal scores would choose experts by rounding)."""
        kind = h.device.type
        if _autocast_on(kind):
            with torch.autocast(kind, enabled=False):
                return F.linear(h.float(), self.router.weight.float())
        return F.linear(h.float(), self.router.weight.float())

    def _weights(self) -> tuple:
        """The experts' weights as this rank computes with them: all of them, or under expert parallel its own experts'
        (the local shard), their gradients averaged over every data-parallel rank, as FSDP averages every other
        gradient: each rank's loss is its own tokens' mean, an expert's gradient arrives summed over the tokens of its
        group's ranks, and the groups' sums are added (``replicas``) before dividing by the number of ranks."""
        ws = (self.w_in, self.w_out, self.b_in, self.b_out)
        if self.ep is None:
            return ws
        ep = self.ep
        return tuple(None if w is None else _ExpertGrad.apply(w.to_local(), 1.0 / ep.ranks, ep.replicas) for w in ws)

    def _products(self, buf: torch.Tensor, offsets: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
        """Rows ``buf`` in the experts' padded groups (:func:`_padded_rows`; ``load``: each group's tokens), each group
        through its expert (the experts this rank holds): the grouped products, row for row."""
        w_in, w_out, b_in, b_out = self._weights()
        G = load.shape[0]
        if b_in is not None:  # each row's expert's biases (the rows after the last group: the last expert's, unread)
            row_group = torch.searchsorted(offsets, torch.arange(buf.shape[0], device=buf.device, dtype=offsets.dtype), right=True).clamp(max=G - 1)
        mid = grouped_mm(buf, w_in.transpose(-2, -1), offsets)
        if b_in is not None:
            mid = mid + b_in.to(mid.dtype)[row_group]
        ys = grouped_mm(self._activation(mid, self.act), w_out.transpose(-2, -1), offsets)
        if b_out is not None:
            ys = ys + b_out.to(ys.dtype)[row_group]
        return ys

    def _experts(self, xs: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` sorted by expert, ``load[e]`` of them expert e's (the experts this rank holds): each row through
        its expert, back in ``xs``'s order (expert parallel's received rows)."""
        rows, offsets, size = _padded_rows(load, xs.shape[0])
        buf = xs.new_zeros(size, xs.shape[-1]).index_copy(0, rows, xs)
        return self._products(buf, offsets, load)[rows]

    def _experts_elsewhere(self, xs: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
        """Expert parallel: each rank holds ``experts / ep`` experts. The rows go to the ranks of their experts (one
        all-to-all: the counts, then the rows), are sorted there by expert, computed, and come back (the reverse
        all-to-all), in ``xs``'s order. The split sizes are read on the host (one sync a layer, as torchtitan's)."""
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        ep, local = self.ep.size, self.cfg.experts // self.ep.size
        send = load.view(ep, local)  # rows to each rank, by its experts
        recv = all_to_all_single(send.flatten(), [local] * ep, [local] * ep, self.ep.group).view(ep, local)  # from each rank
        sizes_in, sizes_out = send.sum(1).tolist(), recv.sum(1).tolist()
        got = all_to_all_single_autograd(xs, sizes_out, sizes_in, self.ep.group)  # by (source rank, expert)
        # by (expert, source rank): each block of rows moved whole
        blocks = recv.flatten()
        src_start = blocks.cumsum(0) - blocks
        by_expert = recv.t().flatten()
        dst_start = (by_expert.cumsum(0) - by_expert).view(local, ep).t().flatten()  # block (s, j)'s start in expert order
        block = torch.repeat_interleave(torch.arange(ep * local, device=xs.device), blocks, output_size=got.shape[0])
        dest = dst_start[block] + torch.arange(got.shape[0], device=xs.device) - src_start[block]
        mine = torch.empty_like(got).index_copy(0, dest, got)
        done = self._experts(mine, recv.sum(0))[dest]  # computed, back in arrival order
        return all_to_all_single_autograd(done, sizes_in, sizes_out, self.ep.group)

    def set_expert_parallel(self, ep) -> None:
        """Hold only this rank's ``experts / ep.size`` experts (their weights DTensors split by expert over ``ep``'s
        mesh, replicated across its groups) and send each token's rows to the ranks of its experts in its group
        (:meth:`_experts_elsewhere`)."""
        from torch.distributed.tensor import distribute_tensor

        if self.cfg.experts % ep.size:
            raise ValueError(f"model.moe.experts={self.cfg.experts} does not divide over strategy.ep={ep.size} ranks")
        for name in ("w_in", "w_out", "b_in", "b_out"):
            w = getattr(self, name)
            if w is not None:
                setattr(self, name, nn.Parameter(distribute_tensor(w.data, ep.mesh, ep.placements)))
        self.ep = ep

    @torch.no_grad()
    def balance(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after a training step: each expert's selection bias raised by
        ``bias_rate`` if it received fewer tokens than the mean (``load``: tokens per expert over the step, every rank's),
        lowered if more."""
        if self.cfg.bias_rate:
            self.expert_bias += self.cfg.bias_rate * torch.sign(load.mean() - load).to(self.expert_bias)

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """The experts as the dense MLP's products are initialised (the router is a linear layer: the model's loop)."""
        nn.init.normal_(self.w_in, 0.0, std)
        nn.init.normal_(self.w_out, 0.0, residual_std)
        for b in (self.b_in, self.b_out):
            if b is not None:
                nn.init.zeros_(b)
        self.expert_bias.zero_()


def unused_params(cfg) -> int:
    """The routed experts' parameters one token does not use: (experts - top_k) experts in every MoE block (0 for a
    dense model): the model's parameters less these are its active ones."""
    moe = cfg.moe_config
    if moe is None:
        return 0
    per_expert = (3 if cfg.family == "llama" else 2) * cfg.d_model * moe.expert_ffn_dim
    if cfg.family != "llama":
        per_expert += moe.expert_ffn_dim + cfg.d_model  # the biases
    return (moe.experts - moe.top_k) * per_expert * (cfg.n_layers - moe.dense_layers)
