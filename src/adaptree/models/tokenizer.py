"""The tokenizer a target model comes with: :class:`TokenizerBundle` (tokenizer, chat template, end ids)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TokenizerBundle", "unique_ids"]


@dataclass
class TokenizerBundle:
    """A tokenizer plus what generation needs from the model's format."""

    tokenizer: Any
    """A ``transformers`` ``PreTrainedTokenizerBase``."""
    chat_template: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    """Every id that ends a reply (eos, end-of-turn...), deduplicated, in priority order."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens are added only as the tokenizer's own format says
        (a Llama-3 tokenizer prepends BOS, SmolLM2 and Qwen add nothing)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}, ...]``), as text."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; encode plain text with encode() instead")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
            tokenize=False)

    def apply_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat. The template writes any BOS itself, so nothing is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def unique_ids(*groups) -> list[int]:
    """The ids in ``groups`` (each an id, a list of ids or None), deduplicated, first occurrence first."""
    out: list[int] = []
    for g in groups:
        if g is None:
            continue
        for x in (g if isinstance(g, (list, tuple)) else [g]):
            if x is not None and int(x) not in out:
                out.append(int(x))
    return out
