"""`ninfer bench speculative`: MTP on and off in one run, same tokens, and the numbers it reports."""

from __future__ import annotations

from ninfer.benchmarks import speculative


def test_speculative_bench_reports_the_ratio_and_acceptance(tiny_model, tmp_path, capsys):
    out = tmp_path / "spec.json"
    result = speculative.run(tiny_model, out=str(out), drafts=(2,), concurrency=(1, 2), max_tokens=12,
                             prompt_tokens=16)
    assert {(r["drafts"], r["C"]) for r in result["rows"]} == {(k, c) for k in (0, 2) for c in (1, 2)}
    assert result["all_same_tokens"]
    on = [r for r in result["rows"] if r["drafts"] == 2]
    assert all(r["tokens_per_step"] >= 1 and r["ratio_on_off"] > 0 for r in on)
    assert len(result["acceptance_by_position"]["2"]) == 2
    assert out.is_file() and out.with_suffix(".png").is_file()
    assert "acceptance by draft position" in capsys.readouterr().out


def test_speculative_bench_runs_a_dflash_draft(tiny_model, tiny_dflash2, tmp_path):
    """`--method dflash2 --draft DIR`: the same table, with the accepted length per block."""
    out = tmp_path / "dflash.json"
    result = speculative.run(tiny_model, out=str(out), drafts=(3,), concurrency=(1,), max_tokens=12,
                             prompt_tokens=16, method="dflash2", draft=tiny_dflash2)
    assert result["method"] == "dflash2" and result["all_same_tokens"]
    [on] = [r for r in result["rows"] if r["drafts"] == 3]
    assert 0 <= on["accepted_per_block"] <= 3 and on["tokens_per_step"] >= 1 and on["ratio_on_off"] > 0, on
    assert out.is_file() and out.with_suffix(".png").is_file()
