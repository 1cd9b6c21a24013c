"""The front page and the guide link only to what a clone holds: every relative link (and image) in README.md,
BENCHMARKS.md, docs/**/*.md and results/**/*.md names a file or folder inside the repository, and a `#anchor` names a
heading of its target as GitHub spells it. The README stays a front page (≤ 260 lines)."""
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("results/**/*.md")})
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto: … are citations, not files


def _unfenced(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code: a link shown as code is not a link."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", _unfenced(text), flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[`*~]|<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LNM" or c == "_")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _unfenced(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(page.read_text(encoding="utf-8")))]


def test_the_pages_exist():
    assert ROOT / "README.md" in PAGES and any(p.parent == ROOT / "docs" for p in PAGES), PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    bad = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if not dest.is_relative_to(ROOT) or ".git" in dest.relative_to(ROOT).parts:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_slug_follows_github():
    assert _slug("Pairs vs head dim, and the eviction stories") == "pairs-vs-head-dim-and-the-eviction-stories"
    assert _slug("On a GPU") == "on-a-gpu"
    assert _slug("`evict explore`: the lesson's figures") == "evict-explore-the-lessons-figures"
    assert _slug("gated_deltanet, 2× H200") == "gated_deltanet-2-h200"
    assert _slug("Memory op v2, step 1 (issue 12) — H200") == "memory-op-v2-step-1-issue-12--h200"


def test_a_broken_link_is_caught(tmp_path, monkeypatch):
    """The checker itself fails on a missing file, an escape from the repository and a missing anchor."""
    page = ROOT / "docs" / "README.md"
    text = "[a](nowhere.md) [b](../../outside.md) [c](README.md#no-such-heading) `[d](code.md)`\n```\n[e](x.md)\n```\n"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: text if self == page else "# Title\n")
    with pytest.raises(AssertionError) as e:
        test_every_relative_link_resolves_inside_the_repository(page)
    msg = str(e.value)
    assert "nowhere.md: no such file" in msg and "outside the repository" in msg and "#no-such-heading" in msg
    assert "code.md" not in msg and "x.md" not in msg


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 260, f"README.md has {lines} lines; the front page's budget is 260 (details go to docs/)"


def test_the_readme_tour_runs(tmp_path, monkeypatch):
    """The front page's Python block runs as written, and its chunked op agrees with the float64 loop it shows."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks, "README.md has no python block"
    monkeypatch.chdir(tmp_path)  # it saves a model folder
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert (scope["o"].double() - scope["ref"]).abs().max() < 1e-4
    assert scope["tokens"].shape == (1, 3 + 16) and (tmp_path / "ckpt" / "config.json").is_file()
