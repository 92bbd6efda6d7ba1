"""Controllers: one small module per method, all plugged into the one engine loop."""

from .base import Controller, CycleContext, TreePlan
from .static import AutoregressiveController, StaticConfig, StaticController

__all__ = ["Controller", "CycleContext", "TreePlan", "AutoregressiveController", "StaticConfig",
           "StaticController", "make_controller", "METHODS"]

METHODS = ("ar", "static")


def make_controller(method: str, **options) -> Controller:
    """Build a controller by method name; ``options`` are the method's config fields."""
    if method == "ar":
        if options:
            raise ValueError(f"method 'ar' takes no options, got {sorted(options)}")
        return AutoregressiveController()
    if method == "static":
        return StaticController(StaticConfig(**options))
    raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
