"""Benchmark summary, printed table, ``report.md`` and PNG plots from the per-run records.

Metric definitions (docs/benchmarking.md has the long form):

- speedup = the method's tokens per second over AR's, both summed over the same runs (prompt x turn x
  repeat): (Σ method tokens / Σ method time) / (Σ AR tokens / Σ AR time), with a 95% percentile-bootstrap
  interval over runs. With equal token counts (greedy float32) it is Σ AR time / Σ method time, the ratio
  of total times (the key keeps that name: ``speedup_total_time``); with sampling the arms' outputs differ
  in length and only the throughput ratio compares like with like. Speedup (mean per prompt) = mean of
  the per-run throughput ratios.
- decode speedup = the same ratio with each run's prefill left out: (Σ tokens / Σ (wall - prefill)) over AR's.
  Where arms stop at different lengths (bfloat16 near-ties, sampling), a short answer carries its whole prefill
  over few tokens, so ``speedup`` mixes how long the answers were with how fast they decoded; this one does not.
- tau = (accepted draft tokens + 1 bonus) summed over cycles / cycles.
- tokens/s = generated tokens / wall time (prefill included), tokens counted as token ids.
- draft forwards per cycle = mean tree depth (one draft forward per level).
- per-position acceptance: P(accepted >= i) and P(accepted >= i | accepted >= i-1, depth >= i).
- time split: draft / verify / policy / other seconds summed over cycles, plus prefill; policy
  overhead = policy seconds / wall seconds.
- differs from AR: runs whose output token ids differ from AR's on the same prompt and turn (greedy).
- vs reference: paired Wilcoxon signed-rank test of per-run tokens/s against the reference method.
- chain (context-match drafts, ``ngram`` and ``hybrid``): chain tokens verified per cycle, and chain tokens
  accepted per cycle.

Rows are grouped per dataset, per later turn as well (``mt_bench/turn2``: a second turn revises the model's
own first answer) and, with several datasets, ``all``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

from adaptree.bench.stats import (
    acceptance_by_position,
    bootstrap_mean_ci,
    bootstrap_throughput_ratio_ci,
    throughput_ratio,
    wilcoxon_paired,
)

SPLIT_KEYS = ("draft_s", "verify_s", "policy_s", "other_s")


def _pair_key(r: dict) -> tuple:
    return (r["dataset"], r["prompt_id"], r.get("turn", 0), r["repeat"])


def _entry(rs: list[dict], ar: dict, ref: dict | None, ref_name: str | None, greedy: bool) -> dict:
    t = sum(r["wall_s"] for r in rs)
    tokens = sum(r["new_tokens"] for r in rs)
    cycles = sum(r["cycles"] for r in rs)
    acc = [a for r in rs for a in r.get("cyc_accepted", [])]
    dep = [d for r in rs for d in r.get("cyc_depth", [])]
    size = [v for r in rs for v in r.get("cyc_size", [])]
    split = {k: sum(r.get(k, 0.0) for r in rs) for k in SPLIT_KEYS}
    split["prefill_s"] = sum(r.get("prefill_s") or 0.0 for r in rs)
    e: dict = {
        "runs": len(rs), "total_s": t, "new_tokens": tokens, "tokens_per_s": tokens / t if t else 0.0,
        "cycles": cycles,
        "tau": sum(r["accepted_plus_one"] for r in rs) / cycles if cycles else None,
        "mean_depth": sum(r["depth_sum"] for r in rs) / cycles if cycles else None,
        "mean_v": sum(r["size_sum"] for r in rs) / cycles if cycles else None,
        "mean_chain": sum(r.get("chain_sum", 0) for r in rs) / cycles if cycles else None,
        "chain_accepted_per_cycle": sum(r.get("chain_accepted_sum", 0) for r in rs) / cycles if cycles else None,
        "time_split_s": split,
        "policy_overhead_pct": 100.0 * split["policy_s"] / t if t and cycles else None,
        "acceptance_by_position": acceptance_by_position(acc, dep) if any(dep) else None,
        "depth_hist": dict(sorted(Counter(dep).items())), "size_hist": dict(sorted(Counter(size).items())),
    }
    e["draft_forwards_per_cycle"] = e["mean_depth"]
    pairs = [(r, ar[_pair_key(r)]) for r in rs if _pair_key(r) in ar]
    if pairs:
        a_t, m_t = [a["wall_s"] for _, a in pairs], [r["wall_s"] for r, _ in pairs]
        a_n, m_n = [a["new_tokens"] for _, a in pairs], [r["new_tokens"] for r, _ in pairs]
        e["speedup_total_time"] = throughput_ratio(m_n, m_t, a_n, a_t)
        e["speedup_total_time_ci95"] = bootstrap_throughput_ratio_ci(m_n, m_t, a_n, a_t)
        per = [throughput_ratio([mn], [mt], [an], [at]) for mn, mt, an, at in zip(m_n, m_t, a_n, a_t)]
        e["speedup_mean_per_prompt"] = statistics.fmean(per)
        e["speedup_mean_per_prompt_ci95"] = bootstrap_mean_ci(per)
        e["speedup_median_per_prompt"] = statistics.median(per)
        # the decode phase alone (prefill seconds out of both arms' times)
        a_d = [at - (a.get("prefill_s") or 0.0) for at, (_, a) in zip(a_t, pairs)]
        m_d = [mt - (r.get("prefill_s") or 0.0) for mt, (r, _) in zip(m_t, pairs)]
        e["speedup_decode"] = throughput_ratio(m_n, m_d, a_n, a_d)
        e["differs_from_ar"] = sum(r["ids_sha1"] != a["ids_sha1"] for r, a in pairs) if greedy else None
        e["same_tokens_as_ar"] = all(r["new_tokens"] == a["new_tokens"] for r, a in pairs)
    if ref is not None and ref_name is not None:
        rp = [(r, ref[_pair_key(r)]) for r in rs if _pair_key(r) in ref]
        if rp:
            mine = [r["new_tokens"] / r["wall_s"] for r, _ in rp]
            theirs = [x["new_tokens"] / x["wall_s"] for _, x in rp]
            cols = ([r["new_tokens"] for r, _ in rp], [r["wall_s"] for r, _ in rp],
                    [x["new_tokens"] for _, x in rp], [x["wall_s"] for _, x in rp])
            e["vs_reference"] = {"reference": ref_name, "speed_ratio_total_time": throughput_ratio(*cols),
                                 "speed_ratio_ci95": bootstrap_throughput_ratio_ci(*cols),
                                 "wilcoxon_tokens_per_s": wilcoxon_paired(mine, theirs)}
    return e


def summarize(rows: list[dict], cfg) -> dict:
    """Per dataset (and ``all`` datasets together when there are several) and method: see the module
    docstring for every metric."""
    skipped = [r for r in rows if "skipped" in r]
    ok = [r for r in rows if "skipped" not in r]
    greedy = cfg.sampling.greedy
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(r["dataset"], []).append(r)
    for r in ok:  # later turns apart too (MT-bench's second turns revise the first answer: they copy from it)
        if r.get("turn", 0) > 0:
            groups.setdefault(f"{r['dataset']}/turn{r['turn'] + 1}", []).append(r)
    if len({r["dataset"] for r in ok}) > 1:
        groups["all"] = ok
    table: dict[str, dict] = {}
    for ds, rs in groups.items():
        by_m: dict[str, list[dict]] = {}
        for r in rs:
            by_m.setdefault(r["method"], []).append(r)
        ar = {_pair_key(r): r for r in by_m.get("ar", [])}
        ref_name = cfg.reference
        ref = {_pair_key(r): r for r in by_m.get(ref_name, [])} if ref_name else None
        table[ds] = {m: _entry(by_m[m], ar, ref if m != ref_name else None, ref_name, greedy)
                     for m in cfg.methods if m in by_m}
    return {"results": table, "greedy": greedy, "reference": cfg.reference,
            "skipped": [{k: r[k] for k in ("dataset", "prompt_id", "turn", "method", "skipped")} for r in skipped]}


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _ci(e: dict) -> str:
    lo, hi = e.get("speedup_total_time_ci95", (None, None))
    return f"[{_fmt(lo)}, {_fmt(hi)}]"


def table_rows(summary: dict) -> list[list[str]]:
    rows = []
    for ds, methods in summary["results"].items():
        for m, e in methods.items():
            vs = e.get("vs_reference")
            rows.append([ds, m, _fmt(e.get("speedup_total_time"), ".2f") + "x", _ci(e),
                         _fmt(e.get("speedup_decode"), ".2f") + "x",
                         _fmt(e["tokens_per_s"], ".1f"), _fmt(e["tau"]), _fmt(e["mean_depth"], ".1f"),
                         _fmt(e["mean_v"], ".1f"), _fmt(e.get("mean_chain"), ".1f"),
                         _fmt(e["policy_overhead_pct"], ".1f"),
                         _fmt(e.get("differs_from_ar"), "d"),
                         _fmt(vs["wilcoxon_tokens_per_s"]["p_value"], ".3g") if vs else "-"])
    return rows


# depth and V: the head's tree per cycle; chain: the tokens an n-gram or draft model proposed per cycle (chain-only
# methods draft nothing with the head, so their depth and V are 0)
HEADER = ["dataset", "method", "speedup", "95% CI", "decode", "tok/s", "tau", "depth", "V", "chain", "policy%", "≠AR",
          "p vs ref"]


def _temperature(summary: dict):
    """The sampling temperature of a summary's config (older summaries: a top-level field of it)."""
    c = summary.get("config", {})
    return c.get("sampling", c).get("temperature")


def print_table(summary: dict) -> None:
    from adaptree.offline.runs import format_table

    print()
    print(format_table(HEADER, table_rows(summary), left=2))
    s = summary.get("settings", {})
    print(f"model {s.get('model')}, dtype {s.get('dtype')}, weights {s.get('weights', 'float')}, attention {s.get('attention', s.get('dtype'))}, threads {s.get('threads')}, "
          f"{'greedy' if summary['greedy'] else 'T=' + str(_temperature(summary))}; "
          f"speedup = method tok/s / AR tok/s over the same runs (= AR time / method time for equal tokens); decode: the same "
          f"without prefill; p: Wilcoxon of per-run tok/s vs {summary.get('reference')}")
    if summary.get("skipped"):
        print(f"{len(summary['skipped'])} runs skipped (see summary.json 'skipped')")
    for m, why in (summary.get("dropped_arms") or {}).items():
        print(f"{m}: {why}; arm dropped")
    if summary.get("oracle"):
        from adaptree.bench.oracle_section import print_section

        print_section(summary["oracle"])


def machine_setup_lines(setup: dict | None) -> list[str]:
    """What the machine setup (:mod:`adaptree.adapt`) chose here, as report lines (none without a setup)."""
    if not setup:
        return ["- machine setup: none (`--no-adapt` and nothing cached): the default method is ar"]
    t = setup["static_tree"]
    modelled = ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in setup["methods"].items() if "skipped" not in v)
    return [f"- machine setup ({setup.get('created')}, {setup['took_s'].get('total', 0):.0f} s): default method "
            f"**{setup['default_method']}**, static tree here W{t['width']} D{t['depth']} V{t['size']}; modelled "
            f"speedups on {setup['took_s'].get('trace_prompts', '?')} tuning prompts' traces: {modelled}"
            + _live_check(setup.get("confirmed") or {})]


def _live_check(confirmed: dict) -> str:
    if not confirmed.get("methods"):
        return ""
    from adaptree.adapt.setup import live_speedups

    return (f"; live check vs AR: {live_speedups(confirmed)} (median of {confirmed.get('rounds')} rounds; the default "
            "needs >= 1.00x)")


def write_report(summary: dict, out: Path) -> None:
    """``report.md`` and the PNG plots next to ``summary.json``."""
    out = Path(out)
    plots = write_plots(summary, out)
    s, m, c = summary.get("settings", {}), summary.get("machine", {}), summary.get("config", {})
    lines = ["# adaptree bench report", ""]
    if summary.get("command"):
        lines += ["Command: `" + summary["command"] + "`", ""]
    lines += [f"- model: {s.get('model')} (sha256 {str(s.get('model_sha256'))[:16]}…), draft head: {s.get('draft')} "
              f"(sha256 {str(s.get('draft_sha256'))[:16]}…)",
              f"- dtype {s.get('dtype')}, weights {s.get('weights', 'float')}, attention {s.get('attention', s.get('dtype'))}, threads {s.get('threads')}, max new tokens {c.get('max_new_tokens')} per turn, "
              f"temperature {_temperature(summary)}, repeats {c.get('repeats')}, prompts per dataset {c.get('limit')}, "
              f"turns {c.get('turns') or 'all'}",
              f"- machine: {m.get('cpu')} ({m.get('cores')} cores), {m.get('platform')}; python {m.get('python')}, "
              f"torch {m.get('torch')}, transformers {m.get('transformers')}" + (f", GPU {m['gpu']}" if m.get("gpu") else ""),
              f"- machine profile: CPU flags {', '.join(m.get('cpu_flags') or []) or '-'}; PyTorch kernels "
              f"{m.get('cpu_capability')}, oneDNN ISA limit {m.get('onednn_max_isa')}, torch threads "
              f"{m.get('torch_threads')}"]
    lines += machine_setup_lines(summary.get("machine_setup"))
    lines += ["", "## Results", "",
              "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(summary)]
    lines += ["", "speedup: the method's tokens/s over AR's, each summed over the same runs (= AR wall time / method wall "
              "time when both generated the same tokens, as in greedy float32; 95% bootstrap CI over runs); "
              "decode: the same ratio with every run's prefill seconds left out (arms that stop at different "
              "lengths carry their prefills over different token counts); "
              "tau: mean accepted draft tokens + 1 per cycle; depth: mean draft forwards per cycle; V: mean "
              "verified draft nodes per cycle; policy%: controller time / wall time; ≠AR: runs whose token ids "
              f"differ from AR's (greedy only); p vs ref: paired Wilcoxon signed-rank test of per-run tokens/s "
              f"against {summary.get('reference')}.", ""]
    from adaptree.bench.streams import report_lines

    lines += report_lines(summary.get("streams"))
    lines += ["## Acceptance by draft position", "",
              "P(accepted ≥ i | reachable) per position i (all datasets pooled where there are several).", ""]
    pooled = summary["results"].get("all") or next(iter(summary["results"].values()), {})
    acc_rows = [(name, e["acceptance_by_position"]) for name, e in pooled.items() if e.get("acceptance_by_position")]
    if acc_rows:
        n = max(len(a["conditional"]) for _, a in acc_rows)
        lines += ["| method | " + " | ".join(str(i) for i in range(1, n + 1)) + " |", "|---|" + "---|" * n]
        for name, a in acc_rows:
            cells = [_fmt(x) for x in a["conditional"]] + [""] * (n - len(a["conditional"]))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Time per generated token (ms)", "",
              "| dataset | method | draft | verify | policy | other | prefill |", "|---|---|---|---|---|---|---|"]
    for ds, methods in summary["results"].items():
        for name, e in methods.items():
            tok = max(e["new_tokens"], 1)
            sp = e["time_split_s"]
            if e["cycles"]:
                lines.append(f"| {ds} | {name} | " + " | ".join(
                    _fmt(1000 * sp[k] / tok) for k in (*SPLIT_KEYS, "prefill_s")) + " |")
    if summary.get("oracle"):
        from adaptree.bench.oracle_section import report_lines

        lines += [""] + report_lines(summary["oracle"])
    if summary.get("dropped_arms"):
        lines += ["", "## Dropped arms", "", "Their runs after the failure were not made (a rerun of the same command "
                  "tries them again).", ""] + [f"- {m}: {why}" for m, why in summary["dropped_arms"].items()]
    if summary.get("skipped"):
        lines += ["", "## Skipped runs", ""] + [f"- {x['dataset']} {x['prompt_id']} turn {x['turn']} "
                                                   f"{x['method']}: {x['skipped']}" for x in summary["skipped"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def write_plots(summary: dict, out: Path) -> list[Path]:
    """speedup.png (bars with 95% CI per method and dataset), depth_v_hist.png, time_breakdown.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional: the report says so
        return []
    res = summary["results"]
    datasets = list(res)
    methods = list(dict.fromkeys(m for ds in res.values() for m in ds))
    paths = []
    if not methods:  # nothing ran (no prompts, or every run skipped): no figures, the report says why
        return paths

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(datasets) * len(methods) ** 0.5 + 3), 4))
    w = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for j, ds in enumerate(datasets):
            e = res[ds].get(m)
            if e is None or e.get("speedup_total_time") is None:
                continue
            s = e["speedup_total_time"]
            a, b = e.get("speedup_total_time_ci95", (math.nan, math.nan))
            xs.append(j + (i - (len(methods) - 1) / 2) * w)
            ys.append(s)
            lo.append(0 if a is None or math.isnan(a) else max(0.0, s - a))
            hi.append(0 if b is None or math.isnan(b) else max(0.0, b - s))
        ax.bar(xs, ys, w, yerr=[lo, hi], capsize=3, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup vs AR (tokens/s ratio)")
    ax.set_title(f"speedup with 95% bootstrap CI ({summary.get('settings', {}).get('dtype')})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    pooled = res.get("all") or res[datasets[0]]
    spec = [(m, e) for m, e in pooled.items() if e.get("depth_hist") and any(int(k) for k in e["depth_hist"])]
    if spec:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for m, e in spec:
            for ax, key, label in ((axes[0], "depth_hist", "draft depth per cycle"),
                                   (axes[1], "size_hist", "verified nodes V per cycle")):
                h = {int(k): v for k, v in e[key].items()}
                total = sum(h.values())
                ks = sorted(h)
                ax.step(ks, [h[k] / total for k in ks], where="mid", label=m)
                ax.set_xlabel(label)
                ax.set_ylabel("share of cycles")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "depth_v_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(methods) + 2), 4))
    keys = (*SPLIT_KEYS, "prefill_s")
    bottom = [0.0] * len(methods)
    for k in keys:
        vals = []
        for m in methods:
            e = pooled.get(m)
            vals.append(1000 * e["time_split_s"][k] / max(e["new_tokens"], 1) if e and e["cycles"] else 0.0)
        ax.bar(methods, vals, bottom=bottom, label=k[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    labelled = False
    for m in methods:  # external arms have no cycle breakdown: show their total
        e = pooled.get(m)
        if e and not e["cycles"]:
            ax.bar([m], [1000 * e["total_s"] / max(e["new_tokens"], 1)], color="0.6",
                   label=None if labelled else "total (no breakdown)")
            labelled = True
    ax.set_ylabel("ms per generated token")
    ax.set_title("time breakdown")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    paths.append(out / "time_breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
