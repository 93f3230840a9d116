"""The verifier app: load the target, warm it up, serve VerifierService, heartbeat to Redis.

Health stays NOT_SERVING until the weights are loaded and a warm-up forward ran. Once live, a sweep
releases requests idle for `idle_ttl_s` (no prefill, verify or resume: their scheduler crashed without a
Release), so a lost scheduler cannot fill the KV cache for good. Knows nothing about drafters beyond the
tap layers it is told to expose.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from dspark_core.errors import InvalidArgument
from dspark_core.stack import SPS_FILE, load_sps, load_target_runtime
from dspark_protos.dspark.v1 import verifier_service_pb2, verifier_service_pb2_grpc

from ..common.app import PodLifecycle, advertise_address
from ..common.registry import PodRecord
from ..common.server import MAX_REQUEST_BYTES, ServerConfig
from .servicer import VerifierServicer

log = logging.getLogger("dspark.verifier")
SERVICE_NAME = verifier_service_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


@dataclass(frozen=True)
class VerifierConfig:
    target: str
    server: ServerConfig
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"
    # the KV store's budget in bytes (None: the target's default, dspark_core.target.TargetConfig)
    kv_cache_bytes: int | None = None
    # target layers to tap for the drafters (None: read them from drafter_path's config.json)
    tap_layer_ids: tuple[int, ...] | None = None
    drafter_path: str | None = None
    redis_url: str | None = None
    verifier_id: str | None = None
    advertise_host: str | None = None
    advertise_address: str | None = None  # host:port, wins over advertise_host
    max_active: int = 256
    # KV slots one caller (scheduler) may hold at most; None = max_active
    max_per_caller: int | None = None
    heartbeat_s: float = 2.0
    # mutual TLS: a directory with ca.crt, tls.crt, tls.key (only CA-signed peers get in); None = plaintext
    tls_dir: str | None = None
    redis_password: str | None = None
    redis_ca: str | None = None
    coalesce_wait_s: float = 0.002
    # wait coalesce_wait_s before every forward even for a lone scheduler (tests that want slow rounds)
    coalesce_wait_alone: bool = False
    # the dtype context features travel in: "auto" (the target's), "float32" or "bfloat16" (half a float32
    # target's feature bytes; the drafters take them in their own precision, verification never reads them)
    feature_dtype: str = "auto"
    # a request untouched (no prefill / verify / resume) this long is released; 0 = never. A live
    # scheduler touches its requests every round (well under a second), and one whose verifier forgot a
    # request resumes it, so the only cost of a short TTL is a Resume after a very long stall.
    idle_ttl_s: float = 300.0
    # no sps.json for the target: seconds to spend profiling a quick cost table at start-up (0 = none)
    profile_budget_s: float = 30.0
    # the target's profiled table when it is not beside it (`dspark profile` wrote it to the install location)
    sps_file: str | None = None

    def __post_init__(self):
        if self.max_active < 1:
            raise InvalidArgument("max_active", self.max_active, "must be >= 1")
        if self.max_per_caller is not None and self.max_per_caller < 1:
            raise InvalidArgument("max_per_caller", self.max_per_caller, "must be >= 1")
        if not self.idle_ttl_s >= 0:
            raise InvalidArgument("idle_ttl_s", self.idle_ttl_s, "must be >= 0 (0 = never expire)")
        if not self.profile_budget_s >= 0:
            raise InvalidArgument("sps_profile_seconds", self.profile_budget_s, "must be >= 0 (0 = do not profile)")
        if self.heartbeat_s <= 0:
            raise InvalidArgument("heartbeat_s", self.heartbeat_s, "must be > 0")


def resolve_taps(cfg: VerifierConfig) -> tuple[int, ...]:
    if cfg.tap_layer_ids is not None:
        return tuple(cfg.tap_layer_ids)
    if cfg.drafter_path:
        from dspark_core.drafters.config import load_config
        from dspark_core.drafters.target_record import check_shapes

        config = load_config(Path(cfg.drafter_path))
        check_shapes(config, cfg.drafter_path, cfg.target)
        return tuple(config.target_layer_ids)
    return ()


def drafter_feature_dtype(cfg: VerifierConfig):
    """The torch dtype `cfg.drafter_path`'s drafter reads context features in (its `context_feature_dtype`), or
    None (no drafter named, or one that takes them as they come)."""
    if not cfg.drafter_path:
        return None
    from dspark_core.drafters.base import context_dtype
    from dspark_core.drafters.config import load_config

    return context_dtype(load_config(Path(cfg.drafter_path)))


def startup_sps(target, target_dir: str, profile_budget_s: float, sps_file: str | None = None):
    """The target's cost table for serving: its profiled sps.json (`sps_file`, which the entry point finds with
    `flags.find_generated`, else beside the target), else, unless `profile_budget_s` is 0, a quick table
    measured now within that many seconds (logged). None: no table; a policy that needs one then runs as
    fixed (the scheduler says so)."""
    import time

    from dspark_core.profiling import kernels_in_use, stale_kernels

    table, path = load_sps(target_dir, path=sps_file or Path(target_dir) / SPS_FILE)
    stale = stale_kernels(table, kernels_in_use(target))
    if table is not None and stale is None:
        log.info("cost table loaded", extra={"path": str(path)})
        return table
    if table is not None and profile_budget_s <= 0:
        log.warning("cost table stale and --sps-profile-seconds 0: served as is, the online table corrects it "
                    "from real passes", extra={"path": str(path), "stale": stale})
        return table
    if profile_budget_s <= 0:
        log.warning("no SPS cost table for this target and --sps-profile-seconds 0: cost-table policies "
                    "(causal, async) run as fixed", extra={"target": target_dir})
        return None
    from dspark_core.profiling import quick_sps_table

    t0 = time.perf_counter()
    table = quick_sps_table(target, budget_s=profile_budget_s)
    log.warning(("a stale" if stale else "no") + " SPS cost table for this target: profiled a quick one at "
                "start-up (run `dspark profile` on this hardware for the full table)",
                extra={"target": target_dir, "stale": stale, "seconds": round(time.perf_counter() - t0, 2),
                       "batch_sizes": json.dumps(list(table.batch_sizes))})
    return table


class VerifierApp(PodLifecycle):
    def __init__(self, config: VerifierConfig):
        self._init_pod("verifier", config, SERVICE_NAME, config.verifier_id,
                       lambda pod_id, ex: VerifierServicer(pod_id, ex, config.max_active, config.coalesce_wait_s,
                                                           config.max_per_caller, wait_alone=config.coalesce_wait_alone,
                                                           feature_dtype=config.feature_dtype,
                                                           drafter_feature_dtype=drafter_feature_dtype(config)),
                       verifier_service_pb2_grpc.add_VerifierServiceServicer_to_server,
                       max_receive_bytes=MAX_REQUEST_BYTES)  # it sends features, never receives them

    def _load(self):
        from dspark_core.sampling import SamplingParams
        from dspark_core.verifier import PrefillItem, Verifier

        cfg = self.config
        target = load_target_runtime(cfg.target, cfg.device, cfg.dtype, resolve_taps(cfg), cfg.weights,
                                     cfg.kv_cache_bytes)
        if cfg.drafter_path and cfg.tap_layer_ids is None:
            from dspark_core.drafters.config import load_config
            from dspark_core.drafters.target_record import check_fingerprint

            check_fingerprint(load_config(Path(cfg.drafter_path)), cfg.drafter_path, target, cfg.target)
        verifier = Verifier(target)
        # warm-up: one real prefill + release before reporting SERVING
        # (one new token: a verifier with a small --kv-cache-gb must not refuse its own warm-up)
        verifier.prefill([PrefillItem("__warmup__", (0, 1, 2), SamplingParams(temperature=0, max_new_tokens=1))])
        verifier.release("__warmup__")
        return target, verifier, startup_sps(target, cfg.target, cfg.profile_budget_s, cfg.sps_file)

    def record(self) -> PodRecord:
        s = self.servicer if self.servicer.verifier is not None else None
        sps, sps_context, sps_rows = s.live_sps() if s else ([], 0, {})
        return PodRecord(
            id=self.id, pool="verifier", address=advertise_address(self.config.advertise_host, self.port,
                                                                   self.config.advertise_address),
            capacity=self.config.max_active, active_requests=s.verifier.num_active if s else 0,
            tokens_per_step=s.tokens_per_step.value if s else 0.0, step_time_ewma_s=s.step_time.value if s else 0.0,
            sps_table=sps, sps_context_length=sps_context, sps_rows=sps_rows,
            health="DRAINING" if self.grpc.draining else ("SERVING" if s else "NOT_SERVING"),
            model=s.target.name if s else "")

    async def load(self) -> "VerifierApp":
        target, verifier, sps = await asyncio.get_running_loop().run_in_executor(self.executor, self._load)
        self.servicer.attach(verifier, target, sps)
        await self.go_live()
        self.start_expiry(self.config.idle_ttl_s)
        log.info("verifier ready", extra={"id": self.id, "model": target.name, "port": self.port,
                                          "taps": json.dumps(list(target.config.tap_layer_ids))})
        return self

