"""Gated feed-forward networks: SwiGLU (Llama, DeepSeek, Kimi Linear) and SiTU (Kimi K3).

Both are y = W_2 act(W_1 x, W_3 x) with no biases; W_1 is the gate, W_3 the up projection, W_2 the down one.
Initialisation (`reset_parameters`): every weight ~ N(0, 0.02). The language model rescales the output
projection `w2` to std 0.02 / sqrt(2 n_layers); that depth-dependent factor is not known here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import compute_inputs, linear_of


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SiLU(a) * b: the SwiGLU activation on gate a and up b (any matching shapes)."""
    return F.silu(a) * b


def situ(a: torch.Tensor, b: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """h = [beta1 tanh(a / beta1) sigmoid(a)] * [beta2 tanh(b / beta2)], so |h| <= beta1 * beta2.

    Computed in float32 (float64 stays float64) and cast back to a's dtype: both soft caps saturate, which
    is what keeps a low-precision product bounded.
    """
    cd = torch.float64 if a.dtype == torch.float64 else torch.float32
    af, bf = a.to(cd), b.to(cd)
    gate = beta1 * torch.tanh(af / beta1) * torch.sigmoid(af)
    up = beta2 * torch.tanh(bf / beta2)
    return (gate * up).to(a.dtype)


class _GatedFFN(nn.Module):
    """W_2 act(W_1 x, W_3 x); subclasses define `act(a, b)`."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        _positive("d_model", d_model)
        _positive("d_hidden", d_hidden)
        self.d_model, self.d_hidden = d_model, d_hidden
        self.w1 = nn.Linear(d_model, d_hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, d_hidden, bias=False)  # up
        self.w2 = nn.Linear(d_hidden, d_model, bias=False)  # down (output projection)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """w1, w3, w2 ~ N(0, 0.02)."""
        for lin in (self.w1, self.w3, self.w2):
            nn.init.normal_(lin.weight, std=0.02)

    def act(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (any leading dims) -> [B, T, D]. Under autocast one bf16 copy of x is kept (not one per
        projection); the activation and its product with W_2 keep only W_1 x and W_3 x (the activation recomputed in
        the backward)."""
        x1, x3 = compute_inputs(x, 2)
        return linear_of(self.w2, self.act, self.w1(x1), self.w3(x3))


class SwiGLU(_GatedFFN):
    """y = W_2( SiLU(W_1 x) * W_3 x )."""

    def act(self, a, b):
        return swiglu(a, b)


class SiTU(_GatedFFN):
    """y = W_2 situ(W_1 x, W_3 x) with soft caps beta1 (gate) and beta2 (up); |hidden| <= beta1 * beta2."""

    def __init__(self, d_model: int, d_hidden: int, beta1: float = 4.0, beta2: float = 25.0):
        for name, v in (("beta1", beta1), ("beta2", beta2)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}: expected a positive number, got {v!r}")
        super().__init__(d_model, d_hidden)
        self.beta1, self.beta2 = float(beta1), float(beta2)

    def act(self, a, b):
        return situ(a, b, self.beta1, self.beta2)

    def extra_repr(self) -> str:
        return f"beta1={self.beta1}, beta2={self.beta2}"
