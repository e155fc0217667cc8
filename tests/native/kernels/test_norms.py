"""The fused RMSNorm kernels (interpreted) against the torch ops of ``native/model/ops.py``:
plain, zero-centred and gated forms; rows of power-of-two and other widths, 2-D and 3-D
inputs, a non-contiguous input (as Qwen3-Next's q beside its gate); fp32 to 1e-6 relative,
fp16 / bf16 within one rounding of the output (the kernel's sum of squares is ordered
differently). The interpreter casts fp32 to bf16 by truncation (measured: 1.0039 -> 1.0 where
torch and a GPU round to 1.0078), so the gated form, which rounds twice before its store, gets
the interpreter's bf16 bound ``GATED_BF16``; `ninfer bench gpu` checks it at the tight bound."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import norms
from tests.native.kernels.conftest import rel_err

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BOUND = {"fp32": 1e-6, "fp16": 1e-3, "bf16": 8e-3}
GATED_BF16 = 2.4e-2            # three truncations under the interpreter (see above)


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.2 + 1).to(dtype)
    gate = torch.randn(shape, generator=g).to(dtype)
    return x, w, gate


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 64), (7, 128), (5, 3, 256), (33, 100)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero-centred"])
def test_rms_norm_equals_the_torch_op(dtype, shape, zero_centered):
    x, w, _ = _inputs(shape, DTYPES[dtype], len(shape) + shape[-1])
    got = norms.rms_norm_triton(x, w, 1e-6, zero_centered)
    want = norms.rms_norm_ref(x, w, 1e-6, zero_centered)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) < BOUND[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 64), (9, 4, 128), (6, 96)], ids=lambda s: "x".join(map(str, s)))
def test_gated_rms_norm_equals_the_torch_op(dtype, shape):
    x, w, gate = _inputs(shape, DTYPES[dtype], shape[-1])
    got = norms.gated_rms_norm_triton(x, gate, w, 1e-6)
    want = norms.gated_rms_norm_ref(x, gate, w, 1e-6)
    assert rel_err(got, want) < (GATED_BF16 if dtype == "bf16" else BOUND[dtype])


def test_a_non_contiguous_input_is_read_by_its_strides():
    x, w, _ = _inputs((4, 6, 128), torch.float32, 3)
    q = x.view(4, 3, 256).chunk(2, dim=-1)[0]          # every other 128-wide half: not contiguous
    assert not q.is_contiguous()
    assert rel_err(norms.rms_norm_triton(q, w, 1e-6, True), norms.rms_norm_ref(q, w, 1e-6, True)) < 1e-6


def test_no_rows():
    x = torch.empty(0, 64)
    assert norms.rms_norm_triton(x, torch.ones(64), 1e-6, False).shape == (0, 64)


def test_the_dispatch_keeps_the_reference_off_cuda():
    x, w, gate = _inputs((3, 64), torch.float32, 0)
    assert torch.equal(norms.rms_norm(x, w, 1e-6, False), norms.rms_norm_ref(x, w, 1e-6, False))
    assert torch.equal(norms.gated_rms_norm(x, gate, w, 1e-6), norms.gated_rms_norm_ref(x, gate, w, 1e-6))
