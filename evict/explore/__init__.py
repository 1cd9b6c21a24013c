"""`evict explore`: the lesson as a local web app (eight chapters and a coda, eleven figures, five Mochi replays,
concept checks, the scorecard), every number computed by evict when asked.

    app.py       FastAPI app: the page, one JSON endpoint per figure, `serve` (uvicorn) and `running` (tests)
    board.py     whiteboard, delta stamp, history fold: the memory op at d = 4 (8), every cell at every step
    scale.py     memory wall, parameter accountant, layer map: the accountant on the meta device
    dial.py      chunk dial: the cost law and the chunked op's wall-clock per chunk size (measured once, cached)
    depth.py     depth lens: AttnRes weights and hidden-state RMS of two trained models (data/depth_lens.json)
    concepts.py  concept map: 18 ideas -> figures and commands
    lesson.py    the five Mochi replays (the ops, when asked) and the scorecard's measured column (data/scorecard.json)
    browser.py   Debian's Chromium through Playwright (the browser test, dev/screenshots.py)
    static/      index.html (the lesson's text), explore.js (hand-written SVG drawing), explore.css, favicon.svg:
                 no CDN, no build step
The fade curve and the twin boards come from evict/stories.py.
"""
