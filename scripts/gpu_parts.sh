#!/usr/bin/env bash
# The parts scripts/gpu_head_pass.sh receives, one per call of the device tool (64 MiB at most per call, the
# travelling tree included): DEST/p1 .. DEST/pN, each to be named in one call's `carry`. p1 holds payload.tar (the
# head to start from, the corpora, and the wheels the GPU machine's image lacks) and the first piece of the
# model file; the others hold the next pieces (model.part.NN, concatenated in name order there).
#
#   MODEL=qwen2.5-coder-0.5b CAP=$((62*1024*1024)) bash scripts/gpu_parts.sh .gpu
#
# CAP: bytes per part, 64 MiB less what travels with every call anyway (measure it: the device tool refuses a call
# over 64 MiB). DEST must be git-ignored (e.g. listed in .git/info/exclude) so that only `carry` takes it along.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
INIT=${INIT:-src/adaptree/heads/$MODEL}
CORPORA=${CORPORA:-corpora/$MODEL-greedy}
CAP=${CAP:-$((62 * 1024 * 1024))}
mkdir -p "$DEST"
if ! git check-ignore -q "$DEST/"; then
  echo "$DEST is not git-ignored: it would travel with every call; add /$DEST/ to .git/info/exclude" >&2
  exit 2
fi
rm -rf "$DEST"
mkdir -p "$DEST/stage/.whl" "$DEST/p1"
# what `adaptree train-head` imports that the GPU image lacks (its command line builds every subcommand's flags,
# the LTD trainer's among them), at the versions installed here
WHEELS=${WHEELS:-gguf gymnasium stable-baselines3 farama-notifications}
for w in $WHEELS; do
  v=$(python3 -c "import importlib.metadata as m; print(m.version('$w'))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$DEST/stage/.whl" "$w==$v"
done
IFS=, read -r -a corpora <<< "$CORPORA"
tar -cf "$DEST/payload.tar" --exclude=.work "$INIT/config.json" "$INIT/model.safetensors" "${corpora[@]}"
tar -rf "$DEST/payload.tar" -C "$DEST/stage" .whl
mv "$DEST/payload.tar" "$DEST/p1/"
rm -rf "$DEST/stage"
file=$(python3 -c "from adaptree.models.assets import resolve_model; print(resolve_model('$MODEL'))")
python3 - "$file" "$DEST" "$CAP" <<'PY'
import os, sys
src, dest, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
room = cap - os.path.getsize(f"{dest}/p1/payload.tar")  # p1 carries the payload and the first piece
n = 0
with open(src, "rb") as f:
    while True:
        piece = f.read(room if n == 0 else cap)
        if not piece:
            break
        os.makedirs(f"{dest}/p{n + 1}", exist_ok=True)
        with open(f"{dest}/p{n + 1}/model.part.{n:02d}", "wb") as out:
            out.write(piece)
        n += 1
print(f"{n} parts of at most {cap} bytes in {dest}: {src} ({os.path.getsize(src)} bytes) and the payload")
PY
du -sb "$DEST"/p*
