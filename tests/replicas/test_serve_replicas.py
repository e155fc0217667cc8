"""``ninfer serve --replicas 2``: one OpenAI endpoint over two engines; the router's decisions on
``/metrics``; a conversation's next turn served from its restore point through the router."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.serving import serving


def test_replicas_need_the_ray_transport(tiny_model):
    out = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", tiny_model, "--transport", "inproc",
                          "--replicas", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == ("ninfer: error: replicas=2 needs transport='ray' (each replica "
                                                  "is a controller and a GPU worker actor)")


@pytest.mark.ray
@pytest.mark.slow
def test_serve_two_replicas_over_http(tiny_model, tmp_path):
    config = 'max_concurrency = 2\nmax_context = 1024\ncost_calibration = false\n'
    with serving(tiny_model, tmp_path, config, "--transport", "ray", "--replicas", "2",
                 "--deployment", "http-replicas") as (base, _):
        system = {"role": "system", "content": "You are a careful assistant. " * 40}
        msgs = [[system, {"role": "user", "content": f"question number {i}"}] for i in range(2)]
        with httpx.Client(base_url=base, timeout=300) as http:
            answers = []
            for i, m in enumerate(msgs):
                r = http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 5, "temperature": 0,
                                                            "user": f"u{i}"})
                assert r.status_code == 200, r.text
                answers.append(r.json()["choices"][0]["message"]["content"])
            follow = msgs[0] + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "more"}]
            r = http.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 3, "temperature": 0,
                                                        "user": "u0"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
            metrics = http.get("/metrics").text
        assert 'ninfer_replicas{model_name=' in metrics and 'state="live"} 2.0' in metrics
        routed = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines() if line.startswith("ninfer_router_routed_total{")}
        assert sum(routed.values()) == 3 and routed["restore"] >= 2, routed
