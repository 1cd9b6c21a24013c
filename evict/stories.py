"""The lesson's running story at d = 4, computed by the memory op (float64): the vectors, the fade curve (figure 7)
and the twin boards (figure 8), as plain dicts and lists that serialise to JSON as they are.

Row vectors: a write adds kᵀv to the 4×4 board S, a read is o = qS (scale 1), a gate multiplies S's rows
(Diag(α) S; one scalar α scales all four rows). Every write is the delta rule with β = 1; every key below is a unit
vector and the keys of different facts are orthogonal, so a read of a fact's key returns survival × its value.

The timeline (LESSON.md, figure 7), token positions 0 … 24:

    2   write cat -> Mochi        k_cat  = [1, 0, 0, 0]        (channel 0)
    6   write subplot junk        k_junk = [0, 0, 0.6, 0.8]    (channels 2-3)
    12  the context switch: the gate slams
    14  write the tax-form fact   k_tax  = [0, 1, 0, 0]        (channel 1)
    24  the query: read cat

k_junk, v_junk, k_tax and v_tax are ours (the lesson names only the story's cat, dog and their values); k_junk
mirrors k_dog's 0.6 / 0.8 so a reader can still check every cell by hand.

    fade_curve(slam=0.2)  one scalar gate: `baseline` at every token, slam × baseline at the switch
    twin_boards()         the switch with one knob (scalar: `clear`) beside four (per channel: keep, clear × 3)

Both return (see `_tell`): the gates, every board S after every token, every fact's read at every token, each fact's
survival (read · value / |value|², None before its write) and each channel's survival (the product of its gates
so far, read off a board the op decays from the identity with nothing written).
"""

from __future__ import annotations

import math
import numbers

import torch

from evict.ops import memory_step
from evict.ops.memory import LOG_ALPHA_FLOOR

D = 4
K_CAT = (1.0, 0.0, 0.0, 0.0)
V_MOCHI = (2.0, 1.0, 0.0, 1.0)
K_DOG = (0.6, 0.8, 0.0, 0.0)
V_REX = (0.0, 3.0, 1.0, 2.0)
V_BISCUIT = (1.0, 0.0, 2.0, 2.0)
K_JUNK = (0.0, 0.0, 0.6, 0.8)
V_JUNK = (1.0, 2.0, 1.0, 0.0)
K_TAX = (0.0, 1.0, 0.0, 0.0)
V_TAX = (0.0, 1.0, 3.0, 1.0)

TOKENS = 25  # positions 0 … 24
SWITCH = 12
QUERY = 24
FACTS = {  # name -> (token written, key, value)
    "mochi": (2, K_CAT, V_MOCHI),
    "junk": (6, K_JUNK, V_JUNK),
    "tax": (14, K_TAX, V_TAX),
}


def _fraction(name: str, value, *, zero_ok: bool) -> float:
    """A gate value: a real number in [0, 1] ((0, 1] unless zero_ok), else a one-line ValueError naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (0 <= value <= 1) or (value == 0 and not zero_ok):
        raise ValueError(f"{name}: expected a number in {'[0, 1]' if zero_ok else '(0, 1]'}, got {value!r}")
    return float(value)


def _gate_rows(name: str, gates) -> list[list[float]]:
    """`gates`: TOKENS entries, each a number (scalar gate) or D numbers (per channel), all in [0, 1] -> [TOKENS][D]."""
    if isinstance(gates, (str, bytes)) or not hasattr(gates, "__len__") or len(gates) != TOKENS:
        raise ValueError(f"{name}: expected {TOKENS} gates (one per token), got {gates!r}")
    rows = []
    for t, g in enumerate(gates):
        if isinstance(g, numbers.Real):
            rows.append([_fraction(f"{name}[{t}]", g, zero_ok=True)] * D)
        elif hasattr(g, "__len__") and not isinstance(g, (str, bytes)) and len(g) == D:
            rows.append([_fraction(f"{name}[{t}][{c}]", x, zero_ok=True) for c, x in enumerate(g)])
        else:
            raise ValueError(f"{name}[{t}]: expected a number or {D} numbers (one per channel), got {g!r}")
    return rows


def _tell(gates: list[list[float]], *, scalar: bool) -> dict:
    """Run the story through `memory_step` with these per-token gates [TOKENS][D]; one batch row per fact's key as the
    query, so every read comes out of the op. Returns the dict described in the module docstring."""
    f64 = torch.float64
    names = list(FACTS)
    B = len(names)
    log_alpha = torch.tensor(gates, dtype=f64).log().clamp(min=LOG_ALPHA_FLOOR[f64])  # [T, D]
    queries = torch.tensor([FACTS[n][1] for n in names], dtype=f64)[:, None]  # [B, 1, D]
    S = torch.zeros(B, 1, D, D, dtype=f64)
    decay_only = torch.eye(D, dtype=f64).expand(1, 1, D, D)  # the identity, decayed and never written
    zero = torch.zeros(1, 1, D, dtype=f64)
    boards, per_channel = [], []
    reads: dict[str, list[list[float]]] = {n: [] for n in names}
    for t in range(TOKENS):
        written = [n for n in names if FACTS[n][0] == t]
        k = torch.tensor(FACTS[written[0]][1] if written else (0.0,) * D, dtype=f64).expand(B, 1, D)
        v = torch.tensor(FACTS[written[0]][2] if written else (0.0,) * D, dtype=f64).expand(B, 1, D)
        la = log_alpha[t, :1].expand(B, 1) if scalar else log_alpha[t].expand(B, 1, D)
        o, S = memory_step(queries, k, v, S, log_alpha=la, beta=torch.ones(B, 1, dtype=f64), delta=True, scale=1.0)
        _, decay_only = memory_step(zero, zero, zero, decay_only, log_alpha=la[:1], scale=1.0)
        boards.append(S[0, 0].tolist())
        for i, n in enumerate(names):
            reads[n].append(o[i, 0].tolist())
        per_channel.append(torch.diagonal(decay_only[0, 0]).tolist())
    survival = {}
    for n in names:
        at, _, value = FACTS[n]
        norm2 = sum(x * x for x in value)
        survival[n] = [None if t < at else sum(a * b for a, b in zip(reads[n][t], value)) / norm2
                       for t in range(TOKENS)]
    return {
        "d": D, "tokens": TOKENS, "switch": SWITCH, "query": QUERY,
        "facts": {n: {"token": FACTS[n][0], "key": list(FACTS[n][1]), "value": list(FACTS[n][2])} for n in names},
        "gates": [g[0] for g in gates] if scalar else gates,
        "boards": boards, "reads": reads, "survival": survival, "survival_per_channel": per_channel,
        "read_cat": reads["mochi"][QUERY],
    }


def fade_curve(slam: float = 0.2, *, baseline: float = 0.99, gates=None) -> dict:
    """Figure 7: one scalar gate for the whole board. Every token's gate is `baseline`, the switch's is slam × baseline
    (the slam comes on top of the ordinary decay, so a fact's survival with the slam is slam × its survival without).
    `gates` (TOKENS numbers in [0, 1]) replaces both, e.g. 0.9, 0.5, 0.9 right after Mochi: survival 0.405.
    Returns _tell's dict plus "slam" and "baseline" (None when `gates` was given)."""
    if gates is None:
        slam = _fraction("slam", slam, zero_ok=True)
        baseline = _fraction("baseline", baseline, zero_ok=False)
        gates = [baseline] * TOKENS
        gates[SWITCH] = slam * baseline
        given: dict[str, float | None] = {"slam": slam, "baseline": baseline}
    else:
        given = {"slam": None, "baseline": None}
    rows = _gate_rows("gates", gates)
    if any(len(set(r)) > 1 for r in rows):
        raise ValueError("gates: expected one number per token (the fade curve's gate is scalar)")
    return {**given, **_tell(rows, scalar=True)}


def twin_boards(*, keep: float = 0.95, clear: float = 0.1, baseline: float = 1.0) -> dict:
    """Figure 8: the same story on two boards; at the switch the left board has one knob, set to `clear` to wipe the
    junk, and the right board four, (keep, clear, clear, clear): Mochi's channel kept, the rest cleared (channel 1 is
    still empty; the tax fact arrives after the switch). Every other token's gate is `baseline` (1: nothing fades but
    at the switch, so the query reads exactly clear × Mochi on the left and keep × Mochi on the right).
    Returns {"keep", "clear", "baseline", "scalar": _tell(...), "per_channel": _tell(...)}."""
    keep = _fraction("keep", keep, zero_ok=True)
    clear = _fraction("clear", clear, zero_ok=True)
    baseline = _fraction("baseline", baseline, zero_ok=False)
    scalar = [[baseline] * D for _ in range(TOKENS)]
    scalar[SWITCH] = [clear * baseline] * D
    per_channel = [[baseline] * D for _ in range(TOKENS)]
    per_channel[SWITCH] = [keep * baseline] + [clear * baseline] * (D - 1)
    return {"keep": keep, "clear": clear, "baseline": baseline,
            "scalar": _tell(scalar, scalar=True), "per_channel": _tell(per_channel, scalar=False)}
