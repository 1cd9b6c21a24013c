"""`evict bench ops`: the memory op's forms timed against each other.

CPU: token-by-token reference vs chunked PyTorch, B=1, H=4, D=64, for the rules of the lesson.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from evict.ops import memory

from .common import card, markdown_table, wall_time, write_json

RULES = {  # name -> (gate kind, delta)
    "linear": (None, False),
    "gated_deltanet": ("scalar", True),
    "kda": ("channel", True),
}


def rule_inputs(rule: str, B: int, T: int, H: int, D: int, *, dtype=torch.float32, device="cpu", seed=0):
    """Inputs as in the anchors file: q, v ~ N(0,1); k L2-normalized; log alpha = logsigmoid(N(0,1)+4); beta = sigmoid(U)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)
    gate, delta = RULES[rule]
    q, k, v = r(B, T, H, D), F.normalize(r(B, T, H, D), dim=-1), r(B, T, H, D)
    la = None
    if gate is not None:
        la = F.logsigmoid(r(*((B, T, H) if gate == "scalar" else (B, T, H, D))) + 4)
    beta = torch.sigmoid(torch.rand(B, T, H, generator=gen, device=device)) if delta else None
    cast = lambda x: None if x is None else x.to(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), log_alpha=cast(la), beta=cast(beta), delta=delta)


def bench_cpu(lengths=(256, 1024, 2048, 4096), rules=tuple(RULES), *, B=1, H=4, D=64, out=None) -> list[dict]:
    rows = []
    for rule in tqdm(rules, desc="rules"):
        for T in lengths:
            x = rule_inputs(rule, B, T, H, D)
            q, k, v = x.pop("q"), x.pop("k"), x.pop("v")
            with torch.no_grad():
                t_ref = wall_time(lambda: memory(q, k, v, impl="reference", **x), repeats=1, warmup=0)
                t_chk = wall_time(lambda: memory(q, k, v, impl="chunked", **x), repeats=3)
            rows.append({"rule": rule, "B": B, "T": T, "H": H, "D": D, "reference_ms": round(t_ref * 1e3, 1),
                         "chunked_ms": round(t_chk * 1e3, 1), "speedup": round(t_ref / t_chk, 1)})
    print(markdown_table(rows, ["rule", "T", "reference_ms", "chunked_ms", "speedup"]))
    info = card()
    print(f"\n{info}")
    if out:
        print(f"wrote {write_json(out, {'card': info, 'rows': rows})}")
    return rows
