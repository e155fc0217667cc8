"""RMSNorm on the GPU: one fused Triton kernel per row for the plain, the zero-centred and the
gated (GDN output) forms of ``native/model/ops.py``, which are the references (same signatures,
re-exported here as ``*_ref``).

Each program normalises one row of D elements: it loads the row (and the gate) once, upcast to
fp32 right after the load, computes ``rsqrt(mean(x^2) + eps)`` and writes the row once — where
the torch form runs about seven elementwise kernels with their round trips to memory. The
roundings are the reference's: the plain and gated forms round the normalised row to the model
dtype before the weight multiplies it (as the Hugging Face implementation does), the
zero-centred form scales by ``1 + w`` in fp32 and rounds once, the gated form rounds ``w * n``
before the SiLU gate. float64 never comes here (the oracle keeps the torch path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.native.kernels import on_cuda
from ninfer.native.model.ops import gated_rms_norm as gated_rms_norm_ref
from ninfer.native.model.ops import rms_norm as rms_norm_ref

__all__ = ["gated_rms_norm", "gated_rms_norm_ref", "gated_rms_norm_triton", "rms_norm", "rms_norm_ref",
           "rms_norm_triton"]


@triton.jit
def _rms_norm(x, gate, w, out, D, eps, BD: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: plain (w * round(n)); 1: zero-centred (round(n * (1 + w))); 2: gated
    (round(round(w * round(n)) * silu(gate)))."""
    row = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BD)
    ok = ds < D
    xv = tl.load(x + row * D + ds, mask=ok, other=0.0).to(tl.float32)
    wv = tl.load(w + ds, mask=ok, other=0.0).to(tl.float32)
    n = xv * tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
    dt = out.dtype.element_ty
    if MODE == 1:
        y = n * (1.0 + wv)
    else:
        y = wv * n.to(dt).to(tl.float32)
        if MODE == 2:
            g = tl.load(gate + row * D + ds, mask=ok, other=0.0).to(tl.float32)
            y = y.to(dt).to(tl.float32) * (g * tl.sigmoid(g))
    tl.store(out + row * D + ds, y.to(dt), mask=ok)


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float, mode: int) -> torch.Tensor:
    d = x.shape[-1]
    xr = x.reshape(-1, d).contiguous()
    out = torch.empty_like(xr)
    if xr.shape[0]:
        g = gate.reshape(-1, d).contiguous() if gate is not None else xr
        _rms_norm[(xr.shape[0],)](xr, g, weight.contiguous(), out, d, eps, BD=triton.next_power_of_2(d), MODE=mode)
    return out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return _launch(x, None, weight, eps, 1 if zero_centered else 0)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, gate, weight, eps, 2)


def rms_norm(x, weight, eps, zero_centered):
    impl = rms_norm_triton if on_cuda(x) and x.dtype != torch.float64 else rms_norm_ref
    return impl(x, weight, eps, zero_centered)


def gated_rms_norm(x, gate, weight, eps):
    impl = gated_rms_norm_triton if on_cuda(x) and x.dtype != torch.float64 else gated_rms_norm_ref
    return impl(x, gate, weight, eps)
