#!/usr/bin/env bash
# lmtrain beside the trainers a team would pick instead, on one GPU: the same model shape, the same tokens, the same
# hyperparameters, each trainer with its own trainer loop and its own best one-GPU settings (issue 59,
# docs/BENCHMARKS.md). A run is named TRAINER-SHAPE[-fp8]:
#
#   DATA=DATASET OUT=DIR bash bench/peers/run.sh lmtrain-1b olmo-1b titan-1b litgpt-1b lmtrain-1b-fp8 olmo-1b-fp8 titan-1b-fp8
#   python3 bench/peers/rows.py DIR                      # the table: tokens/s, MFU, peak memory, first step, loss
#
# DATASET: an lmtrain prepared dataset (python -m lmtrain.data.prepare), read as it is by every trainer. Shapes:
# 1b, Llama 3.2 1B's body (width 2048, 16 layers, 32 heads sharing 8 key/value heads, SwiGLU 8192) with an untied
# head of 128,256 tokens, as OLMo-core's llama3_1B; 125m, Llama-like width 768, 12 layers, 12 heads, SwiGLU 2048,
# 50,304 tokens. Sequence 2048 (SEQ), B sequences a step (default 4), STEPS steps (30) of which the first WARM (10)
# are not timed; AdamW (0.9, 0.95), weight decay 0.1 (none on embeddings), peak rate LR (3e-4) after 20 warm-up steps,
# cosine to a tenth at the last step, gradient clipping at 1.0, bf16.
#
# lmtrain is run as a user types it (train.py, trainer=gpu: compiled, fused AdamW); OLMo-core by bench/peers/olmo_train.py
# after its own Llama example (its model compiled, FSDP wrapper with bf16 parameters, fused AdamW; with -fp8 its
# cookbook's torchao float8); torchtitan 0.2.2 by its own `torchtitan.train` with the shapes registered by
# bench/peers/titan_configs.py (its Llama 3 model and parallelize function: compiled model and loss, bf16 autocast on
# one GPU, fused AdamW, no activation checkpointing; with -fp8 its float8 converter, the output head left in bf16 as
# its float8 docs do; its AdamW decays every parameter, embeddings included: it has no per-group setting); litgpt 0.5.13
# by its own `litgpt pretrain` with bench/peers/litgpt_SHAPE.yaml and lmtrain's samples (bench/peers/litgpt_data.py:
# its GPT compiled, bf16-mixed, fused AdamW decaying every parameter, its warm-up from 0 and cosine to LR/10, logging
# every step as its pretraining defaults; it has no float8 recipe for pretraining). A peer's packages come from
# OLMO_PATH, TITAN_PATH or LITGPT_PATH (put before PYTHONPATH for its runs only).
set -uo pipefail
: "${DATA:?an lmtrain prepared dataset}"
OUT=${OUT:-/tmp/peers}
SEQ=${SEQ:-2048} B=${B:-4} STEPS=${STEPS:-30} WARM=${WARM:-10} LR=${LR:-3e-4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
HERE=$(cd "$(dirname "$0")/../.." && pwd)
CARD=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')")
L1B="model=llama-1b model.tie_embeddings=false"
L125M="model=llama-1b model.tie_embeddings=false model.d_model=768 model.n_layers=12 model.n_heads=12 model.n_kv_heads=12 model.ffn_dim=2048 model.vocab_size=50304"

launch() {  # NAME TRAINER VERSION SHAPE FP8: what rows.py needs to read the run, and the clock before it starts
  python3 - "$@" <<'EOF' > "$OUT/$1.launch"
import datetime, json, sys, time, os
name, trainer, version, shape, fp8 = sys.argv[1:6]
print(json.dumps({"trainer": trainer, "version": version, "shape": shape, "fp8": fp8 == "1", "seq": int(os.environ["SEQ"]),
                  "batch": int(os.environ["B"]), "warm": int(os.environ["WARM"]), "card": os.environ["CARD"],
                  "run_dir": f"{os.environ['OUT']}/runs/{name}", "launch": time.time(),
                  "launch_local": datetime.datetime.now().isoformat(" ")}))
EOF
}
export SEQ B WARM CARD OUT

for run in "${@:?name the runs: lmtrain-1b olmo-1b ...}"; do  # every name checked before anything runs
  IFS=- read -r trainer shape fp8 <<< "$run"
  case "$trainer" in lmtrain|olmo|titan|litgpt) ;; *) echo "bench/peers/run.sh: no trainer '$trainer' in '$run' (lmtrain, olmo, titan or litgpt)" >&2; exit 2 ;; esac
  case "$shape" in 1b|125m) ;; *) echo "bench/peers/run.sh: no shape '$shape' in '$run' (1b or 125m)" >&2; exit 2 ;; esac
  [ -z "$fp8" ] || [ "$fp8" = fp8 ] || { echo "bench/peers/run.sh: '$run': only -fp8 may follow the shape" >&2; exit 2; }
  [ "$trainer-$fp8" != litgpt-fp8 ] || { echo "bench/peers/run.sh: '$run': litgpt's pretraining has no float8 recipe" >&2; exit 2; }
done
for run in "$@"; do
  IFS=- read -r trainer shape fp8 <<< "$run"
  f=$([ "$fp8" = fp8 ] && echo 1 || echo 0)
  case "$trainer" in
  lmtrain)
    model=$([ "$shape" = 1b ] && echo "$L1B" || echo "$L125M")
    launch "$run" lmtrain "$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null)" "$shape" "$f"
    python3 "$HERE/train.py" trainer=gpu logger=csv $model $([ "$f" = 1 ] && echo speed=fp8) data=prepared "data.path=$DATA" \
      data.seq_len="$SEQ" data.batch_size="$B" trainer.max_steps="$STEPS" optimizer.lr="$LR" scheduler.warmup_steps=20 \
      "run_dir=$OUT/runs/$run" "run_name=$run" trainer.enable_progress_bar=false > "$OUT/$run.log" 2>&1
    ;;
  olmo)
    m=$([ "$shape" = 1b ] && echo "--model llama3_1B --vocab 128256" || echo "--model llama_125M --vocab 50304")
    launch "$run" olmo-core "$(PYTHONPATH=${OLMO_PATH:-}:${PYTHONPATH:-} python3 -c 'import importlib.metadata as m; print(m.version("ai2-olmo-core"))' 2>/dev/null)" "$shape" "$f"
    PYTHONPATH=${OLMO_PATH:-}:${PYTHONPATH:-} torchrun --standalone --nproc-per-node 1 "$HERE/bench/peers/olmo_train.py" "$DATA" $m \
      --seq "$SEQ" --batch "$B" --steps "$STEPS" --lr "$LR" --warmup 20 $([ "$f" = 1 ] && echo --fp8) --out "$OUT/runs/$run" > "$OUT/$run.log" 2>&1
    ;;
  titan)
    launch "$run" torchtitan "$(PYTHONPATH=${TITAN_PATH:-}:${PYTHONPATH:-} python3 -c 'import importlib.metadata as m; print(m.version("torchtitan"))' 2>/dev/null)" "$shape" "$f"
    PYTHONPATH=${TITAN_PATH:-}:$HERE:${PYTHONPATH:-}:$HERE/bench/peers/titan_shim torchrun --standalone --nproc-per-node 1 -m torchtitan.train \
      --experimental.custom_import bench.peers.titan_configs --model.name peers_llama3 --model.flavor "$shape" \
      $([ "$f" = 1 ] && echo --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output) \
      --training.dataset_path "$DATA" --training.local_batch_size "$B" --training.seq_len "$SEQ" --training.steps "$STEPS" \
      --training.max_norm 1.0 --optimizer.lr "$LR" --optimizer.weight_decay 0.1 --lr_scheduler.warmup_steps 20 \
      --lr_scheduler.decay_type cosine --lr_scheduler.min_lr_factor 0.1 --compile.enable --activation_checkpoint.mode none \
      --metrics.log_freq 1 --metrics.disable_color_printing --job.dump_folder "$OUT/runs/$run" > "$OUT/$run.log" 2>&1
    ;;
  litgpt)
    launch "$run" litgpt "$(PYTHONPATH=${LITGPT_PATH:-}:${PYTHONPATH:-} python3 -c 'import importlib.metadata as m; print(m.version("litgpt"))' 2>/dev/null)" "$shape" "$f"
    # its console stamped with the wall clock as it comes (rows.py: the time to the first step); the rest from its csv
    PYTHONPATH=${LITGPT_PATH:-}:$HERE:${PYTHONPATH:-} python3 -m litgpt pretrain --config "$HERE/bench/peers/litgpt_$shape.yaml" \
      --data bench.peers.litgpt_data.LmtrainTokens --data.path "$DATA" --train.micro_batch_size "$B" --train.global_batch_size "$B" \
      --train.max_tokens $((STEPS * B * SEQ)) --train.max_seq_length "$SEQ" --train.lr_warmup_steps 20 --train.max_norm 1.0 \
      --train.min_lr "$(awk "BEGIN { print $LR / 10 }")" --train.save_interval null --eval.interval 1000000 --eval.max_iters 2 \
      --eval.final_validation false --out_dir "$OUT/runs/$run" \
      --optimizer "{\"class_path\": \"torch.optim.AdamW\", \"init_args\": {\"lr\": $LR, \"weight_decay\": 0.1, \"betas\": [0.9, 0.95]}}" 2>&1 \
      | python3 -uc 'import sys, time
for line in sys.stdin: sys.stdout.write(f"{time.time():.3f} {line}")' > "$OUT/$run.log"
    ;;
  esac
  rc=$?
  rm -rf "$OUT/runs/$run/save" "$OUT/runs/$run/checkpoints" "$OUT/runs/$run/final"  # a 1B run's final checkpoint is 18 GB: the disk holds few
  echo "$run: exit $rc"
done
