"""A tiny FP8 block-scaled checkpoint (Qwen's ``-FP8`` layout) and its dequantised twin.

``make_tiny_fp8(tokenizer_dir, out)`` writes a small Qwen3-Next whose widths are multiples of the
128-row blocks where the loader keeps FP8 (attention projections, the GDN q|k|v|z projection with
128-dim heads, experts of 128 rows, the dense MLP) and not where it cannot (the GDN b|a rows, 4
of them, move inside one block: dequantised at load), every 2-D Linear weight block-quantized to
e4m3 beside its ``weight_scale_inv`` — except ``lm_head``, the routers and the shared-expert
gates, as the releases leave them — with a ``quantization_config`` saying so. ``dequantized(fp8,
out)`` writes the same model with every weight dequantised to fp32 and no quantization: the
reference an FP8 load must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ninfer.native.model.config import parse_config
from ninfer.native.model.fp8 import SCALE_SUFFIX, Fp8Weight, quantize

NOT_CONVERTED = ("lm_head", "mlp.gate", "shared_expert_gate")
SIZES = {"hidden_size": 256, "num_hidden_layers": 4,
         "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "linear_num_key_heads": 1,
         "linear_num_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
         "intermediate_size": 256, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
         "shared_expert_intermediate_size": 128, "decoder_sparse_step": 2, "mlp_only_layers": []}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def _converted(name: str, t: torch.Tensor) -> bool:
    module = "." + name[: -len(".weight")] + "."
    return name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name and \
        not any(f".{m}." in module for m in NOT_CONVERTED)


def make_tiny_fp8(tokenizer_dir: str | Path, out: str | Path, seed: int = 3) -> Path:
    """An FP8 tiny Qwen3-Next (MoE on every other layer, a dense MLP between, MTP head) beside
    the tokenizer of ``tokenizer_dir`` (a tiny model directory)."""
    from ninfer.tiny.weights import random_tensors
    src, dst = Path(tokenizer_dir), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    raw.update(SIZES)
    raw.pop("mtp_num_hidden_layers", None)
    cfg = parse_config(raw, mtp_layers=1)
    tensors = random_tensors(cfg, seed, dtype=torch.float32)
    out_t: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _converted(name, t):
            q = quantize(t * 4)                    # spread over e4m3's range: blocks of real scale
            out_t[name], out_t[name + SCALE_SUFFIX] = q.weight, q.scale_inv
        else:
            out_t[name] = t.to(torch.bfloat16)
    save_file(out_t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw["quantization_config"] = {"activation_scheme": "dynamic", "quant_method": "fp8",
                                  "weight_block_size": [128, 128], "modules_to_not_convert": list(NOT_CONVERTED)}
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def dequantized(fp8_dir: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 checkpoint with every weight dequantised (fp32 products, rounded to ``dtype``) and
    no ``quantization_config``: the same model, plain."""
    src, dst = Path(fp8_dir), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    t = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, x in t.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = t.get(name + SCALE_SUFFIX)
        plain[name] = Fp8Weight(x, scale.float()).dequantize(dtype) if scale is not None else x.to(dtype)
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst
