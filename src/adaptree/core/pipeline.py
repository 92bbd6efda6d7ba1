"""What the layers above the methods (the machine setup, the bench, the server) need of a loaded pipeline:
:class:`PipelineLike`, which :class:`adaptree.api.Pipeline` satisfies.

It lives here, at the bottom of the layers, so that :mod:`adaptree.adapt`, :mod:`adaptree.bench` and
:mod:`adaptree.serve` can type their ``pipeline`` parameters without importing :mod:`adaptree.api`, which is
above them (the API loads pipelines and adapts them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from adaptree.core.controller import Controller
from adaptree.core.engine import Engine


@runtime_checkable
class PipelineLike(Protocol):
    """A target model with its tokenizer, optional draft head and one engine (:class:`adaptree.api.Pipeline`)."""

    target: Any
    """The target model (:class:`~adaptree.models.llama.Transformer`)."""
    head: Any
    """The EAGLE-3 draft head (:class:`~adaptree.models.eagle3.Eagle3Head`), or None."""
    tokenizer: Any
    """The tokenizer (:class:`~adaptree.models.tokenizer.TokenizerBundle`: ``encode``, ``decode``,
    ``apply_chat``, ``chat_template``, ``eos_token_ids``)."""
    engine: Engine
    model: str | None
    """The model as it was given to load (a short name, a path, or None for the default)."""
    head_folder: Path | None
    dtype: torch.dtype
    weights: str
    """``float`` or ``int4``."""
    max_seq_len: int | None
    machine: Any
    """This machine's setup (:class:`~adaptree.adapt.setup.MachineSetup`), or None before any measurement."""

    @property
    def model_label(self) -> str:
        """The model's name as results show it."""
        ...

    @property
    def head_label(self) -> str | None:
        """The head's folder as results show it (None without a head)."""
        ...

    @property
    def dtype_name(self) -> str: ...

    @property
    def attention_name(self) -> str: ...

    @property
    def execution(self) -> str:
        """The execution mode (``"bfloat16"``, ``"bfloat16+int4"``, ...)."""
        ...

    @property
    def default_method(self) -> str: ...

    def settings(self) -> dict:
        """What a measurement with this pipeline depends on (model, head, dtype, threads, ...)."""
        ...

    def use_chat(self, chat: bool | None = None) -> bool: ...

    def encode(self, prompt: str | Sequence[dict[str, str]] | Sequence[int], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt string, chat messages or ids."""
        ...

    def controller(self, method: str | None = None, **options: Any) -> Controller:
        """The controller of ``method`` (default :attr:`default_method`) with ``options``."""
        ...
