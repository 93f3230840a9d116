"""Who may talk to whom: mutual TLS between the pods, API keys for clients, one loud warning without them.

- TLS: `--tls-dir DIR` holds `ca.crt`, `tls.crt`, `tls.key` (the layout of a cert-manager Secret; `dspark
  certs` writes one per component). Verifiers and drafters then serve TLS and require a client certificate
  signed by that CA; schedulers present theirs and accept only pods whose certificate the CA signed, so a
  pod record in Redis that points anywhere else gets no traffic. Every certificate carries the DNS name
  `TLS_SERVER_NAME` (pods are dialled by address, so that name, not the address, is what is checked).
- API keys: clients of the scheduler send `authorization: Bearer <key>` (gRPC metadata or HTTP header);
  `--api-key` (repeatable) and `DSPARK_API_KEYS` (comma-separated) set the accepted keys.
Knows nothing about what the services do.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from dspark_core.errors import InvalidArgument

log = logging.getLogger("dspark.security")
TLS_SERVER_NAME = "dspark"
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")
# calls that need no key: load balancers and probes check health without one
OPEN_METHODS = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class TlsFiles:
    ca: bytes
    cert: bytes
    key: bytes
    directory: str

    @classmethod
    def load(cls, directory: str) -> "TlsFiles":
        d = Path(directory)
        missing = [n for n in TLS_FILES if not (d / n).is_file()]
        if missing:
            raise InvalidArgument("tls_dir", directory, f"must hold {', '.join(TLS_FILES)} (missing {', '.join(missing)}; "
                                  "`dspark certs --out DIR` makes them)")
        return cls((d / "ca.crt").read_bytes(), (d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes(), str(d))

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def ssl_context(self) -> ssl.SSLContext:
        """An HTTPS server context with this certificate (clients are not asked for one: they use API keys)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        d = Path(self.directory)
        ctx.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
        return ctx


def load_tls(directory: str | None) -> TlsFiles | None:
    return TlsFiles.load(directory) if directory else None


def tls_channel_options() -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", TLS_SERVER_NAME)]


def secure_channel(address: str, tls: TlsFiles | None, options: list) -> grpc.Channel:
    """A channel to a pod: mutual TLS when `tls`, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls_channel_options()])


_warned: set[str] = set()


def warn_if_insecure(service: str, tls: TlsFiles | None, api_keys: tuple[str, ...] | None = None) -> None:
    """Once per process and service: say loudly what is unprotected."""
    if service in _warned:
        return
    _warned.add(service)
    if tls is None:
        log.warning("%s runs WITHOUT TLS: any network neighbour can call it, impersonate its peers or read "
                    "prompts in transit; pass --tls-dir (`dspark certs --out DIR` makes a CA and certificates)",
                    service)
    if api_keys is not None and not api_keys:
        log.warning("%s accepts clients WITHOUT an API key; set --api-key or DSPARK_API_KEYS", service)


def parse_api_keys(flag_values, env_value: str | None) -> tuple[str, ...]:
    keys = [k for k in (flag_values or [])]
    keys += [k for k in (env_value or "").split(",")]
    keys = [k.strip() for k in keys if k and k.strip()]
    short = [k for k in keys if len(k) < 16]
    if short:
        raise InvalidArgument("api_key", f"{len(short)} key(s) shorter than 16 characters",
                              "must be at least 16 characters each")
    return tuple(dict.fromkeys(keys))


def bearer_key(header: str | None) -> str | None:
    """The key of an `authorization` value `Bearer <key>` (HTTP header or gRPC metadata); None for anything else."""
    if not isinstance(header, str) or not header.startswith("Bearer "):
        return None
    return header[len("Bearer "):].strip()


def key_ok(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an `authorization` value is `Bearer <one of keys>` (constant-time comparisons)."""
    key = bearer_key(header)
    if key is None:
        return False
    got = key.encode("utf-8", "surrogatepass")  # HTTP may send bytes no str holds
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(got, k.encode())
    return ok


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call (but health checks) without a valid `authorization: Bearer <key>`."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        header = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
        if key_ok(header if isinstance(header, str) else None, self.keys):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata authorization: Bearer <key>")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key: send metadata authorization: Bearer <key>")
            yield  # pragma: no cover - makes this an async generator

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
