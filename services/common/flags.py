"""Flags and environment variables every service entry point shares (parsed only inside main()).

Every flag has an environment fallback (DSPARK_PORT, DSPARK_REDIS_URL, ...) so Helm can configure pods
with env; flags win. Knows nothing about what a service does.
"""

from __future__ import annotations

import argparse
import asyncio
import os


def env(name: str, default=None):
    return os.environ.get(f"DSPARK_{name}", default)


def add_common(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--port", type=int, default=int(env("PORT", default_port)), help=f"gRPC port (default {default_port})")
    p.add_argument("--host", default=env("HOST", "0.0.0.0"), help="address to bind (default 0.0.0.0)")
    p.add_argument("--redis-url", default=env("REDIS_URL"), help="redis://host:port/db for coordination (optional)")
    p.add_argument("--metrics-port", type=int, default=int(env("METRICS_PORT", 0)),
                   help="Prometheus /metrics port (default off)")
    p.add_argument("--advertise-host", default=env("ADVERTISE_HOST", os.environ.get("POD_IP")),
                   help="host other pods reach this one at (default POD_IP or 127.0.0.1)")
    p.add_argument("--advertise-address", default=env("POD_ADDRESS"),
                   help="host:port other pods reach this one at (default DSPARK_POD_ADDRESS; wins over --advertise-host)")
    p.add_argument("--id", default=env("ID", os.environ.get("POD_NAME")), help="replica id (default POD_NAME)")
    p.add_argument("--drain-seconds", type=float, default=float(env("DRAIN_SECONDS", 30)),
                   help="seconds in-flight calls get on SIGTERM (default 30)")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"))


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=env("DEVICE", "auto"), help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--dtype", default=env("DTYPE", "auto"), help="auto, float32, bfloat16, float16 (default auto)")


def start_observability(service: str, args) -> None:
    from .logs import setup_logging
    from .metrics import start_metrics_server
    from .tracing import setup_tracing

    setup_logging(service, args.log_level)
    if args.metrics_port:
        start_metrics_server(args.metrics_port)
    setup_tracing(os.environ.get("OTEL_SERVICE_NAME") or f"dspark-{service}", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def run_app(app_factory) -> int:
    """Start an app, serve until SIGTERM / SIGINT, drain, exit 0."""
    async def go():
        app = app_factory()
        try:
            await app.start()
        except BaseException:
            await app.stop(0)  # close the half-started server on this loop, then report the error
            raise
        await app.run_forever()

    asyncio.run(go())
    return 0
