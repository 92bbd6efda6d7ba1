"""``adaptree serve``: the OpenAI-compatible server, tested with the official ``openai`` client against a real uvicorn
server on loopback (in a thread of the test process).

Fast tests run a tiny random model (a word-level tokenizer with a chat template, so every id decodes to a word);
the slow ones the real default model in float32, where greedy text through the server must equal
``Pipeline.generate``'s and ``adaptree generate``'s.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import tiny_head
from prometheus_client.parser import text_string_to_metric_families

from adaptree.api import Pipeline
from adaptree.models.config import ModelConfig
from adaptree.models.llama import Transformer
from adaptree.models.tokenizer import TokenizerBundle
from adaptree.serve import ServeConfig, run_load_test, start_server

WORDS = ["<unk>", "<|", "|>", "user", "assistant", "system"] + (
    "the a cat dog sat ran on in of to and is was it he she we they red blue green big small old new one two three "
    "four five six seven eight nine ten sun moon sea sky tree house road car bird fish book pen cup hat door wall "
    "time day night yes no up down left right").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONTEXT = 4096
"""The tiny model's context: room for a generation long enough to be cancelled half-way."""
LONG = 3000
"""max_tokens of a generation that runs for seconds on the tiny model (they are cancelled, never finished)."""
MSG = [{"role": "user", "content": "the cat sat on the road"}]
SMALL_TREE = {"width": 3, "depth": 3, "size": 6}


def tiny_tokenizer() -> TokenizerBundle:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    return TokenizerBundle(fast, chat_template=CHAT_TEMPLATE, eos_token_ids=[])


@pytest.fixture(scope="module")
def pipe():
    """The tiny model served by the fast tests (on the conftest's TINY_THREADS torch threads, set per test)."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, eos_token_id=[])
    target = Transformer(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)
    return Pipeline(target, tiny_tokenizer(), tiny_head(target, seed=1), model="tiny")


@pytest.fixture(scope="module")
def server(pipe):
    srv = start_server(pipe, ServeConfig(port=0, served_model_name="tiny", max_queue=2))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    yield c
    c.close()


# ------------------------------------------------------------------------------------------------ helpers


def get(server, path: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as r:
            status, raw, ctype = r.status, r.read().decode(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read().decode(), e.headers.get("content-type", "")
    return status, json.loads(raw) if "json" in ctype else raw


def post_raw(server, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(server) -> dict[tuple, float]:
    _, text = get(server, "/metrics")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def count(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(cond, timeout: float = 20.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def idle(server) -> bool:
    _, h = get(server, "/health")
    return not h["busy"] and h["queue_depth"] == 0


def start_long_stream(client):
    """A streaming generation that runs for seconds, once its first text has arrived (it is running)."""
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=LONG, temperature=0,
                                            stream=True, extra_body={"method": "ar"})
    it = iter(stream)
    while not (next(it).choices[0].delta.content or ""):
        pass
    return stream


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in exc.response.text
    return body["error"]


# ---------------------------------------------------------------------------------------------- endpoints


def test_models_health_and_unknown_endpoints(server, client, pipe):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.owned_by == "adaptree" and card.model_extra["max_model_len"] == CONTEXT
    assert card.model_extra["default_method"] == pipe.default_method == "ar"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert "'gpt-4'" in error_of(err.value)["message"]
    status, h = get(server, "/health")
    assert status == 200 and h["status"] == "ok" and h["model"] == "tiny" and h["max_queue"] == 2
    status, body = get(server, "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "not_found" and "/v1/nothing" in body["error"]["message"]
    status, body = get(server, "/v1/chat/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_chat_is_the_pipelines_generation_with_adaptrees_figures(client, pipe):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0,
                                       extra_body={"method": "static", "method_options": SMALL_TREE})
    want = pipe.generate(MSG, method="static", max_new_tokens=24, **SMALL_TREE)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion" and r.model == "tiny"
    assert r.id.startswith("chatcmpl-")
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    own = u.model_extra["adaptree"]
    assert own["method"] == "static" and own["cycles"] == len(want.cycles) and own["tau"] == pytest.approx(want.tau)
    assert own["tokens_per_s"] > 0 and own["stop_reason"] == "max_new_tokens" and own["time_to_first_token_s"] > 0
    # no method: the pipeline's default (ar here: nothing measured), the same tokens (fp32 greedy is lossless)
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=24, temperature=0)
    assert r.usage.model_extra["adaptree"]["method"] == "ar" and r.choices[0].message.content == want.text


def test_a_method_with_context_chains_serves_its_pipeline_generation(client, pipe):
    """The server's wrapper of the job's controller passes on every hook: ngram's context index and chain choice."""
    want = pipe.generate(MSG, method="ngram", max_new_tokens=40, min_n=1)
    assert sum(c.chain_accepted for c in want.cycles) > 0  # chains were verified and accepted
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=40, temperature=0,
                                       extra_body={"method": "ngram", "method_options": {"min_n": 1}})
    own = r.usage.model_extra["adaptree"]
    assert r.choices[0].message.content == want.text and own["method"] == "ngram"
    assert own["cycles"] == len(want.cycles) < len(want.token_ids)


def test_chat_stream_adds_up_to_the_whole_text(client, pipe):
    want = pipe.generate(MSG, method="static", max_new_tokens=30, **SMALL_TREE)
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"method": "static", "method_options": SMALL_TREE})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3 and "".join(pieces) == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.model_extra["adaptree"]["cycles"] == len(want.cycles)
    # without include_usage no usage chunk
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, temperature=0,
                                                 stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_completions_raw_prompt_and_token_ids(client, pipe):
    want = pipe.generate("the cat sat", method="ar", max_new_tokens=12, chat=False)
    r = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.object == "text_completion" and r.usage.prompt_tokens == 3
    ids = pipe.encode("the cat sat", chat=False)
    assert client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].text == want.text
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12,
                                                                     temperature=0, stream=True)]
    assert "".join(pieces) == want.text


def test_sampling_with_a_seed_is_the_pipelines(client, pipe):
    kw = dict(model="tiny", messages=MSG, max_tokens=20, temperature=0.9, top_p=0.8, seed=7,
              extra_body={"method": "static", "method_options": SMALL_TREE, "top_k": 20})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    want = pipe.generate(MSG, method="static", max_new_tokens=20, **SMALL_TREE,
                         sampling={"temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": 7})
    assert a == b == want.text


def test_stop_sequences_cut_the_text_and_end_the_generation(client, pipe):
    whole = pipe.generate(MSG, method="ar", max_new_tokens=32).text
    words = whole.split()
    stop = " " + words[5] + " " + words[6]
    cut = whole[:whole.find(stop)]
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=32, temperature=0, stop=[stop, "zzz"],
                                       extra_body={"method": "ar"})
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    own = r.usage.model_extra["adaptree"]
    assert own["stop_reason"] == "stop_sequence" and r.usage.completion_tokens < 32
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=32, temperature=0, stop=stop,
                                                 stream=True, extra_body={"method": "ar"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_metrics_count_requests_tokens_and_tau(server, client):
    before = metrics(server)
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10, temperature=0,
                                       extra_body={"method": "static", "method_options": SMALL_TREE})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, temperature=5)
    after = metrics(server)
    assert count(after, "adaptree_requests_total", endpoint="chat", outcome="completed") == \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="completed") + 1
    assert count(after, "adaptree_requests_total", endpoint="chat", outcome="invalid") == \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="invalid") + 1
    assert count(after, "adaptree_completion_tokens_total", method="static") == \
        count(before, "adaptree_completion_tokens_total", method="static") + 10
    cycles = r.usage.model_extra["adaptree"]["cycles"]
    assert count(after, "adaptree_cycles_total", method="static") == \
        count(before, "adaptree_cycles_total", method="static") + cycles
    assert count(after, "adaptree_request_tau_count", method="static") >= 1
    assert count(after, "adaptree_queue_depth") == 0 and count(after, "adaptree_engine_busy") == 0
    assert count(after, "adaptree_model_info", model="tiny", execution="float32", default_method="ar",
                 version="0.1.0", context=str(CONTEXT)) == 1
    for name in ("adaptree_request_tokens_per_second_count", "adaptree_request_latency_seconds_count",
                 "adaptree_time_to_first_token_seconds_count", "adaptree_queue_wait_seconds_count"):
        assert any(k[0] == name and v >= 1 for k, v in after.items()), name


# ------------------------------------------------------------------------------------------------- errors

BAD_CHAT = [
    ({"extra_body": {"method": "fast"}}, "method", "unknown_method", "'fast'"),
    ({"extra_body": {"method": "deagle", "method_options": {"wdith": 3}}}, "method_options", "invalid_value", "'wdith'"),
    ({"extra_body": {"method": "static", "method_options": {"width": "4"}}}, "method_options", "invalid_value", "'4'"),
    ({"extra_body": {"method": "static", "method_options": {"width": 0}}}, "method_options", "invalid_value", "got 0"),
    ({"extra_body": {"method": "ltd", "method_options": {"depth_policy": "/etc"}}}, "method_options",
     "invalid_value", "'depth_policy'"),
    ({"extra_body": {"method": "ltd"}}, "method", "method_unavailable", "LTD depth policy"),
    ({"extra_body": {"method": "ar", "method_options": {"width": 2}}}, "method_options", "invalid_value", "'ar'"),
    ({"extra_body": {"method_options": [1]}}, "method_options", "invalid_value", "[1]"),
    ({"temperature": -1}, "temperature", "invalid_value", "-1"),
    ({"temperature": 2.5}, "temperature", "invalid_value", "2.5"),
    ({"top_p": 0}, "top_p", "invalid_value", "got 0"),
    ({"top_p": 1.5}, "top_p", "invalid_value", "1.5"),
    ({"extra_body": {"top_k": -2}}, "top_k", "invalid_value", "-2"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value", "got 0"),
    ({"seed": 2 ** 70}, "seed", "invalid_value", str(2 ** 70)),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value", "got 5"),
    ({"stop": ""}, "stop", "invalid_value", "''"),
    ({"n": 2}, "n", "unsupported_value", "n=2"),
    ({"logprobs": True}, "logprobs", "unsupported_value", "logprobs=True"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value", "0.5"),
    ({"model": "gpt-4"}, "model", "model_not_found", "'gpt-4'"),
    ({"messages": []}, "messages", "invalid_value", "[]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value", "'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "unsupported_value", "'image_url'"),
    ({"messages": [{"role": "user", "content": "cat " * CONTEXT}]}, "messages", "context_length_exceeded",
     f"context is {CONTEXT}"),
    ({"max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded", f"max_tokens ({CONTEXT})"),
    # values that passed the request checks and failed in the engine or in the method's arithmetic (500s)
    ({"temperature": 1e-40}, "temperature", "invalid_value", "1e-40"),
    ({"extra_body": {"method": "gammatune", "method_options": {"max_factor": 1e308}}}, "method_options",
     "invalid_value", "1e+308"),
    ({"extra_body": {"method": "ngram", "method_options": {"max_n": 65}}}, "method_options", "invalid_value",
     "got 65"),
    # trees past the server's limits (ServeConfig.max_tree_*)
    ({"max_tokens": 3, "extra_body": {"method": "static", "method_options": {"width": 64, "depth": 64, "size": 8150}}},
     "method_options", "limit_exceeded", "width 64"),
    ({"extra_body": {"method": "static", "method_options": {"width": 4, "depth": 33, "size": 8}}}, "method_options",
     "limit_exceeded", "depth 33"),
    ({"extra_body": {"method": "deagle", "method_options": {"size": 257}}}, "method_options", "limit_exceeded",
     "257; this server allows at most 256"),
    ({"extra_body": {"method": "ngram", "method_options": {"tokens": 10 ** 6}}}, "method_options", "limit_exceeded",
     str(10 ** 6)),
    ({"extra_body": {"method": "gammatune", "method_options": {"depth": 30, "max_factor": 1.5}}}, "method_options",
     "limit_exceeded", "depth 45"),
]


@pytest.mark.parametrize("kw, param, code, named", BAD_CHAT, ids=[f"{c[1]}-{c[3]}"[:40] for c in BAD_CHAT])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_requests_are_400_error_objects_naming_the_value(client, kw, param, code, named, stream):
    args = {"model": "tiny", "messages": MSG, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args, stream=stream)
    e = error_of(err.value)
    assert err.value.status_code == 400 and e["type"] == "invalid_request_error"
    assert (e["param"], e["code"]) == (param, code) and named in e["message"], e


@pytest.mark.parametrize("prompt, named", [(["a b", "c d"], "batch of 2"), ([99], "token id 99"), ("", "empty"),
                                           ([[]], "got []")])
def test_bad_completion_prompts(client, prompt, named):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    e = error_of(err.value)
    assert e["param"] == "prompt" and named in e["message"], e


@pytest.mark.parametrize("data, named", [(b'{"model": "tiny", "messages": [', "not valid JSON"),
                                         (b"[1, 2]", "JSON object, got list"), (b"\xff\xfe", "not valid JSON"),
                                         (b"[" * 100_000, "100000 levels deep; the limit is 64"),
                                         (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", "66 levels deep")],
                         ids=["unfinished", "a-list", "not-utf8", "100000-nested", "66-nested"])
def test_malformed_bodies(server, data, named):
    status, body = post_raw(server, "/v1/chat/completions", data)
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and named in body["error"]["message"]


def test_a_failing_generation_is_an_error_object_and_the_server_goes_on(server, client):
    """temperature=1e-40 used to pass the sampling checks and overflow softmax(logits / T) in the engine: now it is
    refused (400) before it queues, streaming or not. A generation that does fail in the engine (here a controller
    that raises in its first cycle, handed to the scheduler as a request's would be) is answered with an error
    object, counted as failed, and the engine thread goes on with the next request."""
    before = metrics(server)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as err:
            out = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=1e-40,
                                                 stream=stream)
            list(out) if stream else out
        e = error_of(err.value)
        assert err.value.status_code == 400 and "1e-40" in e["message"], e
    after = metrics(server)
    failed = count(after, "adaptree_requests_total", endpoint="chat", outcome="failed") - \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="failed")
    invalid = count(after, "adaptree_requests_total", endpoint="chat", outcome="invalid") - \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="invalid")
    assert failed + invalid == 2 and invalid == 2

    import asyncio

    from adaptree.core.controller import StaticController
    from adaptree.core.verify import SamplingConfig
    from adaptree.serve.scheduler import Job

    class Failing(StaticController):
        def begin_cycle(self, ctx):
            raise RuntimeError("the controller broke")

    async def run_failing():
        job = Job([5, 6, 7], Failing(), 4, SamplingConfig(), endpoint="chat")
        server.app_state.scheduler.submit(job)
        while True:  # the prefill's token comes first
            kind, value = await job.next_event()
            if kind != "text":
                return kind, value

    kind, error = asyncio.run(run_failing())
    assert kind == "error" and error.status == 500 and "the controller broke" in error.message
    assert count(metrics(server), "adaptree_requests_total", endpoint="chat", outcome="failed") == \
        count(after, "adaptree_requests_total", endpoint="chat", outcome="failed") + 1
    assert client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0).choices
    assert get(server, "/health")[1]["status"] == "ok"


# -------------------------------------------------------------------------------------------- concurrency


def test_a_client_that_disconnects_cancels_its_generation(server, client):
    before = metrics(server)
    stream = start_long_stream(client)
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: idle(server), 10, "the engine to be free")
    after = metrics(server)
    assert count(after, "adaptree_requests_total", endpoint="chat", outcome="cancelled") == \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="cancelled") + 1
    made = count(after, "adaptree_completion_tokens_total", method="ar") - \
        count(before, "adaptree_completion_tokens_total", method="ar")
    assert 1 <= made < LONG / 2  # ended at its next cycle, long before max_tokens

    # the same without streaming: the client drops the connection while it waits for the answer
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny", "messages": MSG, "max_tokens": LONG,
                                                             "temperature": 0, "method": "ar"}),
                 {"Content-Type": "application/json"})
    wait_for(lambda: get(server, "/health")[1]["busy"], 10, "the generation to start")
    conn.close()
    wait_for(lambda: idle(server), 10, "the engine to be free")
    final = metrics(server)
    assert count(final, "adaptree_requests_total", endpoint="chat", outcome="cancelled") == \
        count(after, "adaptree_requests_total", endpoint="chat", outcome="cancelled") + 1
    assert count(final, "adaptree_completion_tokens_total", method="ar") - \
        count(after, "adaptree_completion_tokens_total", method="ar") < LONG / 2


def test_queue_is_fifo_bounded_and_answers_429_with_retry_after(server, client, pipe):
    """max_queue 2: one running, two waiting, the next one is refused; the waiting ones then run in order."""
    running = start_long_stream(client)
    finished: list[tuple[str, str]] = []

    def wait_in_queue(name: str) -> None:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0)
        finished.append((name, r.choices[0].message.content))

    threads = []
    for i, name in enumerate(["second", "third"]):
        threads.append(threading.Thread(target=wait_in_queue, args=(name,)))
        threads[-1].start()
        wait_for(lambda n=i + 1: get(server, "/health")[1]["queue_depth"] == n, 10, f"{i + 1} queued")
    before = metrics(server)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
    e = error_of(err.value)
    assert err.value.status_code == 429 and e["code"] == "queue_full" and "2 requests are waiting" in e["message"]
    assert int(err.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):  # streaming requests are refused before the stream starts
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, stream=True)
    assert count(metrics(server), "adaptree_requests_total", endpoint="chat", outcome="rejected") == \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="rejected") + 2
    running.close()
    for t in threads:
        t.join(30)
    want = pipe.generate(MSG, method="ar", max_new_tokens=8).text
    assert finished == [("second", want), ("third", want)]
    assert idle(server)


def test_load_every_request_completes_or_gets_429_and_none_is_interleaved(server, pipe):
    prompts = ["the cat sat", "a dog ran on the road", "red sun and blue sea", "one two three", "we sat in the house",
               "she was on the car", "big old tree", "night and day"]
    want = {p: pipe.generate([{"role": "user", "content": p}], method="ar", max_new_tokens=32).text for p in prompts}
    assert len(set(want.values())) > 1
    before = metrics(server)
    res = run_load_test(server.url, model="tiny", clients=16, requests_per_client=3, max_tokens=32, prompts=prompts,
                        method="static")
    assert res["requests"] == 48 and res["errors"] == 0 and res["lost"] == 0
    assert res["completed"] + res["rejected_429"] == 48 and res["completed"] >= 3 and res["rejected_429"] >= 1
    assert all(res["checks"].values()), res["checks"]
    for r in res["records"]:
        if r["status"] == "completed":
            assert r["text"] == want[r["prompt"]] and r["finish_reason"] == "length" and r["completion_tokens"] == 32
    after = metrics(server)
    assert count(after, "adaptree_requests_total", endpoint="chat", outcome="completed") - \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="completed") == res["completed"]
    assert count(after, "adaptree_requests_total", endpoint="chat", outcome="rejected") - \
        count(before, "adaptree_requests_total", endpoint="chat", outcome="rejected") == res["rejected_429"]
    assert idle(server) and get(server, "/health")[1]["status"] == "ok"


# ----------------------------------------------------------------------------------- what one request may cost

TIGHT = ServeConfig(port=0, served_model_name="tiny", warmup=False, max_body_bytes=4096, max_verified_nodes=1000)


@pytest.fixture(scope="module")
def tight(pipe):
    """A second server on the same pipeline with small limits (its requests never run beside the module server's:
    the tests run one at a time)."""
    srv = start_server(pipe, TIGHT)
    yield srv
    srv.stop()


def test_max_tokens_times_the_tree_is_bounded_and_an_unset_max_tokens_is_capped(tight):
    c = openai.OpenAI(base_url=f"{tight.url}/v1", api_key="none", max_retries=0, timeout=60)
    tree = {"method": "static", "method_options": {"width": 4, "depth": 4, "size": 60}}
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", messages=MSG, max_tokens=17, temperature=0, extra_body=tree)
    e = error_of(err.value)
    assert (e["param"], e["code"]) == ("max_tokens", "limit_exceeded"), e
    assert "max_tokens 17 with 61 verified nodes per cycle may verify 1037 nodes" in e["message"], e
    assert "allows 1000 per request" in e["message"] and "at most 16 tokens" in e["message"], e
    r = c.chat.completions.create(model="tiny", messages=MSG, temperature=0, extra_body=tree)  # no max_tokens: 16
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_a_body_past_the_limit_is_refused_while_it_streams_in(tight):
    """A chunked upload (no Content-Length) is answered 413 once the limit is passed, before the body ends (the
    client here never ends it: a server that read the whole body first would never answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", tight.port, timeout=20)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for _ in range(5):  # 5 KiB of an unfinished body; the limit is 4 KiB
            conn.send(b"400\r\n" + b" " * 1024 + b"\r\n")
        r = conn.getresponse()
        body = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 413 and body["error"]["code"] == "request_too_large", body
    assert "more than 4096 bytes" in body["error"]["message"]


def test_the_depth_scan_agrees_with_the_parsed_json():
    from adaptree.serve.limits import json_depth

    def depth(x) -> int:
        if isinstance(x, dict):
            return 1 + max(map(depth, x.values()), default=0)
        if isinstance(x, list):
            return 1 + max(map(depth, x), default=0)
        return 0

    bodies = [{}, [], {"a": "[[[{{"}, {"a": ["x\\", ["]]\""]], "b": "\\\"[["}, [[[[{"k": [1, "}}"]}]]]],
              {"messages": [{"role": "user", "content": "\\" * 7 + '"[' * 50}]}, "a plain string"]
    for body in bodies:
        raw = json.dumps(body).encode()
        assert json_depth(raw) == depth(json.loads(raw)), raw
        assert json_depth(json.dumps(body, indent=2, ensure_ascii=False).encode()) == depth(body)


def test_brackets_inside_strings_do_not_count_as_nesting(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "[{" * 200 + "\\\""}],
                                       max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_an_operator_raises_the_limits_by_flag(pipe, server, client):
    """--max-tree-width and its siblings are ServeConfig fields; a raised limit lets the wider tree through."""
    from adaptree.cli import build_parser
    from adaptree.cli.serve import _server_flags

    args = build_parser().parse_args(["serve", "--max-tree-width", "64", "--max-tree-depth", "40", "--max-tree-size",
                                      "512", "--max-verified-nodes", "5000", "--max-json-depth", "8"])
    config = _server_flags().build(args)
    assert (config.max_tree_width, config.max_tree_depth, config.max_tree_size, config.max_verified_nodes,
            config.max_json_depth) == (64, 40, 512, 5000, 8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-tree-width", "0"])
    wide = {"method": "static", "method_options": {"width": 40, "depth": 2, "size": 8}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, extra_body=wide)
    assert "width 40; this server allows at most 32 (adaptree serve --max-tree-width)" in error_of(err.value)["message"]
    srv = start_server(pipe, ServeConfig(port=0, served_model_name="tiny", warmup=False, max_tree_width=64))
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0, extra_body=wide)
        assert r.choices[0].message.content == pipe.generate(MSG, method="static", max_new_tokens=4,
                                                             **wide["method_options"]).text
    finally:
        srv.stop()
    from adaptree.serve import create_app

    with pytest.raises(ValueError, match="the server's default method: .*width 40"):  # a default past the limits
        create_app(pipe, ServeConfig(method="static", method_options=wide["method_options"]))


# ------------------------------------------------------------------------------------ other servers, shutdown


def test_api_key_server_default_method_and_graceful_shutdown(pipe):
    config = ServeConfig(port=0, served_model_name="tiny", api_key="sesame", method="static",
                         method_options=SMALL_TREE, graceful_timeout=30)
    srv = start_server(pipe, config)
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert error_of(err.value)["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sesame", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)
        assert r.usage.model_extra["adaptree"]["method"] == "static"  # the server's default method and options
        assert r.choices[0].message.content == pipe.generate(MSG, method="static", max_new_tokens=12,
                                                             **SMALL_TREE).text
        # shutdown while a generation streams: it finishes (within the grace period), then the server stops
        stream = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=300, temperature=0, stream=True,
                                           extra_body={"method": "ar"})
        it = iter(stream)
        next(it)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        stopper.join(30)
        assert not srv.thread.is_alive()
    finally:
        srv.stop()


def test_shutdown_cancels_what_outlasts_the_grace_period(pipe):
    """Past the grace period the running generation ends at its next cycle and the queued request is answered,
    both with a 503 error object ('shutting_down'); the engine thread ends and the engine is free."""
    srv = start_server(pipe, ServeConfig(port=0, served_model_name="tiny", graceful_timeout=0.3))
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    stream = start_long_stream(c)
    queued: list = []

    def wait_in_queue() -> None:
        try:
            c.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0)
        except openai.APIStatusError as exc:
            queued.append(exc)

    t = threading.Thread(target=wait_in_queue)
    t.start()
    wait_for(lambda: srv.app_state.scheduler.depth == 1, 10, "the second request to queue")
    t0 = time.monotonic()
    srv.stop()
    assert not srv.thread.is_alive() and time.monotonic() - t0 < 10
    with pytest.raises(openai.APIError) as err:  # the stream ends with an error event, not a finish reason
        list(stream)
    assert err.value.body["code"] == "shutting_down" and "during the generation" in err.value.body["message"]
    t.join(10)
    assert queued and queued[0].status_code == 503 and error_of(queued[0])["code"] == "shutting_down"
    registry = srv.app_state.metrics.registry
    assert registry.get_sample_value("adaptree_requests_total", {"endpoint": "chat", "outcome": "shutdown"}) == 2
    assert len(pipe.generate(MSG, method="ar", max_new_tokens=4).token_ids) == 4  # the engine is free


def test_a_bad_default_method_fails_when_the_app_is_made(pipe):
    from adaptree.serve import create_app

    with pytest.raises(ValueError, match="LTD depth policy"):
        create_app(pipe, ServeConfig(method="ltd"))


def test_the_serve_command_parses_its_flags_and_serves_until_sigint(tmp_path):
    """``adaptree serve`` as a user runs it: its own process, a tiny Hugging Face folder, /health, then Ctrl-C
    (SIGINT) stops it cleanly with exit status 0."""
    import signal
    import socket
    import subprocess
    import sys

    from test_models import save_hf

    from adaptree.cli import build_parser
    from adaptree.cli.serve import _server_flags

    args = build_parser().parse_args(["serve", "--port", "0", "--max-queue", "3", "--method", "static", "-W", "4",
                                      "--no-warmup", "--served-model-name", "m", "--graceful-timeout", "2"])
    config = _server_flags().build(args)
    assert (config.port, config.max_queue, config.warmup, config.served_model_name) == (0, 3, False, "m")
    assert config.graceful_timeout == 2.0 and args.method == "static" and args.width == 4

    folder = save_hf("llama", tmp_path / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "adaptree.cli", "serve", "--model", str(folder), "--draft", "none",
                             "--dtype", "float32", "--no-adapt", "--port", str(port), "--served-model-name", "tiny-hf",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        assert health["model"] == "tiny-hf" and health["default_method"] == "ar"
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny-hf", messages=[{"role": "user", "content": "the cat sat"}],
                                      max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.usage.model_extra["adaptree"]["method"] == "ar"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "serving tiny-hf (float32, default method ar" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()


# -------------------------------------------------------------------------------------- the real model (slow)


@pytest.fixture(scope="module")
def real():
    """The real default model in float32 with its shipped head, never measuring the machine, and its server."""
    import adaptree
    from adaptree.models import default_model_path, shipped_head

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    if shipped_head() is None:
        pytest.skip("no head shipped for the default model")
    p = adaptree.load(dtype="float32", weights="float", adapt=False, progress=False)
    srv = start_server(p, ServeConfig(port=0, max_queue=8))
    yield p, srv
    srv.stop()


@pytest.mark.slow
def test_real_model_greedy_text_equals_pipeline_and_cli(real, capsys):
    from adaptree.cli import main

    p, srv = real
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
    prompt = "Name three prime numbers and explain why they are prime."
    msgs = [{"role": "user", "content": prompt}]
    for method, opts in [(None, {}), ("static", {}), ("ltd", {}), ("static", {"width": 4, "depth": 3, "size": 8})]:
        body = {"method": method, "method_options": opts} if method else {}
        r = c.chat.completions.create(model=p.model_label, messages=msgs, max_tokens=32, temperature=0,
                                      extra_body=body)
        want = p.generate(msgs, method=method, max_new_tokens=32, **opts)
        assert r.choices[0].message.content == want.text, method
        assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(want.prompt_ids)
        assert r.usage.model_extra["adaptree"]["method"] == (method or p.default_method)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=p.model_label, messages=msgs, max_tokens=32, temperature=0, stream=True,
        extra_body={"method": "static"}) if ch.choices)
    # adaptree generate, same request (chat template, greedy, fp32)
    code = main(["generate", prompt, "--dtype", "float32", "--weights", "float", "--no-adapt", "--method", "static",
                 "--max-new-tokens", "32", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["text"] == streamed
    # /v1/completions: no template, like generate --no-chat
    r = c.completions.create(model=p.model_label, prompt="The capital of France is", max_tokens=16, temperature=0,
                             extra_body={"method": "static"})
    code = main(["generate", "The capital of France is", "--no-chat", "--dtype", "float32", "--weights", "float",
                 "--no-adapt", "--method", "static", "--max-new-tokens", "16", "--json"])
    assert code == 0 and r.choices[0].text == json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    # a seeded sample is the pipeline's too
    r = c.chat.completions.create(model=p.model_label, messages=msgs, max_tokens=24, temperature=1.0, top_p=0.9,
                                  seed=3, extra_body={"method": "static"})
    want = p.generate(msgs, method="static", max_new_tokens=24, sampling={"temperature": 1.0, "top_p": 0.9, "seed": 3})
    assert r.choices[0].message.content == want.text


@pytest.mark.slow
def test_real_model_bounded_load(real):
    p, srv = real
    res = run_load_test(srv.url, model=p.model_label, clients=16, requests_per_client=2, max_tokens=8)
    assert res["requests"] == 32 and res["errors"] == 0 and res["lost"] == 0
    assert res["completed"] + res["rejected_429"] == 32 and res["completed"] >= 9
    assert all(res["checks"].values()), res["checks"]
    want = {}
    for r in res["records"]:
        if r["status"] == "completed":
            if r["prompt"] not in want:
                want[r["prompt"]] = p.generate([{"role": "user", "content": r["prompt"]}], max_new_tokens=8).text
            assert r["text"] == want[r["prompt"]]
    assert idle(srv) and get(srv, "/health")[1]["status"] == "ok"
