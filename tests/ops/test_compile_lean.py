"""compile_blocks(lean=True) (evict/models/compile_blocks.py): a compiled block whose partition recomputes elementwise
values (and the short conv) in the backward gives the default compiled block's forward and gradients (float64, bf16
autocast), keeps no more than a bound computed from its shapes (traced through Inductor's partitioner on the CPU with
the CUDA path's custom ops, evict.bench.saved.compiled_saves; the default form fails the bound), and runs no matmul
and no memory-op forward twice."""

import pytest
import torch

from evict.bench.saved import compiled_saves, saved_bytes, triton_path
from evict.models import LM, presets
from evict.models.compile_blocks import lean_backend
from tests.conftest import run_interpreted


def _lm(letter: str = "K", d=64, H=2, D=32, F=96, n_layers=1) -> LM:
    torch.manual_seed(0)
    return LM(presets.get("kda", pattern=letter, vocab_size=61, n_layers=n_layers, d_model=d, n_heads=H, head_dim=D,
                          d_ff=F))


def _step(model: LM, x: torch.Tensor, amp: bool) -> list[torch.Tensor]:
    """The LM's loss and every gradient (parameters and the embedding), one forward + backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(x, targets=x).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _compiled(letter: str, lean: bool, x: torch.Tensor, dtype=torch.float32, amp=False) -> list[torch.Tensor]:
    import torch._dynamo

    torch._dynamo.reset()
    model = _lm(letter).to(dtype)
    model.compile_blocks(lean=lean, backend="aot_eager_decomp_partition")  # Inductor's partitioner, graphs run eager
    return _step(model, x, amp)


@pytest.mark.parametrize("letter", ["K", "G", pytest.param("A", marks=pytest.mark.slow),
                                    pytest.param("M", marks=pytest.mark.slow)])
def test_lean_block_matches_default_float64(letter):
    """KDA, Gated DeltaNet (softmax attention, MLA: slow) LMs (a compiled block) in float64: the lean partition's loss and every gradient
    equal the default partition's and the eager model's (the recomputed values are the same ops on the same inputs)."""
    x = torch.randint(0, 61, (2, 37))
    eager = _step(_lm(letter).double(), x, amp=False)
    default = _compiled(letter, False, x, torch.float64)
    lean = _compiled(letter, True, x, torch.float64)
    assert len(lean) == len(default) == len(eager) > 8
    for a, b, e in zip(lean, default, eager):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)  # compiled vs eager: decomposed ops, reassociated


def test_lean_block_under_autocast_matches_default():
    """bf16 autocast (float32 parameters and residual stream): the lean partition recomputes the bf16 casts, the
    feature maps, gates and activations as the forward ran them: loss and gradients are the default partition's."""
    x = torch.randint(0, 61, (2, 37))
    default = _compiled("K", False, x, amp=True)
    lean = _compiled("K", True, x, amp=True)
    torch.testing.assert_close(lean[0], default[0], rtol=0, atol=0)
    for a, b in zip(lean[1:], default[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


def _traced(lean: bool, d=64, H=2, D=32, F=96, T=320):
    """The KDA block's partition as Inductor makes it for the CUDA path (custom ops), traced on the CPU under bf16
    autocast: the forward's saved values and the backward's ops. T 320: whole chunks, no factor of the state sizes."""
    model = _lm("K", d=d, H=H, D=D, F=F)
    model.compile_blocks(lean=lean)
    x = torch.randint(0, 61, (1, T))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, targets=x).loss

    with triton_path():
        (part,) = compiled_saves(step, model, T, run=False)
    return part


def test_lean_compiled_kda_block_saved_bytes_bound():
    """A compiled KDA block (d 64, H 2, D 32, F 96, output-gate rank 32; the memory op's chunks of 16) keeps at most,
    per token: its float32 input 4 d; the projection qkv 6 HD; the gate projection's middle 2 D and output 2 HD;
    beta's projection 2 H; the op's output 2 HD and its chunk factors 10 C H (T, A~ float32, P bf16); the output
    gate's middle 2 r and output 2 HD; W_o's output 2 d (the mid-block residual is recomputed from it); SwiGLU's two
    inputs 2 x 2 F; the three norms' 1 / rms and the q / k norms (8 + 8 H). Everything else (the bf16 casts of x and
    of the weights, the short conv, SiLU, the L2 norms, the float32 gate, the gated norm, SwiGLU's product, the
    residual sum) is recomputed. The default partition keeps those too: the bound fails for it (3,616 B a token against
    2,012; main's form, q / k / v by unbind, 3,872; lean with unbind, 2,524: the partitioner does not recompute an
    unbind, so it kept the SiLU output). No matmul and no memory-op forward runs twice: the backward
    graph has as many matmuls as the default's, the conv's forward once (its recompute), the memory op's none."""
    d, H, D, F, r, C = 64, 2, 32, 96, 32, 16
    HD = H * D
    bound = 4 * d + 6 * HD + 2 * D + 2 * HD + 2 * H + 2 * HD + 10 * C * H + 2 * r + 2 * HD + 2 * d + 4 * F + 8 + 8 * H
    T = 320
    lean, default = _traced(True, T=T), _traced(False, T=T)
    listing = "\n".join(f"{s.module} {s.op} {s.shape} {s.dtype} {s.nbytes}" for s in lean.saved if s.nbytes)
    got = saved_bytes(lean.saved) / T
    assert got <= bound, f"{got:.0f} B/token > {bound}\n{listing}"
    assert got >= 0.95 * bound, f"{got:.0f} B/token: the bound {bound} is loose\n{listing}"
    assert saved_bytes(default.saved) / T > 1.6 * bound  # the default keeps the casts, conv, features, gate, products
    assert saved_bytes(lean.saved, fixed=True) < saved_bytes(default.saved, fixed=True) / 10  # no bf16 weight copies
    for op in ("mm", "addmm", "bmm", "evict.memory_backward", "evict.short_conv_backward"):
        assert lean.backward_ops[op] == default.backward_ops[op], op
    assert lean.backward_ops["evict.short_conv_forward"] == 1 and default.backward_ops["evict.short_conv_forward"] == 0
    assert not any(op.startswith("evict.memory_forward") for op in lean.backward_ops)


def test_lean_backend_takes_inductor_options_and_bad_lean_is_refused():
    """lean_backend hands torch.compile's mode / options to Inductor as its config patches; lean must be a bool."""
    from evict.models.compile_blocks import compile_blocks

    with pytest.raises(ValueError, match="^lean: expected True, False or None"):
        compile_blocks(_lm(), lean="yes")
    model = _lm()
    model.compile_blocks(lean=True, options={"max_autotune": False})
    x = torch.randint(0, 61, (1, 16))
    with triton_path():
        (part,) = compiled_saves(lambda: model(x, targets=x).loss, model, 16, run=False)
    assert part.saved  # compiled through Inductor (its partitioner ran) with the options given


INTERP_SCRIPT = r"""
import importlib, json
import torch
from evict.bench.saved import compiled_saves, saved_bytes
from evict.models import LM, presets
from evict.ops.conv import kernel_runs_on
import evict.ops.memory.triton.autograd  # registers evict::memory_forward / memory_backward
mem = importlib.import_module("evict.ops.memory")
real = mem._dispatch
mem._dispatch = lambda *a: real(*a[:9], "triton", *a[10:])  # the memory op's custom op on the CPU (interpreted)
out = {}
def run(lean):
    torch.manual_seed(0)
    m = LM(presets.get("kda", pattern="K", vocab_size=61, n_layers=1, d_model=32, n_heads=1, head_dim=32, d_ff=48))
    x = torch.randint(0, 61, (1, 20))
    assert kernel_runs_on(x.float())
    grads = []
    def step():
        loss = m(x, targets=x).loss
        loss.backward()
        grads.extend([loss.detach()] + [p.grad for p in m.parameters()])
    if lean is None:
        step()
        return grads, None
    m.compile_blocks(lean=lean)
    (part,) = compiled_saves(step, m, 20)
    return grads, part
eager, _ = run(None)
for lean in (False, True):
    got, part = run(lean)
    out[str(lean)] = dict(err=max(float((a - b).norm() / b.norm()) for a, b in zip(got, eager)),
                          kept=saved_bytes(part.saved), conv=part.backward_ops["evict.short_conv_forward"])
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_interpreter_lean_block_through_inductor():
    """Inductor on the CPU, the memory op and the short conv as their custom ops (Triton's interpreter runs the
    kernels), float32: the lean and the default compiled KDA block give eager's loss and gradients (the lean block's
    backward reruns the conv kernel), the lean one keeping less. ~1 minute."""
    r = run_interpreted(INTERP_SCRIPT)
    assert r["False"]["err"] < 1e-5 and r["True"]["err"] < 1e-5, r
    assert r["True"]["conv"] == 1 and r["False"]["conv"] == 0, r
    assert r["True"]["kept"] < r["False"]["kept"], r


@pytest.mark.gpu
@pytest.mark.parametrize("letter", list("KG"))
def test_gpu_lean_block_matches_eager_and_keeps_less(letter):
    """On CUDA (Triton custom ops, Inductor, bf16 autocast): the lean compiled block's forward and gradients agree with
    eager to bf16 rounding (as the default compiled block's do), and it keeps less for its backward than the default
    compiled block, measured from the graphs Inductor compiled and ran (compiled_saves)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from tests.ops.test_compile_blocks import _blocks, _compiled_matches

    blk = _blocks(letter, d=256, H=2, D=128)[0].cuda()
    x = torch.randn(2, 256, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _compiled_matches(blk, x, lean_backend(), 3e-2)
    kept = {}
    for lean in (False, True):
        model = _lm(letter, d=256, H=2, D=128, F=384).cuda()
        model.compile_blocks(lean=lean)
        t = torch.randint(0, 61, (2, 320), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(t, targets=t).loss
            loss.backward()

        (part,) = compiled_saves(step, model, t.numel())
        kept[lean] = saved_bytes(part.saved)
    assert kept[True] < 0.8 * kept[False], kept


def test_lean_compiles_each_block_form_once():
    """compile_blocks(lean=True) hands every block one backend object: a 4-block KDA LM compiles its one block form
    once in two training steps under a recompile limit of 1 (a backend per block would recompile each block)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _lm(n_layers=4)
    model.compile_blocks(lean=True, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            x = torch.randint(0, 61, (2, 12))
            model(x, targets=x).loss.backward()
    assert dict(counters["frames"]) == {"total": 1, "ok": 1} and not counters["unimplemented"]
