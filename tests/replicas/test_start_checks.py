"""What ``Engine.start`` refuses about replicas before anything starts (no Ray needed)."""

from __future__ import annotations

import pytest

import ninfer
from ninfer.errors import ConfigError


@pytest.mark.parametrize("kw,needle", [
    ({"replicas": 2}, "needs transport='ray'"),
    ({"replicas": 0, "transport": "ray"}, "replicas=0 is out of range"),
    ({"router": "session", "transport": "ray"}, "give replicas >= 2"),
    ({"replicas": 2, "router": "random", "transport": "ray"}, "routing='random' is not one of"),
    ({"replicas": 2, "router": {"queue_tokens": -1}, "transport": "ray"}, "queue_tokens=-1 is out of range"),
], ids=["inproc", "zero", "router-alone", "routing", "queue-tokens"])
def test_replica_options_are_checked_before_anything_starts(tiny_model, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ninfer.Engine.start(tiny_model, **kw)
