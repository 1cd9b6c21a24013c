"""Left-padded batches run as one batch (LM's `pad`, evict.cache.PaddedBatch): every row's outputs at its tokens equal
the row alone, prefill and decode, for every mixer family; batched greedy generate() equals one-by-one. float64, so
the only difference left is summation order (~1e-14)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evict.models import LM, presets
from tests.test_hf import SMALL  # vocab 61

TOL = 1e-10  # float64: the padded and the lone row differ only in summation order (measured ~1e-14)
EVERY = ["gpt2", "attention", "linear", "deltanet", "gated_deltanet", "kda", "gla", "mla", "kimi_linear", "k3_mini"]


def _lm(name: str, seed: int = 0, **kw) -> LM:
    torch.manual_seed(seed)
    return LM(presets.get(name, **{**SMALL, **kw})).double().eval()


def _left_pad(prompts: list[torch.Tensor], fill: int = 7) -> tuple[torch.Tensor, list[int]]:
    T = max(len(p) for p in prompts)
    pad = [T - len(p) for p in prompts]
    return torch.stack([torch.cat([torch.full((n,), fill), p]) for n, p in zip(pad, prompts)]), pad


def _check_rows(lm: LM, prompts: list[torch.Tensor], fill: int = 7, steps: int = 3) -> None:
    """Prefill the padded batch into a cache, then `steps` one-token steps and one 2-token call: each row equals the row
    alone at its tokens (the padded batch also without a cache)."""
    ids, pad = _left_pad(prompts, fill)
    B, T = ids.shape
    nxt = torch.randint(0, 61, (B, steps + 2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = lm(ids, pad=pad)
        cache = lm.new_cache(B, T + steps + 2)
        pre = lm(ids, cache, pad=pad)
        later = [lm(nxt[:, i : i + 1], cache) for i in range(steps)] + [lm(nxt[:, steps:], cache)]
        for r, p in enumerate(prompts):
            alone_cache = lm.new_cache(1, len(p) + steps + 2)
            alone = lm(p[None], alone_cache)[0]
            assert torch.allclose(plain[r, pad[r]:], alone, atol=TOL, rtol=0), r
            assert torch.allclose(pre[r, pad[r]:], alone, atol=TOL, rtol=0), r
            for i, got in enumerate(later):
                n = got.shape[1]
                want = lm(nxt[r : r + 1, i : i + n], alone_cache)[0]
                assert torch.allclose(got[r], want, atol=TOL, rtol=0), (r, i)
            assert torch.isfinite(plain[r, : pad[r]]).all()


@pytest.mark.parametrize("name", EVERY)
def test_padded_batch_equals_each_row_alone(name, one_thread):
    lm = _lm(name)
    prompts = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 2, 1)]
    _check_rows(lm, prompts)


@pytest.mark.parametrize("name", ["attention", "mla"])
def test_padded_batch_short_conv_sees_zeros(name, one_thread):
    """Attention and MLA with a short conv (cfg.short_conv): pads reach the conv as zeros."""
    lm = _lm(name, short_conv=True)
    _check_rows(lm, [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 3)])


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4), fill=st.integers(0, 60),
       name=st.sampled_from(["gpt2", "kda", "kimi_linear"]), seed=st.integers(0, 2**16))
def test_random_pad_lengths(lengths, fill, name, seed, one_thread):
    g = torch.Generator().manual_seed(seed)
    _check_rows(_lm(name, seed=seed % 7), [torch.randint(0, 61, (n,), generator=g) for n in lengths], fill=fill, steps=1)


def test_pad_refused_in_one_line(one_thread):
    lm = _lm("kda")
    x = torch.randint(0, 61, (2, 4))
    for bad in ([1], [0, 4], [0, -1], [0, 1.0], "01"):
        with pytest.raises(ValueError, match=r"pad: expected 2 ints in \[0, T=4\)"):
            lm(x, pad=bad)
    cache = lm.new_cache(2, 16)
    lm(x, cache)
    with pytest.raises(ValueError, match="pad: give it with a cache's first tokens"):
        lm(x[:, :1], cache, pad=[0, 0])
    pool = lm.new_pool(2, 4, 4, 16)
    pool.set_blocks(0, [0])
    pool.select([0], [0], 4)
    with pytest.raises(ValueError, match="pad: a slot pool's rows"):
        lm(x[:1], pool, pad=[1])


def test_learned_positions_count_from_each_rows_first_token(one_thread):
    """gpt2 with 8 learned positions: 10 columns fit when every row has at least 2 pads, not otherwise."""
    lm = _lm("gpt2", max_seq_len=8)
    x = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        out = lm(x, pad=[2, 3])
        assert torch.allclose(out[0, 2:], lm(x[:1, 2:])[0], atol=TOL, rtol=0)
        with pytest.raises(ValueError, match="tokens: learned positions cover 8 tokens, got up to 9"):
            lm(x, pad=[1, 3])


transformers = pytest.importorskip("transformers")
from evict.hf import to_hf  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2", "gated_deltanet", "kda", "kimi_linear", "mla"])
def test_batched_greedy_generate_equals_one_by_one(name, one_thread):
    lm = _lm(name)
    model = to_hf(lm)  # no end-of-text: every row runs 6 steps (an eos would be suppressed by min_new_tokens alone)
    model.generation_config.pad_token_id = 60
    prompts = [torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 2)]
    ids, pad = _left_pad(prompts, fill=60)
    mask = (torch.arange(ids.shape[1]) >= torch.tensor(pad)[:, None]).long()
    batches = []
    hook = lm.embed.register_forward_hook(lambda mod, inp, out: batches.append(inp[0].shape[0]))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    hook.remove()
    assert batches == [3] * 6  # one batched forward per step (the prompt, then 5 decode steps), no row-by-row runs
    for r, p in enumerate(prompts):
        alone = lm.generate(p[None], max_new_tokens=6, temperature=0)[0, len(p):]
        assert torch.equal(got[r, ids.shape[1]:], alone), r
    with torch.no_grad():  # the forward: each row's logits are its own, zeros at pads
        logits = model(ids, attention_mask=mask).logits
        hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for r, p in enumerate(prompts):
            assert torch.allclose(logits[r, pad[r]:], lm(p[None])[0], atol=TOL, rtol=0)
            assert not logits[r, : pad[r]].any() and not hidden[-1][r, : pad[r]].any()


def test_padded_beam_search_equals_one_by_one(one_thread):
    """Beam search reorders and repeats the padded cache's rows (pads included)."""
    lm = _lm("kimi_linear", seed=2)
    model = to_hf(lm)
    model.generation_config.pad_token_id = 60
    prompts = [torch.randint(0, 60, (n,), generator=torch.Generator().manual_seed(10 + n)) for n in (4, 7)]
    ids, pad = _left_pad(prompts, fill=60)
    mask = (torch.arange(ids.shape[1]) >= torch.tensor(pad)[:, None]).long()
    kw = dict(max_new_tokens=5, do_sample=False, num_beams=3)
    got = model.generate(ids, attention_mask=mask, **kw)
    for r, p in enumerate(prompts):
        alone = model.generate(p[None], **kw)[0, len(p):]
        assert torch.equal(got[r, ids.shape[1]:], alone), r

