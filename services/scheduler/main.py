"""`dspark serve scheduler`: flags, env and signals of the scheduler service (parsing happens in main())."""

from __future__ import annotations

import argparse
import sys


def _addresses(text: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from dspark_core.lookup import DEFAULT_LOOKUP_NGRAM
    from dspark_core.scheduling import DRAFT_WINDOW

    from ..common import flags

    flags.add_policy_arg(p, flags.env("POLICY", "fixed"))
    p.add_argument("--block-size", type=int, default=None, help="draft block size (default: the drafter's)")
    p.add_argument("--max-active", type=int, default=int(flags.env("MAX_ACTIVE", 64)),
                   help="requests verified together at most (default 64)")
    p.add_argument("--max-waiting", type=int, default=int(flags.env("MAX_WAITING", 256)),
                   help="requests queued at most before RESOURCE_EXHAUSTED (default 256)")
    p.add_argument("--max-requests-per-client", type=int, default=int(flags.env("MAX_REQUESTS_PER_CLIENT", 0)),
                   help="requests one client (an API key or client certificate; anonymous callers share one) runs "
                        "at once, n choices counting n, before RESOURCE_EXHAUSTED / HTTP 429 (default 0: no limit "
                        "but --max-waiting)")
    p.add_argument("--default-max-new-tokens", type=int, default=int(flags.env("DEFAULT_MAX_NEW_TOKENS", 128)),
                   help="tokens a request without max_new_tokens / max_tokens generates at most (default 128)")
    p.add_argument("--served-model-name", default=flags.env("SERVED_MODEL_NAME"),
                   help="the model name clients see (/v1/models, ListModels, the `model` field of responses) and "
                        "may ask for (default: the target directory's name)")
    p.add_argument("--http-port", type=int, default=flags.env("HTTP_PORT"),
                   help="OpenAI-compatible HTTP port (default off)")
    p.add_argument("--calibration-bound", type=float, default=float(flags.env("CALIBRATION_BOUND", 0.1)),
                   help="confidence policies verify the fixed length while a position's running ECE (above its "
                        "noise floor) exceeds this; 0 = not watched (default 0.1)")
    p.add_argument("--collapse-ratio", type=float, default=float(flags.env("COLLAPSE_RATIO", 0.25)),
                   help="a drafter whose first-position acceptance falls under this fraction of its expectation "
                        "decodes autoregressively, probing now and then; 0 = no alarm (default 0.25)")
    p.add_argument("--slot-correction", choices=("on", "off"), default=flags.env("SLOT_CORRECTION", "off"),
                   help="on: learn the workload's level of the drafter's confidences online, per position (greedy "
                        "and sampled requests apart), and plan on the corrected ones (default off: measured neutral "
                        "to negative with the shipped SmolLM2 drafter, docs/results/smollm2/README.md)")
    p.add_argument("--draft-gate-scope", choices=("batch", "request"), default=flags.env("DRAFT_GATE_SCOPE", "batch"),
                   help="what the draft gate decides for: batch (default: a step runs the drafter when the requests "
                        "whose drafts pay are worth a pass's fixed cost; gated requests probe together in one pass) "
                        "or request (each request on its own, carrying its share of the pass)")
    p.add_argument("--draft-window", type=int, default=int(flags.env("DRAFT_WINDOW", DRAFT_WINDOW)),
                   help="a request's drafter context begins at most this many positions before its first anchor "
                        "(only those prompt positions' features are computed into replies and sent); 0 = the "
                        f"whole prompt (default {DRAFT_WINDOW})")
    p.add_argument("--lookup-ngram", type=int, default=int(flags.env("LOOKUP_NGRAM", DEFAULT_LOOKUP_NGRAM)),
                   metavar="N",
                   help="requests verify an n-gram lookup draft (what followed their longest suffix of at least N "
                        "tokens, up to 8, earlier in prompt + output) instead of the drafter's block when it is "
                        "expected to accept more; outputs are unchanged (sampled: in distribution). 0 = off "
                        f"(default {DEFAULT_LOOKUP_NGRAM})")
    p.add_argument("--record-rounds", default=flags.env("RECORD_ROUNDS"), metavar="PATH",
                   help="append every verified round here (JSON lines) for `dspark calibrate --online`")


def _default_tokenizer() -> str | None:
    """The bundled target's tokenizer (used only if the verifiers serve that model)."""
    from pathlib import Path

    from dspark_core.stack import DEFAULT_TARGET, target_dirs

    from ..common import flags

    name = flags.env("TARGET") or DEFAULT_TARGET
    d = str(target_dirs(flags.env("MODELS_DIR"), flags.env("HOME")).get(name, name))
    return d if (Path(d) / "tokenizer.json").exists() or (Path(d) / "tokenizer_config.json").exists() else None


def add_args(p: argparse.ArgumentParser) -> None:
    from ..common import flags

    flags.add_common(p, 50051)
    flags.add_api_keys(p)
    add_engine_args(p)
    p.add_argument("--verifier-addresses", default=flags.env("VERIFIER_ADDRESSES"),
                   help="comma-separated host:port of verifiers (in addition to those found in Redis)")
    p.add_argument("--drafter-addresses", default=flags.env("DRAFTER_ADDRESSES"),
                   help="comma-separated host:port of drafters (in addition to those found in Redis)")
    p.add_argument("--drafter", default=flags.env("DRAFTER", "auto"), choices=("auto", "none"),
                   help="auto: draft with the drafter pods when any is found at start (static or in Redis); "
                        "none: autoregressive (default %(default)s)")
    p.add_argument("--no-drafter", dest="drafter", action="store_const", const="none", help=argparse.SUPPRESS)
    p.add_argument("--target", default=flags.env("TARGET"),
                   help="target model directory, for its tokenizer only (text prompts)")
    p.add_argument("--tokenizer", default=flags.env("TOKENIZER"), help="tokenizer directory (default --target)")
    p.add_argument("--startup-wait", type=float, default=120.0,
                   help="seconds to wait at start for a verifier (and a drafter, when one is expected) (default 120)")
    p.add_argument("--verifier-grace", type=float, default=float(flags.env("VERIFIER_GRACE", 30)),
                   help="seconds requests wait for a verifier when none is reachable, then fail (default 30)")
    p.add_argument("--autoscale", action="store_true",
                   help="scale the pool Deployments itself (settings in DSPARK_AUTOSCALE_POOLS, namespace POD_NAMESPACE)")
    p.add_argument("--target-user-tps", type=float, default=flags.env("TARGET_USER_TPS"), metavar="N",
                   help="desired replicas hold N tokens/s per user at the current load, from the confidences and "
                        "the live SPS table (default: from request counts alone)")
    p.add_argument("--device", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--drafter-path", default=None, help=argparse.SUPPRESS)


def run(args) -> int:
    import os

    from dspark_core.errors import InvalidArgument

    from ..common import flags
    from ..common.server import ServerConfig
    from .server import SchedulerApp, SchedulerConfig

    flags.start_observability("scheduler", args)
    pools = os.environ.get("DSPARK_AUTOSCALE_POOLS") if args.autoscale else None
    if args.autoscale and not pools:
        raise InvalidArgument("DSPARK_AUTOSCALE_POOLS", pools, "must be set (JSON pool settings) with --autoscale")
    if args.slot_correction not in ("on", "off"):  # from DSPARK_SLOT_CORRECTION (argparse checks only the flag)
        raise InvalidArgument("--slot-correction", args.slot_correction, "must be 'on' or 'off'")
    if args.draft_gate_scope not in ("batch", "request"):  # from DSPARK_DRAFT_GATE_SCOPE
        raise InvalidArgument("--draft-gate-scope", args.draft_gate_scope, "must be 'batch' or 'request'")
    cfg = SchedulerConfig(
        server=ServerConfig(args.port, args.host, args.drain_seconds),
        verifier_addresses=_addresses(args.verifier_addresses), drafter_addresses=_addresses(args.drafter_addresses),
        redis_url=args.redis_url, use_drafter=False if args.drafter == "none" else None,
        tokenizer_dir=args.tokenizer or args.target or _default_tokenizer(),
        tokenizer_checked=not (args.tokenizer or args.target), policy=args.policy, block_size=args.block_size,
        max_active=args.max_active, max_waiting=args.max_waiting,
        max_requests_per_client=args.max_requests_per_client, default_max_new_tokens=args.default_max_new_tokens,
        http_port=int(args.http_port) if args.http_port is not None else None, scheduler_id=args.id,
        startup_wait_s=args.startup_wait, autoscale_pools=pools, served_model_name=args.served_model_name,
        namespace=os.environ.get("POD_NAMESPACE", "default"),
        calibration_bound=args.calibration_bound or None, collapse_ratio=args.collapse_ratio or None,
        draft_window=args.draft_window or None, record_rounds=args.record_rounds, lookup_ngram=args.lookup_ngram,
        slot_correction=args.slot_correction == "on", draft_gate_scope=args.draft_gate_scope,
        target_user_tps=float(args.target_user_tps) if args.target_user_tps is not None else None,
        verifier_grace_s=args.verifier_grace, tls_dir=args.tls_dir, api_keys=flags.api_keys(args),
        **flags.redis_auth())
    return flags.run_app(lambda: SchedulerApp(cfg))


def main(argv: list[str] | None = None) -> int:
    from ..common import flags

    return flags.service_main("dspark-scheduler", "DSpark scheduler service", add_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
