"""Commit a piece of `evict recall --full` (or of `evict lab NAME --full`) that came back from the device machine.

    python3 dev/grid_piece.py FILES_AT                # recall: FILES_AT/grid_config.json + grid_results.jsonl
    python3 dev/grid_piece.py --lab state FILES_AT    # a lab: FILES_AT/lab_state_config.json + lab_state_results.jsonl
    python3 dev/grid_piece.py --side finite FILES_AT  # a side experiment: FILES_AT/finite_config.json + _results.jsonl

A call packed as FILES_AT/out.tar.gz (more than the 8 files a call brings back: dev/gpu.sh) is read from inside it.

`FILES_AT` is the `run` tool's folder of the call's $OUT (`bash dev/gpu.sh grid` / `lab` write those files there). The
rows no committed piece holds yet (by run folder) become results/recall/full/piece<N>_results.jsonl beside a copy of
the piece's config as piece<N>_config.json (results/NAME/full/ for a lab; results/state/counters_full/ for `--lab
counters`, the state lab's --counters-full; results/capacity/heads_full/ for `--lab heads`, the capacity lab's
--heads-full: dev/grid_restore.py's MODES), N the next free number; nothing is written
when every row is already committed. A pairs ladder's finished rungs (rows LADDER/RUNG) are committed too while their
ladder is unfinished, so the next bare machine climbs on from them; so are the context lab's timed models (rows
@decode/MODEL), so the next piece times only the rest. Then the sweep's outputs are written here, by the
lab itself, from every committed piece: the runs restored into a scratch folder (dev/grid_restore.py), then the lab's
`run_sweep` over it as a piece of no time, which trains nothing. While runs are left, recall writes partial_table.md
(every cell whose best over lr is known), and so do the state, hybrid and pairs labs (every cell whose seeds are all
in; the other labs write nothing). Once every run has a result, the finished sweep's files (table.md, results.jsonl
with every run, the plots, its config.json; recall's scorecard.md) land beside the pieces and partial_table.md goes.
`--docs DIR` writes elsewhere.
"""

import argparse
import atexit
import contextlib
import dataclasses
import importlib
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))
import grid_restore  # noqa: E402

from evict.lab.sweep import from_json  # noqa: E402


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


def _unpacked(files_at: Path) -> Path:
    """FILES_AT, or where its out.tar.gz unpacks (dev/gpu.sh packs $OUT into it when a call has more than the 8 files
    a call brings back)."""
    packed = files_at / "out.tar.gz"
    if not packed.is_file():
        return files_at
    into = Path(tempfile.mkdtemp(prefix="grid_piece_"))
    atexit.register(shutil.rmtree, into, ignore_errors=True)  # read during main(); gone when the script ends
    with tarfile.open(packed) as tar:
        tar.extractall(into, filter="data")
    return into


def main(files_at: str, lab: str = "recall", docs: str | None = None, table: bool = True,
         target: dict | None = None, side: str | None = None) -> Path | None:
    """Write the new piece; returns its results file (None when nothing was new). `target`: the sweep the pieces
    belong to, as its config dict (default the lab's `--full` config, its module's FULL; counters: COUNTERS_FULL).
    `side`: a side experiment of
    the recall grid (`SIDE=NAME bash dev/gpu.sh side`: FILES_AT/NAME_config.json + NAME_results.jsonl), committed to
    results/recall/full/side_NAME/ with its own config as the target."""
    if lab != "recall" and lab not in grid_restore.LABS:
        sys.exit(f"--lab: expected one of {sorted(grid_restore.LABS)}, got {lab!r}")
    if side is not None and (lab != "recall" or not re.fullmatch(r"[a-z0-9_]+", side)):
        sys.exit(f"--side: expected a side experiment's name (letters, digits, _) of the recall grid, got {side!r}")
    files_at = _unpacked(Path(files_at))
    stem = side or ("grid" if lab == "recall" else f"lab_{lab}")
    if lab != "recall" and not (files_at / f"{stem}_config.json").exists():
        stem = "lab"  # calls before session 20 wrote lab_config.json, whatever the lab
    cfg, res = files_at / f"{stem}_config.json", files_at / f"{stem}_results.jsonl"
    for p in (cfg, res):
        if not p.is_file():
            sys.exit(f"{p}: not found (FILES_AT: the folder a `dev/gpu.sh {stem}` call's files came back to)")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError:
        sys.exit(f"{cfg}: not JSON")
    rows = _read_rows(res)
    folder = Path(docs) if docs else ROOT / "results" / Path(*grid_restore.mode_of(lab))
    if side is not None:
        folder, target = folder / f"side_{side}", target if target is not None else config
    pieces = sorted(folder.glob("piece*_results.jsonl"), key=_number)
    known = {r["dir"] for p in pieces for r in _read_rows(p)}
    # a pairs ladder's finished rungs (dir LADDER/RUNG) are kept only while their ladder is not finished: then the
    # next bare machine climbs on from them (dev/grid_restore.py); a finished ladder's row holds its rungs' numbers
    finished = known | {r["dir"] for r in rows if "/" not in r["dir"]}
    new = [r for r in rows if r["dir"] not in known and ("/" not in r["dir"] or r["dir"].split("/")[0] not in finished)]
    if not new:
        print(f"no new runs: all {len(rows)} rows of {res} are committed already")
        return None
    n = 1 + max(map(_number, pieces), default=0)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"piece{n}_results.jsonl"
    shutil.copyfile(cfg, folder / f"piece{n}_config.json")
    out.write_text("".join(json.dumps(r) + "\n" for r in new))
    others = sum(grid_restore.is_other(r["dir"]) for r in new)  # the context lab's decode timings
    rungs = sum("/" in r["dir"] for r in new) - others
    also = (f", and {rungs} finished rungs of ladders not finished" if rungs else "") + \
        (f", and {others} models' decode timings" if others else "")
    print(f"wrote {out} ({len(new) - rungs - others} new runs of {sum('/' not in r['dir'] for r in rows)}{also}) and its config")
    if table:
        _table(folder, lab, target)
    return out


def _table(folder: Path, lab: str = "recall", target: dict | None = None) -> None:
    """The sweep's outputs from every committed piece, written by the lab itself (a piece of no time over a scratch
    folder of every piece's runs): the lab's partial_table.md (if it writes one) while runs are left; every file the
    finished sweep wrote at its top level once none is."""
    module = importlib.import_module(f"evict.lab.{grid_restore.LABS.get(lab, 'recall')}")
    full = grid_restore.preset(lab)
    config = target if target is not None else json.loads(json.dumps(dataclasses.asdict(full)))
    sweep = dataclasses.replace(from_json(type(full), config), workers=1)  # nothing trains: no worker processes
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2))
        pairs = []
        for res in sorted(folder.glob("piece*_results.jsonl"), key=_number):
            pairs += [str(res).replace("_results.jsonl", "_config.json"), str(res)]
        grid_restore.main(tmp, pairs, lab=lab)
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            module.run_sweep(sweep, out=tmp, minutes=1e-9)
        if (Path(tmp) / "table.md").exists():  # every lab writes its table once, when no run is left
            names = sorted(f.name for f in Path(tmp).iterdir() if f.is_file())
            for name in names:
                shutil.copyfile(Path(tmp) / name, folder / name)
            written = json.loads((folder / "config.json").read_text())  # the sweep as the pieces ran it, not as the
            written["workers"] = config["workers"]                        # scratch run of no time (1 worker) did
            (folder / "config.json").write_text(json.dumps(written, indent=2))
            (folder / "partial_table.md").unlink(missing_ok=True)
            print(f"the sweep is finished: wrote {', '.join(names)} in {folder}")
            return
        stopped = [line for line in said.getvalue().splitlines() if line.startswith("stopped")]
        table = Path(tmp) / "partial_table.md"
        if lab != "recall" and not table.exists():  # a lab whose report cannot show a partial sweep
            print(f"{lab}: {stopped[-1].split(';')[0] if stopped else 'runs left'} (the table comes with the last run)")
            return
        if not table.exists():
            sys.exit(f"evict recall wrote no partial table: {said.getvalue().strip().splitlines()[-1:]}")
        shutil.copyfile(table, folder / "partial_table.md")
        print(f"wrote {folder / 'partial_table.md'}: {table.read_text().splitlines()[0][:80]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files_at")
    ap.add_argument("--lab", default="recall")
    ap.add_argument("--docs", default=None)
    ap.add_argument("--side", default=None, help="a side experiment of the recall grid (dev/gpu.sh side: SIDE)")
    a = ap.parse_args()
    main(a.files_at, a.lab, a.docs, side=a.side)
