"""adaptree's version, in a module of its own that every layer may import (the server reports it)."""

__version__ = "0.1.0"
