"""`evict train`'s run-folder flags, hardened (issue 76): --config run.json replays every `train` field or refuses it by
name; --no-resume removes only what evict wrote; --out expands ~; --set vocab_size, a decay that flips the weights and
--compile-lean against a run.json that records compile false are one line before anything runs."""

import dataclasses
import json

import pytest

from evict.cli import build_parser, main
from evict.commands.train import _start_over, resolve, train_config
from evict.models import presets
from evict.train import TrainConfig


def _run_json(tmp_path, **train):
    t = dataclasses.asdict(TrainConfig(steps=3, batch_size=4, out_dir="somewhere", stop_at=1.0))
    t.update(train)
    run = {"model": presets.get("gpt2", size="tiny", vocab_size=64).to_dict(),
           "task": {"name": "text", "task": "text", "corpus": None, "tokenizer": "char", "bpe_vocab": 2048,
                    "seq_len": 16}, "train": t}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    return path


def _resolve(argv):
    return resolve(build_parser().parse_args(argv))


def test_every_train_field_of_a_run_json_is_replayed(tmp_path):
    path = _run_json(tmp_path, betas=[0.8, 0.9], target_accuracy=0.5, prefetch=0, select_labels=False, lr=2e-3,
                     weight_decay=0.01)
    tcfg = train_config(_resolve(["train", "--config", str(path), "--out", str(tmp_path / "o")]))
    assert (tcfg.betas, tcfg.target_accuracy, tcfg.prefetch, tcfg.select_labels) == ((0.8, 0.9), 0.5, 0, False)
    assert (tcfg.lr, tcfg.weight_decay, tcfg.steps, tcfg.batch_size) == (2e-3, 0.01, 3, 4)
    # the session's own fields are not replayed: this session writes to its --out and has no deadline
    assert tcfg.out_dir == str(tmp_path / "o") and tcfg.stop_at is None


@pytest.mark.parametrize("field, value, says", [
    ("betas", [0.9], "train.betas: expected two numbers"),
    ("betas", "fast", "train.betas: expected two numbers"),
    ("betas", [0.9, 1.5], "betas must be two numbers in [0, 1)"),
    ("target_accuracy", "high", "train.target_accuracy: expected a number"),
    ("target_accuracy", 3.0, "target_accuracy must be in (0, 1]"),
    ("prefetch", -1, "prefetch must be >= 0"),
    ("prefetch", 1.5, "train.prefetch: expected an integer"),
    ("select_labels", "yes", "train.select_labels: expected true or false"),
    ("no_such_field", 1, "train.no_such_field: not a field evict train can replay"),
])
def test_a_bad_recorded_train_field_is_one_line(tmp_path, capsys, monkeypatch, field, value, says):
    monkeypatch.chdir(tmp_path)
    path = _run_json(tmp_path, **{field: value})
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "o").exists()


def test_out_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert _resolve(["train", "--out", "~/run"]).out == str(tmp_path / "run")


def test_no_resume_removes_only_what_evict_wrote(tmp_path):
    out = tmp_path / "run"
    mine = ["notes.txt", "model/README.md", "tensorboard/plot.csv", "data/x.bin"]
    evicts = ["run.json", "metrics.jsonl", "checkpoint.pt", "summary.json", "loss.png", "model/config.json",
              "model/model.safetensors", "model/tokenizer.json", "model/tokenizer_config.json", "model/special_tokens_map.json", "tensorboard/events.out.tfevents.1.host",
              "checkpoint-4.dcp/.metadata", "checkpoint-4.dcp/__0_0.distcp"]
    for name in mine + evicts:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    _start_over(out)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == sorted(mine)
    assert not (out / "checkpoint-4.dcp").exists()  # emptied: the folder goes too


@pytest.mark.parametrize("argv, says", [
    (["--set", "vocab_size=10"], "--set vocab_size: the vocabulary follows the task"),
    (["--weight-decay", "1e30"], "weight_decay must be < 1 / lr"),
    (["--weight-decay", "400", "--lr", "0.01"], "weight_decay must be < 1 / lr = 100"),
])
def test_flags_that_cannot_train_are_one_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "2", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "o").exists()


def test_compile_lean_implies_compile_unless_a_run_json_records_compile_false(tmp_path, capsys, monkeypatch):
    """--compile-lean alone turns --compile on; a run.json that records compile false (an eager run's, or one edited to
    compile_lean true) contradicts it: one line naming --compile-lean, exit 2, nothing written; --compile given as
    well wins over the file. A compiled run.json from before the flag (no compile_lean field) replays the keep-all form
    it ran (compile_lean False); one from before lean became the default records false and replays keep-all as well;
    a fresh --compile leaves compile_lean None (the module's default form, lean), --no-compile-lean makes it False."""
    monkeypatch.chdir(tmp_path)
    o = tmp_path / "o"
    tcfg = train_config(_resolve(["train", "--compile-lean", "--out", str(o)]))
    assert (tcfg.compile, tcfg.compile_lean) == (True, True)
    for recorded, extra in (({}, ["--compile-lean"]), ({"compile_lean": True}, [])):
        path = _run_json(tmp_path, compile=False, **recorded)
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(path), "--out", str(o), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err == [f"evict train: error: --compile-lean: {path} records compile false, and "
                                             "the lean form is a form of --compile; pass --compile as well, or drop "
                                             "--compile-lean"], err
        assert not o.exists()
        tcfg = train_config(_resolve(["train", "--config", str(path), "--out", str(o), "--compile", *extra]))
        assert (tcfg.compile, tcfg.compile_lean) == (True, True)
    old = _run_json(tmp_path, compile=True)
    d = json.loads(old.read_text())
    del d["train"]["compile_lean"]
    old.write_text(json.dumps(d))
    tcfg = train_config(_resolve(["train", "--config", str(old), "--out", str(o)]))
    assert (tcfg.compile, tcfg.compile_lean) == (True, False)
    tcfg = train_config(_resolve(["train", "--config", str(old), "--out", str(o), "--compile-lean"]))
    assert (tcfg.compile, tcfg.compile_lean) == (True, True)
    assert train_config(_resolve(["train", "--compile", "--out", str(o)])).compile_lean is None
    assert train_config(_resolve(["train", "--compile", "--no-compile-lean", "--out", str(o)])).compile_lean is False
    eager = _run_json(tmp_path, compile=False)
    d = json.loads(eager.read_text())
    del d["train"]["compile_lean"]
    eager.write_text(json.dumps(d))
    assert train_config(_resolve(["train", "--config", str(eager), "--out", str(o)])).compile_lean is None
    recorded_false = _run_json(tmp_path, compile=True, compile_lean=False)
    assert train_config(_resolve(["train", "--config", str(recorded_false), "--out", str(o)])).compile_lean is False
