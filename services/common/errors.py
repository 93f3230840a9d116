"""The one place dspark_core errors become gRPC status codes (a grpc.aio server interceptor).

InvalidArgument -> INVALID_ARGUMENT, ResourceExhausted -> RESOURCE_EXHAUSTED, NotFound -> NOT_FOUND,
ModelLoadError -> FAILED_PRECONDITION; anything else is logged with its stack trace and reaches the
client as INTERNAL with a generic message (never the trace). Knows nothing about the services.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from dspark_core.errors import InvalidArgument, KVCacheFull, ModelLoadError, NotFound, ResourceExhausted

log = logging.getLogger("dspark.errors")


class Unavailable(Exception):
    """The service cannot take this call now (draining, not ready, no replica reachable)."""


_CODES = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error (see the server log)"


def _is_passthrough(exc: BaseException) -> bool:
    # context.abort() raises AbortError; cancellation must propagate untouched
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit))


# A refusal for KV room says whether the request would fit once the server's other requests are done
# (dspark_core.errors.KVCacheFull.fits_alone): the caller may then queue it rather than fail it.
KV_FITS_ALONE = "dspark-kv-fits-alone"


def fits_alone_of(exc: grpc.RpcError) -> bool | None:
    """The KV_FITS_ALONE trailer of a RESOURCE_EXHAUSTED reply: True / False, None where it has none."""
    try:
        trailers = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a locally raised RpcError has no call behind it
        return None
    for k, v in trailers:
        if k == KV_FITS_ALONE:
            return v == "1"
    return None


async def _abort(context, method: str, exc: Exception):
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method, extra={"method": method})
    else:
        log.info("%s -> %s: %s", method, code.name, message, extra={"method": method, "code": code.name})
    trailers = ((KV_FITS_ALONE, "1" if exc.fits_alone else "0"),) if isinstance(exc, KVCacheFull) else ()
    await context.abort(code, message, trailing_metadata=trailers)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to status codes, for unary and server-streaming RPCs."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped to a status code here, once
                    if _is_passthrough(exc):
                        raise
                    await _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def stream(request, context):
                try:
                    async for item in inner_s(request, context):
                        yield item
                except Exception as exc:  # noqa: BLE001
                    if _is_passthrough(exc):
                        raise
                    await _abort(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler
