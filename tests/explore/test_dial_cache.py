"""A damaged chunk-dial cache (wrong shape, non-numbers, NaN, negative times) is not served: it is measured again."""

import json
from dataclasses import asdict

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from evict.explore import dial  # noqa: E402
from evict.explore.app import create_app  # noqa: E402

SMALL = dial.Dial(T=8, H=1, D=4, repeats=1)


def _good():
    return {"sizes": SMALL.sizes(), "seconds": [1e-3] * len(SMALL.sizes()), "shape": asdict(SMALL), "card": {}}


@pytest.mark.parametrize("damage", [
    lambda d: d.update(seconds=[float("nan")] + d["seconds"][1:]),
    lambda d: d.update(seconds=[float("inf")] + d["seconds"][1:]),
    lambda d: d.update(seconds=[-1.0] + d["seconds"][1:]),
    lambda d: d.update(seconds=["fast"] + d["seconds"][1:]),
    lambda d: d.update(seconds=[True] + d["seconds"][1:]),
    lambda d: d.update(seconds=None),
    lambda d: d.update(shape={**d["shape"], "D": 64}),
    lambda d: d.pop("shape"),
])
def test_a_damaged_cache_is_not_served(tmp_path, damage):
    m = dial.Measurer(SMALL, tmp_path)
    m.path.parent.mkdir(parents=True, exist_ok=True)
    m.path.write_text(json.dumps(_good()))
    assert m.result() == _good()  # the undamaged one is served
    data = _good()
    damage(data)
    m.path.write_text(json.dumps(data))  # json writes NaN and Infinity as Python reads them back
    assert m.result() is None and m.state()["status"] == "idle"


def test_nan_in_the_cache_does_not_break_a_valid_request(tmp_path):
    client = TestClient(create_app(SMALL, cache_dir=tmp_path, warm=False))
    m = dial.Measurer(SMALL, tmp_path)
    m.path.parent.mkdir(parents=True, exist_ok=True)
    data = _good()
    data["seconds"][2] = float("nan")
    m.path.write_text(json.dumps(data))
    r = client.get("/api/chunk-dial", params={"C": 4})
    assert r.status_code == 200 and r.json()["cpu"] is None and r.json()["progress"]["status"] == "idle"
    client.post("/api/chunk-dial/measure")  # and measuring again replaces it
    for _ in range(600):
        if client.get("/api/chunk-dial/progress").json()["status"] != "running":
            break
        __import__("time").sleep(0.1)
    cpu = client.get("/api/chunk-dial", params={"C": 4}).json()["cpu"]
    assert cpu is not None and all(s > 0 for s in cpu["seconds"])
