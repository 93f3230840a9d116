"""Redis coordination: pod records, request checkpoints, demand / budget summaries, autoscaling signal.

Keys (all JSON values, all with a TTL so that nothing stale outlives its writer):
- `dspark:pod:<pool>:<id>`            a verifier / drafter record, re-published by its heartbeat;
- `dspark:request:<request_id>`       checkpoint: prompt and committed token ids, sampling params, pods;
                                      written and deleted only by the scheduler it names (request ids are
                                      client-chosen), moved to another only by an adoption;
- `dspark:demand:<verifier>:<sched>`  survival-probability mass a scheduler wants verified there;
- `dspark:budget:<verifier>`          the verification budget (draft tokens per step) for that verifier;
- `dspark:autoscale:desired:<pool>`   desired replicas of a pool, from load (an integer);
- `dspark:autoscale:replicas:<pool>`  the same number as the *length* of a list, which is what KEDA's
                                      redis (lists) scaler reads: with listLength 1 it asks for exactly
                                      that many replicas.

Redis is never on the critical path: every call catches Redis errors, marks Redis down and returns a
fallback (the last pods seen, nothing for the rest); redis-py reconnects on the next call, and
heartbeats re-publish everything after a Redis restart. Knows nothing about models or gRPC.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import redis

from dspark_core.errors import InvalidArgument

from . import metrics

log = logging.getLogger("dspark.registry")
PREFIX = "dspark"

# Checkpoint keys are request ids, which clients choose: a scheduler writes or deletes a checkpoint only when
# it is absent or names that scheduler, so that another client's request of the same id on another scheduler
# (or its n choices' ids `<id>-<i>`) cannot replace or delete it. ARGV: record, owner, ttl / owner.
_WRITE_OWNED = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' and rec['scheduler'] ~= ARGV[2] then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""
_DELETE_OWNED = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, rec = pcall(cjson.decode, cur)
if ok and type(rec) == 'table' and rec['scheduler'] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
# an adoption: the record still names the scheduler the adopter read in it (no other adopter came first).
# ARGV: new record, previous owner, ttl
_TAKE_OVER = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, rec = pcall(cjson.decode, cur)
if not ok or type(rec) ~= 'table' or rec['scheduler'] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return 1
"""


@dataclass(frozen=True)
class RegistryConfig:
    url: str
    # seconds a pod record lives without a heartbeat
    pod_ttl_s: float = 10.0
    # seconds a request checkpoint lives without an update
    checkpoint_ttl_s: float = 3600.0
    # socket timeout of every Redis call: Redis must never stall a round for long
    timeout_s: float = 0.5
    # AUTH password (REDIS_PASSWORD), when the URL carries none
    password: str | None = None
    # CA bundle that a rediss:// server's certificate must chain to (default: the system's)
    ssl_ca_certs: str | None = None

    def __post_init__(self):
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument("--redis-url", self.url, "must start with redis://, rediss:// or unix://")
        if self.pod_ttl_s <= 0:
            raise InvalidArgument("pod_ttl_s", self.pod_ttl_s, "must be > 0")


@dataclass
class PodRecord:
    """What a verifier or drafter publishes about itself."""

    id: str
    pool: str  # "verifier" | "drafter"
    address: str  # host:port reachable by schedulers
    capacity: int  # requests it can hold at once
    active_requests: int = 0
    tokens_per_step: float = 0.0  # EWMA of tokens per batched forward
    step_time_ewma_s: float = 0.0
    # [[num_tokens, steps_per_second], ...]: the verifier's live cost table (dspark_core OnlineSpsTable), at
    # the mean context length of its latest passes (sps_context_length)
    sps_table: list = field(default_factory=list)
    sps_context_length: int = 0
    # {requests: [[num_tokens, steps_per_second], ...]}: the same table's request rows (passes of that many
    # requests sharing the tokens, as verify steps with drafts do); {} when it has none
    sps_rows: dict = field(default_factory=dict)
    health: str = "SERVING"
    model: str = ""
    updated: float = 0.0

    @classmethod
    def from_json(cls, text) -> "PodRecord":
        d = json.loads(text)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class Registry:
    def __init__(self, config: RegistryConfig):
        self.config = config
        extra = {}
        if config.password:
            extra["password"] = config.password  # a password in the URL wins (redis-py reads it from there)
        if config.ssl_ca_certs and config.url.startswith("rediss://"):
            extra["ssl_ca_certs"] = config.ssl_ca_certs
        self.redis = redis.Redis.from_url(config.url, socket_timeout=config.timeout_s,
                                          socket_connect_timeout=config.timeout_s, decode_responses=True, **extra)
        self._write_owned = self.redis.register_script(_WRITE_OWNED)
        self._delete_owned = self.redis.register_script(_DELETE_OWNED)
        self._take_over = self.redis.register_script(_TAKE_OVER)
        self.up = True
        self._last_pods: dict[str, list[PodRecord]] = {}
        self._checked = 0.0

    def ping(self) -> bool:
        """Whether Redis answers now (a warning line when it stops answering, an info line when it is back)."""
        self._checked = time.monotonic()
        return bool(self._call("ping", self.redis.ping, False))

    def check(self, max_age_s: float = 2.0) -> bool:
        """`up`, refreshed by a ping when the last check is older than `max_age_s` (for readiness)."""
        if time.monotonic() - self._checked > max_age_s:
            self.ping()
        return self.up

    def _ok(self) -> None:
        if not self.up:
            log.info("redis is back", extra={"url": self.config.url})
        self.up = True
        metrics.REDIS_UP.set(1)

    def _down(self, exc: Exception, what: str) -> None:
        if self.up:
            log.warning("redis unavailable (%s): %s", what, exc, extra={"url": self.config.url})
        self.up = False
        metrics.REDIS_UP.set(0)

    def _call(self, what: str, fn, fallback=None):
        try:
            out = fn()
        except (redis.RedisError, OSError) as exc:
            self._down(exc, what)
            return fallback
        self._ok()
        return out

    # -- pods
    def publish_pod(self, rec: PodRecord) -> bool:
        rec.updated = time.time()
        key = f"{PREFIX}:pod:{rec.pool}:{rec.id}"
        return bool(self._call("publish_pod", lambda: self.redis.set(
            key, json.dumps(asdict(rec)), px=int(self.config.pod_ttl_s * 1000)), False))

    def remove_pod(self, pool: str, pod_id: str) -> None:
        self._call("remove_pod", lambda: self.redis.delete(f"{PREFIX}:pod:{pool}:{pod_id}"))

    def pods(self, pool: str) -> list[PodRecord]:
        """Live pods of a pool; while Redis is away, the last list seen."""
        def read():
            keys = sorted(self.redis.scan_iter(match=f"{PREFIX}:pod:{pool}:*", count=500))
            values = self.redis.mget(keys) if keys else []
            return [PodRecord.from_json(v) for v in values if v]

        out = self._call("pods", read, None)
        if out is None:
            return list(self._last_pods.get(pool, []))
        self._last_pods[pool] = out
        return out

    # -- request checkpoints
    def write_checkpoint(self, request_id: str, data: dict) -> None:
        self.write_checkpoints({request_id: data})

    def write_checkpoints(self, items: dict[str, dict]) -> None:
        """Each record where its key is absent or already names the record's `scheduler` (_WRITE_OWNED)."""
        if not items:
            return

        def write():
            pipe = self.redis.pipeline(transaction=False)
            for rid, data in items.items():
                self._write_owned(keys=[f"{PREFIX}:request:{rid}"], client=pipe,
                                  args=[json.dumps(data), str(data.get("scheduler", "")),
                                        int(self.config.checkpoint_ttl_s)])
            pipe.execute()

        self._call("write_checkpoints", write)

    def read_checkpoint(self, request_id: str) -> dict | None:
        v = self._call("read_checkpoint", lambda: self.redis.get(f"{PREFIX}:request:{request_id}"))
        return json.loads(v) if v else None

    def delete_checkpoint(self, request_id: str, owner: str) -> None:
        """Delete the checkpoint only if it names `owner` (the deleting scheduler)."""
        self._call("delete_checkpoint", lambda: self._delete_owned(keys=[f"{PREFIX}:request:{request_id}"],
                                                                   args=[owner]))

    def adopt_checkpoint(self, request_id: str, previous_owner: str, data: dict) -> bool:
        """Replace the checkpoint with `data` (naming its adopter) if it still names `previous_owner`; False when
        another scheduler took it first or it is gone. True while Redis is away (as without Redis: adopt)."""
        return bool(self._call("adopt_checkpoint", lambda: self._take_over(
            keys=[f"{PREFIX}:request:{request_id}"],
            args=[json.dumps(data), previous_owner, int(self.config.checkpoint_ttl_s)]), True))

    # -- demand, budgets, autoscaling
    def publish_demand(self, verifier_id: str, scheduler_id: str, mass: float, requests: int,
                       confidences: list | None = None) -> None:
        """`confidences`: the scheduler's latest per-request confidence rows for that verifier (for budgets)."""
        rec = {"mass": mass, "requests": requests, "confidences": (confidences or [])[:512]}
        self._call("publish_demand", lambda: self.redis.set(
            f"{PREFIX}:demand:{verifier_id}:{scheduler_id}", json.dumps(rec), px=int(self.config.pod_ttl_s * 1000)))

    def demand_by_scheduler(self, verifier_id: str) -> dict[str, dict]:
        """Every scheduler's demand record on one verifier: {scheduler_id: record}."""
        def read():
            keys = sorted(self.redis.scan_iter(match=f"{PREFIX}:demand:{verifier_id}:*", count=500))
            vals = self.redis.mget(keys) if keys else []
            return {k.rsplit(":", 1)[1]: json.loads(v) for k, v in zip(keys, vals) if v}

        return self._call("demand_by_scheduler", read, {})

    def total_demand(self, verifier_id: str) -> dict:
        """Demand on one verifier summed over every scheduler: {"mass": ..., "requests": ...}."""
        def read():
            keys = list(self.redis.scan_iter(match=f"{PREFIX}:demand:{verifier_id}:*", count=500))
            vals = [json.loads(v) for v in (self.redis.mget(keys) if keys else []) if v]
            return {"mass": sum(v["mass"] for v in vals), "requests": sum(v["requests"] for v in vals)}

        return self._call("total_demand", read, {"mass": 0.0, "requests": 0})

    def publish_budget(self, verifier_id: str, budget: int) -> None:
        self._call("publish_budget", lambda: self.redis.set(
            f"{PREFIX}:budget:{verifier_id}", int(budget), px=int(self.config.pod_ttl_s * 1000)))

    def read_budget(self, verifier_id: str) -> int | None:
        v = self._call("read_budget", lambda: self.redis.get(f"{PREFIX}:budget:{verifier_id}"))
        return int(v) if v is not None else None

    def publish_desired(self, pool: str, replicas: int) -> None:
        metrics.DESIRED_REPLICAS.labels(pool=pool).set(replicas)
        n = max(0, int(replicas))

        def write():
            # one transaction: readers never see a half-rebuilt list
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(f"{PREFIX}:autoscale:desired:{pool}", n, ex=60)
            key = f"{PREFIX}:autoscale:replicas:{pool}"
            pipe.delete(key)
            if n:
                pipe.rpush(key, *([1] * n))
                pipe.expire(key, 60)
            return pipe.execute()

        self._call("publish_desired", write)

    def close(self) -> None:
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001
            pass
