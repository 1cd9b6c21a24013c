"""The engine on CUDA: greedy outputs equal `generate` alone in float32 (Triton memory kernels, SDPA with masks),
through packed steps (several prompt chunks and decode rows in one forward), decode steps replayed from CUDA graphs
and preemption; and a bf16 engine completes every request."""

import random

import pytest
import torch

from evict.bench.decode import model_configs
from evict.models import LM
from evict.serve.engine import Engine, SamplingParams, arena_bytes

pytestmark = pytest.mark.gpu


def build(kind: str, dtype=torch.float32) -> LM:
    torch.manual_seed(0)
    cfg = model_configs((kind,), size="tiny", width={"init_std": 0.2})[kind]
    with torch.device("cuda"):
        return LM(cfg).to(dtype).eval()


def jobs(n, seed):
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(1, 300))], rng.randint(1, 40)) for _ in range(n)]


@pytest.mark.parametrize("kind, graphs", [("hybrid", True), ("attention", True), ("mla", True), ("kda", True),
                                          ("hybrid", False)])
def test_cuda_engine_greedy_equals_generate_float32(kind, graphs):
    model = build(kind)
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, 16, 16))
    eng = Engine(model, max_batch=16, cache_budget=16 * per_slot + 60 * 16 * per_token, block_size=16, prefill_chunk=128,
                 max_num_batched_tokens=300, cuda_graphs=graphs)
    eng.warm_up()  # every bucket captured before the first request (as a server does)
    assert graphs == (eng.graphs is not None) and (not graphs or len(eng.graphs.graphs) == len(eng.graphs.buckets))
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in jobs(48, seed=2)]
    eng.run_until_idle()
    if kind != "kda":
        assert eng.stats["preemptions"] > 0
    assert eng.stats["packed_steps"] > 0 and (eng.stats["graph_steps"] > 0) == graphs, eng.stats
    for p, n, r in reqs:
        want = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, temperature=0, prefill_chunk=128)
        assert r.out == want[0, len(p):].tolist(), (kind, len(p), n)


def test_cuda_engine_bf16_completes():
    model = build("hybrid", torch.bfloat16)
    eng = Engine(model, max_batch=32, cache_budget=64 << 20, block_size=64, prefill_chunk=256)
    reqs = [(n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=i)))
            for i, (p, n) in enumerate(jobs(64, seed=3))]
    eng.run_until_idle()
    assert all(r.finish_reason == "length" and len(r.out) == n for n, r in reqs)
    assert eng.metrics()["peak_memory_bytes"] > 0
