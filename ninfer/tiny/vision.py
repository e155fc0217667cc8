"""The tiny Qwen3.5 vision-language model: config.json and seeded weights, HF on-disk naming.

The text part is the tiny qwen3_next hybrid made dense (Qwen3.5 has no MoE) under Qwen3.5's
names: ``model.language_model.*``, and the GDN input projection split into
``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``. The vision part is a 2-block
tower with the real patch geometry (Conv3d [2, 16, 16], 2×2 merger) and a small 8×8 position table;
``preprocessor_config.json`` is Qwen3.5's but for the resize bounds (``preprocessor_config``).
"""

from __future__ import annotations

import math

import torch

from ninfer.native.model.config import parse_config
from ninfer.native.model.vision import (
    PREFIX,
    expected_vision_tensors,
    parse_vision_config,
)
from ninfer.tiny.weights import qwen3_next_config, random_tensors

# text rotary half-dim = head_dim 64 × 0.25 / 2 = 8, split T/H/W like Qwen3.5's [11, 11, 10] of 32
MROPE_SECTION = [3, 3, 2]


def qwen3_5_vision_config(vocab_size: int, eos_ids: list[int], pad_id: int, vision_ids: dict[str, int]) -> dict:
    """config.json of the tiny Qwen3.5 (model_type qwen3_5: text_config + vision_config)."""
    text = _text_raw(vocab_size, eos_ids, pad_id)
    text.pop("architectures")
    text.update(model_type="qwen3_5_text")
    for key in ("rope_theta", "partial_rotary_factor", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers"):
        text.pop(key, None)
    text["mtp_num_hidden_layers"] = 1         # Qwen3.5 ships one MTP layer (mtp.*)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": MROPE_SECTION, "mrope_interleaved": True}
    vision = {
        "model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_heads": 4, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64,
        "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": vision_ids["<|image_pad|>"],
        "video_token_id": vision_ids["<|video_pad|>"],
        "vision_start_token_id": vision_ids["<|vision_start|>"],
        "vision_end_token_id": vision_ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "eos_token_id": eos_ids[0],
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


def preprocessor_config() -> dict:
    """Qwen3.5's image processor settings, but images of 64×64 .. 128×128 pixels' area: grids of
    4×4 .. 8×8 patches (4 .. 16 image tokens) for square images, the size of the tiny tower's
    8×8 position table. An oblong image gets a side over 8 patches (the table is interpolated,
    as for any grid), and a very thin one more than 64 patches (smart_resize's rounding up)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True,
    }


def _text_raw(vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    raw = qwen3_next_config(vocab_size, eos_ids, pad_id)
    raw.update(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0)
    return raw


def random_vision_model(raw: dict, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of the tiny Qwen3.5: text (renamed from the qwen3_next generator) + vision."""
    # one MTP layer, as Qwen3.5 ships (mtp.* sort after every other tensor: the rest is unchanged)
    text = parse_config(_text_raw(raw["text_config"]["vocab_size"], [raw["eos_token_id"]], raw["pad_token_id"]),
                        mtp_layers=raw["text_config"].get("mtp_num_hidden_layers", 0))
    out: dict[str, torch.Tensor] = {}
    for name, t in random_tensors(text, seed, dtype).items():
        new = name.replace("model.", "model.language_model.", 1)
        if name.endswith("in_proj_qkvz.weight"):      # [q | k | v | z] rows, each projection on its own
            qkv = 2 * text.linear_key_dim + text.linear_value_dim
            out[new.replace("in_proj_qkvz", "in_proj_qkv")] = t[:qkv].contiguous()
            out[new.replace("in_proj_qkvz", "in_proj_z")] = t[qkv:].contiguous()
        elif name.endswith("in_proj_ba.weight"):
            hv = text.linear_num_value_heads
            out[new.replace("in_proj_ba", "in_proj_b")] = t[:hv].contiguous()
            out[new.replace("in_proj_ba", "in_proj_a")] = t[hv:].contiguous()
        else:
            out[new if name.startswith("model.") else name] = t
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in sorted(expected_vision_tensors(parse_vision_config(raw)).items()):
        out[name] = _vision_init(name[len(PREFIX):], shape, gen).to(dtype).contiguous()
    return out


def _vision_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Unit-scale activations through the tower; non-zero biases so every bias path is seen."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    if "norm" in name and name.endswith(".weight"):
        return normal(0.1, 1.0)
    if name.endswith(".bias"):
        return normal(0.1)
    if name == "pos_embed.weight":
        return normal(1.0)
    fan_in = math.prod(shape[1:])
    return normal(1.0 / math.sqrt(fan_in))
