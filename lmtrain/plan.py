"""Compute and memory planner: the arithmetic before a large run, from the same presets and overrides as training.

    python -m lmtrain.plan model=opt-175b cluster.gpus=1024 cluster.tflops_per_gpu=147 budget.flops=4.3e23
    python -m lmtrain.plan model=opt-1.3b data.seq_len=1024 data.batch_size=16 cluster.gpus=8 budget.tokens=3e11 output=json

Planner keys (everything else is a training override: ``model=``, ``model.*``, ``data.seq_len``, ``data.batch_size``):

* ``cluster.gpus`` (8), ``cluster.gpus_per_node`` (8), ``cluster.memory_gb`` per GPU (80),
  ``cluster.tflops_per_gpu`` sustained (default: 50% of 989, an H100's dense bf16 peak) or
  ``cluster.tokens_per_sec_per_gpu`` measured (docs/BENCHMARKS.md);
* ``budget.tokens`` or ``budget.flops`` (training length);
* ``output=table|json``.

Memory per GPU, bf16 mixed precision with fp32 master weights and AdamW: weights 4 B/param, gradients 4 B/param,
optimizer state 8 B/param, each divided by the shard group (ddp: 1, fsdp: all GPUs, hsdp: one node); activations
per micro-batch from Korthikanti et al. (2022) with flash attention: 34 x seq x batch x d_model bytes per layer
without recomputation for an OPT block, 37.5 for llama-7b's gated MLP (:func:`block_activations`), 2 x seq x batch x d_model per layer (the saved block inputs) plus one layer's full set with
full activation checkpointing, half of the layers each way with selective (every other block), and with ``op`` (every
block keeps its products' and attention's outputs) 22 x seq x batch x d_model per layer (of the 34: the block input 2,
q, k and v 6, attention's output 2, the output projection's 2, the MLP's first product 8 and second 2; the norms,
activation and dropout masks recomputed) plus one layer's full set; with ``module.fp8`` the full set is 3 + f/d less
(27 for an OPT block), the four products' inputs kept in float8 (one byte instead of two; measured: 3.0 GiB less for
llama-7b at batch 2 under fsdp x 2 with selective checkpointing, counted 2.8; the compiled 1.3B saved twice what is
counted); against llama-7b's ten measured peaks (bf16 and fp8, every checkpointing setting) the count is within 2.5%; plus the logits,
batch x seq x vocab x 6 bytes (bf16 and the fp32 copy the loss takes; 8 with the output head in float8,
``module.fp8_layers=all|head``, its gradient's float8 copy: measured +6.0 GiB at 65,536 x 50,304 on an H200; with ``module.loss_chunk_tokens=C``, C x vocab
x 6 bytes plus the gradients the chunked head keeps: hidden states and head weight in fp32; with ``module.compile``
or ``strategy.compile`` counted as whole-batch logits, since under compile it saved a tenth to a seventh of that, except
for the chunked float8 head, which saves the whole float8 head's 8 bytes per logit); under ddp on more than one GPU, DDP's
gradient buckets, 4 B/param. The total is the larger of two peaks: at the end of the forward pass (weights,
optimizer state, activations, logits; gradients only when ``trainer.accumulate_grad_batches`` or
``global_batch_size`` makes several micro-batches per step, since the trainer frees them after each optimizer step)
and at the end of the backward pass (weights, gradients, optimizer state; under fsdp/hsdp one block's unsharded
gradients in bf16 and fp32 for the reduce-scatter; the DDP buckets in both). Under fsdp/hsdp the forward peak also
holds two blocks' gathered bf16 parameters, or all of them, 2 B/param, with ``strategy.reshard_after_forward=false``
(measured +2.2 GiB at 1.3B on 2 GPUs); with ``module.fp8=tensorwise`` the blocks' linear weights are gathered in float8,
1 B/param (lmtrain.training.fp8.gathers_in_float8). Measured against both in
docs/BENCHMARKS.md. A 10% margin is kept free.

Checkpoints: fp32 weights and AdamW's two moments, 12 B/param on disk per save (llama-7b: 80.86 GB counted, 80.864 GB
saved on 2 H100s); an asynchronous save first copies that state to host memory, per node: all of it on rank zero's
node (ddp, one file), the node's shards (fsdp over every GPU), a whole replica (hsdp). ``async_save=auto`` wants twice
the copy available; the copy's pinned buffers are exactly its size (callbacks.checkpoint.HostCopy registers memory of
its own rather than PyTorch's pinned allocator, which rounded llama-7b's shards up to x1.39).
"""

from __future__ import annotations

import json
import math
import sys

from lmtrain import config_dir
from lmtrain.training.config import ConfigError, validate_config

STRATEGIES = ("ddp", "fsdp", "hsdp")
AC = ("none", "op", "selective", "full")  # every strategy.activation_checkpointing (strategies.AC_MODES), most memory first
GB = 1e9
MARGIN = 0.9
DEFAULT_TFLOPS = 0.5 * 989.0


def model_numbers(model_cfg, seq_len: int) -> dict:
    """Parameters and FLOPs of a model config (a meta-device build: no memory; each shape built once per process,
    since a plan's search over the presets builds every one of them)."""
    key = (repr(model_cfg), seq_len)  # (ModelConfig is a plain dataclass: its repr names every field)
    if key not in _NUMBERS:
        _NUMBERS[key] = _build_numbers(model_cfg, seq_len)
    return dict(_NUMBERS[key])


_NUMBERS: dict[tuple[str, int], dict] = {}


def _build_numbers(model_cfg, seq_len: int) -> dict:
    import torch

    from lmtrain.nn.model import Decoder, flops_per_token, matmul_params, num_params

    with torch.device("meta"):
        model = Decoder(model_cfg)
    total = num_params(model)
    embedding = model.tok_emb.weight.numel() + (model.pos_emb.weight.numel() if model.pos_emb is not None else 0)
    if not model_cfg.tie_embeddings:
        embedding += model.lm_head.weight.numel()
    return {
        "params": total,
        "non_embedding_params": total - embedding,
        "matmul_params": matmul_params(model),
        # the weights FSDP gathers in float8 with module.fp8=tensorwise (every linear layer inside the blocks)
        "block_linear_params": sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)),
        "flops_per_token": flops_per_token(model, seq_len),
    }


def block_activations(cfg, fp8: bool = False) -> float:
    """What one block keeps for its backward pass without recomputation, in bytes per token per unit of d_model
    (Korthikanti et al. 2022 with flash attention, counted for each family's MLP of width f): the two norms' inputs
    4, attention's input, q, k, v and output 10, the MLP's input 2, then GPT's MLP 4 f/d (its activation's input and
    output) plus 2 (dropout masks; 34 at f = 4d, the count the OPT rows were measured against) or llama's gated MLP
    8 f/d (the gate and up products, silu's output and their product: 37.5 for llama-7b, whose rows the 34 undercounted
    by up to 5%). ``module.fp8``: the four products keep their inputs in float8, one byte instead of two, 3 + f/d less
    (7 at f = 4d). Checkpointing by operator keeps the products' bf16 outputs and recomputes the casts, so its 22 stay."""
    f = cfg.hidden_dim / cfg.d_model
    full = 16 + (8 * f if cfg.family == "llama" else 4 * f + 2)
    return full - (3 + f if fp8 else 0)


def memory(
    cfg,
    params: int,
    seq: int,
    batch: int,
    strategy: str,
    world: int,
    node: int,
    ac: str,
    loss_chunk: int | None = None,
    accumulate: int = 1,
    fp8: bool = False,
    fp8_head: bool = False,
    reshard: bool = True,
    float8_gathered: int = 0,
) -> dict:
    """Bytes per GPU (see the module docstring): each term, and ``total``, the larger of the two peaks."""
    shard = {"ddp": 1, "fsdp": world, "hsdp": min(node, world)}[strategy]
    L, d, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
    per_layer_full = block_activations(cfg, fp8) * seq * batch * d
    per_layer_saved = 2 * seq * batch * d
    if ac == "none":
        act = L * per_layer_full
    elif ac == "full":
        act = L * per_layer_saved + per_layer_full
    elif ac == "op":
        act = L * 22 * seq * batch * d + per_layer_full
    else:
        act = math.ceil(L / 2) * per_layer_full + (L // 2) * per_layer_saved
    out = {
        "weights": 4 * params / shard,
        "gradients": 4 * params / shard,
        "optimizer": 8 * params / shard,
        "activations": act,
        "logits": (8 if fp8_head else 6) * batch * seq * V
        if not loss_chunk
        else 6 * min(loss_chunk, batch * seq) * V + 4 * (batch * seq + V) * cfg.emb_dim,
    }
    always = out["weights"] + out["optimizer"]
    if strategy != "ddp":  # parameters gathered for compute: one block and the prefetched next one, or, with
        # strategy.reshard_after_forward=false, all of them from the forward pass to the backward (+2.2 GiB at 1.3B);
        # bf16, but the ``float8_gathered`` parameters (the blocks' linear weights under float8 all-gather) in float8
        every = 2 * params - float8_gathered
        out["gathered"] = 2 * every / max(L, 1) if reshard else every
        always += out["gathered"]
    elif world > 1:  # DDP's gradient buckets: a second fp32 copy of the gradients (gradient_as_bucket_view off)
        out["buckets"] = 4 * params
        always += out["buckets"]
    # The gradients are freed right after each optimizer step (LMModule.optimizer_step), so at the end of the forward
    # pass they exist only when accumulating over micro-batches; the end of the backward pass holds them with no activations.
    out["forward_peak"] = always + act + out["logits"] + (out["gradients"] if accumulate > 1 else 0)
    out["backward_peak"] = always + out["gradients"]
    if strategy != "ddp":  # the last block's unsharded gradients, bf16 and the fp32 copy reduce-scattered
        out["backward_peak"] += 6 * (params / max(L, 1))
    out["total"] = max(out["forward_peak"], out["backward_peak"])
    return out


def checkpoint_bytes(params: int, gpus: int, node: int) -> dict:
    """A save's size on disk and, per strategy, the host copy an asynchronous save holds on one node (module docstring)."""
    size = 12 * params
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


def plan(cfg, cluster: dict, budget: dict) -> dict:
    from lmtrain.nn.model import ModelConfig
    from lmtrain.training.fp8 import gathers_in_float8

    fields = {k: v for k, v in cfg.model.items() if not str(k).startswith("_")}
    mcfg = ModelConfig(**fields)
    seq, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
    module_cfg, strategy_cfg = cfg.get("module") or {}, cfg.get("strategy") or {}
    chunk = module_cfg.get("loss_chunk_tokens")
    # Under torch.compile the chunked loss saved 0.8 of the 8.1 GiB of logits counted at 1.3B batch 28 and 1.3 of 9.2
    # at batch 32 (one H100, docs/BENCHMARKS.md): the compiled whole-batch loss keeps less than counted. Counted as
    # no saving there.
    # The float8 head, whole, keeps two more bytes per logit even compiled; chunked it holds one chunk's: counted.
    fp8_layers = module_cfg.get("fp8_layers", "blocks")
    fp8 = bool(module_cfg.get("fp8")) and fp8_layers != "head"
    fp8_head = bool(module_cfg.get("fp8")) and fp8_layers != "blocks"
    chunk_uncounted = bool(chunk) and bool(module_cfg.get("compile") or strategy_cfg.get("compile")) and not fp8_head
    chunk = None if chunk_uncounted else chunk
    reshard = strategy_cfg.get("reshard_after_forward", True) is not False
    gpus, node = int(cluster["gpus"]), int(cluster["gpus_per_node"])
    gbs = cfg.get("global_batch_size")
    if gbs and gbs % (batch * gpus):
        raise ConfigError(
            f"global_batch_size={gbs} is not a multiple of data.batch_size ({batch}) x cluster.gpus ({gpus}) = {batch * gpus}"
        )
    accum = gbs // (batch * gpus) if gbs else int(cfg.trainer.accumulate_grad_batches)
    mem_bytes = float(cluster["memory_gb"]) * GB
    nums = model_numbers(mcfg, seq)
    # the blocks' weights fsdp/hsdp gather in float8 (counted only where parameters are gathered: not under ddp)
    float8_gathered = nums["block_linear_params"] if fp8 and gathers_in_float8(module_cfg.get("fp8"), sharded=True) else 0
    out: dict = {"model": mcfg.name, **nums, "fp16_weights_gb": 2 * nums["params"] / GB, "seq_len": seq, "micro_batch": batch}
    out["accumulate_grad_batches"] = accum
    out["loss_chunk_counted"] = not chunk_uncounted
    out["fp8"] = module_cfg.get("fp8")
    out["fp8_layers"] = fp8_layers if out["fp8"] else None
    out["reshard_after_forward"] = reshard
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
    out["memory_gb_per_gpu"] = {
        s: {
            ac: {
                k: v / GB
                for k, v in memory(
                    mcfg, nums["params"], seq, batch, s, gpus, node, ac, chunk, accum, fp8, fp8_head, reshard, float8_gathered
                ).items()
            }
            for ac in AC
        }
        for s in STRATEGIES
    }
    ckpt = checkpoint_bytes(nums["params"], gpus, node)
    out["checkpoint_gb"] = ckpt["size"] / GB
    out["async_host_copy_gb_per_node"] = {s: v / GB for s, v in ckpt["host_copy_per_node"].items()}
    out["fits"] = {s: {ac: out["memory_gb_per_gpu"][s][ac]["total"] * GB <= MARGIN * mem_bytes for ac in AC} for s in STRATEGIES}
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
        + (f" with {p['fp8']} fp8 products ({p.get('fp8_layers') or 'blocks'})" if p.get("fp8") else "")
        + ("" if p.get("reshard_after_forward", True) else ", fsdp/hsdp keeping every gathered parameter from forward to backward")
        + ", AdamW; total: the larger of the peaks at the end of the forward and of the backward pass:"
    )
    lines.append("| strategy | activation ckpt | weights | gradients | optimizer | activations | logits | total | peak at | fits |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for s in STRATEGIES:
        for ac in AC:
            m = p["memory_gb_per_gpu"][s][ac]
            lines.append(
                f"| {s} | {ac} | {m['weights']:.2f} | {m['gradients']:.2f} | {m['optimizer']:.2f} | {m['activations']:.2f} | "
                f"{m['logits']:.2f} | {m['total']:.2f} | {'forward' if m['forward_peak'] >= m['backward_peak'] else 'backward'} | "
                f"{'yes' if p['fits'][s][ac] else 'no'} |"
            )
    copy = p["async_host_copy_gb_per_node"]
    lines.append(
        f"checkpoint: {p['checkpoint_gb']:.2f} GB per save on disk (fp32 weights, AdamW state); an asynchronous save's host "
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
