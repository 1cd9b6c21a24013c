"""The memory layers' per-token input maps, in one place: the decay gate, beta, and q / k / v features.

    log_decay(g, A_log, dt_bias, form)  g [..., H] or [..., H, K] (a projection, pre-activation) -> log alpha <= 0,
                                        float32 (float64 for float64 g): -exp(A_log) softplus(g + dt_bias) ("softplus")
                                        or -5 sigmoid(exp(A_log) (g + dt_bias)) ("bounded")
    beta_of(b, scale)                   b [..., H] (a projection) -> scale sigmoid(b), float32 (float64)
    Preact(...).apply(q, k, v, g, b)    the three above for one decode step, as `memory_step(pre=...)` takes them raw

`memory_step(..., pre=Preact(...))` runs these maps inside the step: on CUDA in the step's one Triton launch when
`evict.ops.memory.step.FUSE_PRE` is on (the default since its GPU tests passed on a card; ~20 fewer small launches a
memory layer in the serving decode step), otherwise through `apply` and then the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FORMS = ("softplus", "bounded")


def gate_dtype(x: torch.Tensor) -> torch.dtype:
    """Gates and beta are float32 (float64 for float64 inputs), whatever the projections' dtype."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def log_decay(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, form: str) -> torch.Tensor:
    """Per-step log decay from the gate projection g [..., H] (scalar) or [..., H, K] (per channel; dt_bias [H K])."""
    ft = gate_dtype(g)
    A = A_log.to(ft).exp()  # [H]
    if dt_bias.numel() != A_log.numel():  # per channel: g [..., H, K], dt_bias [H K]
        g, A = g.to(ft) + dt_bias.to(ft).view(g.shape[-2:]), A[:, None]
    else:
        g = g.to(ft) + dt_bias.to(ft)
    if form == "softplus":
        return -A * F.softplus(g)
    return -5.0 * torch.sigmoid(A * g)


def beta_of(b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """beta = scale sigmoid(b) in the gate dtype (scale 2: negative eigenvalues allowed)."""
    beta = torch.sigmoid(b.to(gate_dtype(b)))
    return beta if scale == 1.0 else beta * scale  # no x1.0 copy: the op keeps sigmoid's own output for its backward


@dataclass(frozen=True)
class Preact:
    """How one decode step's raw inputs become the op's: q, k, v SiLU'd (`silu`, the short conv's activation), then
    q, k L2-normalised (`l2`); log alpha = log_decay(g, A_log, dt_bias, form) when A_log is given (g: the gate
    projection); beta = beta_scale sigmoid(b) (b: the beta projection)."""

    silu: bool = False
    l2: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    form: str = "softplus"
    beta_scale: float = 1.0

    def apply(self, q, k, v, g, b):
        """The torch form: (q, k, v in q's dtype, log alpha or None, beta or None)."""
        dtype = q.dtype
        if self.silu:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        if self.l2:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        la = None
        if g is not None:
            assert self.A_log is not None and self.dt_bias is not None  # check_pre
            la = log_decay(g, self.A_log, self.dt_bias, self.form)
        return q.to(dtype), k.to(dtype), v.to(dtype), la, None if b is None else beta_of(b, self.beta_scale)


def check_pre(pre, q: torch.Tensor, g) -> None:
    """ValueError (one line) unless `pre` is a Preact fitting q [B, H, K] and the raw gate g (or None)."""
    if not isinstance(pre, Preact):
        raise ValueError(f"pre: expected an evict.ops.memory.preact.Preact, got {type(pre).__name__}")
    if pre.form not in FORMS:
        raise ValueError(f"pre: expected form in {FORMS}, got {pre.form!r}")
    if g is None:
        return
    H, K = q.shape[-2], q.shape[-1]
    width = H if g.dim() == q.dim() - 1 else H * K
    for name, t, n in (("A_log", pre.A_log, H), ("dt_bias", pre.dt_bias, width)):
        if not isinstance(t, torch.Tensor) or t.numel() != n or t.device != q.device:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"pre: a raw gate needs {name} of {n} numbers on {q.device}, got {got}")
