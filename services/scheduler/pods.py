"""The scheduler's view of one pool of pods (verifiers or drafters): discovery, channels, liveness, choice.

Pods come from static addresses and/or Redis records (refreshed on a background thread, so a slow or
absent Redis never stalls a round; while Redis is away the last list seen is kept). A pod that fails a
call is marked dead for a while and skipped. `pick()` prefers the least loaded live pod (requests this
scheduler put there plus what the pod last published). Knows nothing about the RPCs' contents.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc

from ..common import metrics
from ..common.errors import Unavailable
from ..common.registry import PodRecord, Registry
from ..common.security import secure_channel
from ..common.server import CHANNEL_OPTIONS

log = logging.getLogger("dspark.pods")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN)


def is_pod_failure(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE


@dataclass(eq=False)
class Pod:
    address: str
    id: str
    stub: object
    channel: grpc.Channel
    record: PodRecord | None = None
    assigned: int = 0  # requests this scheduler routed here and has not released
    dead_until: float = 0.0
    static: bool = False
    missing_since: float | None = None  # when its Redis record was last found missing

    @property
    def alive(self) -> bool:
        return time.monotonic() >= self.dead_until and (self.record is None or self.record.health == "SERVING")

    def load(self) -> float:
        published = self.record.active_requests if self.record else 0
        capacity = max(self.record.capacity, 1) if self.record else 1 << 20
        return max(self.assigned, published) / capacity


@dataclass
class PodPool:
    pool: str  # "verifier" | "drafter"
    stub_cls: type
    static_addresses: tuple[str, ...] = ()
    registry: Registry | None = None
    refresh_s: float = 1.0
    dead_s: float = 5.0
    # a pod whose record is missing this long is forgotten (not at once: an empty, just-restarted Redis
    # has no records until the heartbeats re-publish them)
    forget_s: float = 15.0
    # mutual TLS (services.common.security.TlsFiles): a pod whose certificate the CA did not sign fails the
    # handshake, so a record in Redis is never enough to receive traffic
    tls: object = None
    pods: dict[str, Pod] = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._refreshed = 0.0  # monotonic time of the last refresh from Redis
        for a in self.static_addresses:
            self._add(a, a, None, static=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.registry is not None:
            self.refresh()
            self._thread = threading.Thread(target=self._refresher, name=f"pods-{self.pool}", daemon=True)
            self._thread.start()

    def _add(self, address: str, pod_id: str, rec: PodRecord | None, static: bool = False) -> Pod:
        ch = secure_channel(address, self.tls, CHANNEL_OPTIONS)
        pod = Pod(address, pod_id, self.stub_cls(ch), ch, rec, static=static)
        self.pods[address] = pod
        log.info("pod added", extra={"pool": self.pool, "address": address, "pod_id": pod_id})
        return pod

    def refresh(self) -> None:
        assert self.registry is not None
        self._refreshed = time.monotonic()
        recs = self.registry.pods(self.pool)
        with self._lock:
            seen = set()
            for r in recs:
                seen.add(r.address)
                pod = self.pods.get(r.address)
                if pod is None:
                    pod = self._add(r.address, r.id, r)
                else:
                    if pod.record is not None and pod.record.id != r.id:
                        pod.dead_until = 0.0  # a new process on the same address
                    pod.record, pod.id = r, r.id
                pod.missing_since = None
            if self.registry.up:  # expired records mean gone pods; keep them while Redis itself is away
                now = time.monotonic()
                for addr, pod in list(self.pods.items()):
                    if addr in seen or pod.static:
                        continue
                    if pod.missing_since is None:
                        pod.missing_since = now
                    elif now - pod.missing_since > self.forget_s and pod.assigned <= 0:
                        pod.channel.close()
                        del self.pods[addr]
                        if self.pool == "verifier":
                            metrics.forget_verifier(pod.id)

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - discovery must keep running
                log.exception("pod refresh failed")

    def pick(self, exclude: set[str] = frozenset()) -> Pod:
        for attempt in range(2):
            with self._lock:
                live = [p for p in self.pods.values() if p.alive and p.address not in exclude]
                if live:
                    return min(live, key=lambda p: (p.load(), p.address))
            if attempt == 0 and self.registry is not None and time.monotonic() - self._refreshed > 0.5:
                self.refresh()  # a pod may have appeared since the last refresh
        # the addresses stay in the log (mark_dead names each pod it gives up on): this text can reach a client
        raise Unavailable(f"no live {self.pool} pod ({len(self.pods)} known)")

    def get(self, address: str) -> Pod | None:
        return self.pods.get(address)

    def mark_dead(self, pod: Pod, exc: BaseException) -> None:
        pod.dead_until = time.monotonic() + self.dead_s
        log.warning("pod failed; marked dead", extra={"pool": self.pool, "address": pod.address,
                                                       "error": str(getattr(exc, "code", lambda: exc)())})

    def any_live(self) -> Pod:
        return self.pick()

    def close(self) -> None:
        self._stop.set()
        for p in self.pods.values():
            p.channel.close()
