#!/usr/bin/env bash
# FP8 matmuls, the document mask's FlexAttention kernel and fused output heads on one GPU, each beside the plain
# PyTorch baseline run in the same call on the same card (docs/BENCHMARKS.md).
#
#   RAW=path/to/raw_gpt_baseline.py bash bench/fast_paths_gpu.sh fp8      # opt-1.3b: raw, bf16 (with the inline raw loop), fp8 tensorwise
#   bash bench/fast_paths_gpu.sh rowwise                                   # opt-1.3b: fp8 rowwise (beside the fp8 run's baselines)
#   RAW=... bash bench/fast_paths_gpu.sh mask                              # opt-1.3b at seq 2048: raw, and the trainer with and without data.document_mask
#   RAW=... bash bench/fast_paths_gpu.sh small                             # opt-125m at batch 64: raw, bf16, fp8 tensorwise
#   bash bench/fast_paths_gpu.sh head                                      # opt-1.3b: the plain head against liger-kernel's fused one
#   bash bench/fast_paths_gpu.sh fsdp                                      # 2 GPUs: opt-1.3b fp8 under fsdp vs one GPU; llama-7b fp8 under fsdp
#   RAW=... bash bench/fast_paths_gpu.sh fp8big                            # opt-1.3b: raw at batch 16 and 24, fp8 profiled, fp8 with the fused head at batch 24
#   RAW=... bash bench/fast_paths_gpu.sh fp8accum                          # opt-1.3b: raw at batch 32, fp8 + fused head at batch 48 with and without fast accumulation
#   RAW=... bash bench/fast_paths_gpu.sh small32                           # opt-125m: raw at batch 32, bf16 with and without the fused head
#   bash bench/fast_paths_gpu.sh op7b                                      # 2 GPUs: llama-7b bf16 at batch 2, checkpointing by operator beside selective
#   bash bench/fast_paths_gpu.sh op7bfp8                                   # 2 GPUs: llama-7b fp8, checkpointing by operator, batch 3 and 2
#   bash bench/fast_paths_gpu.sh op7bfast                                  # 2 GPUs: llama-7b fp8, checkpointing by operator, batch 2, with and without module.fp8_fast_accum
#   bash bench/fast_paths_gpu.sh op7bfused                                 # 2 GPUs: llama-7b fp8 fast, checkpointing by operator, batch 2, torchao's MLP layers against module.fp8_fused_mlp (SwiGLU)
#   bash bench/fast_paths_gpu.sh alloc7b                                   # 2 GPUs: llama-7b fp8 without checkpointing, with and without expandable segments
#   bash bench/fast_paths_gpu.sh allocop7b                                 # 2 GPUs: llama-7b, checkpointing by operator, bf16 and fp8 at batch 2, with and without expandable segments
#   bash bench/fast_paths_gpu.sh fsdp7b                                    # 2 GPUs: opt-1.3b fp8 scaling at batch 32; llama-7b in fp8 and bf16, batch 2-3, checkpointing selective, op or none
#   bash bench/fast_paths_gpu.sh loss                                      # opt-1.3b, 1,000 steps in bf16 and in fp8: the loss curves
#   bash bench/fast_paths_gpu.sh lossfast                                  # 2 GPUs: the same, fp8 with module.fp8_fast_accum=true
#   RAW=... bash bench/fast_paths_gpu.sh fp8head                           # opt-1.3b: raw at batch 48, fp8 + fast accumulation at batch 48 with the fused bf16 head and with the head in fp8
#   RAW=... bash bench/fast_paths_gpu.sh smallhead                         # opt-125m at batch 64: raw, bf16, the output head alone in fp8
#   RAW=... bash bench/fast_paths_gpu.sh fp8headcap                        # the same under an 80 GB H100's memory (CAP_GIB=79.1, bench/memory_cap): raw at batch 32, fp8 fast at 48 with either head, the fp8 head at 40
#   RAW=... bash bench/fast_paths_gpu.sh fp8chunk                          # opt-1.3b: raw at batch 48, fp8 fast at 48 with the head in fp8 whole and chunked (module.loss_chunk_tokens)
#   RAW=... bash bench/fast_paths_gpu.sh fp8chunkcap                       # under an 80 GB H100's memory: raw at batch 32, fp8 fast at 48 with the liger head and with the chunked fp8 head
#   RAW=... bash bench/fast_paths_gpu.sh smallchunk                        # opt-125m at batch 64: raw, the output head alone in fp8 and chunked
#   bash bench/fast_paths_gpu.sh fsdpchunk                                  # 2 GPUs: opt-1.3b fp8 fast with the chunked fp8 head under fsdp (batch 32; 48 keeping the gathered parameters) vs one GPU
#   bash bench/fast_paths_gpu.sh fsdpfused                                  # 2 GPUs: the same at batch 48 without resharding, with module.fp8_fused_mlp (its weights gathered in float8) vs one GPU
#   bash bench/fast_paths_gpu.sh fp8chunkprof                               # opt-1.3b fp8 fast with the chunked fp8 head at batch 48, 3 steps profiled: the kernels by device time
#   RAW=... bash bench/fast_paths_gpu.sh fusedmlp                          # opt-1.3b: raw at batch 48, fp8 fast + chunked fp8 head at 48 with torchao's MLP layers and with module.fp8_fused_mlp
#   RAW=... bash bench/fast_paths_gpu.sh fusedmlpcap                       # the same under an 80 GB H100's memory (CAP_GIB=79.1): raw at batch 32
#   LOSS_GPU=1 bash bench/fast_paths_gpu.sh losshead                       # opt-1.3b, 1,000 steps in bf16 and in fp8 with fast accumulation and the head in fp8, both on GPU $LOSS_GPU
#   bash bench/fast_paths_gpu.sh lossfresh                                 # 2 GPUs: the same 1,000 steps on a corpus read once (stdlib + transformers sources): bf16 and fp8 fast on GPU 0, fp8 fast with the head in fp8 on GPU 1
#   bash bench/fast_paths_gpu.sh gather8                                   # one GPU: opt-1.3b under fsdp on one rank, bf16 and fp8 tensorwise, with and without resharding after the forward pass: what keeping the gathered weights costs in each (the planner counts the blocks' linear weights at 1 B in float8)
#   RAW=... bash bench/fast_paths_gpu.sh targets1                          # one GPU, issue 19's single-GPU targets in one call (about 7 min): raw 124m; opt-125m in bf16 with the baseline's tanh GELU and with exact GELU, and the head alone in float8, chunked (batch 64, tanh GELU); raw 1.3b at 32 and opt-1.3b with every fast setting at 48
#   bash bench/fast_paths_gpu.sh targets2                                  # 2 GPUs, its 2-GPU targets in one call (about 8 min): llama-7b in bf16 and in fp8 with the fused MLP (op checkpointing, batch 2); opt-1.3b with every fast setting under fsdp (batch 48, gathered parameters kept) vs one GPU
#   bash bench/fast_paths_gpu.sh lossfused                                 # 2-3 GPUs: the same corpus read once: bf16 on GPU 0; fp8 fast with the chunked float8 head, with torchao's MLP layers and with module.fp8_fused_mlp, on GPU 1 (or 1 and 2)
#
# Logs go to $OUT (default /tmp/fast_paths); the table rows printed at the end are the figures.
set -euo pipefail
OUT=${OUT:-/tmp/fast_paths}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RAW=${RAW:-../shared/bench/raw_gpt_baseline.py}
M13="trainer=gpu logger=csv model=opt-1.3b model.n_heads=16 model.dropout=0 model.vocab_size=50304 model.max_seq_len=2048 module.compile=true scheduler.warmup_steps=5"
M125="trainer=gpu logger=csv model=opt-125m model.dropout=0 model.vocab_size=50304 model.max_seq_len=1024 module.compile=true optimizer.lr=2e-4 scheduler.warmup_steps=30"

bench() {  # NAME ARGS... [--launcher]: one bench/throughput.py run (under torchrun on 2 GPUs with --launcher), its log kept, its row printed; TMO=seconds caps it
  local name=$1
  shift
  local cmd=(python3)
  if [ "${*: -1}" = "--launcher" ]; then
    cmd=(torchrun --standalone --nproc_per_node=2)
    set -- "${@:1:$(($# - 1))}"
  fi
  timeout "${TMO:-0}" "${cmd[@]}" bench/throughput.py "$@" > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -30 "$OUT/$name.log"; return 0; }
  echo "$name $(grep '^| NVIDIA' "$OUT/$name.log")"
}

raw() {  # NAME ARGS...: the shared raw baseline
  local name=$1
  shift
  timeout "${TMO:-0}" python3 "$RAW" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -20 "$OUT/$name.log"; return 0; }
  echo "$name $(tail -2 "$OUT/$name.log" | tr '\n' ' ')"
}

llama7b() {  # PRECISION-CHECKPOINTING-bBATCH [noexpand] (PRECISION: bf16, fp8, fp8fast with module.fp8_fast_accum, fp8fused with it and module.fp8_fused_mlp): one llama-7b run at seq 4096 under fsdp on 2 GPUs (12 steps)
  # The short runs climb to optimizer.lr in 4 steps, and a 7B model spikes under such a warmup even at 3e-5 (bf16 and
  # fp8 alike, docs/BENCHMARKS.md): the divergence detector is left out, as throughput does not depend on the loss.
  # noexpand: without expandable segments (runs default to them: lmtrain.training.run), to see the allocator's share.
  local name=$1 precision ac batch
  IFS=- read -r precision ac batch <<< "$name"
  local fp8=null fast=false fused=false
  [ "$precision" = fp8 ] && fp8=tensorwise
  [ "$precision" = fp8fast ] && fp8=tensorwise fast=true
  [ "$precision" = fp8fused ] && fp8=tensorwise fast=true fused=true
  [ "$ac" = sel ] && ac=selective
  (
  if [ "${2:-}" = noexpand ]; then name=$name-noexpand; export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False; fi
  LMTRAIN_RUN_ID=$name TMO=150 bench "$name-7b" --no-raw --dir "/tmp/$name" --steps 12 --warmup 4 \
    trainer=gpu logger=csv model=llama-7b data.seq_len=4096 strategy=fsdp strategy.compile=true strategy.init_device=meta \
    trainer.devices=2 optimizer.lr=3e-5 scheduler.warmup_steps=4 ~callbacks.divergence \
    module.fp8=$fp8 module.fp8_fast_accum=$fast module.fp8_fused_mlp=$fused data.batch_size="${batch#b}" strategy.activation_checkpointing="$ac" --launcher
  )
}

for mode in "$@"; do  # every mode checked before any runs: a misspelled one is an error, not a silent no-op
  awk -v m="$mode" 'match($0, /^[[:alnum:]_|]+\)/) { n = split(substr($0, 1, RLENGTH - 1), l, "|"); for (i = 1; i <= n; i++) if (l[i] == m) found = 1 } END { exit !found }' "$0" || { echo "bench/fast_paths_gpu.sh: no mode '$mode' (the modes are listed at the top of the script)" >&2; exit 2; }
done
for mode in "${@:?fp8, rowwise, mask, head, small, fp8big, fp8accum, small32, fsdp, fsdp7b, op7b, op7bfp8, op7bfast, op7bfused, alloc7b, allocop7b, loss, lossfast, fp8head, fp8headcap, smallhead, fp8chunk, fp8chunkcap, smallchunk, fsdpchunk, fsdpfused, fp8chunkprof, fusedmlp, fusedmlpcap, losshead, lossfresh, lossfused, targets1 or targets2}"; do
case "$mode" in
fp8)
  raw raw-1.3b 1.3b --compile --batch 16 --steps 30
  bench bf16-1.3b --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16
  bench fp8tw-1.3b --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16 module.fp8=tensorwise
  ;;
rowwise)
  bench fp8rw-1.3b --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16 module.fp8=rowwise
  ;;
mask)
  raw raw-1.3b-2048 1.3b --compile --batch 8 --seq 2048 --steps 30
  bench nomask-2048 --no-raw --steps 30 --warmup 10 $M13 data.seq_len=2048 data.batch_size=8
  bench mask-2048 --no-raw --steps 30 --warmup 10 $M13 data.seq_len=2048 data.batch_size=8 data.document_mask=true
  ;;
head)
  bench plain-head-1.3b --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16
  bench liger-head-1.3b --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16 module.loss_kernel=liger
  ;;
small)
  raw raw-124m 124m --compile --batch 64 --steps 40
  bench bf16-125m --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64
  bench fp8tw-125m --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 module.fp8=tensorwise
  ;;
fsdp)  # 2 GPUs: opt-1.3b fp8 under fsdp against fp8 on one GPU of the same host; the llama-7b preset at seq 4096 in fp8
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  L7="trainer=gpu logger=csv model=llama-7b data.seq_len=4096 data.batch_size=2 strategy=fsdp strategy.compile=true strategy.init_device=meta strategy.activation_checkpointing=selective trainer.devices=2 scheduler.warmup_steps=5 module.fp8=tensorwise"
  LMTRAIN_RUN_ID=f7 bench fp8-7b-fsdp2 --no-raw --dir /tmp/f7 --steps 16 --warmup 6 $L7 --launcher
  LMTRAIN_RUN_ID=f13 bench fp8-1.3b-fsdp2 --no-raw --dir /tmp/f13 --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16 strategy=fsdp strategy.compile=true trainer.devices=2 module.fp8=tensorwise --launcher
  CUDA_VISIBLE_DEVICES=0 bench fp8-1.3b-1gpu --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=16 module.fp8=tensorwise
  ;;
fp8big)
  raw raw-1.3b 1.3b --compile --batch 16 --steps 30
  bench fp8tw-1.3b-prof --no-raw --steps 30 --warmup 10 --profile 3 $M13 data.seq_len=1024 data.batch_size=16 module.fp8=tensorwise
  bench fp8tw-liger-1.3b-b24 --no-raw --steps 30 --warmup 10 $M13 data.seq_len=1024 data.batch_size=24 module.fp8=tensorwise module.loss_kernel=liger
  raw raw-1.3b-b24 1.3b --compile --batch 24 --steps 30
  ;;
fp8accum)  # opt-1.3b fp8 with the fused head at batch 48 against raw at its largest batch (32), with and without fast accumulation
  raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 20
  F48="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.loss_kernel=liger"
  TMO=200 bench fp8-liger-b48 $F48
  TMO=200 bench fp8fast-liger-b48 $F48 module.fp8_fast_accum=true
  ;;
fp8head)  # opt-1.3b fp8 with fast accumulation at batch 48: the fused bf16 head against the plain head in fp8, beside raw at the same batch
  raw raw-1.3b-b48 1.3b --compile --batch 48 --steps 20
  F48="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true"
  TMO=200 bench fp8fast-liger-b48 $F48 module.loss_kernel=liger
  TMO=200 bench fp8fast-all-b48 $F48 module.fp8_layers=all
  ;;
fp8headcap)  # fp8head under the memory of an 80 GB H100 on a larger card: each process's allocator capped at CAP_GIB (bench/memory_cap)
  export PYTHONPATH=$PWD/bench/memory_cap${PYTHONPATH:+:$PYTHONPATH} CAP_GIB=${CAP_GIB:-79.1}
  TMO=100 raw raw-1.3b-b32-cap 1.3b --compile --batch 32 --steps 20
  F="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 module.fp8=tensorwise module.fp8_fast_accum=true"
  TMO=150 bench fp8fast-liger-b48-cap $F data.batch_size=48 module.loss_kernel=liger
  TMO=150 bench fp8fast-all-b48-cap $F data.batch_size=48 module.fp8_layers=all
  TMO=150 bench fp8fast-all-b40-cap $F data.batch_size=40 module.fp8_layers=all
  unset CAP_GIB
  ;;
fp8chunk)  # opt-1.3b fp8 with fast accumulation at batch 48: the head in fp8 whole against chunked (module.loss_chunk_tokens), beside raw at the same batch
  raw raw-1.3b-b48 1.3b --compile --batch 48 --steps 20
  F48="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all"
  TMO=200 bench fp8fast-all-b48 $F48
  TMO=200 bench fp8fast-allchunk-b48 $F48 module.loss_chunk_tokens=8192
  ;;
fp8chunkcap)  # fp8chunk under an 80 GB H100's memory (CAP_GIB, as fp8headcap): raw at batch 32, fp8 fast at batch 48 with the fused bf16 head and with the chunked fp8 head
  export PYTHONPATH=$PWD/bench/memory_cap${PYTHONPATH:+:$PYTHONPATH} CAP_GIB=${CAP_GIB:-79.1}
  TMO=100 raw raw-1.3b-b32-cap 1.3b --compile --batch 32 --steps 20
  F="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true"
  TMO=200 bench fp8fast-liger-b48-cap $F module.loss_kernel=liger
  TMO=200 bench fp8fast-allchunk-b48-cap $F module.fp8_layers=all module.loss_chunk_tokens=8192
  unset CAP_GIB
  ;;
fsdpchunk)  # 2 GPUs: opt-1.3b fp8 fast with the chunked float8 head under fsdp (float8 all-gather, per-block compile), each against one GPU of the same host
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  F="--no-raw $M13 data.seq_len=1024 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192"
  FS="strategy=fsdp strategy.compile=true trainer.devices=2"
  LMTRAIN_RUN_ID=fc32 TMO=230 bench fp8chunk-fsdp2-b32 --dir /tmp/fc32 --steps 24 --warmup 8 $F data.batch_size=32 $FS --launcher
  CUDA_VISIBLE_DEVICES=0 TMO=200 bench fp8chunk-1gpu-b32 --steps 24 --warmup 8 $F data.batch_size=32
  LMTRAIN_RUN_ID=fc48 TMO=230 bench fp8chunk-fsdp2-b48-nr --dir /tmp/fc48 --steps 16 --warmup 6 $F data.batch_size=48 $FS strategy.reshard_after_forward=false --launcher
  CUDA_VISIBLE_DEVICES=0 TMO=200 bench fp8chunk-1gpu-b48 --steps 16 --warmup 6 $F data.batch_size=48
  ;;
gather8)  # one GPU: the peak with every gathered parameter kept (strategy.reshard_after_forward=false) minus the peak without, in bf16 and in fp8 tensorwise (float8 all-gather)
  G="--no-raw --steps 10 --warmup 4 $M13 data.seq_len=1024 data.batch_size=16 strategy=fsdp strategy.compile=true trainer.devices=1"
  for fp8 in null tensorwise; do
    for nr in true false; do TMO=150 bench "gather-fp8$fp8-reshard$nr" $G module.fp8=$fp8 strategy.reshard_after_forward=$nr; done
  done
  ;;
targets1)  # one GPU: issue 19's single-GPU targets, each beside its raw baseline (opt-125m >= 45% MFU; opt-1.3b in FP8 >= 1.2x raw)
  TMO=100 raw raw-124m-b64 124m --compile --batch 64 --steps 40
  # the baseline's model (tanh GELU; the opt default, exact GELU, cost 1.4% at this size on an H200), then the opt default
  TMO=120 bench bf16tanh-125m-b64 --no-raw --steps 40 --warmup 10 $M125 model.activation=gelu_tanh data.seq_len=1024 data.batch_size=64
  TMO=120 bench bf16-125m-b64 --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64
  TMO=120 bench headchunk-125m-b64 --no-raw --steps 40 --warmup 10 $M125 model.activation=gelu_tanh data.seq_len=1024 data.batch_size=64 module.fp8=tensorwise module.fp8_layers=head module.loss_chunk_tokens=16384
  TMO=100 raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 20
  TMO=200 bench fastest-1.3b-b48 --no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192 module.fp8_fused_mlp=true
  ;;
speedfp8)  # one GPU: speed=fp8 as a user types it (issue 44's targets: 1.35x raw at 1.3B, 1.05x at 125M), each beside its raw baseline
  TMO=100 raw raw-1.3b-b32 1.3b --compile --batch 32 --steps 20
  TMO=200 bench speedfp8-1.3b-b48 --no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 speed=fp8
  TMO=100 raw raw-124m-b64 124m --compile --batch 64 --steps 40
  TMO=120 bench speedfp8-125m-b64 --no-raw --steps 40 --warmup 10 $M125 model.activation=gelu_tanh data.seq_len=1024 data.batch_size=64 speed=fp8
  ;;
targets2)  # 2 GPUs: issue 19's 2-GPU targets (llama-7b >= 50% MFU in bf16 and >= 13K tokens/s per GPU in FP8; opt-1.3b fsdp >= 0.95 of one GPU in FP8)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in bf16-op-b2 fp8fused-op-b2; do llama7b "$run"; done
  ;&  # then fsdpfused's runs
fsdpfused)  # 2 GPUs: opt-1.3b fp8 fast, the chunked float8 head and the fused float8 MLP under fsdp at batch 48 without resharding, against one GPU of the same host
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  F="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192 module.fp8_fused_mlp=true"
  LMTRAIN_RUN_ID=ff48 TMO=230 bench fused-fsdp2-b48-nr --dir /tmp/ff48 $F strategy=fsdp strategy.compile=true trainer.devices=2 strategy.reshard_after_forward=false --launcher
  CUDA_VISIBLE_DEVICES=0 TMO=200 bench fused-1gpu-b48 $F
  ;;
fp8chunkprof)  # opt-1.3b fp8 fast with the chunked float8 head at batch 48: 3 steps profiled after the timed ones, the kernel table per step
  TMO=300 bench fp8chunk-prof-b48 --no-raw --dir /tmp/fcprof --steps 12 --warmup 4 --profile 3 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192
  python3 bench/trace_gaps.py /tmp/fcprof/trainer/profile/trace_rank0.json --kernels 45 --steps 3 > "$OUT/fp8chunk-prof-b48-kernels.txt"
  head -48 "$OUT/fp8chunk-prof-b48-kernels.txt"
  ;;
fusedmlp)  # opt-1.3b fp8 fast with the chunked float8 head at batch 48: torchao's MLP layers against the fused float8 MLP (lmtrain.nn.float8_mlp), beside raw at the same batch
  raw raw-1.3b-b48 1.3b --compile --batch 48 --steps 20
  F48="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192"
  TMO=200 bench fp8chunk-b48 $F48
  TMO=200 bench fp8chunk-fusedmlp-b48 $F48 module.fp8_fused_mlp=true
  ;;
fusedmlpcap)  # fusedmlp under an 80 GB H100's memory (CAP_GIB, as fp8headcap): raw at its largest batch there, 32
  export PYTHONPATH=$PWD/bench/memory_cap${PYTHONPATH:+:$PYTHONPATH} CAP_GIB=${CAP_GIB:-79.1}
  TMO=100 raw raw-1.3b-b32-cap 1.3b --compile --batch 32 --steps 20
  F48="--no-raw --steps 16 --warmup 6 $M13 data.seq_len=1024 data.batch_size=48 module.fp8=tensorwise module.fp8_fast_accum=true module.fp8_layers=all module.loss_chunk_tokens=8192"
  TMO=200 bench fp8chunk-b48-cap $F48
  TMO=200 bench fp8chunk-fusedmlp-b48-cap $F48 module.fp8_fused_mlp=true
  unset CAP_GIB
  ;;
smallchunk)  # opt-125m at batch 64: the output head alone in fp8, chunked, beside raw
  raw raw-124m 124m --compile --batch 64 --steps 40
  bench fp8headchunk-125m --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 module.fp8=tensorwise module.fp8_layers=head module.loss_chunk_tokens=16384
  ;;
smallhead)  # opt-125m at batch 64: the output head alone in fp8 (a quarter of the model's FLOPs at this width), beside bf16 and raw
  raw raw-124m 124m --compile --batch 64 --steps 40
  bench bf16-125m --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64
  bench fp8head-125m --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 module.fp8=tensorwise module.fp8_layers=head
  ;;
small32)
  raw raw-124m-b32 124m --compile --batch 32 --steps 40
  bench bf16-125m-b32 --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=32
  bench liger-125m-b32 --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=32 module.loss_kernel=liger
  bench liger-125m-b64 --no-raw --steps 40 --warmup 10 $M125 data.seq_len=1024 data.batch_size=64 module.loss_kernel=liger
  ;;
fsdp7b)  # 2 GPUs: llama-7b at seq 4096 in fp8 and bf16; opt-1.3b fp8 scaling at batch 32 per GPU
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  LMTRAIN_RUN_ID=b13 TMO=150 bench fp8-1.3b-fsdp2-b32 --no-raw --dir /tmp/b13 --steps 24 --warmup 8 $M13 data.seq_len=1024 data.batch_size=32 strategy=fsdp strategy.compile=true trainer.devices=2 module.fp8=tensorwise --launcher
  CUDA_VISIBLE_DEVICES=0 TMO=140 bench fp8-1.3b-1gpu-b32 --no-raw --steps 24 --warmup 8 $M13 data.seq_len=1024 data.batch_size=32 module.fp8=tensorwise
  for run in fp8-sel-b2 bf16-sel-b2 fp8-sel-b3 fp8-none-b2 bf16-sel-b3 bf16-op-b2 fp8-op-b3; do llama7b "$run"; done
  llama7b fp8-none-b2 noexpand
  ;;
op7b)  # 2 GPUs: llama-7b in bf16 with checkpointing by operator, beside the selective row it replaces
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in bf16-sel-b2 bf16-op-b2; do llama7b "$run"; done
  ;;
op7bfused)  # 2 GPUs: llama-7b in fp8 fast with checkpointing by operator at batch 2, torchao's MLP layers against the fused float8 SwiGLU MLP
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in fp8fast-op-b2 fp8fused-op-b2; do llama7b "$run"; done
  ;;
op7bfast)  # 2 GPUs: llama-7b in fp8 with checkpointing by operator at batch 2, with and without fast accumulation
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in fp8fast-op-b2 fp8-op-b2; do llama7b "$run"; done
  ;;
op7bfp8)  # 2 GPUs: llama-7b in fp8 with checkpointing by operator, batch 3 and 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in fp8-op-b3 fp8-op-b2; do llama7b "$run"; done
  ;;
alloc7b)  # 2 GPUs: llama-7b near the card's limit (fp8, no checkpointing, batch 2), with and without expandable segments
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  llama7b fp8-none-b2
  llama7b fp8-none-b2 noexpand
  ;;
allocop7b)  # 2 GPUs: llama-7b with checkpointing by operator (bf16 and fp8 at batch 2), with and without expandable segments
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  for run in fp8-op-b2 bf16-op-b2; do llama7b "$run"; llama7b "$run" noexpand; done
  ;;
loss|lossfast|losshead|lossfresh|lossfused)  # loss: bf16 and fp8 tensorwise, both on one GPU; lossfast: bf16 on GPU 0, fp8 with fast accumulation on GPU 1; losshead: bf16 and fp8 with fast accumulation and the head in fp8, both on GPU $LOSS_GPU; lossfresh, lossfused: see the top
  L="$M13 data.seq_len=1024 data.batch_size=8 optimizer.lr=2e-4 scheduler.warmup_steps=100 trainer.max_steps=1000 trainer.val_check_interval=500 trainer.limit_val_batches=20 trainer.enable_progress_bar=false callbacks.checkpoint.every_n_steps=0 callbacks.disk_guard.margin_gb=0 paths.runs=$OUT/runs"
  # the runs at once (about 30 GiB each): the loss curves do not depend on speed; the timings of these runs are not figures
  case "$mode" in
  loss) runs=(null tensorwise); gpus=(0 0) ;;
  lossfast) runs=(null tensorwise-fast); gpus=(0 1) ;;
  losshead) runs=(null tensorwise-fast-all); gpus=("${LOSS_GPU:-0}" "${LOSS_GPU:-0}") ;;
  lossfresh | lossfused)
    runs=(null tensorwise-fast tensorwise-fast-all); gpus=(0 0 1)
    if [ "$mode" = lossfused ]; then
      runs=(null tensorwise-fast-all-chunk tensorwise-fast-all-chunk-fused) gpus=(0 1 1)
      n=$(nvidia-smi -L | wc -l)
      [ "$n" -ge 3 ] && gpus=(0 1 2)  # a GPU each where there are 3: about 5 min instead of 8
      [ "$n" -ge 4 ] && runs+=(tensorwise-fast-all-chunk-fused-again) gpus+=(3)  # and the fused run twice: its own spread
    fi
    # The embedded corpus is read 6-7 times in 1,000 steps of 8 x 1024 tokens; this one is read less than once.
    python3 - "$OUT/fresh.jsonl" <<'EOF'
import importlib.util, json, pathlib, sys, sysconfig
roots = [pathlib.Path(sysconfig.get_paths()["stdlib"])]
spec = importlib.util.find_spec("transformers")
if spec and spec.origin:
    roots.append(pathlib.Path(spec.origin).parent)
size = 0
with open(sys.argv[1], "w") as out:
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip() and size < 64e6:
                out.write(json.dumps({"text": text}) + "\n")
                size += len(text)
print(f"fresh corpus: {size / 1e6:.1f} M characters from {', '.join(map(str, roots))}")
EOF
    python3 -m lmtrain.data.prepare --input "$OUT/fresh.jsonl" --output "$OUT/fresh" --val-fraction 0.02 --workers 8 > "$OUT/fresh-prepare.log" 2>&1 || { tail "$OUT/fresh-prepare.log"; exit 1; }
    python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); t = m["splits"]["train"]["num_tokens"]; print(f"train tokens {t:,}, read {8192000 / t:.2f} times in 1,000 steps"); sys.exit(t < 8192000 + 1025)' "$OUT/fresh/manifest.json" || exit 1
    L+=" data=prepared data.path=$OUT/fresh"
    rm -f "$OUT/fresh.jsonl"
    ;;
  esac
  for i in "${!runs[@]}"; do
    fp8=${runs[$i]%%-*}
    extra=""
    [[ ${runs[$i]} == *-fast* ]] && extra+=" module.fp8_fast_accum=true"
    [[ ${runs[$i]} == *-all* ]] && extra+=" module.fp8_layers=all"
    [[ ${runs[$i]} == *-chunk* ]] && extra+=" module.loss_chunk_tokens=8192"
    [[ ${runs[$i]} == *-fused* ]] && extra+=" module.fp8_fused_mlp=true"
    (  # each run's metrics copied as it ends: kept if a time limit stops the others
      CUDA_VISIBLE_DEVICES=${gpus[$i]} python3 train.py $L module.fp8=$fp8 $extra run_name=loss-${runs[$i]} > "$OUT/loss-${runs[$i]}.log" 2>&1
      cp "$OUT/runs/loss-${runs[$i]}/csv/metrics.csv" "$OUT/metrics-${runs[$i]}.csv" 2>/dev/null
      rm -rf "$OUT/runs/loss-${runs[$i]}/checkpoints"
    ) &
  done
  wait || true
  for run in "${runs[@]}"; do
    grep -h "finished run\|Error" "$OUT/loss-$run.log" || tail -20 "$OUT/loss-$run.log"
  done
  python3 - "$OUT" "${runs[@]}" <<'EOF'
import csv, sys
out, base, *others = sys.argv[1:]
def series(name, key):
    return {int(r["step"]): float(r[key]) for r in csv.DictReader(open(f"{out}/metrics-{name}.csv")) if r.get(key)}
def mean(values):
    return sum(values) / len(values)
bf = series(base, "train/loss")
for low in others:
    f8 = series(low, "train/loss")
    for lo in range(0, 1000, 100):
        a = mean([bf[s] for s in range(lo, lo + 100) if s in bf]); b = mean([f8[s] for s in range(lo, lo + 100) if s in f8])
        print(f"steps {lo:4d}-{lo + 99:4d}  bf16 {a:.4f}  {low} {b:.4f}  ratio {b / a:.4f}")
    vb, vf = series(base, "val/loss"), series(low, "val/loss")
    print("val/loss bf16", vb, low, vf)
    last = max(vb)
    print(f"LOSS final val: bf16 {vb[last]:.4f} {low} {vf[last]:.4f} ratio {vf[last] / vb[last]:.4f}")
EOF
  ;;
esac
done
