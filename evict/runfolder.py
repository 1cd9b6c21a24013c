"""A run folder's integrity: one run at a time (a lock held for the run's life), and metrics read back as written.

    run_lock(out)          context manager: out/.evict-run.lock, flock'ed for the run's life; a second run on the
                           same folder is one ValueError naming the holder; a lock left by a killed run is named and
                           taken over (the kernel drops a dead process's flock; its record stays in the file)
    read_metrics(path)     metrics.jsonl's rows: a torn last line (a kill mid-append) is dropped with a one-line
                           warning; any other line that is not a JSON object with an integer "step" is a ValueError
                           naming the file and line
    trim_metrics(path, s)  keep the rows of steps <= s (a resumed run drops what came after its checkpoint), atomically
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from evict.jsonfile import replace_text

log = logging.getLogger(__name__)

LOCK_NAME = ".evict-run.lock"
_HELD: dict[str, int] = {}  # real path of a run folder -> the fd of its lock, for the locks this process holds


def _holder(text: str) -> str:
    try:
        d = json.loads(text)
        return f"pid {d['pid']} on {d['host']}, started {d['started']}"
    except (ValueError, TypeError, KeyError):
        return "unknown holder"


@contextlib.contextmanager
def run_lock(out: str | os.PathLike, flag: str = "out") -> Iterator[None]:
    """Hold `out`'s run lock for the block (re-entrant within this process: `evict train` holds it around the
    loop, which takes it too)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(out)
    if key in _HELD:
        yield
        return
    path = out / LOCK_NAME
    for _ in range(20):  # the file may be unlinked by its releasing holder between our open and our flock: retry
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise ValueError(f"{flag}: {out} is in use by another run ({holder}); wait for it to finish or pick "
                             "another folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise ValueError(f"{flag}: could not take the run lock {path} (it keeps changing)")
    previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if previous:
        log.warning("%s: %s: a previous run (%s) ended without releasing its lock (killed?); its checkpoint and "
                    "metrics are checked on resume", flag, out, _holder(previous))
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _HELD[key] = fd
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(OSError):
            path.unlink()  # while still locked: a waiting opener sees the inode change and retries
        os.close(fd)


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl (see the module doc)."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # no newline after it: the append was cut off
                log.warning("metrics: %s: dropped a torn last line (line %d, %d bytes), left by a run killed "
                            "mid-append", path, i, len(line.encode()))
                continue
            raise ValueError(f"metrics: {path}:{i} is not a JSON row; fix or delete that line, or start over "
                             "(--no-resume)") from None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise ValueError(f"metrics: {path}:{i} has no integer \"step\"; fix or delete that line, or start over "
                             "(--no-resume)")
        rows.append(row)
    return rows


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows of steps <= `step`; the file is replaced whole (a kill leaves the old one or the new one)."""
    path = Path(path)
    if not path.exists():
        return
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    replace_text(path, "".join(json.dumps(r) + "\n" for r in rows))
