"""One replica of each pool, and it goes away: the drafter (requests continue autoregressively, then draft
again once a drafter is back) or the verifier (requests wait --verifier-grace for one, then resume from
their checkpoints; past the grace they fail, and an HTTP stream says so and ends with [DONE]). Every output
that completes equals the target's own greedy output. Also: a 20 MB prompt is refused without stalling the
event loop, and a Redis that needs a password is unusable without it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
import urllib.request

import grpc
import pytest

from dspark_protos.dspark.v1 import types_pb2
from services.common import metrics

import svc_cluster as cluster
from svc_cluster import ids_request

NEW = 200
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def long_greedy(fixtures_dir, reference):
    """The target's own greedy continuation of each fixture prompt, NEW tokens (plain autoregressive)."""
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    target = TargetRuntime(TargetConfig(str(fixtures_dir / "target"), device="cpu", dtype="float32"))
    engine = Engine(target, None, EngineConfig(policy="ar"))
    out = [(p, engine.generate(p, SamplingParams(temperature=0, max_new_tokens=NEW)).output_ids) for p, _ in reference]
    assert all(g[:64] == ref for (_, g), (_, ref) in zip(out, reference))
    return out


def _streams(stub, prompts):
    return [iter(stub.Generate(ids_request(p, NEW, cls=types_pb2.GenerateRequest), timeout=120)) for p in prompts]


def _drain(its, firsts):
    """All chunks of each stream (after the ones already read)."""
    def rest(i):
        return firsts[i] + list(its[i])

    with cf.ThreadPoolExecutor(len(its)) as pool:
        return list(pool.map(rest, range(len(its))))


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


def _draftless() -> float:
    return metrics.DRAFTLESS_ROUNDS._value.get()


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_only_drafter_gone_requests_continue_then_draft_again(aio, redis_server, fixtures_dir, long_greedy):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    # the verifier waits 30 ms for company before each forward: rounds last long enough to watch
    v = cluster.verifier(aio, t, d, redis_server.url, "v-f1", coalesce_wait_s=0.03, coalesce_wait_alone=True)
    d1 = cluster.drafter(aio, d, redis_server.url, "d-f1")
    s = cluster.scheduler(aio, redis_url=redis_server.url)
    d2 = None
    try:
        stub, ch = cluster.scheduler_stub(s)
        its = _streams(stub, [p for p, _ in long_greedy])
        firsts = [[next(it), next(it)] for it in its]
        before = _draftless()
        cluster.stop(aio, d1)
        results = {}
        drain = threading.Thread(target=lambda: results.update(out=_drain(its, firsts)))
        drain.start()
        _wait(lambda: _draftless() > before, 20, "rounds without a drafter")
        d2 = cluster.drafter(aio, d, redis_server.url, "d-f2")
        drain.join(120)
        out = results["out"]
        assert [_tokens(c) for c in out] == [g for _, g in long_greedy]
        for chunks in out:
            drafted = [c.round.num_drafted for c in chunks if c.HasField("round")]
            gap = drafted.index(0)  # a round nobody drafted for ...
            assert drafted[0] > 0 and any(x > 0 for x in drafted[gap:])  # ... between drafted ones
        assert d2.servicer.step_time.value > 0  # the new drafter drafted
        ch.close()
    finally:
        cluster.stop(aio, s, d2, v)


def test_only_verifier_gone_and_back_within_grace_loses_nothing(aio, redis_server, fixtures_dir, long_greedy):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v1 = cluster.verifier(aio, t, d, redis_server.url, "v-g1", coalesce_wait_s=0.03, coalesce_wait_alone=True)
    dr = cluster.drafter(aio, d, redis_server.url, "d-g1")
    s = cluster.scheduler(aio, redis_url=redis_server.url, verifier_grace_s=30.0)
    v2 = None
    try:
        stub, ch = cluster.scheduler_stub(s)
        its = _streams(stub, [p for p, _ in long_greedy])
        firsts = [[next(it), next(it)] for it in its]
        cluster.stop(aio, v1)
        results = {}
        drain = threading.Thread(target=lambda: results.update(out=_drain(its, firsts)))
        drain.start()
        time.sleep(1.5)  # nobody to verify: the requests wait
        assert drain.is_alive()
        v2 = cluster.verifier(aio, t, d, redis_server.url, "v-g2")
        drain.join(120)
        assert [_tokens(c) for c in results["out"]] == [g for _, g in long_greedy]
        assert all(c[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH for c in results["out"])
        ch.close()
    finally:
        cluster.stop(aio, s, dr, v2)


def test_past_the_grace_requests_fail_and_http_streams_end_with_an_error_and_done(aio, fixtures_dir, reference):
    """The error names neither the pods' addresses nor the neighbour that failed in the same step."""
    t = fixtures_dir / "target"
    v = cluster.verifier(aio, t, coalesce_wait_s=0.03, coalesce_wait_alone=True)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), use_drafter=False,
                          verifier_grace_s=0.5, http_port=0, http_host="127.0.0.1")
    try:
        stub, ch = cluster.scheduler_stub(s)
        secret = "neighbour-secret-7f3a"  # another client's request id, failing in the same steps
        req_n = ids_request(reference[1][0], NEW, cls=types_pb2.GenerateRequest, temperature=0)
        req_n.request_id = secret
        neighbour = iter(stub.Generate(req_n, timeout=120))
        next(neighbour)
        body = {"prompt": reference[0][0], "max_tokens": NEW, "temperature": 0, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{s.http_port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            first = r.readline()
            assert first.startswith(b"data: ")
            cluster.stop(aio, v)
            t0 = time.monotonic()
            events = [line[6:].strip() for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert time.monotonic() - t0 < 20
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "service_unavailable" and "verifier" in err["message"]
        assert secret not in err["message"] and "127.0.0.1" not in err["message"] and str(v.port) not in err["message"]
        with pytest.raises(grpc.RpcError) as e:
            list(neighbour)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "127.0.0.1" not in e.value.details()
        assert s.loop.num_requests == 0
        ch.close()
    finally:
        cluster.stop(aio, s)


def test_a_20mb_prompt_is_refused_at_once_and_health_stays_responsive(aio, tiny_target_dir):
    s = cluster.scheduler(aio, embedded_target=str(tiny_target_dir), http_port=0, http_host="127.0.0.1")
    try:
        port = s.http_port
        huge = "word " * (4 * 1024 * 1024)  # 20 MiB
        slow = []

        def health():
            for _ in range(20):
                t0 = time.monotonic()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
                    assert r.status == 200
                slow.append(time.monotonic() - t0)

        h = threading.Thread(target=health)
        h.start()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps({"prompt": huge, "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(req, timeout=60)
            raise AssertionError("a 20 MB prompt was accepted")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        h.join(60)
        assert status == 413 or (status == 400 and "bytes" in json.loads(text)["error"]["message"]), text
        assert time.monotonic() - t0 < 10 and max(slow) < 2.0
        # over gRPC: a text longer than any context-window's worth of tokens, named and sized
        stub, ch = cluster.scheduler_stub(s)
        big = "word " * (s.frontend.max_prompt_bytes // 5 + 10)
        with pytest.raises(Exception) as e:
            stub.GenerateUnary(types_pb2.GenerateUnaryRequest(prompt_text=big), timeout=30)
        assert e.value.code().name == "INVALID_ARGUMENT" and "prompt_text" in e.value.details()
        assert "bytes" in e.value.details()
        ch.close()
    finally:
        cluster.stop(aio, s)


def test_redis_with_a_password_is_used_with_it_and_unusable_without(tmp_path):
    from services.common.registry import PodRecord, Registry, RegistryConfig
    from svc_redis import RedisServer

    r = RedisServer(tmp_path, password="pw-0123456789").start()
    try:
        rec = PodRecord(id="p1", pool="verifier", address="127.0.0.1:1", capacity=1)
        without = Registry(RegistryConfig(r.url))
        assert not without.publish_pod(rec) and not without.up
        with_pw = Registry(RegistryConfig(r.url, password="pw-0123456789"))
        assert with_pw.publish_pod(rec) and [p.id for p in with_pw.pods("verifier")] == ["p1"]
        without.close(), with_pw.close()
    finally:
        r.stop()
