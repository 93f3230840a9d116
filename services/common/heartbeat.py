"""A pod's heartbeat: re-publish its record to Redis every few seconds (so a Redis restart heals itself).

Knows nothing about what the record says; the service passes a function that builds it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from .registry import PodRecord, Registry

log = logging.getLogger("dspark.heartbeat")


class Heartbeat:
    def __init__(self, registry: Registry, record: Callable[[], PodRecord], interval_s: float = 2.0):
        self.registry, self.record, self.interval_s = registry, record, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def beat(self) -> bool:
        return await asyncio.to_thread(self.registry.publish_pod, self.record())

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except Exception:  # noqa: BLE001 - a heartbeat must never die
                log.exception("heartbeat failed")
            await asyncio.sleep(self.interval_s)

    async def stop(self, remove: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if remove:
            rec = self.record()
            await asyncio.to_thread(self.registry.remove_pod, rec.pool, rec.id)


class Ewma:
    """Exponentially weighted moving average (alpha = weight of the newest sample)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha, self.value = alpha, 0.0
        self._seen = False

    def update(self, x: float) -> None:
        self.value = x if not self._seen else self.alpha * x + (1 - self.alpha) * self.value
        self._seen = True
