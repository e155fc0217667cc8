"""One private local Ray instance for all actor tests (ray.init takes seconds: start it once).
"local": never the cluster a `ray start` left running on this machine (or RAY_ADDRESS)."""

from __future__ import annotations

import itertools

import pytest

_names = itertools.count()


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    from ninfer.actors.client import init_ray
    init_ray("local")
    yield ray
    ray.shutdown()


@pytest.fixture
def deployment(ray_session):
    """A fresh deployment name per test, so tests never share actors."""
    return f"t{next(_names)}"
