"""The test-time-training frame: the delta rule is one SGD step on ½‖k S − v‖², and this module adds that step's
natural extensions as settings beside the op (the math, and where a chunked form exists, in README.md beside this file).

Legend: B batch, T time, H heads, K key dim, V value dim. State S [B, H, K, V], read o = q S. Per token:

    S' = Diag(α) S_{t-1}                           decay, as the op
    r  = k S' − v                                  the residual; the loss ½‖k X − v‖² has gradient kᵀ(k X − v)
    n  = ρ n + (k ⊙ k) ‖r‖²                        adaptive: Adagrad's sum of squared gradients, per key row of S
    h  = ρ h + k ⊙ k                               second order: the diagonal of the Hessian Σ_s ρ^{t−s} k_sᵀ k_s
    p  = (1 + a n)^{−1/2} ⊙ (1 + c h)^{−1}         the per-key-row step (1 when a = c = 0)
    X_0 = S',  X_{j+1} = X_j − β Diag(p) kᵀ(k X_j − v),  j < m        m inner steps, p held for the token
    M  = μ M + (X_m − S')                          momentum (heavy ball on the token's displacement)
    S_t = S' + M  (with momentum)  or  X_m  (without)
    o  = scale q S_t

With μ absent (None), m = 1, a = c = 0 this is the op's delta rule, operation for operation. The m inner steps
close to one step: k X_j − v = (1 − βλ)^j r with λ = Σ_i p_i k_i², so X_m = S' + Diag(p) kᵀ β_m (v − k S'),
β_m = β Σ_{j<m} (1 − βλ)^j. The reference form takes the m steps literally; the step form uses β_m (and runs over
a sequence too, impl="step": the same token function in a loop); the chunked form exists for inner steps (β_m into
the op's chunked form) and momentum (the (S, M) chunks of ttt_momentum.py, scalar gates), and is refused, with the
reason, for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._check import LOG_ALPHA_FLOOR, check_inputs, check_scale, state_dtype
from .chunked import DEFAULT_CHUNK, memory_chunked
from .ttt_momentum import momentum_chunked

MAX_INNER_STEPS = 64
IMPLS = ("reference", "step", "chunked")


@dataclass(frozen=True)
class TTT:
    """The extensions' constants (the per-token momentum μ is a tensor beside β). Neutral: TTT() = the delta rule.

    inner_steps m: SGD steps per token on the same (k, v), an int in 1 … MAX_INNER_STEPS.
    adaptive a >= 0: the Adagrad-style per-key-row step (1 + a n)^{-1/2}.
    second_order c >= 0: the damped diagonal Newton step (1 + c h)^{-1} (damping 1/c, step β/c as c grows).
    stat_decay ρ in [0, 1]: how n and h fade per token (1: they accumulate, as Adagrad's sum).
    """

    inner_steps: int = 1
    adaptive: float = 0.0
    second_order: float = 0.0
    stat_decay: float = 1.0

    def __post_init__(self) -> None:
        m = self.inner_steps
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_INNER_STEPS:
            raise ValueError(f"inner_steps: expected an int in 1 … {MAX_INNER_STEPS}, got {m!r}")
        for name in ("adaptive", "second_order"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"{name}: expected a finite number >= 0 (0 = off), got {x!r}")
        rho = self.stat_decay
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 <= rho <= 1:
            raise ValueError(f"stat_decay: expected a number in [0, 1], got {rho!r}")


class TTTState(NamedTuple):
    """S [B, H, K, V]; M [B, H, K, V] (momentum) and n, h [B, H, K] (adaptive, second order), None where unused."""

    S: torch.Tensor
    M: torch.Tensor | None = None
    n: torch.Tensor | None = None
    h: torch.Tensor | None = None


def _start(S0, B, H, K, V, ref, sd, ttt: TTT, momentum) -> TTTState:
    """The initial TTTState in the state dtype: a given one, a given S (the rest zero), or zeros."""
    given = S0 if isinstance(S0, TTTState) else TTTState(S0)
    S = ref.new_zeros(B, H, K, V, dtype=sd) if given.S is None else given.S.to(sd)
    pick = lambda x, want, shape: (None if not want else  # noqa: E731
                                   (ref.new_zeros(*shape, dtype=sd) if x is None else x.to(sd)))
    return TTTState(S, pick(given.M, momentum is not None, (B, H, K, V)), pick(given.n, ttt.adaptive > 0, (B, H, K)),
                    pick(given.h, ttt.second_order > 0, (B, H, K)))


def _kept(x: torch.Tensor | None) -> torch.Tensor:
    """A statistic the settings use (_start made it): never None here."""
    assert x is not None
    return x


def _decay(S, log_alpha):
    if log_alpha is None:
        return S
    alpha = log_alpha.exp()  # [B, H] or [B, H, K]
    return S * (alpha[..., None, None] if alpha.dim() == 2 else alpha[..., :, None])


def _step_size(p_n, p_h):
    """The per-key-row step p from its two factors (either may be None; None = 1)."""
    if p_n is None:
        return p_h
    return p_n if p_h is None else p_n * p_h


def reference_token(q, k, v, st: TTTState, log_alpha, beta, mu, scale: float, ttt: TTT):
    """One token, literally: the gradient as a matrix, m SGD steps on ½‖k X − v‖². [B, H, D] tensors, state dtype."""
    S = _decay(st.S, log_alpha)
    grad = lambda X: k[..., :, None] * (torch.einsum("bhk,bhkv->bhv", k, X) - v)[..., None, :]  # noqa: E731
    n = h = p_n = p_h = None
    if ttt.adaptive > 0:
        n = ttt.stat_decay * _kept(st.n) + grad(S).pow(2).sum(-1)  # [B, H, K] squared gradient of each row of S
        p_n = (1 + ttt.adaptive * n).rsqrt()
    if ttt.second_order > 0:
        h = ttt.stat_decay * _kept(st.h) + torch.diagonal(k[..., :, None] * k[..., None, :], dim1=-2, dim2=-1)  # diag kᵀk
        p_h = 1 / (1 + ttt.second_order * h)
    p = _step_size(p_n, p_h)
    wk = k if p is None else p * k
    X = S
    for _ in range(ttt.inner_steps):  # X <- X − β Diag(p) kᵀ(k X − v), written as the op writes its erase
        u = v - torch.einsum("bhk,bhkv->bhv", k, X)
        if beta is not None:
            u = beta[..., None] * u
        X = X + wk[..., :, None] * u[..., None, :]
    M = None
    if mu is not None:
        M = mu[..., None, None] * st.M + (X - S)
        X = S + M
    o = scale * torch.einsum("bhk,bhkv->bhv", q, X)
    return o, TTTState(X, M, n, h)


def step_token(q, k, v, st: TTTState, log_alpha, beta, mu, scale: float, ttt: TTT):
    """One token in closed form: the m inner steps as one step of β_m = β Σ_{j<m} (1 − βλ)^j (module docstring)."""
    S = _decay(st.S, log_alpha)
    u = v - torch.einsum("bhk,bhkv->bhv", k, S)  # −r [B, H, V]
    kk = k * k
    n = h = p_n = p_h = None
    if ttt.adaptive > 0:
        n = ttt.stat_decay * _kept(st.n) + kk * u.pow(2).sum(-1, keepdim=True)  # (k ⊙ k) ‖r‖²
        p_n = (1 + ttt.adaptive * n).rsqrt()
    if ttt.second_order > 0:
        h = ttt.stat_decay * _kept(st.h) + kk
        p_h = 1 / (1 + ttt.second_order * h)
    p = _step_size(p_n, p_h)
    b = beta
    if ttt.inner_steps > 1:
        b1 = torch.ones_like(u[..., 0]) if beta is None else beta  # [B, H]
        y = 1 - b1 * (kk if p is None else p * kk).sum(-1)  # 1 − βλ
        s = torch.ones_like(y)
        for _ in range(ttt.inner_steps - 1):  # Horner: Σ_{j<m} y^j
            s = 1 + y * s
        b = b1 * s
    if b is not None:
        u = b[..., None] * u
    wk = k if p is None else p * k
    write = wk[..., :, None] * u[..., None, :]  # [B, H, K, V]
    M = None
    if mu is None:
        S = S + write
    else:
        M = mu[..., None, None] * st.M + write
        S = S + M
    o = scale * torch.einsum("bhk,bhkv->bhv", q, S)
    return o, TTTState(S, M, n, h)


def _check_momentum(momentum, lead: list[int], device, check_values: bool) -> None:
    if momentum is None:
        return
    if not isinstance(momentum, torch.Tensor) or list(momentum.shape) != lead or not momentum.is_floating_point():
        got = list(momentum.shape) if isinstance(momentum, torch.Tensor) else type(momentum).__name__
        raise ValueError(f"momentum: expected a floating tensor of shape {lead} (μ per token and head) or None, got {got}")
    if momentum.device != device:
        raise ValueError(f"momentum: expected device {device} (as q), got {momentum.device}")
    if check_values and not bool(((momentum >= 0) & (momentum <= 1)).all()):
        raise ValueError(f"momentum: expected values in [0, 1], got range [{momentum.min().item():.4g}, "
                         f"{momentum.max().item():.4g}]")


def _check_state(st, ttt: TTT, momentum, B: int, H: int, K: int, name: str) -> None:
    """A TTTState must carry what its settings use (M with momentum, n with adaptive, h with second order)."""
    if not isinstance(st, TTTState):
        return
    for field, want, shape in (("M", momentum is not None, None), ("n", ttt.adaptive > 0, [B, H, K]),
                               ("h", ttt.second_order > 0, [B, H, K])):
        x = getattr(st, field)
        if x is None:
            continue
        if not want:
            raise ValueError(f"{name}.{field}: given, but the settings do not use it (M: momentum, n: adaptive, "
                             f"h: second_order)")
        expect = list(st.S.shape) if shape is None else shape
        if not isinstance(x, torch.Tensor) or list(x.shape) != expect or x.dtype != st.S.dtype:
            raise ValueError(f"{name}.{field}: expected a {st.S.dtype} tensor of shape {expect}")


def _door(q, k, v, log_alpha, beta, momentum, initial_state, ttt, *, step: bool, check: bool):
    if not isinstance(ttt, TTT):
        raise ValueError(f"ttt: expected a TTT(...) of settings, got {type(ttt).__name__}")
    S0 = initial_state.S if isinstance(initial_state, TTTState) else initial_state
    check_inputs(q, k, v, log_alpha, beta, S0, step=step, check_values=check)
    _check_momentum(momentum, list(q.shape[:-1]), q.device, check)
    _check_state(initial_state, ttt, momentum, q.shape[0], q.shape[-2], q.shape[-1], "state" if step else "initial_state")


def ttt_memory(q, k, v, *, log_alpha=None, beta=None, momentum=None, scale=None, initial_state=None,
               ttt: TTT = TTT(), impl: str = "reference", chunk_size=None, check: bool = True):
    """The TTT update over a sequence: q, k [B, T, H, K]; v [B, T, H, V]; log_alpha [B, T, H] or [B, T, H, K];
    beta, momentum (μ, None = no momentum state) [B, T, H]; initial_state a TTTState or S [B, H, K, V].
    impl "reference" (the token loop, literal inner steps; float64-capable), "step" (the step form token by token:
    the inner steps in closed form, fewer operations for the autograd tape) or "chunked" (inner steps and momentum
    with scalar or no gates; refused with the reason otherwise).
    Returns (o [B, T, H, V] in q's dtype, final TTTState)."""
    _door(q, k, v, log_alpha, beta, momentum, initial_state, ttt, step=False, check=check)
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if chunk_size is not None and (type(chunk_size) is not int or chunk_size < 1 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size: expected None or a power of two (the chunked form's), got {chunk_size!r}")
    scale = check_scale(scale, q.shape[-1])
    sd = state_dtype(q.dtype)
    if log_alpha is not None:
        log_alpha = log_alpha.clamp(min=LOG_ALPHA_FLOOR[sd])
    with torch.autocast(q.device.type, enabled=False):
        if impl == "chunked":
            o, st = _chunked(q, k, v, log_alpha, beta, momentum, scale, initial_state, ttt, chunk_size, sd)
        else:
            token = reference_token if impl == "reference" else step_token
            o, st = _loop(token, q, k, v, log_alpha, beta, momentum, scale, initial_state, ttt, sd)
    return o.to(q.dtype), st


def _loop(token, q, k, v, log_alpha, beta, momentum, scale, initial_state, ttt, sd):
    """`token` (reference_token or step_token) over time."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    st = _start(initial_state, B, H, K, V, q, sd, ttt, momentum)
    at = lambda x, t: None if x is None else x[:, t].to(sd)  # noqa: E731
    outs = []
    for t in range(T):
        o, st = token(at(q, t), at(k, t), at(v, t), st, at(log_alpha, t), at(beta, t), at(momentum, t), scale, ttt)
        outs.append(o)
    return (torch.stack(outs, dim=1) if outs else q.new_zeros(B, 0, H, V, dtype=sd)), st


def inner_steps_beta(k, beta, m: int):
    """β_m = β Σ_{j<m} (1 − β‖k‖²)^j [B, T, H]: m SGD steps on one (k, v) as one delta step (p = 1)."""
    b1 = torch.ones_like(k[..., 0]) if beta is None else beta
    y = 1 - b1 * (k * k).sum(-1)
    s = torch.ones_like(y)
    for _ in range(m - 1):
        s = 1 + y * s
    return b1 * s


NO_CHUNKED = {  # setting -> why it has no chunked form here
    "channel": "momentum with a per-channel gate: its token-pair coefficients are a C × C × K tensor, not implemented",
    "adaptive": "Adagrad's statistic reads the residual ‖k S − v‖², so the update is nonlinear in S: no chunk algebra",
    "second_order": "linear in S, but the write key p ⊙ k differs from the erase key k: it needs a DPLR op with "
                    "separate erase and write keys, which evict's op is not",
}


def _chunked(q, k, v, log_alpha, beta, momentum, scale, initial_state, ttt, chunk_size, sd):
    """Inner steps: the op's chunked form with β_m; with momentum (scalar gates): the (S, M) chunks of ttt_momentum."""
    used = [name for name, on in (("channel", momentum is not None and log_alpha is not None and log_alpha.dim() == 4),
                                  ("adaptive", ttt.adaptive > 0), ("second_order", ttt.second_order > 0)) if on]
    if used:
        raise ValueError(f"impl: 'chunked' exists for inner_steps and momentum (scalar gates); {used[0]} has none "
                         f"here ({NO_CHUNKED[used[0]]})")
    kd = k.to(sd)
    b = beta if ttt.inner_steps == 1 else inner_steps_beta(kd, None if beta is None else beta.to(sd), ttt.inner_steps)
    if momentum is not None:
        B, _, H, K = q.shape
        st = _start(initial_state, B, H, K, v.shape[-1], q, sd, ttt, momentum)
        c = lambda x: None if x is None else x.to(sd)  # noqa: E731
        o, S, M = momentum_chunked(c(q), kd, c(v), log_alpha=c(log_alpha), beta=c(b), momentum=c(momentum),
                                   scale=scale, S=st.S, M=st.M, chunk_size=chunk_size or DEFAULT_CHUNK)
        return o, TTTState(S, M)
    S0 = initial_state.S if isinstance(initial_state, TTTState) else initial_state
    o, S = memory_chunked(q, k, v, log_alpha=log_alpha, beta=b, delta=True, scale=scale, initial_state=S0,
                          chunk_size=chunk_size)
    return o, TTTState(S)


def ttt_step(q, k, v, state, *, log_alpha=None, beta=None, momentum=None, scale=None, ttt: TTT = TTT(),
             check: bool = False):
    """One decode step: q, k [B, H, K]; v [B, H, V]; state a TTTState (or S [B, H, K, V]); log_alpha [B, H] or
    [B, H, K]; beta, momentum [B, H]. Returns (o [B, H, V] in q's dtype, the new TTTState)."""
    if state is None:
        raise ValueError("state: expected a TTTState or a tensor of shape [B, H, Dk, Dv], got None")
    _door(q, k, v, log_alpha, beta, momentum, state, ttt, step=True, check=check)
    scale = check_scale(scale, q.shape[-1])
    sd = state_dtype(q.dtype)
    B, H, K = q.shape
    st = _start(state, B, H, K, v.shape[-1], q, sd, ttt, momentum)
    c = lambda x: None if x is None else x.to(sd)  # noqa: E731
    with torch.autocast(q.device.type, enabled=False):
        o, st = step_token(c(q), c(k), c(v), st, c(log_alpha), c(beta), c(momentum), scale, ttt)
    return o.to(q.dtype), st
