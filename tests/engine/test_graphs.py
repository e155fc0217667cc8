"""Output invariance with the Program's decode graphs (native/graphs.py) on the CPU stand-in
backend (``NINFER_GRAPHS=replay``): the oracle sweep's workloads — pressure, both pause routes,
hits, faults, sampling, logprobs — where every all-decode call replays its bucket's graph on
static buffers, padding rows included, and every other call runs eagerly; with MTP and DFlash
too, whose calls of verify rows (an input and k drafts each) replay the "verify" profile
(DFlash's graphs carry the tap layers). Every completed request equals the isolated oracle;
nothing leaks; graphs really ran, with padding."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_invariance import REGRESSION_SEEDS, run_workloads

pytestmark = pytest.mark.slow


def _check_graphs(all_stats: list[dict], padded: bool = True) -> None:
    g = [s["graphs"] for s in all_stats]
    assert all(x is not None and x["backend"] == "replay" for x in g)
    assert sum(x["replays"] for x in g) > 0
    assert sum(x["padded"] for x in g) > 0 or not padded
    assert sum(x["eager"] for x in g) > 0          # chunks and verify rows took the fallback


def test_workloads_with_decode_graphs_match_the_oracle(tiny_model, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")        # inherited by the sweep's processes
    _check_graphs(run_workloads(tiny_model, REGRESSION_SEEDS + [7000 + s for s in range(7)]))


def test_speculative_workloads_with_decode_graphs_match_the_oracle(tiny_model, tiny_dflash, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")

    def overrides(seed: int) -> dict:
        k = random.Random(seed).randint(1, 4)
        if seed % 2:
            return {"speculative": {"method": "mtp", "num_tokens": k}}
        return {"speculative": {"method": "dflash", "draft": tiny_dflash, "num_tokens": k}}
    # decode calls of speculating sequences carry k drafts: the "verify" profile's graphs
    stats = run_workloads(tiny_model, [7100 + s for s in range(6)], overrides)
    _check_graphs(stats, padded=False)
    assert sum(x["graphs"]["verify_replays"] for x in stats) > 0
    assert all(x["graphs"]["verify_buckets"] for x in stats)


def test_enforce_eager_captures_nothing(tiny_model, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    stats = run_workloads(tiny_model, [7200], lambda seed: {"enforce_eager": True})
    assert stats[0]["graphs"] is None
