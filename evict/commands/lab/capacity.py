"""`evict lab capacity`: the capacity lab's flags (the sweep itself is evict/lab/capacity.py)."""

from __future__ import annotations

from evict.cli_args import add_lab_parser, positive_float, positive_int, run_lab

OVERWRITE = {"no": (False,), "yes": (True,), "both": (False, True)}


def run_capacity(args) -> None:
    from evict.lab import capacity, capacity_heads

    sizes, per_d = (tuple(args.sizes) if args.sizes else None), (tuple(args.per_d) if args.per_d else None)
    if sizes is not None and per_d is None:
        per_d = ()  # sizes given: they replace a preset's ladder in S/d
    elif per_d is not None and sizes is None:
        sizes = ()
    run_lab(args, capacity_heads if args.heads or args.heads_full else capacity, {"rules": tuple(args.rules) if args.rules else None, "sizes": sizes, "per_d": per_d,
                             "d_keys": tuple(args.d_keys) if args.d_keys else None, "threshold": args.threshold,
                             "overwrite": OVERWRITE.get(args.overwrite),
                             "layouts": tuple(args.layouts) if args.layouts else None})


def add_parser(lab_sub) -> None:
    """Register `evict lab capacity` on the `evict lab` subparsers object."""
    from evict.lab.capacity import RULES

    s = add_lab_parser(lab_sub, "capacity", help="Schlag et al.'s capacity regression: additive vs delta rule, S grows",
                       description="How many key -> value pairs can one fixed d_key x d_v memory hold before retrieval\n"
                       "breaks? Learn S keys' values through the memory op with the additive update (linear\n"
                       "attention) and with the delta rule as S grows (Schlag et al., 2021), with and without\n"
                       "overwrites; --law fits the break S* against d_key; --heads splits one total state\n"
                       "H x d_k x d_v into 1, 4 or 16 heads: does splitting buy or cost capacity?",
                       examples=("evict lab capacity --quick --out runs/lab_capacity",
                                 "evict lab capacity --law --out runs/lab_capacity_law",
                                 "evict lab capacity --heads --out runs/lab_capacity_heads",
                                 "evict lab capacity --heads --layouts 1x32 4x16 16x8 --sizes 16 32 64 128"),
                       quick="S 20-100, 2 rules, with and without overwrites, ~2.5 min on a 2-core CPU",
                       full="S up to 300, 10,000 steps, 3 seeds; GPU",
                       seeds_help="seeds per cell; the table shows mean and range",
                       modes={"law": "the break S* against d_key 16-128 (S from d/2 to 3d/2), unique keys, both rules, "
                                     "fit S* = c*d; ~10 min on a 2-core CPU",
                              "heads": "one state of 16x16 numbers as 1x16^2, 4x8^2, 16x4^2 heads, S 16, 32, 64, "
                                       "unique keys, both rules, 800 steps; ~3 min on a 2-core CPU (332 s of CPU)",
                              "heads-full": "one state of 128x128 as 1, 4, 16, 64 heads, S 64-1024, with and without "
                                            "overwrites, 5,000 steps, 3 seeds; GPU"})
    s.add_argument("--rules", nargs="+", choices=list(RULES))
    s.add_argument("--sizes", nargs="+", type=positive_int, metavar="S", help="numbers of distinct keys (>= 2)")
    s.add_argument("--overwrite", choices=list(OVERWRITE), help="S unique writes, 2S with overwrites, or both")
    s.add_argument("--d-keys", nargs="+", type=positive_int, metavar="D", help="key dims (default 64; --law 16-128)")
    s.add_argument("--per-d", nargs="+", type=positive_float, metavar="F",
                   help="instead of --sizes: S = round(F * d_key) at every key dim")
    s.add_argument("--threshold", type=positive_float, help="the loss above which a ladder has broken (default 0.05)")
    s.add_argument("--layouts", nargs="+", metavar="HxD",
                   help="instead of --d-keys: memories of H heads of head dim D, one total H*D*D (e.g. 1x64 4x32 16x16)")
    s.set_defaults(fn=run_capacity)
