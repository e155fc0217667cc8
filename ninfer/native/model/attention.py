"""Paged KV attention (pure-torch ops).

KV layout of one attention layer: ``k_cache, v_cache: [P, PAGE, Hkv, D]`` with PAGE = 64.
A sequence's page table lists the pages holding its positions in order::

    position p  ->  page_table[p // 64], offset p % 64
    flat slot    =  page_table[p // 64] * 64 + p % 64      (index into [P * 64, Hkv, D])

Queries of one call are contiguous positions ``start .. start + Tq - 1`` of a sequence; the
query at position p attends keys 0..p (causal), which must already be written.

Two ops, fla's habit of a naive op beside each fast one with the same signature:

* ``paged_attention`` — one sequence's queries (a prefill/replay chunk over its cached prefix,
  or one decode row). The per-sequence reference, and the chunk op of the batched path.
* ``decode_attention`` — B decode rows at once over a padded block table with a length mask;
  ``decode_attention_naive`` is the same contract computed row by row with
  ``paged_attention``. A paged Triton kernel (split-K) replaces ``decode_attention`` on the GPU
  with this signature.
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
                    page_table: torch.Tensor, start: int, scale: float, base: int = 0) -> torch.Tensor:
    """Causal attention of one sequence's queries over its paged KV.

    q: [Tq, H, D] at positions start..start+Tq-1; page_table: [n_pages] (long) covering at
    least start+Tq positions. Returns [Tq, H, D] in q's dtype. Softmax in the accumulation
    dtype, matmuls in the model dtype (as the reference implementation). ``base``: keys below it
    are not attended (the MTP head's context after it restarted at the bridge; 0 elsewhere).
    """
    tq, h, _ = q.shape
    kv_len = start + tq
    n_pages = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    pages = page_table[:n_pages]
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[base:kv_len]   # [L, Hkv, D]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[base:kv_len]
    rep = h // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    scores = (qh @ kh.transpose(1, 2)) * scale                       # [H, Tq, L]
    qpos = torch.arange(start, kv_len, device=q.device)[:, None]
    kpos = torch.arange(base, kv_len, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    return (probs @ vh).transpose(0, 1)


def decode_kv_slots(block_table: torch.Tensor, kv_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """The flat KV slot of every key position of B decode rows: [B, max_len] long.

    block_table: [B, Pmax]; kv_lens: [B]; max_len >= max(kv_lens). Positions at or past a
    row's kv_len repeat the row's slot of position 0 — always written, so a masked key or value
    is a finite copy, never a stale or uninitialised byte (no 0 * NaN in the output)::

        row b:  slot(0) slot(1) ... slot(kv_len-1) | slot(0) slot(0) ...   (masked)
    """
    pos = torch.arange(max_len, device=block_table.device)
    slots = block_table[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    return torch.where(pos[None, :] < kv_lens[:, None], slots, slots[:, :1])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                     kv_slots: torch.Tensor | None = None, bases: torch.Tensor | None = None,
                     compute: torch.dtype | None = None) -> torch.Tensor:
    """One query per row for B decode rows, batched over rows (no per-row Python loop).

    q: [B, H, D], row b at position kv_lens[b] - 1; k_cache, v_cache: [P, 64, Hkv, D];
    block_table: [B, Pmax] long, row b's pages in order (entries past its ceil(kv_len / 64)
    pages are padding and must name a valid page); kv_lens: [B] long. ``kv_slots``:
    ``decode_kv_slots(block_table, kv_lens, L)``, passed when the caller built it once for all
    layers (a kernel reading the block table ignores it). Returns [B, H, D] in q's dtype, with
    the precision policy of ``paged_attention``. ``bases`` [B] long: keys below a row's base are
    masked too (the MTP head's restarted context; None = 0 for every row).

    The keys of every row are gathered token by token into [B, L, Hkv, D] (L = max kv_len:
    no page padding is copied); slots past a row's kv_len are masked to -inf. GQA without
    repeating K/V: one bmm per key head (Hkv is a small constant of the model), each over the
    strided [B, L, D] view of that head. ``compute``: the dtype the query and the gathered keys
    and values are multiplied in (default q's; the CPU path's bf16 passes fp32,
    ``cpu_ops.decode_attention``); the result is in q's dtype either way.
    """
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    rep = h // hkv
    if kv_slots is None:
        kv_slots = decode_kv_slots(block_table, kv_lens, block_table.shape[1] * PAGE_SIZE)
    flat = kv_slots.reshape(-1)
    out_dtype = q.dtype
    q = q.to(compute or out_dtype)
    k = k_cache.view(-1, hkv * d).index_select(0, flat).view(b, -1, hkv, d).to(q.dtype)  # [B, L, Hkv, D]
    v = v_cache.view(-1, hkv * d).index_select(0, flat).view(b, -1, hkv, d).to(q.dtype)
    pos = torch.arange(k.shape[1], device=q.device)[None, :]
    masked = pos >= kv_lens[:, None]                                                     # [B, L]
    if bases is not None:
        masked = masked | (pos < bases[:, None])
    qg = q.view(b, hkv, rep, d)
    scores = torch.stack([torch.bmm(qg[:, g], k[:, :, g].transpose(1, 2)) for g in range(hkv)], 1)
    scores = (scores * scale).masked_fill(masked[:, None, None, :], float("-inf"))  # [B, Hkv, rep, L]
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    out = torch.stack([torch.bmm(probs[:, g], v[:, :, g]) for g in range(hkv)], 1)  # [B, Hkv, rep, D]
    return out.reshape(b, h, d).to(out_dtype)


def verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, starts: torch.Tensor, n: int, scale: float,
                     ends: torch.Tensor | None = None) -> torch.Tensor:
    """V verify rows of ``n`` queries each at once (no per-row Python loop): row b's queries,
    packed at q[b*n:(b+1)*n] ([V*n, H, D]), sit at positions starts[b] .. starts[b] + n - 1 and
    attend causally over the row's paged KV (the new K/V already written). ``block_table``
    [V, W] covers start + n positions of every row (padded with the row's first page). Keys
    are gathered over L = W * 64 positions (a static length, so a graph can capture it);
    positions past a query's own are masked. The precision policy of ``paged_attention``.
    ``ends`` [V]: one past each row's last written key when fewer than its n queries are real
    (a graph's padded chunk: keys from there on read position 0's, never an unwritten slot)."""
    vb, h, d = q.shape[0] // n, q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    rep = h // hkv
    length = block_table.shape[1] * PAGE_SIZE
    slots = decode_kv_slots(block_table, starts + n if ends is None else ends, length).reshape(-1)
    k = k_cache.view(-1, hkv * d).index_select(0, slots).view(vb, length, hkv, d).to(q.dtype)
    v = v_cache.view(-1, hkv * d).index_select(0, slots).view(vb, length, hkv, d).to(q.dtype)
    qpos = starts[:, None] + torch.arange(n, device=q.device)[None, :]                    # [V, n]
    masked = torch.arange(length, device=q.device)[None, None, :] > qpos[:, :, None]      # [V, n, L]
    qg = q.view(vb, n, hkv, rep, d)
    out = torch.empty_like(qg)
    for g in range(hkv):
        qh = qg[:, :, g].reshape(vb, n * rep, d)
        scores = torch.bmm(qh, k[:, :, g].transpose(1, 2)) * scale                        # [V, n*rep, L]
        scores = scores.view(vb, n, rep, length).masked_fill(masked[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype).view(vb, n * rep, length)
        out[:, :, g] = torch.bmm(probs, v[:, :, g]).view(vb, n, rep, d)
    return out.view(vb * n, h, d)


def decode_attention_naive(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           kv_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of ``decode_attention`` (same signature): ``paged_attention`` row by row."""
    out = torch.empty_like(q)
    for i, n in enumerate(kv_lens.tolist()):
        out[i:i + 1] = paged_attention(q[i:i + 1], k_cache, v_cache, block_table[i], n - 1, scale)
    return out
