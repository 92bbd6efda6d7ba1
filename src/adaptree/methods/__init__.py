"""Methods: one folder per method, all plugged into the one engine loop through the controller seam.

- :mod:`.ngram`: prompt-lookup drafting from the context, no draft head
- :mod:`.draft_model`: classic two-model speculative decoding, a smaller model of the same tokenizer drafting a chain
- :mod:`.hybrid`: the head's tree and a context chain in one verification, sized per cycle by costaware's rule
- :mod:`.static`: ``static-gs`` (the static tree a measured grid search chose) and that grid search; the
  static EAGLE-3 tree and the autoregressive baseline themselves are the seam's defaults
  (:mod:`adaptree.core.controller`)
- :mod:`.costaware`: the training-free cost-aware rule (expected tokens per modelled second from calibrated draft
  scores and this machine's latency model)
- :mod:`.rules`: the training-free rules DEAGLE, DDD, SVIP and Gammatune
- :mod:`.ltd`: LTD (controller and observation, environments, PPO trainer)
- :mod:`.radar`: RADAR (controller, LSTM policy, acceptance-distribution dataset, REINFORCE trainer)
- :mod:`.resps`: Re-SpS (controller and state, environment, PPO trainer)
- :mod:`.specdec`, :mod:`.c2t`: the classifier baselines of LTD's comparison (SpecDec++ stops drafting, C2T sizes the
  verified tree; both trained by supervised learning from traces, :mod:`.common.classifier`)
- :mod:`.common`: what the learned methods share (their runtime settings and hooks, the AR fallback) and the
  context-chain seam they share with the hybrid

The registry below maps a method name to its typed config, its controller and the files it needs
(:class:`Asset`): a learned policy or a tuned tree is looked up next to the draft head in use, never
next to another model's head; a missing one is an error naming the model, the file and the command
that makes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from adaptree.core.controller import (AutoregressiveController, Controller, CycleContext, StaticConfig,
                                      StaticController, TreePlan)
from adaptree.methods.c2t.controller import C2TConfig, C2TController
from adaptree.methods.costaware.controller import CostAwareConfig, CostAwareController
from adaptree.methods.draft_model import DraftModelConfig, DraftModelController
from adaptree.methods.ltd.controller import LTDConfig, LTDController, LTDDepthConfig, LTDSizeConfig
from adaptree.methods.hybrid import HybridConfig, HybridController
from adaptree.methods.ngram import NgramConfig, NgramController
from adaptree.methods.radar.controller import RadarConfig, RadarController
from adaptree.methods.resps.controller import ReSpSConfig, ReSpSController
from adaptree.methods.rules.ddd import DDDConfig, DDDController
from adaptree.methods.rules.deagle import DeagleConfig, DeagleController
from adaptree.methods.rules.gammatune import GammatuneConfig, GammatuneController
from adaptree.methods.rules.svip import SVIPConfig, SVIPController
from adaptree.methods.specdec.controller import SpecDecConfig, SpecDecController
from adaptree.methods.static.gs import StaticGSConfig, StaticGSController

__all__ = ["Controller", "CycleContext", "TreePlan", "AutoregressiveController", "StaticConfig",
           "StaticController", "DeagleConfig", "DeagleController", "DDDConfig", "DDDController", "SVIPConfig",
           "SVIPController", "GammatuneConfig", "GammatuneController", "StaticGSConfig", "StaticGSController",
           "RadarConfig", "RadarController", "LTDConfig", "LTDDepthConfig", "LTDSizeConfig", "LTDController",
           "ReSpSConfig", "ReSpSController", "CostAwareConfig", "CostAwareController", "NgramConfig",
           "NgramController", "DraftModelConfig", "DraftModelController", "HybridConfig", "HybridController",
           "SpecDecConfig", "SpecDecController", "C2TConfig", "C2TController",
           "Asset", "Method", "REGISTRY", "METHODS", "LEARNED", "CONFIGS",
           "MissingAssetError", "make_controller", "resolve_assets", "controller_factories", "HEAD_DEFAULTS"]


class MissingAssetError(FileNotFoundError, ValueError):
    """A method's policy or tuned tree is not there for the model in use (a missing file and a bad choice of
    method for this model, so both kinds of error)."""


@dataclass(frozen=True)
class Asset:
    """A file a method needs, found next to the draft head in use (``<head folder>/<path>``)."""

    option: str
    """The config field the path goes to."""
    path: str
    """Where it lives inside the head folder: a policy folder (with ``config.json``) or a file."""
    what: str
    """What it is, with its article, for error messages ("an LTD depth policy")."""
    flag: str
    """The command-line flag that gives it explicitly."""
    command: str
    """The command that produces it (``MODEL`` and ``HEAD`` stand for the model and head in use)."""

    def find(self, head_folder: Path) -> Path | None:
        """The asset next to ``head_folder``; else, when the head's :data:`TRANSFERRED` file names another shipped
        head for the asset's folder (``ltd`` for ``ltd/depth``), that head's; None when neither has it."""
        here = self._at(head_folder)
        if here is not None:
            return here
        other = transferred_from(head_folder).get(Path(self.path).parts[0])
        return None if other is None else self._at(other)  # one hop: the other head's own files only

    def _at(self, folder: Path) -> Path | None:
        p = folder / self.path
        marker = p / "config.json" if not p.suffix else p
        return p if marker.is_file() else None


TRANSFERRED = "transferred.json"
"""A head folder's declaration that some of its policies are another shipped head's, used unchanged (measured to
transfer): ``{"policies": {"ltd": "smollm2-135m"}, "evidence": "docs/..."}``. Nothing is looked up next to another
model's head unless its own folder says so here."""


def transferred_from(head_folder: Path) -> dict[str, Path]:
    """Asset folder name -> the shipped head folder it comes from, as ``head_folder``'s :data:`TRANSFERRED` says (empty
    without one); a ValueError names a bad entry."""
    import json

    from adaptree.models import HEADS_DIR

    f = Path(head_folder) / TRANSFERRED
    if not f.is_file():
        return {}
    try:
        entries = json.loads(f.read_text())["policies"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{f}: not a JSON object with a 'policies' mapping") from None
    out = {}
    for asset, head in entries.items():
        folder = HEADS_DIR / str(head)
        own = folder.resolve() == Path(head_folder).resolve()
        if "/" in str(head) or not (folder / "config.json").is_file() or own:
            raise ValueError(f"{f}: {asset!r} names {head!r}, which is not another head adaptree ships")
        out[asset] = folder
    return out


@dataclass(frozen=True)
class Method:
    """A registry entry: how to build a method's controller."""

    name: str
    config: type | None
    """The typed config (a dataclass: field defaults are the paper's; docstrings are the help texts)."""
    controller: Callable[..., Controller]
    assets: tuple[Asset, ...] = ()
    needs_tokenizer: bool = False
    """The controller reads the context as text (Re-SpS on the embedding state)."""
    needs_head: bool = True
    """The method drafts with the EAGLE-3 head (False: ``ar``, ``ngram`` and ``draft-model`` run without one)."""
    needs_draft_model: bool = False
    """The controller drafts with a second, smaller model of the target's tokenizer (``draft-model``)."""
    machine_options: tuple[str, ...] = ()
    """Config fields filled from this machine's setup when not given (:mod:`adaptree.adapt`: ``latency``,
    ``acceptance``, ``tuned``); they take precedence over the files next to the head."""

    @property
    def learned(self) -> bool:
        return any(a.option != "tuned" for a in self.assets)

    def check_options(self, options: dict[str, Any]) -> None:
        """A ValueError naming the method and its fields when ``options`` has a name that is not one of them."""
        if self.config is None:
            if options:
                raise ValueError(f"method {self.name!r} takes no options, got {sorted(options)}")
            return
        names = [f.name for f in fields(self.config)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"bad options for method {self.name!r}: unknown {', '.join(map(repr, unknown))}; its "
                             f"fields: {', '.join(names)}")

    def build(self, options: dict[str, Any], tokenizer=None, draft_model=None) -> Controller:
        self.check_options(options)
        if self.config is None:
            return self.controller()
        config = self.config(**options)
        if self.needs_draft_model:
            return self.controller(config, draft_model=draft_model)
        return self.controller(config, tokenizer=tokenizer) if self.needs_tokenizer else self.controller(config)


_TRAIN_LTD = ("adaptree train ltd --model MODEL --draft HEAD --latency LATENCY.json --out RUN, then copy "
              "RUN/policy/{kind} to HEAD/ltd/{kind}")


def _ltd_asset(kind: str) -> Asset:
    return Asset(f"{kind}_policy", f"ltd/{kind}", f"an LTD {kind} policy", f"--ltd-{kind}-policy",
                 _TRAIN_LTD.format(kind=kind))


_LTD_ASSETS = {"ltd": (_ltd_asset("depth"), _ltd_asset("size")), "ltd-depth": (_ltd_asset("depth"),),
               "ltd-size": (_ltd_asset("size"),)}
_RADAR_ASSET = Asset("policy", "radar", "a RADAR policy", "--radar-policy",
                     "adaptree radar dataset --model MODEL --draft HEAD --out DATA, then adaptree radar train --data "
                     "DATA --out RUN, then copy RUN/policy to HEAD/radar")
_RESPS_ASSET = Asset("policy", "resps", "a Re-SpS policy", "--resps-policy",
                     "adaptree train resps --model MODEL --draft HEAD --out RUN, then copy RUN/policy to HEAD/resps")


def _classifier_asset(name: str, what: str) -> Asset:
    return Asset("policy", name, what, f"--{name}-policy",
                 f"adaptree train {name} --model MODEL --draft HEAD --out RUN, then copy RUN/policy to HEAD/{name}")


_SPECDEC_ASSET = _classifier_asset("specdec", "a SpecDec++ classifier")
_C2T_ASSET = _classifier_asset("c2t", "a C2T classifier")
_TUNED_ASSET = Asset("tuned", "static_gs.json", "a tuned static tree", "--tuned",
                     "adaptree tune-static --model MODEL --draft HEAD --out RUN, then copy RUN/static_gs.json to HEAD/")

HEAD_DEFAULTS = {"tuned": "static_gs.json", "chain": "chain.json"}
"""Machine options a learned method falls back to when no machine setup gives them: the static tree and the chain
calibration shipped next to the head (the chain rates depend on the model and head only; the static tree was tuned
on the machine that trained the head)."""

REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("ar", None, AutoregressiveController, needs_head=False),
    Method("static", StaticConfig, StaticController),
    Method("ngram", NgramConfig, NgramController, needs_head=False),
    Method("draft-model", DraftModelConfig, DraftModelController, needs_head=False, needs_draft_model=True),
    Method("static-gs", StaticGSConfig, StaticGSController, (_TUNED_ASSET,), machine_options=("tuned",)),
    Method("costaware", CostAwareConfig, CostAwareController, machine_options=("latency", "acceptance")),
    Method("hybrid", HybridConfig, HybridController, machine_options=("latency", "acceptance", "chain")),
    Method("deagle", DeagleConfig, DeagleController),
    Method("ddd", DDDConfig, DDDController),
    Method("svip", SVIPConfig, SVIPController),
    Method("gammatune", GammatuneConfig, GammatuneController),
    Method("radar", RadarConfig, RadarController, (_RADAR_ASSET,),
           machine_options=("latency", "chain", "tuned")),
    Method("ltd", LTDConfig, LTDController, _LTD_ASSETS["ltd"],
           machine_options=("latency", "depth_policy", "size_policy", "chain", "tuned", "acceptance")),
    Method("ltd-depth", LTDDepthConfig, LTDController, _LTD_ASSETS["ltd-depth"],
           machine_options=("latency", "depth_policy", "chain", "tuned")),
    Method("ltd-size", LTDSizeConfig, LTDController, _LTD_ASSETS["ltd-size"],
           machine_options=("latency", "size_policy", "chain", "tuned", "acceptance")),
    Method("resps", ReSpSConfig, ReSpSController, (_RESPS_ASSET,), needs_tokenizer=True,
           machine_options=("latency", "chain", "tuned")),
    Method("specdec", SpecDecConfig, SpecDecController, (_SPECDEC_ASSET,),
           machine_options=("latency", "chain", "tuned")),
    Method("c2t", C2TConfig, C2TController, (_C2T_ASSET,), machine_options=("latency", "chain")),
)}
"""Method name -> registry entry, in the order the docs list them."""

METHODS = tuple(REGISTRY)

LEARNED = tuple(name for name, m in REGISTRY.items() if m.learned)
"""Methods that run a trained policy (found next to the model's head, or given as a folder)."""

CONFIGS = {name: (m.config, m.controller) for name, m in REGISTRY.items() if m.config is not None}
"""Method name -> (config dataclass, controller class) for every configurable method."""


def method(name: str) -> Method:
    """The registry entry of ``name``; a ValueError lists the methods when there is none."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}") from None


def resolve_assets(name: str, options: dict[str, Any], head_folder: str | Path | None,
                   model: str | None = None) -> dict[str, Any]:
    """``options`` with every file the method needs and was not given filled in from ``head_folder``.

    :raises MissingAssetError: a needed file is not next to the head in use (or there is no head folder);
        the message names the model, the missing file and the command that produces it.
    """
    out = dict(options)
    for asset in method(name).assets:
        if out.get(asset.option):
            continue
        label = model or "this model"
        if head_folder is None:
            raise MissingAssetError(f"method {name!r} needs {asset.what} and no draft head folder is in use to "
                                    f"find it next to: pass {asset.flag} PATH")
        head = Path(head_folder)
        found = asset.find(head)
        if found is None:
            missing = head / asset.path / ("config.json" if not Path(asset.path).suffix else "")
            command = asset.command.replace("MODEL", model or "MODEL").replace("HEAD", str(head))
            raise MissingAssetError(f"method {name!r} needs {asset.what} for {label}, and {missing} does not exist."
                                    f" Make it with: {command} (or pass {asset.flag} PATH)")
        out[asset.option] = str(found)
    return out


def make_controller(name: str, *, head_folder: str | Path | None = None, model: str | None = None,
                    tokenizer=None, machine: Mapping[str, str] | None = None, draft_model=None,
                    **options) -> Controller:
    """Build a controller by method name; ``options`` are the method's config fields.

    :param head_folder: the draft head in use; a learned method's policies and ``static-gs``'s tuned tree are
        looked up next to it when not given in ``options`` (:func:`resolve_assets`).
    :param model: the model's name, for error messages.
    :param tokenizer: the target's, for controllers that read the context as text (Re-SpS on the embedding
        state).
    :param draft_model: the second model ``draft-model`` drafts with (a
        :class:`~adaptree.models.llama.Transformer` sharing the target's tokenizer); the other methods ignore it.
    :param machine: this machine's files (:attr:`adaptree.adapt.MachineSetup.assets`: option -> path), used for the
        method's :attr:`Method.machine_options` that ``options`` does not give. A learned method given no machine
        static tree or chain calibration takes the one shipped next to the head (:data:`HEAD_DEFAULTS`), so that
        policies which observe them run without a machine setup too.
    """
    entry = method(name)
    entry.check_options(options)
    for opt in entry.machine_options:
        if not options.get(opt) and machine and machine.get(opt):
            options = {**options, opt: machine[opt]}
    if entry.learned and head_folder is not None:  # no machine setup: the files shipped with the head
        for opt, file in HEAD_DEFAULTS.items():
            if opt in entry.machine_options and not options.get(opt) and (Path(head_folder) / file).is_file():
                options = {**options, opt: str(Path(head_folder) / file)}
    if entry.assets:
        options = resolve_assets(name, options, head_folder, model)
    return entry.build(options, tokenizer=tokenizer, draft_model=draft_model)


def controller_factories(names: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None, *,
                         head_folder: str | Path | None = None, model: str | None = None,
                         tokenizer=None, machine: Mapping[str, str] | None = None
                         ) -> dict[str, Callable[[], Controller]]:
    """Method name -> a zero-argument builder of its controller with ``options[name]`` (:func:`make_controller`),
    for replaying or benchmarking several methods. Each is built once here, so a bad option or a missing policy
    fails before anything runs; an unknown or repeated name is a ValueError."""
    out: dict[str, Callable[[], Controller]] = {}
    for name in names:
        method(name)
        if name in out:
            raise ValueError(f"method {name!r} is listed twice")
        opts = dict((options or {}).get(name, {}))

        def build(name: str = name, opts: dict = opts) -> Controller:
            return make_controller(name, head_folder=head_folder, model=model, tokenizer=tokenizer, machine=machine,
                                   **opts)

        build()
        out[name] = build
    return out
