"""Why one delta-rule layer cannot count mod 3 through a run of one token, and what can (docs/labs/state.md, Counters).

Inside a run of one token longer than the short conv's window (4 tokens) a layer's key k, value v and β are the same
at every step, so its state follows one fixed affine map S -> (I - β k kᵀ) S + β k vᵀ (k a unit vector): only the
component along k moves, multiplied by 1 - β each step, so after n tokens S_n = S_0 + k ((1 - β)^n - 1)(kᵀS_0 - v).
At β = 2 that is exactly two states (period 2, a reflection); for 0 < β < 2 a sequence that converges; never period 3.
Two keys at an angle θ, alternating, compose to a rotation by 2θ (a product of two reflections): keys at 60° give a
rotation by 120°, period 3 in pairs of tokens. Float64, on the op itself (step form, checked against the reference form).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evict.ops import memory, memory_step
from evict.tasks.state import StateConfig, make_state

K = 4
F64 = dict(dtype=torch.float64)


def _states(keys: torch.Tensor, values: torch.Tensor, beta: float, S0: torch.Tensor) -> torch.Tensor:
    """The op's state before and after each token of keys [n, K] and values [n, V] (one sequence, one head; the same
    β at every token, delta rule, no gate), from S0 [K, V]: [n + 1, K, V]. The reference form's final state must agree."""
    n = keys.shape[0]
    b = torch.full((1, 1), beta, **F64)  # [B, H]
    S, out = S0[None, None], [S0]  # [1, 1, K, V]
    for k, v in zip(keys, values):
        _, S = memory_step(k[None, None], k[None, None], v[None, None], S, beta=b, delta=True)
        out.append(S[0, 0])
    seq = keys[None, :, None]  # [1, n, 1, K]
    _, S_ref = memory(seq, seq, values[None, :, None], beta=b.expand(1, n)[..., None], delta=True,
                      initial_state=S0[None, None], output_final_state=True, impl="reference")
    assert torch.allclose(S_ref[0, 0], out[-1], rtol=0, atol=1e-12)
    return torch.stack(out)


def _distinct(states: torch.Tensor, tol: float = 1e-6) -> int:
    """How many different states [n, K, V] there are (states closer than tol count as one)."""
    flat = states.flatten(1)
    close = torch.cdist(flat, flat) < tol  # [n, n]
    return sum(1 for i in range(len(flat)) if not close[i, :i].any())


def _unit(g: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(K, generator=g, **F64), dim=0)


@settings(max_examples=25, deadline=None)
@given(beta=st.floats(0.0, 2.0), seed=st.integers(0, 2**16))
def test_one_repeated_key_moves_only_along_it(beta, seed):
    """Every β in [0, 2]: S_n = S_0 + k ((1 - β)^n - 1)(kᵀS_0 - v), so the run's states are set by the real number
    (1 - β)^n alone — two values at β = 2, a converging sequence below it, period 3 only at β = 0 (nothing moves)."""
    g = torch.Generator().manual_seed(seed)
    k, v, S0 = _unit(g), torch.randn(3, generator=g, **F64), torch.randn(K, 3, generator=g, **F64)
    n = 12
    S = _states(k.expand(n, K), v.expand(n, 3), beta, S0)
    miss = k @ S0 - v  # [V]: how far S0 is from remembering v at k
    for i in range(n + 1):
        assert torch.allclose(S[i], S0 + torch.outer(k, ((1 - beta) ** i - 1) * miss), rtol=0, atol=1e-12)


def test_one_repeated_key_at_beta_two_has_period_two():
    """β = 2 (a reflection): exactly two states along the run, so 1 token and 3 tokens (counts 1 and 0 mod 3) leave
    the same state and no readout of it can count mod 3; the same run counts mod 2 (parity)."""
    g = torch.Generator().manual_seed(3)
    k, v, S0 = _unit(g), torch.randn(3, generator=g, **F64), torch.zeros(K, 3, **F64)  # a layer starts from 0
    S = _states(k.expand(12, K), v.expand(12, 3), 2.0, S0)
    assert _distinct(S) == 2
    assert torch.allclose(S[2:], S[:-2], rtol=0, atol=1e-12)  # period 2
    assert not torch.allclose(S[1], S[0], rtol=0, atol=1e-6)  # and not 1: the parity is there
    assert torch.allclose(S[1], S[3], rtol=0, atol=1e-12)  # counts 1 and 0 mod 3, one state


@pytest.mark.parametrize("m", [3, 4, 5])
def test_two_alternating_keys_rotate(m):
    """Keys at 180°/m apart, alternating, β = 2: each pair of tokens is a rotation by 360°/m (m = 3: 120°, the step
    of a counter mod 3). From S0 = I with v = 0 the state is the product of the transitions itself: after a pair its
    eigenvalues are e^{±2πi/m} and 1, and the pair has order m exactly."""
    theta = math.pi / m
    ka = torch.tensor([1.0, 0.0, 0.0, 0.0], **F64)
    kb = torch.tensor([math.cos(theta), math.sin(theta), 0.0, 0.0], **F64)
    keys = torch.stack([ka, kb] * (2 * m))  # [4m, K]
    S = _states(keys, torch.zeros(4 * m, K, **F64), 2.0, torch.eye(K, **F64))
    pair = S[2]  # the transition of one pair: H_b H_a
    angles = sorted(torch.linalg.eigvals(pair).angle().tolist())
    assert angles == pytest.approx([-2 * math.pi / m, 0.0, 0.0, 2 * math.pi / m], abs=1e-9)
    assert torch.allclose(S[2 * m], torch.eye(K, **F64), rtol=0, atol=1e-12)  # m pairs: back where it started
    assert _distinct(S[: 2 * m]) == 2 * m  # and nowhere twice before: 2m states, so the run's length mod m is in them


@pytest.mark.parametrize("m", [3, 5])
def test_two_alternating_keys_count_from_zero(m):
    """The same from a layer's real start, S0 = 0, with values va at ka and vb at kb (the maps are affine): the run's
    states have period 2m exactly — 2m different states, then the first again — so a readout of the state can count
    the run mod m, which one repeated key (two states) cannot. (With va = vb, 0 lies on a mirror of the pair's dihedral
    group and odd m gives m states, each at two counts that the parity of the position tells apart.)"""
    g = torch.Generator().manual_seed(m)
    theta = math.pi / m
    ka = torch.tensor([1.0, 0.0, 0.0, 0.0], **F64)
    kb = torch.tensor([math.cos(theta), math.sin(theta), 0.0, 0.0], **F64)
    va, vb = torch.randn(2, 3, generator=g, **F64)
    S = _states(torch.stack([ka, kb] * (3 * m)), torch.stack([va, vb] * (3 * m)), 2.0, torch.zeros(K, 3, **F64))
    assert _distinct(S[: 2 * m]) == 2 * m
    assert torch.allclose(S[2 * m:], S[: -2 * m], rtol=0, atol=1e-12)


def test_two_layers_count_mod3_on_the_lab_rows():
    """Two delta-rule layers (β in {0, 2}) count mod 3 exactly on the lab's own count_mod3 rows (stay / up / down, 256
    tokens), built by hand on the op. Layer 1: every move (up or down) the same key, β = 2: a reflection, so its read
    is the parity p of the moves so far. Layer 2: keys at ±60° (two mirror lines through one point), picked by the
    move's direction and layer 1's p; a stay is β = 0 in both. The layer-2 state is then a function of (p, count mod 3)
    alone, with six different values: a readout recovers the count. (A key's sign is the same reflection, so layer 2's
    key and value are linear in the token and layer 1's read, up to the key's norm.)"""
    x, y = make_state(StateConfig(task="count_mod3"), 16, 7, (256, 256))  # [B, T]: 0 stay, 1 up, 2 down; the count
    B, T = x.shape
    move = (x != 0).double()  # [B, T]
    ones = torch.ones(B, T, 1, 1, **F64)  # [B, T, H=1, 1]: layer 1's key, query and value are all 1
    o1, _ = memory(ones, ones, ones, beta=2 * move[..., None], delta=True, scale=1.0, impl="reference")
    p = (o1[..., 0, 0] / 2).round()  # [B, T]: layer 1's read after each token, 0 or 1
    assert torch.allclose(o1[..., 0, 0], 2 * (move.cumsum(1) % 2), rtol=0, atol=1e-12)  # it is the moves' parity
    up = (x == 1).double()
    flip = (up + p) % 2  # up with an even count of moves after it, or down with an odd one: the +60° line, else -60°
    angle = torch.deg2rad(90 + 60 * (2 * flip - 1))  # [B, T]: the mirror line's normal
    k2 = torch.stack([angle.cos(), angle.sin()], -1)[:, :, None]  # [B, T, 1, 2]
    P = torch.tensor([0.3, -1.1], **F64)  # the point both mirror lines pass through (any point but the start, 0)
    v2 = (k2 @ P)[..., None]  # [B, T, 1, 1]: the mirror line {s : k2 s = k2 P}
    _, S = memory(k2[:, :1], k2[:, :1], v2[:, :1], beta=2 * move[:, :1, None], delta=True, impl="reference",
                  output_final_state=True)
    states = [S[:, 0, :, 0]]  # [B, 2] after each token
    for t in range(1, T):
        _, S = memory_step(k2[:, t], k2[:, t], v2[:, t], S, beta=2 * move[:, t, None], delta=True)
        states.append(S[:, 0, :, 0])
    S2 = torch.stack(states, 1)  # [B, T, 2]
    cls = (p * 3 + y).long()  # [B, T]: (parity, count mod 3), six classes
    points = torch.stack([S2[cls == c][0] for c in range(6)])  # [6, 2]: each class's first state
    assert torch.allclose(S2, points[cls], rtol=0, atol=1e-9)  # every state is its class's point
    gaps = torch.cdist(points, points) + torch.eye(6, **F64)
    assert gaps.min() > 0.25 * P.norm()  # and apart (the orbit's radius is |P|): the count is readable at every token
