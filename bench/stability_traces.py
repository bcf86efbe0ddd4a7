"""Per-step traces of real runs for the divergence detector's labelled set (issue 58, docs/stability.md).

    python3 bench/stability_traces.py --out DIR --tokenizer T.tiktoken --set NAME [--jobs 4] [--steps N] [--only RUN ...]

Each run of the set is ``train.py`` on the GPU with bench/recipe.py's shape (opt-125m unless the run says otherwise,
bf16, compiled, batch 8 x 1024 of the torch and transformers sources) and every divergence action set to ``warn``,
so each run's own course is recorded, whatever a detector would have done; the runs named ``...-detector`` are the
same rates with the detector acting as configured (its defaults, checkpoints every 100 steps), and their logbooks
(DIR/logbooks/RUN.jsonl) say what it did. As each run ends its trace
(lmtrain.training.stability.read_trace: loss, gradient norm, last-block activation RMS, learning rate, fp16 loss
scale and overflows) is appended to DIR/traces.jsonl: a first line naming the source, then one line per step with
the run's name. ``lmtrain replay --events`` and tests/test_stability.py judge them (tests/data/stability/events.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from recipe import base, corpus  # noqa: E402

WARN = [f"callbacks.divergence.{s}.action=warn" for s in
        ("nonfinite", "loss_spike", "grad_spike", "act_growth", "loss_level", "loss_trend", "stall", "loss_scale", "skipped_steps", "routing_collapse")]  # fmt: skip
CONSTANT = ["scheduler=constant", "optimizer.weight_decay=0", "scheduler.warmup_steps=100"]
OPT = ["scheduler=cosine", "scheduler.warmup_steps=100", "optimizer.lr=6e-4"]  # the OPT recipe's rate at 125M
GUARDED = ["model.qk_norm=true", "module.z_loss=1e-4"]
ACTING = "+detector"  # in a run's overrides: its detector acts as configured (the defaults), checkpoints every 100 steps


# opt-1.3b with the detector acting: a healthy checkpoint every 50 steps, two kept (3 x 16 GB at most on the disk)
BIG_SAVES = ["callbacks.checkpoint.every_n_steps=50", "callbacks.checkpoint.keep_last=2"]


def blip(step: int, count: int = 1) -> list[str]:
    return ["fault=bad_data", f"callbacks.fault.step={step}", f"callbacks.fault.count={count}"]


SETS = {
    # opt-125m, 1,000 steps: more rates and seeds of plain AdamW, blips of bad data in healthy runs, fp16
    "125m": {
        "adamw-lr0.01-seed2": [*CONSTANT, "optimizer.lr=0.01", "seed=2"],
        "adamw-lr0.04-seed2": [*CONSTANT, "optimizer.lr=0.04", "seed=2"],
        "adamw-lr0.003-seed2": [*CONSTANT, "optimizer.lr=0.003", "seed=2"],
        "adamw-lr0.1-seed2": [*CONSTANT, "optimizer.lr=0.1", "seed=2", "trainer.max_steps=600"],
        "opt-recipe-blip400": [*OPT, *blip(400)],
        "opt-recipe-blips250x3-700": [*OPT, *blip(250, 3)],
        "qknorm-zloss-lr0.04-blip500": [*CONSTANT, *GUARDED, "optimizer.lr=0.04", *blip(500)],
        "qknorm-zloss-lr0.01-blip300x2": [*CONSTANT, *GUARDED, "optimizer.lr=0.01", *blip(300, 2)],
        "fp16-opt-recipe-blip600": [*OPT, "trainer.precision=16-mixed", *blip(600)],
        "fp16-lr0.1": [*CONSTANT, "trainer.precision=16-mixed", "optimizer.lr=0.1", "trainer.max_steps=400"],
        # issue 58 part 4: the diverging rates again with the detector acting, against the same runs above (detector
        # off: every action warn) and the OPT recipe's rate
        "adamw-lr0.1-seed2-detector": [ACTING, *CONSTANT, "optimizer.lr=0.1", "seed=2", "trainer.max_steps=600"],
        "adamw-lr0.04-seed2-detector": [ACTING, *CONSTANT, "optimizer.lr=0.04", "seed=2"],
    },
    # the CPU, model=tiny on the embedded corpus, batch 4 x 64: issue 58's blip run (3,000 steps), blips of bad data,
    # rates that diverge or stop learning (--cpu)
    "cpu": {
        "tiny-defaults-3000": ["trainer.max_steps=3000", "data.batch_size=4", "data.seq_len=64"],
        "tiny-blip1200": ["data.batch_size=4", "data.seq_len=64", *blip(1200)],
        "tiny-blips900x2": ["data.batch_size=4", "data.seq_len=64", *blip(900, 2)],
        "tiny-lr0.05": ["data.batch_size=4", "data.seq_len=64", *CONSTANT, "optimizer.lr=0.05"],
        "tiny-lr0.3": ["data.batch_size=4", "data.seq_len=64", *CONSTANT, "optimizer.lr=0.3"],
        "tiny-lr0.01": ["data.batch_size=4", "data.seq_len=64", *CONSTANT, "optimizer.lr=0.01"],
    },
    # opt-1.3b, 400 steps: rates that diverge or struggle, the same with QK-norm and z-loss, the OPT recipe's rate
    "1.3b": {
        "1.3b-adamw-lr0.003": ["model=opt-1.3b", *CONSTANT, "optimizer.lr=0.003"],
        "1.3b-qknorm-zloss-lr0.003": ["model=opt-1.3b", *CONSTANT, *GUARDED, "optimizer.lr=0.003"],
        "1.3b-opt-recipe-blip200": ["model=opt-1.3b", "scheduler=cosine", "scheduler.warmup_steps=100", "optimizer.lr=2e-4", *blip(200)],
        "1.3b-adamw-lr0.003-detector": [ACTING, "model=opt-1.3b", *CONSTANT, "optimizer.lr=0.003", *BIG_SAVES],
        "1.3b-adamw-lr0.01": ["model=opt-1.3b", *CONSTANT, "optimizer.lr=0.01"],
        "1.3b-adamw-lr0.01-detector": [ACTING, "model=opt-1.3b", *CONSTANT, "optimizer.lr=0.01", *BIG_SAVES],
        "1.3b-adamw-lr0.03": ["model=opt-1.3b", *CONSTANT, "optimizer.lr=0.03"],
        "1.3b-adamw-lr0.03-detector": [ACTING, "model=opt-1.3b", *CONSTANT, "optimizer.lr=0.03", *BIG_SAVES],
    },
}
_LOCK = threading.Lock()


def run(out: Path, ds: Path, name: str, overrides: list[str], steps: int) -> None:
    from lmtrain.training.stability import read_trace

    rundir = out / "runs" / name
    acting = ACTING in overrides
    # a run whose detector only warns saves nothing (an opt-1.3b checkpoint with AdamW's state is 16 GB)
    quiet = ["callbacks.checkpoint.every_n_steps=0", "callbacks.checkpoint.save_on_train_end=false", *WARN]
    course = ["callbacks.checkpoint.every_n_steps=100"] if acting else quiet
    given = {o.split("=", 1)[0]: o for o in [f"trainer.max_steps={steps}", *course, *(o for o in overrides if o != ACTING)]}
    shape = (["model=tiny", "logger=csv", f"run_dir={rundir}", f"run_name={name}", "trainer.enable_progress_bar=false",
              "trainer.val_check_interval=100000"] if ds is None else base(ds, rundir, name))  # fmt: skip
    cmd = [sys.executable, str(ROOT / "train.py"), *shape, *sorted(given.values(), key=lambda o: "." in o.split("=", 1)[0])]
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    try:
        trace = read_trace(rundir)
    except Exception as exc:  # a run that wrote no record: said in the summary line
        trace, rc = [], f"{rc} (no trace: {exc})"
    with _LOCK, open(out / "traces.jsonl", "a") as fh:
        for stats in trace:
            fh.write(json.dumps({"run": name, **stats}) + "\n")
    if (rundir / "logbook.jsonl").is_file():  # what the detector did, for the runs where it acts
        (out / "logbooks").mkdir(exist_ok=True)
        shutil.copyfile(rundir / "logbook.jsonl", out / "logbooks" / f"{name}.jsonl")
    shutil.rmtree(rundir / "checkpoints", ignore_errors=True)  # the disk for the next run: the trace and logbook are kept
    print(json.dumps({"run": name, "exit": rc, "steps": len(trace), "wall_s": round(time.perf_counter() - t0, 1),
                      "last_loss": trace[-1]["loss"] if trace else None, "command": " ".join(cmd[2:])}), flush=True)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", help="the .tiktoken file of the GPU sets' corpus (bench/recipe.py)")
    p.add_argument("--set", choices=list(SETS), required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--only", nargs="*", help="these runs of the set only")
    p.add_argument("--source", default="", help="what the traces' first line says of where they ran")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ds = None if args.set == "cpu" else corpus(args.out, args.tokenizer)
    with open(args.out / "traces.jsonl", "a") as fh:
        fh.write(json.dumps({"source": f"{args.source} bench/stability_traces.py --set {args.set} --steps {args.steps}",
                             "date": time.strftime("%Y-%m-%d")}) + "\n")  # fmt: skip
    with ThreadPoolExecutor(args.jobs) as pool:
        for f in [pool.submit(run, args.out, ds, n, o, args.steps) for n, o in SETS[args.set].items() if not args.only or n in args.only]:
            f.result()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
