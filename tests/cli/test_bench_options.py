"""`ninfer bench NAME` as a user runs it: each bench's own --help, defaults equal to the
committed measurement's settings, and one tiny run of each that writes its JSON and a PNG.
(`bench serve` runs in test_bench_serve.py, `bench trace` in test_bench_trace.py.)"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from importlib import import_module

import pytest

from ninfer.cli import build_parser

PNG = b"\x89PNG\r\n\x1a\n"
OPTIONS = {
    "controller": ["--concurrency", "--pressure", "--prompt-tokens", "--decode-tokens", "--dtype", "--model",
                   "--out", "--plot"],
    "agent": ["--transport", "--sessions", "--turns", "--system-tokens", "--out-tokens", "--lanes", "--capacity",
              "--seed", "--replicas", "--routing", "--dtype", "--model", "--out", "--plot"],
    "actors": ["--transport", "--concurrency", "--prompt-tokens", "--max-tokens", "--lanes", "--dtype", "--model",
               "--out", "--plot"],
    "cache-scale": ["--records", "--shared-prefix", "--dtype", "--model", "--out", "--plot"],
    "speed": ["--vs-vllm", "--vllm-python", "--concurrency", "--prompt-tokens", "--prefill-prompts",
              "--decode-tokens", "--trace", "--trace-limit", "--time-scale", "--repeats", "--lanes", "--max-context",
              "--chunk", "--dtype", "--model", "--out", "--plot"],
    "router": ["--entries", "--replicas", "--prompt-tokens", "--queries", "--out", "--plot"],
    "serve": ["--base-url", "--clients", "--rounds", "--max-tokens", "--prompt-words", "--replicas", "--routing",
              "--out", "--plot"],
    "trace": ["FILE", "--format", "--block-tokens", "--last-block", "--limit", "--offset", "--window-s",
              "--time-scale", "--transport", "--capacity", "--lanes", "--chunk", "--max-context", "--state-slots",
              "--check", "--seed", "--save-tokens", "--base-url", "--served-model", "--timeout", "--replicas",
              "--routing", "--dtype", "--model", "--out", "--plot"],
}


def _ninfer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_bench_has_its_own_help(name):
    r = _ninfer("bench", name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: ninfer bench {name}")
    for opt in OPTIONS[name]:
        assert opt in r.stdout, opt


@pytest.mark.parametrize("name", ["controller", "agent", "actors", "cache-scale", "router", "speed"])
def test_defaults_are_the_committed_settings(name, monkeypatch):
    """A run without options calls the bench's run() with exactly run()'s own defaults (the
    committed measurement's settings)."""
    module = import_module(f"ninfer.benchmarks.{name.replace('-', '_')}")
    defaults = {k: p.default for k, p in inspect.signature(module.run).parameters.items()
                if p.default is not inspect.Parameter.empty}
    seen = {}
    monkeypatch.setattr(module, "run", lambda model, **kw: seen.update(kw, model=model))
    args = build_parser().parse_args(["bench", name])
    assert args.func(args) == 0
    assert seen.pop("model") == "models/tiny"
    assert seen == defaults


@pytest.mark.parametrize("argv,needle", [
    (["bench", "agent", "--transport", "tcp"], "must be inproc, ray or inproc,ray"),
    (["bench", "agent", "--capacity", "16"], "PAGES:HOST_MIB"),
    (["bench", "actors", "--lanes", "9"], "must be 1..8"),
    (["bench", "controller", "--concurrency", "1,x"], "must be a positive integer"),
    (["bench", "trace", "t.jsonl", "--routing", "random"], "must be exact, session or round-robin"),
], ids=["transport", "capacity", "lanes", "list", "routing"])
def test_bad_options_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def _png(path) -> None:
    assert path.read_bytes()[:8] == PNG, path


@pytest.mark.slow
def test_controller_small_run_prints_table_then_json(tiny_model, tmp_path):
    """(A missing model directory is built by ``ensure_model``, the demo's: tested through the
    CLI by ``test_cli.py::test_demo_builds_the_model_when_missing``.)"""
    png = tmp_path / "controller.png"
    r = _ninfer("bench", "controller", "--model", tiny_model, "--concurrency", "1,2", "--pressure", "2",
                "--decode-tokens", "8", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    table, _, doc = r.stdout.partition("\n\n")                  # stdout is only the table and the JSON
    assert table.split()[:2] == ["mode", "C"]
    data = json.loads(doc)
    assert data["benchmark"] == "controller" and data["config"]["concurrency"] == [1, 2]
    assert [(row["mode"], row["C"]) for row in data["rows"]] == [("steady", 1), ("steady", 2), ("pressure", 2)]
    for row in data["rows"]:
        for key in ("controller_us_per_cycle", "worker_ms_per_cycle", "round_trips_per_cycle", "plan_bytes",
                    "reply_bytes", "pauses", "resumes"):
            assert row[key] is not None, key
    assert all(row["round_trips_per_cycle"] == 1 for row in data["rows"] if row["mode"] == "steady")
    _png(png)


@pytest.mark.slow
def test_agent_small_run_writes_json_and_the_default_png(tiny_model, tmp_path):
    out = tmp_path / "agent.json"
    r = _ninfer("bench", "agent", "--model", tiny_model, "--transport", "inproc", "--sessions", "2", "--turns", "2",
                "--system-tokens", "64", "--out-tokens", "4", "--capacity", "16:2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "agent" and data["config"]["sessions"] == 2
    (tr,) = data["trace"]
    assert tr["transport"] == "inproc" and tr["requests"] == 4 and tr["outputs_exact"] is True
    assert tr["computed"] >= tr["floor"] > 0
    assert [x["round"] for x in tr["rounds"]] == [0, 1] and sum(x["computed"] for x in tr["rounds"]) == tr["computed"]
    assert len(tr["ttft_ms"]) == len(tr["e2e_ms"]) == 4
    (row,) = data["rows"]
    assert row["kv_pages"] == 16 and row["host_MiB"] == 2 and row["requests"] == 30 and row["over_floor"] >= 1
    _png(tmp_path / "agent.png")                                 # next to --out


@pytest.mark.slow
def test_actors_small_run(tiny_model, tmp_path):
    out = tmp_path / "actors.json"
    r = _ninfer("bench", "actors", "--model", tiny_model, "--transport", "inproc", "--concurrency", "1,2",
                "--max-tokens", "8", "--lanes", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "actors" and data["config"]["transports"] == ["inproc"]
    assert [(row["transport"], row["C"]) for row in data["rows"]] == [("inproc", 1), ("inproc", 2)]
    assert all(row["round_trips_per_cycle"] == 1 and row["decode_tok_s"] > 0 for row in data["rows"])
    _png(tmp_path / "actors.png")


@pytest.mark.slow
def test_cache_scale_small_run_with_progress_forced_on(tiny_model, tmp_path):
    out = tmp_path / "cs.json"
    r = _ninfer("bench", "cache-scale", "--model", tiny_model, "--records", "20,40", "--out", str(out),
                env={"NINFER_PROGRESS": "1"})
    assert r.returncode == 0, r.stderr
    assert "fill to 40 records" in r.stderr and "100%" in r.stderr   # the bar, although stderr is a pipe
    data = json.loads(out.read_text())
    assert data["benchmark"] == "cache-scale" and [row["records"] for row in data["rows"]] == [20, 40]
    for key in ("decode_us", "admit_ms", "reclaim_ms", "settle_ms", "fill_first_ms", "host_full_ms", "wide_quotes"):
        assert all(row[key] is not None for row in data["rows"]), key
    _png(tmp_path / "cs.png")


def test_router_small_run(tmp_path):
    """Model-free: the routing cost per request at each summary size, a row per prompt length."""
    out = tmp_path / "router.json"
    r = _ninfer("bench", "router", "--entries", "50,200", "--prompt-tokens", "256", "--queries", "20",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert [(row["entries_per_replica"], row["prompt_tokens"]) for row in data["rows"]] == [(50, 256), (200, 256)]
    assert all(row["route_us_p50"] > 0 and row["restore_routed"] > 0 for row in data["rows"])
    _png(tmp_path / "router.png")
