"""Mixture-of-experts FFN (DeepSeek-V3 / Kimi Linear) and its latent form (Kimi K3).

    y = shared(x) + sum_topk p_i E_i(x)                          (plain)
    y = shared(x) + W_up RMSNorm( sum_topk p_i E_i(W_down x) )    (latent: experts work in latent_dim)

Routing, load, aux loss and the dispatch are the pure functions of evict.ops.moe. Routed experts are stacked
weight tensors [E, ...]; the shared experts are fused into one FFN of width n_shared * d_expert.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..ops import moe as ops
from .ffn import SiTU, SwiGLU, situ, swiglu
from .norms import RMSNorm

EXPERTS = ("swiglu", "situ")


def _int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")


def _nonneg(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}")


class MoE(nn.Module):
    """n_shared always-on experts plus top_k of n_routed sigmoid-routed experts (each a gated FFN, hidden d_expert).

    State: `select_bias` [E] buffer (selection only; updated by `update_bias`, never by the optimizer).
    After a training-mode forward: `last_load` [E] (detached fraction of assignments per expert) and
    `aux_loss` (aux_loss_coef * E sum f_i P_i with grad, or None when aux_loss_coef == 0).
    `update_bias()` applies b_i += bias_update_rate * sign(mean load - load_i) with the load averaged over
    every training forward since the previous update (so gradient accumulation counts all micro-batches).
    """

    def __init__(self, d_model: int, n_routed: int, top_k: int, d_expert: int, n_shared: int = 1,
                 latent_dim: int | None = None, routed_scaling: float = 1.0, bias_update_rate: float = 1e-3,
                 aux_loss_coef: float = 0.0, expert: str = "swiglu", dispatch: str = "auto"):
        super().__init__()
        _int("d_model", d_model, 1)
        _int("n_routed", n_routed, 1)
        _int("d_expert", d_expert, 1)
        _int("n_shared", n_shared, 0)
        if latent_dim is not None:
            _int("latent_dim", latent_dim, 1)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= n_routed:
            raise ValueError(f"top_k: expected an int in [1, n_routed={n_routed}], got {top_k!r}")
        if not isinstance(routed_scaling, (int, float)) or isinstance(routed_scaling, bool) or not routed_scaling > 0:
            raise ValueError(f"routed_scaling: expected a positive number, got {routed_scaling!r}")
        _nonneg("bias_update_rate", bias_update_rate)
        _nonneg("aux_loss_coef", aux_loss_coef)
        if expert not in EXPERTS:
            raise ValueError(f"expert: expected one of {EXPERTS}, got {expert!r}")
        if dispatch not in ops.DISPATCH:
            raise ValueError(f"dispatch: expected one of {ops.DISPATCH}, got {dispatch!r}")
        self.d_model, self.n_routed, self.top_k, self.d_expert = d_model, n_routed, top_k, d_expert
        self.n_shared, self.latent_dim, self.expert = n_shared, latent_dim, expert
        self.routed_scaling = float(routed_scaling)
        self.bias_update_rate, self.aux_loss_coef = float(bias_update_rate), float(aux_loss_coef)

        ffn = SwiGLU if expert == "swiglu" else SiTU
        self.act = swiglu if expert == "swiglu" else functools.partial(situ, beta1=4.0, beta2=25.0)
        self.shared = ffn(d_model, n_shared * d_expert) if n_shared else None
        self.router = nn.Linear(d_model, n_routed, bias=False)
        D = latent_dim or d_model  # expert input/output width
        self.w1 = nn.Parameter(torch.empty(n_routed, d_expert, D))  # [E, H, D] gate
        self.w3 = nn.Parameter(torch.empty(n_routed, d_expert, D))  # [E, H, D] up
        self.w2 = nn.Parameter(torch.empty(n_routed, D, d_expert))  # [E, D, H] down
        if latent_dim is not None:
            self.w_down = nn.Linear(d_model, latent_dim, bias=False)
            self.latent_norm = RMSNorm(latent_dim)
            self.w_up = nn.Linear(latent_dim, d_model, bias=False)
        self.dispatch = dispatch  # evict.ops.moe.experts' dispatch (sort, padded, grouped, gather, dense); "auto" picks
        self.select_bias: torch.Tensor
        self.register_buffer("select_bias", torch.zeros(n_routed))
        self.last_load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self._load_sum: torch.Tensor | None = None
        self._load_n = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """router, w1, w3, w2, w_down, w_up ~ N(0, 0.02); shared FFN its own (same); latent_norm ones; select_bias 0.

        The output projections for depth scaling are `output_weights()`: shared.w2 and w2 (plain) or
        shared.w2 and w_up (latent; the expert w2 feeds an RMSNorm there, so scaling it would be undone).
        """
        nn.init.normal_(self.router.weight, std=0.02)
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)
        if self.shared is not None:
            self.shared.reset_parameters()
        if self.latent_dim is not None:
            nn.init.normal_(self.w_down.weight, std=0.02)
            nn.init.normal_(self.w_up.weight, std=0.02)
            self.latent_norm.weight.data.fill_(1.0)
        self.select_bias.zero_()

    def output_weights(self) -> list[torch.Tensor]:
        """The weights that write into the residual stream (for the LM's 0.02 / sqrt(2 n_layers) rescale)."""
        out = [] if self.shared is None else [self.shared.w2.weight]
        return out + [self.w2 if self.latent_dim is None else self.w_up.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (any leading dims) -> [B, T, D]."""
        xf = x.reshape(-1, self.d_model)  # [N, D]
        weights, index, scores = ops.route(self.router(xf), self.select_bias, self.top_k, self.routed_scaling)
        xin = xf if self.latent_dim is None else self.w_down(xf)  # [N, D or L]
        u = ops.experts(xin, weights, index, self.w1, self.w3, self.w2, self.act, self.dispatch)  # [N, D or L]
        y = u if self.latent_dim is None else self.w_up(self.latent_norm(u))  # [N, D]
        if self.shared is not None:
            y = y + self.shared(xf)
        if self.training:
            load = ops.expert_load(index, self.n_routed).detach()  # [E]
            self.last_load = load
            self._load_sum = load if self._load_sum is None else self._load_sum + load
            self._load_n += 1
            self.aux_loss = (self.aux_loss_coef * ops.switch_aux_loss(scores, index, self.n_routed, self.top_k)
                             if self.aux_loss_coef > 0 else None)
        else:
            self.aux_loss = None
        return y.reshape(x.shape)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Move the selection bias toward balance using the load since the last update (no-op if none). Under
        torch.distributed the load is averaged over the ranks first, so every rank keeps the same bias."""
        if self._load_n == 0 or self._load_sum is None:
            return
        load = self._load_sum / self._load_n
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(load)
            load = load / dist.get_world_size()
        ops.balance_bias_update(self.select_bias, load, self.bias_update_rate)
        self._load_sum, self._load_n = None, 0

    def param_counts(self) -> dict[str, int]:
        """{"total": every parameter, "active": shared + router + top_k routed experts + latent projections/norm}."""
        total = sum(p.numel() for p in self.parameters())
        per_expert = (self.w1.numel() + self.w3.numel() + self.w2.numel()) // self.n_routed
        return {"total": total, "active": total - (self.n_routed - self.top_k) * per_expert}

    def extra_repr(self) -> str:
        return (f"n_routed={self.n_routed}, top_k={self.top_k}, d_expert={self.d_expert}, n_shared={self.n_shared}, "
                f"latent_dim={self.latent_dim}, expert={self.expert!r}, routed_scaling={self.routed_scaling}")
