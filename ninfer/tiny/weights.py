"""Seeded random weights and config.json of the tiny test/demo models.

The scale of each tensor is chosen so that the model is *informative* for the tests: logits
have a standard deviation of a few units (the top-2 gap is rarely tiny, so fp32 and bf16 runs
rarely flip a greedy token), and the token mixers contribute to the residual stream about as
much as the embedding (so a wrong recurrent state or a wrong KV page changes the output —
otherwise the oracle could not see cache bugs).
"""

from __future__ import annotations

import math

import torch

from ninfer.native.model.config import FULL, LINEAR, ModelConfig
from ninfer.native.model.weights import expected_tensors

LOGIT_STD = 4.0


def qwen3_next_config(vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    """A 5-layer hybrid (3 GDN + 2 gated attention), MoE everywhere, one MTP layer.

    Linear head dims are 64 and positions go to 4096 so that the vLLM CPU build can load the
    same directory for side-by-side benchmarks (DESIGN.md §8).
    """
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 5,
        "layer_types": [LINEAR, LINEAR, FULL, LINEAR, FULL],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


def qwen3_config(vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    """A 4-layer pure-attention Qwen3 with tied embeddings (the degenerate hybrid)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "intermediate_size": 256,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Initial value of one tensor, chosen by its role (see the module docstring)."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(LOGIT_STD / math.sqrt(cfg.hidden_size))
    if name.endswith("linear_attn.norm.weight"):          # gated norm scales by w
        return normal(0.1, 1.0)
    if "norm" in name.rsplit(".", 2)[-2]:                 # every RMSNorm, incl. mtp.pre_fc_norm_*
        return normal(0.1, 0.0 if cfg.zero_centered_norm else 1.0)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("A_log"):                            # per-token decay exp(-A·dt) in ~[0.5, 0.999]
        return torch.empty(shape).uniform_(math.log(1e-3), 0.0, generator=gen)
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name.endswith("mlp.gate.weight"):                  # router: clearly preferred experts
        return normal(2.0 / math.sqrt(shape[1]))
    return normal(1.0 / math.sqrt(shape[1]))              # projections keep unit scale


def random_tensors(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of ``expected_tensors(cfg)``, seeded, stored in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_tensors(cfg)
    return {name: _init(name, shapes[name], cfg, gen).to(dtype).contiguous() for name in sorted(shapes)}
