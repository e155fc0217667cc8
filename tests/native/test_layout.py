"""Device layout and the Main-KV capacity curve (seed: 配置)."""

from __future__ import annotations

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.errors import ConfigError
from ninfer.native.layout import MAIN, MTP, resolve_layout
from ninfer.native.model.model import HybridModel

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return HybridModel.load(tiny_model, "float32").cfg


def test_explicit_capacity_rounds_to_pages(cfg):
    lay = resolve_layout(cfg, EngineConfig(max_concurrency=2, max_context=1000, kv_capacity=1100), CPU)
    assert lay.kv_pages[MAIN] == 18                # ceil(1100 / 64)
    assert lay.kv_pages[MTP] == 0                  # backend pools are typed and zero-sized here
    assert lay.state_slots == 2 + 2                # C basic + default C extra
    assert lay.kv_page_bytes[MAIN] == 2 * 2 * 64 * 2 * 64 * 4   # K+V × 2 attention layers × 64 tok × 2 heads × 64 dims × fp32


@pytest.mark.parametrize("kv,msg", [
    (64 * 15, "allowed 16..32 pages"),            # below ceil(1000 / 64) = 16
    (64 * 33, "allowed 16..32 pages"),            # above C × 16
])
def test_explicit_capacity_outside_the_curve(cfg, kv, msg):
    with pytest.raises(ConfigError, match=msg):
        resolve_layout(cfg, EngineConfig(max_concurrency=2, max_context=1000, kv_capacity=kv), CPU)


def test_lower_bound_is_at_least_c_pages(cfg):
    with pytest.raises(ConfigError, match="allowed 8..8 pages"):
        resolve_layout(cfg, EngineConfig(max_concurrency=8, max_context=64, kv_capacity=64 * 7), CPU)
    assert resolve_layout(cfg, EngineConfig(max_concurrency=8, max_context=64, kv_capacity=64 * 8), CPU).main_pages == 8


def test_solved_capacity_fits_the_budget(cfg):
    ec = EngineConfig(max_concurrency=4, max_context=4096, memory_budget_bytes=20 << 20)
    lay = resolve_layout(cfg, ec, CPU)
    used = lay.main_pages * lay.kv_page_bytes[MAIN] + lay.state_slots * lay.state_image_bytes + lay.workspace_bytes
    assert used <= 28 << 20 and 64 < lay.main_pages < 256
    assert (lay.main_pages + 1) * lay.kv_page_bytes[MAIN] + used - lay.main_pages * lay.kv_page_bytes[MAIN] > 20 << 20
    big = resolve_layout(cfg, EngineConfig(max_concurrency=4, max_context=4096, memory_budget_bytes=1 << 40), CPU)
    assert big.main_pages == 4 * 64                # clipped to the top of the curve


def test_budget_too_small_names_the_numbers(cfg):
    with pytest.raises(ConfigError, match=r"at least 64 KV pages .* budget 1048576 B"):
        resolve_layout(cfg, EngineConfig(max_context=4096, memory_budget_bytes=1 << 20), CPU)
    with pytest.raises(ConfigError, match="does not fit the memory budget"):
        resolve_layout(cfg, EngineConfig(max_context=4096, kv_capacity=4096, memory_budget_bytes=1 << 20), CPU)


def test_host_default_is_8gib_plus_8_images(cfg):
    lay = resolve_layout(cfg, EngineConfig(max_context=1024, kv_capacity=1024), CPU)
    assert lay.host_capacity_bytes == (8 << 30) + 8 * lay.state_image_bytes


def test_cuda_graphs_take_their_pool_and_scratch_from_the_budget(cfg):
    """On CUDA (solved here without a device: the budget is given) the graphs' memory pool —
    the largest graph's activations (4 decode rows beside a 256-token chunk) and every graph's
    hidden-sized outputs — and their scratch page and slot come off the KV pages; ``enforce_eager`` and the
    CPU reserve nothing; a longer chunk budget reserves more."""
    from ninfer.native import graphs as g
    from ninfer.native.layout import workspace_bytes
    cuda = torch.device("cuda")
    ec = dict(max_concurrency=4, max_context=4096, memory_budget_bytes=28 << 20)
    graphs = resolve_layout(cfg, EngineConfig(**ec), cuda)
    eager = resolve_layout(cfg, EngineConfig(**ec, enforce_eager=True), cuda)
    cpu = resolve_layout(cfg, EngineConfig(**ec), CPU)
    assert eager.graph_bytes == cpu.graph_bytes == 0
    keys = g.plan(4, 0, 256)
    assert keys[0] == (g.CHUNK, 4, 1, 256) and len(keys) == 3 + 4 * 3   # decode 1, 2, 4; chunks (0..4) x (64..256)
    outputs = sum(((b + 1 if p == g.CHUNK else g.tokens(k)) + g.tokens(k)) * cfg.hidden_size * 4
                  for k in keys for p, b in [k[:2]])
    assert graphs.graph_bytes == (workspace_bytes(cfg, 260, 4) + outputs + graphs.kv_page_bytes[MAIN]
                                  + graphs.state_image_bytes)
    # the tiny model is a MoE: on the kernel path chunks past FUSED_MAX_ROWS (256) run eagerly, so a
    # longer chunk budget adds no graph; without MoE layers it does
    import msgspec
    longer = resolve_layout(cfg, EngineConfig(**{**ec, "memory_budget_bytes": 64 << 20}, prefill_chunk_tokens=512),
                            cuda)
    assert longer.graph_bytes == graphs.graph_bytes
    dense = msgspec.structs.replace(cfg, num_experts=0)
    short_dense = resolve_layout(dense, EngineConfig(**ec), cuda)
    long_dense = resolve_layout(dense, EngineConfig(**{**ec, "memory_budget_bytes": 64 << 20},
                                                    prefill_chunk_tokens=512), cuda)
    assert long_dense.graph_bytes > short_dense.graph_bytes
    assert graphs.main_pages < eager.main_pages
    used = graphs.main_pages * graphs.kv_page_bytes[MAIN] + graphs.state_slots * graphs.state_image_bytes \
        + graphs.workspace_bytes + graphs.graph_bytes
    assert used <= 28 << 20


def test_free_memory_is_measured_after_the_cache_is_given_back(cfg, monkeypatch):
    """Without a budget on CUDA the solve reads the free memory — after ``empty_cache()``, so
    what the caching allocator keeps from loading (freed, not returned) counts as free."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (calls.append("mem_get_info"),
                                                                          (64 << 20, 80 << 30))[1])
    lay = resolve_layout(cfg, EngineConfig(max_concurrency=2, max_context=1024, enforce_eager=True),
                         torch.device("cuda"))
    assert calls == ["empty_cache", "mem_get_info"] and lay.main_pages > 0


def test_moe_chunk_graphs_stop_where_the_fused_kernel_stops_paying(cfg, tiny_model):
    """On the kernel path a MoE model's chunk graphs stop at FUSED_MAX_ROWS tokens (longer chunks
    run eagerly on the grouped op: the per-(token, expert) kernel would read each chosen expert
    once per token); the torch path and a dense model keep every chunk size up to the budget."""
    import msgspec

    from ninfer.native import graphs as g
    from ninfer.native.model.moe import FUSED_MAX_ROWS
    assert g.chunk_cap(cfg, fused_moe=True) == FUSED_MAX_ROWS
    assert g.chunk_cap(cfg, fused_moe=False) is None
    assert g.chunk_cap(msgspec.structs.replace(cfg, num_experts=0), fused_moe=True) is None
    assert g.chunk_sizes(2048, FUSED_MAX_ROWS) == [64, 128, 256]
    assert g.chunk_sizes(2048) == [64, 128, 256, 512, 1024, 2048]
    assert max(k[3] for k in g.plan(8, 4, 2048, FUSED_MAX_ROWS)) == 256
