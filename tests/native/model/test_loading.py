"""Strict weight loading and clear one-line errors for bad model directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.errors import ModelLoadError
from ninfer.native.model.model import HybridModel
from tests.factories import logits_in_chunks, random_prompt


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_model, dst)
    return dst


def _rewrite(d: Path, edit) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _error(d: Path) -> str:
    with pytest.raises(ModelLoadError) as exc:
        HybridModel.load(d, "float32")
    msg = str(exc.value)
    assert "\n" not in msg, "errors are one line"
    return msg


def test_missing_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    assert "missing tensor 'model.layers.2.self_attn.k_norm.weight'" in _error(model_copy)


def test_unexpected_tensor_is_named(model_copy):
    _rewrite(model_copy, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    assert "unexpected tensor 'model.layers.0.extra.weight'" in _error(model_copy)


def test_wrong_shape_is_named(model_copy):
    def edit(t):
        t["model.layers.0.linear_attn.out_proj.weight"] = torch.zeros(128, 100, dtype=torch.bfloat16)
    _rewrite(model_copy, edit)
    msg = _error(model_copy)
    assert "'model.layers.0.linear_attn.out_proj.weight' has shape (128, 100), expected (128, 256)" in msg


def test_corrupted_file_is_named(model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert "model.safetensors: cannot read safetensors file" in _error(model_copy)


def test_truncated_file_is_named(model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:4096])
    assert "model.safetensors" in _error(model_copy)


def test_nan_weights_are_refused(model_copy):
    def edit(t):
        t["model.norm.weight"] = torch.full_like(t["model.norm.weight"], float("nan"))
    _rewrite(model_copy, edit)
    assert "'model.norm.weight' contains NaN" in _error(model_copy)


def test_sharded_with_index_loads_identically(tiny_model, model_copy):
    tensors = load_file(str(model_copy / "model.safetensors"))
    (model_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model_copy / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tokens = random_prompt(40, seed=1)
    a = logits_in_chunks(HybridModel.load(tiny_model, "float64"), tokens, [])
    b = logits_in_chunks(HybridModel.load(model_copy, "float64"), tokens, [])
    assert torch.equal(a, b)


def test_index_naming_a_missing_shard(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "nope.safetensors"}}))
    assert "names shard 'nope.safetensors', which does not exist" in _error(model_copy)


def test_mtp_weights_are_kept(tiny_model):
    m = HybridModel.load(tiny_model, "float32")
    assert m.cfg.mtp_num_hidden_layers == 1
    assert "mtp.fc.weight" in m.mtp_tensors
    assert "mtp.layers.0.self_attn.q_proj.weight" in m.mtp_tensors
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in m.mtp_tensors


@pytest.mark.parametrize("edit,expected", [
    (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported"),
    (lambda c: c.update(num_key_value_heads=3), "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    (lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda c: c.update(layer_types=["linear_attention"] * 2), "layer_types has 2 entries but num_hidden_layers is 5"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
], ids=["model_type", "heads", "missing-field", "layer-types", "act", "rope"])
def test_bad_config_gives_one_clear_line(model_copy, edit, expected):
    cfg = json.loads((model_copy / "config.json").read_text())
    edit(cfg)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert expected in _error(model_copy)


def test_missing_directory_and_files(tmp_path):
    assert "model directory not found" in _error(tmp_path / "nowhere")
    assert "no config.json" in _error(tmp_path)
    (tmp_path / "config.json").write_text("{ broken")
    assert "invalid JSON" in _error(tmp_path)


def test_unsupported_dtype(tiny_model):
    with pytest.raises(ModelLoadError, match="dtype 'float16' is not supported"):
        HybridModel.load(tiny_model, "float16")


def test_all_dtypes_run(tiny_model):
    tokens = random_prompt(30, seed=2)
    for dtype in ("float64", "float32", "bfloat16"):
        logits = logits_in_chunks(HybridModel.load(tiny_model, dtype), tokens, [10])
        assert torch.isfinite(logits).all()


# ---- Qwen3.5 (text_config nesting, model.language_model.*, split GDN projections) -----------------

@pytest.fixture(scope="module")
def tiny_vision_dir(tmp_path_factory) -> Path:
    from ninfer.tiny.build import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_vision_load"), arch="qwen3_5_vision")


@pytest.fixture
def vision_copy(tiny_vision_dir, tmp_path) -> Path:
    dst = tmp_path / "v"
    shutil.copytree(tiny_vision_dir, dst)
    return dst


def test_qwen3_5_text_loader_is_strict(vision_copy):
    # named with the model.language_model. prefix; the split projections are the expected set
    _rewrite(vision_copy, lambda t: t.pop("model.language_model.layers.0.linear_attn.in_proj_z.weight"))
    assert "missing tensor 'model.language_model.layers.0.linear_attn.in_proj_z.weight'" in _error(vision_copy)
    _rewrite(vision_copy, lambda t: t.update({
        "model.language_model.layers.0.linear_attn.in_proj_z.weight": torch.zeros(3, 3)}))
    assert "in_proj_z.weight' has shape (3, 3)" in _error(vision_copy)
    _rewrite(vision_copy, lambda t: t.update({
        "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight": torch.zeros(3, 3)}))
    assert "unexpected tensor 'model.language_model.layers.0.linear_attn.in_proj_qkvz.weight'" in _error(vision_copy)


def test_qwen3_5_config_needs_text_config(vision_copy):
    from ninfer.native.model.config import parse_config

    raw = json.loads((vision_copy / "config.json").read_text())
    cfg = parse_config(raw)
    assert (cfg.model_type, cfg.text_prefix, cfg.split_gdn_projections) == ("qwen3_5", "model.language_model.", True)
    assert cfg.is_hybrid and cfg.num_experts == 0 and cfg.attn_output_gate and cfg.zero_centered_norm
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (raw["eos_token_id"],)
    del raw["text_config"]
    with pytest.raises(ModelLoadError, match="needs a 'text_config' object"):
        parse_config(raw)


def test_experts_are_stacked_on_the_host_before_the_device_sees_them(tiny_model, monkeypatch):
    """A loaded MoE model forms each layer (experts stacked, GDN rows permuted) where the
    checkpoint's tensors live — the host — and moves only the formed weights: the device never
    holds an expert twice (per-expert tensors beside their stack: non-expert + 2 x experts at
    the peak). ``meta`` stands in for the device; the loader's host dict is given up layer by
    layer."""
    import torch

    from ninfer.native.model import model as model_mod
    from ninfer.native.model.moe import MoeWeights
    stacked_on = []
    real_stack = torch.stack

    def stack(ts, *a, **k):
        stacked_on.extend({t.device.type for t in ts})
        return real_stack(ts, *a, **k)
    monkeypatch.setattr(torch, "stack", stack)
    m = model_mod.HybridModel.load(tiny_model, "float32", device="meta")
    moe = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoeWeights)]
    assert moe and set(stacked_on) == {"cpu"}
    assert all(w.gate_up.device.type == "meta" and w.down.device.type == "meta" for w in moe)
    assert m.embed.device.type == "meta" and all(layer.mixer.out_proj.device.type == "meta" for layer in m.layers
                                                 if hasattr(layer.mixer, "out_proj"))
