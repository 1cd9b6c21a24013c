"""`evict lab stories`: the eviction-stories lab's flags (the sweep itself is evict/lab/switch.py)."""

from __future__ import annotations

from evict.cli_args import add_lab_parser, positive_int, run_lab


def run_stories(args) -> None:
    from evict.lab import switch

    run_lab(args, switch, {"models": tuple(args.models) if args.models else None, "n_layers": args.layers})


def add_parser(lab_sub) -> None:
    """Register `evict lab stories` on the `evict lab` subparsers object."""
    from evict.lab.switch import MODELS

    s = add_lab_parser(lab_sub, "stories", help="the fade curve and twin boards at d = 4, then KDA vs Gated DeltaNet "
                       "trained on a context switch: which channels does each gate clear?",
                       quick="2 layers, one head of 16 channels, 1,500 steps, KDA and GDN, 2 seeds: 168 s of CPU",
                       full="2 layers, 2 heads of 64, 100 pairs, 10,000 steps, 3 seeds; GPU",
                       seeds_help="seeds per model; one row per seed")
    s.add_argument("--models", nargs="+", choices=list(MODELS))
    s.add_argument("--layers", type=positive_int, help="depth (the lesson's story is one layer; quick uses 2)")
    s.set_defaults(fn=run_stories)
