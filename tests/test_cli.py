"""The command line's flags generated from typed configs (adaptree.cli.common)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import pytest

from adaptree.cli.common import ConfigFlags, field_doc, method_flags, method_options
from adaptree.core.config import positive
from adaptree.core.controller import TreeShape
from adaptree.methods import REGISTRY, DeagleConfig, LTDConfig


@dataclass
class Example:
    """A config with one field of every kind a flag is generated for."""

    count: int = positive(3)
    """How many (``count`` of :class:`~adaptree.api.Pipeline`, 100% of them)."""
    ratio: float = 0.5
    name: str | None = "x"
    """A name; None = none."""
    sizes: tuple[int, ...] = (1, 2)
    """Comma list."""
    words: list[str] = field(default_factory=lambda: ["w"])
    flag: bool = False
    """Off by default."""
    on: bool = True
    """On by default."""
    mode: str = "a"
    """a or b."""


def parse(flags: ConfigFlags, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flags.add(p)
    return p.parse_args(argv)


def test_field_docs_come_from_the_class_that_declares_the_field():
    assert field_doc(DeagleConfig, "depth").startswith("Maximum draft depth")  # DEAGLE's own
    assert field_doc(DeagleConfig, "width") == field_doc(TreeShape, "width")  # inherited
    assert field_doc(Example, "count") == "How many (count of Pipeline, 100%% of them)."
    assert field_doc(Example, "name") == "A name; unset = none."
    assert field_doc(Example, "ratio") == ""


def test_config_flags_types_defaults_and_choices():
    flags = ConfigFlags(Example, choices={"mode": ("a", "b")})  # count's range is the field's (positive)
    args = parse(flags, [])
    assert flags.build(args) == Example()
    args = parse(flags, ["--count", "4", "--ratio", "0.25", "--name", "", "--sizes", "3, 4", "--words", "",
                         "--flag", "--no-on", "--mode", "b"])
    assert flags.values(args) == {"count": 4, "ratio": 0.25, "name": None, "sizes": (3, 4), "words": [],
                                  "flag": True, "on": False, "mode": "b"}
    for bad in (["--mode", "c"], ["--count", "0"], ["--sizes", "x"], ["--sizes", ""]):
        with pytest.raises(SystemExit):
            parse(flags, bad)
    p = argparse.ArgumentParser()
    flags.add(p)
    help_text = " ".join(p.format_help().split())
    assert "How many (count of Pipeline, 100% of them). (default 3)" in help_text
    assert "Comma list. (default 1,2)" in help_text and "(default x; empty = unset)" in help_text


def test_renamed_and_unset_flags():
    flags = ConfigFlags(Example, only=("count", "sizes"), prefix="ex", rename={"sizes": "size-list"}, unset=True)
    assert flags.dests() == {"count": "ex_count", "sizes": "size_list"}
    assert flags.values(parse(flags, [])) == {}
    assert flags.values(parse(flags, ["--size-list", "5"])) == {"sizes": (5,)}


def test_every_method_field_has_a_documented_flag():
    shape = {f.name for f in fields(TreeShape)}
    flags = method_flags()
    for name, m in REGISTRY.items():
        if m.config is None:
            continue
        for f in flags[name].fields():
            assert field_doc(m.config, f.name), f"{name}.{f.name} has no docstring"
        covered = set(flags[name].only or ()) | shape | {"mode"}
        siblings = {a.option for n in ("ltd", "ltd-depth", "ltd-size") for a in REGISTRY[n].assets}
        assert {f.name for f in fields(m.config)} - covered <= siblings, name
    # the learned runtime, also the ablations'
    machine = ("latency", "ar_fallback", "probe_every", "chain", "chain_tokens", "tuned")
    assert flags["ltd-depth"].only == (*machine, "depth_policy", "acceptance")
    assert flags["ltd-size"].only == (*machine, "size_policy", "acceptance")
    assert [flags["deagle"].flag(f) for f in ("tau_s", "votes")] == ["deagle-tau-s", "deagle-votes"]
    assert flags["static-gs"].flag("tuned") == "tuned" and flags["ltd-size"].flag("size_policy") == "ltd-size-policy"


def test_method_options_keep_each_methods_defaults():
    from adaptree.cli import build_parser

    p = build_parser()
    args = p.parse_args(["generate", "hi", "-D", "5", "--deagle-votes", "survival,expected"])
    assert method_options(args, "deagle") == {"depth": 5, "votes": ("survival", "expected")}  # what was given
    assert DeagleConfig(**method_options(args, "deagle")).min_votes == 2  # DEAGLE's own rule: 2 of the 2 votes
    assert method_options(args, "resps") == {} and method_options(args, "hf_generate") == {}
    assert LTDConfig(**method_options(args, "ltd")).depth == 5


def test_kill_pid_interrupts_a_command_as_ctrl_c_does(monkeypatch, capsys):
    """SIGTERM inside any command becomes the KeyboardInterrupt its Ctrl-C handler saves on: exit 130."""
    import os
    import signal

    import adaptree.cli as cli

    seen = []

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        except KeyboardInterrupt:
            seen.append("saved")  # where a long job writes its checkpoint
            raise
        return 0

    def parser():
        p = argparse.ArgumentParser(prog="adaptree")
        p.set_defaults(func=command)
        p.add_argument("-v", "--verbose", action="store_true")
        return p

    def outside(signum, frame):  # the handler outside the command: without the conversion the signal lands here
        seen.append("outside")

    monkeypatch.setattr(cli, "build_parser", parser)
    old = signal.signal(signal.SIGTERM, outside)
    try:
        assert cli.main([]) == 130
        assert seen == ["saved"]
        assert "interrupted" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is outside  # restored after the command
    finally:
        signal.signal(signal.SIGTERM, old)


def test_every_model_loading_command_takes_a_checked_device(capsys, monkeypatch):
    """``--device`` on every command that loads a model, checked before anything loads (a device this torch does not
    see is named in the error), and handed to the pipeline."""
    import torch

    from adaptree.cli import build_parser
    from adaptree.cli import common

    p = build_parser()

    def commands(parser, path=()):  # every (sub)command's parser
        yield path, parser
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from commands(sp, path + (name,))

    # export-head names a model to convert its head's files, loading nothing onto a device; vllm-bench runs vLLM,
    # which runs on its own platform's device
    no_device = {"export-head", "vllm-bench"}
    loaders = {" ".join(path) for path, sp in commands(p) if any("--model" in a.option_strings for a in sp._actions)}
    loaders -= no_device
    with_device = {" ".join(path) for path, sp in commands(p) if any("--device" in a.option_strings
                                                                      for a in sp._actions)}
    assert {"generate", "bench", "serve", "adapt", "traces record", "train ltd", "train resps"} <= loaders
    assert loaders <= with_device, loaders - with_device
    assert p.parse_args(["generate", "hi"]).device == "cpu"
    for bad, why in (("mps", "cpu or cuda"), ("tpu", "not a device"), ("cuda:x", "not a device")):
        with pytest.raises(SystemExit):
            p.parse_args(["generate", "hi", "--device", bad])
        assert why in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "--device", "cuda"])
        assert "sees no CUDA device" in capsys.readouterr().err

    seen = {}
    monkeypatch.setattr("adaptree.api.load", lambda *a, **k: seen.update(k) or (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        common.load_pipeline(p.parse_args(["generate", "hi", "--device", "cpu"]))
    assert seen["device"] == "cpu"
