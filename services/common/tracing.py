"""OpenTelemetry traces: setup, context propagation in gRPC metadata, spans.

`setup_tracing(service)` installs an OTLP exporter only when OTEL_EXPORTER_OTLP_ENDPOINT is set (read by
the entry point and passed in) and an OTLP exporter package is importable; otherwise the OpenTelemetry
API's no-op tracer stays in place and spans cost next to nothing. Knows nothing about models.
"""

from __future__ import annotations

import logging

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger("dspark.tracing")
tracer = trace.get_tracer("dspark")


def setup_tracing(service: str, endpoint: str | None) -> bool:
    """Install an OTLP span exporter for `service`; returns False (no-op tracing) when it cannot."""
    if not endpoint:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but no OTLP exporter package is installed; tracing off")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"endpoint": endpoint})
    return True


def outgoing_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (W3C traceparent)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace: a server span per RPC, parented by the metadata's traceparent."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health", "/grpc.reflection")):
            return handler
        carrier = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        name = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                token = otel_context.attach(propagate.extract(carrier))
                try:
                    with tracer.start_as_current_span(name, kind=trace.SpanKind.SERVER):
                        return await inner(request, context)
                finally:
                    otel_context.detach(token)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            async def stream(request, context):
                ctx = propagate.extract(carrier)
                with tracer.start_as_current_span(name, context=ctx, kind=trace.SpanKind.SERVER):
                    async for item in inner_s(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
        return handler
