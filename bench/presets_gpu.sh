#!/usr/bin/env bash
# The speed presets on one GPU, each beside the plain PyTorch baseline run in the same call on the same card
# (docs/BENCHMARKS.md). A comparison is named by what it compares:
#
#   RAW=path/to/raw_gpt_baseline.py bash bench/presets_gpu.sh default    # speed=default (trainer=gpu, nothing else) at 1.3B and 125M, beside raw compiled bf16
#   RAW=... bash bench/presets_gpu.sh fp8                                 # speed=fp8 at 1.3B and 125M (the head's chunk 8,192 and 16,384), beside raw
#   RAW=... bash bench/presets_gpu.sh typed                               # opt-1.3b as typed at batch 32 and auto, then without its dropout, then with 16 heads
#   bash bench/presets_gpu.sh loss                                        # opt-1.3b, 1,000 steps in speed=default and in speed=fp8 at once: the loss curves
#   bash bench/presets_gpu.sh goodput                                     # opt-1.3b, 1,000 steps with validation every 250 (3 batches) and the default checkpointing
#   bash bench/presets_gpu.sh fsdp                                        # 2 GPUs: opt-1.3b speed=fp8 under fsdp against one GPU
#   RAW=... bash bench/presets_gpu.sh rerun                               # 125M raw shape with the suspect-step rerun on and off, beside raw
#
# "as typed" rows are the command a user types (the opt-1.3b preset: OPT's 32 heads, its 50,272-token vocabulary,
# dropout 0.1); "raw shape" rows use the raw baseline's model (16 heads, 50,304 tokens, no dropout, tanh GELU at 125M)
# so that the ratio compares the same arithmetic. Logs go to $OUT (default /tmp/presets); the rows printed are the
# figures.
set -euo pipefail
OUT=${OUT:-/tmp/presets}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RAW=${RAW:-../shared/bench/raw_gpt_baseline.py}
M13="trainer=gpu logger=csv model=opt-1.3b model.n_heads=16 model.dropout=0 model.vocab_size=50304 model.max_seq_len=1024 scheduler.warmup_steps=5"
M125="trainer=gpu logger=csv model=opt-125m model.dropout=0 model.vocab_size=50304 model.max_seq_len=1024 model.activation=gelu_tanh optimizer.lr=2e-4 scheduler.warmup_steps=30"

bench() {  # NAME ARGS... [--launcher]: one bench/throughput.py run (under torchrun on 2 GPUs with --launcher), its log kept, its row printed
  local name=$1
  shift
  local cmd=(python3)
  if [ "${*: -1}" = "--launcher" ]; then
    cmd=(torchrun --standalone --nproc_per_node=2)
    set -- "${@:1:$(($# - 1))}"
  fi
  timeout "${TMO:-0}" "${cmd[@]}" bench/throughput.py --no-raw --dir "/tmp/presets-$name" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -30 "$OUT/$name.log"; return 0; }
  echo "$name $(grep '^| NVIDIA' "$OUT/$name.log") $(grep -h 'speed \|batch_size=auto' "$OUT/$name.log" | tr '\n' ' ')"
}

raw() {  # NAME ARGS...: the shared raw baseline
  local name=$1
  shift
  timeout "${TMO:-0}" python3 "$RAW" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -20 "$OUT/$name.log"; return 0; }
  echo "$name $(tail -2 "$OUT/$name.log" | tr '\n' ' ')"
}

for mode in "$@"; do  # every mode checked before any runs: a misspelled one is an error, not a silent no-op
  awk -v m="$mode" 'match($0, /^[[:alnum:]_|]+\)/) { n = split(substr($0, 1, RLENGTH - 1), l, "|"); for (i = 1; i <= n; i++) if (l[i] == m) found = 1 } END { exit !found }' "$0" || { echo "bench/presets_gpu.sh: no mode '$mode' (the modes are listed at the top of the script)" >&2; exit 2; }
done
for mode in "${@:?default, fp8, loss, goodput or fsdp}"; do
case "$mode" in
default)
  raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 25
  bench default-1.3b-as-typed --steps 20 --warmup 8 trainer=gpu logger=csv model=opt-1.3b data.seq_len=1024 scheduler.warmup_steps=5
  bench default-1.3b-raw-shape --steps 20 --warmup 8 $M13 data.seq_len=1024
  bench default-1.3b-raw-shape-b32 --steps 25 --warmup 8 $M13 data.seq_len=1024 data.batch_size=32
  raw raw-124m-b64 124m --compile --batch 64 --steps 40
  bench default-125m-raw-shape --steps 30 --warmup 10 $M125 data.seq_len=1024
  bench default-125m-raw-shape-b64 --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64
  ;;
typed)  # what each of the preset's differences from the raw model costs, at the raw baseline's batch
  A="trainer=gpu logger=csv model=opt-1.3b data.seq_len=1024 scheduler.warmup_steps=5 data.batch_size=32"
  raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 25
  bench typed-b32 --steps 25 --warmup 8 $A
  bench typed-auto --steps 20 --warmup 8 ${A% data.batch_size=32}
  bench typed-dropout0 --steps 25 --warmup 8 $A model.dropout=0
  bench typed-heads16 --steps 25 --warmup 8 $A model.n_heads=16
  ;;
fp8)
  raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 25
  bench fp8-1.3b-b48 --steps 25 --warmup 8 speed=fp8 $M13 data.seq_len=1024 data.batch_size=48
  bench fp8-1.3b-auto --steps 20 --warmup 8 speed=fp8 $M13 data.seq_len=1024
  raw raw-124m-b64 124m --compile --batch 64 --steps 40
  bench fp8-125m-b64 --steps 40 --warmup 10 speed=fp8 $M125 data.seq_len=1024 data.batch_size=64
  bench fp8-125m-b64-chunk16k --steps 40 --warmup 10 speed=fp8 $M125 data.seq_len=1024 data.batch_size=64 module.head.chunk_tokens=16384
  ;;
rerun)  # what the divergence detector's rerun of a suspect step costs a healthy run (its loss read before the backward)
  raw raw-124m-b64 124m --compile --batch 64 --steps 40
  bench rerun-on-125m-b64 --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 callbacks.divergence.rerun=true
  bench rerun-off-125m-b64 --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 callbacks.divergence.rerun=false
  ;;
fsdp)  # 2 GPUs: opt-1.3b speed=fp8 under fsdp against one GPU of the same host
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  bench fp8-1.3b-one --steps 25 --warmup 8 speed=fp8 $M13 data.seq_len=1024 data.batch_size=48
  LMTRAIN_RUN_ID=pf2 bench fp8-1.3b-fsdp2 --steps 25 --warmup 8 speed=fp8 $M13 data.seq_len=1024 data.batch_size=48 strategy=fsdp strategy.reshard_after_forward=false trainer.devices=2 --launcher
  ;;
goodput)  # the run as a user runs it (train.py, the default callbacks and checkpointing): its summary's goodput line
  timeout "${TMO:-0}" python3 train.py trainer=gpu logger=csv model=opt-1.3b data.seq_len=1024 data.batch_size=16 trainer.max_steps=1000 \
    scheduler.warmup_steps=100 trainer.val_check_interval=250 trainer.limit_val_batches=3 trainer.enable_progress_bar=false \
    paths.runs="$OUT/runs" run_name=goodput > "$OUT/goodput.log" 2>&1 || { echo "goodput FAILED"; tail -30 "$OUT/goodput.log"; }
  grep -h "goodput\|finished run" "$OUT/goodput.log" || tail -20 "$OUT/goodput.log"
  cp "$OUT/runs/goodput/logbook.jsonl" "$OUT/runs/goodput/metrics.jsonl" "$OUT/" 2>/dev/null || true  # each save's figures (ckpt/*)
  rm -rf "$OUT/runs"  # the device tool brings back few files: the two above and the log are the record
  ;;
loss)  # both runs at once (the curves do not depend on speed; their timings are not figures)
  L="trainer=gpu logger=csv model=opt-1.3b data.seq_len=1024 data.batch_size=8 optimizer.lr=2e-4 scheduler.warmup_steps=100 trainer.max_steps=1000 trainer.val_check_interval=500 trainer.limit_val_batches=20 trainer.enable_progress_bar=false callbacks.checkpoint.every_n_steps=0 callbacks.disk_guard.margin_gb=0 paths.runs=$OUT/runs"
  for preset in default fp8; do
    (  # each run's metrics copied as it ends: kept if a time limit stops the other
      timeout "${TMO:-0}" python3 train.py $L speed=$preset run_name=loss-$preset > "$OUT/loss-$preset.log" 2>&1
      cp "$OUT/runs/loss-$preset/csv/metrics.csv" "$OUT/metrics-$preset.csv" 2>/dev/null
      rm -rf "$OUT/runs/loss-$preset/checkpoints"
    ) &
  done
  wait || true
  for preset in default fp8; do grep -h "finished run\|Error" "$OUT/loss-$preset.log" || tail -20 "$OUT/loss-$preset.log"; done
  python3 - "$OUT" <<'PY'
import csv, sys
out = sys.argv[1]
def series(name, key):
    return {int(r["step"]): float(r[key]) for r in csv.DictReader(open(f"{out}/metrics-{name}.csv")) if r.get(key)}
def mean(values):
    return sum(values) / len(values)
bf, f8 = series("default", "train/loss"), series("fp8", "train/loss")
for lo in range(0, 1000, 100):
    a, b = mean([bf[s] for s in range(lo, lo + 100) if s in bf]), mean([f8[s] for s in range(lo, lo + 100) if s in f8])
    print(f"steps {lo:4d}-{lo + 99:4d}  default {a:.4f}  fp8 {b:.4f}  ratio {b / a:.4f}")
vb, vf = series("default", "val/loss"), series("fp8", "val/loss")
last = max(vb)
print(f"LOSS final val: default {vb[last]:.4f} fp8 {vf[last]:.4f} ratio {vf[last] / vb[last]:.4f}")
PY
  ;;
esac
done
