"""`evict serve`: load a model (a folder saved by `evict train`, or a preset with random weights for load tests) and
serve it over HTTP. Flags are checked before the model is loaded; bad values end in one line, exit 2."""

from __future__ import annotations

from evict.cli_args import described, positive_int
from evict.serve.load import add_engine_flags, build_engine


def run_serve(args) -> None:
    try:
        import jinja2  # noqa: F401 (chat templates)
        import uvicorn  # noqa: F401

        from evict.serve.launch import bind, serve_forever
        from evict.serve.server import build_app
    except ImportError as e:
        raise SystemExit(f"serve: {e.name} is not installed: pip install 'evict[serve]' (fastapi, uvicorn, jinja2)") from None
    from evict.serve.chat import find_chat_template

    folder = None
    if args.model is not None:
        from evict.serve.load import resolve_model_dir

        folder = resolve_model_dir(args.model)
    template = find_chat_template(folder, args.chat_template)
    sock = bind(args.host, args.port)  # before the model loads: a bad --host or a port in use fails at once
    try:
        engine, tok, name = build_engine(args)
        name = args.served_model_name or name
        app = build_app(engine, tok, name, chat_template=template, api_key=args.api_key,
                        stream_interval=args.stream_interval)
    except BaseException:
        sock.close()
        raise
    engine.start()
    host, port = sock.getsockname()[:2]
    print(f"serving {name} on http://{host}:{port} ({engine.max_batch} slots, {engine.n_blocks} blocks of "
          f"{engine.block_size} tokens, {engine.pool_bytes / 2**20:.1f} MiB pool, {engine.max_len} tokens per sequence)",
          flush=True)
    serve_forever(app, engine, sock, args)


def add_parser(sub) -> None:
    from evict.serve.launch import add_http_flags

    s = sub.add_parser("serve", **described(
        "serve a model over HTTP (OpenAI completions and chat APIs, continuous batching)",
        "Serve a model saved by `evict train` (or a preset with random weights, for load tests) over HTTP with an\n"
        "OpenAI-compatible /v1/completions and /v1/chat/completions endpoints. The engine decodes many requests together (continuous\n"
        "batching) from one pool of cache memory (--cache-budget). Needs `pip install 'evict[serve]'`.",
        "evict serve --model runs/kda --port 8000",
        "evict serve --preset hybrid --device cuda --dtype bfloat16 --cache-budget 8G"))
    add_engine_flags(s)
    add_http_flags(s)
    s.set_defaults(fn=run_serve)
