"""VerifierService over dspark_core.verifier.Verifier: proto -> domain -> Verifier -> proto.

All model work runs on the service's one model thread (a single-worker executor), so the Verifier is
never touched concurrently. Concurrent Verify calls (from several schedulers) are coalesced into one
ragged forward pass. Per-item problems come back as ItemStatus; whole-call errors are raised as
dspark_core errors and mapped by the server's interceptor. It remembers when each request was last
prefilled, verified or resumed, so that `expire_idle` can free the KV caches of requests whose scheduler
vanished without a Release (the app calls it periodically). Knows nothing about Redis or drafters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import Executor

from dspark_core.errors import InvalidArgument, NotFound, ResourceExhausted
from dspark_core.target import TargetRuntime
from dspark_core.verifier import PrefillItem, StepResult, Verifier
from dspark_protos.dspark.v1 import types_pb2, verifier_service_pb2_grpc
from dspark_protos.tensors import TORCH_TO_DTYPE

from ..common import metrics
from ..common.batcher import Coalescer
from ..common.errors import Unavailable
from ..common.convert import (features_to_proto, logprobs_to_proto, params_from_proto, prefill_item_from_proto,
                              verify_item_from_proto, verify_result_to_proto)
from ..common.heartbeat import Ewma
from ..common.identity import OwnedTable, caller_of, key, split
from ..common.limits import MAX_POD_REQUEST_ID_CHARS, SAMPLING_FIELDS, check_request_id, check_sampling

_S = "verifier"
log = logging.getLogger("dspark.verifier")


class _ItemError:
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def _item_error(exc: Exception) -> _ItemError:
    if isinstance(exc, NotFound):
        return _ItemError(types_pb2.ITEM_STATUS_UNKNOWN_REQUEST, str(exc))
    if isinstance(exc, InvalidArgument) and exc.field == "anchor_pos":
        return _ItemError(types_pb2.ITEM_STATUS_POSITION_MISMATCH, str(exc))
    if isinstance(exc, ResourceExhausted):
        return _ItemError(types_pb2.ITEM_STATUS_RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, InvalidArgument):
        return _ItemError(types_pb2.ITEM_STATUS_INVALID_ARGUMENT, str(exc))
    log.error("verify item failed", exc_info=exc)
    return _ItemError(types_pb2.ITEM_STATUS_INVALID_ARGUMENT, "item failed (see the verifier log)")


FEATURE_DTYPES = ("auto", "float32", "bfloat16")


def wire_feature_dtype(name: str, target_dtype=None, drafter_dtype=None):
    """The dtype context features travel in for --feature-dtype `name`, a target computing in `target_dtype` and
    a drafter that reads them in `drafter_dtype` (its `context_feature_dtype`; None: as they come). "auto": the
    drafter's when it is narrower than the target's (the drafter rounds them to it anyway, so its drafts are
    the embedded engine's, for fewer bytes), else the target's; None while the target is not known."""
    import torch

    if name not in FEATURE_DTYPES:
        raise InvalidArgument("feature_dtype", name, f"must be one of {', '.join(FEATURE_DTYPES)}")
    if name != "auto":
        return getattr(torch, name)
    if target_dtype is not None and drafter_dtype is not None and drafter_dtype.itemsize < target_dtype.itemsize:
        return drafter_dtype
    return target_dtype


class VerifierServicer(verifier_service_pb2_grpc.VerifierServiceServicer):
    def __init__(self, verifier_id: str, executor: Executor, max_active: int = 256, coalesce_wait_s: float = 0.002,
                 max_per_caller: int | None = None, evict_idle_s: float = 10.0, wait_alone: bool = False,
                 feature_dtype: str = "auto", drafter_feature_dtype=None):
        self.verifier: Verifier | None = None
        # the dtype the context features travel in (checked now; "auto" is known at attach: the drafter's
        # `context_feature_dtype` where narrower than the target's own, else the target's; either way a drafter pod
        # drafts exactly what the embedded engine drafts). They only feed the drafters, never the verification:
        # bfloat16 halves a float32 target's feature bytes
        self.feature_dtype = wire_feature_dtype(feature_dtype)
        self._feature_dtype_name, self._drafter_feature_dtype = feature_dtype, drafter_feature_dtype
        self.target: TargetRuntime | None = None
        self.verifier_id, self.executor, self.max_active = verifier_id, executor, max_active
        self.num_layers = 0
        self.online_sps = None  # OnlineSpsTable: that table corrected by every verify pass, published live
        self.step_time, self.tokens_per_step = Ewma(), Ewma()
        # (caller + request id) -> last prefill / verify / resume; the Verifier's slots are keyed the same way
        self.owned = OwnedTable(max_active, max_per_caller, evict_idle_s)
        # Verify waits for company only while several schedulers call (services/common/batcher.py)
        self._verify = Coalescer(self._verify_batch, executor, max_wait_s=coalesce_wait_s, wait_alone=wait_alone)
        self._prefill = Coalescer(self._prefill_batch, executor, max_wait_s=coalesce_wait_s)

    def attach(self, verifier: Verifier, target: TargetRuntime, sps=None) -> None:
        """Called once the model is loaded and warm; until then every RPC is UNAVAILABLE. `sps`: the pod's
        profiled SpsTable (None: none), its request rows included."""
        self.verifier, self.target = verifier, target
        self.num_layers = len(target.config.tap_layer_ids)
        self.feature_dtype = wire_feature_dtype(self._feature_dtype_name, target.dtype, self._drafter_feature_dtype)
        metrics.ACTIVE_STATES.labels(service=_S).set(verifier.num_active)  # present (0) before any request
        if sps is not None:
            from dspark_core.cost_model import OnlineSpsTable

            self.online_sps = OnlineSpsTable(sps)
            verifier.on_forward = self.online_sps.observe

    def live_sps(self) -> tuple[list, int, dict]:
        """The live table's points at the context length of the latest passes, that context length, and its
        request rows ({requests: points}; what a scheduler plans a pass of that many requests with)."""
        if self.online_sps is None:
            return [], 0, {}
        ctx = self.online_sps.last_context
        return self.online_sps.points(ctx), int(ctx), self.online_sps.row_points(ctx)

    def close(self) -> None:
        self._verify.close()
        self._prefill.close()

    def _ready(self) -> None:
        if self.verifier is None:
            raise Unavailable(f"verifier {self.verifier_id} is still loading its model")

    # -- model-thread functions
    def _timed(self, rpc: str, num_tokens: int):
        metrics.BATCH_TOKENS.labels(service=_S, rpc=rpc).observe(num_tokens)
        return metrics.FORWARD_SECONDS.labels(service=_S, rpc=rpc).time()

    def _free(self, keys) -> None:
        for k in keys:
            self.verifier.release(k)
            self.owned.forget(k)

    def _make_room(self, keys: list[str]) -> None:
        evict = self.owned.make_room(keys, f"verifier {self.verifier_id}")
        if evict:  # their schedulers resume them (UNKNOWN_REQUEST -> Resume) if they come back
            metrics.VERIFIER_EXPIRED.inc(len(evict))
            self._free(evict)

    def _prefill_batch(self, items: list[PrefillItem]) -> list:
        """Per item (calls from several schedulers share the pass): (StepResult, seconds), or the exception
        that item alone failed with (no room for its caller, or its own bad input)."""
        out: list = [None] * len(items)
        admitted = []
        latest = {it.request_id: i for i, it in enumerate(items)}
        for i, it in enumerate(items):
            if latest[it.request_id] != i:  # the same request twice in one pass: the later call wins
                out[i] = Unavailable(f"request_id {split(it.request_id)[1]!r} was prefilled again")
                continue
            if it.request_id in self.verifier:  # a retried Prefill (lost reply, adopted request) starts over
                self._free([it.request_id])
            try:
                self._make_room([it.request_id])
            except ResourceExhausted as exc:
                out[i] = exc
                continue
            self.owned.touch([it.request_id])  # holds its place while the batch runs
            admitted.append(i)
        batch = [items[i] for i in admitted]
        t0 = time.perf_counter()
        with self._timed("prefill", sum(len(i.prompt_ids) for i in batch)):
            try:
                results = self.verifier.prefill(batch) if batch else []
            except Exception:  # noqa: BLE001 - one item's input must not fail the others
                results = []
                for it in batch:
                    try:
                        results.extend(self.verifier.prefill([it]))
                    except Exception as exc:  # noqa: BLE001 - that item's error, raised by its own call
                        results.append(exc)
        dt = time.perf_counter() - t0
        for i, r in zip(admitted, results):
            out[i] = r if isinstance(r, Exception) else (r, dt)
            if isinstance(r, Exception):
                self.owned.forget(items[i].request_id)
        metrics.ACTIVE_STATES.labels(service=_S).set(self.verifier.num_active)
        return out

    def _verify_batch(self, entries: list) -> list:
        out: list = [None] * len(entries)
        pending = []
        for i, e in enumerate(entries):
            if isinstance(e, _ItemError):
                out[i] = e
            elif e.request_id not in self.verifier:
                out[i] = _ItemError(types_pb2.ITEM_STATUS_UNKNOWN_REQUEST,
                                    f"request_id {split(e.request_id)[1]!r} is not active on verifier "
                                    f"{self.verifier_id}")
            else:
                pending.append(i)
        self.owned.touch(entries[i].request_id for i in pending)
        metrics.BATCH_CALLS.labels(service=_S).observe(self._verify.last_batch_calls)
        while pending:  # waves: a request id appears at most once per forward pass
            seen, wave, rest = set(), [], []
            for i in pending:
                (rest if entries[i].request_id in seen else wave).append(i)
                seen.add(entries[i].request_id)
            pending = rest
            tokens = sum(1 + len(entries[i].draft.tokens) for i in wave)
            t0 = time.perf_counter()
            try:
                with self._timed("verify", tokens):
                    results = self.verifier.verify([entries[i] for i in wave])
            except Exception:  # noqa: BLE001 - isolate the bad item(s)
                results = []
                for i in wave:
                    try:
                        results.extend(self.verifier.verify([entries[i]]))
                    except Exception as exc:  # noqa: BLE001 - that item's status
                        results.append(_item_error(exc))
            dt = time.perf_counter() - t0
            self.step_time.update(dt)
            self.tokens_per_step.update(tokens)
            for i, r in zip(wave, results):
                out[i] = (r, dt, tokens, len(wave))
        return out

    def _resume(self, req, rid: str) -> tuple[StepResult, bool, float]:
        params = params_from_proto(req.sampling, self.target.eos_token_ids)
        if rid in self.verifier:
            self._free([rid])
        self._make_room([rid])
        t0 = time.perf_counter()
        if not req.generated_token_ids:
            res = self.verifier.prefill([PrefillItem(rid, tuple(req.prompt_token_ids), params)])[0]
            self.owned.touch([rid])
            return res, True, time.perf_counter() - t0
        res = self.verifier.resume(rid, list(req.prompt_token_ids), list(req.generated_token_ids), params)
        self.owned.touch([rid])
        metrics.ACTIVE_STATES.labels(service=_S).set(self.verifier.num_active)
        return res, False, time.perf_counter() - t0

    def expire_idle(self, ttl_s: float) -> list[str]:
        """Model thread: release every request not prefilled, verified or resumed for `ttl_s` seconds
        (its scheduler crashed, or lost it, before a Release). Returns the released ids."""
        if self.verifier is None:
            return []
        expired = []
        for k in self.owned.idle(0.0):
            if k not in self.verifier:
                self.owned.forget(k)  # freed some other way
        for k in self.owned.idle(ttl_s):
            # counted before the release: whoever sees the request gone also sees it counted
            metrics.VERIFIER_EXPIRED.inc()
            self._free([k])
            expired.append(split(k)[1])
        if expired:
            metrics.ACTIVE_STATES.labels(service=_S).set(self.verifier.num_active)
        return expired

    # -- RPCs
    async def Prefill(self, request, context):
        self._ready()
        item = prefill_item_from_proto(request, self.target.eos_token_ids)
        check_request_id(item.request_id, limit=MAX_POD_REQUEST_ID_CHARS)
        check_sampling(item.params, self.target.vocab_size, SAMPLING_FIELDS)  # as the front door checked them
        item = dataclasses.replace(item, request_id=key(caller_of(context), item.request_id))  # caller's own
        [out], queued = await self._prefill.submit([item])
        if isinstance(out, Exception):
            raise out
        res, dt = out
        resp = types_pb2.PrefillResponse(request_id=request.request_id, anchor_token_id=res.tokens[0],
                                         anchor_position=len(item.prompt_ids), stopped=res.stopped)
        if res.stopped:
            resp.finish_reason = types_pb2.FINISH_REASON_STOP
        logprobs_to_proto(res.logprobs, resp.logprobs)
        features_to_proto(self._wire(res.features), res.features_start, self.num_layers, resp.context_features)
        resp.stats.CopyFrom(types_pb2.StepStats(num_requests=1, num_tokens=len(item.prompt_ids),
                                                forward_seconds=dt, queue_seconds=queued))
        return resp

    async def Verify(self, request, context):
        self._ready()
        entries = []
        caller = caller_of(context)
        for i, it in enumerate(request.items):
            try:
                e = verify_item_from_proto(it, f"items[{i}]")
                entries.append(dataclasses.replace(e, request_id=key(caller, e.request_id)))
            except InvalidArgument as exc:
                entries.append(_ItemError(types_pb2.ITEM_STATUS_INVALID_ARGUMENT, str(exc)))
        if not entries:
            raise InvalidArgument("items", [], "must hold at least one VerifyItem")
        out, queued = await self._verify.submit(entries, caller)
        resp = types_pb2.VerifyResponse()
        stats = None
        for i, o in enumerate(out):
            r = resp.results.add(request_id=request.items[i].request_id)
            if isinstance(o, _ItemError):
                r.status, r.error_message = o.status, o.message
                continue
            res, dt, tokens, nreq = o if isinstance(o, tuple) else (o, 0.0, 0, 0)
            if isinstance(res, _ItemError):
                r.status, r.error_message = res.status, res.message
                continue
            stats = stats or (dt, tokens, nreq)
            verify_result_to_proto(dataclasses.replace(res, features=self._wire(res.features)), self.num_layers, r)
        if stats:
            resp.stats.CopyFrom(types_pb2.StepStats(num_requests=stats[2], num_tokens=stats[1],
                                                    forward_seconds=stats[0], queue_seconds=queued))
        return resp

    async def Resume(self, request, context):
        self._ready()
        if not request.request_id:
            raise InvalidArgument("request_id", request.request_id, "must not be empty")
        check_request_id(request.request_id, limit=MAX_POD_REQUEST_ID_CHARS)
        params = check_sampling(params_from_proto(request.sampling, self.target.eos_token_ids), self.target.vocab_size,
                                SAMPLING_FIELDS)
        res, fresh, dt = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._resume, request, key(caller_of(context), request.request_id))
        gen = list(request.generated_token_ids)
        anchor = res.tokens[0] if fresh else gen[-1]
        resp = types_pb2.ResumeResponse(
            request_id=request.request_id, anchor_token_id=anchor,
            anchor_position=len(request.prompt_token_ids) + max(len(gen), 1) - 1,
            stats=types_pb2.StepStats(num_requests=1, num_tokens=len(res.context_tokens), forward_seconds=dt))
        if (fresh and res.stopped) or (not fresh and anchor in params.stop_token_ids):
            resp.stopped, resp.finish_reason = True, types_pb2.FINISH_REASON_STOP
        if fresh:
            logprobs_to_proto(res.logprobs, resp.logprobs)
        if fresh or request.include_context_features:
            features_to_proto(self._wire(res.features), 0, self.num_layers, resp.context_features)
        return resp

    async def Release(self, request, context):
        self._ready()
        keys = [key(caller_of(context), rid) for rid in request.request_ids]

        def release():
            n = sum(1 for k in keys if self.verifier.release(k))
            for k in keys:
                self.owned.forget(k)
            metrics.ACTIVE_STATES.labels(service=_S).set(self.verifier.num_active)
            return n

        n = await asyncio.get_running_loop().run_in_executor(self.executor, release)
        return types_pb2.VerifierServiceReleaseResponse(num_released=n)

    def _wire(self, features: torch.Tensor) -> torch.Tensor:
        """Features as they go on the wire (--feature-dtype; a no-op in the target's own dtype)."""
        return features.to(self.feature_dtype)

    async def GetInfo(self, request, context):
        self._ready()
        t = self.target
        resp = types_pb2.VerifierServiceGetInfoResponse(
            verifier_id=self.verifier_id, model_name=t.name, vocab_size=t.vocab_size,
            tap_layer_ids=[int(x) for x in t.config.tap_layer_ids], hidden_size=t.hidden_size,
            max_context_length=t.max_context, feature_dtype=TORCH_TO_DTYPE[self.feature_dtype],
            eos_token_ids=list(t.eos_token_ids), max_batch_tokens=t.max_context * 16,
            max_active_requests=self.max_active)
        points, _, rows = self.live_sps()
        for b, s in points:
            resp.sps_table.points.add(num_tokens=int(b), steps_per_second=float(s))
        for r, pts in rows.items():
            row = resp.sps_table.rows.add(num_requests=int(r))
            for b, s in pts:
                row.points.add(num_tokens=int(b), steps_per_second=float(s))
        return resp
