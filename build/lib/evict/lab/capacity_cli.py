"""`evict lab capacity`: the capacity lab's flags (the sweep itself is evict/lab/capacity.py)."""

from __future__ import annotations

from evict.cli_args import add_lab_parser, positive_int, run_lab

OVERWRITE = {"no": (False,), "yes": (True,), "both": (False, True)}


def run_capacity(args) -> None:
    from evict.lab import capacity

    run_lab(args, capacity, {"rules": tuple(args.rules) if args.rules else None,
                             "sizes": tuple(args.sizes) if args.sizes else None,
                             "overwrite": OVERWRITE.get(args.overwrite)})


def add_parser(lab_sub) -> None:
    """Register `evict lab capacity` on the `evict lab` subparsers object."""
    from evict.lab.capacity import RULES

    s = add_lab_parser(lab_sub, "capacity", help="Schlag et al.'s capacity regression: additive vs delta rule, S grows",
                       quick="S 20-100, 2 rules, with and without overwrites, ~2.5 min on a 2-core CPU",
                       full="S up to 300, 10,000 steps, 3 seeds; GPU",
                       seeds_help="seeds per cell; the table shows mean and range")
    s.add_argument("--rules", nargs="+", choices=list(RULES))
    s.add_argument("--sizes", nargs="+", type=positive_int, metavar="S", help="numbers of distinct keys (>= 2)")
    s.add_argument("--overwrite", choices=list(OVERWRITE), help="S unique writes, 2S with overwrites, or both")
    s.set_defaults(fn=run_capacity)
