"""Screenshots of `evict explore` into docs/explore/, taken in Debian's Chromium through Playwright: every figure (at
1100 px) and every chapter of the lesson at 1280 px and at 390 px (a phone), its concept check answered.

    python dev/screenshots.py [--out docs/explore]

Serves the app on a free port (its chunk-dial measurement cached in a temporary folder, so it runs once here),
waits for each figure's endpoint to have drawn, and saves PNGs: <figure>.png and chapter-<n>-<width>.png
(palette-quantised with Pillow when it is installed, to keep the repository small).
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

CHAPTERS = 10  # ch-0 (prologue) … ch-9 (coda)
SETTLED = ("document.querySelectorAll('[aria-busy]').length === 0 && document.querySelector('#layers-svg rect')"
           " && document.querySelector('#dial-status').textContent.startsWith('measured')")


def shrink(path: Path) -> None:
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        im.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def prepare(page) -> None:
    page.wait_for_function(SETTLED, timeout=300_000)
    page.click("#concept-fold")
    page.click("#twin-run")
    page.wait_for_function("document.querySelector('#twin-t').textContent === '24'", timeout=30_000)
    page.hover("#layer-4")
    for _ in range(3):
        page.click("#ds-next")
    page.fill("#fold-step", "10")
    page.dispatch_event("#fold-step", "input")
    for check in page.query_selector_all(".check"):  # answer every check (rightly), so the scorecard is filled
        check.query_selector(f"button[data-choice='{check.get_attribute('data-answer')}']").click()
    page.locator(".final details").first.locator("summary").click()
    page.wait_for_function(SETTLED, timeout=60_000)


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
        for width in (1100, 1280, 390):
            ctx = launch(pw, path, viewport=(width, 900))
            page = ctx.new_page()
            page.goto(url)
            prepare(page)
            shots = ([(f"#fig-{fig}", f"{fig}.png") for fig in FIGURES] if width == 1100 else
                     [(f"#ch-{n}", f"chapter-{n}-{width}.png") for n in range(CHAPTERS)])
            for sel, name in shots:
                page.locator(sel).screenshot(path=str(out / name))
                shrink(out / name)
                print(out / name)
            if page.evaluate("document.querySelectorAll('.error').length"):
                print(f"screenshots: error: the page drew an error: {page.text_content('.error')}", file=sys.stderr)
                return 1
            ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
