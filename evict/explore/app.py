"""`evict explore`: the lesson's figures as a local web app. FastAPI serves one page (HTML + SVG drawn by a little
hand-written JavaScript, shipped in evict/explore/static: no CDN, works offline) and one JSON endpoint per figure,
each computed by evict when asked.

    create_app(dial=Dial(), cache_dir=None) -> FastAPI app
    serve(host, port)                        -> runs it with uvicorn (blocks)
    running(app)                             -> context manager: served on a free port on a thread, yields the URL

Endpoints (GET unless noted; a bad query value is HTTP 422 with a one-line "detail"):
    /api/concepts                 concept map            /api/memory-wall?context=N      memory wall
    /api/history-fold?step=t      history fold           /api/whiteboard?writes=cat,dog&read=cat
    /api/delta-stamp?beta=1       delta stamp            /api/chunk-dial?C=64 (+ POST /api/chunk-dial/measure,
    /api/fade-curve?slam=0.2      fade curve               GET /api/chunk-dial/progress)
    /api/twin-boards              twin boards            /api/params?view=stored|active|ratio
    /api/layers                   layer map              /api/depth-lens
    /api/replay/{n}?shelf=N       Mochi replay n (1 … 5)  /api/scorecard                  the scorecard's rows
    /results/{path}               the lab's committed results the scorecard cites (a checkout's results/recall/full/)
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from evict import stories
from evict.explore import board, concepts, depth, dial, lesson, scale

STATIC = Path(__file__).resolve().parent / "static"
RESULTS = Path(__file__).resolve().parents[2] / "results" / "recall" / "full"  # present in a checkout (editable install)
SURVIVAL_EXAMPLE = {3: 0.9, 4: 0.5, 5: 0.9}  # gates right after Mochi's write: survival = their product


def _fade(slam: float) -> dict:
    gates = [1.0] * stories.TOKENS
    for t, g in SURVIVAL_EXAMPLE.items():
        gates[t] = g
    example = stories.fade_curve(gates=gates)
    return {**stories.fade_curve(slam), "example": {"gates": SURVIVAL_EXAMPLE,
                                                   "survival": example["survival"]["mochi"][stories.QUERY]}}


def create_app(dial_shape: dial.Dial | None = None, cache_dir: Path | None = None, warm: bool = True) -> FastAPI:
    """The app. `dial_shape`: the chunk dial's measured shape (default Dial()); `cache_dir`: where its measurement is
    cached (default ~/.cache/evict/explore); `warm`: build the accountant's models on a thread at once."""
    shape = dial_shape or dial.Dial()
    app = FastAPI(title="evict explore", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_error_handlers(app)
    _add_page_routes(app)
    _add_board_routes(app)
    _add_dial_routes(app, shape, dial.Measurer(shape, cache_dir))
    _add_lesson_routes(app)
    if warm:  # K3 takes seconds to build even on the meta device: start before the first page asks
        threading.Thread(target=lambda: [scale.meta_model(n) for n in scale.MODELS], daemon=True).start()
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """A bad value or type in a query: HTTP 422 with a one-line "detail"."""

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError):
        return JSONResponse(status_code=422, content={"detail": " ".join(str(exc).split())})

    @app.exception_handler(RequestValidationError)
    async def bad_type(request: Request, exc: RequestValidationError):  # one line, as every other bad value
        e = exc.errors()[0]
        return JSONResponse(status_code=422, content={"detail": f"{e['loc'][-1]}: {e['msg'].lower()}, got {e.get('input')!r}"})


def _add_page_routes(app: FastAPI) -> None:
    """The page, the concept map, the favicon."""

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC / "index.html")

    @app.get("/api/concepts")
    def concept_map():
        return concepts.concept_map()

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


def _add_board_routes(app: FastAPI) -> None:
    """The memory wall and the whiteboard figures."""

    @app.get("/api/memory-wall")
    def memory_wall(context: int = 1024, curves: bool = True):
        return scale.memory_wall(context, curves)

    @app.get("/api/history-fold")
    def history_fold(step: int = 1):
        return board.history_fold(step)

    @app.get("/api/whiteboard")
    def whiteboard(writes: str = "cat,dog", read: str = "cat"):
        return board.whiteboard([w for w in writes.split(",") if w], read)

    @app.get("/api/delta-stamp")
    def delta_stamp(beta: float = 1.0):
        return board.delta_stamp(beta)


def _add_dial_routes(app: FastAPI, shape: dial.Dial, measurer: dial.Measurer) -> None:
    """The chunk dial: its cost law, and its CPU measurement (started by POST, polled)."""

    @app.get("/api/chunk-dial")
    def chunk_dial(C: int = 64):
        return {"shape": {"T": shape.T, "H": shape.H, "D": shape.D, "B": shape.B}, "sizes": shape.sizes(),
                "at": dial.cost(shape, C), "law": [dial.cost(shape, c) for c in shape.sizes()],
                "cpu": measurer.result(), "progress": measurer.state(), "gpu": dial.gpu_numbers()}

    @app.post("/api/chunk-dial/measure")
    def chunk_dial_measure():
        return measurer.start()

    @app.get("/api/chunk-dial/progress")
    def chunk_dial_progress():
        return measurer.state()


def _add_lesson_routes(app: FastAPI) -> None:
    """Fade curve, twin boards, the accountant, depth lens, Mochi's replays, the scorecard and its result files."""

    @app.get("/api/fade-curve")
    def fade_curve(slam: float = 0.2):
        return _fade(slam)

    @app.get("/api/twin-boards")
    def twin_boards(keep: float = 0.95, clear: float = 0.1):
        return stories.twin_boards(keep=keep, clear=clear)

    @app.get("/api/params")
    def params(view: str = "stored"):
        return scale.params(view)

    @app.get("/api/layers")
    def layers():
        return scale.layer_map()

    @app.get("/api/depth-lens")
    def depth_lens():
        return depth.load()

    @app.get("/api/replay/{n}")
    def replay(n: int, shelf: int = 1024):
        return lesson.replay(n, shelf=shelf)

    @app.get("/api/scorecard")
    def scorecard():
        return lesson.scorecard()

    app.get("/results/{path:path}", include_in_schema=False)(results)


def results(path: str, line: int | None = None):
    """A committed result file of results/recall/full/, or with `line` (1-based) that one run's JSON row."""
    file = (RESULTS / path).resolve()
    if not (file.is_relative_to(RESULTS) and file.is_file()):
        return JSONResponse(status_code=404, content={"detail": f"path: no committed result {path!r} here (results/recall/full/ "
                                                                "comes with a checkout of evict, not a wheel)"})
    if line is None:
        return FileResponse(file, media_type="text/plain; charset=utf-8")
    rows = file.read_text().splitlines()
    if not 1 <= line <= len(rows):
        raise ValueError(f"line: expected 1 to {len(rows)} for {path}, got {line}")
    return JSONResponse(json.loads(rows[line - 1]))


def serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    print(f"evict explore: http://{host}:{port}/  (Ctrl-C to stop)", flush=True)
    uvicorn.run(create_app(), host=host, port=port, log_level="warning")


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", timeout: float = 30.0):
    """Serve `app` with uvicorn on a free port on a thread; yields the base URL (for the browser test and screenshots)."""
    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="explore-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"explore: the server did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
