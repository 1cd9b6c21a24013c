"""The Triton forward and backward behind torch.autograd: `memory_triton(...)` is what `memory(impl="triton")` calls.

The forward keeps its inputs and its per-chunk [C, C] factors (`keep_factors`); the backward recomputes the gates, W,
U and the chunk start states (the rest of the forward's first stage and its carry kernel) and runs the three backward
kernels (backward.py). Chunks are 16, 32 or 64 tokens
(`auto_chunk` by shape unless the caller gives one; packed sequences 64).

Packed sequences (`offsets`) run chunk-aligned: each sequence is copied to a multiple of C rows of one padded row
[1, T', H, D], the rest neutral tokens (q = k = v = 0, log alpha = 0, beta = 0: they read, write, erase and decay
nothing), so no chunk straddles two sequences and the per-chunk kernels run unchanged; the sequential kernels take a
table of each sequence's chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from .backward import backward_triton
from .forward import CHUNKS, C, _gate, forward_triton, precision_for


FACTORS = ("Tm", "Am", "Pm")  # what `keep_factors` saves for the backward; `keep_states`: all of STATES
STATES = ("G", "Ub", "W", "Tm", "Am", "Pm", "Kd", "Dec", "Qg", "U", "Hs", "sT")


class _MemoryTriton(torch.autograd.Function):
    # The context holds tensors (saved) and plain ints / bools only, as torch.compile's tracing of it expects.
    @staticmethod
    def forward(ctx, q, k, v, log_alpha, beta, initial_state, delta, scale, chunks, chunk, keep_factors, keep_states):
        keep = states = None
        if keep_factors is not False and any(ctx.needs_input_grad[:6]):
            keep = keep_factors if isinstance(keep_factors, str) else precision_for(q.dtype)
            states = (keep_states if isinstance(keep_states, str) else "tf32x3") if keep_states else None
        o, S, *kept = forward_triton(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
                                     initial_state=initial_state, chunks=chunks, chunk=chunk, keep_factors=keep,
                                     keep_states=states)
        names = STATES if states else FACTORS if keep else ()
        ctx.save_for_backward(q, k, v, log_alpha, beta, initial_state, *(kept[0][n] for n in names))
        ctx.delta, ctx.scale, ctx.chunks, ctx.chunk = delta, scale, chunks, chunk
        ctx.mode = 2 if states else 1 if keep else 0  # 0: recompute, 1: factors kept, 2: every intermediate kept
        return o, S

    @staticmethod
    def backward(ctx, do, dS):
        q, k, v, la, beta, s0, *saved = ctx.saved_tensors
        factors = states = None
        if ctx.mode == 1:
            factors = dict(zip(FACTORS, saved), C=ctx.chunk)
        elif ctx.mode == 2:
            states = dict(zip(STATES, saved), C=ctx.chunk, N=max(1, triton.cdiv(q.shape[1], ctx.chunk)), gate=_gate(la), kd=True,
                          store=torch.float32)
        dq, dk, dv, dla, dbeta, ds0 = backward_triton(q, k, v, la, beta, s0, do, dS, delta=ctx.delta, scale=ctx.scale,
                                                      chunks=ctx.chunks, chunk=ctx.chunk, factors=factors, states=states)
        need = ctx.needs_input_grad
        grads = (dq, dk, dv, dla, dbeta, ds0)
        return (*(g if need[i] else None for i, g in enumerate(grads)), None, None, None, None, None, None)


MIN_K = 32  # key dims below this are zero-padded: the delta backward faults at K = 16 on an H200 (dev/LOG.md)


def auto_chunk(B: int, H: int, K: int, packed: bool = False) -> int:
    """The kernels' tokens per chunk when the caller leaves it open (`chunk_size=None`), from H200 timings (bf16,
    forward + backward, BENCHMARKS.md session 9): chunks of 16 at key dims <= 32 (the lab's B256 T512 H4 D32: KDA 4.78 ->
    3.60 ms); at larger key dims 32 when B * H >= 64 sequence-heads keep the sequential carry busy (B4 T8192 H16 D128:
    KDA 24.9 -> 22.1 ms), else 64 (B1 T32768 H16: 32 was no faster, the carry's 16 programs leave SMs idle); packed
    sequences 64 (their layout). Key dims between 32 and 128 follow the 128 rule (not measured there). Key dims above
    128: 32 (sm_90 ptxas, K V 256, KDA: the first-stage kernel spills 5,776 B a thread at chunks of 64, 1,128 at 32)."""
    if packed:
        return C
    if K <= 32:
        return 16
    return 32 if B * H >= 64 or K > 128 else C


def _packing(offsets: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chunk-aligned layout of packed sequences: each token's row in the padded row (int64 [T]), each sequence's
    chunks (int32 [N + 1]: sequence n owns chunks [chunks[n], chunks[n + 1])) and the padded length T'."""
    starts = torch.tensor(offsets[:-1], dtype=torch.int64)
    lens = torch.tensor(offsets[1:], dtype=torch.int64) - starts
    counts = (lens + C - 1) // C
    if int(counts.sum()) == 0:  # every sequence empty: one neutral chunk (for the last one) gives the kernels a grid
        counts[-1] = 1
    chunks = F.pad(counts.cumsum(0), (1, 0))
    rows = torch.arange(offsets[-1], dtype=torch.int64) + (C * chunks[:-1] - starts).repeat_interleave(lens)
    return rows.to(device), chunks.to(device=device, dtype=torch.int32), C * int(chunks[-1])


def _pad_rows(x, rows, length):
    """[1, T, H, *] -> [1, length, H, *]: token t at row rows[t], zeros elsewhere (differentiable)."""
    return None if x is None else x.new_zeros(1, length, *x.shape[2:]).index_copy(1, rows, x)


def memory_triton(q, k, v, *, log_alpha=None, beta=None, delta=False, scale, initial_state=None, chunk_size=None,
                  offsets=None, keep_factors=None, keep_states=None):
    """o [B, T, H, V] in q's dtype and the final state [B, H, K, V] float32, differentiable.
    With `offsets` (host ints [N + 1], validated: packed sequences, B = 1) the states are [N, H, K, V].

    Key dims below MIN_K run zero-padded, which is exact: a zero key channel writes nothing into its row of S, a zero
    query channel reads nothing from it, and a zero log-decay there touches only that (zero) row; the padded rows of
    the final state are dropped and the gradients of the padding never reach the inputs.
    `chunk_size`: the kernels' tokens per chunk where it is one of CHUNKS (16, 32, 64), else 64; None: `auto_chunk`.
    Packed sequences always run in chunks of 64 (their layout). `keep_factors`: when a gradient is needed, the forward
    keeps its [C, C] matrices T, A~, P for the backward, which then skips their recompute (the Gram strips and the
    inverse). Default (None / True): kept, formed at the forward's own tl.dot precision (`precision_for`: tf32 for
    16-bit inputs, tf32x3 for float32); a string: that precision; False: recomputed, saving 2 C float32 + C 16-bit
    values per token and head (C 64: 640 B, next to 768 B of bf16 q, k, v at D 128). Measured (H200, bf16, session
    11): KDA's forward + backward kernels at B4 T8192 H16 D128 21.8 -> 17.0 ms at chunks of 64, the lab's B256 T512 H4
    D32 3.29 -> 2.57 ms; log alpha's gradient under strong decay 2.1e-3 either way (dev/check_precision.py).
    `keep_states` (opt-in, not yet measured on a GPU; True or the carry's tl.dot precision, default "tf32x3"): the
    forward also keeps every other intermediate in float32 and its chunk start states, and the backward recomputes
    nothing (`forward_triton(keep_states=...)`: several KB per token and head — for small models)."""
    B, _, H, K = q.shape
    packed = offsets is not None
    if chunk_size is None:
        chunk = auto_chunk(B, H, K, packed)
    else:
        chunk = chunk_size if chunk_size in CHUNKS and not packed else C
    pad = MIN_K - K if K < MIN_K else 0
    if pad:
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        if log_alpha is not None and log_alpha.dim() == 4:
            log_alpha = F.pad(log_alpha, (0, pad))
        if initial_state is not None:
            initial_state = F.pad(initial_state, (0, 0, 0, pad))
    chunks = None
    if offsets is not None:
        rows, chunks, length = _packing(offsets, q.device)
        q, k, v, log_alpha, beta = (_pad_rows(x, rows, length) for x in (q, k, v, log_alpha, beta))
    o, S = _MemoryTriton.apply(q, k, v, log_alpha, beta, initial_state, bool(delta), float(scale), chunks, chunk,
                               keep_factors, keep_states)
    if offsets is not None:
        o = o.index_select(1, rows)
    return o, (S[:, :, :K] if pad else S)
