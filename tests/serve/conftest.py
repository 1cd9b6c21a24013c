"""Shared by the serving tests."""

import os
import time

import pytest

FAILING_TEMPERATURE = 0.123  # a request with this temperature has its sampling fail (flaky_sampler)


def flaky(real):
    """`real` (the engine's sampler), raising "injected sampler failure" for requests of FAILING_TEMPERATURE, as a bug would."""

    def sample(logits, **kw):
        if kw["temperature"] == FAILING_TEMPERATURE:
            raise RuntimeError("injected sampler failure")
        return real(logits, **kw)

    return sample


@pytest.fixture
def flaky_sampler(monkeypatch):
    """The engine's sampler raises "injected sampler failure" for requests of FAILING_TEMPERATURE, as a bug would."""
    from evict.serve import engine as engine_module

    monkeypatch.setattr(engine_module, "sample_next", flaky(engine_module.sample_next))


def install_flaky_sampler() -> None:
    """flaky_sampler for an engine in a child process (evict.serve.remote.EngineClient's `prepare`)."""
    from evict.serve import engine as engine_module

    engine_module.sample_next = flaky(engine_module.sample_next)


def failing_requests_fail_alone(c, name: str, greedy: list[int]) -> None:
    """Through the openai client `c`: a request of FAILING_TEMPERATURE gets a 500 naming the injected failure
    (streamed: an error event); then "hi" at the tiniest positive temperature (greedy, not an overflow) answers `greedy`."""
    import openai

    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=name, prompt="hi", max_tokens=4, temperature=FAILING_TEMPERATURE)
    assert "injected sampler failure" in e.value.body["message"]
    with pytest.raises(openai.APIError):
        list(c.completions.create(model=name, prompt="hi", max_tokens=4, temperature=FAILING_TEMPERATURE, stream=True))
    r = c.completions.create(model=name, prompt="hi", max_tokens=4, temperature=1e-39, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy


def hang_steps() -> None:
    """An engine whose steps hang once a request runs (a stuck kernel), for an EngineClient's `prepare`. With
    $EVICT_TEST_HANG_MARKER set, that file is created as the hang begins (metrics can say "running" a step before)."""
    from evict.serve.engine import Engine

    real = Engine.step
    marker = os.environ.get("EVICT_TEST_HANG_MARKER")

    def step(self):
        if self.running:
            if marker:
                open(marker, "w").close()
            time.sleep(3600)
        return real(self)

    Engine.step = step  # type: ignore[method-assign]


def die_in_step() -> None:
    """An engine whose thread dies (SystemExit: nothing in its loop catches it) once a request runs, for an
    EngineClient's `prepare`."""
    from evict.serve.engine import Engine

    real = Engine.step

    def step(self):
        if self.running:
            raise SystemExit("the thread dies")
        return real(self)

    Engine.step = step  # type: ignore[method-assign]
