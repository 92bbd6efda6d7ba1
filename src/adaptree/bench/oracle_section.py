"""``adaptree bench --oracle-latency FILE``: the oracle and the best static tree next to the measured methods.

After a greedy bench, greedy traces of the bench's prompts (first turns, the bench's token limit, its
model, head and dtype) are recorded under ``<out>/traces`` (resumable: prompts already there are
skipped). With the latency model, per dataset:

- the DP oracle's and the best static tree's **modelled** speedup
  (:func:`adaptree.offline.oracle.compare_methods`),
- every engine method replayed in the simulator: its **simulated** speedup and its fraction of the
  oracle's gain, like with like (both modelled);
- every measured method's **measured** speedup over the same first turns (AR wall time / method wall
  time, prefill included) and "fraction of oracle gain" = (measured - 1) / (oracle modelled - 1). That
  fraction mixes a measured number with a modelled one: it is only as good as the latency model's fit
  to this machine (``adaptree calibrate`` reports that fit).

The modelled part is written to ``<out>/oracle_modelled.json``; :func:`merge` combines it with the
measured records every time the summary is rebuilt (``adaptree report`` too).
"""

from __future__ import annotations

import json
from pathlib import Path

from adaptree.bench.stats import throughput_ratio

ORACLE_FILE = "oracle_modelled.json"
TRACES_DIR = "traces"
NOTE = ("modelled = greedy traces of the first turns replayed with the latency model; measured = wall-clock "
        "speedup of the bench runs of the same first turns (prefill included). 'fraction (measured)' divides a "
        "measured gain by the oracle's modelled gain, so it mixes measured and modelled numbers; 'fraction "
        "(simulated)' compares modelled with modelled.")


def trace_settings(cfg, eos_token_ids, max_seq_len, widths=(10,), max_depth: int = 12):
    from adaptree.offline.traces import TraceSettings

    return TraceSettings(widths=tuple(widths), max_depth=max_depth, max_new_tokens=cfg.max_new_tokens,
                         eos_token_ids=tuple(eos_token_ids), max_seq_len=max_seq_len, feature_dtype="float32",
                         extra=(("source", "bench first turns"),))


def first_turn_prompts(sets, encode, max_len: int) -> dict[str, list[tuple[str, list[int]]]]:
    """dataset -> [(trace key, prompt ids)] of every first turn that fits the context (as the bench encodes it)."""
    out: dict[str, list[tuple[str, list[int]]]] = {}
    for ds, ps in sets:
        for p in ps:
            ids = encode([{"role": "user", "content": p.turns[0]}])
            if len(ids) < max_len:
                out.setdefault(ds, []).append((f"{ds}/{p.id}", list(ids)))
    return out


def record_traces(out: Path, target, head, settings, prompts: dict[str, list[tuple[str, list[int]]]],
                  progress: bool = True):
    """Record (or resume) the traces of ``prompts`` under ``out/traces``; returns the store."""
    from adaptree.offline.traces import open_store_for

    store = open_store_for(Path(out) / TRACES_DIR, target, head, settings)
    store.record(target, head, [x for v in prompts.values() for x in v], progress=progress)
    return store


CHAIN_ORACLE = 16
"""The bench's second oracle may also verify up to this many context-chain tokens per cycle (``hybrid``'s
default chain length): the bound for ``ngram`` and ``hybrid``, and what copying could add to the others."""


def modelled(out: Path, store, prompts: dict[str, list[tuple[str, list[int]]]], latency_path: str, factories: dict,
             progress: bool = False) -> dict:
    """Per dataset (and ``all`` when several): oracle, best static and every method in ``factories``
    replayed; written to ``out/oracle_modelled.json``. A method that cannot be replayed on these traces
    (e.g. a width that was not recorded) gets ``error`` instead of numbers."""
    from tqdm import tqdm

    from adaptree.offline.latency import check_machine, load_checked
    from adaptree.offline.oracle import compare_methods, fraction_of_oracle_gain
    from adaptree.offline.traces import load_trace

    lat = load_checked(latency_path, quiet=True)  # the differences go into the section (and its printed table)
    by_key = {}
    for key, ids in (x for v in prompts.values() for x in v):
        if not store.has(key, ids):
            raise ValueError(f"no trace of {key!r} in {store.folder}: record the traces first")
        by_key[key] = load_trace(store.path(key), store.fingerprints)
    groups = {ds: [by_key[k] for k, _ in v] for ds, v in prompts.items() if v}
    if len(groups) > 1:
        groups["all"] = [t for v in groups.values() for t in v]
    datasets = {}
    for ds, traces in groups.items():
        res = compare_methods(traces, lat, {}, chains=CHAIN_ORACLE)  # the oracles and the best static tree
        orc = res["oracle"]["modelled_speedup"]
        orc_c = res["oracle_chains"]["modelled_speedup"]
        for name, make in tqdm(factories.items(), desc=f"simulate {ds}", unit="method", disable=not progress):
            try:
                row = compare_methods(traces, lat, {name: make}, with_oracle=False, with_static=False)["methods"][name]
            except (ValueError, RuntimeError) as exc:  # e.g. a width the traces do not have
                res["methods"][name] = {"name": name, "error": str(exc)}
                continue
            row["fraction_of_oracle_gain"] = fraction_of_oracle_gain(row["modelled_speedup"], orc)
            row["fraction_of_chain_oracle_gain"] = fraction_of_oracle_gain(row["modelled_speedup"], orc_c)
            res["methods"][name] = row
        res["prompts"] = len(traces)
        datasets[ds] = res
    section = {"latency": str(latency_path), "latency_source": lat.meta.get("source"),
               "latency_machine": lat.meta.get("machine"), "machine_warnings": check_machine(lat),
               "traces": str(store.folder), "trace_widths": list(store.settings.widths),
               "trace_max_depth": store.settings.max_depth, "datasets": datasets}
    (Path(out) / ORACLE_FILE).write_text(json.dumps(section, indent=2) + "\n")
    return section


def measured_first_turns(rows: list[dict]) -> dict[str, dict[str, float]]:
    """dataset (and ``all``) -> method -> its tokens/s over AR's on the first turns both ran (every repeat):
    Σ AR wall time / Σ method wall time when the token counts match (see report.py's speedup)."""
    ok = [r for r in rows if "skipped" not in r and r.get("turn", 0) == 0]
    key = lambda r: (r["dataset"], r["prompt_id"], r["repeat"])  # noqa: E731
    ar = {key(r): r for r in ok if r["method"] == "ar"}
    sums: dict[str, dict[str, list[float]]] = {}
    for r in ok:
        a = ar.get(key(r))
        if a is None:
            continue
        for ds in (r["dataset"], "all"):
            s = sums.setdefault(ds, {}).setdefault(r["method"], [0.0, 0.0, 0.0, 0.0])
            s[0] += r["new_tokens"]
            s[1] += r["wall_s"]
            s[2] += a["new_tokens"]
            s[3] += a["wall_s"]
    if len({r["dataset"] for r in ok}) < 2:
        sums.pop("all", None)
    return {ds: {m: (throughput_ratio(*([x] for x in v)) if v[1] > 0 and v[2] > 0 else None) for m, v in ms.items()}
            for ds, ms in sums.items()}


def merge(out: Path, rows: list[dict], methods: list[str]) -> dict | None:
    """The summary's ``oracle`` section: the modelled file of ``out`` (None if absent) with the measured
    first-turn speedups of ``rows`` and both fractions of the oracle's gain."""
    from adaptree.offline.oracle import fraction_of_oracle_gain

    path = Path(out) / ORACLE_FILE
    if not path.is_file():
        return None
    mod = json.loads(path.read_text())
    measured = measured_first_turns(rows)
    datasets = {}
    for ds, res in mod["datasets"].items():
        orc = res["oracle"]["modelled_speedup"]
        orc_c = (res.get("oracle_chains") or {}).get("modelled_speedup")
        st = res["best_static"]
        rows_out = {}
        for m in methods:
            meas = measured.get(ds, {}).get(m)
            sim = res["methods"].get(m)
            sim_s = sim.get("modelled_speedup") if sim else None
            rows_out[m] = {
                "measured_speedup": meas,
                "fraction_of_oracle_gain_measured": None if meas is None else fraction_of_oracle_gain(meas, orc),
                "simulated_speedup": sim_s,
                "fraction_of_oracle_gain_simulated": sim.get("fraction_of_oracle_gain") if sim else None,
                "fraction_of_chain_oracle_gain_measured": (None if meas is None or orc_c is None
                                                           else fraction_of_oracle_gain(meas, orc_c)),
                "fraction_of_chain_oracle_gain_simulated": sim.get("fraction_of_chain_oracle_gain") if sim else None,
                "simulated_tau": sim.get("tau") if sim else None,
                **({"simulation_error": sim["error"]} if sim and "error" in sim else {}),
            }
        keep = ("modelled_speedup", "tau", "mean_depth", "mean_size")
        datasets[ds] = {"prompts": res["prompts"],
                        "oracle": {k: res["oracle"][k] for k in keep},
                        "oracle_chains": ({k: res["oracle_chains"][k] for k in keep}
                                          if res.get("oracle_chains") else None),
                        "best_static": {k: st[k] for k in ("name", "width", "depth", "size", "modelled_speedup",
                                                           "tau", "mean_depth", "mean_size", "fraction_of_oracle_gain")
                                        if k in st},
                        "methods": rows_out}
    return {k: mod[k] for k in ("latency", "latency_source", "latency_machine", "machine_warnings", "traces",
                                "trace_widths", "trace_max_depth")} | {"datasets": datasets, "note": NOTE}


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table_rows(section: dict) -> list[list[str]]:
    """[dataset, row, measured speedup, simulated speedup, fraction (measured), fraction (simulated), fraction of
    the chain oracle's gain (simulated), tau]"""
    rows = []
    for ds, d in section["datasets"].items():
        o, st, oc = d["oracle"], d["best_static"], d.get("oracle_chains")
        rows.append([ds, "oracle", "-", _f(o["modelled_speedup"]) + "x", "-", "1.00", "-", _f(o["tau"])])
        if oc:
            rows.append([ds, "oracle + chains", "-", _f(oc["modelled_speedup"]) + "x", "-", "-", "1.00", _f(oc["tau"])])
        rows.append([ds, st["name"], "-", _f(st["modelled_speedup"]) + "x", "-",
                     _f(st.get("fraction_of_oracle_gain")), "-", _f(st.get("tau"))])
        for m, r in d["methods"].items():
            sim = _f(r["simulated_speedup"]) + ("x" if r["simulated_speedup"] is not None else "")
            rows.append([ds, m, _f(r["measured_speedup"]) + ("x" if r["measured_speedup"] is not None else ""), sim,
                         _f(r["fraction_of_oracle_gain_measured"]), _f(r["fraction_of_oracle_gain_simulated"]),
                         _f(r.get("fraction_of_chain_oracle_gain_simulated")), _f(r["simulated_tau"])])
    return rows


HEADER = ["dataset", "row", "measured", "modelled", "frac. gain (measured)", "frac. gain (simulated)",
          "frac. chain-oracle gain (sim.)", "sim. tau"]


def print_section(section: dict) -> None:
    from adaptree.offline.runs import format_table

    print()
    print(f"oracle (first turns, latency model {section['latency']}):")
    print(format_table(HEADER, table_rows(section), left=2))
    for w in section.get("machine_warnings") or []:
        print(f"warning: {w}")


def report_lines(section: dict) -> list[str]:
    lines = ["## Oracle and best static tree (modelled)", "",
             f"Latency model `{section['latency']}` ({section.get('latency_source') or 'unknown'} fit; measured on "
             f"{(section.get('latency_machine') or {}).get('cpu', 'an unrecorded machine')}); greedy traces of the "
             f"first turns in `{section['traces']}` (W in {section['trace_widths']}, depth up to "
             f"{section['trace_max_depth']}).", ""]
    for w in section.get("machine_warnings") or []:
        lines += [f"**Warning:** {w}", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(section)]
    lines += ["", section["note"] + " Fraction of oracle gain = (speedup - 1) / (oracle modelled speedup - 1); "
              "'-' where the oracle gains nothing over AR or a number is missing.", ""]
    errs = [(ds, m, r["simulation_error"]) for ds, d in section["datasets"].items()
            for m, r in d["methods"].items() if r.get("simulation_error")]
    lines += [f"- {m} ({ds}) not simulated: {e}" for ds, m, e in errs]
    return lines
