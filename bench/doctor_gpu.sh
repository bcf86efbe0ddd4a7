#!/usr/bin/env bash
# lmtrain doctor on one GPU beside a plain matmul loop and copy run in the same call (docs/BENCHMARKS.md), and the
# watchdog catching a hang injected into a GPU run.
#
#   bash bench/doctor_gpu.sh
#
# Everything goes to $OUT (default /tmp/doctor_gpu); the last lines printed are the figures.
set -uo pipefail
OUT=${OUT:-/tmp/doctor_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m lmtrain doctor --json "$OUT/doctor.json" > "$OUT/doctor.log" 2>&1
echo "doctor exit $?"
cat "$OUT/doctor.log"
python3 - "$OUT/doctor.json" <<'PY'
import json, sys
import torch
sys.path.insert(0, ".")
from tests.test_doctor import _plain_loops
(me,) = json.load(open(sys.argv[1]))["ranks"]
flops, nbytes = _plain_loops(torch.device("cuda"))
print(f"matmul: doctor {me['matmul_flops'] / 1e12:.1f} TFLOP/s, plain 8192^3 bf16 loop (700 products) {flops / 1e12:.1f} ({me['matmul_flops'] / flops:.3f}); card {me['card_flops'] / 1e12:.1f}")
print(f"memory: doctor {me['memory_bytes'] / 1e9:.0f} GB/s, plain 1-GiB D2D copy (2,000 copies) {nbytes / 1e9:.0f} ({me['memory_bytes'] / nbytes:.3f}); card {me['card_bytes'] / 1e9:.0f}")
PY
timeout 300 python3 train.py trainer=gpu model=tiny trainer.devices=1 logger=csv callbacks.disk_guard.margin_gb=0 \
  trainer.max_steps=40 scheduler.total_steps=40 scheduler.warmup_steps=1 fault=hang callbacks.fault.step=20 \
  callbacks.watchdog.timeout_s=30 paths.runs="$OUT/runs" run_name=gpuhang > "$OUT/hang.log" 2>&1
echo "hang run exit $? (5: reported by the watchdog)"
grep -h '"hang"' "$OUT/runs/gpuhang/logbook.jsonl" | cut -c1-400 || echo "no hang entry in $OUT/runs/gpuhang/logbook.jsonl"
