"""The Hugging Face layout of a trained decoder: ``config.json``, weights under their ``transformers`` names, and the
tokenizer as ``tokenizer.json`` (``lmtrain export --format hf``).

An OPT-family model becomes ``OPTForCausalLM`` (learned positions with OPT's offset of 2, pre-norm layers, the
optional embedding projection); a Llama-family one ``LlamaForCausalLM`` (rotary positions in the same half-split
convention, grouped-query attention, SwiGLU), or ``Qwen3ForCausalLM`` with ``model.qk_norm`` (Llama's layers with a
norm on each head's queries and keys). Our fused projections are split into the separate ones ``transformers``
keeps (``qkv`` -> ``q_proj``/``k_proj``/``v_proj``; Llama's ``gate_up`` -> ``gate_proj``/``up_proj``). What those
classes cannot express is refused, naming it. ``transformers`` itself is not needed to write this: only to read it.

The tokenizer: our byte-level BPE ranks (tiktoken's format) as a ``tokenizers`` BPE model whose merges reproduce
tiktoken's (each token's merge is the split of it into two known tokens, ordered by the tokens' ranks), the same
pre-tokenization pattern, and the separator as a special token; it encodes text to the same ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lmtrain.errors import InputError

OPT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def config(model_cfg, eos: int, dtype: str, bos: int | None = None) -> dict:
    """``config.json`` for ``transformers`` (refuses what its class cannot express); ``bos``: the tokenizer's own
    beginning-of-sequence id (None: the separator, as with our own tokenizers)."""
    c = model_cfg
    bos = eos if bos is None else bos
    common = {
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "max_position_embeddings": c.max_seq_len, "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos, "torch_dtype": dtype, "dtype": dtype,
        "use_cache": True, "initializer_range": c.init_std,
    }  # fmt: skip
    if c.family == "opt":
        if c.qk_norm:
            raise InputError(
                "--format hf: model.qk_norm=true on the opt family: no transformers class has OPT's layers with a norm on "
                "queries and keys (Qwen3ForCausalLM has it for the llama family: train family=llama to export one)"
            )
        if c.act not in OPT_ACTIVATIONS:
            raise InputError(f"--format hf: OPTForCausalLM has no activation {c.act!r} (it has {sorted(OPT_ACTIVATIONS)})")
        if abs(c.norm_eps - 1e-5) > 1e-12:
            raise InputError(f"--format hf: OPTForCausalLM's layer norms use eps 1e-05; this model uses model.norm_eps={c.norm_eps}")
        if c.kv_heads != c.n_heads:
            raise InputError(f"--format hf: OPTForCausalLM has no grouped-query attention (model.n_kv_heads={c.kv_heads})")
        return {
            **common, "architectures": ["OPTForCausalLM"], "model_type": "opt", "ffn_dim": c.hidden_dim,
            "word_embed_proj_dim": c.emb_dim, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
            "activation_function": OPT_ACTIVATIONS[c.act], "enable_bias": True, "layer_norm_elementwise_affine": True,
            "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0, "init_std": c.init_std,
        }  # fmt: skip
    if c.family == "llama":
        if c.emb_dim != c.d_model:
            raise InputError(f"--format hf: LlamaForCausalLM has no embedding projection (model.embed_dim={c.emb_dim} != d_model)")
        llama = {
            **common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": c.hidden_dim,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
            "rope_theta": c.rope_theta, "rope_parameters": _rope_parameters(c),
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        }  # fmt: skip
        if c.moe is not None:
            return _olmoe(c, llama) if c.qk_norm == "projection" else _qwen3_moe(c, llama)
        if c.qk_norm == "projection":
            raise InputError("--format hf: model.qk_norm=projection on a dense model: OLMo 2, the dense model with it, puts its "
                             "norms after each branch, which lmtrain's blocks do not (a mixture of experts exports as OLMoE)")  # fmt: skip
        if not c.qk_norm:
            return llama
        # Qwen 3: Llama's layers with an RMSNorm on each head's queries and keys before the rotary positions, as ours
        del llama["mlp_bias"]
        return {**llama, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": c.n_layers, "layer_types": ["full_attention"] * c.n_layers}  # fmt: skip
    raise InputError(f"--format hf: no transformers class for model family {c.family!r}")


def _qwen3_moe(c, llama: dict) -> dict:
    """``Qwen3MoeForCausalLM``'s config of a llama-family mixture of experts: Qwen 3's layers (QK-norm) with routed
    SwiGLU experts, softmax scores, dense MLPs in its ``mlp_only_layers``; what it cannot express is refused."""
    m = _routed_as_transformers(c, "Qwen3MoeForCausalLM", first=[(not c.qk_norm, "model.qk_norm=true (its layers normalise each head's queries and keys)")])
    del llama["mlp_bias"]
    return {**llama, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "use_sliding_window": False,
            "sliding_window": None, "num_experts": m.experts, "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_ffn_dim, "norm_topk_prob": m.norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(m.dense_layers)), "router_aux_loss_coef": m.aux_loss, "output_router_logits": False}  # fmt: skip


def _olmoe(c, llama: dict) -> dict:
    """``OlmoeForCausalLM``'s config: Llama's layers with the whole query and key projections normalised
    (``model.qk_norm=projection``) and every MLP routed SwiGLU experts, softmax scores."""
    m = _routed_as_transformers(c, "OlmoeForCausalLM", last=[(bool(c.moe_config.dense_layers), "every block's MLP routed (model.moe.dense_layers=0)")])
    del llama["mlp_bias"]
    return {**llama, "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "intermediate_size": m.expert_ffn_dim,
            "num_experts": m.experts, "num_experts_per_tok": m.top_k, "norm_topk_prob": m.norm_topk, "clip_qkv": None,
            "router_aux_loss_coef": m.aux_loss, "output_router_logits": False}  # fmt: skip


def _routed_as_transformers(c, their_class: str, first: list[tuple[bool, str]] = (), last: list[tuple[bool, str]] = ()):
    """``c``'s MoEConfig, refused in one line naming each thing ``their_class`` lacks: what both MoE classes compute
    (softmax scores, no shared expert, no selection bias) between the class's own ``first`` and ``last`` needs
    ((lacking?, what it needs) each)."""
    m = c.moe_config
    lacks = [*first, (m.score != "softmax", f"model.moe.score=softmax (not {m.score})"),
             (bool(m.shared_ffn_dim), "no shared expert (model.moe.shared_ffn_dim=0)"),
             (bool(m.bias_rate), "no selection bias (model.moe.bias_rate=0: it chooses experts by their scores alone)"), *last]  # fmt: skip
    needed = [why for bad, why in lacks if bad]
    if needed:
        raise InputError(f"--format hf: {their_class}, transformers' class for this mixture of experts, needs {'; '.join(needed)}")
    return m


def _rope_parameters(c) -> dict:
    """transformers' ``rope_parameters`` of a llama-family model (Llama 3's or YaRN's scaling, or the default kind)."""
    if c.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": c.rope_theta}
    s = c.rope_scaling
    if s["rope_type"] == "yarn":
        from lmtrain.nn.model import ROPE_SCALING, yarn_attention_factor

        s = {**ROPE_SCALING["yarn"][1], **s}
        return {"rope_type": "yarn", "rope_theta": c.rope_theta, "factor": s["factor"],
                "original_max_position_embeddings": s["original_max_seq_len"], "beta_fast": s["beta_fast"], "beta_slow": s["beta_slow"],
                "attention_factor": yarn_attention_factor(s)}  # fmt: skip
    return {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s["factor"], "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"], "original_max_position_embeddings": s["original_max_seq_len"]}  # fmt: skip


def state_dict(state: dict[str, torch.Tensor], model_cfg, offset_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Our parameter names and layouts -> ``transformers``' (a tied output head stored once, as the embedding).
    ``offset_rows``: OPT's two rows of position offset, which OPT never reads (zeros if None; a run started from a
    transformers directory keeps that directory's: lmtrain.training.init_from)."""
    c = model_cfg
    q, kv = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    opt = c.family == "opt"
    root = decoder_root(c.family)
    out = {f"{root}embed_tokens.weight": state["tok_emb.weight"]}
    if opt:
        pos = state["pos_emb.weight"]
        out[f"{root}embed_positions.weight"] = torch.cat(
            [pos.new_zeros(2, pos.shape[1]) if offset_rows is None else offset_rows.to(pos), pos]
        )  # OPT's offset
        for ours, theirs in (("proj_in", "project_in"), ("proj_out", "project_out")):
            if f"{ours}.weight" in state:
                out[f"{root}{theirs}.weight"] = state[f"{ours}.weight"]
    for i in range(c.n_layers):
        b, h = f"blocks.{i}.", f"{root}layers.{i}."
        for part, (start, size) in zip(("q_proj", "k_proj", "v_proj"), ((0, q), (q, kv), (q + kv, kv))):
            for kind in ("weight", "bias"):
                if f"{b}attn.qkv.{kind}" in state:
                    out[f"{h}self_attn.{part}.{kind}"] = state[f"{b}attn.qkv.{kind}"][start : start + size]
        norms = (("attn_norm", "self_attn_layer_norm"), ("mlp_norm", "final_layer_norm")) if opt else (
            ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))  # fmt: skip
        for ours, theirs in norms:
            for kind in ("weight", "bias"):
                if f"{b}{ours}.{kind}" in state:
                    out[f"{h}{theirs}.{kind}"] = state[f"{b}{ours}.{kind}"]
        for norm in ("q_norm", "k_norm"):  # model.qk_norm (Qwen3ForCausalLM's)
            if f"{b}attn.{norm}.weight" in state:
                out[f"{h}self_attn.{norm}.weight"] = state[f"{b}attn.{norm}.weight"]
        for kind in ("weight", "bias"):
            if f"{b}attn.proj.{kind}" in state:
                out[f"{h}self_attn.{'out_proj' if opt else 'o_proj'}.{kind}"] = state[f"{b}attn.proj.{kind}"]
        if opt:
            for ours, theirs in (("up", "fc1"), ("down", "fc2")):
                for kind in ("weight", "bias"):
                    out[f"{h}{theirs}.{kind}"] = state[f"{b}mlp.{ours}.{kind}"]
        elif c.is_moe_layer(i):  # Qwen3MoeForCausalLM's router ("gate") and its experts one by one, as it saves them
            out[f"{h}mlp.gate.weight"] = state[f"{b}mlp.router.weight"]
            for e, (w_in, w_out) in enumerate(zip(state[f"{b}mlp.w_in"], state[f"{b}mlp.w_out"], strict=True)):
                gate, up = w_in.chunk(2, dim=0)
                out[f"{h}mlp.experts.{e}.gate_proj.weight"], out[f"{h}mlp.experts.{e}.up_proj.weight"] = gate, up
                out[f"{h}mlp.experts.{e}.down_proj.weight"] = w_out
        else:
            gate, up = state[f"{b}mlp.gate_up.weight"].chunk(2, dim=0)
            out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
            out[f"{h}mlp.down_proj.weight"] = state[f"{b}mlp.down.weight"]
    final = f"{root}final_layer_norm" if opt else f"{root}norm"
    for kind in ("weight", "bias"):
        if f"norm.{kind}" in state:
            out[f"{final}.{kind}"] = state[f"norm.{kind}"]
    if not c.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def tokenizer_json(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> str:
    """``tokenizer.json`` for byte-level BPE ``ranks`` (tiktoken's format), its pre-tokenization ``pattern`` and
    special tokens ``{text: id}``: the same ids as tiktoken's ``encode_ordinary`` for any text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from lmtrain.formats.tokenizer import byte_chars

    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    for content, idx in sorted(specials.items(), key=lambda kv: kv[1]):
        if idx != len(vocab) + len(tok.get_added_tokens_decoder()):
            raise InputError(f"--format hf: special token {content!r} has id {idx}, not the next id after the ranks")
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    return tok.to_str()


def tokenizer_config(eos_text: str, bos_text: str | None = None) -> dict:
    """``tokenizer_config.json``: a plain fast tokenizer over ``tokenizer.json`` that adds no tokens of its own and, as
    our data pipeline does, reads text that looks like the separator as ordinary text (``split_special_tokens``).
    ``bos_text``: the tokenizer's own beginning-of-sequence token (None: the separator)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_text, "bos_token": bos_text or eos_text, "pad_token": eos_text,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 10**9,
        "split_special_tokens": True,
    }  # fmt: skip


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


# -- reading: a transformers directory as an lmtrain model (issue 45's init_from) ---------------------------------------
HF_OPT_ACTIVATIONS = {theirs: ours for ours, theirs in OPT_ACTIVATIONS.items()}


def model_fields(cfg: dict, where: str = "config.json") -> dict:
    """The lmtrain model fields (``conf/model`` keys) of a transformers ``config.json`` of ``OPTForCausalLM``,
    ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``; what lmtrain cannot express is refused in one line naming the field (InputError)."""

    def need(key: str, want, default=None) -> None:
        got = cfg.get(key, default)
        if got != want:
            raise InputError(
                f"{where}: {key}={json.dumps(got)} is not something lmtrain's decoder can express (it needs {json.dumps(want)})"
            )

    kind = cfg.get("model_type")
    common = {
        "vocab_size": cfg.get("vocab_size"), "d_model": cfg.get("hidden_size"), "n_layers": cfg.get("num_hidden_layers"),
        "n_heads": cfg.get("num_attention_heads"), "max_seq_len": cfg.get("max_position_embeddings"),
    }  # fmt: skip
    missing = [k for k, v in (("vocab_size", common["vocab_size"]), ("hidden_size", common["d_model"]),
                              ("num_hidden_layers", common["n_layers"]), ("num_attention_heads", common["n_heads"]),
                              ("max_position_embeddings", common["max_seq_len"])) if v is None]  # fmt: skip
    if kind not in ("opt", "llama", "qwen3", "qwen3_moe", "olmoe"):
        raise InputError(
            f"{where}: model_type={json.dumps(kind)}: lmtrain reads OPTForCausalLM (opt), LlamaForCausalLM (llama), "
            "Qwen3ForCausalLM (qwen3), Qwen3MoeForCausalLM (qwen3_moe) and OlmoeForCausalLM (olmoe)"
        )
    if missing:
        raise InputError(f"{where}: {', '.join(missing)} missing")
    if kind == "opt":
        need("do_layer_norm_before", True, True)
        need("_remove_final_layer_norm", False, False)
        need("enable_bias", True, True)
        need("layer_norm_elementwise_affine", True, True)
        act = cfg.get("activation_function", "relu")
        if act not in HF_OPT_ACTIVATIONS:
            raise InputError(f"{where}: activation_function={json.dumps(act)} is not one of {sorted(HF_OPT_ACTIVATIONS)}")
        proj = cfg.get("word_embed_proj_dim") or common["d_model"]
        return {
            **common, "family": "opt", "ffn_dim": cfg.get("ffn_dim") or 4 * common["d_model"],
            "embed_dim": proj if proj != common["d_model"] else None, "tie_embeddings": cfg.get("tie_word_embeddings", True),
            "norm_eps": 1e-5, "dropout": float(cfg.get("dropout", 0.1)), "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
            "init_std": float(cfg.get("init_std", 0.02)), "activation": HF_OPT_ACTIVATIONS[act], "n_kv_heads": None,
        }  # fmt: skip
    need("hidden_act", "silu", "silu")
    need("attention_bias", False, False)
    need("mlp_bias", False, False)
    qk_norm = kind in ("qwen3", "qwen3_moe")  # Qwen3ForCausalLM: Llama's layers with model.qk_norm
    if qk_norm:
        need("use_sliding_window", False, False)
    moe = _qwen3_moe_fields(cfg, common["n_layers"], where, need) if kind == "qwen3_moe" else None
    if kind == "olmoe":  # OLMoE: the whole projections' QK-norm, every MLP routed experts of intermediate_size
        need("clip_qkv", None, None)
        qk_norm = "projection"
        moe = _routed_fields(cfg, cfg.get("num_experts", 64), cfg.get("num_experts_per_tok", 8), cfg.get("intermediate_size"), 0.01, 0)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3", "yarn"):
        raise InputError(
            f"{where}: rope_type={json.dumps(kind)}: lmtrain's rotary positions are the default kind, Llama 3's (llama3) or YaRN's (yarn)"
        )
    scaling = None
    if kind == "yarn":
        scaling = _yarn_scaling(rope, cfg, where)
    if kind == "llama3":
        theirs = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                  "original_max_seq_len": "original_max_position_embeddings"}  # fmt: skip
        lacking = [t for t in theirs.values() if t not in rope]
        if lacking:
            raise InputError(f'{where}: rope_type="llama3" without {", ".join(lacking)}')
        scaling = {"rope_type": "llama3", **{ours: rope[t] for ours, t in theirs.items()}}
    head_dim = cfg.get("head_dim") or common["d_model"] // common["n_heads"]
    if head_dim * common["n_heads"] != common["d_model"]:
        raise InputError(
            f"{where}: head_dim={head_dim} with num_attention_heads={common['n_heads']} is not hidden_size={common['d_model']}"
        )
    kv = cfg.get("num_key_value_heads") or common["n_heads"]
    return {
        **common, "family": "llama", "ffn_dim": cfg.get("intermediate_size"), "n_kv_heads": kv if kv != common["n_heads"] else None,
        "embed_dim": None, "tie_embeddings": cfg.get("tie_word_embeddings", False), "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), "rope_scaling": scaling, "dropout": 0.0,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)), "init_std": float(cfg.get("initializer_range", 0.02)),
        "activation": None, "qk_norm": qk_norm, "moe": moe,
    }  # fmt: skip


def _qwen3_moe_fields(cfg: dict, n_layers: int, where: str, need) -> dict:
    """``model.moe`` of a ``Qwen3MoeForCausalLM`` config: its experts, softmax scores, the dense MLPs of
    ``mlp_only_layers`` (the first ones: lmtrain's ``dense_layers``), every other layer sparse."""
    need("decoder_sparse_step", 1, 1)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    dense = list(cfg.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise InputError(f"{where}: mlp_only_layers={json.dumps(dense)}: lmtrain's dense layers are the first ones (0, 1, ...)")
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size"))) if v is None]  # fmt: skip
    if missing:
        raise InputError(f"{where}: {', '.join(missing)} missing")
    return _routed_fields(cfg, experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], 0.001, len(dense))


def _routed_fields(cfg: dict, experts: int, top_k: int, ffn: int, aux_default: float, dense_layers: int) -> dict:
    """``model.moe`` of a transformers MoE class: softmax scores renormalised as ``norm_topk_prob`` says, no shared
    expert, no selection bias, no router z-loss, its ``router_aux_loss_coef`` (``aux_default`` where not given)."""
    return {"experts": experts, "top_k": top_k, "expert_ffn_dim": ffn, "shared_ffn_dim": 0, "score": "softmax",
            "norm_topk": bool(cfg.get("norm_topk_prob", False)), "aux_loss": float(cfg.get("router_aux_loss_coef", aux_default)),
            "z_loss": 0.0, "bias_rate": 0.0, "dense_layers": dense_layers}  # fmt: skip


def _yarn_scaling(rope: dict, cfg: dict, where: str) -> dict:
    """transformers' ``rope_type: yarn`` parameters as ``model.rope_scaling``, with the attention factor it would
    compute (from ``mscale`` and ``mscale_all_dim`` where given, as DeepSeek-V3's configs do), so that lmtrain's
    tables are transformers'."""
    from lmtrain.nn.model import ROPE_SCALING, yarn_attention_factor, yarn_mscale

    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise InputError(f'{where}: rope_type="yarn" without original_max_position_embeddings')
    if rope.get("truncate", True) is not True:
        raise InputError(
            f'{where}: rope_type="yarn" with truncate={json.dumps(rope["truncate"])}: lmtrain rounds the ramp\'s ends as truncate=true does'
        )
    factor = rope.get("factor") or cfg.get("max_position_embeddings", 0) / original
    defaults = ROPE_SCALING["yarn"][1]
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_seq_len": original,
               **{k: float(rope.get(k) or defaults[k]) for k in ("beta_fast", "beta_slow")}}  # fmt: skip
    attention = rope.get("attention_factor")
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    scaling["attention_factor"] = float(attention) if attention is not None else yarn_attention_factor(scaling)
    return scaling


def decoder_root(family: str) -> str:
    """The prefix of ``transformers``' decoder tensors for a model family (OPT nests its decoder one level deeper)."""
    return "model.decoder." if family == "opt" else "model."


def our_layout(names, model_cfg) -> dict[str, list[tuple[str, int]]]:
    """Where each of our tensors lies in ``transformers``' (the inverse of :func:`state_dict`), without reading any:
    ``{ours: [(theirs, first row), ...]}``, each from that row to its end, concatenated (the separate projections
    fused; OPT's two position rows of offset left out; a tied head is the embedding). ``names``: their tensor names.
    A tensor missing is refused in one line naming it (InputError); one left over, too."""
    c = model_cfg
    opt = c.family == "opt"
    root = decoder_root(c.family)
    left = set(names)

    def take(name: str, start: int = 0) -> tuple[str, int]:
        if name not in left:
            raise InputError(f"the weights have no tensor {name}" if name not in names else f"tensor {name} read twice")
        left.discard(name)
        return name, start

    out = {"tok_emb.weight": [take(f"{root}embed_tokens.weight")]}
    if opt:
        out["pos_emb.weight"] = [take(f"{root}embed_positions.weight", start=2)]  # OPT's offset of 2
        if c.emb_dim != c.d_model:
            out["proj_in.weight"] = [take(f"{root}project_in.weight")]
            out["proj_out.weight"] = [take(f"{root}project_out.weight")]
    kinds = ("weight", "bias") if opt else ("weight",)
    for i in range(c.n_layers):
        b, h = f"blocks.{i}.", f"{root}layers.{i}."
        for kind in kinds:
            out[f"{b}attn.qkv.{kind}"] = [take(f"{h}self_attn.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{b}attn.proj.{kind}"] = [take(f"{h}self_attn.{'out_proj' if opt else 'o_proj'}.{kind}")]
        if c.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[f"{b}attn.{norm}.weight"] = [take(f"{h}self_attn.{norm}.weight")]
        norms = (("attn_norm", "self_attn_layer_norm"), ("mlp_norm", "final_layer_norm")) if opt else (
            ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))  # fmt: skip
        for ours, theirs_name in norms:
            for kind in kinds:
                out[f"{b}{ours}.{kind}"] = [take(f"{h}{theirs_name}.{kind}")]
        if opt:
            for ours, theirs_name in (("up", "fc1"), ("down", "fc2")):
                for kind in kinds:
                    out[f"{b}mlp.{ours}.{kind}"] = [take(f"{h}{theirs_name}.{kind}")]
        elif c.is_moe_layer(i):  # the experts' 3-D tensors, their rows flattened over experts (read_ours)
            experts = range(c.moe_config.experts)
            out[f"{b}mlp.router.weight"] = [take(f"{h}mlp.gate.weight")]
            out[f"{b}mlp.w_in"] = [take(f"{h}mlp.experts.{e}.{p}.weight") for e in experts for p in ("gate_proj", "up_proj")]
            out[f"{b}mlp.w_out"] = [take(f"{h}mlp.experts.{e}.down_proj.weight") for e in experts]
        else:
            out[f"{b}mlp.gate_up.weight"] = [take(f"{h}mlp.gate_proj.weight"), take(f"{h}mlp.up_proj.weight")]
            out[f"{b}mlp.down.weight"] = [take(f"{h}mlp.down_proj.weight")]
    final = f"{root}final_layer_norm" if opt else f"{root}norm"
    for kind in kinds:
        out[f"norm.{kind}"] = [take(f"{final}.{kind}")]
    if c.tie_embeddings:
        left.discard("lm_head.weight")  # a tied head saved anyway is the embedding
        out["lm_head.weight"] = out["tok_emb.weight"]
    else:
        out["lm_head.weight"] = [take("lm_head.weight")]
    extra = [k for k in left if not k.endswith("rotary_emb.inv_freq")]
    if extra:
        raise InputError(f"the weights have tensors this model does not: {', '.join(sorted(extra)[:5])}")
    return out


def read_rows(parts, start: int, stop: int, get) -> torch.Tensor:
    """Rows ``start:stop`` of one of our tensors laid out as ``parts`` (:func:`our_layout`); ``get(name, a, b)``
    reads rows ``a:b`` of their tensor ``name``, and ``rows(name)`` below tells each one's length."""
    pieces, at = [], 0
    for name, first in parts:
        n = get.rows(name) - first
        lo, hi = max(start, at), min(stop, at + n)
        if lo < hi:
            pieces.append(get(name, first + lo - at, first + hi - at))
        at += n
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _InMemory:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.tensors[name][a:b]

    def rows(self, name: str) -> int:
        return self.tensors[name].shape[0]


def read_ours(parts, shape, first: int, last: int, get) -> torch.Tensor:
    """Rows ``first:last`` (along its first dimension) of our tensor of ``shape`` laid out as ``parts``: a 3-D tensor's
    layout (a mixture of experts' stacked experts) counts the rows of its first two dimensions flattened."""
    if len(shape) != 3:
        return read_rows(parts, first, last, get)
    return read_rows(parts, first * shape[1], last * shape[1], get).reshape(last - first, shape[1], shape[2])


def our_state_dict(theirs: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """``transformers``' tensors -> ours, read whole (:func:`our_layout`)."""
    get = _InMemory(theirs)
    out = {ours: read_rows(parts, 0, 1 << 62, get) for ours, parts in our_layout(set(theirs), model_cfg).items()}
    if model_cfg.moe is not None:  # the stacked experts, (experts, rows, features)
        n = model_cfg.moe_config.experts
        out = {k: v.reshape(n, -1, v.shape[-1]) if k.endswith((".mlp.w_in", ".mlp.w_out")) else v for k, v in out.items()}
        for i in range(model_cfg.n_layers):  # the selection bias, which transformers' class does not have: zero
            if model_cfg.is_moe_layer(i):
                out[f"blocks.{i}.mlp.expert_bias"] = torch.zeros(n)
    return out


# -- a transformers directory's weights, read where they are needed ----------------------------------------------------
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Weights:
    """The safetensors weights of a ``transformers`` directory (one file, or the shards its ``model.safetensors.index.json``
    lists), opened but not read: only the files' headers are, until :meth:`__call__` reads rows of one tensor (a rank
    reads its own shard's rows and no others). A file missing, damaged or cut short, or a tensor the index names that
    its file lacks, is refused in one line naming it (InputError)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = folder = Path(folder)
        if (folder / INDEX).is_file():
            try:
                index = json.loads((folder / INDEX).read_text())
                weight_map = dict(index["weight_map"])
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputError(f"{folder / INDEX} is not a readable safetensors index ({type(exc).__name__}: {exc})") from None
            files = sorted(set(weight_map.values()))
        elif (folder / WEIGHTS).is_file():
            weight_map, files = None, [WEIGHTS]
        else:
            pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
            why = (f" (it has {', '.join(sorted(pickled))}: pickled weights, which can run code when read, are not; "
                   "save them with transformers' save_pretrained, which writes safetensors)") if pickled else ""  # fmt: skip
            raise InputError(f"{folder} has no {WEIGHTS} or {INDEX}: lmtrain reads safetensors weights{why}")
        self.handles, self.where = {}, {}
        for name in files:
            path = folder / name
            if Path(name).name != name or name in (".", ".."):
                raise InputError(
                    f"{folder / INDEX} places tensors in {name!r}, which is not a file name inside {folder} (a path "
                    "elsewhere is not read)"
                )
            if not path.is_file():
                raise InputError(f"{path} is missing" + (f" ({INDEX} lists it)" if weight_map is not None else ""))
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors' own error type: a damaged or truncated file
                raise InputError(f"{path} is not a readable safetensors file: {exc}") from None
            self.handles[name] = handle
            for key in keys:
                if weight_map is None or weight_map.get(key) == name:
                    self.where[key] = name
        if weight_map is not None:
            lacking = [k for k, f in weight_map.items() if k not in self.where]
            if lacking:
                raise InputError(
                    f"{folder / weight_map[lacking[0]]} lacks tensor {lacking[0]}, which {INDEX} places there (a partial file)"
                )
        self.shapes = {k: tuple(self._slice(k).get_shape()) for k in self.where}
        self.dtypes = {k: self._slice(k).get_dtype() for k in self.where}

    def _slice(self, name: str):
        return self.handles[self.where[name]].get_slice(name)

    def __call__(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._slice(name)[a:b]

    def rows(self, name: str) -> int:
        return self.shapes[name][0]

    def nbytes(self, name: str | None = None) -> int:
        """Bytes of one tensor, or of the files (None)."""
        if name is None:
            return sum((self.folder / f).stat().st_size for f in self.handles)
        import math

        return math.prod(self.shapes[name]) * FLOAT_DTYPES[self.dtypes[name]].itemsize if self.dtypes[name] in FLOAT_DTYPES else 0

    def first_non_finite(self, names, chunk_bytes: int = 64 << 20) -> str | None:
        """The first of ``names`` holding a NaN or an infinity, said with where and what (None: every value finite).
        Read in pieces of rows (``chunk_bytes`` at most, one row at least) from the memory-mapped files."""
        for name in names:
            shape = self.shapes[name]
            if not shape:
                pieces = [(0, self.handles[self.where[name]].get_tensor(name).reshape(1))]
            else:
                step = max(1, chunk_bytes // max(1, self.nbytes(name) // max(1, shape[0])))
                pieces = ((a, self(name, a, min(shape[0], a + step))) for a in range(0, shape[0], step))
            for first, t in pieces:
                bad = ~torch.isfinite(t)
                if bool(bad.any()):
                    at = [int(i) for i in bad.nonzero()[0]]
                    value = float(t[tuple(at)])
                    if shape:
                        at[0] += first
                    return f"tensor {name} in {self.folder / self.where[name]} holds {value} at {at if shape else '[]'}"
        return None

    def check(self, model_cfg, ours: dict[str, torch.Tensor]) -> dict[str, list]:
        """Every tensor against what the model needs (``ours``: its state dict, on the meta device serves): a tensor
        missing, left over, of another shape or not of a floating-point type is refused in one line naming it. Returns
        :func:`our_layout`."""
        want = state_dict({k: v for k, v in ours.items() if not k.startswith("rope_")}, model_cfg)
        for name, dtype in sorted(self.dtypes.items()):
            if dtype not in FLOAT_DTYPES and not name.endswith("rotary_emb.inv_freq"):
                raise InputError(
                    f"tensor {name} in {self.folder} is {dtype}, not floating point (a quantized checkpoint?): lmtrain reads F32, BF16, F16 or F64 weights"
                )
        layout = our_layout(set(self.where), model_cfg)
        if model_cfg.tie_embeddings and "lm_head.weight" in self.shapes:  # a tied head saved anyway: the embedding's shape
            want["lm_head.weight"] = want[layout["tok_emb.weight"][0][0]]
        for name, tensor in want.items():
            if self.shapes.get(name) != tuple(tensor.shape):
                raise InputError(
                    f"tensor {name} in {self.folder} has shape {list(self.shapes[name])}; config.json's model needs {list(tensor.shape)}"
                )
        return layout
