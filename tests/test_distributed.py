"""Training on 2 CPU processes (gloo) as torchrun would run it: the same losses as one process at the same global
batch (FSDP2, and DDP with accumulation), exact resume from sharded checkpoints, MoE hooks on the wrapped model; and
parallelize's one compile path, handing `lean` to the model's own compile_blocks."""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from evict import LM, presets
from evict.tasks.mqar import MQARConfig, MQARTask
from evict.train import TrainConfig, train

BASE = dict(steps=4, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=2, eval_batches=1, log_every=1, device="cpu",
            progress=False, threads=1, seed=0)


def _model():
    torch.manual_seed(0)
    return LM(presets.get("kimi_linear", size="tiny", n_layers=2, d_model=32, n_heads=2, head_dim=16, d_ff=64,
                          kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, vocab_size=64))


def _task():
    return MQARTask(MQARConfig(vocab_size=64, seq_len=16, num_pairs=2))


def _run(root, name, **kw):
    model = _model()
    res = train(model, _task(), TrainConfig(**{**BASE, **kw}, out_dir=str(root / name)))
    return model, res


def _worker(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    model, _ = _run(root, "fsdp", dist="fsdp")
    torch.save([m.select_bias for m in model.moe_layers()], root / f"bias_{rank}.pt")
    _run(root, "ddp_accum", dist="ddp", grad_accum=2)
    cut, res = _run(root, "cut", dist="fsdp", stop_at=0.0)  # one step, then a sharded checkpoint
    assert res.interrupted and res.steps_done == 1
    _run(root, "cut", dist="fsdp")  # resumed to the end
    torch.distributed.destroy_process_group()


def _train_rows(path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"]


def test_two_processes_match_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, tmp_path), nprocs=2, join=True)
    single, _ = _run(tmp_path, "single")
    ref = _train_rows(tmp_path / "single" / "metrics.jsonl")
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    for name in ("fsdp", "ddp_accum", "cut"):
        got = _train_rows(tmp_path / name / "metrics.jsonl")  # rank 0 alone wrote it: one row per step
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        for a, b in zip(got, ref):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["lr"] == b["lr"], (name, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["tokens_per_s"] > 0
    # resumed from shards: exactly the uninterrupted 2-process run
    assert [r["loss"] for r in _train_rows(tmp_path / "cut" / "metrics.jsonl")] == \
        [r["loss"] for r in _train_rows(tmp_path / "fsdp" / "metrics.jsonl")]
    ck = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ck["sharded"] == "checkpoint-4.dcp" and [p.name for p in (tmp_path / "cut").glob("*.dcp")] == ["checkpoint-4.dcp"]
    assert [s["world_size"] for s in ck["segments"]] == [2, 2] and ck["segments"][1]["per_rank_batch"] == 4
    # MoE bias balancing ran on every rank with the ranks' averaged load: the same bias everywhere, as one process
    b0, b1 = (torch.load(tmp_path / f"bias_{r}.pt") for r in (0, 1))
    want = [m.select_bias for m in single.moe_layers()]
    assert want and all(w.abs().sum() > 0 for w in want)
    for x, y, w in zip(b0, b1, want):
        assert torch.equal(x, y) and torch.allclose(x, w, atol=1e-9)


@pytest.mark.slow
def test_torchrun_cli_equals_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m evict.cli train` (real processes): rank 0 alone writes the metrics, run.json
    records the world, and the losses and the saved model's val loss are those of one process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    corpus = tmp_path / "c.txt"
    corpus.write_text("ROMEO: what light through yonder window breaks?\nJULIET: ay me!\n" * 40)
    argv = ["-m", "evict.cli", "train", "--preset", "kimi_linear", "--corpus", str(corpus), "--seq-len", "16",
            "--batch-size", "4", "--steps", "3", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1",
            "--log-every", "1", "--threads", "1", "--device", "cpu", "--set", "n_layers=2", "--set", "d_model=32",
            "--set", "n_heads=2", "--set", "head_dim=16", "--set", "d_ff=64"]
    env = dict(os.environ, PYTHONPATH=str(root), XDG_CACHE_HOME=str(tmp_path / "cache"))
    for name, launch in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])):
        cmd = [sys.executable, *launch, *argv, "--out", str(tmp_path / name)]
        subprocess.run(cmd, check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    one, two = (_train_rows(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2, 3]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(one, two))
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["world_size"] == 2 and run["per_rank_batch"] == 2
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "two")]
    assert summaries[0]["val_loss"] == pytest.approx(summaries[1]["val_loss"], abs=1e-5)


def test_parallelize_hands_lean_to_the_models_compile_blocks():
    """One compile path (one process here; FSDP2 / DDP wrap after it): `lean` reaches the model's compile_blocks as
    given (None: the model's default form); without `compile` nothing compiles; a model with no compile_blocks has no
    lean form: one line naming compile_lean."""
    from evict.distributed import parallelize

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = []

        def compile_blocks(self, **kw):
            self.calls.append(kw)

    model, cpu = Spy(), torch.device("cpu")
    for lean in (None, True, False):
        assert parallelize(model, kind="fsdp", compile=True, lean=lean, device=cpu) is model
    parallelize(model, kind="ddp", compile=True, device=cpu)
    parallelize(model, kind="fsdp", compile=False, lean=True, device=cpu)
    assert model.calls == [{"lean": None}, {"lean": True}, {"lean": False}, {"lean": None}]
    with pytest.raises(ValueError, match="^compile_lean: Linear has no lean compiled form"):
        parallelize(torch.nn.Linear(2, 2), kind="fsdp", compile=True, lean=True, device=cpu)
