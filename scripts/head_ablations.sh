#!/usr/bin/env bash
# The recipe ablations for the default model's head, each measured on held-out acceptance.
# Every arm trains on the same first $CHUNKS chunks of the committed greedy corpus with one shared feature
# store (features extracted once), and is resumable: rerun the script after an interruption.
#
#   CHUNKS=3 EPOCHS=3 bash scripts/head_ablations.sh                      # ~30 min per arm on 2 cores
#   ARMS="base ttt3" CHUNKS=3 EPOCHS=3 bash scripts/head_ablations.sh     # only these arms
#
# It ends with the table and plot (scripts/head_curve.py) in docs/results/head-training/ablations.{md,png,json}.
set -euo pipefail
CHUNKS=${CHUNKS:-4}
EPOCHS=${EPOCHS:-1}
THREADS=${THREADS:-2}
OUT=${OUT:-runs/ablate}
ARMS=${ARMS:-base lr1e-3 lr5e-3 ttt3 vocab16k ttt3-vocab16k plus-t1 plus-sharegpt}
GREEDY=corpora/smollm2-135m-greedy
SAMPLED=corpora/smollm2-135m-t1          # adaptree corpus grow --out $SAMPLED --temperature 1 --chunks $CHUNKS
SHAREGPT=corpora/smollm2-135m-sharegpt   # adaptree corpus grow --out $SHAREGPT --source sharegpt --chunks $CHUNKS

arm() {  # arm NAME [train-head flags...]
  local name=$1; shift
  case " $ARMS " in *" $name "*) ;; *) return ;; esac
  local resume=()
  if [ -e "$OUT/$name/ckpt" ] || [ -e "$OUT/$name/ckpt.old" ]; then resume=(--resume); fi
  if [ -e "$OUT/$name/training_summary.json" ]; then echo "== $name: done"; return; fi
  echo "== $name"
  adaptree train-head --out "$OUT/$name" --features "$OUT/features" --corpus-chunks "$CHUNKS" \
    --epochs "$EPOCHS" --max-len 1024 --batch-tokens 4096 --val-every 50 --seed 0 --threads "$THREADS" \
    "${resume[@]}" "$@"
}

arm base      --corpus $GREEDY --ttt-steps 7 --lr 2e-3 --draft-vocab 8192
arm lr1e-3    --corpus $GREEDY --ttt-steps 7 --lr 1e-3 --draft-vocab 8192
arm lr5e-3    --corpus $GREEDY --ttt-steps 7 --lr 5e-3 --draft-vocab 8192
arm ttt3      --corpus $GREEDY --ttt-steps 3 --lr 2e-3 --draft-vocab 8192
arm vocab16k  --corpus $GREEDY --ttt-steps 7 --lr 2e-3 --draft-vocab 16384
arm ttt3-vocab16k --corpus $GREEDY --ttt-steps 3 --lr 2e-3 --draft-vocab 16384
if [ -f $SAMPLED/manifest.json ]; then
  arm plus-t1 --corpus $GREEDY,$SAMPLED --ttt-steps 7 --lr 2e-3 --draft-vocab 8192
fi
if [ -f $SHAREGPT/manifest.json ]; then
  arm plus-sharegpt --corpus $GREEDY,$SHAREGPT --ttt-steps 7 --lr 2e-3 --draft-vocab 8192
fi
runs=()
for d in "$OUT"/*/; do [ -f "$d/training_summary.json" ] && runs+=("$(basename "$d")=$d"); done
python scripts/head_curve.py "${runs[@]}" --out docs/results/head-training/ablations
