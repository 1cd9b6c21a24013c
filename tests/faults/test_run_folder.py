"""A run folder under faults: two runs at once, kill -9 mid-run (mid metrics append, mid checkpoint) then resume,
a torn or foreign metrics line, a full disk. Nothing recorded is false (run.json never claims steps the checkpoint
lacks; metrics hold each step once), nothing written is lost (a resume continues from the last checkpoint)."""

from __future__ import annotations

import errno
import json
import logging
import random
import time

import pytest

from evict.cli import main
from evict.runfolder import LOCK_NAME, read_metrics, run_lock, trim_metrics
from evict.train import read_checkpoint
from tests.test_cli_train import TINY, corpus  # noqa: F401  (the tiny model flags and the corpus fixture)

from .common import kill9, spawn, wait_for_line

HOLDER = """
import sys, time
from evict.runfolder import run_lock
with run_lock(sys.argv[1]):
    print("go", flush=True)
    time.sleep(600)
"""


def test_a_second_run_on_a_locked_folder_is_refused_naming_the_holder(tmp_path):
    child = spawn(HOLDER, str(tmp_path / "run"))
    try:
        wait_for_line(child, "go")
        with pytest.raises(ValueError, match=rf"^out: .*run is in use by another run \(pid {child.pid} on "):
            with run_lock(tmp_path / "run"):
                pass
    finally:
        kill9(child)


def test_a_lock_left_by_a_killed_run_is_named_and_taken_over(tmp_path, caplog):
    child = spawn(HOLDER, str(tmp_path / "run"))
    wait_for_line(child, "go")
    kill9(child)
    assert (tmp_path / "run" / LOCK_NAME).read_text()  # the dead run's record is still there
    with caplog.at_level(logging.WARNING), run_lock(tmp_path / "run"):
        with run_lock(tmp_path / "run"):  # re-entrant in one process (the CLI, then its loop)
            pass
    said = [r.getMessage() for r in caplog.records if "ended without releasing" in r.getMessage()]
    assert len(said) == 1 and f"pid {child.pid}" in said[0]
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released cleanly: nothing stale left


def test_a_torn_last_line_is_dropped_with_a_note_and_a_stepless_line_is_named(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [{"split": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"split": "train", "st')
    with caplog.at_level(logging.WARNING):
        assert read_metrics(path) == rows
    assert any("torn last line" in r.getMessage() and "metrics.jsonl" in r.getMessage() for r in caplog.records)
    trim_metrics(path, 2)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:2])
    for bad, says in (('{"split": "train"}\n', "metrics.jsonl:3 has no integer \"step\""),
                      ('[1, 2]\n', "metrics.jsonl:3 has no integer \"step\""),
                      ('{"step": "3"}\n', "metrics.jsonl:3 has no integer \"step\""),
                      ('not json\n', "metrics.jsonl:3 is not a JSON row")):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + bad)
        with pytest.raises(ValueError, match=f"^metrics: .*{says}"):
            read_metrics(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "garbage\n" + json.dumps(rows[2]) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:3 is not a JSON row"):  # torn, but not last: not a crash's
        read_metrics(path)


def _argv(corpus, out, steps, *extra):
    return ["train", "--corpus", str(corpus), "--seq-len", "16", "--batch-size", "4", "--steps", str(steps),
            "--warmup", "1", "--eval-every", "3", "--eval-batches", "1", "--threads", "1", "--log-every", "1",
            "--out", str(out), *TINY, *extra]


def _check_folder(out) -> int:
    """What a killed run left is true: run.json claims no step the checkpoint lacks; returns the checkpoint's step."""
    step = read_checkpoint(out / "checkpoint.pt")["step"] if (out / "checkpoint.pt").exists() else 0
    if (out / "run.json").exists():
        assert json.loads((out / "run.json").read_text())["steps_done"] <= step
    return step


def _check_resumed(out, steps: int) -> None:
    rows = read_metrics(out / "metrics.jsonl")
    train = [r["step"] for r in rows if r["split"] == "train"]
    assert train == list(range(1, steps + 1))  # every step once: nothing lost, nothing twice
    assert json.loads((out / "run.json").read_text())["steps_done"] == steps


def test_kill_9_mid_run_then_resume_keeps_every_step_once(corpus, tmp_path):  # noqa: F811
    rng = random.Random(76)
    out = tmp_path / "run"
    for kill in range(2):
        child = spawn("import sys; from evict.cli import main; main(sys.argv[1:])", *_argv(corpus, out, 100000))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "checkpoint.pt").exists():
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))  # mid-append, mid-checkpoint or mid-step: wherever it lands
        kill9(child)
        step = _check_folder(out)
        assert step >= 3
        if kill == 1:  # as if the kill had cut an append short
            with (out / "metrics.jsonl").open("a") as f:
                f.write('{"split": "train", "step": ')
        with pytest.raises(SystemExit):  # a resume asking fewer steps than done is refused, and changes nothing
            main(_argv(corpus, out, step - 1))
        main(_argv(corpus, out, step + 1))
        _check_resumed(out, step + 1)


def test_two_runs_on_one_out_the_second_is_refused(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    child = spawn("import sys; from evict.cli import main; main(sys.argv[1:])", *_argv(corpus, out, 100000))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "metrics.jsonl").exists():
            time.sleep(0.05)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(_argv(corpus, out, 4))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and f"is in use by another run (pid {child.pid}" in err[0], err
    finally:
        kill9(child)
    _check_folder(out)


def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes(corpus, tmp_path, capsys, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    main(_argv(corpus, out, 3))
    real_open = type(out).open

    def full(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(type(out), "open", full)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(_argv(corpus, out, 6))
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "it/s]" not in line]  # tqdm's bar
    assert e.value.code == 2 and len(err) == 1 and "No space left on device" in err[0] and "metrics.jsonl" in err[0], err
    monkeypatch.undo()
    assert _check_folder(out) == 3
    main(_argv(corpus, out, 6))
    _check_resumed(out, 6)


@pytest.mark.parametrize("fail", [RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
                                  OSError(errno.EROFS, "Read-only file system")])
def test_a_checkpoint_that_cannot_be_written_keeps_the_last_one(tmp_path, fail, monkeypatch):
    import torch

    from evict.train import save_checkpoint

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 3})

    def broken(obj, f, *args, **kwargs):
        open(f, "wb").write(b"PK\x03\x04 half")  # what a full disk leaves: a partial temporary
        raise fail

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="cannot write the checkpoint") as e:
        save_checkpoint(path, {"step": 6})
    assert e.value.filename == str(path)
    monkeypatch.undo()
    assert read_checkpoint(path)["step"] == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
