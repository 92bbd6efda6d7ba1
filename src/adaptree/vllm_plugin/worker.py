"""vLLM's worker with the speculative path off in steps that draft nothing (vLLM's ``worker_cls`` setting; no
patched vLLM file).

When adaptree's controller decides ``K = 0`` (a full batch, where drafting costs more than it brings), vLLM's
EAGLE path still runs the drafter's first forward over every scheduled token, to keep the drafter's KV cache in
step, returns no drafts, and samples through its rejection sampler: measured on SmolLM2 at 16 streams, a step cost
7-14% more than plain decoding's (docs/vllm.md). This worker's model runner skips the drafter in such a step when
no request in it computes prompt tokens (each decodes its last token and verifies the drafts it has, a context
chain of the hybrid controller for one; a step with prompt tokens still runs the drafter: that pass is what puts
the prompt into the drafter's cache), doing only the bookkeeping vLLM's next step reads (the last valid sampled
token per request), and samples a step without drafts as plain decoding does.

The trade: the drafter's cache keeps no entries for the positions of skipped steps, so drafts made after a busy
stretch see a context with holes and are accepted less (never wrong: verification is the target's). The controller
sees that acceptance and drafts accordingly.

For a controller with a stop rule (``deagle``, ``radar``, ``ltd``:
:class:`adaptree.vllm_plugin.control.StopRuleLength`) the runner also records, at each of the drafter's forwards,
the top-``W`` log-probs of its distribution per request (the drafted token's first: vLLM drafts greedily by default)
and hands them to the scheduler with the drafts (``DraftTokenIds.logprobs``, which vLLM's synchronous engine passes
on as it is).

Enable it with ``worker_cls="adaptree.vllm_plugin.worker.AdaptiveCPUWorker"`` (``--worker-cls`` for
``vllm serve``) or ``...AdaptiveGPUWorker`` with vLLM's CUDA build: :func:`adaptree.vllm_plugin.engine.make_llm` sets
it for every arm with an adaptree controller.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class _IdleDrafterOff:
    """Mixed into vLLM's model runner: the drafter runs only in steps that draft, a step that verifies no draft
    samples as plain decoding does, and the drafter's log-probs go with its drafts where a stop rule reads them."""

    drafter_skips = 0
    """Steps in which the drafter did not run (the bench reports them)."""
    _logprob_width: int | None = None
    _draft_logprobs: dict | None = None

    def _width(self) -> int:
        """Log-probs per draft the controller reads (0: none; read once from vLLM's config)."""
        if self._logprob_width is None:
            from adaptree.vllm_plugin.control import draft_logprob_width

            self._logprob_width = draft_logprob_width((self.vllm_config.additional_config or {}).get("adaptree"))
        return self._logprob_width

    def take_draft_token_ids(self):
        out = super().take_draft_token_ids()
        logprobs, self._draft_logprobs = self._draft_logprobs, None
        if out is not None and logprobs:
            out.logprobs = [logprobs.get(r) for r in out.req_ids]
        return out

    def _sample(self, logits, spec_decode_metadata):
        # with a drafter configured vLLM builds speculative metadata for every step and samples through its rejection
        # sampler; with no draft in the step that is one bonus token per request, which is plain sampling, and the
        # rejection sampler's own work (about 3 ms of a 45 ms step at 16 streams) is saved
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None
        return super()._sample(logits, spec_decode_metadata)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        spec = self.speculative_config
        # only a step without prompt tokens (each request computes its last token and the drafts it verifies): the
        # drafter's first pass over prompt tokens is the only way its cache ever holds the prompt, which every
        # later draft of that request reads
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        skip = (scheduler_output.num_spec_tokens_to_schedule == 0 and spec.use_eagle()
                and not spec.disable_padded_drafter_batch and isinstance(sampled_token_ids, torch.Tensor)
                and all(n == 1 + len(spec_tokens.get(r, ()))
                        for r, n in scheduler_output.num_scheduled_tokens.items()))
        self._draft_logprobs = None
        if not skip:
            width = self._width()
            model = getattr(self.drafter, "model", None)
            if not width or model is None or not spec.use_eagle():
                return super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
            return self._propose_recording(width, model, scheduler_output, sampled_token_ids, *args, **kwargs)
        self.drafter_skips += 1
        self._draft_probs = None
        self._draft_prob_req_ids = None
        # what the drafter's path hands the next step besides drafts: each request's last valid token and count
        next_token_ids, valid_counts = self.drafter.prepare_next_token_ids_padded(
            sampled_token_ids, self.requests, self.input_batch, self.discard_request_mask.gpu)
        self._copy_valid_sampled_token_count(next_token_ids, valid_counts)
        return torch.empty((sampled_token_ids.shape[0], 0), dtype=torch.int64, device=sampled_token_ids.device)

    def _propose_recording(self, width, model, *args, **kwargs):
        """vLLM's drafting, with the top-``width`` log-probs of every draft forward recorded per request."""
        steps = []
        own = model.__dict__.get("compute_logits")
        compute = model.compute_logits

        def recording(hidden_states):
            logits = compute(hidden_states)
            if logits is not None:  # EAGLE-3's logits over the target vocabulary, -inf outside the head's
                steps.append(logits.float().log_softmax(-1).topk(width, dim=-1).values)
            return logits

        model.compute_logits = recording
        try:
            drafts = super().propose_draft_token_ids(*args, **kwargs)
        finally:
            if own is None:
                del model.compute_logits
            else:
                model.compute_logits = own
        # one forward per draft, one row per request in the batch's order (the drafts' rows)
        if isinstance(drafts, torch.Tensor) and drafts.dim() == 2 and 0 < drafts.shape[1] == len(steps):
            n = drafts.shape[0]
            if all(s.shape[0] >= n for s in steps):
                rows = torch.stack([s[:n] for s in steps], dim=1).tolist()
                self._draft_logprobs = dict(zip(self.input_batch.req_ids, rows))
        return drafts


def _idle_drafter_off(runner_cls: type) -> type:
    """``runner_cls`` with the drafter off at K = 0."""
    return type(f"IdleDrafterOff{runner_cls.__name__}", (_IdleDrafterOff, runner_cls), {})


def _warn_v2() -> None:
    # vLLM's second-generation runner drafts by another path: left as it is, drafting at K = 0 as vLLM does
    log.warning("adaptree: vLLM's second-generation model runner; the drafter runs in steps that draft nothing")


def __getattr__(name: str):
    # each worker imports its platform's code: built on first use, on the platform that has it
    if name == "AdaptiveCPUWorker":
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.cpu_worker import CPUWorker

        class Worker(CPUWorker):
            def init_device(self):
                super().init_device()  # builds its runner last, before any model is loaded: rebuilt as ours
                if type(self.model_runner) is CPUModelRunner:
                    del self.model_runner
                    self.model_runner = _idle_drafter_off(CPUModelRunner)(self.vllm_config, torch.device("cpu"))
                else:
                    _warn_v2()
    elif name == "AdaptiveGPUWorker":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker as GPUWorker

        class Worker(GPUWorker):
            def _make_model_runner(self):
                if self.use_v2_model_runner:
                    _warn_v2()
                    return super()._make_model_runner()
                return _idle_drafter_off(GPUModelRunner)(self.vllm_config, self.device)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    Worker.__name__ = Worker.__qualname__ = name
    Worker.__module__ = __name__
    globals()[name] = Worker
    return Worker
