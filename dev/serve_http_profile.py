"""Issue 73: where the serving process's host time per output token goes, HTTP against no HTTP. Runs the load of
`evict bench serve` (same flags) once through the HTTP server (a child process: the engine thread + uvicorn's event
loop) and once straight into an engine in a child process (--spawn engine's load), and prints, per output token, the
CPU time of the engine thread and of the event-loop thread (Linux per-thread counters), the wall time, and (--top N)
the event loop's cProfile table (the engine thread is not profiled: cProfile follows the thread that enables it).
CPU: python dev/serve_http_profile.py --preset hybrid --threads 1 --clients 64 --requests 64 --prompt-len 16 16
--output-len 128 128 --max-batch 64 --cache-budget 64M [--modes http engine] [--top 25]"""

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import signal
import subprocess
import sys
import threading
import time

from evict.bench import serve as bench


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
        json.dump({"mode": "engine", "wall_s": wall, "tokens": n, "engine_cpu_s": marks[1] - marks[0]}, open(out, "w"))
        return
    import uvicorn

    from evict.serve.server import build_app

    if args.stub_step_ms is not None:
        from evict.tasks.tokenizers import ByteTokenizer
        from serve_stub_engine import StubEngine

        engine, tok, name = StubEngine(args.stub_step_ms / 1e3, args.max_batch), ByteTokenizer(), "stub"
    else:
        engine, tok, name = build_engine(args)
    engine.start()
    gen0 = engine.stats["generated_tokens"]
    prof = cProfile.Profile()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, tok, name), port=args.port, log_level="warning",
                                           lifespan="off", http=args.http, loop=args.loop))
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
            proc.send_signal(signal.SIGUSR1)
            asyncio.run(bench.load(url, args))
            proc.send_signal(signal.SIGUSR1)
            args.warmup = warm
            proc.send_signal(signal.SIGUSR2)
        proc.wait()
        r = json.load(open(out))
        os.unlink(out)
        tok = r["tokens"]
        row = {"mode": mode, "tree": os.path.basename(tree.rstrip("/")), "tokens": tok, "wall_s": round(r["wall_s"], 2), "out_tok_s": round(tok / r["wall_s"]),
               "engine_us_per_tok": round(r["engine_cpu_s"] / tok * 1e6, 1),
               "loop_us_per_tok": round(r.get("loop_cpu_s", 0.0) / tok * 1e6, 1),
               "loop_user_us_per_tok": round(r.get("loop_user_s", 0.0) / tok * 1e6, 1)}
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
                    "long (GIL free) and hand every running request a token (dev/serve_stub_engine.py)")
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
