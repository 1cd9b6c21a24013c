"""`evict train`: any preset (or a ModelConfig JSON) on any task, with the shared training loop.

Outputs in --out (an existing folder with a checkpoint is resumed):
    run.json        the model config, task and training flags of the run (a resume must match them)
    metrics.jsonl   train / val rows (evict.train); loss.png is drawn from it
    checkpoint.pt   model, optimizer, scheduler, RNG states (resume)
    model/          model.safetensors + config.json (LM.save) and tokenizer.json (text tasks) for `evict generate`
    summary.json    the final numbers, also printed as one line
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from evict.cli_args import device, nonneg_int, positive_float, positive_int, seed, writable_dir
from evict.models import LM, presets
from evict.models.config import ModelConfig
from evict.plots import plot_metrics
from evict.train import TrainConfig, train


def tokenizer_arg(text: str) -> str:
    """--tokenizer: a kind (char, byte, bpe) or an existing tokenizer.json file."""
    import argparse

    if text in ("char", "byte", "bpe") or Path(text).expanduser().is_file():
        return text
    raise argparse.ArgumentTypeError(f"expected char, byte, bpe or a tokenizer.json file, got {text!r} (no such file)")


def parse_overrides(items: list[str] | None) -> dict:
    """["n_layers=2", "pattern=KKKM"] -> {"n_layers": 2, "pattern": "KKKM"} (values read as JSON, else as text)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_task(args):
    """The task named by --task, from its flags; one-line errors name the flag."""
    if args.task == "text":
        from evict.tasks.text import TextTask

        try:
            return TextTask(corpus=args.corpus, tokenizer=args.tokenizer, seq_len=args.seq_len or 256,
                            bpe_vocab_size=args.bpe_vocab, seed=args.seed)
        except (ValueError, ImportError) as e:
            raise SystemExit(f"--task text: {e}") from None
    from evict.tasks.mqar import MQARConfig, MQARTask

    try:
        return MQARTask(MQARConfig(vocab_size=args.vocab, seq_len=args.seq_len or 64, num_pairs=args.pairs,
                                   train_seed=args.seed))
    except ValueError as e:
        raise SystemExit(f"--task mqar: {e}") from None


def build_config(args, vocab_size: int) -> ModelConfig:
    """--config JSON or --preset/--size, then --set overrides; vocab_size always follows the task."""
    overrides = parse_overrides(args.set)
    try:
        if args.config:
            path = Path(args.config)
            if not path.is_file():
                raise SystemExit(f"--config: no such file: {path}")
            try:
                d = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise SystemExit(f"--config: {path} is not JSON ({e})") from None
            d.update(overrides, vocab_size=vocab_size)
            return ModelConfig.from_dict(d)
        return presets.get(args.preset, size=args.size, **overrides, vocab_size=vocab_size)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--{'config' if args.config else 'preset'}: {e}") from None


def _check_resume(out: Path, run: dict) -> None:
    """An existing run folder may only be resumed with the same model and task. Only a checkpoint makes a run
    resumable: a run.json without one is what a run that failed before its first checkpoint left, and is replaced."""
    prev_path, ckpt = out / "run.json", out / "checkpoint.pt"
    if not ckpt.exists():
        return
    if not zipfile.is_zipfile(ckpt):
        raise SystemExit(f"--out: {ckpt} is not a complete checkpoint (truncated or corrupted); delete it to start over")
    if not prev_path.exists():
        return
    try:
        prev = json.loads(prev_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"--out: {prev_path} is not readable JSON ({e}); delete the folder or pick a new --out") from None
    if not isinstance(prev, dict):
        raise SystemExit(f"--out: {prev_path} is not a run record; delete the folder or pick a new --out")
    for key in ("model", "task"):
        if prev.get(key) != json.loads(json.dumps(run[key])):
            raise SystemExit(f"--out: {out} holds a run with another {key} config; pick a new --out folder")


def run_train(args) -> dict:
    # every flag, the model config and --out are checked before the corpus is read and tokenised
    writable_dir(args.out, "--out")
    warmup = min(50, args.steps) if args.warmup is None else args.warmup
    try:
        tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=warmup,
                           eval_every=args.eval_every, eval_batches=args.eval_batches, seed=args.seed,
                           threads=args.threads, device=args.device, out_dir=args.out,
                           checkpoint_every=args.eval_every)
    except ValueError as e:
        raise SystemExit(f"training flags: {e}") from None
    build_config(args, 256)  # the vocabulary follows the task; every other field is checked now
    task = build_task(args)
    cfg = build_config(args, task.vocab_size)
    out = Path(args.out)
    run = {"model": cfg.to_dict(), "task": {"name": task.name, "seq_len": task.seq_len} if args.task == "text"
           else {"name": task.name, "seq_len": args.seq_len or 64, "pairs": args.pairs, "vocab": args.vocab},
           "train": asdict(tcfg)}
    _check_resume(out, run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run, indent=2))

    torch.manual_seed(args.seed)  # the initial weights are a function of --seed
    model = LM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.config or f'{args.preset} ({args.size})'}, {n_params / 1e6:.2f} M parameters; "
          f"task: {task.name}, vocab {task.vocab_size}; out: {out}")
    result = train(model, task, tcfg)

    png = plot_metrics(out / "metrics.jsonl", out / "loss.png")
    model_dir = model.cpu().save(out / "model")
    if hasattr(task, "tokenizer"):
        task.tokenizer.save(model_dir / "tokenizer.json")
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


def add_parser(sub, fn) -> None:
    """Register `evict train` (calling fn(args)) on the argparse subparsers object."""
    t = sub.add_parser("train", help="train any preset on text (default Shakespeare) or MQAR; save a generate-able model")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--preset", default="gpt2", choices=presets.FAMILIES, help="model family (default gpt2)")
    src.add_argument("--config", help="a ModelConfig JSON file instead of a preset")
    t.add_argument("--size", default="tiny", choices=sorted(presets.SIZES))
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="ModelConfig override, e.g. n_layers=2; repeatable")
    t.add_argument("--task", default="text", choices=["text", "mqar"])
    t.add_argument("--corpus", help="text: a UTF-8 file or a folder of *.txt (default: Shakespeare)")
    t.add_argument("--tokenizer", default="char", type=tokenizer_arg,
                   help="char, byte, bpe (trained on the corpus) or the path of a pretrained HF tokenizer.json")
    t.add_argument("--bpe-vocab", type=positive_int, default=2048)
    t.add_argument("--seq-len", type=positive_int, help="default 256 (text) / 64 (mqar)")
    t.add_argument("--pairs", type=positive_int, default=4, help="mqar: key-value pairs")
    t.add_argument("--vocab", type=positive_int, default=8192, help="mqar: vocabulary size")
    t.add_argument("--steps", type=positive_int, default=1000)
    t.add_argument("--batch-size", type=positive_int, default=32)
    t.add_argument("--lr", type=positive_float, default=3e-3)
    t.add_argument("--warmup", type=nonneg_int, default=None, help="warmup steps, at most --steps (default min(50, steps))")
    t.add_argument("--eval-every", type=positive_int, default=100, help="also the checkpoint interval")
    t.add_argument("--eval-batches", type=positive_int, default=10)
    t.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda, cuda:1 …")
    t.add_argument("--threads", type=positive_int, help="torch CPU threads")
    t.add_argument("--seed", type=seed, default=0)
    t.add_argument("--out", default="runs/train/latest", help="output folder; an existing one is resumed")
    t.set_defaults(fn=fn)

