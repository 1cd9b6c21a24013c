"""OpenAI-compatible HTTP front of the engine (FastAPI + uvicorn).

    POST /v1/completions   prompt (text or token ids), max_tokens, temperature (0 = greedy), top_p, top_k, seed, stop,
                           stream (server-sent `data:` events ending with `data: [DONE]`); extension: return_token_ids
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"}
    GET  /metrics          Prometheus text: running / waiting requests, tokens/s, slot and cache-pool use, peak memory
A bad request gets a 4xx JSON error in OpenAI's shape ({"error": {"message", "type", "param"}}); a client that
disconnects (streaming or not) has its request cancelled, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from evict.serve.engine import Engine, SamplingParams
from evict.serve.text import TextStream


class BadRequest(ValueError):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}")
        self.param, self.status = param, status


def _field(body: dict, name: str, kinds: tuple, default, ok=lambda v: True, want: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds) or not ok(value):
        raise BadRequest(name, f"expected {want}, got {json.dumps(value)[:80]}")
    return value


def parse_request(body, tokenizer, model_name: str) -> tuple[list[int], SamplingParams, dict]:
    """The completion request's JSON -> (prompt ids, sampling params, options); BadRequest names the bad field."""
    if not isinstance(body, dict):
        raise BadRequest("body", "expected a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest("model", f"this server serves {model_name!r}, got {str(model)[:80]!r}", status=404)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "expected a non-empty string or list of token ids")
        try:
            ids = [int(t) for t in tokenizer.encode(prompt)]
        except ValueError as e:
            raise BadRequest("prompt", str(e)) from None
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = prompt
    else:
        raise BadRequest("prompt", "expected a non-empty string or list of token ids (one prompt per request)")
    number = (int, float)
    params = SamplingParams(
        max_tokens=_field(body, "max_tokens", (int,), 16, lambda v: v >= 1, "a positive integer"),
        temperature=float(_field(body, "temperature", number, 1.0, lambda v: 0 <= v < float("inf"), "a number >= 0")),
        top_p=_field(body, "top_p", number, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=_field(body, "top_k", (int,), None, lambda v: v >= 1 or v == -1, "a positive integer (or -1: off)"),
        seed=_field(body, "seed", (int,), None, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)"))
    if params.top_k == -1:
        params = SamplingParams(**{**params.__dict__, "top_k": None})
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop", "expected a non-empty string or a list of at most 4 of them")
    for name, default in (("n", 1), ("best_of", 1)):
        _field(body, name, (int,), default, lambda v: v == 1, "1 (one choice per request)")
    if body.get("echo") or body.get("logprobs") is not None:
        raise BadRequest("echo" if body.get("echo") else "logprobs", "not supported by this server")
    opts = {"stream": _field(body, "stream", (bool,), False, want="true or false"), "stop": stop or [],
            "return_token_ids": _field(body, "return_token_ids", (bool,), False, want="true or false")}
    return ids, params, opts


def build_app(engine: Engine, tokenizer, model_name: str):
    app = FastAPI(title="evict serve")
    counter = iter(range(1, 1 << 62))

    def error(e: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if e.status == 400 else "not_found_error"
        return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": None}}, status_code=e.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "evict",
                                            "max_model_len": engine.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine.metrics()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("body", "expected a JSON object") from None
            ids, params, opts = parse_request(body, tokenizer, model_name)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[tuple] = asyncio.Queue()
            put = lambda *ev: loop.call_soon_threadsafe(events.put_nowait, ev)  # noqa: E731 (engine thread -> loop)
            req = engine.submit(ids, params, on_token=lambda r, t: put("token", t), on_finish=lambda r: put("finish", r.finish_reason))
        except BadRequest as e:
            return error(e)
        except ValueError as e:  # the engine's own check (sizes against the pool)
            msg = str(e)
            return error(BadRequest(msg.split(":", 1)[0], msg.split(": ", 1)[-1]))
        head = {"id": f"cmpl-{next(counter)}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        text = TextStream(tokenizer, opts["stop"])

        def usage() -> dict:  # the tokens this reply carries (the engine may have run a step past a stop text)
            n = len(text.ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def on_event(kind: str, value) -> tuple[str, list[int], str | None]:
            """An engine event -> (text piece, new ids, finish reason or None); a stop text cancels the request."""
            if kind == "finish":
                return text.flush(), [], value
            piece, stopped = text.feed(value)
            if stopped:
                engine.cancel(req)
                return piece, [value], "stop"
            return piece, [value], None

        def choice(piece: str, new_ids: list[int], reason) -> dict:
            c = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            if opts["return_token_ids"]:
                c["token_ids"] = new_ids
            return c

        if opts["stream"]:
            async def sse():
                try:
                    reason = None
                    while reason is None:
                        piece, new_ids, reason = on_event(*await events.get())
                        chunk = {**head, "choices": [choice(piece, new_ids, reason)]}
                        if reason is not None:
                            chunk["usage"] = usage()
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # also when the client went away (the generator is closed or cancelled)
                    if req.finish_reason is None:
                        engine.cancel(req)

            return StreamingResponse(sse(), media_type="text/event-stream")
        async def watch() -> None:  # the request's body is read: the next ASGI message is the client hanging up
            while (await request.receive())["type"] != "http.disconnect":
                pass
            engine.cancel(req)

        watcher = asyncio.create_task(watch())
        pieces, all_ids, reason = [], [], None
        try:
            while reason is None:
                piece, new_ids, reason = on_event(*await events.get())
                pieces.append(piece)
                all_ids += new_ids
        finally:  # also when the handler itself is cancelled
            watcher.cancel()
            if req.finish_reason is None and reason is None:
                engine.cancel(req)
        if reason == "cancelled":
            return None  # the client is gone
        return {**head, "choices": [choice("".join(pieces), all_ids, reason)], "usage": usage()}

    return app


def prometheus(m: dict) -> str:
    """Prometheus text exposition of the engine's metrics."""
    rows = [("requests_running", "gauge", "requests holding a slot", m["running"]),
            ("requests_waiting", "gauge", "requests queued (new or preempted)", m["waiting"]),
            ("requests_total", "counter", "requests received", m["requests"]),
            ("requests_finished_total", "counter", "requests finished (stop, length or cancelled)", m["finished"]),
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

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
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
