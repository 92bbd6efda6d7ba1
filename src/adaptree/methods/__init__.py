"""Controllers: one small module per method, all plugged into the one engine loop."""

from adaptree.core.controller import (
    AutoregressiveController,
    Controller,
    CycleContext,
    StaticConfig,
    StaticController,
    TreePlan,
)
from adaptree.methods.ltd.controller import (
    LTDConfig,
    LTDController,
    LTDDepthConfig,
    LTDSizeConfig,
)
from adaptree.methods.radar.controller import RadarConfig, RadarController
from adaptree.methods.resps.controller import ReSpSConfig, ReSpSController
from adaptree.methods.rules.ddd import DDDConfig, DDDController
from adaptree.methods.rules.deagle import DeagleConfig, DeagleController
from adaptree.methods.rules.gammatune import GammatuneConfig, GammatuneController
from adaptree.methods.rules.svip import SVIPConfig, SVIPController
from adaptree.methods.static.gs import StaticGSConfig, StaticGSController

__all__ = ["Controller", "CycleContext", "TreePlan", "AutoregressiveController", "StaticConfig",
           "StaticController", "DeagleConfig", "DeagleController", "DDDConfig", "DDDController", "SVIPConfig",
           "SVIPController", "GammatuneConfig", "GammatuneController", "StaticGSConfig", "StaticGSController",
           "RadarConfig", "RadarController", "LTDConfig", "LTDDepthConfig", "LTDSizeConfig", "LTDController",
           "ReSpSConfig", "ReSpSController", "make_controller", "METHODS", "LEARNED",
           "CONFIGS"]

METHODS = ("ar", "static", "static-gs", "deagle", "ddd", "svip", "gammatune", "radar", "ltd", "ltd-depth", "ltd-size",
           "resps")

LEARNED = ("radar", "ltd", "ltd-depth", "ltd-size", "resps")
"""Methods that run a trained policy (shipped next to the model's head, or given as a folder)."""

CONFIGS = {
    "static": (StaticConfig, StaticController),
    "static-gs": (StaticGSConfig, StaticGSController),
    "deagle": (DeagleConfig, DeagleController),
    "ddd": (DDDConfig, DDDController),
    "svip": (SVIPConfig, SVIPController),
    "gammatune": (GammatuneConfig, GammatuneController),
    "radar": (RadarConfig, RadarController),
    "ltd": (LTDConfig, LTDController),
    "ltd-depth": (LTDDepthConfig, LTDController),
    "ltd-size": (LTDSizeConfig, LTDController),
    "resps": (ReSpSConfig, ReSpSController),
}
"""Method name -> (config dataclass, controller class) for every configurable method."""


def make_controller(method: str, tokenizer=None, **options) -> Controller:
    """Build a controller by method name; ``options`` are the method's config fields. ``tokenizer``: the
    target's, for controllers that read the context as text (Re-SpS on the embedding state)."""
    if method == "ar":
        if options:
            raise ValueError(f"method 'ar' takes no options, got {sorted(options)}")
        return AutoregressiveController()
    if method in CONFIGS:
        config_cls, controller_cls = CONFIGS[method]
        try:
            config = config_cls(**options)
        except TypeError as exc:  # an unknown field: name the method and its fields
            from dataclasses import fields

            names = ", ".join(f.name for f in fields(config_cls))
            raise ValueError(f"bad options for method {method!r}: {exc}; its fields: {names}") from None
        return controller_cls(config, tokenizer=tokenizer) if method == "resps" else controller_cls(config)
    raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
