"""Continued pretraining from a transformers folder, end to end (issue 45's evidence; needs a GPU and transformers).

1. A released architecture with random weights (no hub here): ``transformers.OPTForCausalLM`` at OPT-125m's shape
   (OPTConfig's defaults: facebook/opt-125m's config), saved with ``save_pretrained``, with a ``tokenizer.json`` of a
   byte-level BPE trained on the embedded corpus.
2. ``lmtrain prepare`` with that tokenizer.json, then ``lmtrain train init_from=DIR`` for ``--steps`` steps on the GPU,
   with the downstream evaluations on (callbacks=[default,evals]); the peak resident memory of the training process
   (its ranks) is read from the kernel (``RUSAGE_CHILDREN``).
3. ``lmtrain export --format hf``, loaded back by transformers: its logits against lmtrain's own model of the same
   checkpoint on real tokens (fp32), and the first step's loss against transformers' on the starting folder.

    python3 bench/hf_continue.py --out DIR [--steps 300] [train overrides ...]

Prints one JSON line and writes it to DIR/hf_continue.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=8192, help="the BPE's size (the model keeps OPT's 50272 rows)")
    args, overrides = p.parse_known_args()
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from lmtrain.data.prepare import prepare
    from lmtrain.formats import hf
    from lmtrain.formats.tokenizer import EOS_TEXT, GPT2_PATTERN, load_ranks

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    folder, bpe, ds = out / "opt-125m-random", out / "bpe", out / "corpus-hf"
    prepare(["python-stdlib"], bpe, tokenizer=f"bpe:{args.vocab}", val_fraction=0.05, workers=4, progress=False)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(transformers.OPTConfig()).save_pretrained(folder)
    ranks = load_ranks(bpe / "tokenizer.tiktoken")
    (folder / "tokenizer.json").write_text(hf.tokenizer_json(ranks, GPT2_PATTERN, {EOS_TEXT: len(ranks)}))
    prepare(["python-stdlib"], ds, tokenizer=str(folder / "tokenizer.json"), val_fraction=0.05, workers=4, progress=False)
    run = out / "runs" / "continued"
    cmd = [sys.executable, str(ROOT / "train.py"), f"init_from={folder}", "data=prepared", f"data.path={ds}", "trainer=gpu", "logger=csv",
           f"run_dir={run}", "run_name=continued", f"trainer.max_steps={args.steps}", "data.seq_len=1024", "data.batch_size=16",
           "optimizer.lr=1e-4", "scheduler.warmup_steps=30", "callbacks=[default,evals]", "trainer.val_check_interval=50",
           "trainer.enable_progress_bar=false", *overrides]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - t0
    (out / "train.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return 1
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child: the training process
    from lmtrain import export
    from lmtrain.data.datamodule import TokenDataModule
    from lmtrain.formats import metrics
    from lmtrain.formats.trained import load_run

    assert export.main([str(run), "--out", str(out / "exported"), "--format", "hf", "--force"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "exported", torch_dtype=torch.float32).cuda().eval()
    ours, _, _, _ = load_run(run, device="cuda")
    dm = TokenDataModule(str(ds), seq_len=1024, batch_size=16, num_workers=0, seed=1234)
    dm.setup("fit")
    x, y = next(iter(dm.val_dataloader() if not isinstance(dm.val_dataloader(), list) else dm.val_dataloader()[0]))
    x = x[:4].cuda()
    with torch.no_grad():
        a, b = ours.float()(x), theirs(x).logits
        start = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).cuda().eval()
        x0, y0 = next(iter(dm.train_dataloader()))
        start_loss = float(torch.nn.functional.cross_entropy(start(x0.cuda()).logits.flatten(0, 1), y0.cuda().flatten()))
    loss = metrics.metric(run, "train/loss")
    evals = {k: metrics.metric(run, f"eval/next-line/{k}") for k in ("acc", "acc_norm")}
    line = next((ln for ln in (res.stdout + res.stderr).splitlines() if "weights read on this rank" in ln), "")
    result = {
        "card": torch.cuda.get_device_name(0), "steps": args.steps, "wall_s": round(took, 1), "peak_rss_gib": round(peak_rss / 2**30, 2),
        "weights_line": line.strip(), "first_loss": loss[0], "transformers_first_batch_loss": start_loss,
        "last_loss": loss[-1], "max_abs_logit_diff": float((a - b).abs().max()), "logit_scale": float(b.abs().max()),
        "eval_next_line": evals, "command": " ".join(cmd[1:]),
    }  # fmt: skip
    (out / "hf_continue.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
