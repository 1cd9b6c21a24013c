"""The HTTP server on a free port, through a real HTTP client: 64+ concurrent requests (streaming and not),
completeness and equality with `generate`, malformed requests, disconnects, metrics; `evict bench serve` end to end."""

import asyncio
import json
import random
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from evict.models import LM, presets  # noqa: E402
from evict.serve.engine import Engine, arena_bytes  # noqa: E402
from evict.serve.server import ServerThread, build_app  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def served(request):
    """A 2-layer K/M hybrid (random init, float32) behind the server: 8 slots, a pool of 20 blocks of 8 tokens, so
    64 requests of up to 40 + 12 tokens run out of blocks (preemption) while the server answers; the engine with and
    without async steps."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LM(presets.get("kimi_linear", n_layers=2, init_std=0.2)).eval()
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, 8, 8))
    engine = Engine(model, max_batch=8, cache_budget=8 * per_slot + 20 * 8 * per_token, block_size=8, prefill_chunk=16,
                    async_steps=request.param)
    engine.start()
    with ServerThread(build_app(engine, ByteTokenizer(), "tiny-hybrid")) as url:
        yield url, model, engine
    engine.stop()
    torch.set_num_threads(n)


def alone(model, prompt, n) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0, prefill_chunk=16)[0, len(prompt):].tolist()


async def complete(client, url, body) -> dict:
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    ids, text, reason, usage, done = [], "", None, None, False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            usage = event.get("usage", usage)
            for c in event["choices"]:
                ids += c.get("token_ids", [])
                text += c["text"]
                reason = c["finish_reason"] or reason
    assert done
    return {"choices": [{"text": text, "token_ids": ids, "finish_reason": reason}], "usage": usage}


def wait_idle(url, engine, timeout=20.0):
    t0 = time.time()
    while engine.running or engine.waiting or not engine.inbox.empty():
        assert time.time() - t0 < timeout, "the engine did not free the slots"
        time.sleep(0.05)
    m = httpx.get(f"{url}/metrics").text
    assert "evict_slots_used 0" in m and "evict_cache_blocks_used 0" in m and "evict_requests_running 0" in m


def test_64_concurrent_requests_complete_and_equal_generate(served):
    url, model, engine = served
    rng = random.Random(3)
    jobs = [([rng.randrange(256) for _ in range(rng.randint(1, 40))], rng.randint(1, 12)) for _ in range(64)]

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=80)) as client:
            bodies = [{"model": "tiny-hybrid", "prompt": p, "max_tokens": n, "temperature": 0, "return_token_ids": True,
                       "stream": i % 2 == 0, **({"stream_options": {"include_usage": True}} if i % 2 == 0 else {})} for i, (p, n) in enumerate(jobs)]
            return await asyncio.gather(*(complete(client, url, b) for b in bodies))

    before = engine.stats["preemptions"]
    results = asyncio.run(main())
    tok = ByteTokenizer()
    for (p, n), res in zip(jobs, results):
        c = res["choices"][0]
        assert c["finish_reason"] == "length" and res["usage"]["completion_tokens"] == n
        assert res["usage"]["prompt_tokens"] == len(p)
        assert c["token_ids"] == alone(model, p, n)
        assert c["text"] == tok.decode(c["token_ids"])
    assert engine.stats["preemptions"] > before  # the pool was full at times
    wait_idle(url, engine)


def test_text_prompt_stop_and_sampling(served):
    url, model, engine = served
    full = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 0}).json()
    want = ByteTokenizer().decode(alone(model, list(b"hello"), 12))
    assert full["choices"][0]["text"] == want and full["object"] == "text_completion"
    stop = want[3:5]
    cut = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == want[: want.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
    body = {"prompt": "hello", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 5, "return_token_ids": True}
    a, b = (httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2))
    assert a == b and len(a) == 8
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "engine": "running"}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-hybrid"
    wait_idle(url, engine)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, "body"), (b"[1, 2]", 400, "body"), ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"), ({"prompt": [1, 256]}, 400, "prompt"), ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"), ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "top_k": 0}, 400, "top_k"), ({"prompt": "hi", "seed": -3}, 400, "seed"),
    ({"prompt": "hi", "stop": [1]}, 400, "stop"), ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"), ({"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"3": 200}}, 400, "logit_bias"), ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "echo": True, "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"), ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"), (b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature"),
    ({"prompt": "hi", "stop_token_ids": [999]}, 400, "stop_token_ids"), (b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"), ({"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(served, body, status, param):
    url, model, engine = served
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/completions", **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}:") and "\n" not in err["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_disconnects_free_their_slots(served):
    url, model, engine = served
    cancelled = engine.stats["cancelled"]
    with httpx.Client(timeout=30) as client:  # streaming: read one event, then hang up
        with client.stream("POST", f"{url}/v1/completions", json={"prompt": [3] * 10, "max_tokens": 150, "stream": True,
                                                                  "temperature": 0}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up before the answer
        httpx.post(f"{url}/v1/completions", json={"prompt": [4] * 10, "max_tokens": 150, "temperature": 0}, timeout=0.1)
    wait_idle(url, engine)
    assert engine.stats["finished"] == engine.stats["requests"] and engine.stats["cancelled"] == cancelled + 2


def test_metrics_are_prometheus_text(served):
    url, _, _ = served
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {line.split()[0] for line in r.text.splitlines() if line and not line.startswith("#")}
    for name in ("requests_running", "requests_waiting", "tokens_per_second", "slots_used", "slots_total",
                 "cache_blocks_used", "cache_blocks_total", "cache_pool_bytes", "preemptions_total", "peak_memory_bytes"):
        assert f"evict_{name}" in names
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            float(line.split()[1])


def test_mailbox_delivers_every_event_in_order_from_another_thread():
    """The engine thread's events (3 streams, 2,000 each, posted in bursts) all reach their queues on the loop, each
    queue in posting order, through fewer wake-ups of the loop than events."""
    from evict.serve.server import Mailbox

    async def main():
        loop = asyncio.get_running_loop()
        box, queues = Mailbox(loop), [asyncio.Queue() for _ in range(3)]
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counted(*a):
            nonlocal wakeups
            wakeups += 1
            return real(*a)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def engine():
            for i in range(2000):
                for q in queues:
                    box.put(q, (i,))

        worker = threading.Thread(target=engine)
        worker.start()
        got = [[(await q.get())[0] for _ in range(2000)] for q in queues]
        worker.join()
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [list(range(2000))] * 3
    assert 1 <= wakeups < 6000
