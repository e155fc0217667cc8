"""Fixtures for the engine tests: harnesses that are closed after each test."""

from __future__ import annotations

import pytest

from tests.engine.harness import Harness


@pytest.fixture
def make_harness(tiny_model):
    """``make_harness(max_context=..., **config)`` builds a Harness on the tiny model."""
    made = []

    def build(**cfg) -> Harness:
        # a rule test sizes its capacities for the rule it pins: anticipated positions (extra
        # optional saves on every prompt) stay off unless the test asks for them; the oracle
        # sweeps build their Harness directly and keep the product's default (on)
        cfg["context_cache"] = {"anticipate": False, **(cfg.get("context_cache") or {})}
        h = Harness(tiny_model, **cfg)
        made.append(h)
        return h
    yield build
    for h in made:
        h.close()


@pytest.fixture
def make(make_harness):
    """``make(**config)``: a Harness with a 256-token context unless given."""
    def build(**cfg) -> Harness:
        cfg.setdefault("max_context", 256)
        return make_harness(**cfg)
    return build
