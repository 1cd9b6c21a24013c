"""`evict …` subcommands."""

from __future__ import annotations

import argparse
import logging
import sys


def _bench(args) -> None:
    if args.what == "ops":
        from evict.bench.ops import bench_cpu

        if args.device != "cpu":
            raise SystemExit(f"--device: only 'cpu' is available in this build, got {args.device!r}")
        bench_cpu(lengths=tuple(args.lengths), out=args.out)


def _demo(args) -> None:
    from evict.demo import run_demo

    run_demo()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evict", description="Attention is an associative memory; a fixed-size memory must evict.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the memory op's worked examples, computed live")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    b.add_argument("what", choices=["ops"])
    b.add_argument("--device", default="cpu")
    b.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    b.add_argument("--out", default=None, help="JSON output path")
    b.set_defaults(fn=_bench)
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
