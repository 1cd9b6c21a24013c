"""Async steps (`Engine(async_steps=True)`): step n + 1 is launched before the host reads step n's tokens, a decode
row's token in flight is read from the device (`Engine.feed`), and stop tokens, max_tokens, failures and cancels are
resolved one step late. Against the synchronous engine and `generate` alone (greedy, float32): same tokens, same
callbacks, the one extra token of a request that stopped computed and never emitted. (The greedy-equality tests of
test_engine.py and test_engine_packed.py also run with async steps: preemption, packed steps, prompt logprobs.)"""

import collections
import time

from evict.serve import engine as engine_module
from evict.serve.engine import Engine, SamplingParams
from tests.serve.conftest import FAILING_TEMPERATURE
from tests.serve.test_engine import alone, budget, requests, tiny


def rows_run(eng: Engine) -> collections.Counter:
    """Counts, per request id, the forward rows run for it (decode rows and prompt chunks): wraps the engine's two
    forwards."""
    count: collections.Counter = collections.Counter()
    decode, packed = eng._decode, eng._packed

    def spy_decode(reqs):
        count.update(r.id for r in reqs)
        return decode(reqs)

    def spy_packed(reqs, chunks):
        count.update([r.id for r in reqs] + [r.id for r, _ in chunks])
        return packed(reqs, chunks)

    eng._decode, eng._packed = spy_decode, spy_packed  # type: ignore[method-assign]
    return count


def test_tokens_in_flight_feed_the_next_step(monkeypatch, one_thread):
    """With async steps most decode rows' input tokens are not on the host when their step is launched (read from
    `feed` on the device); synchronously none is. Outputs equal `generate` alone either way."""
    seen = []
    real = engine_module.fed
    monkeypatch.setattr(engine_module, "fed", lambda t, feed, slots: seen.append(int((t < 0).sum())) or real(t, feed, slots))
    model = tiny("kimi_linear", n_layers=2)
    for async_steps in (False, True):
        seen.clear()
        eng = Engine(model, max_batch=4, cache_budget=1 << 22, block_size=8, prefill_chunk=16, async_steps=async_steps)
        reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in requests(6, seed=3)]
        eng.run_until_idle()
        assert all(r.out == alone(model, p, n, 16) for p, n, r in reqs)
        assert all(r.inflight == 0 for _, _, r in reqs) and eng.pending is None
        if async_steps:
            assert sum(seen) > eng.stats["generated_tokens"] // 2, (sum(seen), eng.stats)
        else:
            assert seen == []


def test_stop_max_tokens_and_eos_resolved_a_step_late(one_thread):
    """Four requests decode together: one ends on a stop token, one on max_tokens, one on its end-of-text token (the
    server passes EOS as a stop token), one runs on. Async: the same outputs, finish reasons and callbacks as the
    synchronous engine (every on_token before the one on_finish, none after); the stopped requests ran exactly one
    extra row (their next token, computed before the stop was read, dropped), the max_tokens one none (the host knows
    the count); the long one is still running when the others finish, and equals `generate` alone."""
    model = tiny("kimi_linear", n_layers=2)
    p_stop, p_eos, p_len, p_long = [1, 2, 3], [40, 41], [7, 8, 9, 10], [200, 3]
    g_stop, g_eos = alone(model, p_stop, 12, 16), alone(model, p_eos, 12, 16)
    stop, eos = g_stop[3], g_eos[5]
    runs = {}
    for async_steps in (False, True):
        eng = Engine(model, max_batch=4, cache_budget=1 << 22, block_size=8, prefill_chunk=16, async_steps=async_steps)
        count = rows_run(eng)
        events: list = []
        on_token = lambda r, t: events.append((r.id, "token", t))  # noqa: E731
        on_finish = lambda r: events.append((r.id, "finish", r.finish_reason, long_r.finish_reason))  # noqa: E731
        params = [(p_stop, SamplingParams(max_tokens=12, temperature=0, stop_tokens=(stop,))),
                  (p_eos, SamplingParams(max_tokens=12, temperature=0, stop_tokens=(eos,))),
                  (p_len, SamplingParams(max_tokens=5, temperature=0)), (p_long, SamplingParams(max_tokens=20, temperature=0))]
        reqs = [eng.submit(p, sp, on_token=on_token, on_finish=on_finish) for p, sp in params]
        long_r = reqs[3]
        eng.run_until_idle()
        runs[async_steps] = ([(r.out, r.finish_reason) for r in reqs], [count[r.id] for r in reqs], events, reqs)
    (outs, rows, events, reqs), (a_outs, a_rows, a_events, a_reqs) = runs[False], runs[True]
    assert a_outs == outs
    assert outs[0] == (g_stop[: g_stop.index(stop) + 1], "stop") and outs[1] == (g_eos[: g_eos.index(eos) + 1], "stop")
    assert outs[2] == (alone(model, p_len, 5, 16), "length") and outs[3] == (alone(model, p_long, 20, 16), "length")
    assert a_rows == [rows[0] + 1, rows[1] + 1, rows[2], rows[3]], (rows, a_rows)
    for evs, rs in ((events, reqs), (a_events, a_reqs)):
        for r in rs:
            mine = [e for e in evs if e[0] == r.id]
            assert [e[2] for e in mine[:-1]] == r.out and mine[-1][1:3] == ("finish", r.finish_reason)
        assert all(e[3] is None for e in evs if e[1] == "finish" and e[0] != rs[3].id)  # the long one still runs


def test_penalties_logprobs_and_seeded_sampling_equal_synchronous(one_thread):
    """Sampled requests (seeded; penalties, logit_bias, min_p; logprobs) give the same tokens and log-probabilities
    with async steps as without: each token is recorded in its request's penalties when drawn, before the next draw
    (the last request would repeat its first token if its penalty were recorded when the host reads it)."""
    model = tiny("kda", n_layers=2)
    params = [SamplingParams(max_tokens=14, temperature=0.9, seed=3, presence_penalty=1.5, frequency_penalty=0.5,
                             logprobs=3),
              SamplingParams(max_tokens=11, temperature=0.7, seed=4, repetition_penalty=1.3, min_p=0.05,
                             logit_bias=((5, 3.0),)),
              SamplingParams(max_tokens=9, temperature=0, repetition_penalty=2.0, logprobs=0),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=8),
              SamplingParams(max_tokens=8, temperature=0, repetition_penalty=100.0, logit_bias=((5, 50.0),))]
    got = {}
    for async_steps in (False, True):
        eng = Engine(model, max_batch=5, cache_budget=1 << 22, async_steps=async_steps)
        reqs = [eng.submit([9, 9, i], p) for i, p in enumerate(params)]
        eng.run_until_idle()
        got[async_steps] = [(r.out, r.logprobs, r.finish_reason) for r in reqs]
    assert got[True] == got[False]
    assert len(got[True][0][1]) == 14 and len(got[True][0][1][0][1]) == 3 and got[True][2][1][0][1] == []
    out = got[True][4][0]  # token 5 first (+50), then never again (seen: its logit / 100): a penalty read late repeats it
    assert out[0] == 5 and 5 not in out[1:], out


def test_failing_sampler_fails_only_its_request(flaky_sampler, one_thread):
    """A request whose sampling raises fails alone (finish_reason "error", the error kept; no token emitted), its
    slot and blocks freed; the requests decoding beside it finish and equal `generate`."""
    model = tiny("attention", n_layers=2)
    eng = Engine(model, max_batch=4, cache_budget=budget(model, 4, 8, 16), block_size=8, async_steps=True)
    ok = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in requests(5, seed=7)]
    for _ in range(4):
        eng.step()  # the others are decoding, their tokens in flight
    bad = eng.submit([1, 2, 3], SamplingParams(max_tokens=8, temperature=FAILING_TEMPERATURE))
    eng.run_until_idle()
    assert bad.finish_reason == "error" and "injected sampler failure" in (bad.error or "") and bad.out == []
    for p, n, r in ok:
        assert r.finish_reason == "length" and r.out == alone(model, p, n, 512)
    assert len(eng.free_slots) == 4 and len(eng.free_blocks) == eng.n_blocks and not eng.running


def test_cancel_while_a_token_is_in_flight(one_thread):
    """A request cancelled between steps (a client gone) while its token is in flight: finished "cancelled" at once,
    slot and blocks freed; the token in flight never reaches its client (no on_token after on_finish); the request
    beside it runs on and equals `generate` alone."""
    model = tiny("kimi_linear", n_layers=2)
    eng = Engine(model, max_batch=2, cache_budget=budget(model, 2, 8, 12), block_size=8, async_steps=True)
    events: list = []
    gone = eng.submit(list(range(20)), SamplingParams(max_tokens=40, temperature=0),
                      on_token=lambda r, t: events.append("token"), on_finish=lambda r: events.append("finish"))
    stays = eng.submit([5, 6, 7], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(6):
        eng.step()
    assert gone.inflight == 1 and eng.pending is not None and gone in eng.pending.reqs
    eng.cancel(gone)
    eng.step()
    assert gone.finish_reason == "cancelled" and events[-1] == "finish" and gone not in eng.running
    n_out = len(gone.out)
    eng.run_until_idle()
    assert events.count("finish") == 1 and events[-1] == "finish" and len(gone.out) == n_out
    assert gone.out == alone(model, list(range(20)), n_out, 512)
    assert stays.out == alone(model, [5, 6, 7], 30, 512)
    assert len(eng.free_slots) == 2 and len(eng.free_blocks) == eng.n_blocks


def test_preempted_with_a_token_in_flight(one_thread):
    """A request preempted while its token is in flight keeps that token (read after the preemption) and is
    recomputed from prompt + output: greedy outputs equal `generate` alone (attention, a pool that runs out)."""
    model = tiny("attention", n_layers=2)
    eng = Engine(model, max_batch=6, cache_budget=budget(model, 6, 8, 14), block_size=8, prefill_chunk=16, async_steps=True)
    in_flight = []

    class Waiting(collections.deque):
        def appendleft(self, r):  # only preemption puts a request back at the head of the queue
            in_flight.append(r.inflight)
            super().appendleft(r)

    eng.waiting = Waiting()
    reqs = [(p, n, eng.submit(p, SamplingParams(max_tokens=n, temperature=0))) for p, n in requests(20, seed=1)]
    eng.run_until_idle()
    assert any(in_flight), in_flight
    for p, n, r in reqs:
        assert r.finish_reason == "length" and r.out == alone(model, p, n, 16)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    """Engine thread, async: a forward that raises fails the requests running (the step before's tokens still go
    out); later requests are served and equal `generate`."""
    model = tiny("kimi_linear", n_layers=2)
    eng = Engine(model, max_batch=2, cache_budget=1 << 22, async_steps=True)
    real, calls = eng._decode, []

    def failing(reqs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")
        return real(reqs)

    monkeypatch.setattr(eng, "_decode", failing)
    first = eng.submit([1, 2, 3], SamplingParams(max_tokens=10, temperature=0))
    eng.start()
    try:
        wait_finished(first)
        assert first.finish_reason == "error" and "injected forward failure" in (first.error or "")
        assert first.out == alone(model, [1, 2, 3], len(first.out), 512) and len(first.out) >= 2
        later = eng.submit([4, 5], SamplingParams(max_tokens=6, temperature=0))
        wait_finished(later)
        assert later.finish_reason == "length" and later.out == alone(model, [4, 5], 6, 512)
    finally:
        eng.stop()


def wait_finished(r, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while r.finish_reason is None:
        assert time.time() < deadline, "the request did not finish"
        time.sleep(0.01)
