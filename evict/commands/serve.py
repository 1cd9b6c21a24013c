"""`evict serve`: load a model (a folder saved by `evict train`, or a preset with random weights for load tests) and
serve it over HTTP. Flags are checked before the model is loaded; bad values end in one line, exit 2."""

from __future__ import annotations

from evict.cli_args import described, positive_int
from evict.serve.load import add_engine_flags, build_engine


def run_serve(args) -> None:
    try:
        import uvicorn

        from evict.serve.server import build_app
    except ImportError as e:
        raise SystemExit(f"serve: {e.name} is not installed: pip install 'evict[serve]' (fastapi, uvicorn, httpx)") from None
    engine, tok, name = build_engine(args)
    app = build_app(engine, tok, name)
    engine.start()
    print(f"serving {name} on http://{args.host}:{args.port} ({engine.max_batch} slots, {engine.n_blocks} blocks of "
          f"{engine.block_size} tokens, {engine.pool_bytes / 2**20:.1f} MiB pool, {engine.max_len} tokens per sequence)",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()


def add_parser(sub) -> None:
    s = sub.add_parser("serve", **described(
        "serve a model over HTTP (OpenAI completions API, continuous batching)",
        "Serve a model saved by `evict train` (or a preset with random weights, for load tests) over HTTP with an\n"
        "OpenAI-compatible /v1/completions endpoint. The engine decodes many requests together (continuous\n"
        "batching) from one pool of cache memory (--cache-budget). Needs `pip install 'evict[serve]'`.",
        "evict serve --model runs/kda --port 8000",
        "evict serve --preset hybrid --device cuda --dtype bfloat16 --cache-budget 8G"))
    add_engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=positive_int, default=8000)
    s.set_defaults(fn=run_serve)
