"""Kernel tests run the Triton kernels on CPU tensors through the interpreter.

triton reads TRITON_INTERPRET when a kernel is decorated (``triton.jit`` consults
``triton.knobs.runtime.interpret``, an environment read), i.e. when ``ninfer.native.kernels.*``
is first imported; so it is set here, before any test module of this folder imports them.
If something imported the kernels earlier in the session without it, the kernels are compiled
for a GPU and every launch on a CPU tensor would fail: the fixture below says so plainly.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreted_kernels():
    from ninfer.native.kernels import copies

    if not torch.cuda.is_available() and "Interpreted" not in type(copies._copy_rows).__name__:
        pytest.fail("ninfer.native.kernels was imported before TRITON_INTERPRET=1 was set; "
                    "run the kernel tests with TRITON_INTERPRET=1 in the environment")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||, in float64."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))
