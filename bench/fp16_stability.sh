#!/usr/bin/env bash
# Stability evidence on one GPU (issue 15), as a user runs it; figures go to docs/BENCHMARKS.md.
#
#   bash bench/fp16_stability.sh [STEPS=500]
#
# 1. opt-125m with the OPT recipe (lr 6e-4, warmup, 1024-token sequences, batch 16) for STEPS steps in fp16
#    (16-mixed: torch.amp.GradScaler) and in bf16: final losses side by side, the fp16 run's loss scale and
#    skipped steps (plots/loss_scale.png by lmtrain.report).
# 2. A real divergence in bf16, no fault group: a healthy run; once step 200 is saved an operator sets an absurd
#    learning rate (`python -m lmtrain.control RUN lr --value 0.05`); the detector must roll back, revoke the
#    correction and end healthy.
# 3. A real divergence in fp16: the OPT recipe at lr 0.1, default detector settings; then again with the loss-level
#    signal only warning, so that the fp16 signals (skipped steps, loss scale) act.
# Logs and run directories go to $OUT (default /tmp/fp16_stability); the last lines printed are the figures.
set -uo pipefail
STEPS=${1:-500}
OUT=${OUT:-/tmp/fp16_stability}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
C="trainer=gpu logger=csv model=opt-125m model.dropout=0 data.seq_len=1024 data.batch_size=16 optimizer.lr=6e-4 scheduler.warmup_steps=50"
C="$C trainer.enable_progress_bar=false trainer.limit_val_batches=20 paths.runs=$OUT/runs"
run() { local name=$1; shift; python3 train.py $C run_name="$name" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/rc.txt"; }
: > "$OUT/rc.txt"
run fp16 trainer.precision=16-mixed trainer.max_steps="$STEPS" trainer.val_check_interval=250
run bf16 trainer.precision=bf16-mixed trainer.max_steps="$STEPS" trainer.val_check_interval=250
python3 train.py $C run_name=operator trainer.max_steps=400 trainer.val_check_interval=1000 callbacks.checkpoint.every_n_steps=50 \
  callbacks.lr_control.poll_every=2 > "$OUT/operator.log" 2>&1 &
pid=$!
while [ ! -d "$OUT/runs/operator/checkpoints/step-0000200" ] && kill -0 $pid 2>/dev/null; do sleep 0.5; done
python3 -m lmtrain.control "$OUT/runs/operator" lr --value 0.05 --note "fat-fingered: meant 5e-5"
wait $pid; echo "operator rc=$?" | tee -a "$OUT/rc.txt"
run hot16 trainer.precision=16-mixed optimizer.lr=0.1 trainer.max_steps=100 trainer.val_check_interval=1000 callbacks.checkpoint.every_n_steps=5
run hot16w trainer.precision=16-mixed optimizer.lr=0.1 trainer.max_steps=100 trainer.val_check_interval=1000 callbacks.checkpoint.every_n_steps=5 \
  callbacks.divergence.loss_level.action=warn
for r in fp16 bf16 operator hot16 hot16w; do python3 -m lmtrain.report "$OUT/runs/$r" > /dev/null 2>&1; done
python3 bench/stability_summary.py "$OUT/runs" fp16 bf16 operator hot16 hot16w | tee "$OUT/summary.txt"
