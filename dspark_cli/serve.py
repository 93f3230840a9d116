"""`dspark serve all|verifier|drafter|scheduler`: run the services (entry points live in services/*/main.py).

`serve all` runs the scheduler with the engine embedded (target + drafter in this process, on the
bundled models unless told otherwise); Redis is optional there.
"""

from __future__ import annotations

import argparse
import logging


def add_parser(sub) -> None:
    from services.drafter import main as drafter_main
    from services.scheduler import main as scheduler_main
    from services.verifier import main as verifier_main

    p = sub.add_parser("serve", help="run the services (gRPC, and OpenAI-compatible HTTP)",
                       description="Run DSpark's services: everything in one process (all), or the verifier, drafter "
                                   "and scheduler as separate pods coordinated through Redis.")
    which = p.add_subparsers(dest="service", required=True, parser_class=type(p), metavar="SERVICE")

    a = which.add_parser("all", help="everything in one process on the bundled model (Redis optional)",
                         description="The scheduler with the target and drafter embedded: one process serving gRPC "
                                     "(and OpenAI-compatible HTTP with --http-port). Redis is optional.")
    _add_all_args(a)
    a.set_defaults(func=_run_all)

    v = which.add_parser("verifier", help="the verifier service (hosts the target)",
                         description="Host the target model: prefill and verify drafts for schedulers, publish itself "
                                     "in Redis. Profiles a quick SPS cost table at start-up when the target has none.")
    verifier_main.add_args(v)
    v.set_defaults(func=verifier_main.run)

    d = which.add_parser("drafter", help="the drafter service (hosts a drafter)",
                         description="Host a drafter: propose draft blocks from the target features schedulers send.")
    drafter_main.add_args(d)
    d.set_defaults(func=drafter_main.run)

    s = which.add_parser("scheduler", help="the scheduler service (front door)",
                         description="The front door: accept requests (gRPC, OpenAI-compatible HTTP), run continuous "
                                     "batching over verifier and drafter pods found by address or in Redis.")
    scheduler_main.add_args(s)
    s.set_defaults(func=scheduler_main.run)


def _add_all_args(p: argparse.ArgumentParser) -> None:
    from services.common import flags
    from services.scheduler.main import add_engine_args

    from .options import add_drafter_args, add_matmul_dtype_arg, add_target_arg

    flags.add_common(p, 50051)
    flags.add_api_keys(p)
    flags.add_model(p)
    flags.add_weights_arg(p, flags.env("WEIGHTS", "auto"))
    flags.add_kv_cache_arg(p)
    add_engine_args(p)
    add_target_arg(p, flags.env("TARGET"))
    add_drafter_args(p, flags.env("DRAFTER", "auto"), flags.env("DRAFTER_PATH"))
    add_matmul_dtype_arg(p, flags.env("DRAFTER_MATMUL_DTYPE", "auto"))
    flags.add_sps_profile(p)


def _run_all(args) -> int:
    from services.common import flags
    from services.common.server import ServerConfig
    from services.scheduler.server import SchedulerApp, SchedulerConfig

    from .models import SPS_FILE, calibration_of, find_generated, resolve_drafter_path, resolve_target
    from .options import drafter_is_auto

    flags.start_observability("dspark-all", args)
    target = resolve_target(args.target)
    log = logging.getLogger("dspark.scheduler")
    drafter = resolve_drafter_path(args.drafter, args.drafter_path, target,
                                   say=lambda why: log.warning(why + "; serving without a drafter"))
    cfg = SchedulerConfig(
        server=ServerConfig(args.port, args.host, args.drain_seconds), redis_url=args.redis_url,
        embedded_target=target, embedded_drafter=drafter,
        embedded_drafter_auto=drafter_is_auto(args), embedded_matmul_dtype=args.drafter_matmul_dtype,
        embedded_sps_file=str(sps) if (sps := find_generated(target, SPS_FILE)) else None,
        embedded_calibration_file=str(cal) if drafter and (cal := calibration_of(drafter)) else None,
        served_model_name=args.served_model_name, device=args.device, dtype=args.dtype, weights=args.weights,
        kv_cache_bytes=flags.kv_cache_bytes(args), policy=args.policy, block_size=args.block_size, max_active=args.max_active, max_waiting=args.max_waiting,
        max_requests_per_client=args.max_requests_per_client,
        default_max_new_tokens=args.default_max_new_tokens, profile_budget_s=args.sps_profile_seconds,
        http_port=int(args.http_port) if args.http_port is not None else None, scheduler_id=args.id,
        calibration_bound=args.calibration_bound or None, collapse_ratio=args.collapse_ratio or None,
        draft_window=args.draft_window or None, record_rounds=args.record_rounds, tls_dir=args.tls_dir,
        lookup_ngram=args.lookup_ngram,
        api_keys=flags.api_keys(args), **flags.redis_auth())
    return flags.run_app(lambda: SchedulerApp(cfg))
