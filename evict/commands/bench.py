"""`evict bench ops|decode|serve|train`: one parser per benchmark, each with only its own flags (the benchmarks
themselves are evict/bench/)."""

from __future__ import annotations

from evict.cli_args import UserError, batch_by_length, described, device, positive_int, seed, writable_file


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


def run_grid(args) -> None:
    from pathlib import Path

    from evict.bench import grid as g

    kind = _resolve_device(args)
    out = Path(args.out or f"runs/bench/grid_{kind}.jsonl")
    table, png = out.with_suffix(".md"), out.with_suffix(".png")
    for path, flag in ((out, "--out"), (table, "--out (its .md table)"), (png, "--out (its .png plot)")):
        writable_file(path, flag)
    rows = g.read_rows(out)  # a malformed file is refused before any cell runs
    if args.report:
        if not rows:
            raise UserError(f"--report: {out} has no rows (expected a grid JSONL written by `evict bench grid`)")
    else:
        grid = _grid_flags(args)
        rows = g.run_grid(out, device=args.device, max_math_tokens=args.max_math_tokens, **grid)
    from evict.bench.grid_report import crossover_table, grid_table, plot_grid

    text = (f"# Kernel grid: {out.name}\n\nms per cell (median); memory kernels at their fastest chunk C\n\n"
            f"{grid_table(rows)}\n\nCrossover: the N from which each memory kernel is faster than each attention "
            f"kernel\n\n{crossover_table(rows)}\n")
    table.write_text(text)
    print(text)
    print(f"wrote {out}, {table}, {plot_grid(rows, png)}")


def run_claims(args) -> None:
    _resolve_device(args)
    if args.device not in ("cpu", "cuda"):
        raise UserError(f"--device: expected 'cpu' or 'cuda', got {args.device!r}")
    if args.full and (args.device != "cuda" or "attn_res_train" not in args.claims):
        raise UserError("--full: expected --device cuda and --claims attn_res_train (the GPU scale of that claim; "
                        f"got --device {args.device}, --claims {' '.join(args.claims)})")
    from pathlib import Path

    for flag, given in (("--seeds", args.seeds is not None), ("--resume", args.resume)):
        if given and "attn_res_train" not in args.claims:
            raise UserError(f"{flag}: expected --claims attn_res_train (its seeds; got --claims {' '.join(args.claims)})")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        raise UserError(f"--seeds: expected distinct seeds, got {' '.join(map(str, args.seeds))}")
    if args.resume and not args.out:
        raise UserError("--resume: expected --out (the JSON whose attn_res_train seeds are kept)")
    if args.out:
        writable_file(args.out, "--out")
        writable_file(Path(args.out).with_suffix(".md"), "--out (its .md beside it)")
    earlier = _earlier_attn_res(Path(args.out), args) if args.resume and Path(args.out).exists() else None
    from evict.bench.claims import run_claims as run

    run(tuple(dict.fromkeys(args.claims)), device=args.device, compile=not args.no_compile, modes=tuple(args.modes),
        out=args.out, full=args.full, seeds=args.seeds, earlier=earlier)


def _earlier_attn_res(path, args) -> dict:
    """--resume: the attn_res_train result in the existing --out, checked against this command's setting before
    anything trains (a file that is not one, or of another setting, is one line)."""
    import json

    from evict.bench import claims_train as ct

    try:
        earlier = json.loads(path.read_text())["attn_res_train"]
        kept = ct.kept_seeds(ct.setting(args.full, args.device, args.seeds), earlier)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"--resume: {path} is not an `evict bench claims` JSON with attn_res_train runs "
                        f"({type(e).__name__})") from None
    except ValueError as e:
        raise UserError(f"--resume: {path}: {e}") from None
    print(f"--resume: seeds {', '.join(map(str, kept)) or 'none'} kept from {path}")
    return earlier


def _claims_arguments(o) -> None:
    from evict.bench.claims import CLAIMS, DEFAULT

    o.add_argument("--claims", nargs="+", choices=CLAIMS, default=list(DEFAULT), metavar="CLAIM",
                   help=f"of {', '.join(CLAIMS)} (default {' '.join(DEFAULT)}; params and decode are exact on any "
                        "machine, attn_res / situ / dplr timed, attn_res_train trains: minutes)")
    o.add_argument("--full", action="store_true",
                   help="attn_res_train at its GPU scale (12 layers of d 384, 3,000 steps, 3 seeds) instead of the "
                        "quick CPU one")
    o.add_argument("--seeds", nargs="+", type=seed, metavar="SEED",
                   help="attn_res_train: these seeds instead of the mode's (quick 0 1, full 0 1 2)")
    o.add_argument("--resume", action="store_true",
                   help="attn_res_train: keep the whole seeds of the existing --out (same setting) and train only the "
                        "others; the result holds both (a --full run a seed or two per call)")
    o.add_argument("--no-compile", action="store_true", help="situ: time the eager (unfused) form only")
    o.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager"],
                   help="attn_res: the training step eager and / or with each block compiled")


def _grid_flags(args) -> dict:
    """The grid's axes: explicit flags, else --quick's subset, else the full grid; --tokens must hold whole sequences."""
    from evict.bench import grid as g

    base = g.QUICK if args.quick else {"lengths": g.LENGTHS, "head_dims": g.HEAD_DIMS, "chunks": g.CHUNKS}
    out = {k: tuple(getattr(args, k) or base[k]) for k in ("lengths", "head_dims", "chunks")}
    bad = [n for n in out["lengths"] if args.tokens % n]
    if bad:
        raise UserError(f"--tokens: expected a multiple of every --lengths value (B = tokens / N), got {args.tokens} "
                        f"with N = {', '.join(map(str, bad))}")
    wrong = [c for c in out["chunks"] if c & (c - 1) or c > 1024]
    if wrong:
        raise UserError(f"--chunks: expected powers of two up to 1024, got {', '.join(map(str, wrong))}")
    return {**out, "kernels": tuple(args.kernels), "passes": tuple(args.passes), "tokens": args.tokens, "heads": args.heads}


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
    if args.lm:
        from evict.bench.model import bench_model

        _resolve_device(args)
        bench_model(models=tuple(args.lm), size=args.lm_size, batch=args.batch_size, seq_len=args.seq_len,
                    modes=tuple(args.modes), references=not args.no_reference, warmup=args.warmup_steps,
                    steps=args.timed_steps, checkpoint_blocks=args.checkpoint_blocks, device=args.device,
                    out=args.out, profile=args.profile or 0)
        return
    from evict.bench.train import bench_train

    bench_train(archs=args.arch, setting=args.setting, d_model=args.d_model, procs=args.procs,
                steps=args.train_steps, variants=args.variants, out=args.out)


def _ops_arguments(o) -> None:
    o.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 2048, 4096], help="CPU: tokens")
    o.add_argument("--no-fla-backward", action="store_true", help="--device cuda: skip fla's fwd+bwd (it autotunes for minutes)")
    o.add_argument("--shapes", type=batch_by_length, nargs="+", default=[(4, 8192), (1, 32768)], metavar="BxT",
                   help="--device cuda: (batch, tokens) shapes at H16 D128 (default 4x8192 1x32768); the first is profiled")


def _grid_arguments(o) -> None:
    from evict.bench import grid as g

    o.add_argument("--quick", action="store_true", help=f"the subset N {' '.join(map(str, g.QUICK['lengths']))}, "
                   f"D {' '.join(map(str, g.QUICK['head_dims']))}, C {' '.join(map(str, g.QUICK['chunks']))} "
                   "(flags given explicitly still win)")
    o.add_argument("--lengths", type=positive_int, nargs="+", help=f"N, tokens per sequence (full: {' '.join(map(str, g.LENGTHS))})")
    o.add_argument("--head-dims", type=positive_int, nargs="+", help=f"head dims D (full: {' '.join(map(str, g.HEAD_DIMS))})")
    o.add_argument("--chunks", type=positive_int, nargs="+", help=f"the memory kernels' chunk C (full: {' '.join(map(str, g.CHUNKS))})")
    o.add_argument("--kernels", nargs="+", choices=g.KERNELS, default=list(g.DEFAULT_KERNELS), metavar="KERNEL",
                   help=f"of {', '.join(g.KERNELS)}")
    o.add_argument("--passes", nargs="+", choices=g.PASSES, default=list(g.PASSES), help="fwd and / or fwd+bwd")
    o.add_argument("--tokens", type=positive_int, default=g.TOKENS, help="B x N in every cell")
    o.add_argument("--heads", type=positive_int, default=g.HEADS, help="heads H")
    o.add_argument("--max-math-tokens", type=positive_int, default=16384,
                   help="sdpa_math: skip N above this (it materializes N x N scores)")
    o.add_argument("--report", action="store_true", help="time nothing: rebuild the table and plot from --out's rows")


def _train_arguments(t) -> None:
    t.add_argument("--arch", nargs="+", default=["attention", "kda"], help="architectures (default attention kda)")
    t.add_argument("--setting", nargs=2, type=positive_int, default=[512, 64], metavar=("L", "K"), help="default 512 64")
    t.add_argument("--d-model", type=positive_int, default=128, help="the models' width")
    t.add_argument("--procs", type=positive_int, default=8, help="cells trained at once (default 8)")
    t.add_argument("--train-steps", type=positive_int, default=300, help="timed steps per cell (default 300)")
    t.add_argument("--variants", nargs="+", default=["before", "bf16", "labels", "graphs"])
    from evict.bench.model import MODES, NAMED

    m = t.add_argument_group("--lm", "one LM's training step beside transformers' / fla's: tokens/s, peak memory, MFU "
                                     "(evict/bench/model.py)")
    m.add_argument("--lm", nargs="+", metavar="NAME",
                   help=f"model-level bench of these: {', '.join(NAMED)} or any preset (at --lm-size)")
    m.add_argument("--lm-size", choices=["tiny", "small"], default="tiny", help="presets' size (default tiny)")
    m.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default 4)")
    m.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (default 4096)")
    m.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager"], help="eager, compiled (the default compiled form: lean), compiled-lean (blocks keeping less for the backward) and / or compiled-keep (the keep-all compiled form)")
    m.add_argument("--no-reference", action="store_true", help="skip transformers' / fla's model beside evict's")
    m.add_argument("--warmup-steps", type=positive_int, default=3, help="untimed steps first (default 3)")
    m.add_argument("--timed-steps", type=positive_int, default=10, help="timed steps (default 10)")
    m.add_argument("--checkpoint-blocks", action="store_true", help="evict's model with activation checkpointing")
    m.add_argument("--profile", type=positive_int, metavar="N",
                   help="also profile one step of every row: its top N kernels by device time (printed; in the JSON)")


def _benches() -> dict:
    """name -> (run, its own flags, --device's help or None for no --device, described(...)'s arguments)."""
    from evict.bench.decode import add_arguments as decode_arguments
    from evict.bench.serve import add_arguments as serve_arguments

    return {
        "ops": (run_ops, _ops_arguments, "cpu, cuda or auto", (
            "the memory op's forms timed against each other (CPU; CUDA against fla and SDPA)",
            "CPU: the token-by-token reference against the chunked PyTorch form, for the lesson's rules, at each "
            "--lengths. CUDA: the Triton kernels' decode step, forward and forward+backward (KDA, Gated DeltaNet) in "
            "bf16 against fla (when installed) and SDPA flash attention, each row also as a fraction of the roofline.",
            "evict bench ops --lengths 256 1024",
            "evict bench ops --device cuda --no-fla-backward --shapes 4x8192 --out runs/bench/ops_cuda.json")),
        "grid": (run_grid, _grid_arguments, "cpu, cuda or auto", (
            "the kernel table: memory op vs SDPA attention over N, head dim, chunk; crossover N",
            "Time every cell of the grid N x head dim D x chunk C x pass (fwd, fwd+bwd): evict's KDA and Gated DeltaNet "
            "(Triton on CUDA, the chunked form on a CPU), fla's (optional oracle, CUDA, when installed) and causal "
            "softmax attention through SDPA with one backend forced at a time (flash, cuDNN; efficient and math on "
            "request), recording the aten op that actually ran. B = --tokens / N, so every cell does the same tokens. "
            "One JSONL row per cell in --out (default runs/bench/grid_DEVICE.jsonl), appended as it ends: cells "
            "already there are skipped (resumable); cells that would not fit are skipped, an out-of-memory or a "
            "refused shape is recorded, and the grid goes on. Writes the table and the crossover N (where each "
            "memory kernel gets faster than each attention kernel) beside it as .md, and a .png plot.",
            "evict bench grid --device cuda --quick --out runs/bench/grid_quick.jsonl",
            "evict bench grid --device cuda --out results/bench/grid/grid_h100.jsonl",
            "evict bench grid --lengths 256 1024 --head-dims 64 --chunks 32 64 --tokens 4096 --heads 4",
            "evict bench grid --report --out results/bench/grid/grid_h100.jsonl")),
        "claims": (run_claims, _claims_arguments, "cpu, cuda or auto", (
            "the lesson's numeric claims beside what evict computes or measures",
            "params: KDA's parameters over Gated DeltaNet's, term by term, at the released shapes (exact). decode: the "
            "3:1 hybrid against all-MLA and attention in the committed decode runs (exact, from results/bench/decode). "
            "attn_res: a training step with and without AttnRes. situ: SiTU's activation eager (unfused) against "
            "torch.compile (fused), SwiGLU beside it. dplr: KDA's chunked kernel against fla's general DPLR op fed "
            "the same recurrence. The timed claims count on CUDA only; on a CPU they run at tiny sizes as a smoke "
            "test. attn_res_train (only when named): the same small LM with and without AttnRes at counted compute "
            "over seeds, against Kimi's 1.25x compute advantage (quick: CPU minutes; --full: one GPU). Writes JSON to "
            "--out and the tables as .md beside it.",
            "evict bench claims --claims params decode --out results/bench/claims/exact.json",
            "evict bench claims --device cuda --claims attn_res situ dplr --modes eager compiled "
            "--out results/bench/claims/timed_h100.json",
            "evict bench claims --claims attn_res_train --out results/bench/claims/attn_res_train_quick.json",
            "evict bench claims --device cuda --claims attn_res_train --full --seeds 1 --resume "
            "--out results/bench/claims/attn_res_train_full.json")),
        "decode": (run_decode, decode_arguments, "cpu, cuda, cuda:N or auto", (
            "time per output token vs context, each memory kind at equal width and depth",
            "Time one decode step of attention, MLA, KDA, the 3:1 hybrid and k3_mini models of equal width and depth "
            "at each context length (a cache filled to that length), at batch 1 and at the largest batch whose cache "
            "fits; report time per token and cache bytes per sequence, and write JSON (default runs/bench/).",
            "evict bench decode --contexts 256 1024 4096",
            "evict bench decode --device cuda --paths before graph --models kda hybrid")),
        "serve": (run_serve, serve_arguments, "cpu, cuda, cuda:N or auto", (
            "load an `evict serve` server: throughput, latency, and equality with decoding alone",
            "Send --requests completions (at most --clients in flight, Poisson arrivals at --rate) to a server: the "
            "one at --url, or one started here from --model / --preset with `evict serve`'s engine flags. Report "
            "tokens per second and latency percentiles, and check that --check greedy answers equal each request "
            "decoded alone.",
            "evict bench serve --preset kda --requests 32 --clients 8",
            "evict bench serve --url http://127.0.0.1:8000 --requests 64 --rate 4")),
        "train": (run_train, _train_arguments, "--lm: cpu, cuda or auto (the MQAR cells always run on CUDA)", (
            "GPU: N MQAR cells trained at once, or (--lm) one LM's step beside transformers' / fla's",
            "Train --procs MQAR cells of the recall lab at once on one GPU (the way `evict recall --full` fills a "
            "card) and report cell-steps per second for each training-step variant: before, bf16, labels (head and "
            "loss at the labelled positions only), graphs (the step replayed from one CUDA graph), compiled.\n\n"
            "With --lm NAME: one language model's training step (bf16 autocast, fused AdamW, loss on every "
            "position), eager and / or compiled, beside transformers' GPT-2 or fla's KDA model when installed: "
            "tokens per second after warm-up, peak memory and MFU in one table.",
            "evict bench train --arch kda --procs 4 --train-steps 100 --variants before graphs",
            "evict bench train --lm kda_226m gpt2_124m --modes eager compiled --device cuda")),
    }


def add_parser(sub) -> None:
    b = sub.add_parser("bench", **described(
        "benchmarks (print a table, write JSON)",
        "Benchmarks, each timing forms side by side in one run and recording the card, versions and flags with "
        "the numbers: ops (the memory op's forms), grid (the kernel table over N, head dim, chunk), claims (the lesson's numbers), decode (time per token vs context), serve (a server under "
        "load), train (N small training runs at once on one GPU). `evict bench NAME --help` lists its flags.",
        "evict bench ops --device cuda --out runs/bench/ops.json",
        "evict bench decode --models kda attention --contexts 1024 4096"))
    benches = b.add_subparsers(dest="what", required=True)
    for name, (run, own_arguments, device_help, text) in _benches().items():
        p = benches.add_parser(name, **described(*text))
        if device_help is not None:
            p.add_argument("--device", type=device, default="cpu", help=device_help)
        p.add_argument("--out", default=None, help="JSONL rows, appended (resumable)" if name == "grid" else "JSON output path")
        own_arguments(p)
        p.set_defaults(fn=run)
