"""A lab sweep stopped with runs left, shared by the labs' tests (run_grid's `partial`): a copy of a finished sweep
holding only some of its runs, a piece of no time over it (its partial_table.md), then the rest of the runs put in
(the finished sweep's files, the partial table gone)."""

import shutil
from pathlib import Path
from typing import Callable


def stopped_piece(root: Path, run: Callable, kept: list[str], total: int, png: str) -> tuple[Path, str]:
    """`run(out=..., minutes=...)` over root.parent / "part": root's config and the run folders `kept`, out of time
    before any other starts. Checks the partial table's head and that no table, rows or plot (`png`) were written;
    returns the folder and the partial table."""
    part = root.parent / "part"
    (part / "runs").mkdir(parents=True)
    shutil.copyfile(root / "config.json", part / "config.json")
    for name in kept:
        shutil.copytree(root / "runs" / name, part / "runs" / name)
    run(out=part, minutes=1e-9)
    partial = (part / "partial_table.md").read_text()
    assert partial.startswith(f"Partial: {len(kept)} of {total} runs finished;") and not (part / "table.md").exists()
    assert not (part / "results.jsonl").exists() and not (part / png).exists()
    return part, partial


def finished_piece(root: Path, part: Path, run: Callable, table: str) -> None:
    """The rest of root's runs put into `part` and `run(out=part)`: nothing trains, the finished sweep's table (the
    same as root's) replaces the partial one."""
    for folder in (root / "runs").iterdir():
        if not (part / "runs" / folder.name).exists():
            shutil.copytree(folder, part / "runs" / folder.name)
    run(out=part)
    assert (part / "table.md").read_text() == table and not (part / "partial_table.md").exists()
