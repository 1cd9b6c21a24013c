"""The package as the index and a new user get it: the built metadata (README links, project URLs, from the one
repository setting) and the wheel installed into a fresh venv, then `evict train` with no other step."""

import email
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _metadata(tmp_path: Path, repository: str) -> tuple[email.message.Message, str]:
    """The wheel metadata the build writes with EVICT_REPOSITORY=repository ('' = none), and the build's stderr."""
    code = f"from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r}))"
    env = {**os.environ, "EVICT_REPOSITORY": repository}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    info = tmp_path / out.stdout.strip().splitlines()[-1] / "METADATA"
    return email.message_from_string(info.read_text(encoding="utf-8")), out.stderr


def test_with_a_repository_every_readme_link_is_absolute(tmp_path):
    repo = "https://example.org/someone/evict"  # a test value: the project's own URL is unset (pyproject [tool.evict])
    md, err = _metadata(tmp_path, repo)
    body = md.get_payload()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = LINK.findall(body)
    assert len(links) == len(LINK.findall(readme)) > 30  # none lost
    assert [t for t in links if not t.startswith("https://")] == []
    assert f"]({repo}/blob/main/docs/fine-tuning.md)" in body and f"]({repo}/blob/main/BENCHMARKS.md#serving)" in body
    assert md.get_all("Project-URL") == [f"Homepage, {repo}", f"Source, {repo}", f"Issues, {repo}/issues",
                                         f"Changelog, {repo}/blob/main/dev/LOG.md"]
    assert md["Description-Content-Type"] == "text/markdown" and "no repository URL" not in err


def test_without_a_repository_the_build_says_so(tmp_path):
    md, err = _metadata(tmp_path, "")
    assert md.get_all("Project-URL") is None
    assert md.get_payload().strip() == (ROOT / "README.md").read_text(encoding="utf-8").strip()  # as written
    said = [line for line in err.splitlines() if "no repository URL" in line]
    assert len(said) == 1 and "[tool.evict] repository" in said[0] and "EVICT_REPOSITORY" in said[0]


def test_a_bad_repository_is_refused_in_one_line(tmp_path):
    code = f"from setuptools import build_meta; build_meta.prepare_metadata_for_build_wheel({str(tmp_path)!r})"
    env = {**os.environ, "EVICT_REPOSITORY": "github.com/x"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "repository: expected an https:// URL of the repository, got 'github.com/x'" in out.stderr


def test_wheel_in_a_fresh_venv_then_evict_train(tmp_path):
    """Build the wheel, make a venv without it, install the wheel alone (--no-deps --no-index: nothing downloaded; the
    dependencies come from this interpreter's site-packages through a .pth line, as `--system-site-packages` would give
    a system install; `pip check` then finds every requirement of evict there), then `evict train` on the default
    corpus from another folder with a fresh HOME."""
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp_path / 'dist')!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = tmp_path / "dist" / out.stdout.strip().splitlines()[-1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "parent_site.pth").write_text("\n".join(sorted(deps)) + "\n")  # plain paths: their own .pth files not run
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(tmp_path / "home"), PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    where = subprocess.run([py, "-c", "import evict; print(evict.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr  # the wheel's copy, not the checkout
    check = subprocess.run([py, "-m", "pip", "check"], env=env, capture_output=True, text=True, timeout=120)
    assert [line for line in check.stdout.splitlines() if line.lower().startswith("evict ")] == []  # its deps all there
    run = subprocess.run([venv / "bin" / "evict", "train", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                          "--eval-every", "2", "--eval-batches", "1", "--device", "cpu", "--out", str(tmp_path / "run")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "run.json").is_file()
    assert list((tmp_path / "home" / ".cache" / "evict" / "corpora").iterdir())  # the shipped corpus, unpacked
