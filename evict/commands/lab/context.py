"""`evict lab context`: the ratio-against-context lab's flags (the sweep itself is evict/lab/context.py)."""

from __future__ import annotations

from evict.cli_args import add_gate_dt_flag, add_lab_parser, positive_int, run_lab


def run_context(args) -> None:
    from evict.lab import context

    run_lab(args, context, {"ratios": tuple(args.ratios) if args.ratios else None,
                            "kinds": tuple(args.kinds) if args.kinds else None,
                            "scales": tuple(args.scales) if args.scales else None, "n_layers": args.layers,
                            "train_len": args.train_len, "contexts": tuple(args.contexts) if args.contexts else None,
                            "decode_contexts": tuple(args.decode_contexts) if args.decode_contexts is not None else None,
                            "corpus": args.corpus, "gate_dt": tuple(args.gate_dt) if args.gate_dt else None,
                            "compile": False if args.no_compile else None})


def add_parser(lab_sub) -> None:
    """Register `evict lab context` on the `evict lab` subparsers object."""
    from evict.lab.hybrid import KINDS

    s = add_lab_parser(lab_sub, "context", help="KDA : attention ratio against context length and decode cost, at "
                       "matched training FLOPs",
                       description="Train KDA : attention stacks of several ratios on text at one short length, with\n"
                       "every model given the same training FLOPs, then read each at longer contexts (length\n"
                       "generalisation) beside its measured decode ms per token and cache bytes at each context;\n"
                       "two model widths, seeds.",
                       examples=("evict lab context --quick --out runs/lab_context",
                                 "evict lab context --ratios 1:0 3:1 0:1 --kinds mla attention --scales 32 --seeds 1"),
                       quick="4 layers, ratios 1:0 3:1 1:1 0:1 (MLA), d 16 and 32, trained at T 32 and read at "
                       "32-256, 2 seeds; ~200 CPU-seconds (~2 min on 2 idle cores)",
                       full="8 layers, ratios 1:0 7:1 3:1 1:1 0:1, MLA and attention, d 128 and 256, trained at T 256 "
                       "and read at 256-4096, 3 seeds; one GPU, ~90 min",
                       seeds_help="seeds per model; the table shows mean and range")
    s.add_argument("--ratios", nargs="+", metavar="A:B",
                   help="KDA:attention layers; the first one's --steps set every model's training FLOPs")
    s.add_argument("--kinds", nargs="+", choices=list(KINDS), help="the attention layers: mla, attention or both")
    s.add_argument("--scales", nargs="+", type=positive_int, metavar="D", help="model widths (d_model)")
    s.add_argument("--layers", type=positive_int, help="depth (a multiple of every ratio's group)")
    s.add_argument("--train-len", type=positive_int, metavar="T", help="training sequence length")
    s.add_argument("--contexts", nargs="+", type=positive_int, metavar="T",
                   help="lengths the models are read at (increasing, each >= --train-len); decode is timed there too")
    s.add_argument("--decode-contexts", nargs="*", type=positive_int, metavar="T",
                   help="longer contexts where only decode is timed")
    s.add_argument("--corpus", help="text file or folder (default Shakespeare)")
    s.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile of the blocks (--full compiles them)")
    add_gate_dt_flag(s, default="1e-3 1e-1 quick, 1e-4 1e-3 full")
    s.set_defaults(fn=run_context)
