"""`evict explore [--port N] [--host H]`: serve the lesson's figures on this machine (needs `pip install evict[explore]`)."""

from __future__ import annotations

import argparse
import socket

from evict.cli_args import UserError, described


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}")
    return value


def add_parser(sub) -> None:
    e = sub.add_parser("explore", **described(
        "the lesson's figures as a local web app, computed by evict (FastAPI + uvicorn)",
        "Serve the lesson's interactive figures on this machine: each figure is computed by evict's op or models\n"
        "as you move its controls. Needs `pip install 'evict[explore]'`. Open the printed address in a browser.",
        "evict explore",
        "evict explore --port 8080"))
    e.add_argument("--port", type=port, default=8000, help="default 8000")
    e.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    e.set_defaults(fn=run)


def run(args) -> None:
    try:
        from evict.explore.app import serve
    except ImportError as e:
        raise UserError(f"explore: needs FastAPI and uvicorn ({e.name} is missing): pip install 'evict[explore]'") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # before uvicorn, so a busy port is one line
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise UserError(f"--port: cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    serve(args.host, args.port)
