#!/usr/bin/env bash
# Per-GPU throughput of the trainer beside hand-written PyTorch, on 1, 2 and 4 GPUs of one host, in one go.
#
#   RAW_DIR=path/to/shared/bench bash bench/gpu_scaling.sh [MODEL_SIZE=1.3b] [BATCH=32] [STEPS=30]
#
# RAW_DIR holds raw_gpt_baseline.py and raw_fsdp_baseline.py (../shared/bench in the workspace; copy them into a
# git-ignored folder of the checkout to take them to a GPU machine). Rows, in order: raw single GPU, trainer single
# GPU, then for 2 and 4 GPUs raw FSDP2 and the trainer's `fsdp` (and `fsdp` without resharding after forward), and on
# 4 GPUs raw HSDP 2 x 2 and the trainer's `hsdp` launched as two torchrun agents ("nodes") of 2 GPUs (with and
# without resharding after forward). Everything
# goes to $OUT (default /tmp/gpu_scaling) as logs; the last lines printed are the figures. Record them in
# docs/BENCHMARKS.md with the card and these commands. BATCH is per GPU: sharding costs a fixed share of each step,
# so per-GPU scaling depends on it (1.3B on 4 H200s: 0.93-0.94 of one GPU at 16, 0.96 at 32; docs/BENCHMARKS.md).
set -o pipefail
SIZE=${1:-1.3b}
BATCH=${2:-32}
STEPS=${3:-30}
OUT=${OUT:-/tmp/gpu_scaling}
RAW_DIR=${RAW_DIR:?set RAW_DIR to the folder holding raw_gpt_baseline.py and raw_fsdp_baseline.py}
RAW_DIR=$(cd "$RAW_DIR" && pwd)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
declare -A PRESET=([124m]="model=opt-125m" [350m]="model=opt-350m" [1.3b]="model=opt-1.3b model.n_heads=16")
MODEL="trainer=gpu logger=csv ${PRESET[$SIZE]:?unknown size $SIZE} model.dropout=0 model.vocab_size=50304 model.max_seq_len=1024 model.activation=gelu_tanh data.seq_len=1024 data.batch_size=$BATCH scheduler.warmup_steps=5"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
LOG=$OUT/summary.txt
: > "$LOG"
row() { echo "$*" | tee -a "$LOG"; }
raw_single() { (cd "$RAW_DIR" && CUDA_VISIBLE_DEVICES=0 python3 raw_gpt_baseline.py "$SIZE" --compile --batch "$BATCH" --steps "$STEPS") 2>&1 | tail -1; }
raw_fsdp() { (cd "$RAW_DIR" && torchrun --standalone --nproc_per_node="$1" raw_fsdp_baseline.py "$SIZE" --compile --batch "$BATCH" --steps "$STEPS" ${2:+--hsdp $2}) 2>&1 | grep RAWFSDP | tail -1; }
trainer() {  # name nproc args...
  local name=$1 n=$2; shift 2
  LMTRAIN_RUN_ID=$name torchrun --standalone --nproc_per_node="$n" bench/throughput.py --no-raw --dir "/tmp/gs_$name" --steps "$STEPS" --warmup 10 $MODEL "$@" > "$OUT/$name.txt" 2>&1
  grep -E "^\| NVIDIA" "$OUT/$name.txt" | tail -1 || tail -5 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
row "== 1 GPU";  row "raw: $(raw_single)"
row "trainer: $(CUDA_VISIBLE_DEVICES=0 trainer single 1 module.compile=true)"
for n in 2 4; do
  (( NGPU >= n )) || continue
  row "== $n GPUs"; row "raw fsdp: $(raw_fsdp $n)"
  row "trainer fsdp: $(trainer fsdp$n $n strategy=fsdp module.compile=true trainer.devices=$n)"
  row "trainer fsdp, reshard_after_forward=false: $(trainer fsdpnr$n $n strategy=fsdp module.compile=true trainer.devices=$n strategy.reshard_after_forward=false)"
done
if (( NGPU >= 4 )); then
  row "== 4 GPUs as 2 nodes x 2"; row "raw hsdp: $(raw_fsdp 4 2)"
  for NR in true false; do  # strategy.reshard_after_forward
    A="bench/throughput.py --no-raw --dir /tmp/gs_h22$NR --steps $STEPS --warmup 10 $MODEL strategy=hsdp module.compile=true trainer.devices=2 trainer.num_nodes=2 strategy.reshard_after_forward=$NR"
    R="--nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:29517 --rdzv-id=gs_h22$NR"
    CUDA_VISIBLE_DEVICES=2,3 LMTRAIN_RUN_ID=gs_h22$NR torchrun $R $A > "$OUT/h22${NR}_node1.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=0,1 LMTRAIN_RUN_ID=gs_h22$NR torchrun $R $A > "$OUT/h22${NR}_node0.txt" 2>&1
    wait
    row "trainer hsdp (2 torchrun nodes), reshard_after_forward=$NR: $(grep -hE '^\| NVIDIA' "$OUT"/h22${NR}_node*.txt | tail -1)"
  done
fi
