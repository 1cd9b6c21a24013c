"""Decode attention: one new query per sequence over a cache, each sequence with its own length.

Legend: B batch, L cache capacity (positions), G key/value groups, M query heads per group (H = G M),
Dk key dim, Dv value dim, D2 the optional second key part (MLA's rope key).

    scores[b, h, l] = scale (q[b, h] . k[b, l, g] + q2[b, h] . k2[b, l, g])     h in group g = h // M
    o[b, h] = sum_{l < lengths[b]} softmax_l(scores[b, h]) v[b, l, g]

Two callers, one op:
    attention (GQA / MHA)   k, v [B, L, Hkv, D]                             G = Hkv
    MLA, absorbed           k = latent c [B, L, 1, r], k2 = rope key [B, L, 1, p], v = None (the latent is also the
                            value: v = k), q = q_nope W_uk (latent space)     G = 1, M = H
Forms: `reference` (explicit float32 softmax, float64 for float64) and `triton` (split-K "flash decoding": the keys of
each sequence are cut into splits that run in parallel, every (sequence, group, split) program reads its keys once for
all M heads of the group, and a second kernel merges the splits' partial softmax sums). Keys at positions >= lengths[b]
are never read, so the same call serves a cache allocated for far more tokens than it holds, and `lengths` lives on the
device (no host sync; CUDA-graph safe).
"""

from __future__ import annotations

import torch

from .memory import triton as _tri
from .memory._check import FLOAT_DTYPES, check_scale

IMPLS = ("auto", "reference", "triton")


def _check(q, k, v, lengths, q2, k2, impl, block_table=None):
    def shape(t):
        return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__

    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected shape [B, H, Dk], got {shape(q)}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k: expected shape [B, L, G, Dk], got {shape(k)}")
    B, H, Dk = q.shape
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: expected a floating dtype (float16/bfloat16/float32/float64), got {q.dtype}")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B \
                or block_table.dtype not in (torch.int32, torch.int64) or block_table.device != q.device:
            raise ValueError(f"block_table: expected an int32/int64 tensor [B={B}, max_blocks] on {q.device}, "
                             f"got {shape(block_table)}")
        if lengths is None:
            raise ValueError("lengths: expected a tensor with block_table (a paged cache has no full length)")
        if k.shape[3] != Dk or k.shape[1] < 1:
            raise ValueError(f"k: expected a block arena [n_blocks, page, G, Dk={Dk}], got {shape(k)}")
    elif k.shape[0] != B or k.shape[3] != Dk or k.shape[1] < 1:
        raise ValueError(f"k: expected [B={B}, L >= 1, G, Dk={Dk}] (as q), got {shape(k)}")
    G = k.shape[2]
    if G < 1 or H % G:
        raise ValueError(f"k: expected a number of groups dividing q's {H} heads, got {G}")
    pairs = [("k", k)]
    if v is not None:
        if not isinstance(v, torch.Tensor) or v.dim() != 4 or list(v.shape[:3]) != list(k.shape[:3]):
            raise ValueError(f"v: expected shape {list(k.shape[:3]) + ['Dv']} (as k), got {shape(v)}")
        pairs.append(("v", v))
    if (q2 is None) != (k2 is None):
        raise ValueError("q2, k2: expected both or neither (the second score term)")
    if q2 is not None:
        if not isinstance(q2, torch.Tensor) or q2.dim() != 3 or list(q2.shape[:2]) != [B, H]:
            raise ValueError(f"q2: expected shape [{B}, {H}, D2] (as q), got {shape(q2)}")
        if not isinstance(k2, torch.Tensor) or k2.dim() != 4 or list(k2.shape) != [*k.shape[:3], q2.shape[2]]:
            raise ValueError(f"k2: expected shape {[*k.shape[:3], q2.shape[2]]}, got {shape(k2)}")
        pairs += [("q2", q2), ("k2", k2)]
    for name, t in pairs:
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected dtype {q.dtype} on {q.device} (as q), got {t.dtype} on {t.device}")
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor) or lengths.shape != (B,) or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths: expected an int32/int64 tensor of shape [{B}], got {shape(lengths)}")
        if lengths.device != q.device:
            raise ValueError(f"lengths: expected device {q.device} (as q), got {lengths.device}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


def gather_pages(x: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A block arena [n_blocks, page, ...] read through block_table [B, max_blocks] as [B, max_blocks page, ...]."""
    return x[block_table].flatten(1, 2)


def decode_reference(q, k, v, lengths, *, scale, q2=None, k2=None, block_table=None):
    """The explicit form: per-sequence masked softmax in float32 (float64 for float64 inputs)."""
    if block_table is not None:
        k, v, k2 = (None if t is None else gather_pages(t, block_table) for t in (k, v, k2))
    B, H, _ = q.shape
    L, G = k.shape[1], k.shape[2]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    v = k if v is None else v
    grp = torch.arange(H, device=q.device) // (H // G)  # [H] the group of each head
    kh, vh = k[:, :, grp].to(cd), v[:, :, grp].to(cd)  # [B, L, H, D]
    scores = torch.einsum("bhd,blhd->bhl", q.to(cd), kh)
    if q2 is not None:
        scores = scores + torch.einsum("bhd,blhd->bhl", q2.to(cd), k2[:, :, grp].to(cd))
    valid = torch.arange(L, device=q.device)[None, :] < lengths[:, None]  # [B, L]
    p = (scores * scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)  # [B, H, L]
    return torch.einsum("bhl,blhd->bhd", p, vh).to(q.dtype)


def kernel_runs_on(q: torch.Tensor) -> bool:
    """Whether the Triton kernels serve `q` (CUDA, not float64, triton installed): the layers' decode test."""
    return q.is_cuda and _tri.runs_on(q)


def decode_attention(q, k, v, lengths=None, *, scale=None, q2=None, k2=None, block_table=None, impl="auto"):
    """o [B, H, Dv] (q's dtype) for one query per sequence; see the module docstring. `lengths` [B] (int) defaults to
    L for every sequence; each must be in [1, L] (not checked: a device tensor, and checking would sync).
    Paged cache: `block_table` [B, max_blocks] (int) and k, v, k2 given as block arenas [n_blocks, page, G, D]; position
    n of sequence b lives at row n % page of block block_table[b, n // page]; `lengths` is then required.
    `v=None` reads the values from k (MLA's latent: Dv = Dk). `scale` defaults to 1/sqrt(Dk + D2).
    `impl="auto"` runs the Triton kernels on CUDA (not float64) when triton is installed, else the reference."""
    _check(q, k, v, lengths, q2, k2, impl, block_table)
    scale = check_scale(scale, q.shape[-1] + (0 if q2 is None else q2.shape[-1]))
    if lengths is None:
        lengths = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    if impl == "auto":
        impl = "triton" if _tri.runs_on(q) else "reference"
    if impl == "reference":
        return decode_reference(q, k, v, lengths, scale=scale, q2=q2, k2=k2, block_table=block_table)
    if not _tri.available():
        raise ValueError("impl: 'triton' needs the triton package")
    from .decode_triton import decode_triton

    return decode_triton(q, k, v, lengths, scale=scale, q2=q2, k2=k2, block_table=block_table)
