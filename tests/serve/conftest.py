"""Shared by the serving tests."""

import pytest

FAILING_TEMPERATURE = 0.123  # a request with this temperature has its sampling fail (flaky_sampler)


@pytest.fixture
def flaky_sampler(monkeypatch):
    """The engine's sampler raises "injected sampler failure" for requests of FAILING_TEMPERATURE, as a bug would."""
    from evict.serve import engine as engine_module

    real = engine_module.sample_next

    def flaky(logits, **kw):
        if kw["temperature"] == FAILING_TEMPERATURE:
            raise RuntimeError("injected sampler failure")
        return real(logits, **kw)

    monkeypatch.setattr(engine_module, "sample_next", flaky)
