"""Step-wise EAGLE-2/3 draft trees.

A :class:`DraftTree` is grown one draft forward at a time so a controller can look at every step
(:class:`DraftStep`) and decide whether to go on. After drafting, :meth:`DraftTree.select` keeps the
``V`` best candidates by cumulative log-probability and returns a :class:`VerifyTree` with the tree
attention mask, position ids and retrieve indices, all built with vectorised tensor ops (the loops
run over depth levels, never over nodes).

Terminology (SPEC.md §1): W = beam width (top-k per expansion), depth = number of draft forwards so
far = number of node levels, V = number of draft nodes sent to the target (the root is extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class DraftStep:
    """What a controller sees after each draft forward."""

    depth: int
    """Levels drafted so far (1 after the first forward)."""
    width: int
    """Beam width W of this tree."""
    context_len: int
    """True context length L of the target (tokens committed before the root)."""
    beam_tokens: torch.Tensor
    """``[W]`` target token ids of the current beam (the frontier that would be expanded next)."""
    beam_scores: torch.Tensor
    """``[W]`` cumulative log-probabilities of the beam nodes (descending)."""
    child_scores: torch.Tensor
    """Cumulative log-probs of all children scored by this forward: ``[W, W]`` (``[1, W]`` at depth 1)."""
    tree: "DraftTree" = field(repr=False)
    """The whole tree so far (all candidates: :meth:`DraftTree.candidate_scores`)."""
    logp: torch.Tensor | None = field(default=None, repr=False)
    """``[P, draft_vocab]`` log-probs of the distributions this forward produced (one row per expanded
    node, the rows of ``child_scores``); kept by reference, nothing is computed unless asked for."""
    beam_rows: torch.Tensor | None = field(default=None, repr=False)
    """``[W]`` row of ``child_scores`` / ``logp`` each beam node came from (its parent's distribution)."""

    @cached_property
    def entropy(self) -> torch.Tensor:
        """``[P]`` entropy (nats) of each distribution of this forward, computed on first use."""
        if self.logp is None:
            raise ValueError("this DraftStep carries no log-probs")
        return torch.special.entr(self.logp.exp()).sum(-1)  # -p log p, 0 where p = 0 (masked logits)

    @property
    def beam_entropy(self) -> torch.Tensor:
        """``[W]`` entropy of the distribution each beam node was drafted from (descending-score order)."""
        return self.entropy[self.beam_rows]


@dataclass
class VerifyTree:
    """The selected tree, flattened for one target forward. Node 0 is the root."""

    tokens: torch.Tensor
    """``[N]`` target token ids, N = V + 1; nodes are topologically ordered (parents first)."""
    parents: torch.Tensor
    """``[N]`` parent node index, -1 for the root."""
    depth: torch.Tensor
    """``[N]`` depth of each node (root 0)."""
    positions: torch.Tensor
    """``[N]`` rotary positions: context length + depth."""
    mask: torch.Tensor
    """``[N, N]`` bool, ``mask[i, j]`` iff j is an ancestor of i or i itself."""

    @property
    def size(self) -> int:
        """V: number of draft nodes (excluding the root)."""
        return int(self.tokens.numel()) - 1

    @cached_property
    def retrieve_indices(self) -> torch.Tensor:
        """``[leaves, max_depth + 1]``: node indices of every root-to-leaf path, padded with -1."""
        n = self.tokens.numel()
        has_child = torch.zeros(n, dtype=torch.bool, device=self.tokens.device)
        has_child[self.parents[1:]] = True
        leaves = (~has_child).nonzero().squeeze(1)
        out = torch.full((leaves.numel(), int(self.depth.max()) + 1), -1, dtype=torch.long,
                         device=self.tokens.device)
        rows, cols = self.mask[leaves].nonzero(as_tuple=True)
        out[rows, self.depth[cols]] = cols
        return out


def ancestor_mask(parents: torch.Tensor, depth: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Ancestor-or-self mask of a topologically ordered tree, filled one depth level at a time. ``max_depth``: a
    bound on ``depth`` known to the caller (the levels drafted), so that nothing is read back from the device
    (default: read from ``depth``)."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    if max_depth is None:
        max_depth = int(depth.max()) if n else 0
    up = parents.clamp(min=0)
    for d in range(1, max_depth + 1):  # each level takes its parent's row, complete by then
        mask |= (depth == d)[:, None] & mask[up]
    return mask


class DraftTree:
    """Grows the EAGLE-3 draft tree for one cycle, one draft forward per :meth:`step`.

    :param head: the EAGLE-3 draft head (``forward(hidden, input_ids, position_ids, cache, tree_mask)``
        returning ``(out_hidden, logits)``, and ``draft_to_target``).
    :param cache: the head's KV cache; committed entries stay, tree entries are dropped by :meth:`discard`.
    :param width: beam width W.
    :param root: target token id of the root (the last token the target produced).
    :param context_len: target context length L before the root.
    :param steps: the head's fixed-shape steps over ``cache`` (:class:`~adaptree.core.graphs.StepGraphs`, CUDA
        graphs on CUDA); None: plain forwards.
    """

    def __init__(self, head, cache, width: int, root: int, context_len: int, steps=None) -> None:
        self.head, self.cache, self.width = head, cache, width
        self.steps = steps
        self.root, self.context_len = root, context_len
        self.depth = 0
        self.draft_forwards = 0
        self.committed = cache.length
        # Candidate storage, one chunk per depth level (concatenated lazily).
        self._tokens: list[torch.Tensor] = []
        self._scores: list[torch.Tensor] = []
        self._parents: list[torch.Tensor] = []
        self._offset = 0  # number of candidates before the current level
        self._cat: tuple[torch.Tensor, ...] | None = None

    # ----------------------------------------------------------------- drafting
    def _expand(self, logits: torch.Tensor, parent_scores: torch.Tensor, parent_cand: torch.Tensor) -> torch.Tensor:
        """Score the top-W children of each of the ``P`` rows of ``logits``, record them as the next
        level of candidates and pick the next beam; returns their cumulative scores ``[P, W]``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        self.level_logp = logp  # for DraftStep.entropy, computed only when a controller asks
        top_lp, top_ids = logp.topk(self.width, dim=-1)
        child_scores = parent_scores[:, None] + top_lp
        p, w = child_scores.shape
        tokens = self.head.draft_to_target(top_ids.reshape(-1))
        self._tokens.append(tokens)
        self._scores.append(child_scores.reshape(-1))
        self._parents.append(parent_cand.repeat_interleave(w))
        self._level_offset = self._offset
        self._offset += p * w
        self._cat = None
        # Next beam: global top-W of this level's children.
        flat = child_scores.reshape(-1)
        k = min(self.width, flat.numel())
        beam_scores, beam_pos = flat.topk(k)
        self.beam_pos = beam_pos  # position within this level
        self.beam_rows = torch.div(beam_pos, w, rounding_mode="floor")  # which parent row
        self.beam_cand = beam_pos + self._level_offset
        self.beam_scores = beam_scores
        self.beam_tokens = tokens[beam_pos]
        self.depth += 1
        return child_scores

    def first_step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> DraftStep:
        """Consume the pending accepted positions (target features ``[1, P, 3H]``, next tokens ``[1, P]``,
        the last being the root) into the committed draft cache and draft depth 1."""
        out = None
        if self.steps is not None:
            past = self.cache.length
            pos = torch.arange(past, past + tokens.shape[1], device=tokens.device)
            out = self.steps.forward(tokens, pos, None, hidden)
        if out is None:
            out_hidden, logits = self.head(hidden, tokens, cache=self.cache, logits_at=slice(-1, None))
        else:
            out_hidden, logits = out[0][:, -1:].clone(), out[1][:, -1:]  # the bucket's output is reused
        self.draft_forwards += 1
        self.committed = self.cache.length
        self.base_pos = self.committed - 1  # draft position of the root's input
        zero = torch.zeros(1, device=logits.device)
        child = self._expand(logits[0, -1:], zero, torch.full((1,), -1, dtype=torch.long, device=logits.device))
        # Every depth-1 beam node takes the root position's output hidden as its input hidden.
        self.beam_hidden = out_hidden[0, -1:].expand(self.beam_tokens.numel(), -1)
        self.beam_anc = torch.zeros(self.beam_tokens.numel(), 0, dtype=torch.bool, device=logits.device)
        return DraftStep(1, self.width, self.context_len, self.beam_tokens, self.beam_scores, child, self,
                         self.level_logp, self.beam_rows)

    def step(self) -> DraftStep:
        """One draft forward over the current beam; its W×W children become candidates."""
        w = self.beam_tokens.numel()
        dev = self.beam_tokens.device
        pos = torch.full((w,), self.base_pos + self.depth, dtype=torch.long, device=dev)
        mask = torch.cat([self.beam_anc, torch.eye(w, dtype=torch.bool, device=dev)], dim=1)
        out = self.steps.forward(self.beam_tokens[None], pos, mask, self.beam_hidden[None]) if self.steps else None
        if out is None:
            out = self.head(self.beam_hidden[None], self.beam_tokens[None], position_ids=pos, cache=self.cache,
                            tree_mask=mask)
        out_hidden, logits = out
        self.draft_forwards += 1
        child = self._expand(logits[0], self.beam_scores, self.beam_cand)
        rows = self.beam_rows
        self.beam_hidden = out_hidden[0, rows]
        self.beam_anc = mask[rows]
        return DraftStep(self.depth, self.width, self.context_len, self.beam_tokens, self.beam_scores,
                         child, self, self.level_logp, self.beam_rows)

    def best_hidden(self) -> torch.Tensor:
        """``[H]`` the head's output hidden state whose distribution drafted the best node of the current beam (at
        depth 1: the root's): what a classifier on the draft's hidden states reads (SpecDec++)."""
        return self.beam_hidden[0]

    def discard(self) -> None:
        """Drop the tree's throw-away KV entries, keeping the committed context."""
        self.cache.truncate(self.committed)

    # ---------------------------------------------------------------- selection
    def _all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._cat is None:
            tokens = torch.cat(self._tokens)
            scores = torch.cat(self._scores)
            parents = torch.cat(self._parents)
            depth = torch.cat([torch.full((t.numel(),), d + 1, dtype=torch.long, device=t.device)
                               for d, t in enumerate(self._tokens)])
            self._cat = (tokens, scores, parents, depth)
        return self._cat

    @property
    def num_candidates(self) -> int:
        return self._offset

    def candidate_scores(self) -> torch.Tensor:
        """Cumulative log-probs of all candidates so far, in creation order (level by level)."""
        return self._all()[1]

    def candidate_tokens(self) -> torch.Tensor:
        return self._all()[0]

    def candidate_parents(self) -> torch.Tensor:
        """Parent candidate index of each candidate (-1: child of the root)."""
        return self._all()[2]

    def candidate_depths(self) -> torch.Tensor:
        return self._all()[3]

    def level_candidates(self, levels: int) -> int:
        """Number of candidates in levels ``1..levels`` (they are stored first, level by level)."""
        return sum(t.numel() for t in self._tokens[:max(0, int(levels))])

    def top_candidates(self, v: int, levels: int | None = None) -> torch.Tensor:
        """Ascending indices of the top-``v`` candidates by cumulative score, among the candidates of
        levels ``1..levels`` (default: all levels); the rule of :meth:`select`."""
        scores = self._all()[1]
        if levels is not None:
            scores = scores[:self.level_candidates(levels)]
        v = max(0, min(int(v), scores.numel()))
        return torch.sort(scores, descending=True, stable=True).indices[:v].sort().values

    def select(self, v: int, levels: int | None = None) -> VerifyTree:
        """Keep the top-``v`` candidates by cumulative score (``v`` is clamped to the candidate count).
        ``levels`` restricts the choice to levels ``1..levels`` (the tree drafting would have verified
        had it stopped at that depth).

        The sort is stable and candidates are stored level by level, so on exact score ties a parent
        (earlier index) always outranks its child and the kept set is always a tree.
        """
        return self.tree_of(self.top_candidates(v, levels))

    def tree_of(self, sel: torch.Tensor) -> VerifyTree:
        """The :class:`VerifyTree` of the candidates ``sel`` (ascending indices, closed under parents)."""
        tokens, scores, parents, depth = self._all()
        dev = scores.device
        v = int(sel.numel())
        node_of = torch.full((scores.numel(),), -1, dtype=torch.long, device=dev)
        node_of[sel] = torch.arange(1, v + 1, device=dev)
        par_c = parents[sel]
        node_par = torch.where(par_c < 0, torch.zeros_like(par_c), node_of[par_c.clamp(min=0)])
        # cannot fail with the stable sort; checked without waiting for an accelerator
        torch._assert_async((node_par >= 0).all(), "selected draft nodes do not form a tree")
        root = torch.tensor([self.root], dtype=torch.long, device=dev)
        all_tokens = torch.cat([root, tokens[sel]])
        all_par = torch.cat([torch.tensor([-1], device=dev), node_par])
        all_depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), depth[sel]])
        return VerifyTree(all_tokens, all_par, all_depth, self.context_len + all_depth,
                          ancestor_mask(all_par, all_depth, len(self._tokens)))  # candidates of level d: depth d


def chain_walk(tree: VerifyTree, chain: Sequence[int]) -> list[int]:
    """The nodes of ``tree`` down ``chain``'s tokens from the root (the root first; at each node the first child with
    the next token), as far as the tree holds them."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child: dict[tuple[int, int], int] = {}
    for node in range(len(tokens) - 1, 0, -1):  # the first child with a token wins
        child[(parents[node], tokens[node])] = node
    path = [0]
    for t in chain:
        nxt = child.get((path[-1], int(t)))
        if nxt is None:
            break
        path.append(nxt)
    return path


def add_chain(tree: VerifyTree, chain: Sequence[int]) -> tuple[VerifyTree, int]:
    """``tree`` with ``chain`` as one more root-to-leaf path: the chain walks down the nodes whose tokens it
    shares (a child with the same token, the first such child), then its remaining tokens become new nodes
    (appended: the order stays topological). Returns the tree and the number of nodes added."""
    if not chain:
        return tree, 0
    path = chain_walk(tree, chain)
    cur, k = path[-1], len(path) - 1
    rest = [int(t) for t in chain[k:]]
    if not rest:
        return tree, 0
    dev, n = tree.tokens.device, tree.tokens.numel()
    start = int(tree.depth[cur])
    new_par = torch.tensor([cur] + list(range(n, n + len(rest) - 1)), dtype=torch.long, device=dev)
    new_depth = torch.arange(start + 1, start + 1 + len(rest), dtype=torch.long, device=dev)
    parents_t = torch.cat([tree.parents, new_par])
    depth_t = torch.cat([tree.depth, new_depth])
    m = len(rest)
    mask = torch.zeros(n + m, n + m, dtype=torch.bool, device=dev)
    mask[:n, :n] = tree.mask
    mask[n:, :n] = tree.mask[cur]  # the chain's new nodes see the shared path ...
    mask[n:, n:] = torch.ones(m, m, dtype=torch.bool, device=dev).tril()  # ... and their own chain
    base = tree.positions[0] - tree.depth[0]
    return VerifyTree(torch.cat([tree.tokens, torch.tensor(rest, dtype=torch.long, device=dev)]), parents_t,
                      depth_t, base + depth_t, mask), m


def is_chain(tree: VerifyTree) -> bool:
    """Every node's parent is the node before it: the tree is one path and a causal mask is its tree mask."""
    n = tree.tokens.numel()
    return bool((tree.parents[1:] == torch.arange(n - 1, device=tree.parents.device)).all()) if n > 1 else True


def root_only_tree(root: int, context_len: int, device="cpu") -> VerifyTree:
    """The degenerate tree of autoregressive decoding: the root alone."""
    z = torch.zeros(1, dtype=torch.long, device=device)
    return VerifyTree(torch.tensor([root], device=device), z - 1, z, z + context_len,
                      torch.ones(1, 1, dtype=torch.bool, device=device))
