"""`evict serve`: load a model (a folder saved by `evict train`, or a preset with random weights for load tests) and
serve it over HTTP. Flags are checked before the model is loaded; bad values end in one line, exit 2."""

from __future__ import annotations

import argparse
import re

import torch

from evict.cli_args import device as device_type
from evict.cli_args import positive_int, seed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def byte_size(text: str) -> int:
    """'512M', '8G', '1.5G', '65536' (bytes; K / M / G / T are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M, 8G or a number of bytes, got {text!r}")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))


def preset_names() -> list[str]:
    from evict.models import presets

    return list(presets.FAMILIES) + ["hybrid"]


def preset_config(name: str, size: str, overrides: list[str] | None):
    """A preset's config ('hybrid' = the kda preset in Kimi Linear's KKKM pattern, last layer MLA, dense FFN: the
    same width and depth as 'attention'), with --set KEY=VALUE overrides."""
    from evict.bench.decode import model_configs
    from evict.cli_args import parse_overrides
    from evict.models import presets

    try:
        if name == "hybrid":
            return model_configs(("hybrid",), size=size, width=parse_overrides(overrides))["hybrid"]
        return presets.get(name, size=size, **parse_overrides(overrides))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--preset {name}: {e}") from None


def load_served(args, dev: torch.device):
    """(model, tokenizer, name) from --model or --preset; the preset's weights are random (seeded), its tokenizer bytes."""
    if args.model is not None:
        from evict.commands.generate import load_model, resolve_model_dir

        model, tok = load_model(args.model, dev)
        name = resolve_model_dir(args.model).resolve().parent.name
    else:
        from evict.models import LM
        from evict.tasks.tokenizers import ByteTokenizer

        cfg = preset_config(args.preset, args.size, args.set)
        if cfg.vocab_size != 256:
            raise SystemExit(f"--set: a preset is served with the byte tokenizer (vocab_size 256), got {cfg.vocab_size}")
        torch.manual_seed(args.seed)
        with torch.device(dev):
            model = LM(cfg)
        tok, name = ByteTokenizer(), args.preset
    return model.to(DTYPES[args.dtype]).eval(), tok, name


def build_engine(args):
    from evict.serve.engine import Engine
    from evict.train import resolve_device

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.model is None and args.preset is None:
        raise SystemExit("--model: expected --model DIR (a model saved by `evict train`) or --preset NAME")
    dev = resolve_device(args.device)
    model, tok, name = load_served(args, dev)
    try:
        engine = Engine(model, max_batch=args.max_batch, cache_budget=args.cache_budget, block_size=args.block_size,
                        max_len=args.max_len, prefill_chunk=args.prefill_chunk)
    except ValueError as e:
        raise SystemExit(f"--{str(e).split(':', 1)[0].replace('_', '-')}: {str(e).split(': ', 1)[-1]}") from None
    return engine, tok, name


def run_serve(args) -> None:
    try:
        import uvicorn

        from evict.serve.server import build_app
    except ImportError as e:
        raise SystemExit(f"serve: {e.name} is not installed: pip install 'evict[serve]' (fastapi, uvicorn, httpx)") from None
    engine, tok, name = build_engine(args)
    app = build_app(engine, tok, name)
    engine.start()
    print(f"serving {name} on http://{args.host}:{args.port} ({engine.max_batch} slots, {engine.n_blocks} blocks of "
          f"{engine.block_size} tokens, {engine.pool_bytes / 2**20:.1f} MiB pool, {engine.max_len} tokens per sequence)",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.stop()


def add_engine_flags(p, *, device: bool = True) -> None:
    """The model and engine flags of `evict serve` (and of `evict bench serve`, which has its own --device)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="the run folder of `evict train` (or its model/ folder)")
    src.add_argument("--preset", choices=preset_names(), help="random weights of a preset (byte tokenizer), for load tests")
    p.add_argument("--set", nargs="+", metavar="KEY=VALUE", help="--preset config overrides, e.g. d_model=1024 n_layers=8")
    p.add_argument("--seed", type=seed, default=0, help="--preset weights' seed")
    p.add_argument("--cache-budget", type=byte_size, default=byte_size("256M"),
                   help="bytes for the slot pool: recurrent states + KV / latent blocks (e.g. 512M, 40G; default 256M)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV / latent block (default 16)")
    p.add_argument("--max-len", type=positive_int, help="tokens per sequence (default: what the pool holds)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens per prefill step (default 512)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="--preset size (default tiny)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="slots: sequences decoded together (default 16)")
    if device:
        p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI completions API, continuous batching)")
    add_engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=positive_int, default=8000)
    s.set_defaults(fn=run_serve)
