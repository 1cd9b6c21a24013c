"""`evict lab capacity`: the capacity lab's flags (the sweep itself is evict/lab/capacity.py)."""

from __future__ import annotations

from evict.cli_args import add_sweep_flags, positive_float, positive_int, writable_dir


def run_capacity(args) -> None:
    from dataclasses import replace

    from evict.lab.capacity import FULL, QUICK, run_sweep

    writable_dir(args.out, "--out")
    overrides = {k: v for k, v in {
        "rules": tuple(args.rules) if args.rules else None, "sizes": tuple(args.sizes) if args.sizes else None,
        "overwrite": {"no": (False,), "yes": (True,), "both": (False, True)}.get(args.overwrite),
        "steps": args.steps, "lr": args.lr, "seeds": args.seeds, "workers": args.workers, "device": args.device,
    }.items() if v is not None}
    try:
        run_sweep(replace(FULL if args.full else QUICK, **overrides), out=args.out)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_parser(lab_sub) -> None:
    """Register `evict lab capacity` on the `evict lab` subparsers object."""
    from evict.lab.capacity import RULES

    s = lab_sub.add_parser("capacity", help="Schlag et al.'s capacity regression: additive vs delta rule as S grows")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: S 20-100, 2 rules, with and without overwrites")
    mode.add_argument("--full", action="store_true", help="S up to 300, 10,000 steps, 3 seeds; GPU")
    s.add_argument("--rules", nargs="+", choices=list(RULES))
    s.add_argument("--sizes", nargs="+", type=positive_int, metavar="S", help="numbers of distinct keys (>= 2)")
    s.add_argument("--overwrite", choices=["no", "yes", "both"], help="S unique writes, 2S with overwrites, or both")
    s.add_argument("--steps", type=positive_int)
    s.add_argument("--lr", type=positive_float)
    add_sweep_flags(s, seeds_help="seeds per cell; the table shows mean and range")
    s.set_defaults(fn=run_capacity)
