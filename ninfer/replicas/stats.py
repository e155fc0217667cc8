"""``engine.stats()`` of a replicated deployment: the replicas' own stats merged into one dict of
the single-engine shape (so ``/metrics`` and every reader work unchanged), counters and pools
summed, histograms summed bucket by bucket; rates and settings taken from the first replica."""

from __future__ import annotations

FIRST = {"cost_model", "step_channel", "graphs", "bounds"}     # settings and measured rates: not summed


def merge(stats: list[dict]) -> dict:
    """The replicas' ``stats()`` as one (empty list: an empty dict)."""
    return _merge(stats, None) if stats else {}


def _merge(values: list, key: str | None):
    first = values[0]
    if key in FIRST or (key is not None and "per_" in key):
        return first
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if isinstance(first, (int, float)):
        return sum(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in values if isinstance(v, dict) for k in v))
        return {k: _merge([v[k] for v in values if isinstance(v, dict) and k in v], k) for k in keys}
    if isinstance(first, list):
        same = all(isinstance(v, list) and len(v) == len(first) for v in values)
        numbers = same and all(isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for x in v)
        return [sum(col) for col in zip(*values)] if numbers else first
    return first
