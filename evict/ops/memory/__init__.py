"""The memory op: one update rule (decay -> delta erase -> write -> read) in every form, behind one entry point.

    o, S = memory(q, k, v, log_alpha=..., beta=..., delta=True)      # sequences [B, T, H, D]
    o, S = memory(q, k, v, ..., cu_seqlens=offsets)                   # N sequences packed along T, B = 1
    o, S = memory_step(q, k, v, S, log_alpha=..., beta=..., delta=True)  # one token [B, H, D]

Forms: "reference" (token loop, float64-capable), "chunked" (WY/UT chunks), "triton" (CUDA kernels; triton is optional).
"auto" picks "triton" for CUDA inputs (not float64) when triton imports, else "chunked".
"""

from __future__ import annotations

import functools
import warnings

import torch

from ._check import LOG_ALPHA_FLOOR, check_flag, check_inputs, check_scale, seq_offsets, state_dtype
from .chunked import memory_chunked
from .reference import memory_reference
from .step import memory_step
from .triton import MAX_K, MAX_V
from .triton import fits as triton_fits
from .triton import runs_on as triton_runs_on

IMPLS = ("auto", "reference", "chunked", "triton")
CHUNK_SIZES = tuple(2**i for i in range(11))  # 1 … 1024; 16–128 are the fast ones (the others: the chunk dial)

__all__ = ["memory", "memory_step", "IMPLS", "CHUNK_SIZES", "LOG_ALPHA_FLOOR"]


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def memory(
    q, k, v, *,
    log_alpha=None, beta=None, delta=False, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None,
    impl="auto", chunk_size=None, check=True, keep_factors=True,
):
    """The generalized associative-memory update over a sequence.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_alpha: [B, T, H] (scalar gate) or [B, T, H, K] (per channel),
    values <= 0, None = no decay (at or below LOG_ALPHA_FLOOR: a hard reset, alpha = 0 exactly); beta: [B, T, H],
    None = 1; delta: erase against the faded state before writing; scale: a finite number, default K ** -0.5;
    initial_state: [B, H, K, V] float32 (float64 for float64 inputs), on q's device.
    Returns (o [B, T, H, V] in q's dtype, final state or None unless output_final_state).
    cu_seqlens: N variable-length sequences packed along T in a batch of one: int64 (or int32) offsets [N + 1], 0 first,
    T last, non-decreasing (an empty sequence passes its initial state through); on the CPU (no sync) or q's device
    (one sync: every form lays its work out from the offsets, which are always checked). Each sequence runs alone
    from its own initial_state [N, H, K, V]; the final state is [N, H, K, V].
    `check=True` validates values too (finite, log_alpha <= 0, beta in [0, 2]); it costs a host sync.
    Autocast does not reach inside: the op computes at its own precision (float32 state and decays, or float64)
    whatever autocast is active, so a caller casts q, k, v to one dtype and gets o back in it.
    `chunk_size` (a power of two, 1 … 1024; 16–128 are fast; None = each form's own choice): the chunked PyTorch form's
    chunk (None: 64), and the Triton kernels' where it is 16, 32 or 64 (other sizes, and packed sequences, run there in
    chunks of 64; None: `triton.autograd.auto_chunk` — 16 at key dims <= 32, else 32 with >= 64 sequence-heads or key
    dims above 128, else 64, from H200 timings). The Triton kernels take key and value dims up to 256 ("auto" falls back to
    "chunked" beyond that, with a warning). `keep_factors` (Triton form, when a gradient is needed): the forward keeps
    its per-chunk [C, C] factors for the backward (True: faster, KDA's kernels at B4 T8192 H16 D128 bf16 21.8 -> 17.0
    ms on an H200) or the backward recomputes them (False: 640 B less activation memory per token and head at
    chunks of 64).
    """
    check_inputs(q, k, v, log_alpha, beta, initial_state, step=False, check_values=check, cu_seqlens=cu_seqlens)
    check_flag("delta", delta)
    check_flag("output_final_state", output_final_state)
    check_flag("keep_factors", keep_factors)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"chunk_size: expected None or one of {CHUNK_SIZES}, got {chunk_size!r}")
    scale = check_scale(scale, q.shape[-1])
    offsets = None if cu_seqlens is None else seq_offsets(cu_seqlens, q.shape[1])
    if log_alpha is not None:
        # clamp(min=floor) as a where: the same values and gradient (NaN passes through), but its backward keeps a
        # bool mask where clamp keeps the float32 input (4 B a channel per token beside the op's own clamped copy)
        floor = LOG_ALPHA_FLOOR[state_dtype(q.dtype)]
        log_alpha = torch.where(log_alpha < floor, floor, log_alpha)
    with torch.autocast(q.device.type, enabled=False):
        return _dispatch(q, k, v, log_alpha, beta, delta, scale, initial_state, output_final_state, impl, chunk_size, offsets,
                         keep_factors)


def _per_sequence(form, offsets, q, k, v, *, log_alpha, beta, initial_state, **kw):
    """Run `form` on each packed sequence alone: o [1, T, H, V] and the final states [N, H, K, V]."""
    cut = lambda x, a, b: None if x is None else x[:, a:b]  # noqa: E731
    outs, states = [], []
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        o, S = form(cut(q, a, b), cut(k, a, b), cut(v, a, b), log_alpha=cut(log_alpha, a, b), beta=cut(beta, a, b),
                    initial_state=None if initial_state is None else initial_state[n:n + 1], **kw)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


def _dispatch(q, k, v, log_alpha, beta, delta, scale, initial_state, output_final_state, impl, chunk_size, offsets,
              keep_factors=True):
    K, V = q.shape[-1], v.shape[-1]
    if impl == "auto":
        impl = "triton" if q.is_cuda and triton_runs_on(q) else "chunked"
        if impl == "triton" and not triton_fits(K, V):
            _warn_once(f"memory: head dims K={K}, V={V} exceed the Triton kernels' {MAX_K} / {MAX_V}; using the chunked PyTorch form")
            impl = "chunked"
    if impl == "triton":
        if not triton_fits(K, V):
            raise ValueError(f"impl: 'triton' takes key dims up to {MAX_K} and value dims up to {MAX_V}, got K={K}, V={V}")
        if not triton_runs_on(q):
            raise ValueError(f"impl: 'triton' needs the triton package and CUDA tensors (not float64), got {q.device} {q.dtype}")
        from .triton.autograd import memory_triton

        o, S = memory_triton(
            q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
            initial_state=initial_state, chunk_size=chunk_size, offsets=offsets, keep_factors=keep_factors,
        )
    elif offsets is not None:  # the PyTorch forms: one sequence at a time
        form = memory_reference if impl == "reference" else functools.partial(memory_chunked, chunk_size=chunk_size)
        o, S = _per_sequence(form, offsets, q, k, v, log_alpha=log_alpha, beta=beta, initial_state=initial_state,
                             delta=delta, scale=scale)
    elif impl == "reference":
        o, S = memory_reference(q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale, initial_state=initial_state)
    else:
        o, S = memory_chunked(
            q, k, v, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale,
            initial_state=initial_state, chunk_size=chunk_size,
        )
    return o.to(q.dtype), (S if output_final_state else None)
