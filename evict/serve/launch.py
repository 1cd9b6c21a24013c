"""`evict serve`'s HTTP side: its flags, the listening socket (bound before the model loads: a bad --host or a port in
use is one line, exit 2, and "serving" is never printed), logging, and shutdown with a deadline (SIGTERM / Ctrl-C:
the engine stops after its current step, every request in flight gets a 503 error, the process exits)."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import socket
from contextlib import contextmanager

from evict.cli_args import UserError, positive_int

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# uvicorn's own default is 5 s, the same as httpx's (and the openai client's) idle-connection expiry: a client then
# sends a request on a connection the server is closing that instant ("Server disconnected without sending a
# response"). The server keeping idle connections longer than its clients leaves the closing to them.
KEEP_ALIVE_S = 65


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [1, 65535], got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def add_http_flags(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the run folder's or preset's name)")
    p.add_argument("--api-key", default=os.environ.get("EVICT_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/ routes (default: $EVICT_API_KEY; none: open)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (default: the model folder's "
                   "chat_template.jinja or tokenizer_config.json's chat_template, else a plain <|role|> one)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="server log level")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False, help="log every request")
    p.add_argument("--shutdown-timeout", type=seconds, default=5.0,
                   help="seconds a SIGTERM waits for connections to close after failing the requests in flight")
    p.add_argument("--stream-interval", type=positive_int, metavar="N", default=1,
                   help="write a stream once per N tokens (its first token and its end at once; default 1): the same "
                        "events, fewer wake-ups and writes of the server's event loop per token")
    p.add_argument("--timeout-keep-alive", type=positive_int, metavar="SECONDS", default=KEEP_ALIVE_S,
                   help="seconds an idle connection stays open (longer than clients keep idle connections: httpx and "
                        "the openai client drop theirs after 5 s, so a request never meets a connection being closed)")


def bind(host: str, port_: int) -> socket.socket:
    """A listening TCP socket on host:port; UserError (one line) for a host that is no local address or a port in use."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port_, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--host: cannot listen on {host!r} ({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--port: {host}:{port_} is in use (another server?)") from None
        flag = "--port" if e.errno == errno.EACCES else "--host"
        raise UserError(f"{flag}: cannot listen on {host}:{port_} ({e.strerror})") from None
    return sock


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic GC's reach (gc.freeze): the modules, the model, the
    app (~330,000 objects with torch loaded). Else each full collection walks them all, 60-160 ms with the GIL held
    on a CPU (every stream and the engine thread stopped; about one per 16K streamed tokens here); the objects
    allocated later (requests, steps) are collected as before. Call it once the process has built what it keeps."""
    gc.collect()
    gc.freeze()


@contextmanager
def frozen_heap():
    """freeze_heap() for a while (a load of `evict bench serve`), then the frozen objects collectable again."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def serve_forever(app, engine, sock: socket.socket, args) -> None:
    """uvicorn on the bound socket until SIGTERM / SIGINT; then the engine stops at once (its requests in flight get
    errors), connections get --shutdown-timeout seconds to close, and this returns."""
    import uvicorn

    logging.getLogger("evict.serve").setLevel(args.log_level.upper())
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log, lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=args.timeout_keep_alive)
    if args.access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.stop(timeout=0)  # the engine thread fails what is in flight and ends after its current step
            super().handle_exit(sig, frame)

    freeze_heap()  # the engine and the app are built
    try:
        Server(config).run(sockets=[sock])
    finally:
        engine.stop(timeout=args.shutdown_timeout)
        sock.close()
