"""Fast CPU forms of the chunk ops (``paths.CPU``: a model on the CPU in fp32 / bf16 / fp16).

Each op has the contract of the reference beside which it is tested (fla's habit): the same
signature, the same result to the dtype's rounding — not bit for bit, which is why the float64
oracle keeps the references (``paths.BATCHED``; ``paths.for_device``).

* ``chunk_attention`` — ``attention.paged_attention`` through torch's fused CPU attention
  (``scaled_dot_product_attention``: blocked, online softmax, masked blocks skipped, GQA without
  repeating K/V). The reference builds the whole [H, Tq, L] score matrix: at a 2,048-token chunk
  that was 2/3 of the forward.
* ``dense_moe`` — ``moe.sparse_moe`` for a few rows (decode, short chunks): every expert over
  every row as two matmuls over the experts' weights side by side, the unchosen experts' rows
  zeroed by the routing weights — no per-expert loop, sort or gather. It reads all E experts'
  weights for each row, so it pays only while rows x experts is small (``DENSE_MOE_MAX_PAIRS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.moe import MoeWeights, with_shared
from ninfer.native.model.ops import acc_dtype

# rows x experts up to which ``dense_moe`` beats the grouped loop (tiny model, fp32, one thread:
# 8 rows 0.19 -> 0.10 ms, 64 rows 0.35 -> 0.29 ms a layer; 256 rows 0.70 vs 0.94 ms)
DENSE_MOE_MAX_PAIRS = 512


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """``paged_attention``'s contract (``base`` = 0). q: [Tq, H, D] at positions
    start .. start+Tq-1; k_cache, v_cache: [P, 64, Hkv, D]; page_table: [n_pages].
    Returns [Tq, H, D] in q's dtype; the softmax accumulates in fp32 inside the fused op.

        keys 0 .. start+Tq-1, query i attends keys 0 .. start+i   (lower-right causal)
    """
    tq = q.shape[0]
    kv_len = start + tq
    pages = page_table[:(kv_len + PAGE_SIZE - 1) // PAGE_SIZE]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]             # [L, Hkv, D]
    v = v_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]
    qh, kh, vh = q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None]
    mask = causal_lower_right(tq, kv_len) if start else None
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=not start, scale=scale,
                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return out[0].transpose(0, 1)


def dense_moe_fits(x: torch.Tensor, w: MoeWeights) -> bool:
    """``dense_moe`` pays here: few rows x experts, plain (not FP8) weights of x's dtype."""
    return x.shape[0] * w.gate_up.shape[0] <= DENSE_MOE_MAX_PAIRS and w.gate_up.dtype == x.dtype == w.down.dtype


def _down_side_by_side(w: MoeWeights) -> torch.Tensor:
    """The experts' down projections side by side, [H, E*I] (built once per layer, kept on ``w``)."""
    down = getattr(w, "_down_cat", None)
    if down is None or down.dtype != w.down.dtype:
        e, h, i = w.down.shape
        down = w.down.permute(1, 0, 2).reshape(h, e * i).contiguous()
        w._down_cat = down                    # derived from w.down, never saved or moved
    return down


def dense_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """``sparse_moe``'s contract (x: [T, H] -> [T, H]): the same routing (softmax in the
    accumulation dtype, top-k, optional renormalisation), then

        gate_up = x @ [W_gu(0); ...; W_gu(E-1)]^T          [T, E, 2I]   (one matmul)
        h       = silu(gate) * up * route                  [T, E, I]    route[t, e] = 0 unless chosen
        out     = h @ [W_d(0) ... W_d(E-1)]^T               [T, H]       (one matmul over E*I)

    plus the gated shared expert. The sum over a row's experts happens inside the second
    matmul (another order than the grouped form's: equal to rounding)."""
    acc = acc_dtype(x.dtype)
    e, two_i, hidden = w.gate_up.shape
    inter = two_i // 2
    probs = torch.softmax(F.linear(x, w.router).to(acc), dim=-1)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    route = torch.zeros(x.shape[0], e, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w.to(x.dtype))
    gate_up = F.linear(x, w.gate_up.view(e * two_i, hidden)).view(-1, e, 2, inter)
    h = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * route[:, :, None]
    out = F.linear(h.reshape(-1, e * inter), _down_side_by_side(w))
    return with_shared(out, x, w)
