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
