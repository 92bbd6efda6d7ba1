"""Tiny random models shared by the fast tests."""

from __future__ import annotations

import os

import pytest
import torch

# The suite never measures the machine on its own (adaptree.load and the CLI would on a first use): tests that
# exercise the machine setup turn it on explicitly, with a cache folder of their own. Subprocesses inherit this.
os.environ["ADAPTREE_ADAPT"] = "0"

from adaptree.core.tree import DraftStep, DraftTree
from adaptree.models.config import ModelConfig
from adaptree.models.eagle3 import Eagle3Head
from adaptree.models.llama import ForwardOutput, Transformer
from adaptree.offline.traces import TraceSettings

PROMPTS = [[1, 5, 3], [2], [7, 7, 7, 7, 1, 0, 9], [4, 11, 2, 8, 15, 3, 6, 1, 12, 13, 5]]
"""Prompts for the tiny models (16-token vocabulary) shared by the engine, trace and oracle tests."""

N_NEW = 30
"""New tokens per prompt in the trace and oracle tests."""

TRACE_SETTINGS = TraceSettings(widths=(3, 8, 10), max_depth=12, max_new_tokens=N_NEW, feature_dtype="float32")
"""Greedy traces of the trace and oracle tests: three widths, depth up to 12."""


def tiny_target(vocab: int = 16, seed: int = 0, layers: int = 4, dtype=torch.float32) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, eos_token_id=[])
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger logits than the default init: a peakier, more "decisive" model
        model.lm_head.weight.mul_(40.0)
    return model.to(dtype)


def tiny_head(target: Transformer, draft_vocab: int | None = None, seed: int = 1) -> Eagle3Head:
    vocab = target.config.vocab_size
    counts = torch.arange(vocab, 0, -1).float()  # lower ids more frequent
    return Eagle3Head.init_for_target(target, draft_vocab or vocab, counts, seed=seed).eval()


def open_tree(target: Transformer, head: Eagle3Head, prompt: list[int], width: int, *, cache=None,
              head_cache: int = 128) -> tuple[DraftTree, DraftStep, ForwardOutput]:
    """How every draft opens: the target's forward over ``prompt`` (into its ``cache`` when given), its greedy next
    token as the root of a :class:`DraftTree` of ``width`` (in a fresh head cache of ``head_cache`` positions) and
    the tree's first level. Returns the tree, that first step and the target's output; call it under no_grad."""
    out = target(torch.tensor([prompt]), cache=cache, features=True)
    root = int(out.logits[0, -1].argmax())
    tree = DraftTree(head, head.new_cache(head_cache), width, root, len(prompt))
    return tree, tree.first_step(out.features, torch.tensor([prompt[1:] + [root]])), out


def tiny_prompt_items(n_train: int, n_val: int, seed: int, vocab: int = 48):
    """ShareGPT-like items for head-training runs on a tiny target: ``n_train`` then ``n_val`` one-turn conversations,
    and the random prompt ids (3-10 of ``vocab``) each stands for; pass ``lambda it: prompts[it.id]`` as
    ``train_head``'s ``prompt_ids_fn``. Returns ``(items, prompts)``."""
    import random

    from adaptree.head_training.corpus import ConversationItem

    rng = random.Random(seed)
    items, prompts = [], {}
    for i in range(n_train + n_val):
        iid = f"p{seed}-{i}"
        prompts[iid] = [rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
        items.append(ConversationItem(iid, [{"role": "user", "content": iid}], "train" if i < n_train else "val"))
    return items, prompts


def tiny_train_cfg(out, **kw):
    """The head-training settings of the tiny runs (24 prompts, 40 new tokens, a 40-token draft vocabulary), with
    ``kw`` overriding any of them."""
    from adaptree.head_training import TrainHeadConfig

    base = dict(out=str(out), num_prompts=24, max_len=64, max_new_tokens=40, gen_batch_size=16, draft_vocab=40,
                epochs=2, ttt_steps=3, batch_tokens=256, lr=3e-3, val_every=1000, ckpt_every=5, log_every=1,
                seed=0, target_dtype="float32")
    base.update(kw)
    return TrainHeadConfig(**base)


TINY_THREADS = int(os.environ.get("ADAPTREE_TEST_THREADS") or 1)
"""Torch threads of the tests on tiny models: 1 (they run faster so: no spin-waiting on a shared 2-core
machine) unless ADAPTREE_TEST_THREADS says otherwise (docs/testing.md: the suite at other thread counts)."""


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run on TINY_THREADS threads; the slow end-to-end tests on the real model keep torch's
    default (OMP_NUM_THREADS sets it)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)
    yield
    torch.set_num_threads(before)


def record_tiny_traces(models, settings, prompts=PROMPTS, tag: str = "p") -> list:
    """The traces of ``prompts`` on ``models`` with ``settings`` (keys ``tag`` + 0, 1, ...), recorded on TINY_THREADS
    (a module-scoped fixture runs outside the per-test thread setting)."""
    from adaptree.offline.traces import record_trace

    target, head = models
    before = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)
    try:
        return [record_trace(target, head, p, settings=settings, key=f"{tag}{i}") for i, p in enumerate(prompts)]
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    """A tiny target and its head (12-token draft vocabulary), shared by a test module, on TINY_THREADS."""
    before = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)
    target = tiny_target()
    yield target, tiny_head(target, draft_vocab=12)
    torch.set_num_threads(before)


@pytest.fixture
def tiny_pair():
    target = tiny_target()
    return target, tiny_head(target, draft_vocab=12)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny Hugging Face llama folder (256-token context, a word-level tokenizer with a chat template) and a
    float32 EAGLE-3 head folder for it that holds no policies and no tuned tree, made once per test module."""
    from test_models import save_hf  # not at the top: test_models imports this module

    from adaptree.models import load_target

    root = tmp_path_factory.mktemp("tiny")
    model = save_hf("llama", root / "model")
    target, _ = load_target(model)
    tiny_head(target, seed=3).save_pretrained(root / "head", dtype=torch.float32)
    return model, root / "head"


class ToyTokenizer:
    """A tokenizer for text prompts on the tiny folders' model: every id decodes to visible text (the tiny random
    model emits ids the saved word-level vocabulary lacks)."""

    chat_template = "toy"
    eos_token_ids: list[int] = []  # a random model may emit any id first: these tests are about cycles, not stops

    def encode(self, text: str) -> list[int]:
        return [3 + len(w) % 13 for w in text.split()]

    def apply_chat(self, messages) -> list[int]:
        return [1] + [i for m in messages for i in self.encode(m["content"])]

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids)
