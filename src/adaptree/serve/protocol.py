"""The OpenAI wire format: request bodies -> :class:`GenerationRequest` (every value checked, a bad one named in a
400), and finished generations -> response bodies and stream chunks.

adaptree's own request fields (extra body fields, ``extra_body=`` in the ``openai`` client):

- ``method``: the controller (:data:`adaptree.methods.METHODS`); default: the server's (this machine's best).
- ``method_options``: that method's config fields, e.g. ``{"width": 4, "depth": 2, "size": 8}``; JSON numbers,
  strings, booleans and lists (for tuple fields). Fields that name files on the server (policies, tuned trees,
  latency models) are not accepted over HTTP.
- ``top_k``: keep the k most likely tokens when sampling (0 or -1 = off).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig
from adaptree.serve.errors import InvalidRequest

MAX_STOP = 4
"""Stop sequences per request at most (OpenAI's limit)."""

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles accepted (``developer`` is passed to the chat template as ``system``)."""

SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
"""The seeds torch's generator takes."""

CHAT, COMPLETION = "chat", "completion"

UNSET = object()


@dataclass
class GenerationRequest:
    """One checked request: what to generate, how, and how to answer."""

    kind: str
    """``chat`` (/v1/chat/completions) or ``completion`` (/v1/completions)."""
    prompt: Any
    """What :meth:`adaptree.api.Pipeline.encode` takes: chat messages, a string or token ids."""
    chat: bool
    """Whether a string prompt goes through the chat template (never for /v1/completions)."""
    sampling: SamplingConfig
    max_tokens: int | None = None
    """As asked (None: the server's default, capped by the context room)."""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: one more chunk with the usage before ``[DONE]``."""
    model: str | None = None
    method: str | None = None
    method_options: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == CHAT else "prompt"


# ------------------------------------------------------------------------------------------------ checks


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and not (isinstance(x, float) and math.isnan(x))


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    x = body.get(name)
    if x is None:
        return default
    if not _is_number(x):
        raise InvalidRequest(f"{name} must be a number, got {x!r}", param=name, code="invalid_value")
    bad = x <= lo if lo_open else x < lo
    if bad or x > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequest(f"{name} must be in {interval}, got {x!r}", param=name, code="invalid_value")
    return float(x)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    x = body.get(name)
    if x is None:
        return None
    if not _is_int(x):
        raise InvalidRequest(f"{name} must be an integer, got {x!r}", param=name, code="invalid_value")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        what = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be {what}, got {x!r}", param=name, code="invalid_value")
    return x


def _unsupported(body: dict, name: str, allowed: tuple = (None,), what: str = "") -> None:
    x = body.get(name)
    if any(x == a and type(x) is type(a) for a in allowed):
        return
    raise InvalidRequest(f"{name}={x!r} is not supported by this server{what}", param=name, code="unsupported_value")


def _stop(body: dict) -> tuple[str, ...]:
    x = body.get("stop")
    if x is None:
        return ()
    items = [x] if isinstance(x, str) else x
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequest(f"stop must be a string or a list of strings, got {x!r}", param="stop",
                             code="invalid_value")
    if len(items) > MAX_STOP:
        raise InvalidRequest(f"stop takes at most {MAX_STOP} sequences, got {len(items)}", param="stop",
                             code="invalid_value")
    if any(s == "" for s in items):
        raise InvalidRequest(f"stop sequences must not be empty, got {x!r}", param="stop", code="invalid_value")
    return tuple(dict.fromkeys(items))


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported, got a {kind!r} part",
                                     param=f"messages[{i}].content", code="unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
                         param=f"messages[{i}].content", code="invalid_value")


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {msgs!r}",
                             param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content', got {m!r}",
                                 param=f"messages[{i}]", code="invalid_value")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}",
                                 param=f"messages[{i}].role", code="invalid_value")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)})
    return out


def _prompt(body: dict) -> str | list[int]:
    """/v1/completions' prompt: a string or token ids, or a list holding one of them (one prompt per request)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise InvalidRequest("prompt is empty", param="prompt", code="invalid_value")
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise InvalidRequest(f"one prompt per request: got a batch of {len(p)}", param="prompt",
                             code="unsupported_value")
    raise InvalidRequest(f"prompt must be a non-empty string or a non-empty list of token ids, got {p!r}",
                         param="prompt", code="invalid_value")


def parse_request(body: Any, kind: str) -> GenerationRequest:
    """A request body (parsed JSON) of ``kind`` (:data:`CHAT` or :data:`COMPLETION`) -> a
    :class:`GenerationRequest`; an :class:`~adaptree.serve.errors.InvalidRequest` names the first bad value.
    Fields this server does not know are ignored; fields it knows but cannot honour (``n`` > 1, ``logprobs``,
    ``tools``, penalties, ...) are refused."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}",
                             code="invalid_body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}", param="model", code="invalid_value")
    prompt = _messages(body) if kind == CHAT else _prompt(body)

    # what the engine cannot do
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1) or isinstance(body.get(name), bool):
            raise InvalidRequest(f"{name}={body.get(name)!r} is not supported: one completion per request",
                                 param=name, code="unsupported_value")
    _unsupported(body, "logprobs", (None, False, 0), ": no log-probabilities")
    _unsupported(body, "top_logprobs", (None, 0), ": no log-probabilities")
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "suffix", (None,))
    for name in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, name, (None, 0, 0.0), ": no penalties")
    if body.get("logit_bias") not in (None, {}):
        raise InvalidRequest("logit_bias is not supported by this server", param="logit_bias",
                             code="unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise InvalidRequest(f"{name} are not supported by this server", param=name, code="unsupported_value")
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidRequest("tool_choice is not supported by this server", param="tool_choice",
                             code="unsupported_value")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest(f"response_format {fmt!r} is not supported: text only", param="response_format",
                             code="unsupported_value")

    # sampling
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    seed = _int(body, "seed", *SEED_RANGE)
    try:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=max(0, top_k or 0), seed=seed)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="temperature", code="invalid_value") from None

    max_tokens = _int(body, "max_tokens", 1)
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        mct = _int(body, "max_completion_tokens", 1)
        if max_tokens is not None and mct != max_tokens:
            raise InvalidRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) disagree",
                                 param="max_completion_tokens", code="invalid_value")
        max_tokens = mct

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", param="stream", code="invalid_value")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options",
                                 code="invalid_value")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise InvalidRequest(f"stream_options must be {{'include_usage': bool}}, got {opts!r}",
                                 param="stream_options", code="invalid_value")
        include_usage = opts.get("include_usage", False)

    method = body.get("method")
    if method is not None:
        from adaptree.methods import METHODS

        if method not in METHODS:
            raise InvalidRequest(f"unknown method {method!r}; available: {', '.join(METHODS)}", param="method",
                                 code="unknown_method")
    options = body.get("method_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidRequest(f"method_options must be an object of the method's config fields, got {options!r}",
                             param="method_options", code="invalid_value")
    return GenerationRequest(kind=kind, prompt=prompt, chat=kind == CHAT, sampling=sampling, max_tokens=max_tokens,
                             stop=_stop(body), stream=stream, include_usage=include_usage, model=model, method=method,
                             method_options=dict(options))


# ------------------------------------------------------------------------------------------- method options


def file_options(method: str) -> set[str]:
    """The config fields of ``method`` that name files on the server (policies, tuned trees, latency models) or
    that its name decides (``mode``): not settable over HTTP."""
    from adaptree.methods import REGISTRY

    m = REGISTRY[method]
    return {a.option for a in m.assets} | set(m.machine_options) | {"mode"}


def _check_value(value: Any, tp: Any, where: str) -> Any:
    """``value`` (parsed JSON) as a value of type ``tp``; an InvalidRequest naming ``where`` otherwise."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _check_value(value, rest[0], where)
    if origin in (tuple, list):
        item = typing.get_args(tp)[0]
        if not isinstance(value, list):
            raise InvalidRequest(f"{where} must be a list, got {value!r}", param="method_options",
                                 code="invalid_value")
        checked = [_check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(checked) if origin is tuple else checked
    ok = {int: _is_int, float: _is_number, str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}
    check = ok.get(tp)
    if check is None:
        return value
    if not check(value):
        noun = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]
        raise InvalidRequest(f"{where} must be {noun}, got {value!r}", param="method_options", code="invalid_value")
    return float(value) if tp is float else value


def check_method_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``method``'s config, each value checked against its field's type (JSON lists become tuples);
    unknown fields and file fields are refused, naming them."""
    from adaptree.methods import REGISTRY

    m = REGISTRY[method]
    if m.config is None:
        if options:
            raise InvalidRequest(f"method {method!r} takes no options, got {sorted(options)}",
                                 param="method_options", code="invalid_value")
        return {}
    hints = typing.get_type_hints(m.config)
    names = [f.name for f in dataclasses.fields(m.config)]
    blocked = file_options(method)
    out = {}
    for key, value in options.items():
        if key in blocked:
            raise InvalidRequest(f"method option {key!r} of {method!r} names a file on the server or is set by the "
                                 "method's name; it cannot be given in a request", param="method_options",
                                 code="invalid_value")
        if key not in names:
            allowed = ", ".join(n for n in names if n not in blocked)
            raise InvalidRequest(f"unknown option {key!r} for method {method!r}; its options: {allowed}",
                                 param="method_options", code="invalid_value")
        out[key] = _check_value(value, hints[key], f"method_options.{key}")
    return out


# ----------------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, result: GenerationResult, extra: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object plus adaptree's own figures under ``adaptree``."""
    n = result.new_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "adaptree": {"method": result.method, "tau": round(result.tau, 4), "cycles": len(result.cycles),
                         "tokens_per_s": round(result.tokens_per_s, 3),
                         "wall_time_s": round(result.wall_time_s, 4), "prefill_s": round(result.prefill_s, 4),
                         "stop_reason": result.stop_reason, **extra}}


def response_body(req: GenerationRequest, rid: str, created: int, model: str, text: str, finish_reason: str,
                  usage_obj: dict, fingerprint: str) -> dict[str, Any]:
    if req.kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fingerprint,
            "choices": [choice], "usage": usage_obj}


def chunk_body(req: GenerationRequest, rid: str, created: int, model: str, fingerprint: str, *, text: str | None = None,
               role: bool = False, finish_reason: str | None = None, usage_obj: dict | None = None) -> dict[str, Any]:
    """One stream chunk: a piece of text, the opening role (chat), the finish reason, or (``usage_obj``) the usage
    chunk with no choices."""
    if usage_obj is not None:
        choices: list = []
    elif req.kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk" if req.kind == CHAT else "text_completion", "created": created,
           "model": model, "system_fingerprint": fingerprint, "choices": choices}
    if usage_obj is not None:
        out["usage"] = usage_obj
    return out
