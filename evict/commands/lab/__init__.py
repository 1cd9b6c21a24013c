"""`evict lab …`: one module per experiment, each with add_parser(lab_sub) (the sweeps themselves are evict/lab/)."""

from __future__ import annotations

from evict.commands.lab import capacity, hybrid, pairs, state, stories


def add_parser(sub) -> None:
    lab = sub.add_parser("lab", help="the research lab's experiments (each with --quick and --full)")
    experiments = lab.add_subparsers(dest="experiment", required=True)
    for module in (state, capacity, pairs, stories, hybrid):
        module.add_parser(experiments)
