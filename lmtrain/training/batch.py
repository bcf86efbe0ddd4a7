"""``data.batch_size=auto``: the largest micro-batch that fits this GPU for this model, preset and strategy.

The size comes from lmtrain.plan's memory count (weights, gradients, optimizer state, activations by layer and
checkpointing mode, logits by output head, gathered parameters under fsdp/hsdp: within a few percent of the peaks
measured on H100s and H200s, tests/test_plan.py), searched over the card's memory with the planner's 10% margin:
the largest size whose counted peak fits. With ``global_batch_size`` set, only sizes that divide it over the ranks
are tried, and ``trainer.accumulate_grad_batches`` follows (lmtrain.training.config.apply_global_batch_size); without
it the global batch is the chosen size times the ranks times the accumulation. The choice is said in one line at the
start. On the CPU there is no card's memory to fill: ``auto`` is refused there, with the number to give instead.

Whatever the batch, the model's state must fit (:func:`check_fits`): a run whose weights, gradients and optimizer state
alone are counted beyond the card's memory (or on the CPU, the host's available memory) is refused with the count
before anything is built.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from lmtrain.errors import InputError

LIMIT = 4096  # the largest micro-batch tried


def planner_strategy(cfg: DictConfig) -> tuple[str, str]:
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

    strategy, ac = planner_strategy(cfg)
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
    from lmtrain.training.layout import Layout

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
    per_step = size * Layout.of_config(cfg).dp
    steps = f"{gbs // per_step} micro-batch(es) per step for global_batch_size={gbs}" if gbs else "the global batch follows"
    return (
        f"data.batch_size=auto: {size} sequences of {cfg.data.seq_len} tokens per GPU, {peak / 2**30:.1f} GiB counted of "
        f"{total / 2**30:.1f} (lmtrain.plan, {1 - memory.MARGIN:.0%} kept free); {steps}"
    )


STATE_BYTES = {"bf16-true": 0.5, "16-true": 0.5, "64-true": 2.0}  # the count's 16 B/param (fp32 weights, gradients, 2 moments) scaled


def check_fits(cfg: DictConfig) -> None:
    """The model's state per rank, counted as lmtrain.plan counts it (weights, gradients, optimizer state and, under
    fsdp/hsdp, the gathered blocks: what no batch size changes), against this machine: each GPU's memory, or on the
    CPU (or with ``strategy.cpu_offload``) the host's available memory shared by its ranks. A model that cannot fit (``n_layers: 1000000``, a 70B on one
    card) is one error with the count, before anything is built or written."""
    import torch

    from lmtrain.training import memory
    from lmtrain.training.config import device_type, world_size

    world = world_size(cfg)
    node = max(1, world // int(cfg.trainer.get("num_nodes", 1) or 1))
    strategy, ac = planner_strategy(cfg)
    counted = memory.counted(cfg, world, node)
    terms = memory.breakdown(counted, strategy, world, node, ac)
    scale = STATE_BYTES.get(str(cfg.trainer.get("precision")), 1.0)
    state = scale * terms["backward_peak"]
    offload = bool((cfg.get("strategy") or {}).get("cpu_offload"))  # fsdp's state in host memory: the host's to hold
    if device_type(cfg.trainer.get("accelerator", "auto")) == "cuda" and torch.cuda.is_available() and not offload:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        need, have, where = state, float(props.total_memory), f"this GPU's {props.total_memory / 2**30:,.1f} GiB ({props.name})"
    else:
        have = _host_available()
        if have is None:
            return
        need, where = state * node, f"this host's {have / 2**30:,.1f} GiB available" + (f" for its {node} ranks" if node > 1 else "")
    if need <= have:
        return
    params = counted["nums"]["params"]
    shown = ", ".join(f"{k} {scale * terms[k] / 2**30:,.1f}" for k in ("weights", "gradients", "optimizer", "gathered", "buckets") if k in terms)
    raise InputError(
        f"model {cfg.model.get('name')}: {params:,} parameters need {state / 2**30:,.1f} GiB per rank for their state alone "
        f"({shown} GiB: lmtrain.plan's count, {strategy} on {world} rank{'s' if world != 1 else ''}), more than {where}: "
        "nothing was started; shard it over more GPUs (strategy=fsdp), or check the model's size with `python -m lmtrain.plan`"
    )


def _host_available() -> float | None:
    """Bytes of memory the host can give now (Linux: MemAvailable), None where unknown."""
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
