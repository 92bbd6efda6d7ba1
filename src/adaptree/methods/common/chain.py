"""The chain seam: a context match's continuation verified next to a controller's tree, valued by how often it is
what the target says next.

The hybrid rule (:mod:`adaptree.methods.hybrid.controller`) and :class:`ChainRule` value a context chain
(:class:`~adaptree.core.context.ContextMatch`) by its expected accepted tokens ``sum_i c_i``, ``c_i`` = the
probability that its first ``i`` tokens are all accepted. :class:`ChainCalibration` measures it on recorded greedy
traces (:mod:`adaptree.offline.traces`), with the same :class:`~adaptree.core.context.ContextIndex` the controller
keeps:

* **Samples.** At every root ``y_j`` of every trace, the longest earlier match of ``prompt + y_0..y_j`` (at
  least one token; n-grams of up to ``max_ngram``; the occurrence picked by the index's ``select`` rule, which
  the calibration records and the controllers' indexes then use) proposes ``max_tokens`` tokens; greedy
  verification accepts its longest prefix that equals ``y_{j+1}, y_{j+2}, ...`` (a chain token past the
  recorded output has no label and is left out).
* **Rates.** Matches are grouped by their length (the buckets ``edges``: ``[edges[b], edges[b+1])``, the last
  open-ended). ``rates[b][t]`` = P(chain token ``t`` accepted | tokens ``< t`` accepted) in bucket ``b``,
  estimated as ``(hits + s * pooled) / (trials + s)`` with ``s = smoothing`` pseudo-trials at the rate pooled
  over all buckets for that ``t`` (a bucket seen rarely borrows the pooled rate). ``c_i = prod_{t < i}
  rates[b][t]``.

* **Temperatures.** Under sampling, a chain token (a draft proposed with certainty) is accepted with the target's
  probability of it, which is also the probability that the target *samples* it: the same count on the target's
  outputs sampled at temperature ``T`` (:meth:`ChainCalibration.fit_sampled`) measures the rates at ``T``. They
  are far below the greedy ones (docs/methods.md gives the default model's), which is why a calibration is per
  temperature. One calibration holds rates at several temperatures
  (:meth:`ChainCalibration.combine`); :meth:`~ChainCalibration.probs` interpolates linearly between them and takes
  the nearest beyond them.

Plain JSON (:meth:`ChainCalibration.save` / :meth:`ChainCalibration.load`), loaded strictly: format ``version``,
``max_ngram``, ``select``, ``edges``, ``temperatures``, ``rates`` and ``trials`` (per temperature, bucket and
token: the counts behind each rate), ``samples`` (per temperature: positions with a match) and ``fingerprints``
(``model`` and ``head`` digests of the traces; the chain rates depend on the target's outputs only, the head is
recorded for :meth:`ChainCalibration.check`). Older files still load: version 2 (no ``select``) as fitted with
``"recent"``, version 1 (greedy rates only, no ``temperatures``) also as temperature 0.

:class:`ChainRule` puts a context chain into any other controller's cycles (the learned methods' ``chain_tokens``;
:class:`ChainSeam` gives their controllers the hooks), and :data:`MATCH_FEATURES` are what their policies observe of
the match. The calibration lives here, next to the rule, because the learned methods' trainers fit and read it as
much as the hybrid does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from adaptree.core.context import DEFAULT_SELECT, SELECT, ContextIndex, ContextMatch
from adaptree.methods.common.ar_gate import Meter
from adaptree.methods.common.pricing import MAX_SIZE, level_pays, price_split, shared_ranks
from adaptree.offline.runs import read_json_as, write_json
from adaptree.offline.traces import PromptTrace, context_matches

FORMAT_VERSION = 3
FIELDS = ("version", "max_ngram", "select", "edges", "temperatures", "rates", "trials", "samples", "fingerprints")
OLD_FIELDS = {2: tuple(f for f in FIELDS if f != "select"), 1: tuple(f for f in FIELDS if f not in ("select",
                                                                                                   "temperatures"))}
SAMPLED_TEMPERATURES = (1.0,)
"""The temperatures a machine setup measures the chain rates at besides greedy
(:meth:`ChainCalibration.fit_sampled`)."""
DEFAULT_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Match-length buckets: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-31, 32 and more tokens."""


@dataclass(eq=False)
class ChainCalibration:
    """Per temperature and match-length bucket, the conditional acceptance rate of each chain token (module
    docstring)."""

    max_ngram: int
    """Longest n-gram of the index the samples came from (the controller's index must use the same)."""
    edges: np.ndarray
    """``[B]`` strictly increasing lower bounds of the match-length buckets, the first 1."""
    rates: np.ndarray
    """``[N, B, T]`` P(chain token t accepted | the tokens before it accepted), per temperature and bucket (a
    ``[B, T]`` array: one temperature)."""
    trials: np.ndarray = None  # type: ignore[assignment]
    """``[N, B, T]`` samples behind each rate (chains that reached token t)."""
    samples: np.ndarray = 0  # type: ignore[assignment]
    """``[N]`` root positions with a match, per temperature."""
    fingerprints: dict[str, str] = field(default_factory=dict)
    temperatures: np.ndarray = (0.0,)  # type: ignore[assignment]
    """``[N]`` strictly increasing sampling temperatures the rates were measured at (0: greedy)."""
    select: str = DEFAULT_SELECT
    """The context index's rule for which earlier occurrence proposes the chain (:data:`~adaptree.core.context.SELECT`):
    the samples' and, through :meth:`index`, the controllers'."""

    def __post_init__(self) -> None:
        self.edges = np.asarray(self.edges, np.int64).reshape(-1)
        self.temperatures = np.asarray(self.temperatures, np.float64).reshape(-1)
        r = np.asarray(self.rates, np.float64)
        self.rates = r = r[None] if r.ndim == 2 else r
        n = np.zeros_like(r) if self.trials is None else np.asarray(self.trials, np.float64)
        self.trials = n[None] if n.ndim == 2 else n
        samples = np.asarray(self.samples, np.int64)
        if samples.ndim > 0 and samples.shape != self.temperatures.shape:
            raise ValueError(f"samples must be one count per temperature ({self.temperatures.size}), got "
                             f"{samples.tolist()}")
        self.samples = np.broadcast_to(samples, self.temperatures.shape).copy()
        if self.max_ngram < 1 or int(self.max_ngram) != self.max_ngram:
            raise ValueError(f"max_ngram must be a positive integer, got {self.max_ngram!r}")
        self.max_ngram = int(self.max_ngram)
        if self.select not in SELECT:
            raise ValueError(f"select must be one of {', '.join(SELECT)}, got {self.select!r}")
        e, t = self.edges, self.temperatures
        if e.size < 1 or e[0] != 1 or (np.diff(e) <= 0).any():
            raise ValueError(f"edges must be strictly increasing match lengths starting at 1, got {e.tolist()}")
        if t.size < 1 or not np.isfinite(t).all() or t[0] < 0 or (np.diff(t) <= 0).any():
            raise ValueError(f"temperatures must be strictly increasing and >= 0, got {t.tolist()}")
        if r.ndim != 3 or r.shape[:2] != (t.size, e.size) or r.shape[2] < 1:
            raise ValueError(f"rates must be [temperatures={t.size}, buckets={e.size}, tokens >= 1], got shape "
                             f"{list(r.shape)}")
        if not np.isfinite(r).all() or r.min() < 0.0 or r.max() > 1.0:
            raise ValueError("rates must be probabilities in [0, 1]")
        if self.trials.shape != r.shape or (self.trials < 0).any():
            raise ValueError(f"trials must be non-negative counts of the rates' shape {list(r.shape)}")
        self.fingerprints = {str(k): str(v) for k, v in dict(self.fingerprints).items()}

    @property
    def max_tokens(self) -> int:
        """Longest chain the rates cover (a longer one is valued with the last token's rate)."""
        return int(self.rates.shape[2])

    def index(self) -> ContextIndex:
        """A context index that proposes chains as the samples' index did (``max_ngram``, ``select``)."""
        return ContextIndex(max_ngram=self.max_ngram, select=self.select)

    def bucket(self, length: int) -> int:
        return int(np.searchsorted(self.edges, int(length), side="right")) - 1

    def _at(self, x: np.ndarray, temperature: float) -> np.ndarray:
        """``x`` (per measured temperature on its first axis) at ``temperature``: linear between the two nearest
        measured temperatures, the nearest one's beyond them."""
        t = self.temperatures
        temperature = float(temperature)
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        j = int(np.searchsorted(t, temperature, side="right"))  # t[j-1] <= temperature < t[j]
        if j == 0 or j == t.size:
            return x[max(j - 1, 0)]
        w = (temperature - t[j - 1]) / (t[j] - t[j - 1])
        return (1.0 - w) * x[j - 1] + w * x[j]

    def rates_at(self, temperature: float = 0.0) -> np.ndarray:
        """``[B, T]`` rates at ``temperature`` (linear between measured temperatures, the nearest beyond them)."""
        return self._at(self.rates, temperature)

    def at(self, temperature: float) -> ChainCalibration:
        """This calibration at one temperature (rates and counts weighed as :meth:`rates_at` weighs them): what a
        consumer that always verifies at ``temperature`` reads (RADAR's training, on a dataset sampled at it)."""
        return ChainCalibration(self.max_ngram, self.edges, self.rates_at(temperature)[None],
                                self._at(self.trials, temperature)[None],
                                [round(float(self._at(self.samples, temperature)))], self.fingerprints,
                                (float(temperature),), self.select)

    def probs(self, match: ContextMatch | None, k: int | None = None, temperature: float = 0.0) -> np.ndarray:
        """``[k]`` (default: the match's tokens) probabilities that the chain's first 1..k tokens are all accepted,
        verified at ``temperature`` (0: greedy)."""
        if match is None:
            return np.zeros(0)
        k = len(match.tokens) if k is None else min(int(k), len(match.tokens))
        r = self.rates_at(temperature)[self.bucket(match.length)]
        if k > r.size:
            r = np.concatenate([r, np.full(k - r.size, r[-1])])
        return np.cumprod(r[:k])

    # ------------------------------------------------------------------------------------------ fitting

    @classmethod
    def fit(cls, traces: PromptTrace | Iterable[PromptTrace], max_ngram: int = 4, max_tokens: int = 16,
            edges: Sequence[int] = DEFAULT_EDGES, smoothing: float = 4.0, select: str = DEFAULT_SELECT
            ) -> ChainCalibration:
        """Fit on greedy traces (module docstring); an iterable is consumed once."""
        if isinstance(traces, PromptTrace):
            traces = [traces]
        fps: dict[str, str] = {}

        def texts() -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
            first = None
            for trace in traces:
                own = {k: trace.fingerprints.get(k, "") for k in ("model", "head")}
                if first is None:
                    fps.update(own)
                    first = trace.key
                elif own["model"] != fps["model"]:
                    raise ValueError(f"trace {trace.key!r} was recorded with another model than {first!r}; fit "
                                     f"one chain calibration per model")
                yield trace.prompt, trace.output, trace.end

        cal = cls.fit_texts(texts(), max_ngram=max_ngram, max_tokens=max_tokens, edges=edges, smoothing=smoothing,
                            select=select)
        cal.fingerprints = dict(fps)
        return cal

    @classmethod
    def fit_texts(cls, texts: Iterable[tuple[Sequence[int], Sequence[int], int]], fingerprints: Mapping[str, str]
                  | None = None, max_ngram: int = 4, max_tokens: int = 16, edges: Sequence[int] = DEFAULT_EDGES,
                  smoothing: float = 4.0, temperature: float = 0.0, select: str = DEFAULT_SELECT) -> ChainCalibration:
        """Fit on ``(prompt, output, end)`` token-id texts: the target's ``output`` after ``prompt`` (greedy, or sampled
        at ``temperature``), roots at its first ``end`` tokens (a self-distilled corpus: ``end = len(output)``).
        ``fingerprints``: at least the target's ``model`` digest (:func:`~adaptree.offline.traces.model_fingerprint`),
        which :meth:`check` compares."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if smoothing < 0:
            raise ValueError(f"smoothing must be >= 0, got {smoothing}")
        edges_a = np.asarray(edges, np.int64)
        hits = np.zeros((edges_a.size, max_tokens))
        trials = np.zeros((edges_a.size, max_tokens))
        samples = 0
        for prompt, output, end in texts:
            y = [int(t) for t in output]
            for j, m in context_matches(prompt, y, end, max_tokens, max_ngram, select=select):
                if m is None:
                    continue
                samples += 1
                b = int(np.searchsorted(edges_a, m.length, side="right")) - 1
                for t, tok in enumerate(m.tokens):
                    if j + 1 + t >= len(y):  # past the recorded output: no label
                        break
                    trials[b, t] += 1
                    if tok != y[j + 1 + t]:
                        break
                    hits[b, t] += 1
        pooled = np.divide(hits.sum(0), trials.sum(0), out=np.zeros(max_tokens), where=trials.sum(0) > 0)
        rates = (hits + smoothing * pooled) / np.maximum(trials + smoothing, 1e-12)
        rates[(trials + smoothing) == 0] = 0.0
        return cls(max_ngram, edges_a, np.clip(rates, 0.0, 1.0), trials, samples, dict(fingerprints or {}),
                   (float(temperature),), select)

    @classmethod
    def fit_sampled(cls, target, prompts: Sequence[Sequence[int]], temperature: float = 1.0,
                    max_new_tokens: int = 128, eos_token_ids: Iterable[int] = (), samples_per_prompt: int = 4,
                    seed: int = 0, batch_size: int = 16, max_ngram: int = 4, max_tokens: int = 16,
                    edges: Sequence[int] = DEFAULT_EDGES, smoothing: float = 4.0, select: str = DEFAULT_SELECT
                    ) -> ChainCalibration:
        """The rates at ``temperature`` > 0: ``samples_per_prompt`` outputs of ``target`` sampled at ``temperature``
        (seeded) for each prompt, counted as :meth:`fit_texts` counts greedy ones (module docstring)."""
        from adaptree.core.batched import batched_generate
        from adaptree.offline.store import model_fingerprint

        if not temperature > 0:
            raise ValueError(f"fit_sampled needs a temperature > 0, got {temperature} (greedy rates: fit)")
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
        gen = torch.Generator(device=target.device).manual_seed(int(seed))
        outs = batched_generate(target, rows, max_new_tokens, eos_token_ids, temperature=temperature,
                                generator=gen, batch_size=batch_size)
        return cls.fit_texts(((p, y, len(y)) for p, y in zip(rows, outs)), {"model": model_fingerprint(target)},
                             max_ngram, max_tokens, edges, smoothing, temperature, select)

    @classmethod
    def combine(cls, calibrations: Sequence[ChainCalibration]) -> ChainCalibration:
        """One calibration with the rates of all of ``calibrations`` (the same model, n-grams, occurrence rule, buckets
        and chain length; distinct temperatures), sorted by temperature."""
        cals = sorted(calibrations, key=lambda c: float(c.temperatures[0]))
        if not cals:
            raise ValueError("combine needs at least one chain calibration")
        a = cals[0]
        for c in cals[1:]:
            if (c.max_ngram, c.select, c.edges.tolist(), c.max_tokens) != (a.max_ngram, a.select, a.edges.tolist(),
                                                                          a.max_tokens):
                raise ValueError(f"chain calibrations of different shapes cannot be combined: max_ngram, select, "
                                 f"edges, tokens {c.max_ngram}, {c.select}, {c.edges.tolist()}, {c.max_tokens} vs "
                                 f"{a.max_ngram}, {a.select}, {a.edges.tolist()}, {a.max_tokens}")
            if c.check(a.fingerprints):
                raise ValueError("chain calibrations of different models cannot be combined")
        fps = {k: v for c in reversed(cals) for k, v in c.fingerprints.items()}
        return cls(a.max_ngram, a.edges, np.concatenate([c.rates for c in cals]),
                   np.concatenate([c.trials for c in cals]), np.concatenate([c.samples for c in cals]), fps,
                   np.concatenate([c.temperatures for c in cals]), a.select)

    def check(self, fingerprints: Mapping[str, str]) -> list[str]:
        """A message when ``fingerprints``' model differs from the one the rates were measured on."""
        a, b = self.fingerprints.get("model"), fingerprints.get("model")
        if a and b and a != b:
            return [f"the chain calibration was fitted on traces of another model (sha256 {a[:12]}..., in use: "
                    f"{b[:12]}...): refit it on traces of this model"]
        return []

    # --------------------------------------------------------------------------------------------- files

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "max_ngram": self.max_ngram, "select": self.select,
                "edges": self.edges.tolist(),
                "temperatures": self.temperatures.tolist(),
                "rates": [[[round(float(x), 6) for x in row] for row in rt] for rt in self.rates],
                "trials": [[[int(x) for x in row] for row in nt] for nt in self.trials],
                "samples": self.samples.tolist(), "fingerprints": dict(self.fingerprints)}

    @classmethod
    def from_dict(cls, d: Mapping) -> ChainCalibration:
        if not isinstance(d, Mapping):
            raise ValueError(f"a chain calibration must be a JSON object, got {type(d).__name__}")
        version = d.get("version")
        if version not in (1, 2, FORMAT_VERSION):
            raise ValueError(f"chain calibration format version {version!r}, this adaptree reads 1 to "
                             f"{FORMAT_VERSION}")
        fields = FIELDS if version == FORMAT_VERSION else OLD_FIELDS[version]
        unknown, missing = sorted(set(d) - set(fields)), [k for k in fields if k not in d]
        if unknown or missing:
            raise ValueError(f"bad chain calibration (version {version}): unknown fields {unknown}, missing fields "
                             f"{missing}")
        return cls(d["max_ngram"], d["edges"], d["rates"], d["trials"], d["samples"], d["fingerprints"],
                   d.get("temperatures", (0.0,)), d.get("select", "recent"))

    def save(self, path: str | os.PathLike) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ChainCalibration:
        return read_json_as(path, cls.from_dict, "chain calibration")

RULE = -1
"""The chain option that leaves the chain's length to :class:`ChainRule`'s pricing."""
CHAIN_OPTIONS = (RULE, 0, 4, 8, 16)
"""A policy's chain options (:meth:`ChainRule.fix`): the rule's length, or that many of the chain's tokens (all of a
shorter chain)."""

MATCH_FEATURES = ("chain_first", "chain_expected", "match_length")
"""What a learned policy observes of the cycle's context match (:meth:`ChainRule.features`), whatever the chain's
length: P(the chain's first token accepted), the expected accepted tokens of a 16-token chain over 16, and the match
length over 16 (capped at 1); all 0 without a match."""

MATCH_LENGTH_SCALE = 16


def match_values(match, policy: str) -> list[float]:
    """``match`` (a policy's match features, :data:`MATCH_FEATURES`) as floats; a ValueError when they are missing."""
    if match is None or len(match) != len(MATCH_FEATURES):
        raise ValueError(f"this {policy} policy observes the context match (use_match): it needs the "
                         f"{len(MATCH_FEATURES)} match features {MATCH_FEATURES}, got {match!r}")
    return [float(x) for x in match]


class ChainSeam:
    """The controller hooks of a method whose cycles may carry a :class:`ChainRule`'s chain (``self.chain_rule``;
    None: no chain, no context index). Put it before :class:`~adaptree.core.controller.Controller` in the bases."""

    chain_rule: ChainRule | None = None

    def context_index(self) -> ContextIndex | None:
        return self.chain_rule.index() if self.chain_rule is not None else None

    def choose_chain(self, tree, plan, size: int) -> int:
        return self.chain_rule.choose(tree, plan, size)


class ChainRule:
    """A context chain in the cycles of a controller that decides the head's tree by other means (a learned policy).

    * :meth:`index`: the :class:`~adaptree.core.context.ContextIndex` the loop keeps (the controller's
      ``context_index``).
    * :meth:`begin` (in ``begin_cycle``): the longest earlier match of the context; its continuation (``tokens``
      long) is the plan's chain; :meth:`features` describe it (:data:`MATCH_FEATURES`).
    * :meth:`fix` (a policy's ``choose_size``): the policy chose the chain's length next to its V (one of
      :data:`CHAIN_OPTIONS`); :meth:`choose` then returns it.
    * :meth:`choose` (``choose_chain``): after :meth:`fix`, its length; else, with a latency model, the chain
      length ``k`` that maximises
      ``C(max(k, s)) - C(s) - rate * (verify(V + max(0, k - s)) - verify(V))``, ``C`` the calibrated expected
      accepted chain tokens at the cycle's temperature (:meth:`ChainCalibration.probs`), ``s`` the chain's first
      tokens already among the head's top-V nodes: a chain token is verified when its acceptance is worth its
      verification time at the tokens per second the method earns (``rate``: its AR gate's running throughput, set
      by the controller after each cycle, as hybrid's Dinkelbach rule prices nodes; without a gate, in training or
      with the fallback off, the same estimate measured by :meth:`record`; never below the autoregressive rate,
      which stands in until there is an estimate). Without a latency model, the whole chain.
      (At the AR rate alone, on the replayed family, the learned methods verified chain tokens that cost more than
      they earned where verification grows steeply: LTD 2.04x -> 2.13x on the AVX-512 1-thread bf16 profile with
      the running rate, docs/adapting.md.)
    * :meth:`priced_size`, :meth:`priced_continue`: the hybrid rule's V and its look-ahead on drafting another level
      (:mod:`~.pricing`), at the same price: what a policy's RULE actions defer to.

    Decisions depend on the context and the modelled costs only: replay makes the live engine's decisions.
    """

    def __init__(self, calibration: ChainCalibration, tokens: int = 16) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"chain tokens must be a positive integer, got {tokens!r}")
        self.cal, self.tokens = calibration, tokens
        self.latency = None
        self.acceptance = None
        """The head's :class:`~adaptree.methods.costaware.acceptance.AcceptanceCalibration`, for the priced decisions
        (:meth:`priced_size`, :meth:`priced_continue`)."""
        self.meter = Meter()  # the price without an AR gate to tell it (:meth:`record`)
        self._child_rates: dict[int, np.ndarray] = {}
        self.reset()
        self.begin_match(None, 0)

    def reset(self) -> None:
        """A new generation: the price starts again at the AR rate."""
        self.rate: float | None = None  # tokens per second the method earns (None: the AR rate)
        self.meter.reset()

    def record(self, rec) -> None:
        """After a cycle of a method without an AR gate (training, or the fallback off): the price becomes the
        drafted cycles' modelled throughput, measured as the gate measures it (:class:`~.ar_gate.Meter`)."""
        drafted = Meter.sample(rec, self.latency)
        if drafted is None:
            return
        self.meter.add(*drafted)
        self.rate = self.meter.throughput()

    @classmethod
    def of(cls, config, calibration: ChainCalibration | None, observes: bool, method: str) -> "ChainRule | None":
        """The rule a learned method's config asks for (its ``chain`` calibration file and ``chain_tokens``, default 16
        when its policies observe the match (``observes``), else 0), or None without a chain."""
        tokens = config.chain_tokens if config.chain_tokens is not None else (16 if observes else 0)
        if observes and tokens < 1:
            raise ValueError(f"{method}'s policies observe the context match: chain_tokens must be >= 1, got {tokens}")
        if tokens == 0:
            return None
        if calibration is None:
            if not config.chain:
                raise ValueError(f"{method} with a context chain needs a chain calibration: pass "
                                 f"--{method.split('-')[0]}-chain PATH (the machine setup's chain.json; fit one with "
                                 f"adaptree.methods.common.ChainCalibration.fit(traces).save(PATH))")
            calibration = ChainCalibration.load(config.chain)
        return cls(calibration, tokens)

    def index(self) -> ContextIndex:
        return self.cal.index()

    def begin_match(self, match: ContextMatch | None, context_len: int, temperature: float = 0.0) -> tuple[int, ...]:
        self.match, self.context_len, self.temperature = match, int(context_len), float(temperature)
        self.chosen: int | None = None  # the chain length a policy fixed this cycle (None: the rule's)
        self.chain = tuple(match.tokens) if match is not None else ()
        self._verify_s: np.ndarray | None = None  # the cycle's verification seconds, for the priced decisions
        self.gain = np.concatenate([[0.0], np.cumsum(self.cal.probs(match, temperature=temperature))])  # C(k)
        return match.tokens if match is not None else ()

    def begin(self, ctx) -> tuple[int, ...]:
        """The cycle's chain (empty without a match) from the index of ``ctx``
        (a :class:`~adaptree.core.controller.CycleContext`)."""
        if ctx.index is None:
            raise ValueError("the chain rule needs the loop's context index: return ChainRule.index() from the "
                             "controller's context_index()")
        return self.begin_match(ctx.index.match(self.tokens, 1), ctx.context_len, ctx.temperature)

    def features(self) -> list[float]:
        """:data:`MATCH_FEATURES` of the cycle's match."""
        m = self.match
        if m is None:
            return [0.0, 0.0, 0.0]
        c = self.cal.probs(ContextMatch(m.length, m.count, m.position, (0,) * MATCH_LENGTH_SCALE),  # chain-length free
                           temperature=self.temperature)
        return [float(c[0]), float(c.mean()), min(m.length, MATCH_LENGTH_SCALE) / MATCH_LENGTH_SCALE]

    def fix(self, tokens: int) -> None:
        """This cycle's chain: ``tokens`` of it (all of a shorter chain), or the rule's length (:data:`RULE`)."""
        if tokens != RULE and tokens < 0:
            raise ValueError(f"a chain option is {RULE} (the rule's length) or a token count >= 0, got {tokens}")
        self.chosen = None if tokens == RULE else int(tokens)

    def choose(self, tree, plan, size: int) -> int:
        """How many of ``plan.chain``'s tokens to verify next to the head's top-``size`` nodes of ``tree``."""
        if self.chosen is not None:
            return min(self.chosen, len(plan.chain))
        k_max = min(len(plan.chain), self.gain.size - 1)
        lat = self.latency
        if lat is None or k_max == 0:
            return k_max
        s = 0
        if tree is not None and size > 0:
            order = torch.sort(tree.candidate_scores(), descending=True, stable=True).indices
            s = int((shared_ranks(tree, plan.chain[:k_max], order) < size).sum())  # as the hybrid rule counts them
        L = self.context_len
        ks = np.arange(k_max + 1)
        added = np.maximum(ks - s, 0)
        verify = lat.verify_times(size + added, L) - lat.verify_time(size, L)
        value = self.gain[np.maximum(ks, s)] - self.gain[s] - self._price(lat) * verify
        return int(np.argmax(value))

    def _price(self, lat) -> float:
        """Tokens per second a verified node's seconds are worth: the method's throughput, at least the AR rate."""
        return max(1.0 / max(lat.ar_step(self.context_len), 1e-12), self.rate or 0.0)

    def _priced(self):
        """(latency model, price, the cost of verifying n = 0..MAX_SIZE + chain nodes this cycle); the verification
        seconds are read once per cycle, not once per draft step."""
        lat = self.latency
        if lat is None or self.acceptance is None:
            raise ValueError("the rule's decisions (a policy's RULE action) need the machine's latency model and the "
                             "head's acceptance calibration (--ltd-latency and --ltd-acceptance, or a machine setup)")
        if self._verify_s is None:
            self._verify_s = lat.verify_times(np.arange(MAX_SIZE + len(self.chain) + 1), self.context_len)
        price = self._price(lat)
        return lat, price, price * self._verify_s

    def priced_size(self, tree) -> int:
        """The head's V as the hybrid rule chooses it (:func:`~.pricing.price_split`, at most
        :data:`~.pricing.MAX_SIZE`) next to this cycle's chain, at :meth:`choose`'s price; :meth:`choose` then gives
        the chain's length for that V. Needs the latency model and :attr:`acceptance`."""
        _, _, cost = self._priced()
        k_max = min(len(self.chain), self.gain.size - 1)
        return price_split(tree, self.chain[:k_max], self.gain[:k_max + 1], self.acceptance, MAX_SIZE, cost).size

    def priced_continue(self, step) -> bool:
        """Whether the hybrid rule drafts another level after ``step`` (costaware's look-ahead,
        :func:`~.pricing.level_pays`), at :meth:`choose`'s price."""
        lat, price, cost = self._priced()
        rates = self._child_rates.get(step.width)
        if rates is None:
            rates = self._child_rates[step.width] = self.acceptance.rates(step.width)
        return level_pays(step, self.acceptance, rates, MAX_SIZE, cost, price * lat.draft_step(step.width,
                                                                                              self.context_len))


__all__ = ["CHAIN_OPTIONS", "RULE", "ChainCalibration", "ChainRule", "ChainSeam", "DEFAULT_EDGES", "MATCH_FEATURES",
           "SAMPLED_TEMPERATURES", "match_values"]
