"""Softmax attention: an explicit reference beside PyTorch SDPA, one contract for training and decoding.

Legend: B batch, Tq query length, Tk key length, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), D head dim.
Queries are the LAST Tq positions of the Tk keys (bottom-right causal alignment), so the same call serves a
full sequence (Tq == Tk), a chunked prefill over a cache, and a one-token decode (Tq == 1) over a KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .memory._check import FLOAT_DTYPES, check_flag, check_scale

IMPLS = ("auto", "reference", "sdpa")


def _check(q, k, v, impl, check_values):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected shape [B, T, H, D], got {got}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected dtype {q.dtype} on {q.device} (as q), got {t.dtype} on {t.device}")
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a head dim D >= 1, got {list(q.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"v: expected leading dims {list(k.shape[:3])} (as k), got {list(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected batch {q.shape[0]} and head dim {q.shape[-1]} (as q), got {list(k.shape)}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"k: expected a number of heads dividing q's {q.shape[2]}, got {k.shape[2]}")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"q: expected at most Tk={k.shape[1]} queries (they are the last Tq positions), got {q.shape[1]}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if check_values:  # SDPA's CPU kernels turn a NaN query row into zeros where the reference gives NaN: reject both
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: contains NaN or Inf")


def _causal_mask(tq: int, tk: int, device) -> torch.Tensor:
    """[Tq, Tk] bool, True where query i (absolute position tk - tq + i) may see key j."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(tk - tq)


def attention_reference(q, k, v, *, causal=True, scale, mask=None):
    """softmax(q k^T * scale) v written out, in float32 (float64 for float64 inputs)."""
    sd = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.to(sd), k.to(sd)) * scale  # (B, H, Tq, Tk)
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    p = scores.softmax(dim=-1)
    return torch.einsum("bhij,bjhd->bihd", p, v.to(sd)).to(q.dtype)


# SDPA's kernels for a CUDA forward without gradient (serving steps, generate): flash, memory-efficient or math, not
# cuDNN. cuDNN builds a plan for every new shape (11.4 ms of host time per call on an H100, torch 2.11: 59 % of a packed
# serving step's host time, dev/LOG.md session 58 serve-speed), and serving gives nearly every step new (Tq, Tk); a
# training run's shapes are fixed (one plan each), so its dispatch is left as torch chooses.
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# A CUDA forward without gradient whose value head dim is below the key's (MLA: 192 / 128) pads v with zeros to the
# key's dim, so SDPA can take its flash kernel (one head dim for q, k, v; up to 256 in 16-bit), not the memory-efficient
# one; the padded output columns are zero and dropped. False: the unpadded call (dev/serve_prefill_profile.py runs both
# side by side: its hybrid and hybrid_nopad rows). On since its GPU test passed on an H100 (session 62, dev/LOG.md).
PAD_VALUES_FOR_FLASH = True


def attention_sdpa(q, k, v, *, causal=True, scale, mask=None):
    if q.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        with sdpa_kernel(_NO_CUDNN):
            return _sdpa(q, k, v, causal=causal, scale=scale, mask=mask, pad_v=PAD_VALUES_FOR_FLASH and _flash_dtype(q))
    return _sdpa(q, k, v, causal=causal, scale=scale, mask=mask)


def _flash_dtype(q: torch.Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _sdpa(q, k, v, *, causal, scale, mask, pad_v=False):
    """SDPA over [B, T, H, D] inputs. `pad_v`: v's head dim, when smaller than q's, zero-padded to it (without a mask:
    flash takes no mask), the output's extra columns dropped: the same numbers, one head dim for flash."""
    dv = v.shape[-1]
    if pad_v and mask is None and dv < q.shape[-1]:
        return _sdpa(q, k, F.pad(v, (0, q.shape[-1] - dv)), causal=causal, scale=scale, mask=None)[..., :dv]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    gqa = q.shape[2] != k.shape[2]  # SDPA reads each kv head once (torch >= 2.5)
    tq, tk = q.shape[1], k.shape[1]
    if mask is not None:
        if causal:
            mask = mask & _causal_mask(tq, tk, q.device)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], scale=scale, enable_gqa=gqa)
    elif not causal or tq == 1:
        o = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=gqa)
    elif tq == tk:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # a chunk over a longer cache: the queries are the last Tq of the Tk keys (bottom-right causal)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=_suffix_causal(tq, tk, q.device), scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def _suffix_causal(tq: int, tk: int, device):
    """The bottom-right causal mask for SDPA. On CUDA as torch's `causal_lower_right` bias, which SDPA runs in the
    flash or memory-efficient kernel with no dense mask (a [Tq, Tk] bool tensor went to cuDNN, which builds a plan for
    every new shape: see _NO_CUDNN). Elsewhere (CPU) the bool mask (the bias would be materialized there anyway)."""
    if device.type == "cuda":
        return causal_lower_right(tq, tk)
    return _causal_mask(tq, tk, device)


def attention(q, k, v, *, causal=True, scale=None, mask=None, impl="auto", check=True):
    """Softmax attention. q [B, Tq, H, D]; k, v [B, Tk, Hkv, D]; returns [B, Tq, H, D] in q's dtype.

    `mask` [B, Tq, Tk] bool (True = may attend), applied with the causal mask when causal: sequences of different
    lengths in one batch (the serving engine's slots). Every query row must see at least one key.
    Decode: pass the one new query (Tq = 1) and the cache's keys/values up to and including the new token.
    `check=True` rejects NaN/Inf inputs, as the memory op does (a host sync); with check=False such inputs give
    unspecified outputs (NaN through the reference, zeros through SDPA on CPU), so layers pass it only on the hot path.
    """
    _check(q, k, v, impl, check)
    check_flag("causal", causal)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or tuple(mask.shape) != (q.shape[0], q.shape[1], k.shape[1])):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected a bool tensor [B, Tq, Tk] = {[q.shape[0], q.shape[1], k.shape[1]]}, got {got}")
    scale = check_scale(scale, q.shape[-1])
    if impl == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale, mask=mask)
    return attention_sdpa(q, k, v, causal=causal, scale=scale, mask=mask)
