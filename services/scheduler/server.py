"""The scheduler app: build the engine (remote verifier + drafter pools, or embedded models for
`dspark serve all`), run it on its thread, serve SchedulerService (+ optional OpenAI-compatible HTTP).

Health stays NOT_SERVING until the engine can run: in distributed mode a verifier (and drafter, when one
is expected) answered GetInfo; embedded, the models are loaded and warmed up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_core.cost_model import SpsTable, table_from_points
from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument
from dspark_core.lookup import DEFAULT_LOOKUP_NGRAM
from dspark_core.scheduling import DRAFT_WINDOW, policy_spec
from dspark_protos.dspark.v1 import (drafter_service_pb2_grpc, scheduler_service_pb2, scheduler_service_pb2_grpc,
                                     verifier_service_pb2_grpc)

from ..common.app import ServingApp, default_pod_id, make_registry
from ..common.errors import Unavailable
from ..common.security import load_tls, warn_if_insecure
from ..common.server import MAX_REQUEST_BYTES, GrpcService, ServerConfig
from .loop import EngineLoop
from .pods import PodPool
from .remote import RemoteDrafter, RemoteVerifier
from .servicer import Frontend, ModelCard, SchedulerServicer

log = logging.getLogger("dspark.scheduler")
SERVICE_NAME = scheduler_service_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name


@dataclass(frozen=True)
class SchedulerConfig:
    server: ServerConfig
    # distributed mode: pods from static addresses and/or Redis
    verifier_addresses: tuple[str, ...] = ()
    drafter_addresses: tuple[str, ...] = ()
    redis_url: str | None = None
    # False: autoregressive, no drafter; None: use one when any is found at start
    use_drafter: bool | None = None
    tokenizer_dir: str | None = None
    # tokenizer_dir is a default guess: use it only if the verifiers serve the model of that directory
    tokenizer_checked: bool = False
    # embedded mode (`dspark serve all`): the models run in this process
    embedded_target: str | None = None
    embedded_drafter: str | None = None
    # the drafter was picked by `--drafter auto`: beside a target it was not trained for, serve without it
    embedded_drafter_auto: bool = False
    embedded_matmul_dtype: str = "auto"
    # what `dspark profile` / `calibrate` generated for the embedded models, when not beside them
    embedded_sps_file: str | None = None
    embedded_calibration_file: str | None = None
    # the model name clients see and ask for; None: the target's name
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"
    # embedded: the KV store's budget in bytes (None: the target's default)
    kv_cache_bytes: int | None = None
    # embedded, no sps.json for the target: seconds to spend profiling a quick cost table at start-up
    profile_budget_s: float = 30.0
    policy: str = "fixed"
    block_size: int | None = None
    max_active: int = 64
    max_waiting: int = 256
    # engine requests one client (API key / client certificate; all anonymous callers together) holds at once,
    # n choices counting n; 0 = no limit but max_waiting
    max_requests_per_client: int = 0
    default_max_new_tokens: int = 128
    http_port: int | None = None
    http_host: str = "0.0.0.0"
    scheduler_id: str | None = None
    rpc_timeout_s: float = 60.0
    # how long start() waits for pods to appear
    startup_wait_s: float = 60.0
    # built-in scaler: DSPARK_AUTOSCALE_POOLS JSON and the namespace of the pool Deployments
    autoscale_pools: str | None = None
    namespace: str = "default"
    # a checkpoint this old belongs to a lost scheduler: a retry with the same request id adopts it
    adopt_after_s: float = 5.0
    # online operation (dspark_core.monitoring): the confidence policies fall back to the fixed length while
    # a position's running ECE exceeds this bound (None = not watched); a drafter whose position-1
    # acceptance falls under this fraction of its expectation decodes autoregressively (None = no alarm)
    calibration_bound: float | None = 0.1
    collapse_ratio: float | None = 0.25
    # the engine's online slot correction (EngineConfig.slot_correction): per position, the workload's level of
    # the confidences learned from verified rounds
    slot_correction: bool = False
    # n-gram lookup drafts (EngineConfig.lookup_ngram: the shortest match; 0 = off)
    lookup_ngram: int = DEFAULT_LOOKUP_NGRAM
    # what the draft gate decides for (EngineConfig.draft_gate_scope): "batch" or "request"
    draft_gate_scope: str = "batch"
    # a request's drafter context begins at most this many positions before its first anchor
    # (EngineConfig.draft_window; None = the whole prompt)
    draft_window: int | None = DRAFT_WINDOW
    # append every verified round (JSON lines) here, for `dspark calibrate --online`
    record_rounds: str | None = None
    # autoscale to hold this many tokens per second per user (None: on request counts alone)
    target_user_tps: float | None = None
    # requests wait this long for a verifier when none is reachable (a lone one restarting), then fail
    verifier_grace_s: float = 30.0
    # TLS: serve clients over TLS and talk to pods with mutual TLS (ca.crt, tls.crt, tls.key); None = plaintext
    tls_dir: str | None = None
    # clients must send one of these (authorization: Bearer <key>); empty = no authentication
    api_keys: tuple[str, ...] = ()
    redis_password: str | None = None
    redis_ca: str | None = None

    def __post_init__(self):
        if self.embedded_target is None and not self.verifier_addresses and not self.redis_url:
            raise InvalidArgument("verifier_addresses", self.verifier_addresses,
                                  "must be given (or a redis url to discover verifiers, or an embedded target)")
        EngineConfig(policy=self.policy, block_size=self.block_size, max_active=self.max_active,
                     max_waiting=self.max_waiting, calibration_bound=self.calibration_bound,
                     collapse_ratio=self.collapse_ratio, draft_window=self.draft_window,
                     slot_correction=self.slot_correction, draft_gate_scope=self.draft_gate_scope,
                     lookup_ngram=self.lookup_ngram)  # validates
        if self.target_user_tps is not None and not self.target_user_tps > 0:
            raise InvalidArgument("target_user_tps", self.target_user_tps, "must be > 0 tokens per second")
        if not self.verifier_grace_s >= 0:
            raise InvalidArgument("verifier_grace_s", self.verifier_grace_s, "must be >= 0")
        if self.default_max_new_tokens < 1:
            raise InvalidArgument("default_max_new_tokens", self.default_max_new_tokens, "must be >= 1")
        if not (isinstance(self.max_requests_per_client, int) and self.max_requests_per_client >= 0):
            raise InvalidArgument("max_requests_per_client", self.max_requests_per_client,
                                  "must be an integer >= 0 (0: no limit)")


@dataclass
class _Stack:
    """What the engine is built from (the engine itself is built by the EngineLoop, with its observer)."""

    target: object  # a TargetRuntime, or the verifiers' TargetInfo
    drafter: object
    config: EngineConfig
    sps: object
    verifier: RemoteVerifier | None  # None: a local Verifier over `target`
    card: ModelCard
    tokenizer: object


class SchedulerApp(ServingApp):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.tls = load_tls(config.tls_dir)
        warn_if_insecure("scheduler", self.tls, tuple(config.api_keys))
        self.grpc = GrpcService(config.server, [SERVICE_NAME], tls=self.tls, require_client_auth=False,
                                api_keys=tuple(config.api_keys), max_receive_bytes=MAX_REQUEST_BYTES)
        self.port = self.grpc.port
        self.id = config.scheduler_id or default_pod_id("scheduler", self.port)
        self.servicer = SchedulerServicer()
        scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, self.grpc.server)
        self.registry = make_registry(config)
        self.verifiers: PodPool | None = None
        self.drafters: PodPool | None = None
        self.remote_verifier: RemoteVerifier | None = None
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.frontend: Frontend | None = None
        self.http = None
        self.http_port: int | None = None
        self._live_points: tuple | None = None  # (points, rows) the engine last took

    # -- engine construction (blocking; runs in a worker thread)
    def _engine_config(self, has_drafter: bool, has_sps: bool = True, online_sps: bool = False) -> EngineConfig:
        c = self.config
        policy = c.policy if has_drafter else "ar"
        if policy_spec(policy).needs_sps and not has_sps:
            log.warning("policy needs the target's SPS cost table and the verifier has none: running as fixed "
                        "until one exists (profile one with `dspark profile`, or let the verifier profile at "
                        "start-up: --sps-profile-seconds > 0)", extra={"policy": policy})
            policy = "fixed"
        return EngineConfig(policy=policy, block_size=c.block_size, max_active=c.max_active,
                            max_waiting=c.max_waiting, calibration_bound=c.calibration_bound,
                            collapse_ratio=c.collapse_ratio, online_sps=online_sps and has_sps,
                            draft_window=c.draft_window, slot_correction=c.slot_correction,
                            draft_gate_scope=c.draft_gate_scope, lookup_ngram=c.lookup_ngram if has_drafter else 0)

    def _build_embedded(self) -> _Stack:
        from dspark_core.sampling import SamplingParams
        from dspark_core.stack import load_stack

        from ..verifier.server import startup_sps

        c = self.config

        def no_drafter(why: str) -> None:
            log.warning(why + "; serving without a drafter", extra={"drafter": c.embedded_drafter})

        target, drafter = load_stack(c.embedded_target, c.embedded_drafter, c.device, c.dtype,
                                     c.embedded_matmul_dtype, auto=c.embedded_drafter_auto, say=no_drafter,
                                     calibration_file=c.embedded_calibration_file, weights=c.weights,
                                     kv_cache_bytes=c.kv_cache_bytes)
        sps = None
        if drafter is not None and policy_spec(c.policy).needs_sps:
            sps = startup_sps(target, c.embedded_target, c.profile_budget_s, c.embedded_sps_file)
        # in-process, every verify pass corrects the cost table (the services' verifiers do it on their side)
        ecfg = self._engine_config(drafter is not None, sps is not None, online_sps=isinstance(sps, SpsTable))
        # warm-up on an engine of its own, so that the served one starts with no history
        Engine(target, drafter, ecfg, sps=sps).generate([0, 1, 2], SamplingParams(temperature=0, max_new_tokens=2))
        card = ModelCard(c.served_model_name or target.name, target.vocab_size, target.max_context,
                         getattr(drafter, "name", None),
                         ecfg.policy, target.eos_token_ids, c.default_max_new_tokens)
        return _Stack(target, drafter, ecfg, sps, None, card, target.tokenizer)

    def _build_distributed(self) -> _Stack:
        from dspark_core.target import load_tokenizer

        c = self.config
        self.verifiers = PodPool("verifier", verifier_service_pb2_grpc.VerifierServiceStub,
                                 tuple(c.verifier_addresses), self.registry, tls=self.tls)
        self.drafters = PodPool("drafter", drafter_service_pb2_grpc.DrafterServiceStub,
                                tuple(c.drafter_addresses), self.registry, tls=self.tls)
        rv = RemoteVerifier(self.verifiers, self.registry, c.rpc_timeout_s, caller=self.id)
        deadline = time.monotonic() + c.startup_wait_s
        info = None
        while info is None:
            try:
                info = rv.info()
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                if self.registry:
                    self.verifiers.refresh()
        drafter = None
        want = c.use_drafter if c.use_drafter is not None else bool(c.drafter_addresses) or bool(self.drafters.pods)
        while want and drafter is None:
            try:
                drafter = RemoteDrafter.connect(self.drafters, rv, info.hidden_size, info.vocab_size, c.rpc_timeout_s)
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                if self.registry:
                    self.drafters.refresh()
        if drafter is not None and drafter.target_hidden_size and drafter.target_hidden_size != info.hidden_size:
            from dspark_core.errors import ModelLoadError

            raise ModelLoadError(
                f"drafter pods ({drafter.name}) were trained for target '{drafter.target_model_name}' (hidden "
                f"{drafter.target_hidden_size}), not for the verifiers' '{info.name}' (hidden {info.hidden_size}): "
                "deploy a drafter trained for this target, or serve without drafters (--drafter none)")
        if drafter is not None and tuple(drafter.target_layer_ids) != tuple(info.tap_layer_ids):
            raise InvalidArgument("tap_layer_ids", info.tap_layer_ids,
                                  f"of the verifier must equal the drafter's target_layer_ids {drafter.target_layer_ids}")
        ecfg = self._engine_config(drafter is not None, bool(info.sps_points))
        tokenizer_dir = c.tokenizer_dir
        if tokenizer_dir and c.tokenizer_checked and Path(tokenizer_dir).name != info.name:
            log.warning("text prompts are off: the verifiers serve %r; pass --target DIR (or --tokenizer) for "
                        "its tokenizer", info.name)
            tokenizer_dir = None
        tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        card = ModelCard(c.served_model_name or info.name, info.vocab_size, info.max_context,
                         getattr(drafter, "name", None), ecfg.policy,
                         info.eos_token_ids, c.default_max_new_tokens)
        self.remote_verifier = rv
        return _Stack(info, drafter, ecfg, table_from_points(info.sps_points, info.sps_rows), rv, card, tokenizer)

    def _pods_capacity(self) -> dict:
        out: dict = {}
        for name, pool in (("verifier", self.verifiers), ("drafter", self.drafters)):
            if pool is not None:
                out[name] = [(p.record.capacity, p.record.active_requests) for p in list(pool.pods.values())
                             if p.record is not None]
        if self.remote_verifier is not None and self.engine is not None:
            demand: dict = {}
            for req in self.engine.active:
                pod = self.remote_verifier.requests.get(req.request_id)
                if pod is None or pod.pod is None:
                    continue
                want = self.loop.demand_mass.get(req.request_id, 0.0) if self.loop else 0.0
                row = self.loop.demand_rows.get(req.request_id) if self.loop else None
                m, n, rows = demand.get(pod.pod.id, (0.0, 0, []))
                demand[pod.pod.id] = (m + want, n + 1, rows + ([row] if row else []))
            out["demand"] = demand
            out["sps"] = {p.record.id: p.record.sps_table for p in list(self.verifiers.pods.values())
                          if p.record is not None}
            rows = {p.record.id: p.record.sps_rows for p in list(self.verifiers.pods.values())
                    if p.record is not None}
            pod = next((vid for vid, pts in sorted(out["sps"].items()) if pts), None)
            live = None if pod is None else (out["sps"][pod], rows.get(pod) or {})
            if live and live != self._live_points:  # the verifiers' live table (they measure every pass)
                self._live_points = live
                self.engine.sps = table_from_points(*live)
        return out

    async def load(self) -> "SchedulerApp":
        c = self.config
        build = self._build_embedded if c.embedded_target else self._build_distributed
        st = await asyncio.to_thread(build)
        card, tokenizer, rv = st.card, st.tokenizer, st.verifier
        autoscaler = None
        if c.autoscale_pools:
            from .autoscaler import Autoscaler, parse_pools

            autoscaler = Autoscaler(parse_pools(c.autoscale_pools), c.namespace)
        policy = budgets = None
        if rv is not None and self.registry is not None and st.config.policy == "async":
            from dspark_core.scheduling import make_policy

            from .budget import BudgetedPolicy, ClusterBudgets

            budgets = ClusterBudgets(self.registry, self.id)
            policy = BudgetedPolicy(make_policy("async"), lambda rid: (
                rv.requests[rid].pod.id if rid in rv.requests and rv.requests[rid].pod else None), budgets)
        self.loop = EngineLoop(
            lambda observer: Engine(st.target, st.drafter, st.config, sps=st.sps, verifier=rv, policy=policy,
                                    observer=observer),
            self.registry, self.id, checkpoint=rv.checkpoint if rv is not None else None,
            pods_capacity=self._pods_capacity, autoscaler=autoscaler, record_rounds=c.record_rounds,
            target_user_tps=c.target_user_tps, verifier_grace_s=c.verifier_grace_s)
        self.loop.budgets = budgets
        self.engine = self.loop.engine
        self.loop.start()
        self.frontend = Frontend(self.loop, card, tokenizer, self.registry if rv is not None else None,
                                 c.adopt_after_s, max_requests_per_client=c.max_requests_per_client,
                                 trust_api_key=bool(c.api_keys))
        self.servicer.f = self.frontend
        if c.http_port is not None:
            from .http import start_http

            self.http, self.http_port = await start_http(self.frontend, c.http_host, c.http_port,
                                                         lambda: not self.grpc.draining,
                                                         self.registry.check if self.registry else None,
                                                         tuple(c.api_keys), self.tls.ssl_context() if self.tls else None)
        await self.grpc.set_serving()
        log.info("scheduler ready", extra={"id": self.id, "port": self.port, "http_port": self.http_port,
                                           "model": card.name, "drafter": card.drafter, "policy": card.policy})
        return self

    async def _shutdown_rest(self) -> None:
        if self.http is not None:
            await self.http.cleanup()
        if self.loop:
            self.loop.stop()
        for pool in (self.verifiers, self.drafters):
            if pool:
                pool.close()
        if self.registry:
            self.registry.close()

    async def stop(self, grace: float = 0.0) -> None:
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        if self.frontend:
            self.frontend.draining = True
        await self.grpc.drain(grace)
        await self._shutdown_rest()

    async def run_forever(self) -> None:
        await self.grpc.wait_for_termination()
        await self._shutdown_rest()
