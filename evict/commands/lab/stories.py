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
                       description="The lesson's eviction stories: the fade curve and the twin boards computed by the op\n"
                       "at d = 4, then the same question asked of trained models on a context switch (facts, a\n"
                       "distractor, a switch marker, a new topic): which channels does a trained KDA layer's\n"
                       "per-channel gate clear at the switch, and does the fact survive where Gated DeltaNet's one\n"
                       "gate per head does not?",
                       examples=("evict lab stories --quick --out runs/lab_stories",
                                 "evict lab stories --models kda --seeds 1 --steps 500"),
                       quick="2 layers, one head of 16 channels, 1,500 steps, KDA and GDN, 2 seeds: 168 s of CPU",
                       full="2 layers, 2 heads of 64, 100 pairs, 10,000 steps, 3 seeds; GPU",
                       seeds_help="seeds per model; one row per seed")
    s.add_argument("--models", nargs="+", choices=list(MODELS))
    s.add_argument("--layers", type=positive_int, help="depth (the lesson's story is one layer; quick uses 2)")
    s.set_defaults(fn=run_stories)
