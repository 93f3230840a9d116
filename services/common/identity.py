"""Who is calling: the caller identity that verifiers and drafters key request state by.

A request id names a request only within its owner. A verifier or drafter therefore keys every request's
state by (caller, request id), where the caller is the identity of the peer's TLS certificate when the
server runs mutual TLS (a CA-signed identity nobody else can present) joined with the scheduler id the
call carries in `x-dspark-caller` metadata (schedulers sharing one certificate stay apart). Without TLS
only the carried id is left, which any network neighbour can claim: that is why the services warn
loudly when they run without TLS. `OwnedTable` holds such keyed state with a per-caller quota and idle
times for expiry.

A scheduler's clients may choose request ids too (to retry on another scheduler after a failover); those are
scoped the same way one level up: `client_owner` names the credentials a client was checked by (its API key,
its TLS certificate) and `scoped_request_id` puts that owner in front of the id, so two clients naming a
request `job-1` neither collide nor learn of each other, and only the same credentials adopt a checkpoint. The
same owner is what the scheduler's per-client request limit counts by. Knows nothing about models.
"""

from __future__ import annotations

import hashlib
import time

from dspark_core.errors import ResourceExhausted

from .security import bearer_key

CALLER_METADATA = "x-dspark-caller"
_SEP = "\x1f"  # cannot occur in a request id (services.common.limits) or a metadata value


def _escaped(name: str) -> str:
    """A certificate name with the characters that delimit caller names escaped ('%', '/', the key separator), so
    that no certificate name + carried id reads as another's: CN "pod/a" carrying "b" is not CN "pod" carrying "a/b"."""
    return name.replace("%", "%25").replace("/", "%2F").replace(_SEP, "%1F")


def _certificate_name(context) -> str:
    """The peer certificate's common name (or first subject alternative name); "" without mutual TLS."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - no security context on an insecure port
        auth = {}
    for name in ("x509_common_name", "x509_subject_alternative_name"):
        vals = auth.get(name)
        if vals:
            return vals[0].decode() if isinstance(vals[0], bytes) else str(vals[0])
    return ""


def caller_of(context) -> str:
    """`<certificate identity>/<carried caller id>` of a grpc.aio call ("" parts when absent). The certificate part
    is escaped (`_escaped`) and holds no '/', so the first '/' always ends it."""
    carried = ""
    for k, v in context.invocation_metadata() or ():
        if k == CALLER_METADATA and isinstance(v, str):
            carried = v[:128].replace(_SEP, "%1F")  # keys split at the separator
            break
    return f"{_escaped(_certificate_name(context))}/{carried}"


ANONYMOUS_OWNER = "anon"


def client_owner(context, trust_api_key: bool) -> str:
    """Who a scheduler client is: 16 hex digits of a hash of its credentials (the API key of its `authorization`
    metadata when the scheduler checks API keys, and its TLS client certificate's name), or ANONYMOUS_OWNER for
    a call that presented neither. Without API-key checking any client could name any key, so a key alone
    identifies nobody then. The key itself is never kept or shown."""
    header = next((v for k, v in (context.invocation_metadata() or ()) if k == "authorization"), None)
    return credentials_owner(header if trust_api_key else None, _certificate_name(context))


def credentials_owner(authorization: str | None, certificate_name: str = "") -> str:
    """The owner of a call with this (checked) `authorization` value (`Bearer <key>`; HTTP header or gRPC metadata
    alike) and certificate name."""
    api_key = bearer_key(authorization) or ""
    if not api_key and not certificate_name:
        return ANONYMOUS_OWNER
    h = hashlib.sha256(b"dspark request owner\0")
    h.update(api_key.encode("utf-8", "surrogatepass") + b"\0" + certificate_name.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def scoped_request_id(owner: str, request_id: str) -> str:
    """The id a scheduler runs a client-chosen request under (engine, Redis checkpoint, pods): `<owner>/<id>`. The
    owner is never chosen by the client and holds no '/', so no client id reads as another owner's."""
    return f"{owner}/{request_id}"


def key(caller: str, request_id: str) -> str:
    return f"{caller}{_SEP}{request_id}"


def split(k: str) -> tuple[str, str]:
    caller, _, rid = k.rpartition(_SEP)
    return caller, rid


class OwnedTable:
    """Keys (caller + request id) of held state with their last-use times, a total capacity, a per-caller
    quota, and the ones to free: idle for `ttl_s`, or idle for `evict_idle_s` when room is needed."""

    def __init__(self, capacity: int, per_caller: int | None = None, evict_idle_s: float = 10.0):
        self.capacity = capacity
        self.per_caller = per_caller or capacity
        self.evict_idle_s = evict_idle_s
        self.last_used: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.last_used)

    def __contains__(self, k: str) -> bool:
        return k in self.last_used

    def touch(self, keys) -> None:
        now = time.monotonic()
        for k in keys:
            self.last_used[k] = now

    def forget(self, k: str) -> None:
        self.last_used.pop(k, None)

    def held_by(self, caller: str) -> int:
        prefix = caller + _SEP
        return sum(1 for k in self.last_used if k.startswith(prefix))

    def idle(self, ttl_s: float) -> list[str]:
        cutoff = time.monotonic() - ttl_s
        return [k for k, t in self.last_used.items() if t < cutoff]

    def make_room(self, new_keys: list[str], where: str) -> list[str]:
        """Before admitting `new_keys`: check each caller's quota, and return the keys to evict (the least
        recently used ones idle for evict_idle_s) so that the total fits; ResourceExhausted if it cannot."""
        fresh = [k for k in dict.fromkeys(new_keys) if k not in self.last_used]
        by_caller: dict[str, int] = {}
        for k in fresh:
            c = split(k)[0]
            by_caller[c] = by_caller.get(c, 0) + 1
        for c, n in by_caller.items() if self.per_caller < self.capacity else ():
            held = self.held_by(c)
            if held + n > self.per_caller:
                raise ResourceExhausted(f"{where}: caller {c or 'anonymous'!r} holds {held} requests "
                                        f"(max_per_caller {self.per_caller})")
        over = len(self.last_used) + len(fresh) - self.capacity
        if over <= 0:
            return []
        cutoff = time.monotonic() - self.evict_idle_s
        old = sorted((t, k) for k, t in self.last_used.items() if t < cutoff and k not in new_keys)
        if len(old) < over:
            raise ResourceExhausted(f"{where} holds {len(self.last_used)} requests (max_active_requests {self.capacity}), "
                                    f"none idle for {self.evict_idle_s:g}s")
        return [k for _, k in old[:over]]
