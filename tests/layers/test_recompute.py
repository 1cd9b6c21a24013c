"""Activation memory of a block (evict/layers/recompute.py, evict/bench/saved.py): the recomputed pieces give the
same forward and gradients as the plain forms (float64, and under bf16 autocast), and a KDA block under bf16 autocast
keeps no more than a bound computed from its shapes (a count of what each piece must keep)."""

import pytest
import torch

import evict.layers.ffn as ffn
import evict.layers.memory_mixer as mm
from evict.bench.saved import saved_bytes, saved_tensors, triton_op_saves
from evict.models import LM, presets


def _lm(letter: str, d=64, H=2, D=32, F=96, **kw) -> LM:
    torch.manual_seed(0)
    return LM(presets.get("kda", pattern=letter, vocab_size=61, n_layers=1, d_model=d, n_heads=H, head_dim=D,
                          d_ff=F, **kw))


def _grads(model: LM, x: torch.Tensor, amp: bool = False) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    h = model.embed(x).detach().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        y = model.blocks[0](h)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype if y.dtype == torch.float64 else torch.float32,
                                 device=y.device)
     ).square().sum().backward()
    return [y.detach(), h.grad] + [p.grad for p in model.parameters() if p.grad is not None]


def _plain_forms(monkeypatch):
    """The plain forms in place of the lean ones: every piece run as it is, x cast by each Linear."""
    for m in (mm, ffn):
        monkeypatch.setattr(m, "compute_inputs", lambda t, n: (t,) * n)
        monkeypatch.setattr(m, "linear_of", lambda lin, fn, *args, params=(): lin(fn(*args)))
    monkeypatch.setattr(mm, "recompute", lambda fn, *args, params=(): fn(*args))


@pytest.mark.parametrize("letter", list("KGDLC"))
def test_recomputed_block_matches_plain_float64(letter, monkeypatch):
    """KDA, Gated DeltaNet, DeltaNet, linear attention, GLA blocks in float64: forward and every gradient of the block
    with its pieces recomputed equal the plain forms' (the same arithmetic, run again)."""
    model = _lm(letter).double()
    x = torch.randint(0, 61, (2, 37))
    lean = _grads(model, x)
    _plain_forms(monkeypatch)
    plain = _grads(model, x)
    assert len(lean) == len(plain) > 8
    for a, b in zip(lean, plain):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recomputed_block_under_autocast_matches_plain(device, monkeypatch):
    """Under bf16 autocast (on CUDA: the Triton op and conv): the cast-once input and the recomputed pieces give the
    plain forms' values."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    model = _lm("K", d=256, H=2, D=128, F=384).to(device) if device == "cuda" else _lm("K")
    x = torch.randint(0, 61, (2, 37), device=device)
    lean = _grads(model, x, amp=True)
    _plain_forms(monkeypatch)
    plain = _grads(model, x, amp=True)
    torch.testing.assert_close(lean[0], plain[0], rtol=0, atol=0)  # the forward: the same casts
    for a, b in zip(lean[1:], plain[1:]):  # the gradients: float32 sums of the same bf16 terms, in another order
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


def test_floor_where_is_clamp():
    """memory()'s floor on log alpha (a where) gives clamp's values and gradient, NaN passing through."""
    la = torch.tensor([-200.0, -110.0, -3.0, 0.0, float("nan")], dtype=torch.float64, requires_grad=True)
    a = torch.where(la < -110.0, -110.0, la)
    b = la.clamp(min=-110.0)
    torch.testing.assert_close(a, b, equal_nan=True)
    (ga,) = torch.autograd.grad(a[:4].sum(), la)
    (gb,) = torch.autograd.grad(b[:4].sum(), la)
    assert torch.equal(ga, gb)


def _block_saves(model: LM, B: int, T: int) -> tuple[int, list]:
    x = torch.randint(0, 61, (B, T))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, targets=x).loss

    with triton_op_saves(factors=False):  # the op keeps its inputs (its CPU form keeps much more)
        rows = saved_tensors(step, model, B * T)
    return saved_bytes(rows, "blocks.0"), rows


def test_kda_block_saved_bytes_bound():
    """A KDA block under bf16 autocast (float32 residual stream and parameters, CPU) keeps at most, per token:
    the two pre-norms' input and output (float32; CUDA's fused norm keeps the input and 1 / rms) 2 x (8 d + 4); x in
    bf16 once per sublayer 2 x 2 d; qkv 6 HD; the op's q, k, v 6 HD, log alpha 4 HD (+ its floor's bool mask HD),
    beta 4 H; the gate projection's rank-D middle 2 D and output 2 HD; the output gate's rank-r middle 2 r and output
    2 HD, o 2 HD; SwiGLU's two inputs 2 x 2 F (the activation and the output projections' inputs are recomputed). Before the cuts
    (session 60) the same block kept 4 bf16 copies of x, the conv's and SiLU's outputs, the float32 gate twice and the
    clamp's input, the norm's float32 copy of o, the gated output and SwiGLU's SiLU output and product: this bound
    fails for it."""
    d, H, D, F, r = 64, 2, 32, 96, 32
    HD = H * D
    B, T = 1, 40  # B T differs from every weight dim: the `fixed` rows are the weights' bf16 copies
    model = _lm("K", d=d, H=H, D=D, F=F)
    got, rows = _block_saves(model, B, T)
    bound = 2 * (8 * d + 4) + 2 * 2 * d + 6 * HD + 6 * HD + 5 * HD + 4 * H + 2 * D + 2 * HD + 2 * r + 2 * 2 * HD + 2 * 2 * F
    listing = "\n".join(f"{r.module} {r.op} {r.shape} {r.dtype} {r.nbytes}" for r in rows if r.nbytes)
    assert got <= bound * B * T, f"{got / (B * T):.0f} B/token > {bound}\n{listing}"
    assert got >= 0.9 * bound * B * T, f"{got / (B * T):.0f} B/token: the bound {bound} is loose\n{listing}"


def test_saved_tensors_counts_storage_once_and_skips_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(5, 8, requires_grad=True)

    def fn():
        y = lin(x)
        return (y * y).sigmoid().sum()

    rows = saved_tensors(fn, lin, 5)
    assert any(r.param for r in rows)  # the weight, saved by linear
    # x (linear), y (mul, twice: one storage), sigmoid's output: 3 storages of 5 x 8 float32
    assert saved_bytes(rows) == 3 * 5 * 8 * 4, [(r.op, r.shape, r.nbytes) for r in rows]
