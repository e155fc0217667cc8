"""``ninfer bench cache-scale --shared-prefix``: the fills' requests share their first tokens (a
system prompt) and differ after them; the measurement runs on such a cache."""

from __future__ import annotations

from ninfer.benchmarks import cache_scale as cs


def test_shared_prefix_requests_share_their_first_tokens_and_differ_after():
    a, b = cs._spec(1, shared=64).prompt, cs._spec(2, shared=64).prompt
    assert a[:64] == b[:64] and a[64:] != b[64:] and len(a) == 64 + cs.PROMPT
    assert cs._spec(1).prompt == cs._prompt(1)                       # the default: no shared tokens


def test_a_small_shared_prefix_fill_is_measured(tiny_model):
    row = cs.measure(tiny_model, 12, shared=64)
    assert row["records"] >= 12 and row["checkpoints"] > row["records"]    # the prefix's own points too
    for key in ("decode_us", "admit_ms", "reclaim_ms", "fill_first_ms", "fill_last_ms"):
        assert row[key] is not None and row[key] >= 0, key
