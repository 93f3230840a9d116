"""A verifier frees the KV caches of requests whose scheduler vanished: after idle_ttl_s without prefill,
verify or resume a request is released and counted in dspark_verifier_expired_requests_total; a request
that keeps being verified stays, and a released one is UNKNOWN_REQUEST (a live scheduler would Resume)."""

from __future__ import annotations

import time

import pytest

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster
from services.common.identity import key  # the verifier keys state by caller + id

TTL = 0.6
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def short_ttl_verifier(aio, fixtures_dir):
    v = cluster.verifier(aio, fixtures_dir / "target", fixtures_dir / "dspark", vid="v-ttl", idle_ttl_s=TTL)
    stub, ch = cluster.verifier_stub(v)
    yield v, stub
    ch.close()
    cluster.stop(aio, v)


def _expired() -> float:
    from services.common import metrics

    return metrics.VERIFIER_EXPIRED._value.get()


def test_idle_request_is_released_and_counted_busy_one_is_kept(short_ttl_verifier):
    v, stub = short_ttl_verifier
    before = _expired()
    anchors = {}
    for rid in ("idle", "busy"):
        resp = stub.Prefill(types_pb2.PrefillRequest(request_id=rid, prompt_token_ids=[5, 6, 7]), timeout=30)
        anchors[rid] = (resp.anchor_token_id, resp.anchor_position)
    assert v.servicer.verifier.num_active == 2
    deadline = time.monotonic() + 3 * TTL + 5
    while key("/", "idle") in v.servicer.verifier and time.monotonic() < deadline:
        anchor, pos = anchors["busy"]  # a live scheduler's rounds: a plain decode step each
        res = stub.Verify(types_pb2.VerifyRequest(items=[types_pb2.VerifyItem(
            request_id="busy", anchor_token_id=anchor, anchor_position=pos)]), timeout=30).results[0]
        assert res.status == types_pb2.ITEM_STATUS_OK
        anchors["busy"] = (res.committed_token_ids[-1], pos + len(res.committed_token_ids))
        time.sleep(TTL / 6)
    assert key("/", "idle") not in v.servicer.verifier and key("/", "busy") in v.servicer.verifier
    assert _expired() - before == 1
    from services.common import metrics

    assert "dspark_verifier_expired_requests_total 1.0" in metrics.render().decode()
    gone = stub.Verify(types_pb2.VerifyRequest(items=[types_pb2.VerifyItem(
        request_id="idle", anchor_token_id=anchors["idle"][0], anchor_position=anchors["idle"][1])]), timeout=30)
    assert gone.results[0].status == types_pb2.ITEM_STATUS_UNKNOWN_REQUEST
    # Release frees it now; the sweep has nothing left to expire (the counter does not move)
    assert stub.Release(types_pb2.VerifierServiceReleaseRequest(request_ids=["busy"]), timeout=30).num_released == 1
    time.sleep(2 * TTL)
    assert v.servicer.verifier.num_active == 0 and _expired() - before == 1 and not v.servicer.owned


def test_idle_ttl_must_be_non_negative(fixtures_dir):
    from dspark_core.errors import InvalidArgument
    from services.verifier.server import VerifierConfig

    with pytest.raises(InvalidArgument) as e:
        VerifierConfig(str(fixtures_dir / "target"), cluster.LOCAL, idle_ttl_s=-1)
    assert "idle_ttl_s" in str(e.value) and "-1" in str(e.value)
