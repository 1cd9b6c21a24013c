"""Write a folder whole or not at all: into a hidden sibling, renamed onto the target when every file is written."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_folder(out: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """write(tmp folder), then rename it to `out`. `out` must not exist, or be an empty folder (else ValueError)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out: {out} already exists and is not an empty folder; pick a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
