"""Write the standard latency family (adaptree.offline.family): the synthetic grid, the measured CPU profiles and an
H100 member built from its forward curve and per-cycle split, every measured member held out of training.

    python scripts/build_family.py [--shared ../shared/machines] [--profiles docs/results/machines/profiles] \
        [--own NAME=LATENCY.json ...] [--out src/adaptree/offline/machines]

Measured members keep their latency model and the machine it was measured on (`meta.machine`); the calibration
samples are dropped (they stay in the files they came from).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptree.offline.family import STANDARD_INDEX, Member, from_forward_curve, standard_synthetic, write_index
from adaptree.offline.latency import LatencyModel


def measured(path: Path, name: str, source: str) -> Member:
    m = LatencyModel.load(path)
    m.meta = {k: m.meta[k] for k in ("device", "dtype", "threads", "machine") if k in m.meta}
    return Member(name, m, True, source, "measured")


def h100(shared: Path) -> Member:
    """The H100 member: verification from the bf16 forward curve (flat in the rows: host-bound), the draft step the
    least-disturbed arm of the cycle split measured (host noise only adds), the median overhead of the drafting
    arms."""
    curve = json.loads((shared / "h100-forward-curve.json").read_text())
    split = json.loads((shared / "h100-bf16-cycle-split.json").read_text())["methods"]
    drafting = [r for r in split.values() if r["mean_depth"] > 0]
    draft = min(r["draft_per_step_ms"] for r in drafting)
    other = sorted(r["other_ms"] for r in drafting)[len(drafting) // 2]
    meta = {"device": "cuda", "dtype": "bfloat16", "machine": {"gpu": curve["machine"]},
            "source": "h100-forward-curve.json (bfloat16) + h100-bf16-cycle-split.json"}
    return Member("h100-bf16", from_forward_curve(curve["ms"]["bfloat16"], draft, other, meta), True,
                  "shared/machines/h100-forward-curve.json + h100-bf16-cycle-split.json", "measured")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default="../shared/machines", help="the measured AMX and H100 files")
    ap.add_argument("--profiles", default="docs/results/machines/profiles", help="measured profile folders")
    ap.add_argument("--own", action="append", default=[], help="NAME=LATENCY.json: this machine's modes")
    ap.add_argument("--out", default=str(STANDARD_INDEX.parent))
    args = ap.parse_args()
    shared, members = Path(args.shared), standard_synthetic()
    for mode in ("bf16", "fp32", "bf16-int4"):
        members.append(measured(shared / f"xeon-amx-2t-{mode}.latency.json", f"xeon-amx-2t-{mode}",
                                f"shared/machines/xeon-amx-2t-{mode}.latency.json"))
    members.append(h100(shared))
    for prof in sorted(Path(args.profiles).glob("*/latency.json")):
        members.append(measured(prof, prof.parent.name, str(prof)))
    for spec in args.own:
        name, path = spec.split("=", 1)
        members.append(measured(Path(path), name, "this machine's setup"))
    index = write_index(members, args.out)
    n = sum(not m.held_out for m in members)
    print(f"{index}: {len(members)} members, {n} for training, {len(members) - n} held out")


if __name__ == "__main__":
    main()
