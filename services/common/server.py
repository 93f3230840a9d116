"""Building and running a grpc.aio server the same way for every service.

`GrpcService` owns the server, the standard health service (NOT_SERVING until `set_serving()`, called
by a service after load and warm-up), reflection, the error interceptor, raised message-size limits, an
in-flight call counter, and graceful drain (stop accepting, wait for in-flight calls, `server.stop(grace)`).
Knows nothing about models or about what the servicers do.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dspark_core.errors import InvalidArgument

from .errors import ErrorInterceptor, Unavailable
from .security import ApiKeyInterceptor
from .tracing import TracingInterceptor

log = logging.getLogger("dspark.server")

# the largest message between pods: context features (2k tokens x 3 taps x 4096 x bf16 = 48 MiB). Only
# drafters receive them as servers (and schedulers, from verifiers, as clients).
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# what a server that never receives features accepts: the scheduler's clients (prompts are bounded by the
# context window, services.scheduler.servicer.Frontend.max_prompt_bytes) and the verifier's schedulers
MAX_REQUEST_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# servers bind their port exclusively: without this a second server on a held port shares it (SO_REUSEPORT)
SERVER_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]


def check_port_free(flag: str, host: str, port: int) -> None:
    """Refuse a port another socket holds (InvalidArgument naming the flag) before anything binds it, so that
    the failure is one line of ours, not a traceback or a second server sharing the port. Port 0 is free."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidArgument("--host", host, f"must be an address this machine can bind ({exc.strerror})") from None
    for family, kind, proto, _, addr in infos[:1]:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                why = "already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
                raise InvalidArgument(flag, port, f"must be a port free to bind on {host} ({why})") from None


@dataclass(frozen=True)
class ServerConfig:
    port: int
    host: str = "0.0.0.0"
    # seconds in-flight calls get to finish on SIGTERM before the server stops
    drain_seconds: float = 30.0

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("--port", self.port, "must be in [0, 65535]")
        if not self.drain_seconds >= 0:
            raise InvalidArgument("--drain-seconds", self.drain_seconds, "must be >= 0")


class _Undecodable:
    """What a request whose bytes are not its message type deserializes to: the handler refuses it by name."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _lenient(deserializer):
    """Wrap a request deserializer so that corrupt wire bytes (protobuf's DecodeError: a truncated field, a string
    that is not UTF-8) become an `_Undecodable` the handler refuses with INVALID_ARGUMENT. grpcio would otherwise
    answer UNKNOWN "Unexpected DecodeError" and log it at error level: a client's bad bytes are not our error."""
    if deserializer is None:
        return None

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a message type's parser raises
            return _Undecodable(str(exc) or type(exc).__name__)

    return deserialize


def _refuse_undecodable(request, method: str) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument("request", f"<{method} bytes>", f"must be a well-formed protobuf message ({request.why})")


class _InFlight(grpc.aio.ServerInterceptor):
    """Counts calls in progress, refuses new ones (UNAVAILABLE) once draining, and refuses a request whose bytes
    do not parse (INVALID_ARGUMENT) before the servicer sees it."""

    def __init__(self, owner: "GrpcService"):
        self.owner = owner

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        owner = self.owner
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                _refuse_undecodable(request, details.method)
                if owner.draining:
                    raise Unavailable("server is draining; retry on another replica")
                owner.in_flight += 1
                try:
                    return await inner(request, context)
                finally:
                    owner.in_flight -= 1

            return grpc.unary_unary_rpc_method_handler(unary, _lenient(handler.request_deserializer),
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def stream(request, context):
                _refuse_undecodable(request, details.method)
                if owner.draining:
                    raise Unavailable("server is draining; retry on another replica")
                owner.in_flight += 1
                try:
                    async for item in inner_s(request, context):
                        yield item
                finally:
                    owner.in_flight -= 1

            return grpc.unary_stream_rpc_method_handler(stream, _lenient(handler.request_deserializer),
                                                        handler.response_serializer)
        return handler


class GrpcService:
    """One grpc.aio server with health, reflection, error mapping and drain."""

    def __init__(self, config: ServerConfig, service_names: list[str], tls=None, require_client_auth: bool = True,
                 api_keys: tuple[str, ...] = (), max_receive_bytes: int = MAX_MESSAGE_BYTES):
        """`tls` (services.common.security.TlsFiles): serve TLS, and with `require_client_auth` only to peers
        whose certificate its CA signed; `api_keys`: every call but health needs one."""
        self.config = config
        self.service_names = list(service_names)
        self.draining = False
        self.in_flight = 0
        # order: API keys first (nothing runs for a caller without one), then error mapping, so that
        # Unavailable from the drain gate is mapped too
        check_port_free("--port", config.host, config.port)
        auth = [ApiKeyInterceptor(tuple(api_keys))] if api_keys else []
        options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        self.server = grpc.aio.server(
            interceptors=[*auth, ErrorInterceptor(), _InFlight(self), TracingInterceptor()],
            options=[*options, ("grpc.max_receive_message_length", max_receive_bytes)])
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        address = f"{config.host}:{config.port}"
        try:
            self.port = (self.server.add_secure_port(address, tls.server_credentials(require_client_auth)) if tls
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc's "Failed to bind": lost a race with another socket since the check
            self.port = 0
        if self.port == 0:
            raise InvalidArgument("--port", config.port, f"must be a port free to bind on {config.host}")

    async def _set_all(self, status) -> None:
        for name in ("", *self.service_names):
            await _maybe_await(self.health.set(name, status))

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        log.info("listening", extra={"port": self.port, "services": self.service_names})

    async def set_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"port": self.port})

    async def drain(self, grace: float | None = None) -> None:
        """Stop accepting calls, wait for in-flight ones (up to `grace` seconds), then stop the server."""
        grace = self.config.drain_seconds if grace is None else grace
        if not self.draining:
            self.draining = True
            await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
            log.info("draining", extra={"in_flight": self.in_flight, "grace_s": grace})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(max(0.0, deadline - loop.time()))
        log.info("stopped", extra={"port": self.port})

    async def wait_for_termination(self) -> None:
        """Run until SIGTERM / SIGINT, then drain."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        waiter = asyncio.ensure_future(self.server.wait_for_termination())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            await self.drain()
        waiter.cancel()


async def _maybe_await(x):
    if asyncio.iscoroutine(x):
        await x
