"""EAGLE-3 over the services: ProposeItem.context_token_ids carries the tokens at the feature rows, so the
drafter service drafts from exactly what the embedded engine's drafter sees.

Greedy output through verifier + drafter + scheduler equals the embedded Engine's token for token AND
round for round (accepted drafts per round), which placeholder context tokens would not give. The drafter
refuses context_token_ids that do not line up with the feature rows.
"""

from __future__ import annotations

import pytest

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster
from svc_cluster import ids_request

NEW = 48
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eagle3_stack(aio, fixtures_dir):
    t, d = fixtures_dir / "target", fixtures_dir / "eagle3"
    v = cluster.verifier(aio, t, d, vid="v-eagle3")
    dr = cluster.drafter(aio, d, did="d-eagle3")
    # the fixture's random Eagle3 accepts almost nothing, so the scheduler's collapse alarm (on by default)
    # would stop its drafting: off here, where the wire path is compared round for round with a plain engine
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",),
                          drafter_addresses=(f"127.0.0.1:{dr.port}",), collapse_ratio=None)
    stub, ch = cluster.scheduler_stub(s)
    yield {"v": v, "d": dr, "s": s, "stub": stub}
    ch.close()
    cluster.stop(aio, s, dr, v)


def embedded(fixtures_dir, prompts, n):
    """(token_ids, accepted_per_round) per prompt from the in-process Engine, one request at a time."""
    from dspark_core.drafters import load_drafter
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    drafter = load_drafter(fixtures_dir / "eagle3")
    target = TargetRuntime(TargetConfig(str(fixtures_dir / "target"), device="cpu", dtype="float32",
                                        tap_layer_ids=tuple(drafter.target_layer_ids)))
    engine = Engine(target, drafter, EngineConfig(policy="fixed"))
    out = []
    for p in prompts:
        req = engine.generate(p, SamplingParams(temperature=0, max_new_tokens=n,
                                                stop_token_ids=tuple(target.eos_token_ids)))
        out.append((req.output_ids, req.accepted_per_round))
    return out


def through_services(stub, prompt, n):
    chunks = list(stub.Generate(ids_request(prompt, n, cls=types_pb2.GenerateRequest), timeout=120))
    tokens = [t for c in chunks for t in c.token_ids]
    accepted = [c.round.num_accepted for c in chunks if c.HasField("round")]
    return tokens, accepted


def test_greedy_eagle3_through_services_equals_embedded_engine_round_for_round(eagle3_stack, reference, fixtures_dir):
    prompts = [p for p, _ in reference]
    want = embedded(fixtures_dir, prompts, NEW)
    got = [through_services(eagle3_stack["stub"], p, NEW) for p in prompts]
    for (tokens, accepted), (want_tokens, want_accepted), (_, greedy) in zip(got, want, reference):
        assert tokens == want_tokens == greedy[:NEW]
        assert accepted == want_accepted
    # the drafter really drafted
    assert sum(sum(a) for _, a in got) > 0


def test_context_token_ids_must_line_up_with_feature_rows(eagle3_stack):
    import torch

    from dspark_protos.tensors import tensor_to_proto

    stub, ch = cluster.drafter_stub(eagle3_stack["d"])
    info = stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest())
    feats = torch.zeros((3, len(info.target_layer_ids), info.target_hidden_size))

    def item(tokens):
        it = types_pb2.ProposeItem(request_id="eagle3-bad", anchor_token_id=1, anchor_position=3,
                                   context_token_ids=tokens)
        it.context_features.start_position = 0
        tensor_to_proto(feats, it.context_features.hidden_states)
        return it

    try:
        short = stub.Propose(types_pb2.ProposeRequest(items=[item([1, 2])])).proposals[0]
        assert short.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
        assert "context_token_ids" in short.error_message and "3" in short.error_message
        bad = stub.Propose(types_pb2.ProposeRequest(items=[item([1, 2, 10 ** 6])])).proposals[0]
        assert bad.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
        assert "context_token_ids" in bad.error_message and "1000000" in bad.error_message
        ok = stub.Propose(types_pb2.ProposeRequest(items=[item([1, 2, 3])])).proposals[0]
        assert ok.status == types_pb2.ITEM_STATUS_OK and ok.context_length == 3
    finally:
        stub.Release(types_pb2.DrafterServiceReleaseRequest(request_ids=["eagle3-bad"]))
        ch.close()
