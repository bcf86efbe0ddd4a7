"""Compute and memory planner: the arithmetic before a large run, from the same presets and overrides as training.

    python -m lmtrain.plan model=opt-175b cluster.gpus=1024 cluster.tflops_per_gpu=147 budget.flops=4.3e23
    python -m lmtrain.plan model=opt-1.3b data.seq_len=1024 data.batch_size=16 cluster.gpus=8 budget.tokens=3e11 output=json

Planner keys (everything else is a training override: ``model=``, ``model.*``, ``data.seq_len``, ``data.batch_size``):

* ``cluster.gpus`` (8), ``cluster.gpus_per_node`` (8), ``cluster.memory_gb`` per GPU (80),
  ``cluster.tflops_per_gpu`` sustained (default: 50% of 989, an H100's dense bf16 peak) or
  ``cluster.tokens_per_sec_per_gpu`` measured (docs/BENCHMARKS.md);
* ``budget.tokens`` or ``budget.flops`` (training length);
* ``output=table|json``.

Memory per GPU: lmtrain.training.memory's count (its docstring says what is counted and how it compares with
measured peaks), a tensor-parallel rank's with ``strategy.tp``; the bytes each GPU sends per step; and a suggested
layout (:func:`suggest_layout`: sharding alone while it fits, tensor parallel within a node when not). Checkpoints: fp32 weights and AdamW's two moments, 12 B/param on disk per save (llama-7b: 80.86 GB counted, 80.864 GB
saved on 2 H100s; ``optimizer=muon``: 8 B for the blocks' matrices, one momentum buffer); an asynchronous save first copies that state to host memory, per node: all of it on rank zero's
node (ddp, one file), the node's shards (fsdp over every GPU), a whole replica (hsdp). ``async_save=auto`` wants twice
the copy available; the copy's pinned buffers are exactly its size (callbacks.checkpoint.HostCopy registers memory of
its own rather than PyTorch's pinned allocator, which rounded llama-7b's shards up to x1.39).
"""

from __future__ import annotations

import json
import sys

from lmtrain import config_dir
from lmtrain.training.config import ConfigError, validate_config
from lmtrain.training.memory import AC, GB, MARGIN, block_activations, breakdown, counted, memory, model_numbers  # noqa: F401 (block_activations: its API)

STRATEGIES = ("ddp", "fsdp", "hsdp")
DEFAULT_TFLOPS = 0.5 * 989.0


def checkpoint_bytes(params: int, gpus: int, node: int, muon_params: int = 0) -> dict:
    """A save's size on disk and, per strategy, the host copy an asynchronous save holds on one node (module docstring);
    ``muon_params``: parameters with Muon's one state buffer instead of AdamW's two."""
    size = 12 * params - 4 * muon_params
    nodes = max(1, gpus // node)
    return {"size": size, "host_copy_per_node": {"ddp": size, "fsdp": size / nodes, "hsdp": size}}


def fewest_gpus(cfg, params: int, seq: int, batch: int, node: int, mem_bytes: float, ac: str, accumulate: int = 1) -> int | None:
    """Fewest GPUs (whole nodes) on which fsdp fits the model, or None up to 65,536 GPUs."""
    world = node
    while world <= 65536:
        if memory(cfg, params, seq, batch, "fsdp", world, node, ac, accumulate=accumulate)["total"] <= MARGIN * mem_bytes:
            return world
        world += node
    return None


def communication(c: dict, strategy: str, gpus: int, node: int, tp: int, accumulate: int, cp: int = 1) -> dict:
    """Bytes each GPU sends per optimizer step, by ring collectives ((n - 1) / n of the data each way): ``sharding``,
    per micro-batch two all-gathers of the bf16 parameters (forward and backward) and one reduce-scatter of the fp32
    gradients over the shard group, and under hsdp an all-reduce of the gradient shards across replicas; ``tensor``,
    per micro-batch and block under ``tp`` two all-gathers of the sequence-split input of a branch and two
    reduce-scatters of its output (bf16, batch x seq x d_model), each way: the bytes of four all-reduces, the traffic
    of a tensor-parallel group, kept within a node; ``context``, per micro-batch under ``cp`` an all-gather of
    every block's keys and values in the forward pass and a reduce-scatter of their gradients in the backward."""
    nums, mcfg, seq, batch = c["nums"], c["mcfg"], c["seq"], c["batch"]
    local = nums["params"] - nums["tp_split_params"] * (1 - 1 / tp)
    shard = {"ddp": 1, "fsdp": gpus // tp, "hsdp": min(node, gpus) // tp}[strategy]
    out = {"sharding": 0.0, "tensor": 0.0, "context": 0.0}
    if strategy == "ddp":
        out["sharding"] = 2 * (gpus - 1) / gpus * 4 * nums["params"] if gpus > 1 else 0.0  # DDP's fp32 all-reduce
    else:
        ring = (shard - 1) / shard
        out["sharding"] = accumulate * ring * (2 * 2 * local + 4 * local)
        replicas = gpus // (shard * tp)
        if replicas > 1:
            out["sharding"] += 2 * (replicas - 1) / replicas * 4 * local / shard
    if tp > 1:
        out["tensor"] = accumulate * mcfg.n_layers * 4 * 2 * (tp - 1) / tp * 2 * batch * seq / cp * mcfg.d_model
    if cp > 1:  # keys and values, bf16, this rank's heads: gathered forward, their gradients reduce-scattered backward
        out["context"] = accumulate * mcfg.n_layers * 2 * (cp - 1) / cp * 2 * 2 * batch * seq * mcfg.kv_heads * mcfg.head_dim / tp
    return out


def suggest_layout(c: dict, gpus: int, node: int, mem_bytes: float, global_batch: int | None) -> dict | None:
    """The layout a run of ``c`` on ``gpus`` GPUs should start from, as a torchtitan user is told to choose one: the
    fewest tensor-parallel ranks that fit (1: sharding alone; tp divides the heads, key-value heads, MLP features and the
    GPUs, at most one node's), with the least recomputation (activation checkpointing none, op, selective, full), then
    hsdp over more than one node (its parameter gathers stay in a node) or fsdp. Context parallel (cp divides
    the GPUs and the sequence into 2 cp chunks) counts with tensor parallel: of the same number of ranks splitting the
    model's work, the one that sends the least. Activation offloading (``offload``: each block's input in host memory,
    sent there and back every step) only where nothing else fits. None when nothing fits."""
    recomputing = tuple(ac for ac in AC if ac != "offload")
    return _fewest_splits(c, gpus, node, mem_bytes, global_batch, recomputing) or _fewest_splits(c, gpus, node, mem_bytes, global_batch, ("offload",))


def _fewest_splits(c: dict, gpus: int, node: int, mem_bytes: float, global_batch: int | None, acs: tuple) -> dict | None:
    mcfg, seq = c["mcfg"], c["seq"]
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= node and gpus % t == 0 and node % t == 0 and not mcfg.undivided_by(t)]
    pairs = [(t, k) for t in tps for k in (1, 2, 4, 8, 16, 32, 64) if gpus % (t * k) == 0 and seq % (2 * k) == 0]
    for split in sorted({t * k for t, k in pairs}):
        fits = []
        for tp, cp in [(t, k) for t, k in pairs if t * k == split]:
            for ac in acs:
                found = None
                for strategy in ("hsdp", "fsdp") if gpus > node else ("fsdp",):
                    dp = gpus // split
                    if global_batch and global_batch % (c["batch"] * dp):
                        continue
                    accum = global_batch // (c["batch"] * dp) if global_batch else c["accum"]
                    m = breakdown({**c, "tp": tp, "cp": cp, "accum": accum}, strategy, gpus, node, ac)
                    if m["total"] <= MARGIN * mem_bytes:
                        sent = communication(c, strategy, gpus, node, tp, accum, cp)
                        overrides = [f"strategy={strategy}", *([f"strategy.tp={tp}"] if tp > 1 else []), *([f"strategy.cp={cp}"] if cp > 1 else []),
                                     f"strategy.activation_checkpointing={ac}"]  # fmt: skip
                        found = {"strategy": strategy, "tp": tp, "cp": cp, "activation_checkpointing": ac, "accumulate_grad_batches": accum,
                                 "memory_gb_per_gpu": m["total"] / GB, "overrides": " ".join(overrides),
                                 "communication_gb_per_step": {k: v / GB for k, v in sent.items()}}  # fmt: skip
                        break
                if found:
                    fits.append((acs.index(ac), sum(found["communication_gb_per_step"].values()), found))
                    break
        if fits:
            return min(fits, key=lambda f: f[:2])[2]
    return None


def plan(cfg, cluster: dict, budget: dict) -> dict:
    c = counted(cfg, gpus=int(cluster["gpus"]), node=int(cluster["gpus_per_node"]))
    mcfg, nums, seq, batch, accum = c["mcfg"], c["nums"], c["seq"], c["batch"], c["accum"]
    gpus, node = int(cluster["gpus"]), int(cluster["gpus_per_node"])
    mem_bytes = float(cluster["memory_gb"]) * GB
    out: dict = {"model": mcfg.name, **nums, "fp16_weights_gb": 2 * nums["params"] / GB, "seq_len": seq, "micro_batch": batch}
    out["accumulate_grad_batches"] = accum
    out["loss_chunk_counted"] = not c["chunk_uncounted"]
    out["fp8"] = c["fp8_recipe"]
    out["head"] = c["head"]
    out["optimizer"] = "muon" if c["muon_params"] else "adamw"
    out["reshard_after_forward"] = c["reshard"]
    out["cluster"] = {"gpus": gpus, "gpus_per_node": node, "memory_gb": cluster["memory_gb"]}
    if cluster.get("tokens_per_sec_per_gpu"):
        rate_flops = float(cluster["tokens_per_sec_per_gpu"]) * nums["flops_per_token"]
        out["cluster"]["tokens_per_sec_per_gpu"] = float(cluster["tokens_per_sec_per_gpu"])
    else:
        rate_flops = float(cluster.get("tflops_per_gpu") or DEFAULT_TFLOPS) * 1e12
    out["cluster"]["tflops_per_gpu"] = rate_flops / 1e12
    if budget.get("flops") or budget.get("tokens"):
        flops = float(budget["flops"]) if budget.get("flops") else float(budget["tokens"]) * nums["flops_per_token"]
        tokens = float(budget["tokens"]) if budget.get("tokens") else flops / nums["flops_per_token"]
        seconds = flops / (gpus * rate_flops)
        out["run"] = {"flops": flops, "tokens": tokens, "days": seconds / 86400, "gpu_hours": gpus * seconds / 3600}
    # tensor parallel splits layers and context parallel sequences under fsdp and hsdp
    strategies = [s for s in STRATEGIES if s != "ddp" or (c["tp"] == 1 and c["cp"] == 1)]
    out["tp"], out["cp"] = c["tp"], c["cp"]
    out["memory_gb_per_gpu"] = {s: {ac: {k: v / GB for k, v in breakdown(c, s, gpus, node, ac).items()} for ac in AC} for s in strategies}
    sent = {s: communication(c, s, gpus, node, c["tp"], accum, c["cp"]) for s in strategies}
    out["communication_gb_per_step"] = {s: {k: v / GB for k, v in parts.items()} for s, parts in sent.items()}
    ckpt = checkpoint_bytes(nums["params"], gpus, node, c["muon_params"])
    out["checkpoint_gb"] = ckpt["size"] / GB
    out["async_host_copy_gb_per_node"] = {s: v / GB for s, v in ckpt["host_copy_per_node"].items()}
    out["fits"] = {s: {ac: out["memory_gb_per_gpu"][s][ac]["total"] * GB <= MARGIN * mem_bytes for ac in AC} for s in strategies}
    out["suggested_layout"] = suggest_layout(c, gpus, node, mem_bytes, cfg.get("global_batch_size"))
    fewest = fewest_gpus(mcfg, nums["params"], seq, batch, node, mem_bytes, "full", accum)
    out["fewest_gpus_fsdp_full_ac"] = fewest
    out["fewest_nodes_fsdp_full_ac"] = None if fewest is None else fewest // node
    out["largest_preset_on_one_node"] = largest_on_one_node(seq, batch, node, mem_bytes, accum)
    return out


def largest_on_one_node(seq: int, batch: int, node: int, mem_bytes: float, accumulate: int = 1) -> str | None:
    """The preset with the most parameters that fits one node under fsdp with full activation checkpointing."""
    from lmtrain.formats.presets import available_presets, preset

    best = None
    for name in available_presets():
        mcfg = preset(name)
        n = model_numbers(mcfg, seq)["params"]
        if (
            memory(mcfg, n, min(seq, mcfg.max_seq_len), batch, "fsdp", node, node, "full", accumulate=accumulate)["total"]
            <= MARGIN * mem_bytes
        ):
            if best is None or n > best[1]:
                best = (name, n)
    return best[0] if best else None


def table(p: dict) -> str:
    lines = [
        f"model {p['model']}: {p['params']:,} parameters ({p['params'] / 1e9:.2f}B; {p['non_embedding_params']:,} non-embedding), "
        f"fp16 weights {p['fp16_weights_gb']:.1f} GB",
        f"FLOPs per token (6N + attention at seq {p['seq_len']}): {p['flops_per_token']:.4g}",
    ]
    c = p["cluster"]
    lines.append(
        f"cluster: {c['gpus']} GPUs, {c['gpus_per_node']} per node, {c['memory_gb']} GB each, {c['tflops_per_gpu']:.1f} TFLOP/s sustained per GPU"
    )
    if "run" in p:
        r = p["run"]
        lines.append(f"run: {r['flops']:.3g} FLOPs = {r['tokens']:.3g} tokens: {r['days']:.1f} days, {r['gpu_hours']:,.0f} GPU-hours")
    accum = p["accumulate_grad_batches"]
    lines.append(
        f"memory per GPU (GB), micro-batch {p['micro_batch']} x {p['seq_len']}"
        + (f", {accum} micro-batches per step" if accum > 1 else "")
        + ("" if p["loss_chunk_counted"] else ", chunked loss counted as whole-batch logits under compile")
        + ", bf16 mixed"
        + (f" with {p['fp8']} fp8 products in the blocks" if p.get("fp8") else "")
        + (f", the output head {p['head']}" if p.get("head", "plain") != "plain" else "")
        + ("" if p.get("reshard_after_forward", True) else ", fsdp/hsdp keeping every gathered parameter from forward to backward")
        + (", Muon on the blocks' matrices and AdamW on the rest" if p.get("optimizer") == "muon" else ", AdamW")
        + "; total: the larger of the peaks at the end of the forward and of the backward pass:"
    )
    lines.append("| strategy | activation ckpt | weights | gradients | optimizer | activations | logits | total | peak at | fits |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    tp = (f" x tp {p['tp']}" if p.get("tp", 1) > 1 else "") + (f" x cp {p['cp']}" if p.get("cp", 1) > 1 else "")
    for s in p["memory_gb_per_gpu"]:
        for ac in AC:
            m = p["memory_gb_per_gpu"][s][ac]
            lines.append(
                f"| {s}{tp} | {ac} | {m['weights']:.2f} | {m['gradients']:.2f} | {m['optimizer']:.2f} | {m['activations']:.2f} | "
                f"{m['logits']:.2f} | {m['total']:.2f} | {'forward' if m['forward_peak'] >= m['backward_peak'] else 'backward'} | "
                f"{'yes' if p['fits'][s][ac] else 'no'} |"
            )
    comm = p["communication_gb_per_step"]
    lines.append(
        "sent per GPU per step (GB): "
        + "; ".join(f"{s}{tp} {v['sharding']:.2f}" + (f" + tensor parallel {v['tensor']:.2f}" if v["tensor"] else "")
                    + (f" + context parallel {v['context']:.2f}" if v["context"] else "") for s, v in comm.items())
    )
    lay = p["suggested_layout"]
    lines.append(
        f"suggested layout on {c['gpus']} GPUs: {lay['overrides']}: {lay['memory_gb_per_gpu']:.2f} GB per GPU, "
        f"{lay['communication_gb_per_step']['sharding']:.2f} GB sent per GPU per step for sharding"
        + (f", {lay['communication_gb_per_step']['tensor']:.2f} within tensor-parallel groups" if lay["tp"] > 1 else "")
        + (f", {lay['communication_gb_per_step']['context']:.2f} within context-parallel groups" if lay["cp"] > 1 else "")
        + (f", {lay['accumulate_grad_batches']} micro-batches per step" if lay["accumulate_grad_batches"] > 1 else "")
        + " (the fewest model-splitting ranks that fit, with the least recomputation)"
        if lay
        else f"suggested layout on {c['gpus']} GPUs: none fits (more GPUs, a smaller micro-batch or a shorter sequence)"
    )
    copy = p["async_host_copy_gb_per_node"]
    lines.append(
        f"checkpoint: {p['checkpoint_gb']:.2f} GB per save on disk (fp32 weights, optimizer state); an asynchronous save's host "
        f"copy per node: ddp {copy['ddp']:.2f}, fsdp {copy['fsdp']:.2f}, hsdp {copy['hsdp']:.2f} GB "
        "(async_save=auto wants twice that available)"
    )
    few = p["fewest_gpus_fsdp_full_ac"]
    lines.append(
        f"fewest GPUs that fit it (fsdp, full activation checkpointing): {few if few else 'more than 65,536'}"
        + (f" ({p['fewest_nodes_fsdp_full_ac']} node(s))" if few else "")
    )
    lines.append(f"largest preset that fits one node (fsdp, full activation checkpointing): {p['largest_preset_on_one_node']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.plan") -> int:
    from hydra import compose, initialize_config_dir

    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.replace("python -m lmtrain.plan", prog))  # the examples as the user called it
        return 0
    cluster = {"gpus": 8, "gpus_per_node": 8, "memory_gb": 80.0, "tflops_per_gpu": None, "tokens_per_sec_per_gpu": None}
    budget: dict = {"tokens": None, "flops": None}
    output, overrides = "table", []
    for a in args:
        key, _, value = a.partition("=")
        if key.startswith("cluster.") or key.startswith("budget."):
            group, name = key.split(".", 1)
            target = cluster if group == "cluster" else budget
            if name not in target:
                print(f"error: unknown planner key '{key}'; allowed: {sorted(f'{group}.{k}' for k in target)}", file=sys.stderr)
                return 2
            try:
                target[name] = float(value)
            except ValueError:
                print(f"error: {key}={value!r} must be a number", file=sys.stderr)
                return 2
        elif key == "output":
            if value not in ("table", "json"):
                print(f"error: output={value!r}: use table or json", file=sys.stderr)
                return 2
            output = value
        else:
            overrides.append(a)
    if cluster["gpus"] < 1 or cluster["gpus_per_node"] < 1 or cluster["memory_gb"] <= 0:
        print("error: cluster.gpus, cluster.gpus_per_node and cluster.memory_gb must be positive", file=sys.stderr)
        return 2
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's override errors are the user's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from omegaconf import OmegaConf, open_dict

    if "data" in cfg and OmegaConf.is_missing(cfg.data, "path"):  # the planner reads no data: the experiment's own need
        with open_dict(cfg):
            cfg.data.path = "(not read by the planner)"
    with open_dict(cfg):  # the training config's world size is the cluster's (its checks of the global batch, per rank)
        cfg.trainer.devices, cfg.trainer.num_nodes = int(cluster["gpus"]), 1
    try:  # the training config's own checks (keys, sizes, batch and accumulation), then the cluster's
        validate_config(cfg)
        result = plan(cfg, cluster, budget)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if output == "json" else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
