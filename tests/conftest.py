"""Test setup: fresh allocations are filled with NaN (deterministic mode), so an output a kernel never writes fails."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

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


def run_interpreted(script: str, *args: str, timeout: int = 600) -> Any:
    """Run `script` (after INTERPRETER_PRELUDE) in a subprocess under Triton's CPU interpreter; it prints one line
    "RESULT" + JSON, which is returned. Skips when triton is not installed."""
    return _Job(script, [list(args)], timeout).result()


def interpreter_fixture(script: str, *args: str, cases: list | None = None, parts: int = 2, timeout: int = 600):
    """A module-scoped fixture: `run_interpreted(script, *args)`, or with `cases` the script run on `parts` slices of
    them (json.dumps(slice) its one argument; its RESULT a dict keyed by case; the dicts merged).

    Its run starts at collection, in the background: the suite's own tests run on one core of CI's two, so these
    subprocesses (most of the suite's CPU time) run on the other beside them, and the modules that use such a fixture
    run last (`pytest_collection_modifyitems`). A fixture reached before its background run finished runs the parts
    not yet started itself.
    Not under xdist (each worker would start every run)."""
    arg_lists = [list(args)] if cases is None else [[json.dumps(cases[i::parts])] for i in range(parts) if cases[i::parts]]
    job = _Job(script, arg_lists, timeout)

    @pytest.fixture(scope="module")
    def interpreted():
        return job.result()

    interpreted._interpreter_job = job  # type: ignore[attr-defined]
    return interpreted


class _Part:
    """One interpreter subprocess: pending, then run once (by the background thread or the fixture), then done."""

    def __init__(self, script: str, args: list, timeout: int):
        self.script, self.args, self.timeout = script, args, timeout
        self.claimed, self.done = False, threading.Event()
        self.proc: subprocess.Popen | None = None
        self.out: tuple | None = None  # (returncode, stdout, stderr), or (None, "", why) after a timeout

    def claim(self) -> bool:
        with _LOCK:
            mine, self.claimed = not self.claimed, True
            return mine

    def start(self) -> None:
        # one BLAS thread: the interpreter runs tl.dot as numpy matmuls, whose threaded sums vary run to run
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", INTERPRETER_PRELUDE + self.script, *self.args], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(self) -> None:
        assert self.proc is not None
        try:
            stdout, stderr = self.proc.communicate(timeout=self.timeout)
            self.out = (self.proc.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            self.out = (None, "", f"timed out after {self.timeout} s")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.done.set()

    def result(self) -> dict:
        self.done.wait()
        assert self.out is not None
        code, stdout, stderr = self.out
        line = [l for l in stdout.splitlines() if l.startswith("RESULT")]
        assert code == 0 and line, stderr[-3000:]
        return json.loads(line[0][len("RESULT"):])


class _Job:
    def __init__(self, script: str, arg_lists: list, timeout: int):
        self.parts = [_Part(script, args, timeout) for args in arg_lists]

    def result(self) -> Any:
        """The script's RESULT: one part's as it printed it (any JSON), several parts' dicts merged."""
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        mine = [p for p in self.parts if p.claim()]  # the parts the background has not started: run them here, at once
        for p in mine:
            p.start()
        for p in mine:
            p.finish()
        if len(self.parts) == 1:  # run_interpreted's scripts may print a list (the 65,536-token test's)
            return self.parts[0].result()
        merged: dict = {}
        for p in self.parts:
            merged.update(p.result())
        return merged


_LOCK = threading.Lock()
_BACKGROUND: list[_Part] = []  # the parts the background thread runs, one at a time, in the order the suite needs them


def _background() -> None:
    for part in _BACKGROUND:
        if part.claim():
            part.start()
            part.finish()


def _jobs_of(item) -> list:
    """The interpreter jobs of the `interpreter_fixture`s an item uses."""
    module = getattr(item, "module", None)
    jobs = (getattr(getattr(module, name, None), "_interpreter_job", None) for name in item.fixturenames)
    return [job for job in jobs if isinstance(job, _Job)]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER") or importlib.util.find_spec("triton") is None:
        return
    # the modules whose interpreter runs start in the background go last, in their order, so those runs have the
    # rest of the suite's time to finish on the other core
    late = {item.module for item in items if "gpu" not in item.keywords and _jobs_of(item)}
    items[:] = [i for i in items if getattr(i, "module", None) not in late] + \
               [i for i in items if getattr(i, "module", None) in late]
    for item in items:
        if "gpu" not in item.keywords:
            for job in _jobs_of(item):
                _BACKGROUND.extend(p for p in job.parts if p not in _BACKGROUND)


def pytest_collection_finish(session):
    if _BACKGROUND and not session.config.option.collectonly:
        threading.Thread(target=_background, name="interpreter-runs", daemon=True).start()


def pytest_sessionfinish(session, exitstatus):
    for part in _BACKGROUND:  # an interrupted or -x session leaves no interpreter process behind
        part.claim()
        if part.proc is not None and part.proc.poll() is None:
            part.proc.kill()


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
