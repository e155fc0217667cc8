"""Byte-exact copies on the Device: KV write by slot mapping, tail copy-on-write of pages,
StateImage gather / scatter / copy between slots.

All of them are one Triton kernel, ``_copy_rows``: row ``dst_idx[i]`` of every layer of a
``[L, S, R]`` view receives the first ``n[i]`` elements of row ``src_idx[i]``::

    KV write      cache [P*64, Hkv*D]     (L = 1)   src = token i      dst = slot_mapping[i]
    page COW      k, v  [La, P, 64*Hkv*D]           src = old page     dst = new page, n = tokens*Hkv*D
    slot gather   conv / ssm [L, S, R]              src = slots[i]     dst = i        (into [L, N, R])
    slot scatter                                    src = i            dst = slots[i]
    slot copy                                       src = a            dst = b

The kernel moves integers of the element's width (``_bits``), so a copy is bit-identical for
every dtype (fp64 included), and the interpreter's bf16 arithmetic problem never arises. A
destination index < 0 is skipped (the padding convention of CUDA-graph batches).
Destinations of one call must be distinct, and in ``copy_slots`` disjoint from the sources:
the rows are copied in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.native.kernels import on_cuda

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BLOCK = 1024


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


@triton.jit
def _copy_rows(src, dst, src_idx, dst_idx, n_elems, src_sl, src_ss, dst_sl, dst_ss,
               BLOCK: tl.constexpr):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(2)
    s = tl.load(src_idx + i).to(tl.int64)
    d = tl.load(dst_idx + i).to(tl.int64)
    n = tl.where(d >= 0, tl.load(n_elems + i), 0)
    off = blk * BLOCK + tl.arange(0, BLOCK)
    mask = off < n
    x = tl.load(src + layer * src_sl + s * src_ss + off, mask=mask)
    tl.store(dst + layer * dst_sl + d * dst_ss + off, x, mask=mask)


def copy_rows_triton(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                     n_elems: torch.Tensor | None = None) -> None:
    """dst[l, dst_idx[i], :n[i]] = src[l, src_idx[i], :n[i]]. src: [L, S, R]; dst: [L, S', R]
    (rows contiguous); src_idx, dst_idx: [M]; n_elems: [M] (default R)."""
    assert src.dtype == dst.dtype and src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2]
    assert src.stride(2) == 1 and dst.stride(2) == 1
    m, r = src_idx.numel(), src.shape[2]
    if m == 0:
        return
    if n_elems is None:
        n_elems = torch.full((m,), r, dtype=torch.int32, device=src.device)
        blocks = triton.cdiv(r, BLOCK)
    else:
        blocks = triton.cdiv(int(n_elems.max()), BLOCK) if n_elems.numel() else 0
        if blocks == 0:
            return
    s, d = _bits(src), _bits(dst)
    _copy_rows[(m, src.shape[0], blocks)](s, d, src_idx, dst_idx, n_elems, s.stride(0), s.stride(1),
                                          d.stride(0), d.stride(1), BLOCK=BLOCK)


# ---- KV write by slot mapping -----------------------------------------------------------
def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new keys/values of one layer. k_cache, v_cache: [P, 64, Hkv, D]; slots: [T]
    (flat slot page*64 + offset; < 0 skipped); k, v: [T, Hkv, D]."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    t = slots.numel()
    src_idx = torch.arange(t, dtype=torch.int32, device=slots.device)
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = cache.view(1, -1, cache.shape[2] * cache.shape[3])
        new = new.to(cache.dtype).reshape(1, t, -1).contiguous()
        copy_rows_triton(new, rows, src_idx, slots)


def write_kv(k_cache, v_cache, slots, k, v) -> None:
    (write_kv_triton if on_cuda(k_cache, k) else write_kv_ref)(k_cache, v_cache, slots, k, v)


# ---- page copy (tail copy-on-write) -------------------------------------------------------
def copy_page_prefix_ref(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                         n_tokens: torch.Tensor) -> None:
    """For every layer: positions 0..n_tokens[i]-1 of page src[i] into page dst[i].
    k, v: [La, P, 64, Hkv, D]; src, dst, n_tokens: [M]."""
    for s, d, n in zip(src.tolist(), dst.tolist(), n_tokens.tolist()):
        k[:, d, :n] = k[:, s, :n]
        v[:, d, :n] = v[:, s, :n]


def copy_page_prefix_triton(k, v, src, dst, n_tokens) -> None:
    per_token = k.shape[3] * k.shape[4]
    n_elems = (n_tokens.to(torch.int64) * per_token).to(torch.int32)
    for cache in (k, v):
        rows = cache.view(cache.shape[0], cache.shape[1], -1)
        copy_rows_triton(rows, rows, src, dst, n_elems)


def copy_page_prefix(k, v, src, dst, n_tokens) -> None:
    (copy_page_prefix_triton if on_cuda(k) else copy_page_prefix_ref)(k, v, src, dst, n_tokens)


# ---- StateImage slots -------------------------------------------------------------------
# A state tensor has the slot on dim 1: conv [Ll, S, C, K-1], ssm [Ll, S, Hv, Dk, Dv];
# the continuation hidden [S, H] is passed as hidden[None].
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], t.shape[1], -1)


def gather_slots_ref(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """t: [L, S, *R]; slots: [N] -> [L, N, *R] (a copy)."""
    return t[:, slots]


def gather_slots_triton(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty((t.shape[0], slots.numel(), *t.shape[2:]), dtype=t.dtype, device=t.device)
    idx = torch.arange(slots.numel(), dtype=torch.int32, device=t.device)
    copy_rows_triton(_rows(t), _rows(out), slots, idx)
    return out


def gather_slots(t, slots):
    return (gather_slots_triton if on_cuda(t) else gather_slots_ref)(t, slots)


def scatter_slots_ref(t: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """t[:, slots[i]] = src[:, i]. t: [L, S, *R]; slots: [N] distinct; src: [L, N, *R]."""
    t[:, slots] = src.to(t.dtype)


def scatter_slots_triton(t, slots, src) -> None:
    idx = torch.arange(slots.numel(), dtype=torch.int32, device=t.device)
    copy_rows_triton(_rows(src.to(t.dtype).contiguous()), _rows(t), idx, slots)


def scatter_slots(t, slots, src) -> None:
    (scatter_slots_triton if on_cuda(t) else scatter_slots_ref)(t, slots, src)


def copy_slots_ref(t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """t[:, dst[i]] = t[:, src[i]] (slot moves and forks). t: [L, S, *R]; src, dst: [M],
    dst distinct and disjoint from src."""
    t[:, dst] = t[:, src]


def copy_slots_triton(t, src, dst) -> None:
    rows = _rows(t)
    copy_rows_triton(rows, rows, src, dst)


def copy_slots(t, src, dst) -> None:
    (copy_slots_triton if on_cuda(t) else copy_slots_ref)(t, src, dst)
