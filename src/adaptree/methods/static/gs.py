"""``static-gs``: the static tree chosen by ``adaptree tune-static`` (a measured grid search).

The choice lives in a ``static_gs.json`` written by the search (see :mod:`.tune`); a
model may ship one measured on the project's reference machine (next to its draft head). It is read
once, checked, and used every cycle like the static EAGLE-3 tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adaptree.core.controller import StaticConfig, StaticController


@dataclass
class StaticGSConfig:
    """Where the tuned tree comes from."""

    tuned: str | None = None
    """A ``static_gs.json`` from ``adaptree tune-static`` (the one next to the head in use when built through the
    method registry)."""

    def __post_init__(self) -> None:
        if self.tuned is not None and not Path(self.tuned).is_file():
            raise FileNotFoundError(f"tuned static config {self.tuned!r} does not exist; run `adaptree tune-static` "
                                    "and pass its static_gs.json")

    def resolve(self) -> Path:
        if self.tuned is None:
            raise FileNotFoundError("no tuned static config given: run `adaptree tune-static` and pass "
                                    "--tuned PATH/static_gs.json")
        return Path(self.tuned)

    def load(self) -> tuple[StaticConfig, dict]:
        path = self.resolve()
        try:
            obj = json.loads(path.read_text())
            return StaticConfig(int(obj["width"]), int(obj["depth"]), int(obj["size"])), obj
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a static_gs.json from adaptree tune-static ({e})") from None


class StaticGSController(StaticController):
    """The static tree with the grid-searched (W, depth, V)."""

    name = "static-gs"

    def __init__(self, config: StaticGSConfig | None = None) -> None:
        self.gs_config = config or StaticGSConfig()
        static, self.tuning = self.gs_config.load()
        super().__init__(static)
