"""`evict lab state`: the state-tracking lab's flags (the sweep itself is evict/lab/state.py)."""

from __future__ import annotations

from evict.cli_args import add_sweep_flags, positive_float, positive_int, writable_dir


def run_state(args) -> None:
    from dataclasses import replace

    from evict.lab.state import FULL, QUICK, run_sweep

    writable_dir(args.out, "--out")
    overrides = {k: v for k, v in {
        "tasks": tuple(args.tasks) if args.tasks else None, "models": tuple(args.models) if args.models else None,
        "steps": args.steps, "lr": args.lr, "seeds": args.seeds, "workers": args.workers, "device": args.device,
    }.items() if v is not None}
    try:
        run_sweep(replace(FULL if args.full else QUICK, **overrides), out=args.out)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_parser(lab_sub) -> None:
    """Register `evict lab state` on the `evict lab` subparsers object."""
    from evict.lab.state import MODELS
    from evict.tasks.state import TASKS

    s = lab_sub.add_parser("state", help="state tracking: parity, mod-5 arithmetic, S3/S5; train short, test long")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: parity, 6 models, ~4 min on a 2-core CPU")
    mode.add_argument("--full", action="store_true", help="Grazzi et al.'s protocol: 4 tasks, 8 models, 3 seeds; GPU")
    s.add_argument("--tasks", nargs="+", choices=TASKS)
    s.add_argument("--models", nargs="+", choices=list(MODELS), help="a _neg suffix: beta in [0, 2] (neg_eigval)")
    s.add_argument("--steps", type=positive_int)
    s.add_argument("--lr", type=positive_float)
    add_sweep_flags(s, seeds_help="seeds per cell; a cell is the best of them")
    s.set_defaults(fn=run_state)
