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
from concurrent.futures import Future
from dataclasses import dataclass

from dspark_core.errors import InvalidArgument, ResourceExhausted
from dspark_core.scheduling import POLICY_ALIASES
from dspark_core.verifier import validate_prompt_ids
from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc, types_pb2

from ..common.convert import FINISH_REASONS, logprobs_to_proto, params_from_proto
from ..common.errors import Unavailable
from ..common.identity import ANONYMOUS_OWNER, client_owner, credentials_owner, scoped_request_id
from ..common.limits import MAX_REQUEST_ID_CHARS, SAMPLING_FIELDS, check_request_id, check_sampling
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


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry (byte-level BPE entries are one char a byte)."""
    try:
        return max((len(t.encode()) for t in tokenizer.get_vocab()), default=16)
    except Exception:  # noqa: BLE001 - an unusual tokenizer: assume long tokens
        return 64


def check_unicode(text: str, field: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode: refuse them by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(field, text[exc.start:exc.end], "must be valid Unicode text (it holds a lone "
                                                               "surrogate)") from None
    return text


def encode_text(tokenizer, text: str, field: str, chat: bool = False) -> list[int]:
    if tokenizer is None:
        raise InvalidArgument(field, text[:40], "needs a tokenizer; this model has none, send prompt_token_ids")
    if not text.strip():
        raise InvalidArgument(field, text, "must not be empty")
    check_unicode(text, field)
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class Frontend:
    """What the gRPC servicer and the HTTP routes share: validation and running one request."""

    def __init__(self, loop: EngineLoop, card: ModelCard, tokenizer, registry=None, adopt_after_s: float = 5.0,
                 max_requests_per_client: int = 0, trust_api_key: bool = False):
        self.loop, self.card, self.tokenizer = loop, card, tokenizer
        # who a client is (services.common.identity.client_owner): its API key counts only when keys are checked
        self.trust_api_key = trust_api_key
        # engine requests (n choices count n) one client may hold at once; 0: no limit but the queue's
        self.max_requests_per_client = max_requests_per_client
        self.held_by: dict[str, int] = {}
        # a client-chosen request id whose Redis checkpoint has not moved for adopt_after_s belongs to a
        # scheduler that is gone: this one adopts it (continues from the committed tokens)
        self.registry, self.adopt_after_s = registry, adopt_after_s
        self.draining = False
        self.adopted = 0  # requests adopted from a lost scheduler's checkpoint
        # a text longer than this cannot fit in the context window even if every token were the longest one
        self.max_prompt_bytes = card.max_context * max(4, min(
            longest_token_bytes(tokenizer) if tokenizer is not None else 16, 256))

    def owner_of(self, context) -> str:
        """The client of a gRPC call (`client_owner`)."""
        return client_owner(context, self.trust_api_key)

    def owner_of_http(self, authorization: str | None) -> str:
        """The client of an HTTP request, from its `Authorization` header (the same owner as on gRPC)."""
        return credentials_owner(authorization if self.trust_api_key else None)

    def hold(self, owner: str, n: int) -> None:
        """Count `n` more requests against `owner`'s limit, or ResourceExhausted (its other requests go on)."""
        held = self.held_by.get(owner, 0)
        if self.max_requests_per_client and held + n > self.max_requests_per_client:
            raise ResourceExhausted(f"this client already runs {held} requests; at most {self.max_requests_per_client} "
                                    f"at once per client (--max-requests-per-client), and this one asks for {n}")
        self.held_by[owner] = held + n

    def unhold(self, owner: str, n: int) -> None:
        left = self.held_by.get(owner, 0) - n
        if left > 0:
            self.held_by[owner] = left
        else:
            self.held_by.pop(owner, None)

    async def encode(self, text: str, field: str, chat: bool = False, messages: list | None = None) -> list[int]:
        """Tokenize off the event loop, within the byte and token limits of the context window."""
        size = len(text.encode("utf-8", "replace")) if messages is None else sum(
            len(str(m.get("content", "")).encode("utf-8", "replace")) for m in messages)
        if size > self.max_prompt_bytes:
            raise InvalidArgument(field, f"{size} bytes", f"must be at most {self.max_prompt_bytes} bytes: longer text "
                                  f"cannot fit in the context window ({self.card.max_context} tokens)")
        if messages is None:
            ids = await asyncio.to_thread(encode_text, self.tokenizer, text, field, chat)
        else:
            ids = await asyncio.to_thread(self._encode_messages, messages, field)
        if len(ids) >= self.card.max_context:
            raise InvalidArgument(field, f"{len(ids)} tokens",
                                  f"must be shorter than the context window ({self.card.max_context} tokens)")
        return ids

    def _encode_messages(self, messages: list, field: str) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise InvalidArgument(field, "...", "need a tokenizer; this model has none")
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(str(m.get("content", "")) for m in messages) + "\n"
        return tok.encode(check_unicode(text, field), add_special_tokens=False)

    def check_names(self, model: str, drafter: str, policy: str) -> None:
        if model and model != self.card.name:
            raise InvalidArgument("model", model, f"must be a served model ({self.card.name})")
        if drafter and drafter != (self.card.drafter or ""):
            raise InvalidArgument("drafter", drafter, f"must be the served drafter ({self.card.drafter or 'none'})")
        if policy and POLICY_ALIASES.get(policy, policy) != self.card.policy:
            raise InvalidArgument("policy", policy, f"must be the configured policy ({self.card.policy})")

    async def parse(self, request) -> tuple[str, list[int], object]:
        rid = check_request_id(request.request_id) if request.request_id else f"req-{uuid.uuid4().hex[:16]}"
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt", None, "must be set: prompt_text or prompt_token_ids")
        self.check_names(request.model, request.drafter, request.policy)
        params = check_sampling(params_from_proto(request.sampling, self.card.eos_token_ids,
                                                  self.card.default_max_new_tokens), self.card.vocab_size,
                                SAMPLING_FIELDS)
        if which == "prompt_text":
            ids = await self.encode(request.prompt_text, "prompt_text")
        else:
            ids = list(request.prompt_token_ids.token_ids)
        validate_prompt_ids(ids, self.card.vocab_size, self.card.max_context, which)
        return rid, ids, params

    async def _adoptable(self, rid: str, prompt_ids: list[int], shown: str) -> list[int]:
        """Tokens a lost scheduler committed for this request id (empty when there is nothing to adopt);
        errors name the client's own id, `shown`."""
        if self.registry is None or rid in self.loop.engine.requests:
            return []
        ck = await asyncio.to_thread(self.registry.read_checkpoint, rid)
        if not ck:
            return []
        if time.time() - float(ck.get("updated", 0)) < self.adopt_after_s:
            # which scheduler holds it is not this client's business (a pod certificate could act on it)
            raise Unavailable(f"request_id {shown!r} is in progress on another scheduler; "
                              f"retry in {self.adopt_after_s:g}s if that scheduler is gone")
        if list(ck.get("prompt_ids", [])) != list(prompt_ids):
            raise InvalidArgument("request_id", shown, "has a checkpoint with a different prompt")
        # this scheduler now holds the checkpoint (only its holder writes or deletes it): one adopter wins
        mine = dict(ck, scheduler=self.loop.scheduler_id, updated=time.time())
        if not await asyncio.to_thread(self.registry.adopt_checkpoint, rid, str(ck.get("scheduler", "")), mine):
            raise Unavailable(f"request_id {shown!r} was just adopted by another scheduler; retry in "
                              f"{self.adopt_after_s:g}s if that scheduler is gone")
        return list(ck.get("generated", []))

    async def run(self, rid: str, prompt_ids: list[int], params, client_id: bool = False, submit=None,
                  shown: str | None = None):
        """Async iterator of Updates for one request; cancels it in the engine if the consumer goes away.
        `rid` is the id it runs under (a client's own id scoped by its owner), `shown` the one its errors name.

        With a client-chosen id whose scheduler is gone, the request is adopted from its checkpoint: the
        committed tokens but the last are replayed, and the engine prefills prompt + those (the last one,
        the anchor, is sampled again: for greedy requests it comes back identical). `submit` replaces
        `self.loop.submit` (Choices hands the n choices to the engine together).
        """
        if self.draining:
            raise Unavailable("scheduler is draining; retry on another replica")
        shown = rid if shown is None else shown
        prefix = (await self._adoptable(rid, prompt_ids, shown))[:-1] if client_id else []
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
        def sink(u):
            aloop.call_soon_threadsafe(q.put_nowait, u)

        fut = (submit or self.loop.submit)(prompt_ids, params, rid, sink, span.get_span_context(), len(prefix))
        done = submitted = False
        try:
            try:
                await asyncio.wrap_future(fut)
            except InvalidArgument as exc:
                if exc.field == "request_id" and exc.value == rid and shown != rid:
                    raise InvalidArgument("request_id", shown, exc.requirement) from None
                raise
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
            if submitted and not done:  # only this request: never another one that shares its id
                self.loop.cancel(rid, sink)


MAX_CHOICES = 16  # n at most, on gRPC and HTTP


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index` of a seeded request: choice 0 uses the seed itself (n = 1 equals a plain request),
    the others a seed mixed from (seed, index), so the n samples are independent and reproducible."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


class Choices:
    """The n choices of one request: n engine requests submitted together (so the verifier prefills the
    shared prompt once), choice i seeded by `choice_seed`, their updates merged in arrival order. They count
    against `owner`'s request limit until `aclose()`; a client's own request id (`client_id`) runs scoped by
    `owner` (`scoped_request_id`): in the engine, in Redis and on the pods.

    `next()` returns (index, Update) or raises the error that ended a choice; `cancel(i)` ends one choice
    (a stop string cut it) and `aclose()` all of them, freeing their state in the engine.
    """

    def __init__(self, f: "Frontend", rid: str, prompt_ids: list[int], params, n: int, client_id: bool = False,
                 owner: str = ANONYMOUS_OWNER):
        if not 1 <= n <= MAX_CHOICES:
            raise InvalidArgument("n", n, f"must be an integer in [1, {MAX_CHOICES}]")
        self.request_ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        if len(self.request_ids[-1]) > MAX_REQUEST_ID_CHARS:  # every hop bounds the ids it keys state by
            raise InvalidArgument("request_id", rid[:40] + "...",
                                  f"must be at most {MAX_REQUEST_ID_CHARS - len(str(n - 1)) - 1} characters with "
                                  f"n = {n} (choice i runs as <request_id>-<i>)")
        # a client's own ids run scoped by its owner (the ids shown to it stay its own)
        runs = [scoped_request_id(owner, r) for r in self.request_ids] if client_id else self.request_ids
        f.hold(owner, n)  # last: nothing below fails, and aclose() gives it back
        self._f, self._owner = f, owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop, self._n, self._held = f.loop, n, []
        self._tasks = [asyncio.create_task(self._pump(i, f.run(
            runs[i], prompt_ids, dataclasses.replace(params, seed=choice_seed(params.seed, i)),
            client_id=client_id and n == 1, submit=self._submit if n > 1 else None, shown=self.request_ids[i])))
            for i in range(n)]

    def _submit(self, *entry) -> Future:
        """Hold each choice's submission until all n are in, then hand them to the engine in one command."""
        mine: Future = Future()
        self._held.append((entry, mine))
        if len(self._held) == self._n:
            for (_, m), theirs in zip(self._held, self._loop.submit_group([e for e, _ in self._held])):
                theirs.add_done_callback(lambda t, m=m: m.set_exception(t.exception()) if t.exception()
                                         else m.set_result(t.result()))
        return mine

    async def _pump(self, index: int, gen) -> None:
        try:
            async for upd in gen:
                self._queue.put_nowait((index, upd, None))
                if upd.finished:
                    break
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which answers for this request only
            self._queue.put_nowait((index, None, exc))
        finally:
            await gen.aclose()

    async def next(self) -> tuple[int, Update]:
        index, upd, exc = await self._queue.get()
        if exc is not None:
            raise exc
        return index, upd

    def cancel(self, index: int) -> None:
        self._tasks[index].cancel()

    async def aclose(self) -> None:
        if self._owner is not None:  # at once: a cancelled handler may not get past the await below
            self._f.unhold(self._owner, self._n)
            self._owner = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


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
        rid, ids, params = await self.f.parse(request)
        n = request.n or 1
        choices = Choices(self.f, rid, ids, params, n, client_id=bool(request.request_id),
                          owner=self.f.owner_of(context))
        detoks = [Detokenizer(self.f.tokenizer) for _ in range(n)]
        finished = 0
        try:
            while finished < n:
                i, upd = await choices.next()
                chunk = types_pb2.GenerateResponse(request_id=choices.request_ids[i], token_ids=upd.token_ids,
                                                   text_delta=detoks[i].push(upd.token_ids, final=upd.finished),
                                                   choice_index=i)
                _round_proto(upd.round, chunk.round)
                logprobs_to_proto(upd.logprobs, chunk.logprobs)
                if upd.finished:
                    finished += 1
                    chunk.finish_reason = FINISH_REASONS.get(upd.finish_reason, types_pb2.FINISH_REASON_UNSPECIFIED)
                    _summary_proto(upd.summary, chunk.summary)
                yield chunk
        finally:
            await choices.aclose()  # client went away (or the stream failed): free every choice everywhere

    async def GenerateUnary(self, request, context):
        self._ready()
        rid, ids, params = await self.f.parse(request)
        n = request.n or 1
        choices = Choices(self.f, rid, ids, params, n, client_id=bool(request.request_id),
                          owner=self.f.owner_of(context))
        tokens, logprobs, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        try:
            while not all(u is not None and u.finished for u in last):
                i, upd = await choices.next()
                tokens[i].extend(upd.token_ids)
                logprobs[i].extend(upd.logprobs or ())
                last[i] = upd
        finally:
            await choices.aclose()
        out = []
        for i in range(n):
            text = self.f.tokenizer.decode(tokens[i], skip_special_tokens=True) if self.f.tokenizer else ""
            c = types_pb2.GenerateChoice(index=i, text=text, token_ids=tokens[i],
                                         finish_reason=FINISH_REASONS.get(last[i].finish_reason, 0))
            _summary_proto(last[i].summary, c.summary)
            logprobs_to_proto(logprobs[i], c.logprobs)
            out.append(c)
        first = out[0]
        resp = types_pb2.GenerateUnaryResponse(request_id=rid, text=first.text, token_ids=first.token_ids,
                                               finish_reason=first.finish_reason, summary=first.summary,
                                               logprobs=first.logprobs, choices=out if n > 1 else [])
        return resp

    async def ListModels(self, request, context):
        self._ready()
        c = self.f.card
        m = types_pb2.ModelInfo(name=c.name, vocab_size=c.vocab_size, max_context_length=c.max_context,
                                drafters=[c.drafter] if c.drafter else [], default_drafter=c.drafter or "")
        return types_pb2.ListModelsResponse(models=[m], default_model=c.name, policies=[c.policy],
                                            default_policy=c.policy)
