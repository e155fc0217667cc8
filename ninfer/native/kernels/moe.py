"""Sparse MoE on the GPU without data-dependent shapes: one program per (token, chosen expert)
row and block of the expert's width, so a CUDA graph can capture it for any expert count.

The torch reference (``native/model/moe.py`` ``sparse_moe``, re-exported as ``sparse_moe_ref``)
groups tokens by expert with ``torch.unique`` — a host sync and shapes that depend on the
routing. Here routing stays on the device (softmax, top-k, optional renormalisation: the
reference's own ops), then two kernels run over the T × k (token, expert) rows:

    _moe_up     act[r, i]  = silu(x[t] · Wg[e, i]) * (x[t] · Wu[e, i])        (fp32)
    _moe_down   y[r, h]    = w[r] * sum_i act[r, i] * Wd[e, h, i]              (model dtype)

with r = t * k + j, e = top_i[t, j], w = top_w[t, j]; out[t] = sum_j y[t*k + j] (fp32, one
rounding), plus the gated shared expert (torch). Each program reads its expert's rows once: for
a decode batch that is what the sparse form reads too (an expert chosen by two tokens is read
twice). Matrix-vector work on CUDA cores — the decode and verify calls this serves are bound by
weight reads; a prefill chunk keeps the grouped torch form (``use_fused``).

Precision: dot products and the activation in fp32 (values upcast right after each load); the
reference rounds gate_up and the activation to the model dtype, so 16-bit results differ by
those roundings (bounds in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.native.model.fp8 import Fp8Weight, linear
from ninfer.native.model.moe import FUSED_MAX_ROWS, MoeWeights, with_shared
from ninfer.native.model.moe import sparse_moe as sparse_moe_ref
from ninfer.native.model.ops import acc_dtype

__all__ = ["FUSED_MAX_ROWS", "fused_moe_triton", "sparse_moe_ref", "use_fused"]



def use_fused(tokens: int, static: bool) -> bool:
    """A graph's capture (any size) and small calls take the fused kernels."""
    return static or tokens <= FUSED_MAX_ROWS


@triton.jit
def _moe_up(x, wgu, sgu, top_i, act, H, I, K: tl.constexpr, BI: tl.constexpr, BH: tl.constexpr,
            FP8: tl.constexpr):
    """FP8: ``wgu`` is e4m3 and ``sgu`` its [E, ceil(2I/128), ceil(H/128)] block scales: each
    element is dequantised (times its block's scale, fp32) right after its load."""
    r = tl.program_id(0).to(tl.int64)
    ib = tl.program_id(1)
    t = r // K
    e = tl.load(top_i + r).to(tl.int64)
    rows = ib * BI + tl.arange(0, BI)
    r_ok = rows < I
    base = wgu + e * (2 * I * H)
    sc = tl.cdiv(H, 128)
    sbase = sgu + e * (tl.cdiv(2 * I, 128) * sc)
    acc_g = tl.zeros([BI], tl.float32)
    acc_u = tl.zeros([BI], tl.float32)
    for h0 in range(0, H, BH):
        hs = h0 + tl.arange(0, BH)
        h_ok = hs < H
        xv = tl.load(x + t * H + hs, mask=h_ok, other=0.0).to(tl.float32)
        m = r_ok[:, None] & h_ok[None, :]
        wg = tl.load(base + rows[:, None] * H + hs[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(base + (I + rows)[:, None] * H + hs[None, :], mask=m, other=0.0).to(tl.float32)
        if FP8:
            hb = (hs // 128)[None, :]
            wg *= tl.load(sbase + (rows // 128)[:, None] * sc + hb, mask=m, other=0.0)
            wu *= tl.load(sbase + ((I + rows) // 128)[:, None] * sc + hb, mask=m, other=0.0)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    a = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act + r * I + rows, a, mask=r_ok)


@triton.jit
def _moe_down(act, wd, sd, top_i, top_w, y, H, I, BH: tl.constexpr, BI: tl.constexpr, FP8: tl.constexpr):
    """FP8: ``sd`` holds ``wd``'s [E, ceil(H/128), ceil(I/128)] block scales (as ``_moe_up``)."""
    r = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    e = tl.load(top_i + r).to(tl.int64)
    w = tl.load(top_w + r).to(tl.float32)
    hs = hb * BH + tl.arange(0, BH)
    h_ok = hs < H
    base = wd + e * (H * I)
    sc = tl.cdiv(I, 128)
    sbase = sd + e * (tl.cdiv(H, 128) * sc)
    acc = tl.zeros([BH], tl.float32)
    for i0 in range(0, I, BI):
        cols = i0 + tl.arange(0, BI)
        i_ok = cols < I
        a = tl.load(act + r * I + cols, mask=i_ok, other=0.0)
        m = h_ok[:, None] & i_ok[None, :]
        wv = tl.load(base + hs[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if FP8:
            wv *= tl.load(sbase + (hs // 128)[:, None] * sc + (cols // 128)[None, :], mask=m, other=0.0)
        acc += tl.sum(wv * a[None, :], axis=1)
    tl.store(y + r * H + hs, acc * w, mask=h_ok)


def fused_moe_triton(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """``sparse_moe``'s contract: x [T, H] -> [T, H]."""
    acc = acc_dtype(x.dtype)
    probs = torch.softmax(linear(x, w.router).to(acc), dim=-1)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    top_w = top_w.to(x.dtype)
    t, h = x.shape
    k, inter = w.top_k, w.down.shape[-1]
    rows = t * k
    out = torch.zeros_like(x)
    if rows:
        xc = x.contiguous()
        act = torch.empty(rows, inter, dtype=torch.float32, device=x.device)
        y = torch.empty(rows, h, dtype=torch.float32, device=x.device)
        ti, tw = top_i.reshape(-1).contiguous(), top_w.reshape(-1).contiguous()
        # each matrix FP8 or not on its own (a gate|up whose rows leave their blocks is dequantised
        # at load while its down projection stays FP8)
        fp8_up, fp8_down = isinstance(w.gate_up, Fp8Weight), isinstance(w.down, Fp8Weight)
        gu, gs = (w.gate_up.weight, w.gate_up.scale_inv) if fp8_up else (w.gate_up, w.gate_up)
        dn, ds = (w.down.weight, w.down.scale_inv) if fp8_down else (w.down, w.down)
        # fp32 weights take twice the registers: a [64, 128] fp32 tile pair sat at 250 of 255
        # registers on sm_90 (kernels/compile_check.py); half the width leaves room (FP8 weights
        # are dequantised to fp32 tiles too)
        wide = gu.element_size() < 4 and not fp8_up and not fp8_down
        bi, bh = min(64, triton.next_power_of_2(inter)), min(128 if wide else 64, triton.next_power_of_2(h))
        _moe_up[(rows, triton.cdiv(inter, bi))](xc, gu.contiguous(), gs.contiguous(), ti, act, h, inter, K=k, BI=bi,
                                                BH=bh, FP8=fp8_up)
        _moe_down[(rows, triton.cdiv(h, bh))](act, dn.contiguous(), ds.contiguous(), ti, tw, y, h, inter, BH=bh,
                                              BI=bi, FP8=fp8_down)
        out = y.view(t, k, h).sum(1).to(x.dtype)
    return with_shared(out, x, w)
