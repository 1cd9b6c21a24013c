"""`evict serve` and `evict bench serve` from the command line: one command starts a server from a model folder,
loads it, and checks completeness and equality; bad flags are one line, exit 2."""

import json

import pytest
import torch

pytest.importorskip("httpx")

from evict.cli import main  # noqa: E402
from evict.models import LM, presets  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("run") / "model"
    LM(presets.get("kimi_linear", n_layers=2, init_std=0.2)).save(folder)
    ByteTokenizer().save(folder / "tokenizer.json")
    return folder.parent


def test_bench_serve_starts_its_server_and_checks(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    main(["bench", "serve", "--model", str(model_dir), "--requests", "12", "--clients", "6", "--rate", "200",
          "--prompt-len", "2", "30", "--output-len", "2", "8", "--check", "3", "--max-batch", "4", "--block-size", "8",
          "--cache-budget", "2M", "--threads", "1", "--out", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 0 and s["complete"] == "12/12" and s["equal_alone"] == "3/3"
    assert s["ttft_p50_s"] > 0 and s["output_tokens_per_s"] > 0 and s["peak_memory_gib"] > 0
    assert 0 < s["client_busy"] < 4  # the bench process's CPU seconds per wall second over the load (the server's its own)
    assert "| model |" in capsys.readouterr().out


def test_bench_serve_from_two_client_processes(model_dir, tmp_path):
    """--client-procs 2: the timed requests from two processes, every one answered and counted, in job order."""
    out = tmp_path / "procs.json"
    main(["bench", "serve", "--spawn", "thread", "--client-procs", "2", "--model", str(model_dir), "--requests", "9",
          "--clients", "4", "--prompt-len", "2", "30", "--output-len", "2", "8", "--check", "3", "--max-batch", "4",
          "--block-size", "8", "--cache-budget", "2M", "--threads", "1", "--warmup", "1", "--out", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert s["requests"] == 9 and s["errors"] == 0 and s["complete"] == "9/9" and s["equal_alone"] == "3/3"
    assert 0 < s["client_busy"] < 4  # the busier client process's (the server is a thread of the bench here)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_bench_serve_in_process_runs_the_same_load_with_no_http(model_dir, tmp_path, capsys, monkeypatch, async_scheduling):
    """--spawn engine: the load straight into an engine here, completeness and equality checked as through HTTP;
    with --async-scheduling on, that engine runs async steps."""
    from evict.serve import load

    built = []
    real = load.build_engine
    monkeypatch.setattr(load, "build_engine", lambda args: built.append(real(args)) or built[-1])
    out = tmp_path / "engine.json"
    main(["bench", "serve", "--spawn", "engine", "--model", str(model_dir), "--requests", "12", "--clients", "6",
          "--rate", "200", "--prompt-len", "2", "30", "--output-len", "2", "8", "--check", "3", "--max-batch", "4",
          "--block-size", "8", "--cache-budget", "2M", "--threads", "1", "--warmup", "2", "--async-scheduling",
          async_scheduling, "--out", str(out)])
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 0 and s["complete"] == "12/12" and s["equal_alone"] == "3/3"
    assert 0 < s["ttft_p50_s"] < s["wall_s"] and s["tpot_p50_s"] > 0 and s["output_tokens_per_s"] > 0
    assert "(in process, no HTTP)" in capsys.readouterr().out
    assert built[0][0].depth == (async_scheduling == "on")


def test_bench_passes_async_scheduling_to_its_server():
    import argparse

    from evict.bench.serve import add_arguments, server_argv

    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--device", default="cpu")
    for flag in ("on", "off"):
        argv = server_argv(p.parse_args(["--preset", "attention", "--async-scheduling", flag]), 8000)
        assert argv[argv.index("--async-scheduling") + 1] == flag
    assert "--async-scheduling" not in server_argv(p.parse_args(["--preset", "attention"]), 8000)
    argv = server_argv(p.parse_args(["--preset", "attention", "--stream-interval", "4"]), 8000)
    assert argv[argv.index("--stream-interval") + 1] == "4"
    assert "--stream-interval" not in server_argv(p.parse_args(["--preset", "attention"]), 8000)


def test_served_text_equals_evict_generate(model_dir, capsys):
    """`evict serve --model DIR`'s engine and app answer a text prompt with `evict generate --temperature 0`'s text."""
    import httpx

    from evict.cli import build_parser
    from evict.serve.load import build_engine
    from evict.serve.server import ServerThread, build_app

    main(["generate", "--model", str(model_dir), "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "20",
          "--threads", "1"])
    want = capsys.readouterr().out.split("\n\n[prefill")[0].removeprefix("To be")
    engine, tok, name = build_engine(build_parser().parse_args(["serve", "--model", str(model_dir), "--threads", "1"]))
    engine.start()
    try:
        with ServerThread(build_app(engine, tok, name)) as url:
            got = httpx.post(f"{url}/v1/completions", json={"prompt": "To be", "max_tokens": 20, "temperature": 0}).json()
    finally:
        engine.stop()
    assert got["choices"][0]["text"] == want and got["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize("argv, flag", [
    (["serve"], "--model"), (["serve", "--model", "/nonexistent/run"], "--model"),
    (["serve", "--preset", "attention", "--cache-budget", "12X"], "--cache-budget"),
    (["serve", "--preset", "attention", "--cache-budget", "1K"], "--cache-budget"),
    (["serve", "--preset", "attention", "--set", "vocab_size=300"], "--set"),
    (["serve", "--preset", "attention", "--max-len", "999999999"], "--max-len"),
    (["bench", "serve"], "--url"),
    (["serve", "--preset", "attention", "--cuda-graphs", "on"], "--cuda-graphs"),  # a CPU device
    (["serve", "--preset", "attention", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),  # < max batch
    (["serve", "--preset", "attention", "--priority", "fifo"], "--priority"),
    (["serve", "--preset", "attention", "--async-scheduling", "yes"], "--async-scheduling"),
    (["serve", "--preset", "attention", "--port", "70000"], "--port"), (["serve", "--preset", "attention", "--port", "0"], "--port"),
    (["serve", "--preset", "attention", "--host", "999.1.1.1"], "--host"),
    (["serve", "--preset", "attention", "--log-level", "loud"], "--log-level"),
    (["serve", "--preset", "attention", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--preset", "attention", "--timeout-keep-alive", "0.5"], "--timeout-keep-alive"),
    (["serve", "--preset", "attention", "--stream-interval", "0"], "--stream-interval"),
    (["serve", "--preset", "attention", "--port", "8", "--chat-template", "/nonexistent.jinja"], "--chat-template"),
])
def test_bad_flags_are_one_line_exit_2(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err


def test_a_port_in_use_is_one_line_exit_2_and_never_serving(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--preset", "attention", "--port", str(port)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and "serving" not in out
    assert len(err.strip().splitlines()) == 1 and "--port" in err and "in use" in err


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_sigterm_fails_the_requests_in_flight_and_exits(model_dir, tmp_path, engine_process):
    """A recurrent model asked for 1,000,000 tokens: SIGTERM answers that request with a 503 and the process exits
    (with --engine-process on, its engine's child process too)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "EVICT_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "evict", "serve", "--preset", "deltanet", "--set", "n_layers=1",
                             "d_model=32", "--threads", "1", "--port", str(port), "--served-model-name", "dn",
                             "--chat-template", str(template), "--shutdown-timeout", "3", "--access-log", "--log-level", "info",
                             "--engine-process", engine_process],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving dn on http://127.0.0.1:{port}"), (line, proc.stderr.read() if proc.poll() else "")
        url, auth = f"http://127.0.0.1:{port}", {"authorization": "Bearer k"}
        chat = httpx.post(f"{url}/v1/chat/completions", headers=auth, json={"model": "dn", "max_tokens": 3,
                          "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 2  # the template: content only
        result = {}

        def ask():
            result["r"] = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60,
                                     json={"prompt": "hi", "max_tokens": 1_000_000})

        t = threading.Thread(target=ask)
        t.start()
        while "evict_requests_running 1" not in httpx.get(f"{url}/metrics").text:
            time.sleep(0.05)
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(kids) >= (engine_process == "on")  # the engine's process (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGTERM)
        t.join(20)
        assert result["r"].status_code == 503 and "shutting down" in result["r"].json()["error"]["message"]
        assert proc.wait(timeout=20) == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
        def running(pid: str) -> bool:  # not gone, not a zombie for its new parent to reap
            try:
                with open(f"/proc/{pid}/status") as f:
                    return "zombie" not in f.read()
            except FileNotFoundError:
                return False

        t0 = time.time()  # no process left behind
        while left := [k for k in kids if running(k)]:
            assert time.time() - t0 < 10, left
            time.sleep(0.1)
        assert "Traceback" not in proc.stderr.read()
        assert '"POST /v1/chat/completions HTTP/1.1" 200' in proc.stdout.read()  # uvicorn's access log
    finally:
        proc.kill()
        proc.wait()


def test_bench_serve_against_no_server_is_one_line(capsys):
    """--url where nothing listens: one line naming the failed connection, not httpx's traceback."""
    from evict.bench.serve import free_port

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--requests", "2"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "bench serve: a request failed:" in err and "ConnectError" in err


def test_a_dropped_connection_is_that_request_s_error():
    """A server that closes the connection before answering (what a request meets on a connection the server is
    closing, or a dead server): that request's error, counted in the row, the load goes on."""
    import asyncio
    import socket
    import threading

    import httpx

    from evict.bench.serve import one_request

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def accept_and_close():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.close()

    threading.Thread(target=accept_and_close, daemon=True).start()

    async def go():
        async with httpx.AsyncClient(timeout=10) as client:
            return await one_request(client, f"http://127.0.0.1:{srv.getsockname()[1]}", "m", [1, 2], 4, 0.0, None)

    r = asyncio.run(go())
    srv.close()
    # closed with the body still unread, the close may go out as a reset: ReadError instead of RemoteProtocolError
    assert r["prompt"] == [1, 2] and r["error"].split(":")[:2] in (["connection", " RemoteProtocolError"],
                                                                   ["connection", " ReadError"])


def test_the_server_keeps_idle_connections_past_a_clients_5_s():
    """A keep-alive connection idle for 5.5 s still answers: clients (httpx, the openai client) drop idle connections
    after 5 s, so the server closing first (uvicorn's default, 5 s) races their next request on it."""
    import socket
    import time

    from fastapi import FastAPI

    from evict.serve.server import ServerThread

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    with ServerThread(app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            for i in range(2):
                if i:
                    time.sleep(5.5)
                s.sendall(f"GET /ping HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                reply = s.recv(65536)
                assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"ok":true}'), (i, reply)


def test_serve_passes_its_keep_alive_to_uvicorn(monkeypatch):
    """`evict serve`'s --timeout-keep-alive (default 65 s) is uvicorn's timeout_keep_alive; the heap is frozen (out of
    the cyclic GC's reach) before uvicorn runs."""
    import argparse
    import gc

    import uvicorn

    from evict.serve import launch

    seen = []

    def run(self, sockets=None):
        seen.append(self.config.timeout_keep_alive)
        frozen.append(gc.get_freeze_count())
        gc.unfreeze()  # not this test process's heap for the rest of the session

    frozen: list[int] = []
    monkeypatch.setattr(uvicorn.Server, "run", run)

    class Engine:
        def stop(self, timeout=None):
            pass

    p = argparse.ArgumentParser()
    launch.add_http_flags(p)
    for argv, want in (([], 65), (["--timeout-keep-alive", "12"], 12)):
        launch.serve_forever(object(), Engine(), launch.bind("127.0.0.1", 0), p.parse_args(argv))
        assert seen[-1] == want and frozen[-1] > 10_000


@pytest.mark.parametrize("cpus, procs", [(None, 1), (2, 1), (8, 2), (16, 4), (128, 4)])
def test_client_processes_default_to_a_quarter_of_the_cpus(monkeypatch, cpus, procs):
    from evict.bench import serve

    monkeypatch.setattr(serve.os, "cpu_count", lambda: cpus)
    assert serve.default_client_procs() == procs


def test_a_busy_client_is_said_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """A client process busy past BUSY of the load gets a line naming --client-procs; the JSON records the flags the
    row ran with (the default resolved) and how busy the client was."""
    from evict.bench import serve

    monkeypatch.setattr(serve, "BUSY", 0.0)
    out = tmp_path / "busy.json"
    main(["bench", "serve", "--model", str(model_dir), "--requests", "4", "--clients", "4", "--prompt-len", "2", "8",
          "--output-len", "2", "4", "--check", "0", "--max-batch", "4", "--block-size", "8", "--cache-budget", "2M",
          "--threads", "1", "--warmup", "0", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if "client process was busy" in line]
    d = json.loads(out.read_text())
    assert len(err) == 1 and f"--client-procs {d['flags']['client_procs']}" in err[0]
    assert d["flags"]["client_procs"] == serve.default_client_procs() and d["summary"]["client_busy"] > 0


def test_the_bench_clients_send_at_most_n_at_once_each_client_one_request_at_a_time(monkeypatch):
    """Clients(3): 8 requests, at most 3 in flight, never two on one client (one connection each), every result
    back to its caller, the waiting ones served in arrival order."""
    import asyncio

    from evict.bench import serve

    busy: set = set()
    peak, order = [0], []

    async def fake(client, url, model, prompt, max_tokens, temperature, seed):
        assert client not in busy
        busy.add(client)
        peak[0] = max(peak[0], len(busy))
        order.append(prompt[0])
        await asyncio.sleep(0.01 * (1 + prompt[0] % 3))
        busy.discard(client)
        return {"prompt": prompt}

    monkeypatch.setattr(serve, "one_request", fake)

    async def go():
        async with serve.Clients(3) as clients:
            assert len({id(c) for c in clients.all}) == 3
            return await asyncio.gather(*(clients.send("u", "m", [i], 2, 0.0) for i in range(8)))

    got = asyncio.run(go())
    assert [r["prompt"] for r in got] == [[i] for i in range(8)]
    assert peak[0] == 3 and order == list(range(8))


def test_a_frozen_heap_is_out_of_the_collectors_reach_until_the_load_ends():
    import gc

    from evict.serve.launch import frozen_heap

    before = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() > max(before, 10_000)
    assert gc.get_freeze_count() == 0
