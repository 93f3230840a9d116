"""Health is NOT_SERVING (and RPCs UNAVAILABLE) until the model is loaded and warmed up; then SERVING.
SIGTERM-style drain refuses new calls and lets in-flight ones finish."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_protos.dspark.v1 import types_pb2, verifier_service_pb2_grpc
from services.common.server import ServerConfig
from services.verifier.server import VerifierApp, VerifierConfig


def _health(port, service=""):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_verifier_health_serving_only_after_load_and_warmup(aio, fixtures_dir):
    async def make():
        return VerifierApp(VerifierConfig(str(fixtures_dir / "target"), ServerConfig(0, "127.0.0.1", 1.0),
                                          device="cpu", dtype="float32", tap_layer_ids=(0, 1, 2)))

    app = aio.run(make())
    aio.run(app.start_server())
    try:
        assert _health(app.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert _health(app.port, "dspark.v1.VerifierService") == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                verifier_service_pb2_grpc.VerifierServiceStub(ch).Prefill(
                    types_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
        aio.run(app.load())
        assert _health(app.port) == health_pb2.HealthCheckResponse.SERVING
        assert _health(app.port, "dspark.v1.VerifierService") == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = verifier_service_pb2_grpc.VerifierServiceStub(ch)
            resp = stub.Prefill(types_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3]), timeout=30)
            assert resp.anchor_position == 3
            assert list(resp.context_features.hidden_states.shape) == [3, 3, 64]
            # draining: health goes NOT_SERVING, new calls are refused
            app.grpc.draining = True
            with pytest.raises(grpc.RpcError) as e:
                stub.Release(types_pb2.VerifierServiceReleaseRequest(request_ids=["r"]), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    finally:
        aio.run(app.stop(0))
