#!/usr/bin/env python3
"""Load test of the distributed deployment as real processes, with one verifier (or the drafter) SIGKILLed.

    python scripts/load_test.py [--duration 300] [--concurrency 32] [--max-new-tokens 64]
                                [--kill-at SECONDS] [--restart-after 10] [--out runs/load]
                                [--verifiers 2] [--kill verifier|drafter] [--tls]

Starts a redis-server on a free port, `--verifiers` (default two) `dspark serve verifier`, one `dspark serve
drafter` and one `dspark serve scheduler` on the bundled model (models/target + models/dspark), then
`--concurrency` client threads send greedy gRPC Generate requests (held-out prompts of data/dev/*.jsonl,
chat template) back to back for `--duration` seconds. At `--kill-at` (default: half the duration) the
verifier holding more requests (`--kill drafter`: the drafter) is SIGKILLed and `--restart-after` seconds
later restarted on the same port. With one verifier the requests wait for it (the scheduler's
--verifier-grace, 30 s); with the drafter gone they continue without drafts. `--tls`: certificates from
`dspark certs`, mutual TLS between the services, an API key on the scheduler, and the clients use both.

Recorded: requests completed, failed (a gRPC error or exception), lost (started but never finished: a stream
that ended without a final chunk, ran into its deadline, or was still open after the drain), per-request
latency, tokens/s over time, and the RSS of every process (psutil when installed, else /proc/PID/status
VmRSS) every `--sample-every` seconds. Afterwards every service must hold no request state, and every
completed output must equal the target's own greedy output (computed in-process by
dspark_core.engine.Engine without a drafter, for every distinct prompt served, or a sample with
`--check-sample N`).

Writes `summary.json` and `load.png` (throughput and RSS over time, kill and restart marked) to --out and
prints the summary. Exits 1 on any failed or lost request, output mismatch, leftover request state, or RSS
growth beyond the bound over the second half (see `rss_check`); 2 when the deployment cannot start.
Service logs go to a temporary directory (its path is in the summary) unless --log-dir is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc, types_pb2  # noqa: E402

MiB = 1024 * 1024
# RSS growth allowed per process over the second half of the run (median of its last quarter minus median
# of its first quarter). A leak of what a request carries (its features: prompt x 3 taps x 256 x 4 bytes,
# ~0.3 MiB for a 100-token prompt; a KV slot's tensors, more) grows by > 100 MiB over the ~400 requests
# of the second half of a 5-minute run, while the floor of a healthy, warm process moves by a few MiB
# (measured on the 5-minute run: verifiers and drafter within +-5 MiB, scheduler +5 MiB). A slow leak
# of a few KiB per request (a dict entry, a log record) stays under the bound: the leftover-state check
# (every service holds no request after the run) is the precise test for those.
RSS_GROWTH_BOUND_MIB = 48.0
RSS_GROWTH_BOUND_FRACTION = 0.10  # ... or 10% of the process's RSS, whichever is larger


def client_channel(address: str, tls_dir: Path | None, options: list) -> grpc.Channel:
    """Plaintext, or TLS presenting the scheduler's certificate (which every service accepts)."""
    if tls_dir is None:
        return grpc.insecure_channel(address, options=options)
    from services.common.security import TlsFiles, tls_channel_options

    creds = TlsFiles.load(str(tls_dir / "scheduler")).channel_credentials()
    return grpc.secure_channel(address, creds, options=[*options, *tls_channel_options()])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------------------------
# the deployment


@dataclass
class Service:
    role: str  # verifier-1, verifier-2, drafter, scheduler
    args: list[str]
    port: int
    metrics_port: int
    log: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    tls_dir: Path | None = None  # mutual TLS: health checks present the scheduler's certificate

    def spawn(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(REPO))
        self.starts += 1
        log = open(self.log, "a")
        log.write(f"\n==== start {self.starts} at {time.time():.3f}\n")
        log.flush()
        self.proc = subprocess.Popen([sys.executable, "-m", "dspark_cli.main", "serve", *self.args], cwd=REPO,
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def channel(self) -> grpc.Channel:
        return client_channel(f"127.0.0.1:{self.port}", self.tls_dir, [])

    def serving(self) -> bool:
        try:
            with self.channel() as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_serving(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with code {self.proc.returncode} (log: {self.log})")
            if self.serving():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"{self.role} not SERVING after {timeout:.0f}s (log: {self.log})")

    def metric(self, name: str, labels: str = "") -> float | None:
        """One sample of the service's Prometheus endpoint (None when unreachable or absent)."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return None

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


class Deployment:
    def __init__(self, args, log_dir: Path):
        self.log_dir = log_dir
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.redis: subprocess.Popen | None = None
        common = ["--redis-url", self.redis_url, "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
                  "--log-level", args.log_level]
        self.tls_dir: Path | None = None
        self.api_key: str | None = None
        self.verifier_roles = [f"verifier-{i}" for i in range(1, args.verifiers + 1)]
        if args.tls:
            from dspark_cli.certs import make_certs

            self.tls_dir = log_dir / "certs"
            make_certs(self.tls_dir, force=True)
            self.api_key = f"load-{os.urandom(12).hex()}"
        model = ["--device", "cpu"]
        self.services: dict[str, Service] = {}

        def add(role, kind, extra):
            port, mport = free_port(), free_port()
            tls = ["--tls-dir", str(self.tls_dir / kind)] if self.tls_dir else []
            self.services[role] = Service(role, [kind, "--port", str(port), "--metrics-port", str(mport),
                                                 "--id", role, *common, *tls, *extra], port, mport,
                                          log_dir / f"{role}.log", tls_dir=self.tls_dir)

        for role in self.verifier_roles:
            add(role, "verifier", ["--target", args.target, "--drafter-path", args.drafter_path, *model])
        add("drafter", "drafter", ["--drafter-path", args.drafter_path, *model])
        add("scheduler", "scheduler", ["--target", args.target, "--max-active", str(args.max_active),
                                       "--max-waiting", str(max(256, 2 * args.concurrency)),
                                       "--verifier-grace", str(args.verifier_grace),
                                       *(["--api-key", self.api_key] if self.api_key else [])])

    def start(self, timeout: float) -> dict:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH")
        self.redis = subprocess.Popen([exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(self.log_dir)],
                                      stdout=open(self.log_dir / "redis.log", "w"), stderr=subprocess.STDOUT)
        startup = {}
        for role in (*self.verifier_roles, "drafter"):
            self.services[role].spawn()
        for role in (*self.verifier_roles, "drafter"):
            startup[role] = round(self.services[role].wait_serving(timeout), 2)
        self.services["scheduler"].spawn()
        startup["scheduler"] = round(self.services["scheduler"].wait_serving(timeout), 2)
        return startup

    def pids(self) -> dict[str, int | None]:
        out = {role: s.pid for role, s in self.services.items()}
        out["redis"] = self.redis.pid if self.redis is not None and self.redis.poll() is None else None
        return out

    def pod_records(self) -> dict:
        import redis

        r = redis.Redis(port=self.redis_port, decode_responses=True, socket_timeout=2)
        out = {}
        for key in r.keys("dspark:pod:*"):
            raw = r.get(key)
            if raw:
                rec = json.loads(raw)
                out[rec["id"]] = rec
        return out

    def checkpoints(self) -> list[str]:
        import redis

        return redis.Redis(port=self.redis_port, decode_responses=True, socket_timeout=2).keys("dspark:request:*")

    def stop(self) -> dict:
        codes = {}
        for role in ("scheduler", "drafter", *self.verifier_roles):
            codes[role] = self.services[role].stop()
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)
        return codes


# ------------------------------------------------------------------------------------------------
# the clients


@dataclass
class Record:
    prompt_index: int
    worker: int
    t_start: float
    request_id: str = ""
    t_first: float | None = None
    t_end: float | None = None
    status: str = "running"  # ok | failed | lost | running
    error: str = ""
    finish_reason: str = ""
    num_tokens: int = 0
    tokens: list[int] = field(default_factory=list)


class Load:
    def __init__(self, address: str, prompts: list[list[int]], args, t0: float, tls_dir: Path | None = None,
                 api_key: str | None = None):
        self.prompts, self.args, self.t0 = prompts, args, t0
        self.channel = client_channel(address, tls_dir, [("grpc.max_receive_message_length", 64 * MiB)])
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.stub = scheduler_service_pb2_grpc.SchedulerServiceStub(self.channel)
        self.records: list[Record] = []
        self.token_events: list[tuple[float, int]] = []  # (seconds since t0, tokens in the chunk)
        self._next = 0
        self._lock = threading.Lock()
        self.stop_at = float("inf")
        self.threads: list[threading.Thread] = []

    def _prompt_index(self) -> int:
        with self._lock:
            i = self._next % len(self.prompts)
            self._next += 1
            return i

    def one(self, worker: int) -> Record:
        i = self._prompt_index()
        rec = Record(i, worker, time.monotonic() - self.t0)
        self.records.append(rec)
        req = types_pb2.GenerateRequest(prompt_token_ids=types_pb2.TokenIds(token_ids=self.prompts[i]),
                                        sampling=types_pb2.SamplingParams(temperature=0.0,
                                                                          max_new_tokens=self.args.max_new_tokens))
        try:
            for chunk in self.stub.Generate(req, timeout=self.args.request_timeout, metadata=self.metadata):
                now = time.monotonic() - self.t0
                rec.request_id = rec.request_id or chunk.request_id
                if chunk.token_ids:
                    rec.tokens.extend(chunk.token_ids)
                    self.token_events.append((now, len(chunk.token_ids)))
                    if rec.t_first is None:
                        rec.t_first = now
                if chunk.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED:
                    rec.finish_reason = types_pb2.FinishReason.Name(chunk.finish_reason)
            rec.t_end = time.monotonic() - self.t0
            rec.num_tokens = len(rec.tokens)
            if rec.finish_reason:
                rec.status = "ok"
            else:
                rec.status, rec.error = "lost", "stream ended without a final chunk"
        except grpc.RpcError as exc:
            rec.t_end = time.monotonic() - self.t0
            rec.status = "lost" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
            rec.error = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # noqa: BLE001 - every failure is counted
            rec.t_end = time.monotonic() - self.t0
            rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"
        return rec

    def _worker(self, w: int) -> None:
        while time.monotonic() - self.t0 < self.stop_at:
            self.one(w)

    def start(self, duration: float) -> None:
        self.stop_at = duration
        for w in range(self.args.concurrency):
            t = threading.Thread(target=self._worker, args=(w,), name=f"client-{w}", daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for r in self.records:  # still open after the drain: never finished
            if r.status == "running":
                r.status, r.error = "lost", "still in flight after the drain"
        self.channel.close()


class RssSampler(threading.Thread):
    def __init__(self, deployment: Deployment, every: float, t0: float):
        super().__init__(name="rss", daemon=True)
        self.deployment, self.every, self.t0 = deployment, every, t0
        self.samples: list[dict] = []  # {"t": s, role: MiB}
        self.pids: list[dict] = []
        self._halt = threading.Event()

    def sample(self) -> None:
        row: dict = {"t": round(time.monotonic() - self.t0, 2)}
        pids = self.deployment.pids()
        for role, pid in pids.items():
            b = rss_bytes(pid) if pid else None
            row[role] = round(b / MiB, 1) if b else None
        row["pids"] = pids
        self.samples.append(row)

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


# ------------------------------------------------------------------------------------------------
# prompts and references


def held_out_prompts(data_dir: Path, tokenizer, max_prompt_tokens: int, limit: int, seed: int) -> list[list[int]]:
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import load_prompts, split

    texts = []
    for path in sorted(data_dir.glob("*.jsonl")):
        _, held = split(load_prompts(path))
        texts += [p.text for p in held]
    if not texts:
        raise RuntimeError(f"no prompts in {data_dir}/*.jsonl")
    random.Random(seed).shuffle(texts)
    out = []
    for text in texts[:limit]:
        ids = encode_prompt(tokenizer, text[:4 * max_prompt_tokens])
        while len(ids) > max_prompt_tokens:  # shorten the text, not the ids (keep the chat template's tail)
            text = text[: int(len(text) * 0.8)]
            ids = encode_prompt(tokenizer, text)
        out.append(ids)
    return out


def references(target_dir: str, prompts: dict[int, list[int]], max_new_tokens: int) -> dict[int, list[int]]:
    """The target's own greedy output for each prompt: the embedded engine with no drafter."""
    import torch

    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    torch.set_num_threads(1)
    target = TargetRuntime(TargetConfig(target_dir, device="cpu"))
    engine = Engine(target, None, EngineConfig(policy="ar", max_active=16))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(target.eos_token_ids))
    rids = {i: engine.add_request(p, params) for i, p in prompts.items()}
    engine.run()
    return {i: engine.pop(rid).output_ids for i, rid in rids.items()}


def reference_batch1(target_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    target = TargetRuntime(TargetConfig(target_dir, device="cpu"))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(target.eos_token_ids))
    return Engine(target, None, EngineConfig(policy="ar")).generate(prompt, params).output_ids


# ------------------------------------------------------------------------------------------------
# analysis


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 3)


def throughput_series(events: list[tuple[float, int]], duration: float, bin_s: float) -> list[list[float]]:
    n = int(duration // bin_s) + 1
    bins = [0] * n
    for t, k in events:
        if 0 <= t < n * bin_s:
            bins[int(t // bin_s)] += k
    return [[round((i + 0.5) * bin_s, 1), round(b / bin_s, 2)] for i, b in enumerate(bins)]


def rss_check(samples: list[dict], half: float, end: float, warm_s: float, restarted: dict[str, float]) -> dict:
    """Per process: RSS floor at the start of the second half (or `warm_s` after a restart, if later) vs at
    the end (samples up to `end`, the last sample after the drain included)."""
    out = {}
    roles = [k for k in samples[0] if k not in ("t", "pids")] if samples else []
    for role in roles:
        begin = max(half, restarted.get(role, -1.0) + warm_s)
        series = [(s["t"], s[role]) for s in samples if s.get(role) is not None and begin <= s["t"] <= end]
        first_all = next((s[role] for s in samples if s.get(role) is not None), None)
        if len(series) < 2:
            # a process restarted too late in a short run has no warm second half to judge; one that
            # was up all along must have been sampled
            late = role in restarted
            out[role] = {"rss_first_mib": first_all, "ok": late,
                         "why": f"fewer than 2 samples after t={begin:.0f}s" + (" (restarted late)" if late else "")}
            continue
        # the floor (minimum) of the first and of the last quarter of the window: a process's RSS swings
        # up to +40 MiB above its floor while it runs a large batch and drops back after (measured on the
        # drafter), so single samples or medians measure how busy it was; the floor is what it retains
        k = max(1, len(series) // 4)
        start = min(v for _, v in series[:k])
        stop = min(v for _, v in series[-k:])
        bound = max(RSS_GROWTH_BOUND_MIB, RSS_GROWTH_BOUND_FRACTION * start)
        out[role] = {"rss_first_mib": first_all, "rss_second_half_start_mib": start, "rss_end_mib": stop,
                     "rss_max_mib": max(v for _, v in series), "growth_mib": round(stop - start, 1),
                     "bound_mib": round(bound, 1), "from_t": series[0][0], "ok": stop - start <= bound}
    return out


def plot(path: Path, tput: list, samples: list[dict], events: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    a1.plot([t for t, _ in tput], [v for _, v in tput], color="tab:blue")
    a1.set_ylabel("generated tokens/s")
    a1.set_ylim(bottom=0)
    a1.set_title(title)
    roles = [k for k in samples[0] if k not in ("t", "pids")] if samples else []
    for role in roles:
        a2.plot([s["t"] for s in samples], [s.get(role) if s.get(role) is not None else float("nan") for s in samples],
                label=role)
    a2.set_ylabel("RSS (MiB)")
    a2.set_xlabel("seconds since load start")
    a2.legend(loc="center right", fontsize=8)
    for ax in (a1, a2):
        for name, t, color in (("kill", events.get("kill"), "red"), ("restart", events.get("restart"), "green"),
                               ("serving", events.get("serving"), "darkgreen")):
            if t is not None:
                ax.axvline(t, color=color, linestyle="--", linewidth=1)
                if ax is a1:
                    ax.text(t, ax.get_ylim()[1] * 0.95, f" {name}", color=color, fontsize=8, va="top")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="load_test.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--concurrency", type=int, default=32, help="client threads (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request (default 64)")
    p.add_argument("--kill-at", type=float, default=None, help="seconds into the load (default duration / 2)")
    p.add_argument("--restart-after", type=float, default=10.0, help="seconds the verifier stays dead (default 10)")
    p.add_argument("--no-kill", action="store_true", help="no verifier is killed")
    p.add_argument("--kill", choices=("verifier", "drafter"), default="verifier",
                   help="which pool loses a pod (default verifier)")
    p.add_argument("--verifiers", type=int, default=2, help="verifier replicas (default 2)")
    p.add_argument("--tls", action="store_true", help="mutual TLS between the services and an API key for clients")
    p.add_argument("--verifier-grace", type=float, default=30.0,
                   help="scheduler --verifier-grace: how long requests wait for a verifier (default 30)")
    p.add_argument("--out", default="runs/load", help="directory for summary.json and load.png (default runs/load)")
    p.add_argument("--log-dir", default=None, help="service logs (default: a temporary directory)")
    p.add_argument("--target", default=None,
                   help="target name or directory (default: the default target, DSPARK_TARGET overrides it)")
    p.add_argument("--drafter-path", default=None, help="drafter directory (default: the target's DSpark drafter)")
    p.add_argument("--data", default=str(REPO / "data" / "dev"), help="directory of *.jsonl")
    p.add_argument("--num-prompts", type=int, default=512, help="distinct held-out prompts to cycle (default 512)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompt length cap (default 256)")
    p.add_argument("--max-active", type=int, default=64, help="scheduler --max-active (default 64)")
    p.add_argument("--request-timeout", type=float, default=180.0, help="gRPC deadline per request (default 180)")
    p.add_argument("--sample-every", type=float, default=2.0, help="RSS sampling period (default 2)")
    p.add_argument("--bin", type=float, default=5.0, help="throughput bin in seconds (default 5)")
    p.add_argument("--check-sample", type=int, default=0,
                   help="check this many distinct prompts against the target (default 0: all served)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="WARNING", help="services' log level (default WARNING)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = args.duration / 2
    for name in ("duration", "concurrency", "max_new_tokens", "sample_every", "bin", "verifiers"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0; got {getattr(args, name)}")
    if not args.no_kill and not 0 < args.kill_at < args.duration:
        p.error(f"--kill-at must be inside (0, --duration); got {args.kill_at}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_core.stack import drafters_dir, resolve_target

    args.target = resolve_target(args.target)
    if args.drafter_path is None:
        args.drafter_path = str(drafters_dir(args.target) / "dspark")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="dspark-load-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    from dspark_core.target import load_tokenizer

    prompts = held_out_prompts(Path(args.data), load_tokenizer(args.target), args.max_prompt_tokens,
                               args.num_prompts, args.seed)
    dep = Deployment(args, log_dir)
    summary: dict = {"args": {k: v for k, v in vars(args).items()}, "log_dir": str(log_dir),
                     "prompts": len(prompts), "cpu_count": os.cpu_count()}
    print(f"load_test: {len(prompts)} prompts, logs in {log_dir}", flush=True)
    try:
        summary["startup_seconds"] = dep.start(args.startup_timeout)
    except Exception as exc:  # noqa: BLE001
        print(f"load_test: the deployment did not start: {exc}", file=sys.stderr)
        dep.stop()
        return 2
    print(f"load_test: deployment up {summary['startup_seconds']}", flush=True)

    t0 = time.monotonic()
    sampler = RssSampler(dep, args.sample_every, t0)
    sampler.start()
    load = Load(f"127.0.0.1:{dep.services['scheduler'].port}", prompts, args, t0, dep.tls_dir, dep.api_key)
    load.start(args.duration)
    events: dict = {}
    try:
        if not args.no_kill:
            time.sleep(max(0.0, args.kill_at - (time.monotonic() - t0)))
            recs = dep.pod_records()
            victim = "drafter" if args.kill == "drafter" else max(
                dep.verifier_roles, key=lambda r: (recs.get(r, {}).get("active_requests", 0), r == "verifier-1"))
            events["victim"] = victim
            events["victim_active_requests"] = recs.get(victim, {}).get("active_requests")
            dep.services[victim].proc.send_signal(signal.SIGKILL)
            dep.services[victim].proc.wait(10)
            events["kill"] = round(time.monotonic() - t0, 2)
            print(f"load_test: t={events['kill']}s SIGKILL {victim} "
                  f"({events['victim_active_requests']} active requests)", flush=True)
            time.sleep(args.restart_after)
            dep.services[victim].spawn()
            events["restart"] = round(time.monotonic() - t0, 2)
            dep.services[victim].wait_serving(args.startup_timeout)
            events["serving"] = round(time.monotonic() - t0, 2)
            print(f"load_test: t={events['restart']}s restarted {victim}, SERVING at t={events['serving']}s",
                  flush=True)
        while time.monotonic() - t0 < args.duration:
            time.sleep(0.5)
        load.join(args.request_timeout + 30)
        events["load_end"] = round(time.monotonic() - t0, 2)
        # state left behind: every pod's published active requests, every service's gauges, checkpoints
        time.sleep(3 * 2.0 + 1)  # heartbeats (2 s) catch up
        recs = dep.pod_records()
        sched = dep.services["scheduler"]
        leftovers = {
            "pods_active_requests": {pid: rec.get("active_requests") for pid, rec in sorted(recs.items())},
            "verifier_gauges": {r: dep.services[r].metric("dspark_active_requests", 'service="verifier"')
                                for r in dep.verifier_roles},
            "drafter_gauge": dep.services["drafter"].metric("dspark_active_requests", 'service="drafter"'),
            "scheduler_running": sched.metric("dspark_requests_running"),
            "scheduler_waiting": sched.metric("dspark_requests_waiting"),
            "checkpoints_in_redis": len(dep.checkpoints()),
            "verifier_expired_requests": {r: dep.services[r].metric("dspark_verifier_expired_requests_total")
                                          for r in dep.verifier_roles},
            "scheduler_draftless_rounds": sched.metric("dspark_draftless_rounds_total"),
            "scheduler_failovers": {pool: sched.metric("dspark_failovers_total", f'pool="{pool}"')
                                    for pool in ("verifier", "drafter")},
        }
        sampler.sample()
    finally:
        try:
            sampler.stop()
        finally:
            summary["exit_codes"] = dep.stop()

    # -- analysis
    recs_all = load.records
    ok = [r for r in recs_all if r.status == "ok"]
    failed = [r for r in recs_all if r.status == "failed"]
    lost = [r for r in recs_all if r.status == "lost"]
    lat = [r.t_end - r.t_start for r in ok]
    ttft = [r.t_first - r.t_start for r in ok if r.t_first is not None]
    tokens = sum(r.num_tokens for r in ok)
    kill, back = events.get("kill"), events.get("serving")
    across = [r for r in ok if kill is not None and r.t_start <= kill <= (r.t_end or 0)]
    tput = throughput_series(load.token_events, args.duration, args.bin)
    rates = [v for _, v in tput]

    def window_rate(a, b):
        return round(sum(k for t, k in load.token_events if a <= t < b) / max(b - a, 1e-9), 2)

    phases = {"before_kill": window_rate(10.0, kill) if kill else None,
              "victim_down": window_rate(kill, events["restart"]) if kill else None,
              "after_serving": window_rate(back, args.duration) if back else None,
              "whole_run": window_rate(0.0, args.duration)}

    # correctness against the target's own greedy output
    served = sorted({r.prompt_index for r in ok})
    check = served
    if args.check_sample and len(served) > args.check_sample:
        across_idx = sorted({r.prompt_index for r in across})
        rest = [i for i in served if i not in set(across_idx)]
        check = sorted(set(across_idx) | set(random.Random(args.seed).sample(rest, max(0, args.check_sample - len(across_idx)))))
    print(f"load_test: computing target greedy references for {len(check)} prompts", flush=True)
    t_ref = time.monotonic()
    ref = references(args.target, {i: prompts[i] for i in check}, args.max_new_tokens)
    mismatches = []
    checked = 0
    for r in ok:
        if r.prompt_index not in ref:
            continue
        checked += 1
        if r.tokens != ref[r.prompt_index]:
            want = ref[r.prompt_index]
            at = next((k for k, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
            solo = reference_batch1(args.target, prompts[r.prompt_index], args.max_new_tokens)
            mismatches.append({"request_id": r.request_id, "prompt_index": r.prompt_index, "first_diff": at,
                               "got_len": len(r.tokens), "want_len": len(want),
                               "matches_batch1_reference": r.tokens == solo,
                               "got_head": r.tokens[:12], "want_head": want[:12],
                               "across_kill": r in across})
    summary["reference_seconds"] = round(time.monotonic() - t_ref, 1)

    restarted = {events["victim"]: events["serving"]} if back else {}
    rss = rss_check(sampler.samples, args.duration / 2, float("inf"), 30.0, restarted)
    state_clean = (all(v == 0 for v in leftovers["pods_active_requests"].values())
                   and all(v == 0 for v in leftovers["verifier_gauges"].values())
                   and leftovers["drafter_gauge"] == 0 and leftovers["scheduler_running"] == 0
                   and leftovers["scheduler_waiting"] == 0 and leftovers["checkpoints_in_redis"] == 0)
    summary.update({
        "events": events,
        "requests": {"started": len(recs_all), "completed": len(ok), "failed": len(failed), "lost": len(lost),
                     "completed_across_kill": len(across),
                     "finish_reasons": {k: sum(1 for r in ok if r.finish_reason == k)
                                        for k in sorted({r.finish_reason for r in ok})}},
        "errors": [{"status": r.status, "error": r.error[:300], "t_start": round(r.t_start, 2),
                    "request_id": r.request_id} for r in failed + lost][:50],
        "latency_seconds": {"p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99),
                            "max": round(max(lat), 3) if lat else None},
        "time_to_first_token_seconds": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9),
                                        "p99": percentile(ttft, 0.99)},
        "tokens": {"generated": tokens, "tokens_per_second": phases,
                   "binned_min_after_warmup": min(rates[2:]) if len(rates) > 2 else None},
        "throughput_series": tput,
        "correctness": {"checked_requests": checked, "distinct_prompts": len(check), "mismatches": mismatches},
        "leftover_state": leftovers, "state_clean": state_clean,
        "rss": rss, "rss_samples": [{k: v for k, v in s.items() if k != "pids"} for s in sampler.samples],
    })
    problems = []
    if failed:
        problems.append(f"{len(failed)} failed requests")
    if lost:
        problems.append(f"{len(lost)} lost requests")
    if mismatches:
        problems.append(f"{len(mismatches)} outputs differ from the target's greedy output")
    if not ok:
        problems.append("no request completed")
    if not state_clean:
        problems.append(f"request state left behind: {leftovers}")
    bad_rss = [role for role, v in rss.items() if not v.get("ok")]
    if bad_rss:
        problems.append(f"RSS grew beyond the bound: {bad_rss}")
    summary["problems"] = problems
    summary["ok"] = not problems
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(out / "load.png", tput, sampler.samples, events,
         f"{args.concurrency} clients, greedy, {args.max_new_tokens} new tokens; "
         f"{len(ok)} completed, {len(failed)} failed, {len(lost)} lost")

    brief = {k: summary[k] for k in ("requests", "latency_seconds", "events")}
    brief["tokens_per_second"] = phases
    brief["rss_mib"] = {role: (v.get("rss_first_mib"), v.get("rss_second_half_start_mib"), v.get("rss_end_mib"),
                               v.get("ok")) for role, v in rss.items()}
    brief["correctness"] = {"checked_requests": checked, "mismatches": len(mismatches)}
    brief["state_clean"] = state_clean
    print(json.dumps(brief, indent=1))
    print(f"load_test: wrote {out / 'summary.json'} and {out / 'load.png'}")
    for p in problems:
        print(f"load_test: FAIL: {p}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
