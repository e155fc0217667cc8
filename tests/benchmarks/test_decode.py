"""`ninfer bench decode` runs both forward paths and they decode the same tokens."""

from __future__ import annotations

from ninfer.benchmarks import decode
from ninfer.native.model import paths
from ninfer.native.model.model import HybridModel


def test_decode_bench_compares_both_paths(tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(decode, "STEPS", 3)
    monkeypatch.setattr(decode, "REPEATS", 1)
    result = decode.run(tiny_model)
    assert {(r["path"], r["C"]) for r in result["rows"]} == {
        (p, c) for p in ("cpu", "per_sequence") for c in (1, 2, 4, 8)}
    assert all(r["same_tokens"] for r in result["rows"])
    assert result["ratio_at_C8"] > 0
    assert HybridModel.path is paths.BATCHED      # the bench leaves the default alone
    assert "at C=8" in capsys.readouterr().out
