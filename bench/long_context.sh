#!/usr/bin/env bash
# Long context on one GPU (issue 60): the llama-1b preset at 8K, 16K, 32K and 64K tokens a sequence, batch 1, with
# each activation-checkpointing choice, as a user types it (trainer=gpu: compiled, bf16; strategy=fsdp on one rank,
# where strategy.activation_checkpointing lives): tokens/s, MFU and peak memory from bench/throughput.py, or the
# error that stopped the run (out of memory: it does not fit).
#
#   [DATA=DATASET] [SEQS="8192 16384"] [ACS="none full"] bash bench/long_context.sh
#
# DATA: an lmtrain prepared dataset (default: the preset's own data config); SEQS, ACS: the rows to run (default
# 8192 16384 32768 65536 x none selective full offload); STEPS (12, of which the first 4 are not timed). Everything goes to
# $OUT (default /tmp/long_context); the rows are printed last and written to $OUT/rows.md. The longest context that
# fits is the longest sequence with a row. Record them in docs/BENCHMARKS.md with the card and this command.
set -o pipefail
SEQS=${SEQS:-8192 16384 32768 65536}
ACS=${ACS:-none selective full offload}
STEPS=${STEPS:-12}
OUT=${OUT:-/tmp/long_context}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DATA_ARGS=${DATA:+data=prepared data.path=$DATA}
: > "$OUT/rows.md"
for seq in $SEQS; do
  for ac in $ACS; do
    name=llama-1b-$seq-$ac
    python3 bench/throughput.py --no-raw --dir "$OUT/runs/$name" --steps "$STEPS" --warmup 4 trainer=gpu logger=csv \
      model=llama-1b model.max_seq_len="$seq" $DATA_ARGS data.seq_len="$seq" data.batch_size=1 \
      strategy=fsdp strategy.activation_checkpointing="$ac" scheduler.warmup_steps=2 > "$OUT/$name.txt" 2>&1
    row=$(grep -E "^\| NVIDIA" "$OUT/$name.txt" | tail -1)
    if [ -z "$row" ]; then
      why=$(grep -m1 -oE "OutOfMemoryError|CUDA out of memory|[A-Za-z]+Error: .{0,160}" "$OUT/$name.txt")
      row="| $seq | $ac | did not run: ${why:-see $name.txt} |"
    else
      row="| $seq | $ac ${row#| }"
    fi
    echo "$row" | tee -a "$OUT/rows.md"
    rm -rf "$OUT/runs/$name/checkpoints"
  done
done
