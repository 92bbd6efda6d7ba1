"""The live benchmarks of the measured profiles side by side (``all`` rows of each run's summary.json):
speedup over AR (tokens/s ratio over the same runs) with its 95% bootstrap interval, tau, mean depth and V.

    python scripts/profile_table.py docs/results/machines/mainjob-native-2t docs/results/machines/bench-avx2-2t ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    lines = ["| profile (run) | execution | method | speedup vs AR [95% CI] | tok/s | tau | depth | V |",
             "|---|---|---|---|---|---|---|---|"]
    for folder in map(Path, sys.argv[1:]):
        s = json.loads((folder / "summary.json").read_text())
        m, st = s["machine"], s.get("settings", {})
        prof = f"{m['cpu_capability'].lower()}, {m['torch_threads']} threads ({folder.name})"
        ex = f"{st.get('dtype', '?')}{'+int4' if st.get('weights') == 'int4' else ''}"
        for name, r in s["results"]["all"].items():
            lo, hi = r["speedup_total_time_ci95"]
            lines.append(f"| {prof} | {ex} | {name} | {r['speedup_total_time']:.2f}x [{lo:.2f}, {hi:.2f}] | "
                         f"{r['tokens_per_s']:.1f} | {r['tau']:.2f} | {r['mean_depth']:.2f} | {r['mean_v']:.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
