"""`ninfer bench serve` as a user runs it, against `ninfer serve` started by the test (inproc,
tiny model, an API key): every stream finishes, the JSON carries the report, and the second
round of every conversation reuses the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.serving import free_port, serving

KEY = "bench-key"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    config = ('max_concurrency = 4\nmax_context = 1024\ndtype = "float32"\n\n[context_cache]\n'
              'host_capacity_bytes = 67108864\n')
    with serving(tiny_model, tmp_path_factory.mktemp("serve"), config, "--api-key", KEY,
                 "--served-model-name", "tiny") as (base, _):
        yield f"{base}/v1"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", "bench", "serve", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_bench_serve_against_a_running_server(server, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    r = _bench("--base-url", server, "--api-key", KEY, "--clients", "8", "--rounds", "2", "--max-tokens", "8",
               "--out", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "ttft_p50_ms" in r.stdout and "total" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "serve" and data["errors"] == 0 and data["unfinished"] == 0
    assert data["config"]["model"] == "tiny" and data["config"]["clients"] == 8
    reqs = data["requests"]
    assert len(reqs) == 16 and all(q["error"] is None and q["finish_reason"] in ("stop", "length") for q in reqs)
    assert all(q["ttft_s"] is not None or q["output_tokens"] == 0 for q in reqs)
    rows = {row["round"]: row for row in data["rows"]}
    for key in ("requests", "errors", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p95_ms",
                "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "ttft_p90_ms",
                "out_tok_s", "cached_mean"):
        assert rows["total"][key] is not None, key
    assert rows["total"]["requests"] == 16 and rows[0]["requests"] == rows[1]["requests"] == 8
    second = [q for q in reqs if q["round"] == 1]
    assert all(q["cached_tokens"] > 0 for q in second)               # the first round's prompt was reused
    assert rows[1]["cached_mean"] > rows[0]["cached_mean"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"                # the TTFT CDF per round


@pytest.mark.slow
def test_bench_serve_reports_the_grammars_cost_beside_the_unconstrained_run(server, tmp_path):
    out = tmp_path / "structured.json"
    r = _bench("--base-url", server, "--api-key", KEY, "--clients", "4", "--rounds", "1", "--max-tokens", "48",
               "--structured", "both", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = {row["round"]: row for row in data["rows"]}
    assert rows["plain total"]["requests"] == rows["json total"]["requests"] == 4
    assert rows["json total"]["mask_us_per_token"] > 0 and data["grammar"]["masks"] > 0
    assert data["config"]["structured"] == "both" and "mask_us_per_token" in r.stdout


@pytest.mark.slow
def test_bench_serve_fails_on_request_errors(server):
    r = _bench("--base-url", server, "--model", "tiny", "--api-key", "wrong", "--clients", "2", "--rounds", "1",
               "--max-tokens", "4")
    assert r.returncode == 1
    assert "2 of 2 requests failed; first: HTTP 401" in r.stderr


@pytest.mark.slow
def test_bench_serve_without_a_server_prints_one_line():
    r = _bench("--base-url", f"http://127.0.0.1:{free_port()}/v1", "--clients", "1", "--rounds", "1")
    assert r.returncode == 2
    assert "cannot list models" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_serve_starts_and_stops_its_own_server(tiny_model):
    r = _bench("--model-dir", tiny_model, "--clients", "2", "--rounds", "2", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout[r.stdout.index("\n{"):])              # the table, then the JSON
    assert data["errors"] == 0 and data["config"]["server"].startswith("built in")
    assert "requests" not in data                                    # per-request records only with --out
    with pytest.raises(httpx.HTTPError):                              # the server is gone
        httpx.get(data["config"]["base_url"] + "/models", timeout=2)
