"""`dspark serve drafter`: flags, env and signals of the drafter service (parsing happens in main())."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from ..common import flags

    flags.add_common(p, 50053)
    flags.add_model(p)
    flags.add_target_arg(p, flags.env("TARGET"))
    p.add_argument("--drafter-path", default=flags.env("DRAFTER_PATH"),
                   help="drafter checkpoint directory (DeepSpec format; default: the bundled models/dspark)")
    flags.add_matmul_dtype_arg(p, flags.env("DRAFTER_MATMUL_DTYPE", flags.env("MATMUL_DTYPE", "auto")))
    p.add_argument("--max-active", type=int, default=int(flags.env("MAX_ACTIVE", 1024)),
                   help="requests whose draft context it holds at most (default 1024)")
    p.add_argument("--max-per-caller", type=int, default=flags.env("MAX_PER_CALLER"),
                   help="draft contexts one scheduler may hold at most (default --max-active)")
    p.add_argument("--idle-ttl", type=float, default=float(flags.env("IDLE_TTL", 300)),
                   help="seconds after which a context nobody proposed for is dropped; 0 = never (default 300)")


def run(args) -> int:
    from dspark_core.stack import CALIBRATION_FILE, resolve_drafter_path, resolve_target

    from ..common import flags
    from ..common.server import ServerConfig
    from .server import DrafterApp, DrafterAppConfig

    flags.start_observability("drafter", args)
    # the target's shipped DSpark by default; a drafter that references its target's embedding / LM head reads
    # them from the target's weights (nothing else of the target is loaded)
    target = resolve_target(args.target, flags.env("MODELS_DIR"), flags.env("HOME"))
    path = args.drafter_path or resolve_drafter_path("dspark", None, flags.env("MODELS_DIR"), target,
                                                     home=flags.env("HOME"))
    cfg = DrafterAppConfig(drafter_path=path, target_dir=target, server=ServerConfig(args.port, args.host, args.drain_seconds),
                           device=args.device, dtype=args.dtype, matmul_dtype=args.drafter_matmul_dtype,
                           calibration_file=flags.find_generated(path, CALIBRATION_FILE),
                           redis_url=args.redis_url, drafter_id=args.id,
                           advertise_host=args.advertise_host,
                           advertise_address=args.advertise_address, max_active=args.max_active,
                           max_per_caller=int(args.max_per_caller) if args.max_per_caller else None,
                           idle_ttl_s=args.idle_ttl, tls_dir=args.tls_dir, **flags.redis_auth())
    return flags.run_app(lambda: DrafterApp(cfg))


def main(argv: list[str] | None = None) -> int:
    from ..common import flags

    return flags.service_main("dspark-drafter", "DSpark drafter service", add_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
