"""Config facts kept on the fields (adaptree.core.config): a config refuses what its fields' ranges and choices say,
and the command line's flags read the same facts (types that refuse, choices, configs nested in configs)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field

import pytest

from adaptree.cli.common import ConfigFlags
from adaptree.core.config import (
    FLAG_HELP,
    Bounds,
    at_least,
    between,
    bounds_of,
    check_fields,
    choice,
    choices_of,
    positive,
)


@dataclass
class Inner:
    rate: float = between(0.0, 1.0, 0.5, lo_open=True)
    """A rate."""
    kind: str = choice(("a", "b"), "a")
    """a or b."""
    seed: int | None = None
    """A seed."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class Outer:
    count: int = positive(3)
    """How many."""
    inner: Inner = field(default_factory=lambda: Inner(seed=7), metadata={FLAG_HELP: {"seed": "the outer's seed"}})
    """The inner settings."""
    sizes: tuple[int, ...] = at_least(0, (0, 2))
    """Sizes."""
    strict: int | None = positive(None, integer=True)
    """A whole count from JSON."""

    def __post_init__(self) -> None:
        check_fields(self)


def parse(flags: ConfigFlags, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flags.add(p)
    return p.parse_args(argv)


def test_a_config_refuses_values_outside_its_fields_ranges_and_choices():
    assert Outer() == Outer(3, Inner(0.5, "a", 7), (0, 2), None)  # None passes an optional field's range
    for bad, message in [(dict(count=0), "count must be >= 1, got 0"),
                         (dict(count="3"), "count must be >= 1, got '3'"),  # no number
                         (dict(sizes=(1, -1)), "sizes must be >= 0, got -1 in (1, -1)"),
                         (dict(strict=0), "strict must be an integer >= 1, got 0"),
                         (dict(strict=1.5), "strict must be an integer >= 1, got 1.5"),
                         (dict(strict=True), "strict must be an integer >= 1, got True")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            Outer(**bad)
    for bad, message in [(dict(rate=0.0), "rate must be in (0, 1], got 0.0"),
                         (dict(rate=math.nan), "rate must be in (0, 1], got nan"),
                         (dict(kind="c"), "kind must be one of a, b, got 'c'")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            Inner(**bad)
    assert Outer(count=1, sizes=(), strict=2).strict == 2 and Inner(rate=1.0, kind="b").kind == "b"


def test_ranges_in_words():
    assert [Bounds(lo=1).describe(), Bounds(1, 64).describe(), Bounds(0.0, 1.0, lo_open=True).describe(),
            Bounds(0.0, math.inf, hi_open=True).describe(), Bounds(lo=0.0, lo_open=True).describe(),
            Bounds(hi=0.0).describe(), Bounds(1.0, 64).describe()] == \
        [">= 1", "in 1..64", "in (0, 1]", "in [0, inf)", "> 0", "<= 0", "in [1, 64]"]
    f = {g.name: g for g in dataclasses.fields(Outer)}
    assert bounds_of(f["count"]) == Bounds(lo=1) and choices_of(f["count"]) is None
    assert choices_of({g.name: g for g in dataclasses.fields(Inner)}["kind"]) == ("a", "b")


def test_flags_refuse_what_the_config_refuses_and_show_its_choices(capsys):
    flags = ConfigFlags(Outer)
    for argv, message in [(["--count", "0"], "count must be >= 1, got 0"), (["--rate", "0"], "rate must be in (0, 1]"),
                          (["--sizes", "1,-1"], "sizes must be >= 0, got -1 in '1,-1'"), (["--kind", "c"], "'c'")]:
        with pytest.raises(SystemExit):
            parse(flags, argv)
        assert message in capsys.readouterr().err
    p = argparse.ArgumentParser()
    flags.add(p)
    text = " ".join(p.format_help().split())
    assert "--kind {a,b} a or b. (default a)" in text and "--count COUNT How many. (default 3)" in text


def test_a_nested_config_gets_flags_of_its_own_and_is_built_from_them():
    flags = ConfigFlags(Outer)
    assert flags.build(parse(flags, [])) == Outer()
    built = flags.build(parse(flags, ["--rate", "0.25", "--seed", "3", "--count", "2"]))
    assert built == Outer(count=2, inner=Inner(0.25, "a", 3))
    assert flags.dests() == {"count": "count", "rate": "rate", "kind": "kind", "seed": "seed", "sizes": "sizes",
                             "strict": "strict"}
    p = argparse.ArgumentParser()
    flags.add(p)
    text = " ".join(p.format_help().split())
    assert "--seed SEED the outer's seed (default 7)" in text  # the outer's default and its own help for the flag
    assert "--rate RATE A rate. (default 0.5)" in text
    shared = ConfigFlags(Outer, prefix="o", unset=True)
    assert shared.values(parse(shared, [])) == {}
    assert shared.values(parse(shared, ["--o-kind", "b"])) == {"inner": Inner(kind="b", seed=7)}


def test_bench_flags_build_its_sampling_config():
    from adaptree.bench.runner import BenchConfig
    from adaptree.cli import build_parser
    from adaptree.cli.bench import _bench_flags
    from adaptree.core.verify import SamplingConfig

    p = build_parser()
    cfg = _bench_flags().build(p.parse_args(["bench"]))
    assert cfg.sampling == SamplingConfig(0.0, 1.0, 0, seed=0) and cfg.repeat_sampling(2).seed == 2
    cfg = _bench_flags().build(p.parse_args(["bench", "--temperature", "0.5", "--top-k", "3", "--seed", "4"]))
    assert cfg.sampling == SamplingConfig(0.5, 1.0, 3, seed=4)
    assert cfg.repeat_sampling(2) == SamplingConfig(0.5, 1.0, 3, seed=6)
    saved = dataclasses.asdict(cfg)
    assert BenchConfig.from_dict(saved) == cfg  # bench_config.json read back
    old = {k: v for k, v in saved.items() if k != "sampling"} | dict(temperature=0.5, top_p=1.0, top_k=3, seed=4)
    assert BenchConfig.from_dict(old) == cfg  # an older folder's flat sampling fields
    assert BenchConfig(sampling=SamplingConfig(seed=None)).sampling.seed == 0  # every arm samples alike


def _bad_values(f: dataclasses.Field) -> list:
    b, options = bounds_of(f), choices_of(f)
    out = ["no-such-choice"] if options else []
    if b is not None:
        out += [b.lo - (0 if b.lo_open else 1)] if b.lo is not None else []
        out += [b.hi + (0 if b.hi_open or b.hi == math.inf else 1)] if b.hi is not None and b.hi != math.inf else []
    return out


def _command_configs() -> list[type]:
    from adaptree.cli import adapt, bench, generate, head, offline, radar, serve, train
    from adaptree.cli.common import method_flags

    flags = [adapt._adapt_flags(), bench._bench_flags(), bench._compare_flags(), bench._tune_flags(),
             generate._sampling_flags(), head._flags(), head._corpus_flags(), offline._trace_flags(),
             offline._calibration_flags(), radar._dataset_flags(), radar._train_flags(), serve._server_flags(),
             train._prompt_flags(), train._ltd_flags(), train._resps_flags(), *method_flags().values()]
    return list(dict.fromkeys(f.config for f in flags))


NEEDS = {"RadarTrainConfig": {"latency": "latency.json"}}
"""What a config needs besides the bad value to be built at all."""


def test_every_commands_config_refuses_what_its_fields_say():
    """The command line lists no range or choice of its own: each is a field's, and the config enforces it too."""
    checked = 0
    for config in _command_configs():
        assert config(**NEEDS.get(config.__name__, {})) is not None, config  # the defaults are valid
        for f in dataclasses.fields(config):
            for bad in _bad_values(f):
                value = (bad,) if "tuple" in str(f.type) or "list" in str(f.type) else bad
                with pytest.raises(ValueError, match=f"{f.name}.*{re.escape(repr(bad))}"):
                    config(**NEEDS.get(config.__name__, {}), **{f.name: value})
                checked += 1
    assert checked > 100


def test_deagle_derives_its_min_votes_from_the_votes():
    """DEAGLE's rule lives in its config: with min_votes unset, 2 of the enabled votes, or 1 with a single vote (the
    paper's one-heuristic ablation); a given min_votes is checked against the votes."""
    from adaptree.methods import DeagleConfig, make_controller

    assert DeagleConfig().min_votes == 2 and DeagleConfig(votes="survival,momentum").min_votes == 2
    assert DeagleConfig(votes=("expected",)).min_votes == 1
    assert make_controller("deagle", votes=("momentum",)).config.min_votes == 1  # as the command line builds it
    assert DeagleConfig(votes=("survival", "momentum", "expected"), min_votes=3).min_votes == 3
    with pytest.raises(ValueError, match="min_votes must be in 1..1 .*got 2"):
        DeagleConfig(votes=("expected",), min_votes=2)
