"""The shared training loop, on CPU with tiny stand-in models: learning, exact resume, hooks, decay, metrics."""

import json
import math

import pytest
import torch
from torch import nn

from evict.plots import plot_metrics
from evict.tasks.base import Task
from evict.train import TrainConfig, TrainResult, WarmupCosine, param_groups, train


class CopyTask:
    """targets = inputs (every position labelled but the first); deterministic in (split, step)."""

    name = "copy"
    vocab_size = 16
    seq_len = 8

    def get_batch(self, split, step, batch_size):
        g = torch.Generator().manual_seed((split == "val") << 31 | step)
        x = torch.randint(0, self.vocab_size, (batch_size, self.seq_len), generator=g)  # [B, T]
        y = x.clone()
        y[:, 0] = -100
        return x, y


class Tiny(nn.Module):
    """Embedding → LayerNorm → Linear; `extra` ([4, 4]) and `gain` ([4]) get zero gradients."""

    def __init__(self, vocab=16, d=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.extra = nn.Parameter(torch.ones(4, 4))
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):  # [B, T] -> [B, T, V]
        h = self.norm(self.emb(x))
        zero = 0.0 * (self.extra.sum() + self.gain.sum())
        return self.head(h) + zero


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _cfg(tmp_path=None, **kw):
    """One thread: these models are tiny, and threads only contend on a shared CPU."""
    base = dict(steps=60, batch_size=32, lr=1e-2, eval_every=20, eval_batches=2, progress=False, log_every=5,
                device="cpu", threads=1, out_dir=str(tmp_path) if tmp_path is not None else None)
    base.update(kw)
    return TrainConfig(**base)


def _rows(path, split):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == split]


def test_learns_copy_task(tmp_path):
    assert isinstance(CopyTask(), Task)
    res = train(Tiny(), CopyTask(), _cfg(tmp_path, steps=150, eval_every=50))
    assert isinstance(res, TrainResult)
    assert res.steps_done == 150 and not res.stopped_early
    assert res.final_val_accuracy > 0.95 and res.best_val_accuracy >= res.final_val_accuracy
    assert [h["step"] for h in res.history] == [50, 100, 150]
    assert res.final_val_loss == res.history[-1]["loss"] and res.wall_seconds > 0


def test_resume_is_exact(tmp_path):
    cfg = dict(steps=20, log_every=1, eval_every=7, warmup_steps=3, min_lr_ratio=0.1, checkpoint_every=10)
    ref_model = Tiny()
    train(ref_model, CopyTask(), _cfg(tmp_path / "ref", **cfg))
    ref = _rows(tmp_path / "ref" / "metrics.jsonl", "train")

    class Crash(Tiny):
        calls = 0

        def forward(self, x):
            if self.training:
                Crash.calls += 1
                if Crash.calls == 14:  # dies in step 14, after the step-10 checkpoint and steps 11–13 logged
                    raise RuntimeError("simulated crash")
            return super().forward(x)

    with pytest.raises(RuntimeError, match="simulated"):
        train(Crash(), CopyTask(), _cfg(tmp_path / "run", **cfg))
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 13
    model = Tiny(seed=123)  # a different init: everything must come from the checkpoint
    res = train(model, CopyTask(), _cfg(tmp_path / "run", **cfg))
    got = _rows(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert [r["lr"] for r in got] == [r["lr"] for r in ref]
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert res.steps_done == 20 and [h["step"] for h in res.history] == [7, 14, 20]

    again = train(Tiny(seed=5), CopyTask(), _cfg(tmp_path / "run", **cfg))  # finished: nothing more to do
    assert again.steps_done == 20 and again.final_val_loss == res.final_val_loss
    fresh = train(Tiny(), CopyTask(), _cfg(tmp_path / "run", resume=False, **cfg))
    assert _rows(tmp_path / "run" / "metrics.jsonl", "train")[0]["loss"] == ref[0]["loss"]
    assert fresh.steps_done == 20


def test_hooks_called_and_aux_added():
    class Hooked(Tiny):
        def __init__(self, aux):
            super().__init__()
            self.use_aux, self.aux_calls, self.after_calls = aux, 0, 0

        def aux_loss(self):
            self.aux_calls += 1
            return 10.0 * self.extra.pow(2).sum() if self.use_aux else None

        def after_step(self):
            self.after_calls += 1

    with_aux, without = Hooked(True), Hooked(False)
    for m in (with_aux, without):
        train(m, CopyTask(), _cfg(steps=25, weight_decay=0.0))
        assert m.aux_calls == 25 and m.after_calls == 25
    assert (with_aux.extra < 0.95).all()  # the aux penalty pulled it toward 0
    assert torch.equal(without.extra, torch.ones(4, 4))  # zero gradient, no decay: untouched


def test_no_weight_decay_on_1d_params():
    groups = param_groups(Tiny(), 0.1)
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and groups[0]["weight_decay"] == 0.1
    assert all(p.ndim < 2 for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(Tiny().parameters()))
    m = Tiny()
    train(m, CopyTask(), _cfg(steps=10, weight_decay=0.5))
    assert torch.equal(m.gain, torch.ones(4))  # 1-D, zero gradient: no decay
    assert (m.extra < 1).all()  # 2-D, zero gradient: decayed


def test_early_stop_and_metrics(tmp_path):
    res = train(Tiny(), CopyTask(), _cfg(tmp_path, steps=2000, eval_every=10, target_accuracy=0.9))
    assert res.stopped_early and res.steps_done < 2000 and res.final_val_accuracy >= 0.9
    assert res.steps_done == res.history[-1]["step"]
    path = tmp_path / "metrics.jsonl"
    tr, va = _rows(path, "train"), _rows(path, "val")
    assert [r["step"] for r in tr] == list(range(5, res.steps_done + 1, 5))
    assert {"step", "loss", "lr", "tokens_per_s", "accuracy"} <= set(tr[0])
    assert [r["step"] for r in va] == list(range(10, res.steps_done + 1, 10))
    assert (tmp_path / "checkpoint.pt").exists() and not list(tmp_path.glob("*.tmp*"))
    png = plot_metrics(path, tmp_path / "plot.png")
    assert png.stat().st_size > 1000


def test_schedule():
    f = WarmupCosine(steps=100, warmup=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1)
    g = WarmupCosine(steps=50, warmup=0, min_ratio=0.0)
    assert g(0) == 1.0 and g(50) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs,word",
    [({"steps": 0}, "steps"), ({"lr": 0.0}, "lr"), ({"warmup_steps": 100}, "warmup_steps"),
     ({"amp": "fp8"}, "amp"), ({"min_lr_ratio": 2.0}, "min_lr_ratio"), ({"target_accuracy": 1.5}, "target_accuracy"),
     ({"checkpoint_every": 0}, "checkpoint_every"), ({"betas": (0.9, 1.0)}, "betas"),
     ({"compile_lean": True}, "^compile_lean: the lean form is a form of the compiled blocks; needs compile=True")],
)
def test_config_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        TrainConfig(**{"steps": 10, **kwargs})


def test_stop_at_checkpoints_and_resumes_exactly(tmp_path):
    """A run stopped by `stop_at` (a time budget) continues from its checkpoint to the same steps and weights."""
    cfg = dict(steps=12, log_every=1, eval_every=5, warmup_steps=2, min_lr_ratio=0.1)
    ref_model = Tiny()
    train(ref_model, CopyTask(), _cfg(tmp_path / "ref", **cfg))
    first = train(Tiny(), CopyTask(), _cfg(tmp_path / "run", stop_at=0.0, **cfg))  # long past: one step, then stop
    assert first.interrupted and first.steps_done == 1 and (tmp_path / "run" / "checkpoint.pt").exists()
    assert first.total_seconds == first.wall_seconds > 0
    model = Tiny(seed=9)
    res = train(model, CopyTask(), _cfg(tmp_path / "run", **cfg))
    assert not res.interrupted and res.steps_done == 12
    # total_seconds: both sessions, the first as its last checkpoint recorded it (just before it returned)
    assert 0 < res.total_seconds - res.wall_seconds <= first.wall_seconds
    got, ref = (_rows(tmp_path / d / "metrics.jsonl", "train") for d in ("run", "ref"))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_stop_file_ends_the_run_at_the_next_evaluation(tmp_path):
    """`stop_file`: absent, the run goes on; present, the run ends at its next evaluation, stopped early, and says so."""
    flag = tmp_path / "solved"
    res = train(Tiny(), CopyTask(), _cfg(tmp_path / "a", steps=12, eval_every=5, stop_file=str(flag)))
    assert res.steps_done == 12 and not res.stopped_early
    flag.write_text("lr=0.01\n")
    res = train(Tiny(), CopyTask(), _cfg(tmp_path / "b", steps=12, eval_every=5, stop_file=str(flag)))
    assert res.steps_done == 5 and res.stopped_early and not res.interrupted and len(res.history) == 1


def test_a_loss_that_stops_being_finite_stops_the_run_and_says_so(tmp_path, caplog):
    """A NaN weight after step 7: the loss logged at step 10 is not finite, so the run stops there (no evaluation of
    the broken weights), keeps the best accuracy it had, records the step in its result, run.json and checkpoint,
    prints one line, and a resume does not train on."""

    class Breaks(Tiny):
        steps = 0

        def after_step(self):
            self.steps += 1
            if self.steps == 7:
                with torch.no_grad():
                    self.head.weight[0, 0] = math.nan

    out = tmp_path / "run"
    cfg = _cfg(out, steps=30, eval_every=5, log_every=5)
    res = train(Breaks(), CopyTask(), cfg, record={"what": "test"})
    assert res.diverged_at == 10 and res.steps_done == 10 and not res.stopped_early
    assert [h["step"] for h in res.history] == [5] and res.best_val_accuracy == res.history[0]["accuracy"]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "not finite by step 10" in warning and "lr 0.01" in warning
    assert json.loads((out / "run.json").read_text())["diverged_at"] == 10
    again = train(Breaks(), CopyTask(), cfg, record={"what": "test"})
    assert again.diverged_at == 10 and again.steps_done == 10 and again.history == res.history
    fine = train(Tiny(), CopyTask(), _cfg(steps=10, eval_every=5, log_every=5))
    assert fine.diverged_at is None and fine.steps_done == 10
