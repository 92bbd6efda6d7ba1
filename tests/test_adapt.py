"""The per-machine setup (adaptree.adapt) on tiny models: made once, cached, invalidated by any fingerprint change,
and what the API takes from it (default method, static-gs's tree, the cost-aware rule's files)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PROMPTS

TINY = dict(prompts=len(PROMPTS), max_new_tokens=16, max_depth=8, width=10, widths=(2, 4), sizes=(0, 1, 2, 4, 8),
            lengths=(8, 24), repeats=1, validate_tokens=4, confirm_rounds=2, confirm_tokens=4,
            methods=("ar", "static", "static-gs", "costaware", "deagle", "ltd", "ngram", "hybrid"))


class Tok:  # what a Pipeline needs of a TokenizerBundle for token-id prompts
    chat_template = None
    eos_token_ids = [15]

    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _pipeline(models):
    from adaptree.api import Pipeline

    target, head = models
    return Pipeline(target, Tok(), head)


def _adapt(p, **kw):
    from adaptree.adapt import AdaptConfig, adapt

    said = []
    setup = adapt(p, AdaptConfig(**TINY), prompt_ids=[(f"p{i}", ids) for i, ids in enumerate(PROMPTS)],
                  progress=False, message=said.append, **kw)
    return setup, said


def test_setup_is_made_once_and_cached(models, cache):
    from adaptree.adapt import find_setup

    p = _pipeline(models)
    assert find_setup(p) is None and p.default_method == "ar"  # nothing measured: no tree is known to pay
    setup, said = _adapt(p)
    assert len(said) == 2 and "measuring this machine once" in said[0]  # one line before, one after
    files = {f.name for f in setup.folder.iterdir()}
    assert {"setup.json", "latency.json", "static_gs.json"} <= files
    # every candidate was modelled or says why it could not run here (no LTD policy for a tiny head)
    assert set(setup.methods) == set(TINY["methods"])
    assert "skipped" in setup.methods["ltd"] and "ltd" in setup.methods["ltd"]["skipped"].lower()
    ran = {m: r for m, r in setup.methods.items() if "skipped" not in r}
    assert {"ar", "static", "static-gs", "costaware", "deagle", "ngram", "hybrid"} <= set(ran)
    assert setup.default_method != "static" and setup.default_method in ran
    # the default is the live check's choice among the best-modelled methods that model faster than AR (ar when
    # none beats AR live): a modelled gain alone does not make a default
    from adaptree.adapt.setup import contenders, pick_default

    live = setup.confirmed.get("methods", {})
    assert list(live) == contenders(ran, 2)
    assert all(len(v["rounds"]) == 2 for v in live.values())
    assert setup.default_method == pick_default({m: v["speedup"] for m, v in live.items()})
    assert 0.98 < ran["ar"]["speedup"] <= 1.0 and ran["ar"]["tau"] == 1.0  # AR over AR (its own policy time aside)
    # static-gs's tree is the best static one under this latency model (EAGLE-3's W10 D8 V60 is in the grid): it
    # models at least as fast (same simulator, same traces; the controllers' measured time aside)
    assert ran["static-gs"]["tokens_per_s"] >= 0.98 * ran["static"]["tokens_per_s"]
    again, said2 = _adapt(p)
    assert said2 == [] and again.folder == setup.folder and again.default_method == setup.default_method
    assert find_setup(p).to_dict() == setup.to_dict()
    # a setup made before hybrid existed lacks chain.json: the cached setup gets it from its own traces
    chain = setup.acceptance_path.with_name("chain.json")
    fitted = chain.read_text()
    chain.unlink()
    assert find_setup(p).assets["chain"] == str(chain) and chain.read_text() == fitted
    # with greedy and T=1 rates (sampled seeded: the same file again); a greedy-only one (an older setup's) gets them
    from adaptree.methods.common import ChainCalibration

    cal = ChainCalibration.load(chain)
    assert cal.temperatures.tolist() == [0.0, 1.0] and cal.trials[1].sum() > 0
    ChainCalibration(cal.max_ngram, cal.edges, cal.rates[:1], cal.trials[:1], cal.samples[:1],
                     cal.fingerprints).save(chain)
    assert find_setup(p) is not None and chain.read_text() == fitted
    # one fitted with the most recent occurrence's chains (before the longest-match rule) is fitted again
    ChainCalibration(cal.max_ngram, cal.edges, cal.rates, cal.trials, cal.samples, cal.fingerprints,
                     cal.temperatures, "recent").save(chain)
    assert find_setup(p) is not None and chain.read_text() == fitted and cal.select == "longest"


def test_any_fingerprint_change_invalidates(models, cache):
    from adaptree.adapt import find_setup, fingerprint

    p = _pipeline(models)
    setup, _ = _adapt(p)
    fp = fingerprint(p)
    other_kernels = "AVX2" if fp["cpu_capability"] == "DEFAULT" else "DEFAULT"  # (ATEN_CPU_CAPABILITY=default)
    for key, value in (("torch_threads", fp["torch_threads"] + 1), ("cpu_capability", other_kernels),
                       ("dtype", "bfloat16"), ("head", "0" * 64), ("cpu_flags", [])):
        assert find_setup(p, {**fp, key: value}) is None, key
    # a tampered setup.json (its fingerprint no longer this machine's) is not used either
    d = json.loads((setup.folder / "setup.json").read_text())
    d["fingerprint"]["cpu"] = "another CPU"
    (setup.folder / "setup.json").write_text(json.dumps(d))
    assert find_setup(p) is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if before == 1 else 1)
        assert find_setup(p) is None  # the live thread count is part of the profile
    finally:
        torch.set_num_threads(before)


def test_pipeline_takes_this_machines_tree_and_default(models, cache):
    from adaptree.core.controller import StaticController
    from adaptree.methods.static.gs import StaticGSController

    p = _pipeline(models)
    p.machine, _ = _adapt(p)
    t = p.machine.static_tree
    ctl = p.controller("static-gs")
    assert isinstance(ctl, StaticGSController)
    assert (ctl.plan.width, ctl.plan.max_depth, ctl.plan.size) == (t["width"], t["depth"], t["size"])
    assert p.default_method == p.machine.default_method
    assert p.controller("costaware").name == "costaware"
    # the default method is lossless like every other (fp32 greedy identical to AR)
    for ids in PROMPTS:
        ar = p.generate(ids, method="ar", max_new_tokens=12).token_ids
        assert p.generate(ids, max_new_tokens=12).token_ids == ar
        assert isinstance(p.controller(), StaticController) or p.generate(ids, method="static-gs",
                                                                          max_new_tokens=12).token_ids == ar


def test_adapt_config_rejects_bad_values():
    from adaptree.adapt import AdaptConfig

    with pytest.raises(ValueError, match="prompts must be >= 1, got 0"):
        AdaptConfig(prompts=0)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        AdaptConfig(methods=("ar", "nope"))
    with pytest.raises(ValueError, match="must include 'ar'"):
        AdaptConfig(methods=("static",))
    with pytest.raises(ValueError, match=r"probe_sizes needs at least two distinct sizes, got \[4, 4\]"):
        AdaptConfig(probe_sizes=(4, 4))


def test_learned_methods_take_this_machines_latency_and_retrained_policies(models, cache):
    """LTD gets this machine's latency model from the setup (its AR fallback and cost features), and a pair that
    ``adaptree train ltd --machine`` exported into the setup folder replaces the one next to the head."""
    import shutil

    from adaptree.adapt.setup import MACHINE_POLICIES, machine_assets
    from test_ltd import W, random_policy

    p = _pipeline(models)
    p.machine, _ = _adapt(p)
    assert set(MACHINE_POLICIES).isdisjoint(p.machine.assets)  # nothing retrained yet
    for kind in ("depth", "size"):
        random_policy(kind, 1).save(cache / "elsewhere" / kind)
        shutil.copytree(cache / "elsewhere" / kind, p.machine.folder / MACHINE_POLICIES[f"{kind}_policy"])
    assets = machine_assets(p.machine.folder, p.machine.acceptance_path)
    assert assets["depth_policy"].endswith("ltd/depth") and assets["size_policy"].endswith("ltd/size")
    ctl = p.controller("ltd", width=W, depth=6)
    assert ctl.config.depth_policy == assets["depth_policy"] and ctl.config.latency == assets["latency"]
    assert ctl.gate is not None and ctl.gate.latency is not None
    # an explicit policy still wins over the machine's
    ctl = p.controller("ltd", width=W, depth=6, depth_policy=str(cache / "elsewhere" / "depth"))
    assert ctl.config.depth_policy == str(cache / "elsewhere" / "depth")


def test_pick_default_needs_a_live_gain():
    from adaptree.adapt.setup import contenders, pick_default

    assert pick_default({}) == "ar"
    assert pick_default({"static-gs": 0.93, "ltd": 0.99}) == "ar"  # modelled faster, slower live: AR stays
    assert pick_default({"static-gs": 1.04, "ltd": 1.12}) == "ltd"  # the live gain decides, not the model's rank
    rows = {"ar": {"tokens_per_s": 10.0}, "static": {"tokens_per_s": 30.0}, "deagle": {"tokens_per_s": 9.0},
            "ltd": {"tokens_per_s": 12.0}, "static-gs": {"tokens_per_s": 11.0}, "resps": {"skipped": "no policy"},
            "radar": {"tokens_per_s": 10.5}}
    assert contenders(rows, 2) == ["ltd", "static-gs"]  # never static (the papers' baseline), ar or a skipped one
    assert contenders(rows, 5) == ["ltd", "static-gs", "radar"]  # only those modelled faster than AR


def test_live_check_runs_the_contenders_against_ar(models, cache):
    from adaptree.adapt import AdaptConfig
    from adaptree.adapt.setup import confirm_default

    p = _pipeline(models)
    cfg = AdaptConfig(**{**TINY, "confirm_rounds": 3})
    methods = {"ar": {"tokens_per_s": 10.0}, "deagle": {"tokens_per_s": 20.0}}  # deagle modelled 2x: run live
    default, record = confirm_default(p, cfg, methods, PROMPTS[:2], {})
    assert record["rounds"] == 3 and record["ar_tokens_per_s"] > 0 and set(record["methods"]) == {"deagle"}
    rounds = record["methods"]["deagle"]["rounds"]
    assert len(rounds) == 3 and all(r > 0 for r in rounds)
    assert default == ("deagle" if sorted(rounds)[1] >= 1.0 else "ar")
    # no check: the best modelled method, whatever it does live
    assert confirm_default(p, AdaptConfig(**{**TINY, "confirm_rounds": 0}), methods, PROMPTS[:2], {}) == ("deagle", {})
    # nothing modelled faster than AR: ar, without running anything
    assert confirm_default(p, cfg, {"ar": {"tokens_per_s": 10.0}, "deagle": {"tokens_per_s": 9.0}}, PROMPTS[:2],
                           {}) == ("ar", {})
    with pytest.raises(ValueError, match="confirm_rounds must be >= 0, got -1"):
        AdaptConfig(confirm_rounds=-1)


def test_report_line_shows_the_live_check():
    from adaptree.bench.report import machine_setup_lines

    setup = {"static_tree": {"width": 10, "depth": 1, "size": 1}, "default_method": "ar", "created": "t",
             "took_s": {"total": 60, "trace_prompts": 12},
             "methods": {"ar": {"speedup": 1.0}, "static-gs": {"speedup": 1.05}, "ltd": {"skipped": "no policy"}},
             "confirmed": {"rounds": 3, "methods": {"static-gs": {"speedup": 0.91, "rounds": [0.9, 0.91, 0.95]}}}}
    (line,) = machine_setup_lines(setup)
    assert "default method **ar**" in line and "static-gs 1.05x" in line and "ltd" not in line
    assert "live check vs AR: static-gs 0.91x (median of 3 rounds" in line
    (old,) = machine_setup_lines({k: v for k, v in setup.items() if k != "confirmed"})  # a version-1 summary.json
    assert "live check" not in old


PROBED = dict(prompts=2, max_new_tokens=8, max_depth=4, width=4, widths=(2, 4), sizes=(0, 1, 2, 4), lengths=(8, 24),
              repeats=1, validate_tokens=4, confirm_rounds=1, confirm_tokens=4, probe_sizes=(0, 2, 4))
"""A choice of execution mode of a few seconds on the tiny model."""


def test_every_mode_is_probed_and_only_the_one_kept_is_set_up(tiny_folders, cache):
    """``dtype="auto"``: each candidate mode is loaded once and probed on traces recorded once; the best-probed mode
    gets the full setup (here the only one: with AR the only method, the live check cannot undo what the probe counted
    on), and the execution file and the setup record the probes."""
    from adaptree.adapt import AdaptConfig
    from adaptree.adapt.execution import choose_execution
    from adaptree.api import load_execution

    model, head = tiny_folders
    loads, said = [], []

    def load(mode):
        loads.append(mode)
        return load_execution(model, head, mode, measure=True)

    cfg = AdaptConfig(**PROBED, methods=("ar",))
    p = choose_execution(load, ("bfloat16", "float32"), model, head, cfg=cfg, progress=False, message=said.append)
    assert loads == ["bfloat16", "float32"]  # each loaded once: the best-probed pipeline is the one set up
    assert [line.split(":")[0] for line in said if line.startswith("probe ")] == ["probe bfloat16", "probe float32"]
    assert sum("measuring this machine once" in line for line in said) == 1
    assert len(list((cache / "machines").glob("*/setup.json"))) == 1  # one full setup, the kept mode's
    assert len([d for d in (cache / "traces").iterdir() if d.is_dir()]) == 1  # traces recorded once, for both
    (path,) = (cache / "machines").glob("execution-*.json")
    entry = json.loads(path.read_text())
    probes = entry["probes"]
    assert set(probes) == {"bfloat16", "float32"} and all(v["method"] == "ar" and v["tokens_per_s"] > 0
                                                          for v in probes.values())
    assert entry["chosen_by"] == "probe" and entry["set_up"] == [p.execution] == [entry["execution"]]
    assert p.execution == max(probes, key=lambda m: probes[m]["tokens_per_s"])
    assert p.machine.execution_choice["probes"] == probes and p.machine.default_method == "ar"
    assert any(line.startswith(f"full setup of {p.execution}:") and "(about " in line for line in said)
    # the choice is cached: the kept mode alone is loaded, nothing is measured
    loads.clear()
    said.clear()
    again = choose_execution(load, ("bfloat16", "float32"), model, head, cfg=cfg, progress=False,
                             message=said.append)
    assert loads == [p.execution] and said == [] and again.machine.to_dict() == p.machine.to_dict()


def test_a_runner_up_is_set_up_only_while_its_probe_beats_what_the_live_check_kept():
    from adaptree.adapt.probe import Probe, next_to_set_up

    def probe(name, rates):
        return Probe(name, {m: r if isinstance(r, dict) else {"tokens_per_s": r} for m, r in rates.items()}, 10.0, 1.0)

    probes = {"bfloat16": probe("bfloat16", {"ar": 40.0, "hybrid": 60.0, "static": 90.0}),
              "bfloat16+int4": probe("bfloat16+int4", {"ar": 55.0, "hybrid": 50.0}),
              "float32": probe("float32", {"ar": 20.0, "static-gs": 30.0, "ltd": {"skipped": "no policy"}})}
    assert probes["bfloat16"].method == "hybrid"  # static (the papers' baseline) is never the default
    assert next_to_set_up(probes, {}) == "bfloat16"
    assert next_to_set_up(probes, {"bfloat16": "hybrid"}) is None  # the live check kept what the probe counted on
    assert next_to_set_up(probes, {"bfloat16": "ar"}) == "bfloat16+int4"  # it kept ar (40): int4's probe (55) beats it
    assert next_to_set_up(probes, {"bfloat16": "ar", "bfloat16+int4": "ar"}) is None  # float32's 30 does not
    assert next_to_set_up(probes, {m: "ar" for m in probes}) is None
