"""A stand-in for evict.serve.engine.Engine with no model (dev/serve_http_profile.py --stub-step-ms): each step hands
every running request its next token (token id = position % 256) through the same callbacks, then sleeps the given
milliseconds with the GIL free (a GPU step's wait), so the HTTP side's own cost per token is what is left."""

import itertools
import queue
import threading
import time

from evict.serve.engine import Request


class StubEngine:
    def __init__(self, step_s: float, max_batch: int, max_len: int = 1 << 20):
        self.step_s, self.max_batch, self.max_len = step_s, max_batch, max_len
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.ids = itertools.count()
        self.stats = {"generated_tokens": 0, "finished": 0, "requests": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt, params, on_token=None, on_finish=None) -> Request:
        req = Request(list(prompt), params, on_token, on_finish, id=next(self.ids))
        self.inbox.put(("add", req))
        return req

    def cancel(self, req: Request) -> None:
        self.inbox.put(("cancel", req))

    def _finish(self, r: Request, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        r.finish_reason = reason
        self.stats["finished"] += 1
        if r.on_finish is not None:
            r.on_finish(r)

    def step(self) -> bool:
        while not self.inbox.empty():
            verb, r = self.inbox.get()
            if verb == "add":
                self.waiting.append(r)
                self.stats["requests"] += 1
            elif r.finish_reason is None:
                self._finish(r, "cancelled")
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return False
        time.sleep(self.step_s)  # the device's part of a step, GIL free
        for r in list(self.running):
            t = (len(r.prompt) + len(r.out)) % 256
            r.out.append(t)
            self.stats["generated_tokens"] += 1
            if r.on_token is not None:
                r.on_token(r, t)
            if len(r.out) == r.params.max_tokens:
                self._finish(r, "length")
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                time.sleep(0.001)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="evict-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def warm_up(self) -> None:
        pass

    def metrics(self) -> dict:
        z = {k: 0 for k in ("running", "waiting", "requests", "finished", "cancelled", "preemptions", "prefill_tokens",
                            "tokens_per_second", "slots_used", "slots_total", "blocks_used", "blocks_total",
                            "pool_bytes", "pool_peak_used_bytes", "peak_memory_bytes")}
        return {**z, **self.stats}
