"""The target on llama.cpp's kernels: :class:`GgmlTarget` runs a GGUF file through libllama (llama-cpp-python's
low-level API) behind the same calls as :class:`~adaptree.models.llama.Transformer`, so the engine, every method,
the machine setup and the bench run on ggml unchanged (docs/ggml.md).

What the engine needs of a target, and how libllama provides it:

- the forward of T new tokens under a tree mask: one ``llama_decode`` whose tokens carry sets of sequence ids.
  Sequence 0 is the committed context; every leaf of the tree gets a sequence of its own (1, 2, ...), the context
  is copied into it first (``llama_memory_seq_cp``; with ``kv_unified`` a copy only tags the cells), and a node is
  in the sequences of the leaves below it. llama.cpp masks a query by its first sequence id, a leaf below the
  node, whose sequence holds exactly the node's ancestors and the context, and by position (``L + depth``), which
  hides the node's own descendants on that path. A chain (and AR's one token) runs in sequence 0, causal;
- logits for the rows asked (``batch.logits``);
- EAGLE-3's features: the outputs of decoder layers (1, L//2-1, L-4) are the inputs of layers (2, L//2, L-3),
  which libllama returns for every token of a batch (``llama_set_embeddings_layer_inp`` /
  ``llama_get_embeddings_layer_inp``, C++ linkage: bound by their mangled names);
- commit and roll back (:class:`GgmlCache`): the accepted path is one leaf's sequence cut at the accepted depth;
  ``seq_keep`` of that leaf drops every other node, the cut drops the rest, and the path becomes sequence 0 again.

The draft head borrows the target's token embeddings, so the target keeps that one table in PyTorch
(``model.embed_tokens``), dequantized from the file; everything else stays in the file's blocks, run by ggml.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from adaptree.models.config import ModelConfig
from adaptree.models.llama import ForwardOutput

log = logging.getLogger(__name__)

VERIFY_ROWS = 63
"""Rows of one ``llama_decode`` when more than one row's logits are asked (a verification): ggml's CPU flash attention
runs 64 query rows or more through its tiled kernel, which rounds differently from the one-token step; a larger
verification runs in pieces (its later nodes attend the earlier ones' cells), so every verified row is computed as
a one-token step over the same cells would be (docs/ggml.md says where that stops: one-token steps over 512 cells
or more split the cells between threads)."""
MAX_LEAVES = 127
"""Leaves of a verified tree (one sequence each, besides the context's; libllama keeps a logits row per sequence)."""

_TAP_SYMBOLS = {
    "set": ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"),
    "get": ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"),
}


class GgmlUnavailable(RuntimeError):
    """The llama.cpp backend cannot run here; the message says why (shown by the fallback to PyTorch)."""


_LIB: SimpleNamespace | None = None


def libllama() -> SimpleNamespace:
    """llama-cpp-python's low-level module with the layer taps bound; GgmlUnavailable says what is missing."""
    global _LIB
    if _LIB is not None:
        return _LIB
    try:
        import llama_cpp
    except ImportError:
        raise GgmlUnavailable("llama-cpp-python is not installed (bash scripts/setup.sh builds it here)") from None
    except OSError as e:  # libllama itself failed to load (a build for another CPU, a missing libgomp, ...)
        raise GgmlUnavailable(f"libllama does not load: {e}") from None
    # the ctypes module itself: the package re-exports its functions but not the library handle
    from llama_cpp import llama_cpp as ll

    lib = ll._lib
    taps = {}
    for kind, names in _TAP_SYMBOLS.items():
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is None:
            raise GgmlUnavailable(f"this libllama lacks {names[0]} (the layer taps the draft head reads); "
                                  f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is installed, "
                                  f"0.3.36 has them")
        taps[kind] = fn
    taps["set"].argtypes = [llama_cpp.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool]
    taps["set"].restype = None
    taps["get"].argtypes = [llama_cpp.llama_context_p_ctypes, ctypes.c_uint32]
    taps["get"].restype = ctypes.POINTER(ctypes.c_float)
    llama_cpp.llama_backend_init()
    _quiet(llama_cpp)
    _LIB = SimpleNamespace(ll=llama_cpp, set_tap=taps["set"], get_tap=taps["get"],
                           version=getattr(llama_cpp, "__version__", "?"))
    return _LIB


_LOG_CALLBACK = None


def _quiet(llama_cpp) -> None:
    """libllama's log lines go to Python's logging (errors as errors, the rest below warning level), not to stderr."""
    global _LOG_CALLBACK

    def forward(level, text, _user):
        msg = text.decode("utf-8", "replace").rstrip() if text else ""
        if msg:
            # its warnings are about its own choices (a tensor quantized to a fallback type, ...): info, not shown
            log.log(logging.ERROR if level == 4 else logging.INFO if level == 3 else logging.DEBUG, "%s", msg)

    _LOG_CALLBACK = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def ggml_available() -> str | None:
    """None when the llama.cpp backend can run here, else why not (one line)."""
    try:
        libllama()
    except GgmlUnavailable as e:
        return str(e)
    return None


_HUGE = 1 << 21
"""x86-64's transparent huge page (2 MiB)."""


def _anonymous_ranges(heap_only: bool = False) -> list[tuple[int, int]]:
    """This process's writable anonymous mappings (the heap included; ``heap_only``: the heap alone), as
    ``(start, end)``; empty where there is no ``/proc/self/maps``."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        f = line.split()
        if "w" in f[1] and (f[5:] == ["[heap]"] or not heap_only and len(f) < 6):
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b))
    return out


def _loaded_ranges(before: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where memory allocated since ``before`` (:func:`_anonymous_ranges`) can lie: the anonymous mappings made since,
    and the heap (glibc serves a buffer from a free chunk of its heap before it maps new memory; the heap is dense,
    so collapsing all of it adds little)."""
    heap = _anonymous_ranges(heap_only=True)
    return _subtract(_anonymous_ranges(), before + heap) + heap


def _huge_pages(before: list[tuple[int, int]]) -> int:
    """Back the memory allocated since ``before`` (:func:`_loaded_ranges`) with transparent huge pages, now
    (``MADV_COLLAPSE``, Linux 6.1+; bytes collapsed returned, 0 where the kernel refuses). The weights libllama
    repacks for its GEMM land in such memory in 4 KiB pages, and a one-token step reads all of them: with 2 MiB
    pages a step took 3-10% less on a 2-core EPYC (docs/ggml.md). llama.cpp itself leaves them in small pages."""
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for a, b in _loaded_ranges(before):
        a, b = (a + _HUGE - 1) & ~(_HUGE - 1), b & ~(_HUGE - 1)
        if b - a < _HUGE:
            continue
        # MADV_HUGEPAGE (14) first: with THP in "madvise" mode a later fault in the range also gets a huge page
        if libc.madvise(a, b - a, 14) == 0 and libc.madvise(a, b - a, 25) == 0:
            done += b - a
    return done


def _subtract(ranges: list[tuple[int, int]], old: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` that no range of ``old`` covers (the kernel merges a new mapping into a neighbour,
    so a new one can show as an old one grown at either end). ``ranges`` are disjoint ``(start, end)``; ``old``
    may overlap."""
    import bisect

    merged: list[tuple[int, int]] = []
    for x, y in sorted(old):
        if merged and x <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], y))
        else:
            merged.append((x, y))
    old = merged
    starts = [x for x, _ in old]
    out = []
    for a, b in ranges:
        i = max(0, bisect.bisect_right(starts, a) - 1)  # the last old range starting at or before a, then on
        while i < len(old) and old[i][0] < b:
            x, y = old[i]
            if y > a:
                if x > a:
                    out.append((a, x))
                a = max(a, y)
            i += 1
        if b > a:
            out.append((a, b))
    return out


class LlamaModel:
    """A loaded ``llama_model`` (weights mmapped from the file), freed with the last context using it.

    :param huge_pages: move the memory the load allocated (the weights libllama repacks) to huge pages where the
        kernel allows (:func:`_huge_pages`); False: as llama.cpp leaves it (its own loop arm, the bar)."""

    def __init__(self, path: str | Path, huge_pages: bool = True) -> None:
        ll = libllama().ll
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        before = _anonymous_ranges()
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise GgmlUnavailable(f"libllama could not load {path}")
        self.huge_bytes = _huge_pages(before) if huge_pages else 0
        """Bytes moved to huge pages."""
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.ptr))
        self.n_embd = ll.llama_model_n_embd(self.ptr)
        self._ll = ll

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self._ll.llama_model_free(self.ptr)
            self.ptr = None


@dataclass
class _Tree:
    """The last tree a forward ran, until the engine keeps its accepted path."""

    start: int
    """Committed tokens before it."""
    tokens: list[int]
    leaf_of: list[int]
    """A leaf's sequence below each node (the node's own when it is a leaf)."""
    leaves: int
    first: list[int]
    """Its first path (the root, its first child, that one's first child, ...), which the batch runs first."""


class GgmlCache:
    """One llama.cpp context: its KV cells are this cache. ``length`` committed tokens are sequence 0; a forward
    appends its new tokens (a tree: in its leaves' sequences) and advances ``length`` past them, and
    :meth:`truncate` / :meth:`compact` then keep the accepted ones, as :class:`~adaptree.models.llama.KVCache`'s do.

    The context's cells stay in position order, because llama.cpp's attention sums over cells in the order they
    sit in the buffer, and a one-token step equals a verified row bit for bit only over the same order. A kept path
    that is the tree's first path (run first in its batch) is in order already; any other is dropped from the cells
    and its tokens run again, in order, in front of the next forward (``_pending``): a few more rows instead of a
    different greedy text (docs/ggml.md).

    Setting ``length`` above the tokens held fills the difference with token 0 (the calibration times forwards
    after a context of a given length, whose contents do not matter); below, it rolls back."""

    def __init__(self, target: GgmlTarget, max_len: int) -> None:
        self._lib = libllama()
        ll = self._ll = self._lib.ll
        self.target, self.max_len = target, int(max_len)
        p = ll.llama_context_default_params()
        p.n_ctx = self.max_len
        p.n_batch = self.max_len  # a prompt runs in one llama_decode (its taps are one buffer of n_batch rows)
        p.n_ubatch = min(512, self.max_len)
        p.n_seq_max = MAX_LEAVES + 1
        p.n_outputs_max = MAX_LEAVES + 1  # libllama reserves a row per sequence whatever a batch asks
        p.n_threads = p.n_threads_batch = target.threads
        p.kv_unified = True  # a cell in several sequences: the shared context and the tree's inner nodes
        p.flash_attn_type = 1  # flash attention skips masked cells outright: holes and other paths add nothing
        p.no_perf = True
        before = _anonymous_ranges()
        self.ctx = ll.llama_init_from_model(target.gguf.ptr, p)
        if not self.ctx:
            raise GgmlUnavailable(f"libllama could not create a context of {self.max_len} tokens")
        self.huge_bytes = _huge_pages(before) if target.gguf.huge_bytes else 0
        """Bytes of the context's buffers (the KV cells, the compute graph's) moved to huge pages, as the weights."""
        self._model = target.gguf  # the weights outlive this context
        self._taps = False
        """Whether libllama copies out the tapped layer inputs: only while forwards ask for features, because keeping
        those tensors costs a one-token step 0.7 of its 6 ms (AR never asks)."""
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(self.max_len, 0, MAX_LEAVES + 1)
        n = self.max_len
        self._tok = np.ctypeslib.as_array(self.batch.token, shape=(n,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n,))
        self._nseq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n,))
        self._out = np.ctypeslib.as_array(self.batch.logits, shape=(n,))
        self._filled = 0
        """Tokens in sequence 0's cells, in position order."""
        self._pending: list[int] = []
        """Committed tokens at positions ``_filled..`` not in the cells yet (run in front of the next forward)."""
        self._tree: _Tree | None = None
        self._length = 0
        self.rerun = 0
        """Tokens run again because a kept path was not its tree's first (what the cell order costs)."""
        self._row, self._row_addr = None, None
        """:meth:`step`'s view of libllama's logits buffer, and the address it views."""

    def __del__(self) -> None:
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        if getattr(self, "batch", None) is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            ll.llama_free(self.ctx)
            self.ctx = None

    # -- the KVCache interface -------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        n = int(n)
        if not 0 <= n <= self.max_len:
            raise ValueError(f"cache length {n} is outside 0..{self.max_len}")
        self._drop_tree()
        if n <= self._filled:
            if n < self._filled:
                self._ll.llama_memory_seq_rm(self.mem, 0, n, -1)
            self._filled, self._pending = n, []
        else:
            fill = (self._pending + [0] * n)[:n - self._filled]
            self._pending = []
            self._decode(np.asarray(fill, dtype=np.int32), np.arange(self._filled, n, dtype=np.int32), None, [],
                         taps=None)
            self._filled = n
        self._length = n

    def check_room(self, n: int) -> None:
        if self._length + n > self.max_len:
            raise ValueError(f"KV cache overflow: {self._length} cached + {n} new > capacity {self.max_len}")

    def reset(self) -> None:
        self._ll.llama_memory_clear(self.mem, True)
        self._tree, self._filled, self._pending, self._length = None, 0, [], 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate cache of length {self._length} to {length}")
        if self._tree is not None and length > self._tree.start:
            self._commit(list(range(length - self._tree.start)))  # nodes 0..k of a tree are a path
        else:
            self.length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the new tokens ``start + keep[i]`` (the accepted path of the last tree) as positions ``start + i``."""
        path = [int(i) for i in keep.tolist()]
        if self._tree is not None and self._tree.start == start:
            self._commit(path)
        elif path == list(range(len(path))):  # a causal forward: its first tokens are already in place
            self.truncate(start + len(path))
        else:
            raise ValueError(f"compact({start}, {path}): the last forward was not a tree after {start} tokens")

    # -- llama.cpp's sequences ----------------------------------------------------------------------------------
    def _drop_tree(self) -> None:
        if self._tree is not None:
            for s in range(1, self._tree.leaves + 1):
                self._ll.llama_memory_seq_rm(self.mem, s, -1, -1)
            self._length = self._tree.start
            self._tree = None

    def _commit(self, path: list[int]) -> None:
        tree, ll = self._tree, self._ll
        if path and path == tree.first[:len(path)]:  # in the cells in order: the path becomes sequence 0
            s = tree.leaf_of[path[-1]]  # a leaf below the last kept node: its sequence is the context + the path + more
            ll.llama_memory_seq_keep(self.mem, s)
            ll.llama_memory_seq_rm(self.mem, s, tree.start + len(path), -1)
            ll.llama_memory_seq_cp(self.mem, s, 0, -1, -1)
            ll.llama_memory_seq_rm(self.mem, s, -1, -1)
            self._tree = None
            self._filled = tree.start + len(path)
        else:
            self._drop_tree()
            self._pending = [tree.tokens[i] for i in path]
            self.rerun += len(path)
        self._length = tree.start + len(path)

    def step(self, token: int, taps: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """One token after the committed context (an uncommitted tree dropped first): its logits ``[vocab]`` (a view
        of libllama's buffer, valid until the next decode) and, with ``taps``, its features ``[1, 3 * hidden]``.
        :meth:`run`'s decode step with no allocation it can skip: between two steps that each stream the whole
        model through the caches, every Python and torch call runs cold (torch.tensor took 65 us after a step, 4
        when repeated), and on a 5 ms step they added 5-10%."""
        self._drop_tree()
        self.check_room(1)
        if self._pending or taps != self._taps:  # the general path reruns a kept path first / switches the taps
            lg, fs = self.run([token], np.array([self._length], dtype=np.int32), None, [0], taps)
            return lg[0], fs
        b = self.batch
        b.n_tokens = 1
        self._tok[0], self._pos[0], self._nseq[0], self._out[0] = token, self._filled, 1, 1
        b.seq_id[0][0] = 0
        rc = self._ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of 1 token failed (code {rc})")
        self._filled = self._length = self._filled + 1
        ptr = self._ll.llama_get_logits(self.ctx)
        addr = ctypes.cast(ptr, ctypes.c_void_p).value
        if addr != self._row_addr:  # libllama moved its output buffer: a new view
            self._row = np.ctypeslib.as_array(ptr, shape=(self.target.gguf.n_vocab,))
            self._row_addr = addr
        return self._row, self._tapped(1) if taps else None

    def run(self, tokens: list[int], pos: np.ndarray, tree_mask: torch.Tensor | None, rows: list[int],
            taps: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The forward of ``tokens`` at ``pos`` after the committed context (``tree_mask``: their ancestor mask,
        None: causal): logits of ``rows`` (ascending) and the tapped features of every token. The caller dropped an
        uncommitted tree first (:meth:`GgmlTarget.forward`: the positions count from the committed length)."""
        pend, self._pending = self._pending, []
        p, t, base = len(pend), len(tokens), self._filled
        if tree_mask is None and not pend and len(rows) <= 1:  # a decode step or a prompt: one call, nothing to map
            lg, fs = self._decode(np.asarray(tokens, dtype=np.int32), pos, None, rows, taps)
            self._filled = self._length = base + t
            return lg, fs
        ppos = np.arange(base, base + p, dtype=np.int32)
        if tree_mask is None:
            all_tok = np.asarray(pend + tokens, dtype=np.int32)
            all_pos = np.concatenate([ppos, pos])
            seqs = None
            at = np.arange(p, p + t)
        else:
            order, first, tseqs, leaf_of, leaves = _tree_layout(tree_mask)
            for s in range(1, leaves + 1):
                self._ll.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
            at = np.empty(t, dtype=np.int64)  # each node's row in the batch
            at[order] = np.arange(p, p + t)
            all_tok = np.asarray(pend + [tokens[i] for i in order], dtype=np.int32)
            all_pos = np.concatenate([ppos, pos[order]])
            seqs = [list(range(leaves + 1))] * p + [tseqs[i] for i in order]
        want = sorted(int(at[r]) for r in rows)
        n = len(all_tok)
        step = VERIFY_ROWS if len(want) > 1 else n  # a prompt's one row: one call (llama.cpp splits it itself)
        parts = [self._decode(all_tok[a:a + step], all_pos[a:a + step], None if seqs is None else seqs[a:a + step],
                              [r - a for r in want if a <= r < a + step], taps) for a in range(0, n, step)]
        logits = np.concatenate([lg for lg, _ in parts if lg is not None])[np.searchsorted(want, at[rows])] \
            if rows else None
        feats = np.concatenate([f for _, f in parts])[at] if taps else None
        if tree_mask is None:
            self._filled = base + p + t
        else:
            self._filled = base + p
            self._tree = _Tree(base + p, list(tokens), leaf_of, leaves, first)
        self._length = base + p + t
        return logits, feats

    def _decode(self, tokens: np.ndarray, pos: np.ndarray, seqs: Sequence[Sequence[int]] | None, rows: list[int],
                taps: bool | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One ``llama_decode`` of ``tokens`` at ``pos`` (``seqs``: each token's sequence ids, None: all in 0),
        returning the logits of ``rows`` ``[len(rows), vocab]`` and (``taps``) the tapped layer inputs side by side
        ``[T, 3 * hidden]`` (None: no features, the taps left as they are)."""
        ll, t = self._ll, len(tokens)
        if taps is not None and taps != self._taps:  # libllama plans its graphs anew: once per switch
            for lid in self.target.tap_layers:
                self._lib.set_tap(self.ctx, lid, taps)
            self._taps = taps
        b = self.batch
        b.n_tokens = t
        self._tok[:t] = tokens
        self._pos[:t] = pos
        self._out[:t] = 0
        if rows:
            self._out[rows] = 1
        if seqs is None:
            self._nseq[:t] = 1
            for i in range(t):
                b.seq_id[i][0] = 0
        else:
            for i, ids in enumerate(seqs):
                self._nseq[i] = len(ids)
                row = b.seq_id[i]
                for j, s in enumerate(ids):
                    row[j] = s
        rc = ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {t} tokens failed (code {rc})")
        logits = None
        if rows:
            ptr = ll.llama_get_logits(self.ctx)
            logits = np.ctypeslib.as_array(ptr, shape=(len(rows), self.target.gguf.n_vocab)).copy()
        return logits, self._tapped(t) if taps else None

    def _tapped(self, t: int) -> np.ndarray:
        """The tapped layer inputs of the last decode's ``t`` tokens side by side, ``[t, 3 * hidden]``."""
        n_embd = self.target.gguf.n_embd
        return np.concatenate([np.ctypeslib.as_array(self._lib.get_tap(self.ctx, lid), shape=(t, n_embd))
                               for lid in self.target.tap_layers], axis=1)


def _tree_layout(tree_mask: torch.Tensor) -> tuple[list[int], list[int], list[list[int]], list[int], int]:
    """How a tree of ancestor mask ``[T, T]`` (row i: the ancestors of i and i) runs in one batch: the node order
    (depth first, children in node order, so parents come first and the first path leads), the first path, each
    node's sequence ids (leaf k in node order is sequence k+1; a node is in the sequences of the leaves below it,
    a leaf below it first), a leaf's sequence below each node, and the number of leaves."""
    m = tree_mask.to(torch.bool).cpu()
    t = m.shape[0]
    if m.shape != (t, t):
        raise ValueError(f"the llama.cpp backend takes a tree mask over the new tokens only, not {tuple(m.shape)}")
    rows = m.tolist()
    depth = [sum(r) - 1 for r in rows]
    children: list[list[int]] = [[] for _ in range(t)]
    roots = []
    for i, r in enumerate(rows):
        anc = [j for j in range(t) if r[j] and j != i]
        if anc:
            children[max(anc, key=depth.__getitem__)].append(i)
        else:
            roots.append(i)
    order, stack = [], roots[::-1]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(children[i][::-1])
    first = [roots[0]] if roots else []
    while first and children[first[-1]]:
        first.append(children[first[-1]][0])
    leaves = [i for i in range(t) if not children[i]]
    if len(leaves) > MAX_LEAVES:
        raise ValueError(f"a tree of {len(leaves)} leaves exceeds the llama.cpp backend's {MAX_LEAVES}")
    seqs: list[list[int]] = [[] for _ in range(t)]
    for k, leaf in enumerate(leaves):
        for j, anc in enumerate(rows[leaf]):
            if anc:
                seqs[j].append(k + 1)
    return order, first, seqs, [s[0] for s in seqs], len(leaves)


def _rows(t: int, logits_at: torch.Tensor | slice | int | None) -> list[int]:
    """The rows of ``t`` new tokens that ``logits_at`` asks logits for; libllama returns them in batch order, so
    they must ascend."""
    if logits_at is None:
        return list(range(t))
    if isinstance(logits_at, int):
        return [logits_at % t]
    if isinstance(logits_at, slice):
        rows = list(range(t))[logits_at]
    else:
        rows = [int(i) % t for i in torch.as_tensor(logits_at).reshape(-1).tolist()]
    if rows != sorted(set(rows)):
        raise ValueError(f"the llama.cpp backend returns logits of ascending distinct rows only, not {logits_at}")
    return rows


class GgmlTarget(nn.Module):
    """A GGUF model run by llama.cpp, called like :class:`~adaptree.models.llama.Transformer` (batch 1).

    :param path: the GGUF file (its own types, or a :func:`requantized` copy).
    :param cfg: its :class:`ModelConfig` (:func:`adaptree.models.gguf_file.gguf_config`).
    :param embed_weight: the token embeddings ``[vocab, hidden]`` the draft head borrows, in ``dtype``.
    :param dtype: the dtype of the features and embeddings handed to the head (logits are float32).
    :param threads: llama.cpp's threads (default: torch's).
    """

    compile_tokens = 0
    dense_prefill_rows = 0
    backend = "ggml"

    def __init__(self, path: str | Path, cfg: ModelConfig, embed_weight: torch.Tensor, dtype: torch.dtype,
                 max_seq_len: int | None = None, threads: int | None = None) -> None:
        super().__init__()
        self.path, self.config, self._dtype = Path(path), cfg, dtype
        self.threads = int(threads or torch.get_num_threads())
        self.gguf = LlamaModel(self.path)
        if self.gguf.n_vocab != cfg.vocab_size or self.gguf.n_embd != cfg.hidden_size:
            raise GgmlUnavailable(f"libllama reads {self.path} as vocabulary {self.gguf.n_vocab} x hidden "
                                  f"{self.gguf.n_embd}; adaptree reads {cfg.vocab_size} x {cfg.hidden_size}")
        self.max_seq_len = min(int(max_seq_len or cfg.max_position_embeddings), cfg.max_position_embeddings)
        self.tap_layers = tuple(i + 1 for i in cfg.feature_layers)  # a layer's output is the next one's input
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed_weight.to(dtype), freeze=True)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def weights_id(self) -> str:
        """The GGUF file's sha256 (what the weights are: fingerprints of this target include it)."""
        from adaptree.models.cache import file_sha256

        return file_sha256(self.path)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def attn_dtype(self) -> torch.dtype:
        return torch.float16  # llama.cpp's KV cache

    def compile(self, max_tokens: int) -> GgmlTarget:
        return self  # ggml's graphs are its own

    def to(self, *args, **kwargs):
        dev = next((torch.device(a) for a in args if isinstance(a, (str, torch.device))), kwargs.get("device"))
        if dev is not None and torch.device(dev).type != "cpu":
            raise ValueError(f"the llama.cpp backend runs on the CPU, not on {dev}")
        return self

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> GgmlCache:
        if batch != 1:
            raise ValueError(f"the llama.cpp backend runs one sequence; a batch of {batch} needs the PyTorch backend")
        return GgmlCache(self, max_len or self.max_seq_len)

    def greedy_step(self, token: int, cache: GgmlCache, features: bool) -> tuple[int, np.ndarray | None]:
        """A greedy decode step of ``token`` after ``cache``'s committed context: the argmax of its logits (numpy's:
        the first maximal index, as :func:`~adaptree.core.verify.greedy_tokens` takes it) and, with ``features``, its
        features ``[1, 3 * hidden]`` float32 (numpy: the engine makes tensors of them when the head drafts). The
        engine's AR step on this backend (:meth:`GgmlCache.step`: no torch object per token)."""
        row, fs = cache.step(int(token), features)
        return int(row.argmax()), fs

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: GgmlCache | None = None, tree_mask: torch.Tensor | None = None,
                features: bool = False, logits_at: torch.Tensor | slice | int | None = None,
                logits: bool = True) -> ForwardOutput:
        """As :meth:`Transformer.forward <adaptree.models.llama.Transformer.forward>`, for one sequence."""
        b, t = input_ids.shape
        if b != 1:
            raise ValueError(f"the llama.cpp backend runs one sequence; got a batch of {b}")
        if cache is None:
            cache = self.new_cache(t)
        cache._drop_tree()  # a forward over an uncommitted tree replaces it (the calibration's repeated shapes)
        cache.check_room(t)
        past = cache.length
        pos = (np.arange(past, past + t, dtype=np.int32) if position_ids is None
               else position_ids.reshape(-1).to(torch.int32).numpy())
        if pos.size and int(pos.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(pos.max())} exceeds the model's context limit {self.max_seq_len}")
        rows = _rows(t, logits_at) if logits else []
        lg, fs = cache.run(input_ids[0].tolist(), pos, tree_mask, rows, features)
        out_logits = torch.from_numpy(lg)[None] if lg is not None else None
        feats = torch.from_numpy(fs)[None].to(self._dtype) if features else None
        return ForwardOutput(out_logits, feats)


def load_ggml(path: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
              threads: int | None = None):
    """The GGUF file ``path`` on llama.cpp (:class:`GgmlTarget`) and its tokenizer bundle; GgmlUnavailable when
    this machine's llama.cpp cannot run it (the caller falls back to PyTorch, saying why)."""
    from adaptree.models.gguf_file import (
        dequantize_gguf_tensor,
        gguf_config,
        gguf_tokenizer_bundle,
        read_gguf,
    )

    why = ggml_available()
    if why is not None:
        raise GgmlUnavailable(why)
    path = Path(path)
    reader = read_gguf(path)
    try:
        cfg = gguf_config(reader, path)
    except ValueError as e:  # an architecture adaptree's head and tokenizer code do not know
        raise GgmlUnavailable(str(e)) from None
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    target = GgmlTarget(path, cfg, dequantize_gguf_tensor(embed), dtype, max_seq_len, threads)
    return target, gguf_tokenizer_bundle(reader, path, cfg)


QUANTS = {"q4_0": 2, "q8_0": 7}
"""The types llama.cpp can requantize a GGUF file to for the backend (``llama_ftype`` values): Q4_0, whose blocks
ggml repacks for its AVX2/AVX-512 GEMM, and Q8_0, which its tinyBLAS GEMM runs for several rows at once."""


def requantized(path: str | Path, kind: str) -> Path:
    """``path`` requantized to ``kind`` (:data:`QUANTS`) by llama.cpp's own quantizer, made once (seconds) and cached
    under ``$ADAPTREE_CACHE/gguf`` by the source file's sha256. Requantizing a 4-bit file rounds its weights once
    more: the greedy text can move (docs/ggml.md has what it costs)."""
    from adaptree.core.files import atomic_path, file_lock
    from adaptree.models.cache import cache_dir, file_sha256

    if kind not in QUANTS:
        raise ValueError(f"requantization {kind!r} is not one of {', '.join(QUANTS)}")
    path = Path(path)
    out = cache_dir() / "gguf" / f"{file_sha256(path)[:16]}-{kind}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    ll = libllama().ll
    with file_lock(out.with_name(out.name + ".lock")):
        if out.is_file():  # made by another process while this one waited
            return out
        params = ll.llama_model_quantize_default_params()
        params.ftype = QUANTS[kind]
        params.allow_requantize = True
        params.nthread = torch.get_num_threads()
        with atomic_path(out) as tmp:
            rc = ll.llama_model_quantize(str(path).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0:
                raise GgmlUnavailable(f"llama.cpp could not requantize {path} to {kind} (code {rc})")
    return out
