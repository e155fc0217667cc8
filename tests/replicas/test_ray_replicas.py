"""Two engine replicas behind one frontend, as a user runs them (``Engine.start(replicas=2)``,
``ninfer.connect``): outputs equal the oracle, requests with a shared prefix meet on one replica,
a session's next turn follows its restore point, and a replica killed under load loses nothing
queued."""

from __future__ import annotations

import random
import time

import pytest

import ninfer
from ninfer.frontend.metrics import prometheus
from tests.engine.harness import oracle
from tests.factories import random_prompt

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CFG = {"max_concurrency": 2, "max_context": 512, "prefill_chunk_tokens": 64, "cost_calibration": False}


@pytest.fixture
def replicated(tiny_model, deployment):
    eng = ninfer.Engine.start(tiny_model, config=CFG, dtype="float64", transport="ray", deployment=deployment,
                              replicas=2)
    yield eng
    eng.shutdown()


def test_two_replicas_serve_one_endpoint_and_route_by_restore_points(replicated, tiny_model, deployment):
    eng = replicated
    system = random_prompt(160, seed=11)
    # two requests sharing a prefix, submitted together: the second follows the first
    first = [system + random_prompt(12, seed=20 + i) for i in range(2)]
    hs = [eng.generate(p, max_tokens=6, session_id=f"s{i}") for i, p in enumerate(first)]
    outs = [h.result(300) for h in hs]
    for p, o in zip(first, outs):
        assert o.finish_reason == "length" and o.token_ids == oracle(tiny_model, p, max_tokens=6)
    r = eng.stats()["router"]
    assert r["routed_by_reason"]["inflight"] == 1, r
    # an unrelated request goes to the other (idle) replica
    other = random_prompt(40, seed=30)
    assert eng.generate(other, max_tokens=3).result(300).token_ids == oracle(tiny_model, other, max_tokens=3)
    s = eng.stats()
    per = {rep["slot"]: rep for rep in s["replicas"]}
    assert sorted(rep["finished"] for rep in per.values()) == [1, 2]
    assert s["finished"] == 3 and s["prefill_tokens"] == sum(rep["prefill_tokens"] for rep in per.values())
    assert all(v["summary_entries"] > 0 for v in s["router"]["replicas"].values())
    # the next turn of session 0 reuses its E: routed by a restore position, served from cache
    nxt = first[0] + outs[0].token_ids + random_prompt(10, seed=40)
    out = eng.generate(nxt, max_tokens=4, session_id="s0").result(300)
    assert out.token_ids == oracle(tiny_model, nxt, max_tokens=4)
    assert out.usage.cached_tokens >= len(first[0]) + 5
    s = eng.stats()
    assert s["router"]["routed_by_reason"]["restore"] == 1, s["router"]
    text = prometheus(s, model="tiny").decode()
    assert 'ninfer_router_routed_total{model_name="tiny",reason="restore"} 1.0' in text
    assert 'ninfer_router_summary_entries{model_name="tiny",replica="0"}' in text
    assert 'ninfer_replicas{model_name="tiny",state="live"} 2.0' in text
    # a second client of the same deployment sees the same engine
    other_client = ninfer.connect(address="auto", deployment=deployment)
    try:
        p = random_prompt(30, seed=50)
        assert other_client.generate(p, max_tokens=3).result(300).token_ids == oracle(tiny_model, p, max_tokens=3)
    finally:
        other_client.shutdown()
    eng.drop_caches()
    eng.check_integrity()
    assert all(v["summary_entries"] == 0 for v in eng.stats()["router"]["replicas"].values())


def test_a_replica_killed_under_load_loses_nothing_queued(tiny_model, deployment, ray_session):
    """One lane per replica and eight requests: replica 1 holds one generating and queued ones
    when it is killed. The queued ones are re-routed and complete (equal to the oracle); the
    generating one fails with ``replica_lost`` (retryable); replica 1 is replaced and joins with
    an empty summary; new requests are served."""
    ray = ray_session
    cfg = {**CFG, "max_concurrency": 1}
    eng = ninfer.Engine.start(tiny_model, config=cfg, dtype="float64", transport="ray", deployment=deployment,
                              replicas=2)
    try:
        rng = random.Random(3)
        prompts = [random_prompt(rng.randint(20, 40), seed=60 + i) for i in range(8)]
        hs = [eng.generate(p, max_tokens=60) for p in prompts]
        first = next(iter(hs[1]))                       # replica 1's first request is generating
        assert first.token_ids
        before = eng.stats()["router"]["replicas"]["1"]
        assert before["outstanding"] >= 2, before       # and more wait behind it
        ray.kill(ray.get_actor(f"{deployment}-r1.0-controller", namespace="ninfer"))
        lost = done = 0
        for p, h in zip(prompts, hs):
            out = h.result(300)
            if out.finish_reason == "error":
                assert out.error["type"] == "replica_lost" and out.error["retryable"], out.error
                lost += 1
            else:
                assert out.token_ids == oracle(tiny_model, p, max_tokens=60)
                done += 1
        assert lost == 1 and done == 7
        deadline = time.monotonic() + 120
        while True:
            s = eng.stats()
            keys = {rep["slot"]: (rep["key"], rep["state"]) for rep in s["replicas"]}
            if keys.get(1) == ("1.1", "live"):
                break
            assert time.monotonic() < deadline, keys
            time.sleep(0.5)
        f = s["frontend"]
        assert f["replicas_lost"] == 1 and f["failed_in_flight"] == 1 and f["rerouted"] >= 1
        assert s["router"]["replicas"]["1"]["summary_entries"] == 0      # the replacement starts empty
        again = [eng.generate(random_prompt(25, seed=90 + i), max_tokens=4) for i in range(4)]
        assert all(h.result(300).finish_reason == "length" for h in again)
        assert eng.stats()["router"]["replicas"]["1"]["outstanding"] == 0
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert not [g for g in ray.util.placement_group_table().values()
                if g["name"].startswith(f"{deployment}-r") and g["state"] != "REMOVED"]


def test_a_replicated_start_that_fails_in_the_workers_is_one_error_and_leaves_nothing(tiny_model, deployment,
                                                                                       ray_session):
    """A layout no worker can build: the start raises the worker's own error, and neither the
    replicas' actors nor their placement groups are left on the cluster."""
    ray = ray_session
    with pytest.raises(ninfer.ConfigError, match="memory budget"):
        ninfer.Engine.start(tiny_model, config={**CFG, "memory_budget_bytes": 4096}, transport="ray",
                            deployment=deployment, replicas=2)
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(deployment)]
    assert not left
    assert not [g for g in ray.util.placement_group_table().values()
                if (g["name"] or "").startswith(f"{deployment}-r") and g["state"] != "REMOVED"]


def test_draining_a_replica_under_load_fails_nothing_and_replaces_it(tiny_model, deployment):
    """``drain_replica(1)`` while both replicas hold work: replica 1 takes nothing new, finishes
    what it holds, and a fresh replica takes its slot; every request completes exactly."""
    import threading
    cfg = {**CFG, "max_concurrency": 1}
    eng = ninfer.Engine.start(tiny_model, config=cfg, dtype="float64", transport="ray", deployment=deployment,
                              replicas=2)
    try:
        prompts = [random_prompt(30, seed=120 + i) for i in range(6)]
        hs = [eng.generate(p, max_tokens=20) for p in prompts]
        assert eng.stats()["router"]["replicas"]["1"]["outstanding"] >= 2
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(eng.drain_replica(1)))
        t.start()
        later = [random_prompt(25, seed=140 + i) for i in range(3)]
        time.sleep(0.2)
        hl = [eng.generate(p, max_tokens=5) for p in later]      # while draining: replica 0 (or queued)
        for p, h in zip(prompts, hs):
            assert h.result(300).token_ids == oracle(tiny_model, p, max_tokens=20)
        for p, h in zip(later, hl):
            assert h.result(300).token_ids == oracle(tiny_model, p, max_tokens=5)
        t.join(300)
        assert done["key"] == "1.1" and done["state"] == "live", done
        s = eng.stats()
        assert s["frontend"].get("replicas_drained") == 1 and not s["frontend"].get("failed_in_flight")
        assert {r["key"] for r in s["replicas"]} == {"0.0", "1.1"}
        with pytest.raises(ninfer.RequestError, match="not serving"):
            eng.drain_replica(7)
    finally:
        eng.shutdown()
