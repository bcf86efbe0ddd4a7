"""Decoder-only transformer in pure PyTorch (no Lightning here).

Two families share one implementation:

* ``opt``   -- OPT / GPT-2 style: LayerNorm, learned absolute positions, GELU MLP, biases.
* ``llama`` -- Llama style: RMSNorm, rotary positions, SwiGLU MLP, no biases, optional
  grouped-query attention (``n_kv_heads < n_heads``).

Weights are initialised as in GPT-2 / OPT (Megatron): normal(0, ``init_std``) everywhere, with the
residual output projections scaled by ``1 / sqrt(2 * n_layers)``.

Named sizes live in one registry, the yaml files under ``conf/model/``; this module takes them as data
(``ModelConfig.from_dict``), and ``lmtrain.formats.presets`` reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lmtrain.nn.context import ContextParallel, ContextSplit
from lmtrain.nn.loss import chunked_linear_cross_entropy, cross_entropy
from lmtrain.nn.moe import MoE, unused_params

FAMILIES = ("opt", "llama")
# per family, its MLP activations (the first is the default): opt/GPT-2 MLP, or llama's gated SwiGLU
ACTIVATIONS = {"opt": ("gelu", "gelu_tanh", "relu"), "llama": ("silu",)}


@dataclass
class ModelConfig:
    """Shape and flavour of the decoder. Field names are the yaml keys of ``conf/model/*.yaml``."""

    name: str = "custom"
    family: str = "opt"  # one of FAMILIES
    vocab_size: int = 50272
    max_seq_len: int = 2048  # longest sequence the position encoding supports
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: = n_heads (multi-head); fewer: grouped-query attention
    ffn_dim: int | None = None  # None: 4 * d_model
    embed_dim: int | None = None  # None: = d_model; else project embeddings in/out (OPT-350m: 512)
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama: Llama 3's or YaRN's long-context frequencies (ROPE_SCALING); None: plain rotary
    dropout: float = 0.0  # on each block's two residual branches (OPT's `dropout`); never on the embeddings
    attention_dropout: float = 0.0  # on the attention probabilities (OPT's `attention_dropout`: 0.0 in its released configs)
    init_std: float = 0.02
    embed_init_std: float | None = None  # the token embeddings' init; None: 1.0 for a llama with its own head, else init_std
    activation: str | None = None  # None: the family's (opt: gelu, llama: silu); opt also: gelu_tanh, relu
    qk_norm: bool | str = False  # queries and keys normalised before attention: true each head's (Qwen 3's), projection the whole projections' (OLMoE's, OLMo 2's)
    moe: dict | None = None  # mixture of experts: lmtrain.nn.moe.MoEConfig's keys; None: every block's MLP dense

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):  # a DictConfig from Hydra
            self.rope_scaling = {str(k): v for k, v in self.rope_scaling.items()}
        if isinstance(self.moe, Mapping):
            self.moe = {str(k): v for k, v in self.moe.items()}
        errors = self.problems()
        if errors:
            raise ValueError(f"invalid model config '{self.name}': " + "; ".join(errors))
        if self.moe is not None:  # every key spelt out, so what is stored says what trained whatever defaults change
            from lmtrain.nn.moe import complete

            self.moe = complete(self.moe)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim or 4 * self.d_model

    @property
    def act(self) -> str:
        return self.activation or ACTIVATIONS[self.family][0]

    @property
    def emb_dim(self) -> int:
        return self.embed_dim or self.d_model

    @property
    def moe_config(self):
        """``moe`` as lmtrain.nn.moe.MoEConfig, or None for a dense model."""
        from lmtrain.nn.moe import MoEConfig

        return MoEConfig.of(self.moe) if self.moe is not None else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe_config.dense_layers

    def undivided_by(self, tp: int) -> str:
        """The sizes tensor parallel over ``tp`` ranks would split and ``tp`` does not divide (heads, key-value heads,
        MLP features), as ``model.KEY=N`` joined; empty when it divides them all."""
        sizes = (("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads), ("ffn_dim", self.hidden_dim))
        return ", ".join(f"model.{k}={n}" for k, n in sizes if n % tp)

    def problems(self) -> list[str]:
        """Every inconsistency in this config, as messages naming the key (empty when valid)."""
        out: list[str] = []
        if self.family not in FAMILIES:
            out.append(f"model.family='{self.family}' is not one of {list(FAMILIES)}")
        for key in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                out.append(f"model.{key}={getattr(self, key)!r} must be a positive integer")
        if out:
            return out
        if self.d_model % self.n_heads:
            out.append(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}")
        elif self.family == "llama" and self.head_dim % 2:
            out.append(f"rotary positions need an even head size, got d_model/n_heads={self.head_dim}")
        if self.n_kv_heads is not None:
            if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
                out.append(f"model.n_kv_heads={self.n_kv_heads} must be positive and divide model.n_heads={self.n_heads}")
        for key in ("ffn_dim", "embed_dim"):
            val = getattr(self, key)
            if val is not None and (not isinstance(val, int) or val <= 0):
                out.append(f"model.{key}={val!r} must be a positive integer or null")
        if self.activation is not None and self.activation not in ACTIVATIONS[self.family]:
            out.append(f"model.activation={self.activation!r} is not one of {list(ACTIVATIONS[self.family])} for the {self.family} family")
        if self.rope_scaling is not None:
            out += rope_scaling_problems(self.rope_scaling, self.family)
        if not isinstance(self.qk_norm, bool) and self.qk_norm != "projection":
            out.append(f"model.qk_norm={self.qk_norm!r} must be true (each head's), projection (the whole projections') or false")
        if self.moe is not None:
            from lmtrain.nn.moe import moe_problems

            out += moe_problems(self.moe, self.n_layers)
        for key in ("dropout", "attention_dropout"):
            val = getattr(self, key)
            if not isinstance(val, (int, float)) or not 0.0 <= val < 1.0:
                out.append(f"model.{key}={val!r} must be in [0, 1)")
        for key, nullable in (("init_std", False), ("embed_init_std", True)):
            val = getattr(self, key)
            if not (val is None and nullable) and (isinstance(val, bool) or not isinstance(val, (int, float)) or not 0.0 <= val < math.inf):
                out.append(f"model.{key}={val!r} must be a standard deviation >= 0" + (" or null" if nullable else ""))
        return out

    @classmethod
    def from_dict(cls, fields: dict, **overrides) -> ModelConfig:
        """From a preset's or a config's fields (keys starting with ``_``, such as Hydra's ``_target_``, ignored)."""
        return cls(**{**{k: v for k, v in fields.items() if not str(k).startswith("_")}, **overrides})

    @classmethod
    def as_trained(cls, fields: dict) -> ModelConfig:
        """The model a run directory's config, a checkpoint or an export stored: ``from_dict``, with a ``model.moe``
        written before lmtrain spelt every key out read at the defaults it trained with (lmtrain.nn.moe.as_trained)."""
        from lmtrain.nn.moe import as_trained

        return cls.from_dict({**fields, "moe": as_trained(fields.get("moe"))})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- building blocks ----------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


# model.rope_scaling, by rope_type: the keys it needs, and those it may give with their defaults
ROPE_SCALING = {
    # Llama 3.1's: the long wavelengths divided by factor, the short ones kept, those between blended smoothly
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"}, {}),
    # YaRN (Peng et al. 2023; Qwen's and DeepSeek-V3's long context): the frequencies turning fewer than beta_slow times
    # over the original context divided by factor, those turning more than beta_fast times kept, a linear ramp between,
    # and every logit scaled by attention_factor (null: 0.1 ln(factor) + 1, the paper's)
    "yarn": ({"factor", "original_max_seq_len"}, {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None}),
}
ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")  # llama3's, in order


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def rope_scaling_problems(scaling, family: str) -> list[str]:
    """``model.rope_scaling``: Llama 3's (``rope_type: llama3`` and its four numbers) or YaRN's (``rope_type: yarn``,
    ``factor``, ``original_max_seq_len``, optionally ``beta_fast``, ``beta_slow``, ``attention_factor``), on the llama
    family only."""
    if family != "llama":
        return [f"model.rope_scaling is for the llama family's rotary positions, not {family}'s"]
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    forms = (
        "{rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_seq_len} or "
        "{rope_type: yarn, factor, original_max_seq_len[, beta_fast, beta_slow, attention_factor]}"
    )
    if kind not in ROPE_SCALING:
        return [f"model.rope_scaling={scaling!r}: give {forms}"]
    need, may = ROPE_SCALING[kind]
    given = set(scaling) - {"rope_type"}
    if not need <= given or given - need - set(may):
        return [f"model.rope_scaling={scaling!r}: give {forms}"]
    numbers = {**may, **scaling}
    bad = [k for k in sorted(given) if not (_number(numbers[k]) or (k in may and may[k] is None and numbers[k] is None))]
    if bad:
        return [f"model.rope_scaling.{bad[0]}={scaling[bad[0]]!r} must be a positive number"]
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return ["model.rope_scaling.high_freq_factor must exceed low_freq_factor"]
    if kind == "yarn" and numbers["beta_fast"] <= numbers["beta_slow"]:
        return ["model.rope_scaling.beta_fast must exceed beta_slow"]
    return []


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's scale for a context ``factor`` times longer: 0.1 mscale ln(factor) + 1 (1 for a factor up to 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's scale of the cos/sin tables (each attention logit scaled by its square): ``attention_factor``, else
    :func:`yarn_mscale` of the factor."""
    given = scaling.get("attention_factor")
    return float(given) if given is not None else yarn_mscale(scaling["factor"])


def rope_cache(seq_len: int, head_dim: int, theta: float, device=None, scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) for the half-split rotary convention; ``scaling``: Llama 3's or
    YaRN's (ROPE_SCALING)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    scale = 1.0
    if scaling is not None and scaling["rope_type"] == "llama3":
        factor, low, high, context = (scaling[k] for k in ROPE_SCALING_KEYS[1:])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = torch.where(wavelen > context / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq)
    elif scaling is not None:  # yarn
        s = {**ROPE_SCALING["yarn"][1], **scaling}
        factor, context = s["factor"], s["original_max_seq_len"]

        def dim(rotations: float) -> float:  # the pair index whose frequency turns ``rotations`` times over the context
            return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(dim(s["beta_fast"])), 0), min(math.ceil(dim(s["beta_slow"])), head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)  # past the ramp interpolated, before it kept
        scale = yarn_attention_factor(s)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd), or (B, 1, T, hd) for positions that restart per document
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def document_ids(idx: torch.Tensor, separator: int) -> torch.Tensor:
    """Each token's document within its sequence (B, T): the number of separators before it. The separator counts
    with the document it ends; a sequence's first tokens (the end of a document begun in an earlier block) are
    document 0."""
    sep = (idx == separator).to(torch.int32)
    return torch.cumsum(sep, dim=-1) - sep


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (B, T): 0 at each document's first token."""
    T = doc.shape[-1]
    ar = torch.arange(T, device=doc.device).expand_as(doc)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[..., 1:] = doc[..., 1:] != doc[..., :-1]
    start = torch.where(first, ar, torch.zeros_like(ar)).cummax(dim=-1).values
    return ar - start


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean attention mask: a token attends to itself and the earlier tokens of its own document."""
    T = doc.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc.unsqueeze(-1) == doc.unsqueeze(-2))).unsqueeze(1)


@torch.compiler.disable  # built once per batch outside the compiled graph, then passed to every (compiled) block
def document_block_mask(doc: torch.Tensor) -> BlockMask:
    """The rule of :func:`document_mask` as FlexAttention's block-sparse mask: blocks of 128 x 128 that lie wholly
    outside every document's causal triangle are skipped, not computed and masked. Built by compiled code on a GPU."""
    B, T = doc.shape

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    build = _compiled_create_block_mask() if doc.is_cuda else create_block_mask
    return build(same_document_causal, B, None, T, T, device=doc.device)


@functools.cache
def _compiled_create_block_mask():
    """``torch.compile(create_block_mask)``: what its deprecated ``_compile=True`` does (PyTorch 2.13's source), once."""
    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def flex_attention_fn(device: torch.device):
    """FlexAttention for this device: in eager code on CUDA, a compiled wrapper (its fused Triton kernel); while being
    compiled (``module.compile``, ``strategy.compile``), the plain function, which the compiler turns into the same
    kernel inside the graph: tracing into the wrapper instead broke the graph at every attention call (seen on a GPU),
    and a checkpointed block with a break runs eagerly, its attention then recomputed under
    ``activation_checkpointing=op``. On the CPU: the eager reference implementation (tests)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex_attention()


class QKProbe(nn.Module):
    """Returns the queries and keys it is given, as they enter attention (after QK-norm and the rotary positions):
    the place a hook reads them. lmtrain.training.module records from them each training step's attention-logit
    bound (docs/stability.md); nothing else depends on it, and it holds no state."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        bias = cfg.family == "opt"
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.proj.residual_out = True  # scaled init
        self.dropout = cfg.attention_dropout
        # model.qk_norm: the family's norm on queries and keys before the rotary positions, over each head's features
        # (true: Qwen 3's per-head RMSNorm) or over the whole projection (projection: OLMoE's and OLMo 2's), which bounds
        # the attention logits' growth, one cause of the loss spikes of large runs
        self.qk_whole = cfg.qk_norm == "projection"
        q_dim, k_dim = (cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim) if self.qk_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = make_norm(cfg, q_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, k_dim) if cfg.qk_norm else None
        self.qk_probe = QKProbe()

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | BlockMask | ContextSplit | None = None
    ) -> torch.Tensor:
        """``rope``: the (cos, sin) rows of each position; ``mask``: where a query may attend a key (document masking),
        a (B, 1, T, T) boolean tensor (:func:`document_mask`, for SDPA) or a FlexAttention block mask
        (:func:`document_block_mask`); under context parallel a :class:`ContextSplit` (the keys and values gathered
        from the group, its mask of this rank's queries against them); None: plain causal attention."""
        B, T, _ = x.shape  # (B, T, C)
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        else:  # split for tensor parallelism (unfuse): this rank's heads
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # over the whole projections (every head's features together)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not self.qk_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's features (the last dimension)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = self.qk_probe(q, k)
        if isinstance(mask, ContextSplit):  # context parallel: this rank's queries against the whole sequence's keys
            k, v, mask = mask.cp.gather(k, 2), mask.cp.gather(v, 2), mask.mask
        if isinstance(mask, BlockMask):
            y = flex_attention_fn(x.device)(q, k, v, block_mask=mask, enable_gqa=self.kv_heads != self.n_heads)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.kv_heads != self.n_heads,
        )  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


    def unfuse(self) -> None:
        """The fused ``qkv`` product as three, ``q``, ``k`` and ``v``, the same weights (tensor parallelism splits each
        by heads; the fused one's rows cannot be split so)."""
        if self.qkv is not None:
            kv = self.kv_heads * self.head_dim
            _replace(self, "qkv", dict(zip(("q", "k", "v"), _split_linear(self.qkv, [self.n_heads * self.head_dim, kv, kv]), strict=True)))


def _replace(parent: nn.Module, name: str, parts: dict[str, nn.Module]) -> None:
    """``parent``'s submodule ``name`` replaced by ``parts`` in its place (the parameters' order, which optimizer
    states saved by position follow, stays the fused layout's), ``name`` left as None."""
    items = list(parent._modules.items())
    parent._modules.clear()
    for key, module in items:
        if key == name:
            parent._modules.update(parts)
            parent._modules[name] = None
        else:
            parent._modules[key] = module


def _split_linear(layer: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """``layer`` as one linear layer per block of ``sizes`` of its output features, holding its rows (and bias)."""
    out = []
    biases = layer.bias.split(sizes) if layer.bias is not None else [None] * len(sizes)
    for w, b in zip(layer.weight.split(sizes), biases, strict=True):
        part = nn.Linear(layer.in_features, w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            part.weight.copy_(w)
            if b is not None:
                part.bias.copy_(b)
        out.append(part)
    return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.family == "llama"
        if self.swiglu:
            self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden_dim, bias=False)
            self.down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)
        else:
            self.up = nn.Linear(cfg.d_model, cfg.hidden_dim, bias=True)
            self.down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=True)
        self.down.residual_out = True
        self.act = cfg.act
        # module.fp8_fused_mlp: lmtrain.nn.float8_mlp.float8_mlp, computing up (or gate_up), the activation and down
        # in float8 as one function (set by lmtrain.training.fp8.convert: that module imports this one)
        self.float8, self.float8_fast_accum = None, False

    @property
    def first(self) -> nn.Linear:
        """The product before the activation: ``gate_up`` (SwiGLU) or ``up``."""
        return self.gate_up if self.swiglu else self.up

    def unfuse(self) -> None:
        """SwiGLU's fused ``gate_up`` as ``gate`` and ``up`` (tensor parallelism splits each by its features)."""
        if self.swiglu and self.gate_up is not None:
            half = self.gate_up.out_features // 2
            _replace(self, "gate_up", dict(zip(("gate", "up"), _split_linear(self.gate_up, [half, half]), strict=True)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu and self.gate_up is None:  # unfused
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.float8 is not None:
            return self.float8(x, self.first, self.down, self.act, self.float8_fast_accum)
        return self.down(mlp_activation(self.first(x), self.act))


def mlp_activation(h: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP activation named by ``ModelConfig.act``: the opt family's (ACTIVATIONS["opt"]) on ``h``, or the llama
    family's SwiGLU ("silu") on the gate and value projections side by side, ``h = (..., 2F)``."""
    if act == "silu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.relu(h) if act == "relu" else F.gelu(h, approximate="tanh" if act == "gelu_tanh" else "none")


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The family's norm over ``dim`` features (the model's width by default): RMSNorm (llama) or LayerNorm (opt)."""
    dim = dim or cfg.d_model
    return RMSNorm(dim, cfg.norm_eps) if cfg.family == "llama" else nn.LayerNorm(dim, cfg.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); the mlp a mixture of experts in a
    ``model.moe`` model's blocks from ``dense_layers`` on."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)  # (lmtrain.nn.moe)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class LanguageModel(nn.Module):
    """What a network offers lmtrain.training.assemble, which builds and prepares it in one order: declared here, so
    that the room asks for these instead of probing for attributes. ``blocks``: the repeated layers, each converted to
    float8, checkpointed, compiled and sharded on its own; ``final_norm``: the module whose input is the last block's
    output (its RMS is a divergence signal); ``width``: the residual stream's (activation offloading moves it); :meth:`configure_head`: how the output head computes its loss;
    :meth:`head_loss`: that head and loss, compiled apart from the blocks under sharding; :meth:`init_weights`: the
    seeded initialisation, run again on shards built on the meta device; :meth:`tensor_parallel_plan` and
    :meth:`set_context_parallel`: how it splits over tensor- and context-parallel ranks. LMModule trains any
    ``(B, T) -> (B, T, V)`` network; the options of ``module.head``, ``module.z_loss``, ``module.fp8``, fsdp/hsdp, tp
    and cp need one of these."""

    blocks: nn.ModuleList

    @property
    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    @property
    def width(self) -> int:
        """The residual stream's width: the last dimension of every block's input and output."""
        raise NotImplementedError

    def configure_head(self, *, chunk_tokens: int | None = None, kernel=None, z_loss: float = 0.0, loss_scale: float = 1.0) -> None:
        """``chunk_tokens``: the loss computed that many tokens at a time (lmtrain.nn.loss); ``kernel``: a fused
        ``(hidden, weight, targets[, z_loss]) -> loss`` function (lmtrain.training.kernels); ``z_loss``: the coefficient
        of the log-partition penalty (lmtrain.nn.loss.with_z_loss); ``loss_scale``: the factor the trainer applies to the
        returned loss before its backward pass (1 over the micro-batches a step accumulates), which losses added inside
        the blocks (a mixture of experts' balancing losses, lmtrain.nn.moe) take too. Called once, before compiling."""
        raise NotImplementedError

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def init_weights(self) -> None:
        raise NotImplementedError

    def tensor_parallel_plan(self, tp: int) -> dict:
        """Prepare this network to be split over ``tp`` ranks and return the plan for
        ``torch.distributed.tensor.parallel.parallelize_module``: a style per module name. Raises ValueError naming
        what ``tp`` does not divide."""
        raise NotImplementedError

    def set_context_parallel(self, cp) -> None:
        """Compute each sequence's loss split over ``cp``'s group (lmtrain.nn.context.ContextParallel), each rank its
        own tokens."""
        raise NotImplementedError


class Decoder(LanguageModel):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, cfg: ModelConfig | None = None, **fields) -> None:
        super().__init__()
        if cfg is None:
            cfg = ModelConfig(**fields)
        elif fields:
            cfg = dataclasses.replace(cfg, **fields)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "opt" else None
        self.proj_in = nn.Linear(cfg.emb_dim, cfg.d_model, bias=False) if cfg.emb_dim != cfg.d_model else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.proj_out = nn.Linear(cfg.d_model, cfg.emb_dim, bias=False) if cfg.emb_dim != cfg.d_model else None
        self.lm_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        self.loss_chunk_tokens: int | None = None  # how the loss is computed, not the architecture: see head_loss
        self.loss_kernel = None  # a fused (hidden, weight, targets) -> loss function given from outside; see head_loss
        self.loss_float8 = False  # the chunked head's products in float8 (and their backward ones in fast mode): see head_loss
        self.loss_float8_fast_accum = False
        self.z_loss = 0.0  # module.z_loss: the coefficient of the log-partition penalty in every head (lmtrain.nn.loss.with_z_loss)
        self.flex_attention: bool | None = None  # the document mask's kernel: see document_attention_mask
        self.context_parallel: ContextParallel | None = None  # strategy.cp: see set_context_parallel
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.family == "llama":
            cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, self.tok_emb.weight.device, cfg.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights()

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    @property
    def width(self) -> int:
        return self.cfg.d_model

    def configure_head(self, *, chunk_tokens: int | None = None, kernel=None, z_loss: float = 0.0, loss_scale: float = 1.0) -> None:
        self.loss_chunk_tokens, self.loss_kernel, self.z_loss = chunk_tokens, kernel, float(z_loss)
        for block in self.blocks:
            if isinstance(block.mlp, MoE):  # its losses join the objective as the trainer scales it (lmtrain.nn.moe)
                block.mlp.loss_scale = float(loss_scale)

    def tensor_parallel_plan(self, tp: int) -> dict:
        """Megatron's split with sequence parallelism (torchtitan's plan): in each block the query, key and value
        products (and the MLP's first ones) split by output features, each rank computing its own heads, and the
        attention's and the MLP's output products by input features, their partial sums reduce-scattered over the
        sequence; between the products the residual stream and the norms are split by sequence, gathered whole
        before each branch. The embedding and the output head are split by vocabulary (lmtrain.nn.parallel), the
        loss computed on the split logits; positional embeddings and the projections around a factorised embedding
        whole on every rank. The fused ``qkv`` and ``gate_up`` are unfused first (their rows hold the heads in an
        order no even split keeps)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

        from lmtrain.nn.parallel import Replicated, VocabColumns, VocabRows

        c = self.cfg
        if undivided := c.undivided_by(tp):
            raise ValueError(f"tensor parallel over {tp} ranks splits heads and MLP features: it does not divide {undivided}")
        shared: dict = {}  # a tied embedding and head: one parameter
        seq = Shard(1)  # the residual stream between the branches: each rank its part of every sequence
        plan = {"lm_head": VocabColumns(shared), "tok_emb": VocabRows(shared), "norm": Replicated(seq, shared)}
        plan |= {n: Replicated(shared=shared) for n in ("pos_emb", "proj_in") if getattr(self, n) is not None}
        if self.proj_out is not None:
            plan["proj_out"] = Replicated(seq, shared)
        whole, split = (Replicate(), None, None), (seq, None, None)
        plan["blocks.0"] = PrepareModuleInput(input_layouts=whole, desired_input_layouts=split, use_local_output=True)
        for i, block in enumerate(self.blocks):
            at = f"blocks.{i}."
            block.attn.unfuse()
            block.mlp.unfuse()
            plan |= {at + "attn_norm": Replicated(seq, shared), at + "mlp_norm": Replicated(seq, shared)}
            plan[at + "attn"] = PrepareModuleInput(input_layouts=split, desired_input_layouts=whole, use_local_output=True)
            plan |= {at + f"attn.{n}": ColwiseParallel() for n in ("q", "k", "v")} | {at + "attn.proj": RowwiseParallel(output_layouts=seq)}
            if c.qk_norm:  # over each of this rank's heads (B, H / tp, T, hd): their weights' gradients summed over the ranks
                plan |= {at + f"attn.{n}": Replicated(Shard(1), shared) for n in ("q_norm", "k_norm")}
            plan[at + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
            plan |= {at + f"mlp.{n}": ColwiseParallel() for n in (("gate", "up") if block.mlp.swiglu else ("up",))}
            plan |= {at + "mlp.down": RowwiseParallel(output_layouts=seq)}
            block.attn.n_heads, block.attn.kv_heads = c.n_heads // tp, c.kv_heads // tp  # this rank's
        return plan

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer: call after materialising a meta-device model.

        GPT-2's scheme (N(0, ``init_std``), the residual outputs scaled by 1/sqrt(2 x layers)), but the token embeddings
        of a llama-family model with its own output head: N(0, 1), as Meta's Llama and torchtitan initialise them
        (every block reads them through an RMSNorm, so their scale sets how much of the residual stream the tokens
        themselves are at the start, not the size of anything computed). At 0.02 a 16-layer Llama's blocks drown the
        tokens: on one H100 (docs/benchmarks/2026-12-07.md) the Llama 3.2 1B body with a 128,256-token head reached a
        loss of 6.128 after 491,520 tokens, and 5.029 with this alone (torchtitan 0.2.2 on the same samples: 5.190);
        at 125M, 5.046 against 5.069; a model of a few layers (tiny-llama) starts slower with it and sets
        ``embed_init_std: 0.02``. A tied embedding is the output head too and keeps ``init_std``."""
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        token_std = self.cfg.embed_init_std
        if token_std is None:
            token_std = 1.0 if self.cfg.family == "llama" and not self.cfg.tie_embeddings else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, resid_std if getattr(module, "residual_out", False) else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, token_std if module is self.tok_emb else std)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                module.reset_parameters()
            elif isinstance(module, MoE):
                module.reset_parameters(std, resid_std)
        if self.cfg.family == "llama":
            cos, sin = rope_cache(self.cfg.max_seq_len, self.cfg.head_dim, self.cfg.rope_theta, self.rope_cos.device, self.cfg.rope_scaling)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def document_attention_mask(self, doc: torch.Tensor) -> torch.Tensor | BlockMask:
        """The mask that keeps attention inside each document, for the kernel that computes it: FlexAttention's block
        mask on a GPU (its kernel skips the blocks that cross documents), SDPA's dense boolean mask on the CPU and
        under attention dropout (which FlexAttention lacks). ``flex_attention`` (True/False) overrides the choice."""
        flex = self.flex_attention
        if flex is None:
            flex = doc.is_cuda and not (self.training and self.cfg.attention_dropout > 0)
        elif flex and self.training and self.cfg.attention_dropout > 0:
            raise ValueError(
                f"FlexAttention has no attention dropout: model.attention_dropout={self.cfg.attention_dropout} needs the SDPA mask"
            )
        return document_block_mask(doc) if flex else document_mask(doc)

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Split every training and validation forward pass that computes a loss over ``cp``'s group
        (lmtrain.nn.context): each rank embeds, runs the blocks on and scores its own tokens, attention gathering the
        whole sequence's keys and values; its loss is the mean over its tokens, every rank's the same number of them,
        so the group's mean is the sequence's. Logits without targets (evaluations, generation) are computed whole."""
        self.context_parallel = cp

    def hidden_states(self, idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Final normalised hidden state before the output head, (B, T, emb_dim). ``doc`` (B, T): each token's document
        within its sequence (:func:`document_ids`); given, attention stays inside each document and positions restart
        at each document's first token, so a packed sequence computes what its documents compute alone."""
        T = idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        positions = torch.arange(T, device=idx.device) if doc is None else document_positions(doc)  # (T,) or (B, T)
        mask = None if doc is None else self.document_attention_mask(doc)
        return self._run(idx, positions, mask)

    def _split_hidden_states(self, idx: torch.Tensor, doc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Under context parallel: this rank's tokens' final hidden states and their positions in the sequence
        (:meth:`set_context_parallel`); the mask is causal by those positions and, with ``doc``, keeps each document."""
        cp, T = self.context_parallel, idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        mine, keys = cp.index(T, idx.device), cp.key_index(T, idx.device)
        allowed = keys.unsqueeze(0) <= mine.unsqueeze(1)  # (T / cp, T): causal by position in the sequence
        if doc is None:
            positions, mask = mine, allowed[None, None]
        else:
            positions = document_positions(doc)[:, mine]
            mask = (allowed & (doc[:, keys].unsqueeze(1) == doc[:, mine].unsqueeze(2))).unsqueeze(1)
        return self._run(idx[:, mine], positions, ContextSplit(cp, mask)), mine

    def _run(self, idx: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        """Embeddings, blocks, final norm for tokens ``idx`` at ``positions`` ((T,) or (B, T)) under ``mask``."""
        T = idx.shape[1]
        x = self.tok_emb(idx)  # (B, T, E)
        if self.proj_in is not None:
            x = self.proj_in(x)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        rope = None
        if self.cfg.family == "llama":
            if positions.dim() == 1:  # one set of positions for every sequence: the cache's rows (a slice when in order)
                in_order = not isinstance(mask, ContextSplit)
                rope = (self.rope_cos[:T], self.rope_sin[:T]) if in_order else (self.rope_cos[positions], self.rope_sin[positions])
            else:
                rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        for block in self.blocks:
            x = block(x, rope, mask)
        x = self.norm(x)
        if self.proj_out is not None:
            x = self.proj_out(x)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits (B, T, V); with ``targets`` (B, T), the mean cross-entropy loss instead; ``doc``: see
        :meth:`hidden_states`."""
        if targets is not None and self.context_parallel is not None:
            hidden, mine = self._split_hidden_states(idx, doc)
            return self.head_loss(hidden, targets[:, mine])
        if targets is None and isinstance(self.lm_head.weight, DTensor):  # tensor parallel: sequences split in equal parts
            pad = -idx.shape[1] % self.lm_head.weight.device_mesh.size()
            if pad:  # tokens after the last, which causal attention keeps from the others; a document of their own
                idx = F.pad(idx, (0, pad))
                doc = None if doc is None else torch.cat([doc, (doc[:, -1:] + 1).expand(-1, pad)], dim=1)
                return self.forward(idx, None, doc)[:, :-pad]
        hidden = self.hidden_states(idx, doc)
        if targets is None:
            logits = self.lm_head(hidden)  # (B, T, V)
            return logits.full_tensor() if isinstance(logits, DTensor) else logits  # split by vocabulary under tp
        return self.head_loss(hidden, targets)

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Output head and mean cross-entropy, logits upcast to fp32. A method of its own so that a sharded
        strategy can compile it (its blocks are compiled one by one): compiled, the upcast, log-softmax and their
        backward are fused instead of materialising (B, T, V) fp32 tensors. With ``loss_chunk_tokens`` set
        (``module.loss_chunk_tokens``), computed that many tokens at a time (lmtrain.nn.loss), its products in float8 with
        ``loss_float8``; with ``loss_kernel`` set to a
        function (``module.loss_kernel``: lmtrain.training.kernels), by that fused kernel. With ``z_loss`` set, each
        returns :func:`lmtrain.nn.loss.with_z_loss`'s (objective, cross-entropy, z) instead of the mean. Under tensor
        parallel (:meth:`tensor_parallel_plan`) the head is split by vocabulary and so is the loss, chunked or whole."""
        if isinstance(self.lm_head.weight, DTensor):
            from lmtrain.nn.parallel import chunked_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy

            if self.loss_chunk_tokens:
                return chunked_vocab_parallel_cross_entropy(hidden, self.lm_head.weight, targets, self.loss_chunk_tokens, self.z_loss)
            return vocab_parallel_cross_entropy(self.lm_head(hidden), targets, self.z_loss)
        if self.loss_kernel is not None:
            if self.z_loss:
                return self.loss_kernel(hidden.flatten(0, 1), self.lm_head.weight, targets.flatten(), z_loss=self.z_loss)
            return self.loss_kernel(hidden.flatten(0, 1), self.lm_head.weight, targets.flatten())
        if self.loss_chunk_tokens:
            return chunked_linear_cross_entropy(
                hidden.flatten(0, 1),
                self.lm_head.weight,
                targets.flatten(),
                self.loss_chunk_tokens,
                float8=self.loss_float8,
                fast_accum=self.loss_float8_fast_accum,
                z_loss=self.z_loss,
            )
        return cross_entropy(self.lm_head(hidden), targets, self.z_loss)


def fused_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with tensor parallelism's split products (``attn.q``, ``k``, ``v``; SwiGLU's ``mlp.gate``, ``up``:
    :meth:`Decoder.tensor_parallel_plan`) as the fused ones of every other layout (``attn.qkv``, ``mlp.gate_up``),
    whole tensors; any other state is returned as it is."""
    out = dict(state)
    for key in [k for k in state if k.endswith(".attn.q.weight")]:
        at = key.removesuffix("q.weight")
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{at}{n}.{kind}", None) for n in ("q", "k", "v")]
            if parts[0] is not None:
                out[f"{at}qkv.{kind}"] = torch.cat(parts)
    for key in [k for k in state if k.endswith(".mlp.gate.weight")]:
        at = key.removesuffix("gate.weight")
        out[f"{at}gate_up.weight"] = torch.cat([out.pop(f"{at}gate.weight"), out.pop(f"{at}up.weight")])
    return out


def split_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The reverse of :func:`fused_state`: ``attn.qkv`` as ``attn.q``, ``k``, ``v`` and SwiGLU's ``mlp.gate_up`` as
    ``mlp.gate``, ``up`` (the layout of a model split by :meth:`Decoder.tensor_parallel_plan`), whole tensors."""
    out = dict(state)
    kv = cfg.kv_heads * cfg.head_dim
    for key in [k for k in state if k.endswith((".attn.qkv.weight", ".attn.qkv.bias"))]:
        at, kind = key.rsplit("qkv.", 1)
        for n, part in zip(("q", "k", "v"), out.pop(key).split([cfg.n_heads * cfg.head_dim, kv, kv]), strict=True):
            out[f"{at}{n}.{kind}"] = part
    for key in [k for k in state if k.endswith(".mlp.gate_up.weight")]:
        at = key.removesuffix("gate_up.weight")
        out[f"{at}gate.weight"], out[f"{at}up.weight"] = out.pop(key).chunk(2)
    return out


def relayout_names(names: list[str], split: bool) -> list[str]:
    """Parameter names in order, as :func:`split_state` (``split``) or :func:`fused_state` leaves them: the split
    products take the fused one's place."""
    out: list[str] = []
    for n in names:
        if split and n.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
            at, kind = n.rsplit("qkv.", 1)
            out += [f"{at}{x}.{kind}" for x in ("q", "k", "v")]
        elif split and n.endswith(".mlp.gate_up.weight"):
            out += [n.replace("gate_up.", "gate."), n.replace("gate_up.", "up.")]
        elif not split and n.endswith((".attn.q.weight", ".attn.q.bias")):
            out.append(n.replace(".attn.q.", ".attn.qkv."))
        elif not split and n.endswith(".mlp.gate.weight"):
            out.append(n.replace(".mlp.gate.", ".mlp.gate_up."))
        elif not split and n.endswith((".attn.k.weight", ".attn.k.bias", ".attn.v.weight", ".attn.v.bias")):
            continue  # in the fused one, at q's place
        elif not split and n.endswith(".mlp.up.weight") and n.replace(".mlp.up.", ".mlp.gate.") in names:
            continue  # SwiGLU's value half, in gate_up at gate's place (the opt family's own up stays)
        else:
            out.append(n)
    return out


# -- counting ----------------------------------------------------------------------------------
def num_params(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once); works on the meta device."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def matmul_params(model: Decoder) -> int:
    """Parameters that take part in a matmul per token: all but lookup tables, and of a mixture of experts' routed
    experts only the ``top_k`` a token is sent to (its active parameters; lmtrain.nn.moe.unused_params).

    Position embeddings are a lookup; the token embedding is a lookup unless tied to the output head.
    """
    n = num_params(model) - unused_params(model.cfg)  # a mixture of experts: the experts a token is computed by
    if model.pos_emb is not None:
        n -= model.pos_emb.weight.numel()
    if not model.cfg.tie_embeddings:
        n -= model.tok_emb.weight.numel()
    return n


def flops_per_token(model: Decoder, seq_len: int) -> float:
    """Training FLOPs per token: 6N (forward + backward matmuls) + 12 * L * d * T (attention)."""
    cfg = model.cfg
    return 6.0 * matmul_params(model) + 12.0 * cfg.n_layers * cfg.d_model * seq_len
