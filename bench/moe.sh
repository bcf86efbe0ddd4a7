#!/usr/bin/env bash
# A mixture of experts against the dense model of its active parameters, at equal tokens, on one GPU (issue 61):
# OLMoE-1B-7B's shape (model=olmoe-1b-7b: 64 experts of 1,024, 8 a token; EXPERTS=N fewer where its 6.9B do not fit
# the card) and the dense Llama of the same active shape (its 8 chosen experts as one SwiGLU of 8,192 features: 1.28B
# parameters, every one active), the same data, batch, steps and recipe, each as a user types it (trainer=gpu:
# compiled, bf16, fused AdamW). Printed last and written to $OUT/rows.md: tokens/s (the median step after the first
# 10), MFU (counted on active parameters, as the throughput callback counts it), peak memory held, and the mean
# training loss of the last 10 steps, which is the loss at equal tokens since both read the same batches; and the
# planner's count for the same run (lmtrain plan, one GPU, no activation checkpointing) beside the measured peak.
# moe-norm: the same mixture with each token's chosen affinities renormalised to sum to 1 (model.moe.norm_topk=true,
# as Qwen3-MoE and DeepSeek-V3 route, and lmtrain's default for a model.moe that does not set it; OLMoE and its
# preset do not): on the CPU at width 256 it ends below its dense twin on three seeds (docs/benchmarks/2026-12-08.md).
# No checkpoint is written: the runs measure steps, and OLMoE's 83 GB of state would not fit a 64 GB disk.
#
#   [DATA=DATASET] [STEPS=300] [B=8] [SEQ=2048] [EXPERTS=64] [KINDS="moe moe-norm dense"] [OUT=/tmp/moe] bash bench/moe.sh
#
# DATA: an lmtrain prepared dataset (default: the preset's own data config).
# Record the rows in docs/BENCHMARKS.md with the card and this command.
set -o pipefail
STEPS=${STEPS:-300} B=${B:-8} SEQ=${SEQ:-2048} EXPERTS=${EXPERTS:-64} OUT=${OUT:-/tmp/moe} KINDS=${KINDS:-moe moe-norm dense}
model_of() {  # the model overrides of kind $1, in the array `model`; 1 for a kind this script does not have
  case $1 in
    moe) model=(model=olmoe-1b-7b "model.moe.experts=$EXPERTS") ;;
    moe-norm) model=(model=olmoe-1b-7b "model.moe.experts=$EXPERTS" model.moe.norm_topk=true) ;;
    dense) model=(model=olmoe-1b-7b model.moe=null model.ffn_dim=8192) ;;
    *) return 1 ;;
  esac
}
for kind in $KINDS; do  # every kind known before anything is written
  model_of "$kind" || { echo "bench/moe.sh: unknown kind '$kind' in KINDS (moe, moe-norm, dense)" >&2; exit 2; }
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
common=(trainer=gpu logger=csv ${DATA:+data=prepared "data.path=$DATA"} "data.seq_len=$SEQ" "data.batch_size=$B" "trainer.max_steps=$STEPS"
        "scheduler.total_steps=$STEPS" scheduler.warmup_steps=30 trainer.val_check_interval=100000 trainer.enable_progress_bar=false
        '~callbacks.checkpoint' '~callbacks.disk_guard')
for kind in $KINDS; do
  model_of "$kind"
  python3 train.py "${common[@]}" "${model[@]}" "run_dir=$OUT/runs/$kind" "run_name=$kind" > "$OUT/$kind.log" 2>&1
  echo "$kind: exit $?"
  python3 -m lmtrain plan trainer=gpu "data.seq_len=$SEQ" "data.batch_size=$B" "${model[@]}" cluster.gpus=1 output=json \
    > "$OUT/$kind.plan.json" 2> "$OUT/$kind.plan.err"
done
python3 - "$OUT" $KINDS <<'EOF' | tee "$OUT/rows.md"
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| model | tokens/s | MFU (active) | peak GiB held | planner's count, GiB | loss, last 10 steps |\n|---|---|---|---|---|---|")
for kind in sys.argv[2:]:  # the kinds that ran, in KINDS's order
    path = out / "runs" / kind / "metrics.jsonl"
    if not path.exists():
        print(f"| {kind} | did not run: see {kind}.log | | | | |")
        continue
    rows = [json.loads(x).get("m", {}) | {"step": json.loads(x).get("step")} for x in path.read_text().splitlines()]
    def series(key):
        return {r["step"]: r[key] for r in rows if key in r}
    rate, mfu, held, loss = (series(k) for k in ("perf/tokens_per_sec", "perf/mfu", "perf/max_reserved_gib", "train/loss"))
    def median(values):  # the steps after the first 10 (compilation, warm-up)
        steady = [v for s, v in values.items() if s > 10]
        return statistics.median(steady) if steady else float("nan")
    last = sorted(loss)[-10:]
    try:
        counted = json.loads((out / f"{kind}.plan.json").read_text())["memory_gb_per_gpu"]["ddp"]["none"]["total"] * 1e9 / 2**30
    except (OSError, ValueError, KeyError):
        counted = float("nan")
    print(f"| {kind} | {median(rate):,.0f} | {median(mfu):.1%} | {max(held.values(), default=float('nan')):.1f} | {counted:.1f} | "
          f"{statistics.mean(loss[s] for s in last):.4f} (steps {last[0]}-{last[-1]}) |")
EOF
