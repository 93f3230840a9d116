"""`dspark serve all|verifier|drafter|scheduler`: run the services (entry points live in services/*/main.py).

`serve all` runs the scheduler with the engine embedded (target + drafter in this process, on the
bundled models unless told otherwise); Redis is optional there.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from services.drafter import main as drafter_main
    from services.scheduler import main as scheduler_main
    from services.verifier import main as verifier_main

    p = sub.add_parser("serve", help="run the gRPC services", description="Run DSpark's gRPC services.")
    which = p.add_subparsers(dest="service", required=True, parser_class=type(p), metavar="SERVICE")

    a = which.add_parser("all", help="everything in one process on the bundled model (Redis optional)")
    _add_all_args(a)
    a.set_defaults(func=_run_all)

    v = which.add_parser("verifier", help="the verifier service (hosts the target)")
    verifier_main.add_args(v)
    v.set_defaults(func=verifier_main.run)

    d = which.add_parser("drafter", help="the drafter service (hosts a drafter)")
    drafter_main.add_args(d)
    d.set_defaults(func=drafter_main.run)

    s = which.add_parser("scheduler", help="the scheduler service (front door)")
    scheduler_main.add_args(s)
    s.set_defaults(func=scheduler_main.run)


def _add_all_args(p: argparse.ArgumentParser) -> None:
    from services.common import flags
    from services.scheduler.main import add_engine_args

    from .models import DRAFTER_NAMES

    flags.add_common(p, 50051)
    flags.add_model(p)
    add_engine_args(p)
    p.add_argument("--target", default=flags.env("TARGET"), help="target: tiny (the bundled 7M model, default), smollm2, or a model directory")
    p.add_argument("--drafter", default="auto", choices=("auto", "none", *DRAFTER_NAMES),
                   help="shipped drafter; none = autoregressive; auto = dspark when installed")
    p.add_argument("--drafter-path", default=flags.env("DRAFTER_PATH"), help="drafter checkpoint directory")


def _run_all(args) -> int:
    from services.common import flags
    from services.common.server import ServerConfig
    from services.scheduler.server import SchedulerApp, SchedulerConfig

    from .models import resolve_target, resolve_drafter_path

    flags.start_observability("dspark-all", args)
    cfg = SchedulerConfig(
        server=ServerConfig(args.port, args.host, args.drain_seconds), redis_url=args.redis_url,
        embedded_target=resolve_target(args.target),
        embedded_drafter=resolve_drafter_path(args.drafter, args.drafter_path), device=args.device, dtype=args.dtype,
        policy=args.policy, block_size=args.block_size, max_active=args.max_active, max_waiting=args.max_waiting,
        default_max_new_tokens=args.default_max_new_tokens,
        http_port=int(args.http_port) if args.http_port is not None else None, scheduler_id=args.id)
    return flags.run_app(lambda: SchedulerApp(cfg))
