"""OpenAI-compatible HTTP on the scheduler (aiohttp): /v1/completions, /v1/chat/completions (SSE streaming
with "stream": true), /v1/models, /health, /metrics.

Same Frontend as the gRPC servicer, so validation, the engine path and cancellation are shared: a client
that disconnects mid-stream cancels its request. OpenAI `stop` strings end the text before the first
occurrence of any of them (finish_reason "stop"; the request is cancelled in the engine at that point, and
a stream holds back a tail that could still grow into one). Errors: bad input 400, overload 429, draining
503, with OpenAI's {"error": {...}} body. Knows nothing about Redis or pods.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from aiohttp import web

from dspark_core.errors import DSparkError, InvalidArgument, NotFound, ResourceExhausted
from dspark_core.sampling import SamplingParams
from dspark_core.verifier import validate_prompt_ids

from ..common import metrics
from ..common.errors import Unavailable
from .servicer import Frontend, encode_text

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


def _params(body: dict, f: Frontend) -> SamplingParams:
    def num(name, default, cast=float):
        v = body.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgument(name, v, "must be a number")
        return cast(v)

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", f.card.default_max_new_tokens))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidArgument("max_tokens", max_tokens, "must be an integer >= 1")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument("seed", seed, "must be an integer")
    stop_ids = list(f.card.eos_token_ids)
    try:
        return SamplingParams(temperature=num("temperature", 1.0), top_p=num("top_p", 1.0),
                              top_k=num("top_k", 0, int) if body.get("top_k", 0) != -1 else 0, seed=seed,
                              max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids))
    except InvalidArgument as exc:
        name = {"max_new_tokens": "max_tokens"}.get(exc.field, exc.field)
        raise InvalidArgument(name, exc.value, exc.requirement) from None


def _prompt_ids(body: dict, f: Frontend, chat: bool) -> list[int]:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise InvalidArgument("messages", msgs, "must be a non-empty list of {role, content} objects")
        tok = f.tokenizer
        if tok is None:
            raise InvalidArgument("messages", "...", "need a tokenizer; this model has none")
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(str(m.get("content", "")) for m in msgs) + "\n"
        ids = tok.encode(text, add_special_tokens=False)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            ids = encode_text(f.tokenizer, p, "prompt")
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


def make_app(f: Frontend, is_serving, redis_up=None) -> web.Application:
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

    async def prom(request):
        return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": f.card.name, "object": "model", "created": 0, "owned_by": "dspark",
             "drafter": f.card.drafter, "policy": f.card.policy}]})

    async def generate(request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        try:
            model = body.get("model") or ""
            f.check_names(model if model != "default" else "", "", "")
            ids = _prompt_ids(body, f, chat)
            params = _params(body, f)
            stops = _stop_strings(body, f)
            n = body.get("n", 1)
            if n != 1:
                raise InvalidArgument("n", n, "must be 1")
        except DSparkError as exc:
            return _map_error(exc)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        text_of = StopText(f.tokenizer, stops)
        gen = f.run(rid, ids, params)
        if not body.get("stream"):
            last = None
            try:
                async for upd in gen:
                    text_of.push(upd.token_ids, final=upd.finished)
                    last = upd
                    if text_of.hit:
                        break
            except (DSparkError, Unavailable) as exc:
                return _map_error(exc)
            finally:
                await gen.aclose()  # a stop string cancels the rest of the request in the engine
            tokens, text = text_of.ids, text_of.text
            reason = "stop" if text_of.hit else _FINISH.get(last.finish_reason, last.finish_reason)
            choice = {"index": 0, "finish_reason": reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice.update(text=text, logprobs=None)
            s = last.summary or {}  # no summary when a stop string cut the request short
            return web.json_response({
                "id": rid, "object": kind, "created": created, "model": f.card.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                          "total_tokens": len(ids) + len(tokens)},
                "dspark": {"token_ids": tokens, "num_rounds": s.get("num_rounds"),
                           "accepted_per_round": s.get("accepted_per_round_list"),
                           "tokens_per_second": s.get("tokens_per_second")}})
        # SSE streaming
        try:
            first = await gen.__anext__()
        except (DSparkError, Unavailable) as exc:
            return _map_error(exc)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(upd, role: bool = False):
            delta = text_of.push(upd.token_ids, final=upd.finished)
            finish = _FINISH.get(upd.finish_reason, upd.finish_reason) if upd.finished else None
            if text_of.hit:
                finish = "stop"
            if chat:
                d = {"content": delta}
                if role:
                    d["role"] = "assistant"
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            data = {"id": rid, "object": chunk_kind, "created": created, "model": f.card.name, "choices": [choice]}
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        try:
            await send(first, role=True)
            if not first.finished and not text_of.hit:
                async for upd in gen:
                    await send(upd)
                    if text_of.hit:
                        break
            await resp.write(b"data: [DONE]\n\n")
        finally:
            await gen.aclose()  # a client that went away cancels its request
        return resp

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/metrics", prom), web.get("/v1/models", models),
                    web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat_completions)])
    return app


async def start_http(f: Frontend, host: str, port: int, is_serving, redis_up=None):
    runner = web.AppRunner(make_app(f, is_serving, redis_up), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise InvalidArgument("--http-port", port, f"must be a port free to bind on {host} ({exc.strerror or exc})") \
            from None
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    log.info("http listening", extra={"port": bound})
    return runner, bound
