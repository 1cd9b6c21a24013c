"""`evict convert`: between evict's model folders and the ecosystem's.

    evict convert gpt2 HF_DIR --out DIR   a transformers GPT-2 folder -> an evict model folder (+ its tokenizer.json)
    evict convert hf MODEL --out DIR      an evict model folder -> a transformers folder (EvictForCausalLM, evict[hf])
    evict convert fla MODEL --out DIR     an evict model folder -> an fla folder (model_type kda / gated_deltanet)
Every output folder is written whole or not at all; a tokenizer.json beside the source model is copied along.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from evict.cli_args import described, writable_dir

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def run_convert(args: argparse.Namespace) -> None:
    import torch

    from evict.convert.folder import write_folder
    from evict.models import LM

    writable_dir(args.out, "--out")
    src = Path(args.source).expanduser()
    if args.kind == "gpt2":
        from evict.convert.gpt2 import from_hf_gpt2, load_hf_gpt2

        lm = from_hf_gpt2(load_hf_gpt2(str(src)))

        def write(folder: Path) -> None:
            lm.save(folder)  # in the source's dtype (a bfloat16 GPT-2 stays bfloat16)
            _copy_tokenizer(src, folder, lm)

        out = write_folder(args.out, write)
        print(f"weights kept in the source's dtype, {str(next(lm.parameters()).dtype).removeprefix('torch.')}")
    else:
        folder = _model_dir(src)
        dtype = getattr(torch, args.dtype) if args.dtype else _saved_dtype(folder)
        lm = LM.load(folder)  # float32 (LM.load converts), then the saved dtype or --dtype
        if args.kind == "fla":
            from evict.convert.fla import to_fla

            out = to_fla(lm, args.out, dtype=dtype)
            _copy_tokenizer(folder, out, lm)
        else:
            from evict.hf import to_hf

            lm = lm.to(dtype)

            def write_hf(tmp: Path) -> None:
                to_hf(lm, eos_token_id=_eos_id(folder, lm)).save_pretrained(tmp)
                _copy_tokenizer(folder, tmp, lm)

            out = write_folder(args.out, write_hf)
        how = "as --dtype asked" if args.dtype else "the source's dtype"
        print(f"weights in {how}, {str(dtype).removeprefix('torch.')}")
    print(f"wrote {out}")


def _model_dir(src: Path) -> Path:
    """An evict model folder (config.json + model.safetensors), or a run folder holding one in model/."""
    if (src / "model" / "config.json").is_file():
        src = src / "model"
    if not (src / "config.json").is_file():
        raise ValueError(f"source: expected an evict model folder with config.json (or a run folder with model/), got {src}")
    return src


def _saved_dtype(folder: Path):
    """The dtype the folder's weights were saved in (its token embedding's): convert keeps it (a bfloat16 model stays
    bfloat16). A folder LM.load cannot read is refused there."""
    import torch
    from safetensors import safe_open

    names = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    try:
        with safe_open(str(folder / "model.safetensors"), "pt", device="cpu") as f:
            return names.get(f.get_slice("embed.weight").get_dtype(), torch.float32)
    except Exception:  # missing or unreadable: LM.load names the problem in its own one line
        return torch.float32


def _eos_id(src: Path, lm) -> int | None:
    """The end-of-text id of the tokenizer.json beside the model (None without one, or without end-of-text)."""
    from evict.tasks.tokenizers import load_tokenizer

    if not (src / "tokenizer.json").is_file():
        return None
    eos = load_tokenizer(src / "tokenizer.json").eos_token_id
    return eos if eos is not None and eos < lm.cfg.vocab_size else None


def _copy_tokenizer(src: Path, dst: Path, lm) -> None:
    """tokenizer.json copied along, with the tokenizer_config.json transformers' AutoTokenizer needs beside it."""
    from evict.tasks.tokenizers import load_tokenizer, write_hf_tokenizer_config

    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
        limit = lm.cfg.max_seq_len if lm.cfg.pos == "learned" else None
        write_hf_tokenizer_config(dst, load_tokenizer(dst / "tokenizer.json"), model_max_length=limit)


def add_parser(sub) -> None:
    """Register `evict convert` (calling fn(args)) on the argparse subparsers object."""
    c = sub.add_parser("convert", **described(
        "convert models: from transformers' GPT-2; to transformers or fla folders",
        "Convert between evict's model folders and the ecosystem's: gpt2 reads a transformers GPT-2 folder into an\n"
        "evict model folder; hf writes an evict model as a transformers folder (EvictForCausalLM); fla writes it as\n"
        "an fla folder (KDA / Gated DeltaNet). The output is written whole or not at all.",
        "evict convert gpt2 ~/models/gpt2 --out runs/gpt2",
        "evict convert hf runs/kda --out runs/kda_hf"))
    c.add_argument("kind", choices=["gpt2", "hf", "fla"], help="gpt2: from a transformers GPT-2 folder; hf / fla: from an "
                                                             "evict model folder to that format")
    c.add_argument("source", help="the folder to convert (for hf / fla: a model folder or a run folder holding model/)")
    c.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    c.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="hf / fla: weight dtype (default the dtype the model was saved in)")
    c.set_defaults(fn=run_convert)
