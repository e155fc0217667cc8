"""Fault injection through the public surface (``EngineConfig(faults=...)``) over the
in-process transport: each fault gives a clear error to the affected requests only, nothing
else is lost, nothing waits forever, and the engine keeps serving with its books balanced.
(tests/actors/test_faults.py does the same over the Ray actors.)"""

from __future__ import annotations

import pytest

import ninfer
from tests.factories import random_prompt

BASE = {"max_concurrency": 2, "max_context": 256, "kv_capacity": 4 * 64, "prefill_chunk_tokens": 48,
        "context_cache": {"device_state_slots": 0, "host_capacity_bytes": 4 << 20}}


def _start(model, *faults, **cfg):
    return ninfer.Engine.start(model, config={**BASE, **cfg, "faults": list(faults)}, dtype="float64",
                               transport="inproc")


def _ref(model, prompt, n):
    return ninfer.reference_generate(model, prompt, max_tokens=n, dtype="float64", ignore_eos=True)


def _serves(eng, model) -> None:
    """After the fault: a new request is exact, and nothing is held once caches are dropped."""
    p = random_prompt(40, seed=99)
    out = eng.generate(p, max_tokens=5, ignore_eos=True).result(120)
    assert out.finish_reason == "length" and out.token_ids == _ref(model, p, 5)
    eng.drop_caches()
    eng.check_integrity()
    s = eng.stats()
    assert all(v["available"] == v["total"] for v in s["occupancy"].values())


def _lost_only_after_tokens(outs, kind: str) -> list:
    """A request a loss fails had produced tokens (its output so far), and its error is typed
    and says a retry is served; every other request is kept."""
    lost = [o for o in outs if o.finish_reason == "error"]
    for o in lost:
        assert o.error["type"] == kind and o.error["retryable"] and "retry the request" in o.error["message"]
        assert o.token_ids, "a request without a token is resubmitted, never failed"
    return lost


@pytest.mark.parametrize("point", ["before_execute", "mid_transaction", "after_execute"])
def test_worker_death_at_a_named_point(tiny_model, point):
    """Requests that had produced tokens fail with worker_lost (a retry hint); every other one
    — queued or mid-prefill — is kept and completes exactly; the worker is recreated once (the
    fault does not fire again in the new one)."""
    skip = 1 if point == "mid_transaction" else 3          # steps that end with a save in flight are rarer
    # inline copies: which steps end with a transaction in flight does not depend on a thread
    eng = _start(tiny_model, {"kind": "worker_death", "point": point, "skip": skip}, max_concurrency=1,
                 copy_engine="inline")
    try:
        prompts = [random_prompt(60, seed=i) for i in range(3)]
        hs = [eng.generate(p, max_tokens=20, ignore_eos=True, recovery_frontier=50) for p in prompts]
        outs = [h.result(120) for h in hs]
        lost = _lost_only_after_tokens(outs, "worker_lost")
        for o, p in zip(outs, prompts):
            if o.finish_reason != "error":
                assert o.token_ids == _ref(tiny_model, p, 20)
        s = eng.stats()
        assert s["worker_recoveries"] == 1 and len(lost) + s["requests_resubmitted"] >= 1
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()


def test_a_worker_loss_keeps_every_request_without_a_token(tiny_model):
    """At the loss one request is generating, one is mid-prefill (admitted, no token yet), one
    is queued: the first fails with worker_lost and its tokens so far; the other two start again
    on the fresh worker and equal the oracle."""
    eng = _start(tiny_model, {"kind": "worker_death", "point": "before_execute", "skip": 8},
                 prefill_chunk_tokens=16, max_context=512, kv_capacity=8 * 64)
    try:
        short = random_prompt(16, seed=60)
        long = random_prompt(300, seed=61)
        queued = random_prompt(20, seed=62)
        hs = [eng.generate(p, max_tokens=n, ignore_eos=True) for p, n in ((short, 60), (long, 6), (queued, 6))]
        outs = [h.result(120) for h in hs]
        assert outs[0].finish_reason == "error" and _lost_only_after_tokens(outs, "worker_lost") == [outs[0]]
        assert outs[0].token_ids == _ref(tiny_model, short, 60)[:len(outs[0].token_ids)]
        assert outs[1].token_ids == _ref(tiny_model, long, 6) and outs[2].token_ids == _ref(tiny_model, queued, 6)
        s = eng.stats()
        assert s["worker_recoveries"] == 1 and s["requests_resubmitted"] == 2
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()


def test_forward_error_fails_only_the_rows_of_that_call(tiny_model):
    eng = _start(tiny_model, {"kind": "forward_error", "skip": 4})
    try:
        prompts = [random_prompt(30 + i, seed=20 + i) for i in range(4)]
        outs = [h.result(120) for h in [eng.generate(p, max_tokens=8, ignore_eos=True) for p in prompts]]
        failed = [o for o in outs if o.finish_reason == "error"]
        assert 1 <= len(failed) <= 2                       # the rows of one call (C = 2)
        assert all(o.error["type"] == "device_error" and "injected forward error" in o.error["message"]
                   for o in failed)
        for o, p in zip(outs, prompts):
            if o.finish_reason != "error":
                assert o.token_ids == _ref(tiny_model, p, 8)
        assert eng.stats()["device_errors"] == len(failed)
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()


def test_copy_error_fails_nothing_but_the_lost_save_and_integrity_returns(tiny_model):
    """Finding 2 through the user's path: after a failed copy the next transaction works and
    check_integrity() returns (it waited forever on the first wave's dead copy thread)."""
    eng = _start(tiny_model, {"kind": "copy_error", "count": 2})
    try:
        prompts = [random_prompt(70, seed=30 + i) for i in range(4)]
        outs = [h.result(120) for h in [eng.generate(p, max_tokens=6, ignore_eos=True, recovery_frontier=60)
                                        for p in prompts]]
        for o, p in zip(outs, prompts):
            assert o.finish_reason == "length", o.error        # saves only: no request is affected
            assert o.token_ids == _ref(tiny_model, p, 6)
        assert eng.stats()["copy_failures"] >= 1
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kind", ["completion_delay", "completion_drop", "completion_duplicate",
                                  "completion_reorder"])
def test_completion_faults_keep_outputs_exact(tiny_model, kind):
    # a dropped completion is settled by the timeout: 0.2 s instead of the default 2 s per transfer
    eng = _start(tiny_model, {"kind": kind, "count": 0, "steps": 3},
                 **({"completion_timeout_s": 0.2} if kind == "completion_drop" else {}))
    try:
        base = random_prompt(100, seed=40)
        prompts = [base + random_prompt(20, seed=41 + i) for i in range(3)]
        for i, p in enumerate(prompts):         # one at a time: the cache moves Device <-> Host
            # (separate sessions: each branches, so the earlier generation ends stay and move)
            out = eng.generate(p, max_tokens=6, ignore_eos=True, recovery_frontier=100,
                               session_id=f"s{i}").result(120)
            assert out.finish_reason == "length" and out.token_ids == _ref(tiny_model, p, 6)
        assert eng.stats()["bytes_d2h"] > 0
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()


def test_controller_restart_in_process(tiny_model):
    """Requests that had produced tokens end with controller_lost (as over Ray), a queued one
    starts again and completes; then it serves anew."""
    eng = _start(tiny_model, {"kind": "controller_restart", "skip": 10})
    try:
        prompts = [random_prompt(40, seed=50 + i) for i in range(3)]
        hs = [eng.generate(p, max_tokens=40, ignore_eos=True) for p in prompts]
        outs = [h.result(120) for h in hs]
        assert len(_lost_only_after_tokens(outs, "controller_lost")) == 2
        assert outs[2].token_ids == _ref(tiny_model, prompts[2], 40)
        assert eng.stats()["controller_restarts"] == 1
        _serves(eng, tiny_model)
    finally:
        eng.shutdown()
