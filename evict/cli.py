"""`evict …`: the console entry. The subcommands live in evict/commands/, one module each."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from evict.cli_args import Parser, UserError, examples_text, first_line, out_of_memory, refill


def build_parser() -> Parser:
    from evict import __version__
    from evict.commands import bench, convert, data, demo, explore, generate, lab, recall, serve, size, train

    p = Parser(prog="evict", description=refill(
        "Attention is an associative memory; a fixed-size memory must evict.\n\n"
        "evict is a library of memories for language models (attention, MLA, linear attention, DeltaNet, Gated "
        "DeltaNet, KDA as one update equation) and a lab that measures them. `evict COMMAND --help` describes a "
        "command, its flags and examples."),
        epilog=examples_text("evict demo", "evict recall --quick", "evict train --preset kda --out runs/kda",
                             "evict generate --model runs/kda --prompt 'ROMEO:'"))
    p.add_argument("--version", action="version", version=f"evict {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in (demo, bench, recall, size, train, generate, explore, serve, convert, data, lab):
        command.add_parser(sub)
    for leaf in _leaves(p):
        leaf.set_defaults(parser=leaf)
        _add_verbosity(leaf)
    return p


def _add_verbosity(p: argparse.ArgumentParser) -> None:
    """-q / -v, the same on every command."""
    group = p.add_argument_group("output").add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="errors and results only (no warnings, no log lines)")
    group.add_argument("-v", "--verbose", action="store_true",
                       help="log lines too, down to debug detail (e.g. each model's layer list)")


def _set_verbosity(quiet: bool, verbose: bool) -> None:
    """Log lines on stderr: warnings by default; -q errors only; -v evict's debug lines and others' info too."""
    logging.basicConfig(format="%(message)s")  # a handler on the root logger, unless one is there (pytest's)
    logging.getLogger().setLevel(logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING)
    logging.getLogger("evict").setLevel(logging.DEBUG if verbose else logging.NOTSET)


def _leaves(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of the runnable commands (`evict train`, `evict bench ops`, `evict lab state`, …), in order."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [p]
    return [leaf for s in subs for child in dict.fromkeys(s.choices.values()) for leaf in _leaves(child)]


def main(argv=None) -> int:
    """Run one subcommand. A user error (bad flag, value, path or file) is one line on stderr and exit code 2;
    EVICT_DEBUG=1 shows the traceback instead."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    leaf = vars(args).pop("parser")  # the command's own parser (not a flag: kept out of records of the flags)
    if extra:  # named by the command that refused them, not by `evict`
        leaf.error(f"unrecognized arguments: {' '.join(extra)}")
    _set_verbosity(args.quiet, args.verbose)
    name = {"bench": f"bench {getattr(args, 'what', '')}",
            "lab": f"lab {getattr(args, 'experiment', '')}"}.get(args.command, args.command)
    try:
        args.fn(args)
    except SystemExit as e:
        if isinstance(e, UserError) or isinstance(e.code, str):
            raise _fail(name, str(e)) from None
        raise
    except Exception as e:
        # user errors: bad values (ValueError), paths (OSError), sizes that do not fit (host or device memory), an
        # optional package not installed (ModuleNotFoundError; ours name the package and its pip line)
        user = isinstance(e, (ValueError, OSError, ModuleNotFoundError)) or out_of_memory(e)
        if not user or os.environ.get("EVICT_DEBUG") == "1":
            raise
        raise _fail(name, _describe(e)) from None
    return 0


def _describe(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    if out_of_memory(e):
        return f"out of memory ({first_line(e)}); try smaller sizes"
    return str(e) or type(e).__name__


def _fail(name: str, message: str) -> UserError:
    """Print `evict <name>: error: <message>` on one line to stderr; return the UserError (exit code 2) to raise."""
    message = " ".join(message.split()) or "failed"
    print(f"evict {name}: error: {message}", file=sys.stderr)
    return UserError(message)


if __name__ == "__main__":
    sys.exit(main())
