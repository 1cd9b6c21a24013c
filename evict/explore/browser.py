"""Debian's Chromium driven by Playwright, as the browser test and dev/screenshots.py launch it.

    chromium_path() -> the executable (EVICT_CHROMIUM, else /usr/bin/chromium), or None when absent
    launch(playwright, path) -> a persistent context in a fresh, temporary profile (headless, no network chatter)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    path = os.environ.get("EVICT_CHROMIUM") or "/usr/bin/chromium"
    return path if Path(path).is_file() and os.access(path, os.X_OK) else None


def launch(playwright, path: str, viewport=(1100, 900)):
    """A headless Chromium context with a fresh --user-data-dir (Playwright passes it as the persistent profile)."""
    profile = tempfile.mkdtemp(prefix="evict-chromium-")
    return playwright.chromium.launch_persistent_context(
        profile, executable_path=path, headless=True, args=FLAGS,
        viewport={"width": viewport[0], "height": viewport[1]})
