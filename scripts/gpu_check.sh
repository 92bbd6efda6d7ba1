#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): forward curve, machine setup, fp32 losslessness of every method and a short
# bench with the reference arms on a CUDA machine, in a few minutes, into one folder of at most 8 files.
#
#   bash scripts/gpu_check.sh [OUT] [more gpu_check.py flags]     # OUT default: gpu-check
#
# Works from an installed adaptree or from a checkout (PYTHONPATH=src plus its dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
shift || true
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_check.py --out "$OUT" "$@"
