"""The tiny text model (real tokenizer): `serve all`'s embedded scheduler and a distributed verifier +
scheduler (static addresses, no Redis) both produce the target's own greedy text; the OpenAI-compatible
HTTP routes (completions, chat with SSE, models, health) serve the same engine; metrics are on their own port."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import struct
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

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


def _raw(port, path, data: str | bytes, headers=None, method="POST"):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request(method, path, body=data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data,
              headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, r.read().decode("utf-8", "replace")


@pytest.mark.parametrize("path,data,headers,param", [
    ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "temperature": 1' + "0" * 400 + "}", {}, "temperature"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", {}, None),  # past Python's int limit
    ("/v1/completions", '{"prompt": "x", "user": ' + "[" * 100000 + "]" * 100000 + "}", {}, None),
    ("/v1/completions", '{"prompt": "x"}', {"Content-Type": "application/json; charset=no-such"}, None),
    ("/v1/completions", '{"prompt": "x"}', {"Content-Encoding": "gzip"}, None),  # not gzip
    ("/v1/completions", '{"prompt": "x \\ud800 y", "max_tokens": 4}', {}, "prompt"),  # a lone surrogate
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', {},
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', {}, "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": null}]}', {}, "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     '{"url": "x"}}]}]}', {}, "messages[0].content[0].type"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', {},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": 5, "content": "hi"}]}', {}, "messages[0].role"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "temperature": 1e-40}', {}, "temperature"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 4, "repetition_penalty": 1e-30}', {}, "repetition_penalty"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 4000 + "}", {}, "max_tokens"),  # echoed, cut
    ("/v1/completions", '{"prompt": "x", "stop": ' + json.dumps(["s" * 20000] * 5) + "}", {}, "stop"),  # 5 > 4
])
def test_hostile_bodies_are_a_400_in_openais_shape_never_a_500(embedded, path, data, headers, param):
    status, body = _raw(embedded.http_port, path, data, headers)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    if param is not None:
        assert param in err["message"]
    assert len(err["message"]) < 400, f"the error echoes {len(err['message'])} characters of the request"


def test_text_content_parts_read_as_the_same_string(embedded):
    """OpenAI's content parts: text parts are the message's text, joined by newlines (as vLLM reads them)."""
    port = embedded.http_port

    def reply(content):
        status, raw = _http(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 6, "temperature": 0})
        assert status == 200, raw
        return json.loads(raw)["dspark"]["token_ids"]

    assert reply([{"type": "text", "text": "def add(a, b):"}]) == reply("def add(a, b):")
    assert reply([{"type": "text", "text": "x = 1"}, {"type": "text", "text": "y ="}]) == reply("x = 1\ny =")


def test_unknown_paths_methods_and_oversized_bodies_answer_in_openais_shape(embedded):
    port = embedded.http_port
    for path, method, data, status in (("/v1/nope", "POST", "{}", 404), ("/v1/completions", "GET", "", 405),
                                       ("/v1/completions", "POST", "x" * (4 << 20), 413)):
        got, body = _raw(port, path, data, method=method)
        assert got == status and json.loads(body)["error"]["message"], body


def test_a_stream_whose_client_left_before_its_headers_ends_quietly(embedded, expected, caplog):
    port = embedded.http_port
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            s.close()
        time.sleep(1.0)  # their handlers get the first update and find the client gone
        deadline = time.monotonic() + 30
        while embedded.loop.num_requests and time.monotonic() < deadline:
            time.sleep(0.05)
    assert embedded.loop.num_requests == 0  # cancelled in the engine
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    ids, greedy = expected[0]
    status, raw = _http(port, "/v1/completions", {"prompt": ids, "max_tokens": NEW, "temperature": 0,
                                                  "ignore_eos": True})
    assert json.loads(raw)["dspark"]["token_ids"] == greedy


def test_a_non_streamed_request_whose_client_left_is_cancelled(embedded, expected, caplog, monkeypatch):
    """aiohttp does not cancel a handler whose client disconnects: the request must notice by itself, or a
    client could leave generations running for nobody (up to max_tokens each). The tiny model reaches the end
    of its context in well under a second, so the test looks often."""
    from services.common import metrics
    from services.scheduler import http as http_front

    monkeypatch.setattr(http_front, "DISCONNECT_POLL_S", 0.01)

    cancelled = metrics.REQUESTS.labels(finish_reason="cancelled")
    before = cancelled._value.get()
    port = embedded.http_port
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 100000, "ignore_eos": True}).encode()
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 30
            while not embedded.loop.num_requests and time.monotonic() < deadline:
                time.sleep(0.02)
            assert embedded.loop.num_requests  # it is generating
            s.close()
            deadline = time.monotonic() + 30
            while embedded.loop.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
            assert embedded.loop.num_requests == 0
    assert cancelled._value.get() - before == 2  # cancelled, not run to the end of the context for nobody
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    ids, greedy = expected[0]
    status, raw = _http(port, "/v1/completions", {"prompt": ids, "max_tokens": NEW, "temperature": 0,
                                                  "ignore_eos": True})
    assert json.loads(raw)["dspark"]["token_ids"] == greedy


async def _one_step(f, entries):
    """f.run for each (request_id, prompt_ids, params), handed to the engine together (one prefill batch);
    per entry its tokens or the exception that ended it."""
    held = []

    def submit(*entry):
        mine = Future()
        held.append((entry, mine))
        if len(held) == len(entries):
            for (_, m), theirs in zip(held, f.loop.submit_group([e for e, _ in held])):
                theirs.add_done_callback(lambda t, m=m: m.set_exception(t.exception()) if t.exception()
                                         else m.set_result(t.result()))
        return mine

    async def one(rid, ids, params):
        out = []
        try:
            async for upd in f.run(rid, list(ids), params, submit=submit):
                out.extend(upd.token_ids)
        except Exception as exc:  # noqa: BLE001
            return exc
        return out

    return await asyncio.gather(*(one(*e) for e in entries))


def test_a_request_whose_first_token_fails_takes_no_neighbour_down_and_leaks_no_slot(aio, embedded, expected):
    """Values past the edge (SamplingParams built in-process, as a verifier pod receives them): a temperature
    that overflows the scaled logits makes sampling the first token fail. The prefill batch is retried without
    it: the neighbour prefilled in the same step is served exactly, the n choices of such a request fail with
    their own error (not a stale "request_id is already active"), and no verifier slot is left behind."""
    from dspark_core.sampling import SamplingParams
    from services.scheduler.servicer import Choices

    f = embedded.frontend
    (ids, greedy), (other, _) = expected[0], expected[1]
    bad = SamplingParams(temperature=1e-45, max_new_tokens=NEW)
    good_out, bad_out = aio.run(_one_step(f, [("good-1", ids, SamplingParams(temperature=0, max_new_tokens=NEW)),
                                              ("bad-1", other, bad)]))
    assert good_out == greedy
    assert isinstance(bad_out, Exception) and "already active" not in str(bad_out), bad_out

    async def n_choices():
        runs = Choices(f, "bad-n", ids, bad, 2)
        try:
            while True:
                await runs.next()
        except Exception as exc:  # noqa: BLE001
            return exc
        finally:
            await runs.aclose()

    err = aio.run(n_choices())
    assert "already active" not in str(err), err
    deadline = time.monotonic() + 10
    while embedded.loop.num_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert embedded.engine.verifier.num_active == 0


def test_an_api_key_header_that_is_not_utf8_is_a_401(aio, tiny_target_dir):
    key = "k" * 20
    s = cluster.scheduler(aio, embedded_target=str(tiny_target_dir), http_port=0, http_host="127.0.0.1",
                          api_keys=(key,))
    try:
        for auth, status in ((b"Bearer \xff\xfe", 401), (f"Bearer {key}\xff".encode("latin-1"), 401),
                             (f"Bearer {key}".encode(), 200)):
            c = socket.create_connection(("127.0.0.1", s.http_port), timeout=30)
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth +
                      b"\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := c.recv(65536):
                out += chunk
            c.close()
            assert out.startswith(b"HTTP/1.1 %d " % status), out
    finally:
        cluster.stop(aio, s)


def test_corrupt_wire_bytes_are_invalid_argument_and_the_server_serves_on(aio, embedded, expected, caplog):
    """Bytes that do not parse as the method's message (truncated, a string field that is not UTF-8) are the
    client's error: INVALID_ARGUMENT naming the request, no error-level log, and the next call is served."""
    import grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{embedded.port}")
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    unary = ch.unary_unary("/dspark.v1.SchedulerService/GenerateUnary", **raw)
    stream = ch.unary_stream("/dspark.v1.SchedulerService/Generate", **raw)
    with caplog.at_level(logging.ERROR):
        for call, body, why in ((unary, b"\xff\xff\xff", "Wire format was corrupt"),
                                (unary, b"\x0a\x05\xff\xfe\xfd\xfc\xfb", "UTF-8"),  # prompt_text, not UTF-8
                                (lambda b, timeout: list(stream(b, timeout=timeout)), b"\xff\xff\xff", "corrupt")):
            with pytest.raises(grpc.RpcError) as err:
                call(body, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert err.value.details().startswith("request ") and why in err.value.details(), err.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    ch.close()
    stub, ch = cluster.scheduler_stub(embedded)
    eos = embedded.frontend.card.eos_token_ids[0]
    assert list(stub.GenerateUnary(_text_request(PROMPTS[0]), timeout=60).token_ids) == _cut(expected[0][1], eos)
    ch.close()
