#!/bin/bash
# The execution-mode measurements (docs/performance.md): run alone on an idle machine.
set -x
export OMP_NUM_THREADS=2
# the code before the execution-mode choice runs from a worktree: git worktree add /tmp/base 80f0bc2, with
# src/adaptree/bench/profile.py copied in as src/adaptree/bench/profile_new.py
cd "$(dirname "$0")/.." && mkdir -p runs/execution
COMMON="--limit 3 --turns 1 --max-new-tokens 128 --threads 2 --no-adapt"
# before (base commit 80f0bc2): bf16 and fp32 AR
PYTHONPATH=/tmp/base/src python3 -m adaptree.cli bench --dtype bfloat16 --methods ar $COMMON --out runs/execution/before_bf16 > runs/execution/before_bf16.log 2>&1
PYTHONPATH=/tmp/base/src python3 -c "
import torch; torch.set_num_threads(2)
from adaptree.models.loader import load_model
from adaptree.bench.profile_new import profile_forward, profile_table
m,_ = load_model(None, dtype=torch.bfloat16)
print(profile_table(profile_forward(m, tokens=(1,4,16,64), repeats=20)))" > runs/execution/before_profile.md 2>&1
# after: profiles
for w in float int4; do adaptree profile --dtype bfloat16 --weights $w --threads 2 --no-adapt --out runs/execution/profile_$w > runs/execution/profile_$w.log 2>&1; done
# after: float and int4 side by side with llama.cpp
adaptree bench --dtype bfloat16 --weights float --methods ar,llama_cpp,llama_cpp_lookup $COMMON --out runs/execution/after_float > runs/execution/after_float.log 2>&1
# machine setup for the int4 mode (timed), then the best methods
/usr/bin/time -v adaptree adapt --dtype bfloat16 --weights int4 --threads 2 > runs/execution/adapt_int4.log 2>&1
adaptree bench --dtype bfloat16 --weights int4 --methods ar,static,static-gs,costaware,llama_cpp,llama_cpp_lookup --limit 3 --turns 1 --max-new-tokens 128 --threads 2 --out runs/execution/after_int4 > runs/execution/after_int4.log 2>&1
# torch.compile of decode steps: measured choice (adapt), then compiled and eager side by side with llama.cpp
adaptree adapt --dtype bfloat16 --weights int4 --threads 2 --quiet > runs/execution/adapt_compile.log 2>&1
for c in auto off; do adaptree bench --dtype bfloat16 --weights int4 --compile $c --methods ar,static-gs,costaware,llama_cpp --limit 3 --turns 1 --max-new-tokens 128 --threads 2 --out runs/execution/compile_$c > runs/execution/compile_$c.log 2>&1; done
# AVX2 kernels: before bf16 AR, after float and int4 AR
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
PYTHONPATH=/tmp/base/src python3 -m adaptree.cli bench --dtype bfloat16 --methods ar $COMMON --out runs/execution/avx2_before_bf16 > runs/execution/avx2_before_bf16.log 2>&1
adaptree bench --dtype bfloat16 --weights int4 --methods ar,llama_cpp $COMMON --out runs/execution/avx2_after_int4 > runs/execution/avx2_after_int4.log 2>&1
adaptree bench --dtype float32 --weights float --methods ar $COMMON --out runs/execution/avx2_after_fp32 > runs/execution/avx2_after_fp32.log 2>&1
adaptree profile --dtype bfloat16 --weights int4 --threads 2 --no-adapt --out runs/execution/avx2_profile_int4 > runs/execution/avx2_profile_int4.log 2>&1
echo DONE
