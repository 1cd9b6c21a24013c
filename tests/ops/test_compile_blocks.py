"""torch.compile takes whole blocks without a graph break: the memory op and the short conv are torch.library custom
ops on their Triton path (checked under Triton's CPU interpreter and on CUDA), the PyTorch forms trace as they are.
Breaks are counted with torch._dynamo.explain; compiled blocks (aot_eager on the CPU: AOTAutograd through the ops'
fake forms and register_autograd; Inductor on CUDA) match the eager ones, forward and gradients."""

import json

import pytest
import torch

from evict.models import LM, presets
from tests.conftest import interpreter_fixture

PATTERN = "KGDACM"  # every mixer of the lab but linear attention's normalizer form; L below


def _blocks(pattern, d=32, H=2, D=16, **kw):
    torch.manual_seed(0)
    cfg = presets.get("kda", pattern=pattern, vocab_size=61, n_layers=len(pattern), d_model=d, n_heads=H,
                      head_dim=D, d_ff=48, **kw)
    return LM(cfg).layers()


def _breaks(blk, x):
    import torch._dynamo

    torch._dynamo.reset()
    e = torch._dynamo.explain(blk)(x)
    return e.graph_break_count, [str(b.reason).splitlines()[0] for b in e.break_reasons]


def _compiled_matches(blk, x, backend, tol):
    """Forward and every gradient of a compiled block against the eager block; returns the worst relative error."""
    import torch._dynamo

    torch._dynamo.reset()
    worst = 0.0
    outs = []
    for fn in (blk, torch.compile(blk, backend=backend, fullgraph=True)):
        blk.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        y = fn(xi)
        y.float().square().sum().backward()
        outs.append([y.detach().float(), xi.grad.float()] + [p.grad.float() for p in blk.parameters() if p.grad is not None])
    assert len(outs[0]) == len(outs[1])
    for a, b in zip(*outs):
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
    assert worst < tol, worst
    return worst


@pytest.mark.parametrize("letter", list(PATTERN + "L"))
def test_cpu_blocks_have_no_graph_break(letter):
    n, why = _breaks(_blocks(letter)[0], torch.randn(2, 20, 32))
    assert n == 0, why


@pytest.mark.slow
@pytest.mark.parametrize("letter", list(PATTERN + "L"))
def test_cpu_compiled_blocks_match_eager(letter):
    _compiled_matches(_blocks(letter)[0], torch.randn(2, 20, 32), "aot_eager", 1e-5)


INTERP_SCRIPT = r"""
import json, sys
import torch
from tests.ops.test_compile_blocks import _blocks, _breaks, _compiled_matches
from evict.ops.conv import kernel_runs_on
import evict.ops.memory.triton.autograd  # registers evict::memory_forward / memory_backward
out = {}
for letter in sys.argv[1]:
    blk = _blocks(letter, d=32, H=1, D=32)[0]
    x = torch.randn(1, 20, 32)
    assert kernel_runs_on(x)
    n, why = _breaks(blk, x)
    err = _compiled_matches(blk, x, "aot_eager", 1e-5)
    out[letter] = dict(breaks=n, why=why, err=err)
# the custom op's registrations: schema, fake form vs the real one, autograd, AOT dispatch
q, k, v = (torch.randn(1, 20, 1, 32) for _ in range(3))
q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
la, beta = -torch.rand(1, 20, 1, 32) * 0.3, torch.rand(1, 20, 1)
args = [t.requires_grad_() for t in (q, k, v, la, beta)] + [None, None, True, 32 ** -0.5, 16, "tf32x3", ""]
res = torch.library.opcheck(torch.ops.evict.memory_forward.default, args,
                            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
out["opcheck"] = {k: v for k, v in res.items()}
print("RESULT" + json.dumps(out))
"""


interpreted = interpreter_fixture(INTERP_SCRIPT, "KGC")  # ~2 minutes on a shared 2-core machine


@pytest.mark.slow
@pytest.mark.parametrize("letter", list("KGC"))
def test_interpreter_triton_blocks_compile_whole(interpreted, letter):
    """KDA, Gated DeltaNet, GLA blocks on the Triton path (memory op + short conv custom ops): one graph, and the
    compiled block's forward and gradients are the eager block's."""
    r = interpreted[letter]
    assert r["breaks"] == 0, r["why"]
    assert r["err"] < 1e-5


@pytest.mark.slow
def test_interpreter_memory_op_registration(interpreted):
    assert interpreted["opcheck"] == {"test_schema": "SUCCESS", "test_autograd_registration": "SUCCESS",
                                      "test_faketensor": "SUCCESS"}


@pytest.mark.gpu
@pytest.mark.parametrize("letter", list("KGA"))
def test_gpu_blocks_compile_whole(letter):
    """On CUDA in bf16 autocast (the Triton path), Inductor: no graph break, and the compiled block's forward and
    gradients agree with eager to bf16 rounding (Inductor fuses the elementwise chain in float32 where eager rounds
    each op to bf16)."""
    blk = _blocks(letter, d=256, H=2, D=128)[0].cuda()
    x = torch.randn(2, 256, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        n, why = _breaks(blk, x)
        assert n == 0, why
        _compiled_matches(blk, x, "inductor", 3e-2)


def _compile_counts(attn_res, per_form, limit=1):
    """Compile a 4-layer KDA + MLA hybrid's blocks (dynamo only, backend "eager") under a recompile limit, run one
    training step; returns (dynamo's counters, the number of distinct block forms)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from evict.models import compile_blocks
    from evict.models.compile_blocks import block_form

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = presets.get("kda", pattern="KM", vocab_size=61, n_layers=4, d_model=32, n_heads=2, head_dim=16, d_ff=48,
                      attn_res=attn_res, attn_res_block=2)
    m = LM(cfg)
    if per_form:
        compile_blocks(m, backend="eager")
    else:  # the per-block mode before: one dynamo cache for every block
        for blk in m.layers():
            blk.compile(backend="eager")
    with torch._dynamo.config.patch(recompile_limit=limit):
        for _ in range(2):
            m(torch.randint(0, 61, (2, 12))).square().mean().backward()
    return counters, len({block_form(m, i) for i in range(4)})


@pytest.mark.parametrize("attn_res", [pytest.param(False, marks=pytest.mark.slow), True])
def test_cpu_hybrid_compiles_each_block_form_once(attn_res):
    """compile_blocks: a KDA + MLA hybrid (with AttnRes: four forms, each block reads another number of depth
    sources) compiles each block form exactly once, two steps, under a recompile limit of 1: no recompile, no
    fallback to eager, no graph break (one graph per form). The old per-block mode shares one dynamo cache among all
    blocks: it hits the limit at the second form (the H100's kkkm_226m AttnRes run hit 8 and ran eager)."""
    counters, forms = _compile_counts(attn_res, per_form=True)
    assert forms == (4 if attn_res else 2)
    assert not counters["unimplemented"], dict(counters["unimplemented"])
    assert dict(counters["frames"]) == {"total": forms, "ok": forms}
    assert counters["stats"]["unique_graphs"] == forms
    if attn_res:
        old, _ = _compile_counts(attn_res, per_form=False)
        assert any("recompile" in k.lower() for k in old["unimplemented"]), dict(old["unimplemented"])
