"""`dspark bench --distributed`: the serving bench over real processes (issue 21).

Two deployments of the same models run side by side on loopback, each as real processes:
- embedded: `dspark serve all` (target and drafter in the scheduler's process);
- distributed: redis-server + `dspark serve verifier` + `dspark serve drafter` + `dspark serve scheduler`.
For every concurrency C and repeat, the same prompt list goes through each (interleaved: embedded, then
distributed, then the next repeat), closed loop with C requests in flight over gRPC GenerateUnary, and the
aggregate tokens/s is measured. Both schedulers expose /metrics; the deltas of
`dspark_scheduler_stage_seconds_total{stage}` around each load give the stage breakdown per step
(services/scheduler/stages.py). Greedy outputs of the two deployments are compared token for token.

`scripts/bench_distributed.py` is the same orchestration at one concurrency, for a quick check.
Knows nothing about the engine: it talks to the services only.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspark_core.errors import InvalidArgument
from dspark_core.scheduling import DRAFT_WINDOW
from dspark_core.lookup import DEFAULT_LOOKUP_NGRAM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    """One set of service processes on loopback: its scheduler's gRPC address and metrics port."""

    name: str
    port: int
    metrics_port: int
    procs: list = field(default_factory=list)
    log: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> tuple[int, dict[str, float], dict[str, float]]:
        """(steps, stage seconds, speculation counters) from the scheduler's /metrics."""
        from services.scheduler.stages import parse_prometheus, parse_spec_counters

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return (*parse_prometheus(text), parse_spec_counters(text))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()


def _dspark(*args) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.main", *args]


class Cluster:
    """Starts the embedded and the distributed deployment; `stop()` ends every process it started."""

    def __init__(self, target_dir: str, drafter_dir: str | None, policy: str, block_size: int | None,
                 log_dir: Path, env: dict | None = None, draft_window: int | None = DRAFT_WINDOW,
                 lookup_ngram: int = DEFAULT_LOOKUP_NGRAM):
        """`env`: the processes' environment (default this one's), e.g. another PYTHONPATH for an A/B run.
        `draft_window`: the schedulers' --draft-window (None: the whole prompt); passed only when not the
        default, so that an A/B run against an older checkout starts."""
        self.target_dir, self.drafter_dir, self.policy, self.block_size = target_dir, drafter_dir, policy, block_size
        self.draft_window = draft_window
        self.lookup_ngram = lookup_ngram  # the schedulers' --lookup-ngram (passed only when not the default)
        self.env = env
        self.log_dir = log_dir
        self.deployments: list[Deployment] = []
        self.redis = None

    def _spawn(self, dep: Deployment, argv: list[str]) -> None:
        err = open(dep.log, "a")  # noqa: SIM115 - closed with the process
        env = dict(os.environ if self.env is None else self.env)
        # every process shares this machine's cores: OpenMP threads spinning after a forward would take the
        # core another process's forward needs (distributed, 2 cores, c = 1: +15-20% tokens/s; embedded
        # unchanged within noise), as docker-compose.yml sets for its pods
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        dep.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env))
        err.close()

    def _engine_args(self) -> list[str]:
        out = ["--policy", self.policy, "--max-active", "64", "--max-waiting", "1024", "--log-level", "WARNING"]
        if self.block_size is not None:
            out += ["--block-size", str(self.block_size)]
        if self.draft_window != DRAFT_WINDOW:
            out += ["--draft-window", str(self.draft_window or 0)]
        if self.lookup_ngram != DEFAULT_LOOKUP_NGRAM:
            out += ["--lookup-ngram", str(self.lookup_ngram)]
        return out

    def start_embedded(self) -> Deployment:
        dep = Deployment("embedded", free_port(), free_port(), log=self.log_dir / "embedded.log")
        self.deployments.append(dep)
        drafter = ["--drafter-path", self.drafter_dir] if self.drafter_dir else ["--drafter", "none"]
        self._spawn(dep, _dspark("serve", "all", "--port", str(dep.port), "--host", "127.0.0.1",
                                 "--metrics-port", str(dep.metrics_port), "--target", self.target_dir, *drafter,
                                 *self._engine_args()))
        return dep

    def start_distributed(self) -> Deployment:
        redis_exe = shutil.which("redis-server")
        if redis_exe is None:
            raise InvalidArgument("--distributed", True, "needs redis-server on PATH (apt-get install redis-server)")
        dep = Deployment("distributed", free_port(), free_port(), log=self.log_dir / "distributed.log")
        self.deployments.append(dep)
        rp = free_port()
        dep.procs.append(subprocess.Popen([redis_exe, "--port", str(rp), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no", "--dir", str(self.log_dir)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"redis://127.0.0.1:{rp}/0"
        common = ["--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--redis-url", url,
                  "--log-level", "WARNING"]
        drafter = ["--drafter-path", self.drafter_dir] if self.drafter_dir else []
        self._spawn(dep, _dspark("serve", "verifier", "--port", str(free_port()), "--metrics-port", str(free_port()),
                                 "--target", self.target_dir, *drafter, *common))
        if self.drafter_dir:
            self._spawn(dep, _dspark("serve", "drafter", "--port", str(free_port()),  # --target: the tensors it
                                     "--metrics-port", str(free_port()), "--target", self.target_dir,  # may share
                                     *drafter, *common))
        self._spawn(dep, _dspark("serve", "scheduler", "--port", str(dep.port), "--metrics-port",
                                 str(dep.metrics_port), "--target", self.target_dir, "--startup-wait", "300",
                                 *(["--drafter", "none"] if not self.drafter_dir else []),
                                 *common,
                                 *self._engine_args()))
        return dep

    def stop(self) -> None:
        for dep in self.deployments:
            dep.stop()


def wait_ready(dep: Deployment, timeout: float = 300.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(dep.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not dep.alive():
                raise RuntimeError(f"the {dep.name} deployment exited while starting (see {dep.log})")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"the {dep.name} deployment was not serving after {timeout:.0f} s (see {dep.log})")


class Client:
    """GenerateUnary over one channel, `concurrency` requests in flight."""

    def __init__(self, dep: Deployment):
        import grpc

        from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc

        self.channel = grpc.insecure_channel(dep.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = scheduler_service_pb2_grpc.SchedulerServiceStub(self.channel)

    def call(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int | None) -> list[int]:
        from dspark_protos.dspark.v1 import types_pb2

        sampling = types_pb2.SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        if seed is not None:
            sampling.seed = seed
        req = types_pb2.GenerateUnaryRequest(prompt_token_ids=types_pb2.TokenIds(token_ids=list(ids)), sampling=sampling)
        return list(self.stub.GenerateUnary(req, timeout=600).token_ids)

    def load(self, prompts: list[list[int]], concurrency: int, max_new_tokens: int, temperature: float,
             seed: int) -> tuple[float, list[list[int]], float]:
        """Closed loop: every prompt once (cycled to at least 2 x concurrency requests); (tokens/s, outputs of
        the prompts' first pass, wall seconds)."""
        n = max(len(prompts), 2 * concurrency)
        jobs = [(i, prompts[i % len(prompts)]) for i in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as ex:
            outs = list(ex.map(lambda j: self.call(j[1], max_new_tokens, temperature,
                                                   None if temperature == 0 else seed + j[0]), jobs))
        wall = time.perf_counter() - t0
        return sum(map(len, outs)) / wall, outs[:len(prompts)], wall

    def close(self) -> None:
        self.channel.close()


def _median(xs):
    return statistics.median(xs) if xs else None


def run_distributed_bench(target_dir: str, drafter_dir: str | None, prompts: list[list[int]], policy: str,
                          concurrencies: list[int], repeats: int, max_new_tokens: int, temperature: float,
                          seed: int, block_size: int | None, progress=None,
                          draft_window: int | None = DRAFT_WINDOW, lookup_ngram: int = DEFAULT_LOOKUP_NGRAM
                          ) -> dict:
    """Embedded vs distributed over real processes; see the module doc. Returns the JSON-ready result."""
    log_dir = Path(tempfile.mkdtemp(prefix="dspark-bench-dist-"))
    cluster = Cluster(target_dir, drafter_dir, policy, block_size, log_dir, draft_window=draft_window,
                      lookup_ngram=lookup_ngram)
    try:
        deps = [cluster.start_embedded(), cluster.start_distributed()]
        for dep in deps:
            wait_ready(dep)
        clients = {dep.name: Client(dep) for dep in deps}
        for dep in deps:  # warm-up: one request each (first-call costs are not the bench's)
            clients[dep.name].call(prompts[0], 4, temperature, None if temperature == 0 else seed)
        # and one untimed closed loop per concurrency (the timed one's shape, longest prompts): the first load at a
        # new concurrency grows the KV stores inside the timed window (SmolLM2, 8 -> 32 slots of 1,024 positions:
        # a 1.9-2.2 s copy in each deployment, which one unpaired repeat then carries alone)
        longest = sorted(prompts, key=len, reverse=True)
        for c in concurrencies:
            if c > 1:
                for dep in deps:
                    clients[dep.name].load(longest[:c], c, max_new_tokens, temperature, seed)
        rates: dict[str, dict[int, list[float]]] = {d.name: {c: [] for c in concurrencies} for d in deps}
        stages: dict[str, dict[int, list]] = {d.name: {} for d in deps}  # (before, after) metrics per load
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(repeats):
            for c in concurrencies:
                for dep in deps:
                    before = dep.metrics()
                    rate, outs, _ = clients[dep.name].load(prompts, c, max_new_tokens, temperature, seed)
                    after = dep.metrics()
                    rates[dep.name][c].append(rate)
                    stages[dep.name].setdefault(c, []).append((before, after))
                    outputs.setdefault(dep.name, outs)
                    if progress:
                        progress(f"{dep.name} c={c} rep {rep + 1}/{repeats}: {rate:.1f} tokens/s")
        for cl in clients.values():
            cl.close()
    finally:
        cluster.stop()
    return _report(rates, stages, outputs, concurrencies, temperature, log_dir)


def _sum_spans(spans) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """Stage totals over the load windows only (not the other deployment's turns in between)."""
    steps, secs = 0, {}
    for before, after in spans:
        steps += after[0] - before[0]
        for k, v in after[1].items():
            secs[k] = secs.get(k, 0.0) + v - before[1].get(k, 0.0)
    return (0, {}), (steps, secs)


def _speculation(spans) -> dict:
    """Per step over the load windows: what the policy and the draft gate decided (speculation_per_step)."""
    from services.scheduler.stages import speculation_per_step

    steps, total = 0, {}
    for before, after in spans:
        steps += after[0] - before[0]
        for k, v in after[2].items():
            total[k] = total.get(k, 0.0) + v - before[2].get(k, 0.0)
    return speculation_per_step(steps, {}, total)


def _breakdown(spans) -> dict:
    from services.scheduler.stages import per_step

    out = per_step(*_sum_spans(spans))
    spec = _speculation(spans)
    if spec:
        out["speculation"] = spec
    return out


def _report(rates, stages, outputs, concurrencies, temperature, log_dir) -> dict:
    results, ratio, paired = [], {}, {}
    for name, by_c in rates.items():
        for c, xs in by_c.items():
            results.append({"mode": name, "concurrency": c, "tokens_per_s": [round(x, 2) for x in xs],
                            "median_tokens_per_s": round(_median(xs), 2)})
    for c in concurrencies:
        e, d = rates["embedded"][c], rates["distributed"][c]
        ratio[str(c)] = round(_median(d) / _median(e), 3) if _median(e) else None
        paired[str(c)] = round(_median([b / a for a, b in zip(e, d) if a]), 3)
    breakdown = {name: {str(c): _breakdown(spans) for c, spans in by_c.items()}
                 for name, by_c in stages.items()}
    out = {"results": results, "distributed_vs_embedded": ratio, "distributed_vs_embedded_paired": paired,
           "stage_breakdown": breakdown, "logs": str(log_dir)}
    if temperature == 0:
        out["outputs_match"] = outputs.get("embedded") == outputs.get("distributed")
    return out


def human_summary(r: dict) -> str:
    lines = [f"{'mode':<12} {'conc':>4} {'median tok/s':>12}  repeats"]
    for x in r["results"]:
        lines.append(f"{x['mode']:<12} {x['concurrency']:>4} {x['median_tokens_per_s']:>12.1f}  "
                     + " ".join(f"{v:.1f}" for v in x["tokens_per_s"]))
    lines.append("distributed / embedded (ratio of medians): "
                 + ", ".join(f"c={c} {v:.3f}x" for c, v in r["distributed_vs_embedded"].items() if v is not None))
    if "outputs_match" in r:
        lines.append(f"greedy outputs identical in both modes: {'yes' if r['outputs_match'] else 'NO'}")
    lines.append("")
    lines.append("stage breakdown (ms per step, engine thread of the scheduler; * = inside an rpc)")
    from services.scheduler.stages import _PARTS

    for name, by_c in r["stage_breakdown"].items():
        for c, b in by_c.items():
            sps = b.get("seconds_per_step", {})
            if not sps:
                continue
            parts = ", ".join(f"{'*' if k in _PARTS else ''}{k} {v * 1e3:.2f}" for k, v in sps.items())
            idle = ", ".join(f"{pod} idle {v:.0%}" for pod, v in b.get("pod_idle_share", {}).items())
            sp = b.get("speculation")
            spec = (f"; {sp['tokens_per_step']:.2f} tokens, {sp['draft_tokens_per_step']:.2f} draft tokens a step"
                    if sp else "")
            lines.append(f"{name} c={c} ({b['steps']} steps, {b['wall_per_step_s'] * 1e3:.2f} ms/step{spec}"
                         f"{'; ' + idle if idle else ''}): {parts}")
    return "\n".join(lines)
