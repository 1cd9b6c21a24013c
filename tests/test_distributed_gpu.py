"""CUDA: FSDP2 in a world of one with bf16 autocast and per-block compile, resumed from shards; two GPUs (FSDP2 and
DDP, nccl) matching one GPU at the same global batch. Skipped without CUDA (or with fewer than two GPUs)."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from evict import LM, presets
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, train

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BASE = dict(steps=8, batch_size=16, lr=3e-3, warmup_steps=2, eval_every=4, eval_batches=1, log_every=1, progress=False,
            seed=0, prefetch=0)
COMPILED_RTOL = 1e-3  # compiled blocks' training losses against eager's, float32 (also tests/test_cli_train_flags.py)


def _model():
    torch.manual_seed(0)
    return LM(presets.get("kimi_linear", size="tiny", n_layers=4, vocab_size=128))


def _task():
    return MQARTask(MQARConfig(vocab_size=128, seq_len=64, num_pairs=4))


def _losses(out):
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_cuda
def test_fsdp_world_of_one_bf16_compile_resumes_from_shards(tmp_path):
    eager = tmp_path / "eager"
    train(_model(), _task(), TrainConfig(**BASE, device="cuda", amp="bf16", out_dir=str(eager)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cfg = dict(BASE, device="cuda", amp="bf16", compile=True, dist="fsdp")
        res = train(_model(), _task(), TrainConfig(**cfg, stop_at=0.0, out_dir=str(tmp_path / "run")))
        assert res.interrupted and res.steps_done == 1
        assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["sharded"] == "checkpoint-1.dcp"
        model = _model()
        res = train(model, _task(), TrainConfig(**cfg, out_dir=str(tmp_path / "run")))
        assert res.steps_done == 8 and hasattr(model.blocks[0], "reshard")  # an FSDP2 module
    finally:
        dist.destroy_process_group()
    got, want = _losses(tmp_path / "run"), _losses(eager)
    assert len(got) == 8 and all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, want)), (got, want)


@needs_cuda
def test_compile_matches_eager_on_cuda(tmp_path):
    """The compiled blocks (default and lean form, `evict train --compile` / `--compile-lean`) train as eager does."""
    forms = {"eager": {}, "compiled": dict(compile=True), "lean": dict(compile=True, compile_lean=True)}
    for name, kw in forms.items():
        torch._dynamo.reset()  # each form compiles its blocks afresh (no other test's cache entries)
        train(_model(), _task(), TrainConfig(**BASE, device="cuda", amp="none", **kw, out_dir=str(tmp_path / name)))
    want = _losses(tmp_path / "eager")
    for name in ("compiled", "lean"):
        got = _losses(tmp_path / name)
        assert len(got) == 8 and all(abs(a - b) <= COMPILED_RTOL * abs(b) for a, b in zip(got, want)), (name, got, want)


def _worker(rank, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    for kind in ("fsdp", "ddp"):
        train(_model(), _task(), TrainConfig(**BASE, device="auto", amp="none", dist=kind, out_dir=str(root / kind)))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_match_one(tmp_path):
    """FSDP2 and DDP on two GPUs against one GPU at the same global batch, float32: the first four steps within 1e-5
    (the issue's bar; 2x H200 measured 0, 4.8e-7, 5.7e-6, 1.4e-6), the rest within 1e-3 — float32 rounding (other
    matmul shapes per rank, the all-reduce's sum order) that training at lr 3e-3 amplifies about tenfold every two
    steps (measured 8.6e-6, 7.4e-5, 2.3e-4, 8.3e-5 at steps 5-8; every run gave the same numbers)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    train(_model(), _task(), TrainConfig(**BASE, device="cuda", amp="none", out_dir=str(tmp_path / "one")))
    mp.spawn(_worker, args=(_port(), tmp_path), nprocs=2, join=True)
    want = _losses(tmp_path / "one")
    for kind in ("fsdp", "ddp"):
        got = _losses(tmp_path / kind)
        diffs = [abs(a - b) for a, b in zip(got, want)]
        assert len(got) == 8 and max(diffs[:4]) <= 1e-5 and max(diffs) <= 1e-3, (kind, [f"{d:.1e}" for d in diffs])
