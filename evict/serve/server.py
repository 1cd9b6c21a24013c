"""OpenAI-compatible HTTP front of the engine (FastAPI + uvicorn; requests are the pydantic models of
evict.serve.protocol, so GET /openapi.json and /docs describe them).

    POST /v1/completions        prompt (text or token ids), echo, logprobs (top N; with echo the prompt's too, from
                                the prefill's logits, and max_tokens may be 0), n, stream (server-sent `data:`
                                events ending with `data: [DONE]`, stream_options.include_usage; the echo comes in
                                a choice's first chunk), and the sampling fields of protocol.Sampling; extension:
                                return_token_ids
    POST /v1/chat/completions   messages through the model's chat template (evict.serve.chat), the same sampling
                                fields, logprobs / top_logprobs, n, stream
    GET  /v1/models             the one model served
    GET  /health                200 {"status": "ok"} while the engine thread runs, else 503
    GET  /metrics               Prometheus text: running / waiting requests, tokens/s, slot and cache-pool use, memory
Every error (a bad field, 401, 404, 405, a failed step, shutting down) is JSON in OpenAI's shape: {"error": {"message":
"<param>: <what was expected>", "type", "param", "code"}}; a request whose step failed gets a 500 (streaming: an
`error` event), the others go on. The tokenizer's end-of-text token (evict.serve.chat.eos_token_id) and the
request's stop_token_ids end a choice with finish_reason "stop" (their text is not returned). A client that hangs up
(streaming or not) has its requests cancelled, which frees their slots at the engine's next step. With an api_key,
/v1/ routes need `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from json.encoder import encode_basestring_ascii as json_str  # what json.dumps writes for a str

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from evict.serve.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, eos_token_id
from evict.serve.engine import Engine, EngineDown, SamplingParams
from evict.serve.engine import Request as EngineRequest
from evict.serve.launch import KEEP_ALIVE_S
from evict.serve.protocol import BadRequest, ChatRequest, CompletionRequest, Sampling, sampling_params, stop_strings
from evict.serve.text import IncrementalDecoder, TextStream

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error", 422: "invalid_request_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": " ".join(message.split())[:500], "type": kind, "param": param, "code": status}}


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


@dataclass(slots=True)
class Delta:
    """What one engine event adds to one choice."""

    index: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    # (token, its, top N); a choice's first delta with echo and logprobs starts with the prompt's (the first: None, None)
    logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


class Choice:
    """One choice = one engine request: its events -> Deltas (text through a TextStream, stop ids' text dropped). With
    `echo` (text), the first Delta starts with it and, if the request asked for prompt_logprobs, with the prompt's
    log-probabilities (complete once the request has an event: it has read its prompt)."""

    def __init__(self, index: int, tokenizer, stop: list[str], stop_ids: tuple[int, ...], echo: str | None = None):
        self.index, self.text, self.stop_ids = index, TextStream(tokenizer, stop), set(stop_ids)
        self.done, self.tokens, self.echo = False, 0, echo
        self.req: EngineRequest | None = None

    def handle(self, kind: str, value, extra, cancel) -> Delta | None:
        if self.done:  # a step the engine ran past a stop text
            return None
        d = self._token(value, extra, cancel) if kind == "token" else self._end(value, extra)
        if self.echo is not None and d.error is None and self.req is not None:
            d.text = self.echo + d.text
            if self.req.params.prompt_logprobs is not None:
                p = self.req.prompt
                d.logprobs = [(p[0], None, None), *((t, v, top) for t, (v, top) in zip(p[1:], self.req.prompt_logprobs)),
                              *d.logprobs]
            self.echo = None
        return d

    def _token(self, t: int, extra, cancel) -> Delta:
        self.tokens += 1
        lps = [] if extra is None else [(t, *extra)]
        if t in self.stop_ids:  # its text is not returned
            return Delta(self.index, "", [t], lps)
        text, stopped = self.text.feed(t)
        if not stopped:
            return Delta(self.index, text, [t], lps)
        self.done = True
        cancel(self.req)
        return Delta(self.index, text, [t], lps, "stop")

    def _end(self, reason: str, error: str | None) -> Delta:
        self.done = True
        if reason == "error":
            return Delta(self.index, error=error)
        return Delta(self.index, self.text.flush(), finish=reason)


class Mailbox:
    """Events from the engine thread to one event loop's inboxes (anything with put_nowait: an Inbox, an asyncio.Queue),
    delivered in batches: the loop is woken once for all the events posted since its last delivery (one engine step's
    tokens of every stream), not once per token: at 128 streams that takes the engine thread's share from ~0.5–0.9 ms
    per step to ~0.08 ms on a CPU (`python dev/serve_mailbox_bench.py`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock = loop, threading.Lock()
        self.items: list[tuple] = []  # (inbox, event) posted, not yet delivered

    def put(self, inbox, event: tuple) -> None:  # from the engine thread
        with self.lock:
            self.items.append((inbox, event))
            if len(self.items) > 1:  # a delivery is already scheduled and will take this one too
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _deliver(self) -> None:  # on the loop
        with self.lock:
            items, self.items = self.items, []
        for inbox, event in items:
            inbox.put_nowait(event)


class Inbox:
    """One Generation's events on the loop: a list, and its reader woken once per delivery (not per event). With
    `interval` > 1 (--stream-interval) token events gather until `interval` of them wait, so the reader wakes and the
    stream is written once per that many (its first token and every finish or error still wake it at once)."""

    def __init__(self, interval: int = 1):
        self.items: list[tuple] = []
        self.waiter: asyncio.Future | None = None
        self.interval, self.first, self.urgent = interval, True, False

    def put_nowait(self, event: tuple) -> None:
        self.items.append(event)
        if event[1] != "token":
            self.urgent = True
        if self.waiter is not None and not self.waiter.done() and self.ready():
            self.waiter.set_result(None)

    def ready(self) -> bool:
        return bool(self.items) and (self.first or self.urgent or len(self.items) >= self.interval)

    async def take(self) -> list[tuple]:
        """Every event delivered so far (waits until they are ready to send)."""
        while not self.ready():
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        self.first = self.urgent = False
        return items


_MAILBOXES: dict[asyncio.AbstractEventLoop, Mailbox] = {}


def mailbox() -> Mailbox:
    """The running loop's Mailbox (made on first use)."""
    loop = asyncio.get_running_loop()
    if loop not in _MAILBOXES:
        for old in [lp for lp in _MAILBOXES if lp.is_closed()]:
            del _MAILBOXES[old]
        _MAILBOXES[loop] = Mailbox(loop)
    return _MAILBOXES[loop]


class Generation:
    """The n choices of one HTTP request, submitted together; `deltas()` yields their Deltas as they come."""

    def __init__(self, engine: Engine, tokenizer, ids: list[int], params: list[SamplingParams], stop: list[str],
                 echo: str | None = None, interval: int = 1):
        self.engine, self.ids = engine, ids
        self.mailbox = mailbox()
        self.events = Inbox(interval * len(params))  # `interval` tokens of each choice
        self.choices = [Choice(i, tokenizer, stop, p.stop_tokens, echo) for i, p in enumerate(params)]
        self.left = len(self.choices)  # choices not finished yet (as the loop has seen them)
        try:
            for c, p in zip(self.choices, params):
                c.req = engine.submit(ids, p, on_token=self._on_token(c.index), on_finish=self._on_finish(c.index))
        except BaseException:
            self.cancel()
            raise

    def _on_token(self, i: int):  # called from the engine thread
        put, inbox = self.mailbox.put, self.events
        return lambda r, t: put(inbox, (i, "token", t, r.logprobs[-1] if r.params.logprobs is not None else None))

    def _on_finish(self, i: int):
        put, inbox = self.mailbox.put, self.events
        return lambda r: put(inbox, (i, "finish", r.finish_reason, r.error))

    async def take(self) -> list[Delta]:
        """The Deltas of every event delivered by the next wake-up (one engine step's, or several steps' when the loop
        fell behind; may be none), so a stream is written once per wake-up, not once per token. Call while `left`."""
        out, choices, cancel = [], self.choices, self.engine.cancel
        for i, kind, value, extra in await self.events.take():
            d = choices[i].handle(kind, value, extra, cancel)
            if d is not None:
                self.left -= d.finish is not None or d.error is not None
                out.append(d)
        return out

    async def deltas(self):
        """take()'s Deltas one by one, until every choice has finished."""
        while self.left:
            for d in await self.take():
                yield d

    def cancel(self) -> None:
        for c in self.choices:
            if c.req is not None and c.req.finish_reason is None:
                self.engine.cancel(c.req)

    def usage(self) -> dict:
        n = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": len(self.ids), "completion_tokens": n, "total_tokens": len(self.ids) + n}


def failure_status(message: str) -> int:
    """A choice's step failed (500), or the engine is stopping (503)."""
    return 503 if message.startswith(EngineDown.__name__) else 500


class Served:
    """What the routes share: the engine, its tokenizer, the model's name, chat template and end-of-text token."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, chat_template: str, stream_interval: int = 1):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.stream_interval = stream_interval
        self.counter = iter(range(1, 1 << 62))
        self.eos = eos_token_id(tokenizer)
        self.template = ChatTemplate(chat_template, tokenizer.decode([self.eos]) if self.eos is not None else "")

    def token_text(self, t: int) -> str:
        s = self.tokenizer.decode([t])
        return f"token_id:{t}" if "\ufffd" in s else s  # a token that is part of a character

    def head(self, kind: str) -> dict:
        return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{next(self.counter)}", "object": kind,
                "created": int(time.time()), "model": self.model_name}

    def start(self, body: Sampling, ids: list[int], *, max_tokens: int, logprobs: int | None, echo: str | None = None,
              prompt_logprobs: int | None = None) -> Generation:
        if body.model is not None and body.model != self.model_name:
            raise BadRequest("model", f"this server serves {self.model_name!r}, got {body.model[:80]!r}", status=404)
        if body.max_tokens is not None:
            max_tokens = body.max_tokens
        stops = (self.eos,) if self.eos is not None else ()
        params = [sampling_params(body, max_tokens=max_tokens, stop_tokens=stops, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, index=i) for i in range(body.n)]
        try:
            return Generation(self.engine, self.tokenizer, ids, params, stop_strings(body), echo, self.stream_interval)
        except EngineDown as e:
            raise BadRequest(None, str(e), status=503) from None
        except ValueError as e:  # the engine's door: one line naming the field
            msg = str(e)
            param = msg.split(":", 1)[0]
            param = {"stop_tokens": "stop_token_ids", "prompt": "messages" if isinstance(body, ChatRequest) else "prompt"}.get(param, param)
            raise BadRequest(param, msg.split(": ", 1)[-1]) from None


def build_app(engine: Engine, tokenizer, model_name: str, *, chat_template: str = DEFAULT_CHAT_TEMPLATE,
              api_key: str | None = None, stream_interval: int = 1):
    """The FastAPI app over an engine. stream_interval: a stream is written once per that many tokens of each choice
    (its first token and its end at once); the events a client reads are the same, only their grouping into writes
    changes (fewer wake-ups and writes of the event loop per token)."""
    app = FastAPI(title="evict serve", version="1")
    served = Served(engine, tokenizer, model_name, chat_template, stream_interval)
    add_error_handlers(app)
    if api_key:
        add_auth(app, api_key)
    add_info_routes(app, served)
    add_completions(app, served)
    add_chat(app, served)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON shape: a bad field (400), an HTTP error (401, 404, 405, ...), a crash (500)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        e = exc.errors()[0]
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = loc[0] if loc and e.get("type") != "json_invalid" else "body"
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            msg = "not a field this server honours (it is refused, not ignored)"
        elif e.get("type") == "json_invalid":
            msg = "expected a JSON object (the body is not valid JSON)"
        elif len(loc) > 1 and loc[1] not in ("str", "int", "float", "bool"):
            msg = f"at {'.'.join(loc[1:])}: {msg}"
        return error(400, f"{param}: {msg}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        param = "body" if exc.status_code == 400 else None
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error(exc.status_code, f"body: {detail}" if param else f"{detail}: {request.method} {request.url.path}",
                     param)

    @app.exception_handler(Exception)
    async def crash(request, exc: Exception):
        return error(500, f"{type(exc).__name__}: {str(exc)[:200]}")


def add_auth(app: FastAPI, api_key: str) -> None:
    """/v1/ routes need `Authorization: Bearer <api_key>` (401 otherwise)."""

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return error(401, "expected the header Authorization: Bearer <the server's --api-key>")
        return await call_next(request)


def add_info_routes(app: FastAPI, served: Served) -> None:
    """GET /health, /v1/models, /metrics."""
    engine = served.engine

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "error", "engine": "not running"}, status_code=503)
        return {"status": "ok", "engine": "running"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "evict", "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():  # in a worker thread: with --engine-process on it waits for the child's answer
        return PlainTextResponse(prometheus(await run_in_threadpool(engine.metrics)),
                                 media_type="text/plain; version=0.0.4")


async def respond(request: Request, gen: Generation, stream: bool, include_usage: bool, chunk, final, event=None):
    """Stream `chunk(delta)` events (rendered by `event`), or gather the deltas and answer `final(per-choice deltas)`."""
    if stream:
        return StreamingResponse(sse(gen, include_usage, chunk, event), media_type="text/event-stream")

    async def watch() -> None:  # the body is read: the next ASGI message is the client hanging up
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.cancel()

    watcher = asyncio.create_task(watch())
    per: list[list[Delta]] = [[] for _ in gen.choices]
    try:
        async for d in gen.deltas():
            if d.error is not None:
                return error(failure_status(d.error), d.error)
            per[d.index].append(d)
    finally:  # also when the handler itself is cancelled
        watcher.cancel()
        gen.cancel()
    if any(ds[-1].finish == "cancelled" for ds in per):
        return None  # the client is gone
    return final(per)


async def sse(gen: Generation, include_usage: bool, chunk, event=None):
    """The server-sent events of a streamed answer: opening chunks, one per delta, usage, `[DONE]` (or an error).
    `event(delta)` is the `data:` line of `chunk(delta)` (rendered without building the dict, see dict_event); the
    events of one wake-up go out as one write."""
    if event is None or not FAST_EVENTS:
        event = partial(dict_event, chunk)
    try:
        head = [f"data: {json.dumps(first)}\n\n" for c in gen.choices
                if (first := chunk(Delta(c.index), opening=True)) is not None]
        if head:
            yield "".join(head).encode()
        while gen.left:
            out = []
            for d in await gen.take():
                if d.error is not None:
                    gen.cancel()
                    out.append(f"data: {json.dumps(error_body(failure_status(d.error), d.error))}\n\n")
                    break
                e = event(d)
                if e is not None:
                    out.append(e)
            else:
                if out:
                    yield "".join(out).encode()
                continue
            yield "".join(out).encode()  # an error: nothing after it
            break
        else:
            if include_usage:
                yield f"data: {json.dumps({**chunk(None, opening=False), 'usage': gen.usage()})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:  # also when the client went away (the generator is closed or cancelled)
        gen.cancel()


FAST_EVENTS = True  # stream events from string templates (tests turn it off to compare with the dicts' json.dumps)


def dict_event(chunk, d: Delta) -> str | None:
    """The `data:` line of chunk(d): the reference form of the answers' `event` (their templates must equal it)."""
    c = chunk(d, opening=False)
    return None if c is None else f"data: {json.dumps(c)}\n\n"


def head_prefix(h: dict) -> str:
    """json.dumps({**h, "choices": [...]}) up to the first choice."""
    return json.dumps(h)[:-1] + ', "choices": ['


def id_list(ids: list[int]) -> str:
    return str(ids)  # a list of ints: json.dumps's text


def completion_ids(body: CompletionRequest, tokenizer) -> list[int]:
    """The prompt's token ids, after the checks /v1/completions makes of its fields (BadRequest)."""
    if body.max_tokens == 0 and not (body.echo and body.logprobs is not None):
        raise BadRequest("max_tokens", "expected a positive integer (0 only with echo and logprobs: the prompt's "
                                       "log-probabilities alone)")
    if body.best_of is not None and body.best_of != body.n:
        raise BadRequest("best_of", "expected n (this server does not rank choices)")
    if not isinstance(body.prompt, str):
        return body.prompt
    if not body.prompt:
        raise BadRequest("prompt", "expected a non-empty string or list of token ids")
    try:
        return [int(t) for t in tokenizer.encode(body.prompt)]
    except ValueError as e:
        raise BadRequest("prompt", str(e)) from None


class CompletionAnswer:
    """The /v1/completions answer of one request: its stream chunks and its final body. A token's text_offset is
    where its text begins in the choice's text (echo included): each choice's tokens are decoded incrementally."""

    def __init__(self, served: Served, body: CompletionRequest, gen: Generation):
        self.served, self.body, self.gen = served, body, gen
        self.h = served.head("text_completion")
        self.prefix = head_prefix(self.h)
        self.offsets = [0] * body.n
        self.decoders = [IncrementalDecoder(served.tokenizer) for _ in range(body.n)]

    def logprobs(self, i: int, entries) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            out["tokens"].append(self.served.token_text(t))
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if top is None else {self.served.token_text(j): v for j, v in top})
            out["text_offset"].append(self.offsets[i])
            self.offsets[i] += len(self.decoders[i].step(t))
        return out

    def piece(self, d: Delta) -> dict:
        c: dict = {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish}
        if self.body.logprobs is not None:
            c["logprobs"] = self.logprobs(d.index, d.logprobs)
        if self.body.return_token_ids:
            c["token_ids"] = d.ids
        return c

    def chunk(self, d: Delta | None, *, opening: bool) -> dict | None:
        h = self.h
        if d is None:
            return {**h, "choices": []}
        if opening:  # the echo, if any, comes with the first token (or the finish): its log-probabilities need the prefill
            return None
        if not (d.text or d.finish or d.logprobs or (self.body.return_token_ids and d.ids)):
            return None
        return {**h, "choices": [self.piece(d)]}

    def event(self, d: Delta) -> str | None:
        """`data: json.dumps(self.chunk(d))`, from a template when the choice has no logprobs."""
        if self.body.logprobs is not None:
            return dict_event(self.chunk, d)
        if not (d.text or d.finish or (self.body.return_token_ids and d.ids)):
            return None
        ids = f', "token_ids": {id_list(d.ids)}' if self.body.return_token_ids else ""
        finish = "null" if d.finish is None else json_str(d.finish)
        return (f'data: {self.prefix}{{"index": {d.index}, "text": {json_str(d.text)}, "logprobs": null, '
                f'"finish_reason": {finish}{ids}}}]}}\n\n')

    def final(self, per: list[list[Delta]]) -> dict:
        choices = []
        for i, ds in enumerate(per):
            joined = Delta(i, "".join(d.text for d in ds), [t for d in ds for t in d.ids],
                           [e for d in ds for e in d.logprobs], ds[-1].finish)
            choices.append(self.piece(joined))
        return {**self.h, "choices": choices, "usage": self.gen.usage()}


def add_completions(app: FastAPI, served: Served) -> None:
    """POST /v1/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            ids = completion_ids(body, served.tokenizer)
            echo = (body.prompt if isinstance(body.prompt, str) else served.tokenizer.decode(ids)) if body.echo else None
            gen = served.start(body, ids, max_tokens=16, logprobs=body.logprobs, echo=echo,
                               prompt_logprobs=body.logprobs if body.echo else None)
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        answer = CompletionAnswer(served, body, gen)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, gen, body.stream, include, answer.chunk, answer.final, answer.event)


def chat_ids(body: ChatRequest, served: Served) -> list[int]:
    """The messages through the chat template as token ids, after the checks of the fields (BadRequest); sets
    body.max_tokens from max_completion_tokens."""
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs", "needs logprobs: true")
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise BadRequest("max_completion_tokens", "differs from max_tokens (give one of them)")
        body.max_tokens = body.max_completion_tokens
    try:
        text = served.template.render([{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                                       for m in body.messages])
        ids = [int(t) for t in served.tokenizer.encode(text)]
    except ValueError as e:
        raise BadRequest("messages", str(e)) from None
    if not ids:
        raise BadRequest("messages", "the chat template made an empty prompt of them")
    return ids


class ChatAnswer:
    """The /v1/chat/completions answer of one request: its stream chunks and its final body."""

    def __init__(self, served: Served, body: ChatRequest, gen: Generation):
        self.served, self.body, self.gen = served, body, gen
        self.h = served.head("chat.completion.chunk" if body.stream else "chat.completion")
        self.prefix = head_prefix(self.h)

    def logprobs(self, entries) -> dict:
        def one(t: int, lp: float) -> dict:
            s = self.served.token_text(t)
            return {"token": s, "logprob": lp, "bytes": None if s.startswith("token_id:") else list(s.encode())}

        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]}

    def chunk(self, d: Delta | None, *, opening: bool) -> dict | None:
        h, body = self.h, self.body
        if d is None:
            return {**h, "choices": []}
        if opening:
            return {**h, "choices": [{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
        if not (d.text or d.finish or d.logprobs or (body.return_token_ids and d.ids)):
            return None
        c: dict = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                   "logprobs": self.logprobs(d.logprobs) if body.logprobs else None, "finish_reason": d.finish}
        if body.return_token_ids:
            c["token_ids"] = d.ids
        return {**h, "choices": [c]}

    def event(self, d: Delta) -> str | None:
        """`data: json.dumps(self.chunk(d))`, from a template when the request asked for no logprobs."""
        body = self.body
        if body.logprobs:
            return dict_event(self.chunk, d)
        if not (d.text or d.finish or (body.return_token_ids and d.ids)):
            return None
        delta = f'{{"content": {json_str(d.text)}}}' if d.text else "{}"
        ids = f', "token_ids": {id_list(d.ids)}' if body.return_token_ids else ""
        finish = "null" if d.finish is None else json_str(d.finish)
        return (f'data: {self.prefix}{{"index": {d.index}, "delta": {delta}, "logprobs": null, '
                f'"finish_reason": {finish}{ids}}}]}}\n\n')

    def final(self, per: list[list[Delta]]) -> dict:
        choices = []
        for i, ds in enumerate(per):
            c: dict = {"index": i, "message": {"role": "assistant", "content": "".join(d.text for d in ds)},
                       "logprobs": self.logprobs([e for d in ds for e in d.logprobs]) if self.body.logprobs else None,
                       "finish_reason": ds[-1].finish}
            if self.body.return_token_ids:
                c["token_ids"] = [t for d in ds for t in d.ids]
            choices.append(c)
        return {**self.h, "choices": choices, "usage": self.gen.usage()}


def add_chat(app: FastAPI, served: Served) -> None:
    """POST /v1/chat/completions."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            ids = chat_ids(body, served)
            n_lp = (body.top_logprobs or 0) if body.logprobs else None
            gen = served.start(body, ids, max_tokens=max(served.engine.max_len - len(ids), 1), logprobs=n_lp)
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        answer = ChatAnswer(served, body, gen)
        include = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, gen, body.stream, include, answer.chunk, answer.final, answer.event)


def prometheus(m: dict) -> str:
    """Prometheus text exposition of the engine's metrics."""
    rows = [("requests_running", "gauge", "requests holding a slot", m["running"]),
            ("requests_waiting", "gauge", "requests queued (new or preempted)", m["waiting"]),
            ("requests_total", "counter", "requests received", m["requests"]),
            ("requests_finished_total", "counter", "requests finished (stop, length, cancelled or error)", m["finished"]),
            ("requests_cancelled_total", "counter", "requests cancelled (client gone, stop text seen)", m["cancelled"]),
            ("preemptions_total", "counter", "requests preempted (freed, to be recomputed)", m["preemptions"]),
            ("generated_tokens_total", "counter", "tokens generated", m["generated_tokens"]),
            ("prefill_tokens_total", "counter", "prompt tokens run (recomputation included)", m["prefill_tokens"]),
            ("tokens_per_second", "gauge", "generated tokens per second over the last 10 s", m["tokens_per_second"]),
            ("slots_used", "gauge", "slots holding a sequence", m["slots_used"]),
            ("slots_total", "gauge", "slots in the pool", m["slots_total"]),
            ("cache_blocks_used", "gauge", "KV / latent blocks in use", m["blocks_used"]),
            ("cache_blocks_total", "gauge", "KV / latent blocks in the pool", m["blocks_total"]),
            ("cache_pool_bytes", "gauge", "bytes of the slot pool (blocks + recurrent states)", m["pool_bytes"]),
            ("cache_pool_peak_used_bytes", "gauge", "peak bytes of the pool in use (blocks held + all slots' states)",
             m["pool_peak_used_bytes"]),
            ("peak_memory_bytes", "gauge", "peak device memory (CUDA) or resident set (CPU)", m["peak_memory_bytes"])]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP evict_{name} {help_}", f"# TYPE evict_{name} {kind}", f"evict_{name} {value}"]
    return "\n".join(out) + "\n"


class ServerThread:
    """uvicorn serving `app` on host:port in a background thread (tests, the in-process load test)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                                    timeout_keep_alive=KEEP_ALIVE_S))
        self.thread = threading.Thread(target=self.server.run, name="evict-http", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise OSError("serve: the HTTP server did not start (is the port free?)")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
