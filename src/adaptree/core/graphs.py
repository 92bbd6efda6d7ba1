"""Model forwards at a few fixed shapes, replayed as CUDA graphs: what takes a small model's decode step, draft
steps and verification on a GPU from host-bound (every kernel launched by Python: 8.5 ms per target forward for
SmolLM2 on an H100, about 7 ms per draft step) to the GPU's own time.

A forward of ``n`` new positions runs at the smallest bucket of :data:`BUCKETS` that holds them: the ``n``
positions and ``bucket - n`` padding rows (token 0 at the last real position, seeing only themselves), whose keys
and values land in cache slots past the new length, where nothing attends to them and the next forward overwrites
them. Attention covers the cache's whole buffer under a mask built on the device from the host's cache length, so
no value is read back and every shape is fixed (the model's ``step_fixed``:
:meth:`adaptree.models.llama.Transformer.step_fixed`, :meth:`adaptree.models.eagle3.Eagle3Head.step_fixed`).
Controllers keep choosing any V and W; the engine pads. On CUDA each bucket is captured as a
``torch.cuda.CUDAGraph`` on its first use (once per process and cache); elsewhere (``capture=False``: the CPU,
tests) the same padded step runs eagerly, which is how the padding is tested against the plain forward.
"""

from __future__ import annotations

import dataclasses

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Sizes (new positions) of the fixed-shape steps; a forward runs at the smallest one that holds it."""


def bucket_of(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` positions; None when none does."""
    return next((b for b in buckets if b >= n), None)


def _rows(out, n: int):
    """The first ``n`` rows (dim 1) of every tensor of a step's output (a dataclass or a tuple)."""
    if dataclasses.is_dataclass(out):
        return dataclasses.replace(out, **{f.name: _rows(getattr(out, f.name), n) for f in dataclasses.fields(out)})
    if isinstance(out, tuple):
        return tuple(_rows(x, n) for x in out)
    return out[:, :n] if isinstance(out, torch.Tensor) else out


class _Bucket:
    """One bucket's static inputs and output (and, captured, its graph)."""

    def __init__(self, size: int, width: int, cache, device: torch.device, dtype: torch.dtype) -> None:
        self.size = size
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.mask = torch.zeros(size, cache.max_len, dtype=torch.bool, device=device)
        self.hidden = torch.zeros(1, size, width, dtype=dtype, device=device) if width else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None


class StepGraphs:
    """Fixed-shape forwards of one model over one KV cache (module docstring).

    :param model: the target (:class:`~adaptree.models.llama.Transformer`) or the draft head
        (:class:`~adaptree.models.eagle3.Eagle3Head`, whose steps take a ``hidden`` input): anything with
        ``step_fixed(input_ids, position_ids, slots, mask, cache[, hidden])``.
    :param cache: the model's KV cache (:class:`~adaptree.models.llama.KVCache`) every step writes (its buffers'
        addresses are captured: one object per cache).
    :param max_tokens: the largest bucket used; larger forwards return None from :meth:`forward` (the caller
        runs the plain forward).
    :param capture: capture CUDA graphs (default: when the model is on CUDA).
    """

    def __init__(self, model, cache, max_tokens: int = BUCKETS[-1], capture: bool | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model, self.cache = model, cache
        self.device = model.device
        self.buckets = tuple(b for b in BUCKETS if b <= max_tokens) or (1,)
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        if hasattr(model, "reserve_positions"):
            model.reserve_positions(cache.max_len)  # the rotary table a captured step reads must not be replaced
        self._static: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self._slot_range = torch.arange(cache.max_len, device=self.device)

    def _run(self, b: _Bucket):
        if b.hidden is None:
            return self.model.step_fixed(b.ids, b.positions, b.slots, b.mask, self.cache)
        return self.model.step_fixed(b.ids, b.positions, b.slots, b.mask, self.cache, b.hidden)

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream (torch's capture recipe), then capture; the cache's contents are restored
        afterwards, since the warm-up writes the bucket's slots."""
        torch.cuda.synchronize(self.device)
        saved = (self.cache.k.clone(), self.cache.v.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.out = self._run(b)
        b.graph = graph
        self.cache.k.copy_(saved[0])
        self.cache.v.copy_(saved[1])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tree_mask: torch.Tensor | None,
                hidden: torch.Tensor | None = None):
        """The model's forward of ``input_ids [1, n]`` (and the head's ``hidden [1, n, width]``) at ``position_ids``
        after the cache's committed slots, ``tree_mask [n, K]`` over the last K slots, the new ones included, as in
        :func:`adaptree.models.llama.build_attn_mask` (None: causal among the new), through the bucket's fixed
        step; advances the cache like the plain forward. Returns the model's output for the ``n`` positions (all
        of them: views of the bucket's output when captured, valid until that bucket runs again), or None when no
        bucket holds ``n`` or the cache has no room for the bucket (the caller runs the plain forward)."""
        n = input_ids.shape[1]
        size = bucket_of(n, self.buckets)
        past = self.cache.length
        k = n if tree_mask is None else tree_mask.shape[-1]
        if (size is None or past + size > self.cache.max_len or input_ids.shape[0] != 1 or not n <= k <= past + n
                or (tree_mask is not None and tree_mask.shape[0] != n)):
            return None
        width = 0 if hidden is None else hidden.shape[-1]
        b = self._static.get((size, width))
        if b is None:
            dtype = getattr(self.model, "dtype", None) or (hidden.dtype if hidden is not None else torch.float32)
            b = self._static[size, width] = _Bucket(size, width, self.cache, self.device, dtype)
        b.ids[0, :n].copy_(input_ids[0])
        b.ids[0, n:] = 0
        b.positions[:n].copy_(position_ids.reshape(-1))
        b.positions[n:] = b.positions[n - 1]  # padding rows: a position the rotary table holds
        if hidden is not None:
            b.hidden[0, :n].copy_(hidden[0])
            b.hidden[0, n:] = 0
        b.slots.copy_(self._slot_range[past:past + size])
        end = past + n
        b.mask[:, :end - k] = True
        b.mask[:, end - k:] = False
        if tree_mask is None:
            b.mask[:n, past:end] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        else:
            b.mask[:n, end - k:end] = tree_mask
        pad = torch.arange(n, size, device=self.device)
        b.mask[pad] = False
        b.mask[pad, past + pad] = True  # a padding row sees itself alone
        if self.capture:
            if b.graph is None:
                self._capture(b)
            b.graph.replay()
            out = b.out
        else:
            out = self._run(b)
        self.cache.length = end
        return _rows(out, n)
