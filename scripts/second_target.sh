#!/usr/bin/env bash
# Everything adaptree ships and measures for the second target, Qwen2.5-Coder-0.5B-Instruct, after its head run
# (OUT=training/qwen2.5-coder-0.5b-head MODEL=qwen2.5-coder-0.5b INTERMEDIATE=2432
#  CORPORA=corpora/qwen2.5-coder-0.5b-greedy CHUNKS=6 EPOCHS=2 SELECT=chain_tau bash scripts/head_full.sh),
# in order; rerun from a step with the second argument. Needs `bash scripts/setup.sh --qwen-0.5b --qwen-1.5b`.
#
#   bash scripts/second_target.sh [RUNS_DIR] [FIRST_STEP]    # default runs/qwen05, step 1
#
# Steps 4-7 take wall-clock timings: run them on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs/qwen05}
FROM=${2:-1}
M=qwen2.5-coder-0.5b
H=src/adaptree/heads/$M
S=src/adaptree/heads/smollm2-135m
mkdir -p "$R"
export OMP_WAIT_POLICY=PASSIVE
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }
from() { [ "$1" -ge "$FROM" ]; }
if from 1; then
  step "1. ship the head as int8 rows; the shipped copy's held-out acceptance (validated before a 1-step run)"
  python3 scripts/ship_head.py "training/$M-head/head" --model "$M" --out "$H" --storage int8
  rm -rf "$R/heldout-int8"
  adaptree train-head --out "$R/heldout-int8" --model "$M" --corpus "corpora/$M-greedy" --corpus-chunks 1 \
    --features online --init-head "$H" --max-steps 1 --ttt-steps 3 --val-steps 8 --select last --threads 2
fi
if from 2; then
  step "2. LTD, Re-SpS, RADAR retrained over the latency family on this model's traces (half the PPO steps)"
  MODEL=$M STEPS=0.5 bash scripts/retrain_family.sh "$R/family"
  step "2b. the default model's LTD and RADAR policies replayed on this model's traces (transfer across models)"
  python3 scripts/transfer_table.py --model "$M" --traces "$R/family/eval-traces" \
    --train-traces "$R/family/train-traces" --ltd "$S/ltd" --radar "$S/radar" --resps "$R/family/resps/policy" \
    --out "$R/family/transfer-smollm2-policies"
fi
if from 3; then
  step "3. ship the retrained policies next to the head"
  rm -rf "$H/ltd" "$H/resps" "$H/radar" && mkdir -p "$H/ltd" "$H/resps"
  cp -r "$R/family/ltd/policy/depth" "$R/family/ltd/policy/size" "$H/ltd/"
  cp "$R/family/resps/policy/"{config.json,model.safetensors} "$H/resps/"
  cp -r "$R/family/radar/policy" "$H/radar"
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
METHODS=ar,static,static-gs,costaware,hybrid,ngram,deagle,ddd,svip,gammatune,radar,ltd,ltd-depth,ltd-size,resps
if from 5; then
  step "5. every method, greedy, in this machine's default mode (timed)"
  adaptree bench --model "$M" --methods "$METHODS" --limit 2 --max-new-tokens 128 --threads 2 --out "$R/bench-t0"
fi
if from 6; then
  step "6. every method, T=1 (timed)"
  adaptree bench --model "$M" --methods "$METHODS" --limit 2 --max-new-tokens 128 --temperature 1 --threads 2 \
    --out "$R/bench-t1"
fi
if from 7; then
  step "7. Qwen2.5-Coder-1.5B with the 0.5B as its draft model (timed)"
  adaptree bench --model qwen2.5-coder-1.5b --draft none --draft-model auto --methods ar,draft-model,ngram \
    --limit 2 --max-new-tokens 128 --threads 2 --out "$R/bench-15b"
fi
if from 8; then
  step "8. losslessness: float32 greedy, every method against AR (and the 1.5B's draft-model)"
  adaptree bench --model "$M" --dtype float32 --weights float --compile off --no-adapt --methods "$METHODS" \
    --limit 1 --turns 1 --max-new-tokens 64 --threads 2 --out "$R/bench-fp32"
fi
step "done: results under $R; the head and its assets under $H"
