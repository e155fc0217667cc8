"""The actor tests' local Ray (one per session: ``init_ray`` joins the running one) and fresh
deployment names of their own."""

from __future__ import annotations

import itertools

import pytest

from tests.actors.conftest import ray_session  # noqa: F401 — the same private Ray

_names = itertools.count()


@pytest.fixture
def deployment(ray_session):  # noqa: F811
    return f"rep{next(_names)}"
