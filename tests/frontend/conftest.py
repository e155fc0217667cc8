"""One `ninfer serve` (in-process transport, the tiny model, an API key) for every HTTP test of
this package, started on a free loopback port; and helpers to reach it."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from tests.serving import serving

KEY = "test-key"


@pytest.fixture(scope="session")
def served(tiny_model, tmp_path_factory):
    config = ('max_concurrency = 2\nmax_context = 1024\ndtype = "float32"\n\n[context_cache]\n'
              'host_capacity_bytes = 16777216\n')
    with serving(tiny_model, tmp_path_factory.mktemp("serve"), config, "--api-key", KEY,
                 "--served-model-name", "tiny", "--max-body-bytes", "2000000") as (base, proc):
        yield SimpleNamespace(base=base, pid=proc.pid, model=tiny_model)


@pytest.fixture
def server(served) -> str:
    return served.base


def reset_cache(server: str) -> None:
    """Empty the shared server's prefix cache (vLLM's POST /reset_prefix_cache), for a test that
    asserts reuse: with the cache full of the package's earlier points, a cold first save may be
    refused (the seed's capture admission). Retried while a request of an earlier test is still
    open (409)."""
    import time
    for _ in range(100):
        r = httpx.post(f"{server}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        if r.status_code != 409:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def scrape(server: str) -> dict:
    """/metrics parsed by prometheus_client's own parser: family name -> family."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=30).text)}


def metric(server: str, sample: str, **labels) -> float:
    """The value of one sample (its exposed name, e.g. ``vllm:prefix_cache_hits_total``)."""
    for fam in scrape(server).values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample)
