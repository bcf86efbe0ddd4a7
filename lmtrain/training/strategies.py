"""Strategies for ``conf/strategy/*.yaml``: Lightning's own by name, and FSDP2 / HSDP through ModelParallelStrategy.

``fsdp`` shards parameters, gradients and optimizer state over every rank (FSDP2 ``fully_shard`` per block,
then the root); ``hsdp`` shards within groups of ``shard_size`` ranks (a node) and replicates across groups,
through a 2-D ``("replicate", "shard")`` device mesh. Both run on CPU with gloo, so CI tests them, and write
sharded checkpoints (PyTorch distributed checkpoint, one file per rank). Options:

* ``mixed_precision``: under ``trainer.precision=bf16-mixed``, all-gather parameters in bf16 and reduce
  gradients in ``reduce_dtype`` (``MixedPrecisionPolicy``); the sharded master weights and optimizer state stay fp32.
  Under ``16-mixed``, parameters are gathered in fp16 and gradients reduced in fp32; the loss is scaled by
  ``torch.amp.GradScaler``, whose overflow check PyTorch reduces over the mesh for sharded (DTensor) gradients,
  so every rank skips the same steps (lmtrain.training.precision);
* ``reduce_dtype``: ``float32`` (the default: gradients summed over ranks in fp32) or ``bfloat16`` (half the
  reduce-scatter traffic; each rank's bf16 gradient is rounded before the sum);
* ``activation_checkpointing``: ``none``, ``selective`` (every other block), ``full`` (every block) or ``op``
  (every block, by operator: the matrix products' and attention's outputs are kept and only the cheap rest, the
  norms, activation functions, rotary embedding and dropout, is recomputed; torchtitan's op-level selective mode) or
  ``offload`` (``full``, with the block inputs it keeps held in host memory until the backward pass: the least card
  memory, for the longest contexts; lmtrain.training.offload);
* compiled by ``module.compile``: ``torch.compile`` each block, and the output head with the loss;
* ``tp``: tensor parallel, each block split over groups of ``tp`` ranks, the groups sharded (a 2-D mesh; 3-D under hsdp);
* ``cp``: context parallel (fsdp), each sequence split over groups of ``cp`` ranks (lmtrain.nn.context), the data-parallel
  and context-parallel ranks sharding together (a 3-D mesh: data, context, tensor parallel);
* ``ep``: expert parallel (a mixture of experts: lmtrain.nn.moe), each layer's experts split over groups of ``ep``
  consecutive ranks (under hsdp within a shard group: a node), replicated across the groups, each token's rows sent
  to its experts' ranks in its group and back (all-to-all); the experts' gradients are averaged over every rank;
* ``cpu_offload``: keep sharded parameters, gradients and optimizer state in host memory;
* ``reshard_after_forward``: free gathered parameters after forward (less memory, one more all-gather); the
  last block keeps them either way, as its backward comes right after;
* ``init_device``: ``cpu`` builds the full model on every rank with the seeded initialisation, then shards
  it (bit-identical to a single-process run); ``meta`` builds it without memory and initialises each shard
  in place (for models that do not fit one host's memory per rank).

Tensor parallel, activation checkpointing and compiling are applied by lmtrain.training.assemble, in its one order;
the strategy shards (:meth:`FSDP2Strategy.shard`).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lmtrain.errors import InputError
from lmtrain.training import compat
from lmtrain.training.layout import Layout

AC_MODES = ("none", "selective", "full", "op", "offload")
REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class StrategyError(InputError):
    """A strategy that cannot run as configured (accelerator, mesh, option)."""


def named(name: str) -> str:
    """A strategy Lightning knows by name (``auto``, ``single_device``, ``ddp``...), passed through."""
    return name


class FSDP2Strategy(ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) over all ranks; see the module docstring for the options."""

    @classmethod
    def config_problems(cls, options: dict, *, precision: str, on_cpu: bool, world_size: int, devices) -> list[str]:
        """What these options cannot do in this run (lmtrain.training.config asks before any process starts; the options' own
        values are checked in ``__init__``, where the strategy is built)."""
        out = []
        tp = options.get("tp", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            out.append(f"strategy.tp={tp!r} must be a positive number of ranks")
        elif world_size % tp:
            out.append(f"strategy.tp={tp} does not divide the world size {world_size} (trainer.devices x trainer.num_nodes)")
        cp = options.get("cp", 1)
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            out.append(f"strategy.cp={cp!r} must be a positive number of ranks")
        elif isinstance(tp, int) and tp >= 1 and world_size % (tp * cp):
            world = f"the world size {world_size} (trainer.devices x trainer.num_nodes)"
            out.append(f"strategy.cp={cp} x strategy.tp={tp} does not divide {world}")
        ep = options.get("ep", 1)
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            out.append(f"strategy.ep={ep!r} must be a positive number of ranks")
        elif ep > 1 and (tp != 1 or cp != 1):
            out.append(f"strategy.ep={ep}: expert parallel does not combine with tensor or context parallel yet (strategy.tp={tp}, strategy.cp={cp})")
        elif ep > 1 and world_size % ep:
            out.append(f"strategy.ep={ep} does not divide the world size {world_size} (trainer.devices x trainer.num_nodes): "
                       "the experts are split over groups of ep ranks, replicated across the groups")  # fmt: skip
        if on_cpu and options.get("cpu_offload"):
            out.append("strategy.cpu_offload=true needs GPUs: on CPU the parameters already live in host memory")
        mixed = str(precision) == "bf16-mixed" and options.get("mixed_precision", True)
        if options.get("reduce_dtype") == "bfloat16" and not mixed:
            out.append(
                f"strategy.reduce_dtype={options.get('reduce_dtype')} takes effect only with trainer.precision=bf16-mixed and "
                "strategy.mixed_precision=true (otherwise gradients are reduced in the parameters' fp32)"
            )
        return out

    def __init__(
        self,
        mixed_precision: bool = True,
        activation_checkpointing: str = "none",
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        init_device: str = "cpu",
        process_group_backend: str | None = None,
        timeout_s: int = 1800,
        reduce_dtype: str = "float32",
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> None:
        for key, value in (("tp", tp), ("cp", cp), ("ep", ep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(f"strategy.{key}={value!r} must be a positive number of ranks")
        if reduce_dtype not in REDUCE_DTYPES:
            raise StrategyError(f"strategy.reduce_dtype={reduce_dtype!r}: use one of {list(REDUCE_DTYPES)}")
        if activation_checkpointing not in AC_MODES:
            raise StrategyError(f"strategy.activation_checkpointing={activation_checkpointing!r}: use one of {list(AC_MODES)}")
        if init_device not in ("cpu", "meta"):
            raise StrategyError(f"strategy.init_device={init_device!r}: use 'cpu' or 'meta'")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=tp,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.mixed_precision, self.activation_checkpointing = mixed_precision, activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reshard_after_forward, self.init_device = reshard_after_forward, init_device
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        self.tp, self.cp, self.ep = tp, cp, ep
        self._shard_mesh = self._expert_mesh = None

    @classmethod
    def layout_for(cls, options: dict, *, world: int, devices) -> Layout:
        """The layout these options give ``world`` processes (lmtrain.training.layout): groups of ``tp`` ranks split
        each layer (tensor parallel), groups of ``cp`` such groups each sequence (context parallel), and all of them
        shard."""
        tp, cp = options.get("tp") or 1, options.get("cp") or 1
        if isinstance(tp, int) and isinstance(cp, int) and tp > 0 and cp > 0 and world % (tp * cp) == 0:
            return Layout(shard=world // (tp * cp), tp=tp, cp=cp)
        return Layout(shard=world)  # said by config_problems

    @property
    def layout(self) -> Layout:
        return Layout(shard=self.world_size // (self.tp * self.cp), tp=self.tp, cp=self.cp)

    def tensor_parallel_mesh(self):
        """The mesh each layer is split over (strategy.tp > 1), the inner dimension of the device mesh."""
        return self.device_mesh["tensor_parallel"]

    def context_parallel_mesh(self):
        """The mesh each sequence is split over (strategy.cp > 1)."""
        return self.device_mesh["context_parallel"]

    def setup_environment(self) -> None:
        if self.cp == 1:
            self._data_parallel_size = self.world_size_for_mesh()
            super().setup_environment()
            return
        from torch.distributed.device_mesh import init_device_mesh

        # devices and the process group as ModelParallelStrategy sets them up, then a 3-D mesh ordered as the layout
        # numbers the ranks (lmtrain.training.layout): (data parallel, context parallel, tensor parallel)
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        shape = (self.world_size // (self.cp * self.tp), self.cp, self.tp)
        names = ("data_parallel", "context_parallel", "tensor_parallel")
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        compat.set_module_device_mesh(self.lightning_module, self._device_mesh)

    def world_size_for_mesh(self) -> int:
        """The data-parallel size of the mesh: every process, in groups of ``tp``."""
        return self.num_nodes * self.num_processes // self.tp

    def shard_mesh(self):
        """The mesh ``fully_shard`` gets: 1-D over every rank of a tensor-parallel position (the data-parallel and,
        under context parallel, the context-parallel ranks together: each holds its own share of the gradients)."""
        if self.cp == 1:
            return self.device_mesh["data_parallel"]
        if self._shard_mesh is None:
            self._shard_mesh = self.device_mesh["data_parallel", "context_parallel"]._flatten("data_context_parallel")
        return self._shard_mesh

    def expert_mesh(self):
        """The mesh each MoE layer's experts are split over (strategy.ep > 1): every rank's 1-D shard mesh when ``ep``
        is all of them, else a 2-D ``("expert_replicate", "expert_parallel")`` mesh of groups of ``ep`` consecutive
        ranks (under hsdp, within a shard group), the experts split over dim 1 and replicated over dim 0."""
        if self.ep == self.world_size:
            return self.shard_mesh()
        if self._expert_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.world_size // self.ep, self.ep)
            self._expert_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("expert_replicate", "expert_parallel"))
        return self._expert_mesh

    # -- applied by lmtrain.training.assemble -----------------------------------------------------
    def shard(self, model: nn.Module, compiled: bool, kept: set | None = None) -> nn.Module:
        """``fully_shard`` each of ``model.blocks`` (as they are: checkpointed and compiled already), then the root, on
        :meth:`shard_mesh`; ``compiled`` is said in the line printed; ``kept``: parameters split already (expert
        parallel's experts), which FSDP leaves as they are: never gathered, their gradients not reduced."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": self.shard_mesh(), "reshard_after_forward": self.reshard_after_forward}
        if kept:
            kwargs["ignored_params"] = set(kept)
        precision = str(getattr(self.precision_plugin, "precision", ""))
        if self.mixed_precision and precision == "bf16-mixed":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype)
        elif self.mixed_precision and precision == "16-mixed":  # fp16 compute, fp32 reduction; lmtrain.training.precision scales the loss
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        blocks = model.blocks
        for i, block in enumerate(blocks):
            # the last block's parameters would be gathered again at once for the backward: keep them (as torchtitan)
            fully_shard(block, **{**kwargs, "reshard_after_forward": kwargs["reshard_after_forward"] and i < len(blocks) - 1})
        fully_shard(model, **kwargs)
        if self.global_rank == 0:
            mesh = kwargs["mesh"]
            print(
                f"[lmtrain] {type(self).__name__}: fully_shard per block on mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, "
                f"mixed precision {'mp_policy' in kwargs}{f' (reduce {self.reduce_dtype})' if 'mp_policy' in kwargs else ''}, "
                f"activation checkpointing {self.activation_checkpointing}, "
                f"compile {compiled}, cpu offload {self.cpu_offload}",
                file=sys.stderr,
            )
        return model

    @property
    def distributed_sampler_kwargs(self) -> dict:
        layout = self.layout
        return {"num_replicas": layout.dp, "rank": layout.dp_rank(self.global_rank)}

    def lightning_module_state_dict(self) -> dict:
        """This rank's shards of the model, where they are (Lightning's copies them to host memory first, tensor by
        tensor, which held training 8 s per save of 1.3B on 2 H100s): a synchronous save writes them as they are, an
        asynchronous one copies them once into its pinned buffers (lmtrain.callbacks.checkpoint). Float8-gathered
        weights as the plain tensors they wrap (lmtrain.training.fp8.plain_state)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from lmtrain.training.fp8 import plain_state

        return plain_state(get_model_state_dict(self.model))

    def optimizer_state(self, optimizer) -> dict:
        """This rank's shards of the optimizer state, keyed by parameter name, where they are (see above)."""
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """A sharded checkpoint on any number of ranks (distributed checkpoint reshards it), or a single-file one
        (``single``/``ddp``) loaded into the shards (lmtrain.training.checkpoint.reshard)."""
        from lmtrain.training.checkpoint import reshard

        path = Path(self.broadcast(checkpoint_path))
        split = self.tp > 1  # this run's products split for tensor parallelism (lmtrain.nn.model.Decoder.tensor_parallel_plan)
        if path.is_file():
            return reshard.load_full_into_sharded(path, self.lightning_module, self.optimizers, split=split)
        if reshard.saved_split(path) != split:  # saved on another side of tp = 1: read whole, fused or split, then sharded
            checkpoint = reshard.relayout(reshard.read_named(path), split=split, cfg=self.lightning_module.model.cfg)
            return reshard.load_named_into_sharded(checkpoint, self.lightning_module, self.optimizers)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # any tp > 1 to any other: DCP reshards


class HSDPStrategy(FSDP2Strategy):
    """Hybrid sharding: shard within groups of ``shard_size`` ranks, replicate across groups (2-D mesh).

    Args:
        shard_size: ranks per shard group; null = the processes of one node (``trainer.devices``).
    """

    @classmethod
    def config_problems(cls, options: dict, *, precision: str, on_cpu: bool, world_size: int, devices) -> list[str]:
        out = super().config_problems(options, precision=precision, on_cpu=on_cpu, world_size=world_size, devices=devices)
        tp, cp = options.get("tp") or 1, options.get("cp") or 1
        if not isinstance(tp, int) or not isinstance(cp, int) or tp < 1 or cp < 1 or world_size % (tp * cp):
            return out  # said by the parent
        shard = cls._shard(options.get("shard_size"), devices, tp * cp)
        ep = options.get("ep", 1)
        if isinstance(shard, int) and shard >= 1 and isinstance(ep, int) and ep > 1 and shard % ep:
            out.append(f"strategy.ep={ep} does not divide strategy.shard_size={shard}: under hsdp each group of experts stays "
                       "within a shard group (a node), where the all-to-all is fast")  # fmt: skip
        if isinstance(shard, int) and (shard < 1 or world_size % (shard * tp * cp)):
            groups = "".join(f" x strategy.{k}={v}" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
            out.append(
                f"strategy.shard_size={shard}{groups} does not divide the world size {world_size} (trainer.devices x trainer.num_nodes): "
                f"HSDP needs world size = replicas x shard_size{''.join(f' x {k}' for k, v in (('cp', cp), ('tp', tp)) if v > 1)}"
            )
        return out

    @staticmethod
    def _shard(shard_size, devices, group: int):
        """Data-parallel ranks per shard group: ``shard_size``, else one node's (``trainer.devices`` over the ranks of a
        tensor- and context-parallel ``group``)."""
        if shard_size:
            return shard_size
        return devices // group if isinstance(devices, int) and devices > 0 and devices % group == 0 else None

    def __init__(
        self,
        shard_size: int | None = None,
        mixed_precision: bool = True,
        activation_checkpointing: str = "none",
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        init_device: str = "cpu",
        process_group_backend: str | None = None,
        timeout_s: int = 1800,
        reduce_dtype: str = "float32",
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
    ) -> None:
        super().__init__(  # by name: the parent's arguments are this one's, listed again so that config keys are checked
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            init_device=init_device,
            process_group_backend=process_group_backend,
            timeout_s=timeout_s,
            reduce_dtype=reduce_dtype,
            tp=tp,
            cp=cp,
            ep=ep,
        )
        if shard_size is not None and shard_size < 1:
            raise StrategyError(f"strategy.shard_size={shard_size} must be a positive number of ranks")
        self.shard_size = shard_size

    @classmethod
    def layout_for(cls, options: dict, *, world: int, devices) -> Layout:
        """Groups of ``shard_size`` data-parallel ranks (else a node's) that shard, replicated across groups, each
        data-parallel rank a group of ``cp`` x ``tp`` ranks splitting each sequence and each layer."""
        tp, cp = options.get("tp") or 1, options.get("cp") or 1
        ok = isinstance(tp, int) and isinstance(cp, int) and tp > 0 and cp > 0
        shard = cls._shard(options.get("shard_size"), devices, tp * cp) or world // (tp * cp) if ok else None
        if not isinstance(shard, int) or shard < 1 or world % (shard * tp * cp):  # said by config_problems
            return Layout(shard=world)
        return Layout(replicate=world // (shard * tp * cp), shard=shard, tp=tp, cp=cp)

    @property
    def layout(self) -> Layout:
        group = self.tp * self.cp
        shard = self.shard_size or self.num_processes // group
        return Layout(replicate=self.world_size // (shard * group), shard=shard, tp=self.tp, cp=self.cp)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        # set up devices and the process group as ModelParallelStrategy does, then our own 2-D (3-D with tp) mesh
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        world, tp, cp = self.world_size, self.tp, self.cp
        shard = self.shard_size or self.num_processes // (tp * cp)
        if shard < 1 or world % (shard * tp * cp):
            raise StrategyError(
                f"strategy.shard_size={shard} does not divide the world size {world}: HSDP needs world = replicas x shard_size"
                + "".join(f" x {k} ({v})" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
            )
        # (replicate, shard[, context_parallel][, tensor_parallel]): the layout's rank order, tp varying fastest
        dims = [("replicate", world // (shard * tp * cp)), ("shard", shard), ("context_parallel", cp), ("tensor_parallel", tp)]
        dims = [d for d in dims if d[1] > 1 or d[0] in ("replicate", "shard")]
        names, shape = zip(*dims, strict=True)
        self._device_mesh = init_device_mesh(self.root_device.type, tuple(shape), mesh_dim_names=tuple(names))
        compat.set_module_device_mesh(self.lightning_module, self._device_mesh)

    def shard_mesh(self):
        """2-D: fully_shard replicates over dim 0 and shards over dim 1; under tp the 4-D mesh's outer two, under cp the
        shard and context-parallel ranks flattened into dim 1 (each holds its own share of the gradients)."""
        if self.cp == 1:
            return self.device_mesh if self.tp == 1 else self.device_mesh["replicate", "shard"]
        if self._shard_mesh is None:
            self.device_mesh["shard", "context_parallel"]._flatten("shard_context_parallel")
            self._shard_mesh = self.device_mesh["replicate", "shard_context_parallel"]
        return self._shard_mesh
