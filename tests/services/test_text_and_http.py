"""The tiny text model (real tokenizer): `serve all`'s embedded scheduler and a distributed verifier +
scheduler (static addresses, no Redis) both produce the target's own greedy text; the OpenAI-compatible
HTTP routes (completions, chat with SSE, models, health) serve the same engine; metrics are on their own port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster

PROMPTS = ["def add(a, b):", "The answer is", "for i in range(10):"]
NEW = 10


def hf_greedy(model_dir, ids, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module")
def expected(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    res = []
    for p in PROMPTS:
        ids = tok.encode(p, add_special_tokens=False)
        res.append((ids, hf_greedy(tiny_target_dir, ids, NEW)))
    return res


@pytest.fixture(scope="module")
def embedded(aio, tiny_target_dir):
    s = cluster.scheduler(aio, embedded_target=str(tiny_target_dir), http_port=0, http_host="127.0.0.1")
    yield s
    cluster.stop(aio, s)


def _text_request(text, n=NEW):
    return types_pb2.GenerateUnaryRequest(prompt_text=text, sampling=types_pb2.SamplingParams(max_new_tokens=n))


def _cut(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_embedded_text_generation_equals_target_greedy(embedded, expected, tiny_target_dir):
    stub, ch = cluster.scheduler_stub(embedded)
    eos = embedded.frontend.card.eos_token_ids[0]
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    for text, (ids, greedy) in zip(PROMPTS, expected):
        resp = stub.GenerateUnary(_text_request(text), timeout=60)
        assert list(resp.token_ids) == _cut(greedy, eos)
        assert resp.text == tok.decode(list(resp.token_ids), skip_special_tokens=True)
    ch.close()


def test_distributed_text_generation_without_redis_equals_target_greedy(aio, tiny_target_dir, expected):
    v = cluster.verifier(aio, tiny_target_dir)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), use_drafter=False,
                          tokenizer_dir=str(tiny_target_dir))
    try:
        stub, ch = cluster.scheduler_stub(s)
        eos = s.frontend.card.eos_token_ids[0]
        for text, (_, greedy) in zip(PROMPTS, expected):
            chunks = list(stub.Generate(types_pb2.GenerateRequest(
                prompt_text=text, sampling=types_pb2.SamplingParams(max_new_tokens=NEW)), timeout=60))
            assert [t for c in chunks for t in c.token_ids] == _cut(greedy, eos)
        ch.close()
    finally:
        cluster.stop(aio, s, v)


def _http(port, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_openai_completions_chat_sse_models_health_and_no_metrics(embedded, expected, tiny_target_dir):
    port = embedded.http_port
    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    eos = embedded.frontend.card.eos_token_ids[0]
    ids, greedy = expected[0]
    status, body = _http(port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0})
    assert status == 200, body
    out = json.loads(body)
    assert out["choices"][0]["text"] == tok.decode(_cut(greedy, eos), skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(ids) and out["object"] == "text_completion"
    # chat, streamed as server-sent events
    status, body = _http(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True})
    assert status == 200
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    status, body = _http(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0})
    assert json.loads(body)["choices"][0]["message"]["content"] == streamed
    # errors name the field
    status, body = _http(port, "/v1/completions", {"prompt": "x", "temperature": -2})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    status, body = _http(port, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and "max_tokens" in json.loads(body)["error"]["message"]
    status, body = _http(port, "/v1/models")
    assert json.loads(body)["data"][0]["id"] == embedded.frontend.card.name
    assert _http(port, "/health")[0] == 200
    # metrics are not on the public port: they have their own (--metrics-port, services.common.metrics)
    assert _http(port, "/metrics")[0] == 404
    from services.common import metrics

    body = metrics.render().decode()
    assert "dspark_requests_total" in body and "dspark_inter_token_latency_seconds_bucket" in body


def test_full_verifier_refuses_only_the_new_request(aio, tiny_target_dir, expected):
    from dspark_protos.dspark.v1 import types_pb2 as t

    v = cluster.verifier(aio, tiny_target_dir, max_active=1)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), use_drafter=False,
                          tokenizer_dir=str(tiny_target_dir))
    try:
        stub, ch = cluster.scheduler_stub(s)
        ids, _ = expected[1]
        first = iter(stub.Generate(cluster.ids_request(ids, 60, cls=t.GenerateRequest, stop_token_ids=[]), timeout=60))
        chunks = [next(first)]
        with pytest.raises(Exception) as e:
            stub.GenerateUnary(cluster.ids_request(ids, 4), timeout=60)
        assert e.value.code().name == "RESOURCE_EXHAUSTED" and "max_active_requests" in e.value.details()
        chunks.extend(first)  # the request already running is unaffected
        assert chunks[-1].finish_reason in (t.FINISH_REASON_LENGTH, t.FINISH_REASON_STOP)
        ch.close()
    finally:
        cluster.stop(aio, s, v)


def test_openai_stop_strings_cut_the_text_and_end_the_request(embedded):
    port = embedded.http_port
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    full = json.loads(_http(port, "/v1/completions", body)[1])["choices"][0]["text"]
    assert len(full) >= 6, full
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = full[: full.find(stop)]
    status, raw = _http(port, "/v1/completions", {**body, "stop": [stop, "\u2603never"]})
    assert status == 200, raw
    out = json.loads(raw)
    assert out["choices"][0]["text"] == want and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(out["dspark"]["token_ids"]) < 24
    # streamed: the same text, nothing of the stop string leaks, the last chunk says "stop"
    status, raw = _http(port, "/v1/completions", {**body, "stop": stop, "stream": True})
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # chat too; and a stop string that never occurs changes nothing
    status, raw = _http(port, "/v1/completions", {**body, "stop": "\u2603never"})
    assert json.loads(raw)["choices"][0]["text"] == full
    status, raw = _http(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 8, "temperature": 0, "stop": ["\u2603"]})
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("length", "stop")
    # the cut requests were cancelled in the engine, not run to max_tokens
    import time

    deadline = time.monotonic() + 10
    while embedded.loop.num_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert embedded.loop.num_requests == 0
    for bad in (5, ["a", ""], ["a", "b", "c", "d", "e"]):
        status, raw = _http(port, "/v1/completions", {**body, "stop": bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == "stop", raw
