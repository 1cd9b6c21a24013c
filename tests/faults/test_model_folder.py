"""A model folder under faults: kill -9 mid-save, two writers and a reader at once, a full disk, a read-only folder.
What a load returns is always one save's config with that save's weights, or one line refusing."""

from __future__ import annotations

import errno
import random
import time

import pytest
import torch

from evict.models import LM
from evict.models.config import ModelConfig

from .common import kill9, spawn, wait_for_line

# A child that saves model A or B (seed and norm_eps differ) into argv[1], forever, printing "go" once started; with an
# argv[3], it rests a random 0..argv[3] seconds between saves. (The flock is not fair: two writers saving back to back
# can starve one another for tens of seconds on a loaded two-core machine, as CI's did; the rest gives the other writer
# its turn, while every save still races the reader's loads.)
SAVER = """
import random, sys, time, torch
from evict.models import LM
from evict.models.config import ModelConfig
which = sys.argv[2]
models = {w: (torch.manual_seed(s), LM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, pattern="AK",
          norm_eps=e)))[1] for w, s, e in (("A", 0, 1e-5), ("B", 1, 1e-3))}
order = "AB" if which == "both" else which
models[order[0]].save(sys.argv[1])
print("go", flush=True)
rest = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
i = 0
while True:
    i += 1
    models[order[i % len(order)]].save(sys.argv[1])
    if rest:
        time.sleep(random.uniform(0.0, rest))
"""


def _models() -> dict[float, LM]:
    out = {}
    for seed, eps in ((0, 1e-5), (1, 1e-3)):
        torch.manual_seed(seed)
        out[eps] = LM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, pattern="AK", norm_eps=eps))
    return out


def _assert_one_save(folder, models) -> None:
    """The folder loads as exactly one of the saved models: its config and every tensor of that model."""
    _assert_is_one(LM.load(folder), models)


def _assert_is_one(got: LM, models) -> None:
    want = models[got.cfg.norm_eps]
    assert got.cfg == want.cfg
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.equal(a, b), name


def test_kill_9_mid_save_leaves_one_whole_save_and_no_temporaries(tmp_path):
    models, rng = _models(), random.Random(76)
    folder = tmp_path / "m"
    for _ in range(3):
        child = spawn(SAVER, str(folder), "both")
        wait_for_line(child, "go")
        time.sleep(rng.uniform(0.0, 0.4))
        kill9(child)
        _assert_one_save(folder, models)
    models[1e-5].save(folder)  # the next save clears what a killed one left
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


# A child whose tensor write dies as safetensors' would mid-file: its own temporary (".tmp" + 6 characters, beside its
# target) written, then SIGKILL. session 61's CI saw such a file left in the folder by the kill -9 test above.
DIES_IN_WRITE = """
import os, pathlib, signal, sys, torch
import safetensors.torch
from evict.models import LM
from evict.models.config import ModelConfig

def dies(model, filename, metadata=None):
    pathlib.Path(filename).with_name(".tmpAbC123").write_bytes(b"half a file")
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_model = dies
LM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, pattern="AK")).save(sys.argv[1])
"""


def test_a_save_killed_inside_the_tensor_write_leaves_nothing_after_the_next_save(tmp_path):
    models = _models()
    folder = tmp_path / "m"
    models[1e-5].save(folder)
    child = spawn(DIES_IN_WRITE, str(folder))
    child.wait(timeout=120)
    assert child.returncode == -9, child.returncode
    assert len(list(folder.iterdir())) > 2  # the dead write's leftovers are there
    _assert_one_save(folder, models)
    models[1e-3].save(folder)  # the next save clears them
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    _assert_is_one(LM.load(folder), {1e-3: models[1e-3]})


def test_two_writers_and_a_reader_never_mix_a_pair(tmp_path):
    models = _models()
    folder = tmp_path / "m"
    a = spawn(SAVER, str(folder), "A", "0.02")
    wait_for_line(a, "go")
    b = spawn(SAVER, str(folder), "B", "0.02")
    try:
        wait_for_line(b, "go")
        seen = set()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or len(seen) < 2:
            got = LM.load(folder)  # never refused, never mixed: the folder lock orders saves and loads
            _assert_is_one(got, models)
            seen.add(got.cfg.norm_eps)
            assert time.monotonic() < deadline + 30, "one writer never got the folder"
    finally:
        kill9(a)
        kill9(b)
    _assert_one_save(folder, models)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["tensors", "config"])
def test_a_full_disk_keeps_the_last_save_and_says_so(tmp_path, monkeypatch, where):
    models = _models()
    folder = tmp_path / "m"
    models[1e-5].save(folder)
    if where == "tensors":
        monkeypatch.setattr("safetensors.torch.save_model", _no_space)
    else:
        monkeypatch.setattr("pathlib.Path.write_text", _no_space)
    with pytest.raises(ValueError, match=r"^path: cannot write the model into .*No space left on device"):
        models[1e-3].save(folder)
    monkeypatch.undo()
    _assert_one_save(folder, models)
    assert LM.load(folder).cfg.norm_eps == 1e-5
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_a_read_only_folder_is_one_line(tmp_path, monkeypatch):
    models = _models()
    folder = tmp_path / "m"
    models[1e-5].save(folder)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("pathlib.Path.write_text", read_only)
    with pytest.raises(ValueError, match=r"^path: cannot write the model into .*Read-only file system"):
        models[1e-3].save(folder)
    monkeypatch.setattr("pathlib.Path.mkdir", read_only)
    with pytest.raises(ValueError, match=r"^path: cannot create the model folder .*Read-only file system"):
        models[1e-3].save(tmp_path / "new")
    monkeypatch.undo()
    _assert_one_save(folder, models)


def test_a_save_cut_between_its_two_renames_loads_as_that_save(tmp_path):
    """The window kill -9 rarely hits, made by hand: B's tensors renamed into A's folder, B's config still a temporary."""
    models = _models()
    models[1e-5].save(tmp_path / "a")
    models[1e-3].save(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    (tmp_path / "b" / "config.json").replace(tmp_path / "a" / ".config.json.tmp-99999")
    assert LM.load(tmp_path / "a").cfg.norm_eps == 1e-3
    _assert_one_save(tmp_path / "a", models)
    (tmp_path / "a" / ".config.json.tmp-99999").unlink()  # without it, the pair is refused, not mixed
    with pytest.raises(ValueError, match="is not the config saved with model.safetensors"):
        LM.load(tmp_path / "a")
