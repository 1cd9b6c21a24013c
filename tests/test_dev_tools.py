"""The maintained tools in dev/ are listed on the development page and each answers --help without doing its work."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (ROOT / "dev").iterdir() if p.suffix in (".py", ".sh"))


def test_the_development_page_lists_every_tool_and_no_other():
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`dev/([\w.]+\.(?:py|sh))", page))
    assert listed == {p.name for p in TOOLS}, (sorted(listed - {p.name for p in TOOLS}),
                                                sorted({p.name for p in TOOLS} - listed))


def _help(tool: Path) -> subprocess.CompletedProcess:
    cmd = ["bash", str(tool), "--help"] if tool.suffix == ".sh" else [sys.executable, str(tool), "--help"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", [t for t in TOOLS if t.suffix == ".sh"], ids=lambda t: t.name)
def test_a_shell_tool_answers_help(tool):
    out = _help(tool)
    assert out.returncode == 0 and len(out.stdout.splitlines()) >= 2 and not out.stderr, (out.stdout, out.stderr)


@pytest.mark.slow  # each imports torch (and some evict's kernels) first: ~5 s apiece on a shared CPU
@pytest.mark.parametrize("tool", [t for t in TOOLS if t.suffix == ".py"], ids=lambda t: t.name)
def test_a_python_tool_answers_help(tool):
    out = _help(tool)
    assert out.returncode == 0 and out.stdout.strip(), (out.stdout[-2000:], out.stderr[-2000:])


@pytest.mark.slow  # tiny models, but two of them stepped and profiled on a shared CPU: ~30-90 s
def test_serve_prefill_profile_runs_on_a_cpu(tmp_path):
    """dev/serve_prefill_profile.py --cpu: both models' steps at every scenario, the load's predicted prefill time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "serve_prefill_profile.py"), "--cpu", "--models", "hybrid",
                          "attention", "--reps", "1", "--kernels", "2", "--json", str(tmp_path / "p.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "p.json").read_text())
    for kind, letters in (("hybrid", {"K", "M", "ffn"}), ("attention", {"A", "ffn"})):
        rows = res[kind]["rows"]
        assert len(rows) == 3 + 4 + 1 and all(set(r["by_type_ms"]) == letters for r in rows)
        assert res[kind]["load_prefill_s"] > 0 and len(res[kind]["engine_step_ms"]) == 128 // 32  # the engine's steps
        assert res[kind]["engine_load"]["requests"] == 4 and res[kind]["engine_load"]["steps"] >= 4  # the load in process
    assert "load prefill time hybrid / attention" in out.stdout
