"""The modern recipe on a GPU (issue 46's evidence): stability with and without QK-norm and z-loss, Muon against AdamW,
and a WSD cooldown started by ``lmtrain control`` against the same decay configured.

    python3 bench/recipe.py --out DIR --tokenizer FILE.tiktoken PART [PART ...]

PART is one of:

* ``stability``: the opt-125m shape with plain AdamW at rising peak rates (``--lrs``, ``--stability-steps`` steps,
  ``--stability-warmup``), stopping at the first rate the divergence detector acts on (a rollback or a stop in the
  logbook); then the same rate with ``model.qk_norm=true module.z_loss=1e-4`` (``--stability-pairs``: both at
  every rate; ``--stability-arms`` adds QK-norm or z-loss alone; ``--jobs N``: N runs at once on the card, for the losses, not the speed). ``--stability-overrides``
  replaces or adds Hydra overrides of both runs (a schedule, the weight decay). After each run, the largest attention
  logit of each layer (q.k / sqrt(head_dim) over the causal positions of the first validation blocks) at every
  checkpoint it kept.
* ``muon``: ``optimizer=adamw`` and ``optimizer=muon`` at each of ``--muon-lrs``, ``--muon-steps`` steps each at
  equal tokens (the same data, batch and schedule).
* ``wsd``: ``scheduler=wsd`` whose decay an operator starts (``lmtrain control RUN decay --steps N``, issued once the
  run has logged step ``--wsd-at``), then the same run with ``scheduler.decay_start`` set to the step the first run
  recorded: the learning rates and losses of the two, step by step.
* ``raw``: the plain-PyTorch GPT-124M step of ../shared/bench/raw_gpt_baseline.py (copied to .whl/raw/), compiled,
  at the same batch, for the step time.
* ``plot`` (alone): the curves of DIR/recipe.jsonl as PNG files in DIR.

The corpus: every UTF-8 ``.py`` file of the installed torch and transformers packages as one JSONL document each,
prepared with the given tokenizer (a BPE of the embedded corpus: ``prepare(["python-stdlib"], ..., tokenizer="bpe:8192")``).
Each run's summary goes to DIR/recipe.jsonl as it finishes (one JSON line), its metrics record stays under DIR/runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH, SEQ = 8, 1024
_RESULTS = threading.Lock()  # one recipe.jsonl line at a time (--jobs)


def corpus(out: Path, tokenizer: str) -> Path:
    """The prepared dataset (built once per machine)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from lmtrain.data.prepare import prepare

    ds = out / "ds"
    if (ds / "manifest.json").is_file():
        return ds
    docs = out / "corpus.jsonl"
    with open(docs, "w", encoding="utf-8") as fh:
        for package in (torch, transformers):
            for path in sorted(Path(package.__file__).parent.rglob("*.py")):
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    fh.write(json.dumps({"text": text}) + "\n")
    prepare([str(docs)], ds, tokenizer=tokenizer, val_fraction=0.005, workers=12, progress=False)
    return ds


def base(ds: Path, run: Path, name: str) -> list[str]:
    """What every run shares: opt-125m, bf16, compiled, batch 8 x 1024."""
    return ["model=opt-125m", "trainer=gpu", "logger=csv", "data=prepared", f"data.path={ds}", f"data.seq_len={SEQ}",
            f"data.batch_size={BATCH}", f"run_dir={run}", f"run_name={name}", "trainer.enable_progress_bar=false",
            "trainer.val_check_interval=100000"]  # fmt: skip


ARMS = {
    "plain": [],
    "both": ["model.qk_norm=true", "module.z_loss=1e-4"],
    "qknorm": ["model.qk_norm=true"],
    "zloss": ["module.z_loss=1e-4"],
}


def stability_runs(lr: float, steps: int, warmup: int = 100, extra: list[str] = (), arms=("plain", "both")) -> dict[str, list[str]]:
    """Plain AdamW, then with QK-norm and z-loss (``arms``: which of :data:`ARMS`, in order); checkpoints every 25
    steps, for the detector's rollbacks. ``extra`` overrides replace those of the same key (Hydra refuses a key given
    twice) or add to them."""
    common = {o.split("=", 1)[0]: o for o in [f"trainer.max_steps={steps}", f"scheduler.warmup_steps={warmup}", "scheduler=cosine",
                                              f"optimizer.lr={lr}", "callbacks.checkpoint.every_n_steps=25"]}  # fmt: skip
    common.update({o.split("=", 1)[0]: o for o in extra})
    group_first = sorted(common.values(), key=lambda o: "." in o.split("=", 1)[0])  # a group's choice before its keys
    names = {"plain": "adamw", "both": "adamw-qknorm-zloss", "qknorm": "adamw-qknorm", "zloss": "adamw-zloss"}
    return {f"{names[arm]}-lr{lr:g}": [*group_first, *ARMS[arm]] for arm in arms}


def muon_runs(lr: float, steps: int) -> dict[str, list[str]]:
    common = [f"trainer.max_steps={steps}", "scheduler=cosine", "scheduler.warmup_steps=50", f"optimizer.lr={lr}",
              "callbacks.checkpoint.every_n_steps=500"]  # fmt: skip
    return {f"{opt}-{steps}-lr{lr:g}": [*common, f"optimizer={opt}"] for opt in ("adamw", "muon")}


def wsd_runs(steps: int, decay_start: int, decay_steps: int) -> dict[str, list[str]]:
    """The operator's run (its configured decay: the last 50 steps) and the configured one (its decay where the
    operator's began)."""
    common = [f"trainer.max_steps={steps}", "scheduler=wsd", "scheduler.warmup_steps=50", "callbacks.lr_control.poll_every=1",
              "optimizer.lr=1e-3", "scheduler.decay=1-sqrt", "callbacks.checkpoint.every_n_steps=500"]  # fmt: skip
    return {"wsd-control": [*common, "scheduler.decay_steps=50"],
            "wsd-configured": [*common, f"scheduler.decay_start={decay_start}", f"scheduler.decay_steps={decay_steps}"]}  # fmt: skip


def train(out: Path, ds: Path, name: str, overrides: list[str], operator=None, attention: bool = False) -> dict:
    """One ``train.py`` run on the GPU (:func:`base`); ``operator(run_dir, proc)`` runs beside it; ``attention``: the
    largest attention logits at its checkpoints (:func:`attention_logits`)."""
    sys.path.insert(0, str(ROOT))
    from lmtrain.formats import corrections, logbook, metrics

    run = out / "runs" / name
    cmd = [sys.executable, str(ROOT / "train.py"), *base(ds, run, name), *overrides]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        if operator is not None:
            operator(run, proc)
        proc.wait()
    rows = metrics.by_step(run)
    steps = sorted(s for s in rows if "train/loss" in rows[s])
    speed = [float(rows[s]["perf/tokens_per_sec"]) for s in steps if "perf/tokens_per_sec" in rows[s]]
    entries = logbook.read(run)
    result = {
        "name": name, "exit": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[2:]),
        "steps": len(steps), "loss": [float(rows[s]["train/loss"]) for s in steps], "lr": [float(rows[s]["train/lr"]) for s in steps],
        "z_loss": [float(rows[s]["train/z_loss"]) for s in steps if "train/z_loss" in rows[s]],
        "grad_norm": [float(rows[s]["train/grad_norm"]) for s in steps],
        "tokens_per_sec_median": statistics.median(speed[len(speed) // 5 :]) if speed else None,  # past compilation
        "rollbacks": [e.get("message") for e in entries if e["kind"] == "rollback"],
        "signals": [(e.get("step"), e.get("signals")) for e in entries if e["kind"] == "divergence_signal"],
        "stopped": [e.get("message") for e in entries if e["kind"] in ("stop", "stopped")],
        "corrections": corrections.load(run) if (run / corrections.FILE).exists() else [],
        # the losses of the steps a rollback abandoned (the record keeps them; the timeline above does not)
        "abandoned": [(r["step"], r["values"]["train/loss"]) for r in metrics.record_rows(run) if r["abandoned"] and "train/loss" in r["values"]],
    }  # fmt: skip
    if attention:
        result["attn_logit_max"] = attention_logits(run, ds)
    with _RESULTS:
        with open(out / "recipe.jsonl", "a") as fh:
            fh.write(json.dumps(result) + "\n")
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("loss", "lr", "z_loss", "grad_norm", "command", "abandoned")}),
            flush=True,
        )
    return result


def attention_logits(run: Path, ds: Path, blocks: int = 4, seq: int = SEQ) -> dict[int, list[float]]:
    """At every checkpoint the run kept (step: one figure per layer): the largest attention logit, q.k / sqrt(head_dim)
    over the causal positions of the first ``blocks`` validation blocks, in float32 (Wortsman et al. 2023 follow it:
    without QK-norm it grows with the learning rate until attention collapses onto single tokens)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from lmtrain.data.datamodule import PackedBlocks
    from lmtrain.formats import checkpoint as ck
    from lmtrain.formats.trained import load_run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    val = PackedBlocks(ds, "val", seq)
    idx = torch.stack([val[i][0] for i in range(min(blocks, len(val)))]).to(device)
    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T, T)
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        if attn_mask is not None:
            allowed = allowed & attn_mask
        seen.append(scores.masked_fill(~allowed, float("-inf")).amax().item())
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    out = {}
    for saved in ck.scan(run / "checkpoints", quiet=True):
        model = load_run(run, saved.path.name, device)[0]
        seen.clear()
        F.scaled_dot_product_attention = spy
        try:
            with torch.no_grad():
                model.hidden_states(idx)
        finally:
            F.scaled_dot_product_attention = sdpa
        out[saved.step] = [round(x, 2) for x in seen]
        del model
    return out


def stability(out: Path, ds: Path, args) -> None:
    """At each rate, plain AdamW and then the same with QK-norm and z-loss (without ``--stability-pairs``: the guarded
    run only where the plain one diverged, stopping there; with it, every arm of ``--stability-arms``, ``--jobs`` runs
    at a time)."""
    arms = args.stability_arms if args.stability_pairs else ("plain", "both")
    runs = {lr: stability_runs(lr, args.stability_steps, args.stability_warmup, args.stability_overrides, arms) for lr in args.lrs}
    if args.stability_pairs:
        with ThreadPoolExecutor(args.jobs) as pool:
            done = [pool.submit(train, out, ds, name, o, attention=True) for pairs in runs.values() for name, o in pairs.items()]
            for future in done:
                future.result()
        return
    for lr in args.lrs:
        (plain, plain_args), (guarded, guarded_args) = runs[lr].items()
        result = train(out, ds, plain, plain_args, attention=True)
        if result["rollbacks"] or result["exit"] != 0:
            train(out, ds, guarded, guarded_args, attention=True)
            return


def muon(out: Path, ds: Path, args) -> None:
    for lr in args.muon_lrs:
        for name, overrides in muon_runs(lr, args.muon_steps).items():
            train(out, ds, name, overrides)


def wsd(out: Path, ds: Path, args) -> None:
    sys.path.insert(0, str(ROOT))
    from lmtrain.formats import metrics

    total, at = args.wsd_steps, args.wsd_at

    def operator(run: Path, proc) -> None:
        """Once the run's record shows step ``at`` (it is flushed every 5 s, a few hundred steps at a time here): a
        decay that ends 700 steps before the run does (room for the command's start and the request's pick-up)."""
        while proc.poll() is None:
            logged = max(metrics.by_step(run), default=-1) if (run / metrics.RECORD).exists() else -1
            if logged >= at:
                length = str(total - logged - 700)
                res = subprocess.run([sys.executable, "-m", "lmtrain.control", str(run), "decay", "--steps", length],
                                     capture_output=True, text=True, cwd=ROOT)  # fmt: skip
                (run.parent / "control.txt").write_text(res.stdout + res.stderr)
                return
            time.sleep(0.2)

    first = train(out, ds, "wsd-control", wsd_runs(total, 0, 1)["wsd-control"], operator)
    (entry,) = [e for e in first["corrections"] if e.get("reason") == "decay"]
    start = entry["from_step"]
    second = train(out, ds, "wsd-configured", wsd_runs(total, start, entry["decay_steps"])["wsd-configured"])
    same_lr = first["lr"] == second["lr"]
    diffs = [abs(a - b) for a, b in zip(first["loss"], second["loss"], strict=False)]
    summary = {"wsd_decay_from_step": start, "decay_steps": entry["decay_steps"], "lr_identical_every_step": same_lr,
               "max_abs_loss_diff": max(diffs), "last_loss": (first["loss"][-1], second["loss"][-1])}  # fmt: skip
    with open(out / "recipe.jsonl", "a") as fh:
        fh.write(json.dumps({"name": "wsd-compare", **summary}) + "\n")
    print(json.dumps(summary), flush=True)


def raw(out: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / ".whl" / "raw" / "raw_gpt_baseline.py"), "124m", "--compile", "--batch", str(BATCH),
                          "--seq", str(SEQ), "--steps", "50"], capture_output=True, text=True)  # fmt: skip
    line = (res.stdout.strip().splitlines() or [res.stderr[-500:]])[-1]
    with open(out / "recipe.jsonl", "a") as fh:
        fh.write(json.dumps({"name": "raw-pytorch-124m", "line": line}) + "\n")
    print(line, flush=True)


def plot(results: Path, out: Path) -> list[Path]:
    """The curves of a ``recipe.jsonl``: Muon against AdamW (loss, a 25-step mean), the stability runs (loss with the
    detector's signals, and the largest attention logit at each kept checkpoint), and the two WSD runs (learning rate
    and loss), as PNG files in ``out``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = {r["name"]: r for r in map(json.loads, results.read_text().splitlines()) if "loss" in r}

    def smooth(xs: list[float], k: int = 25) -> list[float]:
        return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]

    written = []
    pairs = [n for n in runs if n.startswith("muon-")]
    if pairs:
        fig = Figure(figsize=(8, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for name in sorted(runs):
            if name.startswith(("muon-", "adamw-")) and name.count("-") == 2:
                r = runs[name]
                ax.plot(smooth(r["loss"]), label=f"{name} ({r['tokens_per_sec_median'] / 1e3:.0f}k tokens/s)")
        ax.set(title="opt-125m shape, H200, batch 8 x 1024: Muon and AdamW at equal tokens", xlabel="optimizer step",
               ylabel="train loss (25-step mean)", ylim=(2, 6))  # fmt: skip
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "muon_vs_adamw.png")
        written.append(out / "muon_vs_adamw.png")
    stable = sorted(n for n in runs if n.startswith(("adamw-lr", "adamw-qknorm-", "adamw-zloss-")))
    if stable:
        fig = Figure(figsize=(8, 6), dpi=100)
        FigureCanvasAgg(fig)
        top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for name in stable:
            r = runs[name]
            style = "--" if "qknorm" in name else "-"  # dashed: with QK-norm
            (line,) = top.plot(smooth(r["loss"]), style, label=f"{name}: {len(r['rollbacks'])} rollbacks, exit {r['exit']}")
            for step, _ in r.get("signals", []):
                top.axvline(step, color=line.get_color(), alpha=0.3, lw=0.8)
            logits = {int(k): max(v) for k, v in r.get("attn_logit_max", {}).items()}
            if logits:
                bottom.plot(sorted(logits), [logits[k] for k in sorted(logits)], style + "o", color=line.get_color(), label=name)
        top.set(title="opt-125m, H200, AdamW, no weight decay (dashed: QK-norm; thin lines: signals)",
                ylabel="train loss (25-step mean)")  # fmt: skip
        bottom.set(xlabel="optimizer step", ylabel="largest attention logit (any layer)", yscale="log")
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "stability.png")
        written.append(out / "stability.png")
    if "wsd-control" in runs and "wsd-configured" in runs:
        fig = Figure(figsize=(8, 6), dpi=100)
        FigureCanvasAgg(fig)
        top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for name, style in (("wsd-control", "-"), ("wsd-configured", "--")):
            r = runs[name]
            top.plot(r["lr"], style, label=name)
            bottom.plot(smooth(r["loss"]), style, label=name)
        top.set(title="scheduler=wsd: cooldown by lmtrain control vs the same decay configured", ylabel="learning rate")
        bottom.set(xlabel="optimizer step", ylabel="train loss (25-step mean)", ylim=(2, 6))
        for ax in (top, bottom):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "wsd_control_vs_configured.png")
        written.append(out / "wsd_control_vs_configured.png")
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", choices=["stability", "muon", "wsd", "raw", "plot"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", help="a .tiktoken file (the BPE the corpus is tokenized with)")
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 6e-3, 1.2e-2, 2.4e-2])
    p.add_argument("--stability-steps", type=int, default=300)
    p.add_argument("--stability-warmup", type=int, default=100)
    p.add_argument("--stability-pairs", action="store_true", help="both runs at every rate (default: stop at the first divergence)")
    p.add_argument("--stability-overrides", nargs="*", default=[], help="Hydra overrides of both stability runs (KEY=VALUE)")
    p.add_argument("--stability-arms", nargs="+", choices=list(ARMS), default=["plain", "both"], help="with --stability-pairs: "
                   "plain AdamW, both QK-norm and z-loss, or one of them (an ablation)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="stability runs at once on the card (with --stability-pairs)")
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[6e-4])
    p.add_argument("--muon-steps", type=int, default=1000)
    p.add_argument("--wsd-steps", type=int, default=1500)
    p.add_argument("--wsd-at", type=int, default=50)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.parts == ["plot"]:  # draw a finished run's curves: --out DIR holding its recipe.jsonl
        print(*plot(args.out / "recipe.jsonl", args.out), sep="\n")
        return 0
    ds = corpus(args.out, args.tokenizer)
    for part in args.parts:
        if part == "raw":
            raw(args.out)
        else:
            {"stability": stability, "muon": muon, "wsd": wsd}[part](args.out, ds, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
