"""The parallel compile before Triton's autotune timing (evict/bench/autotune.py), on the CPU: a real Autotuner and
Triton's real AsyncCompileMode around a stand-in kernel that records what it is asked to compile, where, and how."""

import threading

import pytest

triton = pytest.importorskip("triton")
from triton.runtime import _async_compile  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from evict.bench.autotune import parallel_autotune_compile  # noqa: E402

if not hasattr(triton, "AsyncCompileMode"):
    pytest.skip("Triton without AsyncCompileMode (< 3.5): the context is a no-op", allow_module_level=True)


def kernel(x, n, BLOCK):  # the function the stand-in wraps (Autotuner looks for it under .fn)
    pass


class StandIn:
    """Plays JITFunction.run: under an active AsyncCompileMode a compile goes to the mode's executor."""
    fn = staticmethod(kernel)

    def __init__(self, fail_block=None):
        self.calls, self.compiled_on, self.finalized, self.fail_block = [], [], [], fail_block

    def run(self, *args, grid, warmup, **kwargs):
        self.calls.append((args, grid, warmup, kwargs))
        mode = _async_compile.active_mode.get()
        assert mode is not None and warmup  # only the early compile calls run here in this test

        def compile_():
            if kwargs["BLOCK"] == self.fail_block:
                raise RuntimeError("ptxas failed")
            self.compiled_on.append(threading.current_thread().name)
            return ("binary", kwargs["BLOCK"], kwargs["num_warps"])

        return mode.submit(("key", kwargs["BLOCK"], kwargs["num_warps"]), compile_, self.finalized.append)


def tuner(fn):
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32) for w in (2, 4)]
    t = Autotuner(fn, ["x", "n"], configs, ["n"], None, None)
    t.nargs = {"x": "tensor", "n": 100}  # as Autotuner.run sets it before pruning
    return t


def test_every_config_compiled_on_the_pool_with_the_timing_arguments():
    fn = StandIn()
    t = tuner(fn)
    with parallel_autotune_compile(workers=2, log=False) as stats:
        configs = t.prune_configs({"grid": (4,), "warmup": False})
    assert configs == t.configs  # the configs to time are unchanged
    assert [(c[0], c[1], c[2], c[3]["BLOCK"], c[3]["num_warps"]) for c in fn.calls] == [
        (("tensor", 100), (4,), True, b, w) for b in (16, 32) for w in (2, 4)]
    assert sorted(fn.finalized) == sorted(("binary", b, w) for b in (16, 32) for w in (2, 4))
    assert all(name != threading.current_thread().name for name in fn.compiled_on)
    assert stats["active"] and stats["kernels"] == 1 and stats["configs"] == 4


def test_a_failing_config_is_left_to_the_timing_and_the_patch_is_undone():
    fn = StandIn(fail_block=32)
    t = tuner(fn)
    original = Autotuner.prune_configs
    with parallel_autotune_compile(workers=2, log=False):
        assert Autotuner.prune_configs is not original
        t.prune_configs({"grid": (4,), "warmup": False})
    assert Autotuner.prune_configs is original
    assert sorted(fn.finalized) == [("binary", 16, 2), ("binary", 16, 4)]  # the two BLOCK 32 compiles raised


def test_a_launch_by_keywords_as_fla_does():
    fn = StandIn()
    t = tuner(fn)
    t.nargs = {}  # Autotuner.run: dict(zip(arg_names, args)) of no positional arguments
    with parallel_autotune_compile(workers=2, log=False) as stats:
        t.prune_configs({"grid": (4,), "warmup": False, "x": "tensor", "n": 100})
    assert [c[3]["x"] for c in fn.calls] == ["tensor"] * 4 and all(c[0] == () for c in fn.calls)
    assert len(fn.finalized) == 4 and stats["kernels"] == 1


def test_a_single_config_compiles_nothing_early():
    fn = StandIn()
    t = Autotuner(fn, ["x", "n"], [triton.Config({"BLOCK": 16}, num_warps=2)], ["n"], None, None)
    t.nargs = {"x": "tensor", "n": 100}
    with parallel_autotune_compile(workers=2, log=False) as stats:
        t.prune_configs({"grid": (4,), "warmup": False})
    assert fn.calls == [] and stats["kernels"] == 0
