"""One decode step of the memory op: [B, H, D] tensors and a state [B, H, K, V]."""

from __future__ import annotations

import torch

from ._check import check_flag, check_inputs, check_scale, state_dtype
from .preact import check_pre
from .reference import rule
from .triton import runs_on as triton_runs_on


# `pre` inside the step's one Triton launch on CUDA (on since its GPU tests passed on an H100, session 62). False: CUDA
# maps the raw inputs with `pre.apply` (torch) first, then the plain step kernel.
FUSE_PRE = True


def memory_step(q, k, v, state, *, log_alpha=None, beta=None, delta=False, scale=None, check=False, out=None, rows=None,
                pre=None):
    """(o_t, S_t) = step(q_t, k_t, v_t, S_{t-1}): the T = 1 case of `memory`.

    q, k [B, H, K]; v [B, H, V]; state [B, H, K, V] float32 (float64 for float64 inputs);
    log_alpha [B, H] or [B, H, K]; beta [B, H]. Returns o [B, H, V] in q's dtype and the new state.
    `out` (contiguous, shape and dtype of state; may be `state` itself, for in-place) receives the new state.
    `rows` [B] (int64 / int32, on the state's device): the state is a slot pool's [N, H, K, V] and row b of this step
    is state[rows[b]]; its new state goes to out[rows[b]] (out: `state` itself for in-place, else a copy of state) and
    the other rows of out keep state's. No gather or scatter copy: the kernel reads and writes the rows in place.
    Repeated ids (a CUDA graph's padding rows) leave those rows' new state undefined. Ids outside [0, N) are refused
    on the CPU and with `check=True` (a host sync); on CUDA without `check` they are the caller's to keep in range.
    On CUDA this is one fused Triton launch with no host sync (graph-capturable when check=False).
    `check=True` also rejects NaN/Inf, positive log_alpha and beta outside [0, 2] (costs a host sync; not with `pre`).
    `pre` (evict.ops.memory.preact.Preact): q, k, v are raw (a short conv's outputs), log_alpha the gate projection
    and beta the beta projection, each of the shape above; the step maps them first (SiLU, L2, log_decay, sigmoid):
    on CUDA inside its one launch (with FUSE_PRE), elsewhere by `pre.apply` (the layers' own torch forms).
    """
    pool = isinstance(state, torch.Tensor) and state.dim() > 0  # rows: state's leading size is the pool's, not B
    check_inputs(q, k, v, log_alpha, beta, state, step=True, check_values=check and pre is None,
                 state_rows=state.shape[0] if rows is not None and pool else None)
    check_flag("delta", delta)
    if pre is not None:
        check_pre(pre, q, log_alpha)
    if state is None:
        raise ValueError("state: expected a tensor of shape [B, H, Dk, Dv], got None")
    if rows is not None:
        if not (isinstance(rows, torch.Tensor) and rows.dim() == 1 and rows.shape[0] == q.shape[0]
                and rows.dtype in (torch.int64, torch.int32) and rows.device == state.device):
            got = list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"rows: expected an int64/int32 tensor [B={q.shape[0]}] on the state's device, got {got}")
        if (check or not rows.is_cuda) and rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < state.shape[0]:
            # a host sync: with check=True, or where there is none to cost (a CPU tensor); else the kernel would
            # read and write outside the pool
            raise ValueError(f"rows: expected slot ids in [0, {state.shape[0]}) (the state's rows), "
                             f"got {int(rows.min())} .. {int(rows.max())}")
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == state.shape and out.dtype == state.dtype
                                and out.device == state.device and out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {state.dtype} tensor of shape {list(state.shape)} on {state.device}")
    sd = state_dtype(q.dtype)
    scale = check_scale(scale, q.shape[-1])
    if q.is_cuda and state.dtype == torch.float32 and triton_runs_on(q):
        from .triton.step import step_triton

        if pre is not None and not FUSE_PRE:  # the maps in torch, then the step kernel on plain inputs
            q, k, v, log_alpha, beta = pre.apply(q, k, v, log_alpha, beta)
            q, k, v, pre = q.contiguous(), k.contiguous(), v.contiguous(), None

        return step_triton(q, k, v, state, log_alpha=log_alpha, beta=beta, delta=delta, scale=scale, out=out, rows=rows,
                           pre=pre)
    if pre is not None:
        q, k, v, log_alpha, beta = pre.apply(q, k, v, log_alpha, beta)
    with torch.autocast(q.device.type, enabled=False):  # the step runs at the state's precision, as `memory` does
        o, S = rule(
            q.to(sd), k.to(sd), v.to(sd), (state if rows is None else state[rows]).to(sd),
            None if log_alpha is None else log_alpha.to(sd),
            None if beta is None else beta.to(sd),
            delta, scale,
        )
    if rows is not None:
        out = state.clone() if out is None else out.copy_(state) if out is not state else out
        out.index_copy_(0, rows.long(), S.to(out.dtype))
        S = out
    elif out is not None:
        out.copy_(S)
        S = out
    return o.to(q.dtype), S
