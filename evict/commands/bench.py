"""`evict bench ops|decode|serve|train`: the benchmarks' flags and dispatch (the benchmarks are evict/bench/)."""

from __future__ import annotations

from evict.bench.model import MODES, NAMED
from evict.cli_args import batch_by_length, device, positive_int, writable_file


def run_bench(args) -> None:
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
    elif args.what == "train" and args.lm:
        from evict.bench.model import bench_model

        bench_model(models=tuple(args.lm), size=args.lm_size, batch=args.batch_size, seq_len=args.seq_len,
                    modes=tuple(args.modes), references=not args.no_reference, warmup=args.warmup_steps,
                    steps=args.timed_steps, checkpoint_blocks=args.checkpoint_blocks, device=args.device,
                    out=args.out)
    elif args.what == "train":
        from evict.bench.train import bench_train

        bench_train(archs=args.arch, setting=args.setting, d_model=args.d_model or 128, procs=args.procs,
                    steps=args.train_steps, variants=args.variants, out=args.out)


def add_parser(sub) -> None:
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
    m = b.add_argument_group("train --lm", "flags of `evict bench train --lm` (one LM's training step beside "
                                           "transformers' / fla's: tokens/s, peak memory, MFU; evict/bench/model.py)")
    m.add_argument("--lm", nargs="+", metavar="NAME",
                   help=f"model-level bench of these: {', '.join(NAMED)} or any preset (at --lm-size)")
    m.add_argument("--lm-size", choices=["tiny", "small"], default="tiny", help="presets' size (default tiny)")
    m.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default 4)")
    m.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (default 4096)")
    m.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager"], help="eager and / or compiled")
    m.add_argument("--no-reference", action="store_true", help="skip transformers' / fla's model beside evict's")
    m.add_argument("--warmup-steps", type=positive_int, default=3, help="untimed steps first (default 3)")
    m.add_argument("--timed-steps", type=positive_int, default=10, help="timed steps (default 10)")
    m.add_argument("--checkpoint-blocks", action="store_true", help="evict's model with activation checkpointing")
    b.set_defaults(fn=run_bench)
