"""The committed self-distilled corpus: chunks of token ids, checksums, settings, resumption, training on it."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import torch
import pytest
from conftest import tiny_target

from adaptree.core.engine import Engine
from adaptree.head_training.chunked import ChunkedCorpus, CorpusSettings, read_corpora
from adaptree.head_training.corpus import ConversationItem, TokenSequence
from adaptree.head_training.features import target_fingerprint
from adaptree.methods import make_controller


def _setup(n_train=10, n_val=3, seed=0):
    target = tiny_target(vocab=32, seed=4)
    rng = random.Random(seed)
    prompts = {f"q{i}": [rng.randrange(32) for _ in range(rng.randint(2, 9))] for i in range(n_train + n_val)}
    items = [ConversationItem(k, [{"role": "user", "content": k}], "val" if i >= n_train else "train")
             for i, k in enumerate(prompts)]
    train = [it for it in items if it.split == "train"]
    val = [it for it in items if it.split == "val"]
    return target, prompts, (train, val)


def _grow(folder, settings, chunks, target, prompts, items, **kw):
    return ChunkedCorpus(folder).grow(settings, chunks, target, None, fingerprint=target_fingerprint(target, "tiny"),
                                      items=items, prompt_ids_fn=lambda it: prompts[it.id], **kw)


def test_chunks_hold_the_targets_greedy_answers_and_grow_across_runs(tmp_path):
    target, prompts, items = _setup()
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=12, chunk_prompts=4, val_prompts=3,
                       gen_batch_size=3, target_dtype="float32")
    totals = _grow(tmp_path, s, 1, target, prompts, items)
    assert totals["train"]["chunks"] == 1 and totals["val"]["chunks"] == 1
    _grow(tmp_path, s, 2, target, prompts, items)  # a later session adds a chunk
    corpus = ChunkedCorpus(tmp_path)
    assert [c["file"] for c in corpus.chunks()] == ["val-00000.npz", "train-00000.npz", "train-00001.npz"]
    assert [c["prompts"] for c in corpus.chunks("train")] == [[0, 4], [4, 8]]
    assert not (tmp_path / ".work").exists()
    seqs = corpus.read()
    train_ids = [it.id for it in items[0][:8]]
    assert [x.id for x in seqs if x.split == "train"] == train_ids
    assert sorted(x.id for x in seqs if x.split == "val") == sorted(it.id for it in items[1])
    eng = Engine(target)
    for x in seqs:
        p = prompts[x.id]
        ref = eng.generate(p, make_controller("ar"), max_new_tokens=12).token_ids
        assert x.input_ids == p + ref and x.loss_mask == [0] * len(p) + [1] * len(ref)
    with np.load(tmp_path / "train-00000.npz", allow_pickle=False) as z:
        assert z["tokens"].dtype == np.uint16 and set(z.files) == {"ids", "prompt_len", "response_len", "tokens"}
    # only the first chunk, and two corpora (ids tagged per folder, validation from the first only)
    assert len([x for x in corpus.read(max_chunks=1) if x.split == "train"]) == 4
    other = tmp_path.parent / (tmp_path.name + "-sampled")
    shutil.copytree(tmp_path, other)
    both = read_corpora(f"{tmp_path},{other}")
    assert len(both) == len(seqs) + 8 and len({x.id for x in both}) == len(both)


def test_settings_target_and_checksums_are_enforced(tmp_path):
    target, prompts, items = _setup()
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=6, chunk_prompts=4, val_prompts=2,
                       gen_batch_size=4, target_dtype="float32")
    _grow(tmp_path, s, 1, target, prompts, items)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _grow(tmp_path, CorpusSettings(**{**json.loads((tmp_path / "manifest.json").read_text())["settings"],
                                         "max_new_tokens": 7}), 2, target, prompts, items)
    with pytest.raises(ValueError, match="another target"):
        _grow(tmp_path, s, 2, tiny_target(vocab=32, seed=5), prompts, items)
    with pytest.raises(ValueError, match="training prompts"):
        _grow(tmp_path, s, 5, target, prompts, items)
    raw = bytearray((tmp_path / "train-00000.npz").read_bytes())
    raw[-30] ^= 0xFF
    (tmp_path / "train-00000.npz").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="SHA-256"):
        ChunkedCorpus(tmp_path).read()
    with pytest.raises(ValueError, match="chunk_prompts"):
        CorpusSettings(chunk_prompts=0)
    with pytest.raises(FileNotFoundError, match="corpus grow"):
        read_corpora(str(tmp_path / "nothing"))


def test_an_interrupted_stream_resumes_from_its_parts(tmp_path, monkeypatch):
    from adaptree.head_training import chunked

    target, prompts, items = _setup()
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=6, chunk_prompts=4, val_prompts=2,
                       gen_batch_size=3, target_dtype="float32")
    real = chunked.build_corpus

    def dies_after_one_part(*a, **kw):
        real(*a, **{**kw, "limit": 3})  # three answers (one part), then a kill
        raise KeyboardInterrupt

    monkeypatch.setattr(chunked, "build_corpus", dies_after_one_part)
    with pytest.raises(KeyboardInterrupt):
        _grow(tmp_path, s, 2, target, prompts, items)
    assert len(list((tmp_path / ".work" / "stream").glob("part-*.jsonl"))) == 1
    assert not ChunkedCorpus(tmp_path).chunks("train")
    left = ChunkedCorpus(tmp_path).pending()  # the three answers but those of chunks packed (the held-out one)
    assert left["answers"] == 3 - len(ChunkedCorpus(tmp_path).read()) > 0 and left["dtype"] == "float32"
    # the folder as a commit carries it to another machine, .work included: continued there, the same chunks
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    shutil.copytree(tmp_path, elsewhere)
    monkeypatch.setattr(chunked, "build_corpus", real)
    _grow(tmp_path, s, 2, target, prompts, items)
    corpus = ChunkedCorpus(tmp_path)
    assert [x.id for x in corpus.read("train")] == [it.id for it in items[0][:8]]
    assert [c["file"] for c in corpus.chunks()] == ["val-00000.npz", "train-00000.npz", "train-00001.npz"]
    assert sum(c["generation_seconds"] for c in corpus.chunks()) > 0 and not (tmp_path / ".work").exists()
    assert corpus.pending() is None
    _grow(elsewhere, s, 2, target, prompts, items)
    assert ([(x.id, x.input_ids, x.loss_mask) for x in ChunkedCorpus(elsewhere).read()]
            == [(x.id, x.input_ids, x.loss_mask) for x in corpus.read()])


def test_pending_counts_only_the_answers_of_unpacked_chunks(tmp_path):
    target, prompts, items = _setup()
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=6, chunk_prompts=4, val_prompts=2,
                       gen_batch_size=4, target_dtype="float32")
    _grow(tmp_path, s, 1, target, prompts, items)
    corpus = ChunkedCorpus(tmp_path)
    assert corpus.pending() is None
    # a run of several chunks stopped after packing one: its answers stay in .work beside the unpacked ones
    (corpus.work / "stream").mkdir(parents=True)
    unpacked = TokenSequence("q9", [1, 2, 3, 4], [0, 0, 1, 1], "train")
    (corpus.work / "stream" / "part-00000.jsonl").write_text(
        "".join(x.to_json() + "\n" for x in [*corpus.read("train"), unpacked]))
    (corpus.work / "dtype.json").write_text(json.dumps({"dtype": "float32"}))
    assert corpus.pending() == {"answers": 1, "response_tokens": 2, "dtype": "float32"}


def test_train_head_on_a_committed_corpus(tmp_path):
    from adaptree.head_training.trainer import TrainHeadConfig, train_head

    target, prompts, items = _setup(n_train=12, n_val=3)
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=10, chunk_prompts=6, val_prompts=3,
                       gen_batch_size=6, target_dtype="float32")
    _grow(tmp_path / "c", s, 2, target, prompts, items)
    cfg = TrainHeadConfig(out=str(tmp_path / "run"), corpus=str(tmp_path / "c"), corpus_chunks=1, max_len=40,
                          batch_tokens=64, draft_vocab=16, epochs=1, ttt_steps=2, val_steps=2, target_dtype="float32",
                          train_dtype="float32", val_every=1000)
    res = train_head(cfg, target=target, model_name="tiny")
    data = res.summary["data"]
    assert data["train_sequences"] == 6 and data["val_sequences"] == 3
    assert res.summary["validation"]["final"]["step_acc"]
    # two runs sharing one feature store: the second extracts only the sequences the first did not need
    from adaptree.head_training.features import FeatureStore

    shared = tmp_path / "features"
    for chunks, name in ((1, "a"), (2, "b")):
        run = train_head(TrainHeadConfig(**{**cfg.__dict__, "out": str(tmp_path / name), "corpus_chunks": chunks,
                                            "features": str(shared)}), target=target, model_name="tiny")
        assert run.summary["data"]["train_sequences"] == 6 * chunks
        assert len(FeatureStore(shared)) == 6 * chunks + 3
    assert not (tmp_path / "b" / "features").exists()


def test_the_exported_head_is_the_best_validated_one(tmp_path):
    from safetensors.torch import load_file

    from adaptree.head_training.trainer import TrainHeadConfig, train_head

    target, prompts, items = _setup(n_train=12, n_val=3)
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=10, chunk_prompts=12, val_prompts=3,
                       gen_batch_size=6, target_dtype="float32")
    _grow(tmp_path / "c", s, 1, target, prompts, items)
    common = dict(corpus=str(tmp_path / "c"), max_len=40, batch_tokens=40, draft_vocab=16, epochs=3, ttt_steps=2,
                  val_steps=2, target_dtype="float32", train_dtype="float32", val_every=2, lr=3e-2)
    by = {}
    for select in ("chain_tau", "step0", "last"):
        res = train_head(TrainHeadConfig(out=str(tmp_path / select), select=select, **common), target=target,
                         model_name="tiny")
        hist, sel = res.summary["validation"]["history"], res.summary["validation"]["selected"]
        assert len(hist) > 3
        if select == "last":
            assert sel == {"by": "last", "step": hist[-1]["step"]}
        else:
            metric = (lambda v: v["chain_tau"]) if select == "chain_tau" else (lambda v: v["step_acc"][0])
            best = max(hist, key=metric)
            assert sel["by"] == select and metric(next(h for h in hist if h["step"] == sel["step"])) == metric(best)
            assert res.summary["validation"]["final"]["step"] == sel["step"]
        by[select] = (sel["step"], load_file(str(res.export / "model.safetensors")))
    # the runs are identical up to the choice: the exported weights are the last ones iff chosen at the last step
    last_step, last = by["last"]
    for select in ("chain_tau", "step0"):
        step, weights = by[select]
        same = all(torch.equal(last[k], weights[k]) for k in last)
        assert same == (step == last_step), (select, step, last_step)


def test_a_sharegpt_corpus_keeps_every_assistant_turn(tmp_path):
    from adaptree.head_training.chunked import pack_chunk, unpack_chunk
    from adaptree.head_training.corpus import TokenSequence

    seqs = [TokenSequence("a", [1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 0, 0, 1, 1], "train"),
            TokenSequence("b", [8, 9, 10], [0, 0, 1], "train"), TokenSequence("c", [], [], "train"),
            TokenSequence("d", [70_000, 1], [0, 1], "train")]
    pack_chunk(tmp_path / "x.npz", seqs, vocab_size=80_000)
    back = unpack_chunk(tmp_path / "x.npz", "train")
    assert back == [seqs[0], seqs[1], seqs[3]]
    with pytest.raises(ValueError, match="source"):
        CorpusSettings(source="web")


def test_corpus_cli_info_and_errors(tmp_path, capsys):
    from adaptree import cli

    target, prompts, items = _setup()
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=6, chunk_prompts=4, val_prompts=2,
                       gen_batch_size=4, target_dtype="float32")
    _grow(tmp_path / "c", s, 1, target, prompts, items)
    capsys.readouterr()
    assert cli.main(["corpus", "info", str(tmp_path / "c")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["settings"]["chunk_prompts"] == 4 and info["totals"]["train"]["chunks"] == 1
    assert info["pending"] is None
    assert cli.main(["corpus", "info", str(tmp_path / "missing")]) != 0
    assert cli.main(["corpus", "grow", "--out", str(tmp_path / "c"), "--chunks", "-1"]) != 0


def test_a_chunk_made_in_another_dtype_records_it_and_never_shares_a_chunk(tmp_path, monkeypatch):
    """A bfloat16 corpus continued in float32 (a CPU where bfloat16 is emulated): one fingerprint for the same
    weights, the new chunks' dtype in the manifest, and an interrupted run's answers never finished in another."""
    from adaptree.head_training import chunked

    _, prompts, items = _setup()
    f32 = tiny_target(vocab=32, seed=4)
    bf16 = tiny_target(vocab=32, seed=4).to(torch.bfloat16)  # the same weights, rounded
    assert target_fingerprint(f32, "tiny", torch.bfloat16) == target_fingerprint(bf16, "tiny")
    assert target_fingerprint(f32, "tiny") != target_fingerprint(bf16, "tiny")
    s = CorpusSettings(model="tiny", max_len=40, max_new_tokens=6, chunk_prompts=4, val_prompts=2,
                       gen_batch_size=3, target_dtype="bfloat16")

    def grow(model, chunks, dtype=None, **kw):
        return ChunkedCorpus(tmp_path).grow(s, chunks, model, None, dtype=dtype, items=items,
                                            fingerprint=target_fingerprint(model, "tiny", torch.bfloat16),
                                            prompt_ids_fn=lambda it: prompts[it.id], **kw)

    grow(bf16, 1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        grow(f32, 2, "float64")
    real = chunked.build_corpus

    def dies_after_one_part(*a, **kw):
        real(*a, **{**kw, "limit": 3})
        raise KeyboardInterrupt

    monkeypatch.setattr(chunked, "build_corpus", dies_after_one_part)
    with pytest.raises(KeyboardInterrupt):
        grow(f32, 2, "float32")
    monkeypatch.setattr(chunked, "build_corpus", real)
    with pytest.raises(ValueError, match="answers of an interrupted run in float32"):
        grow(bf16, 2)  # the corpus's own dtype may not finish float32 answers
    totals = grow(f32, 2, "float32")
    corpus = ChunkedCorpus(tmp_path)
    assert [corpus.chunk_dtype(c) for c in corpus.chunks()] == ["bfloat16", "bfloat16", "float32"]
    assert "target_dtype" not in corpus.chunks("train")[0] and corpus.chunks("train")[1]["target_dtype"] == "float32"
    assert totals["train"]["dtypes"] == {"bfloat16": 1, "float32": 1} and totals["val"]["dtypes"] == {"bfloat16": 1}
    eng = Engine(f32)
    for x in corpus.read("train")[4:]:  # the float32 chunk: the float32 target's greedy answers
        p = prompts[x.id]
        assert x.input_ids == p + eng.generate(p, make_controller("ar"), max_new_tokens=6).token_ids
    with pytest.raises(ValueError, match="another target"):  # other weights are refused in any dtype
        grow(tiny_target(vocab=32, seed=5), 3, "float32")


def test_corpus_grow_warns_where_its_dtype_is_emulated(monkeypatch):
    from adaptree.adapt import execution
    from adaptree.cli.head import emulated_dtype_warning

    monkeypatch.setattr(execution, "fallback_dtype", lambda device="cpu": "float32")  # no native bfloat16
    assert "--chunk-dtype float32" in emulated_dtype_warning("bfloat16", "cpu")
    assert emulated_dtype_warning("float32", "cpu") is None
    monkeypatch.setattr(execution, "fallback_dtype", lambda device="cpu": "bfloat16")  # AMX, AVX-512 BF16, a GPU
    assert emulated_dtype_warning("bfloat16", "cpu") is None
