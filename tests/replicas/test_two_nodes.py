"""Two Ray nodes on one machine (separate raylets with one fake GPU each, Ray's own
``cluster_utils.Cluster``): a replicated deployment puts one replica on each, and serves through
one frontend (the script ``tests/replicas/two_nodes.py`` runs it in its own process: this
session already holds a Ray connection)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.harness import oracle

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_two_replicas_on_two_raylets(tiny_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_ADDRESS": ""}
    run = subprocess.run([sys.executable, "-m", "tests.replicas.two_nodes", tiny_model], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["raylets"] == 3
    # each replica's controller and worker on its own GPU node, the two nodes different
    assert seen["replica_nodes"] == seen["worker_nodes"] == seen["gpu_nodes"]
    assert seen["finish"] == ["length"] * 4 and seen["spread"] == [2, 2]
    for prompt, tokens in zip(seen["prompts"], seen["tokens"]):
        assert tokens == oracle(tiny_model, prompt, max_tokens=4)
