"""RADAR's offline dataset (SPEC.md §4): per-step beam scores and, for every stop point, the EXACT
distribution of the accepted length under the engine's lossless sampling rule.

Stop points. In this engine a cycle always drafts one level (the draft forward over the newly accepted
positions); the policy decides after each draft forward whether to run another one. Stop point ``k``
(``k = 0 .. max_depth - 1``) = drafting stopped after ``k`` CONTINUE decisions = ``k + 1`` draft forwards =
a tree of depth ``k + 1``. ``k = 0`` is the paper's "star of first-level tokens" (the root and its top-W
children). ``max_depth`` (D_max, default 8) is the largest number of draft calls, as in the paper's
"maximum number of calls to the draft model is 8" and EAGLE-3's fixed 8 calls. The tree verified at
stop point ``k`` is :meth:`DraftTree.select` ``(V, levels=k + 1)``: the top-V candidates of levels
``1..k+1`` by cumulative log-prob, exactly what the engine verifies when a controller stops there.

Exact distribution (module :func:`acceptance_distribution`). ``verify_sample`` walks down the tree; at
node ``n`` with target distribution ``p_n`` (warped: temperature, top-k, top-p) it tries the children
``c_1, c_2, ...`` in order, accepting ``c_j`` with probability ``p(x_j)`` of the residual renormalised
after the rejections of ``c_1..c_{j-1}``. Sibling tokens are distinct (top-W of one draft distribution),
so ``P(reach trial j) = 1 - sum_{l<j} p_n(x_l)`` and ``P(accept c_j | at n) = p_n(x_j)``: the order of
the children does not matter. Hence, with ``a(c) = p_parent(c)(token c)``:

    q(root) = 1,  q(c) = q(parent(c)) * a(c)           (P(node c accepted))
    P(path ends at n) = q(n) * (1 - sum_{c child of n} a(c))
    P(accepted length = j) = sum over nodes n at depth j of P(path ends at n)

Greedy (temperature 0): ``a(c) = 1`` iff the token is the target's argmax at the parent, which gives the
point mass of :func:`~adaptree.core.verify.verify_greedy`.

One target forward per cycle. The trees of the stop points are not sub-trees of the largest one
(the top-V of fewer levels can keep a shallow node that deeper candidates push out of the top-V of all
levels), but every one is an ancestor-closed subset of the SAME candidate tree, so their union is a
tree. The recorder runs ONE extra target forward over that union (tree-masked: a node's logits
depend only on the context and its ancestors, hence are the same in any tree that contains it;
tests/test_radar.py checks both claims), reads every stop point's distribution from it, and puts the
target cache back. Then the engine proceeds with its normal cycle: it verifies the ``max_depth`` tree
and samples the acceptance, so the recorded trajectory is EAGLE-3's static tree at depth ``max_depth``.

The recorder is a controller (:class:`RadarRecorder`): it always continues to ``max_depth`` and does its
work in ``choose_size``, so the engine loop is reused as is. On disk (:class:`RadarStore`, a
:class:`~adaptree.offline.store.FingerprintedStore`): a folder with ``manifest.json`` (fingerprints +
settings) and one safetensors file per prompt (no pickles) with
``scores`` float32 [C, D, W] (beam scores after each draft forward), ``dist`` float32 [C, D, A + 1] (A: the most
tokens a cycle can accept, D without chains)
(row k: P(accepted = j) at stop point k), ``sizes`` int32 [C, D] (V of each stop point's tree),
``context_len`` int32 [C], ``accepted`` int32 [C] (the trajectory's sampled acceptance), ``union`` int32
[C] (nodes of the union forward), ``match_length`` int32 [C] (see below), and a JSON header (key, prompt, stop
reason, settings, fingerprints).

Context chains. With ``chain_tokens`` K > 0 every cycle also carries the context's chain
(:class:`~adaptree.core.context.ContextIndex` over the prompt and the output, n-grams of up to ``max_ngram``; the
longest earlier match's K-token continuation), as the engine verifies it next to a tree: every stop point's tree
is then that tree plus the chain's path (the prefix the tree holds shared; still a sub-tree of the one union, so
the one forward still serves all), ``dist`` and ``sizes`` are those of the trees with the chain, and
``match_length`` is the match's length (0: no match, no chain). A policy that observes the match reads its
features from the length through a chain calibration (:meth:`~adaptree.methods.common.chain.ChainRule.features`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from adaptree.core.context import ContextIndex
from adaptree.core.config import at_least, between, check_fields, positive
from adaptree.core.controller import MAX_DEPTH, MAX_WIDTH, Controller, CycleContext, TreePlan
from adaptree.core.tree import DraftStep, DraftTree, VerifyTree, add_chain, chain_walk
from adaptree.core.verify import SamplingConfig, greedy_tokens, warp_probs
from adaptree.offline.store import (
    FingerprintedStore,
    StoreFormat,
    StoreSettings,
    read_record,
)

RADAR_DATA_VERSION = 1
META_KEY = "adaptree_radar"


# --------------------------------------------------------------------------------------------------
# the exact distribution
# --------------------------------------------------------------------------------------------------


def child_accept_probs(tree: VerifyTree, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[N]`` float64: probability that node ``c`` is accepted given its parent was (1 for the root)."""
    if sampling.greedy:
        pred = greedy_tokens(logits)
        a = (tree.tokens == pred[tree.parents.clamp(min=0)]).double()
    else:
        probs = warp_probs(logits, sampling).double()
        a = probs[tree.parents.clamp(min=0), tree.tokens]
    a[0] = 1.0
    return a


def acceptance_distribution(tree: VerifyTree, logits: torch.Tensor, sampling: SamplingConfig,
                            max_len: int | None = None) -> torch.Tensor:
    """Exact ``P(accepted draft tokens = j)``, ``j = 0 .. max_len`` (default: the tree's depth), of
    :func:`~adaptree.core.verify.verify` on ``tree`` with target ``logits [N, vocab]`` (see module doc)."""
    return distribution_from_accept(tree, child_accept_probs(tree, logits, sampling), max_len)


def distribution_from_accept(tree: VerifyTree, a: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """The accepted-length distribution from the per-node acceptance probabilities ``a`` (root: 1)."""
    a = a.double()
    q = torch.where(tree.mask, a[None, :], torch.ones_like(a)[None, :]).prod(dim=1)  # product over the path
    kids = torch.zeros_like(a).index_add_(0, tree.parents[1:], a[1:])
    end = q * (1.0 - kids).clamp(min=0.0)
    n = int(tree.depth.max()) if max_len is None else int(max_len)
    dist = torch.zeros(n + 1, dtype=torch.float64, device=a.device).index_add_(0, tree.depth, end)
    return dist / dist.sum()


def union_of(tree: DraftTree, selections: Sequence[torch.Tensor]) -> tuple[VerifyTree, list[torch.Tensor]]:
    """The tree of the union of candidate selections, and each selection's node indices in it
    (root 0 first, ascending: a topologically ordered sub-tree)."""
    dev = tree.candidate_scores().device
    allc = torch.unique(torch.cat(list(selections))) if selections else torch.zeros(0, dtype=torch.long, device=dev)
    union = tree.tree_of(allc)
    pos = torch.full((tree.num_candidates,), -1, dtype=torch.long, device=dev)
    pos[allc] = torch.arange(1, allc.numel() + 1, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return union, [torch.cat([zero, pos[s]]) for s in selections]


def chain_path(tree: VerifyTree, chain: Sequence[int]) -> torch.Tensor:
    """The nodes of ``tree`` on ``chain``'s path from the root (ascending, the root first), as
    :func:`~adaptree.core.tree.add_chain` walks it, for a tree that holds the whole chain."""
    path = chain_walk(tree, chain)
    if len(path) <= len(chain):
        raise ValueError(f"the tree does not hold the chain (token {int(chain[len(path) - 1])} after node {path[-1]})")
    return torch.tensor(path, dtype=torch.long, device=tree.tokens.device)


def sub_tree(tree: VerifyTree, nodes: torch.Tensor) -> VerifyTree:
    """The :class:`VerifyTree` of ``nodes`` (ascending, root first, ancestor-closed) of ``tree``."""
    remap = torch.full((tree.tokens.numel(),), -1, dtype=torch.long, device=nodes.device)
    remap[nodes] = torch.arange(nodes.numel(), device=nodes.device)
    par = tree.parents[nodes]
    new_par = torch.where(par < 0, par, remap[par.clamp(min=0)])
    if bool((new_par[1:] < 0).any()):
        raise ValueError("the nodes are not closed under parents")
    return VerifyTree(tree.tokens[nodes], new_par, tree.depth[nodes], tree.positions[nodes],
                      tree.mask[nodes][:, nodes])


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RadarDataSettings(StoreSettings):
    """How a RADAR dataset is recorded; part of its fingerprint."""

    width: int = between(1, MAX_WIDTH, 10)
    """Beam width W (EAGLE-3: 10); the policy's input size."""
    max_depth: int = between(1, MAX_DEPTH, 8)
    """D_max: the most draft forwards per cycle (paper: at most 8 calls); stop points 0..D_max-1."""
    size: int = positive(60)
    """Verification size V of every stop point's tree (EAGLE-3: 60; clamped to the candidates)."""
    temperature: float = 1.0
    """Sampling temperature of the engine (paper: 1; 0 = greedy, point-mass distributions)."""
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    """Base seed; prompt ``key`` samples with a seed derived from (seed, key), so resuming is exact."""
    max_new_tokens: int = positive(256)
    max_seq_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: tuple[tuple[str, str], ...] = ()
    """Free-form settings that must match on resume (tokenizer, chat template, dataset...)."""
    chain_tokens: int = at_least(0, 0, integer=True)
    """K > 0: every cycle's trees also carry the context's K-token chain, as the engine verifies it next to a tree;
    0: head trees only."""
    max_ngram: int = positive(4, integer=True)
    """With chain_tokens: the longest n-gram the context index matches (a chain calibration's max_ngram)."""

    def __post_init__(self) -> None:
        check_fields(self)
        SamplingConfig(self.temperature, self.top_p, self.top_k)  # validates
        object.__setattr__(self, "eos_token_ids", tuple(sorted({int(t) for t in self.eos_token_ids})))
        object.__setattr__(self, "extra", tuple(sorted((str(k), str(v)) for k, v in dict(self.extra).items())))

    @property
    def longest_accept(self) -> int:
        """The most draft tokens a cycle can accept: ``dist``'s last index (D_max, or the chain's length if longer)."""
        return max(self.max_depth, self.chain_tokens)

    def sampling(self, key: str) -> SamplingConfig:
        digest = hashlib.sha256(f"radar\0{self.seed}\0{key}".encode()).digest()
        return SamplingConfig(self.temperature, self.top_p, self.top_k, int.from_bytes(digest[:6], "big"))


RADAR_FORMAT = StoreFormat(META_KEY, RADAR_DATA_VERSION, RadarDataSettings, record="RADAR record",
                           folder="RADAR dataset")
"""RADAR records and datasets (:mod:`adaptree.offline.store`); fingerprints ``model`` and ``head``."""


# --------------------------------------------------------------------------------------------------
# the recorder: a controller that drafts to D_max and measures every stop point in choose_size
# --------------------------------------------------------------------------------------------------


@dataclass
class CycleData:
    scores: np.ndarray  # [D, W]
    dist: np.ndarray  # [D, D + 1]
    sizes: np.ndarray  # [D]
    context_len: int
    union: int
    match_length: int = 0
    accepted: int = -1


class RadarRecorder(Controller):
    """Always drafts ``max_depth`` levels; before the engine verifies, runs one target forward over the
    union of every stop point's tree on the engine's cache (then truncated back) and stores the exact
    acceptance-length distributions. The engine then verifies the ``max_depth`` tree as usual.

    :param engine: the :class:`~adaptree.core.engine.Engine` this controller is used with (its target and cache).
    """

    name = "radar-recorder"

    def __init__(self, engine, settings: RadarDataSettings, sampling: SamplingConfig) -> None:
        self.engine, self.settings, self.sampling = engine, settings, sampling
        self.plan = TreePlan(settings.width, settings.max_depth, settings.size)
        self.cycles: list[CycleData] = []
        self._scores: list[torch.Tensor] = []
        self.skipped = 0

    def reset(self) -> None:
        self.cycles, self._scores, self.skipped = [], [], 0

    def context_index(self) -> ContextIndex | None:
        return ContextIndex(max_ngram=self.settings.max_ngram) if self.settings.chain_tokens else None

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        self._scores = []
        self._pending: CycleData | None = None
        self.match = ctx.index.match(self.settings.chain_tokens, 1) if ctx.index is not None else None
        return self.plan.with_chain(self.match.tokens if self.match is not None else ())

    def choose_chain(self, tree: DraftTree | None, plan: TreePlan, size: int) -> int:
        return len(plan.chain)  # the whole chain, as the dataset's trees hold it

    def continue_drafting(self, step: DraftStep) -> bool:
        self._scores.append(step.beam_scores.float().cpu())  # [W]: the beam always has W nodes
        return True

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        st = self.settings
        d = st.max_depth
        if tree.depth != d:  # the context limit cut drafting short (the engine drafts less than planned)
            self.skipped += 1
            return plan.size
        # the engine never calls continue_drafting after the last level: read its beam here
        self._scores.append(tree.beam_scores.float().cpu())
        cache = self.engine.cache
        L = cache.length
        sels = [tree.top_candidates(st.size, levels=k + 1) for k in range(d)]
        union, nodes = union_of(tree, sels)
        if plan.chain:  # every stop point's tree with the chain's path (module docstring)
            union, _ = add_chain(union, plan.chain)
            path = chain_path(union, plan.chain)
            nodes = [torch.unique(torch.cat([nd, path])) for nd in nodes]
        if L + union.tokens.numel() > cache.max_len:  # no room for the union near the context limit
            self.skipped += 1
            return plan.size
        out = self.engine.target(union.tokens[None], position_ids=union.positions, cache=cache,
                                 tree_mask=union.mask, features=False)
        cache.truncate(L)
        a = child_accept_probs(union, out.logits[0], self.sampling)  # a node's a(c) is the same in any sub-tree
        n = st.longest_accept
        dist = np.zeros((d, n + 1), np.float64)
        for k, nd in enumerate(nodes):
            dist[k] = distribution_from_accept(sub_tree(union, nd), a[nd], max_len=n).cpu().numpy()
        self._pending = CycleData(torch.stack(self._scores).numpy(), dist.astype(np.float32),
                                  np.array([nd.numel() - 1 for nd in nodes], np.int32), L, int(union.size),
                                  self.match.length if plan.chain else 0)
        return plan.size

    def end_cycle(self, record) -> None:
        if self._pending is not None:
            self._pending.accepted = int(record.accepted)
            self.cycles.append(self._pending)
            self._pending = None


def record_prompt(engine, prompt_ids: Sequence[int], settings: RadarDataSettings, key: str) -> dict:
    """Generate from one prompt with the recorder; returns the arrays and header of its record."""
    sampling = settings.sampling(key)
    rec = RadarRecorder(engine, settings, sampling)
    res = engine.generate(list(prompt_ids), rec, max_new_tokens=settings.max_new_tokens, sampling=sampling)
    c = rec.cycles
    d, w = settings.max_depth, settings.width
    arrays = {
        "prompt": np.asarray(list(prompt_ids), np.int32),
        "output": np.asarray(res.token_ids, np.int32),
        "scores": np.stack([x.scores for x in c]).astype(np.float32) if c else np.zeros((0, d, w), np.float32),
        "dist": (np.stack([x.dist for x in c]).astype(np.float32) if c
                 else np.zeros((0, d, settings.longest_accept + 1), np.float32)),
        "sizes": np.stack([x.sizes for x in c]).astype(np.int32) if c else np.zeros((0, d), np.int32),
        "context_len": np.asarray([x.context_len for x in c], np.int32),
        "accepted": np.asarray([x.accepted for x in c], np.int32),
        "union": np.asarray([x.union for x in c], np.int32),
        "match_length": np.asarray([x.match_length for x in c], np.int32),
    }
    header = {"key": key, "stop_reason": res.stop_reason, "cycles": len(c), "skipped_cycles": rec.skipped,
              "seed": sampling.seed, "new_tokens": res.new_tokens}
    return {"arrays": arrays, "header": header}


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


@dataclass
class RadarRecord:
    """One prompt's cycles, as read back from disk."""

    key: str
    scores: np.ndarray
    dist: np.ndarray
    sizes: np.ndarray
    context_len: np.ndarray
    accepted: np.ndarray
    header: dict = field(default_factory=dict)
    match_length: np.ndarray | None = None
    """``[C]`` the cycle's context match length (0: none); zeros for a dataset recorded without chains."""

    def __post_init__(self) -> None:
        if self.match_length is None:
            self.match_length = np.zeros(self.scores.shape[0], np.int32)

    @property
    def cycles(self) -> int:
        return int(self.scores.shape[0])


def load_record(path: str | os.PathLike) -> RadarRecord:
    header, a = read_record(path, RADAR_FORMAT)
    return RadarRecord(header["key"], a["scores"], a["dist"], a["sizes"], a["context_len"], a["accepted"], header,
                       a.get("match_length"))


class RadarStore(FingerprintedStore):
    """A folder of RADAR records: ``manifest.json`` and one ``.safetensors`` file per prompt.

    Opening a folder recorded with another model, head or settings raises ``ValueError`` naming what
    differs; :meth:`record` skips the prompts already there (resume).
    """

    format = RADAR_FORMAT

    def load_all(self) -> list[RadarRecord]:
        return [load_record(p) for p in self.files()]

    def record(self, engine, prompts: Sequence[tuple[str, Sequence[int]]], progress: bool = True) -> dict:
        """Record every ``(key, prompt_ids)`` not already stored; returns counts."""
        from tqdm import tqdm

        done = skipped = cycles = 0
        bar = tqdm(prompts, desc="radar dataset", unit="prompt", disable=not progress)
        for key, ids in bar:
            if self.has(key):
                skipped += 1
                continue
            out = record_prompt(engine, ids, self.settings, key)
            self.save(key, out["arrays"], {**out["header"], "settings_sha256": self.settings.fingerprint()})
            done += 1
            cycles += out["header"]["cycles"]
            bar.set_postfix(recorded=done, skipped=skipped, cycles=cycles)
        return {"recorded": done, "skipped": skipped, "cycles": cycles}


# --------------------------------------------------------------------------------------------------
# cycles from greedy traces: any machine, no recording
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MachineSizes:
    """What one machine (a latency model) makes of the traces: its V per depth and its best static tree."""

    table: dict[int, int]
    """Depth -> V (:func:`~adaptree.offline.oracle.sizes_by_depth` on the traces)."""
    depth: int
    """The best static tree's depth: the reference controller whose trajectory gives the cycles."""
    size: int
    """The best static tree's V (``table[depth]``)."""

    def sizes(self, max_depth: int) -> list[int]:
        """The table as a list, index ``d - 1`` = V at depth ``d`` (``1 .. max_depth``)."""
        return [self.table[d] for d in range(1, max_depth + 1)]


@dataclass
class _TraceArrays:
    key: str
    n: int
    """Prompt length: the root of position ``j`` has ``n + j`` tokens of context."""
    positions: int
    """T: the roots a run visits are ``j < T`` (:func:`~adaptree.offline.oracle.terminal_position`)."""
    forced_ar: np.ndarray
    """``[T]`` no room to draft: the engine takes an AR step there (no decision)."""
    scores: np.ndarray
    """``[T, D, W]`` beam scores after each draft forward (what ``DraftStep.beam_scores`` holds)."""
    head_acc: np.ndarray
    """``[T, A]`` accepted draft tokens of every (depth, V) head tree (A = D x the V grid), after the engine's
    clamps."""
    head_size: np.ndarray
    """``[T, A]`` its V after the clamps."""
    acc: np.ndarray
    """``[T, A]`` accepted tokens of the trees the cycles verify (the head tree, and the whole chain with chains)."""
    nodes: np.ndarray
    """``[T, A]`` draft nodes those trees verify."""
    match_length: np.ndarray
    """``[T]`` the context match's length where a chain is verified, else 0."""


class TraceCycles:
    """RADAR's cycles from greedy traces (:class:`~adaptree.offline.traces.PromptTrace`), for any machine.

    With greedy decoding a cycle's root position is the whole state, and the trace holds the tree at every root:
    the beam scores after each draft forward and the accepted length of every (depth, V) tree (a point mass), so
    one recording serves every latency model. What depends on the machine is computed per latency model from
    arrays built once here:

    * :meth:`machine`: the machine's V per depth, exactly :func:`~adaptree.offline.oracle.sizes_by_depth` (the
      static grid's total times per (depth, V), walked as :func:`~adaptree.offline.oracle.static_times` walks it;
      tests check the equality), and its best static tree (the grid's minimum).
    * :meth:`records`: the cycles as :class:`RadarRecord` objects (what :func:`~adaptree.methods.radar.train.
      make_episodes` reads): stop point ``k`` verifies ``table[k + 1]`` nodes of the tree of ``k + 1`` levels.
      The positions are those the machine's best static tree visits (a fixed reference controller, as the
      T=1 dataset is the trajectory of static EAGLE-3): the roots a good policy for that machine reaches. Every
      position alike would over-weigh the easy spans (a span accepted in one cycle would count at each of its
      positions) and so the value of deep trees, the decision being learned.

    Accepted lengths and the engine's clamps (V to the candidates and the context room, AR steps without room) are
    the oracle's (:func:`~adaptree.offline.oracle.tree_outcomes`; with ``chain_tokens`` the whole context chain
    verified next to every tree, as the dataset's chains are whole).

    :param width: W (recorded in every trace).
    :param max_depth: D_max of the episodes (at most the traces').
    :param sizes: the V grid the tables choose from (the oracle's default).
    :param chain_tokens: verify the context's chain of up to this many tokens next to every tree (0: none), its
        matches of n-grams of up to ``max_ngram`` tokens.
    """

    def __init__(self, traces, width: int, max_depth: int, sizes: Sequence[int] | None = None,
                 chain_tokens: int = 0, max_ngram: int = 4, max_new_tokens: int | None = None) -> None:
        from adaptree.offline.oracle import DEFAULT_SIZES, terminal_position, tree_outcomes
        from adaptree.offline.traces import context_matches, level_offset

        traces = list(traces)
        if not traces:
            raise ValueError("no greedy traces to make RADAR's cycles from")
        if max_depth < 1 or any(t.max_depth < max_depth for t in traces):
            raise ValueError(f"max_depth must be in 1..{min(t.max_depth for t in traces)} (the traces' max_depth), "
                             f"got {max_depth}")
        self.width, self.max_depth = int(width), int(max_depth)
        self.sizes = tuple(sorted({int(v) for v in (DEFAULT_SIZES if sizes is None else sizes) if int(v) >= 1}))
        if not self.sizes:
            raise ValueError(f"sizes needs at least one V >= 1, got {sizes!r}")
        self.chain_tokens, self.max_ngram = int(chain_tokens), int(max_ngram)
        depths = range(1, self.max_depth + 1)
        w = self.width
        self.arrays: list[_TraceArrays] = []
        for tr in traces:
            wt = tr.width(w)
            T = terminal_position(tr, max_new_tokens)
            o = tree_outcomes(tr, w, depths, self.sizes, chains=self.chain_tokens, max_ngram=self.max_ngram,
                              max_new_tokens=max_new_tokens)
            self.depth_of, self.size_of = o["depth"].astype(np.int64), o["size"].astype(np.int64)  # [A] the grid
            head_acc, head_size = o["accepted"].astype(np.int32), o["verified"].astype(np.int32)
            acc, nodes, match = head_acc, head_size, np.zeros(T, np.int32)
            if self.chain_tokens:
                acc, nodes = o["chain_accepted"].astype(np.int32), o["chain_verified"].astype(np.int32)
                for j, m in context_matches(tr.prompt, tr.output.tolist(), T, self.chain_tokens, self.max_ngram):
                    match[j] = m.length if m is not None else 0
            pos = np.arange(T)
            scores = np.stack([np.take_along_axis(wt.scores[:T, level_offset(w, d):], wt.beam[:T, d - 1].astype(
                np.int64), axis=1) for d in depths], axis=1) if T else np.zeros((0, self.max_depth, w), np.float32)
            self.arrays.append(_TraceArrays(tr.key, tr.prompt_len, T, tr.max_len - tr.prompt_len - pos <= 1,
                                            scores.astype(np.float32), head_acc, head_size, acc, nodes, match))

    @property
    def columns(self) -> int:
        return int(self.depth_of.size)

    def column(self, depth: int, size: int) -> int:
        """The column of the tree (``depth``, V = ``size``); V must be one of :attr:`sizes`."""
        hit = np.flatnonzero((self.depth_of == depth) & (self.size_of == size))
        if hit.size != 1:
            raise ValueError(f"no tree of depth {depth} and V={size} in the grid (depths 1..{self.max_depth}, "
                             f"V in {list(self.sizes)})")
        return int(hit[0])

    def totals(self, latency) -> np.ndarray:
        """``[A]`` the modelled seconds of every static (depth, V) head tree over all traces (static_times' walk)."""
        total = np.zeros(self.columns)
        d = self.depth_of
        for a in self.arrays:
            T = a.positions
            if T == 0:
                continue
            L = (a.n + np.arange(T)).astype(np.float64)
            step = latency.draft_steps(self.width, L)
            cost = d * step[:, None] + latency.verify_times(a.head_size, L[:, None]) + latency.other_s
            cost = np.where(a.forced_ar[:, None], latency.ar_steps(L)[:, None], cost)
            pos = np.zeros(self.columns, np.int64)
            spent = np.zeros(self.columns)
            cols = np.arange(self.columns)
            active = pos < T
            while active.any():
                idx = cols[active]
                p = pos[idx]
                spent[idx] += cost[p, idx]
                pos[idx] = p + a.head_acc[p, idx] + 1
                active = pos < T
            total = total + spent
        return total

    def machine(self, latency) -> MachineSizes:
        """The machine's V per depth and best static tree on these traces (see the class docstring)."""
        total = self.totals(latency)
        table = {}
        for d in range(1, self.max_depth + 1):
            cols = np.flatnonzero(self.depth_of == d)  # ascending V
            table[d] = int(self.size_of[cols[int(np.argmin(total[cols]))]])  # the first minimum: the smaller V
        best = int(np.argmin(total))  # the grid's (depth, V) order: best_static's tie rule
        depth = int(self.depth_of[best])
        return MachineSizes(table, depth, int(self.size_of[best]))

    def records(self, sizes: MachineSizes) -> list[RadarRecord]:
        """Every trace's cycles for a machine (:meth:`machine`): the roots its best static tree visits (AR steps
        where there is no room to draft are no cycles), stop point ``k`` verifying ``sizes.table[k + 1]`` nodes."""
        cols = np.array([self.column(d, v) for d, v in enumerate(sizes.sizes(self.max_depth), start=1)])
        ref = self.column(sizes.depth, sizes.size)
        longest = max(self.max_depth, self.chain_tokens)
        out = []
        for a in self.arrays:
            visited, j = [], 0
            while j < a.positions:
                if a.forced_ar[j]:
                    j += 1
                    continue
                visited.append(j)
                j += int(a.acc[j, ref]) + 1
            pos = np.asarray(visited, np.int64)
            acc = a.acc[pos][:, cols]  # [P, D]
            dist = np.zeros((len(pos), self.max_depth, longest + 1), np.float32)
            np.put_along_axis(dist, acc[..., None].astype(np.int64), 1.0, axis=2)  # greedy: a point mass
            out.append(RadarRecord(a.key, a.scores[pos], dist, a.nodes[pos][:, cols], (a.n + pos).astype(np.int32),
                                   a.acc[pos, ref].astype(np.int32), {"reference": [sizes.depth, sizes.size]},
                                   a.match_length[pos]))
        return out
