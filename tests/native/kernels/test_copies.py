"""KV write by slot mapping, tail copy-on-write of pages, StateImage gather/scatter/copy:
the Triton kernel against its torch reference, bit for bit, in every dtype."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import copies

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
IDS = [str(d).removeprefix("torch.") for d in DTYPES]


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hkv,d", [(1, 64), (2, 128), (4, 256)], ids=["hkv1-d64", "hkv2-d128", "hkv4-d256"])
def test_write_kv(dtype, hkv, d):
    pages, t = 4, 7
    kc, vc = _rand((pages, 64, hkv, d), dtype, 1), _rand((pages, 64, hkv, d), dtype, 2)
    k, v = _rand((t, hkv, d), dtype, 3), _rand((t, hkv, d), dtype, 4)
    # ragged: two sequences' slots on non-adjacent pages, one padding row (-1) skipped
    slots = _i32([2 * 64 + 63, 3 * 64 + 0, 3 * 64 + 1, -1, 0 * 64 + 5, 1 * 64 + 63, 1 * 64 + 62])
    kr, vr = kc.clone(), vc.clone()
    copies.write_kv_ref(kr, vr, slots.long(), k, v)
    copies.write_kv_triton(kc, vc, slots, k, v)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_copy_page_prefix(dtype):
    la, pages, hkv, d = 2, 6, 2, 64
    k, v = _rand((la, pages, 64, hkv, d), dtype, 1), _rand((la, pages, 64, hkv, d), dtype, 2)
    src, dst, n = _i32([1, 3, 0]), _i32([4, 2, 5]), _i32([10, 64, 1])   # partial, full, one token
    kr, vr = k.clone(), v.clone()
    copies.copy_page_prefix_ref(kr, vr, src, dst, n)
    copies.copy_page_prefix_triton(k, v, src, dst, n)
    assert torch.equal(k.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), vr.view(torch.uint8))
    assert not torch.equal(k[:, 4, 10:], k[:, 1, 10:])      # the tail past n is untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("part", ["conv", "ssm", "hidden"])
def test_state_slots(dtype, part):
    shape = {"conv": (3, 5, 24, 3), "ssm": (3, 5, 2, 16, 16), "hidden": (1, 5, 32)}[part]
    t = _rand(shape, dtype, 1)
    slots = _i32([4, 0, 2])
    got = copies.gather_slots_triton(t, slots)
    assert torch.equal(got, copies.gather_slots_ref(t, slots.long()))

    new = _rand((shape[0], 3, *shape[2:]), dtype, 2)
    a, b = t.clone(), t.clone()
    copies.scatter_slots_triton(a, slots, new)
    copies.scatter_slots_ref(b, slots.long(), new)
    assert torch.equal(a, b)

    src, dst = _i32([1, 3]), _i32([0, 4])                     # slot moves: disjoint src / dst
    copies.copy_slots_triton(a, src, dst)
    copies.copy_slots_ref(b, src.long(), dst.long())
    assert torch.equal(a, b)


def test_dispatch_on_cpu_is_the_reference():
    kc, vc = torch.zeros(2, 64, 1, 8), torch.zeros(2, 64, 1, 8)
    k, v = torch.ones(2, 1, 8), torch.ones(2, 1, 8)
    copies.write_kv(kc, vc, torch.tensor([3, -1]), k, v)
    assert kc.view(-1, 1, 8)[3].eq(1).all() and kc.sum() == 8
    t = torch.arange(12.0).view(1, 3, 4)
    assert torch.equal(copies.gather_slots(t, torch.tensor([2, 0])), t[:, [2, 0]])
