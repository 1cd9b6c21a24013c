"""The build's one dynamic part: the README as the package index shows it, and the project URLs.

Both need the public repository's URL, set in ONE place: `[tool.evict] repository` in pyproject.toml (or the
EVICT_REPOSITORY environment variable, which wins). With it, every relative link of README.md becomes
`<repository>/blob/main/<path>` (the layout of GitHub, Gitea and GitLab, which redirects) and the metadata gets
Homepage / Source / Issues / Changelog URLs. Without it the README goes up as written (its relative links break on
the package index) and the build says so in one line on stderr. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from setuptools.compat.py310 import tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")  # [text](target) and ![alt](target); targets without spaces


def repository() -> str | None:
    """The public repository's URL (no trailing slash), or None while the project has none."""
    url = os.environ.get("EVICT_REPOSITORY")
    if url is None:
        url = tomllib.loads((HERE / "pyproject.toml").read_text()).get("tool", {}).get("evict", {}).get("repository", "")
    url = url.strip().rstrip("/")
    if url and not re.fullmatch(r"https://[^\s/]+/\S+", url):
        raise SystemExit(f"repository: expected an https:// URL of the repository, got {url!r}")
    return url or None


def absolute_links(text: str, repo: str) -> str:
    """text with every relative Markdown link target made `<repo>/blob/main/<target>` (a bare `#anchor`: the
    repository's README at that anchor); absolute targets (a scheme, or //host) are kept."""

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", target):
            return m.group(0)
        path = "README.md" + target if target.startswith("#") else target.removeprefix("./")
        return f"{m.group(1)}{repo}/blob/main/{path}{m.group(3)}"

    return LINK.sub(fix, text)


def project_urls(repo: str) -> dict[str, str]:
    return {"Homepage": repo, "Source": repo, "Issues": f"{repo}/issues",
            "Changelog": f"{repo}/blob/main/dev/LOG.md"}


if __name__ == "__main__":  # setuptools runs this file as __main__ (build_meta and `python setup.py`)
    from setuptools import setup

    readme = (HERE / "README.md").read_text(encoding="utf-8")
    repo = repository()
    if repo is None:
        print("evict build: no repository URL ([tool.evict] repository in pyproject.toml, or EVICT_REPOSITORY): "
              "the README keeps its relative links and the metadata has no project URLs", file=sys.stderr)
    setup(long_description=readme if repo is None else absolute_links(readme, repo),
          long_description_content_type="text/markdown", project_urls={} if repo is None else project_urls(repo))
