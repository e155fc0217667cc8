"""Paged attention kernels against the torch reference (``native/model/attention.py``).

The kernels compute in fp32 on the stored fp16/bf16 values and round only the output, so the
reference is evaluated in fp32 on the same stored values and the error is the output rounding:

    relative Frobenius error  fp32 <= 1e-5,  fp16 <= 1e-3,  bf16 <= 8e-3
    (measured: ~2e-7, ~2e-4, ~3.3e-3)

Every cache slot that no sequence has written holds NaN, so a kernel that reads one unmasked
(past a sequence's end, a page it does not own) fails the test instead of passing by luck.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import paged_attention as pa
from tests.native.kernels.conftest import rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = [str(d).removeprefix("torch.") for d in DTYPES]
BOUND = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _setup(lens, h, hkv, d, dtype, seed=0, extra_pages=2):
    """Caches with the positions 0..lens[i]-1 of every sequence written (NaN elsewhere) and
    page tables over a shuffled page pool, padded with -1."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [(n + 63) // 64 for n in lens]
    total = sum(n_pages) + extra_pages
    order = torch.randperm(total, generator=g).tolist()
    k = torch.full((total, 64, hkv, d), float("nan"), dtype=dtype)
    v = torch.full((total, 64, hkv, d), float("nan"), dtype=dtype)
    width = max(n_pages) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    for i, (n, np_) in enumerate(zip(lens, n_pages)):
        pages = [order.pop() for _ in range(np_)]
        tables[i, :np_] = torch.tensor(pages, dtype=torch.int32)
        for p in range(n):
            page, off = pages[p // 64], p % 64
            k[page, off] = torch.randn(hkv, d, generator=g).to(dtype)
            v[page, off] = torch.randn(hkv, d, generator=g).to(dtype)
    return k, v, tables


DECODE_CASES = {
    "mha-d64-lens1,64,65": ([1, 64, 65], 2, 2, 64),
    "gqa4-d128-lens200,3": ([200, 3], 8, 2, 128),
    "gqa8-d256-len130": ([130], 8, 1, 256),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_paged_decode(case, splits, dtype):
    lens, h, hkv, d = DECODE_CASES[case]
    k, v, tables = _setup(lens, h, hkv, d, dtype)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = pa.paged_decode_triton(q, k, v, tables, seq_lens, d ** -0.5, num_splits=splits)
    ref = pa.paged_decode_ref(q.float(), k.float(), v.float(), tables.clamp_min(0), seq_lens, d ** -0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= BOUND[dtype]


def test_decode_splits_cut_each_row_by_its_own_length():
    """A short row in a wide table (4 of 32 pages, 8 splits): every split that can hold a page
    gets one — 4 busy splits, not the 1 that cutting the table's width would give (a 2k row at
    a 32k context kept 16 of 264 programs busy) — and the merged result is the reference's."""
    lens, h, hkv, d = [256], 2, 1, 32
    k, v, tables = _setup(lens, h, hkv, d, torch.float32, seed=4, extra_pages=28)
    wide = torch.cat([tables[:, :4], torch.full((1, 28), 7, dtype=torch.int32)], dim=1)   # 32 pages wide
    q = torch.randn(1, h, d)
    s = 8
    o_part, lse_part = torch.empty(1, h, s, d), torch.empty(1, h, s)
    cfg = pa.launch_config("decode", torch.float32, d)
    pa._decode_split[(1, hkv, s)](q, k, v, wide, torch.tensor(lens), o_part, lse_part, d ** -0.5, wide.stride(0), s,
                                  H=h, HKV=hkv, D=d, REP=h // hkv, BH=16, BD=d, PAGE=64, UPCAST=True, PREC="ieee",
                                  **cfg)
    busy = torch.isfinite(lse_part).sum(-1)
    assert busy.tolist() == [[4, 4]]
    out = pa.paged_decode_triton(q, k, v, wide, torch.tensor(lens), d ** -0.5, num_splits=s)
    ref = pa.paged_decode_ref(q, k, v, wide, torch.tensor(lens), d ** -0.5)
    assert rel_err(out, ref) <= BOUND[torch.float32]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bfloat16"])
def test_paged_decode_long_context_split_k(dtype):
    """20 pages cut into 6 splits (uneven: the last split gets fewer pages, some rows none)."""
    lens, h, hkv, d = [1280, 70], 4, 2, 64
    k, v, tables = _setup(lens, h, hkv, d, dtype, seed=3)
    q = torch.randn(2, h, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = pa.paged_decode_triton(q, k, v, tables, seq_lens, d ** -0.5, num_splits=6)
    ref = pa.paged_decode_ref(q.float(), k.float(), v.float(), tables.clamp_min(0), seq_lens, d ** -0.5)
    assert rel_err(out, ref) <= BOUND[dtype]


PREFILL_CASES = {
    # (starts, q_lens, h, hkv, d, block_m)
    "fresh-20-mha-d64": ([0], [20], 2, 2, 64, 16),
    "prefix+chunk-ragged-gqa2-d128": ([100, 64, 5], [20, 1, 70], 4, 2, 128, 16),
    "page-boundary-gqa4-d64-bm64": ([63, 0], [2, 64], 4, 1, 64, 64),
    "prefix-d256": ([70], [9], 2, 1, 256, 16),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_paged_prefill(case, dtype):
    starts, q_lens, h, hkv, d, bm = PREFILL_CASES[case]
    lens = [s + n for s, n in zip(starts, q_lens)]
    k, v, tables = _setup(lens, h, hkv, d, dtype, seed=1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    st = torch.tensor(starts, dtype=torch.int32)
    out = pa.paged_prefill_triton(q, k, v, tables, cu, st, d ** -0.5, block_m=bm)
    ref = pa.paged_prefill_ref(q.float(), k.float(), v.float(), tables.clamp_min(0), cu, st, d ** -0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_paged_prefill_of_padded_rows(dtype):
    """Rows of 4 query slots with 2, 4 and 1 real queries (``q_lens``: a graph's padded verify
    rows): the real queries equal the same rows packed without padding, every padding row is
    zero, and the reference agrees."""
    starts, q_lens, h, hkv, d = [70, 3, 127], [2, 4, 1], 4, 2, 64
    k, v, tables = _setup([s + 4 for s in starts], h, hkv, d, dtype, seed=4)
    q = torch.randn(12, h, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    cu, st = torch.tensor([0, 4, 8, 12], dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor(q_lens, dtype=torch.int32)
    out = pa.paged_prefill_triton(q, k, v, tables, cu, st, d ** -0.5, block_m=16, q_lens=lens)
    real = torch.tensor([0, 1, 4, 5, 6, 7, 8])
    packed_cu = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    packed = pa.paged_prefill_triton(q[real], k, v, tables, packed_cu, st, d ** -0.5, block_m=16)
    assert torch.equal(out[real], packed)
    pad = torch.tensor([2, 3, 9, 10, 11])
    assert not out[pad].any()
    ref = pa.paged_prefill_ref(q.float(), k.float(), v.float(), tables.clamp_min(0), cu, st, d ** -0.5, q_lens=lens)
    assert not ref[pad].any()
    assert rel_err(out[real], ref[real]) <= BOUND[dtype]


def test_decode_equals_prefill_of_one_row():
    """A decode row is a one-query chunk: both kernels agree (fp32)."""
    lens = [77, 5]
    k, v, tables = _setup(lens, 4, 2, 64, torch.float32, seed=2)
    q = torch.randn(2, 4, 64)
    dec = pa.paged_decode_triton(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), 0.125, num_splits=2)
    pre = pa.paged_prefill_triton(q, k, v, tables, torch.tensor([0, 1, 2], dtype=torch.int32),
                                  torch.tensor([76, 4], dtype=torch.int32), 0.125, block_m=16)
    assert rel_err(dec, pre) <= 1e-6


def test_dispatch_on_cpu_is_the_reference():
    k, v, tables = _setup([10], 2, 1, 64, torch.float32)
    q = torch.randn(1, 2, 64)
    lens = torch.tensor([10], dtype=torch.int32)
    assert torch.equal(pa.paged_decode(q, k, v, tables, lens, 0.125),
                       pa.paged_decode_ref(q, k, v, tables, lens, 0.125))
    cu, st = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    assert torch.equal(pa.paged_prefill(q, k, v, tables, cu, st, 0.125),
                       pa.paged_prefill_ref(q, k, v, tables, cu, st, 0.125))


def test_decode_splits_fill_the_device():
    assert pa.decode_splits(max_pages=100, rows=1, kv_heads=2) == 100
    assert pa.decode_splits(max_pages=100, rows=64, kv_heads=8) == 1
    assert pa.decode_splits(max_pages=4, rows=1, kv_heads=1) == 4
