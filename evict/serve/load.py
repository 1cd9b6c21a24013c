"""Loading a model to run it: a folder saved by `evict train` with its tokenizer (`evict generate`, `evict serve`),
or a preset with random weights (load tests), and the serving engine over it, with the flags that choose them
(`evict serve`, `evict bench serve`). Flags are checked before the model is loaded; bad values end in one line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

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
    from evict.cli_args import parse_overrides
    from evict.models import presets

    try:
        if name == "hybrid":
            return presets.hybrid(size=size, **parse_overrides(overrides))
        return presets.get(name, size=size, **parse_overrides(overrides))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--preset {name}: {e}") from None


def served_name(args) -> str:
    """The served model's name: its run folder's, or the preset's."""
    return resolve_model_dir(args.model).resolve().parent.name if args.model is not None else args.preset


def served_tokenizer(args):
    """The tokenizer of --model (its tokenizer.json) or of a --preset (bytes), without loading the model."""
    if args.model is None:
        from evict.tasks.tokenizers import ByteTokenizer

        return ByteTokenizer()
    return folder_tokenizer(resolve_model_dir(args.model))


def load_served(args, dev: torch.device):
    """(model, tokenizer, name) from --model or --preset; the preset's weights are random (seeded), its tokenizer bytes."""
    if args.model is not None:
        model, tok = load_model(args.model, dev)
        name = served_name(args)
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
    """(engine, tokenizer, name) from the flags: an Engine stepping in a thread of this process, or with
    --engine-process on an EngineClient of one in a child process (evict.serve.remote; the child builds the model)."""
    from evict.distributed import resolve_device
    from evict.serve.engine import Engine

    if args.model is None and args.preset is None:
        raise SystemExit("--model: expected --model DIR (a model saved by `evict train`) or --preset NAME")
    if getattr(args, "engine_process", "off") == "on":
        from evict.serve.remote import EngineClient

        tok, name = served_tokenizer(args), served_name(args)  # one-line errors before the child starts
        return EngineClient(args, build=build_engine), tok, name
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    model, tok, name = load_served(args, dev)
    try:
        engine = Engine(model, max_batch=args.max_batch, cache_budget=args.cache_budget, block_size=args.block_size,
                        max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                        max_num_batched_tokens=args.max_num_batched_tokens, priority=args.priority,
                        cuda_graphs=None if args.cuda_graphs is None else args.cuda_graphs == "on",
                        decode_prefill_tokens=args.decode_prefill_tokens,
                        async_steps=(args.async_scheduling or ("on" if dev.type == "cuda" else "off")) == "on")
    except ValueError as e:
        raise SystemExit(f"--{str(e).split(':', 1)[0].replace('_', '-')}: {str(e).split(': ', 1)[-1]}") from None
    engine.warm_up()  # every decode graph captured before the server answers
    return engine, tok, name


def resolve_model_dir(path: str) -> Path:
    """--model may name the model folder itself or the run folder holding model/."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise SystemExit(f"--model: no such folder: {p}")
    if (p / "model" / "config.json").is_file():
        p = p / "model"
    if not (p / "config.json").is_file():
        raise SystemExit(f"--model: {p} holds no config.json (expected the model/ folder written by `evict train`)")
    if not (p / "tokenizer.json").is_file():
        raise SystemExit(f"--model: {p} holds no tokenizer.json (models trained on text tasks have one)")
    return p


def folder_tokenizer(folder: Path):
    """The tokenizer.json of a model folder; one-line errors."""
    from evict.tasks.tokenizers import load_tokenizer

    try:
        return load_tokenizer(folder / "tokenizer.json")
    except (ValueError, ImportError) as e:
        raise SystemExit(f"--model: {e}") from None


def load_model(path: str, device: torch.device):
    """(model, tokenizer) from --model (a run folder or its model/ folder), on `device`; one-line errors."""
    from evict.models import LM

    folder = resolve_model_dir(path)
    try:
        model = LM.load(folder, device=device)
    except (ValueError, OSError) as e:
        raise SystemExit(f"--model: {e}") from None
    model.to(device)
    tok = folder_tokenizer(folder)
    if tok.vocab_size != model.cfg.vocab_size:
        raise SystemExit(f"--model: {folder / 'tokenizer.json'} has {tok.vocab_size} tokens but the model's vocab_size is "
                         f"{model.cfg.vocab_size} (a tokenizer from another run?)")
    return model, tok


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
    p.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="tokens per engine step: every decode row + prompt chunks (default 8192 on CUDA, 1024 on a CPU)")
    p.add_argument("--decode-prefill-tokens", type=positive_int,
                   help="prompt tokens at most in a step that also decodes (default: the whole step budget); lower: "
                        "shorter waits between a request's tokens, later first tokens")
    p.add_argument("--priority", choices=["decode", "prefill"], default="decode",
                   help="what fills a step's token budget first: decode rows (default) or prompt chunks")
    p.add_argument("--cuda-graphs", choices=["on", "off"], help="replay decode-only steps from CUDA graphs (default: on on CUDA)")
    p.add_argument("--async-scheduling", choices=["on", "off"],
                   help="plan and launch each step before the host has read the last one's tokens (default: on on CUDA)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="--preset size (default tiny)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="slots: sequences decoded together (default 16)")
    if device:
        p.add_argument("--device", type=device_type, default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads")
    p.add_argument("--engine-process", choices=["on", "off"], default="off",
                   help="run the engine in a child process (its own GIL; the HTTP side talks to it through pipes) or in "
                        "a thread of the server's process (default off: not yet measured on a GPU)")
