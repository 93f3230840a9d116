"""OpenAI-compatible HTTP on the scheduler (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming
with "stream": true), /v1/models, /health (metrics have their own port, --metrics-port). docs/openai_api.md
lists every request field.

Same Frontend as the gRPC servicer, so validation, the engine path and cancellation are shared: a client
that disconnects mid-stream cancels its request. This module only parses and formats: the request's
processing (penalties, min_p, min_tokens), its logprobs and its speculative metrics come from dspark_core.
`n` choices are n engine requests submitted together (they share the prompt's prefill), each with a seed
derived from the request's. OpenAI `stop` strings end the text before the first occurrence of any of them
(finish_reason "stop"; the choice is cancelled in the engine at that point, and a stream holds back a tail
that could still grow into one). Types are strict and unsupported fields are refused, never ignored.
Errors: bad input 400 (naming the field), overload 429, draining 503, with OpenAI's {"error": {...}} body;
with API keys set, 401 without `Authorization: Bearer <key>`. Knows nothing about Redis or pods.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from dspark_core.engine import speculative_metrics
from dspark_core.errors import DSparkError, InvalidArgument, NotFound, ResourceExhausted
from dspark_core.sampling import MAX_LOGPROBS, SamplingParams
from dspark_core.verifier import validate_prompt_ids

from ..common.errors import Unavailable
from ..common.limits import check_sampling
from ..common.security import key_ok
from .servicer import MAX_CHOICES, Choices, Frontend

log = logging.getLogger("dspark.http")


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


def _map_error(exc: BaseException) -> web.Response:
    if isinstance(exc, InvalidArgument):
        return _error(400, str(exc), "invalid_request_error", exc.field)
    if isinstance(exc, NotFound):
        return _error(404, str(exc), "not_found_error")
    if isinstance(exc, ResourceExhausted):
        return _error(429, str(exc), "rate_limit_error")
    if isinstance(exc, Unavailable):
        return _error(503, str(exc), "service_unavailable")
    log.exception("http handler failed", exc_info=exc)
    return _error(500, "internal error (see the server log)", "server_error")


UNSUPPORTED = ("suffix", "logit_bias", "tools", "functions", "tool_choice", "function_call", "response_format",
               "prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(name, v, "must be a number")
    try:
        return float(v)
    except OverflowError:  # an integer beyond any float
        raise InvalidArgument(name, v, "must be a finite number") from None


def _integer(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidArgument(name, v, "must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgument(name, v, f"must be an integer in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidArgument(name, v, "must be a boolean (true or false)")
    return v


@dataclass(frozen=True)
class Options:
    """What an OpenAI request asks for beyond the sampling parameters of each choice."""

    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # None: no logprobs; K: the chosen token's and the top K
    stops: list


def _options(body: dict, f: Frontend, chat: bool) -> Options:
    for name in UNSUPPORTED:
        plain_text = name == "response_format" and body.get(name) == {"type": "text"}
        if body.get(name) not in (None, {}, [], "") and not plain_text:
            raise InvalidArgument(name, body[name], "is not supported by this server")
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    best_of = _integer(body, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise InvalidArgument("best_of", best_of, f"is not supported (only best_of = n = {n}: the n samples are "
                                                  "returned as drawn, never ranked)")
    stream = _boolean(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage"}:
            raise InvalidArgument("stream_options", so, "must be an object with include_usage")
        if not stream:
            raise InvalidArgument("stream_options", so, "is only allowed with stream: true")
        include_usage = _boolean(so, "include_usage")
    echo = False if chat else _boolean(body, "echo")
    if chat:
        want = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise InvalidArgument("top_logprobs", top, "needs logprobs: true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise InvalidArgument("echo", True, "cannot be combined with logprobs (prompt logprobs are not computed)")
    return Options(n, stream, include_usage, echo, logprobs, _stop_strings(body, f))


def _params(body: dict, f: Frontend, chat: bool, logprobs: int | None) -> SamplingParams:
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_name, f.card.default_max_new_tokens)
    top_k = _integer(body, "top_k", 0)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                 0 <= t < f.card.vocab_size for t in stop_ids):
        raise InvalidArgument("stop_token_ids", stop_ids, f"must be a list of token ids in [0, {f.card.vocab_size})")
    stop = list(dict.fromkeys(stop_ids))
    if not _boolean(body, "ignore_eos"):
        stop += [t for t in f.card.eos_token_ids if t not in stop]
    try:
        return check_sampling(SamplingParams(
            temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k, seed=_integer(body, "seed", None), max_new_tokens=max_tokens,
            stop_token_ids=tuple(stop), min_p=_number(body, "min_p", 0.0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            min_tokens=_integer(body, "min_tokens", 0), logprobs=logprobs))  # and what the wire can carry
    except InvalidArgument as exc:
        name = {"max_new_tokens": max_name}.get(exc.field, exc.field)
        raise InvalidArgument(name, exc.value, exc.requirement) from None


def _message(i: int, m: dict) -> dict:
    """One chat message as {role, content} strings. OpenAI's content parts are served when they are text
    (`[{"type": "text", "text": ...}, ...]`, joined in order, as vLLM does); any other part is refused by name."""
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise InvalidArgument(f"messages[{i}].role", role, "must be a string")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else part
                raise InvalidArgument(f"messages[{i}].content[{j}].type", kind,
                                      'must be "text" (this model reads text parts only)')
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content[{j}].text", part.get("text"), "must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidArgument(f"messages[{i}].content", content, "must be a string or a list of text parts")
    return {**m, "role": role, "content": content}


async def _prompt_ids(body: dict, f: Frontend, chat: bool) -> list[int]:
    """Tokenized off the event loop, within the byte and token limits of the context window (Frontend.encode)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise InvalidArgument("messages", msgs, "must be a non-empty list of {role, content} objects")
        # the chat template would render anything but strings as text, or drop it
        ids = await f.encode("", "messages", messages=[_message(i, m) for i, m in enumerate(msgs)])
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            ids = await f.encode(p, "prompt")
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
        else:
            raise InvalidArgument("prompt", p if not isinstance(p, str) else p[:40],
                                  "must be a non-empty string or a list of token ids (one prompt)")
    validate_prompt_ids(ids, f.card.vocab_size, f.card.max_context, "prompt")
    return ids


_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
MAX_STOP_STRINGS = 4  # OpenAI's limit


def _stop_strings(body: dict, f: Frontend) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(x, str) and x for x in stop)):
        raise InvalidArgument("stop", stop, f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                                            "non-empty strings")
    if stop and f.tokenizer is None:
        raise InvalidArgument("stop", stop, "needs a tokenizer; this model has none")
    return stop


class StopText:
    """Incremental text of a growing list of token ids, cut before the first stop string.

    `push(ids)` returns the text that may be sent now: everything up to a stop string once one appeared
    (then `hit` is True and `ids` are the tokens up to the one that completed it), else all but the last
    len(longest stop) - 1 characters (they could still become a stop string) and any incomplete UTF-8
    character; `final=True` releases the rest. With no stop strings it is a plain detokenizer.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.hit = False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _cut(self, text: str) -> int:
        at = [i for i in (text.find(x, max(0, self.sent - self.hold)) for x in self.stops) if i >= 0]
        return min(at) if at else -1

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.hit:
            return ""
        self.ids.extend(ids)
        text = self._decode(self.ids)
        cut = self._cut(text) if self.stops else -1
        if cut >= 0:
            self.hit = True
            # the fewest tokens whose text already holds the stop string
            n = len(self.ids) - len(ids)
            while n < len(self.ids) and self._cut(self._decode(self.ids[: n + 1])) < 0:
                n += 1
            del self.ids[n + 1:]
            safe, self.text = cut, text[:cut]
        else:
            self.text = text
            safe = len(text)
            if not final:
                safe -= self.hold
                if text.endswith("\ufffd"):
                    safe = min(safe, len(text) - 1)
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta


def _prompt_text(body: dict, f: Frontend, ids: list[int]) -> str:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return p
    return f.tokenizer.decode(ids, skip_special_tokens=True) if f.tokenizer is not None else ""


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else -9999.0  # JSON has no -inf; OpenAI's stand-in for "impossible"


def _token_text(f: Frontend, token: int) -> str:
    return f.tokenizer.decode([token]) if f.tokenizer is not None else f"token_id:{token}"


def _completion_logprobs(f: Frontend, lps: list, offset: int, top: int) -> dict:
    """The legacy completions format: parallel lists of tokens, their logprobs, top dicts, text offsets."""
    tokens = [_token_text(f, lp.token) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in lps],
            "top_logprobs": [{_token_text(f, t): _logprob(v) for t, v in lp.top} for lp in lps] if top else None,
            "text_offset": offsets}


def _chat_logprobs(f: Frontend, lps: list) -> dict:
    def entry(token: int, value: float) -> dict:
        text = _token_text(f, token)
        return {"token": text, "logprob": _logprob(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps], "refusal": None}


class _ChoiceRun:
    """What one of the n choices of a request produced so far: text cut at the stop strings, logprobs of
    the tokens kept, the rounds' drafted and accepted counts."""

    def __init__(self, index: int, f: Frontend, opts: Options, runs: Choices):
        self.index, self.opts, self.runs = index, opts, runs
        self.text = StopText(f.tokenizer, opts.stops)
        self.logprobs: list = []
        self.accepted: list[int] = []
        self.proposed: list[int] = []
        self.finish: str | None = None
        self.summary: dict | None = None
        self.sent_logprobs = 0
        self.sent_chars = 0
        self.started = False  # a chunk of this choice went out

    def take(self, upd) -> tuple[str, list]:
        """Record one update; returns the text delta that may go out now and the logprobs of new kept tokens."""
        delta = self.text.push(upd.token_ids, final=upd.finished)
        self.logprobs.extend(upd.logprobs or ())
        if upd.round:
            self.accepted.append(upd.round["num_accepted"])
            self.proposed.append(upd.round["num_drafted"])
        if self.text.hit:
            self.finish = "stop"
            self.runs.cancel(self.index)  # end its engine request now, not when the other choices are done
        elif upd.finished:
            self.finish = _FINISH.get(upd.finish_reason, upd.finish_reason)
            self.summary = upd.summary
        kept = len(self.text.ids) if self.opts.logprobs is not None else 0
        new = self.logprobs[self.sent_logprobs:kept]
        self.sent_logprobs = max(self.sent_logprobs, kept)
        return delta, new

    @property
    def done(self) -> bool:
        return self.finish is not None

    def token_ids(self) -> list[int]:
        return list(self.text.ids)


def _usage(ids: list[int], choices: list[_ChoiceRun]) -> dict:
    completion = sum(len(c.text.ids) for c in choices)
    acc = [a for c in choices for a in c.accepted]
    prop = [p for c in choices for p in c.proposed]
    return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion,
            "speculative": speculative_metrics(acc, prop)}


async def _next(runs: Choices, choices: list[_ChoiceRun]):
    i, upd = await runs.next()
    return choices[i], upd


# how often a non-streamed request looks whether its client is still connected while it waits for the engine
DISCONNECT_POLL_S = 0.5


def _client_gone(request) -> bool:
    transport = request.transport  # None once the connection is lost
    return transport is None or transport.is_closing()


async def _next_while_connected(request, runs: Choices, choices: list[_ChoiceRun]):
    """The next update, or None when the client went away first (aiohttp does not cancel a handler whose
    client disconnects, so a non-streamed request would otherwise generate to its end for nobody)."""
    if _client_gone(request):  # updates may come faster than the poll: look before each one too
        return None
    nxt = asyncio.ensure_future(_next(runs, choices))
    while True:
        done, _ = await asyncio.wait({nxt}, timeout=DISCONNECT_POLL_S)
        if done:
            return nxt.result()
        if _client_gone(request):
            nxt.cancel()
            return None


async def _complete(request, f, rid, created, chat, ids, opts, echo, choices, runs) -> web.Response:
    try:
        while not all(c.done for c in choices):
            got = await _next_while_connected(request, runs, choices)
            if got is None:  # the handler's cleanup cancels the engine requests; nobody reads this answer
                return web.Response(status=499, text="client closed the connection")
            c, upd = got
            if not c.done:
                c.take(upd)
    except Exception as exc:  # noqa: BLE001 - mapped to a status (a generic 500 for a bug)
        return _map_error(exc)
    out = []
    for c in choices:
        text = echo + c.text.text
        kept = c.logprobs[: len(c.text.ids)]
        choice = {"index": c.index, "finish_reason": c.finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = _chat_logprobs(f, kept) if opts.logprobs is not None else None
        else:
            choice.update(text=text, logprobs=_completion_logprobs(f, kept, len(echo), opts.logprobs)
                          if opts.logprobs is not None else None)
        out.append(choice)
    first = choices[0]
    s = first.summary or {}  # no summary when a stop string cut the request short
    ext = {"token_ids": first.token_ids(), "num_rounds": len(first.accepted), "accepted_per_round": first.accepted,
           "tokens_per_second": s.get("tokens_per_second")}
    if len(choices) > 1:
        ext["choices"] = [{"token_ids": c.token_ids(), "accepted_per_round": c.accepted} for c in choices]
    return web.json_response({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": f.card.name, "choices": out, "usage": _usage(ids, choices), "dspark": ext})


async def _stream(request, f, rid, created, chat, ids, opts, echo, choices, runs) -> web.StreamResponse:
    # every choice's first update (or its error) comes before the headers: a refused request is a 4xx
    early, started = [], set()
    try:
        while len(started) < len(choices):
            c, upd = await _next(runs, choices)
            started.add(c.index)
            early.append((c, upd))
    except Exception as exc:  # noqa: BLE001
        return _map_error(exc)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def write(data: dict) -> None:
        await resp.write(f"data: {json.dumps(data)}\n\n".encode())

    async def send(c: _ChoiceRun, upd) -> None:
        first = not c.started  # its first chunk carries the role (and the echoed prompt)
        c.started = True
        delta, lps = c.take(upd)
        if first and echo:
            delta = echo + delta
        if chat:
            d = {"content": delta}
            if first:
                d["role"] = "assistant"
            choice = {"index": c.index, "delta": d, "finish_reason": c.finish}
            choice["logprobs"] = _chat_logprobs(f, lps) if opts.logprobs is not None else None
        else:
            choice = {"index": c.index, "text": delta, "finish_reason": c.finish,
                      "logprobs": _completion_logprobs(f, lps, c.sent_chars, opts.logprobs)
                      if opts.logprobs is not None else None}
        c.sent_chars += len(delta)
        data = {"id": rid, "object": kind, "created": created, "model": f.card.name, "choices": [choice]}
        if c.done:  # the choice's own speculation, on its last chunk
            data["dspark"] = {"index": c.index, "speculative": speculative_metrics(c.accepted, c.proposed)}
        await write(data)

    try:
        await resp.prepare(request)  # the client may be gone already
        for c, upd in early:
            await send(c, upd)
        while not all(c.done for c in choices):
            try:
                c, upd = await _next(runs, choices)
            except Exception as exc:  # noqa: BLE001 - headers are out: end the stream with an error event
                await write(json.loads(_map_error(exc).body))
                break
            if not c.done:
                await send(c, upd)
        else:
            if opts.include_usage:
                await write({"id": rid, "object": kind, "created": created, "model": f.card.name, "choices": [],
                             "usage": _usage(ids, choices)})
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # the client went away: the handler's cleanup cancels its requests
    return resp


def make_app(f: Frontend, is_serving, redis_up=None, api_keys: tuple[str, ...] = ()) -> web.Application:
    """`redis_up()` (blocking; None: no Redis configured) says whether Redis answers: /health then reports
    `"redis": "up" | "unreachable"`, and `"status": "degraded"` (still 200: requests are served, coordination
    is off) while it does not."""
    async def health(request):
        ok = is_serving() and not f.draining
        body = {"status": "ok" if ok else "unavailable"}
        if redis_up is not None:
            up = await asyncio.to_thread(redis_up)
            body["redis"] = "up" if up else "unreachable"
            if ok and not up:
                body["status"] = "degraded"
        return web.json_response(body, status=200 if ok else 503)

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": f.card.name, "object": "model", "created": 0, "owned_by": "dspark",
             "drafter": f.card.drafter, "policy": f.card.policy}]})

    async def generate(request, chat: bool):
        try:
            body = await request.json()
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body is not in
            return _error(400, f"request body could not be read: {str(exc).strip()}", "invalid_request_error")
        except (ValueError, RecursionError, LookupError) as exc:
            # not JSON (or not in its charset), nested too deeply, an unknown charset, an integer too long to read
            return _error(400, f"request body must be a JSON object ({type(exc).__name__}: {str(exc)[:200]})",
                          "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            model = body.get("model") or ""
            if not isinstance(model, str):
                raise InvalidArgument("model", model, "must be a string")
            f.check_names(model if model != "default" else "", "", "")
            ids = await _prompt_ids(body, f, chat)
            opts = _options(body, f, chat)
            params = _params(body, f, chat, opts.logprobs)
        except DSparkError as exc:
            return _map_error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        echo = _prompt_text(body, f, ids) if opts.echo else ""
        try:  # the n requests join the engine together
            runs = Choices(f, rid, ids, params, opts.n, owner=f.owner_of_http(request.headers.get("Authorization")))
        except DSparkError as exc:  # e.g. this client's request limit
            return _map_error(exc)
        choices = [_ChoiceRun(i, f, opts, runs) for i in range(opts.n)]
        try:
            if not opts.stream:
                return await _complete(request, f, rid, created, chat, ids, opts, echo, choices, runs)
            return await _stream(request, f, rid, created, chat, ids, opts, echo, choices, runs)
        finally:
            await runs.aclose()  # a client gone, or an error: cancel what still runs in the engine

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    @web.middleware
    async def authenticate(request, handler):
        # /health stays open for probes; everything else needs `Authorization: Bearer <key>` when keys are set
        if api_keys and request.path != "/health" and not key_ok(request.headers.get("Authorization"), api_keys):
            return web.json_response({"error": {"message": "missing or invalid API key: send the header "
                                                           "Authorization: Bearer <key>",
                                                "type": "authentication_error", "param": None,
                                                "code": "invalid_api_key"}}, status=401)
        return await handler(request)

    @web.middleware
    async def openai_errors(request, handler):
        # aiohttp's own 4xx (unknown path, wrong method, body too large) in OpenAI's error body too
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = _error(exc.status, exc.text or exc.reason,
                          "not_found_error" if exc.status == 404 else "invalid_request_error")
            if "Allow" in exc.headers:
                resp.headers["Allow"] = exc.headers["Allow"]
            return resp

    # Prometheus metrics are served on their own port (--metrics-port), never next to the public API
    app = web.Application(middlewares=[openai_errors, authenticate],
                          client_max_size=max(1 << 20, 2 * f.max_prompt_bytes + (64 << 10)))
    app.add_routes([web.get("/health", health), web.get("/v1/models", models),
                    web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat_completions)])
    return app


async def start_http(f: Frontend, host: str, port: int, is_serving, redis_up=None, api_keys: tuple[str, ...] = (),
                     ssl_context=None):
    runner = web.AppRunner(make_app(f, is_serving, redis_up, api_keys), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise InvalidArgument("--http-port", port, f"must be a port free to bind on {host} ({exc.strerror or exc})") \
            from None
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    log.info("http listening", extra={"port": bound})
    return runner, bound
