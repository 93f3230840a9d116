"""The drafter's context window over the wire (EngineConfig.draft_window, `--draft-window`): a Prefill that
sets context_feature_rows gets only the prompt's last rows back (start_position says where they begin), a
ProposeItem with begins_context starts a request's drafter context there, and the scheduler uses both while
the output stays the target's own. Hostile values fail their item alone, naming the field."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from dspark_protos.dspark.v1 import types_pb2
from dspark_protos.tensors import tensor_to_proto
from services.common.convert import features_from_proto

import svc_cluster as cluster
from svc_cluster import ids_request

WINDOW = 8


@pytest.fixture(scope="module")
def stack(aio, redis_server, fixtures_dir):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v = cluster.verifier(aio, t, d, redis_server.url, "wv1")
    dr = cluster.drafter(aio, d, redis_server.url, "wd1")
    s = cluster.scheduler(aio, redis_url=redis_server.url, draft_window=WINDOW, policy="fixed")
    stub, ch = cluster.scheduler_stub(s)
    yield {"v": v, "d": dr, "s": s, "stub": stub}
    ch.close()
    cluster.stop(aio, s, dr, v)


def test_a_prefill_returns_the_rows_it_asks_for(stack):
    stub, ch = cluster.verifier_stub(stack["v"])
    prompt = list(range(30, 44))
    try:
        full = stub.Prefill(types_pb2.PrefillRequest(request_id="full", prompt_token_ids=prompt), timeout=30)
        assert full.context_features.start_position == 0
        whole = features_from_proto(full.context_features, "f")
        assert whole.shape[0] == 14
        for rows, start in ((5, 9), (0, 14), (50, 0)):
            resp = stub.Prefill(types_pb2.PrefillRequest(request_id=f"w{rows}", prompt_token_ids=prompt,
                                                         context_feature_rows=rows), timeout=30)
            assert resp.context_features.start_position == start
            assert resp.anchor_token_id == full.anchor_token_id
            got = features_from_proto(resp.context_features, "f")
            assert got.shape[0] == 14 - start
            if got.shape[0]:
                assert torch.equal(got, whole[start:])
        stub.Release(types_pb2.VerifierServiceReleaseRequest(request_ids=["full", "w5", "w0", "w50"]))
    finally:
        ch.close()


def _item(rid, feats, start, begins, anchor=7):
    it = types_pb2.ProposeItem(request_id=rid, anchor_token_id=anchor, anchor_position=start + feats.shape[0],
                               begins_context=begins)
    it.context_features.start_position = start
    tensor_to_proto(feats, it.context_features.hidden_states)
    return it


def test_a_drafter_context_begins_where_the_scheduler_says_and_hostile_starts_fail_alone(stack):
    stub, ch = cluster.drafter_stub(stack["d"])
    info = stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest())
    feats = torch.randn((6, len(info.target_layer_ids), info.target_hidden_size))
    try:
        resp = stub.Propose(types_pb2.ProposeRequest(items=[
            _item("late", feats, 50, True),
            _item("lost", feats, 30, False),  # a context the drafter does not hold, without begins_context
            _item("far", feats, 2**31, True),  # past every position table: refused, never allocated
            _item("fine", feats, 0, False)]), timeout=30)
        st = [p.status for p in resp.proposals]
        assert st == [types_pb2.ITEM_STATUS_OK, types_pb2.ITEM_STATUS_UNKNOWN_REQUEST,
                      types_pb2.ITEM_STATUS_INVALID_ARGUMENT, types_pb2.ITEM_STATUS_OK]
        assert resp.proposals[0].context_length == 56 and resp.proposals[3].context_length == 6
        assert "anchor_pos" in resp.proposals[2].error_message
        # it continues from there; begins_context again starts it over
        nxt = stub.Propose(types_pb2.ProposeRequest(items=[_item("late", feats[:2], 56, False)]), timeout=30)
        assert nxt.proposals[0].status == types_pb2.ITEM_STATUS_OK and nxt.proposals[0].context_length == 58
        again = stub.Propose(types_pb2.ProposeRequest(items=[_item("late", feats[:3], 100, True)]), timeout=30)
        assert again.proposals[0].status == types_pb2.ITEM_STATUS_OK and again.proposals[0].context_length == 103
        stub.Release(types_pb2.DrafterServiceReleaseRequest(request_ids=["late", "fine"]))
    finally:
        ch.close()


def test_the_scheduler_drafts_from_the_window_and_the_output_is_the_targets(stack, reference, fixtures_dir):
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams

    drafter = stack["d"].servicer.drafter
    target = stack["v"].servicer.verifier.target
    # prompts longer than the window: each fixture prompt followed by the target's own continuation
    base = [p for p, _ in reference]
    ar = Engine(target, None, EngineConfig(policy="ar"))
    prompts = [p + ar.generate(p, SamplingParams(temperature=0, max_new_tokens=12)).output_ids for p in base]
    want = [ar.generate(p, SamplingParams(temperature=0, max_new_tokens=16)).output_ids for p in prompts]
    firsts = []
    real = drafter.propose

    def spy(items):
        out = real(items)
        firsts.extend((it.state.first, it.anchor_pos) for it in items)
        return out

    drafter.propose = spy
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: stack["stub"].GenerateUnary(ids_request(p, 16), timeout=120), prompts))
    finally:
        del drafter.propose
    assert [list(o.token_ids) for o in outs] == want
    assert sum(o.summary.accepted_per_round for o in outs) > 0
    starts = {len(p) - WINDOW for p in prompts}
    assert {f for f, _ in firsts} == starts  # every context began WINDOW positions before its prompt's end
