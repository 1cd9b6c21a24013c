"""Shared by the serving tests."""

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


def hang_steps() -> None:
    """An engine whose steps hang once a request runs (a stuck kernel), for an EngineClient's `prepare`."""
    from evict.serve.engine import Engine

    real = Engine.step

    def step(self):
        if self.running:
            time.sleep(3600)
        return real(self)

    Engine.step = step  # type: ignore[method-assign]
