"""Property tests (hypothesis) for the doors hardened in issue 76: `LM.forward(positions=)`, devices given to
`LM.load` / `new_cache` / `new_pool`, the config digest of a saved folder, the chunk-dial cache check. Every bad value
is one ValueError naming its argument; every good one is accepted."""

import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from evict import LM, ModelConfig  # noqa: E402
from evict.explore import dial  # noqa: E402

FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

torch.manual_seed(0)
MODEL = LM(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, pattern="AK", max_seq_len=64))


@FAST
@given(B=st.integers(1, 3), T=st.integers(1, 6), P=st.integers(0, 4), lo=st.integers(-10, 10), hi=st.integers(-10, 10),
       seed=st.integers(0, 2**16))
def test_positions_in_range_pick_rows_and_out_of_range_are_named(B, T, P, lo, hi, seed):
    lo, hi = min(lo, hi), max(lo, hi)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (B, T), generator=g)
    pos = torch.randint(lo, hi + 1, (B, P), generator=g)
    if P and (int(pos.min()) < 0 or int(pos.max()) >= T):
        with pytest.raises(ValueError, match=r"^positions: expected indices into the T="):
            MODEL(x, positions=pos)
        return
    with torch.no_grad():
        got, full = MODEL(x, positions=pos), MODEL(x)
    assert got.shape == (B, P, 32)
    assert torch.equal(got, full.gather(1, pos[..., None].expand(-1, -1, 32)))


DEVICES = st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:9", "mps", "xpu", "gpu", "", "cpu:0", "meta",
                                     "CPU", "cuda:-1", "cuda:x"]),
                    st.text(max_size=8), st.integers(-3, 3), st.floats(allow_nan=True), st.none())


@FAST
@given(device=DEVICES)
def test_a_device_is_accepted_or_one_line_naming_device(device):
    try:
        dev = None if device is None else torch.device(device)
        ok = dev is None or dev.type in ("cpu", "meta") or (dev.type == "cuda" and torch.cuda.is_available()
                                                            and (dev.index or 0) < torch.cuda.device_count())
    except (RuntimeError, TypeError, ValueError):
        ok = False
    for call in (lambda: MODEL.new_cache(1, 4, device=device), lambda: MODEL.new_pool(1, 2, 4, 8, device=device)):
        if ok:
            call()
        else:
            with pytest.raises(ValueError, match=r"^device: ") as e:
                call()
            assert "\n" not in str(e.value)
    if not ok:
        with pytest.raises(ValueError, match=r"^device: "):
            LM.load("/nonexistent-evict-folder", device=device)


SAVED = Path(tempfile.mkdtemp()) / "m"
MODEL.save(SAVED)
CONFIG = json.loads((SAVED / "config.json").read_text())
EDITABLE = {"norm_eps": st.floats(1e-8, 1e-2).filter(lambda v: v != CONFIG["norm_eps"]),
            "neg_eigval": st.just(not CONFIG["neg_eigval"]),
            "gate_form": st.sampled_from(["softplus", "bounded"]).filter(lambda v: v != CONFIG["gate_form"]),
            "rope_theta": st.floats(100.0, 1e6).filter(lambda v: v != CONFIG["rope_theta"])}


@FAST
@given(data=st.data(), fields=st.sets(st.sampled_from(sorted(EDITABLE)), min_size=1), indent=st.sampled_from([None, 1, 4]))
def test_any_edit_of_a_saved_config_is_refused_and_any_relayout_loads(data, fields, indent):
    edited = {**CONFIG, **{f: data.draw(EDITABLE[f]) for f in fields}}
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "model.safetensors").symlink_to(SAVED / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(dict(reversed(list(CONFIG.items()))), indent=indent))
        assert torch.equal(LM.load(folder).embed.weight, MODEL.embed.weight)
        (folder / "config.json").write_text(json.dumps(edited, indent=indent))
        with pytest.raises(ValueError, match=r"^checkpoint: .*config.json is not the config saved with"):
            LM.load(folder)


SMALL = dial.Dial(T=8, H=1, D=4, repeats=1)
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans(), st.text(max_size=3),
                    st.none())


@FAST
@given(seconds=st.lists(NUMBERS, min_size=0, max_size=6))
def test_the_dial_cache_serves_only_finite_positive_times_of_its_shape(seconds):
    with tempfile.TemporaryDirectory() as d:
        m = dial.Measurer(SMALL, Path(d))
        m.path.write_text(json.dumps({"sizes": SMALL.sizes(), "seconds": seconds, "shape": asdict(SMALL)}))
        valid = len(seconds) == len(SMALL.sizes()) and all(
            type(s) in (int, float) and math.isfinite(s) and s > 0 for s in seconds)
        assert (m.result() is not None) == valid


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=4), st.lists(st.floats(-1, 2), max_size=3))


@FAST
@given(field=st.sampled_from(["betas", "target_accuracy", "prefetch", "graphs", "select_labels", "bogus"]), value=VALUES)
def test_a_recorded_train_field_is_replayed_exactly_or_refused_in_one_line(field, value):
    """`evict train --config run.json`: any value of a flagless `train` field is either the TrainConfig's value or one
    line naming `train.<field>` (or TrainConfig's check of it); never dropped, never a traceback."""
    import dataclasses

    from evict.cli import build_parser
    from evict.commands.train import resolve, train_config
    from evict.models import presets
    from evict.train import TrainConfig

    t = {**dataclasses.asdict(TrainConfig(steps=3, batch_size=4)), field: value}
    run = {"model": presets.get("gpt2", size="tiny", vocab_size=64).to_dict(), "task": {"task": "text"}, "train": t}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "run.json"
        path.write_text(json.dumps(run))
        try:
            tcfg = train_config(resolve(build_parser().parse_args(["train", "--config", str(path), "--out", d])))
        except SystemExit as e:
            msg = str(e.code)
            assert "\n" not in msg and field in msg, msg
            return
    assert field != "bogus"
    assert getattr(tcfg, field) == (tuple(value) if field == "betas" else value)
