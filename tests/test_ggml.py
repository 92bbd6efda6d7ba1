"""The llama.cpp backend (``weights="ggml"``, :mod:`adaptree.models.ggml`): how a tree runs in one batch (fast, no
llama.cpp needed), and on the real default model through libllama: the taps are the PyTorch target's features, a
kept path leaves the cells as one-token steps would, every method's greedy text is llama.cpp AR's and AR's is
llama.cpp's own loop's; where it cannot run, one line says why and PyTorch runs. The libllama tests skip without
llama-cpp-python (``bash scripts/setup.sh`` builds it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaptree.models.ggml import _anonymous_ranges, _loaded_ranges, _subtract, _tree_layout, ggml_available

needs_ggml = pytest.mark.skipif(ggml_available() is not None, reason=str(ggml_available()))

QUESTIONS = ["Explain what a KV cache is in two sentences.",
             "Write a Python function that returns the n-th Fibonacci number.",
             "Name three prime numbers and say why they are prime."]


def _mask(parents: list[int]) -> torch.Tensor:
    """The ancestor mask of a tree given by each node's parent (-1: the root)."""
    t = len(parents)
    m = torch.eye(t, dtype=torch.bool)
    for i in range(t):
        j = parents[i]
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 0, 2, 2, 5, 1]])
def test_a_tree_runs_parents_first_with_a_sequence_per_leaf(parents):
    order, first, seqs, leaf_of, leaves = _tree_layout(_mask(parents))
    t = len(parents)
    assert sorted(order) == list(range(t))
    assert all(order.index(parents[i]) < order.index(i) for i in range(1, t))  # parents before children
    assert order[:len(first)] == first and first[0] == 0  # the first path runs first
    assert all(parents[b] == a for a, b in zip(first, first[1:]))
    kids = {i: [j for j in range(t) if parents[j] == i] for i in range(t)}
    assert not kids[first[-1]] and all(kids[a][0] == b for a, b in zip(first, first[1:]))
    leaf_ids = [i for i in range(t) if not kids[i]]
    assert leaves == len(leaf_ids)
    m = _mask(parents)
    for j in range(t):  # node j is in leaf k's sequence iff it is an ancestor of (or is) that leaf
        assert seqs[j] == [k + 1 for k, leaf in enumerate(leaf_ids) if m[leaf, j]]
        assert leaf_of[j] == seqs[j][0]


def test_subtracting_address_ranges_keeps_exactly_the_uncovered_bytes():
    rng = np.random.default_rng(0)
    for _ in range(500):
        pts = np.sort(rng.choice(200, 10, replace=False)).tolist()
        old = [(pts[i], pts[i + 1]) for i in range(0, 10, 2)]
        a, b = np.sort(rng.choice(200, 2, replace=False)).tolist()
        old.append((a, b))  # one that may overlap the others (an old heap and the heap now)
        cut = np.sort(rng.choice(200, 4, replace=False)).tolist()
        ranges = [(cut[0], cut[1]), (cut[2], cut[3])]
        got = _subtract(ranges, old)
        want = {x for a, b in ranges for x in range(a, b)} - {x for a, b in old for x in range(a, b)}
        assert all(b > a for a, b in got)
        assert sorted(x for a, b in got for x in range(a, b)) == sorted(want)


@pytest.mark.skipif(not _anonymous_ranges(), reason="no /proc/self/maps")
def test_memory_allocated_after_a_snapshot_is_among_the_ranges_to_collapse():
    before = _anonymous_ranges()
    block = np.ones(48 << 20, dtype=np.uint8)  # above glibc's largest mmap threshold: a mapping of its own
    addr = block.ctypes.data
    ranges = _loaded_ranges(before)
    end = addr + block.nbytes  # one allocation can show as neighbouring mappings (numpy advises huge pages itself)
    assert sum(max(0, min(b, end) - max(a, addr)) for a, b in ranges) == block.nbytes
    heap = _anonymous_ranges(heap_only=True)
    kept = [r for r in before if r in _anonymous_ranges() and r not in heap]  # mappings older than the snapshot
    assert not any(a < y and x < b for a, b in _subtract(ranges, heap) for x, y in kept)


def test_a_mask_over_more_than_the_new_tokens_is_refused():
    with pytest.raises(ValueError, match="new tokens only"):
        _tree_layout(torch.ones(3, 5, dtype=torch.bool))


# -- on libllama, a tiny random GGUF (fast) ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ggml(tmp_path_factory):
    """The tiny Q4_1 GGUF of the quantization tests on llama.cpp, with a tiny random head."""
    from conftest import tiny_head
    from test_registry import write_tiny_gguf

    from adaptree.core.engine import Engine
    from adaptree.models.ggml import load_ggml

    target, _ = load_ggml(write_tiny_gguf(tmp_path_factory.mktemp("ggml") / "tiny.gguf", seed=5), torch.float32)
    return Engine(target, tiny_head(target, draft_vocab=64))


@needs_ggml
def test_tiny_trees_and_chains_on_llama_cpp_keep_ar_greedy_text(tiny_ggml):
    from conftest import PROMPTS

    from adaptree.methods import StaticConfig, StaticController

    eng = tiny_ggml
    for prompt in PROMPTS:
        ar = eng.generate(prompt, None, max_new_tokens=24)
        for cfg in (StaticConfig(width=1, depth=4, size=4), StaticConfig(width=3, depth=4, size=8),
                    StaticConfig(width=10, depth=8, size=70)):  # a chain, a tree, a tree verified in two pieces
            assert eng.generate(prompt, StaticController(cfg), max_new_tokens=24).token_ids == ar.token_ids, cfg


@needs_ggml
def test_tiny_speculative_sampling_on_llama_cpp_matches_the_targets_distribution(tiny_ggml):
    """Tokens 1 (the prompt's) and 2 (the first tree's, by rejection sampling over llama.cpp's logits) are drawn from
    the target's joint distribution: a chi-square test over the cells with 5 expected draws or more."""
    from scipy.stats import chisquare

    from adaptree.core.verify import SamplingConfig, warp_probs
    from adaptree.methods import StaticConfig, StaticController

    eng, prompt, n = tiny_ggml, [1, 2, 3], 2500
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20)
    target, vocab = eng.target, eng.target.config.vocab_size
    cache = target.new_cache(8)
    p1 = warp_probs(target(torch.tensor([prompt]), cache=cache).logits[0, -1], cfg)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for a in torch.nonzero(p1).flatten().tolist():
        cache.length = len(prompt)
        joint[a] = float(p1[a]) * warp_probs(target(torch.tensor([[a]]), cache=cache).logits[0, -1], cfg).double()
    counts = torch.zeros_like(joint)
    ctl = StaticController(StaticConfig(3, 3, 8))
    for i in range(n):
        out = eng.generate(prompt, ctl, max_new_tokens=2,
                           sampling=SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=10_000 + i))
        counts[out.token_ids[0], out.token_ids[1]] += 1
    exp = joint.flatten() * n
    keep = exp >= 5
    obs, exp = counts.flatten()[keep], exp[keep]
    assert int(keep.sum()) >= 10 and float(obs.sum()) > 0.5 * n
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-3


# -- on libllama, the real default model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ggml_pipeline():
    import adaptree
    from adaptree.models import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return adaptree.load(None, dtype="float32", weights="ggml", adapt=False, compile="off")


def _prompt(p, q: str) -> list[int]:
    return p.encode([{"role": "user", "content": q}])


@pytest.mark.slow
@needs_ggml
def test_the_taps_are_the_pytorch_targets_features(ggml_pipeline):
    """Layer inputs 2, L/2, L-3 from libllama are the outputs of layers 1, L/2-1, L-4 that the head was trained on:
    the same vectors up to the two kernels' rounding (ggml quantizes activations to 8 bits)."""
    from adaptree.models import load_model

    p = ggml_pipeline
    ref, _ = load_model(None, torch.float32)
    x = torch.tensor([_prompt(p, QUESTIONS[0])])
    got = p.target(x, cache=p.target.new_cache(256), features=True, logits_at=slice(-1, None))
    want = ref(x, cache=ref.new_cache(256), features=True, logits_at=slice(-1, None))
    h = ref.config.hidden_size
    for i in range(3):
        cos = torch.nn.functional.cosine_similarity(got.features[0, :, i * h:(i + 1) * h],
                                                    want.features[0, :, i * h:(i + 1) * h], dim=-1)
        assert float(cos.min()) > 0.99, (i, float(cos.min()))
    assert int(got.logits[0, -1].argmax()) == int(want.logits[0, -1].argmax())


@pytest.mark.slow
@needs_ggml
@pytest.mark.parametrize("path", [[0, 1, 3], [0, 2]])
def test_a_kept_path_leaves_the_cells_as_one_token_steps_would(ggml_pipeline, path):
    """The first path of a tree is kept in place; another one is dropped and run again in front of the next forward
    (``rerun``). Either way the next step's logits are the one-token steps' bit for bit (a short context: one-token
    steps over fewer than 512 cells)."""
    p = ggml_pipeline
    target, ids = p.target, _prompt(p, QUESTIONS[1])
    L = len(ids)
    tokens, parents = [5, 17, 99, 7], [-1, 0, 0, 1]
    depth = torch.tensor([0, 1, 1, 2])

    cache = target.new_cache(256)
    target(torch.tensor([ids]), cache=cache, logits_at=slice(-1, None))
    tree = target(torch.tensor([tokens]), position_ids=L + depth, cache=cache, tree_mask=_mask(parents),
                  features=True)
    cache.compact(L, torch.tensor(path))
    assert cache.length == L + len(path) and cache.rerun == (0 if path == [0, 1, 3] else len(path))
    got = target(torch.tensor([[42]]), cache=cache, features=True)

    ref = target.new_cache(256)
    target(torch.tensor([ids]), cache=ref, logits_at=slice(-1, None))
    steps = [target(torch.tensor([[tokens[i]]]), cache=ref, features=True) for i in path]
    want = target(torch.tensor([[42]]), cache=ref, features=True)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.features, want.features)
    # and each kept node's verified row is the one-token step's
    for i, step in zip(path, steps):
        assert torch.equal(tree.logits[0, i], step.logits[0, 0])
        assert torch.equal(tree.features[0, i], step.features[0, 0])


@pytest.mark.slow
@needs_ggml
def test_every_method_keeps_llama_cpp_ars_greedy_text(ggml_pipeline):
    """Trees by sequence ids, chains, the head fed from the taps: every method's greedy text is AR's on the same
    llama.cpp target (contexts under 256 tokens, where a verified row and a one-token step are computed alike)."""
    p = ggml_pipeline
    methods = ("static", "deagle", "ltd", "radar", "resps", "ngram", "svip", "ddd", "gammatune")
    for q in QUESTIONS:
        ids = _prompt(p, q)
        ar = p.engine.generate(ids, None, max_new_tokens=48)
        for m in methods:
            out = p.engine.generate(ids, p.controller(m), max_new_tokens=48)
            assert out.token_ids == ar.token_ids, (m, q)
            if m == "static":
                assert max(c.size for c in out.cycles) >= 30  # 60-node trees: verified in pieces of 63 rows
    assert p.engine.cache.rerun > 0  # some kept paths were not their tree's first


@pytest.mark.slow
@needs_ggml
def test_adaptrees_ar_on_ggml_is_llama_cpps_own_greedy_loop(ggml_pipeline):
    from adaptree.bench.llama_cpp_arm import LlamaCppLoop
    from adaptree.core.verify import SamplingConfig
    from adaptree.models import default_model_path

    p = ggml_pipeline
    loop = LlamaCppLoop(default_model_path(), eos_token_ids=p.tokenizer.eos_token_ids, n_ctx=1024)
    for q in QUESTIONS[:2]:
        ids = _prompt(p, q)
        assert loop(ids, 48, SamplingConfig()).token_ids == p.engine.generate(ids, None, max_new_tokens=48).token_ids
    with pytest.raises(ValueError, match="greedily only"):
        loop(ids, 4, SamplingConfig(temperature=0.7))


@pytest.mark.slow
@needs_ggml
def test_requantized_files_are_made_once_and_run(tmp_path, monkeypatch):
    import adaptree
    from adaptree.models import default_model_path
    from adaptree.models.ggml import requantized

    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path))
    first = requantized(default_model_path(), "q4_0")
    stamp = first.stat().st_mtime_ns
    assert requantized(default_model_path(), "q4_0") == first and first.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="q3_k"):
        requantized(default_model_path(), "q3_k")
    p = adaptree.load(None, head=None, dtype="float32", weights="ggml-q4_0", adapt=False, compile="off")
    assert p.execution == "float32+ggml-q4_0" and p.target.path == first
    out = p.engine.generate(_prompt(p, QUESTIONS[2]), None, max_new_tokens=16)
    assert len(out.token_ids) == 16 or out.stop_reason == "eos"


@pytest.mark.slow
def test_where_llama_cpp_cannot_run_one_line_says_why_and_pytorch_runs(monkeypatch, capsys):
    import adaptree
    from adaptree.models import default_model_path, ggml

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(ggml, "ggml_available", lambda: "this libllama lacks llama_set_embeddings_layer_inp")
    p = adaptree.load(None, head=None, dtype="float32", weights="ggml", adapt=False, compile="off")
    err = capsys.readouterr().err
    assert p.weights == "float" and p.target.backend == "torch"
    assert err.count("llama.cpp backend cannot run") == 1 and "llama_set_embeddings_layer_inp" in err
    from adaptree.adapt.execution import execution_candidates

    assert not any("ggml" in m for m in execution_candidates(None))  # nor does auto measure it


@needs_ggml
def test_a_gguf_of_an_architecture_adaptree_cannot_run_is_refused_by_name(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    from adaptree.models.ggml import GgmlUnavailable, load_ggml

    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GgmlUnavailable, match="mamba"):
        load_ggml(path)
