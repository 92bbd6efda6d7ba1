#!/usr/bin/env bash
# The context benchmark: where answers copy their context (MT-bench second turns, long pasted ShareGPT texts,
# edits of HumanEval solutions) next to where they do not (MT-bench first turns, HumanEval): the head-only
# methods, prompt lookup on the engine (ngram), the hybrid and transformers' prompt lookup (the outside
# reference), greedy with the oracle (and its chain variant), then T=1. Resumes when rerun.
#
#   bash scripts/bench_context.sh [RUNS_DIR] [PROMPTS_PER_DATASET]   # default runs/context, 5
#   DTYPE=float32 bash scripts/bench_context.sh runs/context-fp32 8  # every arm's greedy output is AR's
#
# Float weights (--weights float): the transformers arm runs the same float weights (the machine setup may
# prefer the GGUF's 4-bit ones). Run it on an otherwise idle machine: every number is wall-clock.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs/context}
N=${2:-5}
DTYPE=${DTYPE:-auto}   # auto: the dtype this machine runs fastest (bf16 outputs differ between arms on near-ties)
M=ar,static,static-gs,costaware,ngram,hybrid,hf_prompt_lookup
D=mt_bench,humaneval,sharegpt_long,code_edit
mkdir -p "$R"
export OMP_WAIT_POLICY=PASSIVE   # no spinning threads between forwards
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }

step "machine setup (latency model, acceptance and chain calibrations; cached)"
adaptree adapt --dtype "$DTYPE" --weights float --quiet --json > "$R/setup.json"
LAT=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['folder'] + '/latency.json')" "$R/setup.json")

step "greedy, with the oracle"
adaptree bench --dtype "$DTYPE" --weights float --methods "$M" --datasets "$D" --limit "$N" --max-new-tokens 128 --reference hybrid \
  --oracle-latency "$LAT" --out "$R/greedy"

step "T=1"
adaptree bench --dtype "$DTYPE" --weights float --methods "$M" --datasets "$D" --limit "$N" --max-new-tokens 128 --reference hybrid \
  --temperature 1 --out "$R/t1"
