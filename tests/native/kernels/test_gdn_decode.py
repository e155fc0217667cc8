"""GDN decode rows in place (``kernels/gdn_decode.py``, interpreted) against the gather / torch
step / scatter references: outputs, the rows' slots after the step, every other slot untouched
bit for bit; GQA (value heads sharing key heads), widths not powers of two, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import gdn_decode as gd
from tests.native.kernels.conftest import rel_err

CASES = {"hk2-hv4-d32": (2, 4, 32, 32), "hk1-hv2-d64x48": (1, 2, 64, 48)}


def _inputs(hk, hv, dk, dv, dtype, n=3, slots=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(n, hk, dk).to(dtype), r(n, hk, dk).to(dtype), r(n, hv, dv).to(dtype)
    gg, beta = -torch.rand(n, hv, generator=g) * 0.5, torch.rand(n, hv, generator=g).to(dtype)
    ssm = r(slots, hv, dk, dv) * 0.1
    idx = torch.tensor([5, 0, 3][:n])
    return q, k, v, gg, beta, ssm, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_delta_rule_step_in_place(case, dtype):
    q, k, v, g, beta, ssm, idx = _inputs(*CASES[case], dtype)
    want_ssm, got_ssm = ssm.clone(), ssm.clone()
    want = gd.delta_rule_step_ref(q, k, v, g, beta, want_ssm, idx)
    got = gd.delta_rule_step_triton(q, k, v, g, beta, got_ssm, idx)
    bound = 1e-5 if dtype == torch.float32 else 8e-3
    assert got.dtype == dtype and rel_err(got, want) < bound
    assert rel_err(got_ssm[idx], want_ssm[idx]) < 1e-5
    others = [s for s in range(ssm.shape[0]) if s not in idx.tolist()]
    assert torch.equal(got_ssm[others], ssm[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_conv_step_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    n, c, k = 3, 300, 4
    x = torch.randn(n, c, generator=g).to(dtype)
    states = torch.randn(6, c, k - 1, generator=g).to(dtype)
    w = (torch.randn(c, k, generator=g) * 0.5).to(dtype)
    idx = torch.tensor([4, 1, 2])
    want_s, got_s = states.clone(), states.clone()
    want = gd.conv_step_ref(x, want_s, idx, w)
    got = gd.conv_step_triton(x, got_s, idx, w)
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1.6e-2)
    assert torch.equal(got_s, want_s)                   # the shifted inputs: moved, never computed
