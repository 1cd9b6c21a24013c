"""`evict train`: any preset (or a ModelConfig JSON) on any task, with the shared training loop.

Outputs in --out (an existing folder with a checkpoint is resumed; --no-resume starts over, removing only these
files; one run at a time: .evict-run.lock is held for the run's life, see evict.runfolder):
    run.json        the model, task and training flags of what has been trained (rewritten at each checkpoint;
                    `--config run.json` replays it, flags given on the command line win)
    metrics.jsonl   train / val rows (evict.train: loss, accuracy, lr, grad_norm, tokens_per_s); loss.png from it
    checkpoint.pt   model, optimizer, RNG states (resume); under torchrun it points at checkpoint-<step>.dcp/
    tensorboard/    with --tensorboard: the metrics as TensorBoard scalars
    model/          model.safetensors + config.json (LM.save) and tokenizer.json (text tasks) for `evict generate`
    summary.json    the final numbers, also printed as one line
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from evict import distributed, finetune
from evict.cli_args import (described, device, nonneg_float, nonneg_int, parse_overrides, positive_float, positive_int, seed,
                            writable_dir)
from evict.models import LM, presets
from evict.models.config import ModelConfig
from evict.plots import plot_metrics
from evict.runfolder import run_lock
from evict.train import TrainConfig, read_checkpoint, train

# Flag defaults, applied after --config: a flag given on the command line wins, then the config file's value, then these.
DEFAULTS = dict(preset="gpt2", size="tiny", task="text", corpus=None, text_field="text", tokenizer="char", bpe_vocab=2048,
                seq_len=None,
                pairs=4, vocab=8192, steps=1000, batch_size=32, lr=3e-3, min_lr=0.0, warmup=None, weight_decay=0.1,
                clip=1.0, grad_accum=1, amp="auto", compile=False, compile_lean=None, checkpoint_blocks=False, dist="fsdp",
                eval_every=100,
                eval_batches=10, log_every=10, ckpt_every=None, device="auto", threads=None, seed=0, tensorboard=False,
                out="runs/train/latest")
# run.json's "train" fields -> the flags they came from
_TRAIN_FLAGS = dict(steps="steps", batch_size="batch_size", lr="lr", warmup_steps="warmup", weight_decay="weight_decay",
                    grad_clip="clip", grad_accum="grad_accum", amp="amp", compile="compile", compile_lean="compile_lean",
                    checkpoint_blocks="checkpoint_blocks", dist="dist",
                    eval_every="eval_every", eval_batches="eval_batches", log_every="log_every",
                    checkpoint_every="ckpt_every", device="device", threads="threads", seed="seed",
                    tensorboard="tensorboard")
_TASK_FLAGS = ("task", "corpus", "text_field", "tokenizer", "bpe_vocab", "seq_len", "pairs", "vocab")
# run.json's "train" fields that have no flag: replayed as recorded, each checked here and then by TrainConfig
_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
_TRAIN_ONLY = {
    "betas": (lambda v: isinstance(v, list) and len(v) == 2 and all(map(_num, v)), "two numbers in [0, 1)"),
    "target_accuracy": (lambda v: v is None or _num(v), "a number in (0, 1] or null"),
    "prefetch": (lambda v: type(v) is int, "an integer >= 0"),
    "graphs": (lambda v: isinstance(v, bool), "true or false"),
    "select_labels": (lambda v: isinstance(v, bool), "true or false"),
}
_TRAIN_DERIVED = {"min_lr_ratio"}  # replayed as --min-lr = min_lr_ratio × lr
# fields of the session that wrote run.json, not of the run: where and how it ran, not what it trained
_TRAIN_SESSION = {"out_dir", "resume", "progress", "stop_at", "stop_file"}


def tokenizer_arg(text: str) -> str:
    """--tokenizer: a kind (char, byte, bpe) or an existing tokenizer.json file."""
    import argparse

    if text in ("char", "byte", "bpe") or Path(text).expanduser().is_file():
        return text
    raise argparse.ArgumentTypeError(f"expected char, byte, bpe or a tokenizer.json file, got {text!r} (no such file)")


def _read_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"--config: no such file: {p}")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"--config: {p} is not JSON ({e})") from None
    if not isinstance(d, dict):
        raise SystemExit(f"--config: {p}: expected a JSON object (a ModelConfig or a run.json)")
    return d


_ACTIONS: dict = {}  # dest -> the argparse action of `evict train` (filled by add_parser): checks config-file values


def _check_recorded(path: str, dest: str, value):
    """A flag's value read from a run.json, checked as the command line would check it."""
    act = _ACTIONS[dest]
    flag = act.option_strings[0]
    if value is None and DEFAULTS.get(dest) is None:
        return value
    if act.nargs == 0:  # store_true
        ok = isinstance(value, bool)
    elif act.choices is not None:
        ok = value in act.choices
    elif act.type is not None and not isinstance(value, (bool, dict, list)):
        try:
            return act.type(str(value))
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"--config: {path}: {flag}: {e}") from None
    else:
        ok = isinstance(value, str)
    if not ok:
        raise SystemExit(f"--config: {path}: {flag}: unexpected value {value!r}")
    return value


def resolve(args) -> SimpleNamespace:
    """Every flag's value: the command line's, else (--config run.json) the recorded run's, else DEFAULTS.
    A --config that is a ModelConfig JSON gives only the model."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    o: dict[str, Any] = dict(DEFAULTS, model=None, config=None, set=None, train_only={})
    recorded: dict[str, Any] = {}
    if args.config:
        d = _read_config_file(args.config)
        if {"model", "task", "train"} <= set(d):  # a run.json
            if not all(isinstance(d[k], dict) for k in ("model", "task", "train")):
                raise SystemExit(f"--config: {args.config}: model, task and train must be JSON objects")
            o["model"] = d["model"]
            t = d["train"]
            unknown = sorted(set(t) - set(_TRAIN_FLAGS) - set(_TRAIN_ONLY) - _TRAIN_DERIVED - _TRAIN_SESSION)
            if unknown:
                raise SystemExit(f"--config: {args.config}: train.{unknown[0]}: not a field evict train can replay "
                                 f"(unknown: {', '.join(unknown[:4])})")
            for field, (ok, want) in _TRAIN_ONLY.items():
                if field in t:
                    if not ok(t[field]):
                        raise SystemExit(f"--config: {args.config}: train.{field}: expected {want}, got {t[field]!r}")
                    o["train_only"][field] = tuple(t[field]) if field == "betas" else t[field]
            recorded = {k: d["task"][k] for k in _TASK_FLAGS if k in d["task"]}
            recorded.update({flag: t[field] for field, flag in _TRAIN_FLAGS.items() if field in t})
            if t.get("compile") and "compile_lean" not in t:  # a compiled run from before the flag: the keep-all form
                recorded["compile_lean"] = False
            if isinstance(t.get("min_lr_ratio"), (int, float)) and isinstance(t.get("lr"), (int, float)):
                recorded["min_lr"] = t["min_lr_ratio"] * t["lr"]
            o.update({k: _check_recorded(args.config, k, v) for k, v in recorded.items()})
        else:
            o["model"] = d
    o.update(given)
    if o["compile_lean"] and not o["compile"]:  # --compile-lean implies --compile, unless a --config says otherwise
        if "compile" in recorded:
            raise SystemExit(f"--compile-lean: {args.config} records compile false, and the lean form is a form of "
                             "--compile; pass --compile as well, or drop --compile-lean")
        o["compile"] = True
    o["out"] = str(Path(o["out"]).expanduser())  # as generate, convert and serve take theirs
    o["warmup"] = min(50, o["steps"]) if o["warmup"] is None else o["warmup"]
    o["ckpt_every"] = o["eval_every"] if o["ckpt_every"] is None else o["ckpt_every"]
    return SimpleNamespace(**o)


def build_task(args):
    """The task named by --task, from its flags; one-line errors name the flag."""
    if args.task == "text":
        from evict.tasks.text import TextTask

        try:
            return TextTask(corpus=args.corpus, tokenizer=args.tokenizer, seq_len=args.seq_len or 256,
                            bpe_vocab_size=args.bpe_vocab, seed=args.seed, text_field=args.text_field)
        except (ValueError, ImportError) as e:
            raise SystemExit(f"--task text: {e}") from None
    from evict.tasks.mqar import MQARConfig, MQARTask

    try:
        return MQARTask(MQARConfig(vocab_size=args.vocab, seq_len=args.seq_len or 64, num_pairs=args.pairs,
                                   train_seed=args.seed))
    except ValueError as e:
        raise SystemExit(f"--task mqar: {e}") from None


def build_config(args, vocab_size: int) -> ModelConfig:
    """The model (--config or --preset/--size), then --set overrides; vocab_size always follows the task."""
    overrides = parse_overrides(args.set)
    if "vocab_size" in overrides:
        raise SystemExit("--set vocab_size: the vocabulary follows the task (--vocab for mqar, the tokenizer for "
                         "text); drop this override")
    try:
        if args.model is not None:
            if isinstance(overrides.get("moe"), dict) and isinstance(args.model.get("moe"), dict):
                overrides["moe"] = {**args.model["moe"], **overrides["moe"]}  # a partial MoE dict edits the file's
            return ModelConfig.from_dict({**args.model, **overrides, "vocab_size": vocab_size})
        return presets.get(args.preset, size=args.size, **overrides, vocab_size=vocab_size)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--{'config' if args.model is not None else 'preset'}: {e}") from None


def train_config(o) -> TrainConfig:
    """The TrainConfig of the flags; every value checked (ValueError -> one line naming it)."""
    for name, ok, want in (("seq_len", lambda v: v is None or (type(v) is int and v >= 1), "a positive integer"),
                           ("min_lr", lambda v: 0 <= v <= o.lr, f"a number in [0, --lr={o.lr}]"),
                           ("clip", lambda v: v >= 0, "a number >= 0 (0 = no clipping)")):
        if not ok(getattr(o, name)):
            raise SystemExit(f"--{name.replace('_', '-')}: expected {want}, got {getattr(o, name)!r}")
    try:
        device(o.device)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--device: {e}") from None
    try:
        tcfg = TrainConfig(steps=o.steps, batch_size=o.batch_size, lr=o.lr, warmup_steps=o.warmup,
                           min_lr_ratio=o.min_lr / o.lr, weight_decay=o.weight_decay, grad_clip=o.clip or None,
                           grad_accum=o.grad_accum, amp=o.amp, compile=o.compile, compile_lean=o.compile_lean,
                           checkpoint_blocks=o.checkpoint_blocks, dist=o.dist, eval_every=o.eval_every,
                           eval_batches=o.eval_batches, log_every=o.log_every, checkpoint_every=o.ckpt_every,
                           seed=o.seed, threads=o.threads, device=o.device, out_dir=o.out, resume=not o.no_resume,
                           tensorboard=o.tensorboard, **o.train_only)
        world = distributed.env_world_size()
        tcfg.check_world(world)
        if world > 1 and tcfg.dist == "fsdp":
            distributed.check_fsdp_available()
    except (ValueError, TypeError) as e:
        raise SystemExit(f"training flags: {e}") from None
    if tcfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise SystemExit("--tensorboard: the tensorboard package is not installed (pip install tensorboard)") from None
    return tcfg


def _check_resume(out: Path, run: dict, tcfg: TrainConfig) -> None:
    """An existing run folder is resumed only with the same model and task and with flags the loop can honour
    (evict.train.check_resume); only a checkpoint makes a run resumable (a folder without one is started over)."""
    ckpt = out / "checkpoint.pt"
    if not tcfg.resume or not ckpt.exists():
        return
    if not zipfile.is_zipfile(ckpt):
        raise SystemExit(f"--out: {ckpt} is not a complete checkpoint (truncated or corrupted); delete it to start over")
    try:
        ck = read_checkpoint(ckpt)
        prev = ck.get("record") or {}
        for key in ("model", "task"):
            if key in prev and prev[key] != json.loads(json.dumps(run[key])):
                raise SystemExit(f"--out: {out} holds a run with another {key} config; pick a new --out folder "
                                 "or pass --no-resume")
        from evict.train import check_resume

        check_resume(ck["config"], ck["step"], tcfg)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"--out: {out}: {e}") from None


# what evict writes in a run folder: --no-resume removes these and nothing else (a folder left empty goes too)
_RUN_FILES = ("checkpoint.pt", "run.json", "metrics.jsonl", "summary.json", "loss.png")
_RUN_SUBFOLDERS = {"model": ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                             "special_tokens_map.json", ".config.json.tmp-*", ".model.safetensors.tmp-*"),
                   "tensorboard": ("events.out.tfevents.*",), "checkpoint-*.dcp": ("*.distcp", ".metadata")}


def _start_over(out: Path) -> None:
    """--no-resume: remove what a previous run wrote in `out` (its checkpoint, record, metrics, model, event files);
    files evict did not write stay, and so do the folders holding them."""
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for pattern, files in _RUN_SUBFOLDERS.items():
        for folder in out.glob(pattern):
            if not folder.is_dir() or folder.is_symlink():
                continue
            for f in files:
                for path in folder.glob(f):
                    if path.is_file() or path.is_symlink():
                        path.unlink()
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if nothing else is in it


def _init_from(args, o) -> finetune.InitSource | None:
    """--init-from: the source folder, with the model, tokenizer and (unless given) --lr it sets in `o`."""
    if getattr(args, "init_from", None) is None:
        return None
    finetune.check_flags(args, vars(args))
    src = finetune.init_source(args.init_from)
    o.model, o.tokenizer, o.task = src.model, str(src.tokenizer), "text"
    if args.lr is None:
        o.lr = finetune.FINETUNE_LR
    return src


def run_train(args) -> dict | None:
    # every flag, the model config and --out are checked before the corpus is read and anything is written
    o = resolve(args)
    init = _init_from(args, o)
    writable_dir(o.out, "--out")
    tcfg = train_config(o)
    build_config(o, 256 if init is None else init.model.get("vocab_size", 256))  # every field but the vocabulary
    task = build_task(o)
    if init is not None:
        finetune.check_vocab(init, task.vocab_size)
    cfg = build_config(o, task.vocab_size)
    out = Path(o.out)
    flags = ("corpus", "text_field", "tokenizer", "bpe_vocab") if o.task == "text" else ("pairs", "vocab")
    task_record = {"name": task.name, "task": o.task, **{k: getattr(o, k) for k in flags}, "seq_len": task.seq_len}
    if init is not None:
        task_record["init_from"] = str(init.folder)
    run = {"model": cfg.to_dict(), "task": task_record}
    lead = int(os.environ.get("RANK", "0")) == 0
    with run_lock(out, "--out") if lead else contextlib.nullcontext():  # one run at a time in a folder
        return _run_locked(o, out, run, tcfg, task, cfg, lead, init)


def _run_locked(o, out: Path, run: dict, tcfg: TrainConfig, task, cfg: ModelConfig, lead: bool,
                init: finetune.InitSource | None) -> dict | None:
    _check_resume(out, run, tcfg)
    if not lead:  # rank 0 alone logs and prints
        logging.getLogger().setLevel(logging.WARNING)
    if lead and out.exists() and not tcfg.resume:
        _start_over(out)

    torch.manual_seed(o.seed)  # the initial weights are a function of --seed (the same on every rank)
    model = LM(cfg)
    if init is not None:
        finetune.load_weights(model, init)
    n_params = sum(p.numel() for p in model.parameters())
    if lead:
        name = f"init from {init.folder}" if init is not None else o.config or f"{o.preset} ({o.size})"
        print(f"model: {name}, {n_params / 1e6:.2f} M parameters; "
              f"task: {task.name}, vocab {task.vocab_size}; out: {out}")
    try:
        result = train(model, task, tcfg, record=json.loads(json.dumps(run)))
        state = distributed.full_model_state(model) if distributed.active() else None  # a collective
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if not lead:
        return None
    if result.diverged_at is not None:  # nothing to save: the weights are not finite
        raise SystemExit(f"--lr {tcfg.lr:g}, --weight-decay {tcfg.weight_decay:g}: the training loss is not finite by "
                         f"step {result.diverged_at}; no model saved (metrics and the checkpoint up to there are in "
                         f"{out}); try a lower --lr, a lower --weight-decay or a longer --warmup")
    if state is not None:  # FSDP2 left the model sharded: save a whole copy
        model = LM(cfg)
        model.load_state_dict(state)
    png = plot_metrics(out / "metrics.jsonl", out / "loss.png")
    model_dir = model.cpu().save(out / "model")
    if hasattr(task, "tokenizer"):
        from evict.tasks.tokenizers import write_hf_tokenizer_config

        task.tokenizer.save(model_dir / "tokenizer.json")
        write_hf_tokenizer_config(model_dir, task.tokenizer, cfg.max_seq_len if cfg.pos == "learned" else None)
    summary = {"steps": result.steps_done, "val_loss": result.final_val_loss,
               "val_ppl": math.exp(min(result.final_val_loss, 700.0)), "val_accuracy": result.final_val_accuracy,
               "wall_seconds": result.wall_seconds, "params": n_params, "model_dir": str(model_dir), "plot": str(png)}
    if hasattr(task, "unigram_loss"):
        summary["unigram_loss"] = task.unigram_loss()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    line = (f"done: val loss {summary['val_loss']:.4f} nats/token, ppl {summary['val_ppl']:.2f}, "
            f"acc {summary['val_accuracy']:.3f}")
    if "unigram_loss" in summary:
        line += f" (unigram baseline {summary['unigram_loss']:.4f})"
    line += f"; {summary['steps']} steps in {summary['wall_seconds']:.1f} s (this session); model: {model_dir}"
    print(line)
    return summary


def add_parser(sub) -> None:
    """Register `evict train` (calling fn(args)) on the argparse subparsers object. Flags default to None here and
    get their values in `resolve` (command line > --config run.json > DEFAULTS)."""
    t = sub.add_parser("train", **described(
        "train any preset on text (default Shakespeare) or MQAR; save a generate-able model",
        "Train a preset (or a ModelConfig JSON) on a text corpus or on MQAR with the shared training loop: AdamW,\n"
        "warmup + cosine, clipping, evaluation, checkpoints. --out gets run.json, metrics.jsonl, loss.png, a\n"
        "checkpoint (an existing --out is resumed) and model/ for `evict generate`. Under torchrun the model is\n"
        "sharded with FSDP2 (or replicated with --dist ddp).",
        "evict train --preset kda --steps 300 --out runs/kda",
        "evict train --preset attention --task mqar --pairs 8 --seq-len 64 --out runs/mqar",
        "torchrun --nproc_per_node 2 -m evict.cli train --preset kimi_linear --size small --out runs/kl"))
    d = DEFAULTS
    src = t.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=presets.FAMILIES, help=f"model family (default {d['preset']})")
    src.add_argument("--config", help="a ModelConfig JSON, or the run.json of a run (its model, task and flags; "
                                      "flags given here win)")
    t.add_argument("--size", choices=sorted(presets.SIZES), help=f"default {d['size']}")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="ModelConfig override, e.g. n_layers=2; repeatable")
    t.add_argument("--task", choices=["text", "mqar"], help="default text")
    t.add_argument("--data", "--corpus", dest="corpus",
                   help="text: a .txt file or folder of *.txt, a .jsonl, .parquet or datasets folder (see --text-field), "
                        "or a .bin of `evict data prepare` (default: Shakespeare, shipped)")
    t.add_argument("--init-from", metavar="PATH",
                   help="fine-tune: start from this model folder (evict train's model/ or an `evict convert gpt2` "
                        f"output) with its config and tokenizer; fresh optimizer and warmup; --lr default {3e-4:g}")
    t.add_argument("--text-field", help="--data .jsonl / .parquet / datasets: the text field (default text)")
    t.add_argument("--tokenizer", type=tokenizer_arg,
                   help="char, byte, bpe (trained on the corpus) or the path of a pretrained HF tokenizer.json (default: char)")
    t.add_argument("--bpe-vocab", type=positive_int, help=f"default {d['bpe_vocab']}")
    t.add_argument("--seq-len", type=positive_int, help="default 256 (text) / 64 (mqar)")
    t.add_argument("--pairs", type=positive_int, help=f"mqar: key-value pairs (default {d['pairs']})")
    t.add_argument("--vocab", type=positive_int, help=f"mqar: vocabulary size (default {d['vocab']})")
    t.add_argument("--steps", type=positive_int, help=f"optimizer steps in all (default {d['steps']}); a larger value "
                                                       "continues a finished run")
    t.add_argument("--batch-size", type=positive_int, help=f"global batch per step, over all ranks (default {d['batch_size']})")
    t.add_argument("--grad-accum", type=positive_int, help="micro-batches per rank per step (default 1)")
    t.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {d['lr']})")
    t.add_argument("--min-lr", type=nonneg_float, help="the cosine's final learning rate (default 0)")
    t.add_argument("--warmup", type=nonneg_int, help="warmup steps, at most --steps (default min(50, steps))")
    t.add_argument("--weight-decay", type=nonneg_float, help=f"AdamW decay of matrices (default {d['weight_decay']})")
    t.add_argument("--clip", type=nonneg_float, help=f"gradient-norm clip, 0 = none (default {d['clip']})")
    t.add_argument("--amp", choices=["auto", "bf16", "none"], help="bf16 autocast: auto = on CUDA only (default)")
    t.add_argument("--compile", action="store_true", default=None, help="torch.compile each block")
    t.add_argument("--compile-lean", action=argparse.BooleanOptionalAction, default=None,
                   help="implies --compile: each block compiled in the lean form (the default form of --compile), "
                        "which keeps less for the backward and recomputes there the elementwise values between the "
                        "matmuls and the short conv (no matmul or memory-op forward runs twice); --no-compile-lean: "
                        "the keep-all form; KDA 226M on an H100: lean 0.67x the keep-all form's memory at 0.96x its "
                        "speed (docs/training.md)")
    t.add_argument("--checkpoint-blocks", action="store_true", default=None,
                   help="activation checkpointing per block: recompute each block's activations in the backward")
    t.add_argument("--dist", choices=list(distributed.DIST), help="under torchrun: fsdp (FSDP2, default) or ddp")
    t.add_argument("--eval-every", type=positive_int, help=f"default {d['eval_every']}")
    t.add_argument("--eval-batches", type=positive_int, help=f"default {d['eval_batches']}")
    t.add_argument("--log-every", type=positive_int, help=f"train rows in metrics.jsonl (default every {d['log_every']} steps)")
    t.add_argument("--ckpt-every", type=positive_int, help="checkpoint interval (default --eval-every)")
    t.add_argument("--device", type=device, help="auto (default), cpu, cuda, cuda:1 …")
    t.add_argument("--threads", type=positive_int, help="torch CPU threads")
    t.add_argument("--seed", type=seed, help="default 0")
    t.add_argument("--tensorboard", action="store_true", default=None, help="also write TensorBoard scalars")
    t.add_argument("--no-resume", action="store_true", help="start over in --out (removes the previous run's files)")
    t.add_argument("--out", help=f"output folder; an existing one is resumed (default {d['out']})")
    t.set_defaults(fn=run_train)
    _ACTIONS.update({a.dest: a for a in t._actions if a.option_strings})
