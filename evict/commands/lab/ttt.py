"""`evict lab ttt`: the test-time-training lab's flags (the sweep itself is evict/lab/ttt.py)."""

from __future__ import annotations

from evict.cli_args import add_lab_parser, positive_int, run_lab


def run_ttt(args) -> None:
    from evict.lab import ttt

    run_lab(args, ttt, {"rules": tuple(args.rules) if args.rules else None,
                        "tasks": tuple(args.tasks) if args.tasks else None,
                        "sizes": tuple(args.sizes) if args.sizes else None,
                        "pairs": tuple(args.pairs) if args.pairs else None, "d_key": args.d_key})


DESCRIPTION = ("The delta rule is one SGD step on 1/2 ||k S - v||^2. Its natural extensions (momentum on the\n"
               "state update, an Adagrad-style per-key step, several inner steps per token, a damped diagonal\n"
               "Newton step) against it at a fixed state size, on the capacity regression (S keys past d_key) and\n"
               "on MQAR: the final held-out metric (capacity) beside its value early in training (speed).")


def add_parser(lab_sub) -> None:
    """Register `evict lab ttt` on the `evict lab` subparsers object."""
    from evict.lab.ttt import RULES, TASKS

    s = add_lab_parser(
        lab_sub, "ttt", description=DESCRIPTION, seeds_help="seeds per cell; the table shows the mean",
        help="the delta rule as one SGD step: do momentum, Adagrad, inner steps, Newton buy capacity or speed?",
        examples=("evict lab ttt --quick --out runs/lab_ttt",
                  "evict lab ttt --rules delta momentum --tasks mqar --pairs 4 8 16 --out runs/lab_ttt_mom"),
        quick="d_key 8, capacity S 6/10/14, MQAR K 4/8 at length 32, 5 rules, 400 steps; ~3 min on a 2-core CPU",
        full="d_key 32, S 24-64, MQAR K 16-32 at length 128, 3,000 steps, 3 seeds; one GPU (not run yet)")
    s.add_argument("--rules", nargs="+", choices=list(RULES))
    s.add_argument("--tasks", nargs="+", choices=list(TASKS))
    s.add_argument("--sizes", nargs="+", type=positive_int, metavar="S",
                   help="capacity: numbers of distinct keys (>= 2)")
    s.add_argument("--pairs", nargs="+", type=positive_int, metavar="K", help="MQAR: numbers of pairs")
    s.add_argument("--d-key", type=positive_int, metavar="D", help="the key dim (the state is D x D_v)")
    s.set_defaults(fn=run_ttt)
