"""Load: 1,000 requests at 48 at a time: greedy ones (streaming and not, n 1 or 2) checked token
for token against `generate`, sampled ones with penalties / min_p / logprobs, malformed bodies, clients that hang up
mid-stream or before the answer (over a real socket; the rest through httpx's ASGI transport, which on this 2-core
machine costs an eighth of a socket's time per request), and one request whose sampling fails; with and without the
engine's async steps. Every valid request is answered correctly, the
failing one gets a 500 and nothing else fails, and afterwards /metrics shows no slot and no block in use."""

import asyncio
import json
import random
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from evict.models import LM, presets  # noqa: E402
from evict.serve.engine import Engine, arena_bytes  # noqa: E402
from evict.serve.server import ServerThread, build_app  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402
from tests.serve.conftest import FAILING_TEMPERATURE  # noqa: E402

BAD = [b"{oops", b"[]", b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "temprature": 1}',
       b'{"prompt": [1, 999]}', b'{"prompt": "x", "n": 99}', b'{"prompt": "x", "logit_bias": {"q": 1}}',
       b'{"messages": []}', b'{"prompt": "x", "stop": [1]}', b"[" * 50_000, b'{"prompt": "x", "max_tokens": 1000000}']


@pytest.mark.parametrize("async_steps", [False, True])
def test_1000_requests_with_disconnects_malformed_bodies_and_a_failing_sampler(flaky_sampler, async_steps):
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LM(presets.get("attention", n_layers=1, d_model=32, n_heads=2, init_std=0.2)).eval()  # the cheapest step
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, 8, 8))
    engine = Engine(model, max_batch=16, cache_budget=16 * per_slot + 40 * 8 * per_token, block_size=8, prefill_chunk=16,
                    async_steps=async_steps)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 14))] for _ in range(12)]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=4, temperature=0, prefill_chunk=16)[0, len(p):].tolist()
            for p in prompts]
    kinds = ["greedy"] * 690 + ["sampled"] * 100 + ["bad"] * 110 + ["hangup"] * 99 + ["fail"]
    rng.shuffle(kinds)
    engine.start()
    try:
        app = build_app(engine, ByteTokenizer(), "load")
        with ServerThread(app) as url:
            t0 = time.perf_counter()
            problems = asyncio.run(drive(app, url, kinds, prompts, refs, rng))
            elapsed = time.perf_counter() - t0
            assert problems == [], problems[:5]
            deadline = time.time() + 20
            while engine.running or engine.waiting or not engine.inbox.empty():
                assert time.time() < deadline, "the engine did not free its slots"
                time.sleep(0.05)
            m = httpx.get(f"{url}/metrics").text
            assert "evict_slots_used 0" in m and "evict_cache_blocks_used 0" in m and "evict_requests_running 0" in m
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        engine.stop()
        torch.set_num_threads(n_threads)
    assert engine.stats["finished"] == engine.stats["requests"] and engine.stats["cancelled"] >= 10
    assert elapsed < 120


async def drive(app, url, kinds, prompts, refs, rng) -> list:
    problems: list = []
    gate = asyncio.Semaphore(48)
    socket = httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64))
    asgi = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://asgi", timeout=60)
    async with socket, asgi:
        async def one(i: int, kind: str):
            k = rng.randrange(len(prompts))
            n_tok, stream, n = rng.randint(1, 4), rng.random() < 0.5, 1 + (rng.random() < 0.2)
            async with gate:
                try:
                    await request(socket if kind == "hangup" else asgi, kind, prompts[k], refs[k], n_tok, stream, n, rng.choice(BAD), problems, i)
                except Exception as e:  # noqa: BLE001 (any client-side surprise is a failure of the test)
                    problems.append((i, kind, repr(e)))

        await asyncio.gather(*(one(i, kind) for i, kind in enumerate(kinds)))
    return problems


async def request(client, kind, prompt, ref, n_tok, stream, n, bad, problems, i):
    body = {"prompt": prompt, "max_tokens": n_tok, "temperature": 0, "n": n, "return_token_ids": True, "stream": stream}
    if kind == "bad":
        path = "/v1/chat/completions" if b"messages" in bad else "/v1/completions"
        r = await client.post(path, content=bad, headers={"content-type": "application/json"})
        if not (400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}):
            problems.append((i, kind, r.status_code, r.text[:200]))
        return
    if kind == "hangup":
        body["max_tokens"] = 64  # long enough to be running when the client hangs up
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
        else:
            try:
                await client.post("/v1/completions", json=body, timeout=0.02)
            except httpx.TimeoutException:
                pass
        return
    if kind == "fail":
        body.update(temperature=FAILING_TEMPERATURE, stream=False, n=1)
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 500 or "injected sampler failure" not in r.json()["error"]["message"]:
            problems.append((i, kind, r.status_code, r.text[:200]))
        return
    if kind == "sampled":
        body.update(temperature=0.8, seed=i, top_k=50, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2,
                    logprobs=2, stream=False)
    choices = await answer(client, body)
    if len(choices) != n:
        problems.append((i, kind, "choices", choices))
    for c in choices:
        ids = c["token_ids"]
        ok = c["finish_reason"] == "length" and len(ids) == n_tok
        if kind == "greedy":
            ok = ok and ids == ref[:n_tok] and c["text"] == ByteTokenizer().decode(ids)
        else:
            ok = ok and len(c["logprobs"]["token_logprobs"]) == n_tok
        if not ok:
            problems.append((i, kind, body, c))


async def answer(client, body) -> list[dict]:
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"]
    out = [{"token_ids": [], "text": "", "finish_reason": None} for _ in range(body["n"])]
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    o = out[c["index"]]
                    o["token_ids"] += c["token_ids"]
                    o["text"] += c["text"]
                    o["finish_reason"] = c["finish_reason"] or o["finish_reason"]
    return out
