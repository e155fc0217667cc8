"""GDN decode rows in place: the causal conv step and the gated delta rule of one token per row,
reading and writing each row's state slot where it lies (as vLLM's ``fused_recurrent`` with
``ssm_state_indices`` does) — no gather of the rows' states into a batch and scatter back, which
moved 2 MiB of fp32 state per row and GDN layer twice at Qwen3-Next's size.

    conv   [S, C, K-1]      row n: y = silu(w · [state[slot_n], x_n]),  state[slot_n] <- last K-1 inputs
    ssm    [S, Hv, Dk, Dv]  row n: S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

q and k are L2-normalised inside (eps 1e-6), q scaled by Dk^-0.5, value head h reads key head
h // (Hv / Hk) — the references' conventions (``model/gdn.py``). Everything in fp32; the state is
stored back in its own dtype, the outputs in the inputs'. Slots of one call must be distinct
(each program owns its slot's rows). The references (gather, the torch step, scatter) sit beside
the kernels with the same signatures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.native.model.gdn import causal_conv1d_step, recurrent_gated_delta_rule


# ---- references ---------------------------------------------------------------------------
def conv_step_ref(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [N, C]; conv_states: [S, C, K-1] (rows ``slots`` read and overwritten); weight: [C, K].
    Returns y [N, C]."""
    y, new = causal_conv1d_step(x, conv_states.index_select(0, slots), weight)
    conv_states.index_copy_(0, slots, new.to(conv_states.dtype))
    return y


def delta_rule_step_ref(q, k, v, g, beta, ssm_states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; ssm_states: [S, Hv, Dk, Dv] (rows
    ``slots`` read and overwritten). Returns o [N, Hv, Dv] in v's dtype."""
    o, new = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                        ssm_states.index_select(0, slots))
    ssm_states.index_copy_(0, slots, new.to(ssm_states.dtype))
    return o[:, 0]


# ---- kernels ------------------------------------------------------------------------------
@triton.jit
def _conv_step(x, state, slots, w, y, C, K1: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    """One (row, block of BC channels): the K-1 stored inputs and the new one, the weighted sum,
    SiLU; the stored inputs shifted by one. Every load comes before the stores."""
    n = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = cs < C
    js = tl.arange(0, KP)
    slot = tl.load(slots + n).to(tl.int64)
    xv = tl.load(x + n * C + cs, mask=ok, other=0.0).to(tl.float32)
    base = state + (slot * C + cs[:, None]) * K1
    tap = ok[:, None] & (js[None, :] < K1)
    st = tl.load(base + js[None, :], mask=tap, other=0.0).to(tl.float32)                   # [BC, KP]
    wt = tl.load(w + cs[:, None] * (K1 + 1) + js[None, :], mask=tap, other=0.0).to(tl.float32)
    w_last = tl.load(w + cs * (K1 + 1) + K1, mask=ok, other=0.0).to(tl.float32)
    acc = tl.sum(st * wt, axis=1) + xv * w_last
    shifted = tl.load(base + js[None, :] + 1, mask=ok[:, None] & (js[None, :] < K1 - 1), other=0.0).to(tl.float32)
    new = tl.where(js[None, :] == K1 - 1, xv[:, None], shifted)
    tl.store(y + n * C + cs, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=ok)
    tl.store(base + js[None, :], new.to(state.dtype.element_ty), mask=tap)


@triton.jit
def _delta_rule_step(q, k, v, g, beta, ssm, slots, o, scale, HK: tl.constexpr, HV: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One (row, value head, block of BV value dims): the [Dk, BV] state tile read from the row's
    slot, one step of the gated delta rule, the tile written back."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ks = tl.arange(0, BK)
    k_ok, v_ok = ks < DK, vs < DV
    hk = h // (HV // HK)
    slot = tl.load(slots + n).to(tl.int64)
    qv = tl.load(q + (n * HK + hk) * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    kv = tl.load(k + (n * HK + hk) * DK + ks, mask=k_ok, other=0.0).to(tl.float32)
    qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + 1e-6) * scale
    kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + 1e-6)
    vv = tl.load(v + (n * HV + h) * DV + vs, mask=v_ok, other=0.0).to(tl.float32)
    gv = tl.load(g + n * HV + h).to(tl.float32)
    bv = tl.load(beta + n * HV + h).to(tl.float32)
    base = ssm + (slot * HV + h) * (DK * DV)
    tile = k_ok[:, None] & v_ok[None, :]
    s = tl.load(base + ks[:, None] * DV + vs[None, :], mask=tile, other=0.0).to(tl.float32)    # [BK, BV]
    s = s * tl.exp(gv)
    delta = (vv - tl.sum(s * kv[:, None], axis=0)) * bv
    s = s + kv[:, None] * delta[None, :]
    out = tl.sum(s * qv[:, None], axis=0)
    tl.store(o + (n * HV + h) * DV + vs, out.to(o.dtype.element_ty), mask=v_ok)
    tl.store(base + ks[:, None] * DV + vs[None, :], s.to(ssm.dtype.element_ty), mask=tile)


def conv_step_triton(x, conv_states, slots, weight):
    n, c = x.shape
    k1 = conv_states.shape[2]
    y = torch.empty_like(x)
    if n:
        bc = 256
        _conv_step[(n, triton.cdiv(c, bc))](x.contiguous(), conv_states, slots.contiguous(), weight.contiguous(), y, c,
                                            K1=k1, KP=triton.next_power_of_2(k1), BC=bc)
    return y


def delta_rule_step_triton(q, k, v, g, beta, ssm_states, slots):
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    o = torch.empty_like(v)
    if n:
        bv = min(32, triton.next_power_of_2(dv))
        _delta_rule_step[(n, hv, triton.cdiv(dv, bv))](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                                       beta.contiguous(), ssm_states, slots.contiguous(), o,
                                                       dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv,
                                                       BK=triton.next_power_of_2(dk), BV=bv)
    return o
