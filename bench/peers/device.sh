#!/usr/bin/env bash
# bench/peers/run.sh on an offline GPU machine, as the issue-59 rows were measured (docs/benchmarks/2026-12-06.md):
# install the carried wheels, run each named run under a time limit, print the table, pack the logs in one archive.
#
#   OUT=DIR [DS=DATASET] [B1B=16] [B125M=32] [T=200] bash bench/peers/device.sh lmtrain-1b olmo-1b titan-1b ...
#
# Carried (git-ignored, made on a machine with the package registry, for Python 3.12 x86-64):
#   .whl/*.whl        lmtrain's own extras: hydra-core, omegaconf, antlr4, torchdata (../shared/gpu/wheels.sh),
#                     torchao 0.18.0 (EXTRA_WHEELS); .whl/ds the default dataset (python -m lmtrain.data.prepare)
#   .gpu/olmo/*.whl   ai2-olmo-core 3.0.0, torchao 0.15.0 and their dependencies the GPU image lacks
#   .gpu/titan/*.whl  torchtitan 0.2.2 and its dependencies (Hugging Face datasets: bench/peers/titan_shim)
#   .gpu/litgpt/*.whl litgpt 0.5.13, jsonargparse 4.41.0, docstring-parser, typeshed-client, torchmetrics, psutil
# Each peer's packages go to their own folder, put before PYTHONPATH for that peer's runs only (run.sh).
set -u
mkdir -p "$OUT/peers"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
install() { [ -d "$1" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$2" "$1"/*.whl 2>&1 | grep -v WARNING | tail -2; }
install .whl /tmp/site
install .gpu/olmo /tmp/olmo-site
install .gpu/titan /tmp/titan-site
install .gpu/litgpt /tmp/litgpt-site
export PYTHONPATH=/tmp/site OLMO_PATH=/tmp/olmo-site TITAN_PATH=/tmp/titan-site LITGPT_PATH=/tmp/litgpt-site
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
for r in "$@"; do
  case "$r" in *-1b*) b=${B1B:-16} ;; *) b=${B125M:-32} ;; esac
  s=$(date +%s)
  DATA=${DS:-$PWD/.whl/ds} OUT=$OUT/peers B=$b timeout "${T:-200}" bash bench/peers/run.sh "$r"
  echo "$r: B=$b $(( $(date +%s) - s )) s"
  grep -m3 "Error\|error:" "$OUT/peers/$r.log" | cut -c1-400
done
python3 bench/peers/rows.py "$OUT/peers" | tee "$OUT/rows.md"
find "$OUT" -type f -size +20M -delete
tar czf "$OUT/peers.tgz" -C "$OUT" peers && rm -rf "$OUT/peers"  # a call returns a few files: one archive
