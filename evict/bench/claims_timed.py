"""The timed half of `evict bench claims` (the exact half is evict/bench/claims.py). Numbers count on CUDA only; on a
CPU the same code runs at tiny sizes as a smoke test (its rows say device "cpu" and are never quoted).

    time_attn_res(device)   step time of an LM with AttnRes / without, same everything else: the overhead in %
    time_situ(device)       SiTU's activation eager (unfused) and compiled (fused), fwd and fwd+bwd; SwiGLU beside it
    time_dplr(device)       KDA through evict's kernel, fla's chunk_kda, and fla's general DPLR op on the same inputs
    kda_as_dplr(...)        KDA's (q, k, v, log alpha, beta) written as a DPLR transition (a, b, gate, values)
    dplr_reference(...)     the DPLR recurrence, token by token (float64-capable): the check of that mapping
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from evict.cli_args import first_line
from evict.report import median_ms

SIZES: dict[str, dict[str, Any]] = {  # device -> shapes (CUDA: the measured sizes; CPU: a smoke test's)
    "cuda": dict(lm="kkkm_226m", batch=4, seq_len=4096, attn_res_block=3, steps=10, warmup=3,
                 situ_tokens=16384, situ_hidden=2816, dplr=(4, 8192, 16, 128)),
    "cpu": dict(lm="kda", vocab_size=256, n_layers=2, batch=1, seq_len=32, attn_res_block=1, steps=1, warmup=1,
                situ_tokens=256, situ_hidden=64, dplr=(1, 64, 2, 16)),
}


def _timer(device: str):
    return median_ms(device, warmup_ms=25, rep_ms=100, repeats=3)


# -- AttnRes ------------------------------------------------------------------------------------------------------------

def time_attn_res(device: str, modes=("eager",)) -> list[dict]:
    """One training step (bf16 autocast, fused AdamW on CUDA) of the same LM with and without AttnRes; each one's
    peak memory (CUDA) and warm-up seconds (compiled: every block form's compile)."""
    from dataclasses import replace

    from evict.bench.model import _evict, _measure, model_config

    s = SIZES[device]
    base = model_config(s["lm"], "tiny")
    base = replace(base, **{k: s[k] for k in ("vocab_size", "n_layers") if k in s})
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, base.vocab_size, (s["batch"], s["seq_len"] + 1), generator=g).to(dev)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    rows = []
    for mode in modes:
        ms, gib, warm = {}, {}, {}
        for on in (False, True):
            cfg = replace(base, attn_res=on, attn_res_block=s["attn_res_block"])
            torch.manual_seed(0)
            subject = _evict(cfg, s["seq_len"], dev, False)
            r = _measure(subject, x, y, warmup=s["warmup"], steps=s["steps"], compiled=mode == "compiled")
            ms[on], gib[on], warm[on] = r["ms/step"], r["peak GiB"], r["warmup s"]
            print(f"attn_res {mode} {'with' if on else 'without'}: {r['ms/step']} ms/step, {r['peak GiB']} GiB, "
                  f"warm-up {r['warmup s']} s", flush=True)  # a run cut by its timeout still shows what it measured
            del subject
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append({"claim": "attn_res", "device": device, "mode": mode, "model": s["lm"],
                     "shape": f"B{s['batch']} T{s['seq_len']}, {base.n_layers} layers, block {s['attn_res_block']}",
                     "without ms": ms[False], "with ms": ms[True],
                     "overhead %": round(100 * (ms[True] / ms[False] - 1), 2),
                     "without GiB": gib[False], "with GiB": gib[True], "warmup s without / with": f"{warm[False]} / {warm[True]}"})
    return rows


# -- SiTU ---------------------------------------------------------------------------------------------------------------

def time_situ(device: str, compile: bool = True) -> list[dict]:
    """The activation alone on [tokens, hidden] gate and up inputs (bf16 on CUDA, float32 on a CPU), eager (each
    elementwise op its own kernel) against torch.compile (one fused kernel), forward and forward + backward."""
    from evict.layers.ffn import situ, swiglu

    s = SIZES[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(s["situ_tokens"], s["situ_hidden"], device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    dh = torch.randn_like(a)
    timer = _timer(device)
    rows = []
    for name, act in (("situ", situ), ("swiglu", swiglu)):
        forms = {"eager": act}
        if compile:
            forms["compiled"] = torch.compile(act, dynamic=False)
        row: dict[str, Any] = {"claim": "situ", "device": device, "activation": name,
                               "shape": f"{s['situ_tokens']} x {s['situ_hidden']} {str(dtype).split('.')[-1]}"}
        for form, f in forms.items():
            def fwd(f=f):
                with torch.no_grad():
                    return f(a, b)

            def fb(f=f):
                return torch.autograd.grad(f(a, b), (a, b), dh)
            row[f"{form} fwd ms"] = round(timer(fwd), 4)
            row[f"{form} fwd+bwd ms"] = round(timer(fb), 4)
        if compile:
            for p in ("fwd", "fwd+bwd"):
                row[f"eager / compiled {p}"] = round(row[f"eager {p} ms"] / row[f"compiled {p} ms"], 2)
        rows.append(row)
    return rows


# -- KDA against the general DPLR form ------------------------------------------------------------------------------------

def kda_as_dplr(q, k, v, log_alpha, beta):
    """KDA in the DPLR form S_t = (Diag(α_t) + a_t b_tᵀ) S_{t-1} + k_tᵀ w_t (row convention, S [K, V]):
    KDA's S_t = (I − β k kᵀ) Diag(α) S_{t-1} + β kᵀ v gives a = −β k, b = α ⊙ k, w = β v.
    Returns (q, k, w, a, b, log_alpha), shapes as given ([B, T, H, D]; log_alpha per channel)."""
    alpha = log_alpha.exp()
    bk = beta[..., None]
    return q, k, v * bk, -bk * k, alpha * k, log_alpha


def dplr_reference(q, k, w, a, b, log_alpha, *, scale=None):
    """The DPLR recurrence token by token: S_t = Diag(α_t) S_{t-1} + a_t (b_tᵀ S_{t-1}) + k_tᵀ w_t, o_t = scale q_t S_t.
    [B, T, H, D] inputs; o [B, T, H, V]; the state in the inputs' dtype (use float64 for a check)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, w.shape[-1])
    out = []
    for t in range(T):
        S = (log_alpha[:, t].exp()[..., None] * S + a[:, t][..., None] * torch.einsum("bhk,bhkv->bhv", b[:, t], S)[:, :, None]
             + k[:, t][..., None] * w[:, t][:, :, None])
        out.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1)


def _fla_dplr():
    try:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda, chunk_dplr_delta_rule


def time_dplr(device: str) -> list[dict]:
    """KDA's forward and forward + backward: evict's kernel, fla's chunk_kda and fla's chunk_dplr_delta_rule (the general
    form, fed kda_as_dplr's transition: fla's S_t = Diag(exp gk) S_{t-1} + b (aᵀ S_{t-1}) + kᵀ v names the contracted
    vector a and the outer one b, the other way round from ours), all on the same
    inputs; each fla row carries its output's relative error against evict's (a wrong mapping shows there)."""
    from evict.bench.ops import rel_err, rule_inputs
    from evict.ops import memory

    B, T, H, D = SIZES[device]["dplr"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = rule_inputs("kda", B, T, H, D, dtype=dtype, device=device)
    args = [x["q"], x["k"], x["v"], x["log_alpha"], x["beta"]]
    leaves = [t.clone().requires_grad_(True) for t in args]
    do = torch.randn_like(x["v"])
    impl = "triton" if device == "cuda" else "chunked"
    forms = {f"evict kda ({impl})": lambda *t: memory(*t[:3], log_alpha=t[3], beta=t[4], delta=True, check=False, impl=impl)[0]}
    fla = _fla_dplr() if device == "cuda" else None
    if fla is not None:
        chunk_kda, chunk_dplr = fla
        forms["fla chunk_kda"] = lambda *t: chunk_kda(*t)[0]

        def dplr(q, k, v, la, beta):
            q, k, w, a, b, g = kda_as_dplr(q, k, v, la, beta)
            return chunk_dplr(q, k, w, b, a, g)[0]  # fla's (a, b) = our (b, a)
        forms["fla chunk_dplr_delta_rule"] = dplr
    timer = _timer(device)
    ref = forms[f"evict kda ({impl})"]
    with torch.no_grad():
        o_ref = ref(*args)
    rows = []
    for name, f in forms.items():
        row: dict[str, Any] = {"claim": "dplr", "device": device, "form": name, "shape": f"B{B} T{T} H{H} D{D}"}
        try:
            with torch.no_grad():
                row["rel err vs evict"] = f"{rel_err(f(*args), o_ref):.1e}"
                row["fwd ms"] = round(timer(lambda: f(*args)), 4)
            row["fwd+bwd ms"] = round(timer(lambda: torch.autograd.grad(f(*leaves), leaves, do)), 4)
        except Exception as e:  # fla's own guards (e.g. its gated backward on some Triton / card pairs): the row says so
            row["note"] = f"refused: {first_line(e, 100)}"
        rows.append(row)
    if fla is None:
        rows.append({"claim": "dplr", "device": device, "form": "fla chunk_kda / chunk_dplr_delta_rule",
                     "note": "not run: fla is not installed" if device == "cuda" else "not run: fla runs on CUDA only"})
    base = next((r for r in rows if r["form"] == "fla chunk_kda" and "fwd ms" in r), None)
    for r in rows:
        if base is not None and "fwd ms" in r:
            r["fwd / fla chunk_kda"] = round(r["fwd ms"] / base["fwd ms"], 2)
            if "fwd+bwd ms" in r and "fwd+bwd ms" in base:
                r["fwd+bwd / fla chunk_kda"] = round(r["fwd+bwd ms"] / base["fwd+bwd ms"], 2)
    return rows
