"""SchedulerService: GenerateRequest -> (prompt ids, SamplingParams) -> EngineLoop -> GenerateResponse chunks.

Thin: parsing and validation of the request (errors name the proto field and value), incremental
detokenization, and the stream of chunks. Cancelling the RPC cancels the request in the engine, which
releases its state on the verifier and the drafter. Knows nothing about Redis or pods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass

from dspark_core.errors import InvalidArgument
from dspark_core.scheduling import POLICY_ALIASES
from dspark_core.verifier import validate_prompt_ids
from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc, types_pb2

from ..common.convert import FINISH_REASONS, logprobs_to_proto, params_from_proto
from ..common.errors import Unavailable
from ..common.tracing import tracer
from .loop import EngineLoop, Update

@dataclass(frozen=True)
class ModelCard:
    """What ListModels and request validation need to know about the served model."""

    name: str
    vocab_size: int
    max_context: int
    drafter: str | None
    policy: str
    eos_token_ids: tuple[int, ...]
    default_max_new_tokens: int = 128


class Detokenizer:
    """Text deltas from a growing list of ids, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def encode_text(tokenizer, text: str, field: str, chat: bool = False) -> list[int]:
    if tokenizer is None:
        raise InvalidArgument(field, text[:40], "needs a tokenizer; this model has none, send prompt_token_ids")
    if not text.strip():
        raise InvalidArgument(field, text, "must not be empty")
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class Frontend:
    """What the gRPC servicer and the HTTP routes share: validation and running one request."""

    def __init__(self, loop: EngineLoop, card: ModelCard, tokenizer, registry=None, adopt_after_s: float = 5.0):
        self.loop, self.card, self.tokenizer = loop, card, tokenizer
        # a client-chosen request id whose Redis checkpoint has not moved for adopt_after_s belongs to a
        # scheduler that is gone: this one adopts it (continues from the committed tokens)
        self.registry, self.adopt_after_s = registry, adopt_after_s
        self.draining = False
        self.adopted = 0  # requests adopted from a lost scheduler's checkpoint

    def check_names(self, model: str, drafter: str, policy: str) -> None:
        if model and model != self.card.name:
            raise InvalidArgument("model", model, f"must be a served model ({self.card.name})")
        if drafter and drafter != (self.card.drafter or ""):
            raise InvalidArgument("drafter", drafter, f"must be the served drafter ({self.card.drafter or 'none'})")
        if policy and POLICY_ALIASES.get(policy, policy) != self.card.policy:
            raise InvalidArgument("policy", policy, f"must be the configured policy ({self.card.policy})")

    def parse(self, request) -> tuple[str, list[int], object]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt", None, "must be set: prompt_text or prompt_token_ids")
        if which == "prompt_text":
            ids = encode_text(self.tokenizer, request.prompt_text, "prompt_text")
        else:
            ids = list(request.prompt_token_ids.token_ids)
        validate_prompt_ids(ids, self.card.vocab_size, self.card.max_context, which)
        self.check_names(request.model, request.drafter, request.policy)
        params = params_from_proto(request.sampling, self.card.eos_token_ids, self.card.default_max_new_tokens)
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        return rid, ids, params

    async def _adoptable(self, rid: str, prompt_ids: list[int]) -> list[int]:
        """Tokens a lost scheduler committed for this request id (empty when there is nothing to adopt)."""
        if self.registry is None or rid in self.loop.engine.requests:
            return []
        ck = await asyncio.to_thread(self.registry.read_checkpoint, rid)
        if not ck:
            return []
        if time.time() - float(ck.get("updated", 0)) < self.adopt_after_s:
            raise Unavailable(f"request_id {rid!r} is in progress on scheduler {ck.get('scheduler')}; "
                              f"retry in {self.adopt_after_s:g}s if that scheduler is gone")
        if list(ck.get("prompt_ids", [])) != list(prompt_ids):
            raise InvalidArgument("request_id", rid, "has a checkpoint with a different prompt")
        return list(ck.get("generated", []))

    async def run(self, rid: str, prompt_ids: list[int], params, client_id: bool = False):
        """Async iterator of Updates for one request; cancels it in the engine if the consumer goes away.

        With a client-chosen id whose scheduler is gone, the request is adopted from its checkpoint: the
        committed tokens but the last are replayed, and the engine prefills prompt + those (the last one,
        the anchor, is sampled again: for greedy requests it comes back identical).
        """
        if self.draining:
            raise Unavailable("scheduler is draining; retry on another replica")
        prefix = (await self._adoptable(rid, prompt_ids))[:-1] if client_id else []
        if prefix:
            self.adopted += 1
            prefix = prefix[: params.max_new_tokens - 1]
            params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(prefix))
            yield Update(rid, list(prefix))
            prompt_ids = list(prompt_ids) + prefix
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        # one trace per request: this span (a child of the RPC's server span, if any) parents every round
        span = tracer.start_span("generate", attributes={"dspark.request_id": rid,
                                                         "dspark.prompt_tokens": len(prompt_ids)})
        fut = self.loop.submit(prompt_ids, params, rid, lambda u: aloop.call_soon_threadsafe(q.put_nowait, u),
                               span.get_span_context(), adopted=len(prefix))
        done = submitted = False
        try:
            await asyncio.wrap_future(fut)
            submitted = True
            while True:
                upd = await q.get()
                if upd.error is not None:
                    done = True
                    raise upd.error
                done = upd.finished
                yield upd
                if done:
                    return
        finally:
            span.set_attribute("dspark.finished", done)
            span.end()
            if submitted and not done:
                self.loop.cancel(rid)


def _round_proto(r: dict | None, out) -> None:
    if r:
        out.CopyFrom(types_pb2.RoundStats(round_index=r["index"], num_drafted=r["num_drafted"],
                                          num_verified=r["num_verified"], num_accepted=r["num_accepted"],
                                          num_committed=r["num_committed"]))


def _summary_proto(s: dict, out) -> None:
    spec = s["speculative"]
    out.CopyFrom(types_pb2.GenerationSummary(
        prompt_tokens=s["prompt_tokens"], completion_tokens=s["completion_tokens"], num_rounds=s["num_rounds"],
        accepted_per_round=s["accepted_per_round"], tokens_per_round=s["tokens_per_round"],
        tokens_per_second=s["tokens_per_second"], time_to_first_token_seconds=s["time_to_first_token_seconds"],
        elapsed_seconds=s["elapsed_seconds"], num_draft_tokens=spec["num_draft_tokens"],
        num_accepted_tokens=spec["num_accepted_tokens"], accepted_per_position=spec["accepted_per_position"],
        mean_verification_length=spec["mean_verification_length"]))


class SchedulerServicer(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, frontend: Frontend | None = None):
        self.f = frontend  # set once the engine is up; until then every RPC is UNAVAILABLE

    def _ready(self) -> None:
        if self.f is None:
            raise Unavailable("scheduler is starting: waiting for its verifier / drafter")

    async def Generate(self, request, context):
        self._ready()
        rid, ids, params = self.f.parse(request)
        detok = Detokenizer(self.f.tokenizer)
        finished = False
        try:
            async for upd in self.f.run(rid, ids, params, client_id=bool(request.request_id)):
                chunk = types_pb2.GenerateResponse(request_id=rid, token_ids=upd.token_ids,
                                                   text_delta=detok.push(upd.token_ids, final=upd.finished))
                _round_proto(upd.round, chunk.round)
                logprobs_to_proto(upd.logprobs, chunk.logprobs)
                if upd.finished:
                    finished = True
                    chunk.finish_reason = FINISH_REASONS.get(upd.finish_reason, types_pb2.FINISH_REASON_UNSPECIFIED)
                    _summary_proto(upd.summary, chunk.summary)
                yield chunk
        finally:
            if not finished:  # client went away (or the stream failed): free the request everywhere
                self.f.loop.cancel(rid)

    async def GenerateUnary(self, request, context):
        self._ready()
        rid, ids, params = self.f.parse(request)
        tokens, logprobs, last = [], [], None
        try:
            async for upd in self.f.run(rid, ids, params, client_id=bool(request.request_id)):
                tokens.extend(upd.token_ids)
                logprobs.extend(upd.logprobs or ())
                last = upd
        finally:
            if last is None or not last.finished:
                self.f.loop.cancel(rid)
        text = self.f.tokenizer.decode(tokens, skip_special_tokens=True) if self.f.tokenizer else ""
        resp = types_pb2.GenerateUnaryResponse(request_id=rid, text=text, token_ids=tokens,
                                               finish_reason=FINISH_REASONS.get(last.finish_reason, 0))
        _summary_proto(last.summary, resp.summary)
        logprobs_to_proto(logprobs, resp.logprobs)
        return resp

    async def ListModels(self, request, context):
        self._ready()
        c = self.f.card
        m = types_pb2.ModelInfo(name=c.name, vocab_size=c.vocab_size, max_context_length=c.max_context,
                                drafters=[c.drafter] if c.drafter else [], default_drafter=c.drafter or "")
        return types_pb2.ListModelsResponse(models=[m], default_model=c.name, policies=[c.policy],
                                            default_policy=c.policy)
