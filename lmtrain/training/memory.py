"""Memory per GPU of a training run, counted: what lmtrain.plan tabulates for a cluster and what
``data.batch_size=auto`` (lmtrain.training.batch) fills a card with.

Memory per GPU, bf16 mixed precision with fp32 master weights and AdamW: weights 4 B/param, gradients 4 B/param,
optimizer state 8 B/param (``optimizer=muon``: 4 B for the blocks' matrices, Muon's one momentum buffer), each divided by the shard group (ddp: 1, fsdp: all GPUs, hsdp: one node); activations
per micro-batch from Korthikanti et al. (2022) with flash attention: 34 x seq x batch x d_model bytes per layer
without recomputation for an OPT block, 37.5 for llama-7b's gated MLP (:func:`block_activations`), 2 x seq x batch x d_model per layer (the saved block inputs) plus one layer's full set with
full activation checkpointing (with ``offload``, two layers' inputs: the rest wait in host memory), half of the layers
each way with selective (every other block), and with ``op`` (every
block keeps its products' and attention's outputs) 22 x seq x batch x d_model per layer (of the 34: the block input 2,
q, k and v 6, attention's output 2, the output projection's 2, the MLP's first product 8 and second 2; the norms,
activation and dropout masks recomputed) plus one layer's full set; with ``module.fp8.recipe`` the full set is 3 + f/d less
(27 for an OPT block), the four products' inputs kept in float8 (one byte instead of two; measured: 3.0 GiB less for
llama-7b at batch 2 under fsdp x 2 with selective checkpointing, counted 2.8; the compiled 1.3B saved twice what is
counted); against llama-7b's ten measured peaks (bf16 and fp8, every checkpointing setting) the count is within 2.5%; plus the logits,
batch x seq x vocab x 6 bytes (bf16 and the fp32 copy the loss takes); with a chunked head (``module.head.kind=chunked``
or ``float8``, ``module.head.chunk_tokens=C``), C x vocab x 6 bytes plus the gradients the chunked head keeps: hidden
states and head weight in fp32; with ``module.compile`` the bf16 chunked head is counted as whole-batch logits, since
under compile it saved a tenth to a seventh of that, the float8 one as chunked (under tensor parallel the head runs
eager and holds a chunk's logits of its vocabulary, C x vocab / tp x 6 bytes, and the gathered hidden states); under ddp on more than one GPU, DDP's
gradient buckets, 4 B/param. The total is the larger of two peaks: at the end of the forward pass (weights,
optimizer state, activations, logits; gradients only when ``trainer.accumulate_grad_batches`` or
``global_batch_size`` makes several micro-batches per step, since the trainer frees them after each optimizer step)
and at the end of the backward pass (weights, gradients, optimizer state; under fsdp/hsdp one block's unsharded
gradients in bf16 and fp32 for the reduce-scatter; the DDP buckets in both). Under fsdp/hsdp the forward peak also
holds two blocks' gathered bf16 parameters, or all of them, 2 B/param, with ``strategy.reshard_after_forward=false``
(measured +2.2 GiB at 1.3B on 2 GPUs); with ``module.fp8.recipe=tensorwise`` the blocks' linear weights are gathered in float8,
1 B/param (lmtrain.training.fp8.gathers_in_float8). Measured against both in
docs/BENCHMARKS.md. A 10% margin is kept free.
"""

from __future__ import annotations

import math

AC = ("none", "op", "selective", "full", "offload")  # every strategy.activation_checkpointing (strategies.AC_MODES), most memory first
GB = 1e9
MARGIN = 0.9


def model_numbers(model_cfg, seq_len: int) -> dict:
    """Parameters and FLOPs of a model config (a meta-device build: no memory; each shape built once per process,
    since a plan's search over the presets builds every one of them)."""
    key = (repr(model_cfg), seq_len)  # (ModelConfig is a plain dataclass: its repr names every field)
    if key not in _NUMBERS:
        _NUMBERS[key] = _build_numbers(model_cfg, seq_len)
    return dict(_NUMBERS[key])


_NUMBERS: dict[tuple[str, int], dict] = {}


def _build_numbers(model_cfg, seq_len: int) -> dict:
    """Every figure is linear in the number of blocks (each block the same): built on the meta device with one block
    and with two, the rest extrapolated, so that a count of ``n_layers: 1000000`` takes no time and no memory. (A
    mixture of experts' first ``dense_layers`` blocks are built in both, the blocks after them extrapolated.)"""
    import dataclasses

    depth, dense = int(model_cfg.n_layers), model_cfg.moe_config.dense_layers if model_cfg.moe is not None else 0
    one = _numbers_of(dataclasses.replace(model_cfg, n_layers=dense + 1), seq_len)
    if depth <= dense + 1:
        return one
    two = _numbers_of(dataclasses.replace(model_cfg, n_layers=dense + 2), seq_len)
    return {k: type(one[k])(one[k] + (depth - dense - 1) * (two[k] - one[k])) for k in one}


def _numbers_of(model_cfg, seq_len: int) -> dict:
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
        # the weights FSDP gathers in float8 with module.fp8.recipe=tensorwise (every linear layer inside the blocks)
        "block_linear_params": sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)),
        # what tensor parallel splits (Decoder.tensor_parallel_plan): those weights, the biases of the column-split
        # products (every one but attention's output projection and the MLP's down projection, split by rows), and the
        # embedding and the output head (split by vocabulary; one tensor when tied)
        "tp_split_params": sum(m.weight.numel() + (m.bias.numel() if m.bias is not None and not n.endswith(("attn.proj", "mlp.down")) else 0)
                               for n, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear))
                           + model.tok_emb.weight.numel() + (0 if model_cfg.tie_embeddings else model.lm_head.weight.numel()),  # fmt: skip
        "flops_per_token": flops_per_token(model, seq_len),
    }


def block_activations(cfg, fp8: bool = False, tp: int = 1) -> float:
    """What one block keeps for its backward pass without recomputation, in bytes per token per unit of d_model
    (Korthikanti et al. 2022 with flash attention, counted for each family's MLP of width f): the two norms' inputs
    4, attention's input, q, k, v and output 10, the MLP's input 2, then GPT's MLP 4 f/d (its activation's input and
    output) plus 2 (dropout masks; 34 at f = 4d, the count the OPT rows were measured against) or llama's gated MLP
    8 f/d (the gate and up products, silu's output and their product: 37.5 for llama-7b, whose rows the 34 undercounted
    by up to 5%). ``module.fp8.recipe``: the four products keep their inputs in float8, one byte instead of two, 3 + f/d less
    (7 at f = 4d). Checkpointing by operator keeps the products' bf16 outputs and recomputes the casts, so its 22 stay.
    ``tp``: split over that many tensor-parallel ranks with sequence parallelism (Korthikanti et al.'s 34/t for an
    OPT block): q, k, v, attention's output and the MLP's inner activations split by heads and features, the norms'
    inputs, the products' gathered inputs (kept as each rank's part of the sequence) and the dropout masks by
    sequence. A mixture of experts (``model.moe``, never under tp): the mean over the blocks, the MoE ones counted below
    (not yet measured against a GPU's peak)."""
    f = cfg.hidden_dim / cfg.d_model
    whole = 8 + (0 if cfg.family == "llama" else 2) - (2 if fp8 else 0)  # the norms' inputs 4, the two inputs 2 + 2 (masks 2)
    split = 8 + (8 * f if cfg.family == "llama" else 4 * f) - (1 + f if fp8 else 0)  # q, k, v, output 8; the MLP's inside
    dense = (whole + split) / tp
    moe = getattr(cfg, "moe_config", None)
    if moe is None:
        return dense
    # A mixture of experts' block (lmtrain.nn.moe): attention as above; the router's fp32 logits and affinities 8 E / d;
    # each of the top_k copies of the token, its expert's input 2 (gathered, then padded), inside 8 f_e or 4 f_e, output 2
    # and weighted output 2; a shared expert's inside as a dense MLP's. The experts stay bf16 under float8 (only
    # attention's products and the shared expert's are float8). Averaged over the blocks, the first dense_layers dense.
    fe, fs = moe.expert_ffn_dim / cfg.d_model, moe.shared_ffn_dim / cfg.d_model
    inside = (lambda g: 8 * g) if cfg.family == "llama" else (lambda g: 4 * g)
    routed = 8 + inside(0) + 8 * moe.experts / cfg.d_model + moe.top_k * (6 + inside(fe)) + (inside(fs) if fs else 0)
    sparse = whole + routed - (1 if fp8 else 0) - ((1 + fs) if fp8 and fs else 0)
    n_dense = moe.dense_layers
    return (n_dense * dense + (cfg.n_layers - n_dense) * sparse) / cfg.n_layers


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
    reshard: bool = True,
    float8_gathered: int = 0,
    muon_params: int = 0,
    tp: int = 1,
    tp_split: int = 0,
    cp: int = 1,
) -> dict:
    """Bytes per GPU (see the module docstring): each term, and ``total``, the larger of the two peaks. ``muon_params``:
    the parameters whose state is Muon's one buffer instead of AdamW's two. ``tp``: tensor-parallel ranks (fsdp and
    hsdp): the ``tp_split`` parameters (the blocks' matrices, the column-split products' biases) split over them, every
    other parameter whole in each group,
    the groups sharded (fsdp over ``world / tp`` ranks, hsdp over one node's); activations by
    :func:`block_activations`; the output head split by vocabulary, and its logits. ``cp``: context-parallel ranks (fsdp),
    each holding ``seq / cp`` of every sequence's activations and logits, plus what attention gathers and keeps for
    its backward pass, every block's keys and values of the whole sequence, and the mask of its queries against them
    (one byte per pair); the groups shard with the data-parallel ranks (fsdp over ``world / tp``)."""
    if tp > 1 and strategy == "ddp":
        raise ValueError("strategy.tp splits layers under fsdp or hsdp, not ddp")
    shard = {"ddp": 1, "fsdp": world // tp, "hsdp": min(node, world) // tp}[strategy]
    local = params - tp_split * (1 - 1 / tp)  # a tensor-parallel rank's share before sharding
    split = local / params if params else 1.0
    L, d, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
    mine = seq / cp  # a context-parallel rank's tokens of each sequence
    gathered = 2 * 2 * batch * seq * cfg.kv_heads * cfg.head_dim / tp if cp > 1 else 0  # bf16 keys and values, whole
    per_layer_full = block_activations(cfg, fp8, tp) * mine * batch * d + gathered
    per_layer_saved = 2 * mine * batch * d
    if ac == "none":
        act = L * per_layer_full
    elif ac == "full":
        act = L * per_layer_saved + per_layer_full
    elif ac == "offload":  # full's saved inputs in host memory: on the card, one block's full set and two inputs in flight
        act = 2 * per_layer_saved + per_layer_full
    elif ac == "op":  # the 22 the products keep, split over the tensor-parallel ranks
        act = L * (22 / tp * mine * batch * d + gathered) + per_layer_full
    else:
        act = math.ceil(L / 2) * per_layer_full + (L // 2) * per_layer_saved
    if cp > 1:
        act += batch * mine * seq  # the mask of this rank's queries against every key, kept for every block's backward
    out = {
        "weights": 4 * local / shard,
        "gradients": 4 * local / shard,
        "optimizer": (8 * params - 4 * muon_params) * split / shard,
        "activations": act,
        "logits": 6 * batch * mine * V / tp if not loss_chunk else _chunked_head(loss_chunk, batch * mine, V, cfg.emb_dim, tp),
    }
    always = out["weights"] + out["optimizer"]
    if strategy != "ddp":  # parameters gathered for compute: one block and the prefetched next one, or, with
        # strategy.reshard_after_forward=false, all of them from the forward pass to the backward (+2.2 GiB at 1.3B);
        # bf16, but the ``float8_gathered`` parameters (the blocks' linear weights under float8 all-gather) in float8
        every = 2 * local - float8_gathered / tp
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
        out["backward_peak"] += 6 * (local / max(L, 1))
    out["total"] = max(out["forward_peak"], out["backward_peak"])
    return out


def counted(cfg, gpus: int, node: int) -> dict:
    """What :func:`memory` needs from a composed training config (model, data, module, strategy, trainer,
    global_batch_size) on ``gpus`` GPUs of ``node`` per node, besides the strategy and checkpointing mode."""
    from lmtrain.nn.model import ModelConfig
    from lmtrain.training import fastpaths
    from lmtrain.training.fp8 import gathers_in_float8

    fields = {k: v for k, v in cfg.model.items() if not str(k).startswith("_")}
    mcfg = ModelConfig(**fields)
    if cfg.data.get("batch_size") == "auto":
        from lmtrain.training.config import ConfigError

        raise ConfigError(
            "data.batch_size=auto is chosen on the GPU when training starts (lmtrain.training.batch, from this count): "
            "give the planner a number, data.batch_size=N"
        )
    seq, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
    module_cfg, strategy_cfg = cfg.get("module") or {}, cfg.get("strategy") or {}
    head_cfg, fp8_cfg, _ = fastpaths.read(module_cfg.get("head"), module_cfg.get("fp8"))
    chunk = head_cfg.chunk
    # Under torch.compile the chunked loss saved 0.8 of the 8.1 GiB of logits counted at 1.3B batch 28 and 1.3 of 9.2
    # at batch 32 (one H100, docs/BENCHMARKS.md): the compiled whole-batch loss keeps less than counted. Counted as
    # no saving there. The float8 head holds one chunk's: counted.
    fp8 = fp8_cfg.recipe is not None
    fp8_head = head_cfg.kind == "float8"
    reshard = strategy_cfg.get("reshard_after_forward", True) is not False
    gbs = cfg.get("global_batch_size")
    tp = strategy_cfg.get("tp") or 1  # the ranks of a tensor- and a context-parallel group read the same samples
    # (under tensor parallel the head runs eager: its chunks are what it holds)
    chunk_uncounted = bool(chunk) and bool(module_cfg.get("compile")) and not fp8_head and tp == 1
    chunk = None if chunk_uncounted else chunk
    cp = strategy_cfg.get("cp") or 1
    group = tp * cp if isinstance(tp, int) and isinstance(cp, int) and tp > 0 and cp > 0 else 1
    dp = gpus // group if gpus % group == 0 else gpus
    if gbs and gbs % (batch * dp):
        from lmtrain.training.config import ConfigError

        ranks = f"cluster.gpus ({gpus}) / (strategy.tp x strategy.cp) ({group})" if dp != gpus else f"cluster.gpus ({gpus})"
        raise ConfigError(f"global_batch_size={gbs} is not a multiple of data.batch_size ({batch}) x {ranks} = {batch * dp}")
    accum = gbs // (batch * dp) if gbs else int(cfg.trainer.accumulate_grad_batches)
    nums = model_numbers(mcfg, seq)
    # the blocks' weights fsdp/hsdp gather in float8 (counted only where parameters are gathered: not under ddp)
    # (under tensor parallel in bf16: lmtrain.training.assemble)
    float8_gathered = nums["block_linear_params"] if fp8 and gathers_in_float8(fp8_cfg.recipe, sharded=True) and tp == 1 else 0
    muon = str((cfg.get("optimizer") or {}).get("_target_", "")) == "lmtrain.nn.optim.MuonWithAdamW"  # its matrices: the blocks'
    return {
        "tp": tp if dp != gpus or tp == 1 else 1,
        "cp": cp if dp != gpus or cp == 1 else 1,
        "muon_params": nums["block_linear_params"] if muon else 0,
        "mcfg": mcfg, "nums": nums, "seq": seq, "batch": batch, "chunk": chunk, "accum": accum, "fp8": fp8, "reshard": reshard,
        "float8_gathered": float8_gathered, "chunk_uncounted": chunk_uncounted, "fp8_recipe": fp8_cfg.recipe, "head": head_cfg.kind,
    }  # fmt: skip


def _chunked_head(chunk: int, tokens: float, vocab: int, width: int, tp: int) -> float:
    """The chunked head's memory: one chunk's logits (bf16 and fp32), and the gradients it keeps (lmtrain.nn.loss: the
    hidden states' and the head weight's, fp32); under tensor parallel a chunk's logits of this rank's vocabulary and
    the gathered hidden states (bf16), each chunk's logits computed again in the backward pass instead of gradients
    kept (lmtrain.nn.parallel.chunked_vocab_parallel_cross_entropy)."""
    if tp > 1:
        return 6 * min(chunk, tokens) * vocab / tp + 2 * tokens * width
    return 6 * min(chunk, tokens) * vocab + 4 * (tokens + vocab) * width


def breakdown(c: dict, strategy: str, gpus: int, node: int, ac: str) -> dict:
    """:func:`memory`'s terms and peaks (bytes per GPU) for what :func:`counted` read from a config."""
    return memory(
        c["mcfg"], c["nums"]["params"], c["seq"], c["batch"], strategy, gpus, node, ac, c["chunk"], c["accum"], c["fp8"], c["reshard"],
        c["float8_gathered"], c["muon_params"], c["tp"] if strategy != "ddp" else 1, c["nums"]["tp_split_params"],
        c.get("cp", 1) if strategy == "fsdp" else 1,
    )  # fmt: skip


def peak(cfg, gpus: int, node: int, strategy: str, ac: str) -> float:
    """The counted peak in bytes per GPU of ``cfg`` under ``strategy`` (ddp, fsdp, hsdp) and checkpointing ``ac``."""
    return breakdown(counted(cfg, gpus, node), strategy, gpus, node, ac)["total"]
