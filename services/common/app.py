"""What the verifier, drafter and scheduler apps share: identity, Redis wiring and their run loop.

An app is started in-process (`await app.start()`, tests do this) or by its `main.py` (which then waits
for SIGTERM and drains). Knows nothing about models.
"""

from __future__ import annotations

import asyncio
import json
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


def make_registry(config):
    """The app's Registry (None without a redis url), with its Redis password and CA."""
    from .registry import Registry, RegistryConfig

    if not config.redis_url:
        return None
    return Registry(RegistryConfig(config.redis_url, password=config.redis_password,
                                   ssl_ca_certs=config.redis_ca))


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

    def _init_pod(self, kind: str, config, service_name: str, pod_id: str | None, make_servicer, add_to_server,
                  max_receive_bytes: int | None = None):
        """The gRPC server (mutual TLS with `config.tls_dir`), pod id, one model thread, the servicer
        (`make_servicer(id, executor)`) and Redis."""
        from .security import load_tls, warn_if_insecure
        from .server import MAX_MESSAGE_BYTES, GrpcService

        self.config = config
        tls = load_tls(config.tls_dir)
        warn_if_insecure(kind, tls)
        self.grpc = GrpcService(config.server, [service_name], tls=tls, require_client_auth=True,
                                max_receive_bytes=max_receive_bytes or MAX_MESSAGE_BYTES)
        self.port = self.grpc.port
        self.id = pod_id or default_pod_id(kind, self.port)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{kind}-model")
        self.servicer = make_servicer(self.id, self.executor)
        add_to_server(self.servicer, self.grpc.server)
        self.registry = make_registry(config)
        self.heartbeat = None
        self._expiry: asyncio.Task | None = None

    def start_expiry(self, ttl_s: float) -> None:
        """Sweep state idle for `ttl_s` (its scheduler vanished without a Release); 0 = never."""
        if ttl_s > 0:
            self._expiry = asyncio.ensure_future(self._expire_idle(ttl_s))

    async def go_live(self) -> None:
        """Report SERVING, then publish this pod in Redis and keep its record fresh."""
        from .heartbeat import Heartbeat

        await self.grpc.set_serving()
        if self.registry:
            self.heartbeat = Heartbeat(self.registry, self.record, self.config.heartbeat_s)
            await self.heartbeat.beat()
            self.heartbeat.start()

    async def _expire_idle(self, ttl_s: float) -> None:
        """Every ttl/4 (at most 10 s): release requests idle for longer than ttl_s, on the model thread."""
        period = min(max(ttl_s / 4, 0.05), 10.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            try:
                expired = await loop.run_in_executor(self.executor, self.servicer.expire_idle, ttl_s)
            except RuntimeError:  # the executor shut down: the app is stopping
                return
            except Exception:  # noqa: BLE001 - the sweep must keep running
                log.exception("idle expiry failed")
                continue
            if expired:
                log.warning("released idle requests", extra={"count": len(expired), "idle_ttl_s": ttl_s,
                                                             "request_ids": json.dumps(expired[:10])})

    def _release(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
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
