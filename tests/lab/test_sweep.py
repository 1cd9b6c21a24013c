"""Timed pieces of every lab sweep (`--minutes`, evict/lab/sweep.py): a run in flight checkpoints and stops, the
runs not started wait, nothing but the runs' own folders is written, and the same command continues to the results
of one uninterrupted sweep."""

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from evict.cli import main
from evict.lab import capacity, hybrid, pairs, recall, state
from evict.lab import sweep as sweep_mod
from evict.lab.sweep import compiles, curve, lab_train_config, out_of_time, piece_fields, with_deadline

from .test_capacity import MICRO as CAPACITY
from .test_pairs import MICRO as PAIRS
from .test_state import MICRO as STATE

CLOCK = type("Clock", (), {"time": staticmethod(lambda: 0.0)})  # the lab's clock says "start"; train()'s real one "stop"


def test_deadline_helpers():
    jobs = [{"dir": "a"}, {"dir": "b"}]
    assert with_deadline(jobs, None) is jobs and not out_of_time(jobs[0]) and piece_fields(jobs[0], 5) == {}
    timed = with_deadline(jobs, 2.0)
    assert len({j["stop_at"] for j in timed}) == 1 and 119 < timed[0]["stop_at"] - time.time() <= 120
    assert not out_of_time(timed[0]) and piece_fields(timed[0], 5) == {"stop_at": timed[0]["stop_at"], "checkpoint_every": 5}
    assert out_of_time({"stop_at": time.time() - 1})
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="minutes: expected a positive number"):
            with_deadline(jobs, bad)


def test_lab_train_config_carries_the_sweep_and_the_piece():
    """The one TrainConfig of the state and stories labs' runs: the sweep's schedule, the job's folder and seed, and a
    timed piece's stop and checkpoints; CUDA graphs only where the sweep's device is a GPU (here the CPU)."""
    sweep = replace(STATE, steps=7, batch_size=5, lr=2e-3, eval_every=3, eval_batches=4)
    tc = lab_train_config(sweep, 11, {"dir": "runs/x"})
    assert (tc.steps, tc.batch_size, tc.lr, tc.eval_every, tc.eval_batches) == (7, 5, 2e-3, 3, 4)
    assert (tc.seed, tc.out_dir, tc.device, tc.weight_decay, tc.warmup_steps) == (11, "runs/x", "cpu", 0.1, 0)
    assert not tc.graphs and tc.stop_at is None and not tc.progress
    timed = lab_train_config(sweep, 11, {"dir": "runs/x", "stop_at": 123.0})
    assert (timed.stop_at, timed.checkpoint_every) == (123.0, 3)
    assert not tc.compile


def test_compiled_blocks_only_on_a_gpu_and_where_the_sweep_asks():
    """`compiles`: torch.compile of the blocks where the sweep has `compile` and its device is CUDA (the recall and
    hybrid labs' --full; the device named, not run, so this holds on a CPU machine too); never on the CPU, never for a
    sweep without the field (state, stories), never with --no-compile's False."""
    gpu = lambda s, **kw: replace(s, device="cuda", **kw)
    assert compiles(gpu(hybrid.FULL)) and compiles(gpu(recall.FULL))
    assert not compiles(replace(hybrid.FULL, device="cpu")) and not compiles(gpu(hybrid.FULL, compile=False))
    assert not compiles(gpu(hybrid.QUICK)) and not compiles(gpu(STATE))
    tc = hybrid.train_config(gpu(hybrid.FULL), "mqar", 0)
    assert tc.compile and tc.graphs and tc.steps == 8000
    assert not hybrid.train_config(gpu(hybrid.FULL, compile=False), "mqar", 0).compile


def _rows(root):
    return [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]


def test_state_lab_in_pieces_equals_one_piece(tmp_path, capsys, monkeypatch):
    sweep = replace(STATE, tasks=("parity",), models=("deltanet",), steps=6, eval_every=2)
    whole = state.run_sweep(sweep, out=tmp_path / "whole")
    late = state.run_sweep(sweep, out=tmp_path / "late", minutes=1e-9)  # over before the run starts: nothing runs
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out
    assert not list(late.glob("runs/*")) and not (late / "table.md").exists() and not (late / "results.jsonl").exists()
    monkeypatch.setattr(sweep_mod, "time", CLOCK)
    piece = state.run_sweep(sweep, out=tmp_path / "piece", minutes=1e-9)  # starts, stops after a step, checkpointed
    monkeypatch.setattr(sweep_mod, "time", time)
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out
    assert not (piece / "table.md").exists() and not list(piece.glob("runs/*/result.json"))
    assert (next(piece.glob("runs/*")) / "checkpoint.pt").exists()
    state.run_sweep(sweep, out=piece)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(_rows(piece)) == strip(_rows(whole)) and (piece / "table.md").exists()


def test_a_sweep_grows_its_seeds_over_a_folder_and_keeps_its_runs(tmp_path):
    """Seeds only choose which runs exist (a lab's WHICH_FIELDS; each run's folder names its seed): a sweep over a
    folder of the same sweep with fewer seeds trains only the new seeds' runs, and config.json says the new count;
    a field that changes what a run trains is still refused."""
    sweep = replace(STATE, tasks=("parity",), models=("deltanet",), steps=2, eval_every=2)
    root = state.run_sweep(sweep, out=tmp_path / "s")
    (first,) = root.glob("runs/*/result.json")
    stamp = first.stat().st_mtime_ns
    state.run_sweep(replace(sweep, seeds=2), out=root)
    assert first.stat().st_mtime_ns == stamp and len(list(root.glob("runs/*/result.json"))) == 2
    assert json.loads((root / "config.json").read_text())["seeds"] == 2 and len(_rows(root)) == 2
    with pytest.raises(ValueError, match=r"^out: .* holds a sweep with another config"):
        state.run_sweep(replace(sweep, seeds=2, steps=4), out=root)


def test_pairs_lab_piece_keeps_finished_rungs(tmp_path, capsys, monkeypatch):
    sweep = replace(PAIRS, rules=("deltanet",), dims=(4,), pairs=(1, 2), steps=4, eval_every=2)
    whole = pairs.run_sweep(sweep, out=tmp_path / "whole")
    monkeypatch.setattr(sweep_mod, "time", CLOCK)
    piece = pairs.run_sweep(sweep, out=tmp_path / "piece", minutes=1e-9)
    monkeypatch.setattr(sweep_mod, "time", time)
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out and not (piece / "table.md").exists()
    assert list(piece.glob("runs/*/*/checkpoint.pt")) and not list(piece.glob("runs/*/*/result.json"))
    pairs.run_sweep(sweep, out=piece)
    strip = lambda rows: [(r["rule"], r["d"], r["max_pairs"], [g["accuracy"] for g in r["rungs"]]) for r in rows]
    assert strip(_rows(piece)) == strip(_rows(whole))


def test_capacity_lab_piece_starts_nothing_after_its_end(tmp_path, capsys):
    sweep = replace(CAPACITY, rules=("delta",), sizes=(2,), overwrite=(False,), seeds=1)
    root = capacity.run_sweep(sweep, out=tmp_path / "c", minutes=1e-9)
    assert "0 of 1 runs finished, 1 left" in capsys.readouterr().out and not (root / "table.md").exists()
    capacity.run_sweep(sweep, out=root)
    assert len(_rows(root)) == 1 and (root / "table.md").exists()


def test_cli_minutes_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["lab", "state", "--minutes", "0", "--out", str(tmp_path / "x")])
    assert e.value.code != 0 and "--minutes" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("text, said", [("{oops", "is not readable JSON"), ("[1, 2]", "holds a JSON list")])
def test_a_corrupted_sweep_config_is_one_line(tmp_path, capsys, text, said):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["lab", "state", "--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0 and len(err.splitlines()) == 1 and f"out: {tmp_path / 'config.json'} {said}" in err
    assert (tmp_path / "config.json").read_text() == text and not (tmp_path / "runs").exists()  # nothing written


def test_a_corrupted_result_is_named_not_retrained_or_skipped(tmp_path):
    """A finished run's result.json that is not a JSON object (written by hand, or a disk fault: evict writes it
    whole or not at all) stops the sweep with the file's name, not a traceback or a silent retrain."""
    sweep = replace(STATE, tasks=("parity",), models=("deltanet",), steps=2, eval_every=2)
    root = state.run_sweep(sweep, out=tmp_path / "s")
    (done,) = root.glob("runs/*/result.json")
    done.write_text('{"accuracy": ')
    with pytest.raises(ValueError, match=rf"^out: {re.escape(str(done))} is not readable JSON"):
        state.run_sweep(sweep, out=root)


def test_stopped_message_says_the_time_the_piece_took(monkeypatch, tmp_path):
    """A piece that ends early (no run left would finish in time) says how long it took, not its budget."""
    from evict.lab import sweep as sweep_mod

    now = [1000.0]
    monkeypatch.setattr(sweep_mod, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    jobs = sweep_mod.with_deadline([{"dir": "a"}, {"dir": "b"}], 10)
    now[0] += 90  # 1.5 of the piece's 10 minutes
    msg = sweep_mod.stopped_message(10, jobs, 1, tmp_path)
    assert msg.startswith("stopped after 1.5 min (a piece of at most 10 min): 1 of 2 runs finished, 1 left"), msg
    assert sweep_mod.stopped_message(None, [{"dir": "a"}], 1, tmp_path).startswith("stopped: 0 of 1 runs finished")


def _square_or_die(job):  # module level: the spawned workers import it from here
    import os
    import signal

    if job["n"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # what the system's out-of-memory killer does
    return {"n": job["n"] ** 2}


def test_a_killed_worker_ends_the_sweep_with_an_error_not_a_hang(tmp_path):
    """Session 15: `evict recall --full` on the CPU had a worker killed for lack of memory, and mp.Pool then waited
    forever for its job. Now the sweep stops with a MemoryError (one line from the CLI); finished runs are kept."""
    jobs = [{"n": n, "dir": str(tmp_path / str(n))} for n in range(6)]
    start = time.time()
    with pytest.raises(MemoryError, match=r"a worker process of the sweep was killed.* runs are finished and kept"):
        sweep_mod.run_jobs(_square_or_die, jobs, workers=2)
    assert time.time() - start < 120
    for n in range(6):  # whatever finished before the kill is kept, and right
        done = tmp_path / str(n) / "result.json"
        assert n != 3 or not done.exists()
        assert not done.exists() or json.loads(done.read_text()) == {"n": n * n}
    assert sweep_mod.run_jobs(_square_or_die, jobs[:3], workers=2) == [{"n": 0}, {"n": 1}, {"n": 4}]


def _big_beside_small(job):  # module level: the spawned workers import it from here
    """A fake run on a shared card. "big" runs out of memory whenever another run is in flight (an entry of room/running
    besides its own), and with `always` even alone; a small run stays in flight until big has run out once."""
    import torch

    room = Path(job["room"])
    me = room / "running" / job["name"]
    me.touch()
    try:
        deadline = time.time() + 60
        if job["name"] == "big":
            with (room / "tries").open("a") as f:
                f.write("x")
            while time.time() < deadline:
                if job["always"] or any(p.name != "big" for p in (room / "running").iterdir()):
                    (room / "ran_out").touch()
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB.")
                if all((room / "done" / n).exists() for n in job["smalls"]):
                    return {"name": "big"}
                time.sleep(0.02)
            raise TimeoutError("big: the small runs never finished")
        while not (room / "ran_out").exists() and time.time() < deadline:
            time.sleep(0.02)
        (room / "done" / job["name"]).touch()
        return {"name": job["name"]}
    finally:
        me.unlink()


def _shared_card(tmp_path, always=False):
    room = tmp_path / "room"
    (room / "running").mkdir(parents=True)
    (room / "done").mkdir()
    names = ["big", "s1", "s2"]
    return room, [{"name": n, "room": str(room), "always": always, "smalls": names[1:], "dir": str(tmp_path / n)}
                  for n in names]


def test_a_run_out_of_memory_beside_others_goes_back_in_the_queue_and_runs_with_fewer(tmp_path, capsys):
    """Session 50: one of 8 pairs ladders on an H100 ran out of the card's memory and the error ended the piece. Now
    it goes back in the queue, the sweep runs fewer at once, and it finishes once the others are done."""
    room, jobs = _shared_card(tmp_path)
    out = sweep_mod.run_jobs(_big_beside_small, jobs, workers=3, desc="fake")
    assert out == [{"name": "big"}, {"name": "s1"}, {"name": "s2"}]
    tries = len((room / "tries").read_text())
    assert 2 <= tries <= 3, tries  # out of memory beside s1 / s2 (once or twice), then fine once they were done
    said = capsys.readouterr()
    assert said.out.count("ran out of memory with other runs beside it") + said.err.count(
        "ran out of memory with other runs beside it") == tries - 1
    assert "at most 2 now run at once" in said.out + said.err
    for job, res in zip(jobs, out):
        assert json.loads((Path(job["dir"]) / "result.json").read_text()) == res


def test_a_run_out_of_memory_alone_ends_the_sweep_with_its_error(tmp_path):
    """One that runs out of memory even alone is the run's own problem: its error ends the sweep (the CLI's one line:
    "out of memory (...); try smaller sizes"), and the runs finished beside it are kept."""
    import torch

    room, jobs = _shared_card(tmp_path, always=True)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        sweep_mod.run_jobs(_big_beside_small, jobs, workers=3)
    assert not (Path(jobs[0]["dir"]) / "result.json").exists()
    for job in jobs[1:]:
        assert json.loads((Path(job["dir"]) / "result.json").read_text()) == {"name": job["name"]}
    assert len((room / "tries").read_text()) >= 2  # the last try ran alone

    room, jobs = _shared_card(tmp_path / "last", always=True)  # the sweep's last run: alone from the start, one try
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        sweep_mod.run_jobs(_big_beside_small, jobs[:1], workers=3)
    assert (room / "tries").read_text() == "x"


def _hog(job):  # module level: the spawned workers import it from here
    """Two of these fill 60 % of the card each: once both are in flight (or after one ran out), allocate; the one that
    got its memory holds it until the other has run out."""
    import torch

    room = Path(job["room"])
    (room / "running" / job["name"]).touch()
    deadline = time.time() + 60
    while len(list((room / "running").iterdir())) < 2 and not (room / "ran_out").exists() and time.time() < deadline:
        time.sleep(0.02)
    try:
        x = torch.empty(int(0.6 * torch.cuda.get_device_properties(0).total_memory), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        (room / "ran_out").touch()
        raise
    while not (room / "ran_out").exists() and time.time() < deadline:
        time.sleep(0.02)
    del x
    return {"name": job["name"]}


@pytest.mark.gpu
def test_two_runs_too_big_for_the_card_together_both_finish_one_after_the_other(tmp_path):
    """On a real card: a run that ran out of device memory beside another runs again once that one is done, and has
    its memory, because the finished run's worker process handed back what its allocator had cached."""
    room = tmp_path / "room"
    (room / "running").mkdir(parents=True)
    jobs = [{"name": n, "room": str(room), "dir": str(tmp_path / n)} for n in ("a", "b")]
    assert sweep_mod.run_jobs(_hog, jobs, workers=2) == [{"name": "a"}, {"name": "b"}]
    assert (room / "ran_out").exists()


def _fill(job):  # module level, like a sweep's run
    import torch

    x = torch.empty(int(job["share"] * torch.cuda.get_device_properties(0).total_memory), dtype=torch.uint8,
                    device="cuda")
    x.fill_(1)
    return {"first": int(x[0])}


@pytest.mark.gpu
def test_a_worker_hands_its_cached_device_memory_back_after_each_job():
    """After a job, finished or out of memory, the worker's allocator keeps nothing cached: the blocks go back to the
    card for the processes beside it (and a job that ran out beside others comes back as SharedOutOfMemory)."""
    import torch

    big, threads = int(0.5 * torch.cuda.get_device_properties(0).total_memory), torch.get_num_threads()
    assert sweep_mod._worker((0, _fill, {"share": 0.6, "dir": "x"}, threads, True)) == (0, {"first": 1})
    assert torch.cuda.memory_reserved() < big
    i, res = sweep_mod._worker((1, _fill, {"share": 2.0, "dir": "y"}, threads, True))
    assert i == 1 and isinstance(res, sweep_mod.SharedOutOfMemory) and "out of memory" in res.message
    assert torch.cuda.memory_reserved() < big
    with pytest.raises(torch.OutOfMemoryError):  # alone, the error is the job's own
        sweep_mod._worker((2, _fill, {"share": 2.0, "dir": "z"}, threads, False))


def test_out_of_memory_is_the_hosts_or_a_devices():
    import torch

    assert sweep_mod.out_of_memory(MemoryError()) and sweep_mod.out_of_memory(torch.OutOfMemoryError("CUDA"))
    assert not sweep_mod.out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def _host_oom(job):  # module level, like a sweep's run
    raise MemoryError("Unable to allocate 745. GiB for an array\nwith shape (1, 2)")


def test_a_worker_hands_back_a_shared_lack_of_memory_in_one_line_and_raises_its_own():
    """On any machine: a job out of (host) memory beside others comes back as SharedOutOfMemory, its message the
    error's first line; alone, the error is the job's own."""
    i, res = sweep_mod._worker((3, _host_oom, {"dir": "x"}, 1, True))
    assert i == 3 and isinstance(res, sweep_mod.SharedOutOfMemory)
    assert res.message == "Unable to allocate 745. GiB for an array"
    with pytest.raises(MemoryError):
        sweep_mod._worker((4, _host_oom, {"dir": "x"}, 1, False))


def test_an_error_in_brief_is_its_first_line_or_its_type():
    from evict.cli_args import first_line

    assert first_line(ValueError("bad header\nat byte 12")) == "bad header"
    assert first_line(ValueError("\n  truncated file \n")) == "truncated file"
    assert first_line(ValueError("x" * 300)) == "x" * 160 and first_line(ValueError("x" * 300), 60) == "x" * 60
    assert first_line(MemoryError()) == "MemoryError" and first_line(KeyError("")) == "''"


def test_run_jobs_hands_out_jobs_in_the_order_of_first_and_returns_them_in_job_order(tmp_path):
    """`first` orders the unfinished jobs for the workers (ties keep job order); results stay in job order, and a
    finished job is read back whatever its key."""
    seen = []

    def square(job):
        seen.append(job["n"])
        return {"n": job["n"] ** 2}

    jobs = [{"n": n, "dir": str(tmp_path / str(n))} for n in range(5)]
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "result.json").write_text('{"n": 16}')
    key = {0: 2, 1: 1, 2: 2, 3: 0, 4: -1}
    out = sweep_mod.run_jobs(square, jobs, first=lambda job: key[job["n"]])
    assert seen == [3, 1, 0, 2] and out == [{"n": n * n} for n in range(5)]


def test_a_rows_curve_spans_every_piece_of_its_run(tmp_path):
    """`curve`: a run stopped after its first step's evaluation and resumed in a second piece reports every evaluation
    of both, the same values as the run trained in one go; accuracy or loss, to 4 decimals."""
    from evict.train import train
    from tests.test_train import CopyTask, Tiny, _cfg

    cfg = dict(steps=6, log_every=1, eval_every=1, warmup_steps=2, min_lr_ratio=0.1)
    first = train(Tiny(), CopyTask(), _cfg(tmp_path / "run", stop_at=0.0, **cfg))
    assert first.interrupted and curve(first) == [[1, round(first.history[0]["accuracy"], 4)]]
    resumed = train(Tiny(seed=9), CopyTask(), _cfg(tmp_path / "run", **cfg))
    whole = train(Tiny(), CopyTask(), _cfg(tmp_path / "whole", **cfg))
    assert [step for step, _ in curve(resumed)] == [1, 2, 3, 4, 5, 6]
    assert curve(resumed) == curve(whole) and curve(resumed, "loss") == curve(whole, "loss")
    assert curve(whole, "loss")[-1][1] == round(whole.final_val_loss, 4)
