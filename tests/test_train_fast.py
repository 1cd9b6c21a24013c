"""The training loop's fast path: logits at the labelled positions only, prefetched batches, whole-step CUDA graphs.
Each is the same computation as the plain loop, checked side by side; the GPU tests also check that MQAR learns."""

import json

import pytest
import torch

from evict import LM, presets
from evict.lab.recall import ARCHS, RecallSweep, model_config
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, label_positions, train


def _losses(path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def test_label_positions():
    y = torch.full((3, 11), -100)
    want = torch.tensor([[0, 4, 10], [1, 2, 3], [5, 6, 9]])
    y.scatter_(1, want, 7)
    assert torch.equal(label_positions(y, 3), want)


def test_lm_logits_at_positions():
    torch.manual_seed(0)
    model = LM(presets.get("kimi_linear", size="tiny", vocab_size=50, n_layers=2)).double()
    x = torch.randint(0, 50, (2, 19))
    pos = torch.tensor([[0, 7, 18], [3, 4, 11]])
    full = model(x)
    torch.testing.assert_close(model(x, positions=pos), full.gather(1, pos[..., None].expand(-1, -1, 50)))
    with pytest.raises(ValueError, match="positions"):
        model(x, positions=pos.int())


def _mqar_run(tmp_path, name, arch="kda", device="cpu", steps=6, **kw):
    sweep = RecallSweep(vocab_size=64, head_dim=16)
    torch.manual_seed(0)
    model = LM(model_config(arch, 32, sweep, 32))
    task = MQARTask(MQARConfig(vocab_size=64, seq_len=32, num_pairs=4))
    cfg = TrainConfig(steps=steps, batch_size=16, lr=3e-3, eval_every=steps, eval_batches=2, device=device,
                      progress=False, log_every=1, out_dir=str(tmp_path / name), **kw)
    return train(model, task, cfg), _losses(tmp_path / name)


@pytest.mark.parametrize("arch", ["attention", "kda"])
def test_select_labels_is_the_same_loss(tmp_path, arch):
    """The head at the K labelled positions gives the loss, gradients and steps of the head everywhere."""
    a, la = _mqar_run(tmp_path, "all", arch, select_labels=False)
    b, lb = _mqar_run(tmp_path, "sel", arch, select_labels=True)
    assert len(la) == 6
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=0)
    assert b.final_val_loss == pytest.approx(a.final_val_loss, rel=1e-5)


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="graphs"):
        train(LM(presets.get("kda", size="tiny", n_layers=1)), MQARTask(), TrainConfig(steps=1, device="cpu", graphs=True))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["attention", "kda", "kimi_linear"])
def test_graphs_match_eager_on_cuda(tmp_path, arch):
    """float32: the replayed graph takes the same steps as the eager loop (same kernels, same batches)."""
    _, eager = _mqar_run(tmp_path, "eager", arch, device="cuda", steps=12, amp="none", graphs=False, prefetch=0)
    res, graphed = _mqar_run(tmp_path, "graph", arch, device="cuda", steps=12, amp="none", graphs=True, prefetch=2)
    assert len(graphed) == 12 and res.steps_done == 12
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_mqar_learns_on_cuda(arch):
    """200 steps of MQAR (L 64, K 4) under bf16 autocast with the graphed step: attention reaches >= 0.9,
    every architecture leaves chance (1/64) far behind in at least one of seeds 0-2. One seed is not enough at 200
    steps: Gated DeltaNet's seeds score 0.12 / 0.57 / 0.80 and GLA's 0.07 / 0.37 / 0.09 on the H200, with the same
    spread in every form of the op (`dev/learns_gpu.py`, dev/LOG.md session 13)."""
    best = []
    for seed in (0, 1, 2):
        best.append(_learns(arch, "cuda", graphs=True, seed=seed))
        if best[-1] >= _floor(arch):
            return
    pytest.fail(f"{arch}: best accuracy per seed {best}")


@pytest.mark.slow
def test_mqar_learns_on_cpu_under_autocast():
    """The same run on the CPU under bf16 autocast (about 1.5 min on 2 cores): attention 0.83 at step 100, 0.99 at 150."""
    best = _learns("attention", "cpu", graphs=False)
    assert best >= _floor("attention"), best


def _floor(arch):
    """The best validation accuracy a learns test asks for: attention 0.9, every other mixer 0.05 (chance 1/64)."""
    return 0.9 if arch == "attention" else 0.05


def _learns(arch, device, graphs, seed=0):
    """Best validation accuracy of 200 MQAR steps (L 64, K 4) from the model init of `seed`."""
    sweep = RecallSweep(vocab_size=128, head_dim=16)
    torch.manual_seed(seed)
    model = LM(model_config(arch, 64, sweep, 64))
    task = MQARTask(MQARConfig(vocab_size=128, seq_len=64, num_pairs=4))
    # kimi_linear (KDA + MLA) diverges at 1e-2 (CPU, float32, seed 0: 0.06 at step 200) and learns at 3e-3 (0.64)
    lr = 3e-3 if arch == "kimi_linear" else 1e-2
    cfg = TrainConfig(steps=200, batch_size=64, lr=lr, eval_every=50, eval_batches=4, device=device, amp="bf16",
                      progress=False, graphs=graphs)
    return train(model, task, cfg).best_val_accuracy
