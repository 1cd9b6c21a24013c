"""Softmax attention: SDPA fast path against the explicit reference, including GQA, offsets and decode."""

import importlib

import pytest
import torch

from evict.ops import attention
from tests.conftest import rel

attention_ops = importlib.import_module("evict.ops.attention")  # the module (the package exports its function)


@pytest.mark.parametrize("T", [1, 63, 65, 200])
@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_reference(T, hkv, causal):
    q = torch.randn(2, T, 4, 16, dtype=torch.float64)
    k, v = torch.randn(2, T, hkv, 16, dtype=torch.float64), torch.randn(2, T, hkv, 16, dtype=torch.float64)
    assert rel(attention(q, k, v, causal=causal, impl="sdpa"), attention(q, k, v, causal=causal, impl="reference")) <= 1e-12


def test_reference_is_softmax_written_out():
    q, k, v = (torch.randn(1, 5, 1, 3, dtype=torch.float64) for _ in range(3))
    o = attention(q, k, v, impl="reference", scale=1.0)
    i = 2  # query 2 sees keys 0..2
    w = torch.softmax(q[0, i, 0] @ k[0, : i + 1, 0].T, dim=-1)
    assert torch.allclose(o[0, i, 0], w @ v[0, : i + 1, 0], atol=1e-14)


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_suffix_queries_and_decode_equal_full(impl):
    """Queries aligned to the end of the keys (prefill over a cache, one-token decode) equal the full causal pass."""
    q = torch.randn(2, 50, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 50, 3, 8, dtype=torch.float64), torch.randn(2, 50, 3, 8, dtype=torch.float64)
    full = attention(q, k, v, impl=impl)
    assert rel(attention(q[:, 30:], k, v, impl=impl), full[:, 30:]) <= 1e-12
    for t in (0, 17, 49):
        assert rel(attention(q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], impl=impl), full[:, t : t + 1]) <= 1e-12


@pytest.mark.parametrize("tq,tk", [(1, 40), (13, 40), (40, 40)])
def test_values_padded_for_flash_give_the_same_output(tq, tk):
    """MLA's value head dim (here 5) below the key's (12): v zero-padded to 12 for one SDPA head dim, the extra output
    columns dropped, equals the reference (decode row, a chunk over a longer cache, a whole sequence)."""
    q, k, v = torch.randn(2, tq, 4, 12, dtype=torch.float64), torch.randn(2, tk, 4, 12, dtype=torch.float64), \
        torch.randn(2, tk, 4, 5, dtype=torch.float64)
    o = attention_ops._sdpa(q, k, v, causal=True, scale=0.3, mask=None, pad_v=True)
    assert o.shape == (2, tq, 4, 5)
    assert rel(o, attention(q, k, v, scale=0.3, impl="reference")) <= 1e-12


def test_bad_inputs():
    q = torch.randn(2, 5, 4, 8)
    with pytest.raises(ValueError, match=r"^k: expected a number of heads dividing"):
        attention(q, torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8))
    with pytest.raises(ValueError, match=r"^q: expected shape"):
        attention(q[0], q, q)
    with pytest.raises(ValueError, match=r"^q: expected at most Tk=3"):
        attention(q, q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match=r"^impl:"):
        attention(q, q, q, impl="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])  # without gradient (serving) SDPA runs without cuDNN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hkv,dv", [(8, 128), (2, 128), (8, 96)])  # MHA, GQA, a value dim unlike the key's (MLA)
@pytest.mark.parametrize("tq,tk", [(1, 300), (77, 300), (256, 4096), (300, 300)])
def test_gpu_suffix_queries_match_reference(grad, dtype, hkv, dv, tq, tk):
    """A prompt chunk over a longer cache (Tq < Tk, the packed serving step) or the whole sequence (Tq = Tk) through
    SDPA on CUDA (torch's lower-right causal bias; flash / memory-efficient kernels, not cuDNN, without gradient) against
    the float64 reference, fresh random inputs."""
    g = torch.Generator(device="cuda").manual_seed(tq * 7 + tk + hkv + dv)
    q = torch.randn(2, tq, 8, 192 if dv != 128 else 128, device="cuda", generator=g)
    k = torch.randn(2, tk, hkv, q.shape[-1], device="cuda", generator=g)
    v = torch.randn(2, tk, hkv, dv, device="cuda", generator=g)
    with torch.set_grad_enabled(grad):
        o = attention(q.to(dtype), k.to(dtype), v.to(dtype), check=False)
    ref = attention(q.double(), k.double(), v.double(), impl="reference")
    assert o.dtype == dtype and o.shape == (2, tq, 8, dv)
    assert rel(o, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tq,tk", [(256, 4096), (300, 300)])
def test_gpu_mla_head_dims_run_flash_without_gradient(tq, tk, monkeypatch):
    """MLA's prompt chunk (keys 192, values 128, bf16, no gradient: serving) reaches SDPA's flash kernel (values padded
    to 192), not the memory-efficient one (neither its aten op nor its cutlass kernel runs); the output matches the
    float64 reference to 1e-2, as the op's other 16-bit GPU tests."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(attention_ops, "PAD_VALUES_FOR_FLASH", True)  # the default: this test is about the padded path
    g = torch.Generator(device="cuda").manual_seed(tq + tk)
    q, k = (torch.randn(1, t, 8, 192, device="cuda", generator=g, dtype=torch.bfloat16) for t in (tq, tk))
    v = torch.randn(1, tk, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]  # aten ops and kernels
    with torch.no_grad(), torch.profiler.profile(activities=acts) as prof:
        o = attention(q, k, v, check=False)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any("flash" in n for n in names), names
    assert not any("fmha_cutlass" in n or "efficient_attention" in n for n in names), names
    ref = attention(q.double(), k.double(), v.double(), impl="reference")
    assert rel(o, ref) <= 1e-2
