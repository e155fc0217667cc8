"""The Qwen3.5 vision tower against transformers' Qwen3_5VisionModel on the same safetensors."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.errors import ModelLoadError
from ninfer.native.model.vision import (
    VisionTower,
    expected_vision_tensors,
    parse_vision_config,
)
from ninfer.tiny.build import make_tiny_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

# two single images (one smaller, one larger than the 8×8 position table, non-square) and a
# 2-frame clip: interpolation, per-frame attention and the merge order all get exercised
GRIDS = {"mixed": [[1, 4, 6], [2, 6, 4], [1, 10, 8]], "one": [[1, 12, 16]]}  # "one": the unmasked path
# relative to the output's max |value|; float64 is bounded by transformers' float32 rope
# (measured: fp32 9e-7, fp64 2e-8, bf16 6e-3 where both sides round alike in bfloat16)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-6, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_vision"), arch="qwen3_5_vision"))


def _raw(model_dir: str) -> dict:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)


def _inputs(cfg, grids="mixed", seed=3):
    grid = torch.tensor(GRIDS[grids])
    n = int(grid.prod(-1).sum())
    return torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), grid


def test_checkpoint_has_exactly_the_hf_vision_keys(tiny_vision):
    hf, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        tiny_vision, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = parse_vision_config(_raw(tiny_vision))
    hf_shapes = {f"model.visual.{k}": tuple(v.shape) for k, v in hf.model.visual.state_dict().items()}
    assert hf_shapes == expected_vision_tensors(cfg)


@pytest.mark.parametrize("grids", list(GRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
def test_tower_matches_transformers(tiny_vision, dtype, grids):
    torch.set_num_threads(1)
    cfg = parse_vision_config(_raw(tiny_vision))
    pixels, grid = _inputs(cfg, grids)
    ours = VisionTower.load(tiny_vision, cfg, dtype).encode(pixels, grid)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vision, dtype=dtype).eval()
    with torch.no_grad():
        ref = hf.model.visual(pixels.to(dtype), grid_thw=grid).pooler_output
    assert ours.shape == ref.shape == (int(grid.prod(-1).sum()) // 4, cfg.out_hidden_size)
    assert ref.std() > 0.3, "reference output is degenerate; the comparison would prove nothing"
    assert ours.dtype == dtype
    err = ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err <= RTOL[dtype]


def test_loader_is_strict(tiny_vision, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = parse_vision_config(_raw(tiny_vision))
    tensors = load_file(f"{tiny_vision}/model.safetensors")
    del tensors["model.visual.blocks.1.attn.qkv.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor 'model.visual.blocks.1.attn.qkv.bias'"):
        VisionTower.load(tmp_path, cfg)
    tensors["model.visual.blocks.1.attn.qkv.bias"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="has shape"):
        VisionTower.load(tmp_path, cfg)
    tensors["model.visual.blocks.1.attn.qkv.bias"] = torch.zeros(3 * cfg.hidden_size)
    tensors["model.visual.deepstack_merger_list.0.norm.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.visual.deepstack"):
        VisionTower.load(tmp_path, cfg)
