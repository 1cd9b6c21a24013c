"""The fast-weight view (issue 15 part 5): the delta update is one SGD step on ½‖kS − v‖² with step size β."""

import pytest
import torch

from evict.ops import memory, memory_step


def _sgd_step(S, k, v, beta):
    """S − β ∇_S ½‖kS − v‖², the gradient taken by autograd: S [B, H, K, V], k [B, H, K], v [B, H, V], beta [B, H]."""
    S = S.clone().requires_grad_(True)
    loss = 0.5 * ((torch.einsum("bhk,bhkv->bhv", k, S) - v) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, S)
    return (S - beta[..., None, None] * grad).detach()


@pytest.mark.parametrize("beta_max", [1.0, 2.0])
@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_delta_step_is_one_sgd_step(gate, beta_max):
    g = torch.Generator().manual_seed(15)
    B, H, K, V = 2, 3, 7, 5
    q, k = torch.randn(B, H, K, generator=g, dtype=torch.float64), torch.randn(B, H, K, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, H, V, generator=g, dtype=torch.float64)
    S = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    beta = beta_max * torch.rand(B, H, generator=g, dtype=torch.float64)
    la = None
    if gate is not None:
        la = -torch.rand((B, H) if gate == "scalar" else (B, H, K), generator=g, dtype=torch.float64)
    _, S_new = memory_step(q, k, v, S, log_alpha=la, beta=beta, delta=True)
    decayed = S if la is None else S * (la.exp()[..., None, None] if gate == "scalar" else la.exp()[..., None])
    assert torch.allclose(S_new, _sgd_step(decayed, k, v, beta), rtol=0, atol=1e-12)


def test_sequence_is_sgd_iterates():
    """Over a sequence, the final state is T successive SGD steps, one per token, from S0 (chunked form too)."""
    g = torch.Generator().manual_seed(5)
    B, T, H, D = 1, 37, 2, 6
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = 2 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    S = S0
    for t in range(T):
        S = _sgd_step(S, k[:, t], v[:, t], beta[:, t])
    for impl in ("reference", "chunked"):
        _, S_T = memory(q, k, v, beta=beta, delta=True, initial_state=S0, output_final_state=True, impl=impl, chunk_size=16)
        assert torch.allclose(S_T, S, rtol=0, atol=1e-10), impl
