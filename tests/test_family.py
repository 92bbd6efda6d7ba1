"""Cost features and latency families: what a machine charges as policy inputs, and the perturbed measured
models learned policies are trained over."""

from __future__ import annotations

import numpy as np
import pytest

from adaptree.offline.family import COST_FEATURES, LatencyFamily, cost_features, scaled
from adaptree.offline.latency import LatencyModel

BILINEAR = LatencyModel(draft=[0.004, 0.0001, 1e-6, 0.0], verify=[0.03, 0.001, 2e-5, 1e-7], other_s=0.001)
KNOTS = LatencyModel(draft=[0.003, 0.0002, 0.0, 0.0], verify=[0.02, 1e-5, 0.021, 1e-5, 0.03, 2e-5, 0.09, 3e-5],
                     other_s=0.002, verify_knots=[1, 2, 8, 64])


def times_k(model: LatencyModel, k: float) -> LatencyModel:
    """The same machine, uniformly ``k`` times faster or slower."""
    return LatencyModel([c * k for c in model.draft], [c * k for c in model.verify], model.other_s * k, {},
                        model.verify_knots)


@pytest.mark.parametrize("model", [BILINEAR, KNOTS], ids=["bilinear", "knots"])
def test_cost_features_are_relative_to_the_machines_own_step(model):
    f = cost_features(model)
    assert len(f) == len(COST_FEATURES) and all(np.isfinite(f))
    assert cost_features(times_k(model, 3.7)) == pytest.approx(f)  # a uniformly faster machine looks the same
    assert f[1] <= f[2] <= f[3]  # verification grows with V
    assert cost_features(scaled(model, draft=2.0))[0] == pytest.approx(2 * f[0])


@pytest.mark.parametrize("model", [BILINEAR, KNOTS], ids=["bilinear", "knots"])
def test_scaled_keeps_one_row_and_scales_the_growth(model):
    s = scaled(model, draft=0.5, verify=3.0, other=2.0)
    for L in (10, 300, 900):
        assert s.verify_time(0, L) == pytest.approx(model.verify_time(0, L))
        for v in (1, 7, 40, 100):
            grow = model.verify_time(v, L) - model.verify_time(0, L)
            assert s.verify_time(v, L) - s.verify_time(0, L) == pytest.approx(3.0 * grow, rel=1e-9, abs=1e-12)
        assert s.draft_step(10, L) == pytest.approx(0.5 * model.draft_step(10, L))
    assert s.other_s == pytest.approx(2 * model.other_s) and s.verify_knots == model.verify_knots
    with pytest.raises(ValueError, match="verify=0"):
        scaled(model, verify=0)


def test_family_samples_stay_inside_the_spread(tmp_path):
    BILINEAR.save(tmp_path / "a.json")
    KNOTS.save(tmp_path / "b.json")
    fam = LatencyFamily.from_files([tmp_path / "a.json", tmp_path / "b.json"], spread=2.0)
    assert len(fam.bases) == 2 and fam.names[0].endswith("a.json")
    rng = np.random.default_rng(0)
    seen_bases, ratios = set(), []
    for _ in range(200):
        m = fam.sample(rng)
        base = BILINEAR if m.verify_knots is None else KNOTS
        seen_bases.add(m.verify_knots is None)
        ratios.append(m.draft_step(10, 100) / base.draft_step(10, 100))
    assert seen_bases == {True, False}
    assert 0.5 - 1e-9 <= min(ratios) < 0.6 and 1.7 < max(ratios) <= 2.0 + 1e-9
    assert LatencyFamily([BILINEAR]).sample(rng) is BILINEAR  # spread 1: the measured model itself
    d = fam.describe()
    assert d["spread"] == 2.0 and len(d["bases"]) == 2 and len(fam.reference_costs()) == len(COST_FEATURES)
    with pytest.raises(ValueError, match="spread"):
        LatencyFamily([BILINEAR], spread=0.5)
    with pytest.raises(ValueError, match="at least one"):
        LatencyFamily([])


# ---------------------------------------------------------------------------------------------- the standard family


def test_synthetic_member_follows_its_four_numbers():
    from adaptree.offline.family import synthetic, verify_ratio

    m = synthetic(step=0.5, growth=0.02, draft=0.25, other=0.1, row_s=0.01, length_growth=0.0)
    assert m.verify_time(0, 500) == pytest.approx(0.01)
    assert m.verify_time(1, 500) == pytest.approx(0.01 * 1.52)  # the step and one row of growth
    assert m.verify_time(64, 500) == pytest.approx(0.01 * (1.5 + 0.02 * 64))
    assert m.draft_step(10, 500) == pytest.approx(0.0025) and m.other_s == pytest.approx(0.001)
    assert verify_ratio(m) == pytest.approx(1.5 + 0.02 * 64)
    grows = synthetic(0.0, 0.01, 0.1, 0.0, row_s=0.01, length_growth=0.3)
    assert grows.verify_time(4, 1000) == pytest.approx(1.3 * grows.verify_time(4, 0))
    with pytest.raises(ValueError, match="draft"):
        synthetic(0.0, 0.01, 0.0, 0.0)


def test_forward_curve_member_takes_the_least_time_at_or_above_each_row_count():
    from adaptree.offline.family import from_forward_curve

    m = from_forward_curve({"1": 8.0, "2": 13.0, "4": 19.0, "8": 12.0, "16": 12.5}, draft_ms=1.5, other_ms=1.0)
    assert [round(m.verify_time(n - 1, 256) * 1e3, 6) for n in (1, 2, 4, 8, 16)] == [8.0, 12.0, 12.0, 12.0, 12.5]
    assert m.draft_step(10, 999) == pytest.approx(1.5e-3) and m.other_s == pytest.approx(1e-3)


def test_family_index_round_trip_holds_out_and_validates(tmp_path):
    from adaptree.offline.family import Member, load_members, read_index, synthetic, write_index

    members = [Member(f"m{i}", synthetic(0.0, g, 0.1, 0.01), held_out=(i == 1), source="test")
               for i, g in enumerate((0.001, 0.01, 0.1, 0.5))]
    index = write_index(members, tmp_path / "fam")
    back = read_index(index)
    assert [(m.name, m.held_out) for m in back] == [(m.name, m.held_out) for m in members]
    assert back[2].model.verify_time(30, 100) == pytest.approx(members[2].model.verify_time(30, 100))
    models, names, val = load_members([str(index)])
    assert names == ["m0", "m2", "m3"] and len(models) == 3 and val == [0, 1, 2]  # the held-out member never trains
    fam = LatencyFamily.from_files([str(index)])
    assert fam.names == names and len(fam.validation_bases) == 3


def test_a_validation_band_is_validated_on_and_never_drawn(tmp_path):
    from adaptree.offline.family import Member, family_around, synthetic, verify_ratio, write_index

    members = [Member(f"m{i}", synthetic(0.0, g, 0.1, 0.01), held_out=False, source="test")
               for i, g in enumerate((0.001, 0.01, 0.1, 0.5))]
    index = str(write_index(members, tmp_path / "fam"))
    r = [verify_ratio(m.model) for m in members]
    fam = family_around(BILINEAR, [index], band=(r[1] * 0.99, r[2] * 0.99))  # m1 alone is in the band
    assert fam.names == ["main", "m0", "m2", "m3", "m1"] and fam.validation_only == 1
    assert fam.validation == [0, 1, 2, 3, 4] and fam.describe()["validation_only"] == ["m1"]
    rng = np.random.default_rng(0)
    assert all(fam.sample(rng) is not fam.bases[-1] for _ in range(200))  # never trained on
    assert family_around(BILINEAR, [index]).validation_only == 0
    with pytest.raises(ValueError, match=r"no training member of the family lies in the validation band \[50.0, 60"):
        family_around(BILINEAR, [index], band=(50.0, 60.0))
    with pytest.raises(ValueError, match="0 < lo < hi"):
        family_around(BILINEAR, [index], band=(2.0, 1.0))


def test_the_standard_family_holds_out_a_band_and_every_measured_member():
    from adaptree.offline.family import HELD_OUT_BAND, read_index, verify_ratio

    members = read_index()
    assert {m.group for m in members} == {"synthetic", "measured"}
    assert all(m.held_out for m in members if m.group == "measured")
    lo, hi = HELD_OUT_BAND
    for m in members:
        if m.group == "synthetic":
            assert m.held_out == (lo <= verify_ratio(m.model) < hi), m.name
    names = {m.name for m in members}
    assert {"h100-bf16", "xeon-amx-2t-bf16", "xeon-amx-2t-fp32", "xeon-amx-2t-bf16-int4"} <= names
    assert sum(not m.held_out for m in members) >= 100


def test_synthetic_members_compare_with_no_machine():
    from adaptree.offline.family import synthetic
    from adaptree.offline.latency import check_machine

    assert check_machine(synthetic(0.0, 0.01, 0.1, 0.01)) == []
