"""Output invariance with the Program's graphs (native/graphs.py) on the CPU stand-in backend
(``NINFER_GRAPHS=replay``): the oracle sweep's workloads — pressure, both pause routes, hits,
faults, sampling, logprobs — where every all-decode call replays its bucket's graph on static
buffers, padding rows included, every call of one prefill/replay chunk and decode rows replays
the "chunk" profile (the chunk padded to its length), and the rest runs eagerly; with MTP and
DFlash too, whose calls of verify rows (an input and k drafts each) replay the "verify" profile
(DFlash's graphs carry the tap layers). Every completed request equals the isolated oracle;
nothing leaks; graphs really ran, with padding."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_invariance import FULL, REGRESSION_SEEDS, run_workloads, seeds

pytestmark = pytest.mark.slow


def _check_graphs(all_stats: list[dict], padded: bool = True) -> None:
    g = [s["graphs"] for s in all_stats]
    assert all(x is not None and x["backend"] == "replay" for x in g)
    assert sum(x["replays"] for x in g) > 0
    assert sum(x["padded"] for x in g) > 0 or not padded
    assert sum(x["chunk_replays"] for x in g) > 0 and all(x["chunk_buckets"] for x in g)


def test_workloads_with_graphs_match_the_oracle(tiny_model, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")        # inherited by the sweep's processes
    # the suite: 4 of the oracle's regression seeds and one more (NINFER_SWEEP=full: all of them and 7)
    stats = run_workloads(tiny_model, (REGRESSION_SEEDS if FULL else REGRESSION_SEEDS[:4]) + seeds(7000, 1, 7))
    _check_graphs(stats)
    g = [s["graphs"] for s in stats]
    # without a draft backend every chunk of the budget has a graph: a call runs eagerly only
    # for images or a chunk past the budget, which these workloads do not make
    assert sum(x["eager"] for x in g) == 0


def test_speculative_workloads_with_decode_graphs_match_the_oracle(tiny_model, tiny_dflash, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")

    def overrides(seed: int) -> dict:
        k = random.Random(seed).randint(1, 4)
        if seed % 2:
            return {"speculative": {"method": "mtp", "num_tokens": k}}
        return {"speculative": {"method": "dflash", "draft": tiny_dflash, "num_tokens": k}}
    # decode calls of speculating sequences carry k drafts: the "verify" profile's graphs
    stats = run_workloads(tiny_model, seeds(7100, 2, 6), overrides)
    _check_graphs(stats, padded=False)
    assert sum(x["graphs"]["verify_replays"] for x in stats) > 0
    # a row with fewer drafts (near max_tokens) or a plain decode row beside verify rows is
    # padded inside its row: every call of these workloads replays a graph
    assert sum(x["graphs"]["eager"] for x in stats) == 0
    assert all(x["graphs"]["verify_buckets"] for x in stats)


def test_enforce_eager_captures_nothing(tiny_model, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    stats = run_workloads(tiny_model, [7200], lambda seed: {"enforce_eager": True})
    assert stats[0]["graphs"] is None


def test_prompt_logprobs_from_padded_chunk_graphs_match_the_oracle(make, tiny_model, monkeypatch):
    """prompt_logprobs read every real row of a chunk that replayed its (padded) "chunk" graph
    beside a decode row: the entries equal the isolated forward's."""
    from tests.engine.harness import assert_prompt_logprobs_close, oracle_prompt_logprobs
    from tests.factories import random_prompt

    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    h = make(max_concurrency=2, prefill_chunk_tokens=64)
    p = random_prompt(150, seed=31)                          # chunks of 64, 64 and 22 (padded)
    a = h.submit(random_prompt(40, seed=32), max_tokens=30)
    b = h.submit(p, max_tokens=3, prompt_logprobs=2)
    h.run(until=lambda: h.done(a, b))
    assert_prompt_logprobs_close(h.finals[b].prompt_logprobs, oracle_prompt_logprobs(tiny_model, p, 2))
    g = h.core.stats_dict()["graphs"]
    assert g["chunk_replays"] > 0 and g["padded"] > 0 and g["eager"] == 0
    h.check_clean()
