"""`evict recall`: the recall lab's flags (the sweep itself is evict/lab/recall.py)."""

from __future__ import annotations

from evict.cli_args import (add_gate_dt_flag, add_sweep_flags, described, parse_overrides, positive_float, positive_int,
                            writable_dir)


def run_recall(args) -> None:
    from dataclasses import replace

    from evict.lab.recall import FULL, QUICK, gate_dt_fields, model_set_fields, run_sweep

    writable_dir(args.out, "--out")
    sweep = FULL if args.full else QUICK
    overrides = {k: v for k, v in {
        "archs": tuple(args.archs) if args.archs else None,
        "settings": tuple(tuple(s) for s in args.setting) if args.setting else None,
        "d_models": tuple(args.d_model) if args.d_model else None,
        "lrs": tuple(args.lr) if args.lr else None,
        "steps": args.steps, "seeds": args.seeds, "seed": args.seed, "workers": args.workers, "device": args.device,
        "vocab_size": args.vocab,
        "compile": False if args.no_compile else None, "train_examples": args.train_examples,
        "gate_dt": tuple(args.gate_dt) if args.gate_dt else None, "model_set": parse_overrides(args.set) or None,
    }.items() if v is not None}
    sweep = replace(sweep, **overrides)  # a ValueError is a user error: main() makes it one line, exit 2
    gate_dt_fields(sweep.gate_dt)  # "gate_dt: expected MIN MAX with 0 < MIN <= MAX", before any model is built
    model_set_fields(sweep.model_set)  # --set's field names, likewise
    _check_recall_models(sweep)
    run_sweep(sweep, out=args.out, minutes=args.minutes)


def _check_recall_models(sweep) -> None:
    """Build every model config of the sweep now (cheap), so a bad width fails before the sweep folder is written."""
    from evict.lab.recall import model_config
    from evict.models import presets

    for arch in (a for a in sweep.archs if a in presets.FAMILIES):  # run_sweep names unknown ones
        for d in sweep.d_models:
            for L, _ in sweep.settings:
                try:
                    model_config(arch, d, sweep, L)
                except ValueError as e:  # the width, or a --set value, that this model cannot take
                    with_set = "".join(f", {k}={v!r}" for k, v in sweep.model_set.items())
                    raise ValueError(f"--d-model {d} ({arch}{with_set}): {e}") from None
                except TypeError as e:  # a --set value of the wrong type
                    raise ValueError(f"--set ({arch}, d {d}): {e}") from None


def add_parser(sub) -> None:
    r = sub.add_parser("recall", **described(
        "the recall lab: MQAR accuracy across memories as pairs grow (the main job)",
        "Train small models of every memory (attention, linear attention, DeltaNet, Gated DeltaNet, KDA, …) on\n"
        "multi-query associative recall (MQAR) at growing numbers of key-value pairs, and write a table, plots and\n"
        "a scorecard to --out. --quick runs in minutes on a CPU; --full is Zoology's grid on a GPU. A run\n"
        "checkpoints as it goes: the same command with the same --out continues it.",
        "evict recall --quick --out runs/recall",
        "evict recall --archs kda attention --setting 64 8 --d-model 32 --steps 300"))
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default: a few minutes on a 2-core CPU")
    mode.add_argument("--full", action="store_true", help="Zoology's grid: (L, K) up to (512, 64), d 64-256, 4 lrs; GPU")
    r.add_argument("--archs", nargs="+", help="architectures (preset families), default all seven")
    r.add_argument("--setting", nargs=2, type=positive_int, action="append", metavar=("L", "K"), help="(seq_len, pairs); repeatable")
    r.add_argument("--d-model", type=positive_int, nargs="+")
    r.add_argument("--lr", type=positive_float, nargs="+")
    r.add_argument("--steps", type=positive_int)
    r.add_argument("--vocab", type=positive_int)
    r.add_argument("--train-examples", type=positive_int, metavar="N",
                   help="train on one fixed set of N examples, reshuffled each epoch (Zoology's regime; default: fresh batches)")
    add_gate_dt_flag(r)
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a ModelConfig field laid over every model of the sweep, e.g. tie_embeddings=true; repeatable")
    add_sweep_flags(r, seeds_help="seeds per cell; the table shows mean and range (default 2 quick, 1 full)")
    r.add_argument("--minutes", type=positive_float, help="stop after about this long (runs checkpoint); rerun to continue")
    r.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile of the blocks (--full compiles them)")
    r.set_defaults(fn=run_recall)
