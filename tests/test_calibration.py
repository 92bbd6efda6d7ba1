"""`adaptree calibrate` and the latency model's machine checks, on tiny random models (seconds).

The error numbers the tiny models give say nothing about a real model; the tests check the mechanics:
predictions against hand-made records, the fit/held-out split, the choice of candidate, the files
written and the warnings.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from adaptree.offline.calibration import (
    CalibrationConfig,
    cycle_errors,
    live_cycles,
    parse_shapes,
    run_calibration,
    split_records,
    validate_models,
)
from adaptree.offline.latency import (
    LatencyModel,
    check_machine,
    load_checked,
    machine_meta,
)
from adaptree.offline.traces import head_fingerprint, model_fingerprint

TRUE = LatencyModel([1e-3, 2e-4, 1e-6, 3e-8], [5e-3, 1e-5, 2e-6, 1e-9], other_s=4e-4)


class Tok:  # what the calibrate command needs of a TokenizerBundle
    chat_template = None
    eos_token_ids = [15]

    @staticmethod
    def encode(text, add_special_tokens=True):
        return [ord(c) % 16 for c in text]


def records_from(model, shapes, noise=None):
    """Cycle records whose times are the model's exactly (times ``noise(i)`` if given)."""
    out = []
    i = 0
    for p in range(4):
        for w, d, v in shapes:
            for L in (20 + 7 * p, 60 + 5 * p, 140 + 3 * p):
                f = noise(i) if noise else 1.0
                i += 1
                out.append({"cycle": 0, "context_len": L, "width": w, "depth": d, "size": v, "candidates": 0,
                            "accepted": 0, "emitted": 1, "draft_s": model.draft_time(w, d, L) * f,
                            "verify_s": model.verify_time(v, L) * f, "policy_s": 0.0, "other_s": model.other_s,
                            "shape": f"{w}/{d}/{v}", "prompt": p})
    return out


# ------------------------------------------------------------------------------------------ validation


def test_cycle_errors_zero_for_the_true_model_and_exact_for_a_scaled_one():
    recs = records_from(TRUE, [(4, 3, 8), (8, 5, 30), (1, 0, 0)])
    e = cycle_errors(TRUE, recs)
    assert e["cycles"] == len(recs) and e["cycle_mare"] < 1e-12 and e["draft_mare"] < 1e-12
    assert e["verify_mare"] < 1e-12 and math.isclose(e["bias"], 1.0)
    double = LatencyModel([2 * a for a in TRUE.draft], [2 * b for b in TRUE.verify], 2 * TRUE.other_s)
    e2 = cycle_errors(double, recs)
    assert math.isclose(e2["cycle_mare"], 1.0) and math.isclose(e2["bias"], 2.0)
    assert cycle_errors(TRUE, [])["cycle_mare"] is None
    ar_only = cycle_errors(TRUE, records_from(TRUE, [(1, 0, 0)]))
    assert ar_only["draft_mare"] is None and ar_only["verify_mare"] < 1e-12


def test_split_alternates_prompts():
    recs = records_from(TRUE, [(4, 3, 8)])
    fit, held, held_out = split_records(recs)
    assert held_out and {r["prompt"] for r in fit} == {0, 2} and {r["prompt"] for r in held} == {1, 3}
    one = [r for r in recs if r["prompt"] == 1]
    fit, held, held_out = split_records(one)
    assert not held_out and fit == one == held


def test_validate_models_prefers_the_better_candidate():
    shapes = [(4, 3, 8), (8, 5, 30), (10, 2, 60), (16, 4, 120), (1, 0, 0)]
    recs = records_from(TRUE, shapes)
    off = LatencyModel([3 * a for a in TRUE.draft], [0.5 * b for b in TRUE.verify], 0.0)  # a poor micro fit
    chosen, micro, live, s = validate_models(off, recs, "auto")
    assert s["chosen"] == "live" and chosen is live
    assert s["candidates"]["live"]["all"]["cycle_mare"] < 1e-6 and s["goal_met"] is True
    assert s["candidates"]["micro"]["all"]["cycle_mare"] > 0.1
    assert micro.other_s == TRUE.other_s  # the overhead comes from the fit half
    assert set(s["candidates"]["micro"]["per_shape"]) == {f"{w}/{d}/{v}" for w, d, v in shapes}
    assert s["fit_cycles"] + s["held_out_cycles"] == len(recs)
    # the true model as the micro fit: a tie on the held-out error keeps the micro-benchmarks
    chosen, *_ , s = validate_models(LatencyModel(TRUE.draft, TRUE.verify), recs, "auto")
    assert s["chosen"] == "micro" and s["candidates"]["micro"]["all"]["cycle_mare"] < 1e-12
    chosen, *_ , s = validate_models(off, recs, "micro")
    assert s["chosen"] == "micro" and s["goal_met"] is False
    # AR cycles only: no draft samples to refit, so no live candidate; asking for it is an error
    ar = records_from(TRUE, [(1, 0, 0)])
    chosen, micro, live, s = validate_models(off, ar, "auto")
    assert live is None and s["chosen"] == "micro" and "need at least 4" in s["live_fit_error"]
    with pytest.raises(ValueError, match="--refit live"):
        validate_models(off, ar, "live")


def test_parse_shapes_and_config_errors():
    assert parse_shapes("ar, 10:8:60,4:3:4") == ((1, 0, 0), (10, 8, 60), (4, 3, 4))
    with pytest.raises(ValueError, match="'10:8'"):
        parse_shapes("10:8")
    with pytest.raises(ValueError, match="no validation shapes"):
        parse_shapes(" , ")
    with pytest.raises(ValueError, match="W=4 D=3 V=0"):
        CalibrationConfig(shapes=((4, 3, 0),))
    with pytest.raises(ValueError, match=r"widths must be integers >= 1, got \[0, 4\]"):
        CalibrationConfig(widths=(0, 4))
    with pytest.raises(ValueError, match="refit must be one of auto, micro, live, got 'best'"):
        CalibrationConfig(refit="best")
    with pytest.raises(ValueError, match="goal"):
        CalibrationConfig(goal=10)
    with pytest.raises(ValueError, match="repeats"):
        CalibrationConfig(repeats=0)


def test_live_cycles_and_run_calibration_on_tiny_models(models):
    from adaptree.core.engine import Engine

    target, head = models
    engine = Engine(target, head)
    prompts = [[1, 5, 3], [2, 9], [7, 7, 1]]
    recs = live_cycles(engine, prompts, ((1, 0, 0), (4, 3, 8)), max_new_tokens=6, warmup=False)
    assert {r["shape"] for r in recs} == {"AR", "W4 D3 V8"} and {r["prompt"] for r in recs} == {0, 1, 2}
    assert all(r["depth"] == 0 for r in recs if r["shape"] == "AR")
    assert all(r["draft_s"] > 0 and r["verify_s"] > 0 for r in recs if r["shape"] != "AR")
    cfg = CalibrationConfig(widths=(2, 4), sizes=(0, 4, 8), lengths=(8, 24), repeats=1,
                            shapes=((1, 0, 0), (4, 3, 8), (2, 2, 4)), max_new_tokens=6, warmup=False)
    res = run_calibration(target, head, engine, prompts, cfg)
    v = res.validation
    assert v["held_out"] and v["chosen"] in ("micro", "live") and res.model.meta["source"] == v["chosen"]
    assert res.model.other_s == v["other_s"] > 0 and res.micro.other_s == v["other_s"]
    assert res.model.meta["machine"] == machine_meta()
    assert res.model.meta["validation"] is v and len(res.records) == len(recs) + sum(
        1 for r in res.records if r["shape"] == "W2 D2 V4")
    no_val = run_calibration(target, head, engine, prompts, CalibrationConfig(
        widths=(2, 4), sizes=(0, 4, 8), lengths=(8, 24), repeats=1, shapes=()))
    assert no_val.model.other_s == 0.0 and no_val.model.meta["validation"] is None and not no_val.records


# ------------------------------------------------------------------------------------------ machine checks


def test_check_machine_names_both_machines(tmp_path, capsys):
    here = machine_meta()
    same = LatencyModel(meta={"machine": dict(here)})
    assert check_machine(same) == []
    other = LatencyModel(meta={"machine": {**here, "cpu": "Imaginary CPU 9000", "torch_threads": 64}})
    msgs = check_machine(other)
    assert len(msgs) == 2
    assert "'Imaginary CPU 9000'" in msgs[0] and repr(here["cpu"]) in msgs[0]
    assert "64" in msgs[1] and repr(here["torch_threads"]) in msgs[1]
    old_style = LatencyModel(meta={"threads": here["torch_threads"] + 3})  # calibrate() before meta["machine"]
    assert len(check_machine(old_style)) == 1 and "torch threads" in check_machine(old_style)[0]
    assert "records no machine" in check_machine(LatencyModel())[0]
    kernels = check_machine(LatencyModel(meta={"machine": {**here, "cpu_capability": "SOME_OTHER_ISA"}}))
    assert len(kernels) == 1 and "PyTorch CPU kernels 'SOME_OTHER_ISA'" in kernels[0]
    gpu = check_machine(LatencyModel(meta={"machine": {**here, "gpu": "Some GPU"}}), current={**here})
    assert len(gpu) == 1 and "'Some GPU'" in gpu[0] and "None" in gpu[0]
    other.save(tmp_path / "lat.json")
    load_checked(tmp_path / "lat.json")
    err = capsys.readouterr().err
    assert err.count("adaptree: warning:") == 2 and "Imaginary CPU 9000" in err and str(tmp_path / "lat.json") in err
    load_checked(tmp_path / "lat.json", quiet=True)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------ the command


def _question_file(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                         for i, t in enumerate(["abc", "hello", "xyz", "tree"])))
    return q


def test_calibrate_cli_writes_model_meta_and_validation(tmp_path, models, monkeypatch, capsys):
    import adaptree.cli as cli
    from adaptree.api import Pipeline
    from adaptree.cli import common

    target, head = models
    monkeypatch.setattr(common, "load_pipeline", lambda args: Pipeline(target, Tok(), head))
    out = tmp_path / "lat" / "latency.json"
    argv = ["calibrate", "--datasets", "", "--question-file", str(_question_file(tmp_path)), "--limit", "3",
            "--widths", "2,4", "--sizes", "0,4,8", "--lengths", "8,24", "--repeats", "1",
            "--validate", "ar,4:3:8,2:2:4", "--max-new-tokens", "6", "--no-warmup", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "W4 D3 V8" in printed and "AR" in printed and "saved:" in printed and "goal <= 10.0%" in printed
    model = LatencyModel.load(out)
    meta = model.meta
    assert meta["machine"] == machine_meta() and meta["dtype"] == "float32" and meta["torch"] == torch.__version__
    assert meta["model_sha256"] == model_fingerprint(target) and meta["head_sha256"] == head_fingerprint(head)
    assert meta["source"] in ("micro", "live") and meta["validation"]["chosen"] == meta["source"]
    assert meta["config"]["shapes"] == [[1, 0, 0], [4, 3, 8], [2, 2, 4]] and meta["prompts"] == 3
    assert model.other_s > 0
    val = json.loads((tmp_path / "lat" / "latency.validation.json").read_text())
    assert len(val["cycles"]) == meta["validation"]["fit_cycles"] + meta["validation"]["held_out_cycles"]
    assert {"micro_pred", "shape", "prompt", "draft_s"} <= set(val["cycles"][0])
    # the saved model loads in `adaptree simulate` without a machine warning (same machine)
    assert check_machine(model) == []


def test_calibrate_cli_without_validation_and_bad_input(tmp_path, models, monkeypatch, capsys):
    import adaptree.cli as cli
    from adaptree.api import Pipeline
    from adaptree.cli import common

    target, head = models
    loaded = []
    monkeypatch.setattr(common, "load_pipeline", lambda args: loaded.append(1) or Pipeline(target, Tok(), head))
    out = tmp_path / "l.json"
    base = ["calibrate", "--datasets", "", "--widths", "2,3", "--sizes", "0,4", "--lengths", "8,16", "--repeats", "1",
            "--out", str(out), "--quiet"]
    assert cli.main(base + ["--validate", ""]) == 0
    assert "no validation run" in capsys.readouterr().out
    assert LatencyModel.load(out).meta["validation"] is None
    loaded.clear()
    assert cli.main(base + ["--validate", "4:3"]) == 2
    assert "W:D:V" in capsys.readouterr().err and not loaded  # refused before the models load
    assert cli.main(base[:3] + ["--widths", "2"] + base[5:] + ["--validate", ""]) == 2
    assert "widths needs at least two distinct values" in capsys.readouterr().err
    assert cli.main(base[:7] + ["--lengths", "8,600"] + base[9:] + ["--validate", ""]) == 2  # past the 512 limit
    err = capsys.readouterr().err
    assert "two context lengths" in err and "[8, 600]" in err and "[8] fit" in err
    assert cli.main(base + ["--validate", "ar"]) == 2  # validation without prompts
    assert "validation needs prompts" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(base[:-3] + ["--out", str(blocker / "x.json"), "--validate", ""]) == 2
    assert "cannot write" in capsys.readouterr().err
    monkeypatch.setattr(common, "load_pipeline", lambda args: Pipeline(target, Tok(), None))
    assert cli.main(base + ["--validate", ""]) == 2
    assert "needs a draft head" in capsys.readouterr().err


def test_simulate_warns_about_a_latency_model_from_another_machine(tmp_path, models, capsys):
    from adaptree.cli import main
    from adaptree.offline.traces import TraceSettings, open_store_for

    target, head = models
    store = open_store_for(tmp_path / "tr", target, head, TraceSettings(widths=(4,), max_depth=3, max_new_tokens=6))
    store.record(target, head, [("q/0", [1, 5, 3])], progress=False)
    here = machine_meta()
    LatencyModel(TRUE.draft, TRUE.verify, TRUE.other_s,
                 meta={"machine": {**here, "cpu": "Imaginary CPU 9000"}}).save(tmp_path / "lat.json")
    assert main(["simulate", "--traces", str(tmp_path / "tr"), "--method", "static", "-W", "4", "-D", "3", "-V", "8",
                 "--latency", str(tmp_path / "lat.json")]) == 0
    err = capsys.readouterr().err
    assert "Imaginary CPU 9000" in err and repr(here["cpu"]) in err
    LatencyModel(TRUE.draft, TRUE.verify, TRUE.other_s, meta={"machine": here}).save(tmp_path / "same.json")
    assert main(["simulate", "--traces", str(tmp_path / "tr"), "--method", "static", "-W", "4", "-D", "3", "-V", "8",
                 "--latency", str(tmp_path / "same.json")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_machine_profile_records_the_kernels_that_run():
    """Two kernel settings on one CPU time differently, so the profile tells them apart (ATEN_CPU_CAPABILITY and
    ONEDNN_MAX_CPU_ISA make this machine run an older CPU's kernels)."""
    import json
    import subprocess
    import sys

    from adaptree.core.machine import CPU_FLAGS, machine_info

    here = machine_meta()
    assert {"cpu", "cpu_flags", "cpu_capability", "onednn_max_isa", "cores", "torch_threads", "torch"} <= set(here)
    assert set(here["cpu_flags"]) <= set(CPU_FLAGS) and here["cpu_capability"]
    assert set(here) <= set(machine_info())
    code = "import json; from adaptree.core.machine import machine_profile; print(json.dumps(machine_profile()))"
    env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    low = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    assert low["cpu_capability"] == "DEFAULT" and low["onednn_max_isa"] == "SSE41"
    assert low["cpu"] == here["cpu"] and low["cpu_flags"] == here["cpu_flags"]  # same CPU, other kernels
    msgs = check_machine(LatencyModel(meta={"machine": low}), current=here)
    if here["cpu_capability"] != "DEFAULT":
        assert any("PyTorch CPU kernels 'DEFAULT'" in m for m in msgs)
    assert any("oneDNN ISA limit 'SSE41'" in m for m in msgs) or here["onednn_max_isa"] == "SSE41"
