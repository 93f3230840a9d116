"""Starting and stopping in-process service apps on loopback ports for the service tests.

Apps must be constructed on the event loop that serves them (grpc.aio binds a server to its loop), so
everything goes through `LoopThread.run`.
"""

from __future__ import annotations

import grpc

from dspark_protos.dspark.v1 import (drafter_service_pb2_grpc, scheduler_service_pb2_grpc, types_pb2,
                                     verifier_service_pb2_grpc)
from services.common.server import ServerConfig
from services.drafter.server import DrafterApp, DrafterAppConfig
from services.scheduler.server import SchedulerApp, SchedulerConfig
from services.verifier.server import VerifierApp, VerifierConfig

LOCAL = ServerConfig(0, "127.0.0.1", drain_seconds=1.0)


async def _make(cls, cfg, start=True):
    app = cls(cfg)
    return await app.start() if start else app


def verifier(aio, target, drafter_path=None, redis_url=None, vid=None, **kw) -> VerifierApp:
    return aio.run(_make(VerifierApp, VerifierConfig(str(target), LOCAL, device="cpu", dtype="float32",
                                                     drafter_path=str(drafter_path) if drafter_path else None,
                                                     redis_url=redis_url, verifier_id=vid, heartbeat_s=0.5, **kw)))


def drafter(aio, path, redis_url=None, did=None, **kw) -> DrafterApp:
    return aio.run(_make(DrafterApp, DrafterAppConfig(str(path), LOCAL, device="cpu", dtype="float32",
                                                      redis_url=redis_url, drafter_id=did, heartbeat_s=0.5, **kw)))


def scheduler(aio, **kw) -> SchedulerApp:
    kw.setdefault("startup_wait_s", 30.0)
    return aio.run(_make(SchedulerApp, SchedulerConfig(LOCAL, device="cpu", dtype="float32", **kw)))


def stop(aio, *apps) -> None:
    for a in apps:
        if a is not None:
            aio.run(a.stop(0))


def scheduler_stub(app):
    ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
    return scheduler_service_pb2_grpc.SchedulerServiceStub(ch), ch


def verifier_stub(app):
    ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
    return verifier_service_pb2_grpc.VerifierServiceStub(ch), ch


def drafter_stub(app):
    ch = grpc.insecure_channel(f"127.0.0.1:{app.port}")
    return drafter_service_pb2_grpc.DrafterServiceStub(ch), ch


def wait_serving(port: int, timeout: float = 240, proc=None) -> None:
    """Until grpc.health on 127.0.0.1:port says SERVING (AssertionError after `timeout` s, or if `proc` exits)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            assert proc is None or proc.poll() is None, "the service exited"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise AssertionError(f"port {port} never became SERVING")


def ids_request(ids, max_new_tokens=16, cls=types_pb2.GenerateUnaryRequest, **sampling):
    return cls(prompt_token_ids=types_pb2.TokenIds(token_ids=list(ids)),
               sampling=types_pb2.SamplingParams(max_new_tokens=max_new_tokens, **sampling))
