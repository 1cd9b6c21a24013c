"""`evict bench serve`: a load test of `evict serve` through its HTTP API.

Requests arrive as a Poisson process (--rate per second; inf = all at once), at most --clients in flight; prompt and
output lengths are drawn uniformly from the given ranges; prompts are random token ids; every request is streamed and
greedy unless --temperature is given. Before the timed load, --warmup requests of the same lengths run at once (not
counted: first-use kernel compiles and plans land there; the server captures its CUDA graphs before it answers).
Reported: requests/s, output and total tokens/s, time to first token (TTFT) and time per output token after the first
(TPOT), p50 / p99, peak memory (the server's /metrics), preemptions, and two
checks: completeness (every request returned exactly max_tokens tokens, finish_reason "length") and equality (the
first --check greedy requests, replayed one at a time on the idle server, return the same tokens).

The server is --url, or started by the benchmark from --model / --preset and the engine flags: as a subprocess
(--spawn process, the default: its memory is its own) or in this process (--spawn thread). --spawn engine runs the
same load with no HTTP at all: the requests go straight to an engine in this process (its thread stepping, callbacks
timing the tokens), so its row beside an HTTP row is what the server and its clients cost. The client (httpx, one
event loop per process) parses every streamed event and can be the limit of an HTTP row: the timed requests go out
from --client-procs processes (default a quarter of the CPUs, 1 to 4), the row reports the busiest one's CPU seconds
per wall second (client_busy), and past 0.9 the bench says in one line that the client may have been the limit.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from evict.report import card, markdown_table, write_json
from evict.serve.launch import freeze_heap, frozen_heap


# the client drops idle connections well before a server closes them (ours keeps them 65 s, uvicorn's default is 5 s):
# otherwise a request may go out on a connection the server is closing ("Server disconnected without sending a response")
KEEPALIVE_S = 2.0


class ServerGone(Exception):
    """A connection to the benchmark's server failed during the load (the server died, or closed it)."""


BUSY = 0.9  # a client process busier than this (CPU seconds per wall second) over the load may be what limits the row


def default_client_procs() -> int:
    """--client-procs by default: a quarter of the CPUs, 1 to 4 (the server, its engine and the clients share them)."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def server_argv(args, port: int) -> list[str]:
    """`evict serve` flags for the benchmark's own server, from the engine flags given to the benchmark."""
    argv = [sys.executable, "-m", "evict.cli", "serve", "--port", str(port)]
    argv += ["--model", args.model] if args.model else ["--preset", args.preset, "--size", args.size, "--seed", str(args.seed)]
    if args.set:
        argv += ["--set", *args.set]
    for flag in ("max_batch", "cache_budget", "block_size", "max_len", "prefill_chunk", "max_num_batched_tokens",
                 "decode_prefill_tokens", "priority", "cuda_graphs", "async_scheduling", "dtype", "threads",
                 "engine_process", "stream_interval"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + ["--device", args.device]


@contextmanager
def started_server(args):
    """The URL of the server to load: --url, or one started here (subprocess or thread) and stopped afterwards."""
    import httpx

    if args.url:
        yield args.url.rstrip("/")
        return
    if args.spawn == "thread":
        from evict.serve.load import build_engine
        from evict.serve.server import ServerThread, build_app

        engine, tok, name = build_engine(args)
        engine.start()
        try:
            with ServerThread(build_app(engine, tok, name, stream_interval=args.stream_interval or 1)) as url:
                yield url
        finally:
            engine.stop()
        return
    port = free_port()
    # its stderr into a file, not a pipe nobody reads while the load runs (a full pipe would block the server's logging)
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(server_argv(args, port), stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"

    def last_line() -> str:
        log.seek(0)
        lines = log.read().strip().splitlines()
        return lines[-1] if lines else "(nothing on stderr)"

    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"bench serve: the server exited (code {proc.returncode}): {last_line()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > args.start_timeout:
                raise SystemExit(f"bench serve: the server did not answer /health within {args.start_timeout} s")
            time.sleep(0.2)
        try:
            yield url
        except ServerGone as e:
            time.sleep(1.0)  # a server that crashed has exited by now
            state = "still running" if proc.poll() is None else f"exited with code {proc.returncode}: {last_line()}"
            raise SystemExit(f"bench serve: a request failed: {e} (the server {state})") from None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float,
                      seed: int | None) -> dict:
    """Stream one completion; returns its token ids, finish reason and timings (or its error: an HTTP status, or a
    connection that failed)."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, **({} if seed is None else {"seed": seed})}
    t0 = time.perf_counter()
    ids, times, reason, usage = [], [], None, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}", "prompt": prompt}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage  # the last event (stream_options.include_usage), with no choices
                for c in chunk["choices"]:
                    if c.get("token_ids"):
                        ids += c["token_ids"]
                        times.append(time.perf_counter())
                    reason = c["finish_reason"] or reason
    except httpx.TransportError as e:  # counted as this request's error; a dead server fails the next /metrics read
        return {"error": f"connection: {type(e).__name__}: {e}", "prompt": prompt}
    return {"prompt": prompt, "max_tokens": max_tokens, "ids": ids, "finish_reason": reason, "usage": usage,
            "ttft": times[0] - t0 if times else float("nan"),
            "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")}


class Clients:
    """`n` httpx clients of one connection each, one per request in flight: `send` waits for a free one (so at most n
    in flight, the first to wait the first served). Not one pool of n connections: httpcore scans all of its pool's
    connections as each request starts and ends, and all of them again for each idle one (O(n^2) as requests end),
    ~40 % of one client process's CPU at 128 requests in flight (cProfile, stand-in engine)."""

    def __init__(self, n: int):
        import httpx

        tls = httpx.create_ssl_context()  # one for all (each client's own would take ~25 ms to make)
        self.all = [httpx.AsyncClient(timeout=None, verify=tls, limits=httpx.Limits(max_connections=1,
                                                                                  keepalive_expiry=KEEPALIVE_S))
                    for _ in range(n)]
        self.free: asyncio.Queue = asyncio.Queue()
        for c in self.all:
            self.free.put_nowait(c)

    async def send(self, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
        client = await self.free.get()
        try:
            return await one_request(client, url, model, prompt, max_tokens, temperature, None)
        finally:
            self.free.put_nowait(client)

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.aclose() for c in self.all))


async def load(url: str, args) -> tuple[list[dict], float, dict]:
    import httpx

    limits = httpx.Limits(max_connections=4, keepalive_expiry=KEEPALIVE_S)  # /v1/models, /metrics, the checks
    async with httpx.AsyncClient(timeout=None, limits=limits) as client, Clients(args.clients) as clients:
        info = (await client.get(f"{url}/v1/models")).json()["data"][0]
        vocab = 256 if args.vocab is None else args.vocab
        jobs = jobs_of(args, args.bench_seed, args.requests, vocab)

        async def client_task(prompt, N, delay):
            await asyncio.sleep(delay)
            return await clients.send(url, info["id"], prompt, N, args.temperature)

        # warm-up, not timed: requests of the same lengths at once (first-use kernel compiles and plans happen here)
        t0 = time.perf_counter()
        await asyncio.gather(*(client_task(p, n, 0.0) for p, n, _ in jobs_of(args, args.bench_seed + 1, args.warmup, vocab)))
        warmup_s = time.perf_counter() - t0
        before = parse_metrics((await client.get(f"{url}/metrics")).text)

        delays, t = [], 0.0
        for _, _, gap in jobs:
            t += gap
            delays.append(t)
        with frozen_heap():  # no full collection walks this process's modules (or its server's model) mid-load
            if args.client_procs > 1:
                results, wall, busy = await asyncio.to_thread(in_client_procs, url, info["id"], args,
                                                              [(p, n, d) for (p, n, _), d in zip(jobs, delays)])
            else:
                t0, c0 = time.perf_counter(), time.process_time()
                results = await asyncio.gather(*(client_task(p, n, d) for (p, n, _), d in zip(jobs, delays)))
                wall = time.perf_counter() - t0
                # this process's CPU over the load: the client's own, unless the server is a thread of it
                busy = (time.process_time() - c0) / wall if args.spawn == "process" or args.url else float("nan")
        metrics = parse_metrics((await client.get(f"{url}/metrics")).text)
        metrics["preemptions_total"] = metrics.get("preemptions_total", 0) - before.get("preemptions_total", 0)
        metrics.update(warmup_requests=args.warmup, warmup_s=warmup_s, client_busy=busy)
        for r in results[: args.check] if args.temperature == 0 else []:  # replayed alone, one at a time
            if "error" not in r:
                alone = await one_request(client, url, info["id"], r["prompt"], r["max_tokens"], 0.0, None)
                if "error" in alone:
                    raise ServerGone(f"the check's request alone: {alone['error']}")
                r["alone"] = alone["ids"]
    return list(results), wall, {**metrics, "model": info["id"]}


def in_client_procs(url: str, model: str, args, jobs: list[tuple[list[int], int, float]]) -> tuple[list[dict], float, float]:
    """The timed requests (prompt, max_tokens, arrival time in s) sent from --client-procs processes (job i from
    process i mod P, each with its share of --clients), all started at one instant (perf_counter is the system's
    monotonic clock on Linux: one clock for every process); (results in job order, wall seconds, the busiest client
    process's CPU seconds per wall second)."""
    import multiprocessing

    P = args.client_procs
    ctx = multiprocessing.get_context("spawn")  # no CUDA or threads inherited
    pipes, procs = [], []
    for i in range(P):
        parent, child = ctx.Pipe()
        clients = args.clients // P + (i < args.clients % P)
        procs.append(ctx.Process(target=client_proc, args=(child, url, model, jobs[i::P], max(clients, 1),
                                                           args.temperature), daemon=True))
        procs[-1].start()
        pipes.append(parent)
    try:
        for c in pipes:
            if c.recv() != "ready":
                raise SystemExit("bench serve: a client process did not start")
        t0 = time.perf_counter() + 0.01
        for c in pipes:
            c.send(t0)
        try:
            parts, busy = zip(*(c.recv() for c in pipes))
        except EOFError:  # it died (its traceback, if any, is on stderr above)
            raise SystemExit("bench serve: a client process died during the load") from None
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=10)
    results: list[dict] = [{}] * len(jobs)
    for i, part in enumerate(parts):
        results[i::P] = part
    return results, wall, max(busy)


def client_proc(conn, url: str, model: str, jobs, clients: int, temperature: float) -> None:
    """One client process of in_client_procs: says ready, waits for the start instant, sends its results back with
    its CPU seconds per wall second over them."""

    async def main() -> tuple[list[dict], float]:
        async with Clients(clients) as pool:
            freeze_heap()
            conn.send("ready")
            t0 = conn.recv()

            async def task(prompt, N, at):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                return await pool.send(url, model, prompt, N, temperature)

            c0 = time.process_time()
            results = list(await asyncio.gather(*(task(*j) for j in jobs)))
            return results, (time.process_time() - c0) / max(time.perf_counter() - t0, 1e-9)

    conn.send(asyncio.run(main()))


def jobs_of(args, seed: int, n: int, vocab: int) -> list[tuple[list[int], int, float]]:
    """n requests (prompt ids, max_tokens, arrival gap in s) drawn from the load's ranges."""
    rng, jobs = random.Random(seed), []
    for _ in range(n):
        P, N = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        jobs.append(([rng.randrange(vocab) for _ in range(P)], N, rng.expovariate(args.rate) if args.rate != math.inf else 0.0))
    return jobs


def engine_load(args, mark=None) -> tuple[list[dict], float, dict]:
    """The load of `load` with no HTTP: each request submitted to an engine stepping in its thread here, at most
    --clients in flight, arrivals as drawn; a token's time is when the engine hands it over (on_token). `mark(engine)`,
    if given, is called as the timed load starts and as it ends (dev/serve_http_profile.py reads counters there)."""
    import threading

    from evict.serve.engine import SamplingParams
    from evict.serve.load import build_engine

    engine, _, name = build_engine(args)
    engine.start()
    gate, vocab = threading.Semaphore(args.clients), 256 if args.vocab is None else args.vocab

    def run_jobs(jobs, timed: bool) -> list[dict]:
        out: list[dict] = []
        done = threading.Semaphore(0)
        t_next = time.perf_counter()
        for prompt, N, gap in jobs:
            t_next += gap if timed else 0.0
            time.sleep(max(0.0, t_next - time.perf_counter()))
            gate.acquire()
            r = {"prompt": prompt, "max_tokens": N, "ids": [], "times": [], "t0": time.perf_counter()}
            out.append(r)

            def finish(req, r=r):
                r.update(finish_reason=req.finish_reason, usage={"completion_tokens": len(r["ids"])})
                gate.release()
                done.release()

            params = SamplingParams(max_tokens=N, temperature=args.temperature)
            engine.submit(prompt, params, on_token=lambda req, t, r=r: (r["ids"].append(t), r["times"].append(time.perf_counter())),
                          on_finish=finish)
        for _ in out:
            done.acquire()
        for r in out:
            ts = r.pop("times")
            t0 = r.pop("t0")
            r["ttft"] = ts[0] - t0 if ts else float("nan")
            r["tpot"] = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else float("nan")
        return out

    try:
        t0 = time.perf_counter()
        run_jobs(jobs_of(args, args.bench_seed + 1, args.warmup, vocab), timed=False)
        warmup_s = time.perf_counter() - t0
        before = engine.metrics()
        t0 = time.perf_counter()
        if mark:
            mark(engine)
        with frozen_heap():  # as load()'s
            results = run_jobs(jobs_of(args, args.bench_seed, args.requests, vocab), timed=True)
        wall = time.perf_counter() - t0
        if mark:
            mark(engine)
        m = engine.metrics()
        for r in results[: args.check] if args.temperature == 0 else []:
            r["alone"] = run_jobs([(r["prompt"], r["max_tokens"], 0.0)], timed=False)[0]["ids"]
    finally:
        engine.stop()
    where = "engine process" if getattr(args, "engine_process", "off") == "on" else "in process"
    metrics = {"peak_memory_bytes": m["peak_memory_bytes"], "cache_pool_bytes": m["pool_bytes"],
               "cache_pool_peak_used_bytes": m["pool_peak_used_bytes"],
               "preemptions_total": m["preemptions"] - before["preemptions"], "warmup_requests": args.warmup,
               "warmup_s": warmup_s, "model": f"{name} ({where}, no HTTP)"}
    return results, wall, metrics


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("evict_")] = float(value)
    return out


def summarize(results: list[dict], wall: float, metrics: dict, args) -> dict:
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(len(r["ids"]) for r in ok)
    complete = [r for r in ok if len(r["ids"]) == r["max_tokens"] and r["finish_reason"] == "length"
                and r["usage"]["completion_tokens"] == r["max_tokens"]]
    replayed = [r for r in ok if "alone" in r]
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + sum(len(r["prompt"]) for r in ok)) / wall,
        "ttft_p50_s": percentile([r["ttft"] for r in ok], 50), "ttft_p99_s": percentile([r["ttft"] for r in ok], 99),
        "tpot_p50_s": percentile([r["tpot"] for r in ok if r["tpot"] == r["tpot"]], 50),
        "tpot_p99_s": percentile([r["tpot"] for r in ok if r["tpot"] == r["tpot"]], 99),
        "peak_memory_gib": metrics.get("peak_memory_bytes", float("nan")) / 2**30,
        "pool_gib": metrics.get("cache_pool_bytes", float("nan")) / 2**30,
        "pool_peak_used_gib": metrics.get("cache_pool_peak_used_bytes", float("nan")) / 2**30,
        "preemptions": int(metrics.get("preemptions_total", 0)),
        "warmup_s": metrics.get("warmup_s", 0.0),
        "client_busy": metrics.get("client_busy", float("nan")),
        "complete": f"{len(complete)}/{len(results)}",
        "equal_alone": f"{sum(r['alone'] == r['ids'] for r in replayed)}/{len(replayed)}",
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


def run(args) -> dict:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.url is None and args.model is None and args.preset is None:
        raise SystemExit("--url: expected a running server's URL, or --model DIR / --preset NAME to start one")
    if args.spawn == "process" and args.url is None and args.model is not None and not os.path.isdir(args.model):
        raise SystemExit(f"--model: no such folder: {args.model}")
    if args.spawn == "engine":
        results, wall, metrics = engine_load(args)
    else:
        import httpx

        try:
            with started_server(args) as url:
                try:
                    results, wall, metrics = asyncio.run(load(url, args))
                except httpx.TransportError as e:  # /v1/models or /metrics: the server is gone
                    raise ServerGone(f"{type(e).__name__}: {e}") from None
        except ServerGone as e:  # --url or --spawn thread (a spawned process's context says more, as SystemExit)
            raise SystemExit(f"bench serve: a request failed: {e}") from None
    s = summarize(results, wall, metrics, args)
    row = {"model": metrics["model"], **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in s.items() if k != "first_error"}}
    print(markdown_table([row], list(row)))
    if s["first_error"]:
        print(f"first error: {s['first_error']}", file=sys.stderr)
    if s["client_busy"] >= BUSY:
        print(f"bench serve: a client process was busy {s['client_busy']:.0%} of the timed load, so it may have been "
              f"this row's limit (--client-procs {args.client_procs}; more spread the requests)", file=sys.stderr)
    payload = {"card": card(), "flags": {k: v for k, v in vars(args).items() if k != "fn"}, "summary": s,
               "server_metrics": metrics}
    if args.out:
        print(f"json: {write_json(args.out, payload)}")
    return payload


def add_arguments(g) -> None:
    """`evict bench serve`'s own flags (--device and --out are added by evict/commands/bench.py)."""
    from evict.cli_args import nonneg_int, positive_float, positive_int

    g.add_argument("--url", help="a running server (default: start one from --model / --preset)")
    g.add_argument("--spawn", choices=["process", "thread", "engine"], default="process",
                   help="how to start the server (default process); engine: no server, the engine in this process")
    g.add_argument("--clients", type=positive_int, default=16, help="requests in flight at most (default 16)")
    g.add_argument("--client-procs", type=positive_int, default=default_client_procs(), help="processes sending the timed requests, each every P-th "
                   "request with its share of --clients (default: a quarter of the CPUs, 1 to 4: one client process "
                   "parses ~10,000 streamed tokens a second at most; the row says how busy the busiest one was)")
    g.add_argument("--requests", type=positive_int, default=64, help="requests in all (default 64)")
    g.add_argument("--rate", type=positive_float, default=math.inf, help="Poisson arrivals per second (default: all at once)")
    g.add_argument("--prompt-len", type=positive_int, nargs=2, default=[16, 256], metavar=("LO", "HI"))
    g.add_argument("--output-len", type=positive_int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; the equality check needs it)")
    g.add_argument("--warmup", type=nonneg_int, default=8, help="requests of the same lengths sent before the timed load, all at "
                   "once, not counted (default 8; 0: none)")
    g.add_argument("--check", type=int, default=8, help="greedy requests replayed alone for the equality check (default 8)")
    g.add_argument("--vocab", type=positive_int, help="prompt token ids in [0, VOCAB) (default 256)")
    g.add_argument("--bench-seed", type=int, default=0, help="seed of the lengths, prompts and arrivals")
    g.add_argument("--stream-interval", type=positive_int, metavar="N",
                   help="its own server's --stream-interval (a stream written once per N tokens; default 1)")
    g.add_argument("--start-timeout", type=positive_float, default=600, help="seconds to wait for the server (default 600)")
    from evict.serve.load import add_engine_flags

    add_engine_flags(g, device=False)  # as `evict serve`'s, for its own server
