"""The small boards of the lesson, computed by the memory op at d = 4 (history fold: d = 8), every cell at every step.

    whiteboard(writes, read)  additive writes into a 4×4 S, then one read: the interference law
    delta_stamp(beta)         read → subtract → write: correcting cat → Mochi to Biscuit beside an orthogonal fact
    history_fold(step)        a KV shelf that grows vs the same tokens folded into one 8×8 state; bytes read per step

Row vectors: S += kᵀv, o = qS (scale 1). Writes and reads go through `memory_step`, the op's one-token form.
"""

from __future__ import annotations

import torch

from evict.ops import attention, memory, memory_step
from evict.stories import K_CAT, K_DOG, K_TAX, V_BISCUIT, V_MOCHI, V_REX, V_TAX

# the story's keys, and three more of ours: owl and bee complete an orthogonal basis with cat and tax (four facts fit a
# 4×4 board exactly); fox overlaps all four, as any fifth unit key must
KEYS = {"cat": list(K_CAT), "dog": list(K_DOG), "tax": list(K_TAX), "owl": [0.0, 0.0, 1.0, 0.0], "bee": [0.0, 0.0, 0.0, 1.0],
        "fox": [0.5, 0.5, 0.5, 0.5]}
VALUES = {"Mochi": list(V_MOCHI), "Rex": list(V_REX), "Biscuit": list(V_BISCUIT), "tax form": list(V_TAX),
          "Hoot": [0.0, 2.0, 1.0, 0.0], "Buzz": [1.0, 0.0, 0.0, 2.0], "Rusty": [2.0, 0.0, 1.0, 1.0]}
FACTS = {"cat": "Mochi", "dog": "Rex", "tax": "tax form", "owl": "Hoot", "bee": "Buzz", "fox": "Rusty"}  # the whiteboard's
MAX_WRITES = 8
FOLD_D, FOLD_T = 8, 16


def _vec(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)[None, None, :]  # [B=1, H=1, D]


def _write(S, key, value, *, beta=None, delta=False):
    zero = torch.zeros_like(_vec(key))
    b = None if beta is None else torch.full((1, 1), float(beta), dtype=torch.float64)
    _, S = memory_step(zero, _vec(key), _vec(value), S, beta=b, delta=delta, scale=1.0)
    return S


def _read(S, key) -> list[float]:
    """o = key · S, with nothing written (k = v = 0)."""
    zero = torch.zeros_like(_vec(key))
    o, _ = memory_step(_vec(key), zero, zero, S, scale=1.0)  # k = 0 writes nothing
    return o[0, 0].tolist()


def _cells(S) -> list[list[float]]:
    return S[0, 0].tolist()


def _empty(d: int = 4) -> torch.Tensor:
    return torch.zeros(1, 1, d, d, dtype=torch.float64)


def whiteboard(writes: list[str], read: str) -> dict:
    """Write the facts named in `writes` (from FACTS, in order) into an empty board, then read key `read`."""
    if not isinstance(writes, list) or len(writes) > MAX_WRITES or any(w not in FACTS for w in writes):
        raise ValueError(f"writes: expected up to {MAX_WRITES} of {sorted(FACTS)}, got {writes!r}")
    if read not in FACTS:
        raise ValueError(f"read: expected one of {sorted(FACTS)}, got {read!r}")
    S = _empty()
    steps: list[dict[str, object]] = [{"label": "empty board", "S": _cells(_empty())}]
    for w in writes:
        S = _write(S, KEYS[w], VALUES[FACTS[w]])
        steps.append({"label": f"write {w} → {FACTS[w]}", "key": KEYS[w], "value": VALUES[FACTS[w]], "S": _cells(S)})
    o = _read(S, KEYS[read])
    want = VALUES[FACTS[read]] if read in writes else [0.0] * 4
    k = torch.tensor(KEYS[read], dtype=torch.float64)
    terms = [{"key": w, "overlap": float(k @ torch.tensor(KEYS[w], dtype=torch.float64)), "value": VALUES[FACTS[w]]}
             for w in writes]  # the interference law: o = Σ (k_read · k_w) v_w
    every = {}  # every written key read back: how far each read is from its own value
    for w in dict.fromkeys(writes):
        got = _read(S, KEYS[w])
        every[w] = {"o": got, "error_norm": sum((a - b) ** 2 for a, b in zip(got, VALUES[FACTS[w]])) ** 0.5}
    return {"writes": writes, "read": read, "query": KEYS[read], "steps": steps, "o": o, "wanted": want,
            "error": [a - b for a, b in zip(o, want)], "terms": terms, "reads": every}


def delta_stamp(beta: float = 1.0) -> dict:
    """The board holds cat → Mochi and the (orthogonal) tax-form fact; correct cat to Biscuit with the delta rule at β."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 2:
        raise ValueError(f"beta: expected a number in [0, 2], got {beta!r}")
    S = _write(_write(_empty(), KEYS["cat"], VALUES["Mochi"]), KEYS["tax"], VALUES["tax form"])
    v_old = _read(S, KEYS["cat"])
    u = [beta * (n - o) for n, o in zip(VALUES["Biscuit"], v_old)]
    S_new = _write(S, KEYS["cat"], VALUES["Biscuit"], beta=beta, delta=True)  # the op's own delta write
    return {"beta": beta, "key": KEYS["cat"], "new_value": VALUES["Biscuit"], "other": {"key": KEYS["tax"], "value": VALUES["tax form"]},
            "steps": [{"label": "board: cat → Mochi, tax → form", "S": _cells(S)},
                      {"label": "read: v_old = k_cat S", "S": _cells(S), "v_old": v_old},
                      {"label": "subtract: u = β (v_new − v_old)", "S": _cells(S), "v_old": v_old, "u": u},
                      {"label": "write: S += k_catᵀ u", "S": _cells(S_new), "v_old": v_old, "u": u}],
            "read_after": {"cat": _read(S_new, KEYS["cat"]), "tax": _read(S_new, KEYS["tax"])}}


def _fold_tokens():
    g = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, FOLD_T, 1, FOLD_D, generator=g), dim=-1)
    v = torch.randn(1, FOLD_T, 1, FOLD_D, generator=g)
    q = torch.nn.functional.normalize(torch.randn(1, FOLD_T, 1, FOLD_D, generator=g), dim=-1)
    return q, k, v


def history_fold(step: int) -> dict:
    """After `step` tokens (1 … 16, d = 8): the KV shelf (16-bit keys and values, all read by softmax attention) and
    the state S (float32, 8×8) the memory op folds the same tokens into; bytes each read touches."""
    if type(step) is not int or not 1 <= step <= FOLD_T:
        raise ValueError(f"step: expected an integer from 1 to {FOLD_T}, got {step!r}")
    q, k, v = _fold_tokens()
    shelf_k, shelf_v = k[:, :step].half(), v[:, :step].half()  # the cache as an inference server keeps it
    o_attn = attention(q[:, step - 1:step], shelf_k.float(), shelf_v.float())  # the one new query reads every row
    o_fold, S = memory(q[:, :step], k[:, :step], v[:, :step], scale=1.0, output_final_state=True)
    per_step = [{"step": t, "kv_bytes": 2 * t * FOLD_D * shelf_k.element_size(), "state_bytes": S.numel() * S.element_size()}
                for t in range(1, FOLD_T + 1)]
    return {"step": step, "d": FOLD_D, "max_step": FOLD_T, "keys": shelf_k[0, :, 0].float().tolist(),
            "values": shelf_v[0, :, 0].float().tolist(), "S": S[0, 0].tolist(),
            "o_attention": o_attn[0, 0, 0].tolist(), "o_fold": o_fold[0, -1, 0].tolist(),
            "kv_bytes_read": per_step[step - 1]["kv_bytes"], "state_bytes_read": per_step[step - 1]["state_bytes"],
            "per_step": per_step}
