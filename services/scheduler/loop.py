"""The scheduler's engine thread: one dspark_core Engine stepping continuously for every request.

gRPC / HTTP handlers (asyncio) talk to it only through thread-safe calls: `submit()` (returns a
concurrent Future with the request id, or the dspark_core error that refused it), `cancel()`; each
request's updates go to its `sink`, called on the engine thread (handlers forward them to their event
loop). After each step it records metrics and request checkpoints (written to Redis by a background
writer, so Redis never stalls a round) and, once a second, the load summaries and autoscaling signal
(read on the engine thread, published to Redis from a thread of their own).
Knows nothing about protos or text.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from dspark_core.cost_model import SpsTable
from dspark_core.engine import Engine, StepRecord
from dspark_core.errors import DSparkError, KVCacheFull, ResourceExhausted
from dspark_core.sampling import SamplingParams

from opentelemetry import trace

from ..common import metrics
from ..common.errors import Unavailable
from ..common.registry import Registry
from ..common.tracing import tracer
from .stages import CLOCK

log = logging.getLogger("dspark.engine_loop")


def _public_step_error(exc: BaseException, failures: int) -> BaseException:
    """What each client of a step that kept failing is told. The step's own error is about the whole batch: it
    can name other clients' request ids, pod addresses or another scheduler (it is in this scheduler's log);
    a client learns the kind of failure and nothing of anyone else."""
    if isinstance(exc, Unavailable):
        return Unavailable(f"no verifier could run this request's step ({failures} tries over the grace period); "
                           "retry later (the scheduler's log has the cause)")
    if isinstance(exc, KVCacheFull):
        return KVCacheFull("the verifiers had no KV room for this request's step; retry later",
                           fits_alone=exc.fits_alone)
    if isinstance(exc, ResourceExhausted):
        return ResourceExhausted("the serving pool was out of room for this request's step; retry later")
    # anything else is the server's fault, never the client's: INTERNAL with a generic message
    return RuntimeError("the step serving this request failed")


@dataclass
class Update:
    """What a request's sink receives after a step."""

    request_id: str
    token_ids: list[int]
    round: dict | None = None  # index, num_drafted, num_verified, num_accepted, num_committed
    finished: bool = False
    finish_reason: str | None = None
    summary: dict | None = None
    error: BaseException | None = None
    # one dspark_core TokenLogprob per token of token_ids when the request asked for logprobs
    logprobs: list | None = None


@dataclass
class _Tracked:
    sink: Callable[[Update], None]
    span_context: object = None  # the request's trace (a SpanContext), parent of its round spans
    adopted: int = 0  # tokens of the engine prompt that the client sees as generated (an adopted request)
    t_start: float = field(default_factory=time.perf_counter)
    t_last: float | None = None
    rounds_seen: int = 0


class CheckpointWriter:
    """Latest-wins background writes of request checkpoints to Redis; `owner` (the scheduler id) deletes only
    checkpoints that name it, never another client's request of the same id on another scheduler."""

    def __init__(self, registry: Registry, owner: str):
        self.registry, self.owner = registry, owner
        self._pending: dict[str, dict | None] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="checkpoints", daemon=True)
        self._thread.start()

    def put(self, request_id: str, data: dict | None) -> None:
        with self._lock:
            self._pending[request_id] = data
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                continue
            try:
                self.registry.write_checkpoints({k: v for k, v in batch.items() if v is not None})
                for rid in [k for k, v in batch.items() if v is None]:
                    self.registry.delete_checkpoint(rid, self.owner)
            except Exception:  # noqa: BLE001 - checkpoints are best effort; the writer must survive
                log.exception("checkpoint write failed")

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(2.0)


class EngineLoop:
    def __init__(self, make_engine: Callable[[Callable[[StepRecord], None]], Engine], registry: Registry | None = None,
                 scheduler_id: str = "scheduler", checkpoint: Callable[[str], dict | None] | None = None,
                 pods_capacity: Callable[[], dict] | None = None, autoscaler=None, record_rounds: str | None = None,
                 target_user_tps: float | None = None, verifier_grace_s: float = 30.0):
        """`make_engine(observer)` builds the engine this loop drives, with `observer` as its step observer."""
        self.registry, self.scheduler_id = registry, scheduler_id
        self.record_rounds = record_rounds  # JSON-lines file every verified round is appended to
        self._rounds_buffer: list = []
        self.target_user_tps = target_user_tps
        self._counted = {"fallback": 0, "skipped": 0, "lookup": 0, "lookup_accepted": 0}
        self._objective_feasible = True
        self._forecast = None  # DemandForecast of the users, with --target-user-tps
        self.pod_start_s = 30.0  # seconds a new pod takes to serve (the forecast's horizon beyond the window)
        self._checkpoint = checkpoint
        self._pods_capacity = pods_capacity
        self.autoscaler = autoscaler  # optional: services.scheduler.autoscaler.Autoscaler
        self._scaling: threading.Thread | None = None
        self._publishing: threading.Thread | None = None  # the load publication of the last second
        self._failures = 0  # consecutive failed steps
        self._failing_since: float | None = None  # monotonic time of the first of them
        self.max_step_failures = 3
        # seconds a step that fails for want of a verifier (Unavailable) is retried before its requests
        # fail: a lone verifier that restarts within this gets them back, resumed from their checkpoints
        self.verifier_grace_s = verifier_grace_s
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = threading.Event()
        self._writer = CheckpointWriter(registry, scheduler_id) if registry is not None else None
        self._last_summary = 0.0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self._times: dict[str, tuple[int, int]] = {}  # stage -> (start, end) ns of the last step
        # survival-probability mass each request wants verified this round (sum over its draft positions
        # of the prefix products of confidences): the demand summary published per verifier
        self.demand_mass: dict[str, float] = {}
        self.demand_rows: dict[str, list[float]] = {}
        self.budgets = None  # optional ClusterBudgets (async policy, distributed)
        self.engine = make_engine(self._observe)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout)
        if self._publishing is not None:  # a publication in flight finishes before Redis is closed
            self._publishing.join(2.0)
        if self._writer:
            self._writer.stop()
        if self._rounds_buffer:
            self._watch_gauges()  # flush the recorded rounds

    @property
    def num_requests(self) -> int:
        return len(self._tracked)

    # -- thread-safe API
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               sink: Callable[[Update], None], span_context=None, adopted: int = 0) -> Future:
        """`adopted`: how many trailing prompt tokens were generated under a previous scheduler."""
        fut: Future = Future()
        self._commands.put(("add", prompt_ids, params, request_id, sink, fut, span_context, adopted))
        return fut

    def submit_group(self, entries: list[tuple]) -> list[Future]:
        """Several `submit(*entry)` calls handled in one go, so the requests join the engine in the same
        step (the n choices of one request: the verifier then prefills their shared prompt once)."""
        futures = [Future() for _ in entries]
        self._commands.put(("group", [(*e, fut) for e, fut in zip(entries, futures)]))
        return futures

    def cancel(self, request_id: str, sink: Callable[[Update], None] | None = None) -> None:
        """Cancel a request; with `sink`, only if it is still the request submitted with that sink (a
        later request that reuses the id, or one that a duplicate submit was refused for, is not touched)."""
        self._commands.put(("cancel", request_id, sink))

    # -- engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_work
            t_wait = time.perf_counter()
            try:
                cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            except queue.Empty:
                cmd = False
            if block:
                CLOCK.add("idle", time.perf_counter() - t_wait)
            while cmd is not False:
                if cmd is None:
                    return
                self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = False
            if self.engine.has_work:
                self._step()
            with CLOCK.time("loop.periodic"):
                self._periodic()

    def _handle(self, cmd) -> None:
        if cmd[0] == "group":
            for prompt_ids, params, rid, sink, span_context, adopted, fut in cmd[1]:
                self._handle(("add", prompt_ids, params, rid, sink, fut, span_context, adopted))
        elif cmd[0] == "add":
            _, prompt_ids, params, rid, sink, fut, span_context, adopted = cmd
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, generated_in_prompt=adopted)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
                return
            self._tracked[rid] = _Tracked(sink, span_context, adopted=adopted)
            fut.set_result(rid)
        elif cmd[0] == "cancel":
            _, rid, sink = cmd
            t = self._tracked.get(rid)
            if t is not None and rid in self.engine.requests and (sink is None or t.sink is sink):
                self._forget(rid)
                metrics.REQUESTS.labels(finish_reason="cancelled").inc()
                log.info("request cancelled", extra={"request_id": rid})

    def _forget(self, rid: str) -> _Tracked | None:
        """Take a request out of the engine (releasing it on its pods) and out of Redis."""
        req = self.engine.requests.get(rid)
        if req is not None:
            if not req.finished:
                self.engine.cancel(rid)
            self.engine.pop(rid)
        self.demand_mass.pop(rid, None)
        self.demand_rows.pop(rid, None)
        if self._writer:
            self._writer.put(rid, None)
        return self._tracked.pop(rid, None)

    def _fail(self, rid: str, exc: BaseException) -> None:
        t = self._forget(rid)
        metrics.REQUESTS.labels(finish_reason="error").inc()
        if t is not None:
            t.sink(Update(rid, [], finished=True, finish_reason="error", error=exc))

    def _step(self) -> None:
        self._times = {}
        links = [trace.Link(t.span_context) for t in list(self._tracked.values())[:32]
                 if t.span_context is not None and t.span_context.is_valid]
        t_step = time.time_ns()
        before = CLOCK.snapshot()[1]
        t0 = time.perf_counter()
        try:
            with tracer.start_as_current_span("engine.step", links=links):
                events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failure of the step itself (requests at fault fail alone)
            CLOCK.add("engine.failed", time.perf_counter() - t0)
            # nothing was committed and every request is still queued or active (dspark_core.engine): retry,
            # for the verifier grace period when no verifier is reachable, else a few times; then fail them
            now = time.monotonic()
            self._failing_since = self._failing_since if self._failures else now
            self._failures += 1
            waiting = isinstance(exc, Unavailable) and now - self._failing_since < self.verifier_grace_s
            if self._failures == 1 or not isinstance(exc, (DSparkError, Unavailable)):
                (log.warning if isinstance(exc, (DSparkError, Unavailable)) else log.exception)(
                    "engine step failed: %s", exc, extra={"consecutive": self._failures})
            if waiting or self._failures < self.max_step_failures:
                time.sleep(min(0.05 * self._failures, 0.5))  # back off before retrying
                return
            log.error("engine step keeps failing; failing its requests: %s", exc,
                      extra={"requests": len(self._tracked), "consecutive": self._failures})
            public = _public_step_error(exc, self._failures)
            for rid in list(self._tracked):
                self._fail(rid, public)
            self._failures = 0
            return
        self._failures = 0
        self.steps += 1
        self._account(before, time.perf_counter() - t0)
        t_events = time.perf_counter()
        t_ck = [0.0]
        try:
            self._after_step(events, t_step, t_ck)
        finally:
            CLOCK.add("loop.checkpoint", t_ck[0])
            CLOCK.add("loop.events", time.perf_counter() - t_events - t_ck[0])

    def _account(self, before: dict, wall: float) -> None:
        """Stage times of the step just run (services/scheduler/stages.py): the engine's own timings, split
        further by what the remote stand-ins measured inside them."""
        CLOCK.step()
        after = CLOCK.snapshot()[1]
        accounted = 0.0
        for stage, (a, b) in self._times.items():
            d = (b - a) / 1e9
            accounted += d
            call = {"draft": "propose", "verify": "verify"}.get(stage)
            sub = 0.0
            if call is not None:
                sub = sum(after.get(f"{call}.{x}", 0.0) - before.get(f"{call}.{x}", 0.0)
                          for x in ("serialize", "rpc", "deserialize"))
            if sub > 0:
                CLOCK.add(f"{call}.other", d - sub)
            else:
                CLOCK.add(stage, d)
        CLOCK.add("engine.other", wall - accounted)

    def _after_step(self, events, t_step: int, t_ck: list) -> None:
        self._watch()
        now = time.perf_counter()
        for ev in events:
            t = self._tracked.get(ev.request_id)
            if t is None:
                continue
            req = self.engine.requests[ev.request_id]
            if ev.finish_reason == "error":  # its own input failed its batch; the others went on
                self._fail(ev.request_id, req.error or RuntimeError("request failed"))
                continue
            upd = Update(ev.request_id, list(ev.new_token_ids),
                         logprobs=None if ev.logprobs is None else list(ev.logprobs))
            self._trace_round(t, req, t_step, len(ev.new_token_ids))
            if req.num_rounds > t.rounds_seen:
                t.rounds_seen = req.num_rounds
                acc, prop = req.accepted_per_round[-1], req.proposed_per_round[-1]
                upd.round = {"index": req.num_rounds, "num_drafted": prop, "num_verified": prop,
                             "num_accepted": acc, "num_committed": len(ev.new_token_ids)}
                if self.engine.drafter is not None:
                    metrics.SPEC_DRAFTS.inc()
                    metrics.SPEC_DRAFT_TOKENS.inc(prop)
                    metrics.SPEC_ACCEPTED.inc(acc)
                    for pos in range(acc):
                        metrics.SPEC_ACCEPTED_POS.labels(position=str(pos)).inc()
            if ev.new_token_ids:
                metrics.GENERATED_TOKENS.inc(len(ev.new_token_ids))
                if t.t_last is None:
                    metrics.TTFT.observe(now - t.t_start)
                else:
                    per = (now - t.t_last) / len(ev.new_token_ids)
                    for _ in ev.new_token_ids:
                        metrics.ITL.observe(per)
                t.t_last = now
            if ev.finished:
                upd.finished, upd.finish_reason = True, ev.finish_reason
                upd.summary = self._summary(req, t, now)
                self.engine.pop(ev.request_id)
                self._tracked.pop(ev.request_id, None)
                self.demand_mass.pop(ev.request_id, None)
                self.demand_rows.pop(ev.request_id, None)
                metrics.REQUESTS.labels(finish_reason=ev.finish_reason or "unknown").inc()
                metrics.E2E.observe(now - t.t_start)
                if self._writer:
                    self._writer.put(ev.request_id, None)
            elif self._writer and self._checkpoint:
                t_c = time.perf_counter()
                self._put_checkpoint(ev.request_id, t)
                t_ck[0] += time.perf_counter() - t_c
            t.sink(upd)

    def _put_checkpoint(self, rid: str, t: _Tracked) -> None:
        """Hand the request's checkpoint to the background writer (it may reach Redis a step late: a resume
        reads it only when it is current, else the scheduler's own copy, so resumes stay exact)."""
        ck = self._checkpoint(rid)
        if ck is None:
            return
        if t.adopted:  # keep the client's view: original prompt, everything generated since
            n = len(ck["prompt_ids"]) - t.adopted
            ck["prompt_ids"], ck["generated"] = ck["prompt_ids"][:n], ck["prompt_ids"][n:] + ck["generated"]
        ck.update(scheduler=self.scheduler_id, updated=time.time())
        self._writer.put(rid, ck)

    def _watch(self) -> None:
        """Metrics of the engine's monitors after a step: per-position expected vs accepted tokens, what the
        alarms decided (the engine logs the transitions), and the rounds to record."""
        eng = self.engine
        if eng.drafter is None:
            return
        name = eng.drafter.name
        rounds = eng.last_rounds
        if rounds:
            expected: dict[int, float] = {}
            realized: dict[int, int] = {}
            for rec in rounds:
                a = 1.0
                for k, c in enumerate(rec.confidences, 1):
                    a *= c
                    expected[k] = expected.get(k, 0.0) + a
                    realized[k] = realized.get(k, 0) + (rec.accepted >= k)
            for k, e in expected.items():
                metrics.SPEC_EXPECTED.labels(drafter=name, position=str(k)).inc(e)
                metrics.SPEC_REALIZED.labels(drafter=name, position=str(k)).inc(realized[k])
            if self.record_rounds:  # what `dspark calibrate --online` refits: the drafter's own confidences
                self._rounds_buffer.extend(eng.last_calibrated_rounds)
        for kind, detail in eng.events:
            if kind == "collapse" and detail["collapsed"]:
                metrics.SPEC_COLLAPSES.labels(drafter=name).inc()
        eng.events.clear()
        for key, total, counter in (("fallback", eng.num_fallback_steps, metrics.SPEC_FALLBACK_STEPS),
                                    ("skipped", eng.num_skipped_drafts, metrics.SPEC_SKIPPED),
                                    ("lookup", eng.num_lookup_rounds, metrics.SPEC_LOOKUP_ROUNDS),
                                    ("lookup_accepted", eng.num_lookup_accepted, metrics.SPEC_LOOKUP_ACCEPTED)):
            if total > self._counted[key]:
                counter.labels(drafter=name).inc(total - self._counted[key])
                self._counted[key] = total

    def _watch_gauges(self) -> None:
        """Once a second: the monitors' state as gauges, and the recorded rounds appended to their file."""
        eng = self.engine
        if eng.drafter is None:
            return
        name = eng.drafter.name
        cal = eng.calibration
        if cal is not None:
            for k, (e, f) in enumerate(zip(cal.ece, cal.floor), 1):
                if e == e:
                    metrics.SPEC_ECE.labels(drafter=name, position=str(k)).set(e)
                    metrics.SPEC_ECE_FLOOR.labels(drafter=name, position=str(k)).set(f)
            metrics.SPEC_CALIBRATED.labels(drafter=name).set(1 if cal.ok else 0)
        if eng.collapse is not None:
            metrics.SPEC_COLLAPSED.labels(drafter=name).set(1 if eng.collapse.is_collapsed(name) else 0)
            ratio = eng.collapse.acceptance_ratio(name)
            if ratio == ratio:
                metrics.SPEC_ACCEPTANCE_RATIO.labels(drafter=name).set(ratio)
        if eng.correction is not None:
            for kind, greedy in (("greedy", True), ("sampled", False)):
                for k, b in enumerate(eng.correction.offsets[greedy], 1):
                    if eng.correction.observed[greedy][k - 1]:
                        metrics.SPEC_CONFIDENCE_OFFSET.labels(drafter=name, kind=kind, position=str(k)).set(b)
        if self._rounds_buffer:
            from dspark_core.monitoring import write_rounds

            batch, self._rounds_buffer = self._rounds_buffer, []
            try:
                write_rounds(self.record_rounds, batch)
            except OSError as exc:
                log.warning("could not record rounds to %s: %s", self.record_rounds, exc)

    def _observe(self, record: StepRecord) -> None:
        """The engine's observer (engine thread): stage timings for the trace, demand from the proposals."""
        self._times = record.timings
        for rid, p in zip(record.request_ids, record.proposals):
            c = p.confidences
            row = [float(x) for x in (c.tolist() if c is not None else [1.0] * len(p.tokens))]
            mass, a = 0.0, 1.0
            for x in row:
                a *= x
                mass += a
            self.demand_mass[rid] = mass
            self.demand_rows[rid] = row

    def _trace_round(self, t: _Tracked, req, t_step: int, committed: int) -> None:
        """A span per round in the request's own trace, with a child span per stage (prefill, draft, verify)."""
        if t.span_context is None or not t.span_context.is_valid:
            return
        parent = trace.set_span_in_context(trace.NonRecordingSpan(t.span_context))
        span = tracer.start_span("round", context=parent, start_time=t_step, attributes={
            "dspark.request_id": req.request_id, "dspark.round": req.num_rounds,
            "dspark.accepted": req.accepted_per_round[-1] if req.accepted_per_round else 0,
            "dspark.committed": committed})
        child = trace.set_span_in_context(span)
        for stage, (a, b) in self._times.items():
            if stage == "prefill" and t.t_last is not None:
                continue  # only the step that admitted this request prefilled it
            tracer.start_span(stage, context=child, start_time=a).end(end_time=b)
        span.end(end_time=time.time_ns())

    @staticmethod
    def _summary(req, t: _Tracked, now: float) -> dict:
        rounds = req.num_rounds
        adopted = req.prompt_ids[len(req.prompt_ids) - t.adopted:] if t.adopted else []
        n = len(req.output_ids) + len(adopted)
        elapsed = now - t.t_start
        first = (req.t_first_token - req.t_start) if req.t_first_token else elapsed
        return {"prompt_tokens": len(req.prompt_ids) - t.adopted, "completion_tokens": n, "num_rounds": rounds,
                "accepted_per_round_list": list(req.accepted_per_round),
                "accepted_per_round": sum(req.accepted_per_round) / rounds if rounds else 0.0,
                "tokens_per_round": (sum(req.accepted_per_round) + rounds) / rounds if rounds else 0.0,
                "tokens_per_second": n / max(elapsed, 1e-9), "time_to_first_token_seconds": first,
                "elapsed_seconds": elapsed, "token_ids": adopted + list(req.output_ids),
                "speculative": req.speculative_metrics()}

    def _periodic(self) -> None:
        metrics.REQUESTS_RUNNING.set(len(self.engine.active))
        metrics.REQUESTS_WAITING.set(len(self.engine.waiting))
        now = time.monotonic()
        if now - self._last_summary < 1.0:
            return
        self._last_summary = now
        self._watch_gauges()
        if self._pods_capacity is None:
            return
        if self._publishing is not None and self._publishing.is_alive():
            return  # the last publication is still talking to Redis: skip this second rather than queue
        try:
            caps = self._pods_capacity()  # the engine's state, read here on its own thread
        except Exception:  # noqa: BLE001 - load signals are advisory
            log.exception("load publication failed")
            return
        waiting = len(self.engine.waiting)
        if self.target_user_tps is not None:  # the live table is the engine thread's to read
            caps = dict(caps, engine_sps=self._engine_sps())
        # the Redis round trips (demand, budgets, desired replicas) never hold up a step
        self._publishing = threading.Thread(target=self._publish_quietly, args=(caps, waiting), name="load-publisher",
                                            daemon=True)
        self._publishing.start()

    def _publish_quietly(self, caps: dict, waiting: int) -> None:
        try:
            self._publish_load(caps, waiting)
        except Exception:  # noqa: BLE001 - load signals are advisory
            log.exception("load publication failed")

    def _engine_sps(self):
        """The live table, each step time plus the verification overhead the engine measures beyond the forward
        (a verifier pod's transport, 1.5-2 ms a step on loopback): a per-user speed planned without it is the
        forward's alone."""
        eng = self.engine
        sps = eng.online_sps.table(eng._mean_context()) if eng.online_sps is not None else eng.sps
        overhead = max(0.0, getattr(eng, "_step_overhead", 0.0))
        return sps.with_overhead(overhead) if isinstance(sps, SpsTable) and overhead > 0 else sps

    def _speed_plan(self, caps: dict, waiting: int):
        """The replicas that hold --target-user-tps at the current load (dspark_core.capacity), or None."""
        eng = self.engine
        sps = caps["engine_sps"] if "engine_sps" in caps else self._engine_sps()
        if self.target_user_tps is None or sps is None or not hasattr(sps, "for_requests"):
            return None
        from dspark_core.capacity import DemandForecast, plan_replicas

        pods_v, pods_d = len(caps.get("verifier", [])) or 1, len(caps.get("drafter", [])) or 1
        active = max(sum(a for _, a in caps.get("verifier", [])), len(eng.active))
        if self._forecast is None:
            self._forecast = DemandForecast(60.0)
        self._forecast.observe(time.monotonic(), active + waiting)
        limits = getattr(self.autoscaler, "pools", {}) or {}
        # plan for the users expected once a new verifier is up: its scale-up window plus a pod start
        horizon = (limits["verifier"].up_window_s if "verifier" in limits else 60.0) + self.pod_start_s
        users = self._forecast.forecast(horizon)
        per_drafter = max(1, math.ceil(len(eng.active) / pods_d))
        plan = plan_replicas(list(self.demand_rows.values()), users, sps, self.target_user_tps,
                             draft_cost=eng.pass_cost(per_drafter),
                             current=(pods_v, pods_d), has_drafter=eng.drafter is not None,
                             max_verifiers=limits["verifier"].max_replicas if "verifier" in limits else 64,
                             max_drafters=limits["drafter"].max_replicas if "drafter" in limits else 64)
        metrics.REQUIRED_REPLICAS.labels(pool="verifier").set(plan.verifiers)
        metrics.REQUIRED_REPLICAS.labels(pool="drafter").set(plan.drafters)
        if math.isfinite(plan.current_user_tps):
            metrics.PREDICTED_USER_TPS.set(plan.current_user_tps)
        if plan.feasible == self._objective_feasible:
            return plan
        self._objective_feasible = plan.feasible
        if not plan.feasible:
            log.warning("the per-user speed objective is out of reach within the replica limits",
                        extra={"target_user_tps": self.target_user_tps, "users": users,
                               "predicted_user_tps": plan.predicted_user_tps})
        return plan

    def _publish_load(self, caps: dict | None = None, waiting: int | None = None) -> None:
        """Demand per verifier and desired replicas per pool (also the dspark_desired_replicas gauge).
        `caps` / `waiting`: what the engine thread read (None: read them now)."""
        # {"verifier": [(capacity, active_requests), ...], "drafter": [...], "demand": {verifier_id: (mass, n)}}
        caps = self._pods_capacity() if caps is None else caps
        demand = caps.get("demand", {})
        if self.registry is not None:
            for vid, (mass, nreq, rows) in demand.items():
                metrics.DEMAND.labels(verifier=vid).set(mass)
                self.registry.publish_demand(vid, self.scheduler_id, mass, nreq, rows)
            if self.budgets is not None:
                self.budgets.update(demand, caps.get("sps", {}))
        waiting = len(self.engine.waiting) if waiting is None else waiting
        plan = self._speed_plan(caps, waiting)
        for pool in ("verifier", "drafter"):
            pods = caps.get(pool, [])
            if not pods:
                continue
            per_pod = max(1.0, sum(c for c, _ in pods) / len(pods))
            # cluster-wide active requests (as the pods publish them) plus this scheduler's queue;
            # keep pods at most 80% full; never scale to zero
            load = max(sum(a for _, a in pods), len(self.engine.active)) + waiting
            desired = max(1, math.ceil(load / (0.8 * per_pod)))
            if plan is not None:  # the per-user speed objective, never below what memory (request counts) needs
                desired = max(desired, plan.verifiers if pool == "verifier" else plan.drafters)
            if self.registry is not None:
                self.registry.publish_desired(pool, desired)
            else:
                metrics.DESIRED_REPLICAS.labels(pool=pool).set(desired)
            if self.autoscaler is not None:
                self.autoscaler.observe(pool, desired)
        if self.autoscaler is not None and (self._scaling is None or not self._scaling.is_alive()):
            self._scaling = threading.Thread(target=self.autoscaler.step, name="autoscale", daemon=True)
            self._scaling.start()  # Kubernetes API calls never block the engine thread
