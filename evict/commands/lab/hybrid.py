"""`evict lab hybrid`: the hybrid lab's flags (the sweep itself is evict/lab/hybrid.py)."""

from __future__ import annotations

from evict.cli_args import add_gate_dt_flag, add_lab_parser, positive_int, run_lab


def run_hybrid(args) -> None:
    from evict.lab import hybrid

    placement_ratios = tuple(args.placement_ratios) if args.placement_ratios is not None else None
    if args.ratios and placement_ratios is None:  # the mode's placement ratios that are among the ratios asked for
        placement_ratios = tuple(r for r in (hybrid.FULL if args.full else hybrid.QUICK).placement_ratios if r in args.ratios)
    run_lab(args, hybrid, {"ratios": tuple(args.ratios) if args.ratios else None,
                           "kinds": tuple(args.kinds) if args.kinds else None, "placement_ratios": placement_ratios,
                           "tasks": tuple(args.tasks) if args.tasks else None,
                           "n_layers": args.layers, "d_model": args.d_model,
                           "seq_len": args.setting[0] if args.setting else None,
                           "pairs": args.setting[1] if args.setting else None, "corpus": args.corpus,
                           "gate_dt": tuple(args.gate_dt) if args.gate_dt else None,
                           "mqar_steps": args.mqar_steps or args.steps,  # --steps sets both tasks' schedules
                           "text_seeds": args.text_seeds,
                           "compile": False if args.no_compile else None})


def add_parser(lab_sub) -> None:
    """Register `evict lab hybrid` on the `evict lab` subparsers object."""
    from evict.lab.hybrid import KINDS, TASKS

    s = add_lab_parser(lab_sub, "hybrid", help="KDA : attention ratio and placement at equal parameters (Kimi Linear Table 1)",
                       description="How many full-attention layers does a KDA stack need, and where? Train stacks of\n"
                       "KDA and attention (MLA or plain) layers at several ratios and placements at equal parameters\n"
                       "on MQAR and on text, as in Kimi Linear's Table 1.",
                       examples=("evict lab hybrid --quick --out runs/lab_hybrid",
                                 "evict lab hybrid --ratios 3:1 1:1 --kinds mla --tasks mqar"),
                       quick="4 layers: ratios 1:0 3:1 1:1 0:1, MLA and attention, placements at 1:1; "
                       "MQAR L 32 K 8 and Shakespeare (T 32); ~4.5 min on 2 cores",
                       full="16 layers: ratios 1:0 15:1 7:1 3:1 1:1 0:1, placements at 3:1; MQAR L 512 K 64; GPU",
                       seeds_help="seeds per cell; the table shows mean and range")
    s.add_argument("--ratios", nargs="+", metavar="A:B", help="KDA:attention layers, e.g. 1:0 15:1 7:1 3:1 1:1 0:1")
    s.add_argument("--kinds", nargs="+", choices=list(KINDS), help="the attention layers: mla, attention or both")
    s.add_argument("--placement-ratios", nargs="*", metavar="A:B", help="ratios that also run early and late (none: spread only)")
    s.add_argument("--tasks", nargs="+", choices=TASKS)
    s.add_argument("--layers", type=positive_int, help="depth (a multiple of every ratio's group)")
    s.add_argument("--d-model", type=positive_int)
    s.add_argument("--setting", nargs=2, type=positive_int, metavar=("L", "K"), help="MQAR sequence length and pairs")
    s.add_argument("--corpus", help="text file or folder for the text task (default Shakespeare)")
    s.add_argument("--mqar-steps", type=positive_int, metavar="N",
                   help="MQAR's schedule length (it stops at 0.99 accuracy; default: --steps, else the mode's: --full 8000)")
    s.add_argument("--text-seeds", type=positive_int, metavar="N",
                   help="seeds of the text runs when more than --seeds (--full: 3, where each MQAR cell has one)")
    s.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile of the blocks (--full compiles them)")
    add_gate_dt_flag(s, default="1e-3 1e-1 quick, 1e-4 1e-3 full")
    s.set_defaults(fn=run_hybrid)
