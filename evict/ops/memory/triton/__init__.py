"""Triton kernels for the memory op (CUDA; also the CPU interpreter with TRITON_INTERPRET=1).

    step.py      fused decode step, one launch per token, state updated in place or into `out`
    forward.py   chunked forward: per-chunk WY factors (parallel), state carry (sequential), output (parallel)
    backward.py  chunked backward: recomputed factors and states, dstate carry, value and key gradients, gate sum
    autograd.py  forward and backward behind torch.autograd (`memory_triton`)

This file imports no triton: `available()` says whether the kernels can load; callers import the submodules lazily,
so machines without triton still import evict.
"""

from __future__ import annotations

import os

import torch


_AVAILABLE: bool | None = None  # a plain module global, not functools.cache: runs_on is traced by torch.compile, and
# Dynamo warns on every compile that it traces through an lru_cache wrapper (session 26's lab hybrid logs)


def available() -> bool:
    """True when the triton package imports (tried once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _AVAILABLE = False
        else:
            _AVAILABLE = True
    return _AVAILABLE


MAX_K, MAX_V = 256, 256  # the chunked kernels' tiles fit an H100/H200 SM's shared memory up to these (keys above 128:
# the carry in one stage, forward.carry; the register spills there are why auto_chunk picks chunks of 32)


def fits(K: int, V: int) -> bool:
    """Whether the chunked kernels take these head dims (the decode step takes any)."""
    return K <= MAX_K and V <= MAX_V


def runs_on(t: torch.Tensor) -> bool:
    """The kernels take CUDA tensors (not float64), or CPU float32 ones under the interpreter (TRITON_INTERPRET=1)."""
    if t.dtype == torch.float64 or not available():
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
