"""`evict bench ops`: the memory op's forms timed against each other.

CPU: token-by-token reference vs chunked PyTorch, B=1, H=4, D=64, for the rules of the lesson.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from evict.ops import memory

from evict.report import card, markdown_table, wall_time, write_json

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


# -- CUDA: evict's Triton kernels vs fla vs SDPA flash attention, with roofline fractions ----------------------

CUDA_SHAPES = ((4, 8192), (1, 32768))  # (B, T) at H16 D128, as in shared/anchors


def _ceilings(dev) -> dict:
    """Measured bf16 matmul TFLOP/s (8192^3, random data) and device copy bandwidth (bytes read + written)."""
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, return_mode="median")
    x = torch.randn(2**28, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    ms_copy = do_bench(lambda: y.copy_(x), return_mode="median")
    return {"tflops": 2 * 8192**3 / ms / 1e9, "tbps": 2 * x.numel() * 4 / ms_copy / 1e9}


def _row(name, shape, ms, flops, nbytes, ceil, note=""):
    roof_ms = max(flops / (ceil["tflops"] * 1e9), nbytes / (ceil["tbps"] * 1e9))
    row = {"op": name, "shape": shape, "ms": round(ms, 4), "roofline_ms": round(roof_ms, 4),
           "of_roofline": round(roof_ms / ms, 3), "note": note}
    print(row, flush=True)
    return row


def _memory_cost(B, T, H, D, C=64, train=False):
    """FLOPs of the chunked algorithm (state matmuls 3 K V, Gram blocks ~C (K + V) per token) and minimal bytes."""
    flops = 2 * B * H * T * (3 * D * D + C * 2 * D) * (3 if train else 1)
    nbytes = B * T * H * D * 2 * 5 * (3 if train else 1)  # q, k, v, gate, o in bf16 (backward: ~twice more)
    return flops, nbytes


def _fla():
    """fla's chunked and fused-recurrent entry points, when fla is installed (optional comparison oracle)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return {}, {}
    return ({"kda": chunk_kda, "gated_deltanet": chunk_gated_delta_rule},
            {"kda": fused_recurrent_kda, "gated_deltanet": fused_recurrent_gated_delta_rule})


def kernel_profile(fn, steps: int = 5) -> list[tuple[str, float]]:
    """CUDA kernel time per kernel name (ms per call of fn), largest first, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.key_averages():  # kernels carry self device time; the ops around them carry none
        t = getattr(e, "self_device_time_total", None)
        t = e.self_cuda_time_total if t is None else t
        if t > 0:
            per[e.key] = per.get(e.key, 0.0) + t / 1e3 / steps
    return sorted(per.items(), key=lambda kv: -kv[1])


def bench_cuda(shapes=CUDA_SHAPES, *, H=16, D=128, out=None, fla_backward=True, profile=True) -> list[dict]:
    """Decode step at B8 H16 D128, then forward and forward+backward of KDA and Gated DeltaNet at bf16 against fla
    (when installed) and SDPA flash attention; each row also as a fraction of the measured roofline.

    Rows print as they are measured. fla's outputs and gradients are compared with evict's on the same inputs
    (relative error in the note). `profile`: CUDA time per kernel of evict's fwd+bwd at the first shape.
    """
    from triton.testing import do_bench

    dev = "cuda"
    bench = lambda fn, rep=200: do_bench(fn, warmup=25, rep=rep, return_mode="median")
    ceil = _ceilings(dev)
    fla, fla_step = _fla()
    rows = _bench_step(dev, ceil, fla_step, bench, H=H, D=D)
    profiles = {}
    for B, T in shapes:
        shape = f"B{B} T{T} H{H} D{D}"
        for rule in ("kda", "gated_deltanet"):
            x = rule_inputs(rule, B, T, H, D, dtype=torch.bfloat16, device=dev)
            args = (x["q"], x["k"], x["v"], x["log_alpha"], x["beta"])
            leaves = [t.clone().requires_grad_(True) for t in args]
            do = torch.randn_like(x["v"])

            def fwd():
                return memory(*args[:3], log_alpha=args[3], beta=args[4], delta=True, check=False, impl="triton")[0]

            def fb():
                o, _ = memory(*leaves[:3], log_alpha=leaves[3], beta=leaves[4], delta=True, check=False, impl="triton")
                return torch.autograd.grad(o, leaves, do)

            flops, nbytes = _memory_cost(B, T, H, D)
            rows.append(_row(f"evict {rule} fwd", shape, bench(fwd), flops, nbytes, ceil))
            flops_t, nbytes_t = _memory_cost(B, T, H, D, train=True)
            rows.append(_row(f"evict {rule} fwd+bwd", shape, bench(fb, rep=500), flops_t, nbytes_t, ceil))
            if profile and (B, T) == shapes[0]:
                profiles[f"evict {rule} fwd"] = kernel_profile(fwd)
                profiles[f"evict {rule} fwd+bwd"] = kernel_profile(fb)
            if rule not in fla:
                continue
            f = fla[rule]
            if profile and (B, T) == shapes[0]:
                profiles[f"fla {rule} fwd"] = kernel_profile(lambda: f(*args))
            with torch.no_grad():
                agree = f"out vs evict {rel_err(f(*args)[0], fwd()):.1e}"
            rows.append(_row(f"fla {rule} fwd", shape, bench(lambda: f(*args)), flops, nbytes, ceil, agree))
            if fla_backward:
                def fb_fla():
                    o, _ = f(*leaves)
                    return torch.autograd.grad(o, leaves, do)
                try:
                    g_fla, g_ev = fb_fla(), fb()
                    agree = "grads vs evict " + " ".join(f"{n}:{rel_err(a, b):.0e}" for n, a, b in zip("qkvab", g_fla, g_ev))
                    rows.append(_row(f"fla {rule} fwd+bwd", shape, bench(fb_fla, rep=500), flops_t, nbytes_t, ceil, agree))
                    if profile and (B, T) == shapes[0]:
                        profiles[f"fla {rule} fwd+bwd"] = kernel_profile(fb_fla)
                except Exception as e:  # fla's own guard refuses gated bwd on Triton 3.6 + Hopper
                    rows.append({"op": f"fla {rule} fwd+bwd", "shape": shape, "note": f"refused: {str(e)[:70]}"})
        qs, ks, vs = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        fl = 2 * B * H * T * T * D
        nb = 4 * B * T * H * D * 2
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            rows.append(_row("sdpa flash causal fwd", shape, bench(sdpa), fl, nb, ceil))
            rows.append(_row("sdpa flash causal fwd+bwd", shape, bench(lambda: sdpa().sum().backward(), rep=500), 3.5 * fl, 2 * nb, ceil))
    print(markdown_table(rows, ["op", "shape", "ms", "roofline_ms", "of_roofline", "note"]))
    print(stage_table(profiles, f"B{shapes[0][0]} T{shapes[0][1]} H{H} D{D}"))
    info = card()
    info["ceilings"] = {k: round(v, 1) for k, v in ceil.items()}
    print(f"\n{info}")
    if out:
        print(f"wrote {write_json(out, {'card': info, 'rows': rows, 'profiles': profiles})}")
    return rows


def stage_table(profiles: dict, shape: str) -> str:
    """CUDA time per kernel (ms per call) of each profiled run, evict's beside fla's for the same rule and pass."""
    out = []
    for key, per in profiles.items():
        if not key.startswith("evict "):
            continue
        other = profiles.get("fla " + key[len("evict "):], [])
        n = max(len(per), len(other))
        pad = lambda xs: [(k[:48], f"{v:.4f}") for k, v in xs] + [("", "")] * (n - len(xs))
        rows = [{"evict kernel": a, "evict ms": am, "fla kernel": b, "fla ms": bm}
                for (a, am), (b, bm) in zip(pad(per[:14]), pad(other[:14]))]
        rows.append({"evict kernel": "TOTAL", "evict ms": f"{sum(v for _, v in per):.4f}", "fla kernel": "TOTAL" if other else "",
                     "fla ms": f"{sum(v for _, v in other):.4f}" if other else ""})
        out.append(f"\nCUDA time per kernel, {key}, {shape}:\n"
                   + markdown_table(rows, ["evict kernel", "evict ms", "fla kernel", "fla ms"]))
    return "\n".join(out)


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _bench_step(dev, ceil, fla_step, bench, *, B=8, H=16, D=128) -> list[dict]:
    """One decode token per sequence against a float32 state: eager launch and CUDA-graph replay."""
    from evict.ops import memory_step

    rows = []
    shape = f"B{B} H{H} D{D}"
    nbytes = 2 * B * H * D * D * 4  # the state read and written once
    for rule in ("kda", "gated_deltanet"):
        x = rule_inputs(rule, B, 1, H, D, dtype=torch.bfloat16, device=dev)
        q, k, v, la, beta = (x[n][:, 0] for n in ("q", "k", "v", "log_alpha", "beta"))
        S = torch.randn(B, H, D, D, device=dev)
        step = lambda: memory_step(q, k, v, S, log_alpha=la, beta=beta, delta=True, out=S)
        rows.append(_row(f"evict {rule} step (eager, in place)", shape, bench(step), 0, nbytes, ceil))
        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        rows.append(_row(f"evict {rule} step (graph replay)", shape, bench(g.replay), 0, nbytes, ceil))
        if rule in fla_step:
            S0 = torch.randn(B, H, D, D, device=dev)
            f = lambda: fla_step[rule](q[:, None], k[:, None], v[:, None], la[:, None], beta[:, None],
                                       initial_state=S0, output_final_state=True)
            rows.append(_row(f"fla {rule} fused_recurrent step", shape, bench(f), 0, nbytes, ceil))
    return rows
