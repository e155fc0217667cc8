"""`ninfer bench trace FILE` as a user runs it, on a small fabricated Mooncake trace whose floors
are worked out by hand: both arrival modes, an ample and a tight capacity (outputs checked
against the reference, no leak), both transports, and `--base-url` against `ninfer serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.serving import serving

PNG = b"\x89PNG\r\n\x1a\n"
# 512-token source blocks -> 16 tokens each; the last, partial block dropped (default) or its head
# kept (--last-block head). What each prompt shares with earlier ones:
#
#   line  ids                input   drop: blocks  ideal  ends     head: tokens  ideal  ends
#   1     0 1 2 3            2048    0 1 2 3  64     64     64       64            64     64
#   2     0 1 2 3 4 5 6      3300    0..5     96     32     32       96+8          40     40  (1 is a prefix)
#   3     0 1 7              1300    0 1      32      0     32       32+9           9     41  (no prompt is
#                                                                                              its prefix)
#   4     0 1 2 3 4 5 8 9    3900    0..5 8  112     16     16 (2)   112+10        26     58  (only 1 is)
#   5     10 11              1024    10 11    32     32     32       32            32     32
#   6     0 1 7 12           1800    0 1 7    48     16     16 (3)   48+9          16     16  (3: the id 7
#                                                                                              recurs)
#   total                            384          160    192      420           187    251
ROWS = [(0, [0, 1, 2, 3], 2048), (500, [0, 1, 2, 3, 4, 5, 6], 3300), (1000, [0, 1, 7], 1300),
        (2500, [0, 1, 2, 3, 4, 5, 8, 9], 3900), (2600, [10, 11], 1024), (4100, [0, 1, 7, 12], 1800)]
FLOORS = {"drop": ([64, 32, 0, 16, 32, 16], [64, 32, 32, 16, 32, 16]),
          "head": ([64, 40, 9, 26, 32, 16], [64, 40, 41, 58, 32, 16])}
PROMPT = {"drop": 384, "head": 420}


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 96, "hash_ids": ids}) + "\n"
                            for t, ids, n in ROWS))
    return str(path)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", "bench", "trace", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _floors_are_exact(data: dict, last: str = "drop") -> None:
    t, (ideal, ends) = data["trace"], FLOORS[last]
    assert (t["requests"], t["prompt_tokens"], t["ideal_floor"], t["ends_floor"]) == (6, PROMPT[last], sum(ideal),
                                                                                      sum(ends))
    assert (data["floors"]["ideal"], data["floors"]["ends"]) == (ideal, ends)
    assert t["windows"] in (None, 3)                           # [1, 2, 3], [4, 5], [6] in 2-second windows


@pytest.mark.slow
def test_windows_at_an_ample_and_a_tight_capacity(tiny_model, trace_file, tmp_path):
    out = tmp_path / "trace.json"
    r = _bench(trace_file, "--model", tiny_model, "--capacity", "ample", "--capacity", "4:1", "--lanes", "2",
               "--max-context", "256", "--check", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "over_ideal" in r.stdout.splitlines()[0]             # the table on stdout
    data = json.loads(out.read_text())
    _floors_are_exact(data)
    ample, tight = data["rows"]
    assert (ample["run"], tight["run"]) == ("inproc ample", "inproc 4:1")
    assert tight["kv_pages"] == 4 and tight["host_MiB"] == 1 and ample["kv_pages"] == 8    # 2 lanes x 256 tokens
    for row in (ample, tight):
        assert row["errors"] == 0 and row["outputs_exact"] is True and row["checked"] == 3 and row["integrity"] == "ok"
        assert row["prompt"] == 384 and 160 <= row["computed"] <= 384 + row["replay"]     # 160: the ideal floor
        assert row["over_ideal"] == round(row["computed"] / 160, 4) and row["over_ends"] == round(row["computed"] / 192, 4)
        assert row["hit"] == round(row["cached"] / 384, 4) and row["ideal_hit"] == round(1 - 160 / 384, 4)
        for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p90_ms", "h2d_MiB", "d2h_MiB", "hit_losses_by_cause", "pauses"):
            assert row[key] is not None, key
    # line 4 arrives in the second window, after line 2 finished: line 2's end is a restore point
    assert data["requests"]["inproc ample"]["cached"][3] >= 96
    tight_run = data["requests"]["inproc 4:1"]
    assert sum(tight_run["computed"]) == tight["computed"] and len(tight_run["ttft_ms"]) == 6
    assert data["floors"]["line"] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "trace.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_recorded_times_scaled_and_the_saved_token_trace(tiny_model, trace_file, tmp_path):
    saved, out = tmp_path / "tokens.jsonl", tmp_path / "t.json"
    r = _bench(trace_file, "--model", tiny_model, "--time-scale", "0.1", "--max-context", "256", "--check", "1",
               "--last-block", "head", "--save-tokens", str(saved), "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _floors_are_exact(data, "head")
    assert data["trace"]["arrival"] == "at the recorded times x 0.1" and data["config"]["window_s"] is None
    (row,) = data["rows"]
    assert row["errors"] == 0 and row["outputs_exact"] is True and row["integrity"] == "ok"
    # the saved token trace replays the same prompts: the same floors from explicit tokens
    r = _bench(str(saved), "--model", tiny_model, "--max-context", "256", "--check", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    again = json.loads(out.read_text())
    assert again["trace"]["format"] == "tokens" and again["floors"] == data["floors"]


@pytest.mark.slow
@pytest.mark.ray
def test_both_transports_replay_the_same_trace(tiny_model, trace_file, tmp_path):
    out = tmp_path / "both.json"
    r = _bench(trace_file, "--model", tiny_model, "--transport", "inproc,ray", "--lanes", "2", "--max-context", "256",
               "--check", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _floors_are_exact(data)
    inproc, ray = data["rows"]
    assert (inproc["transport"], ray["transport"]) == ("inproc", "ray")
    for row in (inproc, ray):
        assert row["errors"] == 0 and row["outputs_exact"] is True and row["integrity"] == "ok"
        assert row["prompt"] == 384 and row["computed"] >= 160
    assert data["requests"]["ray ample"]["cached"][3] >= 96       # line 4 reuses line 2's end over Ray too


@pytest.mark.slow
def test_base_url_replays_against_an_openai_compatible_server(tiny_model, trace_file, tmp_path):
    config = 'max_concurrency = 2\nmax_context = 256\ndtype = "float32"\n\n[context_cache]\nhost_capacity_bytes = 67108864\n'
    out = tmp_path / "http.json"
    with serving(tiny_model, tmp_path, config, "--served-model-name", "tiny") as (base, _):
        r = _bench(trace_file, "--model", tiny_model, "--base-url", f"{base}/v1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    _floors_are_exact(data)
    (row,) = data["rows"]
    assert row["run"] == "http tiny" and row["errors"] == 0 and row["prompt"] == PROMPT["drop"]
    assert row["computed"] == 384 - row["cached"] and row["cached"] >= 96       # line 4 reused line 2 over HTTP
    assert row["ttft_p50_ms"] is not None and "integrity" not in row           # the server is not ours to inspect


@pytest.mark.parametrize("argv,needle", [
    (["--capacity", "64"], "ample or PAGES:HOST_MIB"),
    (["--window-s", "2", "--time-scale", "1"], "not allowed with argument"),
    (["--window-s", "0"], "must be a number > 0"),
    (["--limit", "0"], "must be a positive integer"),
], ids=["capacity", "both-arrivals", "window", "limit"])
def test_bad_options_are_usage_errors(argv, needle, capsys):
    from ninfer.cli import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "trace", "t.jsonl", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_capacity_below_one_context_is_refused_before_any_run(tiny_model, trace_file):
    r = _bench(trace_file, "--model", tiny_model, "--capacity", "ample,2:1", "--max-context", "256")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--capacity pages must be 4..16 for max_context 256 and 4 lanes" in r.stderr


def test_capacity_with_base_url_is_refused(tiny_model, trace_file):
    r = _bench(trace_file, "--model", tiny_model, "--base-url", "http://127.0.0.1:9/v1", "--capacity", "ample")
    assert r.returncode == 2 and "with --base-url the server has its own memory" in r.stderr


def test_defaults_are_the_committed_settings(monkeypatch):
    """`ninfer bench trace FILE` calls run() with exactly run()'s own defaults (the committed
    measurement: 600 requests, 2-second windows, 16-token blocks, ample memory, 4 lanes)."""
    import inspect

    from ninfer.benchmarks import trace
    from ninfer.cli import build_parser
    defaults = {k: p.default for k, p in inspect.signature(trace.run).parameters.items()
                if p.default is not inspect.Parameter.empty}
    seen = {}
    monkeypatch.setattr(trace, "run", lambda file, model, **kw: seen.update(kw, file=file, model=model) or {"rows": []})
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = build_parser().parse_args(["bench", "trace", "t.jsonl"])
    assert args.func(args) == 0
    assert (seen.pop("file"), seen.pop("model")) == ("t.jsonl", "models/tiny")
    assert seen == {k: v for k, v in defaults.items() if k != "model_dir"}
