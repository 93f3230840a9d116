"""`dspark serve verifier`: flags, env and signals of the verifier service (parsing happens in main())."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from ..common import flags

    flags.add_common(p, 50052)
    flags.add_model(p)
    flags.add_target_arg(p, flags.env("TARGET"))
    flags.add_weights_arg(p, flags.env("WEIGHTS", "auto"))
    flags.add_kv_cache_arg(p)
    p.add_argument("--drafter-path", default=flags.env("DRAFTER_PATH"),
                   help="drafter checkpoint whose config names the target layers to tap")
    p.add_argument("--tap-layer-ids", default=flags.env("TAP_LAYER_IDS"),
                   help="comma-separated target layers to tap (overrides --drafter-path)")
    p.add_argument("--max-active", type=int, default=int(flags.env("MAX_ACTIVE", 256)),
                   help="requests whose KV caches it holds at most (default 256)")
    p.add_argument("--idle-ttl", type=float, default=float(flags.env("IDLE_TTL", 300)),
                   help="seconds after which a request with no prefill / verify / resume is released "
                        "(its scheduler crashed); 0 = never (default 300)")
    p.add_argument("--max-per-caller", type=int, default=flags.env("MAX_PER_CALLER"),
                   help="KV slots one scheduler may hold at most (default --max-active)")
    from .servicer import FEATURE_DTYPES

    p.add_argument("--feature-dtype", default=flags.env("FEATURE_DTYPE", "auto"), choices=FEATURE_DTYPES,
                   help="dtype the context features travel in to the drafters: auto = the --drafter-path drafter's "
                        "context_feature_dtype (the precision it was trained on, e.g. bfloat16) where narrower than the "
                        "target's, else the target's own: a drafter pod then drafts exactly what the embedded engine "
                        "drafts; bfloat16 halves a float32 target's feature bytes for any drafter (drafts may then "
                        "differ in the last bits, outputs do not: verification never reads features). Default auto")
    flags.add_sps_profile(p)
    g = p.add_argument_group("drafter beside the verifier (one process, one GPU)")
    g.add_argument("--drafter-port", type=int, default=flags.env("DRAFTER_PORT"),
                   help="also serve --drafter-path's drafter on this gRPC port, in this process and on this device "
                        "(it publishes itself in the drafter pool like a `serve drafter` pod); default off")
    flags.add_matmul_dtype_arg(g, flags.env("DRAFTER_MATMUL_DTYPE", "auto"))


def run(args) -> int:
    from pathlib import Path

    from dspark_core.stack import CALIBRATION_FILE, SPS_FILE, resolve_drafter_path, resolve_target, target_name

    from ..common import flags
    from ..common.server import ServerConfig, check_port_free
    from ..drafter.server import DrafterApp
    from .server import VerifierApp, VerifierConfig

    flags.start_observability("verifier", args)
    taps = None
    if args.tap_layer_ids:
        taps = tuple(int(x) for x in args.tap_layer_ids.split(",") if x.strip())
    target = resolve_target(args.target, flags.env("MODELS_DIR"), flags.env("HOME"))
    drafter_path = args.drafter_path
    if drafter_path is None and taps is None and target_name(target, flags.env("MODELS_DIR"), flags.env("HOME")):
        # a named target taps the layers of its default drafter (what `serve drafter` serves beside it)
        drafter_path = resolve_drafter_path("auto", None, flags.env("MODELS_DIR"), target, home=flags.env("HOME"))
    cfg = VerifierConfig(
        target=target, server=ServerConfig(args.port, args.host, args.drain_seconds),
        device=args.device, dtype=args.dtype, weights=args.weights, kv_cache_bytes=flags.kv_cache_bytes(args),
        tap_layer_ids=taps, drafter_path=drafter_path,
        redis_url=args.redis_url, verifier_id=args.id, advertise_host=args.advertise_host,
        advertise_address=args.advertise_address, max_active=args.max_active,
        max_per_caller=int(args.max_per_caller) if args.max_per_caller else None,
        idle_ttl_s=args.idle_ttl, profile_budget_s=args.sps_profile_seconds, feature_dtype=args.feature_dtype,
        sps_file=flags.find_generated(target, SPS_FILE), tls_dir=args.tls_dir, **flags.redis_auth())
    if args.drafter_port is None:
        return flags.run_app(lambda: VerifierApp(cfg))
    dcfg = colocated_drafter_config(args, flags.find_generated(args.drafter_path or "", CALIBRATION_FILE))
    check_port_free("--drafter-port", args.host, dcfg.server.port)
    return flags.run_app(lambda: VerifierApp(cfg), lambda: DrafterApp(dcfg))


def colocated_drafter_config(args, calibration_file: str | None = None):
    """The drafter app `--drafter-port` runs beside the verifier: same device, dtype, Redis and drain; its own
    port and id, advertised on the verifier's host."""
    from dspark_core.errors import InvalidArgument

    from ..common import flags
    from ..common.server import ServerConfig
    from ..drafter.server import DrafterAppConfig

    if not args.drafter_path:
        raise InvalidArgument("--drafter-port", args.drafter_port, "needs --drafter-path (the drafter to serve)")
    port = int(args.drafter_port)
    if port == args.port or (args.metrics_port and port == args.metrics_port):
        raise InvalidArgument("--drafter-port", port, "must differ from --port and --metrics-port")
    address = None
    if args.advertise_address:
        address = f"{args.advertise_address.rsplit(':', 1)[0]}:{port}"
    return DrafterAppConfig(drafter_path=args.drafter_path, server=ServerConfig(port, args.host, args.drain_seconds),
                            device=args.device, dtype=args.dtype, matmul_dtype=args.drafter_matmul_dtype,
                            calibration_file=calibration_file, redis_url=args.redis_url,
                            drafter_id=f"{args.id}-drafter" if args.id else None,
                            advertise_host=args.advertise_host, advertise_address=address, tls_dir=args.tls_dir,
                            **flags.redis_auth())


def main(argv: list[str] | None = None) -> int:
    from ..common import flags

    return flags.service_main("dspark-verifier", "DSpark verifier service", add_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
