"""Strict weight loading from a local Hugging Face directory (safetensors, with or without index).

The expected tensor set is derived from the ModelConfig in the on-disk naming real checkpoints
use (one key per expert). A missing, unexpected or mis-shaped tensor is a ModelLoadError that
names it. ``mtp.*`` weights are loaded and kept (transformers drops them; the MTP backend needs
them later).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.errors import ModelLoadError
from ninfer.native.model.config import FULL, LINEAR, ModelConfig
from ninfer.progress import bar

Shapes = dict[str, tuple[int, ...]]
VISION_PREFIX = "model.visual."  # a Qwen3.5 checkpoint's vision tower (vision.py)


def _attention(prefix: str, c: ModelConfig) -> Shapes:
    q_out = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
    kv_out = c.num_key_value_heads * c.head_dim
    s = {
        f"{prefix}.q_proj.weight": (q_out, c.hidden_size),
        f"{prefix}.k_proj.weight": (kv_out, c.hidden_size),
        f"{prefix}.v_proj.weight": (kv_out, c.hidden_size),
        f"{prefix}.o_proj.weight": (c.hidden_size, c.num_attention_heads * c.head_dim),
        f"{prefix}.q_norm.weight": (c.head_dim,),
        f"{prefix}.k_norm.weight": (c.head_dim,),
    }
    if c.attention_bias:
        s.update({
            f"{prefix}.q_proj.bias": (q_out,),
            f"{prefix}.k_proj.bias": (kv_out,),
            f"{prefix}.v_proj.bias": (kv_out,),
            f"{prefix}.o_proj.bias": (c.hidden_size,),
        })
    return s


def _linear_attention(prefix: str, c: ModelConfig) -> Shapes:
    hv = c.linear_num_value_heads
    if c.split_gdn_projections:
        proj = {
            f"{prefix}.in_proj_qkv.weight": (c.conv_dim, c.hidden_size),
            f"{prefix}.in_proj_z.weight": (c.linear_value_dim, c.hidden_size),
            f"{prefix}.in_proj_b.weight": (hv, c.hidden_size),
            f"{prefix}.in_proj_a.weight": (hv, c.hidden_size),
        }
    else:
        proj = {
            f"{prefix}.in_proj_qkvz.weight": (2 * c.linear_key_dim + 2 * c.linear_value_dim, c.hidden_size),
            f"{prefix}.in_proj_ba.weight": (2 * hv, c.hidden_size),
        }
    return {
        **proj,
        f"{prefix}.conv1d.weight": (c.conv_dim, 1, c.linear_conv_kernel_dim),
        f"{prefix}.dt_bias": (hv,),
        f"{prefix}.A_log": (hv,),
        f"{prefix}.norm.weight": (c.linear_value_head_dim,),
        f"{prefix}.out_proj.weight": (c.hidden_size, c.linear_value_dim),
    }


def _dense_mlp(prefix: str, hidden: int, inter: int) -> Shapes:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _mlp(prefix: str, c: ModelConfig, moe: bool) -> Shapes:
    if not moe:
        return _dense_mlp(prefix, c.hidden_size, c.intermediate_size)
    s: Shapes = {f"{prefix}.gate.weight": (c.num_experts, c.hidden_size)}
    for e in range(c.num_experts):
        s.update(_dense_mlp(f"{prefix}.experts.{e}", c.hidden_size, c.moe_intermediate_size))
    if c.shared_expert_intermediate_size > 0:
        s.update(_dense_mlp(f"{prefix}.shared_expert", c.hidden_size, c.shared_expert_intermediate_size))
        s[f"{prefix}.shared_expert_gate.weight"] = (1, c.hidden_size)
    return s


def _decoder_layer(prefix: str, c: ModelConfig, kind: str, moe: bool) -> Shapes:
    s: Shapes = {
        f"{prefix}.input_layernorm.weight": (c.hidden_size,),
        f"{prefix}.post_attention_layernorm.weight": (c.hidden_size,),
    }
    if kind == LINEAR:
        s.update(_linear_attention(f"{prefix}.linear_attn", c))
    else:
        s.update(_attention(f"{prefix}.self_attn", c))
    s.update(_mlp(f"{prefix}.mlp", c, moe))
    return s


def expected_tensors(c: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with its shape, in HF on-disk naming (the text
    model's: a Qwen3.5 checkpoint's ``model.visual.*`` tower is ``vision.expected_vision_tensors``)."""
    h = c.hidden_size
    p = c.text_prefix
    s: Shapes = {f"{p}embed_tokens.weight": (c.vocab_size, h), f"{p}norm.weight": (h,)}
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, h)
    for i, kind in enumerate(c.layer_types):
        s.update(_decoder_layer(f"{p}layers.{i}", c, kind, c.is_moe_layer(i)))
    if c.mtp_num_hidden_layers:
        s.update({
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        })
        for j in range(c.mtp_num_hidden_layers):
            s.update(_decoder_layer(f"mtp.layers.{j}", c, FULL, c.num_experts > 0))
    return s


# ---- files ----------------------------------------------------------------------------------

def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> file, from the index if there is one, else by scanning the files."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelLoadError(f"{index}: not a valid safetensors index (no 'weight_map')") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelLoadError(f"{index}: names shard '{f.name}', which does not exist")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    files: dict[str, Path] = {}
    for f in shards:
        for name in _open(f).keys():
            files[name] = f
    return files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path.name}: cannot read safetensors file ({exc})") from None


def count_mtp_layers(names) -> int:
    idx = [int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))]
    return max(idx) + 1 if idx else 0


def load_tensors(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                 files: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """Load exactly the expected tensors, converted to ``dtype``; strict on names and shapes."""
    files = files if files is not None else weight_files(model_dir)
    expected = expected_tensors(cfg)
    if cfg.tie_word_embeddings:  # a tied checkpoint may still store lm_head; it is not used
        files = {n: f for n, f in files.items() if n != "lm_head.weight"}
    if cfg.model_type == "qwen3_5":  # the vision tower is loaded (strictly) by vision.VisionTower
        files = {n: f for n, f in files.items() if not n.startswith(VISION_PREFIX)}
    return load_checked(model_dir, files, expected, dtype, what=cfg.model_type)


def load_checked(model_dir: Path, files: dict[str, Path], expected: Shapes, dtype: torch.dtype,
                 what: str) -> dict[str, torch.Tensor]:
    """The strict core: ``files`` (name -> file) must hold exactly ``expected``, each of its shape,
    float and finite; returns them converted to ``dtype``. ``what`` names the model part in errors.

    An FP8 block-scaled checkpoint (``fp8.py``): a 2-D weight may come as float8_e4m3fn with its
    ``X.weight_scale_inv`` (fp32, one per 128 x 128 block) beside it; both are returned as stored
    (``fp8.fold`` pairs them). A scale without its weight, of the wrong shape, or an FP8 weight
    without a scale is an error like any other."""
    from ninfer.native.model.fp8 import FP8, SCALE_SUFFIX, scale_shape
    expected = dict(expected)
    for name in files:
        base = name[: -len(SCALE_SUFFIX)]
        if name.endswith(SCALE_SUFFIX) and len(expected.get(base, ())) == 2:
            expected[name] = scale_shape(expected[base])
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(f"{model_dir}: unexpected tensor '{unexpected[0]}'{more} for {what}")
    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{model_dir}: missing tensor '{missing[0]}'{more}")
    handles = {f: _open(f) for f in set(files.values())}
    out: dict[str, torch.Tensor] = {}
    # a bar only once loading has taken a second (a real checkpoint, not the tiny model); see
    # ninfer/progress.py for when it shows
    for name, shape in bar(expected.items(), total=len(expected), desc=f"loading {model_dir.name}",
                           unit="tensor", delay=1.0, leave=False):
        f = files[name]
        try:
            t = handles[f].get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"{f.name}: cannot read tensor '{name}' ({exc})") from None
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"{f.name}: tensor '{name}' has shape {tuple(t.shape)}, expected {shape}"
            )
        if not t.is_floating_point():
            raise ModelLoadError(f"{f.name}: tensor '{name}' has non-float dtype {t.dtype}")
        if name.endswith(SCALE_SUFFIX):
            t = t.to(torch.float32)
        elif name + SCALE_SUFFIX in files:
            if t.dtype != FP8:
                raise ModelLoadError(f"{f.name}: tensor '{name}' has a weight_scale_inv but dtype {t.dtype} "
                                     "(FP8 block-scaled weights are float8_e4m3fn)")
        elif t.dtype == FP8:
            raise ModelLoadError(f"{f.name}: FP8 tensor '{name}' has no '{name}{SCALE_SUFFIX}' beside it")
        else:
            t = t.to(dtype)
        if not torch.isfinite(t if t.dtype != FP8 else t.to(torch.float32)).all():
            raise ModelLoadError(f"{f.name}: tensor '{name}' contains NaN or Inf")
        out[name] = t
    return out
