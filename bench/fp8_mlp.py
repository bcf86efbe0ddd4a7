"""The MLP half of an OPT block alone, ``x + fc2(gelu_tanh(fc1(layer_norm(x))))`` (with ``--act silu`` a Llama
block's, ``x + fc2(swiglu(fc1(rms_norm(x))))``, ``fc1`` the gate and value projections stacked), stacked and compiled,
forward and backward: bf16 against float8 (torchao tensorwise with fast accumulation, as ``module.fp8=tensorwise
module.fp8_fast_accum=true``) and against our fused float8 MLP (``fp8-fused``, as ``module.fp8_fused_mlp=true``:
lmtrain.nn.float8_mlp), under Inductor settings given on the command line. Prints the time per block and, on
a GPU, the kernels by device time per block: how much of an FP8 step is casts, amax reductions and the activation
around the float8 products, and whether a compiler setting shortens them (docs/BENCHMARKS.md)::

    python3 bench/fp8_mlp.py                                      # d 2048, 49,152 tokens (opt-1.3b, batch 48), 2 blocks, bf16, fp8 and fp8-fused
    python3 bench/fp8_mlp.py --d 4096 --ffn 11008 --act silu --tokens 8192   # llama-7b's MLP at batch 2 x 4096
    python3 bench/fp8_mlp.py --kinds fp8 --inductor triton.max_tiles=3
    python3 bench/fp8_mlp.py --kinds fp8 --inductor coordinate_descent_tuning=true
    python3 bench/fp8_mlp.py --device cpu --d 64 --tokens 256 --blocks 2 --steps 1   # eager, the numbers only (tests)
    python3 bench/fp8_mlp.py --passes --act gelu                  # the fused MLP's activation passes alone, Triton against compiled PyTorch

Each ``--inductor KEY=VALUE`` sets ``torch._inductor.config.KEY`` (true/false, integers, else text) before anything
compiles. Run one setting per process: Inductor reads its settings when it compiles.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from trace_gaps import kernel_table  # this script's folder, bench/, is first on the path

from lmtrain.nn.float8_mlp import ACTS, float8_mlp
from lmtrain.nn.model import mlp_activation
from lmtrain.training.fp8 import float8_config

KINDS = ("bf16", "fp8", "fp8-fused")


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int, act: str):
        super().__init__()
        glu = act == "silu"
        self.ln = nn.RMSNorm(d) if glu else nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * ffn if glu else ffn, bias=not glu), nn.Linear(ffn, d, bias=not glu)
        self.act, self.fused = act, False

    def forward(self, x):
        if self.fused:
            return x + float8_mlp(self.ln(x), self.fc1, self.fc2, self.act, fast_accum=True)
        return x + self.fc2(mlp_activation(self.fc1(self.ln(x)), self.act))


def inductor_setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--inductor {text!r}: expected KEY=VALUE")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


def apply(settings: list[tuple[str, object]]) -> None:
    import torch._inductor.config as config

    for key, value in settings:
        *path, name = key.split(".")
        node = config
        for part in path:
            node = getattr(node, part, None)
        if node is None or not hasattr(node, name):
            raise SystemExit(f"--inductor {key}: torch._inductor.config has no such setting")
        setattr(node, name, value)


def measure(kind: str, d: int, ffn: int, act: str, tokens: int, blocks: int, steps: int, device: str, top: int) -> str:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(d, ffn, act) for _ in range(blocks)]).to(device)
    if kind == "fp8-fused":
        from lmtrain.training.kernels import register_float8_mlp_passes

        register_float8_mlp_passes()  # its Triton passes on a GPU, as module.fp8_fused_mlp has them
    if kind == "fp8":
        convert_to_float8_training(model, config=float8_config("tensorwise", sharded=False, device=torch.device(device), fast_accum=True))
    for block in model if kind == "fp8-fused" else ():
        block.fused = True
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    grad = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    cuda = device == "cuda"

    def forward():
        x.grad = None  # each step's gradients alone, as training zeroes them
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.bfloat16):
            return model(x)

    if cuda:  # as training runs it; on the CPU eager, for the numbers only
        forward = torch.compile(forward)
    start = time.perf_counter()
    for _ in range(3 if cuda else 1):
        forward().backward(grad)
    if cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        out = forward()
        out.backward(grad)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    line = (
        f"{kind}: {ms / blocks:.3f} ms per block (forward and backward, {blocks} blocks, d {d}, ffn {ffn} {act}, {tokens:,} tokens), "
        f"warm-up (compiling) {compile_s:.0f} s, output norm {float(out.detach().float().norm()):.4f}, x grad norm {float(x.grad.float().norm()):.4f}"
    )
    if not cuda or top <= 0:
        return line
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            forward().backward(grad)
        torch.cuda.synchronize()
    kernels = [{"name": e.name, "dur": e.device_time} for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return "\n".join([line, *kernel_table(kernels, top, 3 * blocks, "block")])


def passes(ffn: int, tokens: int, act: str, steps: int) -> None:
    """lmtrain.nn.float8_mlp's activation passes on a (tokens, ffn) bf16 tensor ((tokens, 2 ffn) for SwiGLU), forward
    (activation to e4m3) and backward (gradient to e5m2 in both layouts, with the bias gradient, and the activation
    again, transposed): its Triton kernels against its PyTorch passes compiled, the time and the share of values that
    differ."""
    from lmtrain.nn import float8_mlp as fm
    from lmtrain.training.kernels import act_float8_triton, register_float8_mlp_passes

    if not register_float8_mlp_passes():
        raise SystemExit("--passes needs Triton (a GPU machine)")
    torch.manual_seed(0)
    width = 2 * ffn if act == "silu" else ffn  # h's
    h = torch.randn(tokens, width, device="cuda").bfloat16()
    dy = (torch.randn(tokens, ffn, device="cuda") * 1e-3).bfloat16()
    scale = fm.act_float8_reference(h, act)[1]
    forward, backward = torch.compile(fm.act_float8_reference), torch.compile(fm.act_grad_float8_reference)
    cases = [
        ("forward", lambda: forward(h, act), lambda: act_float8_triton(h, None, act)),
        ("backward", lambda: backward(h, dy, act, scale), lambda: act_float8_triton(h, dy, act, scale)),
    ]
    for name, reference, ours in cases:
        differ = (ours()[0].float() != reference()[0].float()).float().mean().item()
        times = []
        for fn in (reference, ours):
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / steps)
        # both passes read h (and dy); the second writes the activation in float8 (forward), or the gradient in both
        # layouts and the activation transposed (backward)
        moved = 2 * 2 * h.numel() + dy.numel() if name == "forward" else 2 * 2 * (h.numel() + dy.numel()) + 2 * h.numel() + dy.numel()
        print(
            f"{act} {name} ({tokens:,} x {width:,}): compiled PyTorch {times[0]:.3f} ms, "
            f"Triton {times[1]:.3f} ms ({moved / times[1] / 1e9:.2f} TB/s over {moved / 1e9:.2f} GB), values differing {differ:.1e}",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--ffn", type=int, help="the MLP's hidden width (default 4 d)")
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=18, help="kernels listed per kind (GPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--inductor", type=inductor_setting, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--passes", action="store_true", help="time the fused MLP's activation passes alone (GPU)")
    p.add_argument("--act", choices=ACTS, default="gelu_tanh", help="the MLP's activation (silu: SwiGLU, as Llama's)")
    a = p.parse_args()
    apply(a.inductor)
    settings = " ".join(f"{k}={v}" for k, v in a.inductor) or "default"
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, Inductor settings: {settings}", flush=True)
    ffn = a.ffn or 4 * a.d
    if a.passes:
        passes(ffn, a.tokens, a.act, a.steps)
        return
    for kind in a.kinds:
        print(measure(kind, a.d, ffn, a.act, a.tokens, a.blocks, a.steps, a.device, a.top), flush=True)


if __name__ == "__main__":
    main()
