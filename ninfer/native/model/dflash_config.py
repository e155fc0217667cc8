"""The configuration of a DFlash / DFlash2 draft, parsed from its Hugging Face config.json.

The reference (z-lab/dflash) reads a Qwen3 config: the decoder geometry at the top level, the
draft's own parameters under ``dflash_config`` (each falling back to a top-level key of the same
name). Everything here is plain values: a ``DFlashConfig`` builds in a test without any file.
``expected_tensors`` is the checkpoint's strict tensor set in the reference's state-dict names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from ninfer.errors import ModelLoadError
from ninfer.native.model.config import read_config_json, rope_params
from ninfer.native.model.weights import Shapes

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
FULL, SLIDING = "full_attention", "sliding_attention"
# the on-disk names of the selector's codebooks drop ".weight" (the reference maps them on load)
BARE_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


class DFlashConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Architecture facts of one draft (immutable; builds from a dict without any file)."""

    kind: Literal["dflash", "dflash2"]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int                       # rows of the DFlash2 selector's codebooks
    block_size: int                       # anchor + block_size - 1 drafts at most
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    window: int | None = None             # sliding window W of every layer; None = full context
    is_causal: bool = False               # within the block (the context is always before it)
    conv_kernel_size: int = 0             # DFlash2 only, as the four below
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # 0 = none
    input_embedding_scale: float = 1.0


def _field(raw: dict[str, Any], key: str, kind: type, default: Any = None, draft: bool = False) -> Any:
    """``raw[key]`` checked against ``kind``; ``draft``: ``dflash_config[key]`` first, then the
    top level (the reference's fallback). Missing without a default, or mistyped: ModelLoadError."""
    section = raw.get("dflash_config") or {}
    name = f"dflash_config.{key}" if draft else key
    val = section.get(key, raw.get(key)) if draft else raw.get(key)
    if val is None:
        if default is None:
            raise ModelLoadError(f"draft config.json: missing required field '{name}'")
        return default
    if kind is int and (not isinstance(val, int) or isinstance(val, bool)):
        raise ModelLoadError(f"draft config.json: field '{name}' must be an integer, got {val!r}")
    if kind is float and (not isinstance(val, (int, float)) or isinstance(val, bool)):
        raise ModelLoadError(f"draft config.json: field '{name}' must be a number, got {val!r}")
    if kind is bool and not isinstance(val, bool):
        raise ModelLoadError(f"draft config.json: field '{name}' must be true or false, got {val!r}")
    return kind(val)


def _layer_kind(raw: dict[str, Any], n_layers: int) -> str:
    """One attention kind for every layer (a mixed stack would need one context range per layer)."""
    types = raw.get("layer_types") or [FULL] * n_layers
    if not isinstance(types, list) or len(types) != n_layers:
        raise ModelLoadError(f"draft config.json: layer_types must list {n_layers} layer kinds, got {types!r}")
    bad = [t for t in types if t not in (FULL, SLIDING)]
    if bad:
        raise ModelLoadError(f"draft config.json: layer type {bad[0]!r} is not supported ({FULL!r}, {SLIDING!r})")
    if len(set(types)) > 1:
        raise ModelLoadError("draft config.json: layer_types mixes full and sliding attention (not supported)")
    return types[0]


def parse_draft_config(raw: dict[str, Any]) -> DFlashConfig:
    """A DFlashConfig from a draft's config.json dict; ModelLoadError naming the bad field."""
    arch = [a for a in raw.get("architectures") or [] if a in ARCHITECTURES]
    if not arch:
        raise ModelLoadError(f"draft config.json: architectures {raw.get('architectures')!r} name no DFlash "
                             f"draft (expected one of {', '.join(ARCHITECTURES)})")
    kind = ARCHITECTURES[arch[0]]
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"draft config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("attention_bias", False):
        raise ModelLoadError("draft config.json: attention_bias is not supported")
    theta, factor, mrope = rope_params(raw)
    if factor != 1.0 or mrope:
        raise ModelLoadError("draft config.json: the draft ropes the full head_dim (no partial or multimodal rope)")
    n_layers = _field(raw, "num_hidden_layers", int)
    hidden = _field(raw, "hidden_size", int)
    heads = _field(raw, "num_attention_heads", int)
    layer_kind = _layer_kind(raw, n_layers)
    dflash2 = kind == "dflash2"
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids", raw.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ModelLoadError(f"draft config.json: 'dflash_config.target_layer_ids' must be a non-empty list "
                             f"of layer indices, got {ids!r}")
    cfg = DFlashConfig(
        kind=kind, hidden_size=hidden, num_layers=n_layers, num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, heads),
        head_dim=_field(raw, "head_dim", int, hidden // heads if heads > 0 else 0),
        intermediate_size=_field(raw, "intermediate_size", int),
        rms_norm_eps=_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        vocab_size=_field(raw, "vocab_size", int) if dflash2 else _field(raw, "vocab_size", int, 0),
        block_size=_field(raw, "block_size", int, 16, draft=True),
        mask_token_id=_field(raw, "mask_token_id", int, draft=True),
        target_layer_ids=tuple(ids),
        window=_field(raw, "sliding_window", int) if layer_kind == SLIDING else None,
        # the reference's default: sliding layers are causal unless the config says otherwise
        is_causal=_field(raw, "is_causal", bool, layer_kind == SLIDING),
        conv_kernel_size=_field(raw, "conv_kernel_size", int, draft=True) if dflash2 else 0,
        conv_group_size=_field(raw, "conv_group_size", int, draft=True) if dflash2 else 0,
        selector_rank=_field(raw, "selector_rank", int, draft=True) if dflash2 else 0,
        selector_top_k=_field(raw, "selector_top_k", int, draft=True) if dflash2 else 0,
        output_multiplier=_field(raw, "output_multiplier", float, 1.0, draft=True),
        final_logit_softcapping=_field(raw, "final_logit_softcapping", float, 0.0, draft=True),
        input_embedding_scale=_field(raw, "input_embedding_scale", float, 1.0, draft=True),
    )
    _validate(cfg)
    return cfg


def _validate(c: DFlashConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ModelLoadError(f"draft config.json: {msg}")

    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        need(getattr(c, name) > 0, f"'{name}' must be positive, got {getattr(c, name)}")
    need(c.num_heads % c.num_kv_heads == 0,
         f"num_attention_heads ({c.num_heads}) must be a multiple of num_key_value_heads ({c.num_kv_heads})")
    need(c.head_dim % 2 == 0, f"head_dim must be even (rope), got {c.head_dim}")
    need(c.rope_theta > 0, f"rope_theta must be positive, got {c.rope_theta}")
    need(c.block_size >= 2, f"'dflash_config.block_size' must be at least 2, got {c.block_size}")
    need(c.mask_token_id >= 0, f"'dflash_config.mask_token_id' must be a token id, got {c.mask_token_id}")
    need(c.window is None or c.window > 0, f"'sliding_window' must be positive, got {c.window}")
    need(c.final_logit_softcapping >= 0,
         f"'dflash_config.final_logit_softcapping' must be >= 0, got {c.final_logit_softcapping}")
    if c.kind == "dflash2":
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "vocab_size"):
            need(getattr(c, name) > 0, f"'{name}' must be positive, got {getattr(c, name)}")
        need(c.hidden_size % c.conv_group_size == 0,
             f"'dflash_config.conv_group_size' ({c.conv_group_size}) must divide hidden_size ({c.hidden_size})")
        need(c.selector_top_k <= c.vocab_size,
             f"'dflash_config.selector_top_k' ({c.selector_top_k}) exceeds vocab_size ({c.vocab_size})")


def load_draft_config(draft_dir: str | Path) -> DFlashConfig:
    """Read ``draft_dir/config.json``; errors name the directory or the field."""
    return parse_draft_config(read_config_json(Path(draft_dir), "a DFlash draft directory"))


def expected_tensors(c: DFlashConfig) -> Shapes:
    """Every tensor of the draft's checkpoint with its shape (the reference's state-dict names)."""
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    s: Shapes = {"norm.weight": (h,), "hidden_norm.weight": (h,), "fc.weight": (h, len(c.target_layer_ids) * h)}
    for j in range(c.num_layers):
        p = f"layers.{j}"
        s.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (c.num_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (c.num_kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (c.num_kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, c.num_heads * d),
            f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.mlp.gate_proj.weight": (i, h), f"{p}.mlp.up_proj.weight": (i, h), f"{p}.mlp.down_proj.weight": (h, i),
        })
        if c.kind == "dflash2":
            groups = h // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                s[f"{p}.{conv}.base_kernel"] = (2, c.conv_kernel_size, h)
                s[f"{p}.{conv}.kernel_projection.weight"] = (2 * c.conv_kernel_size * groups, h)
    if c.kind == "dflash2":
        s.update({f"{name}.weight": (c.vocab_size, c.selector_rank) for name in BARE_CODEBOOKS})
        s["candidate_selector.hidden_projection.weight"] = (c.selector_rank, h)
    return s
