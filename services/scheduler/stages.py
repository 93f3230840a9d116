"""Where a scheduler's engine step spends its time (issue 21): one clock, read by metrics and the bench.

Every stage is wall time of the engine thread, added up over steps, so the stages of a step partition it:

  prefill                       admission (Prefill RPCs, or the local prefill)
  propose.serialize / .rpc / .deserialize / .other
                                the drafter call: building the protos, the call itself (from its start to
                                its answer), reading the answer (with, rarely, the failover handling of
                                items the pod refused), and the rest (placement, failover, trace context);
                                embedded: `draft` holds the local pass
  propose.rpc = drafter.forward + drafter.queue + propose.transport
                                what the drafter reported doing (its forward pass, its queue / coalescing
                                wait) and the rest of the round trip (gRPC, the wire, server-side protos);
                                propose.send, the part of transport spent starting the call, on its own
  verify.* / verifier.*         the same for the verifier
  schedule                      the policy and the verify blocks
  engine.other                  the engine's own bookkeeping in the step (commit, monitors)
  loop.events                   the loop after a step: updates to the handlers, metrics, traces
  loop.checkpoint               building the request checkpoints handed to the background writer
  loop.periodic                 the once-a-second work left on the engine thread (gauges; the Redis
                                publication itself runs on its own thread)
  idle                          the engine thread had no request to step

`per_step` adds `pod_idle_share`: the share of the step's wall time each pod spent outside its forward pass
(with one pod per pool; the pods wait for each other, the design's cost that overlap would recover).

`dspark_scheduler_stage_seconds_total{stage}` and `dspark_scheduler_steps_total` carry it to Prometheus;
`dspark bench --distributed` reads their deltas around each load and reports seconds per step.
Knows nothing about gRPC or models.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from ..common import metrics


class StageClock:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        metrics.STAGE_SECONDS.labels(stage=stage).inc(seconds)

    def step(self) -> None:
        with self._lock:
            self.steps += 1
        metrics.STEPS.inc()

    @contextmanager
    def time(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def snapshot(self) -> tuple[int, dict[str, float]]:
        with self._lock:
            return self.steps, dict(self.seconds)


CLOCK = StageClock()  # one per process: a scheduler runs one engine loop


def per_step(before: tuple[int, dict], after: tuple[int, dict]) -> dict:
    """Seconds per step of each stage between two snapshots (`StageClock.snapshot` or parsed metrics), with
    `steps` and each stage's share of the accounted time."""
    steps = after[0] - before[0]
    diff = {k: v - before[1].get(k, 0.0) for k, v in after[1].items()}
    diff = {k: v for k, v in diff.items() if v > 1e-9}
    out: dict = {"steps": steps}
    if steps <= 0:
        return out
    # the stages that partition the engine thread's time (sub-stages of an rpc are not added twice)
    top = {k: v for k, v in diff.items() if k not in _PARTS}
    total = sum(top.values())
    out["seconds_per_step"] = {k: round(v / steps, 6) for k, v in sorted(diff.items())}
    out["share"] = {k: round(v / total, 4) for k, v in sorted(top.items())} if total > 0 else {}
    out["wall_per_step_s"] = round(total / steps, 6)
    # each pod is busy its reported forward time of every step and idle the rest (one pod per pool)
    out["pod_idle_share"] = {pod: round(max(0.0, 1 - diff[f"{pod}.forward"] / total), 4)
                             for pod in ("drafter", "verifier") if f"{pod}.forward" in diff and total > 0}
    return out


# sub-stages of propose.rpc / verify.rpc (the others partition the engine thread's wall time)
_PARTS = frozenset({"drafter.forward", "drafter.queue", "propose.transport", "propose.send",
                    "verifier.forward", "verifier.queue", "verify.transport", "verify.send"})


# the scheduler's speculation counters a bench reads beside the stages (services/common/metrics.py)
SPEC_COUNTERS = {"dspark_spec_decode_drafts_total": "rounds", "dspark_spec_decode_draft_tokens_total": "draft_tokens",
                 "dspark_spec_decode_accepted_tokens_total": "accepted_tokens", "dspark_generation_tokens_total": "tokens"}


def parse_spec_counters(text: str) -> dict[str, float]:
    """The speculation counters of a /metrics page, by SPEC_COUNTERS' short names (absent ones are 0)."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] = float(value)
    return out


def speculation_per_step(steps: int, before: dict[str, float], after: dict[str, float]) -> dict:
    """What the steps between two `parse_spec_counters` readings decided: request-rounds, draft tokens verified
    and accepted, and tokens generated, per step (and the acceptance). Two deployments that spend the same time a
    step but need different numbers of steps for the same tokens differ here, not in the stages."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS.values()}
    if steps <= 0:
        return {}
    out = {f"{k}_per_step": round(v / steps, 4) for k, v in d.items()}
    out["draft_tokens_per_round"] = round(d["draft_tokens"] / d["rounds"], 4) if d["rounds"] > 0 else 0.0
    out["acceptance"] = round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"] > 0 else None
    return out


def parse_prometheus(text: str) -> tuple[int, dict[str, float]]:
    """(steps, stage seconds) from a /metrics page."""
    steps, stages = 0, {}
    for line in text.splitlines():
        if line.startswith("dspark_scheduler_steps_total "):
            steps = int(float(line.split()[-1]))
        elif line.startswith('dspark_scheduler_stage_seconds_total{stage="'):
            name = line.split('"')[1]
            stages[name] = float(line.split()[-1])
    return steps, stages
