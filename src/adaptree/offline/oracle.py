"""The best any controller could do on a greedy trace: a dynamic-programming oracle, and the best static tree.

With greedy decoding the state of a generation between cycles is one integer, the output position
``j`` of the next cycle's root (the context is ``prompt + output[:j+1]``). A cycle from ``j`` that
drafts ``d`` levels of width ``W`` and verifies the top ``V`` candidates costs, in the latency model,
``d * draft_step(W, L) + verify(V', L) + other_s`` with ``L = n + j`` and ``V' = min(V, C_d, room - 1)``
(the engine's clamps), and moves the root to ``j + accepted(j, W, d, V') + 1`` (acceptance from
:func:`~adaptree.offline.traces.acceptance_table`). An AR step (``d = 0``) costs ``verify(0, L) + other_s`` and
moves one position. The run ends at the first position ``T`` the simulator stops at (EOS, the token
limit, the context limit; :func:`terminal_position`), so the oracle's time is

    best(j) = 0 for j >= T,   best(j) = min over (W, d, V) of cost(j, W, d, V) + best(min(j + acc + 1, T)),

computed backwards over ``j`` with every action of a position evaluated at once (numpy). Every
controller's replay through :func:`~adaptree.offline.simulator.simulate` is one path through the same
graph, so ``best(0)`` is a lower bound on its modelled time whenever its choices lie in the oracle's
action set. ``sizes="all"`` makes that set every V: the verification time is non-decreasing in V and
the accepted length is a step function of V, so only the smallest V reaching each accepted length
(d + 1 values per position and depth) can be optimal; the bound then holds for every controller that
uses the recorded widths and depths.

**Context chains** (``chains=K``): every action is also taken with the first ``k = 0..K`` tokens of the
context's longest earlier match (:class:`~adaptree.core.context.ContextIndex` with its default occurrence rule,
``"longest"``, as ``hybrid`` sees it; ``ngram``'s default is ``"recent"``) verified as one more path of the tree.
A chain's accepted prefix is where it leaves the recorded output, the cycle accepts the longer of the head's and the chain's, and the chain's tokens that the head's selected tree
already holds (the same tokens down the same path) cost nothing more: ``verify(V + added)``. So the bound
covers hybrid controllers too, and ``depths`` with AR alone plus chains is the best any ``ngram`` schedule does.

:func:`best_static` evaluates every static (W, D, V) of a grid on the same arrays (all configurations
walked at once) and returns the one with the least total modelled time over the traces; :func:`sizes_by_depth`
reads the best V of every depth off the same grid (the machine's V table a depth policy verifies with).
:class:`ScheduleController` replays an oracle schedule through the simulator (tests prove it
reproduces the oracle's time exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from adaptree.core.context import ContextIndex
from adaptree.core.controller import Controller, CycleContext, TreePlan
from adaptree.offline.latency import LatencyModel
from adaptree.offline.simulator import RunTotals, chain_credit
from adaptree.offline.traces import PromptTrace, _top_order, acceptance_table, context_matches, num_candidates

LTD_SIZES = tuple(range(20, 241, 20))
"""LTD's size-policy action set: 12 values 20, 40, ..., 240."""
DEFAULT_SIZES = tuple(range(1, 17)) + LTD_SIZES
"""The oracle's default V set: LTD's 12 values plus 1..16, which matter on CPU (verification cost grows
with every node)."""


def terminal_position(trace: PromptTrace, max_new_tokens: int | None = None) -> int:
    """The first root position at which the simulator (and the engine) stops: every run of the trace
    emits ``T + 1`` tokens and runs cycles from roots ``j < T``. Mirrors :func:`~adaptree.core.cycle.emit`
    (EOS kept, the token limit) and the loop's context check (``room = max_len - n - j < 1``)."""
    s = trace.settings
    limit = s.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 1 <= limit <= s.max_new_tokens:
        raise ValueError(f"max_new_tokens must be in 1..{s.max_new_tokens} (the trace's), got {limit}")
    eos = set(s.eos_token_ids)
    stop = limit
    for i, t in enumerate(trace.output[:limit].tolist()):
        if t in eos:
            stop = i + 1
            break
    t_end = min(stop - 1, trace.max_len - trace.prompt_len)
    if t_end > trace.end:
        raise RuntimeError(f"trace {trace.key!r}: runs reach root {t_end}, past the recorded {trace.end} positions")
    return max(0, t_end)


def _sizes_arg(sizes) -> tuple[int, ...] | str:
    if isinstance(sizes, str):
        if sizes != "all":
            raise ValueError(f"sizes must be a sequence of V values or 'all', got {sizes!r}")
        return sizes
    try:
        out = tuple(sorted({int(v) for v in sizes}))
    except (TypeError, ValueError):
        raise ValueError(f"sizes must be a sequence of V values or 'all', got {sizes!r}") from None
    if not out or out[0] < 0:
        raise ValueError(f"sizes must be non-negative integers, got {sizes!r}")
    return out


@dataclass
class _Actions:
    """Every action at every root position of one trace: ``[T, A]`` arrays."""

    width: np.ndarray   # [A] W of the action (for AR: the first recorded width, unused)
    depth: np.ndarray   # [A] d (0 = AR)
    size: np.ndarray    # [T, A] effective V after the engine's clamps
    acc: np.ndarray     # [T, A] accepted draft tokens
    cost: np.ndarray    # [T, A] modelled seconds of the cycle
    static: np.ndarray  # [A] bool: a static configuration (same requested V at every position)
    requested: np.ndarray  # [A] requested V (-1 where V differs per position: sizes='all')
    chain: np.ndarray | None = None  # [T, A] chain tokens verified (after the loop's cut to the room)
    added: np.ndarray | None = None  # [T, A] nodes the chain added to the head's selected tree


def _actions(trace: PromptTrace, lat: LatencyModel, T: int, widths: Sequence[int] | None, depths: Sequence[int] | None,
             sizes, allow_ar: bool) -> _Actions:
    widths = sorted(trace.widths) if widths is None else [int(w) for w in widths]
    if not widths:
        raise ValueError(f"widths must name at least one recorded width (recorded in {trace.key!r}: "
                         f"{', '.join(map(str, sorted(trace.widths)))})")
    for w in widths:
        trace.width(w)  # names a width that was not recorded
    depths = list(range(1, trace.max_depth + 1)) if depths is None else [int(d) for d in depths]
    if not depths or any(not 1 <= d <= trace.max_depth for d in depths):
        raise ValueError(f"depths must be in 1..{trace.max_depth} (the trace's max_depth), got {depths}")
    n = trace.prompt_len
    pos = np.arange(T)
    L = (n + pos).astype(np.float64)
    room = trace.max_len - n - pos  # >= 1 for j < T
    forced_ar = room <= 1  # the engine drafts nothing there (run_cycles: room > 1)
    ar_cost = lat.ar_steps(L)

    def verify(v: np.ndarray) -> np.ndarray:
        return lat.verify_times(v, L[:, None])

    W_, D_, S_, A_, C_, ST_, RQ_ = [], [], [], [], [], [], []
    if allow_ar:
        W_.append(np.array([widths[0]]))
        D_.append(np.array([0]))
        S_.append(np.zeros((T, 1), np.int64))
        A_.append(np.zeros((T, 1), np.int64))
        C_.append(ar_cost[:, None])
        ST_.append(np.array([False]))
        RQ_.append(np.array([0]))
    all_sizes = sizes == "all"
    if all_sizes:
        most = max(num_candidates(w, max(depths)) for w in widths)
        if T and (np.diff(verify(np.arange(most + 1)), axis=1) < -1e-12).any():
            raise ValueError("sizes='all' needs a verification time non-decreasing in V at every context length of "
                             "the trace; pass an explicit list of sizes")
    for w in widths:
        wt = trace.widths[w]
        step = lat.draft_steps(w, L)
        for d in depths:
            c = num_candidates(w, d)
            table = acceptance_table(wt, trace.output, d, pos) if T else np.zeros((0, c + 1), np.int64)
            if all_sizes:  # the smallest V reaching each accepted length k = 0..d (k = 0: V = 0)
                ks = np.arange(d + 1)
                req = (table[:, :, None] < ks[None, None, :]).sum(axis=1)  # [T, d+1] first v with table >= k
                req = np.minimum(req, c)  # unreachable k: clamp (duplicates the largest V)
                rq = np.full(d + 1, -1)
            else:
                req = np.broadcast_to(np.asarray(sizes, np.int64), (T, len(sizes)))
                rq = np.asarray(sizes, np.int64)
            v = np.minimum(np.minimum(req, c), (room - 1)[:, None])
            acc = np.take_along_axis(table, v, axis=1)
            cost = d * step[:, None] + verify(v) + lat.other_s
            # rows where the engine cannot draft: every action is the AR step
            v = np.where(forced_ar[:, None], 0, v)
            acc = np.where(forced_ar[:, None], 0, acc)
            cost = np.where(forced_ar[:, None], ar_cost[:, None], cost)
            k = v.shape[1]
            W_.append(np.full(k, w))
            D_.append(np.full(k, d))
            S_.append(v)
            A_.append(acc)
            C_.append(cost)
            ST_.append(np.full(k, not all_sizes))
            RQ_.append(rq)
    return _Actions(np.concatenate(W_), np.concatenate(D_), np.concatenate(S_, axis=1),
                    np.concatenate(A_, axis=1).astype(np.int64), np.concatenate(C_, axis=1), np.concatenate(ST_),
                    np.concatenate(RQ_))


def context_chains(trace: PromptTrace, T: int, max_tokens: int, max_ngram: int = 4) -> tuple[list[tuple[int, ...]],
                                                                                             np.ndarray]:
    """At every root position ``j < T``: the chain the cycle loop's context index proposes
    (:func:`~adaptree.offline.traces.context_matches`; empty without a match) and how many of its first tokens
    the recorded output accepts (:func:`~adaptree.offline.simulator.chain_credit`)."""
    y = trace.output.tolist()
    chains, acc = [], np.zeros(T, np.int64)
    for j, m in context_matches(trace.prompt, y, T, max_tokens, max_ngram):
        chains.append(m.tokens if m is not None else ())
        acc[j] = chain_credit(y, j, chains[-1])
    return chains, acc


def _chain_path(wt, chains: list[tuple[int, ...]], T: int) -> np.ndarray:
    """``[T, max_depth]`` candidate index of the head's recorded tree at each level of the chain's path (the
    child of the previous one with the chain's token), -1 where the chain leaves the tree."""
    out = np.full((T, wt.max_depth), -1, np.int64)
    if T == 0:
        return out
    parents = wt.parents()
    for j in range(T):
        cur = -1
        for i, tok in enumerate(chains[j][:wt.max_depth]):
            hit = np.flatnonzero((parents[j] == cur) & (wt.tokens[j] == tok))
            if hit.size == 0:
                break
            cur = out[j, i] = int(hit[0])
    return out


def _with_chains(act: _Actions, trace: PromptTrace, lat: LatencyModel, T: int, chains: int,
                 max_ngram: int) -> _Actions:
    """Every action of ``act`` with ``k = 0..chains`` context-chain tokens (module docstring)."""
    n = trace.prompt_len
    pos = np.arange(T)
    L = (n + pos).astype(np.float64)
    room = trace.max_len - n - pos
    toks, chain_acc = context_chains(trace, T, chains, max_ngram)
    avail = np.array([len(c) for c in toks], np.int64)
    shared = np.zeros(act.size.shape, np.int64)  # [T, A] chain tokens among the head's selected nodes
    paths = {w: _chain_path(trace.widths[w], toks, T) for w in set(act.width[act.depth > 0].tolist())}
    path_ranks: dict[tuple[int, int], np.ndarray] = {}  # (W, d) -> [T, d] top-V rank of the chain's path nodes
    for a in np.flatnonzero(act.depth > 0):
        w, d = int(act.width[a]), int(act.depth[a])
        if (w, d) not in path_ranks:  # one sort per tree shape, shared by its V values
            c = num_candidates(w, d)
            order = _top_order(torch.from_numpy(np.ascontiguousarray(trace.widths[w].scores[:T, :c]))).numpy()
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.arange(c)[None, :].repeat(T, 0), axis=1)
            path = paths[w][:, :d]
            path_ranks[w, d] = np.where(path >= 0, np.take_along_axis(rank, np.maximum(path, 0), axis=1), c + 1)
        shared[:, a] = (path_ranks[w, d] < act.size[:, a][:, None]).sum(1)
    W_, D_, S_, A_, C_, ST_, RQ_, K_, N_ = [], [], [], [], [], [], [], [], []
    for k in range(chains + 1):
        k_eff = np.minimum(np.minimum(k, avail)[:, None], np.maximum(0, room[:, None] - 1 - act.size))  # [T, A]
        added = np.maximum(0, k_eff - shared)
        acc = np.maximum(act.acc, np.minimum(k_eff, chain_acc[:, None]))
        cost = act.cost - lat.verify_times(act.size, L[:, None]) + lat.verify_times(act.size + added, L[:, None])
        W_.append(act.width), D_.append(act.depth), S_.append(act.size), A_.append(acc), C_.append(cost)
        ST_.append(act.static), RQ_.append(act.requested), K_.append(k_eff), N_.append(added)
    cat = lambda xs, ax=0: np.concatenate(xs, axis=ax)  # noqa: E731
    return _Actions(cat(W_), cat(D_), cat(S_, 1), cat(A_, 1), cat(C_, 1), cat(ST_), cat(RQ_), cat(K_, 1), cat(N_, 1))


@dataclass
class OracleCycle:
    position: int
    """Output index of the cycle's root."""
    context_len: int
    width: int
    depth: int
    """Draft levels (0 = an AR step)."""
    size: int
    """V after the engine's clamps."""
    accepted: int
    draft_s: float
    verify_s: float
    other_s: float
    chain: int = 0
    """Context-chain tokens verified (``chains``)."""
    chain_nodes: int = 0
    """Nodes the chain added to the head's selected tree."""

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + 0.0 + self.other_s  # CycleRecord.total_s's order (policy = 0)


@dataclass
class OracleRun:
    """The oracle's schedule for one prompt."""

    key: str
    cycles: list[OracleCycle]
    tokens: int
    """Tokens emitted (the same for every controller: T + 1)."""
    ar_s: float
    """Modelled AR time of the same tokens (``SimRun.ar_s``)."""
    dp_s: float = 0.0
    """best(0) of the backward recursion (equal to ``total_s`` up to float summation order)."""

    @property
    def total_s(self) -> float:
        return sum(c.total_s for c in self.cycles)  # SimRun.total_s's order

    @property
    def tau(self) -> float:
        return sum(c.accepted + 1 for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    def schedule(self) -> dict[int, tuple[int, ...]]:
        """Root position -> (W, d, V) of the cycle started there, (W, d, V, chain tokens) with chains."""
        return {c.position: (c.width, c.depth, c.size) + ((c.chain,) if c.chain else ()) for c in self.cycles}


@dataclass
class OracleResult(RunTotals):
    runs: list[OracleRun]

    def summary(self) -> dict:
        cyc = [c for r in self.runs for c in r.cycles]
        k = max(1, len(cyc))
        return {"prompts": len(self.runs), "cycles": len(cyc), "new_tokens": sum(r.tokens for r in self.runs),
                "tau": self.tau, "mean_depth": sum(c.depth for c in cyc) / k, "mean_size": sum(c.size for c in cyc) / k,
                "ar_cycles": sum(c.depth == 0 for c in cyc), "modelled_s": self.total_s, "modelled_ar_s": self.ar_s,
                "modelled_speedup": self.speedup}


def _ar_time(lat: LatencyModel, n: int, T: int) -> float:
    return sum(lat.ar_step(n + i) for i in range(T))  # SimRun.ar_s over T + 1 tokens


def oracle(trace: PromptTrace, latency: LatencyModel, *, widths: Sequence[int] | None = None,
           depths: Sequence[int] | None = None, sizes: Sequence[int] | str = DEFAULT_SIZES, allow_ar: bool = True,
           max_new_tokens: int | None = None, chains: int = 0, max_ngram: int = 4) -> OracleRun:
    """The schedule of (W, d, V) per cycle minimising the modelled time to emit the trace's output.

    :param widths: W values allowed per cycle (default: every recorded width; pass one to fix W).
    :param depths: draft depths allowed (default 1..the trace's max_depth).
    :param sizes: the V set (default :data:`DEFAULT_SIZES`), or ``"all"``: every V (exact; see the module docstring).
    :param allow_ar: also allow an AR step (d = 0) per cycle.
    :param max_new_tokens: a smaller token limit than recorded (as in ``simulate``).
    :param chains: also verify the first 0..``chains`` tokens of the context's longest earlier match (n-grams of
        up to ``max_ngram`` tokens) with every action (see the module docstring); 0: head trees only.
    """
    sizes = _sizes_arg(sizes)
    if isinstance(chains, bool) or not isinstance(chains, int) or chains < 0:
        raise ValueError(f"chains must be a non-negative integer, got {chains!r}")
    T = terminal_position(trace, max_new_tokens)
    n = trace.prompt_len
    act = _actions(trace, latency, T, widths, depths, sizes, allow_ar)
    if chains:
        act = _with_chains(act, trace, latency, T, chains, max_ngram)
    best = np.zeros(T + 1)
    choice = np.zeros(T, np.int64)
    steps = act.acc + 1  # [T, A]
    for j in range(T - 1, -1, -1):
        tot = act.cost[j] + best[np.minimum(j + steps[j], T)]
        a = int(np.argmin(tot))
        choice[j], best[j] = a, tot[a]
    cycles = []
    j = 0
    while j < T:
        a = int(choice[j])
        w, d, v, acc = int(act.width[a]), int(act.depth[a]), int(act.size[j, a]), int(act.acc[j, a])
        L = n + j
        if trace.max_len - L <= 1:  # no room to draft: the engine (and the cost above) makes it an AR step
            d = 0
        k, added = (int(act.chain[j, a]), int(act.added[j, a])) if act.chain is not None else (0, 0)
        cycles.append(OracleCycle(j, L, w, d, v, acc, latency.draft_time(w, d, L), latency.verify_time(v + added, L),
                                  latency.other_s, k, added))
        j += acc + 1
    return OracleRun(trace.key, cycles, T + 1, _ar_time(latency, n, T), float(best[0]) if T else 0.0)


def oracle_all(traces: PromptTrace | Iterable[PromptTrace], latency: LatencyModel, **kwargs) -> OracleResult:
    """:func:`oracle` over every trace (keyword arguments as there)."""
    if isinstance(traces, PromptTrace):
        traces = [traces]
    return OracleResult([oracle(t, latency, **kwargs) for t in traces])


class ScheduleController(Controller):
    """Follows a fixed schedule (root position -> (W, d, V)), e.g. an oracle's, in the simulator or the engine.

    A cycle at a position the schedule does not name means the replay left the schedule's path: an error.
    """

    name = "schedule"

    def __init__(self, schedule: Mapping[int, tuple[int, ...]], chains: int = 0, max_ngram: int = 4) -> None:
        """``schedule``: root position -> (W, d, V) or (W, d, V, chain tokens); ``chains``/``max_ngram``: the
        oracle's (the chain is the first tokens of the context match of that many tokens)."""
        self.schedule = {int(k): tuple(int(x) for x in v) for k, v in schedule.items()}
        self.chains, self.max_ngram = int(chains), int(max_ngram)

    def context_index(self) -> ContextIndex | None:
        return ContextIndex(max_ngram=self.max_ngram) if self.chains else None

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        j = ctx.generated - 1  # the root's output index
        if j not in self.schedule:
            raise RuntimeError(f"no scheduled cycle at root position {j}: the replay diverged from the schedule")
        w, d, v, *k = self.schedule[j]
        if k and k[0]:
            m = ctx.index.match(self.chains, 1)
            return TreePlan(w, d, v, m.tokens[:k[0]] if m is not None else ())
        return TreePlan(w, d, v)


# ---------------------------------------------------------------------------------------------- statics


@dataclass
class StaticChoice:
    """The best static tree over a set of traces, and the whole grid's times."""

    width: int
    depth: int
    size: int
    total_s: float
    ar_s: float
    grid: list[dict] = field(default_factory=list)
    """Every configuration: {width, depth, size, total_s, speedup}."""

    @property
    def speedup(self) -> float:
        return self.ar_s / self.total_s if self.total_s > 0 else 0.0

    def size_by_depth(self) -> dict[int, int]:
        """Depth -> the V of the grid's best static tree of that depth (the grid is in (W, D, V) order: the first
        minimum of a depth is its smallest V, as :func:`best_static` breaks ties)."""
        best: dict[int, dict] = {}
        for row in self.grid:
            d = row["depth"]
            if d not in best or row["total_s"] < best[d]["total_s"]:
                best[d] = row
        return {d: int(r["size"]) for d, r in best.items()}

    def to_dict(self, grid: bool = False) -> dict:
        d = asdict(self)
        d["speedup"] = self.speedup
        if not grid:
            d.pop("grid")
        return d


def static_times(trace: PromptTrace, latency: LatencyModel, widths: Sequence[int] | None = None,
                 depths: Sequence[int] | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
                 max_new_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Modelled time of every static (W, D, V) on one trace, all walked at once: (W, D, V, seconds) arrays."""
    sizes = _sizes_arg(sizes)
    if sizes == "all":
        raise ValueError("static_times needs an explicit list of sizes")
    sizes = tuple(v for v in sizes if v >= 1) or (1,)  # StaticConfig needs V >= 1
    T = terminal_position(trace, max_new_tokens)
    act = _actions(trace, latency, T, widths, depths, sizes, allow_ar=False)
    k = act.width.shape[0]
    pos = np.zeros(k, np.int64)
    total = np.zeros(k)
    cols = np.arange(k)
    active = pos < T
    while active.any():
        idx = cols[active]
        p = pos[idx]
        total[idx] += act.cost[p, idx]
        pos[idx] = p + act.acc[p, idx] + 1
        active = pos < T
    return act.width, act.depth, act.requested, total


def best_static(traces: PromptTrace | Iterable[PromptTrace], latency: LatencyModel, *,
                widths: Sequence[int] | None = None, depths: Sequence[int] | None = None,
                sizes: Sequence[int] = DEFAULT_SIZES, max_new_tokens: int | None = None) -> StaticChoice:
    """The single static (W, D, V) minimising the total modelled time over all traces (ties: the first
    in (W, D, V) order). W ranges over the widths recorded in every trace unless given."""
    if isinstance(traces, PromptTrace):
        traces = [traces]
    traces = list(traces)
    if not traces:
        raise ValueError("best_static needs at least one trace")
    if widths is None:
        widths = sorted(set.intersection(*(set(t.widths) for t in traces)))
    total = None
    for t in traces:
        w, d, v, s = static_times(t, latency, widths, depths, sizes, max_new_tokens)
        total = s if total is None else total + s
    ar = sum(_ar_time(latency, t.prompt_len, terminal_position(t, max_new_tokens)) for t in traces)
    a = int(np.argmin(total))
    grid = [{"width": int(w[i]), "depth": int(d[i]), "size": int(v[i]), "total_s": float(total[i]),
             "speedup": ar / float(total[i]) if total[i] > 0 else 0.0} for i in range(len(total))]
    return StaticChoice(int(w[a]), int(d[a]), int(v[a]), float(total[a]), ar, grid)


def sizes_by_depth(traces: PromptTrace | Iterable[PromptTrace], latency: LatencyModel, width: int = 10,
                   depths: Iterable[int] = range(1, 13), sizes: Sequence[int] = DEFAULT_SIZES,
                   max_new_tokens: int | None = None) -> dict[int, int]:
    """Depth -> the V of the static tree (``width``, depth, V) with the least total modelled time over ``traces``:
    :func:`best_static`'s grid, its best per depth (ties: the smaller V, as there). A depth-limited policy (RADAR)
    verifies this V when it stops at that depth, so its trees follow the machine's trade-off between acceptance and
    verification cost. Depths deeper than the traces' ``max_depth`` are left out (no entry)."""
    if isinstance(traces, PromptTrace):
        traces = [traces]
    traces = list(traces)
    if not traces:
        raise ValueError("sizes_by_depth needs at least one trace")
    deepest = min(t.max_depth for t in traces)
    depths = sorted({int(d) for d in depths if 1 <= int(d) <= deepest})
    if not depths:
        raise ValueError(f"no depth in 1..{deepest} (the traces' max_depth) to choose V for")
    return best_static(traces, latency, widths=(width,), depths=depths, sizes=sizes,
                       max_new_tokens=max_new_tokens).size_by_depth()


def tree_outcomes(trace: PromptTrace, width: int, depths: Iterable[int], sizes: Sequence[int] = DEFAULT_SIZES, *,
                  chains: int = 0, max_ngram: int = 4, max_new_tokens: int | None = None) -> dict[str, np.ndarray]:
    """What every static tree (``width``, d, V) of a grid does at every root position ``j < T`` of a greedy trace,
    the machine left out (accepted lengths and the engine's clamps do not depend on it), for a trainer that prices
    the same trees under many latency models: the columns ``depth`` and ``size`` ``[A]`` (the requested V; (depth,
    V) order, V >= 1), and ``accepted`` and ``verified`` ``[T, A]`` (draft tokens accepted, nodes verified after the
    clamps to the candidates and the context room; both 0 where there is no room to draft: the engine's AR step), as
    :func:`oracle` and :func:`static_times` see them. With ``chains`` K also ``chain_accepted`` and
    ``chain_verified``: the same trees with the first K tokens of the context's match verified next to them (as the
    oracle's chains; nodes = the tree's plus those the chain adds)."""
    sizes = _sizes_arg(sizes)
    if sizes == "all":
        raise ValueError("tree_outcomes needs an explicit list of sizes")
    sizes = tuple(v for v in sizes if v >= 1) or (1,)
    zero = LatencyModel([0.0] * 4, [0.0] * 4)  # the outcomes carry no time
    T = terminal_position(trace, max_new_tokens)
    act = _actions(trace, zero, T, (int(width),), list(depths), sizes, allow_ar=False)
    out = {"depth": act.depth, "size": act.requested, "accepted": act.acc, "verified": act.size}
    if chains:
        ch = _with_chains(act, trace, zero, T, int(chains), max_ngram)
        whole = slice(int(chains) * act.depth.size, None)  # the last block: up to K chain tokens
        out["chain_accepted"] = ch.acc[:, whole]
        out["chain_verified"] = ch.size[:, whole] + ch.added[:, whole]
    return out


# ---------------------------------------------------------------------------------------------- comparison


def fraction_of_oracle_gain(speedup: float, oracle_speedup: float) -> float | None:
    """(speedup - 1) / (oracle speedup - 1); None when the oracle gains nothing over AR."""
    if oracle_speedup <= 1.0:
        return None
    return (speedup - 1.0) / (oracle_speedup - 1.0)


def compare_methods(traces: Sequence[PromptTrace], latency: LatencyModel,
                    methods: Mapping[str, Callable[[], Controller]], *, with_oracle: bool = True,
                    with_static: bool = True, oracle_sizes: Sequence[int] | str = DEFAULT_SIZES,
                    static_sizes: Sequence[int] = DEFAULT_SIZES, max_new_tokens: int | None = None,
                    measure_policy: bool = False, progress: bool = False, chains: int = 0) -> dict:
    """Every method replayed in the simulator, with the best static tree and the oracle, on the same traces.

    Returns ``{"methods": {name: row}, "oracle": row | None, "best_static": row | None, "oracle_chains": row |
    None}``; a row has the modelled speedup vs AR, tau, mean depth and V, and ``fraction_of_oracle_gain``. With
    ``chains`` the oracle that may also verify up to that many context-chain tokens per cycle is there too, and
    every row gets ``fraction_of_chain_oracle_gain`` (the head-only oracle does not bound a method that verifies
    chains: ``ngram``, ``hybrid``). The policies' own time is left out unless ``measure_policy`` (the oracle and
    the statics have none). ``progress``: a bar over the methods.
    """
    from tqdm import tqdm

    from adaptree.core.controller import StaticConfig, StaticController
    from adaptree.offline.simulator import simulate

    traces = list(traces)
    out: dict = {"methods": {}, "oracle": None, "best_static": None, "oracle_chains": None}
    orc = orc_c = None
    if with_oracle:
        orc = oracle_all(traces, latency, sizes=oracle_sizes, max_new_tokens=max_new_tokens)
        out["oracle"] = {"name": "oracle", **orc.summary()}
        if chains:
            orc_c = oracle_all(traces, latency, sizes=oracle_sizes, max_new_tokens=max_new_tokens, chains=chains)
            out["oracle_chains"] = {"name": f"oracle + chains <= {chains}", **orc_c.summary()}
    for name, make in tqdm(methods.items(), desc="simulate", unit="method", disable=not progress):
        res = simulate(make(), traces, latency, max_new_tokens=max_new_tokens, measure_policy=measure_policy)
        out["methods"][name] = {"name": name, **res.summary()}
    if with_static:
        st = best_static(traces, latency, sizes=static_sizes, max_new_tokens=max_new_tokens)
        replay = simulate(StaticController(StaticConfig(st.width, st.depth, st.size)), traces, latency,
                          max_new_tokens=max_new_tokens, measure_policy=False).summary()
        out["best_static"] = {"name": f"best-static W{st.width} D{st.depth} V{st.size}", "width": st.width,
                              "depth": st.depth, "size": st.size, "modelled_s": st.total_s, "modelled_ar_s": st.ar_s,
                              "modelled_speedup": st.speedup,
                              **{k: replay[k] for k in ("cycles", "tau", "mean_depth", "mean_size")}}
    rows = list(out["methods"].values()) + [r for r in (out["best_static"], out["oracle"], out["oracle_chains"]) if r]
    for r in rows:
        r["fraction_of_oracle_gain"] = (fraction_of_oracle_gain(r["modelled_speedup"], orc.speedup)
                                        if orc is not None else None)
        if orc_c is not None:
            r["fraction_of_chain_oracle_gain"] = fraction_of_oracle_gain(r["modelled_speedup"], orc_c.speedup)
    return out


def format_table(result: dict) -> str:
    """A plain-text table of :func:`compare_methods`' rows."""
    extra = result.get("oracle_chains")
    rows = list(result["methods"].values()) + [r for r in (result["best_static"], result["oracle"], extra) if r]
    head = f"{'method':<28} {'speedup':>8} {'tau':>6} {'depth':>6} {'V':>6} {'frac. oracle gain':>18}"
    head += f" {'frac. +chains':>14}" if extra else ""
    lines = [head, "-" * len(head)]
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    for r in rows:
        tau, dep, size = (r.get(k) for k in ("tau", "mean_depth", "mean_size"))
        lines.append(f"{r['name']:<28} {r['modelled_speedup']:>7.3f}x {fmt(tau):>6} "
                     f"{(f'{dep:.2f}' if dep is not None else '-'):>6} "
                     f"{(f'{size:.1f}' if size is not None else '-'):>6} {fmt(r.get('fraction_of_oracle_gain')):>18}"
                     + (f" {fmt(r.get('fraction_of_chain_oracle_gain')):>14}" if extra else ""))
    return "\n".join(lines)


def compare_on_traces(traces: str, latency: str, methods: Mapping[str, Callable[[], Controller]], *,
                      oracle_sizes: Sequence[int] | str = DEFAULT_SIZES, static_sizes: Sequence[int] = DEFAULT_SIZES,
                      max_new_tokens: int | None = None, measure_policy: bool = False, progress: bool = False,
                      chains: int = 0) -> dict:
    """:func:`compare_methods` on the trace folder ``traces`` with the latency model file ``latency`` (a warning
    when it was measured on another machine), plus a ``setup`` entry saying what was compared: the folders, the
    oracle's and the static grid's V sets, the recorded widths and depth, the token limit, the trace and latency
    fingerprints and the machine warnings. Every number is modelled."""
    from adaptree.offline.latency import check_machine, load_checked
    from adaptree.offline.traces import TraceStore

    if isinstance(static_sizes, str):
        raise ValueError("--static-sizes must be an explicit list (or 'default'): a static tree has one V")
    store = TraceStore(traces)
    loaded = store.load_all()
    if not loaded:
        raise ValueError(f"no traces in {traces}")
    lat = load_checked(latency)
    res = compare_methods(loaded, lat, methods, oracle_sizes=oracle_sizes, static_sizes=static_sizes,
                          max_new_tokens=max_new_tokens, measure_policy=measure_policy, progress=progress,
                          chains=chains)
    s = store.settings
    res["setup"] = {
        "traces": str(traces), "prompts": len(loaded), "latency": str(latency),
        "oracle_sizes": oracle_sizes if oracle_sizes == "all" else list(oracle_sizes),
        "static_sizes": list(static_sizes), "widths": list(s.widths), "max_depth": s.max_depth, "chains": chains,
        "max_new_tokens": max_new_tokens or s.max_new_tokens, "policy_time": measure_policy,
        "trace_fingerprints": store.fingerprints, "latency_meta": {k: lat.meta.get(k) for k in (
            "machine", "dtype", "source", "model", "model_sha256", "head_sha256") if k in lat.meta},
        "machine_warnings": check_machine(lat),
        "note": "every number is modelled: the methods replayed over greedy traces with the latency model, not timed"}
    return res
