#!/usr/bin/env bash
# Restarts on other hardware and asynchronous sharded saves, on 2 GPUs of one host (docs/BENCHMARKS.md).
#
#   bash bench/restart_gpu.sh reshard      # opt-350m: fsdp on 2 GPUs -> 1 GPU -> 2 GPUs beside an uninterrupted run
#   bash bench/restart_gpu.sh stall        # opt-1.3b under fsdp on 2 GPUs: stall per save, synchronous and asynchronous
#   bash bench/restart_gpu.sh goodput      # opt-1.3b on one GPU, 1,000 steps with the default callbacks: the summary's goodput
#   bash bench/restart_gpu.sh stall7b      # llama-7b as experiment=llama-7b trains it on 2 GPUs: one asynchronous save at step 3, its stall and the GPU memory
#
# Everything goes to $OUT (default /tmp/restart_gpu) as logs; the last lines printed are the figures.
set -euo pipefail
OUT=${OUT:-/tmp/restart_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
QUIET="logger=csv trainer.enable_progress_bar=false trainer.val_check_interval=1000000 trainer.limit_val_batches=0 callbacks.disk_guard.margin_gb=0 paths.runs=$OUT/runs"

metrics() {  # RUN KEY...: the run's logged values of each key, in step order
  python3 - "$@" <<'EOF'
import csv, sys
run, keys = sys.argv[1], sys.argv[2:]
rows = list(csv.DictReader(open(f"{run}/csv/metrics.csv")))
for k in keys:
    print(k, [(int(r["step"]), round(float(r[k]), 4)) for r in rows if r.get(k)])
EOF
}

case "${1:?reshard, stall, stall7b or goodput}" in
reshard)
  R="trainer=gpu model=opt-350m model.dropout=0 data.seq_len=1024 global_batch_size=16 data.batch_size=8 strategy=fsdp optimizer.lr=3e-4 scheduler.warmup_steps=10 scheduler.total_steps=30 callbacks.checkpoint.every_n_steps=10 $QUIET"
  python3 train.py $R trainer.devices=2 trainer.max_steps=30 run_name=ref > "$OUT/ref.log" 2>&1
  python3 train.py $R trainer.devices=2 trainer.max_steps=10 run_name=moved > "$OUT/moved-2.log" 2>&1
  python3 train.py $R trainer.devices=1 trainer.max_steps=20 run_name=moved > "$OUT/moved-1.log" 2>&1
  python3 train.py $R trainer.devices=2 trainer.max_steps=30 run_name=moved > "$OUT/moved-2b.log" 2>&1
  grep -h "resumed from" "$OUT/runs/moved/logbook.jsonl" | cut -c1-200
  python3 - "$OUT/runs" <<'EOF'
import csv, sys
def losses(run):
    return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(f"{sys.argv[1]}/{run}/csv/metrics.csv")) if r.get("train/loss")}
ref, moved = losses("ref"), losses("moved")
assert sorted(ref) == sorted(moved) == list(range(30)), (sorted(ref), sorted(moved))
for s in ref:
    print(f"step {s:2d}  uninterrupted {ref[s]:.5f}  2->1->2 GPUs {moved[s]:.5f}  diff {moved[s] - ref[s]:+.5f}")
before = max(abs(moved[s] - ref[s]) for s in range(10))
after = max(abs(moved[s] - ref[s]) for s in range(10, 30))
print(f"RESHARD max |diff| steps 0-9 (same layout): {before:.5f}; steps 10-29 (after 2->1 and 1->2): {after:.5f}")
EOF
  ;;
stall)
  S="trainer=gpu model=opt-1.3b model.dropout=0 data.seq_len=1024 data.batch_size=4 strategy=fsdp trainer.devices=2 trainer.max_steps=9 scheduler.warmup_steps=2 scheduler.total_steps=9 callbacks.checkpoint.every_n_steps=3 callbacks.checkpoint.keep_last=2 $QUIET"
  for mode in ${MODES:-false true}; do
    python3 train.py $S callbacks.checkpoint.async_save=$mode run_name=async-$mode > "$OUT/stall-$mode.log" 2>&1
    echo "STALL async_save=$mode"; metrics "$OUT/runs/async-$mode" ckpt/stall_s ckpt/collect_s ckpt/write_s ckpt/size_gb
    grep -h "goodput" "$OUT/stall-$mode.log" | head -1
    rm -rf "$OUT/runs/async-$mode/checkpoints"
  done
  ;;
stall7b)  # a 7B save where training holds 63 GiB per GPU: the host copy must not take GPU memory (84 GB of state, one checkpoint on disk)
  S7="trainer=gpu model=llama-7b data.seq_len=4096 data.batch_size=2 strategy=fsdp module.compile=true strategy.init_device=meta strategy.activation_checkpointing=op trainer.devices=2 optimizer.lr=3e-5 scheduler.warmup_steps=2 scheduler.total_steps=5 trainer.max_steps=5 callbacks.checkpoint.every_n_steps=3 callbacks.checkpoint.save_on_train_end=false callbacks.checkpoint.async_save=true ~callbacks.divergence $QUIET"
  python3 train.py $S7 run_name=stall7b > "$OUT/stall7b.log" 2>&1 || { echo "stall7b FAILED"; tail -30 "$OUT/stall7b.log"; }
  echo "STALL7B"; metrics "$OUT/runs/stall7b" ckpt/stall_s ckpt/collect_s ckpt/write_s ckpt/size_gb perf/max_memory_gib
  grep -h "finished run\|goodput  \|checkpoints:" "$OUT/stall7b.log"
  rm -rf "$OUT/runs/stall7b/checkpoints"
  ;;
goodput)
  G="trainer=gpu model=opt-1.3b data.seq_len=1024 data.batch_size=16 optimizer.lr=2e-4 trainer.max_steps=1000 logger=csv trainer.enable_progress_bar=false paths.runs=$OUT/runs"
  CUDA_VISIBLE_DEVICES=0 python3 train.py $G run_name=goodput > "$OUT/goodput.log" 2>&1
  grep -h "finished run\|goodput  \|checkpoints:" "$OUT/goodput.log"
  metrics "$OUT/runs/goodput" ckpt/stall_s ckpt/write_s
  rm -rf "$OUT/runs/goodput/checkpoints"
  ;;
*)
  echo "bench/restart_gpu.sh: no mode '$1' (reshard, stall, stall7b or goodput)" >&2
  exit 2
  ;;
esac
