"""``prefill_chunk_tokens="auto"``: the chunk sized at startup from the measured forward.

The choice (``calibration.auto_chunk``) against fabricated timings through its one seam,
``calibration._prefill_s`` (seconds of a scratch prefill of n tokens); the config's budget; and
an engine started with "auto" end to end: the chunk it reports is one of ``AUTO_CHUNKS``, its
layout was sized for the largest, and its tokens are the reference's.
"""

from __future__ import annotations

import pytest

import ninfer
from ninfer.config import AUTO_CHUNK_STEP_S, AUTO_CHUNKS, EngineConfig
from ninfer.errors import ConfigError
from ninfer.native import calibration
from ninfer.reference import reference_generate
from tests.factories import random_prompt
from tests.native.program_driver import make_program


def _timed(monkeypatch, fixed: float, per_token: float, fail: int | None = None) -> list[int]:
    asked = []

    def prefill_s(prog, tokens):
        asked.append(tokens)
        return None if tokens == fail else fixed + tokens * per_token
    monkeypatch.setattr(calibration, "_prefill_s", prefill_s)
    return asked


@pytest.mark.parametrize("per_token, chunk", [
    (1e-6, 2048),                                   # a GPU: every candidate fits
    ((AUTO_CHUNK_STEP_S - 0.01) / 2050, 2048),      # the largest just fits
    ((AUTO_CHUNK_STEP_S - 0.01) / 2040, 1024),      # ... and just misses
    ((AUTO_CHUNK_STEP_S - 0.01) / 600, 512),
    (1.0, 256),                                     # none fits: the smallest
])
def test_auto_takes_the_largest_chunk_whose_forward_fits_the_step(tiny_model, monkeypatch, per_token, chunk):
    prog = make_program(tiny_model, dtype="float32", max_context=4096, prefill_chunk_tokens="auto")
    try:
        assert prog.layout.prefill_chunk_tokens == AUTO_CHUNKS[-1]         # sized for the largest
        asked = _timed(monkeypatch, 0.01, per_token)
        got, fixed, per = calibration.auto_chunk(prog)
        assert asked == [64, 2048]          # a small and a budget-long prefill
        assert got == chunk and fixed == pytest.approx(0.01) and per == pytest.approx(per_token)
        assert prog.size_chunk() == chunk and prog.layout.prefill_chunk_tokens == chunk
    finally:
        prog.shutdown()


def test_auto_measures_no_longer_than_the_context_and_falls_back_when_it_cannot(tiny_model, monkeypatch):
    prog = make_program(tiny_model, dtype="float32", max_context=700, prefill_chunk_tokens="auto")
    try:
        asked = _timed(monkeypatch, 0.0, 1e-6)
        assert calibration.auto_chunk(prog)[0] == 2048 and asked == [64, 699]
        _timed(monkeypatch, 0.0, 1e-6, fail=699)     # the layout cannot hold the long prefill
        assert calibration.auto_chunk(prog) == (256, 0.0, 0.0)
    finally:
        prog.shutdown()


def test_the_real_measurement_leaves_nothing_held(tiny_model):
    prog = make_program(tiny_model, dtype="float32", max_context=1024, prefill_chunk_tokens="auto")
    try:
        chunk, fixed, per_token = calibration.auto_chunk(prog)
        assert chunk in AUTO_CHUNKS and per_token > 0
        prog.check_integrity(idle=True)
        assert prog.is_empty()
    finally:
        prog.shutdown()


def test_the_config_takes_auto_or_a_positive_count():
    assert EngineConfig(prefill_chunk_tokens="auto").chunk_budget == AUTO_CHUNKS[-1]
    assert EngineConfig(prefill_chunk_tokens=96).chunk_budget == 96
    assert EngineConfig().prefill_chunk_tokens == 256              # the library's default stays fixed
    for bad in (0, -1, "big", 1.5):
        with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
            EngineConfig(prefill_chunk_tokens=bad)


def test_an_engine_started_with_auto_runs_its_measured_chunk(tiny_model):
    eng = ninfer.Engine.start(tiny_model, config={"max_concurrency": 2, "max_context": 2048,
                                                  "prefill_chunk_tokens": "auto"},
                              dtype="float32", transport="inproc")
    try:
        assert eng.info.prefill_chunk_tokens in AUTO_CHUNKS
        prompt = random_prompt(300, seed=5)
        out = eng.generate(prompt, max_tokens=4, ignore_eos=True).result(120)
        assert out.error is None
        assert out.token_ids == reference_generate(tiny_model, prompt, max_tokens=4, dtype="float32",
                                                   ignore_eos=True)
    finally:
        eng.shutdown()


def test_a_slow_run_does_not_size_the_chunk(tiny_model, monkeypatch):
    """``_prefill_s`` takes the fastest of ``PREFILL_RUNS`` after a warm-up: a run slowed by
    other work on the machine (here the last timed run 0.3 s late) does not count — it once
    sized a 2-core machine's chunk at 512 tokens instead of 2,048."""
    import time
    prog = make_program(tiny_model, dtype="float32", max_context=1024, prefill_chunk_tokens="auto")
    try:
        calls, execute = [], prog.execute

        def slowed(rows):
            calls.append(len(calls))
            if len(calls) == calibration.PREFILL_RUNS + 1:     # the last timed run
                time.sleep(0.3)
            return execute(rows)
        monkeypatch.setattr(prog, "execute", slowed)
        took = calibration._prefill_s(prog, 64)
        assert len(calls) == calibration.PREFILL_RUNS + 1 >= 3
        assert took is not None and took < 0.3
        prog.check_integrity(idle=True)
        assert prog.is_empty()
    finally:
        prog.shutdown()
