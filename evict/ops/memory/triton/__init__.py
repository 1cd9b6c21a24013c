"""Triton kernels for the memory op (CUDA; also the CPU interpreter with TRITON_INTERPRET=1).

    step.py      fused decode step, one launch per token, state updated in place or into `out`
    forward.py   chunked forward: per-chunk WY factors (parallel), state carry (sequential), output (parallel)
    backward.py  chunked backward: recomputed factors and states, dstate carry, value and key gradients, gate sum
    autograd.py  forward and backward behind torch.autograd (`memory_triton`)

This file imports no triton: `available()` says whether the kernels can load; callers import the submodules lazily,
so machines without triton still import evict.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
MIN_TRITON, TESTED_TRITON = (3, 2), (3, 6)  # pyproject's `triton` extra has no upper bound, so torch keeps its own


_AVAILABLE: bool | None = None  # a plain module global, not functools.cache: runs_on is traced by torch.compile, and
# Dynamo warns on every compile that it traces through an lru_cache wrapper (session 26's lab hybrid logs)


def version_check(version: str) -> tuple[bool, str | None]:
    """(usable, one-line message or None) for an installed triton version string: older than 3.2 is not used (the
    PyTorch path runs instead), newer than the tested 3.6 is used with a warning."""
    try:
        got = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False, f"triton {version!r}: unreadable version; using the PyTorch path"
    if got < MIN_TRITON:
        return False, (f"triton {version} is older than {MIN_TRITON[0]}.{MIN_TRITON[1]}, which evict's kernels need; "
                       "using the PyTorch path (pip install -U triton)")
    if got > TESTED_TRITON:
        return True, (f"triton {version} is newer than {TESTED_TRITON[0]}.{TESTED_TRITON[1]}, the version evict's kernels "
                      "were tested with; check them with `pytest -m gpu` and report differences")
    return True, None


def available() -> bool:
    """True when the triton package imports and is new enough (tried once; a version message is logged once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import triton
        except ImportError:
            _AVAILABLE = False
        else:
            _AVAILABLE, message = version_check(str(getattr(triton, "__version__", "0")))
            if message:
                log.warning(message)
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
