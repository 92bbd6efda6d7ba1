"""How many tokens of a context chain the target accepts, per occurrence rule of the context index.

    python scripts/chain_select.py runs/ctx-traces --tokens 16 --out runs/select/per-position.json \
        --latency LATENCY.json --acceptance ACCEPTANCE.json --fit-traces SETUP_TRACES

At every position of every greedy trace in a folder (an ``adaptree record`` / machine-setup trace folder), the
context's longest earlier match proposes ``--tokens`` tokens under each of :data:`adaptree.core.context.SELECT`
(``longest``: the occurrence whose match reaches furthest back; ``recent``: the most recent occurrence), and the
recorded output says how many of them greedy verification accepts. Printed and written per dataset (the trace key's
part before the first ``/`` or ``_``): positions with a match and mean accepted tokens per such position; and the
index's time per position under each rule. This is
a property of the target's outputs alone (no head, no timing). With ``--latency`` (a machine's latency model),
``--acceptance`` (its costaware acceptance calibration) and ``--fit-traces`` (the traces to fit the chain
calibrations on: a machine setup's, not the ones simulated), what it is worth per cycle: ``ngram`` and ``hybrid``
replayed over the traces under each rule, modelled speedup over AR per dataset.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict

from tqdm import tqdm

from adaptree.core.context import SELECT
from adaptree.offline.simulator import chain_credit, simulate
from adaptree.offline.traces import TraceStore, context_matches


def dataset_of(key: str) -> str:
    """The dataset a trace key names: its part before the first ``/`` or ``_``."""
    return re.split(r"[/_]", key, maxsplit=1)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", help="a folder of greedy traces")
    ap.add_argument("--tokens", type=int, default=16, help="chain tokens proposed per position (default 16)")
    ap.add_argument("--max-ngram", type=int, default=4, help="the context index's longest n-gram (default 4)")
    ap.add_argument("--out", help="write the table as JSON here too")
    ap.add_argument("--latency", help="a latency model JSON: also simulate ngram and hybrid under each rule")
    ap.add_argument("--acceptance", help="with --latency: hybrid's acceptance calibration JSON")
    ap.add_argument("--fit-traces", help="with --latency: the greedy traces hybrid's chain calibrations are fitted on")
    args = ap.parse_args()
    if args.latency and not (args.acceptance and args.fit_traces):
        raise SystemExit("--latency needs --acceptance and --fit-traces (hybrid's calibrations)")
    if args.tokens < 1 or args.max_ngram < 1:
        raise SystemExit(f"--tokens and --max-ngram must be >= 1, got {args.tokens} and {args.max_ngram}")
    traces = TraceStore(args.traces).load_all()
    if not traces:
        raise SystemExit(f"{args.traces}: no traces")
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: {s: [0, 0] for s in SELECT})
    spent = dict.fromkeys(SELECT, 0.0)  # seconds in the index (extend + match), per rule
    positions = 0
    for trace in tqdm(traces, desc="traces", unit="trace"):
        y = trace.output.tolist()
        dataset = dataset_of(trace.key)
        positions += trace.end
        for select in SELECT:
            row = table[dataset][select]
            t0 = time.perf_counter()
            matches = list(context_matches(trace.prompt, y, trace.end, args.tokens, args.max_ngram, select=select))
            spent[select] += time.perf_counter() - t0
            for j, m in matches:
                if m is not None:
                    row[0] += 1
                    row[1] += chain_credit(y, j, m.tokens)
    out = {}
    print(f"{'dataset':<16}{'positions':>10}" + "".join(f"{s + ' acc':>14}" for s in SELECT) + f"{'ratio':>8}")
    for dataset in sorted(table):
        row = table[dataset]
        n = row[SELECT[0]][0]
        mean = {s: row[s][1] / max(row[s][0], 1) for s in SELECT}
        ratio = mean["longest"] / max(mean["recent"], 1e-12)
        out[dataset] = {"positions": n, "accepted_per_position": mean, "longest_over_recent": ratio}
        print(f"{dataset:<16}{n:>10}" + "".join(f"{mean[s]:>14.2f}" for s in SELECT) + f"{ratio:>8.3f}")
    per = {s: spent[s] / max(positions, 1) * 1e6 for s in SELECT}
    print("index time per position (the prompt indexed once per trace, one token added, one match): "
          + ", ".join(f"{s} {us:.1f} us" for s, us in per.items()))
    result = {"traces": args.traces, "tokens": args.tokens, "max_ngram": args.max_ngram, "datasets": out,
              "index_us_per_position": per}
    if args.latency:
        result["modelled_speedup"] = simulated(args, traces)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def simulated(args, traces) -> dict[str, dict[str, float]]:
    """Modelled speedup over AR of ``ngram`` and ``hybrid`` under each rule, per dataset and over all traces."""
    from adaptree.methods import make_controller
    from adaptree.methods.costaware import AcceptanceCalibration
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.hybrid import HybridConfig, HybridController
    from adaptree.offline.latency import LatencyModel

    lat = LatencyModel.load(args.latency)
    acc = AcceptanceCalibration.load(args.acceptance)
    fit_on = TraceStore(args.fit_traces).load_all()
    groups: dict[str, list] = defaultdict(list)
    for t in traces:
        groups[dataset_of(t.key)].append(t)
    groups["all"] = traces
    arms = {}
    for select in SELECT:
        cal = ChainCalibration.fit(fit_on, max_ngram=args.max_ngram, max_tokens=args.tokens, select=select)
        arms[f"ngram/{select}"] = lambda s=select: make_controller("ngram", max_n=args.max_ngram, select=s)
        arms[f"hybrid/{select}"] = lambda c=cal: HybridController(
            HybridConfig(chain_tokens=args.tokens, max_n=args.max_ngram), lat, acc, c)
    table = {arm: {g: simulate(make(), ts, lat, measure_policy=False).speedup for g, ts in groups.items()}
             for arm, make in arms.items()}
    print(f"\nmodelled speedup over AR ({args.latency})")
    print(f"{'arm':<16}" + "".join(f"{g:>11}" for g in groups))
    for arm, row in table.items():
        print(f"{arm:<16}" + "".join(f"{row[g]:>10.3f}x" for g in groups))
    return table


if __name__ == "__main__":
    main()
