"""The LM's training loss path (chunked linear cross-entropy) and per-block activation checkpointing, in float64."""

import pytest
import torch
import torch.nn.functional as F

from evict.models import LM, presets


def _model(name, **kw):
    torch.manual_seed(0)
    cfg = presets.get(name, vocab_size=61, n_layers=4, d_model=32, n_heads=2, head_dim=16, d_ff=48, **kw)
    return LM(cfg).double()


def _batch(B=3, T=13, V=61, ignore=5):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y.view(-1)[torch.randperm(B * T, generator=g)[:ignore]] = -100
    return x, y


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt2", "kimi_linear", "k3_mini"])
def test_targets_give_the_logits_cross_entropy(name):
    model = _model(name)
    x, y = _batch()
    out = model(x, targets=y)
    out.loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    logits = model(x)
    ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    ref.backward()
    want = _grads(model)
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)
    mask = y != -100
    assert int(out.labelled) == int(mask.sum())
    assert int(out.correct) == int(((logits.argmax(-1) == y) & mask).sum())


def test_targets_at_positions():
    model = _model("kda")
    x, y = _batch(ignore=0)
    pos = torch.tensor([[0, 4, 12], [1, 2, 3], [12, 11, 0]])
    yt = y.gather(1, pos)
    out = model(x, positions=pos, targets=yt)
    ref = F.cross_entropy(model(x, positions=pos).flatten(0, 1), yt.flatten())
    torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)


def test_targets_bad_shape_one_line():
    model = _model("kda")
    x, y = _batch()
    with pytest.raises(ValueError, match=r"^targets: expected an int64 tensor \[3, 13\]"):
        model(x, targets=y[:, :5])
    with pytest.raises(ValueError, match="^checkpoint_blocks: expected True or False"):
        LM(model.cfg, checkpoint_blocks=1)


@pytest.mark.parametrize("name", ["kimi_linear", "k3_mini", "gpt2"])
def test_checkpointing_same_loss_and_grads(name):
    model = _model(name)
    x, y = _batch()
    loss = model(x, targets=y).loss
    loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing = True
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x, targets=y)
    out.loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=0)
    got = _grads(model)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-14, msg=n)
    # what the forward kept: per block only its input (plus the head's saved gradients), not every activation
    model.gradient_checkpointing = False
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(x, targets=y)
    assert len(saved) < len(kept) / 2
