"""`evict bench ops|decode|serve|train`: one parser per benchmark, each with only its own flags (the benchmarks
themselves are evict/bench/)."""

from __future__ import annotations

from evict.cli_args import batch_by_length, device, positive_int, writable_file


def _resolve_device(args) -> str:
    """--device auto -> cuda if available, else cpu; the result's kind ('cpu' or 'cuda')."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if args.device.startswith("cuda") else "cpu"


def run_ops(args) -> None:
    _resolve_device(args)
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected 'cpu' or 'cuda', got {args.device!r}")
    writable_file(args.out, "--out")  # checked before the benchmark, not after it; ops writes JSON only with --out
    from evict.bench.ops import bench_cpu, bench_cuda

    if args.device == "cuda":
        bench_cuda(shapes=tuple(args.shapes), out=args.out, fla_backward=not args.no_fla_backward)
    else:
        bench_cpu(lengths=tuple(args.lengths), out=args.out)


def run_decode(args) -> None:
    kind = _resolve_device(args)
    writable_file(args.out or f"runs/bench/decode_{kind}.json", "--out")
    from evict.bench.decode import cli_run

    cli_run(args)


def run_serve(args) -> None:
    _resolve_device(args)
    writable_file(args.out, "--out")
    from evict.bench.serve import run

    run(args)


def run_train(args) -> None:
    writable_file(args.out, "--out")
    from evict.bench.train import bench_train

    bench_train(archs=args.arch, setting=args.setting, d_model=args.d_model, procs=args.procs,
                steps=args.train_steps, variants=args.variants, out=args.out)


def _device_and_out(p, device_help: str = "cpu, cuda, cuda:N or auto") -> None:
    p.add_argument("--device", type=device, default="cpu", help=device_help)
    p.add_argument("--out", default=None, help="JSON output path")


def add_parser(sub) -> None:
    from evict.bench.decode import add_arguments as add_decode_arguments
    from evict.bench.serve import add_arguments as add_serve_arguments

    b = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    benches = b.add_subparsers(dest="what", required=True)

    o = benches.add_parser("ops", help="the memory op's forms timed against each other (CPU; CUDA against fla and SDPA)")
    _device_and_out(o, "cpu, cuda or auto")
    o.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 2048, 4096], help="CPU: tokens")
    o.add_argument("--no-fla-backward", action="store_true", help="--device cuda: skip fla's fwd+bwd (it autotunes for minutes)")
    o.add_argument("--shapes", type=batch_by_length, nargs="+", default=[(4, 8192), (1, 32768)], metavar="BxT",
                   help="--device cuda: (batch, tokens) shapes at H16 D128 (default 4x8192 1x32768); the first is profiled")
    o.set_defaults(fn=run_ops)

    d = benches.add_parser("decode", help="time per output token vs context, each memory kind at equal width and depth")
    _device_and_out(d)
    add_decode_arguments(d)
    d.set_defaults(fn=run_decode)

    s = benches.add_parser("serve", help="load an `evict serve` server: throughput, latency, and equality with decoding alone")
    _device_and_out(s)
    add_serve_arguments(s)
    s.set_defaults(fn=run_serve)

    t = benches.add_parser("train", help="GPU: N MQAR cells trained at once (cell-steps per second per variant)")
    t.add_argument("--out", default=None, help="JSON output path")
    t.add_argument("--arch", nargs="+", default=["attention", "kda"], help="architectures (default attention kda)")
    t.add_argument("--setting", nargs=2, type=positive_int, default=[512, 64], metavar=("L", "K"), help="default 512 64")
    t.add_argument("--d-model", type=positive_int, default=128, help="the models' width")
    t.add_argument("--procs", type=positive_int, default=8, help="cells trained at once (default 8)")
    t.add_argument("--train-steps", type=positive_int, default=300, help="timed steps per cell (default 300)")
    t.add_argument("--variants", nargs="+", default=["before", "bf16", "labels", "graphs"])
    t.set_defaults(fn=run_train)
