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
