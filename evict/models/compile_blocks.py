"""Per-block torch.compile (`evict train --compile`, `evict bench train/claims` compiled): every block through
torch.compile, each distinct block form traced once.

Dynamo keeps one cache per code object, with at most `recompile_limit` (8) entries. Every block runs the one
`Block.forward`, so a hybrid's blocks (a KDA block, an MLA block: a guard on the mixer's type) and an AttnRes model's
blocks (each block's read sees another number of depth sources) all fill that one cache; past 8 forms dynamo stops
compiling and runs the rest eager, with a single warning (seen on the H100: kkkm_226m with AttnRes, block 3, 12
layers, issue 74). Here each block form gets a forward of its own code object (the same code, `code.replace()`), so
each form has its own cache: blocks of one form share one graph (as before), forms never evict each other.

`lean` (the module's LEAN by default): a block keeps less for its backward. While it compiles, Inductor's partitioner
may recompute in the backward the elementwise values whose backward user is a matmul or an opaque op
(torch._functorch.config's ban_recompute_materialized_backward off), and the short conv's custom op is marked for
recompute (an Inductor joint-graph pass, as torch.utils.checkpoint's selective policy marks an op): a block then keeps
its input, its matmuls' outputs and the memory op's, and reruns the casts, norms, conv, feature maps, gates and
activations between them. No matmul runs twice and the memory op's forward does not: the backward graph has as many
matmuls as the default's, and one more short conv forward (a 4-tap pass over qkv). By default the partitioner keeps
every value a backward matmul or custom op reads (the bf16 inputs of every product, the weights' bf16 copies, q, k, v,
the float32 gate, the conv's output). KDA 226M, one block, per token: 63.6 KB kept by default, 35.4 KB lean (a CPU
trace of the CUDA graph: dev/train_memory.py --compiled [--lean]; tests/ops/test_compile_lean.py; dev/LOG.md, session
61).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

# The default since its GPU tests passed with it on (H100, session 66: the compiled blocks, mixed precision, FSDP2 and the
# engine; KDA 226M lean at 1.11x fla's speed in 0.75x its memory, session 62). lean=False is the keep-all form
# (`evict train --compile --no-compile-lean`, `evict bench train --modes compiled-keep`).
LEAN = True
LEAN_PARTITION = {"ban_recompute_materialized_backward": False}  # torch._functorch.config while a lean block compiles
RECOMPUTED_OPS = ("evict.short_conv_forward.default",)  # custom ops a lean block reruns in its backward


def _recompute_pass() -> Any:
    """Inductor's joint-graph pass (config joint_custom_post_pass) marking the RECOMPUTED_OPS nodes must-recompute:
    the partitioner then keeps their inputs for the backward and reruns them there."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch.utils.checkpoint import CheckpointPolicy

    class RecomputeOps(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in graph.nodes:
                if node.op == "call_function" and str(node.target) in RECOMPUTED_OPS:
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    node.meta.setdefault("ac_graph_id", 0)

        def uuid(self) -> Any:  # its identity for Inductor's caches
            return ("evict.compile_blocks.RecomputeOps", RECOMPUTED_OPS)

    return RecomputeOps()

_FORWARDS: dict[tuple, types.FunctionType] = {}  # block form -> Block.forward under a code object of its own


def block_form(model: Any, i: int) -> tuple:
    """The form of block i of `model`: (mixer letter, FFN kind, AttnRes place or None)."""
    blk = model.layers()[i]
    cfg = model.cfg
    place = (1 + i // cfg.attn_res_block, i % cfg.attn_res_block == 0) if cfg.attn_res else None
    return blk.letter, blk.ffn_kind, place


def _forward_of(form: tuple, cls: Any) -> types.FunctionType:
    key = (cls,) + form
    fn = _FORWARDS.get(key)
    if fn is None:
        f: Any = cls.forward
        fn = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        fn.__kwdefaults__, fn.__doc__, fn.__qualname__ = f.__kwdefaults__, f.__doc__, f.__qualname__
        _FORWARDS[key] = fn
    return fn


def lean_backend(backend: str | Callable = "inductor") -> Callable:
    """A torch.compile backend: `backend` (a name or a backend callable) with LEAN_PARTITION set while it compiles a
    graph (the partition into forward and backward is made then; what each graph keeps is fixed by it). Inductor takes
    torch.compile's mode / options as its own backend does (its config patches), and the pass that marks
    RECOMPUTED_OPS (other backends run no Inductor pass: there only LEAN_PARTITION applies)."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_lean(gm, example_inputs, mode=None, options=None, **kw):
        with torch._functorch.config.patch(LEAN_PARTITION):
            if backend != "inductor":
                extra = {k: v for k, v in (("mode", mode), ("options", options)) if v is not None}
                return inner(gm, example_inputs, **extra, **kw)
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = {**(list_mode_options(mode) if mode else {}), "joint_custom_post_pass": _recompute_pass(),
                       **(options or {})}
            return compile_fx(gm, example_inputs, config_patches=patches, **kw)

    return compile_lean


def compile_blocks(model: Any, *, lean: bool | None = None, **kwargs) -> None:
    """torch.compile(**kwargs) each block of an LM in place (nn.Module.compile), one dynamo cache per block form;
    any other module with `blocks` compiles each block as it is, and one without compiles whole. `lean` (None: LEAN):
    through `lean_backend(kwargs' backend, default Inductor)`, keeping less for the backward (module doc)."""
    if lean is None:
        lean = LEAN
    if not isinstance(lean, bool):
        raise ValueError(f"lean: expected True, False or None, got {lean!r}")
    if lean:
        kwargs["backend"] = lean_backend(kwargs.get("backend", "inductor"))
    if callable(getattr(model, "layers", None)) and hasattr(model, "cfg"):  # an LM (evict.models.lm imports this)
        # the memory op's first call looks for triton once and sets a module global; inside a trace, that global's
        # guard (`_AVAILABLE is None`) fails on the next call and its form compiles twice: look it up here, before
        from evict.ops.memory.triton import available

        available()
        for i, blk in enumerate(model.layers()):
            blk.forward = types.MethodType(_forward_of(block_form(model, i), type(blk)), blk)
            blk.compile(**kwargs)
        return
    for blk in list(getattr(model, "blocks", [])) or [model]:
        blk.compile(**kwargs)
