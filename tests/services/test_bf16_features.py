"""A bf16 verifier sends its context features as raw bf16 bits; a float32 drafter takes them as they come."""

from __future__ import annotations

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster
from services.common.server import ServerConfig
from services.verifier.server import VerifierApp, VerifierConfig


def _stack(aio, fixtures_dir, **verifier):
    """A verifier (VerifierConfig options `verifier`), a float32 drafter and a scheduler over real sockets."""
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"

    async def make():
        return await VerifierApp(VerifierConfig(str(t), ServerConfig(0, "127.0.0.1", 1.0), device="cpu",
                                                drafter_path=str(d), **verifier)).start()

    v = aio.run(make())
    dr = cluster.drafter(aio, d)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), drafter_addresses=(f"127.0.0.1:{dr.port}",))
    return v, dr, s


def test_bf16_verifier_features_reach_a_float32_drafter(aio, fixtures_dir, reference):
    v, dr, s = _stack(aio, fixtures_dir, dtype="bfloat16")
    try:
        vs, ch = cluster.verifier_stub(v)
        assert vs.GetInfo(types_pb2.VerifierServiceGetInfoRequest()).feature_dtype == types_pb2.DTYPE_BFLOAT16
        resp = vs.Prefill(types_pb2.PrefillRequest(request_id="bf", prompt_token_ids=reference[0][0]))
        assert resp.context_features.hidden_states.dtype == types_pb2.DTYPE_BFLOAT16
        ch.close()
        stub, ch = cluster.scheduler_stub(s)
        out = stub.GenerateUnary(cluster.ids_request(reference[0][0], 12), timeout=60)
        ch.close()
        assert len(out.token_ids) == 12 and out.summary.num_rounds > 0
    finally:
        cluster.stop(aio, s, dr, v)


def test_a_float32_verifier_can_send_its_features_in_bf16_and_the_output_stays_the_targets(aio, fixtures_dir,
                                                                                          reference):
    """--feature-dtype bfloat16 on a float32 target: the features (drafter input only) go out as bf16 from
    Prefill and Verify; verification runs in float32 as before, so greedy output is the target's."""
    import pytest

    import torch

    from services.verifier.servicer import wire_feature_dtype

    with pytest.raises(Exception, match="feature_dtype"):
        wire_feature_dtype("float16", torch.float32)
    assert wire_feature_dtype("auto", torch.float32) == torch.float32  # the default: the target's own
    assert wire_feature_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert wire_feature_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert wire_feature_dtype("auto") is None  # the target's, once it is known

    v, dr, s = _stack(aio, fixtures_dir, dtype="float32", feature_dtype="bfloat16")
    try:
        vs, ch = cluster.verifier_stub(v)
        assert vs.GetInfo(types_pb2.VerifierServiceGetInfoRequest()).feature_dtype == types_pb2.DTYPE_BFLOAT16
        prompt, want = reference[0]
        resp = vs.Prefill(types_pb2.PrefillRequest(request_id="f32", prompt_token_ids=prompt))
        feats = resp.context_features.hidden_states
        assert feats.dtype == types_pb2.DTYPE_BFLOAT16 and len(feats.data) == 2 * len(prompt) * \
            feats.shape[1] * feats.shape[2]
        vr = vs.Verify(types_pb2.VerifyRequest(items=[types_pb2.VerifyItem(
            request_id="f32", anchor_token_id=resp.anchor_token_id, anchor_position=resp.anchor_position)]))
        assert vr.results[0].context_features.hidden_states.dtype == types_pb2.DTYPE_BFLOAT16
        ch.close()
        stub, ch = cluster.scheduler_stub(s)
        out = stub.GenerateUnary(cluster.ids_request(prompt, len(want)), timeout=60)
        ch.close()
        assert list(out.token_ids) == want and out.summary.num_rounds > 0
    finally:
        cluster.stop(aio, s, dr, v)


def test_auto_sends_the_features_in_the_precision_the_drafter_was_trained_on(aio, fixtures_dir, reference, tmp_path):
    """--feature-dtype auto with a drafter whose `context_feature_dtype` is bfloat16 (trained on a bf16 cache): a
    float32 verifier sends bf16 features (half the bytes), and the drafter pod drafts exactly what the embedded
    engine drafts from the float32 ones: the same rounds, the same committed tokens, the target's output."""
    import json
    import shutil

    import torch

    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.stack import load_stack
    from services.verifier.servicer import wire_feature_dtype

    assert wire_feature_dtype("auto", torch.float32, torch.bfloat16) == torch.bfloat16  # narrower: the drafter's
    assert wire_feature_dtype("auto", torch.bfloat16, torch.float32) == torch.bfloat16  # never wider than the target
    assert wire_feature_dtype("float32", torch.float32, torch.bfloat16) == torch.float32  # explicit wins

    d = tmp_path / "dspark-bf16"
    shutil.copytree(fixtures_dir / "dspark", d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "context_feature_dtype": "bfloat16"}))
    t = fixtures_dir / "target"
    prompt, want = reference[0]

    async def make():
        return await VerifierApp(VerifierConfig(str(t), ServerConfig(0, "127.0.0.1", 1.0), device="cpu",
                                                dtype="float32", drafter_path=str(d))).start()

    v = aio.run(make())
    dr = cluster.drafter(aio, d)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), drafter_addresses=(f"127.0.0.1:{dr.port}",))
    try:
        vs, ch = cluster.verifier_stub(v)
        assert vs.GetInfo(types_pb2.VerifierServiceGetInfoRequest()).feature_dtype == types_pb2.DTYPE_BFLOAT16
        resp = vs.Prefill(types_pb2.PrefillRequest(request_id="auto", prompt_token_ids=prompt))
        assert resp.context_features.hidden_states.dtype == types_pb2.DTYPE_BFLOAT16
        ch.close()
        stub, ch = cluster.scheduler_stub(s)
        out = stub.GenerateUnary(cluster.ids_request(prompt, len(want)), timeout=60)
        ch.close()
    finally:
        cluster.stop(aio, s, dr, v)
    assert list(out.token_ids) == want
    # the embedded engine on float32 features, the same drafter (and the scheduler's lookup drafts): the same number
    # of rounds for the same tokens
    target, drafter = load_stack(str(t), str(d), device="cpu", dtype="float32")
    engine = Engine(target, drafter, EngineConfig(policy="fixed", lookup_ngram=s.config.lookup_ngram))
    rid = engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_new_tokens=len(want)))
    req = engine.requests[rid]
    while not req.finished:
        engine.step()
    assert list(req.output_ids) == want
    assert out.summary.num_rounds == engine.num_steps
