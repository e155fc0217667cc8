"""The Qwen3.5 vision tower: patches of one or more images/videos -> tokens in the text hidden size.

    pixel_values [P, C·Tp·ps·ps]  (the processor's patches, already in 2×2 merge-block order)
      -> patch embed (Conv3d [Tp, ps, ps], stride = kernel: one matmul per patch)   [P, D]
      + learned position table [S, S, D] resampled bilinearly (align_corners) to each (h, w)
      -> depth × ViT block (LayerNorm, 2-D rotary attention within one frame, GELU-tanh MLP)
      -> merger: LayerNorm, 4 consecutive patches (one 2×2 block) -> [P/4, 4D] -> MLP -> [P/4, out]

Patch order inside a frame of h×w patches (m = spatial_merge_size = 2):

    index = ((block_row · (w/m) + block_col) · m + in_row) · m + in_col
    row   = block_row · m + in_row,   col = block_col · m + in_col

so the four patches of one merged token are adjacent, and the merger is a reshape. Attention is
bidirectional inside one frame (cu_seqlens per frame, as transformers' Qwen3_5VisionModel does).

Weights: ``model.visual.*`` of a Qwen3.5 checkpoint, loaded strictly (names and shapes) through
``weights.load_checked``. Qwen3.5 has no deepstack mergers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from ninfer.errors import ModelLoadError
from ninfer.native.model.weights import (
    VISION_PREFIX,
    Shapes,
    load_checked,
    weight_files,
)

PREFIX = VISION_PREFIX
_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class VisionConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``vision_config`` of a Qwen3.5 ``config.json`` (plain values; builds without files)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side S of the square learned position table (num_position_embeddings = S²)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.spatial_merge_size ** 2


def parse_vision_config(raw: dict[str, Any]) -> VisionConfig:
    """VisionConfig from a Qwen3.5 ``config.json`` dict (its ``vision_config``)."""
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json: no 'vision_config' object (not a Qwen3.5 vision checkpoint)")
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                "num_position_embeddings"):
        if not isinstance(v.get(key), int) or isinstance(v.get(key), bool) or v[key] <= 0:
            raise ModelLoadError(f"config.json: vision_config.{key} must be a positive integer, got {v.get(key)!r}")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"config.json: vision rope type {rope['rope_type']!r} is not supported (only 'axial')")
    known = {k: v[k] for k in VisionConfig.__struct_fields__ if k in v and k != "rope_theta"}
    cfg = VisionConfig(rope_theta=float(rope.get("rope_theta", 10000.0)), **known)
    if cfg.hidden_act not in _ACTS:
        raise ModelLoadError(f"config.json: vision hidden_act {cfg.hidden_act!r} is not supported")
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise ModelLoadError(f"config.json: vision head_dim {cfg.hidden_size}/{cfg.num_heads} must be a multiple of 4")
    if cfg.grid_side ** 2 != cfg.num_position_embeddings:
        raise ModelLoadError(f"config.json: vision num_position_embeddings {cfg.num_position_embeddings} is not a square")
    return cfg


def expected_vision_tensors(c: VisionConfig) -> Shapes:
    """Every ``model.visual.*`` tensor with its shape, in HF on-disk naming."""
    d, i, m = c.hidden_size, c.intermediate_size, c.merged_dim
    s: Shapes = {
        "patch_embed.proj.weight": (d, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (c.num_position_embeddings, d),
        "merger.norm.weight": (d,), "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (m, m), "merger.linear_fc1.bias": (m,),
        "merger.linear_fc2.weight": (c.out_hidden_size, m), "merger.linear_fc2.bias": (c.out_hidden_size,),
    }
    for b in range(c.depth):
        p = f"blocks.{b}."
        s.update({
            p + "norm1.weight": (d,), p + "norm1.bias": (d,),
            p + "norm2.weight": (d,), p + "norm2.bias": (d,),
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "mlp.linear_fc1.weight": (i, d), p + "mlp.linear_fc1.bias": (i,),
            p + "mlp.linear_fc2.weight": (d, i), p + "mlp.linear_fc2.bias": (d,),
        })
    return {PREFIX + k: v for k, v in s.items()}


# ---- grid geometry (no weights) -----------------------------------------------------------------

def patch_coords(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per patch, in the processor's order: (row, col, frame id). grid_thw: [N, 3] -> three [P].

    The frame id numbers every (image, t) frame globally; attention stays inside one frame.
    """
    g = grid_thw.to(torch.long)
    per_frame = g[:, 1] * g[:, 2]
    frames_w = torch.repeat_interleave(g[:, 2], g[:, 0])
    frame_len = torch.repeat_interleave(per_frame, g[:, 0])
    frame = torch.repeat_interleave(torch.arange(len(frame_len)), frame_len)
    starts = F.pad(frame_len.cumsum(0)[:-1], (1, 0))
    within = torch.arange(int(frame_len.sum())) - starts[frame]
    blocks_w = frames_w[frame] // merge
    in_col, in_row = within % merge, (within // merge) % merge
    block = within // (merge * merge)
    row = (block // blocks_w) * merge + in_row
    col = (block % blocks_w) * merge + in_col
    return row, col, frame


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear align_corners taps [P, 2] and weights [P, 2] along one axis of the position table.

    In float32 as transformers' helper computes them, so both resample alike (for fp64 too).
    """
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1).to(torch.float32)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_embedding(table: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                       grid_thw: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """The [S², D] learned table resampled to each frame's (h, w) grid, per patch: [P, D]."""
    side = math.isqrt(table.shape[0])
    g = grid_thw.to(torch.long)
    h = torch.repeat_interleave(g[:, 1], g[:, 0])[frame]
    w = torch.repeat_interleave(g[:, 2], g[:, 0])[frame]
    ht, hw = _axis_taps(row, h, side)
    wt, ww = _axis_taps(col, w, side)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    acc = torch.promote_types(table.dtype, torch.float32)  # bf16 tables blend in fp32, as HF does
    return (table[idx].to(acc) * wts[:, :, None].to(acc)).sum(1).to(table.dtype)


def rotary(row: torch.Tensor, col: torch.Tensor, head_dim: int, theta: float,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D rope: cos, sin [P, head_dim]; the first quarter rotates by row, the second by col.

    Layout [h-freqs | w-freqs | h-freqs | w-freqs] for rotate_half (pairs i and i + head_dim/2).
    """
    quarter = torch.arange(0, head_dim // 2, 2, dtype=dtype) / (head_dim // 2)
    inv_freq = 1.0 / (theta ** quarter)
    emb = torch.cat([row.to(dtype)[:, None] * inv_freq, col.to(dtype)[:, None] * inv_freq], dim=-1)
    emb = torch.cat([emb, emb], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [P, H, Dh]; cos/sin: [P, Dh]. In at least float32 (bf16 activations rotate in fp32)."""
    work = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(work)
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None].to(work) + rot * sin[:, None].to(work)).to(x.dtype)


# ---- the tower ----------------------------------------------------------------------------------

class VisionTower:
    """The vision encoder of one resident model; weights: ``expected_vision_tensors`` names."""

    def __init__(self, cfg: VisionConfig, tensors: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = {k[len(PREFIX):]: v for k, v in tensors.items()}
        self.dtype = self.w["pos_embed.weight"].dtype
        self.device = self.w["pos_embed.weight"].device

    @classmethod
    def load(cls, model_dir: str | Path, cfg: VisionConfig, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> VisionTower:
        """Strict on the ``model.visual.*`` tensors; the text tensors are the text loader's job."""
        files = {n: f for n, f in weight_files(Path(model_dir)).items() if n.startswith(PREFIX)}
        tensors = load_checked(Path(model_dir), files, expected_vision_tensors(cfg), dtype, what="vision tower")
        return cls(cfg, {k: v.to(device) for k, v in tensors.items()})

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], eps=1e-6)

    def _block(self, x: torch.Tensor, b: int, cos: torch.Tensor, sin: torch.Tensor,
               same_frame: torch.Tensor | None) -> torch.Tensor:
        c, p = self.cfg, f"blocks.{b}."
        n = x.shape[0]
        q, k, v = self._linear(self._norm(x, p + "norm1"), p + "attn.qkv").view(n, 3, c.num_heads, c.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [H, P, Dh]; the mask keeps attention inside one frame (block-diagonal over frames)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=same_frame)
        x = x + self._linear(o.transpose(0, 1).reshape(n, -1), p + "attn.proj")
        h = F.gelu(self._linear(self._norm(x, p + "norm2"), p + "mlp.linear_fc1"), approximate=_ACTS[c.hidden_act])
        return x + self._linear(h, p + "mlp.linear_fc2")

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values: [P, C·Tp·ps·ps]; grid_thw: [N, 3] (t, h, w in patches) -> [P/m², out_hidden].

        P = Σ t·h·w; the output rows are the merged tokens in order (image by image, frame by frame).
        """
        c = self.cfg
        x = pixel_values.to(self.device, self.dtype).reshape(-1, c.patch_dim)
        grid_thw = grid_thw.to("cpu")
        if int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum()) != x.shape[0]:
            raise ValueError(f"grid_thw covers {int(grid_thw.prod(-1).sum())} patches, pixel_values has {x.shape[0]}")
        if bool(((grid_thw[:, 1:] % c.spatial_merge_size) != 0).any()):
            raise ValueError(f"grid h and w must be multiples of {c.spatial_merge_size}: {grid_thw.tolist()}")
        row, col, frame = patch_coords(grid_thw, c.spatial_merge_size)
        # Conv3d with stride == kernel is one matmul per patch ([C, Tp, ps, ps] flattened alike)
        x = F.linear(x, self.w["patch_embed.proj.weight"].reshape(c.hidden_size, -1), self.w["patch_embed.proj.bias"])
        x = x + position_embedding(self.w["pos_embed.weight"], row, col, grid_thw, frame).to(x.device)
        rope_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        cos, sin = (t.to(self.device) for t in rotary(row, col, c.head_dim, c.rope_theta, rope_dtype))
        frame = frame.to(self.device)
        # block-diagonal over frames; one frame needs no mask (and SDPA then takes its fast path)
        same_frame = None if int(frame[-1]) == 0 else frame[:, None] == frame[None, :]
        for b in range(c.depth):
            x = self._block(x, b, cos, sin, same_frame)
        x = self._norm(x, "merger.norm").reshape(-1, c.merged_dim)
        return self._linear(F.gelu(self._linear(x, "merger.linear_fc1")), "merger.linear_fc2")
