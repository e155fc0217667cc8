"""Actor-level fault injection over Ray, through the public surface (``EngineConfig(faults=...)``,
``ray.kill``): a killed worker, delayed / reordered / duplicated / dropped completion messages,
a worker that dies at a named point, a restarted controller, a client that disconnects
mid-stream. Each asserts the exact outcome, and where the engine survives it ends with
check_integrity()."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import ray

import ninfer
from ninfer.actors.ray_actors import NAMESPACE, names
from tests.engine.harness import oracle
from tests.factories import random_prompt

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CFG = {"max_concurrency": 2, "max_context": 256, "kv_capacity": 4 * 64, "prefill_chunk_tokens": 48,
       "context_cache": {"device_state_slots": 1, "host_capacity_bytes": 4 << 20}}


def _actor(deployment: str, which: str):
    return ray.get_actor(names(deployment)[which], namespace=NAMESPACE)


def _start(model, deployment, faults=(), **kw):
    # a dropped completion is settled by the timeout: 0.2 s instead of the default 2 s per transfer
    drop = any(f["kind"] == "completion_drop" for f in faults)
    return ninfer.Engine.start(model, config={**CFG, "faults": list(faults), **({"completion_timeout_s": 0.2} if drop else {})},
                               dtype="float64", transport="ray", deployment=deployment, **kw)


def _serves_after_restart(eng, model) -> None:
    """The frontend reconnects to the restarted controller: a new request is exact again."""
    deadline = time.time() + 60
    p = random_prompt(30, seed=41)
    while True:
        try:
            o = eng.generate(p, max_tokens=5, ignore_eos=True).result(120)
            if o.finish_reason == "length":
                break
        except Exception:
            pass
        assert time.time() < deadline, "the deployment did not come back"
        time.sleep(0.5)
    assert o.token_ids == oracle(model, p, max_tokens=5)
    eng.check_integrity()


def _lost_only_after_tokens(outs, prompts, model, kind: str, n: int) -> int:
    """Requests a loss failed had produced tokens, and their error is typed with a retry hint;
    every other one completed exactly. Returns how many failed."""
    lost = 0
    for o, p in zip(outs, prompts):
        if o.finish_reason == "error":
            assert o.error["type"] == kind and o.error["retryable"] and "retry the request" in o.error["message"]
            lost += 1
        else:
            assert o.finish_reason == "length" and o.token_ids == oracle(model, p, max_tokens=n)
    return lost


def test_worker_killed_mid_cycle(tiny_model, deployment):
    eng = _start(tiny_model, deployment)
    try:
        prompts = [random_prompt(60, seed=i) for i in range(3)]
        hs = [eng.generate(p, max_tokens=150, ignore_eos=True) for p in prompts]
        for ev in hs[0]:                       # something is really running
            break
        ray.kill(_actor(deployment, "worker"))
        outs = [h.result(120) for h in hs]
        assert outs[0].finish_reason == "error" and "GPU worker" in outs[0].error["message"]
        assert _lost_only_after_tokens(outs, prompts, tiny_model, "worker_lost", 150) >= 1
        assert outs[2].finish_reason == "length"          # only queued: kept across the restart
        p = random_prompt(40, seed=9)
        out = eng.generate(p, max_tokens=6, ignore_eos=True).result(120)
        assert out.token_ids == oracle(tiny_model, p, max_tokens=6)
        assert eng.stats()["worker_recoveries"] == 1
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("faults", [
    [{"kind": "completion_delay", "steps": 3, "count": 0}],
    [{"kind": "completion_reorder", "steps": 2, "count": 0}, {"kind": "completion_duplicate", "count": 0}],
    [{"kind": "completion_drop", "count": 0}]], ids=["delayed", "reordered-duplicated", "dropped"])
def test_completion_message_faults(tiny_model, deployment, faults):
    """Transfers whose completions come late, out of order, twice, or never are settled
    exactly once (owner/generation checks; a timeout for dropped ones) — outputs stay exact."""
    eng = _start(tiny_model, deployment, faults)
    try:
        base = random_prompt(100, seed=20)
        prompts = [base + random_prompt(30, seed=21 + i) for i in range(4)] + [random_prompt(150, seed=30)]
        outs = []
        for p in prompts:                      # one at a time: the cache moves between Device and Host
            outs.append((p, eng.generate(p, max_tokens=8, ignore_eos=True, recovery_frontier=100).result(120)))
        for p, out in outs:
            assert out.finish_reason == "length", out.error
            assert out.token_ids == oracle(tiny_model, p, max_tokens=8)
        s = eng.stats()
        assert s["bytes_d2h"] > 0                # transfers really happened
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_controller_restarted(tiny_model, deployment):
    eng = _start(tiny_model, deployment)
    try:
        h = eng.generate(random_prompt(50, seed=40), max_tokens=200, ignore_eos=True)
        for _ in h:
            break
        ray.kill(_actor(deployment, "controller"), no_restart=False)
        out = h.result(120)
        assert out.finish_reason == "error" and out.error["type"] == "controller_lost"
        _serves_after_restart(eng, tiny_model)
    finally:
        eng.shutdown()


def test_client_disconnect_cancels_its_request(tiny_model, deployment):
    eng = _start(tiny_model, deployment, client_timeout=2.0)
    # this session's Ray by its address: "auto" finds the newest cluster on the machine, which
    # under xdist may be another worker's private one (the client then found no deployment)
    address = ray.get_runtime_context().gcs_address
    try:
        script = textwrap.dedent(f"""
            import ninfer, sys
            eng = ninfer.connect(address={address!r}, deployment={deployment!r})
            h = eng.generate(list(range(1, 40)), max_tokens=200, ignore_eos=True)
            for ev in h:
                print("streaming", flush=True)
                break
            sys.stdout.flush()
            import time; time.sleep(3600)
        """)
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        err = tempfile.TemporaryFile("w+")          # shown if the client dies before it streams
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
        if proc.stdout.readline().strip() != "streaming":
            proc.wait()
            err.seek(0)
            raise AssertionError(f"the client exited {proc.returncode} before streaming:\n{err.read()[-3000:]}")
        proc.kill()                            # the client vanishes mid-stream
        proc.wait()
        deadline = time.time() + 60
        while eng.stats()["running"] + eng.stats()["waiting"] > 0:
            assert time.time() < deadline, "the disconnected client's request kept running"
            time.sleep(0.5)
        eng.drop_caches()
        eng.check_integrity()
        s = eng.stats()
        assert all(v["available"] == v["total"] for v in s["occupancy"].values())
    finally:
        eng.shutdown()


def test_injected_worker_death_over_ray(tiny_model, deployment):
    """``faults=[worker_death at a point]``: the worker actor's process really exits there; the
    controller recreates it (without that fault), in-flight requests fail clearly, it serves on."""
    eng = _start(tiny_model, deployment, [{"kind": "worker_death", "point": "mid_transaction"}])
    try:
        prompts = [random_prompt(60, seed=60 + i) for i in range(3)]
        outs = [eng.generate(p, max_tokens=10, ignore_eos=True, recovery_frontier=50).result(120) for p in prompts]
        lost = _lost_only_after_tokens(outs, prompts, tiny_model, "worker_lost", 10)
        p = random_prompt(40, seed=70)
        out = eng.generate(p, max_tokens=6, ignore_eos=True).result(120)
        assert out.token_ids == oracle(tiny_model, p, max_tokens=6)
        s = eng.stats()
        assert s["worker_recoveries"] == 1 and lost + s["requests_resubmitted"] >= 1
        eng.drop_caches()
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_hung_worker_is_replaced_after_step_timeout_s(tiny_model, deployment):
    """``faults=[worker_hang]``: the worker stops answering mid-step; past ``step_timeout_s``
    the controller treats it as lost — the request in flight fails with ``worker_lost`` naming
    the timeout, the hung process is killed and replaced (without that fault) — and it serves on."""
    eng = ninfer.Engine.start(tiny_model, config={**CFG, "step_timeout_s": 2.0, "faults": [
        # the 7th step: past the prompt's units (with its anticipated saves), so the request has
        # its first token and fails (one without a token yet would be resubmitted and complete)
        {"kind": "worker_hang", "point": "before_execute", "skip": 6, "seconds": 120}]},
        dtype="float64", transport="ray", deployment=deployment)
    try:
        hung_pid = ray.get(_actor(deployment, "worker").pid.remote())
        t0 = time.time()
        out = eng.generate(random_prompt(60, seed=80), max_tokens=10, ignore_eos=True).result(120)
        assert out.finish_reason == "error" and out.error["type"] == "worker_lost"
        assert "step_timeout_s=2.0" in out.error["message"]
        assert time.time() - t0 < 60                 # not the hang's 120 s
        p = random_prompt(40, seed=81)
        assert eng.generate(p, max_tokens=6, ignore_eos=True).result(120).token_ids == oracle(tiny_model, p, max_tokens=6)
        assert eng.stats()["worker_recoveries"] == 1
        assert ray.get(_actor(deployment, "worker").pid.remote()) != hung_pid
        deadline = time.time() + 30                  # the hung process was killed
        while _alive(hung_pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(hung_pid)
        eng.check_integrity()
    finally:
        eng.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:             # a zombie is dead too
        return f.read().split(")")[1].split()[0] != "Z"


def test_injected_controller_restart_over_ray(tiny_model, deployment):
    """``faults=[controller_restart]``: the controller actor exits, Ray restarts it (the fault
    does not fire again), the frontend fails what was in flight and serves through the new one."""
    eng = _start(tiny_model, deployment, [{"kind": "controller_restart", "skip": 5}])
    try:
        p = random_prompt(50, seed=71)
        out = eng.generate(p, max_tokens=100, ignore_eos=True).result(120)
        _lost_only_after_tokens([out], [p], tiny_model, "controller_lost", 100)
        _serves_after_restart(eng, tiny_model)
        assert eng.stats()["controller_restarts"] == 1
    finally:
        eng.shutdown()


def test_killing_the_controller_then_the_worker_under_load_over_http(tiny_model, deployment):
    """The issue's fault test, through ``ninfer serve``'s server over the Ray transport: under
    load (C = 2, six streams), the controller is killed, then the worker. Streams that had a
    token end with a typed error event (``controller_lost`` / ``worker_lost``, ``code:
    retryable``); streams that had none were resubmitted and complete; a 400-digit max_tokens
    is a 400 (an OverflowError in the encoder before); /metrics counts both restarts, the
    resubmissions and the failures by kind; no actor log mentions ActorAlreadyExistsError."""
    import json
    import threading

    import httpx

    from ninfer.frontend.server import Server
    from tests.frontend.conftest import scrape
    from tests.frontend.scripted import running

    eng = _start(tiny_model, deployment)
    try:
        with running(Server(eng, "tiny")) as base:
            for victim, kind in (("controller", "controller_lost"), ("worker", "worker_lost")):
                results: list[dict] = [{} for _ in range(6)]

                def stream(i: int) -> None:
                    body = {"messages": [{"role": "user", "content": f"story {i} " * 5}], "max_tokens": 120,
                            "ignore_eos": True, "stream": True, "temperature": 0}
                    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=180) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                results[i]["error"] = chunk["error"]
                            for ch in chunk.get("choices", []):
                                if ch["delta"].get("content"):
                                    results[i]["tokens"] = results[i].get("tokens", 0) + 1
                                if ch.get("finish_reason"):
                                    results[i]["finish"] = ch["finish_reason"]
                threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
                for t in threads:
                    t.start()
                deadline = time.time() + 120
                while not any(r.get("tokens") for r in results):
                    assert time.time() < deadline
                    time.sleep(0.05)
                ray.kill(_actor(deployment, victim), no_restart=False)
                for t in threads:
                    t.join(timeout=240)
                failed = [r for r in results if "error" in r]
                assert failed and all(r["error"]["type"] == kind and r["error"]["code"] == "retryable"
                                      and r.get("tokens") for r in failed), results
                done = [r for r in results if "error" not in r]
                assert done and all(r["finish"] == "length" for r in done), results
            r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "max_tokens": int("9" * 400)}, timeout=60)
            assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
            fams = scrape(base)
            restarts = {s.labels["actor"]: s.value for s in fams["ninfer_actor_restarts"].samples}
            assert restarts == {"controller": 1.0, "worker": 1.0}
            failures = {s.labels["kind"]: s.value for s in fams["ninfer_request_failures"].samples}
            assert failures.get("controller_lost", 0) >= 1 and failures.get("worker_lost", 0) >= 1
            assert fams["ninfer_requests_resubmitted"].samples[0].value >= 2
        logs = ray._private.worker._global_node.get_logs_dir_path()
        files = [os.path.join(logs, f) for f in os.listdir(logs) if os.path.isfile(os.path.join(logs, f))]
        assert not [f for f in files if "ActorAlreadyExistsError" in open(f, errors="replace").read()]
    finally:
        eng.shutdown()
