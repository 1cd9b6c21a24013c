"""The packed step: one forward over decode rows and prompt chunks of several requests, against the obviously-correct
form (each sequence alone through a batch cache, float64) and against `generate` alone (greedy, float32), for every
mixer family, with budgets that cut chunks, both priorities, and preemption."""

import random

import pytest
import torch

from evict.models import LM, presets
from evict.serve.engine import Engine, SamplingParams, arena_bytes
from evict.serve.graphs import buckets

FAMILIES = {  # name -> (preset, overrides): attention, MLA, memory (KDA, linear with its normalizer), hybrids
    "attention": ("attention", {}), "mla": ("mla", {}), "kda": ("kda", {}), "linear": ("linear", {}),
    "gpt2": ("gpt2", {}), "attention_conv": ("attention", {"short_conv": True}),
    "mla_rope_conv": ("mla", {"mla_rope": True, "short_conv": True}), "KKKM": ("kimi_linear", {"n_layers": 4}),
    "KKKA": ("kimi_linear", {"n_layers": 4, "pattern": "KKKA", "final_mixer": None}),
}


def build(family: str, dtype=torch.float32) -> LM:
    name, kw = FAMILIES[family]
    torch.manual_seed(0)
    return LM(presets.get(name, init_std=0.2, **{"n_layers": 2, **kw})).to(dtype).eval()


def budget(model, slots: int, block: int, blocks: int) -> int:
    per_token, per_slot = arena_bytes(model.new_pool(1, 1, block, block))
    return slots * per_slot + blocks * block * per_token


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_forward_equals_each_sequence_alone_float64(family, one_thread):
    """Three sequences with histories of 0, 5 and 11 tokens in the pool: a packed forward of two decode rows and three
    prompt chunks (7, 1 and 4 tokens; blocks of 4, so chunks straddle blocks) gives each sequence's logits and leaves
    each slot's states as that sequence run alone through a batch cache does (float64, 1e-10)."""
    model = build(family, torch.float64)
    g = torch.Generator().manual_seed(1)
    pool = model.new_pool(6, 40, 4, 40)
    seqs = {s: torch.randint(0, 256, (1, n), generator=g) for s, n in enumerate([6, 12, 7, 1, 15])}
    history = {0: 5, 1: 11, 2: 0, 3: 0, 4: 11}  # slots 0, 1 decode one token; 2, 3, 4 read chunks
    blocks = iter(range(40))
    for s in seqs:
        pool.set_blocks(s, [next(blocks) for _ in range(4)])
        if history[s]:  # each history through the pool alone (one chunk)
            pool.select([s], [0], history[s])
            model(seqs[s][:, : history[s]], cache=pool)
    decode = [(0, 5), (1, 11)]
    chunks = [(2, 0, 7), (3, 0, 1), (4, 11, 4)]
    pool.select_packed(decode, chunks)
    toks = torch.cat([seqs[0][:, 5:6], seqs[1][:, 11:12], seqs[2], seqs[3], seqs[4][:, 11:]], dim=1)  # [1, 14]
    logits = model(toks, cache=pool)[0]  # [14, V]
    ends = {0: 0, 1: 1, 2: 8, 3: 9, 4: 13}
    for s, x in seqs.items():
        cache = model.new_cache(1, 40)
        want = model(x, cache=cache)[0, -1]
        torch.testing.assert_close(logits[ends[s]], want, rtol=1e-10, atol=1e-10)
        for st, ref in zip(pool.states, cache.states):
            for name in ("S", "conv"):
                if getattr(st, name, None) is not None:
                    torch.testing.assert_close(getattr(st, name)[s], getattr(ref, name)[0], rtol=1e-10, atol=1e-10)


def jobs(n, seed, lengths=(1, 45), outputs=(1, 20)):
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(*lengths))], rng.randint(*outputs)) for _ in range(n)]


def alone(model, prompt, n, chunk) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0, prefill_chunk=chunk)[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("family, priority", [(f, "decode") for f in FAMILIES] + [("KKKM", "prefill"), ("attention", "prefill")])
def test_packed_steps_greedy_equal_generate(family, priority, async_steps, monkeypatch, one_thread):
    """16 requests of 1-45 prompt and 1-20 new tokens, 5 slots, a pool that runs out (preemption), chunks of 16 and a
    budget of 37 tokens per step (so chunks are also cut by the budget): steps pack decode rows with prompt chunks of
    several requests, and every greedy output equals `generate` on that request alone (async: with decode rows whose
    token is still in flight)."""
    model = build(family)
    eng = Engine(model, max_batch=5, cache_budget=budget(model, 5, 8, 13), block_size=8, prefill_chunk=16,
                 max_num_batched_tokens=37, priority=priority, async_steps=async_steps)
    shapes, flying = [], []  # flying: per packed step, its decode rows whose token is in flight (async)
    real = eng.pool.select_packed

    def spy(d, c):
        shapes.append((len(d), len(c)))
        flying.append(sum(r.next_token() < 0 for r in eng.running if (r.slot, r.cached) in d))
        return real(d, c)

    monkeypatch.setattr(eng.pool, "select_packed", spy)
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in jobs(16, seed=5)]
    eng.run_until_idle()
    uses_kv = family not in ("kda", "linear")
    assert eng.stats["preemptions"] > 0 or not uses_kv
    assert any(d > 0 and c > 1 for d, c in shapes), shapes  # decode rows and several chunks in one forward
    assert any(flying) == async_steps  # async: packed steps read decode tokens still on the device
    assert eng.stats["finished"] == 16 and len(eng.free_blocks) == eng.n_blocks and len(eng.free_slots) == 5
    for p, n, r in reqs:
        assert r.finish_reason == "length" and r.out == alone(model, p, n, 16), (len(p), n)


def test_priority_and_budget_shape_the_step(one_thread):
    """Three running decodes and two waiting prompts of 40 tokens, budget 20: "decode" runs the 3 decode tokens and 17
    prompt tokens; "prefill" 20 prompt tokens and no decode."""
    model = build("KKKM")
    plans = {}
    for priority in ("decode", "prefill"):
        eng = Engine(model, max_batch=5, cache_budget=1 << 22, block_size=8, prefill_chunk=32,
                     max_num_batched_tokens=20, priority=priority)
        for _ in range(3):
            eng.submit([1, 2], SamplingParams(max_tokens=50, temperature=0))
        for _ in range(4):
            eng.step()  # the three short prompts are read and decoding
        for _ in range(2):
            eng.submit(list(range(40)), SamplingParams(max_tokens=2, temperature=0))
        eng._drain(block=False)
        eng._admit()
        decode, chunks = eng._plan()
        plans[priority] = (len(decode), [T for _, T in chunks])
    assert plans == {"decode": (3, [17]), "prefill": (0, [20])}


@pytest.mark.parametrize("async_steps", [False, True])
def test_decode_prefill_tokens_caps_prompt_while_decoding(async_steps, one_thread):
    """The same step with `decode_prefill_tokens` 5: 3 decode tokens and 5 prompt tokens (not 17); with nothing
    decoding, prompts take the whole budget; greedy outputs still equal `generate` alone (KKKM, preemption)."""
    model = build("KKKM")
    eng = Engine(model, max_batch=5, cache_budget=1 << 22, block_size=8, prefill_chunk=32, max_num_batched_tokens=20,
                 decode_prefill_tokens=5)
    eng.submit(list(range(40)), SamplingParams(max_tokens=2, temperature=0))
    eng._drain(block=False)
    eng._admit()
    assert [T for _, T in eng._plan()[1]] == [20]
    eng = Engine(model, max_batch=5, cache_budget=1 << 22, block_size=8, prefill_chunk=32, max_num_batched_tokens=20,
                 decode_prefill_tokens=5)
    for _ in range(3):
        eng.submit([1, 2], SamplingParams(max_tokens=50, temperature=0))
    for _ in range(4):
        eng.step()
    for _ in range(2):
        eng.submit(list(range(40)), SamplingParams(max_tokens=2, temperature=0))
    eng._drain(block=False)
    eng._admit()
    decode, chunks = eng._plan()
    assert (len(decode), [T for _, T in chunks]) == (3, [5])
    eng = Engine(model, max_batch=5, cache_budget=budget(model, 5, 8, 13), block_size=8, prefill_chunk=16,
                 max_num_batched_tokens=37, decode_prefill_tokens=7, async_steps=async_steps)
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in jobs(10, seed=6)]
    eng.run_until_idle()
    assert eng.stats["preemptions"] > 0
    for p, n, r in reqs:
        assert r.finish_reason == "length" and r.out == alone(model, p, n, 16), (len(p), n)


def test_knobs_validated():
    model = build("attention")
    for kw, field in [({"max_num_batched_tokens": 8, "max_batch": 16}, "max_num_batched_tokens"),
                      ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"priority": "fifo"}, "priority"),
                      ({"decode_prefill_tokens": 0}, "decode_prefill_tokens"),
                      ({"cuda_graphs": True}, "cuda_graphs"), ({"async_steps": 1}, "async_steps")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            Engine(model, cache_budget=1 << 22, **kw)


def test_graph_buckets():
    assert buckets(1) == [1]
    assert buckets(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    assert buckets(20)[-1] == 20 and buckets(20) == sorted(set(buckets(20)))


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("family", ["KKKA", "mla_rope_conv"])
def test_prompt_logprobs_equal_the_full_forward_float64(family, async_steps, one_thread):
    """Requests with prompt_logprobs (3 or 0 alternatives; max_tokens 0 or not) among requests without, in a float64
    engine whose budget cuts chunks and whose pool runs out (preemption: recomputed positions are not recorded twice):
    each prompt token after the first gets log_softmax(LM(prompt)) at the position before it and the top N of that row
    (float64 full forward of the prompt alone, 1e-10); outputs equal `generate` alone."""
    model = build(family, torch.float64)
    eng = Engine(model, max_batch=5, cache_budget=budget(model, 5, 8, 9), block_size=8, prefill_chunk=16,
                 max_num_batched_tokens=37, async_steps=async_steps)
    reqs = []
    for i, (p, n) in enumerate(jobs(12, seed=9, lengths=(1, 45), outputs=(1, 20))):
        top, n = ((3, n), (0, 0), (None, n))[i % 3]
        reqs.append((p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0, prompt_logprobs=top))))
    eng.run_until_idle()
    assert eng.stats["preemptions"] > 0 and eng.stats["finished"] == 12 and len(eng.free_slots) == 5
    assert any(r.preemptions and r.params.prompt_logprobs is not None for _, _, r in reqs)  # its prompt recomputed
    for p, n, r in reqs:
        assert r.finish_reason == "length" and r.out == (alone(model, p, n, 16) if n else [])
        if r.params.prompt_logprobs is None:
            assert r.prompt_logprobs == []
            continue
        with torch.no_grad():
            lp = model(torch.tensor([p]))[0].log_softmax(-1)  # [P, V]
        assert len(r.prompt_logprobs) == len(p) - 1
        for j, (its, top) in enumerate(r.prompt_logprobs):
            assert its == pytest.approx(lp[j, p[j + 1]].item(), abs=1e-10)
            want = lp[j].topk(r.params.prompt_logprobs)
            assert [i for i, _ in top] == want.indices.tolist()
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-10)
