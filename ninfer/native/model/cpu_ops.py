"""Fast CPU forms of the chunk ops (``paths.CPU``: a model on the CPU in fp32 / bf16 / fp16).

Each op has the contract of the reference beside which it is tested (fla's habit): the same
signature, the same result to the dtype's rounding — not bit for bit, which is why the float64
oracle keeps the references (``paths.BATCHED``; ``paths.for_device``).

* ``chunk_attention`` — ``attention.paged_attention`` through torch's fused CPU attention
  (``scaled_dot_product_attention``: blocked, online softmax, masked blocks skipped, GQA without
  repeating K/V). The reference builds the whole [H, Tq, L] score matrix: at a 2,048-token chunk
  that was 2/3 of the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ninfer.native.model.config import PAGE_SIZE


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
