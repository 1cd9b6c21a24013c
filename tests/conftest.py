"""Test setup: fresh allocations are filled with NaN (deterministic mode), so an output a kernel never writes fails."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Prepended to every script run under Triton's CPU interpreter (TRITON_INTERPRET must be set before triton compiles).
INTERPRETER_PRELUDE = r"""
import os
assert os.environ["TRITON_INTERPRET"] == "1"
import torch
torch.use_deterministic_algorithms(True, warn_only=True)  # as in conftest: fresh allocations are NaN-filled, so
torch.utils.deterministic.fill_uninitialized_memory = True  # an intermediate a kernel never writes fails the test
import triton.runtime.interpreter as interp

# triton 3.6's interpreter turns a runtime loop bound into int(array of shape [1]), which numpy >= 2.3 rejects
_patch = interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interp._patch_lang_tensor = _patch_lang_tensor
"""


def run_interpreted(script: str, *args: str, timeout: int = 600) -> dict:
    """Run `script` (after INTERPRETER_PRELUDE) in a subprocess under Triton's CPU interpreter; it prints one line
    "RESULT" + JSON, which is returned. Skips when triton is not installed."""
    return _interpreted([[*args]], script, timeout)[0]


def run_interpreted_cases(script: str, cases: list, processes: int = 2, timeout: int = 600) -> dict:
    """`run_interpreted(script, json.dumps(cases))` for a script whose RESULT is a dict keyed by case, with the cases
    dealt round-robin to `processes` interpreter processes at once (the suite itself runs on one core; these few
    fixtures were most of its time) and their dicts merged."""
    parts = [cases[i::processes] for i in range(processes) if cases[i::processes]]
    merged: dict = {}
    for result in _interpreted([[json.dumps(p)] for p in parts], script, timeout):
        merged.update(result)
    return merged


def _interpreted(arg_lists: list, script: str, timeout: int) -> list:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    # one BLAS thread: the interpreter runs tl.dot as numpy matmuls, whose threaded sums vary run to run
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", INTERPRETER_PRELUDE + script, *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in arg_lists]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            line = [l for l in stdout.splitlines() if l.startswith("RESULT")]
            assert proc.returncode == 0 and line, stderr[-3000:]
            results.append(json.loads(line[0][len("RESULT"):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny shapes: one CPU thread is faster, and immune to a busy machine's thread contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of a against the reference b."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cli_error(argv: list[str], capsys) -> str:
    """`evict ARGV` must fail with exit code 2 and exactly one line on stderr; returns that line."""
    from evict.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]
