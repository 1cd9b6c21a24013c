"""`evict size`: the accountant's flags (the accounting itself is evict/models/accounting.py)."""

from __future__ import annotations

from evict.cli_args import described, positive_int, writable_file


def run_size(args) -> None:
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
        from evict.report import write_json

        print(f"json: {write_json(args.json, {'reports': reports})}")


def add_parser(sub) -> None:
    z = sub.add_parser("size", **described(
        "the accountant: parameters (total / active) and memory per sequence vs context",
        "Count a preset's parameters (total, active per token, by kind) and the memory one sequence holds at each\n"
        "context length (KV cache, MLA latents, recurrent states), on the meta device: nothing is allocated, so\n"
        "released shapes such as Kimi K3 cost nothing. Prints a table per preset and writes a log-log plot.",
        "evict size gpt2_124m kimi_linear_48b --context 8192 1048576",
        "evict size kda attention --size small --json runs/size/kda.json"))
    z.add_argument("preset", nargs="+", help="preset name(s), e.g. gpt2_124m kimi_linear_48b kimi_k3")
    z.add_argument("--size", default="tiny", choices=["tiny", "small"], help="for the trainable families (released shapes ignore it)")
    z.add_argument("--context", type=positive_int, nargs="+", default=[1024, 8192, 131072, 1048576])
    z.add_argument("--bytes", type=positive_int, default=2, help="bytes per KV / latent / conv number (S is float32 regardless)")
    z.add_argument("--plot", default=None, help="PNG path (default runs/size/<preset>.png)")
    z.add_argument("--json", default=None, help="JSON output path")
    z.set_defaults(fn=run_size)
