#!/usr/bin/env bash
# One warm-started head-training pass on a CUDA machine that receives at most 64 MiB per call (this workplace's
# device tool), sized to a time budget. The model file and the training inputs arrive in parts over several calls
# (scripts/gpu_parts.sh makes them); each call copies its part to $W, and the last one runs this script:
#
#   W=$HOME/w OUT=$OUT BUDGET_S=420 bash scripts/gpu_head_pass.sh
#
# $W holds model.part.* (the GGUF file cut in pieces, concatenated here in name order; adaptree checks its sha256)
# and payload.tar (the head to start from, the corpus and the wheels the machine lacks, paths relative to the
# repository). A probe of 30 steps times a step on this machine; the pass gets as many steps as BUDGET_S leaves (at
# most EPOCHS epochs), so its learning-rate schedule ends inside the budget. $OUT gets the exported head cut into
# pieces of at most 15 MiB (the device returns 8 files of 16 MiB at most), the log, the summary and the console.
# Put back together here: cat head.safetensors.part-* > <run>/head/model.safetensors. The device tool copies the
# working tree again on every call, and files the pass wrote inside the repository were gone on the next call: the
# export is also copied to $W/head-<run name>, for a following pass in the same lease (INIT=$W/head-<run name>).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${W:-$HOME/w}
OUT=${OUT:?set OUT to the folder the results go to}
BUDGET_S=${BUDGET_S:-420}         # seconds for the probe and the pass, model loads and validations included
MODEL=${MODEL:-qwen2.5-coder-0.5b}
INIT=${INIT:-src/adaptree/heads/$MODEL}
CORPORA=${CORPORA:-corpora/$MODEL-greedy}
CHUNKS=${CHUNKS:-27}
EPOCHS=${EPOCHS:-2}
LR=${LR:-1e-3}
SEED=${SEED:-5}
RUN=${RUN:-training/$MODEL-head-gpu}
DEVICE=${DEVICE:-cuda}            # DEVICE=cpu DTYPE=float32 PROBE_STEPS=1 MIN_STEPS=1: a dry run of the script on a CPU
DTYPE=${DTYPE:-bfloat16}
PROBE_STEPS=${PROBE_STEPS:-30}
MIN_STEPS=${MIN_STEPS:-50}
MAX_STEPS=${MAX_STEPS:-1000000}   # a cap on the pass's steps (EPOCHS caps it too)
t_start=$(date +%s)
export ADAPTREE_CACHE=${ADAPTREE_CACHE:-$HOME/adaptree-cache}
tar -xf "$W/payload.tar"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
file=$(python3 -c "from adaptree.models.assets import MODELS; print(MODELS['$MODEL'].source.filename)")
mkdir -p "$ADAPTREE_CACHE/files" "$OUT"
cat "$W"/model.part.* > "$ADAPTREE_CACHE/files/$file"
flags=(--model "$MODEL" --corpus "$CORPORA" --corpus-chunks "$CHUNKS" --features online --ckpt-dtype bfloat16
       --lr "$LR" --ttt-steps 3 --draft-vocab 8192 --max-len 1024 --batch-tokens 4096 --seed "$SEED" --threads 8
       --dtype "$DTYPE" --train-dtype "$DTYPE" --device "$DEVICE" --init-head "$INIT")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/console.txt" ||
  echo "no nvidia-smi" > "$OUT/console.txt"
probe=/tmp/probe
rm -rf "$probe"
python3 -m adaptree.cli train-head --out "$probe" "${flags[@]}" --epochs 1 --max-steps "$PROBE_STEPS" \
  --val-every 100000 --ckpt-every 100000 --select last 2>&1 | tr '\r' '\n' | grep -v "^train-head: " | tail -5 |
  tee -a "$OUT/console.txt"
read -r per_step load_s < <(python3 - "$probe" <<'PY'
import json, sys
s = json.load(open(f"{sys.argv[1]}/training_summary.json"))
t = s["throughput"]
print(t["train_seconds"] / t["steps"], s["wall_time_s_this_run"]["total"] - t["train_seconds"])
PY
)
left=$(( BUDGET_S - ($(date +%s) - t_start) ))
# the pass's load and validations cost about 2.5 times the probe's (the probe validates twice, the pass once per 200
# steps), its export about 30 s; train-head caps the steps at EPOCHS epochs itself
steps=$(python3 -c "print(max($MIN_STEPS, min($MAX_STEPS, int(($left - 2.5 * $load_s - 30) / ($per_step * 1.08)))))")
echo "probe: ${per_step} s per step, ${load_s} s load and validation; ${left} s left: ${steps} steps" |
  tee -a "$OUT/console.txt"
rm -rf "$RUN"
set +e
timeout -s TERM $(( left - 20 )) python3 -m adaptree.cli train-head --out "$RUN" "${flags[@]}" --epochs "$EPOCHS" \
  --max-steps "$steps" --val-every 200 --ckpt-every 100 --select chain_tau > /tmp/train.txt 2>&1
rc=$?
set -e
tr '\r' '\n' < /tmp/train.txt | grep -v "^train-head: " | tail -30 >> "$OUT/console.txt"
echo "train-head exit $rc, $(( $(date +%s) - t_start )) s" | tee -a "$OUT/console.txt"
cp "$RUN/train_log.jsonl" "$OUT/" || true
if [ -d "$RUN/head" ]; then rm -rf "$W/head-$(basename "$RUN")" && cp -r "$RUN/head" "$W/head-$(basename "$RUN")"; fi
if [ -f "$RUN/head/model.safetensors" ]; then
  cp "$RUN/training_summary.json" "$RUN/head/config.json" "$OUT/"
  split -b 15M -d "$RUN/head/model.safetensors" "$OUT/head.safetensors.part-"
else  # stopped before its export: the best validation's weights and the run's settings
  cp "$RUN/best/state.json" "$OUT/best-state.json" || true
  cp "$RUN/ckpt/state.json" "$OUT/ckpt-state.json" || true
  split -b 15M -d "$RUN/best/weights.safetensors" "$OUT/best.safetensors.part-" || true
fi
ls -la "$OUT"
