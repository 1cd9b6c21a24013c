"""`evict lab state`: the state-tracking lab's flags (the sweep itself is evict/lab/state.py)."""

from __future__ import annotations

from evict.cli_args import add_lab_parser, run_lab


def run_state(args) -> None:
    from evict.lab import state

    run_lab(args, state, {"tasks": tuple(args.tasks) if args.tasks else None,
                          "models": tuple(args.models) if args.models else None})


def add_parser(lab_sub) -> None:
    """Register `evict lab state` on the `evict lab` subparsers object."""
    from evict.lab.state import MODELS
    from evict.tasks.state import TASKS

    s = add_lab_parser(lab_sub, "state", help="state tracking: parity, mod-5 arithmetic, S3/S5; train short, test long",
                       description="Can a memory track state? Train each model on short sequences of parity, modular\n"
                       "arithmetic and S3 / S5 permutation products, test on longer ones (Grazzi et al., ICLR 2025):\n"
                       "the delta rule with beta in [0, 2] (the _neg models: negative eigenvalues) solves parity, with\n"
                       "beta in [0, 1] it cannot.",
                       examples=("evict lab state --quick --out runs/lab_state",
                                 "evict lab state --tasks parity --models deltanet deltanet_neg --steps 500"),
                       quick="parity, 6 models, ~4 min on a 2-core CPU",
                       full="Grazzi et al.'s protocol: 5 tasks (modular arithmetic left to right and with × first), 8 models, 3 seeds; GPU",
                       seeds_help="seeds per cell; a cell is the best of them")
    s.add_argument("--tasks", nargs="+", choices=TASKS)
    s.add_argument("--models", nargs="+", choices=list(MODELS), help="a _neg suffix: beta in [0, 2] (neg_eigval)")
    s.set_defaults(fn=run_state)
