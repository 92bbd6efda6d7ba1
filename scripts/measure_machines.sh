#!/usr/bin/env bash
# The machine setup made from scratch on three "machines" made from this one (native kernels, AVX2-only
# kernels, one thread), timed; each profile's setup (latency model, execution mode, modelled methods) is copied
# into docs/results/machines/<profile>/. Run with an empty $ADAPTREE_CACHE/machines and nothing else running.
set -euo pipefail
out=${1:-docs/results/machines}
cache=${ADAPTREE_CACHE:-$HOME/.cache/adaptree}
run() {  # profile, environment (VAR=value ...), threads
  local name=$1 envs=$2 threads=$3
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086
  /usr/bin/time -f "%e s wall" -o "$out/$name/time.txt" env $envs adaptree adapt --threads "$threads" --quiet --json \
    > "$out/$name/setup.json"
  local folder
  folder=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['folder'])" "$out/$name/setup.json")
  cp "$folder/latency.json" "$folder/static_gs.json" "$out/$name/"
  ls "$cache"/machines/execution-*.json >/dev/null 2>&1 && cp -n "$cache"/machines/execution-*.json "$out/$name/" || true
  echo "$name: $(cat "$out/$name/time.txt")"
}
run native-2t "" 2
run avx2-2t "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" 2
run native-1t "" 1
# every setup made above (the execution candidates too), one folder per kernel level, threads and execution mode
python3 - "$cache" "$out" <<'PY'
import json, shutil, sys
from pathlib import Path
cache, out = Path(sys.argv[1]), Path(sys.argv[2])
for setup in sorted((cache / "machines").glob("*/setup.json")):
    d = json.loads(setup.read_text())
    fp = d["fingerprint"]
    name = f"{fp['cpu_capability'].lower()}-{fp['torch_threads']}t-{fp['dtype']}{'-int4' if fp.get('weights') == 'int4' else ''}"
    dst = out / "profiles" / name
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("setup.json", "latency.json", "static_gs.json"):
        shutil.copy(setup.parent / f, dst / f)
    print(name, d["default_method"], d["static_tree"])
PY
# no machine paths in the results
grep -rl "$cache" "$out" | xargs -r sed -i "s#$cache#\$ADAPTREE_CACHE#g"
