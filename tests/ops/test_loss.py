

@pytest.mark.gpu
def test_gpu_bf16_autocast_as_close_as_the_unchunked_head():
    """CUDA bf16 autocast at a model-like shape (several chunks): loss and both gradients against float64, no worse
    than the plain autocast head + float32 cross-entropy; the chunked loss's peak memory stays below the plain one's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    N, D, V = 8192, 256, 32768
    h = torch.randn(N, D, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) / D ** 0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[::7] = -100
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.t(), t, ignore_index=-100)
    ref.backward()
    results = []
    for chunked in (True, False):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss = linear_cross_entropy(h, w, t, rows=2048).loss
            else:
                loss = F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results.append((float(loss.detach()), h.grad.double(), w.grad.double(), peak))

    def err(a, b):
        return float((a - b).norm() / b.norm())

    (lc, hc, wc, pc), (lp, hp, wp, pp) = results
    assert abs(lc - float(ref)) <= 2 * abs(lp - float(ref)) + 1e-3
    assert err(hc, hd.grad) <= 1.5 * err(hp, hd.grad) + 1e-3
    assert err(wc, wd.grad) <= 1.5 * err(wp, wd.grad) + 1e-3
    assert pc < pp / 2, (pc, pp)
