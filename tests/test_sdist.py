"""The sdist carries every tracked test file, the shipped corpus, and the triton version check reads versions right."""

import os
import subprocess
import sys
import tarfile

from evict.ops.memory.triton import version_check
from tests.conftest import ROOT


def test_sdist_holds_the_tests_and_the_default_corpus(tmp_path):
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    name = out.stdout.strip().splitlines()[-1]
    with tarfile.open(os.path.join(tmp_path, name)) as t:
        files = {m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()}
    tracked = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked and [f for f in tracked if f not in files] == []
    assert "evict/data/shakespeare.tar.bz2" in files and "MANIFEST.in" in files
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)


def test_triton_version_check():
    assert version_check("3.6.0") == (True, None) and version_check("3.2.0+git1234") == (True, None)
    ok, msg = version_check("3.1.0")
    assert not ok and "older than 3.2" in msg and "\n" not in msg
    ok, msg = version_check("3.7.1")
    assert ok and "newer than 3.6" in msg and "\n" not in msg
    assert version_check("nightly")[0] is False
