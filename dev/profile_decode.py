"""Where a batch-1 decode step's time goes (issue 13): kernels of one eager step, by CUDA time, for each model.

    python dev/profile_decode.py [--models kda hybrid] [--context 8192]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from evict.bench.decode import GPU_WIDTH, filled_cache, model_configs
from evict.models import LM

p = argparse.ArgumentParser()
p.add_argument("--models", nargs="+", default=["kda", "hybrid", "attention"])
p.add_argument("--context", type=int, default=8192)
a = p.parse_args()
for kind, cfg in model_configs(a.models, "small", GPU_WIDTH).items():
    model = LM(cfg).cuda().to(torch.bfloat16).eval()
    with torch.inference_mode():
        cache = filled_cache(model, 1, a.context, extra=1)
        tok = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
        for _ in range(3):
            cache.pos = a.context
            model(tok, cache=cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cache.pos = a.context
            model(tok, cache=cache)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, 'device_time', 0) or getattr(e, 'cuda_time', 0) for e in ev)
    print(f"\n== {kind} ({cfg.pattern}) context {a.context}: {len(ev)} kernels, {total / 1e3:.3f} ms summed kernel time, "
          f"{total / max(len(ev), 1):.1f} us mean")
    try:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=70))
    except Exception:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))
