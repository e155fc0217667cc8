"""`ninfer plan` (issue 33, item 4) on the published configs (tests/native/configs: Qwen3-Next-
80B-A3B and its -FP8 release, Qwen3.5-35B-A3B, Qwen3.5-27B; the FP8 release's
``modules_to_not_convert`` could not be read offline — the fixture names lm_head and every
layer's router and shared-expert gate, as Qwen's FP8 MoE releases do): the weights and the
per-token / per-image figures of DESIGN.md §9, the engine's own layout solve on what the GPU
has free after the weights, the flagship fitting one H200 in FP8 and refused in bf16 with the
reason, and the weight accounting against what a loaded model really holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ninfer.config import EngineConfig
from ninfer.native.layout import MAIN, MTP, resolve_layout
from ninfer.native.plan import GIB, make_plan, read_config, weight_bytes

CONFIGS = Path(__file__).parent / "configs"
H200, HOST = 139, 128
# name: (weights in GB as DESIGN.md §9 gives them, KV bytes per token, StateImage MB)
PUBLISHED = {"qwen3_next_80b_a3b": (163, 24576, 77.3), "qwen3_next_80b_a3b_fp8": (82, 24576, 77.3),
             "qwen3_5_35b_a3b": (72, 20480, 64.4), "qwen3_5_27b": (56, 65536, 153.9)}


def _ec(**kw) -> EngineConfig:
    return EngineConfig(**{"dtype": "bfloat16", "max_concurrency": 8, "max_context": 32768,
                           "prefill_chunk_tokens": 2048, **kw})


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_configs_give_the_published_figures(name):
    weights_gb, kv_token, image_mb = PUBLISHED[name]
    plan = make_plan(CONFIGS / f"{name}.json", 400, 400, _ec())
    assert plan.weights.total / 1e9 == pytest.approx(weights_gb, rel=0.02)
    lay = plan.layout
    assert lay.kv_page_bytes[MAIN] == 64 * kv_token
    assert lay.state_image_bytes / 1e6 == pytest.approx(image_mb, abs=0.1)


def test_the_flagship_in_fp8_fits_one_h200_with_eight_32k_lanes_and_mtp():
    """Qwen3-Next-80B-A3B-FP8 on one H200 (139 GiB, 128 GiB host): 8 lanes of 32k tokens have all
    their Main pages (no sharing), every lane its StateImage and more, MTP k = 3 its pool and the
    verify rows' kept states — and the bf16 release is refused, saying why."""
    plan = make_plan(CONFIGS / "qwen3_next_80b_a3b_fp8.json", H200, HOST,
                     _ec(speculative={"method": "mtp", "num_tokens": 3}))
    assert plan.fits, plan.refusal
    lay = plan.layout
    assert lay.main_pages == 8 * 32768 // 64 and lay.state_slots >= 8 and lay.kv_pages[MTP] > lay.main_pages
    assert plan.weights.fp8 > 70e9 and plan.weights.scales < 0.1e9
    bf16 = make_plan(CONFIGS / "qwen3_next_80b_a3b.json", H200, HOST, _ec())
    assert not bf16.fits and "weights alone (162.6 GB)" in bf16.refusal and "FP8" in bf16.refusal
    big_gpu = make_plan(CONFIGS / "qwen3_next_80b_a3b.json", 200, HOST, _ec())
    assert not big_gpu.fits and "host memory" in big_gpu.refusal      # the loader's host peak


def test_what_cannot_fit_is_refused_with_the_engines_own_numbers():
    plan = make_plan(CONFIGS / "qwen3_5_27b.json", 56, HOST, _ec())
    assert not plan.fits and "does not fit the memory budget" in plan.refusal and "KV pages" in plan.refusal
    arena = make_plan(CONFIGS / "qwen3_5_35b_a3b.json", H200, 96, _ec(context_cache={"host_capacity_bytes": 100 * GIB}))
    assert not arena.fits and "Host arena" in arena.refusal


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_plan_is_the_engines_own_layout_solve(name, monkeypatch):
    """The worker solves its layout with no budget on CUDA: ``empty_cache()`` then the free
    memory × gpu_memory_utilization. Given the free memory the plan assumes (the GPU less the
    reserve and the weights), that solve is the plan's layout, field for field."""
    plan = make_plan(CONFIGS / f"{name}.json", 192, 192, _ec(speculative={"method": "mtp", "num_tokens": 2}))
    free = plan.gpu_bytes - plan.reserve_bytes - plan.weights.total
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, plan.gpu_bytes))
    _, cfg, _ = read_config(CONFIGS / f"{name}.json")
    assert resolve_layout(cfg, plan.ec, torch.device("cuda")) == plan.layout


def test_the_weight_accounting_is_what_a_loaded_model_holds(tiny_model):
    """The plan's weight bytes for the tiny model's directory equal the bytes of every tensor a
    loaded HybridModel holds (stacked experts, permuted GDN projections, the MTP head's): the
    memory under them, a view counted once (the CPU path's fused products hold the projections,
    which are views of them: ``cpu_layers``). Beyond that the CPU layers keep only vectors (norm
    scales, decay constants)."""
    import dataclasses
    from ninfer.native.model.model import HybridModel
    raw, cfg, _ = read_config(tiny_model)
    m = HybridModel.load(tiny_model, "float32")
    layers = [dataclasses.replace(layer, cpu=None) for layer in m.layers]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in _tensors([layers, m.embed, m.final_norm, m.lm_head, m.mtp_tensors])}
    assert weight_bytes(cfg, raw, torch.float32).total == sum(held.values())
    assert all(layer.cpu is not None for layer in m.layers)
    extra = [t for t in _tensors([layer.cpu for layer in m.layers]) if t.untyped_storage().data_ptr() not in held]
    assert extra and all(t.dim() == 1 for t in extra)
    assert cfg.mtp_num_hidden_layers == m.cfg.mtp_num_hidden_layers > 0


def _tensors(x):
    import dataclasses
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def test_ninfer_plan_prints_the_layout_and_exits_by_the_verdict(capsys):
    from ninfer.cli import main
    fp8 = str(CONFIGS / "qwen3_next_80b_a3b_fp8.json")
    assert main(["plan", fp8, "--gpu-memory", "139", "--host-memory", "128", "--max-context", "32768",
                 "--speculative", "mtp:3"]) == 0
    out = capsys.readouterr().out
    assert "verdict    fits" in out and "8 lanes x 32768 tokens need 4096 Main pages: solved 4096" in out
    assert main(["plan", str(CONFIGS / "qwen3_next_80b_a3b.json"), "--gpu-memory", "139", "--host-memory", "128",
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is False and "weights alone" in doc["refusal"]
