"""`--engine-process on`: the engine in a spawned child process behind the same server, driven by the official
`openai` client: answers equal the in-thread engine's (greedy, seeded sampling, n, logprobs, echo with the prompt's
logprobs, chat) and `generate`'s; a client's hang-up frees its slot; a failing sampler fails its request alone; a
killed child fails what is in flight and /health says not running; stop fails what is in flight and the child exits,
killed at the deadline if its step hangs."""

import argparse
import os
import signal
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from evict.serve.load import add_engine_flags, build_engine, load_served  # noqa: E402
from evict.serve.remote import EngineClient  # noqa: E402
from evict.serve.server import ServerThread, build_app  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402
from tests.serve.conftest import die_in_step, failing_requests_fail_alone, hang_steps, install_flaky_sampler  # noqa: E402

NAME = "tiny"
FLAGS = ["--preset", "kimi_linear", "--set", "n_layers=2", "init_std=0.2", "--max-batch", "8", "--cache-budget", "8M",
         "--block-size", "8", "--prefill-chunk", "16", "--max-len", "256", "--threads", "1"]
SMALL = ["--preset", "deltanet", "--set", "n_layers=1", "d_model=64", "--max-batch", "2", "--cache-budget", "2M",
         "--threads", "1"]  # recurrent: a long generation fits


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return p.parse_args(argv)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def servers():
    """(remote URL, in-thread URL, the model, the remote engine): the same preset and seed served by an engine in a
    child process (its sampler failing FAILING_TEMPERATURE's requests) and by one in this process's thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    remote = EngineClient(parse(FLAGS + ["--engine-process", "on"]), build=build_engine, prepare=install_flaky_sampler)
    local, _, _ = build_engine(parse(FLAGS))
    model, _, _ = load_served(parse(FLAGS), torch.device("cpu"))
    remote.start()
    local.start()
    try:
        with ServerThread(build_app(remote, ByteTokenizer(), NAME)) as r_url, \
                ServerThread(build_app(local, ByteTokenizer(), NAME)) as l_url:
            yield r_url, l_url, model, remote
    finally:
        remote.stop(10)
        local.stop()
        torch.set_num_threads(n)


def alone(model, prompt, n) -> list[int]:
    device = model.embed.weight.device  # the prompt on the model's device (the CUDA test's model is on the card)
    return model.generate(torch.tensor([prompt], device=device), max_new_tokens=n, temperature=0, prefill_chunk=16)[0, len(prompt):].tolist()


def answer(r) -> list:
    """A response's choices (and usage) without its id and time."""
    d = r.model_dump() if not isinstance(r, list) else [x.model_dump() for x in r]
    for x in d if isinstance(d, list) else [d]:
        x.pop("id", None), x.pop("created", None)
    return d


def same(a, b, path="") -> None:
    """a == b, a log-probability to 1e-4 (a step's batch differs between the two engines: its float32 sums too, ~1e-5)."""
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4), path
    elif isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_answers_equal_the_in_thread_engine_and_generate(servers):
    r_url, l_url, model, _ = servers
    want = ByteTokenizer().decode(alone(model, list(b"To be"), 12))
    calls = [dict(prompt="To be", max_tokens=12, temperature=0),
             dict(prompt="To be", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}),
             dict(prompt="abc", max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=3, extra_body={"return_token_ids": True}),
             dict(prompt="To be, or not to be, that is the question", max_tokens=5, temperature=0, echo=True, logprobs=3),
             dict(prompt="To be, or not", max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True),
             dict(prompt=list("naïve".encode()), max_tokens=0, echo=True, logprobs=2, n=2)]
    chats = [dict(messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0),
             dict(messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True),
             dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)]
    got = {}
    for url in (r_url, l_url):
        c = client(url)
        got[url] = [answer(c.completions.create(model=NAME, **kw) if not kw.get("stream")
                           else list(c.completions.create(model=NAME, **kw))) for kw in calls]
        got[url] += [answer(c.chat.completions.create(model=NAME, **kw) if not kw.get("stream")
                            else list(c.chat.completions.create(model=NAME, **kw))) for kw in chats]
    same(got[r_url], got[l_url])
    first = got[r_url][0]["choices"][0]
    assert first["text"] == want and first["finish_reason"] == "length"
    ids = [ch["token_ids"] for ch in got[r_url][2]["choices"]]
    assert len({tuple(x) for x in ids}) > 1 and all(len(x) == 6 for x in ids)  # seeded choices differ
    echo = got[r_url][3]["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None and len(echo["tokens"]) == 41 + 5  # the prompt's logprobs came back


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def test_a_hang_up_frees_its_slot(servers):
    r_url, _, _, remote = servers
    with httpx.Client(timeout=30) as c:  # streaming: read one event, then hang up
        with c.stream("POST", f"{r_url}/v1/completions", json={"prompt": [3] * 10, "max_tokens": 150, "stream": True,
                                                                "temperature": 0}) as r:
            assert next(r.iter_lines()).startswith("data: ")
    t0 = time.time()
    while "evict_slots_used 0" not in (m := metrics(r_url)) or "evict_cache_blocks_used 0" not in m:
        assert time.time() - t0 < 20, "the child did not free the slot"
        time.sleep(0.05)
    assert "evict_requests_cancelled_total 1" in m and remote.metrics()["running"] == 0


def test_a_failing_sampler_fails_only_its_request(servers):
    r_url, _, model, remote = servers
    c = client(r_url)
    failing_requests_fail_alone(c, NAME, alone(model, list(b"hi"), 4))
    assert httpx.get(f"{r_url}/health").json()["status"] == "ok" and remote.alive
    with pytest.raises(openai.BadRequestError) as e:  # checked at the client's door, as the Engine's
        c.completions.create(model=NAME, prompt="hi", max_tokens=1000)
    assert e.value.body["param"] == "max_tokens"


def long_request(url: str, result: dict) -> threading.Thread:
    """A request of 100,000 tokens in a thread; its HTTP status lands in result["status"]."""

    def ask():
        try:
            client(url).completions.create(model=NAME, prompt="hi", max_tokens=100_000)
        except openai.APIStatusError as e:
            result["status"], result["message"] = e.status_code, e.body["message"]

    t = threading.Thread(target=ask)
    t.start()
    return t


def wait_running(remote: EngineClient) -> None:
    t0 = time.time()
    while remote.metrics()["running"] == 0:
        assert time.time() - t0 < 30, "the request never ran"
        time.sleep(0.05)


def test_a_killed_child_fails_what_is_in_flight_and_health_says_so():
    remote = EngineClient(parse(SMALL + ["--engine-process", "on"]), build=build_engine)
    remote.start()
    try:
        with ServerThread(build_app(remote, ByteTokenizer(), NAME)) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            result: dict = {}
            t = long_request(url, result)
            wait_running(remote)
            os.kill(remote.process.pid, signal.SIGKILL)
            t.join(30)
            assert not t.is_alive() and result["status"] == 503 and "died" in result["message"]
            h = httpx.get(f"{url}/health")
            assert h.status_code == 503 and h.json()["engine"] == "not running" and not remote.alive
            with pytest.raises(openai.APIStatusError) as e:  # later requests: refused at once
                client(url).completions.create(model=NAME, prompt="hi", max_tokens=4)
            assert e.value.status_code == 503
            assert httpx.get(f"{url}/metrics").json()["error"]["code"] == 500  # no engine to ask: a JSON error
    finally:
        remote.stop(5)
    assert remote.process.exitcode == -signal.SIGKILL


def test_a_dead_engine_thread_in_the_child_is_reported_and_requests_get_errors():
    remote = EngineClient(parse(SMALL + ["--engine-process", "on"]), build=build_engine, prepare=die_in_step)
    remote.start()
    try:
        with ServerThread(build_app(remote, ByteTokenizer(), NAME)) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            with pytest.raises(openai.APIStatusError) as e:  # in flight when the thread died: an error, not a hang
                client(url).completions.create(model=NAME, prompt="hi", max_tokens=4)
            assert e.value.status_code == 503
            t0 = time.time()
            while httpx.get(f"{url}/health").status_code != 503:  # the child's "down" follows the errors
                assert time.time() - t0 < 10, "/health still says ok"
                time.sleep(0.05)
            assert remote.process.is_alive() and not remote.alive  # the process lives, its engine does not
            with pytest.raises(openai.APIStatusError) as e:  # later requests: refused at once
                client(url).completions.create(model=NAME, prompt="hi", max_tokens=4)
            assert e.value.status_code == 503
    finally:
        remote.stop(5)
    assert remote.process.exitcode == 0


@pytest.mark.parametrize("hang", [False, True], ids=["stops", "killed-at-deadline"])
def test_stop_fails_what_is_in_flight_and_the_child_exits(hang, tmp_path, monkeypatch):
    marker = tmp_path / "hanging"  # the child's step has begun its hang (a fresh clone's CI, s63: "running" was
    monkeypatch.setenv("EVICT_TEST_HANG_MARKER", str(marker))  # reported, the stop came before the hanging step)
    remote = EngineClient(parse(SMALL + ["--engine-process", "on"]), build=build_engine,
                          prepare=hang_steps if hang else None)
    remote.start()
    try:
        with ServerThread(build_app(remote, ByteTokenizer(), NAME)) as url:
            result: dict = {}
            t = long_request(url, result)
            wait_running(remote)
            t_wait = time.time()
            while hang and not marker.exists():
                assert time.time() - t_wait < 30, "the step never hung"
                time.sleep(0.05)
            t0 = time.time()
            remote.stop(timeout=2)
            took = time.time() - t0
            t.join(30)
            assert not t.is_alive() and result["status"] == 503 and "shutting down" in result["message"]
            assert httpx.get(f"{url}/health").status_code == 503
    finally:
        remote.stop(5)
    assert not remote.process.is_alive() and took < 2 + 5 + 5  # the deadline, the kill's join, the reader's
    assert remote.process.exitcode == (-signal.SIGKILL if hang else 0)


def test_the_flag_reaches_the_benchs_server_and_bad_values_are_one_line(capsys):
    from evict.bench.serve import add_arguments, server_argv
    from evict.cli import main

    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--device", default="cpu")
    argv = server_argv(p.parse_args(["--preset", "attention", "--engine-process", "on"]), 8000)
    assert argv[argv.index("--engine-process") + 1] == "on"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--preset", "attention", "--engine-process", "yes"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine-process" in err


def test_a_child_that_cannot_build_its_engine_is_one_line():
    with pytest.raises(SystemExit) as e:
        EngineClient(parse(SMALL + ["--max-len", "100000000", "--engine-process", "on"]), build=build_engine)
    assert str(e.value.code).startswith("--max-len:") and "\n" not in str(e.value.code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_child_answers_equal_generate_float32():
    """On CUDA (CUDA graphs and async steps at their defaults, float32): greedy answers from an engine in a child
    process, several at once (packed prefill, batched decode) and streamed, equal `generate` alone on the same card."""
    flags = FLAGS[:FLAGS.index("--threads")] + ["--device", "cuda", "--dtype", "float32"]
    remote = EngineClient(parse(flags + ["--engine-process", "on"]), build=build_engine)
    model, _, _ = load_served(parse(flags), torch.device("cuda"))
    prompts = ["To be", "or not to be, that is", "the question: whether 'tis nobler", "x" * 40]
    remote.start()
    try:
        with ServerThread(build_app(remote, ByteTokenizer(), NAME)) as url:
            c = client(url)
            results: dict = {}

            def ask(i, p):
                results[i] = c.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0).choices[0].text

            threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
            [t.start() for t in threads]
            [t.join(120) for t in threads]
            stream = "".join(e.choices[0].text for e in c.completions.create(model=NAME, prompt=prompts[1], max_tokens=20,
                                                                              temperature=0, stream=True))
    finally:
        remote.stop(10)
    want = [ByteTokenizer().decode(alone(model, list(p.encode()), 20)) for p in prompts]
    assert [results.get(i) for i in range(len(prompts))] == want
    assert stream == want[1]
