"""Fault injection helpers: child processes that write run and model folders, killed with SIGKILL at random points."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A Python child running `code` (sys.argv[1:] = args) with this checkout on its path; stdout is a pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60.0) -> str:
    """Read the child's stdout until a line starting with `prefix` (the child is running its writes from then on)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited {proc.returncode} before {prefix!r}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError(f"no {prefix!r} from the child in {timeout} s")


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
