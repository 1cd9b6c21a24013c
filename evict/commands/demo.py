"""`evict demo`: the memory op's worked examples (the examples themselves are evict/demo.py)."""

from __future__ import annotations

from evict.cli_args import described


def run(args) -> None:
    from evict.demo import run_demo

    run_demo()


def add_parser(sub) -> None:
    d = sub.add_parser("demo", **described(
        "the memory op's worked examples, computed live",
        "The lesson's worked examples, computed by evict's memory op in float64 and printed with their numbers:\n"
        "interference (the additive rule reads a mix of two values whose keys overlap), a targeted replace (the\n"
        "delta rule overwrites one key's value), survival (what a gate's decays keep) and the delta update as one\n"
        "SGD step on the memory's reconstruction loss.",
        "evict demo"))
    d.set_defaults(fn=run)
