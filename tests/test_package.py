"""The package as a user meets it: metadata, `python -m evict`, `--version`, defaults in every `--help`, py.typed."""

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import evict
from evict.cli import build_parser, main
from tests.conftest import ROOT


def test_metadata_license_readme_and_extras():
    md = importlib.metadata.metadata("evict")
    assert md["Version"] == evict.__version__
    assert md["License-Expression"] == "Apache-2.0" and md["Description-Content-Type"] == "text/markdown"
    assert {"triton", "hf", "serve", "dev"} <= set(md.get_all("Provides-Extra"))
    assert not any("==" in r.split(";")[0] for r in md.get_all("Requires-Dist"))  # ranges, not exact pins
    root = Path(evict.__file__).parent
    assert (root / "py.typed").is_file() and (root.parent / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_python_m_evict_and_version():
    out = subprocess.run([sys.executable, "-m", "evict", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"evict {evict.__version__}"


def _subparsers(parser):
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            for name, sub in action._name_parser_map.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


def test_every_help_shows_defaults():
    parser = build_parser()
    subs = dict(_subparsers(parser))
    assert {"train", "generate", "bench", "convert", "lab state"} <= set(subs)
    for name, sub in subs.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                shown = str(action.default) in " ".join(text.split()) or "default" in (action.help or "").lower()
                assert shown, f"evict {name} --help: {action.option_strings[0]} hides its default {action.default!r}"


def test_train_help_lists_the_default_tokenizer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "(default: char)" in " ".join(capsys.readouterr().out.split())


def test_the_tracked_tree_fits_a_device_call():
    """The `run` tool copies the working tree (tracked files) plus `.whl` (~10 MB) and refuses above 64 MiB; session 29
    committed a 62 MB results/full_runs.md (a broken edit: one paragraph between every character) and the next
    session's first device call was refused. Keep the tree well under the limit and no single text file huge."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    sizes = {n: (ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file()}
    assert sizes, "git ls-files listed nothing"
    total = sum(sizes.values())
    assert total < 48 * 2**20, f"tracked files total {total / 2**20:.1f} MiB; the device call's limit is 64 MiB with .whl"
    big = {n: s for n, s in sizes.items() if n.endswith((".md", ".py", ".sh", ".toml")) and s > 2**20}
    assert not big, f"text files over 1 MiB: {big}"
    leftovers = sorted(n for n in sizes if n.endswith((".orig", ".rej", ".bak", "~")) or "/.dev_" in f"/{n}")
    assert not leftovers, f"merge / patch leftovers or device copies tracked: {leftovers}"


@pytest.mark.parametrize("argv,lab", [(["recall"], "recall"), (["lab", "pairs"], "pairs"), (["lab", "hybrid"], "hybrid")])
def test_gate_dt_help_states_the_sweeps_ranges(capsys, argv, lab):
    """The CLI modules import no lab (start-up stays light), so `--gate-dt`'s help restates the sweeps' gate_dt as a
    literal: it must say each mode's range, quick's first, and full's where it differs."""
    mod = importlib.import_module(f"evict.lab.{lab}")
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    said = text.split("initial dt range, log-uniform (default ")[1].split(")")[0]  # e.g. "1e-3 1e-1 quick, 1e-4 1e-3 full"
    modes = [part.split() for part in said.split(", ")]
    quick, full = (tuple(float(x) for x in s.gate_dt) for s in (mod.QUICK, mod.FULL))
    want = [(quick, [])] if quick == full else [(quick, ["quick"]), (full, ["full"])]
    assert [(tuple(float(x) for x in m[:2]), m[2:]) for m in modes] == want, (argv, said)
