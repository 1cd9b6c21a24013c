"""Commit a piece of `evict recall --full` (or of `evict lab NAME --full`) that came back from the device machine.

    python3 dev/grid_piece.py FILES_AT                # recall: FILES_AT/grid_config.json + grid_results.jsonl
    python3 dev/grid_piece.py --lab state FILES_AT    # a lab: FILES_AT/lab_config.json + lab_results.jsonl

`FILES_AT` is the `run` tool's folder of the call's $OUT (`bash dev/gpu.sh grid` / `lab` write those files there).
The rows no committed piece holds yet (by run folder) become docs/recall_full/piece<N>_results.jsonl beside a copy of
the piece's config as piece<N>_config.json (docs/lab_full/NAME/ for a lab), N the next free number; nothing is
written when every row is already committed. For recall it then rewrites docs/recall_full/partial_table.md from every
piece: restored into a scratch folder (dev/grid_restore.py), then `evict recall --full --minutes 0.000001`, which
trains nothing and writes the table of every cell whose best over lr is known. Once every run of the grid has a
result that command writes the finished sweep's outputs instead, and they replace the partial table: table.md,
scorecard.md, results.jsonl (every run, with its seed) and the two plots, recall_vs_pairs.png and
recall_vs_state.png. `--docs DIR` writes elsewhere.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))
import grid_restore  # noqa: E402


def _read_rows(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"{path}: line {i} is not JSON")
        if not isinstance(row, dict) or "dir" not in row:
            sys.exit(f"{path}: line {i} has no run folder (\"dir\")")
        rows.append(row)
    return rows


def _number(piece: Path) -> int:
    return int(re.findall(r"\d+", piece.name)[0])


def main(files_at: str, lab: str = "recall", docs: str | None = None, table: bool = True,
         target: dict | None = None) -> Path | None:
    """Write the new piece; returns its results file (None when nothing was new). `target`: the recall sweep the
    pieces belong to, as its config dict (default `evict recall --full`'s, recall.FULL)."""
    if lab != "recall" and lab not in grid_restore.LABS:
        sys.exit(f"--lab: expected one of {sorted(grid_restore.LABS)}, got {lab!r}")
    stem = "grid" if lab == "recall" else "lab"
    cfg, res = Path(files_at) / f"{stem}_config.json", Path(files_at) / f"{stem}_results.jsonl"
    for p in (cfg, res):
        if not p.is_file():
            sys.exit(f"{p}: not found (FILES_AT: the folder a `dev/gpu.sh {stem}` call's files came back to)")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError:
        sys.exit(f"{cfg}: not JSON")
    rows = _read_rows(res)
    folder = Path(docs) if docs else ROOT / "docs" / ("recall_full" if lab == "recall" else f"lab_full/{lab}")
    pieces = sorted(folder.glob("piece*_results.jsonl"), key=_number)
    known = {r["dir"] for p in pieces for r in _read_rows(p)}
    new = [r for r in rows if r["dir"] not in known]
    if not new:
        print(f"no new runs: all {len(rows)} rows of {res} are committed already")
        return None
    n = 1 + max(map(_number, pieces), default=0)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"piece{n}_results.jsonl"
    shutil.copyfile(cfg, folder / f"piece{n}_config.json")
    out.write_text("".join(json.dumps(r) + "\n" for r in new))
    print(f"wrote {out} ({len(new)} new runs of {len(rows)}) and its config")
    if table and lab == "recall":
        _table(folder, target)
    return out


FINISHED = ("table.md", "scorecard.md", "results.jsonl", "recall_vs_pairs.png", "recall_vs_state.png")


def _table(folder: Path, target: dict | None = None) -> None:
    """docs/.../partial_table.md from every committed piece, written by the lab itself (`run_sweep` over a scratch
    folder holding every piece's runs, with a piece of no time: it trains nothing); once no run is left, the
    finished sweep's outputs (FINISHED) instead."""
    from evict.lab.recall import FULL, RecallSweep, run_sweep
    from evict.lab.sweep import from_json

    config = target if target is not None else json.loads(json.dumps(dataclasses.asdict(FULL)))
    sweep = dataclasses.replace(from_json(RecallSweep, config), workers=1)  # nothing trains: no worker processes
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        pairs = []
        for res in sorted(folder.glob("piece*_results.jsonl")):
            pairs += [str(res).replace("_results.jsonl", "_config.json"), str(res)]
        grid_restore.main(tmp, pairs)
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            run_sweep(sweep, out=tmp, minutes=1e-9)
        if (Path(tmp) / "table.md").exists():
            for name in FINISHED:
                shutil.copyfile(Path(tmp) / name, folder / name)
            (folder / "partial_table.md").unlink(missing_ok=True)
            print(f"the grid is finished: wrote {', '.join(FINISHED)} in {folder} (partial_table.md removed)")
            return
        table = Path(tmp) / "partial_table.md"
        if not table.exists():
            sys.exit(f"evict recall wrote no partial table: {said.getvalue().strip().splitlines()[-1:]}")
        shutil.copyfile(table, folder / "partial_table.md")
        print(f"wrote {folder / 'partial_table.md'}: {table.read_text().splitlines()[0][:80]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files_at")
    ap.add_argument("--lab", default="recall")
    ap.add_argument("--docs", default=None)
    a = ap.parse_args()
    main(a.files_at, a.lab, a.docs)
