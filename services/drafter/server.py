"""The drafter app: load the drafter, warm it up, serve DrafterService, heartbeat to Redis.

Health stays NOT_SERVING until the weights are loaded and a warm-up proposal ran.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from dspark_core.errors import InvalidArgument
from dspark_core.stack import MATMUL_DTYPES, load_drafter_runtime
from dspark_protos.dspark.v1 import drafter_service_pb2, drafter_service_pb2_grpc

from ..common.app import PodLifecycle, advertise_address
from ..common.registry import PodRecord
from ..common.server import ServerConfig
from .servicer import DrafterServicer

log = logging.getLogger("dspark.drafter")
SERVICE_NAME = drafter_service_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


@dataclass(frozen=True)
class DrafterAppConfig:
    drafter_path: str
    server: ServerConfig
    device: str = "auto"
    dtype: str = "auto"
    matmul_dtype: str = "auto"  # see dspark_core.drafters.checkpoint.resolve_matmul_dtype
    # STS temperatures from there instead of beside the drafter (what `dspark calibrate` generated for it)
    calibration_file: str | None = None
    # the target's directory: a drafter that references the target's embedding / LM head reads them there
    target_dir: str | None = None
    redis_url: str | None = None
    drafter_id: str | None = None
    advertise_host: str | None = None
    advertise_address: str | None = None  # host:port, wins over advertise_host
    max_active: int = 1024
    # contexts one caller (scheduler) may hold at most; None = max_active
    max_per_caller: int | None = None
    heartbeat_s: float = 2.0
    # mutual TLS: a directory with ca.crt, tls.crt, tls.key (only CA-signed peers get in); None = plaintext
    tls_dir: str | None = None
    redis_password: str | None = None
    redis_ca: str | None = None
    coalesce_wait_s: float = 0.002
    # wait coalesce_wait_s before every forward even for a lone scheduler (tests that want slow rounds)
    coalesce_wait_alone: bool = False
    # a context nobody proposed for this long is dropped (its scheduler is gone); 0 = never
    idle_ttl_s: float = 300.0

    def __post_init__(self):
        if not self.drafter_path:
            raise InvalidArgument("drafter_path", self.drafter_path, "must name a drafter checkpoint directory")
        if self.max_active < 1:
            raise InvalidArgument("max_active", self.max_active, "must be >= 1")
        if self.max_per_caller is not None and self.max_per_caller < 1:
            raise InvalidArgument("max_per_caller", self.max_per_caller, "must be >= 1")
        if not self.idle_ttl_s >= 0:
            raise InvalidArgument("idle_ttl_s", self.idle_ttl_s, "must be >= 0 (0 = never expire)")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise InvalidArgument("matmul_dtype", self.matmul_dtype, f"must be one of {', '.join(MATMUL_DTYPES)}")


class DrafterApp(PodLifecycle):
    def __init__(self, config: DrafterAppConfig):
        self._init_pod("drafter", config, SERVICE_NAME, config.drafter_id,
                       lambda pod_id, ex: DrafterServicer(pod_id, ex, config.max_active, config.coalesce_wait_s,
                                                          config.max_per_caller, wait_alone=config.coalesce_wait_alone),
                       drafter_service_pb2_grpc.add_DrafterServiceServicer_to_server)

    def _load(self):
        from dspark_core.drafters.base import ProposeItem

        d = load_drafter_runtime(self.config.drafter_path, self.config.device, self.config.dtype,
                                 self.config.matmul_dtype, self.config.calibration_file, self.config.target_dir)
        st = d.new_state()  # warm-up: one real proposal on zero features
        feats = torch.zeros((2, d.config.feature_size), dtype=next(d.parameters()).dtype,
                            device=next(d.parameters()).device)
        d.propose([ProposeItem(state=st, new_features=feats, new_positions_start=0, new_tokens=[0, 0],
                               anchor=0, anchor_pos=2)])
        return d

    def record(self) -> PodRecord:
        s = self.servicer
        ready = s.drafter is not None
        return PodRecord(
            id=self.id, pool="drafter", address=advertise_address(self.config.advertise_host, self.port,
                                                                   self.config.advertise_address),
            capacity=self.config.max_active, active_requests=len(s.contexts),
            tokens_per_step=s.tokens_per_step.value, step_time_ewma_s=s.step_time.value,
            health="DRAINING" if self.grpc.draining else ("SERVING" if ready else "NOT_SERVING"),
            model=s.drafter.name if ready else "")

    async def load(self) -> "DrafterApp":
        drafter = await asyncio.get_running_loop().run_in_executor(self.executor, self._load)
        self.servicer.attach(drafter)
        await self.go_live()
        self.start_expiry(self.config.idle_ttl_s)
        log.info("drafter ready", extra={"id": self.id, "drafter": drafter.name, "port": self.port})
        return self
