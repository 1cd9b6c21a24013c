"""Which SDPA backend the recall lab's attention gets on this GPU, and why (issue 10 profile showed the math path)."""

import warnings

import torch
import torch.nn.functional as F

from evict.lab.recall import FULL, model_config
from evict.models import LM

warnings.simplefilter("always")
cfg = model_config("attention", 128, FULL, 512)
m = LM(cfg).cuda()
attn = m.blocks[0].mixer
x = torch.randn(256, 512, 128, device="cuda", requires_grad=True)
captured = {}
orig = F.scaled_dot_product_attention


def spy(q, k, v, **kw):
    captured.update(q=q, k=k, v=v, kw=kw)
    return orig(q, k, v, **kw)


F.scaled_dot_product_attention = spy
with torch.autocast("cuda", dtype=torch.bfloat16):
    attn(x)
F.scaled_dot_product_attention = orig
q, k, v, kw = captured["q"], captured["k"], captured["v"], captured["kw"]
print("q", q.dtype, tuple(q.shape), q.stride(), "k", k.dtype, k.stride(), "v", v.dtype, v.stride(), kw)
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

for cast in (False, True):
    qq, kk, vv = (t.to(torch.bfloat16) for t in (q, k, v)) if cast else (q, k, v)
    try:
        p = SDPAParams(qq, kk, vv, None, 0.0, kw.get("is_causal", False), False)
    except TypeError:
        p = SDPAParams(qq, kk, vv, None, 0.0, kw.get("is_causal", False))
    print("cast" if cast else "as called", "flash:", can_use_flash_attention(p, True), "efficient:", can_use_efficient_attention(p, True))
