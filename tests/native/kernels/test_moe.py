"""The fused MoE kernels (interpreted) against the grouped torch reference: expert counts,
top-k, renormalised or not, a shared expert or none, widths that are not powers of two, ragged
token counts; fp32 to 1e-5, fp16 / bf16 within the reference's extra roundings (it rounds
gate_up and the activation to the model dtype; the kernels keep fp32)."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import moe
from ninfer.native.model.moe import MoeWeights
from tests.native.kernels.conftest import rel_err

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BOUND = {"fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2}


def _weights(e, k, h, inter, dtype, shared, norm, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.1: (torch.randn(*s, generator=g) * std).to(dtype)  # noqa: E731
    kw = {}
    if shared:
        kw = dict(shared_gate_proj=r(inter, h), shared_up_proj=r(inter, h), shared_down_proj=r(h, inter),
                  shared_gate=r(1, h))
    return MoeWeights(router=r(e, h, std=0.5), gate_up=r(e, 2 * inter, h), down=r(e, h, inter), top_k=k,
                      norm_topk_prob=norm, **kw)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 8, 2, 128, 64), (5, 16, 4, 96, 40), (17, 8, 2, 128, 64)],
                         ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
@pytest.mark.parametrize("shared,norm", [(True, True), (False, False)], ids=["shared-norm", "plain"])
def test_fused_moe_equals_the_grouped_reference(dtype, shape, shared, norm):
    t, e, k, h, inter = shape
    dt = DTYPES[dtype]
    w = _weights(e, k, h, inter, dt, shared, norm, seed=t + e)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(7)).to(dt)
    got = moe.fused_moe_triton(x, w)
    want = moe.sparse_moe_ref(x, w)
    assert got.dtype == dt and got.shape == want.shape
    assert rel_err(got, want) < BOUND[dtype]


def test_no_tokens():
    w = _weights(8, 2, 64, 32, torch.float32, True, True, 0)
    assert moe.fused_moe_triton(torch.empty(0, 64), w).shape == (0, 64)


def test_the_fused_form_serves_graphs_and_small_calls():
    assert moe.use_fused(4096, True) and moe.use_fused(moe.FUSED_MAX_ROWS, False)
    assert not moe.use_fused(moe.FUSED_MAX_ROWS + 1, False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_moe_reads_fp8_block_scaled_experts(dtype):
    """Stacked FP8 experts (e4m3 + one fp32 scale per 128 x 128 block: Qwen's -FP8 releases) are
    dequantised inside the kernels, element by element after the load: equal to the grouped
    reference that multiplies by the dequantised experts (fp32: to rounding; bf16: the
    reference's own roundings)."""
    from ninfer.native.model import fp8
    dt = DTYPES[dtype]
    e, k, h, inter = 4, 2, 256, 128
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    q = lambda w: fp8.quantize(w)  # noqa: E731
    gate_up = fp8.stack([fp8.cat_rows([q(r(inter, h)), q(r(inter, h))], dt) for _ in range(e)], dt)
    down = fp8.stack([q(r(h, inter)) for _ in range(e)], dt)
    assert isinstance(gate_up, fp8.Fp8Weight) and gate_up.scale_inv.shape == (e, 2, 2)
    w = MoeWeights(router=r(e, h).to(dt), gate_up=gate_up, down=down, top_k=k, norm_topk_prob=True,
                   shared_gate_proj=r(inter, h).to(dt), shared_up_proj=r(inter, h).to(dt),
                   shared_down_proj=r(h, inter).to(dt), shared_gate=r(1, h).to(dt))
    x = torch.randn(5, h, generator=g).to(dt)
    got = moe.fused_moe_triton(x, w)
    want = moe.sparse_moe_ref(x, w)
    assert rel_err(got, want) < BOUND[dtype]
    # the same kernels over the experts dequantised in fp32 up front: what the FP8 path computes
    plain = MoeWeights(**{**w.__dict__, "gate_up": gate_up.dequantize(torch.float32),
                          "down": down.dequantize(torch.float32)})
    assert rel_err(moe.fused_moe_triton(x, plain), got) < 1e-6
