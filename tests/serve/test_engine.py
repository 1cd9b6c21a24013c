"""The engine against `generate` alone: many requests of different lengths, preemption, slot reuse, sampling."""

import random

import pytest
import torch

from evict.models import LM, presets
from evict.ops import attention
from evict.ops.rope import rope
from evict.serve.engine import Engine, SamplingParams, arena_bytes


def tiny(name: str, **kw) -> LM:
    torch.manual_seed(0)
    return LM(presets.get(name, init_std=0.2, **kw)).eval()  # larger weights: clear argmax margins


def alone(model, prompt, n, chunk) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0, prefill_chunk=chunk)[0, len(prompt):].tolist()


def requests(n: int, seed: int, lengths=(1, 40), outputs=(1, 24)):
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(*lengths))], rng.randint(*outputs)) for _ in range(n)]


def budget(model, slots: int, block: int, blocks: int) -> int:
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, block, block))
    return slots * per_slot + blocks * block * per_token


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("name", ["kimi_linear", "attention", "gpt2", "deltanet"])
def test_greedy_equals_generate_with_preemption(name, async_steps, one_thread):
    """20 requests of 1-40 prompt and 1-24 new tokens share 6 slots and a pool of 14 blocks of 8 tokens: sequences
    at different lengths decode together, prompts are prefilled in chunks of 16 between decode steps, and the pool
    runs out (preemption and recompute). Every greedy output equals `generate` on that request alone; async steps
    too (a request preempted while its token is in flight gets that token, then is recomputed)."""
    model = tiny(name, n_layers=2)
    eng = Engine(model, max_batch=6, cache_budget=budget(model, 6, 8, 14), block_size=8, prefill_chunk=16,
                 async_steps=async_steps)
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in requests(20, seed=1)]
    eng.run_until_idle()
    uses_kv = any(letter in "AM" for letter in model.cfg.layer_mixers())
    assert eng.stats["preemptions"] > 0 or not uses_kv
    assert eng.stats["finished"] == 20 and not eng.running and not eng.waiting
    assert len(eng.free_slots) == 6 and len(eng.free_blocks) == eng.n_blocks
    for p, n, r in reqs:
        assert r.finish_reason == "length" and len(r.out) == n
        assert r.out == alone(model, p, n, 16), (len(p), n)


@pytest.mark.parametrize("async_steps", [False, True])
def test_slot_reused_many_times_without_drift(async_steps, one_thread):
    """One slot serves 20 requests in turn (two prompts alternating): each answer equals the first one for its prompt
    and `generate`'s; a stale recurrent state or conv tail would change them."""
    model = tiny("kimi_linear", n_layers=2)
    eng = Engine(model, max_batch=1, cache_budget=budget(model, 1, 8, 16), block_size=8, async_steps=async_steps)
    prompts = [[5, 17, 200, 3, 3, 9], [250, 1, 77]]
    want = [alone(model, p, 10, 512) for p in prompts]
    for i in range(20):
        r = eng.submit(prompts[i % 2], SamplingParams(max_tokens=10, temperature=0))
        eng.run_until_idle()
        assert r.out == want[i % 2], i


@pytest.mark.parametrize("async_steps", [False, True])
def test_stop_tokens_and_seeded_sampling(async_steps, one_thread):
    model = tiny("kda", n_layers=2)
    eng = Engine(model, max_batch=4, cache_budget=1 << 20, async_steps=async_steps)
    greedy = alone(model, [1, 2, 3], 10, 512)
    stop = eng.submit([1, 2, 3], SamplingParams(max_tokens=10, temperature=0, stop_tokens=(greedy[4],)))
    a = eng.submit([9, 9], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7))
    b = eng.submit([9, 9], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7))
    c = eng.submit([9, 9], SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=8))
    eng.run_until_idle()
    cut = greedy.index(greedy[4]) + 1
    assert stop.out == greedy[:cut] and stop.finish_reason == "stop"
    assert a.out == b.out and a.out != c.out and len(a.out) == 12


@pytest.mark.parametrize("async_steps", [False, True])
def test_cancel_frees_slot_and_blocks(async_steps, one_thread):
    model = tiny("attention", n_layers=2)
    eng = Engine(model, max_batch=2, cache_budget=budget(model, 2, 16, 8), async_steps=async_steps)
    r = eng.submit(list(range(30)), SamplingParams(max_tokens=90, temperature=0))
    for _ in range(5):
        eng.step()
    assert eng.running == [r] and len(eng.free_blocks) < eng.n_blocks
    eng.cancel(r)
    eng.step()
    assert r.finish_reason == "cancelled" and not eng.running and len(eng.free_blocks) == eng.n_blocks
    assert len(eng.free_slots) == 2


@pytest.mark.parametrize("bad, field", [
    (([], SamplingParams()), "prompt"), (([256], SamplingParams()), "prompt"), (([1.0], SamplingParams()), "prompt"),
    (([1], SamplingParams(max_tokens=0)), "max_tokens"), (([1], SamplingParams(temperature=-1)), "temperature"),
    (([1], SamplingParams(top_p=0)), "top_p"), (([1], SamplingParams(top_k=0)), "top_k"),
    (([1], SamplingParams(seed=-1)), "seed"), (([1], SamplingParams(stop_tokens=(999,))), "stop_tokens"),
    (([1] * 100, SamplingParams(max_tokens=100)), "max_tokens"),
    (([1], SamplingParams(max_tokens=-1, prompt_logprobs=0)), "max_tokens"),
    (([1], SamplingParams(max_tokens=0, prompt_logprobs=21)), "prompt_logprobs"),
    (([1], SamplingParams(prompt_logprobs=True)), "prompt_logprobs"),
])
def test_bad_requests_name_the_field(bad, field):
    model = tiny("attention", n_layers=1)
    eng = Engine(model, max_batch=1, cache_budget=budget(model, 1, 16, 10))  # 160 tokens per sequence
    with pytest.raises(ValueError, match=f"^{field}:"):
        eng.submit(*bad)


def test_bad_engine_config():
    model = tiny("attention", n_layers=1)
    with pytest.raises(ValueError, match="^cache_budget:"):
        Engine(model, cache_budget=1000)
    with pytest.raises(ValueError, match="^max_batch:"):
        Engine(model, max_batch=0)
    with pytest.raises(ValueError, match="^max_len:"):
        Engine(model, cache_budget=budget(model, 16, 16, 4), max_len=100)


def test_masked_attention_matches_reference():
    """The slot pool's masked attention (SDPA) against the written-out reference in float64, odd sizes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.randn(3, 13, 2, 6, generator=g, dtype=torch.float64), torch.randn(3, 13, 2, 6, generator=g, dtype=torch.float64)
    mask = torch.arange(13) <= torch.tensor([4, 9, 12])[:, None, None] - 4 + torch.arange(5)[:, None]  # [3, 5, 13]
    mask[0, :, 0] = True
    fast = attention(q, k, v, causal=False, mask=mask)
    ref = attention(q, k, v, causal=False, mask=mask, impl="reference")
    torch.testing.assert_close(fast, ref)
    row = attention(q[1:2], k[1:2, :10], v[1:2, :10], causal=True, impl="reference")  # row 1 sees 10 keys, causally
    torch.testing.assert_close(ref[1:2], row)
    with pytest.raises(ValueError, match="^mask:"):
        attention(q, k, v, mask=mask[:, :, :5])


def test_rope_per_row_positions():
    x = torch.randn(2, 3, 2, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    both = rope(x, pos)
    torch.testing.assert_close(both[0], rope(x[:1], pos[0])[0])
    torch.testing.assert_close(both[1], rope(x[1:], pos[1])[0])


def test_pool_needs_a_selection():
    model = tiny("kimi_linear", n_layers=2)
    pool = model.new_pool(2, 4, 8, 32)
    with pytest.raises(ValueError, match="^cache: a slot pool needs select"):
        model(torch.zeros(1, 3, dtype=torch.int64), cache=pool)
    pool.select([1], [0], 2)
    with pytest.raises(ValueError, match="^cache: a slot pool needs select"):
        model(torch.zeros(1, 3, dtype=torch.int64), cache=pool)  # selected for 2 tokens, given 3
    with pytest.raises(ValueError, match="^cache: select needs a slot pool"):
        model.new_cache(1, 8).select([0], [0], 1)
    with pytest.raises(ValueError, match=r"^cache: a step's slots must be distinct, got \[1, 1\]"):
        pool.select([1, 1], [0, 0], 1)  # the in-place recurrent step would write slot 1 twice
    with pytest.raises(ValueError, match=r"^cache: a step's slots must be distinct, got \[0, 1, 0\]"):
        pool.select_packed([(0, 0), (1, 0)], [(0, 0, 2)])
    with pytest.raises(ValueError, match="^n_blocks:"):
        model.new_pool(2, 0, 8, 32)


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("name", ["kimi_linear", "attention"])
def test_paged_decode_op_path(name, async_steps, monkeypatch, one_thread):
    """The path CUDA takes: one-token steps read the pool's blocks in place through the paged decode op (its reference
    form here, forced on) instead of gathering each row's keys; outputs still equal `generate`'s."""
    import evict.layers.attention
    import evict.layers.mla

    for mod in (evict.layers.attention, evict.layers.mla):
        monkeypatch.setattr(mod, "kernel_runs_on", lambda t: True)
    calls = []
    real = evict.layers.attention.decode_attention
    spy = lambda *a, **kw: calls.append("block_table" in kw) or real(*a, **kw)  # noqa: E731
    for mod in (evict.layers.attention, evict.layers.mla):
        monkeypatch.setattr(mod, "decode_attention", spy)
    model = tiny(name, n_layers=2)
    eng = Engine(model, max_batch=4, cache_budget=budget(model, 4, 8, 12), block_size=8, prefill_chunk=16,
                 async_steps=async_steps)
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in requests(10, seed=4)]
    eng.run_until_idle()
    assert any(calls) and eng.stats["preemptions"] > 0
    for p, n, r in reqs:
        assert r.out == alone(model, p, n, 16)
