"""The module's two speed nodes, read and checked here and nowhere else: ``module.head`` (how the output head and its
loss are computed) and ``module.fp8`` (float8 matmuls in the transformer blocks).

    module.head.kind=plain      the whole batch's logits at once (compiled, fused with the loss: the default)
    module.head.kind=chunked    ``module.head.chunk_tokens`` tokens at a time (lmtrain.nn.loss): the batch's logits and
                                their gradient are never held whole (3.3 GB in bf16 per 32k tokens of a 50k vocabulary)
    module.head.kind=liger      liger-kernel's fused linear cross-entropy (Triton, GPU; requirements-gpu.txt)
    module.head.kind=float8     chunked, the chunk's three products in float8 with one scale per tensor
                                (``torch._scaled_mm``: float8 tensor cores on Ada and Hopper, emulated on the CPU)

    module.fp8.recipe=tensorwise | rowwise   the blocks' linear layers in float8 (torchao; lmtrain.training.fp8);
                                             null: in the training precision
    module.fp8.fast_accum=true  every float8 product (the blocks' and a float8 head's) accumulates in Hopper's fast
                                mode; torchao's recipes do so for the forward product only (faster, less exact)
    module.fp8.fused_mlp=true   (tensorwise) each block's MLP as one float8 function with Triton casts
                                (lmtrain.nn.float8_mlp); the same numbers as torchao's two layers

:func:`problems` is the one place their rules live: validate_config asks it for the composed config, LMModule for
the arguments it was built with. Keys these nodes replaced are in :data:`REPLACED`, and each is refused with one line
naming what replaced it (:func:`replaced`). What each choice measured: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

HEADS = ("plain", "chunked", "liger", "float8")
RECIPES = ("tensorwise", "rowwise")

# A key that no longer exists, and what took its place.
REPLACED = {
    "module.loss_chunk_tokens": "module.head.kind=chunked module.head.chunk_tokens=N",
    "module.loss_kernel": "module.head.kind=liger",
    "module.fp8_fast_accum": "module.fp8.fast_accum",
    "module.fp8_fused_mlp": "module.fp8.fused_mlp",
    "module.fp8_layers": "module.head.kind=float8 for a float8 output head (the head alone: with module.fp8.recipe=null)",
    "strategy.compile": "module.compile (under fsdp/hsdp it compiles each block, and the head with the loss)",
}


def replaced(key: str) -> str | None:
    """The line refusing ``key`` when a newer key replaced it, else None."""
    if key in REPLACED:
        return f"{key} was replaced: use {REPLACED[key]}"
    return None


@dataclasses.dataclass(frozen=True)
class Head:
    """``module.head``: how the output head and its loss are computed."""

    kind: str = "plain"
    chunk_tokens: int = 8192  # chunked and float8: tokens per chunk

    @property
    def chunk(self) -> int | None:
        """Tokens per chunk, or None for a head that takes the batch at once."""
        return self.chunk_tokens if self.kind in ("chunked", "float8") else None


@dataclasses.dataclass(frozen=True)
class Float8:
    """``module.fp8``: float8 matmuls in the transformer blocks, and how every float8 product accumulates."""

    recipe: str | None = None
    fast_accum: bool = False
    fused_mlp: bool = False


def uses_float8(head: Head, fp8: Float8) -> bool:
    """Whether any product is in float8: the blocks' (a recipe) or the output head's."""
    return fp8.recipe is not None or head.kind == "float8"


def _read(cls, node: Any, path: str) -> tuple[Any, list[str]]:
    """``cls`` from a config node (a mapping, an instance or None: the defaults), with one line per unknown key or a
    scalar given where the node belongs."""
    if node is None:
        return cls(), []
    if isinstance(node, cls):
        return node, []
    fields = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(node, Mapping):
        first = fields[0]
        return cls(), [f"{path}={node!r}: {path} is a node now, give {path}.{first}={node} (its keys: {fields})"]
    out, problems = {}, []
    for key, value in node.items():
        if key in fields:
            out[key] = value
        else:
            close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            hint = f" (did you mean '{path}.{close[0]}'?)" if close else ""
            problems.append(f"unknown key '{path}.{key}'{hint}; allowed: {fields}")
    return cls(**out), problems


def read(head: Any, fp8: Any) -> tuple[Head, Float8, list[str]]:
    """The two nodes as given (a config mapping, an instance or None), with what is wrong in their form."""
    h, problems = _read(Head, head, "module.head")
    f, more = _read(Float8, fp8, "module.fp8")
    return h, f, problems + more


def _linear_dims(model_cfg, blocks: bool, head: bool) -> dict[str, int]:
    """The in/out sizes of the products in float8, named for messages."""
    dims = {}
    if blocks:
        dims = {"model.d_model": model_cfg.d_model, "model.ffn_dim": model_cfg.hidden_dim}
        dims["qkv width (n_heads + 2 x n_kv_heads) x head size"] = (model_cfg.n_heads + 2 * model_cfg.kv_heads) * model_cfg.head_dim
    if head:
        dims |= {"model.vocab_size": model_cfg.vocab_size, "the head's input width (model.emb_dim or d_model)": model_cfg.emb_dim}
    return dims


def problems(head: Head, fp8: Float8, *, model_cfg=None, precision: str = "bf16-mixed", device: str | None = None) -> list[str]:
    """Everything in ``module.head`` and ``module.fp8`` that cannot run (empty when all can): values, the two nodes
    together, the training precision, the model's sizes (``model_cfg``, a ModelConfig) and, with ``device``
    (``cpu`` or ``cuda``), what needs a GPU. What needs this machine's GPU or libraries is check_machine's."""
    out = []
    if head.kind not in HEADS:
        out.append(f"module.head.kind={head.kind!r} is not one of {list(HEADS)}")
    if not isinstance(head.chunk_tokens, int) or isinstance(head.chunk_tokens, bool) or head.chunk_tokens < 1:
        out.append(f"module.head.chunk_tokens={head.chunk_tokens!r}: give a positive number of tokens")
    for key in ("fast_accum", "fused_mlp"):
        if not isinstance(getattr(fp8, key), bool):
            out.append(f"module.fp8.{key}={getattr(fp8, key)!r} must be true or false")
    if fp8.recipe is not None and fp8.recipe not in RECIPES:
        out.append(f"module.fp8.recipe={fp8.recipe!r} is not one of {list(RECIPES)} or null")
    if out:
        return out
    float8_head = head.kind == "float8"
    if not uses_float8(head, fp8) and fp8.fast_accum:
        out.append(
            "module.fp8.fast_accum=true changes the float8 products, and there are none (module.fp8.recipe=null and "
            "module.head.kind is not float8): set module.fp8.recipe=tensorwise or module.head.kind=float8"
        )
    if fp8.fused_mlp and fp8.recipe != "tensorwise":
        out.append(f"module.fp8.fused_mlp=true scales per tensor: it needs module.fp8.recipe=tensorwise, not {fp8.recipe}")
    if uses_float8(head, fp8) and precision.startswith("16"):
        what = f"module.fp8.recipe={fp8.recipe}" if fp8.recipe else "module.head.kind=float8"
        out.append(f"{what} with trainer.precision={precision}: float8 scales from bf16 or fp32; use bf16-mixed")
    if head.kind == "liger" and device == "cpu":
        out.append("module.head.kind=liger runs Triton kernels on a GPU; on the CPU use module.head.kind=chunked")
    if model_cfg is not None and uses_float8(head, fp8):
        bad = [f"{k}={v}" for k, v in _linear_dims(model_cfg, fp8.recipe is not None, float8_head).items() if v % 16]
        if bad:
            out.append(f"float8 matmuls need sizes divisible by 16, not {', '.join(bad)}")
    if fp8.recipe is not None:
        from lmtrain.training.fp8 import torchao_missing

        missing = torchao_missing()
        if missing:
            out.append(missing)
    return out


def describe(head: Head, fp8: Float8) -> list[str]:
    """What the two nodes turn on, for the start line (empty: plain head, no float8)."""
    on = []
    fast = " with fast accumulation" if fp8.fast_accum else ""
    if fp8.recipe:
        on.append(f"float8 {fp8.recipe}{fast} in the blocks" + (", the fused float8 MLP" if fp8.fused_mlp else ""))
    if head.kind == "float8":
        on.append(f"the output head in float8{'' if fp8.recipe else fast}, chunked ({head.chunk_tokens} tokens)")
    elif head.kind == "chunked":
        on.append(f"the output head chunked ({head.chunk_tokens} tokens)")
    elif head.kind == "liger":
        on.append("the liger output head")
    return on
