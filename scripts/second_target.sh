#!/usr/bin/env bash
# Everything adaptree ships and measures for the second target, Qwen2.5-Coder-0.5B-Instruct, after its head run
# (first pass: OUT=training/qwen2.5-coder-0.5b-head MODEL=qwen2.5-coder-0.5b INTERMEDIATE=2432
#  CORPORA=corpora/qwen2.5-coder-0.5b-greedy CHUNKS=6 EPOCHS=2 SELECT=chain_tau bash scripts/head_full.sh;
#  second pass, from the first's shipped head: OUT=training/qwen2.5-coder-0.5b-head-ep2 MODEL=qwen2.5-coder-0.5b
#  INIT=src/adaptree/heads/qwen2.5-coder-0.5b CORPORA=corpora/qwen2.5-coder-0.5b-greedy CHUNKS=8 EPOCHS=2
#  MAX_STEPS=400 LR=1e-3 SEED=1 SELECT=chain_tau bash scripts/head_full.sh; third pass, the same from the second's
#  with OUT=training/qwen2.5-coder-0.5b-head-ep3 CHUNKS=10 MAX_STEPS=360 SEED=2; fourth pass, the same from the
#  third's with OUT=training/qwen2.5-coder-0.5b-head-ep4 CHUNKS=17 MAX_STEPS=330 SEED=3; then this script with
#  RUN=training/qwen2.5-coder-0.5b-head-ep4),
# in order; rerun from a step with the second argument. Needs `bash scripts/setup.sh --qwen-0.5b --qwen-1.5b`.
#
#   bash scripts/second_target.sh [RUNS_DIR] [FIRST_STEP] [LAST_STEP]    # default runs/qwen05, steps 1-8
#
# Steps 4-7 take wall-clock timings: run them on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs/qwen05}
FROM=${2:-1}
TO=${3:-8}
M=qwen2.5-coder-0.5b
H=src/adaptree/heads/$M
RUN=${RUN:-training/$M-head}   # the head run step 1 ships (the fourth pass: RUN=training/$M-head-ep4)
S=src/adaptree/heads/smollm2-135m
DTYPE=${DTYPE:-bfloat16}       # step 1's validation dtype: float32 where bfloat16 is emulated (AVX2-only CPUs)
mkdir -p "$R"
export OMP_WAIT_POLICY=PASSIVE
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
from() { [ "$1" -ge "$FROM" ] && [ "$1" -le "$TO" ]; }
if from 1; then
  step "1. ship the head as int8 rows; the shipped copy's held-out acceptance (validated before a 1-step run)"
  SRC=$RUN/head   # a finished run's export; a run stopped early ships its best validation's weights
  [ -d "$SRC" ] || SRC=$RUN/best
  python3 scripts/ship_head.py "$SRC" --model "$M" --out "$H" --storage int8
  rm -rf "$R/heldout-int8"
  adaptree train-head --out "$R/heldout-int8" --model "$M" --corpus "corpora/$M-greedy" --corpus-chunks 1 \
    --features online --init-head "$H" --max-steps 1 --ttt-steps 3 --val-steps 8 --select last --threads 2 \
    --dtype "$DTYPE" --train-dtype "$DTYPE"
fi
if from 2; then
  step "2. traces (24 training prompts, 16 evaluation prompts); Re-SpS and LTD retrained over the latency family
  (scripts/retrain_family.sh with smaller counts: a third of its PPO steps, side by side, no RADAR)"
  F=$R/family
  MODEL=$M TRAIN_CODE=12 TRAIN_CHAT=12 EVAL=8 STEPS=1/3 POLICIES="ltd resps" PARALLEL=1 RADAR=$S/radar \
    TABLE_OUT=$F/transfer-retrained bash scripts/retrain_family.sh "$F"
  step "2b. replayed with the default model's LTD and RADAR (transfer across models; the retrained: transfer-retrained)"
  python3 scripts/transfer_table.py --model "$M" --traces "$F/eval-traces" --train-traces "$F/train-traces" \
    --ltd "$S/ltd" --resps "$F/resps/policy" --radar "$S/radar" --out "$F/transfer-smollm2-policies"
fi
if from 3; then
  step "3. ship: Re-SpS retrained; LTD and RADAR transferred (transferred.json), as the replay chose on 2026-11-27"
  rm -rf "$H/resps" && mkdir -p "$H/resps" && cp "$R/family/resps/policy/"{config.json,model.safetensors} "$H/resps/"
fi
if from 4; then
  step "4. the machine setup for this model (timed); its static tree and chain calibration ship with the head"
  adaptree adapt --model "$M" --threads 2 | tee "$R/adapt.txt"
  python3 - "$M" "$H" <<'PY'
import shutil, sys
import adaptree
m, h = sys.argv[1:3]
p = adaptree.load(m, threads=2, adapt=False)
assets = p.machine.assets
shutil.copy(assets["tuned"], f"{h}/static_gs.json")
shutil.copy(assets["chain"], f"{h}/chain.json")
print("copied", assets["tuned"], assets["chain"])
PY
fi
if from 5; then
  step "5. the methods that pay here, greedy, in this machine's default mode (timed; EAGLE-3's 60-node tree and
  DEAGLE model at 0.4x AR here and run in step 8)"
  adaptree bench --model "$M" --methods ar,static-gs,costaware,hybrid,ngram,ltd,radar,resps --limit 2 \
    --max-new-tokens 128 --threads 2 --out "$R/bench-t0"
fi
if from 6; then
  step "6. T=1 (timed)"
  adaptree bench --model "$M" --methods ar,static-gs,costaware,hybrid,ltd,radar,resps --limit 1 --max-new-tokens 128 \
    --temperature 1 --threads 2 --out "$R/bench-t1"
fi
if from 7; then
  step "7. Qwen2.5-Coder-1.5B with the 0.5B as its draft model (timed)"
  adaptree bench --model qwen2.5-coder-1.5b --draft none --draft-model auto --methods ar,draft-model,ngram \
    --limit 2 --max-new-tokens 128 --threads 2 --draft-model-tokens 3 --out "$R/bench-15b"
fi
if from 8; then
  step "8. losslessness: float32 greedy, every method against AR (the cost rules get the setup's latency model)"
  # the setup's latency model and acceptance calibration, from one load
  # (no setup for this model and head on this machine: run step 4 first, or give the rules a shipped profile and
  # step 2's calibrations by hand, as docs/second-target.md's float32 section did on 2026-11-28)
  assets=$(python3 -c "import sys, adaptree
m = adaptree.load('$M', threads=2, adapt=False).machine
if m is None: sys.exit('step 8 needs the machine setup of $M with this head on this machine: run step 4 first')
print(m.assets['latency']); print(m.assets['acceptance'])")
  L=$(sed -n 1p <<< "$assets"); A=$(sed -n 2p <<< "$assets")
  adaptree bench --model "$M" --dtype float32 --weights float --compile off --no-adapt \
    --methods ar,static,static-gs,costaware,hybrid,ngram,deagle,ddd,svip,gammatune,radar,ltd,ltd-depth,ltd-size,resps \
    --limit 2 --turns 1 --max-new-tokens 64 --threads 1 --costaware-latency "$L" --costaware-acceptance "$A" \
    --hybrid-latency "$L" --hybrid-acceptance "$A" --hybrid-chain "$H/chain.json" --ltd-latency "$L" \
    --radar-latency "$L" --resps-latency "$L" --out "$R/bench-fp32"
fi
step "done: results under $R; the head and its assets under $H"
