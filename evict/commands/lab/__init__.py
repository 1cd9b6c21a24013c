"""`evict lab …`: one module per experiment, each with add_parser(lab_sub) (the sweeps themselves are evict/lab/)."""

from __future__ import annotations

from evict.cli_args import described
from evict.commands.lab import capacity, context, hybrid, pairs, state, stories, ttt


def add_parser(sub) -> None:
    lab = sub.add_parser("lab", **described(
        "the research lab's experiments (each with --quick and --full)",
        "The research lab: each experiment is a sweep of small training runs (or of the memory op itself) that\n"
        "writes a table, plots and a scorecard to --out. --quick runs in minutes on a CPU; --full is the published\n"
        "protocol on a GPU. A run checkpoints as it goes: the same command with the same --out continues it.",
        "evict lab state --quick --out runs/lab_state",
        "evict lab pairs --full --minutes 30 --out runs/lab_pairs"))
    experiments = lab.add_subparsers(dest="experiment", required=True)
    for module in (state, capacity, pairs, stories, hybrid, context, ttt):
        module.add_parser(experiments)
