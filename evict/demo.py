"""The worked examples of the lesson, computed by the op: interference, overwrite, survival."""

from __future__ import annotations

import torch

from evict.ops import memory, memory_step
from evict.stories import K_CAT, K_DOG, V_BISCUIT, V_MOCHI, V_REX


def _seq(*rows):
    return torch.tensor(rows, dtype=torch.float64)[None, :, None, :]


def run_demo() -> None:
    z = [0.0] * 4
    k_cat, k_dog, mochi, rex, biscuit = K_CAT, K_DOG, V_MOCHI, V_REX, V_BISCUIT
    o, _ = memory(_seq(z, z, k_cat), _seq(k_cat, k_dog, z), _seq(mochi, rex, z), scale=1.0)
    print(f"additive: write cat->Mochi, dog->Rex; read cat = {o[0, 2, 0].tolist()}  (Mochi + 0.6 * Rex: interference)")
    beta = torch.ones(1, 3, 1, dtype=torch.float64)
    o, _ = memory(_seq(z, z, k_cat), _seq(k_cat, k_cat, z), _seq(mochi, biscuit, z), beta=beta, delta=True, scale=1.0)
    print(f"delta:    write cat->Mochi, cat->Biscuit; read cat = {o[0, 2, 0].tolist()}  (Biscuit exactly: targeted replace)")
    la = torch.log(torch.tensor([1.0, 0.9, 0.5, 0.9], dtype=torch.float64))[None, :, None]
    o, _ = memory(_seq(z, z, z, k_cat), _seq(k_cat, z, z, z), _seq(mochi, z, z, z), log_alpha=la, scale=1.0)
    print(f"gated:    Mochi, then decay 0.9, 0.5, 0.9; read cat = {o[0, 3, 0].tolist()}  (0.405 * Mochi survives)")
    g = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, 1, 4, generator=g, dtype=torch.float64), dim=-1)
    v, S = torch.randn(1, 1, 4, generator=g, dtype=torch.float64), torch.randn(1, 1, 4, 4, generator=g, dtype=torch.float64)
    b = torch.full((1, 1), 1.5, dtype=torch.float64)
    W = S.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(0.5 * ((k[..., None, :] @ W - v[..., None, :]) ** 2).sum(), W)
    _, S_delta = memory_step(k, k, v, S, beta=b, delta=True)
    err = (S_delta - (S - b[..., None, None] * grad)).abs().max().item()
    print(f"sgd:      delta update vs one SGD step on ½‖kS − v‖² with step size β = 1.5: max |difference| = {err:.1e}"
          "  (the same update)")
