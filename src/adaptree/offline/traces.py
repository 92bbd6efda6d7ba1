"""Greedy traces: the draft tree the head grows at every position of the autoregressive output.

With greedy decoding every cycle's context is a prefix of the autoregressive output, so the tree
drafted at a cycle depends only on where the cycle's root is, and the accepted length of any
sub-tree follows from the recorded continuation. :func:`record_trace` records, for one prompt:

- the greedy output ``y_0 .. y_{M-1}`` (the engine's tokens up to its stop, then ``max_depth + 1``
  look-ahead tokens so that a cycle near the end still knows how much it would have accepted);
- for every root ``y_j`` the engine could reach (``j < end``) and every beam width W of the settings,
  the tree grown to ``max_depth`` levels exactly as :class:`~adaptree.core.tree.DraftTree` stores it:
  candidate tokens and cumulative log-probs level by level (level 1: W, later levels: W*W) and the
  beam (positions within the level of the W nodes expanded next), from which the parents follow;
- the target's low/mid/high features of the last accepted position (what a controller sees as
  ``CycleContext.features``), float16 by default.

How it is computed: the greedy output (one autoregressive run on the :class:`~adaptree.core.engine.Engine`
plus the look-ahead; a :class:`TraceStore` computes 8 prompts' at once with
:func:`~adaptree.core.batched.batched_decode`), one target forward over the whole sequence for the
features, one draft-head prefill over the prompt, then the trees of 16 consecutive roots at a time (:func:`grow_trees`: one head forward per
level for all of them, each root's nodes masked to its own context and ancestors). The live engine
feeds the head in chunks (one per accepted path), one tree at a time, and takes the features from its
tree-verification forwards, so the recorded scores can differ from a live run's in the last float bits
(tests/test_traces.py measures it, and checks the trees against the live engine's); the discrete
outcome (tokens, beams, selections, accepted lengths) is what the simulator must and does reproduce.

On disk (:func:`save_trace`): one safetensors file per prompt (numpy arrays, no pickles) whose
metadata key ``adaptree_trace`` holds a JSON header: format version, fingerprints (sha256) of the
target, the head and the settings, the settings themselves, the prompt's key, the stop reason and
the emitted length. Tensors: ``prompt`` int32 [n], ``output`` int32 [M], ``features`` [end, 3H]
(absent with ``feature_dtype="none"``), and per width ``w{W}.tokens`` int32 [end, C],
``w{W}.scores`` float32 [end, C], ``w{W}.beam`` int16 [end, max_depth, W], ``w{W}.entropy`` float32
[end, max_depth, W] (per-row draft entropies, where the tree code exposes them) with
C = W + (max_depth - 1) * W * W, and with ``hidden_dtype`` other than ``none``, ``w{W}.hidden`` [end, max_depth, H]:
the draft head's output hidden state that drafted each level's best beam node (what SpecDec++'s classifier reads,
:meth:`~adaptree.core.tree.DraftTree.best_hidden`). A :class:`TraceStore` is a folder of such files plus
``manifest.json`` (a :class:`~adaptree.offline.store.FingerprintedStore`); recording into it resumes and
refuses a different model, head or settings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from adaptree.core.batched import batched_decode
from adaptree.core.config import between, check_fields, choice, positive
from adaptree.core.context import DEFAULT_SELECT, ContextIndex, ContextMatch
from adaptree.core.controller import MAX_DEPTH, MAX_WIDTH
from adaptree.offline.store import (
    FingerprintedStore,
    StoreFormat,
    StoreSettings,
    head_fingerprint,
    model_fingerprint,
    read_record,
    write_record,
)

TRACE_VERSION = 1
META_KEY = "adaptree_trace"
FEATURE_DTYPES = {"float16": np.float16, "float32": np.float32, "none": None}


# --------------------------------------------------------------------------------------------------
# settings and fingerprints
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSettings(StoreSettings):
    """What a trace is recorded with; part of its fingerprint."""

    widths: tuple[int, ...] = between(1, MAX_WIDTH, (10,))
    """Beam widths W to record a tree for at every position (Re-SpS needs several)."""
    max_depth: int = between(1, MAX_DEPTH, 12)
    """Levels drafted at every position (LTD's maximum depth)."""
    max_new_tokens: int = positive(256)
    """The engine's token limit; the trace covers the output up to it (or EOS) plus a look-ahead."""
    eos_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these (kept in the output), as in the engine."""
    max_seq_len: int | None = None
    """The engine's context limit; None = the target's."""
    feature_dtype: str = choice(FEATURE_DTYPES, "float16")
    """Stored target features: float16, float32 (exact replay of feature-based controllers) or none."""
    hidden_dtype: str = choice(FEATURE_DTYPES, "none")
    """Stored draft-head hidden state of every level's best beam node (SpecDec++): float16, float32 or none."""
    extra: tuple[tuple[str, str], ...] = ()
    """Free-form settings that must match on resume (tokenizer, chat template, dataset...)."""

    added: ClassVar[dict] = {"hidden_dtype": "none"}

    def __post_init__(self) -> None:
        widths = tuple(int(w) for w in self.widths)
        if not widths or len(set(widths)) != len(widths):
            raise ValueError(f"widths must be distinct integers, at least one, got {self.widths!r}")
        object.__setattr__(self, "widths", tuple(sorted(widths)))
        check_fields(self)
        object.__setattr__(self, "eos_token_ids", tuple(sorted({int(t) for t in self.eos_token_ids})))
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in dict(self.extra).items())))


TRACE_FORMAT = StoreFormat(
    META_KEY, TRACE_VERSION, TraceSettings, record="trace", folder="trace folder",
    labels={"model": "target model", "head": "draft head", "settings": "trace settings"},
    remedy="record traces for this {what} into another folder")
"""Trace files and folders (:mod:`adaptree.offline.store`); their fingerprints: ``model``
(:func:`~adaptree.offline.store.model_fingerprint`), ``head`` (:func:`~adaptree.offline.store.head_fingerprint`),
``settings`` (:meth:`TraceSettings.fingerprint`)."""


# --------------------------------------------------------------------------------------------------
# in-memory traces
# --------------------------------------------------------------------------------------------------


def num_candidates(width: int, depth: int) -> int:
    """Candidates of a tree with ``depth`` levels: W + (depth - 1) * W^2."""
    return 0 if depth <= 0 else width + (depth - 1) * width * width


def level_offset(width: int, level: int) -> int:
    """Index of the first candidate of 1-based ``level`` in the level-by-level storage."""
    return num_candidates(width, level - 1)


@dataclass
class WidthTrace:
    """The trees of one width at every root position of one prompt."""

    width: int
    max_depth: int
    tokens: np.ndarray
    """``[J, C]`` int32 candidate target-token ids, level by level."""
    scores: np.ndarray
    """``[J, C]`` float32 cumulative log-probs."""
    beam: np.ndarray
    """``[J, max_depth, W]`` int16: positions within each level of its beam (the top-W of the level)."""
    entropy: np.ndarray | None = None
    """``[J, max_depth, W]`` float32 entropy (nats) of each distribution a level's draft forward produced
    (row r of level d = the distribution of ``child_scores`` row r; level 1 has one row, the rest NaN);
    None when the tree code exposes no ``DraftStep.entropy``."""
    hidden: np.ndarray | None = None
    """``[J, max_depth, H]`` the draft head's output hidden state that drafted each level's best beam node (the
    row of ``child_scores`` it came from), float16 or float32; None unless recorded (``hidden_dtype``)."""
    _torch: tuple | None = field(default=None, repr=False)
    _tables: dict = field(default_factory=dict, repr=False)
    """:func:`acceptance_table` of every root position per (depth, positions): they do not depend on the machine, so
    replaying one trace under many latency models (a family's table) computes each once."""

    @property
    def candidates(self) -> int:
        return self.tokens.shape[1]

    def depths(self) -> np.ndarray:
        """``[C]`` 1-based level of every candidate (the same at every position)."""
        w = self.width
        return np.concatenate([np.ones(w, np.int64)] + [np.full(w * w, d, np.int64)
                                                        for d in range(2, self.max_depth + 1)])

    def parents(self) -> np.ndarray:
        """``[J, C]`` int64 parent candidate index (-1 for level 1), as ``DraftTree.candidate_parents``."""
        j, w = self.tokens.shape[0], self.width
        out = np.empty((j, self.candidates), np.int64)
        out[:, :w] = -1
        for d in range(2, self.max_depth + 1):
            start, prev = level_offset(w, d), level_offset(w, d - 1)
            cand = self.beam[:, d - 2].astype(np.int64) + prev  # [J, W] beam of level d-1
            out[:, start:start + w * w] = np.repeat(cand, w, axis=1)
        return out

    def torch_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens int64, scores float32, parents int64, depths int64, beam int64) as torch tensors, cached."""
        if self._torch is None:
            self._torch = (torch.from_numpy(self.tokens.astype(np.int64)), torch.from_numpy(self.scores),
                           torch.from_numpy(self.parents()), torch.from_numpy(self.depths()),
                           torch.from_numpy(self.beam.astype(np.int64)))
        return self._torch


@dataclass
class PromptTrace:
    """Everything recorded for one prompt (see the module docstring)."""

    key: str
    prompt: np.ndarray
    """``[n]`` prompt token ids."""
    output: np.ndarray
    """``[M]`` greedy output: the engine's tokens (``end`` of them) then the look-ahead."""
    end: int
    """Tokens the engine emits (its stop included: EOS, max_new_tokens or the context limit)."""
    stop_reason: str
    max_len: int
    """The engine's context limit (prompt + generated)."""
    settings: TraceSettings
    widths: dict[int, WidthTrace]
    features: np.ndarray | None = None
    """``[end, 3H]`` target features of the position before each root (``CycleContext.features``)."""
    fingerprints: dict[str, str] = field(default_factory=dict)
    """``model``, ``head``, ``settings`` sha256 digests."""
    info: dict = field(default_factory=dict)
    """Diagnostics (e.g. ``full_forward_mismatches``: output tokens the single full forward disagrees on)."""

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def max_depth(self) -> int:
        return self.settings.max_depth

    def width(self, w: int) -> WidthTrace:
        if w not in self.widths:
            raise ValueError(f"width W={w} was not recorded in trace {self.key!r} (recorded: "
                             f"{', '.join(map(str, sorted(self.widths)))}); record it with --width {w}")
        return self.widths[w]

    def header(self) -> dict:
        return {"version": TRACE_VERSION, "key": self.key, "end": self.end, "stop_reason": self.stop_reason,
                "max_len": self.max_len, "settings": self.settings.to_dict(), "fingerprints": self.fingerprints,
                "info": self.info}


# --------------------------------------------------------------------------------------------------
# acceptance from a trace
# --------------------------------------------------------------------------------------------------


def context_matches(prompt: Sequence[int], output: Sequence[int], positions: int, max_tokens: int,
                    max_ngram: int = 4, max_match: int = 64, select: str = DEFAULT_SELECT
                    ) -> Iterator[tuple[int, ContextMatch | None]]:
    """``(j, match)`` at every root ``j < positions``: the longest earlier match of ``prompt + output[:j+1]`` and
    its ``max_tokens`` continuation tokens, as the cycle loop's :class:`~adaptree.core.context.ContextIndex` (of
    ``max_ngram``, ``max_match``, ``select``) proposes them there (greedy: the context is the recorded output's
    prefix)."""
    idx = ContextIndex(max_ngram=max_ngram, max_match=max_match, select=select)
    idx.extend(int(t) for t in prompt)
    for j, t in enumerate(output[:positions]):
        idx.extend([int(t)])
        yield j, idx.match(max_tokens, 1)


def match_mask(wt: WidthTrace, output: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """``[J', C]`` bool: candidate's whole path equals the greedy continuation after root ``j``
    (``output[j+1], output[j+2], ...``). Continuation tokens past the recorded output never match."""
    w, d_max = wt.width, wt.max_depth
    pos = np.arange(wt.tokens.shape[0]) if positions is None else np.asarray(positions)
    tokens = wt.tokens[pos]
    m = len(output)
    padded = np.concatenate([np.asarray(output, np.int64), np.full(d_max + 1, -1, np.int64)])
    out = np.zeros(tokens.shape, dtype=bool)
    out[:, :w] = tokens[:, :w] == padded[pos + 1][:, None]
    for d in range(2, d_max + 1):
        start, prev = level_offset(w, d), level_offset(w, d - 1)
        parent_ok = np.take_along_axis(out[:, prev:prev + (w if d == 2 else w * w)],
                                       wt.beam[pos, d - 2].astype(np.int64), axis=1)  # [J', W] beam rows
        want = padded[pos + d][:, None]
        out[:, start:start + w * w] = (tokens[:, start:start + w * w] == want) & np.repeat(parent_ok, w, axis=1)
    out[pos + 1 >= m] = False  # no continuation recorded at all
    return out


def _top_order(scores: torch.Tensor) -> torch.Tensor:
    """The order ``DraftTree.select`` ranks candidates in (stable descending sort of the scores)."""
    return torch.sort(scores, descending=True, stable=True).indices


def acceptance_table(wt: WidthTrace, output: np.ndarray, depth: int,
                     positions: np.ndarray | None = None) -> np.ndarray:
    """``[J', C_depth + 1]`` int: accepted draft tokens under greedy verification for every size
    V = 0..C_depth of the tree cut at ``depth`` levels, at every root position.

    The verified tree is the top-V candidates of levels 1..depth by cumulative score (the rule of
    ``DraftTree.select``); the accepted length is the depth of its deepest node whose path matches
    the continuation (the selected set is a tree, so that node's ancestors are in it too).
    """
    if not 1 <= depth <= wt.max_depth:
        raise ValueError(f"depth must be in 1..{wt.max_depth}, got {depth}")
    pos = np.arange(wt.tokens.shape[0]) if positions is None else np.asarray(positions)
    prefix = len(pos) == 0 or (pos[0] == 0 and pos[-1] == len(pos) - 1 and (np.diff(pos) == 1).all())
    key = (depth, len(pos), id(output))
    if prefix and key in wt._tables and wt._tables[key][0] is output:
        return wt._tables[key][1].astype(np.int64)
    table = _acceptance_table(wt, output, depth, pos)
    if prefix:  # the common case (every root position up to T): kept small, accepted lengths are <= max_depth
        wt._tables[key] = (output, table.astype(np.int8))
    return table


def _acceptance_table(wt: WidthTrace, output: np.ndarray, depth: int, pos: np.ndarray) -> np.ndarray:
    c = num_candidates(wt.width, depth)
    match = match_mask(wt, output, pos)[:, :c]
    gain = torch.from_numpy(np.where(match, wt.depths()[:c], 0))
    order = _top_order(torch.from_numpy(np.ascontiguousarray(wt.scores[pos, :c])))
    ranked = torch.gather(gain, 1, order)
    best = torch.cummax(ranked, dim=1).values
    return torch.cat([torch.zeros(len(pos), 1, dtype=best.dtype), best], dim=1).numpy()


def accepted_length(wt: WidthTrace, output: np.ndarray, position: int, depth: int, size: int,
                    match: np.ndarray | None = None) -> int:
    """Accepted draft tokens at root ``position`` for the tree cut at ``depth`` levels, top ``size``
    candidates verified (``size`` is clamped to the candidate count). ``match``: this position's row
    of :func:`match_mask`, if already computed."""
    if depth <= 0 or size <= 0:
        return 0
    c = num_candidates(wt.width, depth)
    v = min(int(size), c)
    if match is None:
        match = match_mask(wt, output, np.array([position]))[0]
    m = match[:c]
    if not m.any():
        return 0
    order = _top_order(torch.from_numpy(np.ascontiguousarray(wt.scores[position, :c])))[:v].numpy()
    sel = m[order]
    if not sel.any():
        return 0
    return int(wt.depths()[order[sel]].max())


# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------


@torch.inference_mode()
def grow_trees(head, cache, feats: torch.Tensor, seq: torch.Tensor, n: int, end: int, width: int, max_depth: int,
               batch: int = 16, hidden_dtype: str = "none") -> WidthTrace:
    """The draft trees of width ``width`` at roots ``y_0 .. y_{end-1}``, ``batch`` consecutive roots per head forward.

    Root ``j`` (context ``ctx = n + j``) is what :class:`~adaptree.core.tree.DraftTree` grows after consuming the
    pending pair ``(f_{ctx-1}, y_j)`` over a cache holding the pairs before it; here the pending pairs of
    ``batch`` roots go through one causal forward (pair ``i`` sees pairs ``< i``: exactly the context root
    ``j0 + i`` has, and the committed pairs the next chunk starts from), and every later level is one
    forward over the ``batch * W`` beam nodes, a node seeing its root's pairs and its own ancestors. The
    expansion rule is DraftTree's (top-W children per row, cumulative log-probs, the level's global
    top-W as the next beam), applied row-wise per root; tests/test_traces.py checks the trees against
    the live engine's. ``cache`` must hold the pairs ``t < n - 1`` and room for a chunk's tree. ``hidden_dtype``
    other than ``none`` also keeps each level's best beam node's drafting hidden state (:attr:`WidthTrace.hidden`).
    """
    w, dev = width, feats.device
    c = num_candidates(w, max_depth)
    tokens = np.zeros((end, c), np.int32)
    scores = np.zeros((end, c), np.float32)
    beam = np.zeros((end, max_depth, w), np.int16)
    entropy = np.full((end, max_depth, w), np.nan, np.float32)
    keep = FEATURE_DTYPES[hidden_dtype]
    hidden = None  # allocated at the first forward (its width is the head's output's)

    def expand(logits, parent_scores):  # logits [R, vocab], parent_scores [R] -> per-row top-W children
        logp = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_ids = logp.topk(w, dim=-1)
        ent = torch.special.entr(logp.exp()).sum(-1)
        return parent_scores[:, None] + top_lp, head.draft_to_target(top_ids.reshape(-1)), ent

    for j0 in range(0, end, batch):
        b = min(batch, end - j0)
        ctx0 = n + j0
        if cache.length < ctx0 - 1:
            raise RuntimeError(f"draft cache holds {cache.length} positions, expected at least {ctx0 - 1}")
        cache.truncate(ctx0 - 1)
        out_h, logits = head(feats[:, ctx0 - 1:ctx0 - 1 + b], seq[:, ctx0:ctx0 + b], cache=cache)
        base_pos = torch.arange(ctx0 - 1, ctx0 - 1 + b, device=dev)  # draft position of each root's input
        rows_of = torch.arange(b, device=dev)[:, None] * w  # first beam row of each root
        child, tok, ent = expand(logits[0], torch.zeros(b, device=dev))  # [b, W]
        beam_hidden = out_h[0].repeat_interleave(w, dim=0)  # every depth-1 beam node reads its root's output
        # Key slots after the committed context: the b pending pairs, then the tree levels as written.
        see_pairs = torch.ones(b, b, dtype=torch.bool, device=dev).tril_().repeat_interleave(w, dim=0)
        anc = torch.zeros(b * w, 0, dtype=torch.bool, device=dev)
        mask = see_pairs  # the previous level's mask (read from level 2 on)
        sl = slice(j0, j0 + b)
        for d in range(1, max_depth + 1):
            start, level = level_offset(w, d), tok.reshape(b, -1)  # W (level 1) or W*W children per root
            flat = child.reshape(b, -1)
            tokens[sl, start:start + level.shape[1]] = level.cpu().numpy()
            scores[sl, start:start + level.shape[1]] = flat.cpu().numpy()
            entropy[sl, d - 1, :ent.numel() // b] = ent.reshape(b, -1).cpu().numpy()
            beam_scores, beam_pos = flat.topk(w, dim=-1)  # [b, W] positions within the level
            beam[sl, d - 1] = beam_pos.cpu().numpy()
            if keep is not None:  # the row whose distribution drafted the best beam node (level 1: the root's)
                if hidden is None:
                    hidden = np.zeros((end, max_depth, out_h.shape[-1]), keep)
                best_row = torch.div(beam_pos[:, 0], w, rounding_mode="floor") + rows_of[:, 0]
                hidden[sl, d - 1] = (out_h[0] if d == 1 else out_h[0, best_row]).float().cpu().numpy()
            if d == max_depth:
                break
            rows = (torch.div(beam_pos, w, rounding_mode="floor") + (rows_of if d > 1 else 0)).reshape(-1)
            beam_tokens = level.gather(1, beam_pos).reshape(1, -1)
            if d > 1:
                beam_hidden = out_h[0, rows]
                anc = mask[rows, b:]
            mask = torch.cat([see_pairs, anc, torch.eye(b * w, dtype=torch.bool, device=dev)], dim=1)
            pos = (base_pos + d).repeat_interleave(w)
            out_h, logits = head(beam_hidden[None], beam_tokens, position_ids=pos, cache=cache, tree_mask=mask)
            child, tok, ent = expand(logits[0], beam_scores.reshape(-1))  # [b*W, W]
    return WidthTrace(w, max_depth, tokens, scores, beam, entropy, hidden)


@torch.inference_mode()
def record_trace(target, head, prompt_ids: Sequence[int], max_new_tokens: int = 256, width: int | Sequence[int] = 10,
                 max_depth: int = 12, eos_token_ids: Sequence[int] = (), *, settings: TraceSettings | None = None,
                 key: str = "prompt", fingerprints: dict[str, str] | None = None, batch: int = 16,
                 output: tuple[Sequence[int], int, str] | None = None) -> PromptTrace:
    """Record the trace of one prompt (see the module docstring).

    :param width: one beam width or several (a tree is recorded per width).
    :param settings: overrides ``max_new_tokens``, ``width``, ``max_depth`` and ``eos_token_ids``.
    :param fingerprints: precomputed ``model``/``head`` digests (hashing a large model once per prompt is waste).
    :param batch: roots whose trees are grown together (:func:`grow_trees`); the trace does not depend on it
        beyond the last float bits.
    :param output: the greedy output already computed (``(tokens with look-ahead, end, stop_reason)``, one
        item of :func:`~adaptree.core.batched.batched_decode`); the engine run is skipped.
    """
    from adaptree.core.engine import Engine

    if settings is None:
        widths = (width,) if isinstance(width, int) else tuple(width)
        settings = TraceSettings(widths=widths, max_depth=max_depth, max_new_tokens=max_new_tokens,
                                 eos_token_ids=tuple(eos_token_ids))
    s = settings
    prompt = [int(t) for t in prompt_ids]
    n = len(prompt)
    max_len = min(s.max_seq_len or target.max_seq_len, target.max_seq_len)
    if output is not None:
        out, end, stop = list(output[0]), int(output[1]), str(output[2])
    else:
        eng = Engine(target, None, eos_token_ids=s.eos_token_ids, max_seq_len=s.max_seq_len)
        res = eng.generate(prompt, None, max_new_tokens=s.max_new_tokens)
        out = list(res.token_ids)
        end, stop = len(out), res.stop_reason
        if n + end < eng.max_len:  # look-ahead: what the target would say after the engine stopped
            eng.eos = frozenset()
            more = eng.generate(prompt + out, None, max_new_tokens=s.max_depth + 1)
            out += more.token_ids
    seq = torch.tensor([prompt + out], dtype=torch.long, device=target.device)
    total = seq.shape[1]

    # Features of every position from one forward (and a check of its greedy tokens against the run).
    fwd = target(seq[:, :-1], features=True, logits_at=slice(n - 1, None))
    feats = fwd.features  # [1, total-1, 3H]
    from adaptree.core.verify import greedy_tokens
    mismatches = int((greedy_tokens(fwd.logits[0]) != seq[0, n:]).sum())

    # Head: one prefill over the committed pairs (f_t, s_{t+1}) for t < n - 1, then the trees of
    # ``batch`` consecutive roots at a time (grow_trees).
    width_max = max(s.widths)
    cache = head.new_cache(max_len + batch * (1 + (s.max_depth - 1) * width_max))
    if n > 1:
        head(feats[:, :n - 1], seq[:, 1:n], cache=cache, logits_at=slice(-1, None))
    widths = {w: grow_trees(head, cache, feats, seq, n, end, w, s.max_depth, batch, s.hidden_dtype) for w in s.widths}
    np_dtype = FEATURE_DTYPES[s.feature_dtype]
    features = None
    info = {"full_forward_mismatches": mismatches, "total_len": total}
    if np_dtype is not None:
        f32 = feats[0, n - 1:n - 1 + end].float().cpu().numpy()
        features = f32.astype(np_dtype)
        if not np.isfinite(features).all() and np.isfinite(f32).all():  # float16 overflow: keep float32
            features, info["features_float32_overflow"] = f32, True
    fps = dict(fingerprints or {})
    fps.setdefault("model", model_fingerprint(target))
    fps.setdefault("head", head_fingerprint(head))
    fps["settings"] = s.fingerprint()
    return PromptTrace(key=key, prompt=np.asarray(prompt, np.int32), output=np.asarray(out, np.int32), end=end,
                       stop_reason=stop, max_len=max_len, settings=s, widths=widths, features=features,
                       fingerprints=fps, info=info)


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def trace_arrays(trace: PromptTrace) -> dict[str, np.ndarray]:
    """The tensors of a trace file (see the module docstring)."""
    tensors = {"prompt": trace.prompt.astype(np.int32), "output": trace.output.astype(np.int32)}
    if trace.features is not None:
        tensors["features"] = trace.features
    for w, wt in trace.widths.items():
        tensors[f"w{w}.tokens"] = wt.tokens.astype(np.int32)
        tensors[f"w{w}.scores"] = wt.scores.astype(np.float32)
        tensors[f"w{w}.beam"] = wt.beam.astype(np.int16)
        if wt.entropy is not None:
            tensors[f"w{w}.entropy"] = wt.entropy.astype(np.float32)
        if wt.hidden is not None:
            tensors[f"w{w}.hidden"] = wt.hidden
    return tensors


def save_trace(trace: PromptTrace, path: str | os.PathLike) -> None:
    """Write one prompt's trace as safetensors (atomically: a temporary file renamed into place)."""
    write_record(path, trace_arrays(trace), META_KEY, trace.header())


def load_trace(path: str | os.PathLike, expect: dict[str, str] | None = None) -> PromptTrace:
    """Read a trace written by :func:`save_trace`; ``expect`` (``model``/``head``/``settings`` digests)
    refuses a trace recorded with anything else."""
    header, arrays = read_record(path, TRACE_FORMAT, expect)
    s = TraceSettings.from_dict(header["settings"])
    widths = {w: WidthTrace(w, s.max_depth, arrays[f"w{w}.tokens"], arrays[f"w{w}.scores"], arrays[f"w{w}.beam"],
                            arrays.get(f"w{w}.entropy"), arrays.get(f"w{w}.hidden")) for w in s.widths}
    return PromptTrace(key=header["key"], prompt=arrays["prompt"], output=arrays["output"], end=header["end"],
                       stop_reason=header["stop_reason"], max_len=header["max_len"], settings=s, widths=widths,
                       features=arrays.get("features"), fingerprints=header["fingerprints"], info=header.get("info", {}))


class TraceStore(FingerprintedStore):
    """A folder of traces: ``manifest.json`` (fingerprints + settings) and one file per prompt.

    Opening a folder recorded with another model, head or settings raises ``ValueError``; recording
    skips the prompts already there (resume) and re-records a prompt whose stored ids differ.
    """

    format = TRACE_FORMAT

    def __init__(self, folder: str | os.PathLike, fingerprints: dict[str, str] | None = None,
                 settings: TraceSettings | None = None) -> None:
        if fingerprints is not None and settings is not None:  # a trace's fingerprints include its settings'
            fingerprints = {**fingerprints, "settings": settings.fingerprint()}
        super().__init__(folder, fingerprints, settings)

    def has(self, key: str, prompt_ids: Sequence[int] | None = None) -> bool:
        return super().has(key, None if prompt_ids is None else {"prompt": prompt_ids})

    def put(self, trace: PromptTrace) -> Path:
        return self.save(trace.key, trace_arrays(trace), trace.header(), trace.fingerprints)

    def keys_on_disk(self) -> list[Path]:
        return self.files()

    def load_all(self) -> list[PromptTrace]:
        return [load_trace(p, self.fingerprints) for p in self.files()]

    def record(self, target, head, prompts: Sequence[tuple[str, Sequence[int]]], progress: bool = True,
               prompt_batch: int = 8) -> dict:
        """Record every ``(key, prompt_ids)`` not already stored; returns counts (recorded, skipped).

        The greedy outputs of ``prompt_batch`` prompts at a time come from one batched autoregressive run
        (:func:`~adaptree.core.batched.batched_decode`); every trace is saved as soon as it is complete (an
        interrupted recording resumes from the prompts already stored).
        """
        from tqdm import tqdm

        if prompt_batch < 1:
            raise ValueError(f"prompt_batch must be >= 1, got {prompt_batch}")
        fps = {"model": self.fingerprints["model"], "head": self.fingerprints["head"]}
        s = self.settings
        # Prompts of similar lengths share a batch (less padding).
        todo = sorted(((k, ids) for k, ids in prompts if not self.has(k, ids)), key=lambda p: len(p[1]))
        skipped, done = len(prompts) - len(todo), 0
        bar = tqdm(total=len(prompts), initial=skipped, desc="traces", unit="prompt", disable=not progress)
        for i in range(0, len(todo), prompt_batch):
            chunk = todo[i:i + prompt_batch]
            outs = batched_decode(target, [ids for _, ids in chunk], s.max_new_tokens, s.eos_token_ids,
                                  s.max_seq_len, lookahead=s.max_depth + 1)
            for (key, ids), output in zip(chunk, outs):
                self.put(record_trace(target, head, ids, settings=s, key=key, fingerprints=fps, output=output))
                done += 1
                bar.update(1)
                bar.set_postfix(recorded=done, skipped=skipped)
        bar.close()
        return {"recorded": done, "skipped": skipped}


def open_store_for(folder: str | os.PathLike, target, head, settings: TraceSettings) -> TraceStore:
    """A store for recording ``target`` + ``head`` with ``settings`` (fingerprints computed here)."""
    return TraceStore(folder, {"model": model_fingerprint(target), "head": head_fingerprint(head)}, settings)
