"""`evict …` subcommands."""

from __future__ import annotations

import logging
import os
import sys

from evict.cli_args import (Parser, UserError, add_gate_dt_flag, add_sweep_flags, batch_by_length, device,
                            first_line, out_of_memory, parse_overrides, positive_float, positive_int, writable_dir,
                            writable_file)


def _bench(args) -> None:
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.what == "ops" and args.device not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected 'cpu' or 'cuda', got {args.device!r}")
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    default = f"runs/bench/decode_{kind}.json" if args.what == "decode" else None  # ops writes JSON only with --out
    writable_file(args.out or default, "--out")  # checked before the benchmark, not after it
    if args.what == "ops":
        from evict.bench.ops import bench_cpu, bench_cuda

        if args.device == "cuda":
            bench_cuda(shapes=tuple(args.shapes), out=args.out, fla_backward=not args.no_fla_backward)
        elif args.device == "cpu":
            bench_cpu(lengths=tuple(args.lengths), out=args.out)
        else:
            raise SystemExit(f"--device: expected 'cpu' or 'cuda', got {args.device!r}")
    elif args.what == "decode":
        from evict.bench.decode import cli_run

        cli_run(args)
    elif args.what == "serve":
        from evict.bench.serve import run

        run(args)
    elif args.what == "train":
        from evict.bench.train import bench_train

        bench_train(archs=args.arch, setting=args.setting, d_model=args.d_model or 128, procs=args.procs,
                    steps=args.train_steps, variants=args.variants, out=args.out)


def _train(args) -> None:
    from evict.lab.train_cli import run_train

    run_train(args)


def _generate(args) -> None:
    from evict.lab.generate_cli import run_generate

    run_generate(args)


def _explore(args) -> None:
    from evict.explore.cli import run

    run(args)


def _serve(args) -> None:
    from evict.serve.cli import run_serve

    run_serve(args)


def _convert(args) -> None:
    from evict.convert.cli import run_convert

    run_convert(args)


def _demo(args) -> None:
    from evict.demo import run_demo

    run_demo()


def _size(args) -> None:
    from evict.models import accounting, presets

    writable_file(args.plot or f"runs/size/{'_vs_'.join(args.preset)}.png", "--plot")
    writable_file(args.json, "--json")
    cfgs = {}
    for name in args.preset:
        try:
            cfgs[name] = presets.get(name, size=args.size)
        except ValueError as e:
            raise SystemExit(f"preset: {e}") from None
    reports = [accounting.size_report(name, cfg, args.context, args.bytes) for name, cfg in cfgs.items()]
    print("\n\n".join(accounting.render(r) for r in reports))
    png = accounting.plot_memory(cfgs, args.context, args.plot or f"runs/size/{'_vs_'.join(cfgs)}.png", args.bytes)
    print(f"\nplot: {png}")
    if args.json:
        from evict.bench.common import write_json

        print(f"json: {write_json(args.json, {'reports': reports})}")


def _recall(args) -> None:
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


def build_parser() -> Parser:
    from evict import __version__

    p = Parser(prog="evict", description="Attention is an associative memory; a fixed-size memory must evict.")
    p.add_argument("--version", action="version", version=f"evict {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the memory op's worked examples, computed live")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    b.add_argument("what", choices=["ops", "decode", "train", "serve"])
    b.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or auto (ops: cpu or cuda)")
    b.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 2048, 4096])
    b.add_argument("--no-fla-backward", action="store_true", help="ops --device cuda: skip fla's fwd+bwd (it autotunes for minutes)")
    b.add_argument("--shapes", type=batch_by_length, nargs="+", default=[(4, 8192), (1, 32768)], metavar="BxT",
                   help="ops --device cuda: (batch, tokens) shapes at H16 D128 (default 4x8192 1x32768); the first is profiled")
    b.add_argument("--out", default=None, help="JSON output path")
    from evict.bench.decode import add_arguments as add_decode_arguments

    add_decode_arguments(b)
    from evict.bench.serve import add_arguments as add_serve_arguments

    add_serve_arguments(b)
    t = b.add_argument_group("train", "flags of `evict bench train` (GPU: N MQAR cells trained at once)")
    t.add_argument("--arch", nargs="+", default=["attention", "kda"], help="architectures (default attention kda)")
    t.add_argument("--setting", nargs=2, type=positive_int, default=[512, 64], metavar=("L", "K"), help="default 512 64")
    t.add_argument("--procs", type=positive_int, default=8, help="cells trained at once (default 8)")
    t.add_argument("--train-steps", type=positive_int, default=300, help="timed steps per cell (default 300)")
    t.add_argument("--variants", nargs="+", default=["before", "bf16", "labels", "graphs"])
    b.set_defaults(fn=_bench)
    r = sub.add_parser("recall", help="the recall lab: MQAR accuracy across memories as pairs grow (the main job)")
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
    r.set_defaults(fn=_recall)
    z = sub.add_parser("size", help="the accountant: parameters (total / active) and memory per sequence vs context")
    z.add_argument("preset", nargs="+", help="preset name(s), e.g. gpt2_124m kimi_linear_48b kimi_k3")
    z.add_argument("--size", default="tiny", choices=["tiny", "small"], help="for the trainable families (released shapes ignore it)")
    z.add_argument("--context", type=positive_int, nargs="+", default=[1024, 8192, 131072, 1048576])
    z.add_argument("--bytes", type=positive_int, default=2, help="bytes per KV / latent / conv number (S is float32 regardless)")
    z.add_argument("--plot", default=None, help="PNG path (default runs/size/<preset>.png)")
    z.add_argument("--json", default=None, help="JSON output path")
    z.set_defaults(fn=_size)
    from evict.convert import cli as convert_cli
    from evict.explore import cli as explore_cli
    from evict.lab import capacity_cli, generate_cli, hybrid_cli, pairs_cli, state_cli, switch_cli, train_cli
    from evict.serve import cli as serve_cli

    train_cli.add_parser(sub, _train)
    generate_cli.add_parser(sub, _generate)
    explore_cli.add_parser(sub, _explore)
    serve_cli.add_parser(sub, _serve)
    convert_cli.add_parser(sub, _convert)
    lab = sub.add_parser("lab", help="the research lab's experiments (each with --quick and --full)")
    experiments = lab.add_subparsers(dest="experiment", required=True)
    state_cli.add_parser(experiments)
    capacity_cli.add_parser(experiments)
    pairs_cli.add_parser(experiments)
    switch_cli.add_parser(experiments)
    hybrid_cli.add_parser(experiments)
    return p


def main(argv=None) -> int:
    """Run one subcommand. A user error (bad flag, value, path or file) is one line on stderr and exit code 2;
    EVICT_DEBUG=1 shows the traceback instead."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    name = {"bench": f"bench {getattr(args, 'what', '')}",
            "lab": f"lab {getattr(args, 'experiment', '')}"}.get(args.command, args.command)
    try:
        args.fn(args)
    except SystemExit as e:
        if isinstance(e, UserError) or isinstance(e.code, str):
            raise _fail(name, str(e)) from None
        raise
    except Exception as e:
        # user errors: bad values (ValueError), paths (OSError), sizes that do not fit (host or device memory), an
        # optional package not installed (ModuleNotFoundError; ours name the package and its pip line)
        user = isinstance(e, (ValueError, OSError, ModuleNotFoundError)) or out_of_memory(e)
        if not user or os.environ.get("EVICT_DEBUG") == "1":
            raise
        raise _fail(name, _describe(e)) from None
    return 0


def _describe(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    if out_of_memory(e):
        return f"out of memory ({first_line(e)}); try smaller sizes"
    return str(e) or type(e).__name__


def _fail(name: str, message: str) -> UserError:
    """Print `evict <name>: error: <message>` on one line to stderr; return the UserError (exit code 2) to raise."""
    message = " ".join(message.split()) or "failed"
    print(f"evict {name}: error: {message}", file=sys.stderr)
    return UserError(message)


if __name__ == "__main__":
    sys.exit(main())
