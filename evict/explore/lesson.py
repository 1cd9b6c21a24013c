"""The lesson's spine around the figures: the five Mochi replays, computed by evict's ops when asked, and the
scorecard's measured column, read out of the lab's committed MQAR results.

    replay(n, shelf=1024)   replay n (1 … 5) of the running story: the numbers each chapter's replay shows
    scorecard()             the eight rows (stores / write / read / eviction) and each one's measured MQAR accuracy
    measured(docs)          that column recomputed from results/recall/full/*.jsonl (the test checks the committed copy)

Replays (d = 4, row vectors, scale 1): 1 softmax attention over a shelf of `shelf` tokens (evict.ops.attention);
2 linear attention's blur and 3 the delta correction (evict.explore.board, through memory_step); 4 one scalar gate
slammed at the switch and 5 four per-channel gates plus an MLA-style exact shelf (evict.stories, evict.ops.attention).
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import cast

import torch

from evict import stories
from evict.explore import board
from evict.jsonfile import read_json_object
from evict.ops import attention

SHELF_MIN, SHELF_MAX = 4, 65_536
SCORE_GAP = 4.0  # replay 1: q = 4 · k_cat, so Mochi's score is 4 and every key orthogonal to cat scores 0
MLA_GAP = 12.0  # replay 5: the MLA layer's sharper query (its learned scale): Mochi's weight ≈ 1 − 2e-5 per junk row
DATA = "data/scorecard.json"
SETTING = {"seq_len": 512, "pairs": 64, "d_model": 64}  # the hardest grid setting, where the rows differ most
SOURCES = {"full/results.jsonl": "evict recall --full (336 runs, results/recall/full/README.md)",
           "full/side_mla/results.jsonl": "evict recall --full --archs mla (the MLA side experiment)"}
ROWS = (  # (name, chapter, stores, write, read, eviction, lab arch or None)
    ("GPT-2", 1, "every k, v: O(N)", "append", "softmax over all", "none", "attention"),
    ("linear attention", 2, "fixed d×d", "add kᵀv", "qS, blended", "accidental", "linear"),
    ("DeltaNet", 3, "fixed d×d", "erase, then write", "qS", "targeted replace", "deltanet"),
    ("Gated DeltaNet", 5, "fixed d×d", "fade · erase · write", "qS", "replace + global decay", "gated_deltanet"),
    ("KDA", 6, "fixed d×d", "per-channel fade · erase · write", "qS", "replace + per-channel decay", "kda"),
    ("MLA", 6, "compressed latents, O(N), ≈ 28× smaller", "append a latent", "softmax", "none, smaller rent", "mla"),
    ("Kimi Linear 3:1", 6, "both", "both", "both", "a policy where cheap, a shelf where sharp", "kimi_linear"),
    ("K3", 7, "states + shelves + experts + depth snapshots", "+ routing", "+ attention over depth", "four policies", None),
)


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _softmax_read(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> tuple[list[float], list[float]]:
    """One query over a shelf, by evict.ops.attention (float64): the read, and each row's weight (the values are
    extended by one-hot columns for the rows asked about, so the op itself returns their weights)."""
    n = keys.shape[0]
    probe = torch.eye(n, dtype=torch.float64)[:, :min(n, 3)]  # weights of rows 0, 1, 2 come out as extra value columns
    v = torch.cat([values, probe], dim=-1)
    o = attention(query[None, None, None], keys[None, :, None], v[None, :, None], causal=False, scale=1.0)[0, 0, 0]
    return o[: values.shape[1]].tolist(), o[values.shape[1]:].tolist()


def _shelf(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cat → Mochi, dog → Rex, then n − 2 filler rows whose unit keys are orthogonal to k_cat (channels 1–3)."""
    g = torch.Generator().manual_seed(0)
    fill_k = torch.nn.functional.normalize(torch.randn(n - 2, 3, generator=g, dtype=torch.float64), dim=-1)
    fill_k = torch.cat([torch.zeros(n - 2, 1, dtype=torch.float64), fill_k], dim=-1)
    fill_v = torch.randn(n - 2, 4, generator=g, dtype=torch.float64)
    keys = torch.cat([_t([stories.K_CAT, stories.K_DOG]), fill_k])
    values = torch.cat([_t([stories.V_MOCHI, stories.V_REX]), fill_v])
    return keys, values


def _replay1(shelf: int) -> dict:
    if type(shelf) is not int or not SHELF_MIN <= shelf <= SHELF_MAX:
        raise ValueError(f"shelf: expected an integer from {SHELF_MIN} to {SHELF_MAX:,}, got {shelf!r}")
    keys, values = _shelf(shelf)
    read, w = _softmax_read(keys, values, SCORE_GAP * _t(stories.K_CAT))
    return {"shelf": shelf, "score_gap": SCORE_GAP, "read": read, "w_mochi": w[0], "w_rex": w[1], "w_filler": w[2],
            "ratio": w[0] / w[2], "e_gap": math.exp(SCORE_GAP),
            "bytes_read": shelf * 2 * stories.D * 2}  # every row's key and value, 16-bit, read for one token


def _replay3() -> dict:
    stamp = board.delta_stamp(1.0)
    S = board._write(board._write(board._empty(), board.KEYS["cat"], board.VALUES["Mochi"]), board.KEYS["tax"],
                     board.VALUES["tax form"])
    additive = board._read(board._write(S, board.KEYS["cat"], board.VALUES["Biscuit"]), board.KEYS["cat"])
    # the contaminated board: cat and dog overlap (0.6); correcting cat fixes cat exactly and moves dog's read
    dirty = board._write(board._write(board._empty(), board.KEYS["cat"], board.VALUES["Mochi"]), board.KEYS["dog"], board.VALUES["Rex"])
    fixed = board._write(dirty, board.KEYS["cat"], board.VALUES["Biscuit"], beta=1.0, delta=True)
    contaminated = {"cat_before": board._read(dirty, board.KEYS["cat"]), "cat_after": board._read(fixed, board.KEYS["cat"]),
                    "dog_before": board._read(dirty, board.KEYS["dog"]), "dog_after": board._read(fixed, board.KEYS["dog"])}
    return {"delta_read": stamp["read_after"]["cat"], "additive_read": additive, "tax_read": stamp["read_after"]["tax"],
            "biscuit": board.VALUES["Biscuit"], "tax": board.VALUES["tax form"], "contaminated": contaminated}


def _replay5() -> dict:
    t = stories.twin_boards()
    pc = t["per_channel"]
    facts = stories.FACTS
    keys = _t([facts[n][1] for n in ("mochi", "junk", "tax")])  # the shelf an MLA layer keeps: every written row, exact
    values = _t([facts[n][2] for n in ("mochi", "junk", "tax")])
    read, w = _softmax_read(keys, values, MLA_GAP * _t(stories.K_CAT))
    return {"kda_mochi": pc["survival"]["mochi"][stories.QUERY], "kda_junk": pc["survival"]["junk"][stories.QUERY],
            "kda_read": pc["read_cat"], "shelf_row": values[0].tolist(), "mla_read": read, "mla_w_mochi": w[0],
            "mla_gap": MLA_GAP, "mochi": list(stories.V_MOCHI)}


def replay(n: int, shelf: int = 1024) -> dict:
    """Replay `n` of the Mochi story (see the module docstring), computed now."""
    if n == 1:
        return {"n": 1, **_replay1(shelf)}
    if n == 2:
        wb = board.whiteboard(["cat", "dog"], "cat")
        return {"n": 2, "read": wb["o"], "error": wb["error"], "terms": wb["terms"], "mochi": board.VALUES["Mochi"]}
    if n == 3:
        return {"n": 3, **_replay3()}
    if n == 4:
        f = stories.fade_curve(0.2)
        base = stories.fade_curve(1.0)
        q = stories.QUERY
        return {"n": 4, "slam": 0.2, "mochi": f["survival"]["mochi"][q], "junk": f["survival"]["junk"][q],
                "mochi_no_slam": base["survival"]["mochi"][q], "junk_no_slam": base["survival"]["junk"][q],
                "read": f["read_cat"]}
    if n == 5:
        return {"n": 5, **_replay5()}
    raise ValueError(f"n: expected a replay from 1 to 5, got {n!r}")


def measured(docs: Path) -> dict:
    """Best MQAR accuracy over learning rates per architecture at SETTING, from the lab's committed JSONL files under
    `docs` (results/recall/ of a checkout), with the run that produced it (its file and line)."""
    best: dict[str, dict] = {}
    for rel in SOURCES:
        path = docs / rel
        if not path.is_file():
            raise ValueError(f"docs: {path} is missing (the scorecard reads the lab's committed results)")
        for number, line in enumerate(path.read_text().splitlines(), 1):
            r = json.loads(line)
            if any(r.get(k) != v for k, v in SETTING.items()) or r.get("accuracy") is None:
                continue
            if r["arch"] not in best or r["accuracy"] > best[r["arch"]]["accuracy"]:
                best[r["arch"]] = {"accuracy": r["accuracy"], "lr": r["lr"], "steps": r["steps"], "seed": r["seed"],
                                   "source": "results/recall/" + rel, "line": number, "command": SOURCES[rel]}
    return {"setting": SETTING, "best": dict(sorted(best.items()))}


def scorecard() -> dict:
    """The eight rows and their measured column (from the committed evict/explore/data/scorecard.json)."""
    path = resources.files("evict.explore").joinpath(DATA)
    data = read_json_object(cast(Path, path), "scorecard")
    best = data.get("best", {})
    rows = [{"name": name, "chapter": ch, "stores": st, "write": wr, "read": rd, "eviction": ev, "arch": arch,
             "measured": best.get(arch) if arch else None} for name, ch, st, wr, rd, ev, arch in ROWS]
    return {"setting": data.get("setting"), "rows": rows}


if __name__ == "__main__":  # python -m evict.explore.lesson RESULTS: rewrite data/scorecard.json from the lab's results
    import sys

    out = Path(__file__).resolve().parent / DATA
    out.write_text(json.dumps(measured(Path(sys.argv[1] if len(sys.argv) > 1 else "results/recall")), indent=1) + "\n")
    print(out)
