"""Training throughput: the trainer's real code path beside a plain PyTorch loop, same model, batch and data.

    python bench/throughput.py [--steps N] [--warmup W] [HYDRA_OVERRIDES ...]
    python bench/throughput.py --steps 60 model=mini data.seq_len=256 data.batch_size=8      # the CPU quickstart shape

The trainer side is ``lmtrain.training.run.train`` with the composed config (Lightning, callbacks, CSV logging on; the
progress bar and validation off), its per-step ``perf/tokens_per_sec`` read back from the CSV log. The baseline
is a bare loop over the same ``Decoder``: forward, cross-entropy, backward, global-norm clip, AdamW step, with
its batches drawn from the same prepared dataset and moved to the device before timing starts (so it pays no
data-loading cost), timed over all steps after ``--warmup`` with no host sync inside the window. The trainer side
reports the tokens of its steps after ``--warmup`` over their total time (the harmonic mean of its per-step
tokens/s: slow steps count in full, as they do in the baseline's window); the table row gives both and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import lmtrain.training.config  # noqa: E402,F401
from lmtrain.callbacks.profiler import summarize  # noqa: E402
from lmtrain.data.datamodule import PackedBlocks  # noqa: E402
from lmtrain.errors import InputError  # noqa: E402
from lmtrain.formats.metrics import metric  # noqa: E402
from lmtrain.nn.model import num_params  # noqa: E402
from lmtrain.training.module import lm_loss  # noqa: E402
from lmtrain.training.run import train  # noqa: E402


def bench_config(cfg, steps: int, out: Path, profile: int = 0):
    """The run the bench trains: ``cfg`` (modified in place) for ``steps`` steps (plus ``profile`` profiled ones) in
    ``out/trainer``, no validation, checkpoints or progress bar, metrics to CSV. tests/test_bench_scripts.py validates
    what the bench scripts pass here, so that a config a GPU call would refuse fails in CI first. The figures come
    from the throughput callback's ``perf/tokens_per_sec``: a config without it (``callbacks=none``) is refused here,
    before anything is built."""
    targets = [str(c.get("_target_", "")) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not any(t.endswith(".Throughput") for t in targets):
        raise InputError(
            "bench/throughput.py reads perf/tokens_per_sec from callbacks.throughput, which this config leaves out "
            "(callbacks=none?): drop single callbacks instead, e.g. ~callbacks.divergence"
        )
    with open_dict(cfg):
        # profiled steps come after the timed ones, and after the two steps the profiler starts up in: they do not slow them
        cfg.trainer.max_steps = steps + 2 + profile if profile else steps
        if profile:
            cfg.callbacks["profiler"] = {
                "_target_": "lmtrain.callbacks.profiler.StepProfiler",
                "start_step": steps + 2,
                "steps": profile,
                "python": True,
            }
        cfg.run_dir = str(out / "trainer")
        cfg.trainer.val_check_interval = 10**9
        cfg.trainer.limit_val_batches = 0
        cfg.trainer.enable_progress_bar = False
        cfg.logger = {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": cfg.run_dir, "name": "csv", "version": ""}}
        for name in ("checkpoint", "disk_guard"):  # saving is measured by bench/checkpoint_stall.py
            (cfg.get("callbacks") or {}).pop(name, None)
    return cfg


def trainer_tokens_per_sec(cfg, steps: int, warmup: int, out: Path, profile: int = 0) -> tuple[list[float], list[float], list[float]]:
    train(bench_config(cfg, steps, out, profile))
    run = Path(cfg.run_dir)
    if int(os.environ.get("RANK", "0")) != 0:  # rank zero writes the log and the table
        return [], [], []
    for name in ("summary_rank0.txt", "python_rank0.txt"):
        if (run / "profile" / name).is_file():
            print(f"== trainer profile: {name}\n" + (run / "profile" / name).read_text(), flush=True)
    rates = metric(run, "perf/tokens_per_sec")[warmup:steps]
    if rates:  # the harmonic mean (total tokens over total time) is the figure; the median and extremes show uneven steps
        print(
            f"trainer per-step tokens/s over the timed steps: harmonic mean {statistics.harmonic_mean(rates):,.0f}, "
            f"median {statistics.median(rates):,.0f}, min {min(rates):,.0f}, max {max(rates):,.0f}",
            flush=True,
        )
        # each timed step's rate in thousands, in order: where the slow steps fall (a period points at its cause)
        print(f"trainer per-step tokens/s (thousands) from step {warmup}: " + " ".join(f"{r / 1e3:.0f}" for r in rates), flush=True)
    return (
        rates,
        metric(run, "perf/mfu")[warmup:steps],
        metric(run, "perf/max_memory_gib")[:steps],
    )


def raw_tokens_per_sec(cfg, steps: int, warmup: int, device: torch.device, profile: int = 0) -> list[float]:
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)().to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas), weight_decay=0.1, fused=device.type == "cuda" or None
    )
    blocks = PackedBlocks(cfg.data.path, "train", cfg.data.seq_len)
    bs = cfg.data.batch_size
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        idx = torch.randint(0, len(blocks), (bs,), generator=g).tolist()
        x, y = zip(*(blocks[i] for i in idx))
        batches.append((torch.stack(x).to(device), torch.stack(y).to(device)))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=str(cfg.trainer.precision).startswith("bf16"))
    loss_fn = torch.compile(lm_loss) if cfg.module.get("compile") else lm_loss  # as the trainer does

    def step(x, y):
        with autocast:
            loss = loss_fn(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.module.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for x, y in batches[:warmup]:
        step(x, y)
    sync()
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:  # no host sync inside the timed window, as a hand-written loop would do
        loss = step(x, y)
    loss.item()
    sync()
    rate = sum(x.numel() for x, _ in batches[warmup:]) / (time.perf_counter() - t0)
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for x, y in batches[warmup : warmup + profile]:
                step(x, y)
            sync()
            wall_us = (time.perf_counter() - t0) * 1e6
        head, table = summarize(prof, wall_us, profile, device.type == "cuda", "== raw loop profile")
        print(head + "\n" + table, flush=True)
    return [rate]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The bench's options, and the rest: the trainer's config overrides."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-raw", action="store_true", help="trainer only (multi-GPU runs: compare with raw_fsdp_baseline.py)")
    p.add_argument("--profile", type=int, default=0, help="after the timed steps, profile this many more (callbacks/profiler.py)")
    p.add_argument("--dir", default=None, help="run directory (shared by all ranks under torchrun); default: temporary")
    return p.parse_known_args(argv)


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def main() -> None:
    args, overrides = parse_args()
    os.environ.setdefault("LMTRAIN_RUN_ID", "bench")
    cfg = composed(overrides)
    with tempfile.TemporaryDirectory() as tmp:
        trained = cfg.copy()
        trainer_rates, mfus, mems = trainer_tokens_per_sec(trained, args.steps, args.warmup, Path(args.dir or tmp), args.profile)
        with open_dict(cfg):  # what the run resolved (data.batch_size=auto, module.compile=auto, the speed preset): the raw loop's and the row's
            cfg.data.batch_size, cfg.module = trained.data.batch_size, trained.module
        if int(os.environ.get("RANK", "0")) != 0:
            return
        device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.accelerator in ("auto", "gpu", "cuda") else "cpu")
        raw_rates = [float("nan")] if args.no_raw else raw_tokens_per_sec(cfg, args.steps, args.warmup, device, args.profile)
    card = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    with torch.device("meta"):
        n = num_params(instantiate(cfg.model)())
    t, r = statistics.harmonic_mean(trainer_rates), statistics.median(raw_rates)
    # per-step MFU is proportional to per-step tokens/s: the window's MFU follows the window's rate
    mfu = f"{statistics.median(mfus) * t / statistics.median(trainer_rates):.1%}" if mfus else "n/a"
    mem = f"{max(mems):.1f}" if mems else "n/a"
    ws = lmtrain.training.config.world_size(cfg)
    strategy = str(cfg.strategy.get("_target_", "")).rsplit(".", 1)[-1] if cfg.get("strategy") else "auto"
    if strategy == "named":
        strategy = str(cfg.strategy.name)
    print(
        "| device | processes | strategy | model | params | precision | speed | fp8 | head | compile | attention | doc mask | batch x seq (per device) | steps (timed) "
        "| trainer tokens/s | per device | raw PyTorch tokens/s | ratio | trainer MFU | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {card} | {ws} | {strategy} | {cfg.model.name} | {n / 1e6:.2f}M | {cfg.trainer.precision} | {cfg.get('speed', 'default')} | "
        f"{cfg.module.fp8.recipe or '-'} | {cfg.module.head.kind} | {bool(cfg.module.get('compile'))} | {cfg.module.get('sdpa_backend') or 'default'} | "
        f"{'on' if cfg.data.get('document_mask') else '-'} | {cfg.data.batch_size} x {cfg.data.seq_len} | {args.steps} ({len(trainer_rates)}) | {t:,.0f} | {t / ws:,.0f} | {r:,.0f} | {t / r:.3f} | "
        f"{mfu} | {mem} |"
    )


if __name__ == "__main__":
    main()
