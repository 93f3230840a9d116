"""`dspark serve verifier`: flags, env and signals of the verifier service (parsing happens in main())."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from ..common import flags

    flags.add_common(p, 50052)
    flags.add_model(p)
    p.add_argument("--target", default=flags.env("TARGET"), help="target: tiny (the bundled 7M model, default), smollm2, or a model directory")
    p.add_argument("--drafter-path", default=flags.env("DRAFTER_PATH"),
                   help="drafter checkpoint whose config names the target layers to tap")
    p.add_argument("--tap-layer-ids", default=flags.env("TAP_LAYER_IDS"),
                   help="comma-separated target layers to tap (overrides --drafter-path)")
    p.add_argument("--max-active", type=int, default=int(flags.env("MAX_ACTIVE", 256)),
                   help="requests whose KV caches it holds at most (default 256)")
    p.add_argument("--idle-ttl", type=float, default=float(flags.env("IDLE_TTL", 300)),
                   help="seconds after which a request with no prefill / verify / resume is released "
                        "(its scheduler crashed); 0 = never (default 300)")


def run(args) -> int:
    from dspark_core.stack import resolve_target

    from ..common import flags
    from ..common.server import ServerConfig
    from .server import VerifierApp, VerifierConfig

    flags.start_observability("verifier", args)
    taps = None
    if args.tap_layer_ids:
        taps = tuple(int(x) for x in args.tap_layer_ids.split(",") if x.strip())
    cfg = VerifierConfig(
        target=resolve_target(args.target, flags.env("MODELS_DIR"), flags.env("HOME")), server=ServerConfig(args.port, args.host, args.drain_seconds),
        device=args.device, dtype=args.dtype, tap_layer_ids=taps, drafter_path=args.drafter_path,
        redis_url=args.redis_url, verifier_id=args.id, advertise_host=args.advertise_host,
        advertise_address=args.advertise_address, max_active=args.max_active,
        idle_ttl_s=args.idle_ttl)
    return flags.run_app(lambda: VerifierApp(cfg))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dspark-verifier", description="DSpark verifier service")
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
