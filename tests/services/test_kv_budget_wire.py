"""A KV budget through the services: a request whose whole context cannot fit the verifier's KV budget gets
RESOURCE_EXHAUSTED naming the budget, while requests that fit are served beside it, token for token the target's
own. The attacker's many-long-requests flood costs only its own requests."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime

import svc_cluster as cluster
from svc_cluster import ids_request

PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22], [2, 4, 6]]


@pytest.fixture(scope="module")
def served(aio, tiny_target_dir):
    per = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32")).kv_bytes_per_token
    # room for one request of 16 new tokens at a time (~60 positions), none that may fill the 128-position window
    s = cluster.scheduler(aio, embedded_target=str(tiny_target_dir), kv_cache_bytes=100 * per)
    stub, ch = cluster.scheduler_stub(s)
    yield stub
    ch.close()
    cluster.stop(aio, s)


def test_requests_beyond_the_budget_are_refused_alone_and_the_rest_are_served(served, tiny_target_dir):
    ar = Engine(TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32")), None,
                EngineConfig(policy="ar"))
    want = [ar.generate(p, SamplingParams(temperature=0, max_new_tokens=16)).output_ids for p in PROMPTS]
    with pytest.raises(grpc.RpcError) as e:
        served.GenerateUnary(ids_request(PROMPTS[0], 2000), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV cache budget" in e.value.details()

    def one(i):
        if i % 2:  # a flood of requests that can never fit, interleaved with ones that can
            try:
                served.GenerateUnary(ids_request(PROMPTS[i % 4], 5000), timeout=60)
            except grpc.RpcError as exc:
                return exc.code()
            return "served"
        return list(served.GenerateUnary(ids_request(PROMPTS[i % 4], 16), timeout=120).token_ids)

    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    for i, out in enumerate(outs):
        assert out == (grpc.StatusCode.RESOURCE_EXHAUSTED if i % 2 else want[i % 4]), (i, out)


@pytest.fixture(scope="module")
def distributed(aio, tiny_target_dir):
    """A verifier pod with room for one request of 16 new tokens at a time, and a scheduler that reaches it over a
    socket (no drafter: the refusals are the verifier's)."""
    per = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32")).kv_bytes_per_token
    v = cluster.verifier(aio, tiny_target_dir, kv_cache_bytes=100 * per)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), use_drafter=False)
    stub, ch = cluster.scheduler_stub(s)
    yield stub, v
    ch.close()
    cluster.stop(aio, s, v)


def test_a_remote_verifiers_kv_refusal_says_whether_the_request_fits_alone(distributed, tiny_target_dir):
    from dspark_protos.dspark.v1 import types_pb2

    from services.common.errors import KV_FITS_ALONE

    _, v = distributed
    stub, ch = cluster.verifier_stub(v)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(types_pb2.PrefillRequest(request_id="huge", prompt_token_ids=PROMPTS[0],
                                                  sampling=types_pb2.SamplingParams(max_new_tokens=5000)), timeout=60)
    finally:
        ch.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV cache budget" in e.value.details()
    assert (KV_FITS_ALONE, "0") in tuple(e.value.trailing_metadata())


def test_requests_that_fit_one_at_a_time_wait_for_kv_room_on_a_remote_verifier(distributed, tiny_target_dir):
    """Embedded, a request that fits alone waits at the head of the queue; through a remote verifier too (before,
    the scheduler failed it with RESOURCE_EXHAUSTED). One that can never fit is still refused, alone."""
    stub, _ = distributed
    ar = Engine(TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32")), None,
                EngineConfig(policy="ar"))
    want = [ar.generate(p, SamplingParams(temperature=0, max_new_tokens=16)).output_ids for p in PROMPTS]

    def one(i):
        try:
            return list(stub.GenerateUnary(ids_request(PROMPTS[i % 4], 5000 if i == 5 else 16), timeout=120).token_ids)
        except grpc.RpcError as exc:
            return exc.code()

    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, range(6)))
    for i, out in enumerate(outs):
        assert out == (grpc.StatusCode.RESOURCE_EXHAUSTED if i == 5 else want[i % 4]), (i, out)
