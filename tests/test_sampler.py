"""`sample_next` and `Penalties` against plain float64 loops: each penalty, logit_bias, min_p, top_k / top_p, tiny
temperatures (no overflow), greedy; sampled frequencies against the reference distribution."""

import math
import random

import pytest
import torch

from evict.models.generate import GREEDY_BELOW, Penalties, sample_next


def ref_adjust(logits, prompt, out, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None) -> list[float]:
    """One row, float64, token by token: the obvious reading of each rule."""
    x = [float(v) for v in logits]
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def ref_probs(x, *, temperature, min_p=None, top_k=None, top_p=None) -> list[float]:
    m = max(x)
    p = [math.exp((v - m) / temperature) for v in x]
    s = sum(p)
    p = [v / s for v in p]
    keep = [v >= (min_p or 0) * max(p) for v in p]
    if top_k is not None:
        kth = sorted((v for v, k in zip(p, keep) if k), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and v >= kth for v, k in zip(p, keep)]
    if top_p is not None:
        s = sum(v for v, k in zip(p, keep) if k)
        order = sorted((i for i in range(len(p)) if keep[i]), key=lambda i: -p[i])
        mass, kept = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i] / s
        keep = [i in kept for i in range(len(p))]
    s = sum(v for v, k in zip(p, keep) if k)
    return [v / s if k else 0.0 for v, k in zip(p, keep)]


@pytest.mark.parametrize("seed", range(4))
def test_penalties_equal_the_reference(seed):
    rng = random.Random(seed)
    B, V = 3, 11
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3
    prompts = [[rng.randrange(V) for _ in range(4)] for _ in range(B)]
    outs = [[rng.randrange(V) for _ in range(rng.randint(0, 6))] for _ in range(B)]
    n = min(len(o) for o in outs)
    outs = [o[:n] for o in outs]  # the same number of steps for every row
    kw = dict(presence=rng.uniform(-1, 2), frequency=rng.uniform(-1, 2), repetition=rng.uniform(0.5, 2.0))
    bias = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}
    pen = Penalties.start(torch.tensor(prompts), V, logit_bias=bias, **kw)
    for step in range(n):
        pen.record(torch.tensor([o[step] for o in outs]))
    got = pen.apply(logits)
    for b in range(B):
        want = ref_adjust(logits[b].tolist(), prompts[b], outs[b], bias=bias, **kw)
        assert got[b].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4)
    # greedy takes the adjusted argmax
    greedy = sample_next(logits, temperature=0, top_k=None, top_p=None, generator=None, penalties=pen)
    assert greedy.tolist() == got.argmax(-1).tolist()


@pytest.mark.parametrize("opts", [dict(temperature=0.7), dict(temperature=1.3, min_p=0.2), dict(temperature=1.0, top_k=3),
                                  dict(temperature=0.9, top_p=0.6), dict(temperature=1.1, min_p=0.05, top_k=4, top_p=0.8)])
def test_sampled_frequencies_follow_the_reference_distribution(opts):
    V, N = 7, 40_000
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0, 0.1, -2.0, 1.7]])
    want = ref_probs(logits[0].tolist(), **opts)
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(N, V), top_k=opts.get("top_k"), top_p=opts.get("top_p"), generator=g,
                        temperature=opts["temperature"], min_p=opts.get("min_p"))
    freq = torch.bincount(draws, minlength=V).double() / N
    for f, p in zip(freq.tolist(), want):
        assert abs(f - p) <= 4 * math.sqrt(p * (1 - p) / N) + 1e-12  # zero-probability tokens never drawn


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-300, GREEDY_BELOW, 1e-30, 1e-20])
def test_tiny_temperatures_are_greedy_and_never_overflow(temperature):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 30
    got = sample_next(logits, temperature=temperature, top_k=None, top_p=0.9, generator=torch.Generator().manual_seed(0),
                      min_p=0.1)
    assert got.tolist() == logits.argmax(-1).tolist()


def test_a_huge_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(2))
    pen = Penalties.start(torch.zeros(4, 1, dtype=torch.int64), 20, logit_bias={7: 100.0, 3: -100.0})
    got = sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=torch.Generator().manual_seed(0),
                      penalties=pen)
    assert got.tolist() == [7, 7, 7, 7]
