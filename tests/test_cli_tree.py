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
