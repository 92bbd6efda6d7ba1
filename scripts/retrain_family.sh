#!/usr/bin/env bash
# The learned methods (LTD, Re-SpS, RADAR) retrained over the standard latency family for the default model, then the
# transfer table over the family. Every step resumes when rerun (finished LTD stages, the Re-SpS checkpoint, RADAR's
# --resume, the table's finished members). About 60-70 min on 2 CPU cores when the steps run one after another.
#
#   bash scripts/retrain_family.sh [RUNS_DIR]     # default runs/family
#   MODEL=qwen2.5-coder-0.5b bash scripts/retrain_family.sh runs/family-qwen05   # another registered model, its head
#
# Smaller runs (scripts/second_target.sh step 2 uses all of these):
#   TRAIN_CODE=12 TRAIN_CHAT=12 EVAL=8   training prompts per source, evaluation prompts per dataset
#   STEPS=1/3                            a factor on every PPO step count (a Python expression)
#   POLICIES="ltd resps"                 which policies to train (default all three)
#   PARALLEL=1                           LTD and Re-SpS train side by side, one torch thread each
#   RADAR=DIR TABLE_OUT=DIR              the RADAR policy and the output of the transfer table (TABLE=0: no table)
#
# Copy the exported policies next to the head to ship them (the last step prints the commands).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs/family}
MODEL=${MODEL:-smollm2-135m}
STEPS=${STEPS:-1}
TRAIN_CODE=${TRAIN_CODE:-24}
TRAIN_CHAT=${TRAIN_CHAT:-24}
EVAL=${EVAL:-16}
POLICIES=${POLICIES-ltd resps radar}   # empty: none (the table only)
PARALLEL=${PARALLEL:-0}
RADAR=${RADAR:-$R/radar/policy}
TABLE=${TABLE:-1}
TABLE_OUT=${TABLE_OUT:-$R/transfer}
steps() { python3 -c "print(max(1, round($1 * $STEPS)))"; }
has() { [[ " $POLICIES " == *" $1 "* ]]; }
MAIN=src/adaptree/offline/machines/syn-s0.3-g0.03-d0.1-o0.005.json   # a training member (any one will do)
mkdir -p "$R"
export OMP_WAIT_POLICY=PASSIVE
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
# side by side: each training gets one thread; one after another: the process default
pids=()
run() { if [ "$PARALLEL" = 1 ]; then OMP_NUM_THREADS=1 "$@" --threads 1 & pids+=($!); else "$@"; fi; }
# the policies train on exactly the recorded prompts (other counts would record more traces into the folder)
prompts=(--train-code "$TRAIN_CODE" --train-chat "$TRAIN_CHAT" --max-new-tokens 192)

step "1. greedy traces: $TRAIN_CODE+$TRAIN_CHAT training prompts (192 tokens) and $EVAL+$EVAL evaluation" \
  "prompts (128), target features kept"
python3 - "$R" "$MODEL" "$TRAIN_CODE" "$TRAIN_CHAT" "$EVAL" <<'PY'
import sys
import adaptree
from adaptree.data.prompts import humaneval, mt_bench
from adaptree.offline.recording import TrainingPrompts, record_prompts
R, MODEL = sys.argv[1:3]
code, chat, n_eval = map(int, sys.argv[3:6])
p = adaptree.load(MODEL, dtype="bfloat16", weights="float", compile="off", adapt=False)
record_prompts(p, f"{R}/train-traces", TrainingPrompts(train_code=code, train_chat=chat).prompts(), widths=(10,),
               max_depth=12, max_new_tokens=192, feature_dtype="float16")
record_prompts(p, f"{R}/eval-traces", mt_bench()[:n_eval] + humaneval()[:n_eval], widths=(10,), max_depth=12,
               max_new_tokens=128, feature_dtype="float16")
PY

if has ltd; then
  step "2. LTD over the family: cost, match and machine-tree features, relative V, stage-1 depth behind the size policy"
  run adaptree train ltd --model "$MODEL" --dtype bfloat16 --weights float --compile off --traces "$R/train-traces" \
    "${prompts[@]}" --latency "$MAIN" --family standard --costs --match --machine-tree --depth-partner size \
    --depth-steps "$(steps 60000)" --size-steps "$(steps 40000)" --iter-steps "$(steps 30000)" --iterations 2 \
    --out "$R/ltd" --quiet
fi

if has resps; then
  step "3. Re-SpS over the family: relative (depth offset, V factor) actions, max-entropy PPO, argmax at inference"
  run adaptree train resps --model "$MODEL" --dtype bfloat16 --weights float --compile off \
    --traces "$R/train-traces" "${prompts[@]}" --latency "$MAIN" --family standard --costs --match --machine-tree \
    --eval-every 25 --max-entropy --inference-temperature 0 --steps "$(steps 30000)" --out "$R/resps" --quiet
fi
for pid in "${pids[@]}"; do wait "$pid"; done   # the side-by-side trainings; a failed one stops the script

if has radar; then
  step "4. RADAR over the family on greedy-trace episodes, V per depth from each machine"
  RESUME=(); [ -f "$R/radar/train_config.json" ] && RESUME=(--resume)
  OMP_NUM_THREADS=1 adaptree train radar --traces "$R/train-traces" --latency "$MAIN" --family standard --costs \
    --machine-tree --members 64 --alphas 0 --match --out "$R/radar" "${RESUME[@]}"
fi

if [ "$TABLE" = 1 ]; then
  step "5. the transfer table: every method on the family's measured members and a spread of synthetic ones"
  python3 scripts/transfer_table.py --model "$MODEL" --traces "$R/eval-traces" --train-traces "$R/train-traces" \
    --ltd "$R/ltd/policy" --resps "$R/resps/policy" --radar "$RADAR" --out "$TABLE_OUT"
fi

H=src/adaptree/heads/$MODEL
step "done. To ship: rm -rf $H/ltd/depth $H/ltd/size $H/resps $H/radar && cp -r $R/ltd/policy/depth $R/ltd/policy/size $H/ltd/ && mkdir -p $H/resps && cp $R/resps/policy/{config.json,model.safetensors} $H/resps/ && cp -r $R/radar/policy $H/radar"
