"""`evict lab state`: the state-tracking lab's flags (the sweep itself is evict/lab/state.py)."""

from __future__ import annotations

import argparse

from evict.cli_args import add_lab_parser, run_lab


def run_state(args) -> None:
    from evict.lab import state

    run_lab(args, state, {"tasks": tuple(args.tasks) if args.tasks else None,
                          "models": tuple(args.models) if args.models else None})


def task_name(text: str) -> str:
    """--tasks' type: a task of evict/tasks/state.py (one of TASKS, count_mod<m>, dyck<k>); else argparse's one line."""
    from evict.tasks.state import check_task

    try:
        return check_task(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("task: ")) from None


def add_parser(lab_sub) -> None:
    """Register `evict lab state` on the `evict lab` subparsers object."""
    from evict.lab.state import MODELS
    from evict.tasks.state import TASKS

    s = add_lab_parser(lab_sub, "state", help="state tracking: parity, mod-5 arithmetic, S3/S5, counters; train short, test long",
                       description="Can a memory track state? Train each model on short sequences of parity, modular\n"
                       "arithmetic and S3 / S5 permutation products, test on longer ones (Grazzi et al., ICLR 2025):\n"
                       "the delta rule with beta in [0, 2] (the _neg models: negative eigenvalues) solves parity, with\n"
                       "beta in [0, 1] it cannot. --counters asks the same of bounded counters: a counter mod m\n"
                       "(count_mod3, count_mod5) and the depth of a Dyck-1 prefix of depth <= k (dyck4).",
                       examples=("evict lab state --quick --out runs/lab_state",
                                 "evict lab state --tasks parity --models deltanet deltanet_neg --steps 500",
                                 "evict lab state --counters --out runs/lab_state_counters",
                                 "evict lab state --tasks count_mod7 dyck8 --models deltanet deltanet_neg"),
                       quick="parity, 6 models, ~4 min on a 2-core CPU",
                       full="Grazzi et al.'s protocol: 5 tasks (modular arithmetic left to right and with × first), 8 models, 3 seeds; GPU",
                       seeds_help="seeds per cell; a cell is the best of them",
                       modes={"counters": "count_mod3 and dyck4; DeltaNet with beta in [0, 1] and [0, 2], linear "
                                          "attention; quick settings, ~5 min on a 2-core CPU",
                              "counters-full": "count_mod3, count_mod5, dyck4 at --full's protocol, 10,000 steps, 8 "
                                               "models, 3 seeds; GPU"})
    s.add_argument("--tasks", nargs="+", type=task_name, metavar="TASK",
                   help=f"from {', '.join(TASKS)}, count_mod<m> (a counter mod m, 2-100), dyck<k> (Dyck-1 depth <= k, 1-100)")
    s.add_argument("--models", nargs="+", choices=list(MODELS), help="a _neg suffix: beta in [0, 2] (neg_eigval)")
    s.set_defaults(fn=run_state)
