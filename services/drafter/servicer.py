"""DrafterService over a dspark_core drafter: proto -> ProposeItem -> drafter.propose -> proto.

Holds each request's drafter state keyed by request id (request affinity). The committed tokens at the
positions whose features arrive come in ProposeItem.context_token_ids (EAGLE-3 conditions on them); for
a client that leaves them out it keeps the last anchor and proposal, rebuilds what it can from those and
uses placeholder ids for the rest (exact output, lower acceptance). All model work runs on the one model
thread; concurrent Propose calls are coalesced into one batched pass. Knows nothing about Redis, targets
or scheduling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from dspark_core.drafters.base import ProposeItem
from dspark_core.errors import InvalidArgument, ResourceExhausted
from dspark_core.sampling import derive_seed, make_generator
from dspark_protos.dspark.v1 import drafter_service_pb2_grpc, types_pb2

from ..common import metrics
from ..common.batcher import Coalescer
from ..common.convert import draft_processing_from_proto, features_from_proto, kind_to_proto, proposal_to_proto
from ..common.errors import Unavailable
from ..common.heartbeat import Ewma
from ..common.identity import OwnedTable, caller_of, key, split
from ..common.limits import MAX_POD_REQUEST_ID_CHARS, check_request_id, check_temperature

_S = "drafter"
log = logging.getLogger("dspark.drafter")


@dataclass
class _Context:
    state: object
    last_anchor: int | None = None
    last_tokens: list[int] = field(default_factory=list)


@dataclass
class _Job:
    index: int
    request_id: str
    features: torch.Tensor | None
    start: int
    anchor: int
    anchor_pos: int
    temperature: float
    seed: int | None
    max_draft_tokens: int
    coupling_seed: int | None = None  # the request's seed when it is verified by coupling
    tokens: list[int] | None = None  # context_token_ids, one per feature row (None: not sent)
    processing: object = None  # the item's DraftProcessing (None: not sent, or nothing to do)
    error: tuple[int, str, int] | None = None  # (status, message, context_length)
    begins: bool = False  # begins_context: the request's context starts at `start` (what was held is dropped)


class DrafterServicer(drafter_service_pb2_grpc.DrafterServiceServicer):
    def __init__(self, drafter_id: str, executor: Executor, max_active: int = 1024, coalesce_wait_s: float = 0.002,
                 max_per_caller: int | None = None, evict_idle_s: float = 10.0, wait_alone: bool = False):
        self.drafter = None
        self.drafter_id, self.executor, self.max_active = drafter_id, executor, max_active
        # keyed by caller + request id (services.common.identity); `owned` has their last-use times
        self.contexts: dict[str, _Context] = {}
        self.owned = OwnedTable(max_active, max_per_caller, evict_idle_s)
        self.step_time, self.tokens_per_step = Ewma(), Ewma()
        # waits for company only while several schedulers call (services/common/batcher.py)
        self._propose = Coalescer(self._propose_batch, executor, max_wait_s=coalesce_wait_s, wait_alone=wait_alone)

    def attach(self, drafter) -> None:
        self.drafter = drafter
        self.num_layers = len(drafter.target_layer_ids)
        self.feature_size = drafter.config.feature_size
        self.hidden = self.feature_size // max(self.num_layers, 1)
        param = next(drafter.parameters())
        self.param_dtype, self.param_device = param.dtype, param.device
        metrics.ACTIVE_STATES.labels(service=_S).set(len(self.contexts))  # present (0) before any request

    def close(self) -> None:
        self._propose.close()

    def _ready(self) -> None:
        if self.drafter is None:
            raise Unavailable(f"drafter {self.drafter_id} is still loading its model")

    # -- model thread
    def _new_tokens(self, ctx: _Context, start: int, rows: int) -> list[int]:
        """For a client that sent no context_token_ids: the committed tokens at positions [start,
        start + rows) as far as this drafter knows them (the old anchor, then accepted drafts)."""
        if start == 0 or ctx.last_anchor is None:
            return [0] * rows  # placeholders: DSpark / DFlash context uses features only
        known = [ctx.last_anchor, *ctx.last_tokens][:rows]
        return known + [0] * (rows - len(known))

    def _propose_batch(self, jobs: list[_Job]) -> list:
        metrics.BATCH_CALLS.labels(service=_S).observe(self._propose.last_batch_calls)
        items, runnable = [], []
        seen = set()
        for j in jobs:
            if j.error is not None:
                continue
            if j.request_id in seen:  # before anything below touches the context the first item drafts from
                j.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT, f"request_id {split(j.request_id)[1]!r} twice in one batch", 0)
                continue
            ctx = self.contexts.get(j.request_id)
            rows = 0 if j.features is None else j.features.shape[0]
            if ctx is None and j.start != 0 and not j.begins:
                j.error = (types_pb2.ITEM_STATUS_UNKNOWN_REQUEST,
                           f"request_id {split(j.request_id)[1]!r} has no context on drafter {self.drafter_id}; resend from 0", 0)
                continue
            if ctx is not None and j.start != ctx.state.length and not j.begins:
                j.error = (types_pb2.ITEM_STATUS_POSITION_MISMATCH,
                           f"context_features.start_position must be {ctx.state.length}; got {j.start}",
                           ctx.state.length)
                continue
            if j.anchor_pos != j.start + rows:
                j.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT,
                           f"anchor_position must equal start_position + rows = {j.start + rows}; got {j.anchor_pos}", 0)
                continue
            if j.tokens is not None and len(j.tokens) != rows:
                j.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT,
                           f"items[{j.index}].context_token_ids must hold one id per context_features row "
                           f"({rows}); got {len(j.tokens)}", 0)
                continue
            if j.begins and ctx is not None:  # its scheduler starts the context over (once the item is valid)
                ctx = self.contexts[j.request_id] = _Context(self.drafter.new_state())
            if ctx is None:
                try:
                    for k in self.owned.make_room([j.request_id], f"drafter {self.drafter_id}"):
                        self.contexts.pop(k, None)  # idle: its scheduler resends the context if it comes back
                        self.owned.forget(k)
                except ResourceExhausted as exc:
                    j.error = (types_pb2.ITEM_STATUS_RESOURCE_EXHAUSTED, str(exc), 0)
                    continue
                ctx = self.contexts[j.request_id] = _Context(self.drafter.new_state())
            self.owned.touch([j.request_id])
            seen.add(j.request_id)
            feats = j.features if j.features is not None else torch.zeros(
                (0, self.feature_size), dtype=self.param_dtype, device=self.param_device)
            gen = make_generator(derive_seed(j.seed, j.anchor_pos)) if (j.temperature > 0 and j.seed is not None) else None
            items.append(ProposeItem(state=ctx.state, new_features=feats, new_positions_start=j.start,
                                     new_tokens=j.tokens if j.tokens is not None else self._new_tokens(ctx, j.start, rows),
                                     anchor=j.anchor,
                                     anchor_pos=j.anchor_pos, temperature=j.temperature, generator=gen,
                                     coupling_seed=j.coupling_seed, processing=j.processing))
            runnable.append(j)
        out: dict[int, object] = {}
        if items:
            t0 = time.perf_counter()
            with metrics.FORWARD_SECONDS.labels(service=_S, rpc="propose").time():
                proposals = self._propose_isolated(items)  # one pass; an item that breaks it fails alone
            dt = time.perf_counter() - t0
            self.step_time.update(dt)
            self.tokens_per_step.update(len(items) * self.drafter.block_size)
            for j, p in zip(runnable, proposals):
                if isinstance(p, Exception):
                    if not isinstance(p, InvalidArgument):
                        log.error("propose item failed", exc_info=p)
                    j.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT,
                               str(p) if isinstance(p, InvalidArgument) else "item failed (see the drafter log)", 0)
                    self.contexts.pop(j.request_id, None)
                    self.owned.forget(j.request_id)
                    continue
                ctx = self.contexts[j.request_id]
                ctx.last_anchor, ctx.last_tokens = j.anchor, list(p.tokens)
                out[j.index] = (p, dt)
        metrics.ACTIVE_STATES.labels(service=_S).set(len(self.contexts))
        return [out.get(j.index, j.error) for j in jobs]

    def _propose_isolated(self, items: list[ProposeItem]) -> list:
        """One batched pass; if it throws, each item alone, so that an item whose input fails the pass fails
        alone. (Seeded items need no pass of their own: their output is fixed by position-keyed coupling,
        whatever their drafts.)"""
        marks = [_mark(it) for it in items]
        try:
            return self.drafter.propose(items)
        except Exception:  # noqa: BLE001 - one item's input must not fail the others
            # the pass may have failed after extending every item's context and drawing from its generator: each
            # retry starts where the item began (and a seeded item draws what it draws in any pass)
            for it, m in zip(items, marks):
                _restore(it, m)
            out: list = []
            for it in items:
                try:
                    out.extend(self.drafter.propose([it]))
                except Exception as e:  # noqa: BLE001 - that item's status
                    out.append(e)
            return out

    def expire_idle(self, ttl_s: float) -> list[str]:
        """Model thread: drop the contexts nobody proposed for in `ttl_s` seconds (their scheduler is gone)."""
        expired = []
        for k in self.owned.idle(ttl_s):
            self.contexts.pop(k, None)
            self.owned.forget(k)
            expired.append(split(k)[1])
        if expired:
            metrics.ACTIVE_STATES.labels(service=_S).set(len(self.contexts))
        return expired

    # -- RPCs
    async def Propose(self, request, context):
        self._ready()
        if not request.items:
            raise InvalidArgument("items", [], "must hold at least one ProposeItem")
        jobs = []
        caller = caller_of(context)
        for i, it in enumerate(request.items):
            f = f"items[{i}]"
            job = _Job(i, key(caller, it.request_id), None, int(it.context_features.start_position), int(it.anchor_token_id),
                       int(it.anchor_position), float(it.temperature), int(it.seed) if it.HasField("seed") else None,
                       int(it.max_draft_tokens) or self.drafter.block_size,
                       int(it.coupling_seed) if it.HasField("coupling_seed") else None)
            try:
                if not it.request_id:
                    raise InvalidArgument(f"{f}.request_id", it.request_id, "must not be empty")
                check_request_id(it.request_id, f"{f}.request_id", MAX_POD_REQUEST_ID_CHARS)
                if not (0 <= it.temperature < float("inf")):
                    raise InvalidArgument(f"{f}.temperature", it.temperature, "must be a finite number >= 0")
                check_temperature(it.temperature, f"{f}.temperature")  # as the request's own check
                if it.max_draft_tokens > self.drafter.block_size:
                    raise InvalidArgument(f"{f}.max_draft_tokens", it.max_draft_tokens,
                                          f"must be in [0, {self.drafter.block_size}]")
                vocab = self.drafter.config.vocab_size
                bad = [t for t in it.context_token_ids if not 0 <= t < vocab]
                if bad:
                    raise InvalidArgument(f"{f}.context_token_ids", bad[:5], f"must be token ids in [0, {vocab})")
                job.begins = bool(it.begins_context)
                if it.context_token_ids:
                    job.tokens = [int(t) for t in it.context_token_ids]
                if it.HasField("processing"):
                    job.processing = draft_processing_from_proto(it.processing, vocab, job.anchor_pos,
                                                                 f"{f}.processing")
                if it.HasField("context_features"):
                    # in the dtype they came in: the drafter rounds them to its training precision and casts
                    # them for its matmuls (a bf16 wire tensor is not widened to float32 here only to be rounded)
                    job.features = features_from_proto(it.context_features, f"{f}.context_features",
                                                       self.num_layers, self.hidden).to(device=self.param_device)
                    bad = ~torch.isfinite(job.features)
                    if bad.any():  # a verifier never sends them; they would poison the request's context
                        row = int(bad.any(dim=1).nonzero()[0])
                        raise InvalidArgument(f"{f}.context_features.hidden_states",
                                              f"{job.features[row][bad[row]][0].item()} in row {row}",
                                              "must hold finite numbers")
                else:
                    job.start = job.anchor_pos
            except InvalidArgument as exc:
                job.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT, str(exc), 0)
            except Exception as exc:  # noqa: BLE001 - a malformed item fails alone
                log.warning("propose item %d refused: %s", i, exc)
                job.error = (types_pb2.ITEM_STATUS_INVALID_ARGUMENT, f"{f} is malformed", 0)
            jobs.append(job)
        out, queued = await self._propose.submit(jobs, caller)
        resp = types_pb2.ProposeResponse()
        stats = None
        for j, o in zip(jobs, out):
            p = resp.proposals.add(request_id=request.items[j.index].request_id)
            if o is None or isinstance(o, tuple) and len(o) == 3:
                status, msg, ctxlen = o if o is not None else (types_pb2.ITEM_STATUS_UNSPECIFIED, "no result", 0)
                p.status, p.error_message, p.context_length = status, msg, ctxlen
                continue
            prop, dt = o
            stats = dt
            p.status = types_pb2.ITEM_STATUS_OK
            p.context_length = j.anchor_pos
            proposal_to_proto(prop, j.max_draft_tokens, p)
        if stats is not None:
            resp.stats.CopyFrom(types_pb2.StepStats(num_requests=len(jobs), num_tokens=len(jobs) * self.drafter.block_size,
                                                    forward_seconds=stats, queue_seconds=queued))
        return resp

    async def Release(self, request, context):
        self._ready()

        keys = [key(caller_of(context), rid) for rid in request.request_ids]

        def release():
            for k in keys:
                self.owned.forget(k)
            n = sum(1 for k in keys if self.contexts.pop(k, None) is not None)
            metrics.ACTIVE_STATES.labels(service=_S).set(len(self.contexts))
            return n

        n = await asyncio.get_running_loop().run_in_executor(self.executor, release)
        return types_pb2.DrafterServiceReleaseResponse(num_released=n)

    async def GetInfo(self, request, context):
        self._ready()
        d, cfg = self.drafter, self.drafter.config
        head = types_pb2.SEQUENTIAL_HEAD_NONE
        if d.kind == "dspark" and cfg.markov_rank > 0:
            head = types_pb2.SEQUENTIAL_HEAD_RNN if cfg.markov_head_type == "rnn" else types_pb2.SEQUENTIAL_HEAD_MARKOV
        return types_pb2.DrafterServiceGetInfoResponse(
            drafter_id=self.drafter_id, drafter_name=d.name, kind=kind_to_proto(d.kind), sequential_head=head,
            has_confidence_head=bool(cfg.enable_confidence_head), block_size=d.block_size,
            max_support_size=d.support_size,
            target_model_name=str(cfg.extra.get("target_model_name_or_path", "") or ""),
            target_layer_ids=[int(x) for x in d.target_layer_ids], target_hidden_size=self.hidden,
            **{field: _history_proto(hist) for field, hist in (
                ("request_history", _history_of(d, greedy=False)),
                ("request_history_greedy", _history_of(d, greedy=True))) if hist is not None})


def _mark(item: ProposeItem) -> tuple:
    """What a pass may change of an item: its state's fields (first position, EAGLE-3's last row), its state's
    cache length (a pass only appends rows past it) and its generator's state."""
    gen = item.generator
    return dict(vars(item.state)), item.state.cache.length, None if gen is None else gen.get_state()


def _restore(item: ProposeItem, mark: tuple) -> None:
    fields, length, gen_state = mark
    vars(item.state).update(fields)
    if item.state.cache.length > length:
        item.state.cache.crop(length)
    if gen_state is not None:
        item.generator.set_state(gen_state)


def _history_of(drafter, greedy: bool):
    """The drafter's request history for sampled or temperature-0 requests (None: none, or a drafter without)."""
    of = getattr(drafter, "confidence_history", None)
    return None if of is None else of(greedy)


def _history_proto(hist) -> types_pb2.ConfidenceHistory:
    return types_pb2.ConfidenceHistory(weights=list(hist.weights), strength=hist.strength, prior=hist.prior)
