"""Remote stand-ins for the engine's verifier and drafter: same methods as the local ones, over gRPC.

`RemoteVerifier` has dspark_core.verifier.Verifier's `prefill` / `verify` / `release` and
`RemoteDrafter` the drafter protocol's `new_state` / `propose` (+ `release_state`), so the scheduler runs
the very same dspark_core.engine.Engine as the embedded mode. They add what distribution needs:
- request affinity: a request's KV cache lives on one verifier, its draft context on one drafter;
- failover: a verifier that fails (or forgot the request) is replaced by another one rebuilt with
  Resume from the request's checkpoint (Redis when available, else the copy kept here), and a drafter
  that fails gets the whole context again (features from the verifier's Resume). Greedy output is
  unchanged by a failover;
- batching: one Verify / Propose call per pod per round, pods called in parallel.
Called only from the engine thread (blocking gRPC). Knows nothing about text or HTTP.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from dspark_core.drafters.base import Proposal
from dspark_core.errors import InvalidArgument, KVCacheFull, NotFound, ResourceExhausted
from dspark_core.sampling import SamplingParams
from dspark_core.verifier import PrefillItem, StepResult, VerifyItem, validate_prompt_ids
from dspark_protos.dspark.v1 import types_pb2

from ..common import metrics
from ..common.convert import (TargetInfo, features_from_proto, kind_from_proto, params_to_dict, params_to_proto,
                              prefill_item_to_proto, prefill_result_from_proto, propose_item_to_proto,
                              proposal_from_proto, target_info_from_proto, verify_item_to_proto,
                              verify_result_from_proto)
from ..common.errors import Unavailable, fits_alone_of
from ..common.identity import CALLER_METADATA
from ..common.registry import Registry
from ..common.tracing import outgoing_metadata, tracer
from .pods import Pod, PodPool, is_pod_failure
from .stages import CLOCK

log = logging.getLogger("dspark.remote")
MAX_ATTEMPTS = 3


_in_flight: set = set()  # fire-and-forget calls must stay referenced: a dropped grpc future cancels its call


def _fire(callable_, msg, timeout: float, metadata=None) -> None:
    try:
        fut = callable_.future(msg, timeout=timeout, metadata=metadata)
    except Exception:  # noqa: BLE001 - best effort (closed channel)
        return
    _in_flight.add(fut)
    fut.add_done_callback(_in_flight.discard)


def _settle(fut) -> None:
    """Until a call has ended, however it ended (its own deadline bounds the wait)."""
    try:
        fut.exception()
    except BaseException:  # noqa: BLE001 - cancelled, or an interrupt: the call is over either way
        pass


def _brief(exc: grpc.RpcError | None) -> str:
    """A failed call's code and details, without the transport's debug string (peer addresses)."""
    if exc is None:
        return "none live"
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # noqa: BLE001 - an RpcError raised locally has no call behind it
        return type(exc).__name__


def _raise_status(exc: grpc.RpcError, where: str, fits_alone: bool | None = None):
    """The dspark_core error for a failed call. A verifier's refusal for KV room becomes KVCacheFull, so the engine
    queues a request that fits once others finish (`fits_alone`: what the refusing verifiers said; default: the
    reply's own trailer) instead of failing it."""
    code, msg = exc.code(), exc.details()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        fits = fits_alone_of(exc) if fits_alone is None else fits_alone
        if fits is not None:
            raise KVCacheFull(f"{where}: {msg}", fits_alone=fits) from None
        raise ResourceExhausted(f"{where}: {msg}") from None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidArgument(where, msg, "was refused by the verifier") from None
    raise Unavailable(f"{where}: {code.name}: {msg}") from None


def _send_per_pod(call: str, groups, build, send) -> tuple[list, float | None, float]:
    """Build and start one call per pod: groups [(pod, item indices)], build(indices) -> message,
    send(pod, message) -> future. Returns ([(pod, indices, future)], the first call's start, the proto-building
    time spent after it) and books `<call>.serialize` / `<call>.send`."""
    futures, t_sent, later = [], None, 0.0
    for pod, idx in groups:
        t0 = time.perf_counter()
        msg = build(idx)
        t1 = time.perf_counter()
        futures.append((pod, idx, send(pod, msg)))
        CLOCK.add(f"{call}.serialize", t1 - t0)
        CLOCK.add(f"{call}.send", time.perf_counter() - t1)
        if t_sent is None:
            t_sent = t1
        else:
            later += t1 - t0
    return futures, t_sent, later


def _verify_message(items, idx):
    msg = types_pb2.VerifyRequest()
    for i in idx:
        verify_item_to_proto(items[i], msg.items.add())
    return msg


def _rpc_stages(call: str, pod: str, t_sent: float | None, later: float, server: list) -> None:
    """Stage times of one round of `call` RPCs (services/scheduler/stages.py): from the first call's start to
    the last answer read, less the reading (`server[2:]`) and the protos built for the other pods meanwhile
    (`later`), is `call`.rpc, of which the pods reported `server[0]` forward and `server[1]` queueing; the
    rest is transport (starting the call, the wire, gRPC and the pod's own protos on both sides)."""
    if t_sent is None:
        return
    read = sum(server[2:])
    rpc = time.perf_counter() - t_sent - read - later
    CLOCK.add(f"{call}.rpc", rpc)
    CLOCK.add(f"{call}.deserialize", read)
    CLOCK.add(f"{pod}.forward", server[0])
    CLOCK.add(f"{pod}.queue", server[1])
    CLOCK.add(f"{call}.transport", rpc - server[0] - server[1])


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    generated_in_prompt: int = 0  # trailing prompt tokens generated before (an adopted request)
    generated: list[int] = field(default_factory=list)
    pod: Pod | None = None


def _caller_md(caller: str):
    """The metadata of every call to a pod: the trace context and who calls (whose requests these are)."""
    return [*outgoing_metadata(), (CALLER_METADATA, caller)]


class RemoteVerifier:
    def __init__(self, pool: PodPool, checkpoints: Registry | None = None, timeout_s: float = 60.0,
                 caller: str = "scheduler"):
        self.pool, self.checkpoints, self.timeout_s = pool, checkpoints, timeout_s
        self.caller = caller  # this scheduler's id: verifiers key its requests by it
        self.requests: dict[str, _Request] = {}
        self.num_layers = 0
        self.target: TargetInfo | None = None  # from the first GetInfo

    def info(self) -> TargetInfo:
        last = None
        for _ in range(MAX_ATTEMPTS):
            pod = self.pool.pick()
            try:
                info = target_info_from_proto(pod.stub.GetInfo(types_pb2.VerifierServiceGetInfoRequest(),
                                                              timeout=self.timeout_s))
                self.num_layers = len(info.tap_layer_ids)
                self.target = info
                return info
            except grpc.RpcError as exc:
                last = exc
                self.pool.mark_dead(pod, exc)
        raise Unavailable(f"no verifier answered GetInfo: {_brief(last)}")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def validate_prompt(self, ids) -> None:
        """Verifier.validate_prompt against the verifiers' published model (no round trip)."""
        t = self.target
        validate_prompt_ids(ids, t and t.vocab_size, t and t.max_context)

    @property
    def num_active(self) -> int:
        return len(self.requests)

    def pod_of(self, request_id: str) -> str | None:
        r = self.requests.get(request_id)
        return r.pod.address if r and r.pod else None

    def _assign(self, req: _Request, pod: Pod | None) -> None:
        if req.pod is not None:
            req.pod.assigned -= 1
        req.pod = pod
        if pod is not None:
            pod.assigned += 1

    # -- prefill
    def prefill(self, items: list[PrefillItem]) -> list[StepResult]:
        with tracer.start_as_current_span("verifier.prefill") as span:
            span.set_attribute("dspark.requests", len(items))
            md = _caller_md(self.caller)
            calls = []
            try:
                for it in items:
                    req = _Request(list(it.prompt_ids), it.params, it.generated_in_prompt)
                    self.release(it.request_id)  # a retried prefill starts over
                    self.requests[it.request_id] = req
                    calls.append((it, req, self._start_prefill(it, req, md, set())))
                return self._finish_prefill(calls, md)
            except BaseException:
                # the batch failed: nothing of it stays registered here, nor on a verifier. A neighbour's Prefill
                # may still be on its way; its Release must land after it, or the verifier registers the request
                # after the Release and holds its KV slot for nobody until idle expiry.
                for _, _, (_, fut, _) in calls:
                    _settle(fut)
                for it in items:
                    self.release(it.request_id)
                raise

    def _finish_prefill(self, calls, md) -> list[StepResult]:
        out = []
        for it, req, (pod, fut, tried) in calls:
            fits = None  # whether some verifier that refused it for KV room could hold it alone
            while True:
                try:
                    resp = fut.result()
                    break
                except grpc.RpcError as exc:
                    if is_pod_failure(exc) or exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        if is_pod_failure(exc):
                            self.pool.mark_dead(pod, exc)
                        elif (said := fits_alone_of(exc)) is not None:
                            fits = bool(fits) or said
                        tried.add(pod.address)
                        try:
                            if len(tried) >= MAX_ATTEMPTS:
                                raise Unavailable("tried enough verifiers")
                            pod, fut, tried = self._start_prefill(it, req, md, tried)
                        except Unavailable:  # no other verifier: report what the last one said
                            self.release(it.request_id)
                            _raise_status(exc, "prefill", fits)
                        continue
                    self.release(it.request_id)
                    _raise_status(exc, "prefill")
            req.generated = [resp.anchor_token_id]
            out.append(prefill_result_from_proto(resp, it))
        return out

    def _start_prefill(self, it: PrefillItem, req: _Request, md, tried: set):
        pod = self.pool.pick(exclude=tried)
        self._assign(req, pod)
        msg = prefill_item_to_proto(it)
        return pod, pod.stub.Prefill.future(msg, timeout=self.timeout_s, metadata=md), tried

    # -- resume (failover)
    def _committed(self, request_id: str, req: _Request, anchor_pos: int) -> list[int]:
        """The committed tokens to rebuild from: the Redis checkpoint when it is current, else ours."""
        if self.checkpoints is not None:
            ck = self.checkpoints.read_checkpoint(request_id)
            if ck and ck.get("scheduler") != self.caller:  # another scheduler's request of the same id
                ck = None
            full = list(ck.get("prompt_ids", [])) + list(ck.get("generated", [])) if ck else []
            # an adopted request's engine prompt holds tokens the checkpoint counts as generated
            if len(full) - 1 == anchor_pos and full[: len(req.prompt)] == req.prompt:
                return full[len(req.prompt):]
        return list(req.generated)

    def _resume(self, request_id: str, req: _Request, anchor_pos: int, exclude: set[str],
                include_features: bool = False, same_pod: bool = False):
        gen = self._committed(request_id, req, anchor_pos)
        last = None
        for _ in range(MAX_ATTEMPTS):
            pod = req.pod if same_pod and req.pod is not None and req.pod.alive else self.pool.pick(exclude=exclude)
            p = len(req.prompt) - req.generated_in_prompt  # the verifier counts adopted tokens as generated too
            msg = types_pb2.ResumeRequest(request_id=request_id, prompt_token_ids=req.prompt[:p],
                                          generated_token_ids=req.prompt[p:] + gen,
                                          include_context_features=include_features)
            params_to_proto(req.params, msg.sampling, complete_stop_set=True)
            try:
                resp = pod.stub.Resume(msg, timeout=self.timeout_s, metadata=_caller_md(self.caller))
            except grpc.RpcError as exc:
                last = exc
                if is_pod_failure(exc):
                    self.pool.mark_dead(pod, exc)
                exclude = exclude | {pod.address}
                same_pod = False
                continue
            if req.pod is not pod:
                metrics.FAILOVERS.labels(pool="verifier").inc()
                log.warning("request resumed on another verifier",
                            extra={"request_id": request_id, "verifier": pod.address, "committed": len(gen)})
            self._assign(req, pod)
            return resp
        raise Unavailable(f"cannot resume request {request_id!r} on any verifier: "
                          f"{_brief(last)}")

    def context_features(self, request_id: str, anchor_pos: int) -> tuple[torch.Tensor, list[int]]:
        """[anchor_pos, L*H] features of every committed position and the tokens at those positions
        (for a drafter that lost the context)."""
        req = self.requests.get(request_id)
        if req is None:
            raise NotFound(f"request {request_id!r} is not active")
        resp = self._resume(request_id, req, anchor_pos, set(), include_features=True, same_pod=True)
        tokens = (req.prompt + self._committed(request_id, req, anchor_pos))[:anchor_pos]
        return features_from_proto(resp.context_features, "context_features"), tokens

    # -- verify
    def verify(self, items: list[VerifyItem]) -> list[StepResult]:
        with tracer.start_as_current_span("verifier.verify") as span:
            span.set_attribute("dspark.requests", len(items))
            results: list[StepResult | None] = [None] * len(items)
            todo = list(range(len(items)))
            for attempt in range(MAX_ATTEMPTS + 1):
                if not todo:
                    break
                todo = self._verify_round(items, todo, results, last=attempt == MAX_ATTEMPTS)
            if todo:
                raise Unavailable(f"verification failed for {[items[i].request_id for i in todo]}")
            for it, r in zip(items, results):  # committed only once the whole call succeeded
                self.requests[it.request_id].generated.extend(r.tokens)
            return results  # type: ignore[return-value]

    def _verify_round(self, items, todo, results, last: bool) -> list[int]:
        md = _caller_md(self.caller)
        by_pod: dict[str, list[int]] = {}
        retry: list[int] = []
        for i in todo:
            req = self.requests.get(items[i].request_id)
            if req is None:
                raise NotFound(f"request {items[i].request_id!r} is not active on this scheduler")
            if req.pod is None or not req.pod.alive:
                self._resume(items[i].request_id, req, items[i].anchor_pos,
                             exclude={req.pod.address} if req.pod else set())
            by_pod.setdefault(req.pod.address, []).append(i)
        groups = [(self.pool.get(addr) or self.requests[items[idx[0]].request_id].pod, idx)
                  for addr, idx in by_pod.items()]
        futures, t_sent, later = _send_per_pod(
            "verify", groups, lambda idx: _verify_message(items, idx),
            lambda pod, msg: pod.stub.Verify.future(msg, timeout=self.timeout_s, metadata=md))
        server = [0.0, 0.0]  # the longest forward and queue any pod reported (the pods run in parallel)
        try:
            return self._verify_results(items, futures, results, retry, last, server)
        finally:
            _rpc_stages("verify", "verifier", t_sent, later, server)

    def _verify_results(self, items, futures, results, retry, last: bool, server: list) -> list[int]:
        for pod, idx, fut in futures:
            try:
                resp = fut.result()
            except grpc.RpcError as exc:
                if not is_pod_failure(exc) or last:
                    _raise_status(exc, "verify")
                self.pool.mark_dead(pod, exc)
                for i in idx:  # resume elsewhere, then retry
                    req = self.requests[items[i].request_id]
                    self._resume(items[i].request_id, req, items[i].anchor_pos, exclude={pod.address})
                retry.extend(idx)
                continue
            server[0] = max(server[0], resp.stats.forward_seconds)
            server[1] = max(server[1], resp.stats.queue_seconds)
            t_read = time.perf_counter()
            metrics.VERIFY_BUDGET.labels(verifier=pod.id).set(sum(len(items[i].draft.tokens) for i in idx))
            for i, r in zip(idx, resp.results):
                it = items[i]
                req = self.requests[it.request_id]
                if r.status == types_pb2.ITEM_STATUS_OK:
                    results[i] = verify_result_from_proto(r, it)
                elif r.status in (types_pb2.ITEM_STATUS_UNKNOWN_REQUEST, types_pb2.ITEM_STATUS_POSITION_MISMATCH):
                    if last:
                        raise Unavailable(f"verify {it.request_id}: {r.error_message}")
                    self._resume(it.request_id, req, it.anchor_pos, set(), same_pod=True)
                    retry.append(i)
                elif r.status == types_pb2.ITEM_STATUS_RESOURCE_EXHAUSTED:
                    raise ResourceExhausted(f"verify {it.request_id}: {r.error_message}")
                else:
                    raise InvalidArgument(f"verify item {it.request_id}", r.error_message, "was refused by the verifier")
            server.append(time.perf_counter() - t_read)
        return retry

    def release(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        pod = req.pod
        self._assign(req, None)
        if pod is not None and pod.alive:
            # fire and forget: an unreachable verifier frees the KV cache on restart anyway
            _fire(pod.stub.Release, types_pb2.VerifierServiceReleaseRequest(request_ids=[request_id]), self.timeout_s,
                  _caller_md(self.caller))
        return True

    def checkpoint(self, request_id: str) -> dict | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        return {"prompt_ids": req.prompt, "generated": req.generated, "params": params_to_dict(req.params),
                "verifier": req.pod.address if req.pod else None}


@dataclass(eq=False)
class DraftHandle:
    """The engine's opaque drafter state for one request: which drafter holds its context, and how much."""

    request_id: str
    pod: Pod | None = None
    length: int = 0  # positions of context the drafter holds
    resend: bool = False  # the drafter lost the context: send it all again


def _history_from_proto(info, field: str, block_size: int, name: str):
    """A GetInfo reply's request history, checked (it only moves lengths: a malformed one is logged and
    dropped, not fatal)."""
    from dspark_core.calibration import RequestHistory

    if not info.HasField(field):
        return None
    msg = getattr(info, field)
    try:
        hist = RequestHistory(tuple(msg.weights), float(msg.strength), float(msg.prior))
        if len(hist.weights) != block_size:
            raise InvalidArgument(f"{field}.weights", len(hist.weights), f"must be block_size = {block_size} numbers")
    except InvalidArgument as exc:
        log.warning("drafter %s reported an unusable %s (%s); its requests go without it", name, field, exc)
        return None
    return hist


class RemoteDrafter:
    def __init__(self, pool: PodPool, verifier: RemoteVerifier, info, hidden_size: int, vocab_size: int,
                 timeout_s: float = 60.0):
        self.pool, self.verifier, self.timeout_s = pool, verifier, timeout_s
        self.caller = verifier.caller
        self._retry_at = 0.0  # no drafter was found: do not look again before this (monotonic)
        self._orphaned = 0  # rounds drafted by nobody since drafting last worked for everyone
        self.name = info.drafter_name
        self.kind = kind_from_proto(info.kind)
        self.block_size = int(info.block_size)
        self.target_layer_ids = tuple(info.target_layer_ids)
        self.support_size = int(info.max_support_size)
        self.has_confidence = bool(info.has_confidence_head)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        # what the drafter was trained for (0 / "": not reported)
        self.target_hidden_size, self.target_model_name = int(info.target_hidden_size), info.target_model_name
        # its request-history recalibration, applied here from each request's verified rounds (None: none)
        self._history = {False: _history_from_proto(info, "request_history", self.block_size, self.name),
                         True: _history_from_proto(info, "request_history_greedy", self.block_size, self.name)}

    def confidence_history(self, greedy: bool):
        """The drafter's request history for temperature-0 (`greedy`) or sampled requests; None = none."""
        return self._history[bool(greedy)] if self.has_confidence else None

    @classmethod
    def connect(cls, pool: PodPool, verifier: RemoteVerifier, hidden_size: int, vocab_size: int,
                timeout_s: float = 60.0) -> "RemoteDrafter":
        last = None
        for _ in range(MAX_ATTEMPTS):
            pod = pool.pick()
            try:
                info = pod.stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest(), timeout=timeout_s)
                return cls(pool, verifier, info, hidden_size, vocab_size, timeout_s)
            except grpc.RpcError as exc:
                last = exc
                pool.mark_dead(pod, exc)
        raise Unavailable(f"no drafter answered GetInfo: {_brief(last)}")

    def new_state(self) -> DraftHandle:
        return DraftHandle(f"draft-{uuid.uuid4().hex}")

    def new_state_for(self, request_id: str) -> DraftHandle:
        return DraftHandle(request_id)

    def release_state(self, h: DraftHandle) -> None:
        pod, h.pod = h.pod, None
        if pod is None:
            return
        pod.assigned -= 1
        if pod.alive:
            _fire(pod.stub.Release, types_pb2.DrafterServiceReleaseRequest(request_ids=[h.request_id]), self.timeout_s,
                  _caller_md(self.caller))

    def _place(self, h: DraftHandle, exclude: set[str] = frozenset()) -> None:
        if h.pod is not None:
            h.pod.assigned -= 1
            metrics.FAILOVERS.labels(pool="drafter").inc()
        h.pod = None
        if time.monotonic() < self._retry_at:
            raise Unavailable("no drafter (looked less than a second ago)")
        try:
            h.pod = self.pool.pick(exclude=exclude)
        except Unavailable:
            self._retry_at = time.monotonic() + 1.0  # look again in a second, not every round
            raise
        h.pod.assigned += 1
        h.resend = h.resend or h.length > 0
        h.length = 0

    def _orphan(self, h: DraftHandle, why: BaseException) -> Proposal:
        """No drafter can draft for this request now: this round verifies the anchor alone (autoregressive,
        so the output is unchanged), and the next drafter that takes it gets the whole context."""
        if h.pod is not None:
            h.pod.assigned -= 1
            if h.pod.alive:  # it may still hold the context: it would never hear of this request again
                _fire(h.pod.stub.Release, types_pb2.DrafterServiceReleaseRequest(request_ids=[h.request_id]),
                      self.timeout_s, _caller_md(self.caller))
            h.pod = None
        h.resend, h.length = True, 0
        if not self._orphaned:
            log.warning("no drafter: decoding autoregressively until one is back: %s", why)
        self._orphaned += 1
        metrics.DRAFTLESS_ROUNDS.inc()
        return Proposal(tokens=[])

    def _item(self, it, seed: int | None) -> types_pb2.ProposeItem:
        h: DraftHandle = it.state
        if h.resend:  # the whole context, from the verifier
            (feats, tokens), start = self.verifier.context_features(h.request_id, it.anchor_pos), 0
        else:
            feats, tokens, start = it.new_features, it.new_tokens, it.new_positions_start
        # a request's first propose may begin its context after position 0 (the engine's draft window)
        begins = not h.resend and h.length == 0 and start > 0
        return propose_item_to_proto(h.request_id, it, feats, start, tokens, len(self.target_layer_ids), seed,
                                     begins=begins)

    def propose(self, items) -> list[Proposal]:
        with tracer.start_as_current_span("drafter.propose") as span:
            span.set_attribute("dspark.requests", len(items))
            seeds = []
            out: list[Proposal | None] = [None] * len(items)
            todo = []
            for i, it in enumerate(items):
                h: DraftHandle = it.state
                seed = None
                if it.temperature > 0 and it.generator is not None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=it.generator))
                seeds.append(seed)
                try:
                    if h.pod is None:
                        self._place(h)
                    elif not h.pod.alive:
                        self._place(h, exclude={h.pod.address})
                except Unavailable as exc:
                    out[i] = self._orphan(h, exc)
                    continue
                todo.append(i)
            for attempt in range(MAX_ATTEMPTS + 1):
                if not todo:
                    break
                try:
                    todo = self._propose_round(items, seeds, todo, out, last=attempt == MAX_ATTEMPTS)
                except (Unavailable, InvalidArgument, ResourceExhausted) as exc:
                    for i in todo:  # drafting is optional: these verify their anchor alone this round
                        if out[i] is None:
                            out[i] = self._orphan(items[i].state, exc)
                    todo = []
            for i in todo:
                out[i] = self._orphan(items[i].state, Unavailable("drafting failed"))
            if all(p is not None and p.tokens for p in out):
                self._orphaned = 0
            return out  # type: ignore[return-value]

    def _propose_round(self, items, seeds, todo, out, last: bool) -> list[int]:
        md = _caller_md(self.caller)
        by_pod: dict[str, list[int]] = {}
        for i in todo:
            by_pod.setdefault(items[i].state.pod.address, []).append(i)
        futures, t_sent, later = _send_per_pod(
            "propose", [(items[idx[0]].state.pod, idx) for idx in by_pod.values()],
            lambda idx: types_pb2.ProposeRequest(items=[self._item(items[i], seeds[i]) for i in idx]),
            lambda pod, msg: pod.stub.Propose.future(msg, timeout=self.timeout_s, metadata=md))
        server = [0.0, 0.0]
        try:
            return self._propose_results(items, futures, out, last, md, server)
        finally:
            _rpc_stages("propose", "drafter", t_sent, later, server)

    def _propose_results(self, items, futures, out, last: bool, md, server: list) -> list[int]:
        retry = []
        for pod, idx, fut in futures:
            try:
                resp = fut.result()
            except grpc.RpcError as exc:
                if not is_pod_failure(exc) or last:
                    _raise_status(exc, "propose")
                self.pool.mark_dead(pod, exc)
                for i in idx:
                    self._move(items, i, pod, out, retry)
                continue
            server[0] = max(server[0], resp.stats.forward_seconds)
            server[1] = max(server[1], resp.stats.queue_seconds)
            t_read = time.perf_counter()
            for i, p in zip(idx, resp.proposals):
                h: DraftHandle = items[i].state
                if p.status == types_pb2.ITEM_STATUS_OK:
                    h.length, h.resend = int(p.context_length), False
                    out[i] = proposal_from_proto(p, f"proposals[{i}]")
                elif p.status in (types_pb2.ITEM_STATUS_UNKNOWN_REQUEST, types_pb2.ITEM_STATUS_POSITION_MISMATCH):
                    if last:
                        raise Unavailable(f"propose {h.request_id}: {p.error_message}")
                    pod.stub.Release(types_pb2.DrafterServiceReleaseRequest(request_ids=[h.request_id]),
                                     timeout=self.timeout_s, metadata=md)
                    h.resend, h.length = True, 0
                    retry.append(i)
                elif p.status == types_pb2.ITEM_STATUS_RESOURCE_EXHAUSTED and not last:
                    self._move(items, i, pod, out, retry)
                else:  # refused: this request verifies its anchor alone, the others' proposals stand
                    out[i] = self._orphan(h, InvalidArgument(f"propose item {h.request_id}", p.error_message,
                                                             "was refused by the drafter"))
            for i in idx[len(resp.proposals):]:  # a reply short of proposals: those draft nowhere this round
                out[i] = self._orphan(items[i].state, Unavailable(f"drafter {pod.address} sent no proposal"))
            server.append(time.perf_counter() - t_read)
        return retry

    def _move(self, items, i: int, pod: Pod, out: list, retry: list) -> None:
        """Item i goes to another drafter with its whole context (retried this round), or drafts nowhere."""
        h: DraftHandle = items[i].state
        h.resend = True
        try:
            self._place(h, exclude={pod.address})
        except Unavailable as e:
            out[i] = self._orphan(h, e)
            return
        retry.append(i)
