"""A bf16 verifier sends its context features as raw bf16 bits; a float32 drafter takes them as they come."""

from __future__ import annotations

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster
from services.common.server import ServerConfig
from services.verifier.server import VerifierApp, VerifierConfig


def test_bf16_verifier_features_reach_a_float32_drafter(aio, fixtures_dir, reference):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"

    async def make():
        return await VerifierApp(VerifierConfig(str(t), ServerConfig(0, "127.0.0.1", 1.0), device="cpu",
                                                dtype="bfloat16", drafter_path=str(d))).start()

    v = aio.run(make())
    dr = cluster.drafter(aio, d)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), drafter_addresses=(f"127.0.0.1:{dr.port}",))
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
