"""adaptree's draft-length controllers inside vLLM, as a scheduler class (vLLM's ``scheduler_cls`` setting; no
patched vLLM file).

vLLM's scheduler decides, before every engine step, which tokens each running request computes: for a decoding
request, its last sampled token plus the drafts the drafter left in ``request.spec_token_ids``. This subclass asks
an adaptree controller (:mod:`adaptree.vllm_plugin.control`) first, keeps each request's first ``k_i`` drafts (or,
for the hybrid controller, puts the context's chain in their place), and sets how many drafts the drafter makes
after the step (``num_spec_tokens_to_schedule``, vLLM's dynamic speculative decoding field, which its EAGLE drafter
and rejection sampler honour per step). Verification is vLLM's own: the text is the same as without drafts
(lossless), only the work per step changes.

It also records each step's wall time (schedule to schedule: forward, sampling, drafting, bookkeeping) with the
batch it ran, which :func:`adaptree.vllm_plugin.engine.measure_step_costs` turns into the controller's cost table.

Enable it with ``scheduler_cls="adaptree.vllm_plugin.scheduler.AdaptiveDraftAsyncScheduler"`` and
``async_scheduling=True`` (vLLM's default where it can; or ``...AdaptiveDraftScheduler`` with it off, which the
hybrid needs), ``speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": K_MAX}`` and
``additional_config={"adaptree": {"controller": "costaware", "step_costs": PATH}}``:
:func:`adaptree.vllm_plugin.engine.plugin_settings` gives them for a controller.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from adaptree.vllm_plugin.control import build_controller


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the scheduler planned it, and its wall time."""

    decoding: int
    """Requests that verified drafts or decoded one token."""
    verified: tuple[int, ...]
    """Drafts verified per decoding request."""
    drafted_after: int
    """K: drafts the drafter made after the step."""
    prefill_tokens: int
    """Prompt tokens computed in the step (0 in a pure decode step)."""
    seconds: float


class _DraftControl:
    """The controller's hooks on vLLM's scheduler (mixed into both of vLLM's scheduler classes)."""

    RECORDS = 4096

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = (self.vllm_config.additional_config or {}).get("adaptree", {})
        if not self.num_spec_tokens:
            raise ValueError("adaptree's scheduler decides speculative drafts: configure vLLM's speculative_config "
                             "(method eagle3, num_speculative_tokens = the most drafts a step may take)")
        self.controller = build_controller(settings, self.num_spec_tokens)
        if (self.controller.uses_context or self.controller.reads_drafts) and isinstance(self, AsyncScheduler):
            raise ValueError(f"the {self.controller.name} controller reads each request's output or drafts when it "
                             "decides, which vLLM's async scheduler has not received yet: use "
                             "adaptree.vllm_plugin.scheduler.AdaptiveDraftScheduler with async_scheduling=False")
        # vLLM's dynamic speculative decoding reads K from this batch-size lookup; schedule() fills it with the
        # controller's K before every step (so vLLM also sizes its async placeholders by it, and stops padding new
        # decode requests to the full draft length)
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 2)
        self.step_records: deque[StepRecord] = deque(maxlen=self.RECORDS)
        self.steps_done = 0
        self._open: tuple[float, int, tuple[int, ...], int, int] | None = None

    def schedule(self, *args, **kwargs):
        now = time.perf_counter()
        if self._open is not None:
            t0, n, verified, k_after, prefill = self._open
            self.step_records.append(StepRecord(n, verified, k_after, prefill, now - t0))
            if n and not prefill and all(v == k_after for v in verified):
                self.controller.observe_step(n, k_after, now - t0)
            self.steps_done += 1
            self._open = None
        drafting = [r for r in self.running if r.spec_token_ids and not r.is_prefill_chunk]
        live = [r.request_id for r in self.running]
        self.controller.forget(live)
        # the batch this step will run: the running requests and those it admits, whose first drafts K decides
        admitted = list(itertools.islice(self.waiting, max(0, self.max_num_active_reqs - len(live))))
        ks, k_next = self.controller.decide(live + [r.request_id for r in admitted])
        for r in drafting:
            k = ks.get(r.request_id, 0)
            if len(r.spec_token_ids) > k:  # never more than were drafted (under async scheduling: placeholders)
                r.spec_token_ids = r.spec_token_ids[:k]  # a new list: async scheduling shares its placeholders
        if self.controller.uses_context:
            self._chains(ks)
        self.dynamic_sd_lookup = [k_next] * len(self.dynamic_sd_lookup)
        out = super().schedule(*args, **kwargs)
        if out.num_scheduled_tokens:
            spec = out.scheduled_spec_decode_tokens
            decoding = [r for r, n in out.num_scheduled_tokens.items() if n == 1 + len(spec.get(r, ()))]
            prefill = out.total_num_scheduled_tokens - sum(out.num_scheduled_tokens[r] for r in decoding)
            self._open = (now, len(decoding), tuple(len(spec.get(r, ())) for r in decoding), k_next, prefill)
        return out

    def _chains(self, ks) -> None:
        """The context chains the controller verifies in place of the head's drafts (synchronous scheduling: each
        request's output is complete here)."""
        contexts, lengths, room = {}, {}, {}
        for r in self.running:
            # decoding: everything but the last sampled token computed; a grammar would have to check the chain
            if r.is_prefill_chunk or r.num_computed_tokens != r.num_tokens - 1 or r.use_structured_output:
                continue
            rid = r.request_id
            contexts[rid] = r.all_token_ids
            lengths[rid] = min(len(r.spec_token_ids), ks.get(rid, 0))
            room[rid] = min(self.max_model_len - r.num_tokens - 1, r.max_tokens - r.num_output_tokens - 1)
        for rid, chain in self.controller.chains(contexts, lengths, room).items():
            self.requests[rid].spec_token_ids = list(chain)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        # synchronous scheduling: the drafts of the step just run, with the drafter's log-probs where adaptree's
        # worker recorded them (a controller with a stop rule reads them)
        logprobs = getattr(draft_token_ids, "logprobs", None)
        if logprobs is not None and self.controller.reads_drafts:
            for req_id, lp in zip(draft_token_ids.req_ids, logprobs):
                request = self.requests.get(req_id)
                if lp and request is not None:
                    self.controller.drafted(req_id, lp, request.num_tokens)
        super().update_draft_token_ids(draft_token_ids)

    def update_from_output(self, scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        if sampled:
            index = model_runner_output.req_id_to_index
            for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                i = index.get(req_id)
                if i is not None and drafts and sampled[i]:
                    self.controller.observe(req_id, len(drafts), min(len(sampled[i]) - 1, len(drafts)))
        return super().update_from_output(scheduler_output, model_runner_output)


class AdaptiveDraftScheduler(_DraftControl, Scheduler):
    """vLLM's scheduler with an adaptree controller deciding the drafts."""


class AdaptiveDraftAsyncScheduler(_DraftControl, AsyncScheduler):
    """vLLM's async scheduler with an adaptree controller deciding the drafts."""
