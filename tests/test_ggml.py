"""The llama.cpp backend (``weights="ggml"``, :mod:`adaptree.models.ggml`): how a tree runs in one batch (fast, no
llama.cpp needed), and on the real default model through libllama: the taps are the PyTorch target's features, a
kept path leaves the cells as one-token steps would, every method's greedy text is llama.cpp AR's and AR's is
llama.cpp's own loop's; where it cannot run, one line says why and PyTorch runs. The libllama tests skip without
llama-cpp-python (``bash scripts/setup.sh --llama-cpp``)."""

from __future__ import annotations

import pytest
import torch

from adaptree.models.ggml import _tree_layout, ggml_available

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


def test_a_tree_with_a_node_of_two_parents_is_refused_by_its_mask_shape():
    with pytest.raises(ValueError, match="new tokens only"):
        _tree_layout(torch.ones(3, 5, dtype=torch.bool))


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
        assert torch.equal(tree.logits[0, i], step.logits[0, 0]) and torch.equal(tree.features[0, i], step.features[0, 0])


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
    from adaptree.models import default_model_path
    from adaptree.models import ggml

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
