"""Put finished runs of earlier `evict recall --full` (or `evict lab NAME --full`) pieces back into a sweep folder,
so the next piece skips them.

    python3 dev/grid_restore.py runs/grid results/recall/full/piece1_config.json results/recall/full/piece1_results.jsonl ...
    python3 dev/grid_restore.py --lab state runs/lab_state results/state/full/piece1_config.json ...results.jsonl

For a lab (`--lab`: capacity, context, counters, heads, hybrid, pairs, state, stories, ttt), a row is restored only when its config
equals the target sweep's (config.json, or the lab's preset for a folder not yet started: FULL; counters: the state
lab's COUNTERS_FULL, heads: capacity_heads.HEADS_FULL; MODES) in every field but `workers` and the
fields the lab's module names in WHICH_FIELDS (state: tasks, models, seeds — which runs exist, each row naming its own:
a sweep that adds a task keeps the runs of the others), with the list fields it names in UNORDERED_FIELDS compared as
sets (pairs' lrs: pieces climbed in another lr order are restored).

The device machine starts bare on every call, so a piece's result.json files come back as one JSONL (`bash dev/gpu.sh
grid`) and are committed under results/recall/full/. Each JSONL sits beside the config its runs were trained with; a row
is restored only when that config equals the target sweep's — its config.json, or `evict recall --full`'s own
(recall.FULL) for a folder not yet started — in every field but the ones that choose *which* runs exist (archs,
settings, d_models, lrs, lr_order, seeds, workers) and chunk_size (the same sums, split at other places): those do
not change what one run trains. Runs already in the target folder
are left alone. Prints how many rows it restored.

A pairs ladder's finished rungs come back and are restored too (rows whose `dir` is LADDER/RUNG), so a ladder that a
device session leaves half-climbed continues on the next bare machine from its first rung not yet trained, instead of
from the bottom: a ladder at d 256 climbs to L 4,096 and may outlast one session's calls.

    python3 dev/grid_restore.py --finished runs/lab_pairs > rows.jsonl   # what a call sends back (dev/gpu.sh)
    python3 dev/grid_restore.py --mode counters                          # "state counters_full" (dev/gpu.sh lab)
"""

import dataclasses
import importlib
import json
import sys
from pathlib import Path

from evict.lab.sweep import EXECUTION_FIELDS, config_differences  # workers: how a sweep runs, not what it trains

WHICH = {"archs", "settings", "d_models", "lrs", "lr_order", "seeds", "chunk_size", *EXECUTION_FIELDS}
LABS = {"capacity": "capacity", "context": "context", "counters": "state", "heads": "capacity_heads", "hybrid": "hybrid",
        "pairs": "pairs", "state": "state", "stories": "switch", "ttt": "ttt"}  # a piece's name -> its module under evict/lab
# rows that are not training runs: the context lab's decode timings (ROOT/decode/MODEL/result.json), named "@decode/MODEL"
# ("@" is in no run's folder name), so that a piece's timed models come back and are not timed again
OTHER = {"@decode": "decode"}
# a piece's name for a lab's GPU mode other than --full -> (the lab as `evict lab` names it, the mode): its pieces run
# `evict lab LAB --MODE` (_ read as -) against the module's preset MODE.upper() and are committed in results/LAB/MODE/;
# every other name runs `evict lab NAME --full` against FULL, committed in results/NAME/full/ (mode_of)
MODES = {"counters": ("state", "counters_full"), "heads": ("capacity", "heads_full")}


def mode_of(lab: str) -> tuple[str, str]:
    """(the `evict lab` name, the mode) of a piece's name: ("state", "counters_full") for counters, ("capacity",
    "heads_full") for heads, else (NAME, "full")."""
    return MODES.get(lab, (lab, "full"))


def preset(lab: str):
    """The sweep a lab's pieces belong to unless a folder says otherwise: its module's preset of the piece's mode
    (FULL; counters: state.COUNTERS_FULL; heads: capacity_heads.HEADS_FULL)."""
    module = importlib.import_module(f"evict.lab.{LABS.get(lab, 'recall')}")
    return getattr(module, mode_of(lab)[1].upper())


def finished_rows(root: str | Path) -> list[dict]:
    """Every finished run under ROOT/runs as a row naming its folder (`dir`, relative to runs/): each run's
    result.json, and a pairs ladder's finished rungs (runs/LADDER/RUNG/result.json) as rows of dir LADDER/RUNG; then
    the OTHER rows (the context lab's timed models, ROOT/decode/MODEL/result.json, as dir "@decode/MODEL")."""
    runs = Path(root) / "runs"
    found = sorted([*runs.glob("*/result.json"), *runs.glob("*/*/result.json")])
    rows = [{**json.loads(f.read_text()), "dir": f.parent.relative_to(runs).as_posix()} for f in found]
    for tag, folder in OTHER.items():
        for f in sorted((Path(root) / folder).glob("*/result.json")):
            rows.append({**json.loads(f.read_text()), "dir": f"{tag}/{f.parent.name}"})
    return rows


def is_other(d: str) -> bool:
    """Whether a row's dir names an OTHER row (not a run, not a ladder's rung)."""
    return d.split("/")[0] in OTHER


def _folder(root: Path, d: object, where: str) -> Path:
    """A row's run folder under root/runs: one name, or LADDER/RUNG; never outside runs/. An OTHER row's ("@decode/M")
    is its folder under root (root/decode/M)."""
    parts = d.split("/") if isinstance(d, str) else []
    if not 1 <= len(parts) <= 2 or any(p in ("", ".", "..") or "\\" in p for p in parts):
        sys.exit(f"{where}: a row's \"dir\" must be a run folder (NAME or LADDER/RUNG), got {d!r}")
    if parts[0] in OTHER:
        if len(parts) != 2:
            sys.exit(f"{where}: a row's \"dir\" {d!r} names no folder after {parts[0]}/")
        return root / OTHER[parts[0]] / parts[1]
    return root / "runs" / Path(*parts)


def main(target: str, pairs: list[str], lab: str = "recall") -> None:
    module, full = importlib.import_module(f"evict.lab.{LABS.get(lab, 'recall')}"), preset(lab)
    which = WHICH if lab == "recall" else {*EXECUTION_FIELDS, *getattr(module, "WHICH_FIELDS", ())}
    unordered = getattr(module, "UNORDERED_FIELDS", ())  # pairs' lrs: their order says only which run goes first
    root = Path(target)
    cfg = root / "config.json"
    # fields a saved config predates take their defaults (as sweep_folder does), e.g. recall's gate_dt
    defaults = json.loads(json.dumps(dataclasses.asdict(type(full)())))
    want = {**defaults, **json.loads(cfg.read_text() if cfg.exists() else json.dumps(dataclasses.asdict(full)))}
    restored = markers = rungs = others = 0
    for cfg_path, rows_path in zip(pairs[::2], pairs[1::2]):
        got = {**defaults, **json.loads(Path(cfg_path).read_text())}
        differ = config_differences(want, got, which, unordered)
        if differ:
            sys.exit(f"{cfg_path}: trained with another config ({', '.join(differ)} differ); its runs are not restored")
        for line in Path(rows_path).read_text().splitlines():
            row = json.loads(line)
            d = row.pop("dir", None)
            out = _folder(root, d, rows_path) / "result.json"
            if lab == "recall":
                markers += _solved(root, row, want.get("target_accuracy", 0.99))
            if out.exists():
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(row, indent=2))
            restored += 1
            others += is_other(d)
            rungs += "/" in d and not is_other(d)
    print(f"restored {restored - rungs - others} finished runs into {root / 'runs'}"
          + (f", {markers} solved-cell markers" if markers else "")
          + (f", {rungs} finished rungs of ladders not finished" if rungs else "")
          + (f", {others} models' decode timings" if others else ""))


def _solved(root: Path, row: dict, target: float) -> int:
    """The cell's solved marker (recall.solved_marker) for a restored run that reached the target, so the next piece
    skips or stops the cell's other learning rates as the piece that solved it would have; 1 when written."""
    from evict.lab.recall import solved_marker

    if (row.get("accuracy") or 0) < target:
        return 0
    marker = solved_marker({**row, "seed": row.get("seed", 0), "seq_len": row["seq_len"], "solved_dir": str(root / "solved")})
    if marker is None or marker.exists():
        return 0
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"lr={row['lr']:g} (restored)\n")
    return 1


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    if sys.argv[1:2] == ["--finished"] and len(sys.argv) == 3:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in finished_rows(sys.argv[2])))
        sys.exit()
    if sys.argv[1:2] == ["--mode"] and len(sys.argv) == 3:
        if sys.argv[2] not in LABS:
            sys.exit(f"--mode: expected one of {sorted(LABS)}, got {sys.argv[2]!r}")
        print(*mode_of(sys.argv[2]))
        sys.exit()
    args, lab = sys.argv[1:], "recall"
    if args[:1] == ["--lab"]:
        lab, args = args[1], args[2:]
    if len(args) < 3 or len(args) % 2 == 0 or lab not in {"recall", *LABS}:
        sys.exit("usage: python3 dev/grid_restore.py [--lab NAME] SWEEP_DIR CONFIG.json RESULTS.jsonl [CONFIG.json "
                 "RESULTS.jsonl ...]  |  python3 dev/grid_restore.py --finished SWEEP_DIR  |  python3 "
                 "dev/grid_restore.py --mode NAME")
    main(args[0], args[1:], lab)
