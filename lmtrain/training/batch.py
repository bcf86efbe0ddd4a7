"""``data.batch_size=auto``: the largest micro-batch that fits this GPU for this model, preset and strategy.

The size comes from lmtrain.plan's memory count (weights, gradients, optimizer state, activations by layer and
checkpointing mode, logits by output head, gathered parameters under fsdp/hsdp: within a few percent of the peaks
measured on H100s and H200s, tests/test_plan.py), searched over the card's memory with the planner's 10% margin:
the largest size whose counted peak fits. With ``global_batch_size`` set, only sizes that divide it over the ranks
are tried, and ``trainer.accumulate_grad_batches`` follows (lmtrain.training.config.apply_global_batch_size); without
it the global batch is the chosen size times the ranks times the accumulation. The choice is said in one line at the
start. On the CPU there is no card's memory to fill: ``auto`` is refused there, with the number to give instead.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from lmtrain.errors import InputError

LIMIT = 4096  # the largest micro-batch tried


def _strategy(cfg: DictConfig) -> tuple[str, str]:
    """The planner's strategy (ddp, fsdp or hsdp) and activation-checkpointing mode for this run's strategy."""
    st = cfg.get("strategy") or {}
    target = str(st.get("_target_", ""))
    if target.endswith("HSDPStrategy"):
        name = "hsdp"
    elif target.endswith("FSDP2Strategy"):
        name = "fsdp"
    else:  # single device, ddp, Lightning's own by name: every rank holds the whole model
        name = "ddp"
    return name, str(st.get("activation_checkpointing", "none") or "none") if name != "ddp" else "none"


def largest(cfg: DictConfig, *, memory_bytes: float, world: int, node: int) -> tuple[int, float]:
    """The largest micro-batch whose planned peak fits ``memory_bytes`` (with the planner's margin), and that peak in
    bytes; an InputError naming the model when not even one sequence fits."""
    from lmtrain.training import memory

    strategy, ac = _strategy(cfg)
    gbs = cfg.get("global_batch_size")
    if gbs and gbs % world:
        raise InputError(
            f"data.batch_size=auto with global_batch_size={gbs}: the global batch does not divide over the world size "
            f"{world} (trainer.devices x trainer.num_nodes); give a multiple of {world}"
        )
    sizes = [b for b in range(1, LIMIT + 1) if not gbs or (gbs // world) % b == 0]
    base = OmegaConf.to_container(cfg, resolve=True)
    peaks: dict[int, float] = {}

    def peak(b: int) -> float:
        if b not in peaks:
            trial = OmegaConf.create(base)
            trial.data.batch_size = b
            peaks[b] = memory.peak(trial, world, node, strategy, ac)
        return peaks[b]

    budget = memory.MARGIN * memory_bytes
    if peak(sizes[0]) > budget:
        raise InputError(
            f"data.batch_size=auto: not even one sequence of data.seq_len={cfg.data.seq_len} fits "
            f"{memory_bytes / 2**30:.1f} GiB for model {cfg.model.get('name')} under {strategy} ({peak(sizes[0]) / 2**30:.1f} GiB counted): "
            "shard it (strategy=fsdp), checkpoint activations (strategy.activation_checkpointing=full) or shorten data.seq_len"
        )
    lo, hi = 0, len(sizes) - 1  # the counted peak grows with the batch: bisect for the last size that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(sizes[mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return sizes[lo], peak(sizes[lo])


def resolve(cfg: DictConfig) -> str | None:
    """``data.batch_size=auto`` replaced by the chosen size in place (on a GPU); the line saying so, or None when the
    size was given."""
    data = cfg.get("data")
    if data is None or data.get("batch_size") != "auto":
        return None
    import torch

    from lmtrain.training import memory
    from lmtrain.training.config import device_type, world_size

    if device_type(cfg.trainer.get("accelerator", "auto")) != "cuda" or not torch.cuda.is_available():
        raise InputError(
            "data.batch_size=auto sizes the micro-batch to a GPU's memory, and this run trains on the CPU: give a number "
            "(data.batch_size=8, the quickstart's)"
        )
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    world = world_size(cfg)
    node = max(1, world // int(cfg.trainer.get("num_nodes", 1) or 1))  # ranks per node
    size, peak = largest(cfg, memory_bytes=total, world=world, node=node)
    with open_dict(cfg):
        data.batch_size = size
    gbs = cfg.get("global_batch_size")
    steps = f"{gbs // (size * world)} micro-batch(es) per step for global_batch_size={gbs}" if gbs else "the global batch follows"
    return (
        f"data.batch_size=auto: {size} sequences of {cfg.data.seq_len} tokens per GPU, {peak / 2**30:.1f} GiB counted of "
        f"{total / 2**30:.1f} (lmtrain.plan, {1 - memory.MARGIN:.0%} kept free); {steps}"
    )
