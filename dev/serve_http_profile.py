"""Issue 73: where the serving process's host time per output token goes, HTTP against no HTTP. Runs the load of
`evict bench serve` (same flags) once through the HTTP server (a child process: the engine thread + uvicorn's event
loop) and once straight into an engine in a child process (--spawn engine's load), and prints, per output token, the
CPU time of the engine thread and of the event-loop thread (Linux per-thread counters), of the bench's client (this
process, which parses every streamed event; with --client-procs only the parent's share), the wall time, and (--top N)
the event loop's cProfile table (the engine thread is not profiled: cProfile follows the thread that enables it).
CPU: python dev/serve_http_profile.py --preset hybrid --threads 1 --clients 64 --requests 64 --prompt-len 16 16
--output-len 128 128 --max-batch 64 --cache-budget 64M [--modes http engine] [--top 25]"""

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import os
import pstats
import queue
import signal
import subprocess
import sys
import threading
import time

from evict.bench import serve as bench
from evict.serve import launch
from evict.serve.engine import Request


class StubEngine:
    """A stand-in for evict.serve.engine.Engine with no model (--stub-step-ms): each step hands every running request
    its next token (id = position % 256) through the same callbacks, after sleeping the step's time with the GIL free
    (a GPU step's wait), so the HTTP side's own cost per token is what is left."""

    def __init__(self, step_s: float, max_batch: int, max_len: int = 1 << 20):
        self.step_s, self.max_batch, self.max_len = step_s, max_batch, max_len
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.ids = itertools.count()
        self.stats = {"generated_tokens": 0, "finished": 0, "requests": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt, params, on_token=None, on_finish=None) -> Request:
        req = Request(list(prompt), params, on_token, on_finish, id=next(self.ids))
        self.inbox.put(("add", req))
        return req

    def cancel(self, req: Request) -> None:
        self.inbox.put(("cancel", req))

    def _finish(self, r: Request, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        r.finish_reason = reason
        self.stats["finished"] += 1
        if r.on_finish is not None:
            r.on_finish(r)

    def step(self) -> bool:
        while not self.inbox.empty():
            verb, r = self.inbox.get()
            if verb == "add":
                self.waiting.append(r)
                self.stats["requests"] += 1
            elif r.finish_reason is None:
                self._finish(r, "cancelled")
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return False
        time.sleep(self.step_s)  # the device's part of a step, GIL free
        for r in list(self.running):
            t = (len(r.prompt) + len(r.out)) % 256
            r.out.append(t)
            self.stats["generated_tokens"] += 1
            if r.on_token is not None:
                r.on_token(r, t)
            if len(r.out) == r.params.max_tokens:
                self._finish(r, "length")
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                time.sleep(0.001)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="evict-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def warm_up(self) -> None:
        pass

    def metrics(self) -> dict:
        z = {k: 0 for k in ("running", "waiting", "requests", "finished", "cancelled", "preemptions", "prefill_tokens",
                            "tokens_per_second", "slots_used", "slots_total", "blocks_used", "blocks_total",
                            "pool_bytes", "pool_peak_used_bytes", "peak_memory_bytes")}
        return {**z, **self.stats}


def tpot_p50(results: list[dict]) -> float:
    """The median of the requests' time per output token after the first (seconds; NaN if none has two tokens)."""
    return bench.percentile([r["tpot"] for r in results if "tpot" in r and r["tpot"] == r["tpot"]], 50)


def thread_cpu(tid: int, part: slice = slice(11, 13)) -> float:
    """Seconds of CPU thread `tid` of this process has used: user + system, or `part` (slice(11, 12): user only)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[part]) / os.sysconf("SC_CLK_TCK")


def child(args, out: str) -> None:
    """The server (http) or the engine alone (engine); writes the per-thread CPU and the loop's profile to `out`."""
    from evict.serve.load import build_engine

    if args.mode == "engine":
        marks = []
        results, wall, _ = bench.engine_load(args, lambda e: marks.append(thread_cpu(e._thread.native_id)))
        n = sum(len(r["ids"]) for r in results)
        json.dump({"mode": "engine", "wall_s": wall, "tokens": n, "engine_cpu_s": marks[1] - marks[0],
                   "tpot_p50_s": tpot_p50(results)}, open(out, "w"))
        return
    import uvicorn

    from evict.serve.server import build_app

    if args.stub_step_ms is not None:
        from evict.tasks.tokenizers import ByteTokenizer

        engine, tok, name = StubEngine(args.stub_step_ms / 1e3, args.max_batch), ByteTokenizer(), "stub"
    else:
        engine, tok, name = build_engine(args)
    engine.start()
    gen0 = engine.stats["generated_tokens"]
    prof = cProfile.Profile()
    app = build_app(engine, tok, name, stream_interval=args.stream_interval or 1)
    server = uvicorn.Server(uvicorn.Config(app, port=args.port, log_level="warning", lifespan="off", http=args.http,
                                           loop=args.loop))
    loop_tid, eng_tid = threading.get_native_id(), engine._thread.native_id
    marks: dict[str, tuple] = {}

    def mark(sig, frame):  # SIGUSR1 from the parent: the timed load starts / ends
        key = "start" if "start" not in marks else "end"
        marks[key] = (thread_cpu(loop_tid), thread_cpu(eng_tid), engine.stats["generated_tokens"], time.perf_counter(),
                      thread_cpu(loop_tid, slice(11, 12)))
        if key == "start" and args.top:
            prof.enable()
        elif key == "end" and args.top:
            prof.disable()

    signal.signal(signal.SIGUSR1, mark)
    signal.signal(signal.SIGUSR2, lambda sig, frame: setattr(server, "should_exit", True))  # the parent is done
    getattr(launch, "freeze_heap", lambda: None)()  # as `evict serve` does before uvicorn runs (older --trees: none)
    server.run()
    engine.stop()
    (l0, e0, g0, t0, u0), (l1, e1, g1, t1, u1) = marks["start"], marks["end"]
    s = io.StringIO()
    if args.top:
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    json.dump({"mode": "http", "wall_s": t1 - t0, "tokens": g1 - g0, "engine_cpu_s": e1 - e0, "loop_cpu_s": l1 - l0, "loop_user_s": u1 - u0,
               "profile": s.getvalue(), "generated_before": gen0}, open(out, "w"))


def parent(args, argv: list[str]) -> None:
    import httpx

    rows = []
    runs = [(m, t) for m in args.modes for t in (args.trees if m == "http" else [os.getcwd()])]
    for mode, tree in runs * args.repeat:
        out = f"/tmp/serve_http_profile_{os.getpid()}_{mode}.json"
        port = bench.free_port()
        keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not os.path.isdir(f"{p}/evict")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, *keep])}  # that tree's evict, other paths kept
        proc = subprocess.Popen([sys.executable, __file__, *argv, "--child", out, "--mode", mode, "--port", str(port)],
                                env=env)
        if mode == "http":
            url = f"http://127.0.0.1:{port}"
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            args.warmup, warm = 0, args.warmup
            if warm:  # untimed requests first, as the bench
                n, args.requests = args.requests, warm
                asyncio.run(bench.load(url, args))
                args.requests = n
            args.check = 0
            getattr(launch, "freeze_heap", lambda: None)()  # its collection before c0 (bench.load's, after: cheap)
            proc.send_signal(signal.SIGUSR1)
            c0 = time.process_time()
            timed, bench_wall, _ = asyncio.run(bench.load(url, args))  # the timed requests' wall (not the clients' start)
            client_s = time.process_time() - c0  # the bench's client (this process), parsing every event
            proc.send_signal(signal.SIGUSR1)
            args.warmup = warm
            proc.send_signal(signal.SIGUSR2)
        proc.wait()
        r = {**json.load(open(out)), **({"client_s": client_s, "wall_s": bench_wall, "tpot_p50_s": tpot_p50(timed)}
                                        if mode == "http" else {})}
        os.unlink(out)
        tok = r["tokens"]
        row = {"mode": mode, "tree": os.path.basename(tree.rstrip("/")), "tokens": tok, "wall_s": round(r["wall_s"], 2), "out_tok_s": round(tok / r["wall_s"]),
               "engine_us_per_tok": round(r["engine_cpu_s"] / tok * 1e6, 1),
               "loop_us_per_tok": round(r.get("loop_cpu_s", 0.0) / tok * 1e6, 1),
               "loop_user_us_per_tok": round(r.get("loop_user_s", 0.0) / tok * 1e6, 1),
               "client_us_per_tok": round(r.get("client_s", 0.0) / tok * 1e6, 1),
               "tpot_p50_ms": round(r["tpot_p50_s"] * 1e3, 2)}
        rows.append(row)
        if r.get("profile"):
            print(r["profile"])
    from evict.report import markdown_table

    print(markdown_table(rows, list(rows[0])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", nargs="+", choices=["http", "engine"], default=["http", "engine"])
    ap.add_argument("--top", type=int, default=0, help="the event loop's cProfile, N rows by own time")
    ap.add_argument("--trees", nargs="+", default=[os.getcwd()], help="source trees whose server the http mode runs "
                    "(PYTHONPATH), one row each (default: this one); the engine mode runs this one")
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"], help="uvicorn's HTTP protocol")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"], help="uvicorn's event loop")
    ap.add_argument("--stub-step-ms", type=float, help="http mode: no model, a stand-in engine whose steps take this "
                    "long (GIL free) and hand every running request a token (StubEngine here)")
    ap.add_argument("--repeat", type=int, default=1, help="the rows again, in the same order (machine drift)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args, args.child)
    else:
        argv = list(sys.argv[1:])
        for flag in ("--modes", "--trees"):
            if flag in argv:
                i = j = argv.index(flag)
                while j + 1 < len(argv) and not argv[j + 1].startswith("--"):
                    j += 1
                del argv[i : j + 1]
        parent(args, argv)


if __name__ == "__main__":
    main()
