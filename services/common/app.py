"""What the verifier, drafter and scheduler apps share: identity, Redis wiring and their run loop.

An app is started in-process (`await app.start()`, tests do this) or by its `main.py` (which then waits
for SIGTERM and drains). Knows nothing about models.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("dspark.app")


def default_pod_id(kind: str, port: int) -> str:
    """POD_NAME in Kubernetes (the entry point reads env and passes it), else host-kind-port."""
    return f"{socket.gethostname()}-{kind}-{port}-{os.getpid()}"


def advertise_address(host: str | None, port: int, address: str | None = None) -> str:
    """The host:port published in Redis: an explicit address (DSPARK_POD_ADDRESS) wins over host + port."""
    return address or f"{host or '127.0.0.1'}:{port}"


class ServingApp:
    """Start-up shared by every app: serve first (health NOT_SERVING), then `load()` and report SERVING.

    The app provides `grpc` (GrpcService) and `async load()`.
    """

    async def start(self):
        """Serve (health NOT_SERVING), say whether Redis answers, load and warm up, then report SERVING."""
        await self.start_server()
        registry = getattr(self, "registry", None)
        if registry is not None and not await asyncio.to_thread(registry.ping):
            log.warning("redis is unreachable at start-up: coordination is off until it answers",
                        extra={"url": registry.config.url})
        await self.load()
        return self

    async def start_server(self) -> None:
        await self.grpc.start()


class PodLifecycle(ServingApp):
    """Identity, going live, draining and shutting down, shared by the verifier and drafter apps.

    The app provides `servicer` (with `close()`), `record()`, `load()` and `config.heartbeat_s`;
    `_init_pod` sets up `grpc`, `port`, `id`, `executor`, `registry` and `heartbeat`.
    """

    def _init_pod(self, kind: str, config, service_name: str, pod_id: str | None, make_servicer, add_to_server):
        """The gRPC server, pod id, one model thread, the servicer (`make_servicer(id, executor)`) and Redis."""
        from .registry import Registry, RegistryConfig
        from .server import GrpcService

        self.config = config
        self.grpc = GrpcService(config.server, [service_name])
        self.port = self.grpc.port
        self.id = pod_id or default_pod_id(kind, self.port)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{kind}-model")
        self.servicer = make_servicer(self.id, self.executor)
        add_to_server(self.servicer, self.grpc.server)
        self.registry = Registry(RegistryConfig(config.redis_url)) if config.redis_url else None
        self.heartbeat = None

    async def go_live(self) -> None:
        """Report SERVING, then publish this pod in Redis and keep its record fresh."""
        from .heartbeat import Heartbeat

        await self.grpc.set_serving()
        if self.registry:
            self.heartbeat = Heartbeat(self.registry, self.record, self.config.heartbeat_s)
            await self.heartbeat.beat()
            self.heartbeat.start()

    def _release(self) -> None:
        self.servicer.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def stop(self, grace: float = 0.0) -> None:
        """Leave Redis, drain in-flight calls for up to `grace` seconds, free the model's resources."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        if self.heartbeat:
            await self.heartbeat.stop(remove=True)
        await self.grpc.drain(grace)
        self._release()
        if self.registry:
            self.registry.close()

    async def run_forever(self) -> None:
        await self.grpc.wait_for_termination()
        if self.heartbeat:
            await self.heartbeat.stop(remove=True)
        self._release()
