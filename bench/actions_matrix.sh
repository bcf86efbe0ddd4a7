#!/usr/bin/env bash
# Every divergence action under every precision and strategy on the GPUs of one host (issue 15): a NaN loss on
# rank 1 at step 6 (fault nan_loss), the `nonfinite` signal set to each action in turn. Expected: skip and rollback
# exit 0, stop exits 3, never a traceback or a hang. One more row: fp16 under fsdp with the backward overflowing on
# rank 1 only for 2 steps (fault grad_overflow): both ranks skip them (train/skipped_steps 2), exit 0.
#
#   bash bench/actions_matrix.sh [DEVICES=2]
#
# ONLY=GLOB runs the rows whose name matches; EXTRA="..." appends overrides to every row (a CPU smoke test:
# ONLY='ddp-16-mixed-stop' EXTRA='trainer.accelerator=cpu model=tiny data.seq_len=64' bash bench/actions_matrix.sh).
#
# Logs go to $OUT (default /tmp/actions_matrix); the table is printed last.
set -uo pipefail
DEV=${1:-2}
OUT=${OUT:-/tmp/actions_matrix}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
C="trainer=gpu trainer.devices=$DEV logger=csv model=opt-125m model.dropout=0 data.seq_len=512 data.batch_size=8 trainer.max_steps=12"
C="$C trainer.val_check_interval=100 trainer.enable_progress_bar=false callbacks.checkpoint.every_n_steps=4 callbacks.divergence.warmup_steps=2 scheduler.warmup_steps=2 paths.runs=$OUT/runs ${EXTRA:-}"
row() {  # name, expected exit, overrides...
  local name=$1 want=$2; shift 2
  [[ -n "${ONLY:-}" && "$name" != $ONLY ]] && return
  local t0=$SECONDS
  timeout 300 python3 train.py $C run_name="$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$? tb=$(grep -c Traceback "$OUT/$name.log")
  local skipped=$(python3 -c "import sys; sys.path.insert(0, '.'); from lmtrain.logs import metric; v = metric('$OUT/runs/$name', 'train/skipped_steps'); print(int(v[-1]) if v else '-')" 2>/dev/null)
  printf '%-26s exit %-3s (want %s)  tracebacks %s  skipped %s  %ss  %s\n' "$name" "$rc" "$want" "$tb" "$skipped" $((SECONDS - t0)) \
    "$(grep -h '^stopped:' "$OUT/$name.log" | head -1 | cut -c1-90)" | tee -a "$OUT/table.txt"
}
: > "$OUT/table.txt"
for S in ddp fsdp; do
  for P in bf16-mixed 16-mixed; do
    for A in skip rollback stop; do
      want=0; [ "$A" = stop ] && want=3
      row "$S-$P-$A" $want strategy=$S trainer.precision=$P fault=nan_loss callbacks.fault.step=6 callbacks.fault.rank=1 \
        "callbacks.divergence.nonfinite={action: $A}"
    done
  done
done
row fsdp-16-mixed-overflow 0 strategy=fsdp trainer.precision=16-mixed fault=grad_overflow callbacks.fault.step=3 callbacks.fault.count=2 callbacks.fault.rank=1
echo; cat "$OUT/table.txt"
