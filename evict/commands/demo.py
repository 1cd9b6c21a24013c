"""`evict demo`: the memory op's worked examples (the examples themselves are evict/demo.py)."""

from __future__ import annotations


def run(args) -> None:
    from evict.demo import run_demo

    run_demo()


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="the memory op's worked examples, computed live")
    d.set_defaults(fn=run)
