"""Paged KV attention (pure-torch reference).

KV layout of one attention layer: ``k_cache, v_cache: [P, PAGE, Hkv, D]`` with PAGE = 64.
A sequence's page table lists the pages holding its positions in order::

    position p  ->  page_table[p // 64], offset p % 64
    flat slot    =  page_table[p // 64] * 64 + p % 64      (index into [P * 64, Hkv, D])

Queries of one call are contiguous positions ``start .. start + Tq - 1`` of a sequence; the
query at position p attends keys 0..p (causal), which must already be written.
"""

from __future__ import annotations

import torch

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.ops import acc_dtype


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values. k_cache, v_cache: [P, 64, Hkv, D]; slots: [T]; k, v: [T, Hkv, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's queries over its paged KV.

    q: [Tq, H, D] at positions start..start+Tq-1; page_table: [n_pages] (long) covering at
    least start+Tq positions. Returns [Tq, H, D] in q's dtype. Softmax in the accumulation
    dtype, matmuls in the model dtype (as the reference implementation).
    """
    tq, h, _ = q.shape
    kv_len = start + tq
    n_pages = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    pages = page_table[:n_pages]
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len]   # [L, Hkv, D]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len]
    rep = h // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    scores = (qh @ kh.transpose(1, 2)) * scale                       # [H, Tq, L]
    qpos = torch.arange(start, kv_len, device=q.device)[:, None]
    kpos = torch.arange(kv_len, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    return (probs @ vh).transpose(0, 1)
