"""Decode attention (one query per sequence, per-sequence lengths) against plain softmax attention in float64.

The reference is checked against evict.ops.attention run on each sequence's own prefix; the Triton split-K kernels
run in Triton's CPU interpreter (a subprocess, as for the memory op) and on CUDA (tests marked `gpu`).
"""

import json

import pytest
import torch

from evict.ops import attention
from evict.ops.decode import decode_attention, decode_reference
from tests.conftest import interpreter_fixture, rel

def make(B, H, G, L, Dk, Dv, D2=0, mla=False, dtype=torch.float64, seed=0, device="cpu"):
    """Random decode inputs; lengths include 1 and L. mla: values are the keys (v None) and G = 1."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    q, k = r(B, H, Dk), r(B, L, G, Dk)
    v = None if mla else r(B, L, G, Dv)
    q2 = k2 = None
    if D2:
        q2, k2 = r(B, H, D2), r(B, L, G, D2)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0], lengths[-1] = 1, L
    return dict(q=q, k=k, v=v, q2=q2, k2=k2, lengths=lengths.to(device))


CASES = {  # name: (B, H, G, L, Dk, Dv, D2, mla)
    "mha": (3, 4, 4, 37, 24, 24, 0, False),
    "gqa": (4, 6, 2, 130, 32, 20, 0, False),
    "mqa_odd": (2, 5, 1, 67, 17, 9, 0, False),
    "mla": (3, 4, 1, 75, 32, 32, 8, True),
}


def naive(x, scale):
    """Each sequence alone through evict.ops.attention (the last query of its own prefix)."""
    outs = []
    for b in range(x["q"].shape[0]):
        n = int(x["lengths"][b])
        k, v = x["k"][b : b + 1, :n], (x["k"] if x["v"] is None else x["v"])[b : b + 1, :n]
        q = x["q"][b : b + 1, None]
        if x["q2"] is not None:
            q = torch.cat([q, x["q2"][b : b + 1, None]], -1)
            k = torch.cat([k, x["k2"][b : b + 1, :n]], -1)
        outs.append(attention(q, k, v, causal=True, scale=scale, impl="reference")[:, 0])
    return torch.cat(outs)


def paged(x, page, seed=0):
    """The same inputs as block arenas [B L / page (+ spare), page, G, D] in shuffled block order, with the table."""
    B, L = x["k"].shape[:2]
    nb = L // page
    n_blocks = B * nb + 3  # spare blocks no table points to hold garbage
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))[: B * nb].to(x["k"].device)
    out = dict(x)
    for name in ("k", "v", "k2"):
        t = x[name]
        if t is None:
            continue
        arena = torch.full((n_blocks, page, *t.shape[2:]), 1e4, dtype=t.dtype, device=t.device)
        arena[perm] = t.reshape(B * nb, page, *t.shape[2:])
        out[name] = arena
    out["block_table"] = perm.reshape(B, nb)
    return out


PAGED_CASES = {"gqa": ((4, 6, 2, 128, 32, 20, 0, False), 16), "mla": ((3, 4, 1, 96, 32, 32, 8, True), 32)}


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_reference_equals_contiguous(case):
    shape, page = PAGED_CASES[case]
    x = make(*shape)
    torch.testing.assert_close(decode_attention(**paged(x, page), scale=0.3), decode_reference(**x, scale=0.3),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(**dict(paged(x, page), lengths=None))


@pytest.mark.parametrize("case", CASES)
def test_reference_is_attention_per_sequence(case):
    x = make(*CASES[case])
    scale = 0.3
    torch.testing.assert_close(decode_reference(**x, scale=scale), naive(x, scale), rtol=1e-12, atol=1e-12)
    assert decode_attention(**x, scale=scale).dtype == torch.float64  # auto: the reference for float64


def test_default_lengths_and_scale():
    x = make(*CASES["gqa"])
    x["lengths"] = None
    full = dict(x, lengths=torch.full((4,), 130))
    torch.testing.assert_close(decode_attention(**x), decode_reference(**full, scale=32**-0.5), rtol=0, atol=0)


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(2, 4)), "q: expected shape"),
    (dict(k=torch.zeros(2, 5, 3, 8)), "k: expected a number of groups"),
    (dict(v=torch.zeros(2, 5, 2, 8, 1)), "v: expected shape"),
    (dict(lengths=torch.ones(3, dtype=torch.int64)), "lengths: expected"),
    (dict(lengths=torch.ones(2)), "lengths: expected"),
    (dict(q2=torch.zeros(2, 4, 3)), "q2, k2"),
    (dict(impl="fast"), "impl: expected"),
    (dict(scale="x"), "scale: expected"),
])
def test_bad_input_one_line(bad, match):
    args = dict(q=torch.zeros(2, 4, 8), k=torch.zeros(2, 5, 2, 8), v=torch.zeros(2, 5, 2, 8), lengths=None)
    with pytest.raises(ValueError, match=match) as e:
        decode_attention(**{**args, **bad})
    assert "\n" not in str(e.value)


INTERP_SCRIPT = r"""
import json
from evict.ops.decode import decode_attention, decode_reference
from tests.conftest import rel
from tests.ops.test_decode import CASES, PAGED_CASES, make, paged
out = {}
for name, case in CASES.items():
    for dtype in (torch.float32, torch.float16):
        x = make(*case, dtype=dtype, seed=3)
        x64 = {n: None if t is None or n == "lengths" else t.double() for n, t in x.items()}
        x64["lengths"] = x["lengths"]
        o = decode_attention(**x, scale=0.25, impl="triton")
        out[f"{name}_{dtype}"] = [rel(o, decode_reference(**x64, scale=0.25)), str(o.dtype)]
for name, (shape, page) in PAGED_CASES.items():
    x = make(*shape, dtype=torch.float32, seed=4)
    x64 = {n: None if t is None or n == "lengths" else t.double() for n, t in x.items()}
    x64["lengths"] = x["lengths"]
    o = decode_attention(**paged(x, page), scale=0.25, impl="triton")
    out[f"paged_{name}"] = [rel(o, decode_reference(**x64, scale=0.25)), str(o.dtype)]
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(INTERP_SCRIPT, timeout=300)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
def test_interpreter_matches_reference(interpreted, case, dtype):
    err, out_dtype = interpreted[f"{case}_{dtype}"]
    assert out_dtype == dtype
    assert err <= (1e-6 if dtype == "torch.float32" else 2e-3), err


@pytest.mark.parametrize("case", PAGED_CASES)
def test_interpreter_paged_matches_reference(interpreted, case):
    err, _ = interpreted[f"paged_{case}"]
    assert err <= 1e-6, err


GPU_CASES = {  # the decode bench's shapes, and odd ones
    "mha_128": (2, 8, 8, 4100, 128, 128, 0, False),
    "gqa_4": (3, 16, 4, 3001, 128, 128, 0, False),
    "mla_512": (2, 8, 1, 5000, 512, 512, 64, True),
    "odd": (5, 6, 3, 77, 40, 24, 0, False),
    "many_seqs": (64, 8, 8, 300, 128, 128, 0, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(case, dtype):
    x = make(*GPU_CASES[case], dtype=dtype, seed=5, device="cuda")
    x64 = {n: None if t is None or n == "lengths" else t.double() for n, t in x.items()}
    x64["lengths"] = x["lengths"]
    o = decode_attention(**x)
    assert o.dtype == dtype and torch.isfinite(o).all()
    scale = (x["q"].shape[-1] + (0 if x["q2"] is None else x["q2"].shape[-1])) ** -0.5
    assert rel(o, decode_reference(**x64, scale=scale)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case,page", [("mha_128", 64), ("mla_512", 40), ("many_seqs", 20)])
def test_gpu_paged_matches_reference(case, page):
    shape = list(GPU_CASES[case])
    shape[3] = shape[3] // page * page
    x = make(*shape, dtype=torch.bfloat16, seed=7, device="cuda")
    x64 = {n: None if t is None or n == "lengths" else t.double() for n, t in x.items()}
    x64["lengths"] = x["lengths"]
    scale = (x["q"].shape[-1] + (0 if x["q2"] is None else x["q2"].shape[-1])) ** -0.5
    o = decode_attention(**paged(x, page))
    assert rel(o, decode_reference(**x64, scale=scale)) <= 1e-2


@pytest.mark.gpu
def test_gpu_graph_replay_follows_lengths():
    """Captured once; the lengths change on the device between replays and the output follows."""
    x = make(*GPU_CASES["gqa_4"], dtype=torch.bfloat16, seed=6, device="cuda")
    lengths = x.pop("lengths").to(torch.int32)
    decode_attention(**x, lengths=lengths)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = decode_attention(**x, lengths=lengths)
    for n in (1, 17, 3001):
        lengths.fill_(n)
        graph.replay()
        want = decode_reference(**{k: t.double() for k, t in x.items() if t is not None}, lengths=lengths, scale=128**-0.5)
        assert rel(o, want) <= 1e-2
