"""Flags and environment variables every service entry point shares (parsed only inside main()).

Every flag has an environment fallback (DSPARK_PORT, DSPARK_REDIS_URL, ...) so Helm can configure pods
with env; flags win. Knows nothing about what a service does.
"""

from __future__ import annotations

import argparse
import asyncio
import os


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


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
    p.add_argument("--log-level", default=env("LOG_LEVEL", "INFO"), metavar="LEVEL",
                   help=f"log level: {', '.join(LOG_LEVELS)} (default INFO)")
    p.add_argument("--tls-dir", default=env("TLS_DIR"),
                   help="directory with ca.crt, tls.crt, tls.key: mutual TLS between the services "
                        "(`dspark certs --out DIR` makes them); default plaintext, with a warning")


def add_api_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[],
                   help="an API key clients must send (authorization: Bearer KEY); repeatable, and "
                        "DSPARK_API_KEYS adds comma-separated ones; default none (no authentication)")


def api_keys(args) -> tuple[str, ...]:
    from .security import parse_api_keys

    return parse_api_keys(args.api_key, env("API_KEYS"))


def redis_auth() -> dict:
    """Redis AUTH password (REDIS_PASSWORD or DSPARK_REDIS_PASSWORD) and the CA of a rediss:// server
    (DSPARK_REDIS_CA): environment only, so that no secret shows in a process list."""
    return {"redis_password": env("REDIS_PASSWORD", os.environ.get("REDIS_PASSWORD")) or None,
            "redis_ca": env("REDIS_CA") or None}


def add_model(p: argparse.ArgumentParser) -> None:
    add_device_args(p, env("DEVICE", "auto"), env("DTYPE", "auto"))


# -- flags the services share with the `dspark` commands (dspark_cli.options re-exports them): the same name,
# choices and help for the same thing everywhere

DEVICE_HELP = "auto, cpu, cuda, cuda:N (default %(default)s)"
DTYPE_HELP = "auto, float32, bfloat16, float16 (default %(default)s)"


def add_device_args(p, device: str = "auto", dtype: str = "auto") -> None:
    p.add_argument("--device", default=device, help=DEVICE_HELP)
    p.add_argument("--dtype", default=dtype, help=DTYPE_HELP)


def add_target_arg(p, default: str | None = None) -> None:
    p.add_argument("--target", default=default,
                   help="target: smollm2 (SmolLM2-135M-Instruct, the default; DSPARK_TARGET overrides it), tiny "
                        "(the bundled 7M test model), or a Hugging Face model directory")


def policy_name(text: str) -> str:
    """A policy's registered name (aliases resolved), for argparse `type=`."""
    from dspark_core.scheduling import POLICY_ALIASES, POLICY_NAMES

    name = POLICY_ALIASES.get(text, text)
    if name not in POLICY_NAMES:
        aliases = ", ".join(f"{a} = {n}" for a, n in POLICY_ALIASES.items())
        raise argparse.ArgumentTypeError(f"invalid policy {text!r} (choose from {', '.join(POLICY_NAMES)}; "
                                         f"alias: {aliases})")
    return name


def add_policy_arg(p, default: str = "fixed") -> None:
    from dspark_core.scheduling import POLICY_NAMES

    p.add_argument("--policy", type=policy_name, default=default, metavar="POLICY",
                   help=f"verification-length policy: {', '.join(POLICY_NAMES)} (async_topk = async; causal and "
                        "async read the target's sps.json cost table) (default %(default)s)")


def add_matmul_dtype_arg(p, default: str = "auto") -> None:
    """`--drafter-matmul-dtype`, and `--matmul-dtype` as a hidden alias (the drafter service's old name)."""
    from dspark_core.stack import MATMUL_DTYPES

    p.add_argument("--drafter-matmul-dtype", default=default, choices=MATMUL_DTYPES,
                   help="drafter matmuls: auto (int8 / bf16 weight copies on CPUs with native bf16, int8 in our "
                        "kernels alone on AVX2 CPUs, else the drafter dtype), float32 (exact), bfloat16, int8 "
                        "(default %(default)s)")
    p.add_argument("--matmul-dtype", dest="drafter_matmul_dtype", choices=MATMUL_DTYPES, help=argparse.SUPPRESS)


def add_weights_arg(p, default: str = "auto") -> None:
    """`--weights`: what the target's matmuls read (dspark_core.packed_weights), for every command and service
    that loads a target."""
    from dspark_core.stack import WEIGHT_FORMATS

    p.add_argument("--weights", default=default, choices=WEIGHT_FORMATS,
                   help="target matmul weights: auto (a target imported from a GGUF file serves the file's own "
                        "quantization, as llama.cpp does; any other its loaded weights), float32 (the loaded "
                        "weights; for an imported GGUF the dequantized model), bfloat16, int8 (per channel), int4 "
                        "(groups of 32), gguf (the file's Q4_0/Q4_1/Q8_0 blocks); packed formats run on the CPU "
                        "(default %(default)s)")


def add_kv_cache_arg(p) -> None:
    """`--kv-cache-gb`: the budget of the target's KV store (dspark_core.target.TargetConfig.kv_cache_bytes)."""
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="GiB the target's KV caches may take together; a request whose whole context (prompt + "
                        "max tokens) does not fit beside the others waits, one that cannot fit alone is refused "
                        "(default: $DSPARK_KV_CACHE_GB, else half the memory available at start-up)")


def kv_cache_bytes(args) -> int | None:
    """`--kv-cache-gb` in bytes (None: the target's default), checked."""
    from dspark_core.target import gib_to_bytes

    gb = getattr(args, "kv_cache_gb", None)
    return None if gb is None else gib_to_bytes(gb, "--kv-cache-gb")


def install_dir() -> str:
    """`$DSPARK_HOME/models` (what `dspark profile` / `calibrate` generated for shipped models lives there)."""
    from dspark_core.stack import install_dir as root

    return str(root(env("HOME")))


def find_generated(model_dir: str, filename: str) -> str | None:
    """`dspark_core.stack.find_generated` with this process's directories ($DSPARK_HOME, $DSPARK_MODELS_DIR)."""
    from dspark_core.stack import find_generated as find

    found = find(model_dir, filename, install_dir(), env("MODELS_DIR"))
    return str(found) if found else None


def add_sps_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sps-profile-seconds", type=float, default=float(env("SPS_PROFILE_SECONDS", 30)),
                   help="when the target has no sps.json cost table: seconds to spend profiling a quick one at "
                        "start-up, so that the causal / async policies can run; 0 = do not (they run as fixed) "
                        "(default 30)")


def check_common(args) -> None:
    """The shared flags' values, checked before anything starts: InvalidArgument naming the flag and value."""
    from dspark_core.errors import InvalidArgument

    if str(args.log_level).upper() not in LOG_LEVELS:
        raise InvalidArgument("--log-level", args.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
    if args.redis_url is not None and not str(args.redis_url).startswith(REDIS_SCHEMES):
        raise InvalidArgument("--redis-url", args.redis_url,
                              f"must start with {', '.join(REDIS_SCHEMES)} (e.g. redis://localhost:6379/0)")
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port),
                       ("--http-port", getattr(args, "http_port", None))):
        if port is not None and not 0 <= int(port) <= 65535:
            raise InvalidArgument(flag, port, "must be in [0, 65535]")
    if args.metrics_port and int(args.metrics_port) == int(args.port):
        raise InvalidArgument("--metrics-port", args.metrics_port, "must differ from --port")


def start_observability(service: str, args) -> None:
    """Check the shared flags, then logging, the /metrics server (its port checked free) and tracing."""
    from .logs import setup_logging
    from .metrics import start_metrics_server
    from .server import check_port_free
    from .tracing import setup_tracing

    check_common(args)
    if args.metrics_port:
        check_port_free("--metrics-port", "0.0.0.0", args.metrics_port)
    if getattr(args, "http_port", None) is not None:  # bound after the model loads: refuse a held one now
        check_port_free("--http-port", args.host, int(args.http_port))
    check_port_free("--port", args.host, args.port)
    setup_logging(service, args.log_level)
    if args.metrics_port:
        start_metrics_server(args.metrics_port)
    setup_tracing(os.environ.get("OTEL_SERVICE_NAME") or f"dspark-{service}", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def service_main(prog: str, description: str, add_args, run, argv=None) -> int:
    """A service's own entry point (`python -m services.X.main`): the same one-line errors and exit code 2 as
    `dspark serve X`."""
    import sys

    from dspark_core.errors import DSparkError

    p = argparse.ArgumentParser(prog=prog, description=description)
    add_args(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except DSparkError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroup may use by its quota (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us`), None where there is no quota or no cgroup file to read."""
    from pathlib import Path

    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = Path(root, quota_file).read_text().split()
            if period_file is not None:
                fields.append(Path(root, period_file).read_text().strip())
            quota, period = fields[0], int(fields[1]) if len(fields) > 1 else 100_000
            return None if quota == "max" or int(quota) <= 0 or period <= 0 else int(quota) / period
        except (OSError, ValueError):
            continue
    return None


def size_threads(root: str = "/sys/fs/cgroup") -> int | None:
    """Cap torch's intra-op threads at the CPUs this process may run on (its affinity and its cgroup's quota,
    rounded up) unless OMP_NUM_THREADS says otherwise. torch counts the machine's cores, not a container's CPU limit,
    and our kernels split large passes between all those threads: a 2-CPU pod on a 64-core node would run 64 threads
    under a 2-CPU quota. Returns the count set, None where nothing changed."""
    import logging
    import math

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    if cpus >= torch.get_num_threads():
        return None
    torch.set_num_threads(cpus)
    logging.getLogger("dspark.server").info("intra-op threads capped at the CPUs this process may use",
                                             extra={"threads": cpus, "cgroup_cpus": quota})
    return cpus


def run_app(app_factory, *more_factories) -> int:
    """Start an app (or several in one process, e.g. a verifier with its drafter beside it: each binds its own
    port and publishes itself), serve until SIGTERM / SIGINT, drain them all, exit 0. Torch's threads are sized
    to this process's CPUs first (`size_threads`)."""
    size_threads()

    async def go():
        apps = []
        try:
            for factory in (app_factory, *more_factories):
                apps.append(factory())
                await apps[-1].start()
        except BaseException:
            for app in apps:
                await app.stop(0)  # close the half-started servers on this loop, then report the error
            raise
        if len(apps) == 1:
            await apps[0].run_forever()
            return
        import signal

        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await asyncio.gather(*(app.stop(app.config.server.drain_seconds) for app in apps))

    asyncio.run(go())
    return 0
