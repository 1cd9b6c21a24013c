"""Screenshots of every figure of `evict explore` into docs/explore/, taken in Debian's Chromium through Playwright.

    python dev/screenshots.py [--out docs/explore]

Serves the app on a free port (its chunk-dial measurement cached in a temporary folder, so it runs once here),
waits for each figure's endpoint to have drawn, moves nothing, and saves one PNG per figure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from evict.explore.app import create_app, running
from evict.explore.browser import chromium_path, launch
from evict.explore.concepts import FIGURES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "explore"))
    args = p.parse_args(argv)
    path = chromium_path()
    if path is None:
        print("screenshots: error: no chromium at /usr/bin/chromium (apt-get install chromium, or set EVICT_CHROMIUM)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache, running(create_app(cache_dir=Path(cache))) as url, sync_playwright() as pw:
        ctx = launch(pw, path)
        page = ctx.new_page()
        page.goto(url)
        page.wait_for_function("document.querySelector('#dial-status').textContent.startsWith('measured')", timeout=300_000)
        page.wait_for_function("document.querySelector('#layers-svg rect') && document.querySelector('#lens-weights').textContent", timeout=120_000)
        page.click("#concept-fold")
        page.click("#twin-run")
        page.wait_for_function("document.querySelector('#twin-t').textContent === '24'", timeout=30_000)
        page.hover("#layer-4")
        for _ in range(3):
            page.click("#ds-next")
        page.fill("#fold-step", "10")
        page.dispatch_event("#fold-step", "input")
        page.wait_for_timeout(500)
        for fig in FIGURES:
            page.locator(f"#fig-{fig}").screenshot(path=str(out / f"{fig}.png"))
            print(out / f"{fig}.png")
        if page.evaluate("document.body.dataset.error"):
            print(f"screenshots: error: the page reported {page.evaluate('document.body.dataset.error')}", file=sys.stderr)
            return 1
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
