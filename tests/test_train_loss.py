"""The training loop's one loss path for evict's LM (`targets=`: the chunked linear cross-entropy), its accuracy
counts, per-block activation checkpointing through TrainConfig / `evict train --checkpoint-blocks`, and the lean
compiled form's refusal of a model that has none (its runs: tests/test_cli_train_flags.py)."""

import json

import pytest
import torch
import torch.nn.functional as F

from evict.models import LM, presets
from evict.train import TrainConfig, _loss, read_checkpoint, train
from tests.test_train import CopyTask, Tiny


def _lm():
    torch.manual_seed(0)
    return LM(presets.get("kimi_linear", size="tiny", vocab_size=16, n_layers=2, d_model=32, n_heads=2, head_dim=16,
                          d_ff=48))


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def test_loss_path_lm_and_logits_model_agree():
    """An LM through `targets=` and the same LM seen as a plain logits model give the same loss and counts."""
    lm = _lm().double()
    x, y = CopyTask().get_batch("train", 0, 4)
    got = _loss(lm, x, y, None)

    class Logits(torch.nn.Module):  # the LM without its targets path
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, x):
            return self.lm(x)

    want = _loss(Logits(), x, y, None)
    assert want.loss.dtype == torch.float32  # the logits path takes float32 logits, as the loop always has
    torch.testing.assert_close(got.loss, want.loss.double(), rtol=1e-6, atol=0)
    assert (int(got.correct), int(got.labelled)) == (int(want.correct), int(want.labelled))
    ref = F.cross_entropy(lm(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(got.loss, ref, rtol=1e-12, atol=1e-12)


def test_checkpoint_blocks_trains_the_same(tmp_path):
    cfg = dict(steps=4, batch_size=8, lr=1e-2, eval_every=4, eval_batches=1, progress=False, log_every=1,
               device="cpu", threads=1)
    a = train(_lm(), CopyTask(), TrainConfig(out_dir=str(tmp_path / "a"), **cfg))
    b = train(_lm(), CopyTask(), TrainConfig(out_dir=str(tmp_path / "b"), checkpoint_blocks=True, **cfg))
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(la) == 4
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-6, atol=0)
    assert b.final_val_loss == pytest.approx(a.final_val_loss, rel=1e-6)
    assert read_checkpoint(tmp_path / "b" / "checkpoint.pt")["config"]["checkpoint_blocks"] is True


def test_checkpoint_blocks_needs_a_model_that_has_it():
    with pytest.raises(ValueError, match="^checkpoint_blocks: Tiny has no per-block activation checkpointing"):
        train(Tiny(), CopyTask(), TrainConfig(steps=1, device="cpu", progress=False, checkpoint_blocks=True))


def test_compile_lean_needs_a_model_that_has_it():
    with pytest.raises(ValueError, match="^compile_lean: Tiny has no lean compiled form"):
        train(Tiny(), CopyTask(), TrainConfig(steps=1, device="cpu", progress=False, compile=True, compile_lean=True))
