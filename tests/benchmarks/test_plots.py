"""The benches' figures (ninfer/benchmarks/plots.py): every committed result in bench/results/
draws as a PNG, and where a bench writes its plot (``--plot``, else next to ``--out``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ninfer.benchmarks import plots
from ninfer.errors import NInferError

PNG = b"\x89PNG\r\n\x1a\n"
RESULTS = sorted((Path(__file__).parents[2] / "bench" / "results").glob("*.json"))
CONTROLLER = {"benchmark": "controller", "rows": [
    {"mode": "steady", "C": 1, "controller_us_per_cycle": 80.0, "round_trips_per_cycle": 1.0},
    {"mode": "pressure", "C": 2, "controller_us_per_cycle": 30.0, "round_trips_per_cycle": 1.1}]}


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_committed_results_draw(path, tmp_path):
    out = tmp_path / f"{path.stem}.png"
    assert plots.main([str(path), str(out)]) == 0
    assert out.read_bytes()[:8] == PNG


def test_the_bench_names_all_have_a_figure():
    assert set(plots.PLOTS) == {"controller", "agent", "actors", "cache-scale", "serve", "decode", "speculative",
                                "trace", "router", "speed"}
    assert {json.loads(p.read_text())["benchmark"] for p in RESULTS} <= set(plots.PLOTS)


def test_plot_goes_to_plot_else_next_to_out(tmp_path):
    plots.write(CONTROLLER, None, str(tmp_path / "r.json"))
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG
    plots.write(CONTROLLER, str(tmp_path / "p.png"), str(tmp_path / "s.json"))
    assert (tmp_path / "p.png").is_file() and not (tmp_path / "s.png").exists()
    plots.write(CONTROLLER, None, None)                          # neither: no plot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.png"]


def test_without_matplotlib_an_asked_for_plot_fails_and_an_implied_one_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib raises ImportError
    with pytest.raises(NInferError, match=r"pip install 'ninfer\[bench\]'"):
        plots.write(CONTROLLER, str(tmp_path / "p.png"), None)
    plots.write(CONTROLLER, None, str(tmp_path / "r.json"))
    assert "no plot: plots need matplotlib" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
