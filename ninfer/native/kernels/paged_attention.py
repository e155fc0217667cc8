"""Paged attention over 64-token pages, read through the page table (no gather of K/V).

Layout (as ``native/model/attention.py``): ``k_cache, v_cache: [P, 64, Hkv, D]``;
``page_tables: [N, max_pages]`` (int32 or long; row i lists sequence i's pages in order)::

    position p of sequence i  ->  page page_tables[i, p // 64], row p % 64

The K/V of the new tokens are written before attention runs (``copies.write_kv``), so both
kernels read every key from the pages, the new ones included.

* ``paged_decode``: one query per row at position ``seq_lens[i] - 1``. Split-K: the pages of a
  row (its own length, not the table's width) are cut into ``num_splits`` ranges, each program keeps an online softmax over its range
  and writes (o, lse); a second kernel merges the splits (log-sum-exp weights).
* ``paged_prefill``: a chunk of queries per sequence (packed, ``cu_seqlens``) at positions
  ``starts[i] .. starts[i] + q_len - 1``: full attention over the cached prefix, causal within
  the chunk.

Qwen3-Next's output gate (``out * sigmoid(gate)``) is applied outside, by the caller, on
``[T, H*D]``: it is one elementwise op the o_proj prologue would fuse no better, and keeping it
out lets the kernels serve plain Qwen3 attention unchanged.

Precision: all softmax state and accumulators in fp32, output cast to q's dtype. Scores are
fp32 dot products (products of fp16/bf16 values are exact in fp32); on CUDA the P·V product
uses V's dtype for P (the flash-attention convention), under the interpreter fp32, since the
interpreter's bf16 arithmetic is wrong (DESIGN.md §8) — values are upcast right after load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.native.kernels import interpreting, on_cuda
from ninfer.native.model.attention import paged_attention
from ninfer.native.model.config import PAGE_SIZE


# ---- references ---------------------------------------------------------------------------
def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int = 1) -> torch.Tensor:
    """q: [N, H, D], row i at position seq_lens[i]-1; page_tables: [N, max_pages];
    seq_lens: [N] (>= 1). Returns [N, H, D] in q's dtype. ``num_splits`` only shapes the kernel."""
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        out[i] = paged_attention(q[i:i + 1], k_cache, v_cache, page_tables[i].long(), n - 1, scale)[0]
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_tables: torch.Tensor, cu_seqlens: torch.Tensor, starts: torch.Tensor,
                      scale: float, q_lens: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] packed (rows cu_seqlens[i]..cu_seqlens[i+1]-1 are sequence i at positions
    starts[i]..); page_tables: [N, max_pages]; cu_seqlens: [N+1]; starts: [N]. ``q_lens`` [N]:
    sequence i's queries are only rows cu_seqlens[i] .. + q_lens[i] - 1 (a graph's padded verify
    rows: the rest are padding, no sequence's). Returns [T, H, D] in q's dtype; rows no sequence
    covers are zeros."""
    out = torch.zeros_like(q)
    cu = cu_seqlens.tolist()
    lens = q_lens.tolist() if q_lens is not None else None
    for i, s in enumerate(starts.tolist()):
        lo, hi = cu[i], cu[i + 1] if lens is None else cu[i] + lens[i]
        if hi > lo:
            out[lo:hi] = paged_attention(q[lo:hi], k_cache, v_cache, page_tables[i].long(), s, scale)
    return out


def _dot_mode(q: torch.Tensor) -> dict:
    """UPCAST: fp32 operands (always under the interpreter; on CUDA for fp32 models), whose
    dots then run in IEEE fp32, not TF32. 16-bit operands on CUDA use the tensor cores."""
    upcast = interpreting() or q.dtype == torch.float32
    return {"UPCAST": upcast, "PREC": "ieee" if upcast else "tf32"}


# ---- launch configs ------------------------------------------------------------------------
# Chosen so that no variant spills at the real head dim (256) on sm_90: the offline compile
# check (``kernels/compile_check.py``, a CI test) compiles every one with ptxas and fails on a
# spill. A key tile of BN rows × BD dims lives in registers (and BN × BD × stages in shared
# memory): fp32 operands take twice the room of 16-bit ones, hence the narrower tiles.
_CONFIGS = {
    # kind, 16-bit?: the widest head dim the entry is for -> tile sizes, warps, pipeline stages
    ("decode", True): ((128, dict(BN=64, num_warps=4, num_stages=3)), (256, dict(BN=64, num_warps=4, num_stages=2))),
    ("decode", False): ((128, dict(BN=64, num_warps=4, num_stages=2)), (256, dict(BN=32, num_warps=8, num_stages=2))),
    ("prefill", True): ((128, dict(BM=64, BN=64, num_warps=4, num_stages=3)),
                        (256, dict(BM=64, BN=32, num_warps=8, num_stages=2))),
    ("prefill", False): ((128, dict(BM=32, BN=32, num_warps=4, num_stages=2)),
                         (256, dict(BM=32, BN=16, num_warps=8, num_stages=2))),
}


def launch_config(kind: str, dtype: torch.dtype, bd: int) -> dict:
    """Tiles, warps and stages of ``kind`` ("decode" | "prefill") for a padded head dim ``bd``.
    The interpreter runs any config; it gets the GPU's, so the tests run the same blocking."""
    table = _CONFIGS[(kind, dtype != torch.float32)]
    for widest, cfg in table:
        if bd <= widest:
            return dict(cfg)
    return dict(table[-1][1])


# ---- decode: split-K over pages --------------------------------------------------------------
# Runtime integers that change with the batch (the table's width, pages per split, the split
# count) are not specialised: one compiled variant serves every batch, so a graph's capture or
# a new batch size never recompiles mid-run.
@triton.jit(do_not_specialize=["pt_stride", "S"])
def _decode_split(q, k_cache, v_cache, page_tables, seq_lens, o_part, lse_part, scale,
                  pt_stride, S,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, REP: tl.constexpr,
                  BH: tl.constexpr, BD: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr,
                  UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One (row, kv head, split): the REP query heads sharing a kv head (padded to BH >= 16
    rows, tl.dot's minimum), over the split's share of the row's own pages (its length cut in
    S, not the table's width: a 2k row in a 32k table keeps every split busy), BN keys of a
    page at a time. Writes o (normalised) and lse per (row, head, split); a split without keys
    (a row of fewer pages than splits) writes lse = -inf."""
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(seq_lens + row)
    KB: tl.constexpr = PAGE // BN                        # key blocks per page
    pages_per_split = tl.cdiv(tl.cdiv(n, PAGE), S)
    b_lo = split * pages_per_split * KB
    b_hi = tl.minimum(b_lo + pages_per_split * KB, tl.cdiv(n, BN))

    hs = tl.arange(0, BH)
    ds = tl.arange(0, BD)
    ts0 = tl.arange(0, BN)
    h_ok = hs < REP
    d_ok = ds < D
    heads = kvh * REP + hs
    qv = tl.load(q + (row * H + heads[:, None]) * D + ds[None, :], mask=h_ok[:, None] & d_ok[None, :],
                 other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)

    m = tl.full([BH], float("-inf"), tl.float32)
    l_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    for kb in range(b_lo, b_hi):
        p = kb // KB
        page = tl.load(page_tables + row * pt_stride + p).to(tl.int64)
        ts = (kb % KB) * BN + ts0                            # rows of the page
        t_ok = (p * PAGE + ts) < n
        off = ((page * PAGE + ts[:, None]) * HKV + kvh) * D + ds[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + off, mask=kv_mask, other=0.0)
        vt = tl.load(v_cache + off, mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(qv, tl.trans(kt), input_precision=PREC) * scale                # [BH, BN]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt, input_precision=PREC)
        m = m_new

    has = l_sum > 0
    o = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    base = (row * H + heads) * S + split
    tl.store(o_part + base[:, None] * D + ds[None, :], o, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse_part + base, lse, mask=h_ok)


@triton.jit(do_not_specialize=["S"])
def _decode_merge(o_part, lse_part, out, S, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    """One (row, head): o = sum_s exp(lse_s - lse) o_s over the splits that saw a key, BS splits
    at a time with a running maximum (a [S, D] tile of a lone row's ~130 splits would spill)."""
    rh = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BD)
    d_ok = ds < D
    m = tl.full([1], float("-inf"), tl.float32)
    w_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    for s0 in range(0, S, BS):
        ss = s0 + tl.arange(0, BS)
        s_ok = ss < S
        lse = tl.load(lse_part + rh * S + ss, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # no key yet in these splits
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        o = tl.load(o_part + (rh * S + ss[:, None]) * D + ds[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        w_sum = w_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    tl.store(out + rh * D + ds, (acc / w_sum).to(out.dtype.element_ty), mask=d_ok)


MERGE_SPLITS = 16                 # splits per step of the merge: a [16, 256] fp32 tile, no spill


def paged_decode_triton(q, k_cache, v_cache, page_tables, seq_lens, scale, num_splits: int = 1):
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    rep = h // hkv
    max_pages = page_tables.shape[1]
    splits = max(1, min(num_splits, max_pages))
    o_part = torch.empty((n, h, splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((n, h, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if n == 0:
        return out
    q, page_tables, seq_lens = q.contiguous(), page_tables.contiguous(), seq_lens.contiguous()
    bd = triton.next_power_of_2(d)
    _decode_split[(n, hkv, splits)](q, k_cache, v_cache, page_tables, seq_lens, o_part, lse_part, scale,
                                    page_tables.stride(0), splits,
                                    H=h, HKV=hkv, D=d, REP=rep, BH=max(16, triton.next_power_of_2(rep)), BD=bd,
                                    PAGE=PAGE_SIZE, **_dot_mode(q), **launch_config("decode", q.dtype, bd))
    _decode_merge[(n * h,)](o_part, lse_part, out, splits, D=d, BD=bd,
                            BS=min(MERGE_SPLITS, triton.next_power_of_2(splits)))
    return out


def decode_splits(max_pages: int, rows: int, kv_heads: int, target_programs: int = 264) -> int:
    """Enough splits to fill the GPU (about 2 programs per SM on an H200) when rows x kv heads
    alone cannot, never more than the pages."""
    return max(1, min(max_pages, target_programs // max(1, rows * kv_heads)))


def paged_decode(q, k_cache, v_cache, page_tables, seq_lens, scale, num_splits: int | None = None):
    if not on_cuda(q, k_cache):
        return paged_decode_ref(q, k_cache, v_cache, page_tables, seq_lens, scale)
    if num_splits is None:
        num_splits = decode_splits(page_tables.shape[1], q.shape[0], k_cache.shape[2])
    return paged_decode_triton(q, k_cache, v_cache, page_tables, seq_lens, scale, num_splits)


# ---- prefill / chunk --------------------------------------------------------------------
@triton.jit(do_not_specialize=["pt_stride"])
def _prefill(q, k_cache, v_cache, page_tables, cu_seqlens, starts, q_lens, out, scale, pt_stride,
             H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
             HAS_LENS: tl.constexpr):
    """One (sequence, block of BM queries, head). Keys: positions 0 .. the block's last query,
    BN at a time (BN divides the page); the mask kpos <= qpos is the prefix (all of it) plus
    causality in the chunk."""
    seq = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // (H // HKV)
    lo = tl.load(cu_seqlens + seq)
    if HAS_LENS:
        q_len = tl.load(q_lens + seq)
    else:
        q_len = tl.load(cu_seqlens + seq + 1) - lo
    start = tl.load(starts + seq)

    ms = blk * BM + tl.arange(0, BM)
    ds = tl.arange(0, BD)
    ts0 = tl.arange(0, BN)
    KB: tl.constexpr = PAGE // BN
    m_ok = ms < q_len
    d_ok = ds < D
    qpos = start + ms
    rows = (lo + ms).to(tl.int64)
    qv = tl.load(q + (rows[:, None] * H + head) * D + ds[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    last = start + tl.minimum(q_len, (blk + 1) * BM)            # one past the block's last position
    n_blocks = tl.where(blk * BM < q_len, tl.cdiv(last, BN), 0)

    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for kb in range(n_blocks):
        p = kb // KB
        page = tl.load(page_tables + seq * pt_stride + p).to(tl.int64)
        ts = (kb % KB) * BN + ts0                            # rows of the page
        kpos = p * PAGE + ts
        t_ok = kpos < last
        off = ((page * PAGE + ts[:, None]) * HKV + kvh) * D + ds[None, :]
        kv_mask = t_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + off, mask=kv_mask, other=0.0)
        vt = tl.load(v_cache + off, mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(qv, tl.trans(kt), input_precision="ieee") * scale             # [BM, BN]
        s = tl.where((kpos[None, :] <= qpos[:, None]) & m_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # rows past q_len see no key
        alpha = tl.exp(m - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype), vt, input_precision="ieee")
        m = m_new

    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out + (rows[:, None] * H + head) * D + ds[None, :], o.to(out.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def paged_prefill_triton(q, k_cache, v_cache, page_tables, cu_seqlens, starts, scale, block_m: int | None = None,
                         max_q: int | None = None, q_lens=None):
    """``max_q``: the longest sequence's queries when the caller knows it (a CUDA graph's
    capture must not read it back from the device); ``q_lens``: as ``paged_prefill_ref``'s;
    ``block_m``: queries per program (default: ``launch_config``'s)."""
    t, h, d = q.shape
    out = torch.zeros_like(q)          # rows no sequence covers (a graph's padded chunk) read as zeros
    n = starts.numel()
    if t == 0 or n == 0:
        return out
    if max_q is None:
        max_q = int((cu_seqlens[1:] - cu_seqlens[:-1]).max() if q_lens is None else q_lens.max())
    q, page_tables = q.contiguous(), page_tables.contiguous()
    bd = triton.next_power_of_2(d)
    cfg = launch_config("prefill", q.dtype, bd)
    if block_m is not None:
        cfg["BM"] = block_m
    grid = (n, triton.cdiv(max_q, cfg["BM"]), h)
    lens = q_lens.contiguous() if q_lens is not None else starts
    _prefill[grid](q, k_cache, v_cache, page_tables, cu_seqlens.contiguous(), starts.contiguous(), lens, out, scale,
                   page_tables.stride(0), H=h, HKV=k_cache.shape[2], D=d, BD=bd, PAGE=PAGE_SIZE,
                   HAS_LENS=q_lens is not None, UPCAST=_dot_mode(q)["UPCAST"], **cfg)
    return out


def paged_prefill(q, k_cache, v_cache, page_tables, cu_seqlens, starts, scale, q_lens=None):
    impl = paged_prefill_triton if on_cuda(q, k_cache) else paged_prefill_ref
    return impl(q, k_cache, v_cache, page_tables, cu_seqlens, starts, scale, q_lens=q_lens)
