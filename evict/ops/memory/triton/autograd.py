"""The Triton forward and backward behind torch.autograd: `memory_triton(...)` is what `memory(impl="triton")` calls.

They are registered as torch.library custom ops (`evict::memory_forward`, `evict::memory_backward`, tied by
register_autograd, each with a fake form for shapes), so torch.compile takes a block that calls them whole: no
graph break at the op.

The forward keeps its inputs and its per-chunk [C, C] factors (`keep_factors`); the backward recomputes the gates, W,
U and the chunk start states (the rest of the forward's first stage and its carry kernel) and runs the three backward
kernels (backward.py). Chunks are 16, 32 or 64 tokens
(`auto_chunk` by shape unless the caller gives one; packed sequences 64).

Packed sequences (`offsets`) run chunk-aligned: each sequence is copied to a multiple of C rows of one padded row
[1, T', H, D], the rest neutral tokens (q = k = v = 0, log alpha = 0, beta = 0: they read, write, erase and decay
nothing), so no chunk straddles two sequences and the per-chunk kernels run unchanged; the sequential kernels take a
table of each sequence's chunks. When every sequence is already a whole number of chunks (a serving step's 4,096-token
prompt chunks) the layout is the identity and nothing is copied.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from evict.host_copy import to_device

from .backward import backward_triton
from .forward import CHUNKS, C, _gate, forward_triton, precision_for


FACTORS = ("Tm", "Am", "Pm")  # what `keep_factors` saves for the backward
KEPT = ("G", "Ub", "W", "Tm", "Am", "Pm", "Kd", "Dec", "Qg", "U", "Hs")  # the forward op's fixed kept outputs (with
# `keep_states`: all of them, the final state being the op's own; with `keep_factors`: FACTORS; the rest empty)

# The forward and backward are two torch.library custom ops (opaque to torch.compile: a compiled block holds them as
# single nodes, no graph break) tied by register_autograd. Each has a fake (meta) form giving its outputs' shapes.
# Their schemas are fixed: absent outputs are empty tensors, absent inputs None.


def _kept_layout(q: torch.Tensor, v: torch.Tensor, log_alpha, delta: bool, chunk: int, mode: int) -> list[tuple]:
    """(numel, dtype) of each KEPT tensor the forward returns in `mode` (0: none, 1: FACTORS, 2: every one), as
    forward.intra / carry allocate them."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, f32 = chunk, torch.float32
    rows = B * H * ((T + C - 1) // C) * C  # chunk-padded tokens, head-major
    gate = _gate(log_alpha)
    st = f32 if mode == 2 else q.dtype  # the forward alone stores its intermediates in a 16-bit input dtype
    size = dict(G=rows * (K if gate == 2 else 1) if gate else 1, Ub=rows * V, W=rows * K if delta else 1,
                Tm=rows * C if delta else 1, Am=rows * C if delta else 1, Pm=rows * C, Kd=rows * K if gate else 1,
                Dec=rows // C * (K if gate == 2 else 1) if gate else 1, Qg=rows * K if gate else 1, U=rows * V,
                Hs=rows // C * K * V)
    dtype = dict(G=f32, Ub=st, W=st, Tm=f32, Am=f32, Pm=st, Kd=st, Dec=f32, Qg=f32, U=st, Hs=st)
    kept = KEPT if mode == 2 else FACTORS if mode == 1 else ()
    return [(size[n], dtype[n]) if n in kept else (0, f32) for n in KEPT]


@torch.library.custom_op("evict::memory_forward", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? log_alpha, Tensor? beta, Tensor? initial_state, Tensor? chunks, bool delta, "
    "float scale, int chunk, str keep, str states) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: Optional[torch.Tensor],
                beta: Optional[torch.Tensor], initial_state: Optional[torch.Tensor], chunks: Optional[torch.Tensor],
                delta: bool, scale: float, chunk: int, keep: str, states: str) -> tuple[torch.Tensor, ...]:
    """(o, final state, *KEPT): `keep` / `states` the tl.dot precisions of keep_factors / keep_states, "" = off."""
    o, S, *kept = forward_triton(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
                                 initial_state=initial_state, chunks=chunks, chunk=chunk, keep_factors=keep or None,
                                 keep_states=states or None)
    got = kept[0] if kept else {}
    return (o, S, *(got[n] if n in got and n != "sT" else q.new_empty(0, dtype=torch.float32) for n in KEPT))


@_forward_op.register_fake
def _(q, k, v, log_alpha, beta, initial_state, chunks, delta, scale, chunk, keep, states):
    B, T, H, K = q.shape
    seqs = B if chunks is None else chunks.shape[0] - 1
    mode = 2 if states else 1 if keep else 0
    kept = [q.new_empty(n, dtype=dt) for n, dt in _kept_layout(q, v, log_alpha, delta, chunk, mode)]
    return (q.new_empty(B, T, H, v.shape[-1]), q.new_empty(seqs, H, K, v.shape[-1], dtype=torch.float32), *kept)


@torch.library.custom_op("evict::memory_backward", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? log_alpha, Tensor? beta, Tensor? initial_state, Tensor? chunks, Tensor? do, "
    "Tensor? dS, Tensor S, Tensor[] kept, bool delta, float scale, int chunk, int mode) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"))
def _backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: Optional[torch.Tensor],
                 beta: Optional[torch.Tensor], initial_state: Optional[torch.Tensor], chunks: Optional[torch.Tensor],
                 do: Optional[torch.Tensor], dS: Optional[torch.Tensor], S: torch.Tensor, kept: list[torch.Tensor],
                 delta: bool, scale: float, chunk: int, mode: int) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dlog_alpha, dbeta, dinitial_state); dlog_alpha / dbeta empty where there is no gate / beta."""
    factors = states = None
    named = dict(zip(KEPT, kept))
    if mode == 1:
        factors = dict(**{n: named[n] for n in FACTORS}, C=chunk)
    elif mode == 2:
        states = dict(named, sT=S, C=chunk, N=max(1, triton.cdiv(q.shape[1], chunk)), gate=_gate(log_alpha), kd=True,
                      store=torch.float32)
    dq, dk, dv, dla, dbeta, ds0 = backward_triton(q, k, v, log_alpha, beta, initial_state, do, dS, delta=delta,
                                                  scale=scale, chunks=chunks, chunk=chunk, factors=factors, states=states)
    none = lambda: q.new_empty(0, dtype=torch.float32)  # noqa: E731  one each: a custom op's returns may not alias
    return dq, dk, dv, none() if dla is None else dla, none() if dbeta is None else dbeta, ds0


@_backward_op.register_fake
def _(q, k, v, log_alpha, beta, initial_state, chunks, do, dS, S, kept, delta, scale, chunk, mode):
    none = lambda: q.new_empty(0, dtype=torch.float32)  # noqa: E731
    like = lambda t: t.new_empty(t.shape)  # noqa: E731  contiguous, as the kernels write them (inputs may be strided)
    return (like(q), like(k), like(v), none() if log_alpha is None else like(log_alpha),
            none() if beta is None else like(beta), like(S))


def _setup_context(ctx, inputs, output):
    q, k, v, log_alpha, beta, initial_state, chunks, delta, scale, chunk, keep, states = inputs
    o, S, *kept = output
    ctx.save_for_backward(q, k, v, log_alpha, beta, initial_state, chunks, S, *kept)
    ctx.delta, ctx.scale, ctx.chunk = delta, scale, chunk
    ctx.mode = 2 if states else 1 if keep else 0  # 0: recompute, 1: factors kept, 2: every intermediate kept
    ctx.mark_non_differentiable(*kept)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None (the kernels skip it), not zeros


def _backward(ctx, do, dS, *_kept):
    q, k, v, la, beta, s0, chunks, S, *kept = ctx.saved_tensors
    if do is None and dS is None:
        return None, None, None, None, None, None, None, None, None, None, None, None
    dq, dk, dv, dla, dbeta, ds0 = _backward_op(q, k, v, la, beta, s0, chunks, do, dS, S, kept, ctx.delta, ctx.scale,
                                               ctx.chunk, ctx.mode)
    need = ctx.needs_input_grad
    grads = (dq, dk, dv, dla, dbeta, ds0)
    return (*(g if need[i] else None for i, g in enumerate(grads)), None, None, None, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


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


_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}  # (offsets, device) -> _packing's answer, a few kept


def _packing(offsets: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """_layout(offsets, device), kept for the last few offsets: every memory layer of one packed forward (a serving
    step) runs the same offsets, and each layout costs two host-to-device copies (the layers after the first then reuse
    the device tensors, read-only); `to_device` makes them from pinned memory, so they do not stall the host."""
    if torch.compiler.is_compiling():
        return _layout(offsets, device)
    key = (tuple(offsets), str(device))
    got = _LAYOUTS.get(key)
    if got is None:
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        got = _LAYOUTS[key] = _layout(offsets, device)
    return got


def _layout(offsets: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The chunk-aligned layout of packed sequences: each token's row in the padded row (int64 [T]), each sequence's
    chunks (int32 [N + 1]: sequence n owns chunks [chunks[n], chunks[n + 1])) and the padded length T'."""
    starts = torch.tensor(offsets[:-1], dtype=torch.int64)
    lens = torch.tensor(offsets[1:], dtype=torch.int64) - starts
    counts = (lens + C - 1) // C
    if int(counts.sum()) == 0:  # every sequence empty: one neutral chunk (for the last one) gives the kernels a grid
        counts[-1] = 1
    chunks = F.pad(counts.cumsum(0), (1, 0))
    rows = torch.arange(offsets[-1], dtype=torch.int64) + (C * chunks[:-1] - starts).repeat_interleave(lens)
    return to_device(rows, device), to_device(chunks.to(torch.int32), device), C * int(chunks[-1])


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
    chunks, aligned = None, True
    if offsets is not None:
        rows, chunks, length = _packing(offsets, q.device)
        aligned = length == q.shape[1]  # every sequence a whole number of chunks: rows is the identity, no copies
        if not aligned:
            q, k, v, log_alpha, beta = (_pad_rows(x, rows, length) for x in (q, k, v, log_alpha, beta))
    keep = states = ""
    if keep_factors is not False and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, log_alpha, beta, initial_state)):
        keep = keep_factors if isinstance(keep_factors, str) else precision_for(q.dtype)
        states = (keep_states if isinstance(keep_states, str) else "tf32x3") if keep_states else ""
    o, S, *_ = _forward_op(q, k, v, log_alpha, beta, initial_state, chunks, bool(delta), float(scale), chunk, keep, states)
    if offsets is not None and not aligned:
        o = o.index_select(1, rows)
    return o, (S[:, :, :K] if pad else S)
