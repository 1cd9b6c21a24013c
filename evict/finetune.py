"""`evict train --init-from PATH`: fine-tune from saved weights (an evict model folder, its run folder, the output of
`evict convert gpt2`, or of `evict convert hf`: a transformers EvictForCausalLM folder, read through transformers).

What carries over: the model config (every field, vocabulary included), the weights, and the tokenizer.json beside
them (the text task tokenises the corpus with it, so ids mean what they meant in pre-training). What starts fresh:
the optimizer and the schedule (warmup from the loaded weights, then cosine), the step count, and --lr's default
(FINETUNE_LR, a tenth of training from scratch's). Refused in one line, before anything is read or written: a
folder without config.json / model.safetensors / tokenizer.json, --preset / --config / --set / --tokenizer given as
well (the model and its tokenizer come from PATH), a non-text task, and a tokenizer whose vocabulary differs from
the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FINETUNE_LR = 3e-4


@dataclass
class InitSource:
    folder: Path  # config.json + model.safetensors + tokenizer.json
    model: dict  # the ModelConfig dict
    tokenizer: Path
    transformers: bool = False  # a `convert hf` folder (EvictForCausalLM's save_pretrained), read through transformers


def init_source(path: str) -> InitSource:
    """The model folder --init-from names (a run folder's model/ too), its files checked to exist."""
    from evict.jsonfile import read_json_object

    p = Path(path).expanduser()
    if (p / "model" / "config.json").is_file():
        p = p / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (p / name).is_file():
            raise SystemExit(f"--init-from: {p} holds no {name} (expected an evict model folder: `evict train`'s "
                             f"model/ or an `evict convert gpt2` output)")
    try:
        model = read_json_object(p / "config.json", "config")
    except ValueError as e:
        raise SystemExit(f"--init-from: {e}") from None
    if model.get("model_type") == "evict" and isinstance(model.get("evict"), dict):
        return InitSource(p, model["evict"], p / "tokenizer.json", transformers=True)
    if "model_type" in model:
        raise SystemExit(f"--init-from: {p} is a transformers {model['model_type']!r} folder; convert it first "
                         "(`evict convert gpt2 DIR --out OUT` for GPT-2)")
    return InitSource(p, model, p / "tokenizer.json")


def check_flags(args, given: dict) -> None:
    """--init-from brings the model and the tokenizer: flags that would choose others are refused."""
    for flag in ("preset", "config", "set", "tokenizer", "size"):
        if given.get(flag) is not None:
            raise SystemExit(f"--{flag}: not with --init-from (the model, its config and tokenizer come from "
                             f"{args.init_from})")
    if given.get("task") not in (None, "text"):
        raise SystemExit("--init-from: fine-tuning is for the text task; drop --task")


def check_vocab(src: InitSource, task_vocab: int) -> None:
    vocab = src.model.get("vocab_size")
    if vocab != task_vocab:
        raise SystemExit(f"--init-from: {src.tokenizer} has {task_vocab} tokens but the model's vocab_size is {vocab}; "
                         "the folder's tokenizer must be the one the model was trained with")


def load_weights(model, src: InitSource) -> None:
    """The folder's weights into `model` (built from the same config); a bad file is one line."""
    try:
        if src.transformers:
            from evict.hf import EvictForCausalLM

            model.load_state_dict(EvictForCausalLM.from_pretrained(src.folder).model.state_dict())
        else:
            model.load_weights(src.folder)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"--init-from: {e}") from None
