"""Model configuration parsed from a Hugging Face ``config.json``, and its physical layout.

Two architectures are served by one code path:

* ``qwen3_next`` — the hybrid: Gated DeltaNet ("linear_attention") layers with a causal conv and
  a recurrent state, interleaved with gated full-attention layers; MoE MLP with shared expert.
* ``qwen3`` — pure attention, the degenerate hybrid with no recurrent state; dense MLP.
* ``qwen3_5`` — the text model of Qwen3.5 (vision-language; ``text_config`` nested in the
  config.json): the same hybrid with a dense MLP, interleaved MRoPE, tensors under
  ``model.language_model.*`` and the GDN input projection split into ``in_proj_qkv`` /
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (plain [q|k|v], z, b, a — no per-key-head
  interleave). Its ``model.visual.*`` tower is ``vision.py``'s.

Everything here is plain values: a ``ModelConfig`` can be built in a test without any files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from ninfer.errors import ModelLoadError

LINEAR = "linear_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3", "qwen3_5")
HYBRID_TYPES = ("qwen3_next", "qwen3_5")
PAGE_SIZE = 64  # tokens per Main-KV page (seed: Main KV 页为 64 token)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Architecture facts of one resident model (immutable, hashable, msgspec-encodable)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    attn_output_gate: bool       # qwen3_next: q_proj carries a sigmoid output gate
    zero_centered_norm: bool     # qwen3_next: RMSNorm scales by (1 + w); qwen3: by w
    # gated deltanet (unused when there is no linear layer)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # MLP / MoE
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # multi-token prediction layers present in the checkpoint (kept for the MTP backend)
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3.5 interleaved MRoPE: frequencies per (t, h, w) row; () = plain 1-D RoPE
    mrope_section: tuple[int, ...] = ()

    # ---- derived geometry -------------------------------------------------------------
    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def text_prefix(self) -> str:
        """Prefix of the text model's tensors in the checkpoint (``{prefix}layers.0. ...``)."""
        return "model.language_model." if self.model_type == "qwen3_5" else "model."

    @property
    def split_gdn_projections(self) -> bool:
        """Qwen3.5: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a instead of the fused, per-key-head
        grouped in_proj_qkvz / in_proj_ba of Qwen3-Next."""
        return self.model_type == "qwen3_5"

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    # ---- physical layout (bytes) -------------------------------------------------------
    def kv_bytes_per_token(self, kv_itemsize: int) -> int:
        """Main-KV bytes one token occupies across all attention layers (K and V)."""
        return 2 * len(self.attention_layers) * self.num_key_value_heads * self.head_dim * kv_itemsize

    def kv_bytes_per_page(self, kv_itemsize: int) -> int:
        return PAGE_SIZE * self.kv_bytes_per_token(kv_itemsize)

    def state_image_bytes(self, state_itemsize: int, conv_itemsize: int, hidden_itemsize: int) -> int:
        """One StateImage: every GDN recurrent + conv state and the continuation hidden."""
        n = len(self.linear_layers)
        ssm = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1)
        return n * (ssm * state_itemsize + conv * conv_itemsize) + self.hidden_size * hidden_itemsize


# ---- parsing ------------------------------------------------------------------------------

def _req(raw: dict[str, Any], key: str, kind: type) -> Any:
    if key not in raw:
        raise ModelLoadError(f"config.json: missing required field '{key}'")
    val = raw[key]
    if kind is int and (not isinstance(val, int) or isinstance(val, bool)):
        raise ModelLoadError(f"config.json: field '{key}' must be an integer, got {val!r}")
    if kind is float and not isinstance(val, (int, float)):
        raise ModelLoadError(f"config.json: field '{key}' must be a number, got {val!r}")
    return val


def rope_params(raw: dict[str, Any]) -> tuple[float, float, tuple[int, ...]]:
    """rope_theta, partial_rotary_factor and mrope_section (Qwen3.5) from either the old or the
    transformers-5 format."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"config.json: rope type '{rope_type}' is not supported (only 'default')")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor is None:
        factor = 0.25 if raw.get("model_type") in ("qwen3_next", "qwen3_5") else 1.0
    section = params.get("mrope_section", scaling.get("mrope_section")) or ()
    # transformers' Qwen3.5 interleaves whatever the flag says; an explicit False means another model
    if section and params.get("mrope_interleaved", scaling.get("mrope_interleaved", True)) is False:
        raise ModelLoadError("config.json: non-interleaved mrope_section is not supported (Qwen3.5 interleaves)")
    return float(theta), float(factor), tuple(section)


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _qwen3_5_text(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a Qwen3.5 config.json: ``text_config``, with the top level's
    tie_word_embeddings / eos_token_id where it names them (transformers reads them there)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("config.json: model_type 'qwen3_5' needs a 'text_config' object")
    merged = dict(text)
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key in raw:
            merged[key] = raw[key]
    merged["model_type"] = "qwen3_5"
    return merged


def parse_config(raw: dict[str, Any], mtp_layers: int = 0) -> ModelConfig:
    """Build a ModelConfig from a config.json dict; raise ModelLoadError with one clear line."""
    model_type = raw.get("model_type")
    if model_type == "qwen3_5":
        raw = _qwen3_5_text(raw)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"config.json: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    n_layers = _req(raw, "num_hidden_layers", int)
    hidden = _req(raw, "hidden_size", int)
    heads = _req(raw, "num_attention_heads", int)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    theta, rot, mrope = rope_params(raw)
    next_arch = model_type in HYBRID_TYPES

    layer_types = raw.get("layer_types")
    if layer_types is None:
        if next_arch:
            interval = raw.get("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        else:
            layer_types = [FULL] * n_layers
    layer_types = tuple(layer_types)
    allowed = (LINEAR, FULL) if next_arch else (FULL,)
    bad = [t for t in layer_types if t not in allowed]
    if bad:
        raise ModelLoadError(f"config.json: layer type {bad[0]!r} is not supported for {model_type}")
    if len(layer_types) != n_layers:
        raise ModelLoadError(
            f"config.json: layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}"
        )

    kw: dict[str, Any] = {}
    if next_arch:
        kw.update(
            linear_conv_kernel_dim=_req(raw, "linear_conv_kernel_dim", int),
            linear_key_head_dim=_req(raw, "linear_key_head_dim", int),
            linear_value_head_dim=_req(raw, "linear_value_head_dim", int),
            linear_num_key_heads=_req(raw, "linear_num_key_heads", int),
            linear_num_value_heads=_req(raw, "linear_num_value_heads", int),
            num_experts=raw.get("num_experts", 0),
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        )
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=_req(raw, "vocab_size", int),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_req(raw, "max_position_embeddings", int),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        partial_rotary_factor=rot,
        attention_bias=bool(raw.get("attention_bias", False)),
        attn_output_gate=next_arch,
        zero_centered_norm=next_arch,
        intermediate_size=raw.get("intermediate_size", 0),
        mtp_num_hidden_layers=raw.get("mtp_num_hidden_layers", mtp_layers),
        eos_token_ids=_eos(raw),
        mrope_section=mrope,
        **kw,
    )
    validate(cfg)
    return cfg


def validate(cfg: ModelConfig) -> None:
    """Consistency checks whose failure would otherwise surface deep inside torch."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ModelLoadError(f"config.json: {msg}")

    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings"]
    for name in positive:
        need(getattr(cfg, name) > 0, f"'{name}' must be positive, got {getattr(cfg, name)}")
    need(cfg.num_attention_heads % cfg.num_key_value_heads == 0,
         f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
         f"num_key_value_heads ({cfg.num_key_value_heads})")
    need(0 < cfg.partial_rotary_factor <= 1, f"partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}")
    need(cfg.rotary_dim % 2 == 0 and cfg.rotary_dim > 0,
         f"head_dim × partial_rotary_factor = {cfg.rotary_dim} must be a positive even number")
    if cfg.is_hybrid:
        for name in ["linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_conv_kernel_dim"]:
            need(getattr(cfg, name) > 0, f"'{name}' must be positive, got {getattr(cfg, name)}")
        need(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
             f"linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
             f"linear_num_key_heads ({cfg.linear_num_key_heads})")
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        need(0 < cfg.num_experts_per_tok <= cfg.num_experts,
             f"num_experts_per_tok must be in 1..num_experts ({cfg.num_experts}), got {cfg.num_experts_per_tok}")
        need(cfg.moe_intermediate_size > 0, "'moe_intermediate_size' must be positive for MoE layers")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        need(cfg.intermediate_size > 0, "'intermediate_size' must be positive for dense MLP layers")
    if cfg.mrope_section:
        need(len(cfg.mrope_section) == 3 and sum(cfg.mrope_section) == cfg.rotary_dim // 2,
             f"mrope_section {list(cfg.mrope_section)} must be 3 numbers summing to rotary_dim/2 = {cfg.rotary_dim // 2}")
    need(math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0, f"rope_theta must be positive, got {cfg.rope_theta}")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json``; errors name the directory or field in one line."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    return parse_config(read_config_json(path, "a Hugging Face model directory"))


def read_config_json(directory: Path, expected: str) -> dict:
    """``directory/config.json`` as a dict; a missing file, bad JSON or a non-object is a
    ModelLoadError naming the file (``expected``: what the directory should have been)."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (expected {expected})")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object")
    return raw


def load_eos_ids(model_dir: str | Path, cfg: ModelConfig) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json if it names them, else config.json's."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            raise ModelLoadError(f"{gen}: invalid JSON") from None
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return cfg.eos_token_ids
