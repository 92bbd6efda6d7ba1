"""adaptree.bench.host_time: the forwards a generation ran are timed and counted (the target's prefill left out),
and the split of a cycle adds up."""

from __future__ import annotations

import math

import pytest
from conftest import PROMPTS, tiny_head, tiny_target

from adaptree.bench.host_time import ForwardClock, host_split
from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController


def test_forward_clock_counts_the_cycles_forwards_and_the_split_adds_up():
    target = tiny_target()
    head = tiny_head(target)
    eng = Engine(target, head)
    with ForwardClock(target, head) as clock:
        gens = [eng.generate(p, StaticController(StaticConfig(width=3, depth=4, size=8)), max_new_tokens=12)
                for p in PROMPTS]
    cycles = sum(len(g.cycles) for g in gens)
    assert clock.calls["target"] == cycles  # one verification per cycle; the prefills are not counted
    assert clock.calls["head"] == sum(c.depth for g in gens for c in g.cycles)
    split = host_split(gens, clock)
    assert split["cycles"] == cycles
    assert math.isclose(split["target"] + split["head"] + split["host"], split["cycle"], rel_tol=1e-9)
    assert split["target"] > 0 and split["head"] > 0
    n_hooks = len(target._forward_hooks) + len(target._forward_pre_hooks)
    assert n_hooks == 0  # removed on exit
    with pytest.raises(ValueError, match="no cycles to split"):
        host_split([], clock)
