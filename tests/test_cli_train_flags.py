"""`evict train`'s training flags and resume semantics: replay a run.json, continue a finished run, refuse what
cannot be honoured (one line, nothing written), start over, grad norm and tokens/s in the metrics; --compile-lean's
runs (the lean compiled blocks train as eager does; recorded and replayed)."""

import json
import sys

import pytest
import torch

from evict.cli import main
from evict.models import LM
from tests.test_cli_train import TINY, corpus  # noqa: F401  (the tiny model flags and the corpus fixture)
from tests.test_distributed_gpu import COMPILED_RTOL


def _argv(corpus, out, *extra, steps=2):
    return ["train", "--corpus", str(corpus), "--seq-len", "16", "--batch-size", "4", "--steps", str(steps),
            "--warmup", "1", "--eval-every", "2", "--eval-batches", "1", "--threads", "1", "--log-every", "1",
            "--out", str(out), *TINY, *extra]


def _rows(out, split="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def _snapshot(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_flags_reach_the_run_and_run_json_replays(corpus, tmp_path):
    out = tmp_path / "a"
    main(_argv(corpus, out, "--grad-accum", "2", "--weight-decay", "0.05", "--clip", "0.5", "--min-lr", "1e-4",
               "--amp", "none"))
    run = json.loads((out / "run.json").read_text())
    t = run["train"]
    assert (t["grad_accum"], t["weight_decay"], t["grad_clip"], t["amp"], t["log_every"]) == (2, 0.05, 0.5, "none", 1)
    assert t["min_lr_ratio"] == pytest.approx(1e-4 / 3e-3)
    assert run["steps_done"] == 2 and run["world_size"] == 1 and run["per_rank_batch"] == 4
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # the run.json replays the same run (model, task, flags) into another folder
    main(["train", "--config", str(out / "run.json"), "--out", str(tmp_path / "b")])
    assert json.loads((tmp_path / "b" / "run.json").read_text())["train"] == {**t, "out_dir": str(tmp_path / "b")}
    assert [r["loss"] for r in _rows(tmp_path / "b")] == [r["loss"] for r in rows]


def test_finished_run_continues_with_more_steps(corpus, tmp_path):
    whole = tmp_path / "whole"
    main(_argv(corpus, whole, steps=4))
    out = tmp_path / "run"
    main(_argv(corpus, out, steps=2))
    main(_argv(corpus, out, "--weight-decay", "0.2", steps=4))  # more steps and a changed flag: honoured
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["lr"] > 0 for r in rows)  # the schedule is re-planned for 4 steps: never a zero learning rate
    assert [r["lr"] for r in rows[2:]] == [r["lr"] for r in _rows(whole)[2:]]
    run = json.loads((out / "run.json").read_text())
    assert run["steps_done"] == 4 and [s["steps"] for s in run["segments"]] == [[0, 2], [2, 4]]
    assert [s["train"]["weight_decay"] for s in run["segments"]] == [0.1, 0.2]
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["optimizer"]["param_groups"][0]["weight_decay"] == 0.2
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("extra, message", [
    (["--seed", "1"], "seed: the checkpoint was trained with 0, got 1"),
    (["--batch-size", "8"], "batch_size: the checkpoint was trained with 4, got 8"),
    (["--steps", "1"], "steps: the checkpoint has already trained 2 steps"),
    (["--set", "d_model=64"], "another model config"),
])
def test_resume_refuses_what_it_cannot_honour(corpus, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    main(_argv(corpus, out))
    before = _snapshot(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(_argv(corpus, out) + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert _snapshot(out) == before
    main(_argv(corpus, out, "--no-resume") + extra)  # starting over is allowed
    assert json.loads((out / "run.json").read_text())["steps_done"] == (1 if "--steps" in extra else 2)


@pytest.mark.parametrize("extra, message", [
    (["--grad-accum", "3"], "batch_size must be a multiple of grad_accum=3"),
    (["--min-lr", "0.1"], "--min-lr: expected a number in [0, --lr=0.003]"),
    (["--clip", "-1"], "--clip: expected a finite number >= 0"),
    (["--log-every", "0"], "--log-every: expected a positive integer"),
    (["--ckpt-every", "0"], "--ckpt-every: expected a positive integer"),
    (["--dist", "zero"], "--dist: invalid choice"),
])
def test_bad_training_flags_are_refused_before_anything_is_written(corpus, tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(_argv(corpus, out) + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_bad_config_values_are_refused(corpus, tmp_path, capsys):
    run = tmp_path / "run.json"
    for bad, message in ((("task", "seq_len"), 0), "--seq-len: expected a positive integer, got '0'"), \
                        ((("train", "steps"), "ten"), "--steps: expected a positive integer, got 'ten'"), \
                        ((("train", "amp"), "fp8"), "--amp: unexpected value 'fp8'"):
        (where, key), value = bad[0], bad[1]
        d = {"model": {}, "task": {"task": "text", "corpus": str(corpus)}, "train": {}}
        d[where][key] = value
        d["model"] = {"pattern": "A", "d_model": 32, "n_layers": 1, "n_heads": 2, "head_dim": 16}
        run.write_text(json.dumps(d))
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(run), "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
        assert not (tmp_path / "o").exists()


def test_failed_run_leaves_no_record_and_retry_works(corpus, tmp_path, monkeypatch):
    import evict.train

    def broken(path, state):
        raise RuntimeError("disk gone")

    out = tmp_path / "run"
    monkeypatch.setattr(evict.train, "save_checkpoint", broken)
    with pytest.raises(RuntimeError, match="disk gone"):
        main(_argv(corpus, out))
    assert not (out / "run.json").exists() and not (out / "checkpoint.pt").exists()
    monkeypatch.undo()
    main(_argv(corpus, out))
    assert json.loads((out / "run.json").read_text())["steps_done"] == 2


def test_tensorboard_flag(corpus, tmp_path, capsys, monkeypatch):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        tensorboard = None
    if tensorboard is not None:
        main(_argv(corpus, tmp_path / "tb", "--tensorboard"))
        assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        main(_argv(corpus, tmp_path / "none", "--tensorboard"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["evict train: error: --tensorboard: the tensorboard package is not installed "
                                         "(pip install tensorboard)"]
    assert not (tmp_path / "none").exists()


def _losses_close(out, eager):
    got, want = [r["loss"] for r in _rows(out)], [r["loss"] for r in _rows(eager)]
    assert len(got) == len(want) >= 2 and all(abs(a - b) <= COMPILED_RTOL * abs(b) for a, b in zip(got, want)), \
        (got, want)


def test_compile_lean_reaches_compile_blocks_trains_as_eager_and_replays(corpus, tmp_path, monkeypatch):
    """--compile-lean (alone: it implies --compile) calls the LM's compile_blocks(lean=True) once; the run's losses are
    the eager run's within the compiled-vs-eager tolerance; run.json records compile and compile_lean, and resuming the
    run from it (--config run.json, more steps) compiles lean again and records it in the new segment. The graphs are
    compiled by aot_eager_decomp_partition: Inductor's partitioner under the lean form's LEAN_PARTITION, the graphs
    run eager (seconds; Inductor's own C++ compile of the same run is the slow test below)."""
    import torch._dynamo

    torch._dynamo.reset()
    calls = []
    real = LM.compile_blocks

    def spy(self, **kw):
        calls.append(kw)
        real(self, backend="aot_eager_decomp_partition", **kw)

    monkeypatch.setattr(LM, "compile_blocks", spy)
    main(_argv(corpus, tmp_path / "eager", "--preset", "kda"))
    assert calls == []
    out = tmp_path / "lean"
    main(_argv(corpus, out, "--preset", "kda", "--compile-lean"))
    assert calls == [{"lean": True}]
    _losses_close(out, tmp_path / "eager")
    t = json.loads((out / "run.json").read_text())["train"]
    assert (t["compile"], t["compile_lean"]) == (True, True)
    main(["train", "--config", str(out / "run.json"), "--out", str(out), "--steps", "3"])
    assert calls == [{"lean": True}] * 2
    run = json.loads((out / "run.json").read_text())
    assert run["steps_done"] == 3 and [s["steps"] for s in run["segments"]] == [[0, 2], [2, 3]]
    assert [(s["train"]["compile"], s["train"]["compile_lean"]) for s in run["segments"]] == [(True, True)] * 2


@pytest.mark.slow
def test_compile_lean_through_inductor_trains_as_eager(corpus, tmp_path):
    """`evict train --compile-lean` as a user runs it: each KDA block through Inductor (C++ on the CPU) in the lean
    form; the losses are the eager run's within the compiled-vs-eager tolerance. ~2 minutes on 2 busy cores."""
    import torch._dynamo

    torch._dynamo.reset()
    main(_argv(corpus, tmp_path / "eager", "--preset", "kda"))
    main(_argv(corpus, tmp_path / "lean", "--preset", "kda", "--compile-lean"))
    _losses_close(tmp_path / "lean", tmp_path / "eager")
