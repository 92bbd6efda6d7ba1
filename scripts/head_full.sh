#!/usr/bin/env bash
# The shipped head for the default model: one run over every committed corpus chunk, features computed in the
# training loop (no feature store), so the run can be handed from machine to machine. Rerun the script to
# continue after an interruption or on a new machine (it adds --resume when a checkpoint is there).
#
#   bash scripts/head_full.sh     # on 2 cores: ~1.1 h per million response tokens and epoch (features + training)
#
# Stop it with Ctrl-C or `kill PID` (SIGTERM): either saves a checkpoint at the step reached.
# Hand-over at the end of a session (the checkpoint is bfloat16: ~63 MB with the optimizer's moments; the run
# folder's .gitignore keeps checkpoints out of ordinary commits):
#   git add -f "$OUT/ckpt" "$OUT/best" "$OUT/train_log.jsonl" && git commit -m "head run: checkpoint at step N"
# (best/: the weights --select would export so far; without it a resumed run cannot export an earlier validation)
# The run finished on 2026-11-24 (docs/head-training.md, "The full run"): its last weights are the shipped head.
# The run is pinned to its corpus chunks (CHUNKS): a corpus that grew since is refused on resume.
#
# The second pass (started 2026-11-25): the shipped head, one more epoch at half the learning rate, batches
# in another order, validated before its first step too (the baseline in this machine's execution):
#   OUT=training/smollm2-135m-head-ep2 INIT=src/adaptree/heads/smollm2-135m LR=1e-3 SEED=1 SELECT=chain_tau DTYPE=float32 \
#     bash scripts/head_full.sh
# DTYPE: the target's and the head's dtype in training; bfloat16 where the CPU has it natively (7.3 s per step on
# AVX-512 with bf16), float32 where it is emulated (AVX2-only CPUs: 13 s per step, bfloat16 ~20x slower there).
# A run may change DTYPE between machines.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-training/smollm2-135m-head}
CORPORA=${CORPORA:-corpora/smollm2-135m-greedy,corpora/smollm2-135m-t1}
CHUNKS=${CHUNKS:-27}
EPOCHS=${EPOCHS:-1}
LR=${LR:-2e-3}
TTT=${TTT:-3}                 # TTT 7 measured no better at 2.2x the time (docs/head-training.md, ablations)
VOCAB=${VOCAB:-8192}
THREADS=${THREADS:-2}
SELECT=${SELECT:-last}         # export the last weights: they saw every token (chain tau 2.17 vs the best, 2.18 at step 1200)
SEED=${SEED:-0}
DTYPE=${DTYPE:-bfloat16}
INIT=${INIT:-}                 # a head folder to start from (warm start), or empty: a fresh head
MODEL=${MODEL:-}               # the target (a registered name); empty: the default SmolLM2-135M-Instruct
INTERMEDIATE=${INTERMEDIATE:-} # the head's MLP width; empty: the target's
MAX_STEPS=${MAX_STEPS:-}       # a cap on optimizer steps (the schedule is fitted to it); empty: EPOCHS decides
extra=()
if [ -n "$MODEL" ]; then extra+=(--model "$MODEL"); fi
if [ -n "$INTERMEDIATE" ]; then extra+=(--head-intermediate "$INTERMEDIATE"); fi
if [ -e "$OUT/ckpt" ] || [ -e "$OUT/ckpt.old" ]; then extra+=(--resume); fi
if [ -n "$INIT" ]; then extra+=(--init-head "$INIT"); fi
if [ -n "$MAX_STEPS" ]; then extra+=(--max-steps "$MAX_STEPS"); fi
adaptree train-head --out "$OUT" --corpus "$CORPORA" --corpus-chunks "$CHUNKS" --features online \
  --ckpt-dtype bfloat16 --epochs "$EPOCHS" --lr "$LR" --ttt-steps "$TTT" --draft-vocab "$VOCAB" --max-len 1024 \
  --batch-tokens 4096 --val-every 200 --ckpt-every 25 --seed "$SEED" --threads "$THREADS" --select "$SELECT" \
  --dtype "$DTYPE" --train-dtype "$DTYPE" "${extra[@]}"
python scripts/head_curve.py "$OUT" --out "$OUT/curve"
