"""One AttnRes read before and after session 60, side by side in one run (issue 79 item 6, GPU).

Before: the stacked form (torch.stack of the S sources, float32 RMS-normalized keys [S, B, T, D], two einsums;
autograd kept ~5 copies of every source). After: evict.ops.attn_res (an autograd.Function over the list: one dot
and one norm per token and source, the backward written out, the sources saved by reference). For each S: forward
+ backward ms, eager and compiled (torch.compile of the read alone), and the MB each keeps for its backward, at the
claims shape (B4 T4096 D1024, float32 sources: the residual stream under bf16 autocast).
Usage: python dev/attn_res_ab.py [--device cuda] [--sources 2 5] [--no-compile] [--smoke]
"""

import argparse

import torch

from evict.ops.attn_res import attn_res
from evict.report import markdown_table, median_ms


def stacked(sources, query, norm_weight, eps=1e-6):
    """The op as it was before session 60 (evict/ops/attn_res.py at d491461), for the comparison only."""
    v = torch.stack(list(sources))  # [S, B, T, D]
    vf = v.float()
    key = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    w = torch.softmax(torch.einsum("sbtd,d->sbt", key, query.float()), dim=0)  # [S, B, T]
    return torch.einsum("sbt,sbtd->btd", w, v.to(w.dtype)).to(v.dtype)


def saved_mb(fn, src, q, nw) -> float:
    """MB of the tensors autograd saves for fn's backward that are not the sources themselves."""
    ptrs, held = {s.data_ptr() for s in src}, []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        fn(src, q, nw)
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in held if t.data_ptr() not in ptrs}
    return round(sum(seen.values()) / 2**20, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sources", type=int, nargs="+", default=[2, 5])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check of the script, never quoted)")
    a = ap.parse_args()
    B, T, D = (1, 64, 32) if a.smoke else (4, 4096, 1024)
    timer = median_ms(a.device, warmup_ms=25, rep_ms=200)
    forms = {"before": stacked, "after": lambda s, q, nw: attn_res(s, q, norm_weight=nw)}
    rows = []
    for S in a.sources:
        g = torch.Generator().manual_seed(S)
        src = [torch.randn(B, T, D, generator=g).to(a.device).requires_grad_() for _ in range(S)]
        q, nw = (torch.randn(D, generator=g).to(a.device).requires_grad_() for _ in range(2))
        go = torch.randn(B, T, D, generator=g).to(a.device)
        with torch.no_grad():
            outs = {k: f(src, q, nw) for k, f in forms.items()}
        row = {"S": S, "shape": f"B{B} T{T} D{D} fp32",
               "rel diff": f"{float((outs['after'] - outs['before']).norm() / outs['before'].norm()):.1e}",
               "saved MB before": saved_mb(stacked, src, q, nw), "saved MB after": saved_mb(forms["after"], src, q, nw)}
        for mode in ["eager"] + ([] if a.no_compile else ["compiled"]):
            for k, f in forms.items():
                fn = torch.compile(f) if mode == "compiled" else f
                row[f"{mode} {k} ms"] = round(timer(lambda: torch.autograd.grad(fn(src, q, nw), src + [q, nw], go)), 3)
            row[f"{mode} before/after"] = round(row[f"{mode} before ms"] / row[f"{mode} after ms"], 2)
        rows.append(row)
        print(markdown_table([row], list(row)), flush=True)
    print(f"device {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
