"""The output head's product and loss alone: compiled forward and backward of ``cross_entropy(head(x).float(), y)``
on one GPU in bf16 and in float8 (torchao tensorwise, with and without fast accumulation in the backward products),
the chunked head of ``module.loss_chunk_tokens`` in bf16 and in float8 (lmtrain.nn.loss), and liger-kernel's fused
head (``module.loss_kernel=liger``, on a GPU): the time per step, the TFLOP/s of its three products and the peak
memory. What ``module.fp8_layers=head|all`` changes, with and without ``module.loss_chunk_tokens``, without the rest
of the model (docs/BENCHMARKS.md)::

    python3 bench/fp8_head_product.py                       # d 768 x 65,536 tokens (opt-125m, batch 64) and d 2048 x 49,152 (opt-1.3b, batch 48)
    python3 bench/fp8_head_product.py --shape 4096x16384    # any d_model x tokens
    python3 bench/fp8_head_product.py --chunk 16384         # the chunked heads' tokens per chunk (default 8192)
    python3 bench/fp8_head_product.py --device cpu --shape 64x256 --vocab 512 --chunk 96 --steps 1   # eager, the numbers only (tests)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from lmtrain.nn.loss import chunked_linear_cross_entropy
from lmtrain.training.fp8 import float8_config
from lmtrain.training.kernels import liger_linear_cross_entropy

KINDS = ("bf16", "fp8", "fp8-fast", "chunked", "fp8-chunked", "fp8-chunked-fast")


def measure(d: int, tokens: int, vocab: int, kind: str, steps: int, device: str = "cuda", chunk: int = 8192) -> str:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(d, vocab, bias=False)).to(device)
    if kind in ("fp8", "fp8-fast"):
        config = float8_config("tensorwise", sharded=False, device=torch.device(device), fast_accum=kind == "fp8-fast")
        convert_to_float8_training(head, config=config)
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,), device=device)
    cuda = device == "cuda"

    def loss_of(x):
        with torch.autocast(device, torch.bfloat16):
            if kind == "liger":  # module.loss_kernel=liger: Triton, GPU only
                return liger_linear_cross_entropy(x, head[0].weight, y)
            if "chunked" in kind:  # never traced: its per-chunk step is compiled on its own on a GPU
                return chunked_linear_cross_entropy(x, head[0].weight, y, chunk, float8="fp8" in kind, fast_accum=kind.endswith("fast"))
            logits = head(x)
        return F.cross_entropy(logits.float(), y)

    if cuda:  # as training runs it; on the CPU eager, for the numbers only
        loss_of = torch.compile(loss_of)
    for _ in range(5 if cuda else 1):
        loss_of(x).backward()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = loss_of(x)
        loss.backward()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    tflops = 6 * d * vocab * tokens / ms / 1e9
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return f"d={d} tokens={tokens} vocab={vocab} {kind}: {ms:.2f} ms, {tflops:.0f} TFLOP/s, loss {loss.item():.4f}, peak {peak:.1f} GiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", help="D_MODELxTOKENS (repeatable); default 768x65536 and 2048x49152")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--chunk", type=int, default=8192, help="tokens per chunk of the chunked heads")
    p.add_argument("--kinds", help=f"comma-separated, of {','.join(KINDS)},liger (default: all; liger on a GPU only)")
    args = p.parse_args()
    print(torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    for shape in args.shape or ["768x65536", "2048x49152"]:
        d, tokens = (int(v) for v in shape.split("x"))
        for kind in args.kinds.split(",") if args.kinds else KINDS + (("liger",) if args.device == "cuda" else ()):
            print(measure(d, tokens, args.vocab, kind, args.steps, args.device, args.chunk), flush=True)


if __name__ == "__main__":
    main()
