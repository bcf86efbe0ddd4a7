"""The one room that assembles the model: everything done to a network between its config and its first step, in one
fixed order, from one :class:`Plan` made once (OLMo-core's ``parallelize_model``, torchtitan's converters applied
before parallelising):

    build -> output head -> float8 -> tensor parallel -> context parallel -> expert parallel -> activation checkpointing
          -> compile -> activation offloading -> shard -> initialise or load the weights

(the tensor-parallel plan is made before float8 and applied after it: making it splits the fused products, which
float8 must convert). A step reads only the plan and what the network declares it offers (lmtrain.nn.model.LanguageModel: its blocks, its
head's options, its final norm, its initialisation), never attributes probed by name. LMModule.configure_model calls
:func:`Plan.assemble` once; the strategy (lmtrain.training.strategies) shards and nothing else; the process layout
(data, tensor, context parallel sizes) is lmtrain.training.layout's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmtrain.errors import InputError
from lmtrain.nn.model import LanguageModel
from lmtrain.training import compat, fastpaths
from lmtrain.training import fp8 as fp8_module
from lmtrain.training.offload import BlockInputsToHost


@dataclass(frozen=True)
class Plan:
    """What assembling a model does, decided once: ``head`` and ``fp8`` (``module.head``, ``module.fp8``: checked by
    lmtrain.training.fastpaths), ``z_loss``, ``compile`` (resolved: ``auto`` is a GPU), ``sharding`` (the fsdp/hsdp
    strategy, or None: single device or DDP, the model whole on each rank), ``device`` (where it trains), ``rank0``
    (this process says what it did), ``tp`` (``strategy.tp``: the ranks each layer is split over) and ``cp``
    (``strategy.cp``: the ranks each sequence is split over), ``loss_scale`` (what the trainer multiplies each
    micro-batch's loss by: 1 over the micro-batches a step accumulates)."""

    head: fastpaths.Head
    fp8: fastpaths.Float8
    z_loss: float
    compile: bool
    sharding: object | None
    device: torch.device
    rank0: bool = True
    tp: int = 1  # ranks each layer is split over (strategy.tp, under fsdp)
    cp: int = 1  # ranks each sequence is split over (strategy.cp, under fsdp)
    loss_scale: float = 1.0  # the trainer's factor on each micro-batch's loss: 1 / trainer.accumulate_grad_batches

    @classmethod
    def of(cls, module, strategy) -> Plan:
        """The plan of an LMModule (its arguments are the config's ``module`` node) under ``strategy``."""
        from lmtrain.training.strategies import FSDP2Strategy

        sharding = strategy if isinstance(strategy, FSDP2Strategy) else None
        device = strategy.root_device if strategy is not None else module.device
        compile_ = module.compile if module.compile != "auto" else device.type == "cuda"  # built without the config
        tp, cp = (sharding.tp, sharding.cp) if sharding is not None else (1, 1)
        accumulate = module._trainer.accumulate_grad_batches if module._trainer is not None else 1  # Lightning divides the loss
        return cls(module.head, module.fp8, module.z_loss, bool(compile_), sharding, device, module.global_rank == 0, tp, cp, 1.0 / accumulate)

    @property
    def ac(self) -> str:
        """``strategy.activation_checkpointing`` (none, selective, full, op, offload): under fsdp/hsdp."""
        return self.sharding.activation_checkpointing if self.sharding is not None else "none"

    def assemble(self, model: nn.Module | Callable[[], nn.Module], loss: Callable, weights=None) -> tuple[nn.Module, Callable]:
        """The network built (``model``: itself, or its factory) and prepared in the order above; returns it and the
        loss function to call it with (``loss``, compiled whole where the model is not sharded). ``weights``: an
        lmtrain.training.init_from.Loader read into it last (each rank its own rows)."""
        model = self._build(model)
        self._head(model)
        plan = self._tensor_parallel_plan(model)  # made first: it unfuses qkv and gate_up, which float8 then converts
        self._float8(model)
        self._tensor_parallel(model, plan)
        self._context_parallel(model)
        kept = self._expert_parallel(model)
        self._checkpoint_activations(model)
        loss = self._compile(model, loss)
        if self.ac == "offload":  # the inputs full checkpointing keeps, held in host memory (lmtrain.training.offload)
            loss = self._offload(model, loss)
        if self.sharding is not None:
            model = self.sharding.shard(model, compiled=self.compile, kept=kept)
        self._weights(model, weights)
        return model, loss

    # -- the steps, in order -----------------------------------------------------------------
    def _build(self, model):
        if isinstance(model, nn.Module):
            return model
        init_device = self.sharding.init_device if self.sharding is not None else None
        if init_device == "cpu":
            with torch.device("cpu"):  # the full seeded init on every rank, then shard: same weights as 1 process
                return model()
        if init_device == "meta":
            with torch.device("meta"):  # no memory: each shard allocated and initialised in place (_weights)
                return model()
        return model()

    def _head(self, model: nn.Module) -> None:
        kernel = None
        if self.head.kind == "liger":
            from lmtrain.training.kernels import loss_kernel

            kernel = loss_kernel("liger")
        if not isinstance(model, LanguageModel):  # any (B, T) -> (B, T, V) network trains, with the plain head only
            for key, asked, lacks in ((f"module.head.kind={self.head.kind}", self.head.chunk is not None, "chunked loss"),
                                      ("module.head.kind=liger", kernel is not None, "fused head"),
                                      (f"module.z_loss={self.z_loss:g}", bool(self.z_loss), "z-loss")):  # fmt: skip
                if asked:
                    raise InputError(f"{key}: the model {type(model).__name__} has no {lacks} (lmtrain.nn.model.Decoder has)")
            return
        model.configure_head(chunk_tokens=self.head.chunk, kernel=kernel, z_loss=self.z_loss, loss_scale=self.loss_scale)

    def _float8(self, model: nn.Module) -> None:
        if not fastpaths.uses_float8(self.head, self.fp8):
            return
        fp8_module.convert(
            model,
            self.fp8.recipe,
            sharded=self.sharding is not None and self.tp == 1,  # under tp FSDP gathers the split weights in bf16
            device=self.device,
            fast_accum=self.fp8.fast_accum,
            float8_head=self.head.kind == "float8",
            fused_mlp=self.fp8.fused_mlp,
        )
        if self.rank0:
            print(
                f"[lmtrain] float8: {fp8_module.describe(model)} in float8 on {self.device.type}"
                + (" (float8 all-gather)" if fp8_module.uses_float8_all_gather(model) else "")
                + (", every product accumulated in fast mode" if self.fp8.fast_accum else ""),
                flush=True,
            )
            warning = fp8_module.width_warning(model, self.fp8.recipe)
            if warning and self.device.type == "cuda":
                print(f"[lmtrain] warning: {warning}", flush=True)

    def _tensor_parallel_plan(self, model: nn.Module) -> dict | None:
        """The network's own plan for ``tp`` ranks (lmtrain.nn.model.Decoder.tensor_parallel_plan), made before float8
        converts the blocks: making it splits the fused products into the ones it names, and float8 must convert
        those. Applied after float8 by :meth:`_tensor_parallel` (a float8 layer is split as the linear one it is)."""
        if self.tp == 1:
            return None
        if not isinstance(model, LanguageModel):
            name = type(model).__name__
            raise InputError(f"strategy.tp={self.tp}: the model {name} offers no tensor-parallel plan (lmtrain.nn.model.Decoder does)")
        try:
            return model.tensor_parallel_plan(self.tp)
        except ValueError as exc:
            raise InputError(f"strategy.tp={self.tp}: {exc}") from None

    def _tensor_parallel(self, model: nn.Module, plan: dict | None) -> None:
        """Each layer split over the ``tp`` ranks of the tensor-parallel mesh, as ``plan`` says: its parameters become
        DTensors on that mesh, which FSDP2 then shards over the data-parallel one."""
        if plan is None:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.sharding.tensor_parallel_mesh()
        parallelize_module(model, mesh, plan)
        if self.rank0:  # a rank's share before sharding: what lmtrain.training.memory counts under tp
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
            said = (f"[lmtrain] tensor parallel: each block's products split over {self.tp} ranks (mesh {mesh.mesh_dim_names}): "
                    f"{local:,} parameters a rank before sharding")  # fmt: skip
            print(said, file=sys.stderr, flush=True)

    def _context_parallel(self, model: nn.Module) -> None:
        """Each sequence split over the ``cp`` ranks of the context-parallel mesh (lmtrain.nn.context): the network
        computes its own share of each sequence's tokens (Decoder.set_context_parallel); FSDP2 shards over the
        data-parallel and context-parallel ranks together."""
        if self.cp == 1:
            return
        from lmtrain.nn.context import ContextParallel

        if not isinstance(model, LanguageModel):
            name = type(model).__name__
            raise InputError(f"strategy.cp={self.cp}: the model {name} cannot split a sequence (lmtrain.nn.model.Decoder can)")
        mesh = self.sharding.context_parallel_mesh()
        model.set_context_parallel(ContextParallel(mesh.get_group(), self.cp, mesh.get_local_rank()))
        if self.rank0:
            print(f"[lmtrain] context parallel: each sequence split over {self.cp} ranks (mesh {mesh.mesh_dim_names}), "
                  "keys and values gathered", file=sys.stderr, flush=True)  # fmt: skip

    def _expert_parallel(self, model: nn.Module) -> set:
        """``strategy.ep``: each MoE layer's experts split over groups of ``ep`` ranks, replicated across the groups
        (the strategy's expert mesh); returns their parameters, which FSDP then leaves alone
        (lmtrain.nn.moe.MoE.set_expert_parallel)."""
        ep = self.sharding.ep if self.sharding is not None else 1
        if ep == 1:
            return set()
        from lmtrain.nn.moe import ExpertParallel, MoE

        moes = [b.mlp for b in getattr(model, "blocks", []) if isinstance(getattr(b, "mlp", None), MoE)]
        if not moes:
            raise InputError(f"strategy.ep={ep}: the model has no mixture of experts to split (model.moe)")
        mesh = self.sharding.expert_mesh()
        group = ExpertParallel.over(mesh)
        for moe in moes:
            try:
                moe.set_expert_parallel(group)
            except ValueError as exc:
                raise InputError(str(exc)) from None
        if self.rank0:
            copies = f", {mesh.size(0)} copies" if mesh.ndim == 2 else ""
            print(f"[lmtrain] expert parallel: {moes[0].cfg.experts // ep} of {moes[0].cfg.experts} experts a rank in "
                  f"{len(moes)} layers, groups of {ep} ranks{copies}, tokens sent to their experts' ranks (all-to-all)",
                  file=sys.stderr, flush=True)  # fmt: skip
        return {p for moe in moes for p in (moe.w_in, moe.w_out, moe.b_in, moe.b_out) if p is not None}

    def _checkpoint_activations(self, model: nn.Module) -> None:
        if self.sharding is not None and not isinstance(model, LanguageModel):
            raise InputError(f"{type(self.sharding).__name__} shards per block: the model {type(model).__name__} has no `blocks` list")
        if self.ac == "none":
            return
        blocks = model.blocks
        for i, block in enumerate(blocks):
            if self.ac in ("full", "op", "offload") or (self.ac == "selective" and i % 2 == 0):
                blocks[i] = compat.checkpoint_wrapper(block, keep_products=self.ac == "op")

    def _offload(self, model: nn.Module, loss: Callable) -> Callable:
        if not self.compile:
            raise InputError("strategy.activation_checkpointing=offload needs compiled blocks (module.compile=true, or auto on a GPU)")
        if self.rank0:
            print("[lmtrain] activation offloading: each block's input waits for the backward pass in host memory",
                  file=sys.stderr, flush=True)  # fmt: skip
        return BlockInputsToHost(model.width, len(model.blocks))(loss)

    def _compile(self, model: nn.Module, loss: Callable) -> Callable:
        """Sharded: each block, and the output head with the loss (FSDP2's hooks run between the blocks); else the
        forward pass and the loss together, one graph."""
        if not self.compile:
            return loss
        if self.sharding is None:
            return torch.compile(loss)
        for block in model.blocks:
            block.compile()
        if self.tp == 1:  # under tp the head's loss is loss_parallel's operators on DTensors (lmtrain.nn.parallel), eager
            model.head_loss = torch.compile(model.head_loss)  # the output head and loss, fused (lmtrain.nn.model.Decoder)
        return loss

    def _weights(self, model: nn.Module, weights) -> None:
        if any(p.is_meta for p in model.parameters()):  # init_device=meta: allocate the local shards, then initialise
            model.to_empty(device=self.device)
            with torch.no_grad():
                model.init_weights()
        if weights is not None:  # after sharding: each rank reads its own rows
            weights.load_into(model)

