"""The public API: load a model with its draft head once, then generate with any method.

    import adaptree
    p = adaptree.load()                                   # SmolLM2-135M-Instruct + the head adaptree ships
    out = p.generate("Name three primes.", method="ltd", max_new_tokens=32)
    print(out.text, out.tau, out.tokens_per_s)
    for piece in p.stream([{"role": "user", "content": "Hi!"}], method="static", max_new_tokens=32):
        print(piece, end="")

The command line, the benchmark and the trainers' commands all load models and build controllers here; the
measurements behind ``"auto"`` (execution mode, attention dtype, compiling, the machine setup) are
:mod:`adaptree.adapt`'s.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adaptree.adapt.attention import attention_dtype
from adaptree.adapt.cache import say
from adaptree.adapt.compile import COMPILE_MODES, compile_tokens
from adaptree.adapt.prefill import dense_prefill_rows
from adaptree.adapt.execution import (
    WEIGHTS,
    cached_execution,
    choose_execution,
    dtype_of,
    execution_candidates,
    execution_name,
    fallback_execution,
    parse_execution,
)
from adaptree.adapt.setup import AdaptConfig, AdaptError, MachineSetup, adapt_enabled, find_setup
from adaptree.adapt.setup import adapt as adapt_to_machine  # ``adapt`` is load's flag
from adaptree.core.controller import Controller
from adaptree.core.engine import Engine
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig
from adaptree.methods import make_controller
from adaptree.models.ggml import GgmlUnavailable

Messages = Sequence[dict[str, str]]
"""A conversation: ``[{"role": "user", "content": "..."}, ...]``."""


def _from_result(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.result, name), doc=doc)


@dataclass
class Generation:
    """What :meth:`Pipeline.generate` returns: the text, the ids and the engine's cycle records."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    result: GenerationResult = field(repr=False)
    """The engine's record: per-cycle :class:`~adaptree.core.records.CycleRecord` objects, timings, stop reason."""

    cycles = _from_result("cycles", "One record per draft-and-verify cycle.")
    tau = _from_result("tau", "Acceptance length: mean over cycles of (accepted draft tokens + 1).")
    tokens_per_s = _from_result("tokens_per_s", "New tokens per second of wall time (prefill included).")
    method = _from_result("method", "The controller's name.")
    stop_reason = _from_result("stop_reason", "eos, max_new_tokens or context_limit.")


class _Cancelled(Exception):
    """Raised from the streaming callback to end a generation whose consumer went away."""


class Stream:
    """An iterator over the text of a generation as it is produced (one piece per cycle, whole characters
    only); :attr:`generation` holds the :class:`Generation` once the iteration has finished. Closing it early
    (``close()``, or leaving a ``for`` loop) stops the generation at its next cycle."""

    def __init__(self, pipeline: Pipeline, ids: list[int], controller: Controller, max_new_tokens: int,
                 sampling: SamplingConfig) -> None:
        self.generation: Generation | None = None
        self._q: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._done = False
        from adaptree.core.text import TextAssembler

        def run() -> None:
            text = TextAssembler(pipeline.tokenizer)

            def on_tokens(new: list[int]) -> None:
                if self._cancel.is_set():
                    raise _Cancelled
                piece = text.add(new)
                if piece:
                    self._q.put(("text", piece))

            try:
                res = pipeline.engine.generate(ids, controller, max_new_tokens=max_new_tokens, sampling=sampling,
                                               on_tokens=on_tokens)
                final, piece = text.finish()
                if piece:
                    self._q.put(("text", piece))
                self._q.put(("done", Generation(final, res.token_ids, ids, res)))
            except _Cancelled:
                self._q.put(("cancelled", None))
            except BaseException as exc:  # handed to the consumer's thread
                self._q.put(("error", exc))

        self._thread = threading.Thread(target=run, name="adaptree-stream", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        kind, value = self._q.get()
        if kind == "text":
            return value
        self._done = True
        self._thread.join()
        if kind == "done":
            self.generation = value
        elif kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop the generation at its next cycle and wait for the engine to be free again."""
        if not self._done:
            self._cancel.set()
            self._thread.join()
            self._done = True

    def __del__(self) -> None:
        self._cancel.set()


class Pipeline:
    """A target model, its tokenizer and (optionally) an EAGLE-3 draft head, with one engine.

    Build it with :func:`load`. One generation runs at a time (the engine is batch 1 and owns its KV
    caches); :meth:`generate` and :meth:`stream` take a prompt string (rendered with the model's chat
    template when it has one), a list of chat messages, or token ids.
    """

    def __init__(self, target, tokenizer, head=None, *, model: str | None = None, head_folder: str | Path | None = None,
                 dtype: torch.dtype = torch.float32, max_seq_len: int | None = None, weights: str = "float") -> None:
        self.target, self.tokenizer, self.head = target, tokenizer, head
        self.draft_model = None
        """The second model ``draft-model`` drafts with (same tokenizer, same execution mode), or None
        (:meth:`attach_draft_model`)."""
        self.draft_model_name: str | None = None
        self.model = model
        """The model as given to :func:`load` (a short name, a path, or None for the default)."""
        self.head_folder = Path(head_folder) if head_folder else None
        """The head's folder: learned methods' policies and the tuned static tree are found next to it."""
        self.dtype = dtype
        self.weights = weights
        """``float``, ``int4`` or ``ggml`` (:data:`~adaptree.adapt.execution.WEIGHTS`)."""
        self.max_seq_len = max_seq_len
        self.engine = Engine(target, head, eos_token_ids=tokenizer.eos_token_ids, max_seq_len=max_seq_len)
        self.machine: MachineSetup | None = None
        """This machine's setup (:class:`~adaptree.adapt.MachineSetup`: latency model, static tree, default method),
        set by :func:`load` or :meth:`adapt`; None: nothing measured here yet."""

    @property
    def model_label(self) -> str:
        from adaptree.models import DEFAULT_MODEL_NAME

        return str(self.model or DEFAULT_MODEL_NAME)

    def settings(self) -> dict:
        """What a measurement with this pipeline depends on: the model and head (names and sha256), the dtype
        and torch's threads. Results folders are pinned to these."""
        from adaptree.models import model_sha256, sha256_file

        head = self.head_folder
        return {"model": self.model_label, "dtype": self.dtype_name, "weights": self.weights,
                "attention": self.attention_name, "compile_tokens": self.target.compile_tokens,
                "dense_prefill_rows": self.target.dense_prefill_rows,
                "model_sha256": model_sha256(self.model),
                "draft": self.head_label, "draft_sha256": sha256_file(head / "model.safetensors") if head else None,
                "draft_model": self.draft_model_name,
                "draft_model_sha256": model_sha256(self.draft_model_name) if self.draft_model is not None else None,
                "threads": torch.get_num_threads()}

    @property
    def head_label(self) -> str | None:
        """The head's folder as results files show it: ``shipped:<name>`` for a head adaptree ships (no machine
        paths in shareable results), else its path; None without a head."""
        from adaptree.models import HEADS_DIR

        head = self.head_folder
        if head is None:
            return None
        return f"shipped:{head.name}" if head.resolve().parent == HEADS_DIR else str(head)

    @property
    def default_method(self) -> str:
        """The method that models fastest on this machine (:attr:`machine`); ``ar`` without a draft head or before
        anything was measured here (adaptree cannot know that a tree pays on a machine it never timed)."""
        if self.head is None or self.machine is None:
            return "ar"
        return self.machine.default_method

    def adapt(self, config: AdaptConfig | None = None, *, force: bool = False, progress: bool = True) -> MachineSetup:
        """Measure this machine for this model, head, dtype and thread count (:func:`adaptree.adapt.adapt`: latency
        model, traces, static tree, default method), or take the cached result; sets and returns :attr:`machine`."""
        self.machine = adapt_to_machine(self, config, force=force, progress=progress)
        return self.machine

    @property
    def dtype_name(self) -> str:
        """The dtype as :func:`load` takes it (``"bfloat16"``, ...)."""
        from adaptree.models.cache import dtype_name

        return dtype_name(self.dtype)

    @property
    def attention_name(self) -> str:
        """The dtype of attention, rotary and the KV cache (``"float32"`` under bfloat16 projections on a CPU)."""
        from adaptree.models.cache import dtype_name

        return dtype_name(self.target.attn_dtype)

    @property
    def execution(self) -> str:
        """The execution mode (:func:`~adaptree.adapt.execution.execution_name`: ``"bfloat16"``,
        ``"bfloat16+int4"``, ...)."""
        return execution_name(self.dtype_name, self.weights)

    def use_chat(self, chat: bool | None = None) -> bool:
        """Whether a text prompt goes through the chat template: ``chat``, or (None) when the model has one."""
        return bool(self.tokenizer.chat_template) if chat is None else chat

    def encode(self, prompt: str | Messages | Sequence[int], chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: a string (through the chat template when the model has one and ``chat`` is
        not False), a list of chat messages, or ids (returned as they are)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if self.use_chat(chat):
                if not tok.chat_template:
                    raise ValueError("chat=True was given but this model has no chat template")
                return tok.apply_chat([{"role": "user", "content": prompt}])
            return tok.encode(prompt)
        items = list(prompt)
        if not items:
            raise ValueError("the prompt is empty")
        if all(isinstance(x, dict) for x in items):
            if chat is False or not tok.chat_template:  # no template: the turns' text, one after the other
                return tok.encode("\n\n".join(str(m["content"]) for m in items))
            return tok.apply_chat(items)
        if all(isinstance(x, int) for x in items):
            return items
        raise ValueError("a prompt is a string, a list of {'role', 'content'} messages or a list of token ids")

    def attach_draft_model(self, name: str | Path, model) -> None:
        """Use ``model`` (``name`` in results) as the ``draft-model`` method's draft model; a ValueError when its
        vocabulary is not the target's."""
        from adaptree.methods.draft_model import check_draft_model

        check_draft_model(self.target, model)
        self.draft_model, self.draft_model_name = model, str(name)

    def controller(self, method: str | None = None, **options: Any) -> Controller:
        """The controller of ``method`` (default :attr:`default_method`) with ``options`` (the method's config
        fields); policies and tuned trees come from next to the head in use unless given."""
        from adaptree.methods import method as registry_entry

        method = method or self.default_method
        if registry_entry(method).needs_head and self.head is None:
            raise ValueError(f"method {method!r} needs a draft head; this pipeline has none (load(head=...))")
        return make_controller(method, head_folder=self.head_folder, model=self.model_label,
                               tokenizer=self.tokenizer, machine=self.machine.assets if self.machine else None,
                               draft_model=self.draft_model, **options)

    def _prepare(self, prompt, method, controller, sampling, chat, options):
        if controller is not None and (method is not None or options):
            raise ValueError("pass either a controller or a method with its options, not both")
        ctl = controller if controller is not None else self.controller(method, **options)
        if sampling is None:
            sampling = SamplingConfig()
        elif isinstance(sampling, dict):
            sampling = SamplingConfig(**sampling)
        return self.encode(prompt, chat), ctl, sampling

    def generate(self, prompt: str | Messages | Sequence[int], method: str | None = None, *,
                 max_new_tokens: int = 256, sampling: SamplingConfig | dict | None = None,
                 controller: Controller | None = None, chat: bool | None = None, **options: Any) -> Generation:
        """Generate after ``prompt`` with ``method`` (its config fields as ``options``, e.g. ``width=4``).

        :param sampling: greedy by default; a :class:`SamplingConfig` or its fields as a dict
            (``{"temperature": 1.0, "top_p": 0.9, "seed": 0}``).
        :param controller: a controller built elsewhere, instead of ``method``.
        """
        ids, ctl, sampling = self._prepare(prompt, method, controller, sampling, chat, options)
        res = self.engine.generate(ids, ctl, max_new_tokens=max_new_tokens, sampling=sampling)
        return Generation(self.tokenizer.decode(res.token_ids), res.token_ids, ids, res)

    def stream(self, prompt: str | Messages | Sequence[int], method: str | None = None, *,
               max_new_tokens: int = 256, sampling: SamplingConfig | dict | None = None,
               controller: Controller | None = None, chat: bool | None = None, **options: Any) -> Stream:
        """Like :meth:`generate`, as an iterator over text pieces; the :class:`Generation` is on the returned
        :class:`Stream`'s ``generation`` once it is exhausted. Errors in the arguments raise here, before any
        text."""
        ids, ctl, sampling = self._prepare(prompt, method, controller, sampling, chat, options)
        return Stream(self, ids, ctl, max_new_tokens, sampling)


def load(model: str | Path | None = None, head: str | Path | None = "auto", *, dtype: str | torch.dtype = "auto",
         weights: str = "auto", compile: str = "auto", device: str | torch.device = "cpu", threads: int | None = None,
         max_seq_len: int | None = None, adapt: bool | None = None, progress: bool = True,
         draft_model: str | Path | None = None) -> Pipeline:
    """Load a target model, its tokenizer and an EAGLE-3 draft head, adapted to this machine.

    On the first use with a machine profile (CPU and its kernels, torch threads, execution mode, model and head)
    it measures the machine once (a few minutes on the default model, saying so in one line, with progress bars)
    and caches the result (:mod:`adaptree.adapt`): the execution mode, the latency model, the static tree and the
    default method for this machine; later loads find it in a fraction of a second.

    :param model: a registered short name (``smollm2-135m``, the default; ``qwen2.5-coder-0.5b``, ...), a Hugging
        Face checkpoint folder or a ``.gguf`` file.
    :param head: ``"auto"`` = the head adaptree ships for a registered model (none for other models), a head folder
        (``config.json`` + ``model.safetensors``), or None for no head (autoregressive decoding only).
    :param dtype: ``"auto"`` (the one this machine runs fastest, chosen by measurement and cached), ``"float32"``
        (bit-exact lossless greedy output), ``"bfloat16"`` or ``"float16"``.
    :param weights: ``"auto"`` (chosen with the dtype), ``"float"`` (dequantised to ``dtype``), ``"int4"`` (a GGUF
        model's own 4-bit blocks, :mod:`adaptree.models.quant`; CPU only) or ``"ggml"`` (the GGUF file on llama.cpp's
        kernels, :mod:`adaptree.models.ggml`, ``dtype`` the draft head's; CPU only, needs llama-cpp-python: where it
        cannot run, one line says why and the float weights run instead).
    :param compile: ``"auto"`` (decode steps and small trees run through ``torch.compile`` up to the tree size where
        it measured faster on this machine, cached; eager without a measurement), ``"on"`` or ``"off"``
        (:func:`adaptree.adapt.compile.compile_tokens`). Compiling costs seconds once per process, on the first
        generation.
    :param device: ``"cpu"`` or a CUDA device.
    :param threads: torch's CPU threads; torch's setting is process-wide, so this changes it for the whole
        process (None leaves it alone).
    :param max_seq_len: context limit (default: the model's, at most 8192).
    :param adapt: measure the machine when no setup is cached (None: unless ``$ADAPTREE_ADAPT=0``). False never
        measures: a cached setup is still used, ``"auto"`` takes the cached choice or, without one, float weights in
        bfloat16 where the hardware has native bfloat16 and float32 elsewhere, and the default method is ``ar``.
    :param progress: progress bars while measuring.
    :param draft_model: a smaller model with the target's tokenizer (a registered name, folder or ``.gguf``, as
        ``model``) for the ``draft-model`` method, loaded in the target's execution mode; ``"auto"``: the registered
        smaller sibling of a registered model (0.5B for ``qwen2.5-coder-1.5b``); None: none.
    """
    if threads is not None:  # first: the thread count is part of the machine profile
        if int(threads) < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(int(threads))
    if weights != "auto" and weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r} is not supported; use auto or one of {', '.join(WEIGHTS)}")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile {compile!r} is not one of {', '.join(COMPILE_MODES)}")
    if draft_model == "auto":
        from adaptree.models import sibling_draft_model

        draft_model = sibling_draft_model(model)
        if draft_model is None:
            raise ValueError(f"draft_model='auto': no smaller model with the same tokenizer is registered for "
                             f"{model or 'the default model'}; name one")
    if dtype != "auto":
        from adaptree.models.cache import dtype_name

        dtype = dtype_name(dtype_of(dtype))
    measure = adapt_enabled(adapt)
    mode = execution_name(dtype, weights)
    if "auto" in (dtype, weights):
        candidates = execution_candidates(model, device, dtype, weights)
        if measure:
            try:
                p = choose_execution(lambda m: load_execution(model, head, m, device, max_seq_len, measure, "off"),
                                     candidates, model, head, device, max_seq_len, progress=progress,
                                     compile=compile)
                if draft_model is not None:  # loaded once, in the mode chosen (the probes never draft with it)
                    p.attach_draft_model(draft_model, _load_draft_model(draft_model, p, measure, compile))
                return p
            except AdaptError as e:  # a model the measurement cannot run on: load it unmeasured
                say(f"warning: could not measure this machine ({e}); loading without a machine setup")
                measure = False
        mode = (cached_execution(candidates, model, head, device, max_seq_len)
                or fallback_execution(candidates, device))
    p = load_execution(model, head, mode, device, max_seq_len, measure, compile, draft_model)
    if p.head is not None and not measure:
        p.machine = find_setup(p)
    elif p.head is not None:
        try:
            p.adapt(progress=progress)  # the cached setup, or measured now
        except AdaptError as e:
            say(f"warning: could not measure this machine ({e}); the default method is ar")
    return p


def load_execution(model: str | Path | None, head: str | Path | None, mode: str, device: str | torch.device = "cpu",
                   max_seq_len: int | None = None, measure: bool = False, compile: str = "off",
                   draft_model: str | Path | None = None) -> Pipeline:
    """The pipeline of ``model`` and ``head`` (as :func:`load` takes them) in the execution mode ``mode``
    (``"bfloat16+int4"``, ...), not adapted: its attention dtype and compiled sizes are the cached ones, measured
    now when ``measure`` and none is cached. What :func:`load` and ``adaptree adapt`` load each candidate mode
    with."""
    from adaptree.models import load_model, shipped_head
    from adaptree.models.eagle3 import Eagle3Head
    from adaptree.models.llama import set_attention_dtype

    dtype, weights = parse_execution(mode)
    dt = dtype_of(dtype)
    if max_seq_len is not None and int(max_seq_len) < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    if (weights == "int4" or weights.startswith("ggml")) and torch.device(device).type != "cpu":
        raise ValueError(f"weights={weights!r} runs on the CPU only, not on {device}")
    try:
        target, tok = load_model(model, dtype=dt, max_seq_len=max_seq_len, weights=weights)
    except GgmlUnavailable as e:  # this llama.cpp cannot run the file: PyTorch's kernels on the same weights
        say(f"warning: the llama.cpp backend cannot run {model or 'the default model'} here ({e}); "
            f"using PyTorch's kernels ({dtype})")
        weights = "float"
        target, tok = load_model(model, dtype=dt, max_seq_len=max_seq_len, weights=weights)
    if head == "auto":
        head_folder = shipped_head(model)
    elif head is None or head == "none":
        head_folder = None
    else:
        head_folder = Path(head)
    draft = Eagle3Head.from_pretrained(head_folder, target=target, dtype=dt).eval() if head_folder else None
    dev = torch.device(device)
    if dev.type != "cpu":
        target.to(dev)
        if draft is not None:
            draft.to(dev)
    attn = _measured_choices(target, measure, compile)
    if draft is not None:
        set_attention_dtype(draft, attn)
    p = Pipeline(target, tok, draft, model=str(model) if model is not None else None, head_folder=head_folder,
                 dtype=dt, max_seq_len=max_seq_len, weights=weights)
    if draft_model is not None:
        p.attach_draft_model(draft_model, _load_draft_model(draft_model, p, measure, compile))
    return p


def _load_draft_model(name: str | Path, p: Pipeline, measure: bool, compile: str):
    """The draft model ``name`` in ``p``'s execution mode, on its device, with its own attention dtype, compiled
    sizes and prefill rule (cached or measured like the target's)."""
    from adaptree.models import load_model

    second, _ = load_model(name, dtype=p.dtype, max_seq_len=p.max_seq_len, weights=p.weights)
    if p.weights == "int4":  # its layers the file keeps in 5-8 bits, rounded to 4: they only decide proposals
        from adaptree.models.quant import pack_dense

        pack_dense(second)
    if p.target.device.type != "cpu":
        second.to(p.target.device)
    _measured_choices(second, measure, compile)
    return second


def _measured_choices(model, measure: bool, compile: str) -> torch.dtype:
    """Apply this machine's cached (or, with ``measure``, measured) choices for ``model``: its attention dtype,
    compiled sizes and dense-prefill rule; returns the attention dtype."""
    from adaptree.models.llama import set_attention_dtype

    attn = attention_dtype(model, measure)
    set_attention_dtype(model, attn)
    model.compile(compile_tokens(model, measure, compile))
    model.dense_prefill_rows = dense_prefill_rows(model, measure)
    return attn
