"""`dspark serve drafter`: flags, env and signals of the drafter service (parsing happens in main())."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    from dspark_core.stack import MATMUL_DTYPES

    from ..common import flags

    flags.add_common(p, 50053)
    flags.add_model(p)
    p.add_argument("--drafter-path", default=flags.env("DRAFTER_PATH"),
                   help="drafter checkpoint directory (DeepSpec format; default: the bundled models/dspark)")
    p.add_argument("--matmul-dtype", default=flags.env("MATMUL_DTYPE", "auto"), choices=MATMUL_DTYPES,
                   help="drafter matmuls: auto (int8 / bf16 weight copies on CPUs with native bf16, else the drafter "
                        "dtype), float32 (exact), bfloat16, int8 (default %(default)s)")
    p.add_argument("--max-active", type=int, default=int(flags.env("MAX_ACTIVE", 1024)),
                   help="requests whose draft context it holds at most (default 1024)")


def run(args) -> int:
    from dspark_core.stack import resolve_drafter_path

    from ..common import flags
    from ..common.server import ServerConfig
    from .server import DrafterApp, DrafterAppConfig

    flags.start_observability("drafter", args)
    path = args.drafter_path or resolve_drafter_path("dspark", None, flags.env("MODELS_DIR"))
    cfg = DrafterAppConfig(drafter_path=path, server=ServerConfig(args.port, args.host, args.drain_seconds),
                           device=args.device, dtype=args.dtype, matmul_dtype=args.matmul_dtype,
                           redis_url=args.redis_url, drafter_id=args.id,
                           advertise_host=args.advertise_host,
                           advertise_address=args.advertise_address, max_active=args.max_active)
    return flags.run_app(lambda: DrafterApp(cfg))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dspark-drafter", description="DSpark drafter service")
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
