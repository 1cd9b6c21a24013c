"""Flag types and output checks for `evict …`: a bad value is rejected while parsing, with one line naming the flag.

Types (for argparse `type=`): positive_int, nonneg_int, seed, positive_float, nonneg_float, unit_interval, device.
Checks (before any work or write): writable_file(path, flag), writable_dir(path, flag).
Lab commands: add_lab_parser (--quick / --full, --steps, --lr and the sweep flags), run_lab (flags over QUICK / FULL).
`Parser` is an ArgumentParser whose errors are one line (no usage block), exit code 2.
Errors in brief: out_of_memory(e) (host or device), first_line(e) (for a one-line message).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

N = TypeVar("N", int, float)


class UserError(SystemExit):
    """A one-line error for the user: printed to stderr by `evict.cli.main`, exit code 2; str() is the message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def out_of_memory(e: BaseException) -> bool:
    """Whether an error is a lack of memory: the host's (MemoryError) or a device's (torch's OutOfMemoryError, by name:
    no torch import here)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"


def first_line(e: BaseException, width: int = 160) -> str:
    """An error in brief, for a one-line message: the first line of its message, cut to `width` characters; its
    type's name when it has no message."""
    text = str(e).strip()
    return text.splitlines()[0][:width] if text else type(e).__name__


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in `--help` (unless it is None or False, or its help already names its default); the
    description and the examples (epilog) as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)".strip()


class Parser(argparse.ArgumentParser):
    """One-line errors (exit 2); `--help` shows defaults. Subcommand parsers are Parsers too (argparse builds them with
    the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        for action in self._actions:  # an option without help text still gets a line for its default
            if action.help is None and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                action.help = "default: %(default)s"
        return super().format_help()


def described(help: str, description: str, *examples: str) -> dict[str, str]:
    """`add_parser` keywords of a command: its line in the parent's list (help), what it does (description, shown
    by its own --help, refilled to 79 columns; a blank line separates paragraphs) and one or more command lines
    under "examples:" (epilog, as written)."""
    return {"help": help, "description": refill(description), "epilog": examples_text(*examples)}


def refill(text: str, width: int = 79) -> str:
    """Each paragraph of `text` (blank-line separated) as lines of at most `width` characters."""
    import textwrap

    return "\n\n".join(textwrap.fill(" ".join(par.split()), width) for par in text.split("\n\n"))


def examples_text(*examples: str) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in examples)


def _number(text: str, kind: type[N], want: str, ok: Callable[[N], bool]) -> N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if (kind is float and not math.isfinite(value)) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def nonneg_int(text: str) -> int:
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def seed(text: str) -> int:
    return _number(text, int, "an integer in [0, 2**32)", lambda v: 0 <= v < 2**32)


def positive_float(text: str) -> float:
    return _number(text, float, "a finite number > 0", lambda v: v > 0)


def nonneg_float(text: str) -> float:
    return _number(text, float, "a finite number >= 0", lambda v: v >= 0)


def unit_interval(text: str) -> float:
    return _number(text, float, "a number in (0, 1]", lambda v: 0 < v <= 1)


def batch_by_length(text: str) -> tuple[int, int]:
    """`4x8192` -> (4, 8192): a batch size and a sequence length, both positive."""
    b, sep, t = text.partition("x")
    try:
        shape = (int(b), int(t))
    except ValueError:
        shape = (0, 0)
    if not sep or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected BxT with positive integers (e.g. 4x8192), got {text!r}")
    return shape


def device(text: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; a CUDA device must exist on this machine."""
    import torch

    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _can_create_in(folder: Path) -> str | None:
    """None when a file can be created in `folder` (probed with a temporary file, removed at once), else why not."""
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".evict-write-check-"):
            pass
    except OSError as e:
        return f"{folder} is not writable ({e.strerror or type(e).__name__})"
    return None


def writable_file(path: str | os.PathLike | None, flag: str) -> None:
    """Raise UserError unless `path` can be created or overwritten as a file (nothing is left behind)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{flag}: {p} is a folder, expected a file path")
    if p.exists():
        try:
            with p.open("ab"):
                pass
        except OSError as e:
            raise UserError(f"{flag}: {p} is not writable ({e.strerror or type(e).__name__})") from None
        return
    why = _can_create_in(_existing_ancestor(p.parent))
    if why:
        raise UserError(f"{flag}: cannot create {p}: {why}")


def writable_dir(path: str | os.PathLike | None, flag: str) -> None:
    """Raise UserError unless `path` is (or can be created as) a writable folder (nothing is left behind)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag}: {p} is a file, expected a folder")
    why = _can_create_in(_existing_ancestor(p))
    if why:
        raise UserError(f"{flag}: cannot use {p}: {why}")


def add_sweep_flags(p: argparse.ArgumentParser, *, seeds_help: str) -> None:
    """The flags every resumable lab sweep shares: seeds, processes, device, output folder."""
    p.add_argument("--seeds", type=positive_int, help=seeds_help)
    p.add_argument("--seed", type=seed, help="the first seed (default 0): the runs use seeds SEED … SEED+SEEDS-1")
    p.add_argument("--workers", type=positive_int, help="parallel processes (default 2 quick, 4 full)")
    p.add_argument("--device", type=device, help="cpu, cuda or auto")
    p.add_argument("--out", help="output folder; an existing one is resumed")


def add_gate_dt_flag(p: argparse.ArgumentParser, default: str = "1e-3 1e-1") -> None:
    """--gate-dt MIN MAX: the decay gates' initial dt range (ModelConfig.gate_dt_min / gate_dt_max), for the labs;
    `default` as the help states it (a lab whose --full starts the gates slow says so)."""
    p.add_argument("--gate-dt", nargs=2, type=positive_float, metavar=("MIN", "MAX"),
                   help=f"the decay gates' initial dt range, log-uniform (default {default}); the rate is A dt, A ~ U(1, 16)")


def add_lab_parser(lab_sub, name: str, *, help: str, description: str, examples: tuple[str, ...], quick: str, full: str,
                   seeds_help: str, modes: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """`evict lab <name>` with the flags every lab sweep has: --quick (the default) or --full (or one of the lab's
    own `modes`, flag -> help: the preset of that upper-cased name, - read as _, in the lab's module: --counters-full
    -> COUNTERS_FULL), --steps, --batch-size, --lr, then add_sweep_flags'; the caller adds its own and sets `fn`.
    `help`, `description`, `examples`: as described's."""
    s = lab_sub.add_parser(name, **described(help, description, *examples))
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"the default: {quick}")
    mode.add_argument("--full", action="store_true", help=full)
    for flag, text in (modes or {}).items():
        mode.add_argument(f"--{flag}", action="store_true", help=text)
    s.set_defaults(lab_modes=tuple(flag.replace("-", "_") for flag in modes or ()))
    s.add_argument("--steps", type=positive_int)
    s.add_argument("--batch-size", type=positive_int, help="sequences per optimizer step (default: the mode's)")
    s.add_argument("--lr", type=positive_float)
    s.add_argument("--minutes", type=positive_float,
                   help="stop after about this long (runs in flight checkpoint); the same command with --out continues")
    add_sweep_flags(s, seeds_help=seeds_help)
    return s


def run_lab(args, lab, overrides: dict) -> None:
    """Run module `lab`'s sweep (lab.run_sweep on lab.QUICK, lab.FULL or the preset of a lab's own mode) with the
    flags given laid over it: the shared ones of add_lab_parser and `overrides` (field -> value, None = not given);
    --minutes makes the run a timed piece (sweep.with_deadline).
    A bad value is a user error."""
    from dataclasses import replace

    writable_dir(args.out, "--out")
    shared = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds, "seed": args.seed,
              "workers": args.workers, "device": args.device}
    given = {k: v for k, v in {**overrides, **shared}.items() if v is not None}
    try:
        base = lab.FULL if args.full else lab.QUICK
        for m in getattr(args, "lab_modes", ()):
            if getattr(args, m):
                base = getattr(lab, m.upper())
        lab.run_sweep(replace(base, **given), out=args.out, minutes=args.minutes)
    except ValueError as e:
        raise UserError(str(e)) from None


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
