"""Between pods, per request: what one item of a Verify / Propose call (or one scheduler) sends can fail that
item alone, never its neighbours in the pass, and every value a hop accepts is accepted by the next one.
Real verifier and drafter apps on loopback ports, called as a scheduler calls them."""

from __future__ import annotations

import pytest
import torch

from dspark_protos.dspark.v1 import types_pb2
from dspark_protos.tensors import tensor_to_proto

import svc_cluster as cluster
from services.common.identity import key

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pods(aio, fixtures_dir):
    v = cluster.verifier(aio, fixtures_dir / "target", fixtures_dir / "dspark", vid="v-iso")
    d = cluster.drafter(aio, fixtures_dir / "dspark", did="d-iso")
    vstub, vch = cluster.verifier_stub(v)
    dstub, dch = cluster.drafter_stub(d)
    yield {"v": v, "d": d, "vstub": vstub, "dstub": dstub}
    vch.close()
    dch.close()
    cluster.stop(aio, v, d)


def _features(d, rows: int, seed: int = 0) -> torch.Tensor:
    s = d.servicer
    return torch.randn((rows, s.num_layers, s.hidden), generator=torch.Generator().manual_seed(seed))


def _item(d, rid: str, rows: int = 4, start: int = 0, feats=None, **kw) -> types_pb2.ProposeItem:
    seed = kw.pop("seed", None)
    it = types_pb2.ProposeItem(request_id=rid, anchor_token_id=5, anchor_position=start + rows, **kw)
    if seed is not None:
        it.seed = seed
    it.context_features.start_position = start
    tensor_to_proto(_features(d, rows) if feats is None else feats, it.context_features.hidden_states)
    return it


def _propose(pods, *items, **kw):
    return pods["dstub"].Propose(types_pb2.ProposeRequest(items=list(items)), timeout=30, **kw).proposals


def test_a_sampling_floor_accepted_at_the_front_door_is_accepted_by_the_drafter(pods):
    """temperature / repetition_penalty exactly at their floors (1e-6) pass the front door's check, then travel
    as float32 (9.99999997e-07): the drafter's check of the item's processing must not refuse them."""
    from dspark_core.sampling import SamplingParams
    from services.common.convert import params_from_proto, params_to_proto
    from services.common.limits import check_sampling

    for fields in ({"temperature": 1e-6, "presence_penalty": 0.5}, {"temperature": 1.0, "repetition_penalty": 1e-6}):
        p = check_sampling(SamplingParams(**fields))
        check_sampling(params_from_proto(params_to_proto(p)))  # the next hop's check of what arrives
        it = _item(pods["d"], f"floor-{len(fields)}-{fields['temperature']}", temperature=1.0, seed=1)
        params_to_proto(p, it.processing.params, complete_stop_set=True)
        it.processing.prompt_token_ids.extend([1, 2, 3, 4, 5])
        [prop] = _propose(pods, it)
        assert prop.status == types_pb2.ITEM_STATUS_OK, prop.error_message
        assert prop.processed


def test_one_id_twice_in_a_propose_refuses_the_second_and_keeps_the_firsts_context(pods):
    """The second item of one id is refused; it must not reset the context the first one just drafted from
    (begins_context), or that request's next round finds no context (POSITION_MISMATCH)."""
    d = pods["d"]
    assert _propose(pods, _item(d, "twice", rows=4))[0].status == types_pb2.ITEM_STATUS_OK
    first, second = _propose(pods, _item(d, "twice", rows=3, start=4, begins_context=True),
                             _item(d, "twice", rows=3, start=4, begins_context=True))
    assert first.status == types_pb2.ITEM_STATUS_OK and first.context_length == 7
    assert second.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT and "twice in one batch" in second.error_message
    assert d.servicer.contexts[key("/", "twice")].state.length == 7
    [nxt] = _propose(pods, _item(d, "twice", rows=1, start=7))
    assert nxt.status == types_pb2.ITEM_STATUS_OK, nxt.error_message


@pytest.mark.parametrize("bad", ["nan", "tiny-temperature"])
def test_an_item_that_breaks_the_pass_fails_alone_and_its_neighbour_is_drafted_as_alone(pods, bad):
    """A sampled item whose draft cannot be drawn (NaN features, a temperature that overflows the logits) used
    to fail the batched pass after every item's context was extended: each item's retry alone then found its
    context one step ahead and failed too. It is refused by name, and the neighbour drafts what it drafts
    alone."""
    d = pods["d"]
    feats = _features(d, 4, seed=3)
    feats[1, 0, 0] = float("nan") if bad == "nan" else feats[1, 0, 0]
    temp = 1e-45 if bad == "tiny-temperature" else 1.0
    alone = _propose(pods, _item(d, f"alone-{bad}", temperature=1.0, seed=7))[0]
    sick, ok = _propose(pods, _item(d, f"sick-{bad}", feats=feats, temperature=temp, seed=1),
                        _item(d, f"ok-{bad}", temperature=1.0, seed=7))
    assert ok.status == types_pb2.ITEM_STATUS_OK, ok.error_message
    assert list(ok.draft_token_ids) == list(alone.draft_token_ids)
    assert d.servicer.contexts[key("/", f"ok-{bad}")].state.length == 4
    assert sick.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
    field = "items[0].context_features" if bad == "nan" else "items[0].temperature"
    assert field in sick.error_message, sick.error_message
    assert key("/", f"sick-{bad}") not in d.servicer.contexts


def test_a_pass_that_fails_after_extending_the_contexts_is_undone_before_each_item_is_retried(pods):
    """Below the RPC's checks: whatever makes a batched pass fail after it extended every item's context and drew
    from their generators, each item's retry alone starts from where it was, so the neighbour drafts what it
    drafts alone and its context holds its rows once."""
    from services.drafter.servicer import _Job

    d = pods["d"]
    s = d.servicer
    alone = _propose(pods, _item(d, "rb-alone", temperature=1.0, seed=7))[0]
    feats = _features(d, 4).reshape(4, -1)
    jobs = [_Job(0, key("/", "rb-sick"), feats, 0, 5, 4, 1e-45, 1, s.drafter.block_size),  # past Propose's check
            _Job(1, key("/", "rb-ok"), feats, 0, 5, 4, 1.0, 7, s.drafter.block_size)]
    sick, ok = s.executor.submit(s._propose_batch, jobs).result(60)
    assert sick[0] == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
    prop, _ = ok
    assert list(prop.tokens) == list(alone.draft_token_ids)
    assert s.contexts[key("/", "rb-ok")].state.length == 4 and key("/", "rb-sick") not in s.contexts


def test_a_scheduler_whose_drafter_refuses_one_item_keeps_the_other_items_drafts(pods):
    """RemoteDrafter: the drafter refusing one request's item (here NaN features) orphans that request alone;
    the others of the round keep their proposals and their contexts on the drafter (orphaning them dropped
    their contexts, which the next round rebuilt from a verifier Resume each)."""
    from dspark_core.drafters.base import ProposeItem
    from dspark_protos.dspark.v1 import drafter_service_pb2_grpc, verifier_service_pb2_grpc
    from services.scheduler.pods import PodPool
    from services.scheduler.remote import RemoteDrafter, RemoteVerifier

    d = pods["d"]
    vpool = PodPool("verifier", verifier_service_pb2_grpc.VerifierServiceStub, (f"127.0.0.1:{pods['v'].port}",))
    dpool = PodPool("drafter", drafter_service_pb2_grpc.DrafterServiceStub, (f"127.0.0.1:{d.port}",))
    try:
        rv = RemoteVerifier(vpool, caller="sched-iso")
        info = rv.info()
        rd = RemoteDrafter.connect(dpool, rv, info.hidden_size, info.vocab_size)
        good_feats = _features(d, 4, seed=5).reshape(4, -1)
        bad_feats = good_feats.clone()
        bad_feats[2, 7] = float("nan")

        def item(rid, feats):
            return ProposeItem(state=rd.new_state_for(rid), new_features=feats, new_positions_start=0,
                               new_tokens=[1, 2, 3, 4], anchor=5, anchor_pos=4, temperature=0.0)

        bad, good = item("iso-bad", bad_feats), item("iso-good", good_feats)
        pbad, pgood = rd.propose([bad, good])
        assert pbad.tokens == [] and bad.state.resend
        assert len(pgood.tokens) == rd.block_size and not good.state.resend and good.state.length == 4
        assert key("/sched-iso", "iso-good") in d.servicer.contexts
        rd.release_state(good.state)
        rd.release_state(bad.state)
    finally:
        vpool.close()
        dpool.close()


@pytest.mark.parametrize("anchor", [-5, 10**6])
def test_resume_refuses_generated_tokens_outside_the_vocabulary_and_holds_nothing(pods, anchor):
    """Resume's last generated token (the anchor, not in the rebuilt KV cache) was never checked: a slot was
    held for a request whose anchor no forward pass can take."""
    import grpc

    v, stub = pods["v"], pods["vstub"]
    before = v.servicer.verifier.num_active
    with pytest.raises(grpc.RpcError) as e:
        stub.Resume(types_pb2.ResumeRequest(request_id="resume-oov", prompt_token_ids=[3, 4, 5],
                                            generated_token_ids=[7, anchor]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generated" in e.value.details() and str(anchor) in e.value.details()
    assert v.servicer.verifier.num_active == before and key("/", "resume-oov") not in v.servicer.owned


@pytest.mark.parametrize("fields, name", [({"temperature": 1e-45}, "sampling.temperature"),
                                          ({"temperature": 1.0, "repetition_penalty": 1e-45},
                                           "sampling.repetition_penalty")])
def test_the_verifier_refuses_sampling_values_the_front_door_refuses_by_their_field(pods, fields, name):
    """A scheduler's Prefill / Resume sampling is checked as the front door checks it: a temperature that
    overflows the logits was refused only as 'probs must have a positive total mass' (a field of no request)."""
    import grpc

    stub = pods["vstub"]
    sp = types_pb2.SamplingParams(**fields)
    for call in (lambda: stub.Prefill(types_pb2.PrefillRequest(request_id="floor-p", prompt_token_ids=[3, 4, 5],
                                                               sampling=sp), timeout=30),
                 lambda: stub.Resume(types_pb2.ResumeRequest(request_id="floor-r", prompt_token_ids=[3, 4, 5],
                                                             generated_token_ids=[6], sampling=sp), timeout=30)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in e.value.details(), e.value.details()


def test_a_failed_prefill_batch_releases_its_neighbours_slots_after_their_prefills_land(aio, fixtures_dir):
    """RemoteVerifier.prefill: one item of a batch refused while its neighbour's Prefill is still on its way
    released the neighbour at once, fire and forget; the Release could reach the verifier before the Prefill it
    was meant to undo, which then registered the request and held its KV slot for nobody until idle expiry.
    The verifier here waits 100 ms for company before a Prefill (--coalesce-wait-s), as a busy pod may."""
    import time

    from dspark_core.sampling import SamplingParams
    from dspark_core.verifier import PrefillItem
    from dspark_protos.dspark.v1 import verifier_service_pb2_grpc
    from services.scheduler.pods import PodPool
    from services.scheduler.remote import RemoteVerifier

    v = cluster.verifier(aio, fixtures_dir / "target", vid="v-slow-prefill", coalesce_wait_s=0.1)
    vpool = PodPool("verifier", verifier_service_pb2_grpc.VerifierServiceStub, (f"127.0.0.1:{v.port}",))
    try:
        rv = RemoteVerifier(vpool, caller="sched-prefill")
        before = v.servicer.verifier.num_active
        for round_ in range(3):
            bad = PrefillItem(request_id=f"pf-bad-{round_}", prompt_ids=[3, 4, 5],
                              params=SamplingParams(temperature=1e-45))
            good = PrefillItem(request_id=f"pf-good-{round_}", prompt_ids=[(7 * i) % 200 + 3 for i in range(200)],
                               params=SamplingParams())
            with pytest.raises(Exception, match="temperature"):
                rv.prefill([bad, good])
            assert not rv.requests
            time.sleep(0.5)  # past the verifier's wait: a Prefill still on its way has landed by now
            assert v.servicer.verifier.num_active == before, f"round {round_}: a released neighbour holds a slot"
            assert key("/sched-prefill", good.request_id) not in v.servicer.owned
    finally:
        vpool.close()
        cluster.stop(aio, v)
