"""The engine in a child process (`evict serve --engine-process on`): the HTTP side (FastAPI's event loop, its JSON and
text) and the engine's host work (planning, sampling, emitting) then hold two GILs, not one.

The child is started with multiprocessing's spawn context (CUDA is initialised in the child only) and builds the model
and its Engine itself from the same parsed flags (evict.serve.load.build_engine): no model crosses a pipe. The server
holds an EngineClient, the Engine's surface that the server uses (submit, cancel, alive, start, stop, metrics,
max_len and the pool's sizes):

    server process                                  child process
    EngineClient.submit   ("submit", id, prompt, params) ->  command thread: Engine.submit (its callbacks gather events)
    EngineClient.cancel   ("cancel", id) ->                  command thread: Engine.cancel
    EngineClient.metrics  ("metrics", key) ->                command thread: ("metrics", key, Engine.metrics())
    reader thread         <- ("events", [a step's events])   engine thread, after each step (Engine.after_step)
    EngineClient.stop     one byte down a third pipe ->      main thread: Engine.stop, then the process exits

Each step's events (a token with its log-probability entry, or a finish with its reason and error; a request's prompt
log-probabilities with its first event) go up as ONE message; the reader thread hands them to the requests' on_token /
on_finish callbacks with a RemoteRequest, which has the attributes of engine.Request that the server reads. Requests
are checked at the client's door (engine.check_request: a bad field is a ValueError at once, as the Engine's). A child
that dies (killed, out of memory) fails every request in flight with an EngineDown error and `alive` turns false.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from evict.cli_args import first_line
from evict.serve.engine import EngineDown, SamplingParams, check_request
from evict.serve.launch import freeze_heap

log = logging.getLogger(__name__)
INFO = ("vocab", "max_len", "max_batch", "n_blocks", "block_size", "pool_bytes")  # the child's Engine's sizes
METRICS_TIMEOUT = 10.0  # seconds the client waits for the child's metrics


@dataclass(eq=False)
class RemoteRequest:
    """A request served by the child: what the server reads of an engine.Request, filled in from the child's events."""

    id: int
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[RemoteRequest, int], None] | None = None
    on_finish: Callable[[RemoteRequest], None] | None = None
    out: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class EngineClient:
    """An Engine in a child process, built there by `build(args)` (evict.serve.load.build_engine with the flags of
    evict.serve.load.add_engine_flags: passed in, so this module imports no loader); returns once the child's engine
    is built and warmed up (SystemExit with the child's one line if it could not be). `prepare`, a picklable function,
    runs first in the child (tests install a failing sampler there)."""

    def __init__(self, args: argparse.Namespace, *, build: Callable[[argparse.Namespace], tuple],
                 prepare: Callable[[], None] | None = None):
        ctx = mp.get_context("spawn")
        commands, self._commands = ctx.Pipe(duplex=False)  # (reader, writer)
        self._events, events = ctx.Pipe(duplex=False)
        stop, self._stop_pipe = ctx.Pipe(duplex=False)  # one byte: stop (not an mp.Event: a killed child would hang it)
        child_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "fn"})
        child_args.engine_process = "off"
        self.process = ctx.Process(target=child_main, args=(child_args, build, commands, events, stop, prepare),
                                   name="evict-engine", daemon=True)
        self.process.start()
        for end in (commands, events, stop):  # the child's ends: this process keeps none, so a dead child is an EOF here
            end.close()
        try:
            info = self._wait_ready()
        except BaseException:
            self.process.kill()
            self.process.join()
            raise
        self.vocab: int = info["vocab"]
        self.max_len: int = info["max_len"]
        self.max_batch: int = info["max_batch"]
        self.n_blocks: int = info["n_blocks"]
        self.block_size: int = info["block_size"]
        self.pool_bytes: int = info["pool_bytes"]
        self._lock = threading.Lock()  # the command pipe's writers; _requests, _replies and _closed
        self._requests: dict[int, RemoteRequest] = {}
        self._replies: dict[int, list] = {}  # metrics key -> [threading.Event, the child's dict or None]
        self._ids = itertools.count(1)
        self._started = self._stopping = self._closed = False
        self._engine_up = False
        self._reader = threading.Thread(target=self._read, name="evict-engine-events", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict:
        gone = lambda: SystemExit(f"serve: the engine process exited (code {self.process.exitcode}) before it was ready")
        while not self._events.poll(0.2):
            if not self.process.is_alive() and not self._events.poll(0):
                raise gone()
        try:
            kind, value = self._events.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise gone() from None
        if kind == "failed":
            self.process.join(5)
            raise SystemExit(value)
        return value

    # -- the Engine's surface -----------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, on_token=None, on_finish=None) -> RemoteRequest:
        check_request(prompt, params, vocab=self.vocab, max_len=self.max_len)
        if self._started and not self.alive:
            raise EngineDown("engine: not running (stopped, or its process died); see the server's log")
        req = RemoteRequest(next(self._ids), list(prompt), params, on_token, on_finish)
        with self._lock:
            if self._closed:
                raise EngineDown("engine: its process is gone; see the server's log")
            self._requests[req.id] = req
            self._send(("submit", req.id, req.prompt, params))
        return req

    def cancel(self, req: RemoteRequest) -> None:
        """Stop a request (client gone, stop text seen): the child frees its slot at its next step."""
        if req.finish_reason is None:
            with self._lock:
                if not self._closed:
                    self._send(("cancel", req.id))

    @property
    def alive(self) -> bool:
        """The child process runs, and its engine thread too (started, not stopped, not dead)."""
        return self._started and self._engine_up and not self._stopping and not self._exited(0)

    def _exited(self, timeout: float | None) -> bool:
        """The child has exited (waits up to `timeout` s). Its sentinel, not waitpid: only the reader thread reaps it
        (two threads in waitpid make multiprocessing see a reaped child as alive)."""
        return bool(wait([self.process.sentinel], timeout))

    def start(self) -> None:
        self._started = self._engine_up = True
        with self._lock:
            self._send(("start",))

    def stop(self, timeout: float | None = None) -> None:
        """The child's engine stops after its current step (its requests in flight get errors) and the child exits;
        `timeout`: seconds to wait for that (0: do not wait), then the child is killed and whatever is still in flight
        gets its error here."""
        if not self._stopping:  # not through the command pipe: this may run in a signal handler that interrupted a send
            self._stopping = True
            try:
                self._stop_pipe.send_bytes(b"s")
            except OSError:  # the child is gone
                pass
        if timeout == 0:
            return
        if not self._exited(timeout):
            log.warning("serve: the engine process did not stop within %s s; killed", timeout)
            self.process.kill()
            self._exited(5)
        self._reader.join(5)  # it reaps the child and fails what is still in flight

    def metrics(self) -> dict:
        """The child engine's metrics (a round trip: the caller waits for the child's answer)."""
        got: list = [threading.Event(), None]
        with self._lock:
            if self._closed:
                raise EngineDown("engine: its process is gone; see the server's log")
            key = next(self._ids)
            self._replies[key] = got
            self._send(("metrics", key))
        if not got[0].wait(METRICS_TIMEOUT) or got[1] is None:
            self._replies.pop(key, None)
            raise EngineDown(f"engine: its process gave no metrics within {METRICS_TIMEOUT} s")
        return got[1]

    # -- the pipes ----------------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:  # under self._lock
        try:
            self._commands.send(msg)
        except OSError:  # the child is gone: the reader fails what is in flight
            pass

    def _read(self) -> None:
        """The reader thread: the child's messages until it exits; then every request in flight gets an error."""
        try:
            while True:
                msg = self._events.recv()
                if msg[0] == "events":
                    self._dispatch(msg[1])
                elif msg[0] == "metrics":
                    got = self._replies.pop(msg[1], None)
                    if got is not None:
                        got[1] = msg[2]
                        got[0].set()
                elif msg[0] == "down":
                    self._engine_up = False
        except (EOFError, OSError):
            pass
        except Exception as e:  # a message that could not be read: the child is unusable
            log.error("serve: the engine process's messages failed (%s: %s)", type(e).__name__, first_line(e))
        self._engine_up = False
        if self._exited(5):  # its sentinel is ready once its pipes close, a moment before the kernel can reap it:
            self.process.join(5)  # wait for that (join(0) could leave exitcode None); reaped here only
        why = "the server is shutting down" if self._stopping else \
            f"the engine process died (exit code {self.process.exitcode}); see the server's log"
        with self._lock:
            self._closed = True
            left, self._requests = list(self._requests.values()), {}
            for got in self._replies.values():
                got[0].set()
        if left and not self._stopping:
            log.error("serve: %s; its %d requests in flight get an error", why, len(left))
        for r in left:
            self._finish(r, "error", f"{EngineDown.__name__}: {why}")

    def _dispatch(self, events: list[tuple]) -> None:
        """One step's events: (id, token, log-probability entry or None, prompt log-probabilities or None) or
        (id, -1, (finish reason, error), prompt log-probabilities or None)."""
        for rid, t, x, plp in events:
            r = self._requests.get(rid)
            if r is None:
                continue
            if plp is not None:
                r.prompt_logprobs = plp
            if t >= 0:
                r.out.append(t)
                if x is not None:
                    r.logprobs.append(x)
                if r.on_token is not None:
                    try:
                        r.on_token(r, t)
                    except Exception as e:
                        log.error("serve: request %d's on_token failed (%s)", rid, first_line(e))
            else:
                del self._requests[rid]
                self._finish(r, *x)

    @staticmethod
    def _finish(r: RemoteRequest, reason: str, error: str | None) -> None:
        r.finish_reason, r.error = reason, error
        if r.on_finish is not None:
            try:
                r.on_finish(r)
            except Exception as e:
                log.error("serve: request %d's on_finish failed (%s)", r.id, first_line(e))


# -- the child process ----------------------------------------------------------------------------------------------
def child_main(args: argparse.Namespace, build: Callable[[argparse.Namespace], tuple], commands, events, stop,
               prepare: Callable[[], None] | None) -> None:
    """The child: build the engine (`build(args)`: engine, tokenizer, name), answer the client's commands, send each
    step's events; exit when `stop` gets its byte or the server process is gone (its end closed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    if prepare is not None:
        prepare()
    try:
        engine, _, _ = build(args)
    except SystemExit as e:
        events.send(("failed", str(e.code)))
        return
    except Exception as e:
        events.send(("failed", f"serve: the engine could not be built ({type(e).__name__}: {first_line(e)})"))
        raise
    child = Child(engine, events)
    freeze_heap()  # the model is built: full collections no longer walk it
    try:
        events.send(("ready", {k: getattr(engine, k) for k in INFO}))
    except OSError:  # the server process went away while the engine was built
        os._exit(0)
    threading.Thread(target=child.commands, args=(commands,), name="evict-engine-commands", daemon=True).start()
    stop.poll(None)
    engine.stop()  # its thread fails what is in flight, then after_step sends those errors
    child.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (seconds of freeing tensors on a busy host): everything is sent


class Child:
    """The child's side: its engine's callbacks gather events; after each step they go up as one message."""

    def __init__(self, engine, events):
        self.engine, self.events = engine, events
        self.lock = threading.Lock()  # the event pipe's writers: the engine thread, the command thread
        self.batch: list[tuple] = []  # this step's events (the engine thread appends and sends them)
        self.reqs: dict = {}  # id -> engine.Request
        self.sent_prompt: set[int] = set()  # requests whose prompt log-probabilities went up
        self.started = self.down = False
        engine.after_step = self.flush

    def send(self, msg: tuple) -> None:
        with self.lock:
            try:
                self.events.send(msg)
            except OSError:  # the server process is gone: the main thread sees the stop pipe's end closed
                pass

    def flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self.send(("events", batch))
        if self.started and not self.down and not self.engine.alive:
            self.down = True
            self.send(("down",))

    def _prompt_lp(self, r):
        """r's prompt log-probabilities with its first event (then it has read its prompt), else None."""
        if r.params.prompt_logprobs is None or r.id in self.sent_prompt:
            return None
        self.sent_prompt.add(r.id)
        return r.prompt_logprobs

    def submit(self, rid: int, prompt: list[int], params: SamplingParams) -> None:
        def on_token(r, t: int) -> None:
            self.batch.append((rid, t, r.logprobs[-1] if r.params.logprobs is not None else None, self._prompt_lp(r)))

        def on_finish(r) -> None:
            self.reqs.pop(rid, None)
            self.batch.append((rid, -1, (r.finish_reason, r.error), self._prompt_lp(r)))
            self.sent_prompt.discard(r.id)

        try:
            req = self.engine.submit(prompt, params, on_token=on_token, on_finish=on_finish)
        except (ValueError, EngineDown) as e:
            self.send(("events", [(rid, -1, ("error", f"{type(e).__name__}: {first_line(e)}"), None)]))
            return
        self.reqs[rid] = req
        if req.finish_reason is not None:  # finished before it was filed
            self.reqs.pop(rid, None)

    def commands(self, conn) -> None:
        """The command thread: the client's messages until the server process is gone."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the server process is gone: the main thread sees the stop pipe's end closed
                return
            try:
                self.command(msg)
            except Exception as e:  # a bug here must not leave the server waiting for answers: log it, go on
                log.error("serve: the engine process's command %s failed (%s: %s)", msg[0], type(e).__name__,
                          first_line(e))

    def command(self, msg: tuple) -> None:
        if msg[0] == "submit":
            self.submit(*msg[1:])
        elif msg[0] == "cancel":
            if (req := self.reqs.get(msg[1])) is not None:
                self.engine.cancel(req)
        elif msg[0] == "metrics":
            self.send(("metrics", msg[1], self.engine.metrics()))
        elif msg[0] == "start":
            self.started = True
            self.engine.start()
