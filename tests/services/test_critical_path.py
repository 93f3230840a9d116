"""Issue 21: where a distributed step spends its time, and coordination off its critical path.

Real sockets, a real Redis, the tiny fixture target: 2 verifiers + 1 drafter + 1 scheduler in-process.
- the stage breakdown accounts for the engine thread's time (propose / verify RPCs split into pod forward,
  pod queue and transport; schedule; loop work) and reaches Prometheus;
- with Redis writes stalled (CLIENT PAUSE WRITE), tokens keep streaming: checkpoints and the load
  publication lag, the steps do not; a verifier lost meanwhile is replaced by a resume from the
  scheduler's own copy (the Redis checkpoint is stale), and the output is still the target's greedy one;
- a lone scheduler's calls are not held back by the pods' coalescing wait; two schedulers still merge.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dspark_protos.dspark.v1 import types_pb2
from services.common.batcher import Coalescer
from services.scheduler.stages import _PARTS, CLOCK, parse_prometheus, parse_spec_counters, per_step, speculation_per_step

import svc_cluster as cluster
from svc_cluster import ids_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stack(aio, redis_server, fixtures_dir):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v1 = cluster.verifier(aio, t, d, redis_server.url, "cp-v1")
    v2 = cluster.verifier(aio, t, d, redis_server.url, "cp-v2")
    dr = cluster.drafter(aio, d, redis_server.url, "cp-d1")
    s = cluster.scheduler(aio, redis_url=redis_server.url)
    stub, ch = cluster.scheduler_stub(s)
    yield {"v": [v1, v2], "d": dr, "s": s, "stub": stub, "redis": redis_server}
    ch.close()
    cluster.stop(aio, s, dr, v1, v2)


def wait_until(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_stage_breakdown_accounts_for_the_step_and_reaches_prometheus(stack, reference):
    prompt, greedy = reference[0]
    wait_until(lambda: stack["s"].loop.num_requests == 0, what="an idle scheduler")
    from services.common import metrics

    before, spec_before = CLOCK.snapshot(), parse_spec_counters(metrics.render().decode())
    t0 = time.perf_counter()
    out = stack["stub"].GenerateUnary(ids_request(prompt, 24), timeout=120)
    wall = time.perf_counter() - t0
    after, spec_after = CLOCK.snapshot(), parse_spec_counters(metrics.render().decode())
    assert list(out.token_ids) == greedy[:24]
    b = per_step(before, after)
    assert b["steps"] >= out.summary.num_rounds > 0
    s = b["seconds_per_step"]
    for stage in ("prefill", "propose.serialize", "propose.rpc", "drafter.forward", "propose.transport",
                  "verify.rpc", "verifier.forward", "verify.transport", "schedule", "loop.events"):
        assert s.get(stage, 0) > 0, stage
    # what a pod reported doing fits inside the call that waited for it
    assert s["verifier.forward"] + s.get("verifier.queue", 0) <= s["verify.rpc"] + 1e-6
    assert s["drafter.forward"] + s.get("drafter.queue", 0) <= s["propose.rpc"] + 1e-6
    assert abs(sum(b["share"].values()) - 1) < 1e-2 and not set(b["share"]) & _PARTS
    assert set(b["pod_idle_share"]) == {"drafter", "verifier"} and all(0 <= x < 1 for x in b["pod_idle_share"].values())
    # the top-level stages partition the engine thread's time: about the request's wall time
    accounted = b["wall_per_step_s"] * b["steps"]
    assert 0.5 * wall < accounted < wall + 0.3
    steps, stages = parse_prometheus(metrics.render().decode())
    # seconds_per_step is rounded to 1e-6 s, so its product with the step count may exceed the raw total by
    # up to 0.5e-6 per step
    assert steps >= b["steps"] and stages["verify.rpc"] >= (s["verify.rpc"] - 0.5e-6) * b["steps"] - 1e-6
    # what the steps decided, from the same page: this request's rounds, drafts and its 24 tokens
    sp = speculation_per_step(b["steps"], spec_before, spec_after)
    assert sp["tokens_per_step"] * b["steps"] == pytest.approx(24, abs=1e-2)
    assert sp["rounds_per_step"] * b["steps"] == pytest.approx(out.summary.num_rounds, abs=1e-2)
    assert sp["accepted_tokens_per_step"] * b["steps"] == pytest.approx(out.summary.num_accepted_tokens, abs=1e-2)
    assert sp["draft_tokens_per_round"] > 0 and 0 <= sp["acceptance"] <= 1
    assert speculation_per_step(0, spec_before, spec_after) == {}


@pytest.fixture(scope="module")
def long_greedy(fixtures_dir, reference):
    """The target's own greedy continuation (plain autoregressive) of one fixture prompt, LONG tokens."""
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    target = TargetRuntime(TargetConfig(str(fixtures_dir / "target"), device="cpu", dtype="float32"))
    prompt = reference[2][0]
    return prompt, Engine(target, None, EngineConfig(policy="ar")).generate(
        prompt, SamplingParams(temperature=0, max_new_tokens=LONG)).output_ids


LONG = 200
PAUSE_S = 4.0


def test_redis_writes_stalled_tokens_keep_streaming_and_a_lost_verifier_resumes_exactly(aio, stack, long_greedy):
    prompt, greedy = long_greedy
    r = stack["redis"].client()
    it = iter(stack["stub"].Generate(ids_request(prompt, LONG, cls=types_pb2.GenerateRequest), timeout=120))
    chunks = [next(it), next(it)]
    rid = chunks[0].request_id
    wait_until(lambda: r.get(f"dspark:request:{rid}") is not None, what="a first checkpoint")
    holders = [v.servicer.verifier.num_active for v in stack["v"]]
    victim = stack["v"][holders.index(1)]
    failovers = _failovers()
    r.execute_command("CLIENT", "PAUSE", str(int(PAUSE_S * 1000)), "WRITE")  # Redis takes no writes
    t_pause = time.monotonic()
    try:
        for _ in range(4):
            chunks.append(next(it))
        assert time.monotonic() - t_pause < PAUSE_S, "the stream waited for Redis"
        streamed = sum(len(c.token_ids) for c in chunks)
        ck = json.loads(r.get(f"dspark:request:{rid}"))  # reads still work: the checkpoint is behind
        assert len(ck["generated"]) < streamed
        aio.run(victim.grpc.server.stop(0))  # the verifier holding the request crashes, Redis still stalled
        chunks.append(next(it))
        assert time.monotonic() - t_pause < PAUSE_S, "the resume waited for Redis"
        chunks.extend(it)
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        cluster.stop(aio, victim)
    assert [t for c in chunks for t in c.token_ids] == greedy
    assert chunks[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert _failovers() > failovers


def _failovers() -> float:
    from services.common import metrics

    return metrics.FAILOVERS.labels(pool="verifier")._value.get()


def _coalesced(calls, wait_s):
    """Run `calls` [(delay_s, caller)] against one Coalescer; returns (batches, seconds per call)."""
    ex = ThreadPoolExecutor(1)
    c = Coalescer(lambda items: list(items), ex, max_wait_s=wait_s)

    async def one(delay, caller):
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        await c.submit([caller], caller)
        return time.perf_counter() - t0

    async def main():
        return await asyncio.gather(*(one(d, who) for d, who in calls))

    try:
        took = asyncio.run(main())
    finally:
        ex.shutdown()
    return c.batches, took


def test_a_lone_caller_is_not_kept_waiting_and_two_callers_still_merge():
    batches, took = _coalesced([(0.0, "s1")], 0.5)
    assert batches == 1 and took[0] < 0.25  # no company can come: no wait
    # two schedulers: s1's second call waits for s2 (heard from 0.2 s ago), whose call comes 0.1 s later
    batches, took = _coalesced([(0.0, "s1"), (0.0, "s2"), (0.2, "s1"), (0.3, "s2")], 0.5)
    assert batches == 2 and 0.05 < took[2] < 0.45
