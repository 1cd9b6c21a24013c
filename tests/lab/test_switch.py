"""The eviction-stories lab: the recorded gates and survivals against a hand computation, and the sweep end to end
on a micro configuration (real training)."""

import json
import math
from dataclasses import replace

import pytest
import torch

from evict.cli import main
from evict.lab import switch
from evict.lab.switch import QUICK, SwitchTask, read_memory, recording, run_sweep, task_config
from evict.models import LM

MICRO = replace(QUICK, facts=1, distractor=2, new=2, fact_keys=2, topic_keys=4, values=4, d_model=8, head_dim=4,
                n_layers=1, seeds=1, steps=2, eval_every=1, eval_batches=1, batch_size=4, workers=1)


def _model(name, sweep=MICRO):
    task = SwitchTask(task_config(sweep, 0))
    torch.manual_seed(0)
    return LM(switch.model_config(name, sweep, task.vocab_size, task.seq_len)), task


def test_recording_sees_the_ops_inputs_and_changes_nothing():
    model, task = _model("kda", replace(MICRO, n_layers=2))
    x, _ = task.get_batch("val", 0, 3)
    with torch.no_grad():
        plain = model(x)
        with recording() as calls:
            again = model(x)
    assert torch.equal(plain, again) and len(calls) == 2
    q, k, la, beta, delta = calls[0]
    assert q.shape == k.shape == la.shape == (3, task.seq_len, 1, 4)  # per channel: [B, T, H, D]
    assert beta.shape == (3, task.seq_len, 1) and delta is True
    assert torch.allclose(k.norm(dim=-1), torch.ones(3, task.seq_len, 1))  # unit keys: a share sums to 1
    from evict.layers import memory_mixer
    from evict.ops import memory
    assert memory_mixer.memory is memory  # put back


def test_read_memory_by_hand_for_a_scalar_gate(monkeypatch):
    """Gated DeltaNet with its gate pinned to log α = -0.1 per token (and -2 at the switch): every channel's
    survival across the switch and every pair's survival are products of those gates."""
    model, task = _model("gated_deltanet")
    mixer = model.blocks[0].mixer
    s, Q = task.cfg.switch_at, task.cfg.questions_at

    def pinned(x):
        la = torch.full(x.shape[:2] + (mixer.H,), -0.1)
        la[:, s] = -2.0
        return la

    monkeypatch.setattr(mixer, "log_alpha", pinned)
    out = read_memory(model, task, MICRO)
    layer = out["layers"][0]
    assert torch.allclose(torch.tensor(layer["alpha_switch"]), torch.full((1, 4), math.exp(-2.0)))
    assert torch.allclose(torch.tensor(layer["alpha_distractor"]), torch.full((1, 4), math.exp(-0.1)))
    across = torch.tensor(layer["across_switch"])[:, 0, 0]  # from the fact's value token (position 1) on
    want = [math.exp(-0.1 * (t - 1) - (1.9 if t >= s else 0)) for t in range(1, task.seq_len)]
    assert torch.allclose(across, torch.tensor(want, dtype=across.dtype), atol=1e-6)
    fact = math.exp(-0.1 * (Q - 1 - 1) - 1.9)  # written at 1, read at Q - 1, the switch in between
    new = [math.exp(-0.1 * (Q - 1 - p)) for p in (s + 2, s + 4)]
    assert layer["fact"][0] == pytest.approx(fact, rel=1e-5)
    assert layer["new"][0] == pytest.approx(sum(new) / 2, rel=1e-5)
    assert 0 <= out["fact_accuracy"] <= 1 and 0 <= out["new_accuracy"] <= 1


@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_carried_keys_rebuild_the_state(gate, delta):
    """With every token a write and no initial state, the reference op's state after token t is Σ_p x_p(t) (β_p v_p)^T:
    the carried keys are the state's columns, each later erase (I - β k k^T) acting on the earlier pairs' keys."""
    from evict.ops import memory
    from tests.ops.test_memory import make_inputs

    B, T, H, D, V = 2, 11, 2, 4, 3
    x = make_inputs(B, T, H, D, V, gate=gate, beta_max=1.5, seed=4)
    la = x["log_alpha"][..., None].expand(B, T, H, D) if gate == "scalar" else x["log_alpha"]
    X = switch.carried_keys(x["k"], la, x["beta"], delta, list(range(T)), range(T))
    S = torch.zeros(B, H, D, V, dtype=torch.float64)
    for t in range(T):  # u_t from the token loop itself
        S_faded = S * la[:, t].exp()[..., None]
        u = x["v"][:, t] - (torch.einsum("bhd,bhdv->bhv", x["k"][:, t], S_faded) if delta else 0)
        S = S_faded + x["k"][:, t, :, :, None] * (x["beta"][:, t, :, None] * u)[:, :, None, :]
        _, S_op = memory(x["q"][:, :t + 1], x["k"][:, :t + 1], x["v"][:, :t + 1], log_alpha=x["log_alpha"][:, :t + 1],
                         beta=x["beta"][:, :t + 1], delta=delta, impl="reference", output_final_state=True)
        assert torch.allclose(S, S_op, atol=1e-12)
        if t == 0:
            us = []
        us.append(x["beta"][:, t, :, None] * x["v"][:, t])
        rebuilt = torch.einsum("bhpd,pbhv->bhdv", X[t][:, :, :t + 1], torch.stack(us))
        assert torch.allclose(rebuilt, S_op, atol=1e-12), t


def test_sweep_runs_resumes_and_writes_outputs(tmp_path):
    root = run_sweep(MICRO, out=tmp_path / "sweep")
    for name in ("config.json", "results.jsonl", "table.md", "stories.png", "lesson.json", "lesson.png"):
        assert (root / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted(r["model"] for r in rows) == sorted(MICRO.models) and all(r["steps"] == 2 for r in rows)
    for r in rows:
        (layer,) = r["layers"]
        assert len(layer["alpha_switch"]) == 1 and len(layer["alpha_switch"][0]) == MICRO.head_dim
        if r["model"] == "gated_deltanet":  # one gate per head: every channel the same
            assert len({round(a, 6) for a in layer["alpha_switch"][0]}) == 1
    table = (root / "table.md").read_text()
    assert "| 8 twin boards, per-channel gate | 95.0% | 10.0% |" in table
    lesson = json.loads((root / "lesson.json").read_text())
    assert lesson["twin_boards"]["per_channel"]["read_cat"] == pytest.approx([1.9, 0.95, 0, 0.95])
    stamps = {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}
    run_sweep(MICRO, out=root)  # resuming a finished sweep trains nothing
    assert stamps == {p: p.stat().st_mtime_ns for p in (root / "runs").glob("*/result.json")}


def test_bad_sweeps_and_cli(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^models: "):
        run_sweep(replace(MICRO, models=("attention",)), out=tmp_path / "x")
    with pytest.raises(ValueError, match=r"^topic_keys: "):
        run_sweep(replace(MICRO, topic_keys=3), out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr("evict.lab.switch.QUICK", MICRO)  # the flags on top of a micro sweep, not the quick one
    assert main(["lab", "stories", "--models", "kda", "--steps", "1", "--out", str(tmp_path / "y")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "y" / "results.jsonl").read_text().splitlines()]
    assert [(r["model"], r["steps"]) for r in rows] == [("kda", 1)]
    assert main(["lab", "stories", "--models", "kda", "--layers", "2", "--steps", "1", "--out", str(tmp_path / "z")]) == 0
    assert json.loads((tmp_path / "z" / "config.json").read_text())["n_layers"] == 2


@pytest.mark.gpu
def test_micro_sweep_on_cuda(tmp_path):
    """Training with whole-step CUDA graphs, then the recorded read of the memory (Triton op) on the GPU."""
    root = run_sweep(replace(MICRO, device="cuda", n_layers=2, steps=4, eval_every=2), out=tmp_path / "gpu")
    rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert sorted(r["model"] for r in rows) == sorted(MICRO.models)
    for r in rows:
        assert len(r["layers"]) == 2 and all(0 <= a <= 1 for a in r["layers"][0]["alpha_switch"][0])
