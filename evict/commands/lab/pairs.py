"""`evict lab pairs`: the pairs-vs-head-dim lab's flags (the sweep itself is evict/lab/pairs.py)."""

from __future__ import annotations

from evict.cli_args import add_gate_dt_flag, add_lab_parser, positive_int, run_lab, unit_interval


def run_pairs(args) -> None:
    from evict.lab import pairs

    lrs, args.lr = ((args.lr,) if args.lr else None), None  # one --lr replaces the sweep's lrs (PairsSweep has no lr)
    run_lab(args, pairs, {"rules": tuple(args.rules) if args.rules else None,
                          "dims": tuple(args.dims) if args.dims else None,
                          "pairs": tuple(args.pairs) if args.pairs else None,
                          "lrs": lrs, "threshold": args.threshold, "d_model": args.d_model,
                          "tokens_per_step": args.tokens_per_step,
                          "gate_dt": tuple(args.gate_dt) if args.gate_dt else None})


def add_parser(lab_sub) -> None:
    """Register `evict lab pairs` on the `evict lab` subparsers object."""
    from evict.lab.pairs import RULES

    s = add_lab_parser(lab_sub, "pairs", help="largest MQAR K recalled at >= 90%% vs head dim d, per rule; fit K* vs d",
                       description="The largest number of MQAR pairs K* a memory recalls at >= 90% accuracy, as its\n"
                       "head dim d grows, for each update rule: climb a ladder of K per (rule, d), then fit K* against\n"
                       "d (is it linear in d?).",
                       examples=("evict lab pairs --quick --out runs/lab_pairs",
                                 "evict lab pairs --rules kda gated_deltanet --dims 8 16 --out runs/lab_pairs_kda"),
                       quick="d 8/16/32, K 2-32, 5 rules: 283 s of CPU, ~2.5 min on 2 free cores",
                       full="d 16-256, K 4-512, 3 lrs; GPU",
                       seeds_help="seeds per (rule, d); the table shows each seed's K*")
    s.add_argument("--rules", nargs="+", choices=list(RULES))
    s.add_argument("--dims", nargs="+", type=positive_int, metavar="D",
                   help="head dims, one head per layer, each at most the width (--d-model)")
    s.add_argument("--d-model", type=positive_int, metavar="W", help="the models' width, the same for every d (quick 32, full 256)")
    s.add_argument("--pairs", nargs="+", type=positive_int, metavar="K", help="the ladder of pair counts")
    s.add_argument("--threshold", type=unit_interval, help="accuracy a rung must reach (default 0.9)")
    s.add_argument("--tokens-per-step", type=positive_int, metavar="N",
                   help="a rung's batch is --batch-size, or fewer where L x batch would pass N (full: 131072)")
    add_gate_dt_flag(s, default="1e-3 1e-1 quick, 1e-4 1e-3 full")
    s.set_defaults(fn=run_pairs)
