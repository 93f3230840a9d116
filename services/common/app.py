"""What the verifier, drafter and scheduler apps share: identity, Redis wiring and their run loop.

An app is started in-process (`await app.start()`, tests do this) or by its `main.py` (which then waits
for SIGTERM and drains). Knows nothing about models.
"""

from __future__ import annotations

import os
import socket


def default_pod_id(kind: str, port: int) -> str:
    """POD_NAME in Kubernetes (the entry point reads env and passes it), else host-kind-port."""
    return f"{socket.gethostname()}-{kind}-{port}-{os.getpid()}"


def advertise_address(host: str | None, port: int, address: str | None = None) -> str:
    """The host:port published in Redis: an explicit address (DSPARK_POD_ADDRESS) wins over host + port."""
    return address or f"{host or '127.0.0.1'}:{port}"


class PodLifecycle:
    """Going live, draining and shutting down, shared by the verifier and drafter apps.

    The app provides `grpc` (GrpcService), `servicer` (with `close()`), `executor`, `registry` (or None),
    `heartbeat` (None until live), `record()` and `config.heartbeat_s`.
    """

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
