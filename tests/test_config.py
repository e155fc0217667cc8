"""EngineConfig: plain values, TOML loading, ranges named in errors."""

from __future__ import annotations

import pytest

from ninfer.config import GIB, EngineConfig, kv_page_bounds
from ninfer.errors import ConfigError


def test_defaults_build_without_a_model():
    c = EngineConfig()
    assert c.max_concurrency == 4
    assert c.device_state_slots == 4          # default C extra slots
    assert c.kv_pages() is None               # solved from the memory budget later
    assert c.host_capacity(1000) == 8 * GIB + 8 * 1000


def test_kv_capacity_rounds_up_to_pages():
    assert EngineConfig(kv_capacity=1).kv_pages() == 1
    assert EngineConfig(kv_capacity=64).kv_pages() == 1
    assert EngineConfig(kv_capacity=65).kv_pages() == 2


def test_explicit_context_cache_values():
    c = EngineConfig.from_dict({"max_concurrency": 2, "context_cache": {"device_state_slots": 0,
                                                                        "host_capacity_bytes": 0}})
    assert c.device_state_slots == 0
    assert c.host_capacity(10**9) == 0


@pytest.mark.parametrize("raw,needle", [
    ({"max_concurrency": 0}, "max_concurrency=0 is out of range: allowed 1..8"),
    ({"max_concurrency": 9}, "max_concurrency=9 is out of range: allowed 1..8"),
    ({"max_context": 0}, "max_context=0 is out of range"),
    ({"kv_capacity": 0}, "kv_capacity=0 is out of range"),
    ({"dtype": "float16"}, "dtype='float16' is out of range: allowed float64 | float32 | bfloat16"),
    ({"context_cache": {"device_state_slots": -1}}, "context_cache.device_state_slots=-1"),
    ({"context_cache": {"host_capacity_bytes": -5}}, "context_cache.host_capacity_bytes=-5"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
    ({"cpu_threads": 0}, "cpu_threads=0 is out of range: allowed >= 1"),
    ({"max_concurrency": "four"}, "max_concurrency"),
    ({"no_such_field": 1}, "unknown field `no_such_field`"),
])
def test_invalid_values_name_field_and_range(raw, needle):
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_dict(raw)
    assert needle in str(exc.value)


def test_toml_round_trip(tmp_path):
    p = tmp_path / "engine.toml"
    p.write_text('max_concurrency = 3\nkv_capacity = 1000\ndtype = "float64"\n\n'
                 '[context_cache]\ndevice_state_slots = 2\nhost_capacity_bytes = 1048576\n')
    c = EngineConfig.from_toml(p)
    assert (c.max_concurrency, c.kv_pages(), c.dtype, c.device_state_slots) == (3, 16, "float64", 2)
    assert EngineConfig.coerce(str(p)) == c


def test_toml_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("max_concurrency = 12\n")
    with pytest.raises(ConfigError, match=r"bad.toml: .*max_concurrency=12"):
        EngineConfig.from_toml(p)
    p.write_text("max_concurrency = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        EngineConfig.from_toml(p)
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig.from_toml(tmp_path / "missing.toml")


def test_max_context_beyond_the_model():
    with pytest.raises(ConfigError, match=r"max_context=5000 is out of range: allowed 1..4096"):
        EngineConfig(max_context=5000).resolve_max_context(4096)
    assert EngineConfig().resolve_max_context(4096) == 4096


def test_kv_page_curve():
    # lower bound: one request alone at max_context, and at least C pages; upper: C contexts
    assert kv_page_bounds(4096, 4) == (64, 256)
    assert kv_page_bounds(100, 8) == (8, 16)
    assert kv_page_bounds(64, 1) == (1, 1)


def test_the_deploy_example_config_loads():
    from pathlib import Path
    c = EngineConfig.from_toml(Path(__file__).resolve().parents[1] / "deploy" / "engine.toml")
    assert c.max_concurrency == 4 and c.context_cache.device_state_slots == 4 and c.dtype == "bfloat16"


def test_fit_to_model_lowers_what_the_model_cannot_use():
    """A generic file on a short-context model: max_context and an explicit kv_capacity above
    C full contexts are lowered, one warning each; a config that fits is left alone."""
    cfg, notes = EngineConfig(max_context=32768, kv_capacity=262144).fit_to_model(4096)
    assert cfg.max_context == 4096 and cfg.kv_capacity == 4 * 64 * 64
    assert notes == [
        "max_context=32768 is above the model's max_position_embeddings (4096): using 4096",
        "kv_capacity=262144 is above C × ceil(max_context / 64) = 256 pages, the most 4 full contexts of "
        "4096 tokens can hold: using 16384"]
    fits = EngineConfig(max_context=1024, kv_capacity=4096)
    assert fits.fit_to_model(4096) == (fits, [])


def test_fit_to_model_rejects_a_kv_capacity_below_one_full_context():
    with pytest.raises(ConfigError, match=r"kv_capacity=64 \(1 pages of 64 tokens\) is out of range: allowed 64..256"):
        EngineConfig(kv_capacity=64).fit_to_model(4096)


def test_the_deploy_example_config_fits_the_tiny_model():
    from pathlib import Path
    c = EngineConfig.from_toml(Path(__file__).resolve().parents[1] / "deploy" / "engine.toml")
    fitted, notes = c.fit_to_model(4096)                 # the tiny model's max_position_embeddings
    assert fitted.max_context == 4096 and len(notes) == 1
    assert fitted.context_cache.host_capacity_bytes is None   # the default follows the model
