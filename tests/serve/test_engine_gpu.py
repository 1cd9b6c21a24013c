"""The engine on CUDA: greedy outputs equal `generate` alone in float32 (Triton memory kernels, SDPA with masks),
through packed steps (several prompt chunks and decode rows in one forward), decode steps replayed from CUDA graphs
and preemption, with and without async steps (the next step launched before the host reads the tokens: its inputs
read on the device, inside the graph); sampled requests give the same tokens and logprobs with async steps as
without; and a bf16 engine completes every request."""

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


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("kind, graphs", [("hybrid", True), ("attention", True), ("mla", True), ("kda", True),
                                          ("hybrid", False)])
def test_cuda_engine_greedy_equals_generate_float32(kind, graphs, async_steps):
    model = build(kind)
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, 16, 16))
    eng = Engine(model, max_batch=16, cache_budget=16 * per_slot + 60 * 16 * per_token, block_size=16, prefill_chunk=128,
                 max_num_batched_tokens=300, cuda_graphs=graphs, async_steps=async_steps)
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


@pytest.mark.parametrize("async_steps", [False, True])
def test_cuda_engine_sampling_and_logprobs_equal_with_async_steps(async_steps):
    """Float32 hybrid, graphs on, every request running from the first step (no waiting, stops by length only, so both
    modes run the same batches): seeded sampling with penalties / min_p / top-k / top-p and logprobs, and a greedy
    request whose repetition penalty forbids its first token's return (a penalty recorded late would repeat it)."""
    model = build("hybrid")
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=3, presence_penalty=1.5, frequency_penalty=0.5,
                             logprobs=3),
              SamplingParams(max_tokens=17, temperature=0.7, seed=4, repetition_penalty=1.3, min_p=0.05,
                             logit_bias=((5, 3.0),)),
              SamplingParams(max_tokens=9, temperature=0, logprobs=2),
              SamplingParams(max_tokens=25, temperature=1.0, top_k=20, top_p=0.9, seed=8),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=100.0, logit_bias=((5, 50.0),))]
    got = {}
    for mode in (False, async_steps):
        eng = Engine(model, max_batch=8, cache_budget=64 << 20, block_size=16, async_steps=mode)
        eng.warm_up()
        reqs = [eng.submit([9, 9, i] * (i + 1), p) for i, p in enumerate(params)]
        eng.run_until_idle()
        assert eng.stats["graph_steps"] > 0 and all(r.finish_reason == "length" for r in reqs)
        got[mode] = [(r.out, r.logprobs) for r in reqs]
    for (out, lps), (a_out, a_lps) in zip(got[False], got[async_steps]):
        assert a_out == out
        for (v, top), (a_v, a_top) in zip(lps, a_lps):
            assert a_v == pytest.approx(v, abs=1e-5) and [i for i, _ in a_top] == [i for i, _ in top]
    out = got[async_steps][4][0]
    assert out[0] == 5 and 5 not in out[1:], out


@pytest.mark.parametrize("async_steps", [False, True])
def test_cuda_engine_bf16_completes(async_steps):
    model = build("hybrid", torch.bfloat16)
    eng = Engine(model, max_batch=32, cache_budget=64 << 20, block_size=64, prefill_chunk=256, async_steps=async_steps)
    reqs = [(n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=i)))
            for i, (p, n) in enumerate(jobs(64, seed=3))]
    eng.run_until_idle()
    assert all(r.finish_reason == "length" and len(r.out) == n for n, r in reqs)
    assert eng.metrics()["peak_memory_bytes"] > 0
