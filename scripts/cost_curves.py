"""The measured profiles' cost curves side by side (docs/results/machines/profiles/*/latency.json):
one AR step, the draft step, verification of V nodes relative to one AR step, the cost features a policy sees,
and what the setup chose there. Writes cost_curves.md and cost_curves.png next to the profiles.

    python scripts/cost_curves.py [docs/results/machines]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from adaptree.offline.family import cost_features  # noqa: E402
from adaptree.offline.latency import LatencyModel  # noqa: E402

L = 256
SIZES = [0, 1, 2, 4, 8, 16, 32, 64]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/machines")
    rows, fig = [], plt.figure(figsize=(7, 4.5))
    lines = ["| profile | AR step ms | draft step ms (W10) | verify(V)/AR step, V = " + ", ".join(map(str, SIZES[1:]))
             + " | cost features | static tree here | default method |", "|---|---|---|---|---|---|---|"]
    for prof in sorted(p for p in (root / "profiles").iterdir() if (p / "latency.json").is_file()):
        lat = LatencyModel.load(prof / "latency.json")
        setup = json.loads((prof / "setup.json").read_text())
        ar = lat.verify_time(0, L) + lat.other_s
        rel = [lat.verify_time(v, L) / ar for v in SIZES]
        t = setup["static_tree"]
        lines.append(f"| {prof.name} | {ar * 1e3:.1f} | {lat.draft_step(10, L) * 1e3:.2f} | "
                     + " ".join(f"{r:.2f}" for r in rel[1:]) + " | "
                     + ", ".join(f"{x:.3f}" for x in cost_features(lat)) + f" | D{t['depth']} V{t['size']} | "
                     f"{setup['default_method']} |")
        plt.plot(SIZES, rel, marker="o", label=prof.name)
        rows.append({"profile": prof.name, "ar_ms": ar * 1e3, "verify_over_ar": dict(zip(SIZES, rel)),
                     "cost_features": cost_features(lat), "static_tree": t, "default": setup["default_method"]})
    plt.xscale("symlog", linthresh=1)
    plt.xlabel("verified nodes V")
    plt.ylabel("verification time / AR step")
    plt.title(f"Measured cost curves (context {L})")
    plt.legend(fontsize=7)
    plt.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(root / "cost_curves.png", dpi=120)
    (root / "cost_curves.md").write_text("\n".join(lines) + "\n")
    (root / "cost_curves.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
