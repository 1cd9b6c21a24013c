"""Argument validation for the memory op: one-line ValueErrors that name the argument and what was expected; the
state's dtype and its log-alpha floor."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The state accumulates in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# log alpha is clamped from below at these values (by the state dtype) before any form runs: e^floor is exactly 0 there,
# so the decay is the same "hard reset" as for any lower value, while in-chunk prefix sums stay finite and keep their
# precision (float32's most negative value on two consecutive tokens would sum to -inf, and -inf - -inf is NaN).
LOG_ALPHA_FLOOR = {torch.float32: -110.0, torch.float64: -750.0}


def check_inputs(q, k, v, log_alpha, beta, initial_state, *, step: bool, check_values: bool, cu_seqlens=None,
                 state_rows: int | None = None) -> None:
    """Validate the op's tensors. `step` selects the decode layout ([B, H, D]) over the sequence one ([B, T, H, D]).
    With `cu_seqlens` (packed sequences) its type, shape and device, and one initial state per sequence; its values
    are checked by `seq_offsets`. `state_rows`: the state's expected leading size when it is not B (a slot pool's
    states, read at given rows)."""
    lead = "[B, H, D]" if step else "[B, T, H, D]"
    rank = 3 if step else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor of shape {lead}, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name}: expected shape {lead}, got {_shape(t)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype (float16/bfloat16/float32/float64), got {t.dtype}")
    if q.shape[-1] == 0:
        raise ValueError(f"q: expected a key dim Dk >= 1, got {_shape(q)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected the shape of q {_shape(q)}, got {_shape(k)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v: expected leading dims {list(q.shape[:-1])} (as q) with any Dv, got {_shape(v)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (as q), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    lead_dims = list(q.shape[:-1])  # [B, T, H] or [B, H]
    dk, dv = q.shape[-1], v.shape[-1]
    if log_alpha is not None:
        ok = isinstance(log_alpha, torch.Tensor) and (
            list(log_alpha.shape) == lead_dims or list(log_alpha.shape) == lead_dims + [dk]
        )
        if not ok:
            got = _shape(log_alpha) if isinstance(log_alpha, torch.Tensor) else type(log_alpha).__name__
            raise ValueError(f"log_alpha: expected shape {lead_dims} (scalar gate) or {lead_dims + [dk]} (per channel), got {got}")
        if not log_alpha.is_floating_point():
            raise ValueError(f"log_alpha: expected a floating dtype, got {log_alpha.dtype}")
    if beta is not None:
        if not isinstance(beta, torch.Tensor) or list(beta.shape) != lead_dims:
            got = _shape(beta) if isinstance(beta, torch.Tensor) else type(beta).__name__
            raise ValueError(f"beta: expected shape {lead_dims}, got {got}")
        if not beta.is_floating_point():
            raise ValueError(f"beta: expected a floating dtype, got {beta.dtype}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, q)
    if initial_state is not None:
        rows = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = rows if state_rows is None else state_rows
        want = [rows, q.shape[-2], dk, dv]
        if not isinstance(initial_state, torch.Tensor) or list(initial_state.shape) != want:
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            name = "state" if step else "initial_state"
            layout = "[B, H, Dk, Dv]" if cu_seqlens is None else "[N, H, Dk, Dv]: one per sequence of cu_seqlens"
            raise ValueError(f"{name}: expected shape {want} ({layout}), got {got}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            name = "state" if step else "initial_state"
            raise ValueError(f"{name}: expected float32 (or float64), got {initial_state.dtype}")
    for name, t in (("log_alpha", log_alpha), ("beta", beta), ("state" if step else "initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {t.device}")
    if check_values:
        for name, t in (("q", q), ("k", k), ("v", v), ("log_alpha", log_alpha), ("beta", beta), ("initial_state", initial_state)):
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: contains NaN or Inf")
        if log_alpha is not None and bool((log_alpha > 0).any()):
            raise ValueError(f"log_alpha: expected values <= 0 (log of a decay in (0, 1]), got max {log_alpha.max().item():.4g}")
        if beta is not None and bool(((beta < 0) | (beta > 2)).any()):
            raise ValueError(f"beta: expected values in [0, 2], got range [{beta.min().item():.4g}, {beta.max().item():.4g}]")


def _check_cu_seqlens(cu_seqlens, q: torch.Tensor) -> None:
    """Packed sequences: a batch of one, and offsets a 1-D int64 / int32 tensor [N + 1] on the CPU or q's device."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        got = _shape(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens: expected a 1-D tensor of offsets [N + 1] (N >= 1 sequences), got {got}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens: expected dtype int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens: expected device cpu or {q.device} (as q), got {cu_seqlens.device}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: expected q, k, v with batch size 1 (sequences packed along T), got q {_shape(q)}")


def seq_offsets(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """The offsets of packed sequences as host ints, checked: 0 first, T last, non-decreasing (empty sequences are
    allowed). Every form lays its work out from these values, so they are read (one sync for device offsets) and
    checked whatever `check` says: an offset out of range would index outside the tensors."""
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected the first offset 0, got {offsets[0]}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected the last offset T = {T} (q's length), got {offsets[-1]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {offsets[i]} after {offsets[i - 1]} at index {i}")
    return offsets


def check_flag(name: str, value) -> None:
    """A switch such as `delta` must be a bool: a truthy string or tensor would silently pick a rule."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def check_scale(scale, dk: int) -> float:
    """The read scale: None gives dk ** -0.5; otherwise a finite real number (not a tensor: that would cost a sync)."""
    if scale is None:
        return dk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number (or None for Dk ** -0.5), got {scale!r}")
    return float(scale)
