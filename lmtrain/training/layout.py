"""How a run's processes divide the work, in one object (the spirit of torchtitan's ``ParallelDims``): every reader
of "how many data-parallel ranks" and "which one is this" asks it, not ``trainer.world_size``.

The ranks are ``replicate x shard`` data-parallel ranks (DDP: replicate only; fsdp: shard only; hsdp: both), each a
group of ``tp x cp`` ranks that compute the same samples together (tensor and context parallel). Ranks are numbered
in the order (replicate, shard, cp, tp), tensor parallel varying fastest, so that a tensor-parallel group shares a
node. The data-parallel ranks are the ones that read different data: the sampler's replicas, the global batch's
factor, the tokens a step trains.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    replicate: int = 1
    shard: int = 1
    tp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for key in ("replicate", "shard", "tp", "cp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key}={value!r}: a positive number of ranks")

    @property
    def world(self) -> int:
        """Processes in the run."""
        return self.replicate * self.shard * self.tp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the ones that read different samples."""
        return self.replicate * self.shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank`` (the ranks of one tensor/context-parallel group share it)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} not in [0, {self.world})")
        return rank // (self.tp * self.cp)

    @classmethod
    def of_config(cls, cfg) -> Layout:
        """The layout a composed config asks for, before any process starts (lmtrain.training.config): the strategy's
        own answer (its ``layout_for``: the rules live with the class), else pure data parallel over every process."""
        from lmtrain.training.config import strategy_class, world_size
        from lmtrain.training.strategies import FSDP2Strategy

        world = world_size(cfg)
        strategy = cfg.get("strategy")
        target = strategy_class(cfg)
        if isinstance(target, type) and issubclass(target, FSDP2Strategy):
            options = {k: strategy.get(k) for k in strategy if not str(k).startswith("_")}
            return target.layout_for(options, world=world, devices=cfg.trainer.get("devices"))
        return cls(replicate=world)

    @classmethod
    def of(cls, trainer) -> Layout:
        """The layout of a running trainer: its strategy's (fsdp, hsdp), else data parallel over every process."""
        from lmtrain.training.strategies import FSDP2Strategy

        if trainer is None:
            return cls()
        if isinstance(trainer.strategy, FSDP2Strategy):
            return trainer.strategy.layout
        return cls(replicate=trainer.world_size)


def tensor_parallel_problems(tp: int, model_cfg, head_kind: str, fp8_recipe, fused_mlp: bool, seq_len=None, cp: int = 1) -> list[str]:
    """What ``strategy.tp`` cannot split in this run, before any process starts: heads and MLP features it does not
    divide (lmtrain.nn.model.Decoder.tensor_parallel_plan says the same at assembly), and what does not run under
    tensor parallelism yet (a fused or float8 output head, the fused float8 MLP)."""
    if tp == 1:
        return []
    out = []
    if model_cfg is not None and getattr(model_cfg, "qk_norm", False) == "projection":
        out.append(f"model.qk_norm=projection with strategy.tp={tp}: a norm over the whole projection spans every rank's heads "
                   "(use model.qk_norm=true, each head's, under tensor parallel)")  # fmt: skip
    if model_cfg is not None and getattr(model_cfg, "moe", None) is not None:
        out.append(f"model.moe with strategy.tp={tp}: tensor parallel does not split experts yet (train a mixture of experts under fsdp)")
    if model_cfg is not None and (undivided := model_cfg.undivided_by(tp)):
        out.append(f"strategy.tp={tp} splits heads and MLP features over {tp} ranks: it does not divide {undivided}")
    if head_kind not in ("plain", "chunked"):
        out.append(f"module.head.kind={head_kind} with strategy.tp={tp}: under tensor parallel the output head is the plain or "
                   "the chunked one (split by vocabulary) for now")  # fmt: skip
    if fused_mlp:
        out.append(f"module.fp8.fused_mlp=true with strategy.tp={tp}: the fused float8 MLP takes SwiGLU's gate and up products "
                   "whole, which tensor parallel splits (use module.fp8.fused_mlp=false)")  # fmt: skip
    # between the branches each rank holds an equal part of every sequence (sequence parallelism): a training sequence
    # (its context-parallel share) must divide by tp; shorter ones (evaluations, generation) are padded up to a multiple
    # of tp within model.max_seq_len, so that must divide too
    share = seq_len // cp if isinstance(seq_len, int) and seq_len % cp == 0 else seq_len
    if isinstance(share, int) and share % tp:
        what = f"data.seq_len={seq_len}" + (f" over strategy.cp={cp} ({share})" if cp > 1 else "")
        out.append(f"strategy.tp={tp} splits each sequence between the blocks' branches into {tp} equal parts: {what} does not divide by {tp}")
    max_len = getattr(model_cfg, "max_seq_len", None)
    if isinstance(max_len, int) and max_len % tp:
        out.append(f"strategy.tp={tp} pads shorter sequences to a multiple of {tp}: model.max_seq_len={max_len} does not divide by {tp}")
    return out



def context_parallel_problems(cp: int, seq_len) -> list[str]:
    """What ``strategy.cp`` cannot split, before any process starts: a sequence is cut into ``2 x cp`` chunks (each
    rank one from the front and one from the back: lmtrain.nn.context), so ``data.seq_len`` must divide by it."""
    if cp == 1 or not isinstance(seq_len, int) or seq_len % (2 * cp) == 0:
        return []
    return [f"strategy.cp={cp} cuts each sequence into {2 * cp} equal chunks: data.seq_len={seq_len} does not divide by {2 * cp}"]
