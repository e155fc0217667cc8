"""``ninfer report FILE``: verdicts in the seed's evaluation order (lost restore points, then
degradation and stalls, then costs), the table after — on a crafted log, on a bench JSON, and
on the real JSON log of a small pressure workload."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import msgspec
import pytest

from ninfer.logs import JsonFormatter
from ninfer.report import render


def _req(rid, **kw):
    base = {"event": "request", "rid": rid, "finish_reason": "length", "error": None, "prompt_tokens": 100,
            "cached_tokens": 0, "prefill_tokens": 100, "replay_tokens": 0, "completion_tokens": 10,
            "ttft_s": 0.2, "e2e_s": 1.0, "max_output_gap_s": 0.05, "queue_s": 0.01, "paused_s": 0.0,
            "source_wait_s": 0.0, "pauses": {"snapshot": 0, "replay": 0}, "lost": None}
    return {"time": 1.0, "level": "INFO", "logger": "ninfer.requests", "message": "...", **base, **kw}


CRAFTED = [
    _req("a"),
    _req("b", cached_tokens=64, prefill_tokens=36, lost={"frontier": 96, "tokens": 32, "cause": "evicted"}),
    _req("c", ttft_s=0.05, max_output_gap_s=2.5, paused_s=2.4, replay_tokens=80,
         pauses={"snapshot": 1, "replay": 1}),
    _req("d", finish_reason="error", error="capacity_contract", ttft_s=None, completion_tokens=0),
    {"time": 2.0, "level": "INFO", "logger": "ninfer.stats", "message": "engine: ...", "event": "engine",
     "bytes_h2d_total": 3 << 20, "bytes_d2h_total": 1 << 20, "controller_s": 0.004, "round_trips": 40,
     "protocol_bytes": 9000, "hit_losses_by_cause": {"evicted": 1}, "stalls": 0},
]


def _write_crafted(path):
    lines = ["not json at all", "(EngineControllerActor pid=7) " + json.dumps(CRAFTED[0])]
    lines += [json.dumps(r) for r in CRAFTED[1:]]
    path.write_text("\n".join(lines) + "\n")


def _sections(text: str) -> tuple[list[str], list[str]]:
    verdicts, table = text.split("\n\n", 1)
    return verdicts.splitlines(), table.splitlines()


def test_verdicts_on_a_crafted_log(tmp_path):
    log = tmp_path / "run.jsonl"
    _write_crafted(log)
    verdicts, table = _sections(render(log))
    text = "\n".join(verdicts)
    assert verdicts[0] == "4 requests, 1 engine summaries"        # the Ray prefix is skipped, not the record
    # the seed's order: lost points first, then degradation and stalls, then costs
    order = [text.index(k) for k in ("1. LOST RESTORE POINTS", "2. SEVERE", "STALL", "3. costs")]
    assert order == sorted(order)
    assert "1 requests missed a due restore point (evicted 1), 32 tokens recomputed; worst b" in text
    assert "1 requests failed (capacity_contract 1)" in text
    assert "STALL: longest output gap 2.500 s (c); 1 requests with a gap >= 1 s" in text
    assert "pauses by route: replay 1, snapshot 1" in text and "longest 2.400 s (c)" in text
    assert "low TTFT but a gap >= 1 s later: c" in text          # reported apart from TTFT
    assert "prefill 336, Replay 80" in text and "H2D 3.0 MiB, D2H 1.0 MiB" in text
    assert "controller: 4.0 ms outside the worker over 40 round trips (100 us each); protocol 8.8 KiB" in text
    assert table[0].split()[:3] == ["rid", "finish", "prompt"]
    rows = {line.split()[0]: line for line in table[2:]}
    assert set(rows) == {"a", "b", "c", "d"} and "evicted (32)" in rows["b"] and "1/1" in rows["c"]


def test_a_clean_log_says_so(tmp_path):
    log = tmp_path / "ok.jsonl"
    log.write_text(json.dumps(_req("a")) + "\n")
    verdicts, _ = _sections(render(log))
    assert verdicts[1].startswith("1. lost restore points: none")
    assert verdicts[2] == "2. degradation: no request failed"
    assert "paused: no request was paused" in "\n".join(verdicts)
    assert "not logged" in "\n".join(verdicts)


def test_bench_json(tmp_path):
    doc = {"benchmark": "agent", "trace": [{"transport": "inproc", "computed": 900, "floor": 850, "over_floor": 1.06,
                                            "ttft_max_ms": 500.0, "outputs_exact": True}],
           "rows": [{"kv_pages": 16, "host_MiB": 2, "prefill_computed": 1978, "replay": 12, "floor": 1115,
                     "over_floor": 1.774, "hit_losses": 6, "preemptions": 3}]}
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(doc))
    verdicts, table = _sections(render(path))
    text = "\n".join(verdicts)
    assert "1. LOST RESTORE POINTS: rows[0] kv_pages=16,host_MiB=2: 6 hits lost" in text
    assert "longest TTFT 500.0 ms (trace[0] transport=inproc)" in text
    assert "[rows[0] kv_pages=16,host_MiB=2] prefill 1978 + Replay 12 vs floor 1115 (1.774x)" in text
    assert text.index("1. LOST") < text.index("2. ") < text.index("3. costs")
    assert table[0].split()[0] == "scenario" and len(table) == 4


def test_the_cli_command(tmp_path):
    log = tmp_path / "run.jsonl"
    _write_crafted(log)
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "report", str(log), "--stall-s", "3"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "stream: longest output gap 2.500 s (c); 0 requests with a gap >= 3 s" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "report", str(tmp_path / "missing.jsonl")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "no such file" in r.stderr


@pytest.fixture
def json_log(tmp_path):
    """The ``ninfer`` logger written as JSON lines to a file (what NINFER_LOG_FORMAT=json gives);
    its children start at NOTSET (an in-process ``ninfer`` command earlier in this xdist worker
    quiets some of them: the request records would not reach the file)."""
    from ninfer.cli import QUIET_UNLESS_ASKED
    path = tmp_path / "engine.jsonl"
    logger = logging.getLogger("ninfer")
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    level = logger.level
    children = {name: logging.getLogger(name).level for name in QUIET_UNLESS_ASKED}
    for name in children:
        logging.getLogger(name).setLevel(logging.NOTSET)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield path
    logger.removeHandler(handler)
    logger.setLevel(level)
    for name, lvl in children.items():
        logging.getLogger(name).setLevel(lvl)
    handler.close()


def test_verdicts_on_a_real_pressure_log(tiny_model, json_log):
    """Two small workloads on the real engine: a retry whose input point could not be saved
    (no State slot, no Host: a lost restore point), and a long request paused behind an older
    resident (no Host: destructive, resumed by Replay). The report finds both, in order, and
    its table is the engine's own accounting."""
    from ninfer.engine.request import Phase
    from tests.engine.harness import Harness, run
    from tests.factories import random_prompt

    finals = {}
    a = Harness(tiny_model, max_concurrency=1, max_context=512, kv_capacity=8 * 64, prefill_chunk_tokens=256,
                log_stats_interval_s=0.02, context_cache={"device_state_slots": 0, "host_capacity_bytes": 0})
    b = Harness(tiny_model, max_concurrency=3, max_context=256, kv_capacity=6 * 64, prefill_chunk_tokens=64,
                log_stats_interval_s=0.02, context_cache={"device_state_slots": 1, "host_capacity_bytes": 0})
    try:
        p = random_prompt(60, seed=60)
        run(a, p, max_tokens=2, rid="first")
        run(a, p, max_tokens=2, temperature=1.0, seed=3, rid="retry")
        finals.update(a.finals)
        old = b.submit(random_prompt(100, seed=5), max_tokens=150, rid="old")
        long = b.submit(random_prompt(120, seed=6), max_tokens=120, rid="long")
        b.run(until=lambda: (r := b.req(long)) is not None and r.phase is Phase.PAUSED)
        shorts = [b.submit(random_prompt(8, seed=20 + i), max_tokens=2, rid=f"short-{i}") for i in range(3)]
        b.run(until=lambda: b.done(old, long, *shorts))
        finals.update(b.finals)
    finally:
        a.close()
        b.close()
    records = [json.loads(line) for line in json_log.read_text().splitlines()]
    by_rid = {r["rid"]: r for r in records if r.get("event") == "request"}
    assert set(by_rid) == set(finals)
    for rid, f in finals.items():              # the summary line is the engine's accounting
        r = by_rid[rid]
        usage = msgspec.structs.asdict(f.usage)
        assert {k: r[k] for k in usage if k != "completion_tokens"} == {k: v for k, v in usage.items()
                                                                      if k != "completion_tokens"}
        assert r["ttft_s"] == f.timings.ttft_s and r["paused_s"] == f.timings.paused_s
        assert sum(r["pauses"].values()) == len(f.pauses)
    assert by_rid["retry"]["lost"] == {"frontier": 60, "tokens": 60, "cause": "skipped_no_room"}
    engine = [r for r in records if r.get("event") == "engine"]
    assert engine, "no periodic engine summary while busy"
    for key in ("prefill_tps", "replay_tps", "generation_tps", "running", "waiting", "paused", "cache_hit_rate",
                "bytes_h2d", "bytes_d2h", "host_used_bytes", "host_use", "controller_s", "protocol_bytes"):
        assert all(key in e for e in engine), key
    generated = sum(len(f.token_ids) for f in finals.values())
    assert sum(e["generation_tps"] * e["interval_s"] for e in engine) <= generated + len(engine)   # (rounding)

    verdicts, table = _sections(render(json_log, stall_s=60))
    text = "\n".join(verdicts)
    assert "1. LOST RESTORE POINTS: 1 requests missed a due restore point (skipped_no_room 1), 60 tokens " \
           "recomputed; worst retry" in text
    longest = max(by_rid.values(), key=lambda r: r["max_output_gap_s"])
    assert f"longest output gap {longest['max_output_gap_s']:.3f} s ({longest['rid']})" in text
    paused = by_rid["long"]
    assert paused["pauses"]["replay"] >= 1 and paused["replay_tokens"] > 0
    assert f"longest {paused['paused_s']:.3f} s (long); pauses by route: replay {paused['pauses']['replay']}" in text
    replay = sum(r["replay_tokens"] for r in by_rid.values())
    assert f"Replay {replay} (" in text
    assert text.index("1. LOST") < text.index("2. degradation") < text.index("3. costs")
    assert {line.split()[0] for line in table[2:]} == set(finals)
