"""The LightningModule: next-token cross-entropy around an injected decoder."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmtrain.errors import InputError
from lmtrain.nn.loss import cross_entropy, loss_parts, z_loss_problem
from lmtrain.nn.model import LanguageModel, QKProbe
from lmtrain.nn.optim import build_optimizer
from lmtrain.training import compat, fastpaths, precision
from lmtrain.training import fp8 as fp8_module
from lmtrain.training.assemble import Plan
from lmtrain.training.checkpoint.position import adapt_to_layout
from lmtrain.training.contracts import StepChecker
from lmtrain.training.health import every_rank
from lmtrain.training.layout import Layout
from lmtrain.training.logs import log_direct
from lmtrain.training.routing import RoutingStats


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (lmtrain.nn.loss.cross_entropy). A model with a ``head_loss``
    (lmtrain.nn.model.Decoder) computes it in its own forward (which a sharded strategy compiles); ``doc``: each
    token's document, for attention masked at document boundaries (``data.document_mask``)."""
    if isinstance(model, LanguageModel):
        return model(inputs, targets) if doc is None else model(inputs, targets, doc)
    if doc is not None:
        raise ValueError(
            f"data.document_mask=true needs a model that takes document ids (lmtrain.nn.model.Decoder), not {type(model).__name__}"
        )
    return cross_entropy(model(inputs), targets)  # any other (B, T) -> (B, T, V) network


SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_backends(spec: str | list[str] | None) -> list[SDPBackend] | None:
    """``module.sdpa_backend`` as SDPA backends in priority order (None: PyTorch's default order)."""
    if spec is None:
        return None
    names = [spec] if isinstance(spec, str) else list(spec)
    bad = [n for n in names if n not in SDPA_BACKENDS]
    if bad or not names:
        raise InputError(f"module.sdpa_backend={spec!r}: use one of {sorted(SDPA_BACKENDS)}, a list of them, or null")
    return [SDPA_BACKENDS[n] for n in names]


def batch_seed(seed: int, batch: int, rank: int) -> int:
    """A well-mixed 63-bit seed for one (seed, batch, rank)."""
    x = (seed * 0x9E3779B97F4A7C15 + batch * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return (x * 0xD6E8FEB86659FD93 % (1 << 64)) >> 1


@dataclass
class _StepStats:
    """One optimizer step's global statistics (loss, gradient norm, final activation RMS, fp16 loss scale and overflow), on their
    way to the host without blocking it: a non-blocking copy into pinned memory and an event marking its arrival."""

    step: int  # this step's number, counted from 1 as checkpoints count them (compat.step_number)
    lr: float
    values: torch.Tensor
    ready: torch.cuda.Event | None
    rerun: dict | None = None  # the step computed again on its batches before its update (LMModule._rerun)

    @classmethod
    def record(cls, trainer, optimizer, values: torch.Tensor, rerun: dict | None = None) -> _StepStats:
        values, ready = _to_host(values)
        return cls(compat.step_number(trainer), optimizer.param_groups[0]["lr"], values, ready, rerun)

    def read(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        return [float(v) for v in self.values.tolist()]


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A device tensor's copy on its way into pinned host memory without blocking, and the event marking its arrival."""
    if not values.is_cuda:
        return values.detach(), None
    values = values.detach().to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return values, ready


@dataclass
class _MicroBatch:
    """A training micro-batch kept until its step's update, to compute it again (LMModule._rerun): the tensors, and the
    random state its forward pass drew dropout from."""

    batch: tuple
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """The global norm of the gradients (a plain tensor), after scaling them down to ``max_norm`` if above it, as
    ``torch.nn.utils.clip_grad_norm_``, also where they are DTensors on several meshes (FSDP's shard mesh and expert
    parallel's expert mesh: lmtrain.nn.moe), whose norms PyTorch's cannot combine: each mesh's norm is made whole
    (``full_tensor``) and the norms combined."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor under FSDP2
    from torch.distributed.tensor.experimental import implicit_replication

    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
    with implicit_replication():  # the plain total scales each mesh's DTensors
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class LMModule(L.LightningModule):
    """Pretraining objective around any ``(B, T) ids -> (B, T, V) logits`` network.

    Args:
        model: the network, or a zero-argument factory for it (a ``_partial_: true`` config). A factory is
            called in ``configure_model``, so sharded strategies can build it on the meta device.
        optimizer: a partial optimizer (``_partial_: true``), finished on the model's parameter groups.
        scheduler: a partial LR scheduler taking the optimizer, stepped once per optimizer step, or None.
        grad_clip: clip the global gradient norm to this value (None or 0: measure only). Done here rather than
            with the Trainer's ``gradient_clip_val``, which Lightning refuses with fused AdamW under mixed precision.
        compile: ``torch.compile`` the forward pass and loss together (single device and DDP; ``auto``: on a GPU, not on
            the CPU); under a sharded
            strategy it turns on the strategy's own ``compile`` (per block, and the head with the loss:
            lmtrain.training.run). Parameter names do not change.
        sdpa_backend: attention kernel(s) for ``scaled_dot_product_attention``, in priority order: ``flash``,
            ``cudnn`` (cuDNN's fused attention, the fastest on Hopper GPUs in our measurements, see docs/BENCHMARKS.md),
            ``efficient`` or ``math``; a name or a list. None: PyTorch's own choice.
        head: ``module.head``, how the output head and its loss are computed: ``kind`` plain (the default),
            chunked, liger or float8, and ``chunk_tokens`` (lmtrain.training.fastpaths).
        fp8: ``module.fp8``, float8 matmuls in the transformer blocks: ``recipe`` (tensorwise, rowwise or None),
            ``fast_accum`` and ``fused_mlp`` (lmtrain.training.fastpaths, lmtrain.training.fp8).
        seed: if set, torch's RNG (dropout) is re-seeded before every training batch from (seed, batch number,
            rank): the masks of a batch then do not depend on what else drew random numbers before it
            (validation, loader start-up), so a resumed or rolled-back run draws exactly the same ones.
        z_loss: ``module.z_loss``, the coefficient of the log-partition penalty added to the loss in every head
            (lmtrain.nn.loss.with_z_loss; OLMo 2: 1e-5), logged as ``train/z_loss`` (the penalty added: the coefficient
            times the mean squared log-partition); 0: none. ``train/loss`` and
            ``val/loss`` stay the cross-entropy.
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        grad_clip: float | None = 1.0,
        seed: int | None = None,
        compile: bool | str = False,
        sdpa_backend: str | list[str] | None = None,
        head: Mapping | fastpaths.Head | None = None,
        fp8: Mapping | fastpaths.Float8 | None = None,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__()
        if (problem := z_loss_problem(z_loss)) is not None:
            raise InputError(problem)
        self.z_loss = float(z_loss)
        self._sdpa = sdpa_backends(sdpa_backend)
        self.head, self.fp8, problems = fastpaths.read(head, fp8)
        problems = problems or fastpaths.problems(self.head, self.fp8)
        if problems:
            raise InputError("; ".join(problems))
        if isinstance(model, nn.Module):
            self.model: nn.Module | None = model
            self._model_factory = None
        else:
            self.model = None
            self._model_factory = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.grad_clip = grad_clip
        self.seed = seed
        if compile not in (True, False, "auto"):
            raise InputError(f"module.compile={compile!r} must be true, false or auto")
        self.compile = compile
        self._loss_fn = lm_loss
        self._val_sums = torch.zeros(1, 2)  # per validation set: (sum of loss x tokens, tokens)
        self._train_losses: list[torch.Tensor] = []
        self._train_z: list[torch.Tensor] = []
        self._act_sq: list[torch.Tensor] = []
        self._act_hook = None
        self._qk_bounds: list[torch.Tensor] = []
        self._qk_hooks: list = []
        self._routing: RoutingStats | None = None
        self._pending_stats: list[_StepStats] = []
        self._step_batches: list[_MicroBatch] = []  # this optimizer step's, while a checker reruns suspect steps
        self._step_data: tuple | None = None  # ((epoch, global position), samples) of this step's data (_claim_batch)
        self._step_loss: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # (global, local) loss, as forward ended
        self._rerunning = False
        self.last_train_loss: float | None = None
        self.last_train_lr: float | None = None  # the rate the optimizer used at the step of last_train_loss
        self.init_weights_from = None  # init_from=DIR (lmtrain.training.init_from.Loader): read into the model once built
        self._assembled = False
        self.tokens_trained = 0  # summed step by step as trained, so exact across resumes on any layout (in checkpoints)
        self.samples_trained = 0

    def configure_model(self) -> None:
        """The model assembled, once (lmtrain.training.assemble: built, its head, float8, activation checkpointing,
        compiled, sharded, its weights), then the probes the step statistics read."""
        if self._assembled:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        plan = Plan.of(self, strategy)
        built = self.model if self.model is not None else self._model_factory
        self.model, self._loss_fn = plan.assemble(built, lm_loss, self.init_weights_from)
        self.init_weights_from, self.compile, self._assembled = None, plan.compile, True
        if isinstance(self.model, LanguageModel) and self._act_hook is None:
            # first of its hooks: the residual stream as the blocks left it (before a tensor-parallel style's own)
            self._act_hook = self.model.final_norm.register_forward_pre_hook(self._record_activation, prepend=True)
        if not self._qk_hooks:  # lmtrain.nn.model.Decoder's attention layers (another network may have none)
            self._qk_hooks = [m.register_forward_pre_hook(self._record_qk) for m in self.model.modules() if isinstance(m, QKProbe)]
        if self._routing is None:  # a mixture of experts' routers (lmtrain.training.routing)
            self._routing = RoutingStats(self.model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        if self._sdpa is None:
            return self._loss_fn(self.model, inputs, targets, doc)
        with sdpa_kernel(self._sdpa, set_priority=True):
            return self._loss_fn(self.model, inputs, targets, doc)

    # -- training ---------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        # FP8 on the CPU in fp32: the float8 products in PyTorch's emulation, not oneDNN's slow path (fp8.emulate_cpu_matmuls)
        self._onednn_off = fp8_module.emulate_cpu_matmuls(fastpaths.uses_float8(self.head, self.fp8), self.device, self.trainer.precision)

    def teardown(self, stage: str) -> None:
        self._step_batches, self._step_loss = [], None  # a step abandoned by a stop keeps nothing
        self._step_data = None
        torch.compiler.set_stance("default")  # a validation that raised leaves no stance behind
        fp8_module.restore_onednn(getattr(self, "_onednn_off", False))
        self._onednn_off = False

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.seed is not None:
            n = self.trainer.fit_loop.epoch_loop.total_batch_idx  # restored with the loops on resume
            # by data-parallel rank: the ranks that split one layer draw the same masks on the activations they share
            torch.manual_seed(batch_seed(self.seed, n, Layout.of(self.trainer).dp_rank(self.global_rank)))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        inputs, targets, *doc = batch  # (B, T), (B, T), and with data.document_mask each token's document (B, T)
        where = self._claim_batch()
        if self._step_data is None:  # the step's first micro-batch: where the step's data begins
            self._step_data = where
        if self._reruns():
            cuda = torch.cuda.get_rng_state(inputs.device) if inputs.is_cuda else None
            self._step_batches.append(_MicroBatch(tuple(batch), torch.get_rng_state(), cuda))
        loss, parts = loss_parts(self.loss(inputs, targets, *doc))
        if parts is None:
            self._train_losses.append(loss.detach())
        else:  # with module.z_loss: the cross-entropy and z are logged, their sum minimised
            self._train_losses.append(parts[0])
            self._train_z.append(parts[1])
        return loss

    def _claim_batch(self) -> tuple | None:
        """This micro-batch's place in the data stream, from the sampler that drew it (data.datamodule.BlockSampler):
        ((epoch, global position), samples a step over every rank), or None for a data module without one."""
        sampler = getattr(getattr(self.trainer, "datamodule", None), "sampler_in_use", None)
        where = sampler.trained() if sampler is not None else None
        return None if where is None else (where, sampler.unit * sampler.num_replicas)

    def _log_step_data(self) -> None:
        """The step's data as the audit reads it (lmtrain.audit): ``data/epoch``, ``data/position`` (where in the epoch's
        global sample order the step's samples begin) and ``data/samples`` (how many, over every rank); and the training
        tokens read from each source so far, ``data/tokens/<name>`` (lmtrain.data.datamodule's count_read)."""
        if self._step_data is not None:
            (epoch, position), samples = self._step_data
            tokens = self.trainer.datamodule.count_read(epoch, position, samples)
            log_direct(self.trainer, {"data/epoch": epoch, "data/position": position, "data/samples": samples, **tokens},
                       step=compat.step_number(self.trainer))  # fmt: skip
        self._step_data = None

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # A stop asked for at this step (a preemption, a guard) ends the run after it; Lightning would first run a
        # validation of its own, outside the schedule: a row an uninterrupted run lacks, and time an exit may not have.
        # (Lightning calls this after every callback's hook, so every stop of this step is seen here.)
        if self.trainer.should_stop and not compat.validates_after_this_batch(self.trainer):
            compat.skip_validation_after_this_batch(self.trainer)

    def _record_activation(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook on the final norm: mean square of the last block's output (the residual stream), in
        training forwards only (the norm's own mode: the evals put the model, not this module, in eval mode)."""
        if module.training and not self._rerunning:
            self._act_sq.append(args[0].detach().float().square().mean())

    def _record_qk(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook on each attention layer's QKProbe, in training forwards only: the layer's bound on its
        largest attention logit, the largest query norm times the largest key norm over sqrt(head_dim) (no logit
        q.k / sqrt(head_dim) exceeds it); its growth is the sign of attention-logit growth (Wortsman et al. 2023)
        at the cost of two norms, where the logits themselves are never formed by the fused attention kernels."""
        if module.training and not self._rerunning:
            q, k = args
            qn = torch.linalg.vector_norm(q.detach(), dim=-1, dtype=torch.float32).amax()
            kn = torch.linalg.vector_norm(k.detach(), dim=-1, dtype=torch.float32).amax()
            self._qk_bounds.append(qn * kn * q.shape[-1] ** -0.5)

    # -- a suspect step computed again on the same batches --------------------------------------
    def _reruns(self) -> list[StepChecker]:
        return [c for c in self._checkers() if c.reruns_suspects] if self._trainer is not None else []

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """As the step's last forward pass ends, before its backward pass is launched: the step's loss (all ranks'
        mean) and this rank's own, on their way to the host. Read before the update (``_rerun``), they cost no wait
        for the device: its backward pass is queued behind them."""
        if self._train_losses and compat.ends_optimizer_step(self.trainer) and self._reruns():
            local = torch.stack(self._train_losses).mean().float()
            glob = self.trainer.strategy.reduce(local.clone(), reduce_op="mean")
            self._step_loss = _to_host(torch.stack([glob, local]))

    def _rerun(self, checkers: list[StepChecker]) -> dict | None:
        """A suspect step (``StepChecker.suspects``: a non-finite loss, a spike) computed again on the same micro-batches,
        with the same parameters and random state, before its update. A hardware fault (a flipped bit, a bad card)
        rarely strikes twice alike; the data and the model give the same loss again. Each rank compares its own two
        results, within the checker's tolerance; every rank learns which ranks differed. None: not suspect."""
        batches, self._step_batches = self._step_batches, []
        pending, self._step_loss = self._step_loss, None
        if pending is None or not checkers or not batches:
            return None
        values, ready = pending
        if ready is not None:
            ready.synchronize()  # the forward pass's end: the device is busy with the backward pass queued after it
        glob, local = (float(v) for v in values.tolist())
        step = compat.step_number(self.trainer)
        suspect = next((s for c in checkers if (s := c.suspects(glob, step)) is not None), None)
        if suspect is None:
            return None
        why, tolerance = suspect
        again = self._forward_again(batches)
        same = (not math.isfinite(local) and not math.isfinite(again)) or abs(local - again) <= max(tolerance, 0.05 * abs(again))
        world, rank = self.trainer.world_size, self.global_rank
        table = torch.zeros(world, 3, dtype=torch.float64, device=self.device)
        table[rank] = torch.tensor([float(not same), local, again], dtype=torch.float64)
        table = self.trainer.strategy.reduce(table, reduce_op="sum").cpu()  # each rank's row: the same on every rank
        differs = [r for r in range(world) if table[r, 0] > 0]
        return {
            "why": why,
            "again": float(table[:, 2].mean()),
            "differs": differs,
            "results": [[float(a), float(b)] for a, b in table[:, 1:].tolist()],
            "hosts": every_rank((socket.gethostname(), str(self.device))) if differs else None,  # a collective: every rank is here
        }

    def _forward_again(self, batches: list[_MicroBatch]) -> float:
        """This rank's mean loss over ``batches`` computed again (no gradients; eagerly, where a compiled graph was
        made for a training step: the result is compared within a tolerance, never bit for bit), each with the random
        state its first forward pass had; the run's own random state is put back after."""
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._rerunning = True
        torch.compiler.set_stance("force_eager")
        try:
            losses = []
            with torch.no_grad(), self.trainer.precision_plugin.forward_context():  # autocast as the training step had it
                for mb in batches:
                    torch.set_rng_state(mb.cpu_rng)
                    if mb.cuda_rng is not None:
                        torch.cuda.set_rng_state(mb.cuda_rng, self.device)
                    inputs, targets, *doc = mb.batch
                    loss, parts = loss_parts(self.loss(inputs, targets, *doc))
                    losses.append((loss if parts is None else parts[0]).float())
            return float(torch.stack(losses).mean())
        finally:
            torch.compiler.set_stance("default")
            self._rerunning = False
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Gradients are complete (and unscaled under fp16) here: measure and clip the global norm.
        max_norm = self.grad_clip if self.grad_clip else float("inf")
        norm = clip_grad_norm(self.parameters(), max_norm)
        nan = torch.full((), float("nan"), device=self.device)  # a fill kernel: torch.tensor(x, device=cuda) would block on a copy
        local = torch.stack(
            [
                torch.stack(self._train_losses).mean().float() if self._train_losses else nan,
                torch.stack(self._act_sq).mean() if self._act_sq else nan,
                torch.stack(self._train_z).mean().float() if self._train_z else nan,
                torch.stack(self._qk_bounds).amax() if self._qk_bounds else nan,  # over layers and micro-batches
            ]
        )
        self._train_losses.clear()
        self._act_sq.clear()
        self._train_z.clear()
        self._qk_bounds.clear()
        self._log_step_data()
        # every rank sees the same values (the attention bound: the mean of the ranks' largest, so they judge alike)
        loss, act_ms, z, qk = self.trainer.strategy.reduce(local, reduce_op="mean")
        scaler = precision.scaler_of(self.trainer)
        values = torch.stack(
            [
                loss,
                norm.to(loss),
                act_ms.sqrt() if self._act_hook is not None else nan,
                precision.loss_scale(scaler).to(loss) if scaler is not None else nan,
                precision.overflowed(scaler, optimizer).to(loss) if scaler is not None else nan,  # the same on every rank
                z,
                qk,
            ]
        )
        if self._routing:  # a mixture of experts' routing this step, every rank's tokens
            values = torch.cat([values, self._routing.step_values(self.trainer.strategy, self.device).to(values)])
        # Only what the device has finished is read: the statistics of this step are judged at the next one (or at a
        # save, or at the end), so the host never waits for the device mid-step. A checker that must act on this very
        # update (a `skip` action) asks for it now: one device sync per step.
        checkers = self._checkers()
        drop = self._judge_stats(checkers)  # the steps before this one
        rerun = self._rerun([c for c in checkers if c.reruns_suspects])  # this one's loss, read as its forward ended
        self._pending_stats.append(_StepStats.record(self.trainer, optimizer, values, rerun))
        if rerun is not None:  # every rank has the same verdict
            for checker in checkers:
                if checker.reruns_suspects:
                    drop |= bool(checker.on_rerun(self.trainer, self, compat.step_number(self.trainer), rerun))
        if any(c.needs_same_step for c in checkers):
            drop |= self._judge_stats(checkers)
        if drop:
            self.drop_update(optimizer)
        elif self._routing:
            self._routing.balance()  # the experts' selection biases, as the step's update (lmtrain.nn.moe)

    def _checkers(self) -> list[StepChecker]:
        return [c for c in self.trainer.callbacks if isinstance(c, StepChecker)]

    def flush_step_stats(self) -> None:
        """Log and judge every step's statistics not yet read (before a checkpoint is saved, at the end)."""
        if self._pending_stats:
            self._judge_stats(self._checkers())

    def _judge_stats(self, checkers: list) -> bool:
        """Log the pending steps' statistics and run the checkers on them; True: drop the current update.

        Nothing here goes through ``self.log``: Lightning turns every logged value into a device tensor and reads it
        back with ``.item()`` each step (for the progress bar), a device sync that left the GPU idle at every step
        boundary (measured: docs/BENCHMARKS.md). The progress bar reads ``last_train_loss`` instead."""
        todo, self._pending_stats = self._pending_stats, []
        drop = False
        for rec in todo:
            loss, norm, act_rms, scale, overflow, z, qk, *routing = rec.read()
            extra = {"train/loss": loss, "train/lr": rec.lr, "train/grad_norm": norm}
            if self._routing:
                extra.update(zip(self._routing.names(), routing, strict=True))
            if self._act_hook is not None:
                extra["train/act_rms"] = act_rms
            if self._qk_hooks:
                extra["train/attn_logit_bound"] = qk
            if self.z_loss:
                extra["train/z_loss"] = self.z_loss * z  # the penalty added to the objective (OLMo-core's "Z loss")
            log_direct(self.trainer, extra, step=rec.step)
            self.last_train_loss, self.last_train_lr = loss, rec.lr
            stats = {
                "step": rec.step,
                "loss": loss,
                "grad_norm": norm,
                "act_rms": extra.get("train/act_rms"),
                "attn_bound": extra.get("train/attn_logit_bound"),
                "loss_scale": None if math.isnan(scale) else scale,
                "overflow": None if math.isnan(overflow) else bool(overflow),  # fp16: the scaler skips this update
                "routing_collapse": extra.get("moe/collapse"),  # a mixture of experts (lmtrain.training.routing)
            }
            if rec.rerun is not None:  # computed again before its update: how many ranks' results differed, and the loss
                stats["rerun_differs"], stats["rerun_loss"] = len(rec.rerun["differs"]), rec.rerun["again"]
            for checker in checkers:  # all ranks decide alike: the statistics are global
                drop |= bool(checker.check_step(self.trainer, self, stats))
        return drop

    def on_train_end(self) -> None:
        self.flush_step_stats()

    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step across all ranks (from the data module's batch shape)."""
        samples = self.samples_per_step()
        return samples * self.trainer.datamodule.seq_len if samples else 0

    def samples_per_step(self) -> int:
        """Sequences in one optimizer step across all ranks (the global batch)."""
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "seq_len"):
            return 0
        return dm.batch_size * Layout.of(self.trainer).dp * self.trainer.accumulate_grad_batches

    def drop_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Make this optimizer step a no-op: no parameter, moment or weight-decay update. Torch optimizers leave a
        parameter without a gradient untouched; under fp16 the gradients were unscaled already (lmtrain.training.precision),
        so the scaler's step and update go on normally and the loss scale is not lowered for a skip it did not cause."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    # -- validation -------------------------------------------------------------------------------
    def _val_sets(self) -> tuple[list[str], list[bool]]:
        """The data module's named validation sets and which of them make up ``val/loss`` (lmtrain.data.datamodule:
        each source of a mixture, each extra held-out set); one unnamed set otherwise."""
        dm = self.trainer.datamodule
        names = list(getattr(dm, "val_names", None) or [])
        combined = list(getattr(dm, "val_combined", None) or [True] * len(names))
        return (names, combined) if len(names) > 1 else ([], [True])

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(len(self._val_sets()[1]), 2, device=self.device, dtype=torch.float64)
        # Validation compiles nothing: a compiled training step's graphs do not fit it (no gradients, eval mode), and a
        # compilation for a few batches cost more than they took; it runs eagerly wherever no compiled graph fits.
        torch.compiler.set_stance("eager_on_recompile")

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> None:
        inputs, targets, *doc = batch
        loss, parts = loss_parts(self.loss(inputs, targets, *doc))
        loss = loss if parts is None else parts[0]  # the cross-entropy, with or without a z-loss
        self._val_sums[dataloader_idx, 0] += loss.detach().double() * targets.numel()
        self._val_sums[dataloader_idx, 1] += targets.numel()

    def _log_val(self, key: str, total: torch.Tensor, **kwargs) -> torch.Tensor:
        loss = (total[0] / total[1]).float()
        self.log(f"val/loss{key}", loss, sync_dist=False, rank_zero_only=True, **kwargs)
        self.log(f"val/ppl{key}", torch.exp(loss).clamp(max=math.exp(50)), sync_dist=False, rank_zero_only=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        torch.compiler.set_stance("default")
        totals = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")  # (sets, 2), the same on every rank
        names, combined = self._val_sets()
        if bool((totals[:, 1] > 0).any()):
            # at the number of the step validated (the 250th step's validation at 250, as its checkpoint and its train
            # values): Lightning logs a value named "step" as the step of the others, and no "epoch" beside them
            self.log("step", float(self.trainer.global_step), sync_dist=False, rank_zero_only=True)
        for name, total in zip(names, totals):
            if total[1] > 0:
                self._log_val(f"/{name}", total)
        total = totals[torch.tensor(combined, device=totals.device)].sum(0)
        if total[1] == 0:
            return
        self._log_val("", total, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lmtrain_trained"] = {"tokens": self.tokens_trained, "samples": self.samples_trained}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # checkpoints before 2026-12-01 keep no sums: their steps counted at this run's step size
        steps = int(checkpoint.get("global_step", 0))
        trained = checkpoint.get("lmtrain_trained") or {
            "tokens": steps * self.tokens_per_step(),
            "samples": steps * self.samples_per_step(),
        }
        self.tokens_trained, self.samples_trained = int(trained["tokens"]), int(trained["samples"])
        if hasattr(self.trainer.datamodule, "train_sampler"):  # lmtrain.data.datamodule: a resume on another layout
            adapt_to_layout(checkpoint, self.trainer.datamodule)

    # -- optimisation -----------------------------------------------------------------------------
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        samples = self.samples_per_step()
        if samples:  # a step whose update was dropped (skip, fp16 overflow) read them too
            self.samples_trained += samples
            self.tokens_trained += samples * self.trainer.datamodule.seq_len
        # Free the gradients now. Lightning zeroes them after the next batch's forward pass, so they would sit in
        # memory (4 bytes per parameter in fp32) through that forward, where the activations peak: 4.7 GiB of a
        # 1.3B model's peak, measured against the hand-written loop (docs/BENCHMARKS.md).
        optimizer.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.optimizer_factory, self.model)
        if fp8_module.uses_float8_all_gather(self.model):
            optimizer.register_step_post_hook(lambda *_: fp8_module.precompute_scales(self.model))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
