"""gymnasium environments over the one draft-and-verify loop, used by LTD and Re-SpS training.

The method-agnostic part: the sources, the bridge and :class:`CycleEnv`. Each learned method subclasses
:class:`CycleEnv` for its own decision point, in its own folder:

* :class:`~adaptree.methods.ltd.env.DepthEnv` — after every draft forward, STOP (0) or CONTINUE (1) (LTD's
  π_D). One episode = one cycle; the reward arrives with the last decision, once the cycle is verified.
* :class:`~adaptree.methods.ltd.env.SizeEnv` — once drafting stopped, the verification size V from a discrete
  set (LTD's π_V). One episode = one cycle, one step.
* :class:`~adaptree.methods.resps.env.PlanEnv` — at the start of a cycle, a whole tree configuration (W, depth,
  V) that is then kept for ``interval`` cycles (Re-SpS's action caching). One episode = one generation; the
  reward of a step is the mean per-cycle throughput over its interval.

No environment has a loop of its own. A *source* runs the real loop — :class:`SimSource` replays greedy
traces through :func:`~adaptree.offline.simulator.simulate_one` with a calibrated latency model (minutes
of training), :class:`LiveSource` runs :meth:`~adaptree.core.engine.Engine.generate` with wall-clock
timings — in a worker thread, with a bridge controller at the seam: at the agent's decision point the
bridge hands the observation to the environment and blocks until :meth:`CycleEnv.step` brings the action;
every other decision is delegated to an *inner* controller (a fixed V, a frozen partner policy, a random
depth...). Rewards come from each cycle's :class:`~adaptree.core.records.CycleRecord` (draft and
verification seconds: modelled in the simulator, measured live; the policy's own time is recorded apart
and never enters the reward).

Rewards (``reward``), scaled by ``reward_scale`` (default: the source's AR step time, so a throughput
reward reads as "speed relative to autoregressive decoding", of order 1):

* ``throughput`` — (accepted + 1) / (draft_s + verify_s): LTD's eq. 4 (the bonus token counted);
* ``acceptance`` — accepted + 1 (unscaled; LTD's "acceptance length" ablation);
* ``time`` — -(draft_s + verify_s) (LTD's "time cost" ablation);
* ``cycle_throughput`` — (accepted + 1) / (draft_s + verify_s + other_s): Re-SpS's, with the drafting time
  inside the cycle's time (the public code timed the verification only).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np
import torch

from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree

REWARDS = ("throughput", "acceptance", "time", "cycle_throughput")


class _Closed(Exception):
    """Raised inside the worker's loop to abandon a generation."""


# ---------------------------------------------------------------------------------------------- sources


class SimSource:
    """Greedy traces replayed by the simulator with a latency model (deterministic, no model runs).

    :param traces: :class:`~adaptree.offline.traces.PromptTrace` objects (one generation each).
    :param latency: a :class:`~adaptree.offline.latency.LatencyModel` (the rewards' seconds).
    :param max_new_tokens: a smaller token limit than the traces' (None = theirs).
    """

    def __init__(self, traces: Sequence, latency, max_new_tokens: int | None = None, family=None) -> None:
        self.traces = list(traces)
        if not self.traces:
            raise ValueError("SimSource needs at least one trace")
        if latency is None:
            raise ValueError("SimSource needs a latency model (rewards are modelled seconds)")
        self.latency, self.max_new_tokens, self.family = latency, max_new_tokens, family
        self.reference_len = self.traces[0].prompt_len + 128
        self.reference_step_s = latency.ar_step(self.reference_len)

    def __len__(self) -> int:
        return len(self.traces)

    def run(self, controller: Controller, index: int, rng: np.random.Generator | None = None) -> None:
        """One generation; with a :class:`~adaptree.offline.family.LatencyFamily`, on a member drawn with ``rng``
        (the controller is told which through ``use_latency``)."""
        from adaptree.offline.simulator import simulate_one

        latency = self.latency if self.family is None or rng is None else self.family.sample(rng)
        simulate_one(controller, self.traces[index], latency, self.max_new_tokens, measure_policy=False)


class LiveSource:
    """The live engine on real prompts, wall-clock timings (the papers' online mode).

    :param engine: an :class:`~adaptree.core.engine.Engine` with a draft head.
    :param prompts: token-id lists (chat template applied).
    :param sampling: :class:`~adaptree.core.verify.SamplingConfig` (greedy by default).
    """

    def __init__(self, engine, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, sampling=None,
                 latency=None) -> None:
        self.engine, self.prompts = engine, [list(p) for p in prompts]
        if not self.prompts:
            raise ValueError("LiveSource needs at least one prompt")
        self.max_new_tokens, self.sampling = max_new_tokens, sampling
        self.latency = latency
        """This machine's latency model, handed to the controller before every generation (policies that see the
        hardware's costs read them from it); None: none is handed."""
        self._ref: float | None = None
        self.owner = None  # the one environment whose worker may run the engine (its KV caches are shared)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def reference_step_s(self) -> float:
        """Median seconds of one autoregressive step on the first prompt (measured once)."""
        if self._ref is None:
            res = self.engine.generate(self.prompts[0], None, max_new_tokens=16)
            times = sorted(c.verify_s + c.other_s for c in res.cycles) or [res.wall_time_s]
            self._ref = times[len(times) // 2]
        return self._ref

    def run(self, controller: Controller, index: int, rng: np.random.Generator | None = None) -> None:
        if self.latency is not None:
            controller.use_latency(self.latency)
        self.engine.generate(self.prompts[index], controller, max_new_tokens=self.max_new_tokens,
                             sampling=self.sampling)


# ---------------------------------------------------------------------------------------------- the bridge


class _Bridge(Controller):
    """Delegates to ``inner`` except at ``decision``, where it asks the environment (worker thread side)."""

    def __init__(self, inner: Controller, decision: str, env: "CycleEnv") -> None:
        self.inner, self.decision, self.env = inner, decision, env
        self.name = f"env-{decision}"
        self.uses_draft = inner.uses_draft  # reads_features stays True: an environment may observe them
        self.to_env: queue.Queue = queue.Queue()
        self.to_worker: queue.Queue = queue.Queue()
        self.asked = False  # the agent decided something this cycle (depth/size) or interval (plan)
        self.muted = False  # the environment abandoned the episode: finish it with the inner rule, silently
        self.interval: list[CycleRecord] = []
        self.left = 0  # cycles left in the current plan interval

    # ---- talking to the environment
    questions = 0
    """Decisions asked so far (a worker that asks none in a whole pass over its prompts stops with an error)."""

    def _ask(self, obs: np.ndarray):
        self.asked = True
        self.questions += 1
        self.to_env.put(("decide", np.array(obs, dtype=np.float32)))  # a copy: never a view of trace memory
        a = self.to_worker.get()
        if a is None:
            raise _Closed()
        if isinstance(a, str) and a == "abort":
            self.muted = True
            return None
        return a

    def _finish_episode(self, reward: float, info: dict) -> None:
        if not self.muted:
            self.to_env.put(("reward", reward, info))
            self.to_env.put(("done", info))
        self.muted = False

    # ---- the seam
    def use_latency(self, latency) -> None:
        self.inner.use_latency(latency)
        self.env.use_latency(latency)

    def reset(self) -> None:
        self.inner.reset()
        if self._own_chain():
            self.env.chain.reset()
        self.interval, self.left, self.asked, self.muted = [], 0, False, False

    def _own_chain(self) -> bool:
        """Whether the environment's chain rule is its own (not the inner controller's, which resets and prices it)."""
        chain = self.env.chain
        return chain is not None and getattr(self.inner, "chain_rule", None) is not chain

    def context_index(self):
        chain = self.env.chain
        return chain.index() if chain is not None else self.inner.context_index()

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        chain = self.env.chain.begin(ctx) if self.env.chain is not None else ()  # before the observation
        if self.decision != "plan":
            self.asked = False
            plan = self.inner.begin_cycle(ctx)
            if self.decision == "depth" and getattr(self.env, "first_decision", False) and plan.max_depth > 0 \
                    and not self.muted:  # asked before the first draft forward too: STOP = an AR step (+ chain)
                a = self._ask(self.env.observe_first(ctx))
                if a is not None and int(a) == 0:
                    plan = AR_PLAN
        else:
            if self.left <= 0:
                if self.interval:
                    self._interval_reward(done=False)
                a = None if self.muted else self._ask(self.env.observe(ctx))
                self.plan = self.env.plan_of(a) if a is not None else self.inner.begin_cycle(ctx)
                self.left = self.env.interval
            self.left -= 1
            plan = self.plan
        return plan if plan.chain else plan.with_chain(chain)

    def choose_chain(self, tree: DraftTree | None, plan: TreePlan, size: int) -> int:
        if self.env.chain is not None:
            return self.env.chain.choose(tree, plan, size)
        return self.inner.choose_chain(tree, plan, size)

    def continue_drafting(self, step: DraftStep) -> bool:
        if self.decision != "depth" or self.muted:
            return self.inner.continue_drafting(step)
        a = self._ask(self.env.observe(step))
        return self.inner.continue_drafting(step) if a is None else self.env.continues(int(a), step)

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        if self.decision != "size" or self.muted:
            return self.inner.choose_size(tree, plan)
        a = self._ask(self.env.observe(tree))
        return self.inner.choose_size(tree, plan) if a is None else self.env.size_of(int(a))

    def end_cycle(self, record: CycleRecord) -> None:
        self.inner.end_cycle(record)
        if self._own_chain():  # its chain tokens priced at the cycles' throughput, as a method without a gate does
            self.env.chain.record(record)
        if self.decision == "plan":
            if self.asked or self.muted:
                self.interval.append(record)
            return
        if self.asked:
            self.env.last_cycle = record  # with its seconds (wall clock: not in info, which must be reproducible)
            info = {k: getattr(record, k) for k in ("context_len", "width", "depth", "size", "candidates", "accepted")}
            self._finish_episode(self.env.reward(record), {"cycle": info})
        self.asked = False

    def _interval_reward(self, done: bool) -> None:
        recs, self.interval = self.interval, []
        r = float(np.mean([self.env.reward(c) for c in recs])) if recs else 0.0
        info = {"cycles": len(recs), "accepted": sum(c.accepted for c in recs)}
        if not self.muted:
            self.to_env.put(("reward", r, info))
            if done:
                self.to_env.put(("done", info))
        if done:
            self.muted = False

    def generation_done(self) -> None:
        """The worker finished a generation: the plan environment's episode ends here."""
        if self.decision == "plan" and (self.asked or self.interval):
            self._interval_reward(done=True)
        self.asked = False
        self.left = 0


# ---------------------------------------------------------------------------------------------- environments


class CycleEnv(gym.Env):
    """Base class: a source, a decision point, an inner controller, a reward (see the module docstring).

    :param seed: seeds the order in which prompts are visited (a permutation per pass) and the inner rule.
    :param chain: a :class:`~adaptree.methods.common.chain.ChainRule`: every cycle carries the context's chain,
        chosen by the rule, and observations that use match features read them from it.
    """

    metadata = {"render_modes": []}
    decision = ""

    def __init__(self, source, inner: Controller | Callable[[np.random.Generator], Controller], obs_dim: int,
                 n_actions: int, reward: str = "throughput", reward_scale: float | None = None,
                 seed: int = 0, chain=None) -> None:
        super().__init__()
        self.chain = chain
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; available: {', '.join(REWARDS)}")
        self.source, self._inner, self.reward_kind = source, inner, reward
        self.reward_scale = float(reward_scale if reward_scale is not None else source.reference_step_s)
        if self.reward_scale <= 0:
            raise ValueError(f"reward_scale must be > 0, got {self.reward_scale}")
        self._auto_scale = reward_scale is None
        self.latency = getattr(source, "latency", None)
        """The latency model of the generation running now (a family member drawn for it in training)."""
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(obs_dim,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(n_actions)
        self._seed = seed
        self._bridge: _Bridge | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_episode = False
        self._last_obs = np.zeros(obs_dim, np.float32)
        self.last_cycle: CycleRecord | None = None
        """The record of the last cycle an episode ended with (its seconds included)."""

    # ---- what subclasses define
    def observe(self, x) -> np.ndarray:
        raise NotImplementedError

    def size_of(self, action: int) -> int:
        raise NotImplementedError

    def continues(self, action: int, step: DraftStep) -> bool:
        """Whether a depth action drafts on after ``step`` (1: CONTINUE)."""
        return action == 1

    def plan_of(self, action: int) -> TreePlan:
        raise NotImplementedError

    def use_latency(self, latency) -> None:
        """The generation about to run is on ``latency`` (worker thread, before the generation's first decision):
        automatic reward scales follow its autoregressive step, so rewards read as speedups on every member."""
        self.latency = latency
        if self.chain is not None:
            self.chain.latency = latency
        if self._auto_scale and isinstance(self.source, SimSource):  # live rewards keep the measured AR step
            self.reward_scale = latency.ar_step(self.source.reference_len)

    # ---- rewards
    def reward(self, rec: CycleRecord) -> float:
        tokens = rec.accepted + 1
        if self.reward_kind == "acceptance":
            return float(tokens)
        if self.reward_kind == "time":
            return -(rec.draft_s + rec.verify_s) / self.reward_scale
        seconds = rec.draft_s + rec.verify_s + (rec.other_s if self.reward_kind == "cycle_throughput" else 0.0)
        return tokens / max(seconds, 1e-9) * self.reward_scale

    # ---- the worker thread
    def _start(self, seed: int) -> None:
        if hasattr(self.source, "owner"):
            if self.source.owner is not None and self.source.owner is not self:
                raise RuntimeError("this LiveSource already serves another environment (one engine runs one "
                                   "generation at a time): give each environment its own engine, or close the other")
            self.source.owner = self
        rng = np.random.default_rng(seed)
        inner = self._inner(rng) if callable(self._inner) and not isinstance(self._inner, Controller) else self._inner
        self._bridge = bridge = _Bridge(inner, self.decision, self)
        self._error = None

        def work() -> None:
            try:
                with torch.inference_mode():
                    while True:
                        before = bridge.questions
                        for i in rng.permutation(len(self.source)):
                            self.source.run(bridge, int(i), rng)
                            bridge.generation_done()
                        if bridge.questions == before:  # else the environment would wait for ever
                            raise RuntimeError(f"a whole pass over the {len(self.source)} prompts reached no "
                                               f"{self.decision} decision (the other decisions never draft)")
            except _Closed:
                pass
            except BaseException as exc:  # surfaced in the environment's thread
                self._error = exc
                bridge.to_env.put(("error", exc))

        self._thread = threading.Thread(target=work, name=f"adaptree-{self.decision}-env", daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        if self._thread is not None:
            self._bridge.to_worker.put(None)
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                raise RuntimeError("the environment's worker did not stop within 60 s")
        self._thread = self._bridge = None
        if getattr(self.source, "owner", None) is self:
            self.source.owner = None

    def _next(self) -> tuple[np.ndarray | None, float, dict]:
        """Wait for the worker: (obs, reward, info) at a decision, (None, reward, info) at an episode end."""
        total, info = 0.0, {}
        while True:
            msg = self._bridge.to_env.get(timeout=600)
            if msg[0] == "decide":
                return msg[1], total, info
            if msg[0] == "reward":
                total += msg[1]
                info = msg[2]
            elif msg[0] == "done":
                return None, total, info
            elif msg[0] == "error":
                raise RuntimeError(f"the environment's generation loop failed: {msg[1]!r}") from msg[1]

    # ---- gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None or self._thread is None:
            self._stop()
            self._start(self._seed if seed is None else seed)
        elif self._in_episode:  # abandon the running episode (its cycle finishes with the inner rule)
            self._bridge.to_worker.put("abort")
            while True:
                obs, _, _ = self._next()
                if obs is None:  # the muted episode ended... or a new decision started: take it
                    continue
                break
            self._in_episode = True
            self._last_obs = obs
            return obs, {}
        obs, _, _ = self._next()
        while obs is None:
            obs, _, _ = self._next()
        self._in_episode = True
        self._last_obs = obs
        return obs, {}

    def step(self, action):
        if not self._in_episode:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self._bridge.to_worker.put(int(action))
        obs, reward, info = self._next()
        if obs is None:
            self._in_episode = False
            return self._last_obs.copy(), reward, True, False, info
        self._last_obs = obs
        return obs, reward, False, False, info

    def close(self) -> None:
        self._stop()
        self._in_episode = False
