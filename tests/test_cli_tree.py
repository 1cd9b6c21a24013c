"""The shape of `evict …`'s parser tree: each bench has only its own flags, and a flag a command does not have is
one line naming that command (CPU, fast: parsing only)."""

import pytest

from evict.cli import main

OTHER_BENCHES_FLAGS = [
    ["bench", "decode", "--url", "http://127.0.0.1:1", "--clients", "4"],  # serve's flags on decode
    ["bench", "ops", "--contexts", "1024"],  # decode's on ops
    ["bench", "serve", "--lengths", "256"],  # ops' on serve
    ["bench", "train", "--shapes", "1x8"],  # ops' on train
    ["bench", "decode", "--procs", "2"],  # train's on decode
]


@pytest.mark.parametrize("argv", OTHER_BENCHES_FLAGS, ids=[" ".join(a[:3]) for a in OTHER_BENCHES_FLAGS])
def test_a_bench_refuses_another_benchs_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"evict bench {argv[1]}: error: unrecognized arguments: {argv[2]}"), err


def _parsers():
    """(command path, parser) for every parser of the tree, the top one and the groups (bench, lab) included."""
    import argparse

    from evict.cli import build_parser

    out, todo = [], [("evict", build_parser())]
    while todo:
        path, p = todo.pop(0)
        out.append((path, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{path} {name}", child) for name, child in a.choices.items()]
    return out


PARSERS = _parsers()


def _example_argv(line: str) -> list[str]:
    """`evict ARGS` or `torchrun … -m evict.cli ARGS` -> ARGS."""
    import shlex

    words = shlex.split(line)
    if words[0] == "evict":
        return words[1:]
    assert "evict.cli" in words, line
    return words[words.index("evict.cli") + 1:]


def test_the_tree_has_every_command():
    paths = {path for path, _ in PARSERS}
    assert {"evict train", "evict generate", "evict bench ops", "evict bench decode", "evict bench serve",
            "evict bench train", "evict lab state", "evict lab hybrid", "evict recall", "evict serve"} <= paths


@pytest.mark.parametrize("path, parser", PARSERS, ids=[path for path, _ in PARSERS])
def test_every_help_has_a_description_and_examples_that_parse(path, parser, monkeypatch):
    """Each --help says what the command does and shows at least one example; every example is a command line this
    parser tree accepts, of this command (or, for a group, of one of its commands)."""
    import torch

    from evict.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU examples parse here too (parsing only)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    text = parser.format_help()
    assert parser.description and len(parser.description.split()) >= 5, path
    assert parser.description.split("\n")[0] in text
    assert parser.epilog and parser.epilog.startswith("examples:\n") and parser.epilog in text, path
    examples = [line.strip() for line in parser.epilog.splitlines()[1:] if line.strip()]
    assert examples, path
    for line in examples:
        argv = _example_argv(line)
        assert " ".join(["evict", *argv]).startswith(path), (path, line)
        args, extra = build_parser().parse_known_args(argv)
        assert not extra, (line, extra)


LEAVES = [(path, p) for path, p in PARSERS if p.get_default("fn") is not None]


@pytest.mark.parametrize("path, parser", LEAVES, ids=[path for path, _ in LEAVES])
def test_every_command_takes_quiet_and_verbose(path, parser):
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"-q", "--quiet", "-v", "--verbose"} <= flags, path
    with pytest.raises(SystemExit):  # not both
        parser.parse_args(["-q", "-v"])


def test_verbosity_sets_the_log_levels(monkeypatch, capsys):
    import logging

    from evict.cli import main

    monkeypatch.setattr("evict.demo.run_demo", lambda: None)
    try:
        for flag, root, ours in (([], logging.WARNING, logging.WARNING), (["-q"], logging.ERROR, logging.ERROR),
                                 (["-v"], logging.INFO, logging.DEBUG)):
            assert main(["demo", *flag]) == 0
            assert logging.getLogger().level == root and logging.getLogger("evict").getEffectiveLevel() == ours, flag
    finally:
        logging.getLogger("evict").setLevel(logging.NOTSET)


def test_a_model_build_logs_its_layers_at_debug_only(caplog):
    import logging

    from evict.models import LM, presets

    with caplog.at_level(logging.INFO, logger="evict"):
        LM(presets.get("kda", n_layers=2))
    assert not [r for r in caplog.records if r.name.startswith("evict")]
    with caplog.at_level(logging.DEBUG, logger="evict"):
        LM(presets.get("kda", n_layers=2))
    assert [r.getMessage() for r in caplog.records if r.name == "evict.models.lm"] == ["LM K K"]
