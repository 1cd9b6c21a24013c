"""Issue 16's loss gap (two GPUs ran 0.5 ahead of one by step 10): is one GPU's step on a batch the computation two
ranks do on its halves? On dev/dist_bench.sh's model and one random byte batch [16, 2048] (32 ran out of memory in
this script, where `evict train` fits it), bf16 autocast as
`evict train --amp bf16`, every parameter's gradient relative difference (worst first) of:
  repeat   the full batch twice (the run-to-run floor: atomics),
  halves   the full batch against the mean of its two halves' gradients (what DDP / FSDP2 average),
  fp32     the full batch against itself without autocast (the bf16 floor),
then one AdamW step from equal gradients: fused with a tensor learning rate (one GPU) against foreach with a float
one (torchrun). Usage (GPU): python dev/loss_gap.py [--batch 16 --seq-len 2048]
"""

import argparse

import torch
import torch.nn.functional as F

from evict.models import LM, presets


def grads(model, x, amp=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        aux = model.aux_loss()
        total = loss + (aux if aux is not None else 0)
    total.backward()
    return float(loss), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(tag, a, b):
    rel = {n: float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in b}
    missing = sorted(set(b) ^ set(a))
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    print(f"{tag}: global {float((flat(a) - flat(b)).norm() / flat(b).norm()):.2e}; worst "
          + ", ".join(f"{n} {r:.1e}" for n, r in sorted(rel.items(), key=lambda kv: -kv[1])[:6])
          + (f"; gradient only on one side: {missing[:4]}" if missing else ""), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = presets.get("kimi_linear", size="small", d_model=1024, n_layers=18, n_heads=8, head_dim=128, d_ff=2816)
    model = LM(cfg).cuda().train()
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1), device="cuda")
    h = a.batch // 2
    l_full, g_full = grads(model, x)
    _, g_again = grads(model, x)
    l_a, g_a = grads(model, x[:h])
    l_b, g_b = grads(model, x[h:])
    g_half = {n: (g_a[n] + g_b[n]) / 2 for n in g_a}
    _, g_f32 = grads(model, x, amp=False)
    print(f"loss full {l_full:.5f}, halves {l_a:.5f} / {l_b:.5f} (mean {(l_a + l_b) / 2:.5f})")
    compare("repeat", g_again, g_full)
    compare("halves", g_half, g_full)
    compare("fp32  ", g_full, g_f32)
    params = [p for p in model.parameters() if p.grad is not None]
    outs = []
    for fused in (True, False):
        ps = [p.detach().clone().requires_grad_(True) for p in params]
        for p, q in zip(ps, params):
            p.grad = q.grad.clone()
        lr = torch.tensor(1e-3, device="cuda") if fused else 1e-3
        opt = torch.optim.AdamW([{"params": ps, "weight_decay": 0.1}], lr=lr, fused=fused or None,
                                foreach=None if fused else True)
        for _ in range(3):
            opt.step()
        outs.append({str(i): p.detach().float() - q.detach().float() for i, (p, q) in enumerate(zip(ps, params))})
    compare("AdamW fused+tensor lr vs foreach (3 steps, update)", outs[0], outs[1])


if __name__ == "__main__":
    main()
