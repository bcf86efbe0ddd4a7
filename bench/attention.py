"""Causal attention kernels side by side: forward + backward time of ``scaled_dot_product_attention`` per backend.

    python bench/attention.py [--batch 16 --heads 12 --seq 1024 --head-dim 64] [--backends flash cudnn efficient]

For each backend PyTorch can run on this device: the median time of forward + backward (CUDA events, 50 repeats
after 10 warm-ups, three input sets rotated), the achieved TFLOP/s (causal: half of 4*B*H*T*T*d forward, 2.5x that
for forward + backward), and the relative error of the output and of dq against fp32 math on the same inputs.
One table row per backend. Chooses ``module.sdpa_backend``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    a = p.parse_args()
    dev = torch.device("cuda")
    shape = (a.batch, a.heads, a.seq, a.head_dim)
    g = torch.Generator(device=dev).manual_seed(0)
    sets = [[torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True) for _ in range(3)] for _ in range(3)]
    dout = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    q, k, v = (t.detach().float().requires_grad_() for t in sets[0])
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref.backward(dout.float())
    ref_dq = q.grad
    flops = 2.5 * 4 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, B={a.batch} H={a.heads} T={a.seq} d={a.head_dim}")
    print("| backend | fwd+bwd ms (median) | TFLOP/s | rel err out | rel err dq |")
    print("|---|---|---|---|---|")
    for name in a.backends:
        try:
            with sdpa_kernel(BACKENDS[name]):
                for t in sets[0]:
                    t.grad = None
                out = F.scaled_dot_product_attention(*sets[0], is_causal=True)
                out.backward(dout)
                err_out, err_dq = rel(out, ref), rel(sets[0][0].grad, ref_dq)
                times = []
                for i in range(60):
                    qkv = sets[i % 3]
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    F.scaled_dot_product_attention(*qkv, is_causal=True).backward(dout)
                    end.record()
                    end.synchronize()
                    if i >= 10:
                        times.append(start.elapsed_time(end))
        except RuntimeError as exc:
            print(f"| {name} | not available: {str(exc).splitlines()[0][:80]} | | | |")
            continue
        ms = statistics.median(times)
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err_out:.1e} | {err_dq:.1e} |")


if __name__ == "__main__":
    main()
